"""What a checkpoint holds: the variables saved and restored, and the signature that tells a checkpoint
of another model."""
from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any, Dict, List, Optional

import keras
import tensorflow as tf

from keras_scale import state as training_state

from keras_scale.callbacks.checkpoint.names import _NAME, _POSITION, _SIGNATURE_KEY, CheckpointMismatchError
from keras_scale.callbacks.checkpoint import format as _io


# Guard state that describes the moment, not the run: never saved, never restored (a restored "halted" flag
# would freeze the resumed run).
_TRANSIENT_STEP_STATE = frozenset({"halted", "consecutive_bad", "incidents", "diag"})


def _tf_variable(v: Any) -> Any:
    # The tf.Variable (or distributed variable) under a Keras variable. Checkpointing Keras variables directly
    # breaks TensorFlow's async checkpoint from the 2nd save on (KerasVariable._copy_trackable_to_cpu creates a
    # new tf.Variable inside a tf.function on every call).
    return v.value if isinstance(v, keras.Variable) else v


def _optimizer_variables(model: keras.Model) -> List[Any]:
    """``model.optimizer``'s variables (saved under ``optimizer_variables``, the key of a one-optimizer model)."""
    main = training_state.optimizers(model).get("optimizer")
    return list(main.variables) if main is not None else []


def _other_optimizer_items(model: keras.Model) -> Dict[str, List[Any]]:
    """Every other optimizer the model trains with (a GAN's ``d_optimizer``, ``optimizers/gen``...): one checkpoint
    item each, ``optimizer_variables_<path>`` (``/`` and other non-word characters as ``_``)."""
    items: Dict[str, List[Any]] = {}
    for path, opt in training_state.optimizers(model).items():
        if path == "optimizer":
            continue
        key = "optimizer_variables_" + re.sub(r"\W", "_", path)
        while key in items:
            key += "_"
        items[key] = [_tf_variable(v) for v in opt.variables]
    return items


def _metric_variables(model: keras.Model) -> List[Any]:
    return training_state.metric_variables(model)


def _state_size(model: keras.Model) -> int:
    """How many variables the training state has now (a checkpoint object built before some existed is rebuilt)."""
    return len(training_state.variables(model))


def _lr_variable(model: keras.Model) -> Optional[Any]:
    """The optimizer's learning-rate variable (a float LR; ``None`` for a schedule, which is code, not state)."""
    from keras_scale.schedules import learning_rate_variable

    return learning_rate_variable(getattr(model, "optimizer", None))


def _other_lr_values(model: keras.Model) -> List[Any]:
    """``(variable, value now)`` of the float learning rate of every optimizer but ``model.optimizer``."""
    from keras_scale.schedules import learning_rate_variable

    out = []
    for path, opt in training_state.optimizers(model).items():
        var = learning_rate_variable(opt) if path != "optimizer" else None
        if var is not None:
            out.append((var, var.numpy()))
    return out


def _signature(model: keras.Model) -> Dict[str, Any]:
    """The model's variables (path, shape) and each optimizer's class and variables (:func:`keras_scale.state.signature`)."""
    return training_state.signature(model)


