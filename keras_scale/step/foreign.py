"""The composed step for a model with its **own** ``train_step`` (a GAN, keras.io's VAE): run it, guard its
optimizer.

Such a model's batch cannot be split (``wrap`` refuses it), but ``NanGuard`` still guards it: its step runs
unchanged, and each ``optimizer.apply`` it makes is checked at the optimizer (where optax's ``apply_if_finite``
sits, through :mod:`keras_scale.step.optimizer_switches`), skipped when a gradient is non-finite on any replica;
the step counts as bad, once, when any of its updates was skipped.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import tensorflow as tf
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_scale.step.numerics import _all_gradients_finite, _flat, _replicas, _unique
from keras_scale.step.optimizer_switches import _LOCAL, _ThreadFlag


class ForeignStepMixin:
    """The own-``train_step`` part of :class:`keras_scale.step.ComposedStep`."""

    def _foreign_train_step(self, data: Any) -> Dict[str, Any]:
        """A model with its own ``train_step``: run it; NanGuard's check sits at its optimizer's ``apply``."""
        self.traces += 1
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        first = _flat(x)
        if first:
            self._count_samples(tf.shape(first[0])[0], [])
        if not self.guard:
            return self.model.train_step(data)
        snapshot = [(v, tf.identity(v)) for v in self.model.non_trainable_variables]
        # (metric variables: a tracker updated before the apply is put back after a skipped step; those updated
        # after it were not touched, see _install_metric_switch)
        metric_snapshot = [(v, tf.identity(v)) for v in _unique(list(self.model.metrics_variables))]
        verdicts: List[tf.Tensor] = []  # one per optimizer update of this step (a GAN applies two)
        with _ThreadFlag("guarding", self), _ThreadFlag("foreign_data", (x, y, sample_weight, snapshot)), \
                _ThreadFlag("foreign_verdicts", verdicts):
            logs = self.model.train_step(data)
        if verdicts:  # the step is bad when ANY of its updates was skipped: counted once per step
            step_bad = tf.reduce_any(tf.stack(verdicts))
            self._count(step_bad)

            def on_bad() -> tf.Tensor:
                self._count_bad()
                for var, value in metric_snapshot:
                    var.assign(value)
                return tf.constant(True)

            with tf.control_dependencies([t for t in tf.nest.flatten(logs) if tf.is_tensor(t)]):
                tf.cond(step_bad, on_bad, lambda: tf.constant(False))
        return self._logs(logs)

    def _guarded_foreign_apply(self, apply: Callable[[Any], Any], optimizer: Any, grads: Any,
                               trainable_variables: Any) -> Any:
        """``optimizer.apply`` inside a guarded foreign step: apply only when every replica's gradient is finite."""
        grads = list(grads)
        x, y, sample_weight, snapshot = getattr(_LOCAL, "foreign_data", (None, None, None, []))
        present = [i for i, g in enumerate(grads) if g is not None]
        local_bad = tf.cast(tf.logical_not(_all_gradients_finite([grads[i] for i in present])), tf.float32)
        if _replicas(self.model.distribute_strategy) > 1:
            local_bad = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, local_bad)
        bad = self._decide_bad(optimizer, tf.constant(False), [], grads_bad=local_bad > 0)
        apply_now = self._apply_now(bad)
        trainable = list(trainable_variables) if trainable_variables is not None else list(
            optimizer._trainable_variables)
        with _ThreadFlag("guarding", None):  # the inner apply is Keras's own
            self._conditional_apply(apply, grads, apply_now, snapshot, already_reduced=False, optimizer=optimizer,
                                    trainable=trainable)
        verdicts = getattr(_LOCAL, "foreign_verdicts", None)
        earlier_bad = tf.reduce_any(tf.stack(verdicts)) if verdicts else tf.constant(False)
        self._record(bad, x, y, sample_weight, tf.constant(0.0), tf.constant(0.0), [grads[i] for i in present],
                     present, trainable, count=verdicts is None, diagnose=tf.logical_not(earlier_bad))
        if verdicts is not None:
            verdicts.append(bad)
        return optimizer.iterations
