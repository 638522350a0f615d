"""One memory measurement, run in a fresh process: summed PSS after an epoch, workers alive.

python copies_child.py KIND BACKING CONTEXT WORKERS REPEAT SRC
    ->  prints "PSS_BYTES DATA_BYTES PSS_NOLIB_BYTES"
KIND: gpucache | listbytes (a list-of-bytes Dataset in torch's DataLoader, the usual home-made cache)
BACKING: memory | file | memory-view (gpucache only; memory-view: an in-memory store of which a
view, cache[0], is kept from before the loader starts, which keeps the in-memory copy alive
beside the shared one under spawn/forkserver: the harness's check that it sees a second copy).
Before the reading, this process reads one byte of every page of the store's data, so that every
resident page of it is mapped somewhere and counted: PSS leaves out the pages of a shared-memory
or page-cache file that no process maps, which a decoder that read only part of a sample (a crop)
would never touch. The same SRC images are repeated REPEAT times, so two runs
differing only in REPEAT differ only in data bytes: their PSS difference / data difference is the
number of copies held, with build-time and per-worker overheads cancelled.
PSS_NOLIB_BYTES is the same sum without the mappings of shared libraries and the interpreter: their
pages never scale with the data, but their PSS share moves whenever an unrelated process on the
machine maps or unmaps the same libraries (another test run importing torch), by tens of MB.
"""

import gc
import os
import signal
import sys
import tempfile
import warnings

import psutil
import torch
from torch.utils.data import Dataset


class ListOfBytes(Dataset):
    """The usual home-made RAM cache: a Python list of bytes objects, decoded on access."""

    def __init__(self, paths):
        self.items = [open(p, "rb").read() for p in paths]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        from torchvision.io import decode_jpeg

        warnings.simplefilter("ignore")
        return decode_jpeg(torch.frombuffer(self.items[i], dtype=torch.uint8)).shape[1]


def main(kind, backing, context, workers, repeat, src):
    from gpucache.testing._memory import tree_pss

    workers, repeat = int(workers), int(repeat)
    files = sorted(
        os.path.join(r, f) for r, _, fs in os.walk(src) for f in fs if f.endswith(".jpg")
    )
    paths = files * repeat
    if kind == "gpucache":
        from gpucache import GpuCachedLoader, JpegCache

        cache = JpegCache.from_files(paths, progress=False)
        kept = cache[0] if backing == "memory-view" else None  # noqa: F841 - held on purpose
        if backing == "file":
            tmp = tempfile.TemporaryDirectory(prefix="gpucache-copies-")  # removed on return
            cache = JpegCache.open(cache.save(os.path.join(tmp.name, "s.gpucache")))
            gc.collect()
        loader = GpuCachedLoader(
            cache, batch_size=16, num_workers=workers, device="cpu", multiprocessing_context=context
        )
        n = sum(len(labels) for _, labels in loader)
        data_bytes = cache.nbytes
        int(cache._data[::4096].sum())  # every page of the data mapped, so counted once
    else:
        from torch.utils.data import DataLoader

        ds = ListOfBytes(paths)
        loader = DataLoader(
            ds,
            batch_size=16,
            num_workers=workers,
            persistent_workers=workers > 0,
            multiprocessing_context=context if workers else None,
        )
        n = sum(len(b) for b in loader)
        data_bytes = sum(len(b) for b in ds.items)
    assert n == len(paths), (n, len(paths))
    gc.collect()
    print(tree_pss(), data_bytes, tree_pss(without_libraries=True), flush=True)
    # measured: the workers (and a forkserver) are killed rather than shut down in order
    # (seconds of torch's teardown in each, which nothing here checks), and the interpreter
    # leaves at once, its temporary store removed first
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a DataLoader's: a killed worker fails
    children = psutil.Process().children(recursive=True)
    for child in children:
        child.kill()
    psutil.wait_procs(children, timeout=30)
    if kind == "gpucache" and backing == "file":
        cache.close()
        tmp.cleanup()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:7])
