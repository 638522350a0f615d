"""``gpucache build | info | verify | bench`` -- the command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

from . import _cache_cli, bench
from ._build import BuildError
from ._format import CacheFormatError
from ._sniff import Kind
from ._store import JpegCache


def _build(args) -> int:
    from ._sources import cli_build

    t0 = time.perf_counter()
    try:
        cache = cli_build(args, JpegCache)
        if cache is None and args.src is None:
            print("gpucache build: give an ImageFolder root or one of --csv, --webdataset, --hf",
                  file=sys.stderr)
            return 2
        if cache is None:
            cache = JpegCache.from_folder(Path(args.src), on_error=args.on_error,
                                          num_threads=args.threads)
        if args.restart_markers:
            from .decode._roi_rst import restart_store

            cache = restart_store(cache, num_threads=args.threads)
    except (BuildError, RuntimeError) as err:  # RuntimeError: no transcoder (says the fix)
        print(err, file=sys.stderr)
        return 1
    cache.save(args.output)
    print(cache.report)
    print(f"wrote {args.output}: {len(cache)} samples, {cache.nbytes / 2**20:,.1f} MiB of images, "
          f"{len(cache.classes)} classes in {time.perf_counter() - t0:.1f} s")
    return 0


def _info(args) -> int:
    cache = JpegCache.open(args.file)
    kinds = Counter(Kind(k).name for k in cache.samples["kind"])
    s = cache.samples
    print(f"{args.file}: {len(cache)} samples, {cache.nbytes / 2**20:,.1f} MiB of images")
    print(f"classes ({len(cache.classes)}): {', '.join(cache.classes[:20])}"
          f"{' ...' if len(cache.classes) > 20 else ''}")
    print("kinds: " + ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())))
    if len(cache):
        print(f"height: {s['height'].min()}..{s['height'].max()}, width: "
              f"{s['width'].min()}..{s['width'].max()}; grayscale {int((s['components'] == 1).sum())}"
              f", CMYK {int((s['components'] == 4).sum())}; GPU-decodable "
              f"{int(cache.gpu_decodable().sum())}")
    print(f"metadata: {'yes' if cache.metadata is not None else 'no'}")
    if cache.extra:
        print("sections: " + ", ".join(f"{name} {arr.dtype.str} {arr.shape}"
                                       for name, arr in cache.extra.items()))
    return 0


def _verify(args) -> int:
    from tqdm.auto import tqdm

    from .decode.cpu import check_size, decode_sample

    cache = JpegCache.open(args.file)
    crc = zlib.crc32(memoryview(cache._data))
    if crc != cache._file.data_crc:
        print(f"{args.file}: data checksum mismatch (stored {cache._file.data_crc:08x}, computed "
              f"{crc:08x}); the image data is corrupt: rebuild it.", file=sys.stderr)
        return 1
    bad = 0
    for i in tqdm(range(len(cache)), desc="decode", unit="img", disable=None, leave=False):
        try:
            check_size(cache, i, decode_sample(cache, i))
        except Exception as err:  # report every sample, keep going
            bad += 1
            print(f"sample {i} ({cache.paths[i]}): {type(err).__name__}: {err}", file=sys.stderr)
    print(f"{args.file}: checksum ok; {len(cache) - bad} of {len(cache)} samples decode")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(message)s", level=logging.WARNING)
    parser = argparse.ArgumentParser(prog="gpucache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="pack an ImageFolder tree into one store file")
    p.add_argument("src", nargs="?", help="ImageFolder root (root/<class>/<image>)")
    p.add_argument("--csv", help="a CSV of path,label[,metadata] rows instead of a folder")
    p.add_argument("--webdataset", nargs="+", metavar="SHARD", help="WebDataset .tar shards")
    p.add_argument("--hf", metavar="DATASET", help="a Hugging Face dataset: a save_to_disk "
                   "folder or a hub name (with --hf-split, --hf-image-column)")
    p.add_argument("--hf-split", default="train")
    p.add_argument("--hf-image-column", default="image")
    p.add_argument("-o", "--output", required=True, help="store file to write")
    p.add_argument("--on-error", choices=("skip", "raise"), default="skip")
    p.add_argument("--threads", type=int, default=None, help="reader threads")
    p.add_argument("--restart-markers", action="store_true",
                   help="transcode JPEGs losslessly with restart markers: random crops decode "
                        "only their segments (faster CPU crops, about +3%% size; same pixels)")
    p.set_defaults(func=_build)
    p = sub.add_parser("info", help="summarize a store file (reads no image data)")
    p.add_argument("file")
    p.set_defaults(func=_info)
    p = sub.add_parser("verify", help="check a store's checksum and decode every sample")
    p.add_argument("file")
    p.set_defaults(func=_verify)
    bench.add_parser(sub)
    _cache_cli.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (CacheFormatError, FileNotFoundError) as err:
        print(f"gpucache {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
