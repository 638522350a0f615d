"""``gpucache build | info | verify | bench | cache`` -- the command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .. import __version__, bench
from .._errors import BuildError, GpucacheError
from ..ingest._options import spell_on_error
from ..ingest._pipeline import default_threads as read_threads
from ..ingest._resize import SECTION as RESIZED
from ..ingest._resize import max_side_of, resized
from ..ingest._sniff import Kind
from ..node._jpegcache import JpegCache
from ..store._checksum import default_threads as check_threads
from ..store._store import classes_text
from . import _build as _build_cli
from . import _cache as _cache_cli
from . import _tiers
from ._build import ON_ERROR_FLAG

DESCRIPTION = (
    "gpucache build | info | verify | bench | cache: pack images into one store file, "
    "summarize and check stores, compare loaders' speed, and list or clean the node "
    "cache. Each command: gpucache COMMAND --help."
)


def _build(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        cache = _build_cli.store_from_args(args, JpegCache)
        if cache is None:
            print(
                "gpucache build: give an ImageFolder root or one of --csv, --webdataset, --hf",
                file=sys.stderr,
            )
            return 2
    except BuildError as err:  # in the command line's words
        print(BuildError(err.report, skip=spell_on_error("skip", ON_ERROR_FLAG)), file=sys.stderr)
        return 1
    except (ValueError, RuntimeError, MemoryError, ImportError) as err:  # no transcoder, no
        # client for a URL's scheme (each says the fix)
        print(err, file=sys.stderr)
        return 1
    cache.save(args.output)
    report = cache.report
    if report is not None:  # the skipped files were logged as the build went (first 20)
        print(str(report).splitlines()[0])
        if len(report.skipped) > 20:
            print(f"all {len(report.skipped)} skipped files: gpucache info --skipped {args.output}")
    print(
        f"wrote {args.output}: {len(cache)} samples, {cache.nbytes / 2**20:,.1f} MiB of images, "
        f"{classes_text(cache.classes)} in {time.perf_counter() - t0:.1f} s"
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    cache = JpegCache.open(args.file)
    values, counts = np.unique(cache.samples["kind"], return_counts=True)
    kinds = {Kind(int(v)).name: int(c) for v, c in zip(values, counts)}
    s = cache.samples
    print(f"{args.file}: {len(cache)} samples, {cache.nbytes / 2**20:,.1f} MiB of images")
    print(
        f"classes ({len(cache.classes)}): {', '.join(cache.classes[:20])}"
        f"{' ...' if len(cache.classes) > 20 else ''}"
        if cache.classes
        else "classes: none (unlabeled: every label is -1)"
    )
    print("kinds: " + ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())))
    if len(cache):
        print(
            f"height: {s['height'].min()}..{s['height'].max()}, width: "
            f"{s['width'].min()}..{s['width'].max()}; grayscale {int((s['components'] == 1).sum())}"
            f", CMYK {int((s['components'] == 4).sum())}; GPU-decodable "
            f"{int(cache.gpu_decodable().sum())}"
        )
    print(f"metadata: {'yes' if cache.metadata is not None else 'no'}")
    share = cache.node_share
    if share is not None:
        read, read_bytes, reused, reused_bytes = share.fetched
        print(
            f"share: node {share.node} of {share.nodes} ({len(cache):,} of the listing's "
            f"{share.total:,} samples, {share.partitions:,} partitions); built reading {read:,} "
            f"samples ({read_bytes / 2**20:,.1f} MiB) from the source and taking {reused:,} "
            f"({reused_bytes / 2**20:,.1f} MiB) from earlier layouts' stores"
        )
    masks = cache.masks
    if masks is None:
        print("masks: none")
    else:
        held = ", ".join(f"{k}: {v}" for k, v in masks.counts().items())
        print(f"masks: {len(masks)} ({held}), {masks.nbytes / 2**20:,.1f} MiB")
    if cache.report is None:
        print("build report: none stored")
    else:
        lines = str(cache.report).splitlines()
        print(f"build report: {lines[0]}")
        if args.skipped:
            print("\n".join(lines[1:]))
    settings = max_side_of(cache)
    if settings is not None:  # what the build re-encoded (max_side, jpeg_quality)
        mask = resized(cache)
        assert mask is not None  # the build's settings are stored with the section
        was = int(cache.extra[RESIZED][mask, 2].astype(np.int64).sum())
        now = int(np.diff(cache._offsets)[mask].sum())
        cap = f"max_side {settings[0]}, " if settings[0] else ""
        print(
            f"re-encoded at build ({cap}quality {settings[1]}): {int(mask.sum())} of "
            f"{len(cache)} samples, {was / 2**20:,.1f} MiB -> {now / 2**20:,.1f} MiB"
        )
    if cache.extra:
        print(
            "sections: "
            + ", ".join(f"{name} {arr.dtype.str} {arr.shape}" for name, arr in cache.extra.items())
        )
    for line in _tiers.tier_lines(cache, _tiers.folders_for(Path(args.file), args.cache_dir)):
        print(line)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from . import _checks as verify

    t0 = time.perf_counter()
    cache = JpegCache.open(args.file)
    problems = verify.check_checksums(cache, threads=args.num_threads)
    checked = "checksums ok" if not problems else f"{len(problems)} checksum problem(s)"
    decoded = ""
    if args.decode:
        warned: list[verify.Problem] = []
        failed = verify.check_decodes(cache, threads=args.num_threads, warned=warned)
        problems += failed
        decoded = f"; {len(cache) - len(failed)} of {len(cache)} samples decode"
        for w in sorted(warned, key=lambda w: -1 if w.index is None else w.index):
            print(f"{args.file}: {w}", file=sys.stderr)
        if warned:
            decoded += f" ({len(warned)} with corrupt data that libjpeg decoded anyway)"
        if cache.masks is not None:
            bad_masks = verify.check_masks(cache, threads=args.num_threads)
            problems += bad_masks
            decoded += f"; {len(cache) - len(bad_masks)} of {len(cache)} masks decode"
    for p in sorted(problems, key=lambda p: -1 if p.index is None else p.index):
        print(f"{args.file}: {p}", file=sys.stderr)
    print(f"{args.file}: {checked}{decoded} ({time.perf_counter() - t0:.1f} s)")
    if problems:
        print(
            "rebuild the store (`gpucache build`) or copy it again from a good copy",
            file=sys.stderr,
        )
    return 1 if problems else 0


def make_parser() -> argparse.ArgumentParser:
    """The ``gpucache`` command's parser, every command's options on it."""
    parser = argparse.ArgumentParser(prog="gpucache", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="pack an ImageFolder tree into one store file")
    p.add_argument(
        "src",
        nargs="?",
        help="ImageFolder root (root/<class>/<image>), a local folder or a prefix in object "
        "storage (s3://bucket/train/, gs://..., az://...)",
    )
    p.add_argument("--csv", help="a CSV of path,label[,metadata] rows instead of a folder")
    p.add_argument(
        "--webdataset",
        nargs="+",
        metavar="SHARD",
        help="WebDataset .tar shards: paths or URLs, with brace patterns ({000..099}) or globs "
        "(*; quote them so that the shell leaves them to gpucache)",
    )
    p.add_argument(
        "--hf",
        metavar="DATASET",
        help="a Hugging Face dataset: a save_to_disk "
        "folder or a hub name (with --hf-split, --hf-image-column)",
    )
    p.add_argument(
        "--hf-split",
        default="train",
        metavar="SPLIT",
        help="with --hf: the split to pack (default: train)",
    )
    p.add_argument(
        "--hf-image-column",
        default="image",
        metavar="COLUMN",
        help="with --hf: the column holding the images (default: image)",
    )
    p.add_argument("-o", "--output", required=True, help="store file to write")
    p.add_argument(
        ON_ERROR_FLAG,
        type=_build_cli.on_error,
        default="skip",
        metavar="{skip,raise}",
        help="a corrupt, truncated or non-image file: skip it and list it in the "
        "build report (default), or stop the build with an error naming it",
    )
    _build_cli.add_threads(
        p,
        "threads reading the inputs (default: two per usable core, at most 16: "
        f"{read_threads()} here)",
    )
    _build_cli.add_options(p)
    p.add_argument(
        "--restart-markers",
        action="store_true",
        help="transcode JPEGs losslessly with restart markers: random crops decode "
        "only their segments (faster CPU crops, about +3%% size; same pixels)",
    )
    p.add_argument(
        "--max-side",
        type=int,
        default=None,
        metavar="PX",
        help="re-encode images whose long side exceeds PX to that long side (JPEG, "
        "quality 90 or --jpeg-quality, recorded in the store); the rest keep their "
        "bytes",
    )
    p.add_argument(
        "--jpeg-quality",
        type=int,
        default=None,
        metavar="Q",
        help="re-encode every image as JPEG at quality Q (1-100, 4:2:0, upright) where "
        "that makes it smaller, as FFCV's jpg mode (lossy; recorded in the store)",
    )
    p.set_defaults(func=_build)
    p = sub.add_parser("info", help="summarize a store file (reads no image data)")
    p.add_argument("file")
    p.add_argument(
        "--cache-dir",
        help="also look for the store's decoded tiers in this node cache folder (they are "
        "looked for beside the store and in the default node cache folder)",
    )
    p.add_argument(
        "--skipped", action="store_true", help="list every file the build skipped, with the reason"
    )
    p.set_defaults(func=_info)
    p = sub.add_parser(
        "verify", help="check every sample's checksum and decode it, on every usable core"
    )
    p.add_argument("file")
    _build_cli.add_threads(
        p,
        f"threads to check with (default: one per usable core: {check_threads()} here)",
    )
    p.add_argument(
        "--decode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode every sample too (default; --no-decode: checksums only)",
    )
    p.set_defaults(func=_verify)
    bench.add_parser(sub)
    _cache_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # names that are not UTF-8 print escaped (\udcXX)
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    logging.basicConfig(format="%(message)s", level=logging.WARNING)
    args = make_parser().parse_args(argv)
    try:
        command: Callable[[argparse.Namespace], int] = args.func
        return command(args)
    except (GpucacheError, OSError) as err:  # says what, where and the fix
        why = err.strerror if isinstance(err, OSError) and err.strerror else err
        print(f"gpucache {args.command}: {why}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
