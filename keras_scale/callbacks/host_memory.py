"""HostMemoryWatch: per-epoch host RSS in the logs (and TensorBoard), and a warning when it keeps growing."""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence

import keras

from keras_scale._validate import check_int, check_number
from keras_scale.scalars import ChiefScalars, EpochFigures

__all__ = ["HostMemoryWatch", "HostMemoryGrowthWarning", "steady_growth_mb_per_epoch", "host_rss_mb"]

USUAL_CAUSES = (
    "a Python list (or dict) that keeps tensors alive across steps, e.g. appending model outputs or losses "
    "without .numpy()/float(); keras.backend.clear_session() missing in a loop that builds models; "
    "tf.function retracing (a new trace per Python-scalar or shape change: pass tensors, fix shapes); "
    "dataset.cache() without a filename, which fills host memory with the whole dataset"
)


class HostMemoryGrowthWarning(UserWarning):
    """Host memory (RSS) climbed steadily over the last epochs: likely a leak."""


def host_rss_mb() -> float:
    """This process's resident set size in MiB (``psutil``).

    Example:
        >>> host_rss_mb() > 0
        True
    """
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def steady_growth_mb_per_epoch(rss_mb: Sequence[float], window_epochs: int, min_growth_mb_per_epoch: float
                               ) -> Optional[float]:
    """Mean growth in MiB/epoch over the last ``window_epochs`` epochs when it is a steady climb, else ``None``.

    Steady: the mean growth is at least ``min_growth_mb_per_epoch``, all but at most one epoch grew (the
    allocator sometimes reuses freed pages for an epoch), and no epoch released ``min_growth_mb_per_epoch`` or
    more (a real drop means memory is being returned, not leaked).

    Example:
        >>> steady_growth_mb_per_epoch([100, 120, 141, 160, 181], window_epochs=4, min_growth_mb_per_epoch=10)
        20.25
        >>> steady_growth_mb_per_epoch([100, 140, 100, 160, 181], window_epochs=4, min_growth_mb_per_epoch=10)
    """
    if len(rss_mb) < window_epochs + 1:
        return None
    recent = list(rss_mb)[-(window_epochs + 1):]
    deltas = [b - a for a, b in zip(recent, recent[1:])]
    mean = sum(deltas) / len(deltas)
    if mean < min_growth_mb_per_epoch or mean <= 0:
        return None
    if sum(d <= 0 for d in deltas) > 1 or min(deltas) <= -max(min_growth_mb_per_epoch, 1e-9):
        return None
    return mean


def _check(name: str, value: Any, minimum: float, integer: bool) -> Any:
    if integer:
        return check_int(name, value, int(minimum), owner="HostMemoryWatch")
    return check_number(name, value, minimum, owner="HostMemoryWatch")


class HostMemoryWatch(keras.callbacks.Callback):
    """Record this process's host memory (RSS) each epoch and warn when it grows steadily.

    - ``history.history["host_rss_mb"]``: one value per epoch in the ``History`` that ``fit`` returns (added when
      ``fit`` ends, not to the epoch logs: see :mod:`keras_scale.scalars`); also kept in
      ``rss_mb_history`` (after the warm-up epochs).
    - With ``log_dir``, the chief (:func:`keras_scale.is_chief`) writes ``host/rss_mb`` per epoch to the ``train``
      run under ``log_dir`` (the run Keras's ``TensorBoard(log_dir)`` writes to).
    - After ``warmup_epochs`` (the first epoch traces functions and fills caches), if RSS grew in each of the
      last ``window_epochs`` epochs (at most one flat epoch, no real drop) by ``min_growth_mb_per_epoch`` MiB
      or more on average, a
      :class:`HostMemoryGrowthWarning` names the numbers and the usual causes (once per callback). Every
      process checks its own memory.

    Args:
        log_dir: TensorBoard directory for the ``host/rss_mb`` scalar; ``None`` for logs only.
        window_epochs: how many consecutive growing epochs make a trend, >= 2.
        min_growth_mb_per_epoch: mean growth (MiB per epoch) below which growth is ignored, >= 0.
        warmup_epochs: first epochs left out of the trend, >= 0.

    Example:
        >>> import keras_scale as ks
        >>> watch = ks.HostMemoryWatch(log_dir="runs/exp1")
        >>> history = model.fit(ds, epochs=20, callbacks=[watch])  # doctest: +SKIP
        >>> history.history["host_rss_mb"][-1]                       # doctest: +SKIP
        1843.2
    """

    def __init__(self, log_dir: Optional[str] = None, window_epochs: int = 4, min_growth_mb_per_epoch: float = 32.0,
                 warmup_epochs: int = 1) -> None:
        super().__init__()
        if log_dir is not None and not isinstance(log_dir, (str, bytes)) and not hasattr(log_dir, "__fspath__"):
            raise ValueError(f"HostMemoryWatch: log_dir must be a path or None, got {log_dir!r}.")
        self.log_dir = None if log_dir is None else str(log_dir)
        self.window_epochs = _check("window_epochs", window_epochs, 2, integer=True)
        self.min_growth_mb_per_epoch = float(_check("min_growth_mb_per_epoch", min_growth_mb_per_epoch, 0, False))
        self.warmup_epochs = _check("warmup_epochs", warmup_epochs, 0, integer=True)
        self.rss_mb_history: List[float] = []
        self.warned = False
        self._epochs_seen = 0
        self._scalars: Any = None
        self._figures = EpochFigures()

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self._figures.clear()
        if self._scalars is None or not self._scalars.active:
            self._scalars = ChiefScalars(self.log_dir, strategy=self.model.distribute_strategy)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        rss = host_rss_mb()
        self._figures.add({"host_rss_mb": rss})
        self._epochs_seen += 1
        if self._epochs_seen > self.warmup_epochs:
            self.rss_mb_history.append(rss)
        if self._scalars is not None:
            self._scalars.write({"host/rss_mb": rss}, step=epoch)
        if not self.warned:
            self._maybe_warn()

    def on_train_end(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self._figures.deliver(self.model)
        if self._scalars is not None:
            self._scalars.close()

    def _maybe_warn(self) -> None:
        growth = steady_growth_mb_per_epoch(self.rss_mb_history, self.window_epochs, self.min_growth_mb_per_epoch)
        if growth is None:
            return
        self.warned = True
        first, last = self.rss_mb_history[-(self.window_epochs + 1)], self.rss_mb_history[-1]
        warnings.warn(
            f"HostMemoryWatch: host memory (RSS) grew steadily over the last {self.window_epochs} epochs, "
            f"{first:.0f} -> {last:.0f} MiB (+{growth:.1f} MiB/epoch). If it keeps growing the process will be "
            f"killed for memory. Usual causes: {USUAL_CAUSES}.",
            HostMemoryGrowthWarning,
            stacklevel=2,
        )
