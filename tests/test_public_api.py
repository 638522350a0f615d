"""The public surface is exactly gpucache.__all__: every name resolves and is documented."""

import inspect

import numpy as np

import gpucache
from gpucache import JpegCache
from gpucache.testing import make_jpeg_bytes


def test_every_public_name_resolves_and_has_a_docstring():
    for module in (gpucache, gpucache.transforms):
        for name in module.__all__:
            obj = getattr(module, name)  # AttributeError names what is missing
            if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj):
                assert inspect.getdoc(obj), f"{module.__name__}.{name} has no docstring"


def test_build_sources_are_public_and_build_a_store(tmp_path):
    assert {"BytesSource", "FileObjSource", "FileRangeSource"} <= set(gpucache.__all__)
    jpegs = [make_jpeg_bytes(24, 16, seed=i) for i in range(3)]
    blob = tmp_path / "packed.bin"
    blob.write_bytes(b"".join(jpegs))
    with open(tmp_path / "one.jpg", "wb+") as f:
        f.write(jpegs[1])
        f.seek(0)
        cache = JpegCache.from_files(
            [gpucache.BytesSource("a.jpg", jpegs[0]), gpucache.FileObjSource("b.jpg", f),
             gpucache.FileRangeSource("c.jpg", blob, len(jpegs[0]) + len(jpegs[1]), len(jpegs[2]))],
            progress=False)
    assert list(cache.paths) == ["a.jpg", "b.jpg", "c.jpg"]
    for i, data in enumerate(jpegs):
        assert np.array_equal(cache[i], np.frombuffer(data, np.uint8))
