"""What a CPU worker holds while it readies a batch of images of several sizes for sending.

    python benchmarks/worker_send_peak.py [--images 8] [--side 1000]

A batch that is not one stacked tensor (no fixed output size) goes to the socket as one buffer
that ``gpucache.decode.cpu._results.packed`` fills image by image, before the first byte is sent
(so an allocation that fails is reported in place of the result). This prints the peak RSS that
step adds, as a multiple of the batch's bytes, over ``--images`` CHW views of HWC images (as the
decoders return them) of ``--side`` x ``--side`` + 10k pixels, and checks the buffer holds each
image's CHW bytes in order. One run in a fresh process (memory freed by a previous run would
hide the next one's peak).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # benchmarks._record

import numpy as np
import torch

from benchmarks._record import run_line
from gpucache.decode._outcome import Decoded
from gpucache.decode.cpu._worker import _result
from gpucache.testing._memory import reset_peak_rss, status_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--side", type=int, default=1000)
    args = ap.parse_args()
    print(run_line(), flush=True)
    torch.set_num_threads(1)
    imgs = [
        torch.from_numpy(np.full((args.side, args.side + 10 * k, 3), k, np.uint8)).permute(2, 0, 1)
        for k in range(args.images)
    ]
    total = sum(t.numel() for t in imgs)
    base = reset_peak_rss()
    _, data = _result(1, Decoded(imgs, np.arange(args.images)))
    peak = status_bytes("VmHWM") - base
    expected = b"".join(t.contiguous().numpy().tobytes() for t in imgs)
    assert bytes(data) == expected, "the buffer does not hold the images' CHW bytes"
    print(
        f"{args.images} images, {total / 2**20:.1f} MiB: the send buffer adds "
        f"{peak / total:.2f}x the batch at peak"
    )


if __name__ == "__main__":
    main()
