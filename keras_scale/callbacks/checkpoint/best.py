"""keep_best_k: the best epoch-end checkpoints by a monitored log, kept in ``directory/best``."""
from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any, Dict, List

import tensorflow as tf

from keras_scale.callbacks.checkpoint.names import _BEST_DIR, _NAME
from keras_scale.callbacks.checkpoint.format import remove_entry
from keras_scale.storage import _is_local, write_atomic


class BestMixin:
    """Part of :class:`ChiefCheckpoint` (a mixin: it uses the callback's own state)."""

    def _consider_best(self, epoch: int, logs: Any) -> None:
        if not self.keep_best_k:
            return
        value = (logs or {}).get(self.monitor)
        if value is None:
            if not self._warned_monitor:
                self._warned_monitor = True
                warnings.warn(f"ChiefCheckpoint: keep_best_k needs {self.monitor!r} in the epoch logs, which hold "
                              f"{sorted(logs or {})}; no best checkpoint kept for this epoch.", RuntimeWarning,
                              stacklevel=3)
            return
        value = float(value)
        if math.isnan(value):
            return
        best = self._best
        if len(best) >= self.keep_best_k and not self._better(value, best[-1]["value"]):
            return
        self._pending_best = (value, epoch)
        self._pending_epoch_save = True  # the epoch-end state is saved (at the next step or at train end)

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _best_dir(self) -> str:
        return os.path.join(self.directory, _BEST_DIR)

    def _read_best(self) -> List[Dict[str, Any]]:
        try:
            with tf.io.gfile.GFile(os.path.join(self._best_dir(), "best.json")) as f:
                entries = json.load(f)
        except Exception:  # noqa: BLE001 - none yet
            return []
        return sorted(entries, key=lambda e: e["value"], reverse=self.mode == "max")

    def _keep_best(self, value: float, epoch: int) -> None:
        """Copy (hard-link where possible) the checkpoint just saved for this epoch's end into ``best/``."""
        if self._last_saved_prefix is None:
            return
        number = self._last_saved_step
        entries = [e for e in self._best if e["number"] != number]
        entries.append({"number": number, "value": value, "epoch": epoch, "monitor": self.monitor})
        entries.sort(key=lambda e: e["value"], reverse=self.mode == "max")
        self._best, drop = entries[: self.keep_best_k], entries[self.keep_best_k:]
        if not self._chief:  # every worker keeps the same list; only the chief writes files
            return
        self._wait()  # the files must be complete before they are linked
        best_dir = self._best_dir()
        if os.path.islink(best_dir):  # never follow a link out of the directory
            warnings.warn(f"ChiefCheckpoint: {best_dir!r} is a symbolic link; keep_best_k does not write through it. "
                          "Remove the link.", RuntimeWarning, stacklevel=2)
            return
        tf.io.gfile.makedirs(best_dir)
        src_name = os.path.basename(self._last_saved_prefix)
        for name in tf.io.gfile.listdir(self.directory):
            if name == src_name + ".index" or name.startswith(src_name + ".data-"):
                src, dst = os.path.join(self.directory, name), os.path.join(best_dir, name)
                try:
                    if not _is_local(src):
                        raise OSError
                    remove_entry(dst)  # (a link there is removed, never written through)
                    os.link(src, dst)
                except OSError:
                    remove_entry(dst)
                    tf.io.gfile.copy(src, dst, overwrite=True)
        for e in drop:
            for name in tf.io.gfile.listdir(best_dir):
                if name.startswith(f"{_NAME}-{e['number']}."):
                    tf.io.gfile.remove(os.path.join(best_dir, name))
        write_atomic(os.path.join(best_dir, "best.json"), json.dumps(self._best))
        self._say(f"ChiefCheckpoint: {self.monitor}={value:.6g} at epoch {epoch + 1}: kept as "
                  f"{os.path.join(best_dir, src_name)!r}")

