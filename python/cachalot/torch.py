"""cachalot's allocator inside a PyTorch job, through PyTorch's pluggable allocator.

::

    import cachalot.torch
    cachalot.torch.install()          # before the first CUDA allocation
    ...                               # the job, unchanged
    print(cachalot.torch.stats()["reserved_bytes.all.peak"])
    cachalot.torch.snapshot("job.pickle")   # python -m torch.cuda._memory_viz / cachalot replay

``install()`` loads this package's native library into PyTorch as
``torch.cuda.memory.CUDAPluggableAllocator`` (as RAPIDS RMM does) with every hook PyTorch 2.11
offers: ``tensor.record_stream``, ``torch.cuda.empty_cache()`` and
``torch.cuda.set_per_process_memory_fraction`` reach cachalot, and CUDA graph capture is
refused with a clear error. PyTorch's own statistics functions raise under any pluggable
allocator ("does not yet support getDeviceStats"); ``install()`` points them at cachalot's
(``patch_torch=True``), so ``torch.cuda.memory_stats()``, ``max_memory_allocated()``,
``memory_summary()``, ``reset_peak_memory_stats()``, ``torch.cuda.memory._record_memory_history``
and ``_dump_snapshot`` work unchanged, and ``Tensor.record_stream`` records with cachalot
directly. docs/PYTHON.md lists what is supported and what is not.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import sys
import threading
import warnings
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Union

from . import _native

__all__ = [
    "DeviceMemorySampler",
    "InstallError",
    "NoGPUError",
    "empty_cache",
    "install",
    "installed",
    "is_out_of_memory",
    "library_path",
    "memory_summary",
    "nested_stats",
    "record_memory_history",
    "reset_peak_stats",
    "settings",
    "snapshot",
    "stats",
]

#: The environment variable ``install()`` reads when given no ``config``.
ALLOC_CONF_ENV: str = _native.ALLOC_CONF_ENV
#: The names of the C functions PyTorch's ``CUDAPluggableAllocator`` loads from
#: :func:`library_path`.
ALLOC_FN: str = "cachalot_torch_alloc"
FREE_FN: str = "cachalot_torch_free"
#: The hooks ``install()`` sets; the first three are required (without them PyTorch would
#: drop ``record_stream``, ``empty_cache`` and the memory fraction silently).
REQUIRED_HOOKS = ("set_record_stream_fn", "set_reset_fn", "set_memory_fraction_fn")
GRAPH_HOOK = "set_begin_allocate_to_pool"

Device = Union[int, str, Any, None]


class InstallError(RuntimeError):
    """``install()`` could not put cachalot under PyTorch (the reason is in the message)."""


class NoGPUError(InstallError):
    """No CUDA GPU, no CUDA build of PyTorch, or no CUDA driver: nothing to install on."""


_lock = threading.Lock()
_state: Dict[str, Any] = {"allocator": None, "described": None, "patched": {}}


def library_path() -> str:
    """The shared library PyTorch loads: this package's native module, which also exports
    ``cachalot_torch_alloc`` and ``cachalot_torch_free``."""
    path = _native.__file__
    assert path is not None
    return path


def installed() -> bool:
    """Whether :func:`install` has put cachalot under PyTorch in this process."""
    return _state["allocator"] is not None


def _import_torch() -> ModuleType:
    try:
        torch: ModuleType = importlib.import_module("torch")
    except ImportError as e:
        raise NoGPUError(
            "cachalot.torch.install() needs PyTorch with CUDA (import torch failed: "
            f"{e}); the cachalot command and cachalot.replay/fit/explain need none"
        ) from e
    return torch


def install(config: Optional[str] = None, *, pytorch: bool = False, patch_torch: bool = True) -> str:
    """Makes cachalot PyTorch's CUDA allocator for the rest of the process and returns the
    settings in force, described.

    Call it before anything initialises CUDA in PyTorch (the first CUDA tensor,
    ``torch.cuda.current_device()``, ``torch.cuda.init()``): PyTorch cannot change allocators
    after that, and ``install()`` raises :class:`InstallError` then.

    ``config`` is a configuration string in ``PYTORCH_CUDA_ALLOC_CONF`` syntax, the syntax of
    ``cachalot replay --config``, applied over cachalot's own policy (expandable segments with
    2 MiB pages, reclaim, thread caches) or, with ``pytorch=True``, over PyTorch's defaults
    (PyTorch's policy, decision for decision). ``None`` reads ``CACHALOT_ALLOC_CONF``. A
    string that does not parse raises ``ValueError`` naming the key.

    With ``patch_torch`` (default), PyTorch's statistics and history functions, which raise
    under any pluggable allocator, are pointed at cachalot's, and ``Tensor.record_stream``
    records with cachalot directly (see the module's documentation).

    Raises :class:`NoGPUError` without a CUDA GPU (or without PyTorch). Calling it again with
    the same settings does nothing; with others it raises ``RuntimeError``.
    """
    with _lock:
        torch = _import_torch()
        text = os.environ.get(ALLOC_CONF_ENV, "") if config is None else config
        if _state["allocator"] is not None:
            described = _native.configure(text, pytorch)
            if patch_torch:
                _patch(torch)
            return described
        if not torch.cuda.is_available():
            raise NoGPUError(
                "cachalot.torch.install(): PyTorch sees no CUDA GPU "
                f"(torch {getattr(torch, '__version__', '?')}, CUDA "
                f"{getattr(torch.version, 'cuda', None)}); there is nothing to install on"
            )
        try:
            _native.device_count()
        except RuntimeError as e:
            raise NoGPUError(f"cachalot.torch.install(): {e}") from e
        if torch.cuda.is_initialized():
            raise InstallError(
                "cachalot.torch.install() must run before PyTorch initialises CUDA (the first "
                "CUDA tensor, torch.cuda.current_device(), torch.cuda.init()): PyTorch cannot "
                "change its allocator afterwards. Call it at the top of the program."
            )
        described = _native.configure(text, pytorch)  # ValueError for a bad string
        memory = torch.cuda.memory
        allocator = memory.CUDAPluggableAllocator(library_path(), ALLOC_FN, FREE_FN)
        hooks = allocator.allocator()
        entry = _native.entry_points()
        missing = [h for h in REQUIRED_HOOKS if not hasattr(hooks, h)]
        if missing:
            raise InstallError(
                f"this PyTorch ({torch.__version__}) cannot pass {', '.join(missing)} to a "
                "pluggable allocator: record_stream, empty_cache or the memory fraction would be "
                "dropped silently. cachalot needs PyTorch 2.5 or later."
            )
        for h in REQUIRED_HOOKS:
            getattr(hooks, h)(entry[h])
        if hasattr(hooks, GRAPH_HOOK):
            getattr(hooks, GRAPH_HOOK)(entry[GRAPH_HOOK])
        else:
            warnings.warn(
                "this PyTorch has no set_begin_allocate_to_pool: a CUDA graph capture under "
                "cachalot fails later, inside the capture, instead of at its start",
                RuntimeWarning,
                stacklevel=2,
            )
        try:
            memory.change_current_allocator(allocator)
        except RuntimeError as e:
            raise InstallError(
                "cachalot.torch.install(): PyTorch refused to change its allocator "
                f"({e}). Call install() before the first CUDA allocation."
            ) from e
        _state["allocator"] = allocator
        _state["described"] = described
        if patch_torch:
            _patch(torch)
        return described


def settings() -> str:
    """The settings in force (or that will be at the first allocation), described, e.g.
    ``"cachalot's defaults"`` or ``"PyTorch's defaults with max_split_size_mb:128"``."""
    return _native.settings()[0]


def _device_index(device: Device) -> int:
    if device is None:
        if installed():
            torch = _import_torch()
            return int(torch.cuda.current_device())
        return 0
    if isinstance(device, int):
        return device
    torch = _import_torch()
    return int(torch.cuda._utils._get_device_index(device, optional=True))


def nested_stats(device: Device = None) -> Dict[str, Any]:
    """The statistics of ``device`` (default: the current one) nested as PyTorch's
    ``memory_stats_as_nested_dict()`` nests them."""
    nested: Dict[str, Any] = json.loads(_native.stats_json(_device_index(device)))
    return nested


def _flatten(prefix: str, value: Any, out: List[Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}{k}.", v, out)
    else:
        out.append((prefix[:-1], value))


def stats(device: Device = None, *, flush_thread_cache: bool = False) -> Dict[str, int]:
    """cachalot's statistics of ``device`` (default: the current one) with the keys of
    ``torch.cuda.memory_stats()``: ``"allocated_bytes.all.current"``,
    ``"reserved_bytes.all.peak"``, ``"num_device_alloc"``... sorted by key.

    Under cachalot's policy each thread keeps up to 8 of its freed blocks for its next requests
    (thread caches); they count as allocated until reused or flushed. ``flush_thread_cache``
    returns the calling thread's first (other threads' stay: PyTorch's autograd thread keeps
    its own)."""
    if flush_thread_cache:
        _native.flush_thread_cache()
    out: List[Any] = []
    _flatten("", nested_stats(device), out)
    out.sort()
    return dict(out)


def memory_summary(device: Device = None) -> str:
    """A table of ``device``'s statistics in the manner of ``torch.cuda.memory_summary()``."""
    return _native.memory_summary(_device_index(device))


def reset_peak_stats(device: Device = None) -> None:
    """Sets every peak statistic of ``device`` to its current value
    (``torch.cuda.reset_peak_memory_stats``)."""
    _native.reset_peak_stats(_device_index(device))


def empty_cache() -> None:
    """Gives every device's cached memory that holds no tensor back to the driver, after
    waiting for the streams recorded on freed blocks (``torch.cuda.empty_cache()``, which calls
    the same code once installed)."""
    _native.empty_cache()


def record_memory_history(max_entries: Optional[int] = 100_000) -> None:
    """Starts recording allocations, frees and segment events on every device, keeping the last
    ``max_entries`` (PyTorch's ``_record_memory_history``); ``None`` stops and drops them. The
    entries carry no Python stacks (the allocator cannot see them)."""
    _native.record_history(max_entries)


def snapshot(path: Optional[Union[str, "os.PathLike[str]"]] = None, device: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """Writes the memory snapshot (every device, or ``device``) to ``path`` in PyTorch's
    pickle format — what ``torch.cuda.memory._dump_snapshot(path)`` writes:
    ``python -m torch.cuda._memory_viz trace_plot PATH`` and ``cachalot replay PATH`` read it.
    Without ``path``, returns it as the dict ``torch.cuda.memory._snapshot()`` returns.

    Segments and blocks are the state now; the trace holds what was recorded since
    :func:`record_memory_history` (nothing without it)."""
    data: bytes = _native.snapshot(device)
    if path is None:
        value: Dict[str, Any] = pickle.loads(data)
        return value
    with open(os.fspath(path), "wb") as f:
        f.write(data)
    return None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error of PyTorch's allocator
    (``torch.cuda.OutOfMemoryError``) or of cachalot's plug-in (a ``RuntimeError`` whose message
    starts "CUDA out of memory", as PyTorch's does: a pluggable allocator can only throw
    ``std::runtime_error``)."""
    torch = sys.modules.get("torch")
    oom = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    if oom is not None and isinstance(error, oom):
        return True
    return isinstance(error, RuntimeError) and "CUDA out of memory" in str(error)


class DeviceMemorySampler:
    """The device's own peak of memory in use, measured from outside any allocator: a native
    thread reads ``cuMemGetInfo`` (what ``torch.cuda.mem_get_info()`` reads) every
    ``interval_us`` microseconds without the interpreter lock and keeps the highest reading.

    ::

        with cachalot.torch.DeviceMemorySampler(0) as s:
            train()
        print(s.peak_used - s.min_used)   # bytes the job took at its peak

    ``peak_used``, ``min_used``, ``last_used`` and ``total`` are bytes (all processes on the
    device together, the CUDA context included); ``samples`` the number of readings.
    """

    def __init__(self, device: int = 0, interval_us: int = 200) -> None:
        self.device = device
        self.interval_us = interval_us
        self.readings: Dict[str, Any] = {}
        self._sampler: Optional[Any] = None

    def start(self) -> "DeviceMemorySampler":
        """Starts sampling (the first reading is taken before this returns)."""
        self._sampler = _native.MemorySampler(self.device, self.interval_us)
        return self

    def stop(self) -> Dict[str, Any]:
        """Stops sampling and returns the readings."""
        if self._sampler is None:
            raise RuntimeError("the sampler is not running")
        sampler, self._sampler = self._sampler, None
        self.readings = dict(sampler.stop())
        return self.readings

    def __enter__(self) -> "DeviceMemorySampler":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _get(self, key: str) -> int:
        if not self.readings:
            raise RuntimeError("no readings yet: stop the sampler first")
        return int(self.readings[key])

    @property
    def peak_used(self) -> int:
        """The highest reading of the device's memory in use, in bytes."""
        return self._get("peak_used")

    @property
    def min_used(self) -> int:
        """The lowest reading, in bytes."""
        return self._get("min_used")

    @property
    def last_used(self) -> int:
        """The last reading, in bytes."""
        return self._get("last_used")

    @property
    def total(self) -> int:
        """The device's total memory, in bytes."""
        return self._get("total")

    @property
    def samples(self) -> int:
        """How many readings were taken."""
        return self._get("samples")


# --- PyTorch's own functions, pointed at cachalot -------------------------------------------


def _patch(torch: ModuleType) -> None:
    """Points PyTorch's statistics, snapshot and history functions at cachalot's. Each original
    is kept in ``_state["patched"]``."""
    memory = torch.cuda.memory
    patched: Dict[str, Callable[..., Any]] = _state["patched"]
    if patched:
        return

    def memory_stats_as_nested_dict(device: Device = None) -> Dict[str, Any]:
        return nested_stats(device)

    def reset_peak_memory_stats(device: Device = None) -> None:
        reset_peak_stats(device)

    def reset_accumulated_memory_stats(device: Device = None) -> None:
        raise RuntimeError(
            "cachalot keeps its accumulated statistics (allocated/freed sums, counts of device "
            "calls) for the life of the process: reset_accumulated_memory_stats is not supported"
        )

    def _snapshot(device: Optional[int] = None, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        value = snapshot(None, device if isinstance(device, int) else None)
        assert value is not None
        return value

    def memory_snapshot(*args: Any, **kwargs: Any) -> List[Dict[str, Any]]:
        value = snapshot(None)
        assert value is not None
        segments: List[Dict[str, Any]] = value["segments"]
        return segments

    def _record_memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        # PyTorch's signature: (enabled, context, stacks, max_entries, device, ...).
        max_entries = kwargs.get("max_entries", args[2] if len(args) > 2 else sys.maxsize)
        if enabled is None or enabled is False:
            record_memory_history(None)
        else:
            record_memory_history(min(int(max_entries), sys.maxsize))

    # tensor.record_stream(s), straight to cachalot as well as through the pluggable
    # allocator's record_stream hook (set by install()): both routes hold a block until its side
    # stream's work is done (python/tests/test_gpu.py, verified on an H200; docs/PYTHON.md), and
    # recording directly does not depend on PyTorch reaching the hook. Recording twice is
    # harmless.
    original_record_stream = torch.Tensor.record_stream

    def record_stream(self: Any, stream: Any) -> None:
        if getattr(self, "is_cuda", False):
            _native.record_stream(int(self.untyped_storage().data_ptr()), int(stream.cuda_stream))
        else:
            original_record_stream(self, stream)

    record_stream.__doc__ = original_record_stream.__doc__
    patched["Tensor.record_stream"] = original_record_stream
    torch.Tensor.record_stream = record_stream

    replacements: Dict[str, Callable[..., Any]] = {
        "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
        "_snapshot": _snapshot,
        "memory_snapshot": memory_snapshot,
        "_record_memory_history": _record_memory_history,
    }
    for name, fn in replacements.items():
        if not hasattr(memory, name):
            continue
        patched[name] = getattr(memory, name)
        fn.__doc__ = f"cachalot's replacement for torch.cuda.memory.{name} (cachalot.torch.install)."
        setattr(memory, name, fn)
        # `torch.cuda` re-exports most of them: the same function under the same name.
        if getattr(torch.cuda, name, None) is patched[name]:
            setattr(torch.cuda, name, fn)
