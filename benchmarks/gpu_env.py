"""The device machine as the device check will see it, printed before anything imports gpucache.

    python3 benchmarks/gpu_env.py          # first line of the one-call device command

``nvidia-smi`` (its default table), Python, the installed versions of torch, torchvision,
TorchCodec, DALI, nvImageCodec, pytest and pytest-timeout (from the installed distributions, so
a package that fails to import still shows), torch's CUDA and cuDNN, and
``torch.cuda.is_available()`` with the devices, all to stdout: when the check itself fails to
start (an import error, a CUDA that does not initialise), this is what says why. It never
imports gpucache (it says so on its last line) and always exits 0: it reports, the check judges.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata

#: The distributions printed, by what they are (the first one installed of each tuple).
DISTRIBUTIONS = {
    "torch": ("torch",),
    "torchvision": ("torchvision",),
    "torchcodec": ("torchcodec",),
    "dali": ("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110"),
    "nvimgcodec": ("nvidia-nvimgcodec-cu13", "nvidia-nvimgcodec-cu12", "nvidia-nvimgcodec-cu11"),
    "numpy": ("numpy",),
    "pillow": ("pillow",),
    "pytest": ("pytest",),
    "pytest-timeout": ("pytest-timeout",),
}
SMI_TIMEOUT_S = 10.0


def installed(*names: str) -> str | None:
    """``name==version`` of the first of ``names`` installed, else None."""
    for name in names:
        try:
            return f"{name}=={metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def smi() -> str:
    try:
        p = subprocess.run(
            ["nvidia-smi"], capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        return "nvidia-smi: not found"
    except subprocess.TimeoutExpired:
        return f"nvidia-smi: no answer in {SMI_TIMEOUT_S:.0f} s"
    return (p.stdout + p.stderr).rstrip() + (
        "" if p.returncode == 0 else f"\n(exit {p.returncode})"
    )


def main() -> int:
    print("===== nvidia-smi", flush=True)
    print(smi(), flush=True)
    print("===== versions")
    print(f"python {sys.version.split()[0]} ({sys.executable}), {platform.platform()}")
    for what, names in DISTRIBUTIONS.items():
        print(f"{what}: {installed(*names) or 'not installed'}")
    if installed("pytest-timeout") is None:
        print(
            "pytest-timeout is MISSING: `-o timeout=40` does nothing and a hung GPU test is "
            "ended only by the command's outer timeout (pip install pytest-timeout)"
        )
    print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}", flush=True)
    try:
        import torch

        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
        print(f"cuDNN {torch.backends.cudnn.version()}")
        available = torch.cuda.is_available()
        print(f"torch.cuda.is_available(): {available}", flush=True)
        for i in range(torch.cuda.device_count() if available else 0):
            p = torch.cuda.get_device_properties(i)
            print(
                f"cuda:{i}: {p.name}, capability {p.major}.{p.minor}, "
                f"{p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs"
            )
    except Exception as err:  # noqa: BLE001 - printed: it is the finding
        print(f"torch failed: {type(err).__name__}: {err}")
    print(f"gpucache imported: {'gpucache' in sys.modules}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
