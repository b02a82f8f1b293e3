"""LearningRateLogger: the learning rate of every optimizer update, as a TensorBoard scalar.

Keras's TensorBoard callback logs the learning rate once per epoch at most; a warmup, a plateau reduction or a
rollback that lowers the LR is only visible per update. This logger reads nothing on the training thread per
batch: at the end of each epoch it reads ``optimizer.iterations`` once, evaluates the schedule for the epoch's
updates in one vectorised call and writes one point per applied update (a step NanGuard skipped applied no update
and gets no point).

Example:
    model.fit(ds, callbacks=[ks.LearningRateLogger("runs/lr")])
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Dict, Optional

import keras
import numpy as np

from keras_scale._validate import check_int
from keras_scale.scalars import ChiefScalars

__all__ = ["LearningRateLogger", "current_learning_rate"]


def _to_float(value: Any) -> float:
    """A Python float from a float, a tensor, a Keras variable or a (Mirrored) TF variable."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, keras.Variable):
        value = value.value  # its backend (TF) variable
    if hasattr(value, "read_value"):
        value = value.read_value()  # a tf.Variable, MirroredVariable included (float() of one raises)
    return float(np.asarray(keras.ops.convert_to_numpy(value)))


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer


def current_learning_rate(optimizer: Any) -> float:
    """The learning rate ``optimizer`` uses for its next update, as a float (works under every strategy).

    Example:
        >>> current_learning_rate(keras.optimizers.SGD(0.1))
        0.1...
    """
    return _to_float(_inner(optimizer).learning_rate)


def _momentum(optimizer: Any) -> Optional[float]:
    inner = _inner(optimizer)
    for attr in ("momentum", "beta_1", "rho"):  # SGD / RMSprop momentum, Adam-family first moment decay
        value = getattr(inner, attr, None)
        if value is not None and not callable(value):
            return _to_float(value)
        if callable(value):
            return _to_float(value())
    return None


def _weight_decay(optimizer: Any) -> Optional[float]:
    value = getattr(_inner(optimizer), "weight_decay", None)
    return None if value is None else _to_float(value)


