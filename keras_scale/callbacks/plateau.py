"""ReduceLROnPlateau that works with any learning-rate schedule.

Keras's ``keras.callbacks.ReduceLROnPlateau`` raises "learning rate is not settable" when the optimizer's learning
rate is a schedule (``WarmupCosine``, ``CosineDecay``, ...). This one lowers the LR through
:func:`keras_scale.schedules.scale_learning_rate`: a float LR is assigned, a schedule is multiplied by its
multiplier variable (the schedule keeps its shape, scaled down).

Example:
    model.fit(x, y, validation_data=(xv, yv), callbacks=[ks.ReduceLROnPlateau(patience=3)])
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Optional

import keras
import numpy as np

from keras_scale import events
from keras_scale import step as step_lib
from keras_scale._validate import check_int
from keras_scale.callbacks.lr_logger import current_learning_rate
from keras_scale.distribute import chief_print
from keras_scale.schedules import scale_learning_rate

__all__ = ["ReduceLROnPlateau"]


class ReduceLROnPlateau(keras.callbacks.Callback):
    """Multiply the learning rate by ``factor`` when ``monitor`` stopped improving for ``patience`` epochs.

    Keras's ``ReduceLROnPlateau`` semantics (``monitor``, ``factor``, ``patience``, ``mode``, ``min_delta``,
    ``cooldown``, ``min_lr``), for any optimizer learning rate: a float, a :class:`keras_scale.WarmupCosine`, or
    any ``LearningRateSchedule`` (wrapped once in :class:`keras_scale.schedules.ScaledSchedule`; the train function
    is rebuilt then). With a schedule each reduction multiplies the whole remaining curve; ``min_lr`` is checked
    against the LR at the moment of a reduction (no reduction once the current LR is at or below it; a reduction
    never takes the current LR below it). ``logs["learning_rate"]`` holds the LR after the epoch, as in Keras.

    Args:
        monitor: the ``logs`` key to watch, e.g. ``"val_loss"`` or ``"loss"``.
        factor: multiplier of the LR, ``0 < factor < 1``.
        patience: epochs without improvement before a reduction.
        verbose: 1 prints each reduction (chief only).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (``max`` for names containing ``acc``, else ``min``).
        min_delta: a change smaller than this is no improvement.
        cooldown: epochs after a reduction during which no reduction happens and patience does not count.
        min_lr: the lower bound of the LR at a reduction.

    Example:
        >>> from keras_scale.schedules import WarmupCosine
        >>> reducer = ReduceLROnPlateau("val_loss", factor=0.5, patience=3)
        >>> optimizer = keras.optimizers.AdamW(WarmupCosine(1e-3, total_steps=10_000, warmup_steps=500))
        >>> model.compile(optimizer=optimizer, loss="mse")                                 # doctest: +SKIP
        >>> model.fit(x, y, epochs=50, validation_split=0.1, callbacks=[reducer])         # doctest: +SKIP
    """

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10, verbose: int = 0,
                 mode: str = "auto", min_delta: float = 1e-4, cooldown: int = 0, min_lr: float = 0.0) -> None:
        super().__init__()
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"monitor must be the name of a logs key such as 'val_loss', got {monitor!r}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < 1:
            raise ValueError(f"factor must be a number with 0 < factor < 1 (the LR multiplier), got {factor!r}; "
                             "e.g. factor=0.5 halves the learning rate.")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        for name, value in (("min_delta", min_delta), ("min_lr", min_lr)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 and
                                                                                       math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self.monitor = monitor
        self.factor = float(factor)
        self.patience = check_int("patience", patience, minimum=0)
        self.cooldown = check_int("cooldown", cooldown, minimum=0)
        self.verbose = verbose
        self.min_delta = float(min_delta)
        self.min_lr = float(min_lr)
        self.mode = "max" if mode == "max" or (mode == "auto" and "acc" in monitor) else "min"
        self.best = math.inf if self.mode == "min" else -math.inf
        self.wait = 0
        self.cooldown_counter = 0
        self.reductions = 0

    def _improved(self, current: float) -> bool:
        if self.mode == "min":
            return current < self.best - self.min_delta
        return current > self.best + self.min_delta

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self.best = math.inf if self.mode == "min" else -math.inf
        self.wait = 0
        self.cooldown_counter = 0

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        logs = logs if logs is not None else {}
        optimizer = self.model.optimizer
        current = logs.get(self.monitor)
        if current is None:  # as Keras: warn and skip (e.g. an epoch without validation, validation_freq > 1)
            warnings.warn(
                f"ReduceLROnPlateau monitors {self.monitor!r}, which is not in this epoch's logs (available: "
                f"{', '.join(sorted(logs)) or 'none'}): no decision this epoch. Pass monitor= one of them, or "
                "validation data for 'val_*'.", stacklevel=2)
            return
        current = float(np.asarray(current))
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self._improved(current):
            self.best = current
            self.wait = 0
        elif self.cooldown_counter <= 0:
            self.wait += 1
            if self.wait >= self.patience:
                self._reduce(epoch, optimizer)
        logs["learning_rate"] = current_learning_rate(optimizer)

    def _reduce(self, epoch: int, optimizer: Any) -> None:
        old_lr = current_learning_rate(optimizer)
        self.wait = 0
        if old_lr <= self.min_lr:
            return
        new_lr = max(old_lr * self.factor, self.min_lr)
        events.record("lr_cut", int(optimizer.iterations.numpy()), epoch=epoch, old_lr=old_lr, new_lr=new_lr, monitor=self.monitor)
        if scale_learning_rate(optimizer, new_lr / old_lr):
            step_lib.rebuild(self.model)  # a generic schedule was wrapped: retrace (also a cached composed step)
        self.cooldown_counter = self.cooldown
        self.reductions += 1
        chief_print(f"\nEpoch {epoch + 1}: ReduceLROnPlateau: {self.monitor} did not improve for {self.patience} "
                    f"epoch(s): learning rate {old_lr:.4g} -> {new_lr:.4g}.", self.model.distribute_strategy,
                    verbose=self.verbose)
