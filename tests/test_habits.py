"""The tree's habits, checked on the files themselves: the pre-commit hooks run what CI runs, the
package's loggers are named by module, and every benchmark script and result file is cited."""

from __future__ import annotations

import re
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _hooks() -> dict[str, dict]:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    return {h["id"]: h for repo in config["repos"] for h in repo["hooks"]} | {
        "": {"exclude": config.get("exclude")}
    }


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / name for name in out.decode().split("\0") if name]


def test_the_pre_commit_hooks_run_ci_s_lint_format_and_type_commands():
    hooks = _hooks()
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    ci_commands = {c.strip() for c in ci.split("&&")}
    for hook in ("ruff-check", "ruff-format", "mypy"):
        assert hooks[hook]["language"] == "system" and hooks[hook]["pass_filenames"] is False
        assert hooks[hook]["entry"] in ci_commands, (hook, hooks[hook]["entry"], ci_commands)
    # the versions the header names are the test extra's pins
    pins = dict(re.findall(r'"(ruff|mypy)==([\d.]+)"', (REPO / "pyproject.toml").read_text()))
    header = (REPO / ".pre-commit-config.yaml").read_text()
    assert pins and all(f"{tool}=={v}" in header for tool, v in pins.items()), pins


def test_the_file_hooks_pass_on_the_tree_and_catch_what_they_name(tmp_path):
    """The pygrep hooks' expressions applied as pre-commit applies them (each line, or the whole
    file with --multiline), and .ci/hygiene.py, on every tracked text file; then on bad files."""
    hooks = _hooks()
    exclude = re.compile(hooks[""]["exclude"])
    greps = {k: h for k, h in hooks.items() if h.get("language") == "pygrep"}
    assert set(greps) == {"trailing-whitespace", "end-of-file", "merge-conflict"}

    def found(hook: dict, data: bytes) -> bool:
        pattern = re.compile(hook["entry"].encode(), re.M)
        if "--multiline" in hook.get("args", []):
            return bool(pattern.search(data))
        return any(pattern.search(line) for line in data.splitlines(keepends=True))

    files = [p for p in _tracked() if not exclude.match(str(p.relative_to(REPO)))]
    texts = {p: p.read_bytes() for p in files if p.is_file()}
    texts = {p: b for p, b in texts.items() if b"\0" not in b}  # pre-commit's `types: [text]`
    for hook_id, hook in greps.items():
        bad = [str(p.relative_to(REPO)) for p, b in texts.items() if found(hook, b)]
        assert not bad, f"{hook_id}: {bad}"
    assert found(greps["trailing-whitespace"], b"a \nb\n")
    assert found(greps["end-of-file"], b"a") and found(greps["end-of-file"], b"a\n\n")
    assert not found(greps["end-of-file"], b"a\nb\n")
    assert found(greps["merge-conflict"], b"x\n<<<<<<< HEAD\n")

    sys.path.insert(0, str(REPO / ".ci"))
    try:
        import hygiene
    finally:
        sys.path.remove(str(REPO / ".ci"))
    suffixes = {"large-files": None, "check-yaml": (".yaml", ".yml"), "check-toml": (".toml",)}
    for hook_id, suffix in suffixes.items():
        kind = hooks[hook_id]["entry"].split()[-1]  # `.venv/bin/python .ci/hygiene.py KIND`
        names = [str(p) for p in files if p.is_file() and (suffix is None or p.suffix in suffix)]
        assert hygiene.main([kind, *names]) == 0, hook_id
    (tmp_path / "bad.yaml").write_text("a: [1, 2\n")
    (tmp_path / "bad.toml").write_text("a = \n")
    (tmp_path / "big.bin").write_bytes(b"\0" * (hygiene.MAX_BYTES + 1))
    assert hygiene.main(["yaml", str(tmp_path / "bad.yaml")]) == 1
    assert hygiene.main(["large", str(tmp_path / "big.bin")]) == 1
    if sys.version_info >= (3, 11):
        assert hygiene.main(["toml", str(tmp_path / "bad.toml")]) == 1


