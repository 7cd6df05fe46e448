"""The `cachalot` command from the package, and its answers as dicts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cachalot


def test_the_console_script_is_the_whole_cli() -> None:
    exe = shutil.which("cachalot")
    if exe is None:
        pytest.skip("the package is not installed with its scripts (pip install .)")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for sub in ("replay", "compare", "fit", "explain", "bench-report"):
        assert sub in out.stdout
    out = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("cachalot ")


def test_python_dash_m_cachalot_and_its_exit_codes() -> None:
    out = subprocess.run([sys.executable, "-m", "cachalot", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "cachalot" in out.stdout
    out = subprocess.run([sys.executable, "-m", "cachalot", "no-such-command"], capture_output=True, text=True)
    assert out.returncode == 2 and "no-such-command" in out.stderr


def test_replay_as_a_dict(seed_trace: Path) -> None:
    r = cachalot.replay(seed_trace, pytorch=True)
    assert isinstance(r, dict)
    text = repr(r)
    assert "3221225472" in text  # the seed experiment's 3 GiB peak reserved, as PyTorch's
    cachalot_policy = cachalot.replay(seed_trace)
    assert isinstance(cachalot_policy, dict)


def test_fit_and_explain_as_dicts(seed_trace: Path) -> None:
    f = cachalot.fit(seed_trace)
    assert isinstance(f, dict) and f["policies"]
    e = cachalot.explain(seed_trace)
    assert isinstance(e, dict) and e["groups"] and e["peak_reserved_bytes"] == 3 << 30
    small = cachalot.fit(seed_trace, device_memory="1GiB")  # does not fit: an answer, no error
    assert small["policies"][0]["verdict"]["fits"] is False


def test_compare_as_a_dict(seed_trace: Path) -> None:
    c = cachalot.compare([seed_trace])
    assert isinstance(c, dict)


def test_bad_input_raises_with_the_commands_message(tmp_path: Path) -> None:
    bad = tmp_path / "not_a_snapshot.pickle"
    bad.write_bytes(b"hello")
    with pytest.raises(cachalot.CachalotError) as info:
        cachalot.replay(bad)
    assert info.value.code == 2
    assert "not_a_snapshot.pickle" in info.value.message
    with pytest.raises(cachalot.CachalotError) as info:
        cachalot.replay(bad, config="nonsense:1")
    assert info.value.code == 2


def test_a_snapshot_from_the_plug_in_is_read_by_cachalot_replay(tmp_path: Path) -> None:
    import cachalot.torch as ct

    path = tmp_path / "plugin.pickle"
    ct.snapshot(path)
    # An empty allocator's snapshot is read (its format is PyTorch's); there is nothing to replay.
    done = cachalot.run(["replay", str(path), "--json"], check=False)
    assert done.returncode == 2
    assert "device traces are empty: nothing to replay" in done.stderr
