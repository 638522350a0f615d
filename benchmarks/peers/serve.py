"""One contender as a long-lived process: ``python serve.py MODULE:NAME CONFIG.json``.

Runs under the contender's own interpreter (its virtual environment), so it uses the standard
library and NumPy only; the contender module (``p_torch``, ``p_dali``, ``p_ffcv``, ``p_spdl``)
imports its peer. The module's ``make(name, cfg)`` returns an object with ``batches()`` (one
epoch: an iterable of ``(images, sample_indices)``) and optionally ``setup_info`` and ``close()``.

Protocol on stdin/stdout, one line each; result lines start with ``@@`` (anything else a library
prints is passed to stderr): ``@@ready {...}`` after setup, then per ``epoch`` command one
``@@epoch {...}`` and ``quit`` to end. Every batch is checked (uint8, n x 224 x 224 x 3 in either
channel order), and every epoch must deliver each sample index exactly once.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback

import numpy as np

CROP = 224
HERE = os.path.dirname(os.path.abspath(__file__))


def _array(x) -> np.ndarray:
    if hasattr(x, "numpy"):  # a torch tensor
        return x.numpy()
    return np.asarray(x)


def check(images, indices, batch_size: int) -> np.ndarray:
    """The batch's sample indices; ValueError unless images are n uint8 224x224 RGB crops."""
    idx = _array(indices).reshape(-1).astype(np.int64)
    n = len(idx)
    shape, dtype = tuple(images.shape), str(images.dtype).replace("torch.", "")
    ok = (
        dtype == "uint8"
        and 0 < n <= batch_size
        and len(shape) == 4
        and shape[0] == n
        and shape[1:] in ((3, CROP, CROP), (CROP, CROP, 3))
    )
    if not ok:
        raise ValueError(
            f"a batch of {n} indices came with images {dtype} {shape}; expected "
            f"uint8 ({n}, 3, {CROP}, {CROP}) or ({n}, {CROP}, {CROP}, 3)"
        )
    return idx


def run_epoch(contender, n_samples: int, batch_size: int) -> dict:
    counts = np.zeros(n_samples, dtype=np.int64)
    batches = 0
    t0 = last = time.perf_counter()
    for images, indices in contender.batches():
        now = time.perf_counter()
        idx = check(images, indices, batch_size)
        if idx.min() < 0 or idx.max() >= n_samples:
            raise ValueError(
                f"sample index out of range 0..{n_samples - 1}: {idx.min()}..{idx.max()}"
            )
        np.add.at(counts, idx, 1)
        batches += 1
        last = time.perf_counter()
        t0 += last - now  # the checks are not the loader's time
    seconds = last - t0
    missing, repeated = int((counts == 0).sum()), int((counts > 1).sum())
    return {
        "seconds": seconds,
        "images": int(counts.sum()),
        "batches": batches,
        "img_s": float(counts.sum() / seconds) if seconds > 0 else None,
        "exactly_once": missing == 0 and repeated == 0,
        "missing": missing,
        "repeated": repeated,
    }


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def reply(kind: str, payload: dict, out) -> None:
    out.write(f"@@{kind} {json.dumps(payload)}\n")
    out.flush()


def main(argv: list[str]) -> int:
    spec, cfg_path = argv
    module, name = spec.split(":")
    cfg = json.loads(open(cfg_path).read())
    out = os.fdopen(os.dup(1), "w")  # results only; libraries' prints go to stderr
    os.dup2(2, 1)
    sys.path.insert(0, HERE)
    try:
        t0 = time.perf_counter()
        contender = importlib.import_module(module).make(name, cfg)
        info = dict(getattr(contender, "setup_info", {}))
        info["versions"] = {d: _version(d) for d in cfg.get("dists", ())}
        reply("ready", {"setup_s": time.perf_counter() - t0, **info}, out)
    except Exception as err:  # noqa: BLE001 - reported to the runner, which keeps the others
        traceback.print_exc()
        reply("error", {"error": f"{type(err).__name__}: {err}"[:500]}, out)
        return 1
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        try:
            reply("epoch", run_epoch(contender, len(cfg["files"]), cfg["batch_size"]), out)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            reply("error", {"error": f"{type(err).__name__}: {err}"[:500]}, out)
    if hasattr(contender, "close"):
        contender.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
