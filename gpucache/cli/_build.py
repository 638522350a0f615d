"""``gpucache build``: the store its arguments name, through the public builders
(``JpegCache.from_folder`` / ``from_csv`` / ``from_webdataset`` / ``from_hf``), the build options
under the same names as in Python (``--num-threads`` is ``num_threads=``)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from ..ingest._options import check_on_error
from ..node._jpegcache import JpegCache
from ..store._limits import DEFAULT_MAX_PIXELS

ON_ERROR_FLAG = "--on-error"  # on_error= in Python


def on_error(text: str) -> str:
    """``--on-error``: ``skip`` or ``raise``, checked as the builders check ``on_error=``, in the
    command line's words."""
    try:
        return check_on_error(text, ON_ERROR_FLAG)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def max_pixels(text: str) -> int | None:
    """``--max-pixels``: a positive number of pixels, or ``none`` for no bound."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of pixels or 'none'") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of pixels or 'none'")
    return value


def storage_option(text: str) -> tuple[str, object]:
    """``--storage-option KEY=VALUE``: the value as JSON when it parses, else the string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text.split('=')[0]!r}...: give KEY=VALUE")
    try:
        parsed: object = json.loads(value)
    except ValueError:
        parsed = value
    return key.strip(), parsed


def add_threads(p: argparse.ArgumentParser, what: str) -> None:
    """``--num-threads`` (``num_threads=`` in Python), with ``-j`` and ``--threads`` as aliases."""
    p.add_argument(
        "-j",
        "--num-threads",
        "--threads",
        dest="num_threads",
        type=int,
        default=None,
        metavar="N",
        help=what,
    )


def add_options(p: argparse.ArgumentParser) -> None:
    """The build options the Python builders take, and the per-source ones."""
    p.add_argument(
        "--max-pixels",
        type=max_pixels,
        default=DEFAULT_MAX_PIXELS,
        metavar="N",
        help=f"refuse images whose header claims more pixels (default "
        f"{DEFAULT_MAX_PIXELS:,}; none: no bound)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="build into this node cache folder once (reused while the inputs are "
        "unchanged), then write --output",
    )
    p.add_argument("--delimiter", default=",", help="with --csv: the field delimiter (default ,)")
    p.add_argument(
        "--metadata-ext",
        default=None,
        metavar="EXT",
        help="with --webdataset: the member extension holding each sample's metadata "
        "text (e.g. json)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        metavar="N",
        help="for URLs (s3://, gs://, az://): requests to the storage service at once (default 32)",
    )
    p.add_argument(
        "--storage-option",
        action="append",
        default=[],
        type=storage_option,
        metavar="KEY=VALUE",
        help="for URLs: an fsspec storage option (repeatable; VALUE is JSON when it parses, "
        "e.g. anon=true, endpoint_url=http://127.0.0.1:9000). Pass credentials through the "
        "environment, not here: a command line is visible to every user of the machine",
    )
    p.add_argument(
        "--masks",
        default=None,
        metavar="WHERE",
        help="segmentation masks stored with the images: with a folder, the folder of the "
        "masks (the images then unlabeled, paired by relative path and stem, "
        "docs/guides/segmentation.md); with --csv, the column of mask paths (its header name "
        "or 0-based index); with --webdataset, the mask member's extension (png beside jpg); "
        "with --hf, the dataset's mask column",
    )
    p.add_argument(
        "--shard",
        choices=("node",),
        default=None,
        help="node: build only this node's share of the data set (about 1/nodes of it), the node "
        "layout taken from the launcher (torchrun, srun); without it every node builds the "
        "whole data set (docs/guides/nodes.md)",
    )
    p.add_argument(
        "--hf-label-column",
        default="label",
        metavar="COLUMN",
        help="with --hf: the column holding the labels (default: label; none: unlabeled)",
    )


def store_from_args(args: argparse.Namespace, cls: type[JpegCache]) -> JpegCache | None:
    """The store ``gpucache build`` ARGS name; None when they name no input."""
    kw = dict(
        on_error=args.on_error,
        num_threads=args.num_threads,
        progress=True,
        max_pixels=args.max_pixels,
        restart_markers=args.restart_markers,
        max_side=args.max_side,
        jpeg_quality=args.jpeg_quality,
        shard=getattr(args, "shard", None),
    )
    cache_dir: dict[str, Any] = dict(cache_dir=args.cache_dir)
    remote = dict(cache_dir)  # the URL options go to the builders that take URLs
    if args.storage_option or args.requests is not None:
        remote.update(
            storage_options=dict(args.storage_option) or None, requests_in_flight=args.requests
        )
    masks = getattr(args, "masks", None)
    if args.csv:
        column: str | int | None = masks
        if isinstance(column, str) and column.isdigit():
            column = int(column)
        return cls.from_csv(args.csv, delimiter=args.delimiter, mask_column=column, **kw, **remote)
    if args.webdataset:
        return cls.from_webdataset(
            args.webdataset, metadata_ext=args.metadata_ext, mask_ext=masks, **kw, **remote
        )
    if args.hf:
        import datasets

        if os.path.isdir(args.hf):
            ds = datasets.load_from_disk(args.hf)
        else:
            ds = datasets.load_dataset(args.hf, split=args.hf_split)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[args.hf_split]
        label = None if args.hf_label_column.lower() == "none" else args.hf_label_column
        return cls.from_hf(
            ds,
            image_column=args.hf_image_column,
            label_column=label,
            mask_column=masks,
            **kw,
            **cache_dir,
        )
    if args.src is None:
        return None
    src = args.src if "://" in args.src else Path(args.src)  # a URL keeps its "//"
    if masks is not None:
        return cls.from_folder(src, masks=masks, **kw, **remote)
    return cls.from_folder(src, **kw, **remote)
