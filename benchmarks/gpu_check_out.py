"""What ``gpu_check.py`` writes into its one output folder, so that one run on a device machine
diagnoses a failure without a second: the machine (driver, CUDA, ``nvidia-smi -q``), every
part's full traceback, and the stacks of every thread when a part hangs.

Files (fixed names, a handful, so that a device tool that brings back a few files brings them
all): ``gpu_check.json`` (results, full tracebacks included), ``gpu_check_system.txt``
(``nvidia-smi -q``, torch's build configuration), ``gpu_check_errors.txt`` (each failed part's
traceback), ``gpu_check_stacks.txt`` (all threads' stacks, dumped by a watchdog thread when a
part runs past its share of the budget by more than :data:`HANG_GRACE_S`, and again every as
long until it returns). The caller's log (``tee``) and a crash's stacks (``python3 -X
faulthandler`` under ``timeout -s ABRT``) complete it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import platform
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

#: Seconds past a part's share before its threads' stacks are dumped (the part runs on).
HANG_GRACE_S = 30.0
_SMI_QUERY = "driver_version,name,memory.total,compute_cap,pci.bus_id"


class Outputs:
    """The output folder and its files."""

    def __init__(self, folder: Path, json_path: Path | None = None):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.json = json_path or folder / "gpu_check.json"
        self.system = folder / "gpu_check_system.txt"
        self.errors = folder / "gpu_check_errors.txt"
        self.stacks = folder / "gpu_check_stacks.txt"
        for path in (self.errors, self.stacks):
            path.write_text("")  # this run's, not a previous run's
        if not faulthandler.is_enabled():  # run without -X faulthandler: crashes still dump
            faulthandler.enable(all_threads=True)

    def error(self, part: str, err: BaseException) -> str:
        """``err``'s whole traceback (its causes too), appended to the errors file."""
        text = "".join(traceback.format_exception(err))
        with self.errors.open("a") as f:
            f.write(f"===== {part}\n{text}\n")
        return text

    @contextlib.contextmanager
    def watch(self, part: str, seconds: float) -> Iterator[None]:
        """Dump every thread's stack into the stacks file if ``part`` is still running after
        ``seconds`` + :data:`HANG_GRACE_S`, and again as often, until it returns.

        The watchdog is a Python thread that reads the stacks under the GIL
        (``sys._current_frames``). faulthandler's own watchdog (``dump_traceback_later``) reads
        them without it and crashed the process (SIGSEGV) in about 3 runs of 10 when a thread
        started or ended during a dump. A part stuck holding the GIL is left to the crash dump:
        ``-X faulthandler`` under ``timeout -s ABRT`` prints every thread's stack then."""
        every = seconds + HANG_GRACE_S
        done = threading.Event()
        with self.stacks.open("a") as f:
            f.write(f"===== {part}: stacks dumped if it runs past {every:.0f} s\n")
            f.flush()

            def dump() -> None:
                while not done.wait(every):
                    f.write(all_stacks())
                    f.flush()

            dumper = threading.Thread(target=dump, name=f"gpu_check stacks: {part}", daemon=True)
            dumper.start()
            try:
                yield
            finally:
                done.set()
                dumper.join()


def all_stacks() -> str:
    """Every thread's stack, most recent call last, each headed by the thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"Thread {ident:#x} ({names.get(ident, '?')}), most recent call last:\n")
        out.extend(traceback.format_stack(frame))
    return "".join(out)


def _run(cmd: list[str], timeout: float = 30.0) -> tuple[int | None, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return None, f"{cmd[0]}: not found"
    except subprocess.TimeoutExpired:
        return None, f"{' '.join(cmd)}: no answer in {timeout:.0f} s"
    return p.returncode, (p.stdout + p.stderr).strip()


def system(out: Outputs) -> dict:
    """The machine as the check saw it (the real one, read before any emulation): Python, torch
    and its CUDA and cuDNN, the devices, the driver (``nvidia-smi``); ``nvidia-smi -q`` and
    torch's build configuration go whole into the system file."""
    rec: dict = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": None,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "NVIDIA_"))},
    }
    sections = []
    try:
        rec["cudnn"] = torch.backends.cudnn.version()
        rec["cuda_available"] = torch.cuda.is_available()
        rec["devices"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "capability": list(torch.cuda.get_device_capability(i)),
                "total_memory_mib": torch.cuda.get_device_properties(i).total_memory // 2**20,
            }
            for i in range(torch.cuda.device_count() if rec["cuda_available"] else 0)
        ]
    except Exception as err:  # noqa: BLE001 - a CUDA that fails here is the finding
        rec["cuda_error"] = "".join(traceback.format_exception(err))
    code, text = _run(["nvidia-smi", f"--query-gpu={_SMI_QUERY}", "--format=csv,noheader"])
    rec["nvidia_smi"] = text if code == 0 else f"exit {code}: {text}"
    if code == 0:
        rec["driver"] = text.split(",")[0].strip()
    code, text = _run(["nvidia-smi", "-q"])
    sections.append(("nvidia-smi -q", text))
    for line in text.splitlines():
        if line.strip().startswith("CUDA Version"):
            rec["driver_cuda"] = line.split(":", 1)[1].strip()
    try:
        sections.append(("torch.__config__.show()", torch.__config__.show()))
    except Exception as err:  # noqa: BLE001 - recorded
        sections.append(("torch.__config__.show()", repr(err)))
    out.system.write_text("".join(f"===== {name}\n{body}\n\n" for name, body in sections))
    return rec
