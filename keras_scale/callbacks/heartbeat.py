"""Heartbeat: a small file a worker rewrites as its steps progress, so a supervisor can tell a hung worker from a
slow one, and the launcher's restart record that :class:`keras_scale.Goodput` counts.

``keras-scale launch --heartbeat-timeout-s T`` gives every worker a ``KERAS_SCALE_HEARTBEAT_FILE``;
:func:`keras_scale.fit` then adds this callback by itself. A worker whose file says no step finished for ``T``
seconds (a hung collective, a stopped process) is treated as dead and the run restarts.

The file's format is in :mod:`keras_scale.heartbeat_file`: ``"begin"`` at train begin (after a resume restored the
step), ``"step"`` after train/validation batches (at most every ``interval_s``) and at epoch ends, ``"end"`` at
train end (the script may do other work afterwards: no step progress is expected then). ``"trace"`` pauses the clock
until the next ``"step"`` beat, like ``"begin"``: written before the first validation batch of a fit (it traces the
test function) and by ``Goodput`` before it traces the model to count FLOPs (once, at the first epoch end).

Example::

    from keras_scale.callbacks.heartbeat import Heartbeat
    model.fit(ds, callbacks=[Heartbeat("/tmp/worker-0.json")])   # keras_scale.fit adds it under the launcher
"""
from __future__ import annotations

import os
import time
from typing import Dict, Optional

import keras

from keras_scale.heartbeat_file import HEARTBEAT_FILE_ENV, write_beat

__all__ = ["Heartbeat"]


class Heartbeat(keras.callbacks.Callback):
    """Rewrites ``path`` with the optimizer step and the time as training progresses (see the module docstring).

    Args:
        path: the heartbeat file; ``None``: the ``KERAS_SCALE_HEARTBEAT_FILE`` variable (nothing is written when it
            is unset).
        interval_s: at most one write per this many seconds between train begin and train end (a write is an
            ``os.replace`` of a tiny file and one read of the step counter); ``None``: the
            ``KERAS_SCALE_HEARTBEAT_INTERVAL_S`` variable, else 1 s. The launcher's count of redone steps is exact
            to within the steps of one interval (a killed worker cannot write its last step).

    Example:
        >>> beat = Heartbeat("/tmp/worker-0.json", interval_s=1.0)
        >>> beat.interval_s
        1.0
    """

    def __init__(self, path: Optional[str] = None, interval_s: Optional[float] = None) -> None:
        super().__init__()
        if interval_s is None:
            try:
                interval_s = float(os.environ.get("KERAS_SCALE_HEARTBEAT_INTERVAL_S", "1"))
            except ValueError:
                interval_s = 1.0
        if not isinstance(interval_s, (int, float)) or isinstance(interval_s, bool) or not interval_s >= 0:
            raise ValueError(f"Heartbeat: interval_s must be a number of seconds >= 0, got {interval_s!r}.")
        self.path = path if path is not None else (os.environ.get(HEARTBEAT_FILE_ENV) or None)
        self.interval_s = float(interval_s)
        self._last = 0.0
        self._batches = 0

    def on_train_begin(self, logs: Optional[Dict] = None) -> None:
        self._batches = 0
        self._test_stepped = False
        self._write("begin")

    def on_test_begin(self, logs: Optional[Dict] = None) -> None:
        if not getattr(self, "_test_stepped", False):  # the first validation batch traces the test function
            self._write("trace")

    def on_train_batch_end(self, batch: int, logs: Optional[Dict] = None) -> None:
        self._batches += 1
        self._maybe_write()

    def on_test_batch_end(self, batch: int, logs: Optional[Dict] = None) -> None:
        if not getattr(self, "_test_stepped", False):
            self._test_stepped = True
            self._write("step")  # the clock runs again
        else:
            self._maybe_write()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict] = None) -> None:
        self._write("step")

    def on_train_end(self, logs: Optional[Dict] = None) -> None:
        self._write("end")

    def _maybe_write(self) -> None:
        if time.monotonic() - self._last >= self.interval_s:
            self._write("step")

    def _step(self) -> int:
        optimizer = getattr(self.model, "optimizer", None)
        iterations = getattr(optimizer, "iterations", None)
        try:
            return int(iterations.numpy()) if iterations is not None else self._batches
        except Exception:  # noqa: BLE001 - an optimizer without a readable counter: count batches
            return self._batches

    def _write(self, phase: str) -> None:
        if not self.path:
            return
        self._last = time.monotonic()
        write_beat(phase, self._step(), self.path)
