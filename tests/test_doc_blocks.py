"""Every ```python block of README.md and the manual (docs/**/*.md) runs as written.

The blocks run in a folder laid out as the manual names its data: ``imagenet/train`` (an
ImageFolder), ``train.gpucache`` (a saved store), ``shards/train-00000{0,1}.tar`` (WebDataset),
``lists/train.csv`` and ``beans`` (a Hugging Face ``save_to_disk`` folder, made when ``datasets``
is installed), small photos made here; the same under ``s3://my-bucket/`` on an S3 server on
127.0.0.1 (moto's, when installed), whose endpoint and credentials every block gets from the
standard environment variables, as a user's would. Each block runs as a script (``__name__ == "__main__"``,
``sys.argv[1:] == ["imagenet/train"]``, its own globals: a block stands alone), all in one child
process, one after another. A comment line right before a block's fence says how it runs instead:

- ``<!-- needs: torchrun -->``: under ``torchrun --standalone --nproc_per_node=2`` on the CPU (gloo);
- ``<!-- needs: gpu -->``: only where CUDA is present;
- ``<!-- not run: signature -->``: a signature listing, not a program.

A ```bash block whose every command is a ``gpucache`` command runs too, line by line, in the same
folder; other shell blocks (pip, torchrun, mkdocs) are not run here.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from gpucache import JpegCache
from gpucache.testing import make_jpeg_bytes, make_jpeg_folder

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL = re.compile(r"^```bash\n(?P<code>.*?)^```", re.S | re.M)
BLOCK = re.compile(r"(?:^<!-- (?P<mark>[^>]*?) -->\n)?^```python\n(?P<code>.*?)^```", re.S | re.M)

_DRIVER = r"""
import json, runpy, sys, traceback
blocks = json.loads(open(sys.argv[1]).read())
for i, (name, path) in enumerate(blocks):
    sys.argv = [path, "imagenet/train"]
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException:
        print(f"BLOCK FAILED: {name}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available():
        if dist.is_initialized():
            dist.destroy_process_group()  # as the block's exit would
        # a destroyed group's keys stay in the job's store: the next block's group gets new ones
        dist.distributed_c10d._world.group_count = 1000 * (i + 1)
    print(f"ran {name}", flush=True)
"""


def blocks() -> list[tuple[str, str, str]]:
    """(page, mark, code) of every python block, in page order; ``page`` names the line."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))
            out.append((f"{page.relative_to(ROOT)}:{line}", m.group("mark") or "", m.group("code")))
    return out


_S3: dict[str, str] = {}  # the S3 server's environment while the module's blocks run


def _serve_s3(base: Path):
    """An S3 server on 127.0.0.1 (moto's) holding the data the object-storage page names, under
    s3://my-bucket/: the ImageFolder tree, two shards and the CSV list; None without moto."""
    try:
        import s3fs

        from tests.support.s3server import S3Server
    except ImportError:
        return None
    server = S3Server()
    server.start()
    _S3.update(server.env())
    saved = {k: os.environ.get(k) for k in _S3}
    os.environ.update(_S3)
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        if not fs.exists("my-bucket"):  # moto keeps buckets per process, past a server
            fs.mkdir("my-bucket")
        files = {
            f"my-bucket/{p.relative_to(base).as_posix()}": p.read_bytes()
            for p in sorted((base / "imagenet" / "train").rglob("*.jpg"))
        }
        shard = (base / "shards" / "train-000000.tar").read_bytes()
        files["my-bucket/shards/train-000000.tar"] = files["my-bucket/shards/train-000001.tar"] = (
            shard
        )
        files["my-bucket/lists/train.csv"] = "".join(
            f"s3://{k},{k.split('/')[-2]}\n" for k in files if k.endswith(".jpg")
        ).encode()
        fs.pipe(files)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return server


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The folder the blocks run in, with the data the manual names (and an S3 server holding
    the object-storage page's, when moto is installed)."""
    base = tmp_path_factory.mktemp("project")
    root = make_jpeg_folder(base / "imagenet" / "train", 12, classes=("ants", "bees"), seed=5)
    JpegCache.from_folder(root, progress=False).save(base / "train.gpucache")
    (base / "shards").mkdir()
    with tarfile.open(base / "shards" / "train-000000.tar", "w") as tar:
        for k in range(6):
            for ext, data in (
                ("jpg", make_jpeg_bytes(48, 32, seed=k)),
                ("cls", str(k % 2).encode()),
            ):
                info = tarfile.TarInfo(f"{k:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    second = base / "shards" / "train-000001.tar"  # the manual's shard patterns name two
    second.write_bytes((base / "shards" / "train-000000.tar").read_bytes())
    (base / "lists").mkdir()
    rows = [
        f"../imagenet/train/{p.parent.name}/{p.name},{p.parent.name}"
        for p in sorted(root.glob("*/*.jpg"))
    ]
    (base / "lists" / "train.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    try:
        import datasets
    except ImportError:
        pass
    else:
        files = sorted(root.glob("*/*.jpg"))
        ds = datasets.Dataset.from_dict(
            {
                "image": [str(p) for p in files],
                "label": [int(p.parent.name == "bees") for p in files],
            },
            features=datasets.Features(
                {"image": datasets.Image(), "label": datasets.ClassLabel(names=["ants", "bees"])}
            ),
        )
        datasets.DatasetDict({"train": ds}).save_to_disk(str(base / "beans"))
    server = _serve_s3(base)
    try:
        yield base
    finally:
        if server is not None:
            server.stop()
        _S3.clear()


def _runnable(code: str) -> bool:
    """False for a block that needs the S3 server when there is none (no moto installed)."""
    return bool(_S3) or "s3://" not in code


def _env(base: Path) -> dict:
    env = {**os.environ, **_S3, "TMPDIR": str(base), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    return env


def _write(base: Path, i: int, code: str) -> str:
    path = base / "blocks" / f"block{i:02d}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(code)
    return str(path)


def _driver(base: Path, name: str, todo: list[tuple[str, str]]) -> list[str]:
    """The driver script and its argument: ``todo``'s (page:line, file) blocks, in one process."""
    (base / f"{name}.json").write_text(json.dumps(todo))
    (base / f"{name}.py").write_text(_DRIVER)
    return [str(base / f"{name}.py"), str(base / f"{name}.json")]


def test_every_block_is_runnable_or_marked():
    found = blocks()
    assert len(found) >= 10
    for where, mark, code in found:
        assert mark in ("", "needs: torchrun", "needs: gpu", "not run: signature"), (where, mark)
        if mark == "not run: signature":
            continue
        tree = ast.parse(code, where)  # a syntax error fails here, whatever the mark
        statements = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):  # `...` as a statement ("your step here") is fine
            assert not (
                isinstance(node, ast.Constant)
                and node.value is Ellipsis
                and id(node) not in statements
            ), (
                f"{where}: `...` stands in for a value (line {node.lineno}): it does not run "
                "as written"
            )


def test_python_blocks_run_as_written(project):
    plain = [
        (where, code)
        for where, mark, code in blocks()
        if mark == "" or mark == "needs: gpu" and torch.cuda.is_available()
    ]
    todo = [(where, _write(project, i, code)) for i, (where, code) in enumerate(plain)]
    if not (project / "beans").exists():
        todo = [(w, p) for w, p in todo if 'load_from_disk("beans")' not in Path(p).read_text()]
    todo = [(w, p) for w, p in todo if _runnable(Path(p).read_text())]
    run = _drive(project, [sys.executable, *_driver(project, "plain", todo)])
    assert run.stdout.count("ran ") == len(todo), run.stdout


def _drive(project: Path, argv: list[str], **env: str) -> subprocess.CompletedProcess:
    """A driver's run in ``project`` with the manual's environment (and ``env``), which must
    succeed."""
    run = subprocess.run(
        argv,
        cwd=project,
        env={**_env(project), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-6000:]
    return run


def test_torchrun_blocks_run_on_two_cpu_ranks(project):
    launched = [(where, code) for where, mark, code in blocks() if mark == "needs: torchrun"]
    assert launched, "the manual shows torchrun code"
    todo = [(where, _write(project, 50 + i, code)) for i, (where, code) in enumerate(launched)]
    run = _drive(  # one job runs them all, one after another, as the plain blocks run
        project,
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            *_driver(project, "torchrun", todo),
        ],
        CUDA_VISIBLE_DEVICES="",
    )
    for where, _ in todo:  # every block ran to its end on both ranks
        assert run.stdout.count(f"ran {where}\n") == 2, (where, run.stdout)


def shell_blocks() -> list[tuple[str, list[str]]]:
    """(page:line, commands) of every bash block made of gpucache commands only."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in SHELL.finditer(text):
            lines = [ln.split("  #")[0].strip() for ln in m.group("code").splitlines()]
            lines = [ln for ln in lines if ln and not ln.startswith("#")]
            if lines and all(ln.startswith("gpucache ") for ln in lines):
                where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start('code'))}"
                out.append((where, lines))
    return out


_CLI_DRIVER = r"""
import json, sys, traceback
from gpucache.cli import main  # what the `gpucache` script runs
for where, line, argv in json.loads(open(sys.argv[1]).read()):
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        print(traceback.format_exc(), file=sys.stderr)
        code = 1
    if code not in (0, None):
        print(f"LINE FAILED: {where}: {line} (exit {code})", file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"ran {where}: {line}", flush=True)
"""


def _words(line: str, cwd: Path) -> list[str]:
    """The arguments bash gives the command of ``line`` (quotes, braces, globs expanded)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    assert not [t for t in lexer if set(t) <= set("();<>|&")], f"not one command: {line}"
    words = line.split(None, 1)[1] if " " in line else ""
    out = subprocess.run(  # bash alone, no interpreter: printf receives what gpucache would
        ["bash", "-c", f"printf '%s\\0' {words}"], cwd=cwd, capture_output=True, check=True
    ).stdout.decode()
    return out.split("\0")[:-1]


def test_gpucache_shell_blocks_run_as_written(project):
    """Each line's words as bash makes them, run through the `gpucache` script's ``main``; all
    lines in one process, one after another, as the python blocks run."""
    found = shell_blocks()
    assert found, "the manual shows gpucache commands in shell blocks"
    todo = []
    for where, lines in found:
        for line in lines:
            if "--hf " in line and not (project / "beans").exists():
                continue  # needs the datasets package to make the folder
            if not _runnable(line):
                continue  # needs the S3 server (moto)
            todo.append((where, line, _words(line, project)))
    (project / "cli.json").write_text(json.dumps(todo))
    (project / "cli.py").write_text(_CLI_DRIVER)
    run = _drive(project, [sys.executable, str(project / "cli.py"), str(project / "cli.json")])
    assert run.stdout.count("ran ") == len(todo), run.stdout
