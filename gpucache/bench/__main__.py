"""``python -m gpucache.bench``: the same as ``gpucache bench`` (and the memory probes' entry)."""

import sys

from . import main

sys.exit(main())
