"""The package without a GPU: imports, the native library's entry points, the settings."""

from __future__ import annotations

import ctypes
import os

import pytest

import cachalot
import cachalot.torch as ct
from cachalot import _native


def test_version_and_public_names() -> None:
    assert cachalot.__version__ == "0.1.0"
    for name in ("replay", "fit", "explain", "compare", "run", "CachalotError"):
        assert hasattr(cachalot, name)
    for name in ct.__all__:
        assert hasattr(ct, name), name


def test_importing_cachalot_torch_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, cachalot.torch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_library_exports_pytorchs_entry_points() -> None:
    path = ct.library_path()
    assert os.path.isfile(path)
    lib = ctypes.CDLL(path)
    for name in (ct.ALLOC_FN, ct.FREE_FN, "cachalot_torch_record_stream", "cachalot_torch_empty_cache"):
        assert ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    entry = _native.entry_points()
    assert set(entry) == {
        "alloc",
        "free",
        "set_record_stream_fn",
        "set_reset_fn",
        "set_memory_fraction_fn",
        "set_begin_allocate_to_pool",
    }
    assert entry["alloc"] == ctypes.cast(getattr(lib, ct.ALLOC_FN), ctypes.c_void_p).value
    assert all(isinstance(v, int) and v > 0 for v in entry.values())


def test_hooks_that_need_no_device_do_nothing_on_a_machine_without_one() -> None:
    lib = ctypes.CDLL(ct.library_path())
    lib.cachalot_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cachalot_torch_free(None, 0, 0, None)  # freeing the null pointer: nothing
    lib.cachalot_torch_empty_cache()  # no allocator made yet: nothing to release
    assert _native.free_errors() == 0
    assert _native.hook_calls()["empty_cache"] >= 1


def test_configuration_strings_are_parsed_as_the_cli_parses_them() -> None:
    assert _native.configure("", False) == "cachalot's defaults"
    assert _native.configure("", True) == "PyTorch's defaults"
    described = _native.configure("max_split_size_mb:128", True)
    assert described.startswith("PyTorch's defaults with ") and "max_split_size_mb:128" in described
    assert ct.settings() == described
    with pytest.raises(ValueError, match="nonsense"):
        _native.configure("nonsense:1", False)
    with pytest.raises(ValueError, match="max_split_size_mb"):
        _native.configure("max_split_size_mb:abc", False)
    # A refused string changes nothing.
    assert ct.settings() == described
    _native.configure("", False)


def test_statistics_before_any_allocation_have_pytorchs_keys_and_are_zero() -> None:
    _native.configure("", True)
    s = ct.stats(0)
    for key in (
        "allocated_bytes.all.current",
        "allocated_bytes.all.peak",
        "reserved_bytes.large_pool.allocated",
        "active_bytes.small_pool.freed",
        "requested_bytes.all.current",
        "inactive_split_bytes.all.peak",
        "allocation.all.current",
        "segment.all.peak",
        "oversize_allocations.current",
        "oversize_segments.peak",
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
        "max_split_size",
    ):
        assert key in s, key
    assert s["max_split_size"] == -1
    assert all(v == 0 for k, v in s.items() if k != "max_split_size")
    assert list(s) == sorted(s)
    nested = ct.nested_stats(0)
    assert nested["allocated_bytes"]["all"]["current"] == 0
    assert "Memory" in ct.memory_summary(0) or "memory" in ct.memory_summary(0)
    _native.configure("", False)


def test_an_empty_snapshot_is_pytorchs_format(tmp_path) -> None:
    snap = ct.snapshot()
    assert snap is not None
    assert snap["segments"] == [] and snap["device_traces"] == []
    assert "allocator_settings" in snap
    path = tmp_path / "empty.pickle"
    assert ct.snapshot(path) is None
    import pickle

    with open(path, "rb") as f:
        assert pickle.load(f) == snap


def test_history_can_be_started_and_stopped_without_a_device() -> None:
    ct.record_memory_history(1000)
    ct.record_memory_history(None)


def test_is_out_of_memory_recognises_the_plug_ins_message() -> None:
    assert ct.is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB."))
    assert not ct.is_out_of_memory(RuntimeError("something else"))
    assert not ct.is_out_of_memory(ValueError("CUDA out of memory"))
