"""gpucache: encoded images held once in a packed buffer, decoded per batch (GPU or CPU workers).

The public surface is exactly ``__all__``; modules starting with ``_`` are private.
"""

from types import ModuleType as _ModuleType  # private: the public surface is __all__

from . import transforms
from ._dataset import JpegDataset
from ._errors import (
    BuildError,
    CacheFormatError,
    GpucacheError,
    ObjectStoreError,
    SampleError,
    SharedMemoryError,
    ShareError,
    WorkerError,
)
from ._version import read_version as _read_version
from .ingest._build import (
    BuildReport,
    BytesSource,
    FileObjSource,
    FileRangeSource,
    Skipped,
)
from .loader._iteration import BatchInfo
from .loader._loader import GpuCachedLoader
from .loader._stats import LoaderStats
from .node._jpegcache import JpegCache
from .store._format import Kind
from .store._targets import with_targets

__version__ = _read_version()  # pyproject.toml's version, from the installed metadata


def __getattr__(name: str) -> _ModuleType:
    """``gpucache.testing`` (synthetic photos for tests and benchmarks) is imported on first use,
    so ``import gpucache`` stays without it (and without the PIL modules it draws with)."""
    if name == "testing":
        import importlib

        return importlib.import_module(f"{__name__}.testing")  # then an attribute: no more calls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "JpegCache",
    "GpuCachedLoader",
    "JpegDataset",
    "with_targets",
    "BytesSource",
    "FileObjSource",
    "FileRangeSource",
    "BatchInfo",
    "LoaderStats",
    "BuildReport",
    "Skipped",
    "Kind",
    "GpucacheError",
    "BuildError",
    "CacheFormatError",
    "ObjectStoreError",
    "SharedMemoryError",
    "ShareError",
    "SampleError",
    "WorkerError",
    "transforms",
    "testing",
    "__version__",
]
