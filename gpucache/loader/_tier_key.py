"""What names a decoded tier: its store's content, its side and the decoder that made it.

A tier file is reused by a later run only when all three are the same; anything else hashes to
another name and is built afresh. The store's part is a digest of its sample count, offsets,
labels and records and of the CRC-32 of its encoded bytes (a saved store's header holds it; an
in-memory store's is computed once, on every core), so the same folder built again, saved,
opened or shared gives the same tier, and one changed byte gives another.
"""

from __future__ import annotations

import hashlib
import importlib.metadata

import numpy as np
import torch

from ..decode._jpeg import jpeg_decoder_name
from ..store import _checksum, _decoded
from ..store._store import Store
from ._state import store_fingerprint

_VERSION = b"gpucache-tier-1"


def store_digest(cache: Store) -> bytes:
    """16 bytes that change with any of the store's samples (see the module's docstring)."""
    h = hashlib.blake2b(_VERSION, digest_size=16)
    h.update(store_fingerprint(cache).encode())
    h.update(np.ascontiguousarray(cache.samples).tobytes())
    parsed = getattr(cache, "_file", None)
    crc = getattr(parsed, "data_crc", None)
    if crc is None:
        crc = _checksum.crc32(cache._data, threads=_checksum.default_threads())
    h.update(int(crc).to_bytes(4, "little"))
    return h.digest()


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def decoder_version(*, short: bool = False) -> str:
    """The decoder and resize that make the pixels: their packages' versions (``short``: the
    JPEG decoder and its version, as the tier file's header records it)."""
    name = jpeg_decoder_name()
    first = f"{name} {_version(name)}"
    if short:
        return first
    return (
        f"{first}; torch {torch.__version__}; torchvision {_version('torchvision')}; "
        f"pillow {_version('pillow')}; gpucache {_version('gpucache-loader')}; "
        f"format {_decoded.VERSION}"
    )


def tier_key(cache: Store, side: int, mode: str) -> tuple[str, bytes]:
    """``(the tier file's name stem, the store digest its header records)``."""
    digest = store_digest(cache)
    h = hashlib.blake2b(_VERSION, digest_size=16)
    h.update(digest)
    h.update(f"{mode} {side}; {decoder_version()}".encode())
    return h.hexdigest(), digest
