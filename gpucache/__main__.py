"""``python -m gpucache``: the command line (the ``gpucache`` script's entry point)."""

from gpucache.cli import main

raise SystemExit(main())
