"""NVIDIA DALI, CPU pipeline (``device_id=None``, ``cfg["workers"]`` threads), reading the files.

Exactly once per epoch needs the reader's ``shuffle_after_epoch`` (``random_shuffle`` samples from
a buffer and repeats or skips) and ``pad_last_batch`` (the last batch is padded with copies of the
last sample, which are cut off here, so the next epoch starts at a shard boundary). Train:
``decoders.image_random_crop`` (decodes only the crop) + resize 224 + random flip; eval:
``decoders.image_crop`` of the centre square that Resize 256 + CenterCrop 224 reads (224/256 of
the short side, its size from ``peek_image_shape``: DALI's crop-only decode, as in train), then
resize to 224 (on the photos within a few levels of decode + ``resize_shorter=256`` + centre crop,
which differ by the sub-pixel placement of the box). Output HWC uint8.
"""

from __future__ import annotations

import math

import numpy as np

CROP = 224


class Dali:
    def __init__(self, cfg):
        import nvidia.dali.math as dmath
        from nvidia.dali import fn, pipeline_def, types

        self.n, self.bs = len(cfg["files"]), cfg["batch_size"]
        train = cfg["pipeline"] == "train"

        @pipeline_def(
            batch_size=self.bs,
            num_threads=cfg["workers"],
            device_id=None,
            seed=cfg["seed"] + 1,
            exec_dynamic=True,
        )
        def pipe():
            jpegs, labels = fn.readers.file(
                files=cfg["files"],
                labels=list(range(self.n)),
                shuffle_after_epoch=train,
                pad_last_batch=True,
                name="reader",
            )
            if train:
                images = fn.decoders.image_random_crop(
                    jpegs,
                    device="cpu",
                    output_type=types.RGB,
                    random_area=[0.08, 1.0],
                    random_aspect_ratio=[3 / 4, 4 / 3],
                )
                images = fn.resize(images, resize_x=CROP, resize_y=CROP, antialias=True)
                images = fn.flip(images, horizontal=fn.random.coin_flip())
            else:
                shape = fn.peek_image_shape(jpegs)  # H, W, C
                side = dmath.min(
                    fn.cast(shape[0], dtype=types.FLOAT), fn.cast(shape[1], dtype=types.FLOAT)
                ) * (CROP / 256)
                images = fn.decoders.image_crop(
                    jpegs,
                    device="cpu",
                    output_type=types.RGB,
                    crop_h=side,
                    crop_w=side,
                    crop_pos_x=0.5,
                    crop_pos_y=0.5,
                )
                images = fn.resize(images, resize_x=CROP, resize_y=CROP, antialias=True)
            return images, labels

        self.pipe = pipe()
        self.pipe.build()
        self.steps = math.ceil(self.n / self.bs)

    def batches(self):
        for k in range(self.steps):
            images, labels = self.pipe.run()
            images, labels = images.as_array(), np.asarray(labels.as_array()).reshape(-1)
            keep = min(self.bs, self.n - k * self.bs)  # the padded tail of the last batch
            yield images[:keep], labels[:keep]


def make(name: str, cfg: dict):
    return Dali(cfg)
