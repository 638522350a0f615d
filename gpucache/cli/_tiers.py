"""``gpucache info``'s decoded tiers: the tier files of a store found in the node cache.

A tier file (``<key>.pixels``, docs/reference/format.md) records the digest of the store it was
decoded from; ``gpucache info STORE`` lists every tier of that store in the store's own folder,
the default node cache folder and ``--cache-dir`` (reading 128 bytes and the index of each).
"""

from __future__ import annotations

from pathlib import Path

from .._errors import CacheFormatError
from ..loader._tier_key import store_digest
from ..node._dir import default_dir
from ..store._decoded import FROM_STORE, open_tier
from ..store._store import Store


def tier_lines(cache: Store, folders: list[Path]) -> list[str]:
    """One line a tier of ``cache`` found in ``folders`` (or one saying there is none)."""
    digest = store_digest(cache)
    lines, seen = [], set()
    for folder in folders:
        try:
            candidates = sorted(folder.glob("*.pixels"))
        except OSError:
            continue
        for path in candidates:
            if path.resolve() in seen:
                continue
            seen.add(path.resolve())
            try:
                tier = open_tier(path)
            except (OSError, CacheFormatError):
                continue  # another user's, unreadable or corrupt: a loader rebuilds its own
            if tier.key != digest:
                continue
            from_store = int((tier.status == FROM_STORE).sum())
            lines.append(
                f"decoded tier: {tier.mode} side {tier.side}, {len(tier):,} images, "
                f"{tier.nbytes / 2**20:,.1f} MiB ({tier.nbytes / max(1, len(tier)) / 1e3:,.0f} "
                f"kB an image), {tier.decoder}"
                + (f", {from_store} decoded from the store" if from_store else "")
                + f": {path}"
            )
            if tier.handle is not None:
                tier.handle.close()
    return lines or [
        "decoded tiers: none in "
        + ", ".join(str(f) for f in folders)
        + " (GpuCachedLoader(cache, decoded=S) builds one)"
    ]


def folders_for(store: Path, cache_dir: str | None) -> list[Path]:
    """Where a store's tiers may be: its folder, the default node cache, ``--cache-dir``."""
    out = [store.resolve().parent, default_dir()]
    if cache_dir is not None:
        out.append(Path(cache_dir))
    return list(dict.fromkeys(out))