class LearningRateLogger(keras.callbacks.Callback):
    """Write ``optimizer/learning_rate`` for every ``every_n_steps``-th optimizer update to TensorBoard (chief only).

    The x axis is the update index (``optimizer.iterations`` before the update); the value is the LR that update
    used: a float LR, or the schedule (``WarmupCosine``, any ``LearningRateSchedule``) evaluated at that index,
    times the LR multiplier that was in force when the epoch started (so a ``ReduceLROnPlateau`` step shows from
    the next epoch on, whatever the callbacks' order, a mid-epoch NanGuard rollback from the next epoch on). Points are written at each epoch's end
    (and at the end of training), not during the epoch: the logger adds no per-step work or host read.

    Args:
        log_dir: TensorBoard log directory (keras_scale's scalars share one run under it).
        every_n_steps: write one point every this many updates (1: every update).
        log_momentum: also write ``optimizer/momentum`` (SGD/RMSprop ``momentum``, Adam-family ``beta_1``).
        log_weight_decay: also write ``optimizer/weight_decay`` (the optimizer's ``weight_decay``, e.g. AdamW's).

    Example:
        >>> logger = LearningRateLogger("runs/quickstart", every_n_steps=10, log_momentum=True)
        >>> model.fit(x, y, callbacks=[logger])  # doctest: +SKIP
    """

    def __init__(self, log_dir: str, every_n_steps: int = 1, log_momentum: bool = False,
                 log_weight_decay: bool = False) -> None:
        super().__init__()
        self.log_dir = os.fspath(log_dir)
        self.every_n_steps = check_int("every_n_steps", every_n_steps)
        self.log_momentum = bool(log_momentum)
        self.log_weight_decay = bool(log_weight_decay)
        self.points_written = 0
        self._scalars: Any = None
        self._next_step = 0
        self._multiplier_at_epoch_start: Optional[float] = None
        self._lr_at_epoch_start: Optional[float] = None

    # ---- what to write ---------------------------------------------------------------------------------------
    def _multiplier(self) -> Optional[float]:
        from keras_scale.schedules import lr_multiplier

        variable = lr_multiplier(self.model.optimizer)
        return None if variable is None else _to_float(variable)

    def learning_rates(self, first_step: int, end_step: int) -> np.ndarray:
        """The LR of updates ``first_step .. end_step - 1``, evaluated in one call (host side, no training op).

        Example:
            logger.learning_rates(0, 3)
            # array([0.001, 0.002, 0.003], dtype=float32)
        """
        import tensorflow as tf

        n = max(0, end_step - first_step)
        lr = getattr(_inner(self.model.optimizer), "_learning_rate", None)
        if not isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            # the LR in force during the epoch (read at its start), not one a callback lowered at its end
            value = self._lr_at_epoch_start
            return np.full(n, current_learning_rate(self.model.optimizer) if value is None else value, np.float64)
        steps = tf.range(first_step, end_step, dtype=tf.int64)
        try:
            values = np.asarray(keras.ops.convert_to_numpy(lr(steps)), np.float64).reshape(-1)
        except Exception:  # noqa: BLE001 - a schedule that only takes a scalar step: one call per update
            values = np.array([_to_float(lr(tf.constant(s, tf.int64))) for s in range(first_step, end_step)])
        if values.shape != (n,):
            values = np.broadcast_to(values, (n,)).copy()
        now, then = self._multiplier(), self._multiplier_at_epoch_start
        if now is not None and then is not None and now > 0:
            values *= then / now  # the multiplier in force during the epoch, not one lowered at its end
        return values

    def _flush(self) -> None:
        if self._scalars is None or not self._scalars.active:
            return
        end = int(self.model.optimizer.iterations.numpy())  # the one host read of the epoch
        if end < self._next_step:  # a rollback restored an earlier step: its updates are applied again
            self._next_step = end
        first = self._next_step
        if end <= first:
            return
        self._next_step = end
        start = first + (-first) % self.every_n_steps  # the first multiple of every_n_steps
        if start >= end:
            return
        lrs = self.learning_rates(first, end)[start - first::self.every_n_steps]
        extra: Dict[str, float] = {}
        if self.log_momentum and self._has_momentum:
            extra["optimizer/momentum"] = _momentum(self.model.optimizer)
        if self.log_weight_decay and self._has_weight_decay:
            extra["optimizer/weight_decay"] = _weight_decay(self.model.optimizer)
        steps = np.arange(start, end, self.every_n_steps, dtype=np.int64)
        series = {"optimizer/learning_rate": lrs.astype(np.float32)}
        series.update({tag: np.full(len(steps), value, np.float32) for tag, value in extra.items()})
        self._write_series(steps, series)
        self._scalars.write({}, step=int(steps[-1]), flush=True)
        self.points_written += len(steps)

    def _write_series(self, steps: np.ndarray, series: Dict[str, np.ndarray]) -> None:
        """All points of the epoch in one graph call per tag (traced once per process, not per fit)."""
        for tag, values in series.items():
            self._scalars.write_series(tag, steps, values)

    # ---- Keras hooks -----------------------------------------------------------------------------------------
    def on_train_begin(self, logs: Optional[Dict] = None) -> None:
        self._scalars = ChiefScalars(self.log_dir, strategy=self.model.distribute_strategy)
        self._next_step = int(self.model.optimizer.iterations.numpy())  # a resumed run starts where it stopped
        self._has_momentum = _momentum(self.model.optimizer) is not None
        self._has_weight_decay = _weight_decay(self.model.optimizer) is not None
        for wanted, present, what in ((self.log_momentum, self._has_momentum, "momentum"),
                                      (self.log_weight_decay, self._has_weight_decay, "weight_decay")):
            if wanted and not present:
                warnings.warn(f"LearningRateLogger: {type(_inner(self.model.optimizer)).__name__} has no {what}; "
                              f"it is not logged.", stacklevel=2)

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict] = None) -> None:
        if self._scalars is not None and self._scalars.active:
            self._multiplier_at_epoch_start = self._multiplier()
            lr = getattr(_inner(self.model.optimizer), "_learning_rate", None)
            self._lr_at_epoch_start = (None if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule)
                                       else current_learning_rate(self.model.optimizer))

    def on_epoch_end(self, epoch: int, logs: Optional[Dict] = None) -> None:
        self._flush()

    def on_train_end(self, logs: Optional[Dict] = None) -> None:
        if self._scalars is not None:
            self._flush()  # a partial last epoch (a stop mid-epoch)
            self._scalars.close()
