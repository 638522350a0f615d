"""gpucache's own errors share one base, GpucacheError, and stay the built-in types users catch."""

from __future__ import annotations

import ast
import pickle
import traceback
from pathlib import Path

import gpucache
from gpucache import cli

#: The built-in type each public error has always been.
BUILTIN = {
    "BuildError": ValueError,
    "CacheFormatError": ValueError,
    "SharedMemoryError": RuntimeError,
    "ShareError": RuntimeError,
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
    from gpucache._errors import OutOfMemory

    assert issubclass(OutOfMemory, gpucache.GpucacheError) and issubclass(OutOfMemory, MemoryError)


#: Exceptions a module raises and catches within the library; none reaches a user.
INTERNAL = {"SniffError", "ScaleRefused", "IntervalMismatch", "_Changed", "_DescriptorLost"}


def test_every_exception_class_lives_in_the_errors_module():
    """One home: an exception class defined anywhere else is one the library catches itself."""
    root = Path(gpucache.__file__).parent
    elsewhere = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception")))
                for b in node.bases
            ):
                if path.name != "_errors.py":
                    elsewhere[node.name] = str(path.relative_to(root))
    assert set(elsewhere) == INTERNAL, elsewhere


def test_public_errors_are_named_as_users_import_them():
    """A traceback says ``gpucache.BuildError``; the errors pickle (workers send them) by that
    name."""
    for name in BUILTIN | {"GpucacheError": Exception}:
        err = getattr(gpucache, name)
        assert err.__module__ == "gpucache" and err.__qualname__ == name
    text = "".join(traceback.format_exception_only(gpucache.SampleError("sample 3 (x.jpg)")))
    assert text.startswith("gpucache.SampleError: sample 3")
    back = pickle.loads(pickle.dumps(gpucache.WorkerError("worker 0 died")))
    assert type(back) is gpucache.WorkerError and str(back) == "worker 0 died"
    back = pickle.loads(pickle.dumps(gpucache.ObjectStoreError("no bucket", "s3://b")))
    assert type(back) is gpucache.ObjectStoreError and str(back) == "no bucket"


def test_the_cli_reports_a_gpucache_error_without_a_traceback(monkeypatch, capsys, tmp_path):
    def fails(args):
        raise gpucache.WorkerError("a worker died (test)")

    monkeypatch.setattr(cli, "_info", fails)
    assert cli.main(["info", str(tmp_path / "x.gpucache")]) == 2
    assert "gpucache info: a worker died (test)" in capsys.readouterr().err
