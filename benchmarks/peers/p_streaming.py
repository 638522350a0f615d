"""MosaicML Streaming: MDS shards written once (raw JPEG bytes and the sample index), read by
its StreamingDataset in a torch DataLoader, decoded with decode_jpeg + torchvision v2."""

from __future__ import annotations

from pathlib import Path

from p_torch import _dataloader, _du, _Loader, decode, tv_transform
from streaming import MDSWriter, StreamingDataset
from streaming.base.util import clean_stale_shared_memory


class Records(StreamingDataset):
    def __init__(self, pipeline: str, **kw):
        super().__init__(**kw)
        self.tv = tv_transform(pipeline, pil=False)

    def __getitem__(self, i):
        r = super().__getitem__(i)
        return self.tv(decode(r["image"])), r["index"]


class Streaming(_Loader):
    def __init__(self, cfg):
        out = Path(cfg["work"]) / "mds"
        if not (out / "index.json").exists():
            with MDSWriter(
                out=str(out), columns={"index": "int", "image": "bytes"}, size_limit="64mb"
            ) as w:
                for i, p in enumerate(cfg["files"]):
                    w.write({"index": i, "image": Path(p).read_bytes()})
        clean_stale_shared_memory()
        ds = Records(
            cfg["pipeline"],
            local=str(out),
            shuffle=cfg["pipeline"] == "train",
            shuffle_seed=cfg["seed"],
            batch_size=cfg["batch_size"],
        )
        self.loader = _dataloader(ds, cfg)
        self.setup_info = {"format_bytes": _du(out)}


def make(name: str, cfg: dict):
    Path(cfg["work"]).mkdir(parents=True, exist_ok=True)
    return Streaming(cfg)
