"""What a run reports: the machine, the main table, and the PNG charts (matplotlib, ``[bench]``)."""

from __future__ import annotations

import datetime
import math
import os
import platform
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ._common import Config, Source
from ._contenders import CONTENDERS
from ._timing import Result

NO_CACHE_TOLERANCE = 0.1  # a contender that reads files shows "0" when measured within this of 0
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the tree holding this gpucache


def source_commit(root: Path = SOURCE_ROOT) -> str | None:
    """The git commit of the source tree ``root`` (by default the one gpucache is imported from),
    ``"<sha>-dirty"`` when its tracked files differ from it; None outside a checkout (an installed
    wheel: ``root`` has no ``.git`` of its own, whatever repository encloses it)."""
    if not (root / ".git").exists():  # a folder, or a file in a worktree
        return None

    def git(*args: str) -> str:
        run = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30
        )
        return run.stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        return f"{sha}-dirty" if git("status", "--porcelain", "--untracked-files=no") else sha
    except (OSError, subprocess.SubprocessError):  # no git installed, or not a repository
        return None


def machine_info() -> dict[str, Any]:
    import multiprocessing as mp

    import psutil
    import torch

    from .. import __version__
    from ..base._cores import usable_cores
    from ..decode._jpeg import jpeg_decoder_name

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions: dict[str, str | None] = {}
    for mod in ("torch", "torchvision", "torchcodec", "numpy", "PIL"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            versions[mod] = None
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": model,
        "cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpucache": __version__,
        "commit": source_commit(),
        "versions": versions,
        "jpeg_decoder": jpeg_decoder_name(),
        "default_start_method": mp.get_start_method(allow_none=True) or "default",
        "cuda": torch.cuda.is_available(),
        "load_average": [round(v, 2) for v in os.getloadavg()],  # at the start: 1, 5, 15 min
    }
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    if os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        info["shm_free_mb"] = round(st.f_bavail * st.f_frsize / 2**20)
    return info


