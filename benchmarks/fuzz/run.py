"""Fuzz gpucache's compiled decoder (gpucache/_jpeg_regions.c) under AddressSanitizer + UBSan.

    python benchmarks/fuzz/run.py --minutes 30          # the long run
    python benchmarks/fuzz/run.py --seconds 5 --out DIR # a smoke run (tests/test_fuzz_smoke.py)

It compiles _jpeg_regions.c with ``-fsanitize=address,undefined -fno-sanitize-recover=all`` into
``<out>/build`` (the installed extension is untouched), and runs the fuzz loop in a child process
with the ASan runtime preloaded (``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``: a sanitized
library loaded by ctypes into an uninstrumented python needs it; leak detection is off because
python itself never frees some memory). Seeds are real JPEGs (photos from ../shared/data when
present, and generated ones: 4:4:4, 4:2:2, 4:2:0, gray, progressive, big EXIF), each also
transcoded with restart markers. Each iteration mutates one seed (bit flips, truncation, marker
insertion and removal, odd DRI values, SOF dimensions, sampling factors, component counts, length
fields) and runs it through

* the region decoder (``gc_decode_region``) at scales 1, 1/2, 1/4, 1/8: random boxes, each compared
  with the same box of the full decode, whenever both succeed;
* the restart-marker transcoder (``gc_transcode_restart``) and, on its output, the segment decoder
  (``gc_decode_segments``), compared with the full decode of the transcoded JPEG;
* the segment decoder on the mutated input itself (mutated restart-marker JPEGs, any interval).

A mutated input the library would refuse before any decoder sees it (a frame header over the
default ``max_pixels``; scans that cost more than the library allows: more than ``MAX_SCANS``, a
scan that codes again what an earlier one coded, or more decoding work than the budget of
``WORK_PER_PIXEL`` samples a pixel of ``max_pixels``: ``store._limits.bytes_refused``, the check
before every decode) is counted as ``refused`` and not run: a 1.7 KB JPEG claiming 35830 x 58024
would have the transcoder allocate 12 GB and be killed for memory, without a report.

With ``--inputs`` the child runs ``inputs.py`` instead: the library's own input paths through the
public API, mask PNGs built into stores and decoded by a loader, node-share records that lie,
listings whose names collide once their common folder is stripped (see that file); each input
ends in a named outcome (counted in the summary's ``outcomes``) or is a finding; the compiled
decoder the library calls there is the sanitized build. Its inputs are kept as
``crash-N.json`` (replay: ``inputs.py LIB --replay FILE``).

A sanitizer report kills the child; the input it was running is saved as ``<out>/crash-N.jpg`` with
the report in ``crash-N.txt``, and a fresh child goes on. The summary (iterations, calls, crashes,
pixel mismatches, their inputs) is printed as JSON and written to ``<out>/summary.json``. Exit
status 0 means no report and no mismatch. Needs gcc, libjpeg-turbo headers, numpy and Pillow; no
torch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks._record
from benchmarks._record import write_json  # noqa: E402

SRC = HERE.parents[1] / "gpucache" / "_jpeg_regions.c"
FLAGS = [
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-g",
    "-O1",
    "-shared",
    "-fPIC",
]


def asan_runtime() -> str | None:
    """Path of gcc's shared ASan runtime, or None (no gcc, or no libasan)."""
    try:
        out = subprocess.run(
            ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out if os.path.isabs(out) and os.path.exists(out) else None


def build(out: Path) -> Path:
    """The sanitized shared library, compiled into ``out/build``."""
    lib = out / "build" / "_jpeg_regions_asan.so"
    lib.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", *FLAGS, "-o", str(lib), str(SRC), "-ljpeg"], check=True)
    return lib


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=0.0)
    ap.add_argument("--seconds", type=float, default=0.0)
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(tempfile.gettempdir()) / "gpucache-fuzz",
        help="build dir, crash inputs and summary.json (default: %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--inputs",
        action="store_true",
        help="fuzz the mask PNG and node-share paths (inputs.py) instead of the decoder",
    )
    ap.add_argument(
        "--photos", type=Path, default=HERE.parents[2] / "shared" / "data" / "hymenoptera"
    )
    args = ap.parse_args()
    budget = args.minutes * 60 + args.seconds or 10.0
    runtime = asan_runtime()
    if runtime is None:
        print(
            "fuzz: gcc's ASan runtime (libasan.so) is missing: apt-get install gcc", file=sys.stderr
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    lib = build(args.out)
    env = {
        **os.environ,
        "LD_PRELOAD": runtime,
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }
    deadline = time.monotonic() + budget
    if args.inputs:
        return _inputs(args, lib, env, budget)
    total = {
        "iterations": 0,
        "refused": 0,
        "calls": 0,
        "mismatches": [],
        "crashes": [],
        "errors": 0,
        "warned": 0,
        "warned_mismatches": 0,
        "harness_errors": [],
        "seconds": budget,
        "children": 0,
    }
    seed = args.seed
    while time.monotonic() < deadline:
        left = deadline - time.monotonic()
        cmd = [
            sys.executable,
            str(HERE / "loop.py"),
            str(lib),
            str(args.out),
            str(seed),
            f"{left:.1f}",
            str(args.photos),
        ]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        total["children"] += 1
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if lines:
            part = json.loads(lines[-1])
            for key in ("iterations", "refused", "calls", "errors", "warned", "warned_mismatches"):
                total[key] += part[key]
            total["mismatches"] += part["mismatches"]
        sanitizer = "Sanitizer" in r.stderr or "runtime error:" in r.stderr
        if r.returncode != 0 and not sanitizer and "Traceback" in r.stderr:
            total["harness_errors"].append(r.stderr.strip().splitlines()[-1])  # a bug here
        elif r.returncode != 0:  # a sanitizer report (or another crash): keep the input
            n = len(total["crashes"])
            current = args.out / "current.jpg"
            crash = args.out / f"crash-{n}.jpg"
            if current.exists():
                current.replace(crash)
            (args.out / f"crash-{n}.txt").write_text(r.stderr[-20000:])
            total["crashes"].append(
                {
                    "input": str(crash),
                    "rc": r.returncode,
                    "report": r.stderr.strip().splitlines()[-1:],
                }
            )
            total["iterations"] += 1
        seed += 1
    write_json(args.out / "summary.json", total)
    print(json.dumps(total, indent=1))
    return 1 if total["crashes"] or total["mismatches"] or total["harness_errors"] else 0


def _inputs(args: argparse.Namespace, lib: Path, env: dict, budget: float) -> int:
    """``--inputs``: inputs.py in fresh children until the time is up; a sanitizer report (or
    any other crash) keeps the child's current input as crash-N.json with its report."""
    deadline = time.monotonic() + budget
    total: dict = {"iterations": 0, "outcomes": {}, "findings": [], "crashes": [], "children": 0}
    total["harness_errors"] = []
    seed = args.seed
    # torch and torchvision throw C++ exceptions on bad input; ASan's __cxa_throw interceptor
    # finds the real one only if libstdc++ is loaded with it (else a CHECK failure, no finding)
    cxx = subprocess.run(
        ["gcc", "-print-file-name=libstdc++.so.6"], capture_output=True, text=True
    ).stdout.strip()
    preload = env["LD_PRELOAD"] + (f" {cxx}" if os.path.isabs(cxx) and os.path.exists(cxx) else "")
    env = {**env, "PYTHONPATH": str(HERE.parents[1]), "LD_PRELOAD": preload}
    while time.monotonic() < deadline:
        left = deadline - time.monotonic()
        cmd = [sys.executable, str(HERE / "inputs.py"), str(lib), str(args.out), str(seed)]
        r = subprocess.run([*cmd, f"{left:.1f}"], env=env, capture_output=True, text=True)
        total["children"] += 1
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if lines:
            part = json.loads(lines[-1])
            total["iterations"] += part["iterations"]
            total["findings"] += part["findings"]
            for k, v in part["outcomes"].items():
                total["outcomes"][k] = total["outcomes"].get(k, 0) + v
        sanitizer = "Sanitizer" in r.stderr or "runtime error:" in r.stderr
        if r.returncode != 0 and not sanitizer and "Traceback" in r.stderr:
            total["harness_errors"].append(r.stderr.strip().splitlines()[-1])
            current = args.out / "current.json"
            if current.exists():  # the input the library raised on, for a replay
                current.replace(args.out / f"error-{len(total['harness_errors']) - 1}.json")
        elif r.returncode != 0:
            n = len(total["crashes"])
            current, crash = args.out / "current.json", args.out / f"crash-{n}.json"
            if current.exists():
                current.replace(crash)
            (args.out / f"crash-{n}.txt").write_text(r.stderr[-20000:])
            total["crashes"].append(
                {
                    "input": str(crash),
                    "rc": r.returncode,
                    "report": r.stderr.strip().splitlines()[-1:],
                }
            )
        seed += 1
    total["seconds"] = budget
    total["outcomes"] = dict(sorted(total["outcomes"].items(), key=lambda kv: -kv[1]))
    write_json(args.out / "summary.json", total)
    print(json.dumps(total, indent=1))
    return 1 if total["crashes"] or total["findings"] or total["harness_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
