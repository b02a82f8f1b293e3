"""LearningRateLogger: the optimizer's learning rate per step, as a TensorBoard scalar.

Keras's TensorBoard callback logs the learning rate once per epoch at most; a warmup or a rollback that lowers
the LR is only visible per step.

Example:
    >>> model.fit(ds, callbacks=[ks.LearningRateLogger("runs/lr", every_n_steps=1)])
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import keras

from keras_scale._validate import check_int
from keras_scale.callbacks._scalars import ChiefScalars

__all__ = ["LearningRateLogger"]


class LearningRateLogger(keras.callbacks.Callback):
    """Write ``learning_rate`` (the value the optimizer uses for its next update) every ``every_n_steps`` updates.

    Chief only; the x axis is ``optimizer.iterations``.

    Example:
        >>> logger = LearningRateLogger("runs/quickstart", every_n_steps=10)
        >>> model.fit(x, y, callbacks=[logger])
    """

    def __init__(self, log_dir: str, every_n_steps: int = 1) -> None:
        super().__init__()
        self.log_dir = os.fspath(log_dir)
        self.every_n_steps = check_int("every_n_steps", every_n_steps)
        self._scalars: Any = None

    def on_train_begin(self, logs: Optional[Dict] = None) -> None:
        self._scalars = ChiefScalars(self.log_dir, "learning_rate", self.model.distribute_strategy)

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict] = None) -> None:
        if self._scalars is None or not self._scalars.active:
            return
        step = int(self.model.optimizer.iterations.numpy())
        if step % self.every_n_steps == 0:
            self._scalars.write({"learning_rate": float(self.model.optimizer.learning_rate)}, step=step, flush=False)

    def on_train_end(self, logs: Optional[Dict] = None) -> None:
        if self._scalars is not None:
            self._scalars.close()
