"""Ready recipes built on gpucache's public API only."""