def test_every_logger_of_the_package_is_named_by_its_module():
    """``logging.getLogger(__name__)``: a user configures ``gpucache`` (or one module) by name."""
    calls = []
    for path in sorted((REPO / "gpucache").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            calls += [(path, n, arg) for arg in re.findall(r"getLogger\(([^)]*)\)", line)]
    assert calls, "no getLogger call found: the search is broken"
    other = [f"{p.relative_to(REPO)}:{n}: getLogger({a})" for p, n, a in calls if a != "__name__"]
    assert not other, other


# ------------------------------------------------------------------ benchmarks: indexed and cited
BENCH = REPO / "benchmarks"


def _braces(pattern: str) -> list[str]:
    """``a{,-b}.{json,md}`` -> ``a.json a.md a-b.json a-b.md`` (the shell's brace expansion)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [
        out
        for alt in m[1].split(",")
        for out in _braces(pattern[: m.start()] + alt + pattern[m.end() :])
    ]


def test_every_benchmark_script_is_in_the_benchmarks_readme():
    readme = (BENCH / "README.md").read_text()
    named = set(re.findall(r"`([\w/*.]+\.(?:py|c|sh))`", readme))
    scripts = sorted(p.relative_to(BENCH) for p in BENCH.rglob("*") if p.suffix in (".py", ".c"))
    missing = [
        str(s) for s in scripts if not any(fnmatch(str(s), n) or fnmatch(s.name, n) for n in named)
    ]
    assert scripts and not missing, f"benchmarks/README.md does not name {missing}"
    # where the photos come from: the PyTorch tutorial's photo set, named by its public URL
    assert re.search(r"https://download\.pytorch\.org/tutorial/\w+_data\.zip", readme)


def test_every_result_file_is_cited_by_a_page_or_a_script():
    """A file under benchmarks/results/ is named by a README, a manual page or a script, by its
    name, a brace pattern (``peers-photos{,-420q90}.{json,md,png}``), a glob (``quiet-*``) or
    the stem a script was told to write (``--out results/peers-photos``)."""
    texts = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *BENCH.rglob("*.md")]
    texts += [*BENCH.rglob("*.py"), *(REPO / "gpucache").rglob("*.py")]
    cited = set()
    for path in texts:
        if "results" in path.relative_to(REPO).parts[:2]:
            continue  # a result does not cite itself
        for ref in re.findall(r"results/([\w.{},*-]+)", path.read_text()):
            for name in _braces(ref.rstrip(".,")):
                cited |= {name, f"{name}.*"} if "." not in name else {name}
    results = sorted(p.name for p in (BENCH / "results").iterdir())
    uncited = [r for r in results if not any(fnmatch(r, c) for c in cited)]
    assert results and not uncited, f"cited nowhere (delete them, or cite them): {uncited}"


def test_a_result_records_the_commit_it_ran_on(tmp_path, monkeypatch):
    """benchmarks/_record.py's ``"run"``: the command, the date, the machine and this checkout's
    commit (``-dirty`` with uncommitted changes); ``gpucache bench``'s machine entry too."""
    import json
    import subprocess

    from benchmarks import _record
    from gpucache.bench._report import source_commit

    repo = tmp_path / "tree"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    try:
        subprocess.run([*git, "init", "-q"], check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git")
    (repo / "a.txt").write_text("1\n")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert source_commit(repo) == sha
    (repo / "a.txt").write_text("2\n")
    assert source_commit(repo) == f"{sha}-dirty"
    assert source_commit(tmp_path) is None  # no .git of its own: an installed wheel's case

    monkeypatch.setattr(_record, "REPO", repo)
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "x.py"), "--n", "2 3"])
    _record.write_json(tmp_path / "r.json", [{"n": 1}])
    got = json.loads((tmp_path / "r.json").read_text())
    assert got["rows"] == [{"n": 1}] and got["run"]["commit"] == f"{sha}-dirty"
    assert got["run"]["command"].endswith("x.py --n '2 3'") and got["run"]["date"]
    assert "cores" in got["run"]["machine"] and sha in _record.run_line()
    times, last = _record.timed(lambda: 7, 3)
    assert len(times) == 3 and last == 7
