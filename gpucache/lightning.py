"""``LoaderStatsCallback``: where the loader's time goes, in a Lightning trainer's loggers.

    from gpucache.lightning import LoaderStatsCallback
    trainer = lightning.Trainer(callbacks=[LoaderStatsCallback()], logger=CSVLogger("logs"))

At the end of every training epoch (and every ``every_n_steps`` steps when given) it logs the
numbers of ``loader.stats.as_dict()`` under ``gpucache/``: ``data_wait_fraction`` (the share of
the loop's time spent waiting for batches), the stages' milliseconds a batch, the workers' busy
share, and the bottleneck as an index into ``gpucache.loader._stats.BOTTLENECKS`` (loggers take
numbers). It finds the :class:`~gpucache.GpuCachedLoader` the trainer iterates, or takes it as
``loader=``. Importing this module needs Lightning (``lightning`` or ``pytorch_lightning``).
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    from pytorch_lightning import Callback  # type: ignore[assignment]

from .loader._loader import GpuCachedLoader
from .loader._stats import BOTTLENECKS


class LoaderStatsCallback(Callback):
    """Logs ``loader.stats`` to the trainer's loggers (TensorBoard, CSV, W&B, ...).

    Args:
        loader: The loader to report; None finds the one the trainer's training loop iterates.
        every_n_steps: Also log every this many training steps (None: at epoch ends only).
        prefix: Prepended to every metric's name.
        reset_each_epoch: Start the counts afresh after each epoch's log, so that each epoch's
            numbers are its own (default: running totals since the loader was made).
    """

    def __init__(
        self,
        loader: GpuCachedLoader | None = None,
        *,
        every_n_steps: int | None = None,
        prefix: str = "gpucache/",
        reset_each_epoch: bool = False,
    ):
        super().__init__()
        self.loader, self.every_n_steps = loader, every_n_steps
        self.prefix, self.reset_each_epoch = prefix, reset_each_epoch

    def metrics(self, loader: GpuCachedLoader) -> dict[str, float]:
        """The numbers logged: ``as_dict()``'s, prefixed; the bottleneck as its index."""
        out: dict[str, float] = {}
        for key, value in loader.stats.as_dict().items():
            if key == "bottleneck":
                value = -1 if value is None else BOTTLENECKS.index(value)
            if isinstance(value, (int, float)):
                out[self.prefix + key] = float(value)
        return out

    def _loader(self, trainer: Any) -> GpuCachedLoader | None:
        if self.loader is not None:
            return self.loader
        return _find(trainer.train_dataloader)

    def _log(self, trainer: Any) -> None:
        loader = self._loader(trainer)
        if loader is None or not loader.stats.batches:
            return
        metrics = self.metrics(loader)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        n = self.every_n_steps
        if n and trainer.global_step % n == 0:
            self._log(trainer)

    def on_train_epoch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._log(trainer)
        loader = self._loader(trainer)
        if self.reset_each_epoch and loader is not None:
            loader.stats.reset()


def _find(obj: Any, depth: int = 0) -> GpuCachedLoader | None:
    """The GpuCachedLoader in what Lightning holds (the loader, or a CombinedLoader, a list or a
    dict of loaders around it)."""
    if isinstance(obj, GpuCachedLoader) or depth > 4:
        return obj if isinstance(obj, GpuCachedLoader) else None
    inner = getattr(obj, "iterables", None)
    if inner is not None:
        return _find(inner, depth + 1)
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = _find(item, depth + 1)
            if found is not None:
                return found
    return None
