"""Shared test helpers: the repository's committed snapshots, and whether a GPU is here."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "tests" / "fixtures" / "traces"


def have_cuda_torch() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


@pytest.fixture
def seed_trace() -> Path:
    path = TRACES / "seed_experiment.pickle"
    if not path.exists():
        pytest.skip(f"{path} is not here (tests run from a checkout of the repository)")
    return path


@pytest.fixture
def bert_trace() -> Path:
    path = TRACES / "bert_infer.pickle"
    if not path.exists():
        pytest.skip(f"{path} is not here")
    return path


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs PyTorch with a CUDA GPU (skipped otherwise)")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
