"""cachalot: a CUDA caching allocator checked against a reference model, for PyTorch users.

Two halves:

- :mod:`cachalot.torch` runs a PyTorch job *on* cachalot's allocator (PyTorch's pluggable
  allocator interface): ``cachalot.torch.install()`` before the first CUDA allocation, then
  ``cachalot.torch.stats()``, ``snapshot(path)``, ``empty_cache()``;
- :func:`replay`, :func:`fit`, :func:`explain` and :func:`compare` *predict* from a PyTorch memory
  snapshot (``torch.cuda.memory._dump_snapshot``), without a GPU: the answers of the
  ``cachalot`` command, as Python dicts.

The ``cachalot`` command itself (``cachalot --help``) comes with the package.
"""

from ._native import __version__
from .reports import CachalotError, compare, explain, fit, replay, run

__all__ = [
    "CachalotError",
    "__version__",
    "compare",
    "explain",
    "fit",
    "replay",
    "run",
]
