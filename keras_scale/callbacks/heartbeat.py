"""Heartbeat: a small file a worker rewrites as its steps progress, so a supervisor can tell a hung worker from a
slow one, and the launcher's restart record that :class:`keras_scale.Goodput` counts.

``keras-scale launch --heartbeat-timeout-s T`` gives every worker a ``KERAS_SCALE_HEARTBEAT_FILE``;
:func:`keras_scale.fit` then adds this callback by itself. A worker whose file says no step finished for ``T``
seconds (a hung collective, a stopped process) is treated as dead and the run restarts.

The file is one JSON object, replaced atomically: ``{"step": optimizer updates so far, "time": unix seconds,
"phase": "begin" | "step" | "end", "pid": ...}``. ``"begin"`` is written at train begin (after a resume restored
the step), ``"step"`` after train/validation batches (at most every ``interval_s``), ``"end"`` at train end (the
script may do other work afterwards: no step progress is expected then).

Example:
    >>> import keras_scale as ks
    >>> model.fit(ds, callbacks=[ks.callbacks.heartbeat.Heartbeat("/tmp/worker-0.json")])   # doctest: +SKIP
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

import keras

__all__ = ["Heartbeat", "HEARTBEAT_FILE_ENV", "RESTART_LOG_ENV", "read_heartbeat", "read_restart_log",
           "restart_summary"]

#: Environment variable naming this worker's heartbeat file (set per worker by ``keras-scale launch``).
HEARTBEAT_FILE_ENV = "KERAS_SCALE_HEARTBEAT_FILE"
#: Environment variable naming the launcher's restart record (JSON lines), read by ``Goodput``.
RESTART_LOG_ENV = "KERAS_SCALE_RESTART_LOG"


def read_heartbeat(path: str) -> Optional[Dict[str, Any]]:
    """The last heartbeat written to ``path``, or ``None`` when there is none (yet) or it cannot be read.

    Example:
        >>> read_heartbeat("/nonexistent/worker-0.json") is None
        True
    """
    try:
        with open(path) as f:
            beat = json.load(f)
    except (OSError, ValueError):
        return None
    return beat if isinstance(beat, dict) and "time" in beat else None


class Heartbeat(keras.callbacks.Callback):
    """Rewrites ``path`` with the optimizer step and the time as training progresses (see the module docstring).

    Args:
        path: the heartbeat file; ``None``: the ``KERAS_SCALE_HEARTBEAT_FILE`` variable (nothing is written when it
            is unset).
        interval_s: at most one write per this many seconds between train begin and train end (a write is an
            ``os.replace`` of a tiny file and one read of the step counter).

    Example:
        >>> beat = Heartbeat("/tmp/worker-0.json", interval_s=1.0)
        >>> beat.interval_s
        1.0
    """

    def __init__(self, path: Optional[str] = None, interval_s: float = 1.0) -> None:
        super().__init__()
        if not isinstance(interval_s, (int, float)) or isinstance(interval_s, bool) or not interval_s >= 0:
            raise ValueError(f"Heartbeat: interval_s must be a number of seconds >= 0, got {interval_s!r}.")
        self.path = path if path is not None else (os.environ.get(HEARTBEAT_FILE_ENV) or None)
        self.interval_s = float(interval_s)
        self._last = 0.0
        self._batches = 0

    def on_train_begin(self, logs: Optional[Dict] = None) -> None:
        self._batches = 0
        self._write("begin")

    def on_train_batch_end(self, batch: int, logs: Optional[Dict] = None) -> None:
        self._batches += 1
        self._maybe_write()

    def on_test_batch_end(self, batch: int, logs: Optional[Dict] = None) -> None:
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
        beat = {"step": self._step(), "time": time.time(), "phase": phase, "pid": os.getpid()}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(beat, f)
            os.replace(tmp, self.path)
        except OSError:  # a full or vanished directory must not stop training; the supervisor then sees no beat
            pass


def read_restart_log(path: Optional[str] = None) -> List[Dict[str, Any]]:
    """The records of the launcher's restart log (``path``, default ``KERAS_SCALE_RESTART_LOG``); ``[]`` if none.

    Two kinds of line: ``{"event": "restart", "restart": i, "max_restarts": K, "workers": [..], "reason": ..,
    "returncode": .., "last_step": .., "last_progress_unix": .., "num_workers_next": ..}`` when the launcher
    restarts, and ``{"event": "resumed", "restart": i, "first_step": .., "lost_s": .., "redone_steps": ..}`` once the
    restarted workers made their first step.

    Example:
        >>> read_restart_log("/nonexistent/restarts.jsonl")
        []
    """
    path = path if path is not None else os.environ.get(RESTART_LOG_ENV)
    if not path:
        return []
    records = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line torn by a killed launcher
                if isinstance(record, dict):
                    records.append(record)
    except OSError:
        return []
    return records


def restart_summary(path: Optional[str] = None) -> Dict[str, Any]:
    """What the restarts of this run cost: ``{"restarts", "restart_lost_s", "restart_redone_steps"}``, or ``{}``
    when there is no restart log (not launched by ``keras-scale launch --max-restarts``).

    ``restart_lost_s``: per restart, from the failed workers' last step to the restarted workers' first step
    (stopping, backoff, start-up, restore); ``restart_redone_steps``: steps trained again because they came after
    the last checkpoint.

    Example:
        >>> restart_summary("/nonexistent/restarts.jsonl")
        {}
    """
    path = path if path is not None else os.environ.get(RESTART_LOG_ENV)
    if not path or not os.path.exists(path):
        return {}
    records = read_restart_log(path)
    resumed = [r for r in records if r.get("event") == "resumed"]
    return {
        "restarts": sum(r.get("event") == "restart" for r in records),
        "restart_lost_s": round(sum(float(r.get("lost_s") or 0.0) for r in resumed), 6),
        "restart_redone_steps": sum(int(r.get("redone_steps") or 0) for r in resumed),
    }
