"""The public surface is exactly gpucache.__all__: every name resolves and is documented."""

import inspect
import re
from pathlib import Path

import numpy as np

import gpucache
from gpucache import JpegCache
from gpucache.testing import make_jpeg_bytes

ERRORS = {
    "GpucacheError",
    "BuildError",
    "CacheFormatError",
    "ObjectStoreError",
    "SharedMemoryError",
    "SampleError",
    "WorkerError",
    "ShareError",
}
MODULES = {"transforms", "testing"}


def test_every_public_name_resolves_and_has_a_docstring():
    assert ERRORS | MODULES <= set(gpucache.__all__)
    for module in (gpucache, gpucache.transforms):
        for name in module.__all__:
            obj = getattr(module, name)  # AttributeError names what is missing
            where = f"{module.__name__}.{name}"
            if name == "__version__":
                assert isinstance(obj, str) and re.fullmatch(r"\d+\.\d+(\.\d+)?\S*", obj), obj
                continue
            if name in MODULES:
                assert inspect.ismodule(obj) and obj.__name__ == where, where
            elif name in ERRORS:  # every public error is a GpucacheError, caught as one
                assert inspect.isclass(obj) and issubclass(obj, gpucache.GpucacheError), where
            else:  # a class or a function: something a user calls
                assert not (inspect.isclass(obj) and issubclass(obj, BaseException)), (
                    f"{where} is an exception missing from ERRORS"
                )
                assert (inspect.isclass(obj) or inspect.isfunction(obj)) and callable(obj), where
                assert obj.__module__.startswith("gpucache"), where  # not a re-export of torch's
            assert inspect.getdoc(obj), f"{where} has no docstring"


def test_every_public_name_is_in_the_api_reference():
    """``docs/reference/api.md`` renders each name of ``gpucache.__all__`` (``::: gpucache.X``);
    ``::: gpucache.transforms`` renders that module's ``__all__``."""
    api = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "api.md").read_text()
    shown = set(re.findall(r"^::: gpucache\.(\w+)\s*$", api, flags=re.M))
    missing = set(gpucache.__all__) - {"__version__"} - shown
    assert not missing, f"public names missing from docs/reference/api.md: {sorted(missing)}"
    assert not shown - set(gpucache.__all__), "the reference shows names that are not public"


def test_build_sources_are_public_and_build_a_store(tmp_path):
    assert {"BytesSource", "FileObjSource", "FileRangeSource"} <= set(gpucache.__all__)
    jpegs = [make_jpeg_bytes(24, 16, seed=i) for i in range(3)]
    blob = tmp_path / "packed.bin"
    blob.write_bytes(b"".join(jpegs))
    with open(tmp_path / "one.jpg", "wb+") as f:
        f.write(jpegs[1])
        f.seek(0)
        cache = JpegCache.from_files(
            [
                gpucache.BytesSource("a.jpg", jpegs[0]),
                gpucache.FileObjSource("b.jpg", f),
                gpucache.FileRangeSource(
                    "c.jpg", blob, len(jpegs[0]) + len(jpegs[1]), len(jpegs[2])
                ),
            ],
            progress=False,
        )
    assert list(cache.paths) == ["a.jpg", "b.jpg", "c.jpg"]
    for i, data in enumerate(jpegs):
        assert np.array_equal(cache[i], np.frombuffer(data, np.uint8))
