"""FFCV 1.0.2: a ``.beton`` written once, read by its Loader (``cfg["workers"]`` threads).

Modes (``options.mode``): ``jpg`` (every image decoded and re-encoded by FFCV at quality 90, its
documented JPEG path), ``original`` (the source files' own bytes stored as FFCV's JPEG records,
so it decodes exactly the bytes the other contenders read) and ``smart`` with
``options.max_resolution`` (images resized to that long side at write time; ``smart`` without a
threshold stores raw pixels). Train: RandomResizedCropRGBImageDecoder + flip; eval:
CenterCropRGBImageDecoder(224, ratio 224/256). Output NHWC uint8.
"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np

CROP = 224


def _original_bytes_encode(self, destination, value, malloc):
    """RGBImageField.encode for (jpeg bytes, height, width): the bytes kept as they are."""
    data, h, w = value
    destination["mode"] = 0  # IMAGE_MODES["jpg"]
    destination["height"], destination["width"] = h, w
    buf = np.frombuffer(data, dtype=np.uint8)
    destination["data_ptr"], storage = malloc(buf.nbytes)
    storage[:] = buf


class _Files:
    def __init__(self, files, original: bool):
        self.files, self.original = files, original

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image

        with Image.open(self.files[i]) as im:
            if self.original:
                return (Path(self.files[i]).read_bytes(), im.height, im.width), i
            return np.asarray(im.convert("RGB")), i


class Ffcv:
    def __init__(self, cfg):
        from ffcv.fields import IntField, RGBImageField
        from ffcv.fields.basics import IntDecoder
        from ffcv.fields.rgb_image import (
            CenterCropRGBImageDecoder,
            RandomResizedCropRGBImageDecoder,
        )
        from ffcv.loader import Loader, OrderOption
        from ffcv.transforms import RandomHorizontalFlip, ToTensor
        from ffcv.writer import DatasetWriter

        opt = cfg.get("options", {})
        mode, cap = opt.get("mode", "jpg"), opt.get("max_resolution")
        path = Path(cfg["work"]) / f"data-{mode}-{cap}.beton"
        if not path.exists():
            field = RGBImageField(
                write_mode="jpg" if mode == "original" else mode,
                max_resolution=cap,
                jpeg_quality=90,
            )
            if mode == "original":
                field.encode = types.MethodType(_original_bytes_encode, field)
            tmp = path.with_suffix(".tmp")
            DatasetWriter(
                str(tmp), {"image": field, "label": IntField()}, num_workers=cfg["workers"]
            ).from_indexed_dataset(_Files(cfg["files"], mode == "original"))
            tmp.rename(path)
        train = cfg["pipeline"] == "train"
        if train:
            image = [RandomResizedCropRGBImageDecoder((CROP, CROP)), RandomHorizontalFlip()]
        else:
            image = [CenterCropRGBImageDecoder((CROP, CROP), ratio=CROP / 256)]
        self.loader = Loader(
            str(path),
            batch_size=cfg["batch_size"],
            num_workers=cfg["workers"],
            order=OrderOption.RANDOM if train else OrderOption.SEQUENTIAL,
            drop_last=False,
            os_cache=True,
            seed=cfg["seed"],
            pipelines={"image": image + [ToTensor()], "label": [IntDecoder(), ToTensor()]},
        )
        self.setup_info = {"format_bytes": path.stat().st_size}

    def batches(self):
        return iter(self.loader)


def make(name: str, cfg: dict):
    return Ffcv(cfg)
