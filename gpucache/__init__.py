"""gpucache: encoded images held once in a packed buffer, decoded per batch (GPU or CPU workers).

The public surface is exactly ``__all__``; modules starting with ``_`` are private.
"""

from . import testing, transforms
from .ingest._build import (
    BuildError,
    BuildReport,
    BytesSource,
    FileObjSource,
    FileRangeSource,
    Skipped,
)
from .store._format import CacheFormatError
from .loader._loader import BatchInfo, GpuCachedLoader, LoaderStats
from .store._shm import SharedMemoryError
from .ingest._sniff import Kind
from .store._store import JpegCache
from .store._targets import with_targets
from .dataset import JpegDataset
from .loader._workers import WorkerError
from .decode._core import SampleError

__version__ = "0.1.0"

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
    "BuildError",
    "CacheFormatError",
    "SharedMemoryError",
    "SampleError",
    "WorkerError",
    "transforms",
    "testing",
    "__version__",
]
