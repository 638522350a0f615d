"""SPDL 0.8: its thread pipeline (``cfg["workers"]`` decode tasks at once), FFmpeg decode.

Each sample is demuxed, decoded and cropped/resized in one FFmpeg filter graph (train: a
RandomResizedCrop box as in torchvision, ``crop,scale=224:224`` (bicubic) and a random ``hflip``;
eval: ``scale`` to a short side of 256 then ``crop=224:224`` at the centre), then batched.
A new pipeline is built for each epoch, so nothing decodes ahead while the runner is idle.
Output NHWC uint8.
"""

from __future__ import annotations

import math
import random

import numpy as np

CROP = 224


def rrc_box(w: int, h: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box (scale 0.08-1, ratio 3/4-4/3): x, y, width, height."""
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            return rng.randint(0, w - cw), rng.randint(0, h - ch), cw, ch
    ratio = w / h
    if ratio < 3 / 4:
        cw, ch = w, round(w / (3 / 4))
    elif ratio > 4 / 3:
        cw, ch = round(h * 4 / 3), h
    else:
        cw, ch = w, h
    return (w - cw) // 2, (h - ch) // 2, cw, ch


class Spdl:
    def __init__(self, cfg):
        self.files, self.cfg = cfg["files"], cfg
        self.train = cfg["pipeline"] == "train"
        self.rng = random.Random(cfg["seed"])
        self.epoch = 0

    def _filter(self, w: int, h: int, rng: random.Random) -> str:
        if self.train:
            x, y, cw, ch = rrc_box(w, h, rng)
            flip = ",hflip" if rng.random() < 0.5 else ""
            return f"crop={cw}:{ch}:{x}:{y},scale={CROP}:{CROP}:flags=bicubic{flip},format=rgb24"
        s = 256 / min(w, h)
        sw, sh = max(CROP, round(w * s)), max(CROP, round(h * s))
        return f"scale={sw}:{sh}:flags=bicubic,crop={CROP}:{CROP},format=rgb24"

    def _load(self, item):
        import spdl.io

        index, seed = item
        packets = spdl.io.demux_image(self.files[index])
        rng = random.Random(seed)
        frames = spdl.io.decode_packets(
            packets, filter_desc=self._filter(packets.width, packets.height, rng)
        )
        return spdl.io.to_numpy(spdl.io.convert_frames(frames)), index

    @staticmethod
    def _collate(items):
        return np.stack([a for a, _ in items]), np.array([i for _, i in items])

    def batches(self):
        from spdl.pipeline import PipelineBuilder

        order = list(range(len(self.files)))
        if self.train:
            self.rng.shuffle(order)
        seeds = [self.rng.getrandbits(32) for _ in order]
        w = self.cfg["workers"]
        pipe = (
            PipelineBuilder()
            .add_source(list(zip(order, seeds)))
            .pipe(self._load, concurrency=w)
            .aggregate(self.cfg["batch_size"])
            .pipe(self._collate)
            .add_sink(3)
            .build(num_threads=w)
        )
        with pipe.auto_stop():
            yield from pipe.get_iterator(timeout=600)


def make(name: str, cfg: dict):
    return Spdl(cfg)