def fmt(x: float | None, spec: str, dash: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return dash
    return format(x, spec).replace("-0.00", "0.00")  # no "negative zero" copies


def copies_cell(name: str, copies: float | None, *, short: bool = False) -> tuple[str, str | None]:
    """The copies-held text of a contender, and a note when the reading needs one.

    A contender that reads files holds no cache: it shows "0 (reads files)" when measured within
    NO_CACHE_TOLERANCE of 0, and otherwise the measured number, flagged, never clamped."""
    if copies is None:
        return "-", None
    if CONTENDERS[name].kind == "pil":
        if abs(copies) <= NO_CACHE_TOLERANCE:
            return ("reads files" if short else "0 (reads files)"), None
        return f"{fmt(copies, '.2f')}?", (
            f"{name} reads files and holds no cache, yet measured {copies:.2f} copies: its heaps "
            "differed between the two probes (readings in the JSON); try other --probe-mb sizes"
        )
    if copies < -0.05:
        return f"{fmt(copies, '.2f')}?", (
            f"{name}: negative copies held: the two probes' worker heaps differed by more than "
            "the data; try other --probe-mb sizes"
        )
    return fmt(copies, ".2f"), None


def format_table(results: list[Result]) -> str:
    base = next((r.summary().get("img_s") for r in results), None)
    head = (
        f"{'contender':<15} {'img/s (min-max)':>17} {'ratio':>6} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'1st batch s':>11} {'copies':>15} {'peak RSS MB':>11}"
    )
    lines, notes = [head, "-" * len(head)], []
    for r in results:
        s = r.summary()
        if "img_s" in s:
            rate = f"{s['img_s']:.0f} ({s['img_s_min']:.0f}-{s['img_s_max']:.0f})"
            ratio = f"{s['img_s'] / base:.2f}" if base else "-"
        else:
            rate, ratio = "-", "-"
        copies, note = copies_cell(r.name, s.get("copies"))
        lines.append(
            f"{r.name:<15} {rate:>17} {ratio:>6} {fmt(s.get('p50_ms'), '.0f'):>7} "
            f"{fmt(s.get('p99_ms'), '.0f'):>7} {fmt(r.first_batch_s, '.2f'):>11} "
            f"{copies:>15} {fmt(s.get('peak_rss_mb'), '.0f'):>11}"
        )
        notes += [note] if note else []
        if r.error:
            notes.append(f"{r.name} failed: {r.error}")
        elif r.memory and "error" in r.memory:
            notes.append(f"{r.name} memory probe failed: {r.memory['error']}")
    return "\n".join(lines + [f"  {n}" for n in notes])


def header(source: Source, cfg: Config, machine: dict[str, Any]) -> str:
    i = source.info
    return (
        f"{i['images']} images ({i['bytes'] / 2**20:,.1f} MiB, {i['classes']} classes) from "
        f"{i['src']}\npipeline {cfg.pipeline}{' + Normalize (float32)' if cfg.normalize else ''}, batch {cfg.batch_size}, {cfg.workers} workers, "
        f"{cfg.epochs} epochs after a warm-up; {machine['cpu']}, {machine['usable_cores']} "
        f"cores, torch {machine['versions']['torch']}, decoder {machine['jpeg_decoder']}, "
        f"commit {machine['commit'] or 'unknown'}"
    )


def _pyplot() -> ModuleType:
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("--plot needs matplotlib: pip install matplotlib") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plotted_copies(name: str, copies: float | None) -> float:
    """The bar or point for a copies reading: 0 where the table says "0 (reads files)"."""
    if copies is None:
        return np.nan
    return 0.0 if copies_cell(name, copies)[0].startswith(("0 (", "reads")) else copies


def plot_main(results: list[Result], path: Path, title: str) -> None:
    plt = _pyplot()
    from matplotlib.patches import Patch

    rows = [r for r in results if r.epochs]
    names = [r.name for r in rows][::-1]
    s = [r.summary() for r in rows][::-1]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.8), sharey=True)
    rate = [x["img_s"] for x in s]
    err = [[x["img_s"] - x["img_s_min"] for x in s], [x["img_s_max"] - x["img_s"] for x in s]]
    colors = ["#999999" if CONTENDERS[n].kind != "gpucache" else "#2a7ab0" for n in names]
    a1.barh(names, rate, xerr=err, color=colors, capsize=3, ecolor="#444444")
    top = max(x["img_s_max"] for x in s)
    for y, x in enumerate(s):
        a1.text(
            x["img_s_max"] + top * 0.01, y, f"{x['img_s']:.0f}", va="center", ha="left", fontsize=8
        )
    a1.set_xlabel("images/s (median over epochs; whiskers min-max)")
    a1.set_xlim(0, top * 1.15)
    copies = [_plotted_copies(n, x.get("copies")) for n, x in zip(names, s)]
    bars = np.nan_to_num(copies)
    a2.barh(names, bars, color=colors)
    for y, (n, v, x) in enumerate(zip(names, bars, s)):
        text = "n/a" if x.get("copies") is None else copies_cell(n, x["copies"])[0]
        a2.text(max(v, 0.0), y, f" {text}", va="center", ha="left", fontsize=8)
    a2.legend(
        handles=[
            Patch(color="#2a7ab0", label="gpucache"),
            Patch(color="#999999", label="DataLoader peers"),
        ],
        fontsize=8,
        loc="lower right",
    )
    a2.axvline(1.0, color="k", lw=0.8, ls="--")
    a2.set_xlabel("copies of the data held (parent + workers, PSS)")
    a2.set_xlim(min(0.0, bars.min() * 1.25), max(bars.max(), 1.0) * 1.35)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scaling(table: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in table.items():
        ws = [r["workers"] for r in rows]
        style = "-o" if CONTENDERS[name].kind == "gpucache" else "--s"
        label = f"{name} (reads files)" if CONTENDERS[name].kind == "pil" else name
        a1.plot(ws, [r.get("img_s") or np.nan for r in rows], style, label=label)
        a2.plot(ws, [_plotted_copies(name, r.get("copies")) for r in rows], style, label=label)
    a1.set_xlabel("workers")
    a1.set_ylabel("images/s (median)")
    a1.set_ylim(bottom=0)
    a2.set_xlabel("workers")
    a2.set_ylabel("copies held")
    a2.axhline(1.0, color="k", lw=0.8, ls=":")
    for a in (a1, a2):
        a.set_xticks(sorted({r["workers"] for rows in table.values() for r in rows}))
        a.grid(alpha=0.3)
    a1.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
