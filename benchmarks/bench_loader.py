#!/usr/bin/env python
"""GpuCachedLoader against DataLoader peers: the same as ``gpucache bench`` (see README.md here).

python benchmarks/bench_loader.py --synthetic 2000 --json out.json --plot out.png
"""

import sys
from pathlib import Path

try:
    import gpucache  # noqa: F401  (installed)
except ImportError:  # run from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpucache.bench import main

if __name__ == "__main__":
    sys.exit(main())
