"""build: see gpucache/__init__.py for the public surface."""
