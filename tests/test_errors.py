"""gpucache's own errors share one base, GpucacheError, and stay the built-in types users catch."""

from __future__ import annotations

import gpucache
from gpucache import cli

#: The built-in type each public error has always been.
BUILTIN = {
    "BuildError": ValueError,
    "CacheFormatError": ValueError,
    "SharedMemoryError": RuntimeError,
    "SampleError": RuntimeError,
    "WorkerError": RuntimeError,
    "ObjectStoreError": OSError,  # what a failed read of a file has always raised
}


def test_every_public_exception_is_a_gpucache_error_and_still_its_builtin():
    errors = {
        name
        for name in gpucache.__all__
        if name != "__version__"
        and isinstance(getattr(gpucache, name), type)
        and issubclass(getattr(gpucache, name), BaseException)
    }
    assert errors == set(BUILTIN) | {"GpucacheError"}
    assert issubclass(gpucache.GpucacheError, Exception)
    for name, builtin in BUILTIN.items():
        err = getattr(gpucache, name)
        assert issubclass(err, gpucache.GpucacheError), name
        assert issubclass(err, builtin), name


def test_the_out_of_memory_error_is_one_too():
    from gpucache.store._oom import OutOfMemory

    assert issubclass(OutOfMemory, gpucache.GpucacheError) and issubclass(OutOfMemory, MemoryError)


def test_the_cli_reports_a_gpucache_error_without_a_traceback(monkeypatch, capsys, tmp_path):
    def fails(args):
        raise gpucache.WorkerError("a worker died (test)")

    monkeypatch.setattr(cli, "_info", fails)
    assert cli.main(["info", str(tmp_path / "x.gpucache")]) == 2
    assert "gpucache info: a worker died (test)" in capsys.readouterr().err
