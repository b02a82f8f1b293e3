"""Restoring: the newest checkpoint that loads (falling back past damaged ones), the learning rate, metric
state and NaN-skip count of an interrupted epoch."""
from __future__ import annotations

import json
import warnings
from typing import Any, Dict, List, Optional

import tensorflow as tf

from keras_scale.callbacks.checkpoint.names import (
    _EPOCH_SKIPPED_KEY, _METRIC_KEY, _POSITION, _RUN_CONFIG_KEY, _SIGNATURE_KEY, CheckpointMismatchError)
from keras_scale.callbacks.checkpoint import format as _io
from keras_scale.callbacks.checkpoint.directory import _verified, list_checkpoints
from keras_scale import state as training_state
from keras_scale.callbacks.checkpoint.state import _metric_variables
from keras_scale.schedules import learning_rate_variable


class RestoreMixin:
    """Part of :class:`ChiefCheckpoint` (a mixin: it uses the callback's own state)."""

    def _restore_newest(self, everything: bool = True) -> Optional[str]:
        target = self._checkpoint if everything else self._weights_only
        flat = self._flat if everything else self._flat_weights
        candidates = list_checkpoints(self.directory)
        failures: List[str] = []
        for number, prefix in candidates:
            reader = None
            try:
                reader = _io.read_checkpoint(prefix)
                self._check_signature(prefix, reader)  # a different model is an error, not a reason to fall back
                # expect_partial: older checkpoints may hold objects this version no longer restores
                _io.read_into(prefix, flat, target)
            except CheckpointMismatchError:
                raise
            except ValueError as e:
                if "shape" in str(e) and reader is not None and not reader.has_tensor(_SIGNATURE_KEY):
                    raise CheckpointMismatchError(
                        f"checkpoint {prefix!r} does not fit this model: {e}. Fix: give ChiefCheckpoint a new "
                        f"directory, or remove the old checkpoints (rm -r {self.directory!r})."
                    ) from e
                failures.append(f"{prefix}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                continue
            except Exception as e:  # noqa: BLE001 - torn, truncated or bit-flipped files: try the previous one
                failures.append(f"{prefix}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
                continue
            self._report_fallback(failures, prefix)
            self._say(f"ChiefCheckpoint: restored {prefix}")
            return prefix
        self._raise_none_loads(failures)
        return None

    @staticmethod
    def _report_fallback(failures: List[str], prefix: str) -> None:
        if failures:
            warnings.warn(
                "ChiefCheckpoint: newer checkpoint(s) could not be loaded and were skipped: "
                + "; ".join(failures) + f". Resumed from {prefix!r} instead.", RuntimeWarning, stacklevel=3,
            )

    def _raise_none_loads(self, failures: List[str]) -> None:
        if failures:
            raise RuntimeError(
                f"ChiefCheckpoint: no checkpoint in {self.directory!r} could be loaded (the model may now hold "
                "partially restored values): " + "; ".join(failures) + ". Fix: move the damaged files away, or "
                "point ChiefCheckpoint at an empty directory to start over."
            )

    @staticmethod
    def _read_position(prefix: str) -> Dict[str, int]:
        reader = _io.read_checkpoint(prefix)
        out = {}
        for name in _POSITION:
            key = f"keras_scale_position/{name}/.ATTRIBUTES/VARIABLE_VALUE"
            out[name] = int(reader.get_tensor(key)) if reader.has_tensor(key) else 0
        return out

    def _newest_readable(self) -> Optional[str]:
        """The newest checkpoint whose every tensor reads back (CRC-checked), without needing the model."""
        failures: List[str] = []
        for _, prefix in list_checkpoints(self.directory):
            why = _verified(prefix)  # CRC-checked (what `keras-scale checkpoint ls` checks too; remembered per files)
            if why is not None:
                failures.append(f"{prefix}: {why}")
                continue
            try:
                self._read_position(prefix)
            except Exception as e:  # noqa: BLE001 - torn, truncated or bit-flipped files
                failures.append(f"{prefix}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
                continue
            self._report_fallback(failures, prefix)
            return prefix
        self._raise_none_loads(failures)
        return None

    def _restore_deferred(self, iterator: Any) -> None:
        prefix = self._deferred_restore
        try:
            self._restore_deferred_now(iterator)
        except tf.errors.OutOfRangeError as e:
            # runs inside the train function: Keras would read this type as "the data ran out" and end the epoch
            raise RuntimeError(f"ChiefCheckpoint: reading {prefix!r} before the first step failed ({e.message}); the "
                               "files changed since fit start (truncated?). Rerun: the next start checks them and "
                               "falls back to the previous checkpoint.") from e

    def _restore_deferred_now(self, data: Any, when: str = "before the first step") -> None:
        """Build the model (and every optimizer) from ``data`` (the fit's data iterator, or its element spec) and
        restore the checkpoint chosen at fit start, the way this fit's start decided (``weights_only`` or in full)."""
        prefix, self._deferred_restore = self._deferred_restore, None
        self._build_from_data(data, f"to restore {prefix!r} {when}")
        self._ensure_built()
        self._build_checkpoint()
        if self._deferred_weights_only:  # the mode chosen for this run (a rerun of its own run resumes in full)
            self._restore_model_weights(prefix)
            if self._deferred_final is not None:  # a completed run's final weights (EarlyStopping's best)
                self._load_final_weights(prefix, self._deferred_final)
            return
        reader = _io.read_checkpoint(prefix)
        self._check_signature(prefix, reader)
        _io.read_into(prefix, self._flat, self._checkpoint)
        self._restored_from = prefix
        self._say(f"ChiefCheckpoint: restored {prefix}")
        self._reconcile_learning_rate(prefix)

    def _restore_at_fit_start(self) -> None:
        """A fit that trains 0 epochs (a rerun of a completed run) has no first step to restore before: a model
        built by its first step (no ``keras.Input``, a subclassed model, a GAN whose optimizers build at their first
        ``apply``) is built now from the spec of the fit's data, as Keras builds it before the first step, and the
        checkpoint restored (nothing is read from the data, nothing trains)."""
        from keras_scale.callbacks.checkpoint import data_position as _data

        prefix = self._deferred_restore
        epoch_iterator = _data.keras_epoch_iterator(self.model)
        dataset = getattr(epoch_iterator, "_distributed_dataset", None)
        spec = getattr(dataset, "element_spec", None)
        if spec is None:
            self._deferred_restore = None
            raise RuntimeError(
                f"ChiefCheckpoint: the run in {self.directory!r} is complete and this fit trains 0 epochs, but the "
                f"model has no variables yet (it is built by its first step) and the data of this fit could not be "
                f"found to build it, so {prefix!r} cannot be restored. Fix: build the model before fit "
                "(keras.Input(...) as its first layer, or model.build(input_shape)), or load the state with "
                "keras_scale.load_checkpoint.")
        self._restore_deferred_now(spec, "at fit start (this fit trains 0 epochs)")

    def _restore_model_weights(self, prefix: str) -> None:
        """``restore="weights_only"``: the model's variables from ``prefix``; optimizers, counters, metrics and the
        data position start fresh."""
        import tensorflow as tf

        reader = _io.read_checkpoint(prefix)
        self._check_signature(prefix, reader, weights_only=True)
        items = self._model_only
        _io.read_into(prefix, _io.flatten(items), tf.train.Checkpoint(**items))
        self._restored_from = prefix
        self._say(f"ChiefCheckpoint: restored the model weights of {prefix} (restore='weights_only': optimizer "
                  "state and position start fresh)")

    def _reconcile_learning_rate(self, prefix: str) -> None:
        """A learning rate changed in the script between runs is used, with a warning naming both values; one changed
        during training (ReduceLROnPlateau, NanGuard's rollback) is resumed as saved. For every optimizer the model
        trains with (a GAN's ``d_optimizer`` and ``g_optimizer`` too)."""
        self._run_config_var.assign(json.dumps(self._start_config()))  # the read overwrote it
        try:
            raw = _io.read_checkpoint(prefix).get_tensor(_RUN_CONFIG_KEY)
            config = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
            config = config if isinstance(config, dict) else {}
        except Exception:  # noqa: BLE001 - written by an older version: the run's starting values are unknown
            config = {}
        recorded = config.get("learning_rates")
        recorded = recorded if isinstance(recorded, dict) else {}
        optimizers = training_state.optimizers(self.model)
        for path, new in [("optimizer", self._lr_at_start)] + list((self._other_lrs_at_start or {}).items()):
            var = learning_rate_variable(optimizers.get(path))
            started = config.get("learning_rate") if path == "optimizer" else recorded.get(path)
            if self._reconcile_one(prefix, path, var, new, started):
                if path == "optimizer":
                    self._lr_override = new
                else:
                    self._other_lr_overrides[path] = new
        from keras_scale.callbacks.checkpoint.boundaries import short_schedule

        for path, started, new in self._schedule_changes(config):  # a schedule is code: this run's is used
            name = ("the optimizer's learning-rate schedule" if path == "optimizer"
                    else f"{path}'s learning-rate schedule")
            warnings.warn(
                f"ChiefCheckpoint: {name} changed between runs: this run sets {short_schedule(new, started)}; the run "
                f"in {prefix!r} was started with {short_schedule(started, new)}. Using this run's schedule (it is "
                "code; everything else resumes exactly, the step it is evaluated at included). To continue the run "
                "as it was, pass the schedule as before.", RuntimeWarning, stacklevel=4)

    @staticmethod
    def _reconcile_one(prefix: str, path: str, var: Any, new: Optional[float], started: Any) -> bool:
        """One optimizer's learning rate after a restore; True when this run's (changed) value replaced the saved."""
        if var is None or new is None:
            return False
        restored = float(var.numpy())
        which = "the optimizer's learning_rate" if path == "optimizer" else f"{path}'s learning_rate"
        assign = ("model.optimizer.learning_rate" if path == "optimizer"
                  else "model." + path.replace("/", ".") + ".learning_rate")
        if started is None:
            if restored != new:
                warnings.warn(
                    f"ChiefCheckpoint: {which} is {new:g} in this run but {restored:g} in "
                    f"{prefix!r}, which does not record the value its run started with; the checkpoint's {restored:g} "
                    "is restored (as keras.callbacks.BackupAndRestore does; a callback such as ReduceLROnPlateau may "
                    "have set it). To train with a new value, assign it after the restore, e.g. "
                    f"{assign}.assign({new:g}) in the on_train_begin of a callback listed after "
                    "ChiefCheckpoint.", RuntimeWarning, stacklevel=4)
            return False
        if float(started) == new:
            return False  # unchanged in the script: the saved value (possibly lowered during training) continues
        var.assign(new)
        name = "learning_rate" if path == "optimizer" else f"{path}'s learning_rate"
        warnings.warn(
            f"ChiefCheckpoint: {name} changed between runs: this run starts with {new:g}; the run in "
            f"{prefix!r} was started with {float(started):g} and was at {restored:g} when saved. Using this run's "
            f"{new:g} (everything else resumes exactly). To continue with the checkpoint's value, pass the "
            f"learning rate as before ({float(started):g}).", RuntimeWarning, stacklevel=4)
        return True

    def _restore_epoch_skipped(self, prefix: str, mid_epoch: bool) -> None:
        """The resumed epoch's NaN-skipped count continues from the saved one (a fresh epoch starts at 0)."""
        var = self._epoch_skipped_variable()
        if var is None:
            return
        reader = _io.read_checkpoint(prefix)
        value = reader.get_tensor(_EPOCH_SKIPPED_KEY) if mid_epoch and reader.has_tensor(_EPOCH_SKIPPED_KEY) else 0
        var.assign(tf.cast(value, var.dtype))

    def _restore_metrics(self, prefix: str) -> bool:
        """Continue the interrupted epoch's metrics (loss included) from their saved state."""
        reader = _io.read_checkpoint(prefix)
        variables = _metric_variables(self.model)
        keys = [_METRIC_KEY.format(i) for i in range(len(variables))]
        if not variables or not all(reader.has_tensor(k) for k in keys) or reader.has_tensor(
                _METRIC_KEY.format(len(variables))):
            return False
        values = [reader.get_tensor(k) for k in keys]
        if any(tuple(v.shape) != tuple(int(d) for d in var.shape) for v, var in zip(values, variables)):
            return False
        for var, value in zip(variables, values):
            var.assign(value)
        return True

