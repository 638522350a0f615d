"""Leaf helpers any layer may use; they import nothing else of gpucache's.

Distributed ranks (``_dist``), the usable cores (``_cores``), the ordered thread map
(``_threads``), files opened as this user's own (``_owned``), finalizers that stay in the process
that made them (``_fork``), the progress bar (``_progress``) and a plan's columns (``_plan``).
"""
