"""The one ctypes binding of gpucache's compiled part (``gpucache/_jpeg_regions.c``, built at
install when a C compiler and the libjpeg headers are there): region decode, the restart-marker
transcoder, the restart scan and segment decode.

Every signature is set here, once per process, when the library is first asked for. It sits at
the bottom of the package (it imports nothing of gpucache's) because two layers use it: the build
(``ingest._restart``: the transcode) and the decoders (``decode._roi``, ``decode._roi_rst``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading

MISSING = (
    "restart_markers=True needs gpucache's compiled transcoder, which was not built when "
    "gpucache was installed (no C compiler or libjpeg headers). Install them (Debian: "
    "apt-get install gcc libjpeg-dev) and reinstall gpucache, or build without "
    "restart_markers."
)

_state: dict[str, ctypes.CDLL | None] = {}  # per process: the library (None when it was not built)
_lock = threading.Lock()


def _bind(lib: ctypes.CDLL) -> None:
    if hasattr(lib, "gc_decode_region"):
        lib.gc_decode_region.argtypes = [
            ctypes.c_char_p,
            ctypes.c_ulong,
            *[ctypes.c_int] * 5,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_char_p,
            ctypes.c_int,
        ]
    lib.gc_transcode_restart.argtypes = [
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_ulong),
        ctypes.POINTER(ctypes.c_int),
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    lib.gc_free.argtypes = [ctypes.c_void_p]
    lib.gc_find_restarts.argtypes = [
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.POINTER(ctypes.c_longlong),
    ]
    lib.gc_find_restarts.restype = ctypes.c_long
    if hasattr(lib, "gc_decode_segments"):
        lib.gc_decode_segments.argtypes = [
            ctypes.c_void_p,
            ctypes.c_ulong,
            *[ctypes.c_int] * 6,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_char_p,
            ctypes.c_int,
        ]


def lib() -> ctypes.CDLL | None:
    """gpucache's compiled helpers (ctypes, every signature set), or None when they were not
    built at install. Tests set ``_state["lib"] = None`` to run as if they were not."""
    with _lock:
        if "lib" not in _state:
            spec = importlib.util.find_spec("gpucache._jpeg_regions")
            found = ctypes.CDLL(spec.origin) if spec is not None and spec.origin else None
            if found is not None:
                _bind(found)
            _state["lib"] = found
    return _state["lib"]


def transcoder_available() -> bool:
    """Whether the compiled transcoder (built at install with a C compiler and libjpeg) is here."""
    return lib() is not None


def transcode(data: bytes) -> tuple[bytes, int]:
    """``data`` re-encoded losslessly as baseline with restart markers; and the interval in MCUs."""
    c = lib()
    if c is None:
        raise RuntimeError(MISSING)
    out, n, k = ctypes.c_void_p(), ctypes.c_ulong(), ctypes.c_int()
    err = ctypes.create_string_buffer(256)
    if c.gc_transcode_restart(
        bytes(data), len(data), ctypes.byref(out), ctypes.byref(n), ctypes.byref(k), err, len(err)
    ):
        raise ValueError(f"lossless transcode failed: {err.value.decode(errors='replace')}")
    try:
        return ctypes.string_at(out, n.value), k.value
    finally:
        c.gc_free(out)
