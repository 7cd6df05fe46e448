"""Without a GPU (or without PyTorch), install() refuses clearly and changes nothing."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

import cachalot.torch as ct
from cachalot import _native

from conftest import have_cuda_torch


def _fake_torch(available: bool) -> types.ModuleType:
    torch = types.ModuleType("torch")
    cuda = types.ModuleType("torch.cuda")
    cuda.is_available = lambda: available  # type: ignore[attr-defined]
    cuda.is_initialized = lambda: False  # type: ignore[attr-defined]
    torch.cuda = cuda  # type: ignore[attr-defined]
    torch.version = types.SimpleNamespace(cuda=None)  # type: ignore[attr-defined]
    torch.__version__ = "0.0-fake"  # type: ignore[attr-defined]
    return torch


@pytest.mark.skipif(have_cuda_torch(), reason="a CUDA GPU is here")
def test_install_without_a_gpu_raises_no_gpu_error(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("torch") is None:
        monkeypatch.setitem(sys.modules, "torch", _fake_torch(False))
    with pytest.raises(ct.NoGPUError, match="no CUDA GPU|needs PyTorch"):
        ct.install()
    assert not ct.installed()


def test_install_without_pytorch_says_what_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(ct.NoGPUError, match="needs PyTorch with CUDA"):
        ct.install()
    assert not ct.installed()


def test_install_when_pytorch_sees_a_gpu_but_the_driver_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        _native.device_count()
        pytest.skip("a CUDA driver is here")
    except RuntimeError:
        pass
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(True))
    with pytest.raises(ct.NoGPUError, match="CUDA driver"):
        ct.install()
    assert not ct.installed()


def test_the_device_sampler_refuses_clearly_without_a_driver() -> None:
    try:
        _native.device_count()
        pytest.skip("a CUDA driver is here")
    except RuntimeError as e:
        assert "no CUDA driver" in str(e)
    with pytest.raises(RuntimeError, match="CUDA driver"):
        ct.DeviceMemorySampler(0).start()


def test_a_bad_configuration_is_a_value_error_before_anything_else(monkeypatch: pytest.MonkeyPatch) -> None:
    # With a CUDA-less fake torch the GPU check comes first; with a usable GPU the string's.
    if not have_cuda_torch():
        pytest.skip("needs a GPU to get past the GPU check")
    with pytest.raises(ValueError):
        ct.install("max_split_size_mb:abc")
