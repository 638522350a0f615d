"""The peer run's outputs: OUT.json (everything), OUT.md (one table a pipeline), OUT.png."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def summary(res: dict) -> dict:
    rates = [e["img_s"] for e in res.get("epochs", [])]
    if not rates:
        return {}
    loads = [x[0] for x in res.get("load", [])]
    return {
        "img_s": statistics.median(rates),
        "min": min(rates),
        "max": max(rates),
        "epochs": len(rates),
        "load_1min": statistics.median(loads) if loads else None,
    }


def table(pipeline: str, results: dict) -> str:
    base = summary(results.get("pil", {})).get("img_s")
    lines = [
        f"| contender ({pipeline}) | img/s, median (min-max) | vs DataLoader+PIL | setup s | "
        "format MB | what |",
        "|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        s = summary(res)
        size = res.get("store_bytes") or res.get("format_bytes")
        if s:
            f = ",.0f" if s["img_s"] >= 100 else ".1f"
            rate = f"{s['img_s']:{f}} ({s['min']:{f}}-{s['max']:{f}})"
            ratio = f"{s['img_s'] / base:.2f}" if base else "-"
        else:
            rate, ratio = f"failed: {res.get('error', 'no epochs')}"[:160], "-"
        setup = f"{res['setup_s']:.1f}" if "setup_s" in res else "-"
        mb = f"{size / 2**20:,.1f}" if size else "-"
        lines.append(f"| `{name}` | {rate} | {ratio} | {setup} | {mb} | {res['what']} |")
    return "\n".join(lines)


def header(report: dict) -> str:
    m, d, a = report["machine"], report["data"], report["args"]
    loads = [
        x[0] for p in report["pipelines"].values() for r in p.values() for x in r.get("load", [])
    ]
    return (
        f"{d['images']} images ({d['bytes'] / 2**20:,.1f} MiB) from `{d['src']}`; batch "
        f"{a['batch_size']}, {a['workers']} workers/threads, {a['rounds']} timed epochs each "
        f"(one untimed warm-up epoch before each), interleaved. {m['cpu']}, "
        f"{m['usable_cores']} cores, {m['date']}; 1-min load average at the timed epochs: "
        f"median {statistics.median(loads) if loads else float('nan'):.1f} "
        f"(start {report['load_start'][0]}, end {report['load_end'][0]}). {report['note']}"
    )


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pipes = list(report["pipelines"])
    n = max(len(r) for r in report["pipelines"].values())
    fig, axes = plt.subplots(1, len(pipes), figsize=(6 * len(pipes), 0.4 * n + 1.8), squeeze=False)
    for ax, pipe in zip(axes[0], pipes):
        rows = [(k, summary(v)) for k, v in report["pipelines"][pipe].items()][::-1]
        names = [k for k, _ in rows]
        rate = [s.get("img_s", 0) for _, s in rows]
        err = [
            [s.get("img_s", 0) - s.get("min", 0) for _, s in rows],
            [s.get("max", 0) - s.get("img_s", 0) for _, s in rows],
        ]
        colors = ["#2a7ab0" if k.startswith("gpucache") else "#999999" for k in names]
        ax.barh(names, rate, xerr=err, color=colors, capsize=3, ecolor="#444444")
        top = max(rate + [1])
        for y, (_k, s) in enumerate(rows):
            ax.text(
                s.get("max", 0) + top * 0.01,
                y,
                f"{s['img_s']:.0f}" if s else "failed",
                va="center",
                fontsize=8,
            )
        ax.set_xlim(0, top * 1.2)
        ax.set_title(pipe)
        ax.set_xlabel("images/s (median of timed epochs; whiskers min-max)")
    d = report["data"]
    fig.suptitle(f"{d['images']} images from {d['src']}, {report['machine']['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, out: Path) -> str:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    text = (
        header(report)
        + "\n\n"
        + "\n\n".join(table(p, r) for p, r in report["pipelines"].items())
        + "\n"
    )
    out.with_suffix(".md").write_text(text)
    plot(report, out.with_suffix(".png"))
    return text
