"""litdata: the files written once by ``litdata.optimize`` (raw JPEG bytes and the sample index),
read by its StreamingDataset + StreamingDataLoader, decoded with decode_jpeg + torchvision v2."""

from __future__ import annotations

from pathlib import Path

import litdata as ld
from p_torch import _du, _Loader, decode, tv_transform


def _record(item):
    index, path = item
    return {"index": index, "image": Path(path).read_bytes()}


class Records(ld.StreamingDataset):
    def __init__(self, path: str, pipeline: str, **kw):
        super().__init__(path, **kw)
        self.tv = tv_transform(pipeline, pil=False)

    def __getitem__(self, i):
        r = super().__getitem__(i)
        return self.tv(decode(r["image"])), r["index"]


class Litdata(_Loader):
    def __init__(self, cfg):
        out = Path(cfg["work"]) / "optimized"
        if not (out / "index.json").exists():
            ld.optimize(
                fn=_record,
                inputs=list(enumerate(cfg["files"])),
                output_dir=str(out),
                chunk_bytes="64MB",
                num_workers=1,
            )
        ds = Records(
            str(out),
            cfg["pipeline"],
            shuffle=cfg["pipeline"] == "train",
            drop_last=False,
            seed=cfg["seed"],
        )
        self.loader = ld.StreamingDataLoader(
            ds,
            batch_size=cfg["batch_size"],
            num_workers=cfg["workers"],
            persistent_workers=cfg["workers"] > 0,
        )
        self.setup_info = {"format_bytes": _du(out)}


def make(name: str, cfg: dict):
    Path(cfg["work"]).mkdir(parents=True, exist_ok=True)
    return Litdata(cfg)
