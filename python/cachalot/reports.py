"""The ``cachalot`` command's answers as Python dicts: ``replay``, ``fit``, ``explain`` and
``compare`` of PyTorch memory snapshots, on the simulated device (no GPU needed).

Each runs the command in a child process (``python -m cachalot ... --json``) and parses its
JSON report, so the answers are exactly the command's, a replay can be interrupted, and a long
one does not hold this interpreter. Bad input raises :class:`CachalotError` with the command's
message and exit code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["CachalotError", "compare", "explain", "fit", "replay", "run"]


class CachalotError(RuntimeError):
    """The ``cachalot`` command failed: :attr:`code` is its exit code (2 bad input, 1 a failure
    while running), :attr:`message` what it printed on stderr."""

    def __init__(self, code: int, message: str, args: Sequence[str]) -> None:
        self.code = code
        self.message = message.strip()
        self.command = list(args)
        super().__init__(f"cachalot {' '.join(self.command)} exited with code {code}: {self.message}")


def run(args: Sequence[str], *, check: bool = True) -> "subprocess.CompletedProcess[str]":
    """Runs ``cachalot ARGS...`` in a child process and returns it, stdout and stderr captured
    as text. With ``check`` (default), a non-zero exit raises :class:`CachalotError`."""
    argv = [str(a) for a in args]
    done = subprocess.run(
        [sys.executable, "-m", "cachalot", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    if check and done.returncode != 0:
        raise CachalotError(done.returncode, done.stderr, argv)
    return done


def _json(args: List[str], ok_codes: Iterable[int] = (0,)) -> Dict[str, Any]:
    done = run(args, check=False)
    if done.returncode not in tuple(ok_codes):
        raise CachalotError(done.returncode, done.stderr, args)
    try:
        value = json.loads(done.stdout)
    except json.JSONDecodeError as e:
        raise CachalotError(done.returncode, f"not a JSON report: {e}: {done.stdout[:200]!r}", args) from e
    if not isinstance(value, dict):
        raise CachalotError(done.returncode, "the report is not a JSON object", args)
    return value


def _opt(args: List[str], flag: str, value: Optional[Any]) -> None:
    if value is not None:
        args += [flag, str(value)]


def replay(
    trace: PathLike,
    *,
    config: Optional[str] = None,
    pytorch: bool = False,
    device_memory: Optional[Union[int, str]] = None,
    device: Optional[int] = None,
    repeat: int = 1,
    start: Optional[str] = None,
    snapshot_out: Optional[PathLike] = None,
    extra_args: Sequence[str] = (),
) -> Dict[str, Any]:
    """``cachalot replay TRACE --json``: the trace replayed through cachalot's policy (or
    PyTorch's with ``pytorch=True``, which then reproduces the recorded run) under ``config``
    (``PYTORCH_CUDA_ALLOC_CONF`` syntax): peak reserved and allocated bytes, fragmentation,
    the self-check against the dumped state, speed. ``device_memory`` is bytes or a size such as
    ``"80GiB"``."""
    args = ["replay", os.fspath(trace), "--json", "--repeat", str(repeat)]
    if pytorch:
        args.append("--pytorch")
    _opt(args, "--config", config)
    _opt(args, "--device-memory", device_memory)
    _opt(args, "--device", device)
    _opt(args, "--start", start)
    if snapshot_out is not None:
        args += ["--snapshot-out", os.fspath(snapshot_out)]
    return _json(args + list(extra_args))


def fit(
    trace: PathLike,
    *,
    device_memory: Optional[Union[int, str]] = None,
    memory_fraction: Optional[float] = None,
    config: Optional[str] = None,
    policies: Sequence[str] = (),
    limit: Optional[str] = None,
    reserve: Optional[Union[int, str]] = None,
    device: Optional[int] = None,
    extra_args: Sequence[str] = (),
) -> Dict[str, Any]:
    """``cachalot fit TRACE --json``: the smallest GPU the job runs on without running out of
    memory, under each policy; with ``device_memory``, whether it fits on that one (the report's
    ``policies[i]["verdict"]``; "does not fit" is an answer, not an error)."""
    args = ["fit", os.fspath(trace), "--json"]
    _opt(args, "--device-memory", device_memory)
    _opt(args, "--memory-fraction", memory_fraction)
    _opt(args, "--config", config)
    for p in policies:
        args += ["--policy", p]
    _opt(args, "--limit", limit)
    _opt(args, "--reserve", reserve)
    _opt(args, "--device", device)
    return _json(args + list(extra_args), ok_codes=(0, 3))


def explain(
    trace: PathLike,
    *,
    at: Optional[str] = None,
    config: Optional[str] = None,
    device_memory: Optional[Union[int, str]] = None,
    device: Optional[int] = None,
    html: Optional[PathLike] = None,
    extra_args: Sequence[str] = (),
) -> Dict[str, Any]:
    """``cachalot explain TRACE --json``: what holds the memory at ``at`` (``"peak-reserved"``
    by default, ``"peak-allocated"``, ``"op:N"``, ``"entry:N"``): live tensors grouped by
    allocation stack, what ``empty_cache()`` would give back, what is stranded, and replayed
    advice. ``html`` also writes the self-contained page."""
    args = ["explain", os.fspath(trace), "--json"]
    _opt(args, "--at", at)
    _opt(args, "--config", config)
    _opt(args, "--device-memory", device_memory)
    _opt(args, "--device", device)
    if html is not None:
        args += ["--html", os.fspath(html)]
    return _json(args + list(extra_args))


def compare(
    traces: Sequence[PathLike],
    *,
    configs: Sequence[str] = (),
    pytorch: bool = False,
    repeat: int = 1,
    extra_args: Sequence[str] = (),
) -> Dict[str, Any]:
    """``cachalot compare TRACES... --json``: every trace replayed under several settings (by
    default PyTorch's, PyTorch's with expandable segments, and cachalot's), one table."""
    args = ["compare", *[os.fspath(t) for t in traces], "--json", "--repeat", str(repeat)]
    if pytorch:
        args.append("--pytorch")
    for c in configs:
        args += ["--config", c]
    return _json(args + list(extra_args))