class StateMixin:
    """Part of :class:`ChiefCheckpoint` (a mixin: it uses the callback's own state)."""

    def _ensure_built(self) -> bool:
        """Create every variable of the training state now (as Keras's symbolic build does under a strategy) so
        they can be restored before the first step. False when that needs the data (an unbuilt model, or a model
        with its own ``train_step`` whose optimizers build at their first ``apply``)."""
        return training_state.build(self.model)

    def _weights_ready(self) -> bool:
        """The model's own variables exist (what ``restore="weights_only"`` needs; optimizers may still be unbuilt)."""
        model = self.model
        layers = [layer for layer in model._flatten_layers() if layer is not model or training_state._has_call(model)]
        return all(layer.built for layer in layers) and bool(model.variables)

    def _state_variables(self) -> Dict[str, tf.Variable]:
        model = self.model
        state: Dict[str, tf.Variable] = {}
        try:
            from keras_scale import step as ks_step

            state.update(dict(ks_step.state_variables(model) or {}))
        except (ImportError, AttributeError):
            pass
        for name in _TRANSIENT_STEP_STATE:
            state.pop(name, None)
        # each optimizer's LR multiplier ("lr_multiplier" for model.optimizer, as before), from keras_scale.state
        state.update(training_state.lr_multiplier_variables(model))
        return state

    def _build_checkpoint(self, with_manager: bool = True) -> None:
        model = self.model
        if self._manager is not None:
            self._wait()
        # Position and signature are host-side bookkeeping: plain variables outside any strategy scope.
        with tf.init_scope():
            self._vars = {name: tf.Variable(0, dtype=tf.int64, trainable=False, name=f"ks_{name}")
                          for name in _POSITION}
            self._signature = tf.Variable("", dtype=tf.string, trainable=False, name="ks_signature")
            self._epoch_logs_var = tf.Variable("", dtype=tf.string, trainable=False, name="ks_epoch_logs")
            # what this run's script set (not what training made of it): tells a deliberate change at the next resume
            self._run_config_var = tf.Variable(json.dumps(self._start_config()), dtype=tf.string,
                                               trainable=False, name="ks_run_config")
            # the data iterator's position (data_position.py; b"": none saved, a resume reads the data forward)
            self._data_state_var = tf.Variable(b"", dtype=tf.string, trainable=False, name="ks_data_iterator")
        # Variables by position (model.variables, optimizer.variables: a deterministic order for a given model
        # and optimizer); the signature saved alongside makes restoring into a different model an error.
        # Every optimizer the model trains with (keras_scale.state): model.optimizer under "optimizer_variables"
        # (the key a one-optimizer model always had), each other one under its own item.
        optimizer_items: Dict[str, Any] = {"optimizer_variables": [_tf_variable(v) for v in _optimizer_variables(model)]}
        optimizer_items.update(_other_optimizer_items(model))
        items: Dict[str, Any] = {
            "model_variables": [_tf_variable(v) for v in model.variables],
            **optimizer_items,
            "keras_scale_position": self._vars,
            "keras_scale_signature": self._signature,
            "keras_scale_epoch_logs": self._epoch_logs_var,
            "keras_scale_run_config": self._run_config_var,
            "keras_scale_data": {"iterator": self._data_state_var},
        }
        metrics = _metric_variables(model)
        self._num_metric_vars = len(metrics)
        self._state_size = _state_size(model)
        if metrics:  # the interrupted epoch's metric state; restored separately, after Keras resets metrics
            items["metrics_variables"] = [_tf_variable(v) for v in metrics]
        state = self._state_variables()
        if state:
            items["keras_scale_state"] = {k: _tf_variable(v) for k, v in state.items()}
        epoch_skipped = self._epoch_skipped_variable()
        if epoch_skipped is not None:  # the interrupted epoch's NaN-skipped count (its logs' nan_skipped)
            items["keras_scale_epoch_skipped"] = epoch_skipped
        self._checkpoint = tf.train.Checkpoint(**items)
        # Same paths, model and optimizers only: for a mid-training rollback that keeps keras_scale's counters.
        weights = {"model_variables": items["model_variables"], **optimizer_items}
        self._weights_only = tf.train.Checkpoint(**weights)
        # The model's variables alone: restore="weights_only"
        self._model_only = {"model_variables": items["model_variables"]}
        # Synchronous saves are written by format.py (TensorFlow's bundle, directly); these are the same variables
        # under the same keys, for its writer and for restoring.
        self._flat, self._flat_weights = _io.flatten(items), _io.flatten(weights)
        if not with_manager:
            return
        if self._chief:
            self._sanitize_state_file()

        def manager():
            # same numbering, state file and rotation either way; synchronous saves write TensorFlow's bundle
            # directly (format.BundleCheckpoint), async ones through tf.train.Checkpoint
            target = self._checkpoint if self.async_save else _io.BundleCheckpoint(self._checkpoint, self._flat)
            cls = _io.CheckpointManager
            return cls(
                target, self._write_dir, max_to_keep=self.max_to_keep if self._chief else 1,
                keep_checkpoint_every_n_hours=self.keep_every_n_hours if self._chief else None,
                checkpoint_name=_NAME,
            )

        try:
            self._manager = manager()
        except ValueError as e:  # an empty/invalid state file; the checkpoints themselves are found by scanning
            state_file = os.path.join(self._write_dir, "checkpoint")
            warnings.warn(f"ChiefCheckpoint: {e}; moving the invalid {state_file!r} aside to "
                          f"{state_file + '.invalid'!r}.", RuntimeWarning, stacklevel=2)
            tf.io.gfile.rename(state_file, state_file + ".invalid", overwrite=True)
            self._manager = manager()
        self._options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=self.async_save)

    def _check_signature(self, prefix: str, reader: Any, weights_only: bool = False) -> None:
        """A checkpoint of another model, or of another optimizer (class, variables), is an error that says so."""
        if not reader.has_tensor(_SIGNATURE_KEY):
            return
        raw = reader.get_tensor(_SIGNATURE_KEY)
        saved = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        mine = _signature(self.model)
        fix = (f"Fix: give ChiefCheckpoint a new directory for this model, or remove the old checkpoints "
               f"(rm -r {self.directory!r}) if you meant to start over.")
        if not weights_only:
            self._check_optimizer_classes(prefix, saved, mine, fix)
        for part, what in (("model", "model weights"),) + (() if weights_only else (("optimizer", "optimizer variables"),)):
            theirs, ours = saved.get(part, []), mine[part]
            if len(theirs) != len(ours):
                def without_lr(entries):  # a float learning rate is one scalar variable ".../learning_rate"
                    return [list(shape) for path, shape in entries
                            if not (str(path).endswith("learning_rate") and not list(shape))]

                if part == "optimizer" and without_lr(theirs) == without_lr(ours):
                    kind = "a float" if len(theirs) > len(ours) else "a schedule"
                    raise CheckpointMismatchError(
                        f"checkpoint {prefix!r} was written with {kind} learning rate and this optimizer has "
                        f"{'a schedule' if kind == 'a float' else 'a float'}: a float learning rate is an optimizer "
                        f"variable, a schedule is not, so the two cannot be resumed into each other. Fix: keep the "
                        f"first run's kind (a float can be changed between runs: the new value is used, with a "
                        f"warning), or start over in a new directory."
                    )
                raise CheckpointMismatchError(
                    f"checkpoint {prefix!r} was written for a different {part}: it holds {len(theirs)} {what}, "
                    f"this {part} has {len(ours)}. {fix}"
                )
            for (s_path, s_shape), (m_path, m_shape) in zip(theirs, ours):
                if list(s_shape) != list(m_shape):
                    raise CheckpointMismatchError(
                        f"checkpoint {prefix!r} was written for a different {part}: {s_path!r} has shape "
                        f"{tuple(s_shape)} there but {m_path!r} has shape {tuple(m_shape)} here. {fix}"
                    )
        if weights_only:
            return
        for path, entry in (saved.get("optimizers") or {}).items():
            ours = mine["optimizers"].get(path)
            if path == "optimizer" or ours is None:
                continue
            theirs_shapes = [list(shape) for _, shape in entry.get("variables", [])]
            ours_shapes = [list(shape) for _, shape in ours["variables"]]
            if theirs_shapes != ours_shapes:
                raise CheckpointMismatchError(
                    f"checkpoint {prefix!r} was written for a different {path!r} optimizer: it holds "
                    f"{len(theirs_shapes)} variables of shapes {theirs_shapes[:6]}..., this one has {len(ours_shapes)} "
                    f"of shapes {ours_shapes[:6]}.... {fix}")

    def _check_optimizer_classes(self, prefix: str, saved: Dict[str, Any], mine: Dict[str, Any], fix: str) -> None:
        theirs = saved.get("optimizers")
        if theirs is None:
            return  # written by an older version: the variable check below is all there is
        ours = mine["optimizers"]
        if set(theirs) != set(ours):
            extra = [p for p in set(theirs) - set(ours) if isinstance(theirs[p], dict)
                     and str(theirs[p].get("class", "")).startswith("LossScaleOptimizer")]
            why = ""
            if extra and str(ours.get("optimizer", {}).get("class", "")).startswith("LossScaleOptimizer") and \
                    not str((theirs.get("optimizer") or {}).get("class", "")).startswith("LossScaleOptimizer"):
                why = (f" It was written by an earlier keras_scale whose ks.fit(..., accum=..., "
                       f"precision='mixed_float16') trained the wrapper's optimizer without loss scaling ({extra[0]!r} "
                       "was a second, unused LossScaleOptimizer); this version trains with loss scaling, so that run "
                       "cannot resume exactly: continue from its weights with restore='weights_only'.")
            raise CheckpointMismatchError(
                f"checkpoint {prefix!r} holds the optimizers {sorted(theirs)}, this model trains with {sorted(ours)}: "
                f"restoring would leave an optimizer's state behind or fresh.{why} {fix} To start from its model "
                f"weights only, pass ChiefCheckpoint(..., restore='weights_only').")
        for path in ours:
            a, b = theirs[path].get("class"), ours[path]["class"]
            if a != b:
                raise CheckpointMismatchError(
                    f"checkpoint {prefix!r} was written for a different optimizer: {a} as {path!r}, this run uses "
                    f"{b}: the slots of one "
                    f"mean something else to the other (even with the same shapes). Keep {a}, or start from the model "
                    f"weights only with ChiefCheckpoint(..., restore='weights_only') (fresh {b} state), or use a new "
                    f"directory.")

    def _build_from_data(self, iterator: Any, why: str) -> None:
        """Create the training state's variables from the data before the first step: Keras's symbolic build for a
        model with ``call()`` (it builds the compiled metrics too), and, for a model with its own ``train_step`` (the
        keras-io GAN, trained by plain Keras unbuilt), one trace of that step: its optimizers build at their first
        ``apply``; tracing runs nothing, reads no batch and moves no weight or seed."""
        from keras_scale.step import has_own_train_step

        model = self.model
        is_iterator = hasattr(iterator, "get_next") or hasattr(iterator, "__next__")
        spec = getattr(iterator, "element_spec", None) if is_iterator else iterator  # (or already the spec)
        try:
            if training_state._has_call(model) and not has_own_train_step(model):
                model._symbolic_build(data_batch=spec)
            training_state.build(model, iterator)
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(
                f"ChiefCheckpoint could not build the model from the data ({e}) {why}. Fix: build the model before "
                "fit (keras.Input(...) as its first layer, or model.build(input_shape))."
            ) from e

    def _start_variables(self) -> List[Any]:
        """The weights and every optimizer's variables (keras_scale.state), for the start state kept in memory."""
        return list(training_state.variables(self.model, include_metrics=False).values())

    def _epoch_skipped_variable(self) -> Optional[tf.Variable]:
        from keras_scale import step as ks_step

        step = ks_step.get_step(self.model, create=False)
        return None if step is None else step.epoch_skipped

