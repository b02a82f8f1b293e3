"""THE ORDER of the composed train step: the one file to read for what happens in a step, and in which order.

Each line of :meth:`TrainStepMixin.train_step` hands over to one part (the module that holds it on the right)::

    snapshot       what a skipped step puts back (BatchNorm statistics, logged numbers)   apply.py
    1. accumulate  split the batch, forward+backward per micro-batch, sum               accumulate.py
                   (a split batch's losses, logged once)                                logs.py
    2. reduce      ONE all-reduce: gradients, loss flag, normaliser (gradient norms)    reduce.py
                   (no guard: apply, return the logs)                                   apply.py
    3. guard       decide bad/good on reduced values; what a bad step records           guard.py
    4. apply       the update, or skip it and put the snapshot back                     apply.py
    5. logs        the metrics' results (NaN while no step was taken) + nan_skipped     logs.py

A model with its own ``train_step`` runs that instead (:mod:`keras_scale.step.foreign`); which train function
Keras gets is :mod:`keras_scale.step.placement`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import tensorflow as tf
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_scale.step.model_checks import is_loss_scaled
from keras_scale.step.numerics import _flat, _replicas
from keras_scale.step.optimizer_switches import _LOCAL


class TrainStepMixin:
    """The step itself: :meth:`train_step`, the parts in their order (the parts are the other mixins of
    :class:`keras_scale.step.ComposedStep`; they meet on ``self``)."""

    def train_step(self, data: Any) -> Dict[str, Any]:
        """The train step Keras calls once per replica and batch."""
        model = self.model
        self.traces += 1
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        if self.splits and any(isinstance(t, tf.SparseTensor) for t in tf.nest.flatten((x, y, sample_weight))):
            raise ValueError(
                "keras_scale.wrap cannot split SparseTensor inputs into micro-batches. Convert them with "
                "tf.sparse.to_dense in the input pipeline, or train the model unwrapped.")
        if self.splits and any(c is not None and not c.built for c in (
                getattr(model, "_compile_loss", None), getattr(model, "_compile_metrics", None))):
            # (Keras builds them at the first trace without a strategy scope: here, before the micro-batch loop,
            # so their trackers exist outside it and the per-output ones are recorded once per step)
            model._symbolic_build(data_batch=data)
        optimizer = model.optimizer
        first = _flat(x)[0]
        batch_size = tf.shape(first)[0]

        # what a skipped step puts back, and the per-output loss trackers before this step            (apply.py)
        snapshot, outputs, logged, batch_size = self._snapshot(batch_size)

        # 1. split the batch, forward+backward per micro-batch, sum the gradients                  (accumulate.py)
        _LOCAL.metric_logs = None
        grads, trainable, share, loss_bad, pred_bad, stats = self._accumulate(x, y, sample_weight, batch_size)
        returned, _LOCAL.metric_logs = _LOCAL.metric_logs, None
        if stats is not None:  # a split batch's losses, logged once                                      (logs.py)
            self._record_split_logs(stats, batch_size, x, outputs, logged)
        # 2. ONE all-reduce: gradients, the loss flag, the normaliser, (checked) the gradients' norms  (reduce.py)
        # (the guard's gradient check travels in the all-reduce, see _all_reduce; with several replicas in this
        # process it is made once, in the merge_call that decides, on the reduced gradients: see _split_check)
        fold_check = self.guard and (self.check_gradients or is_loss_scaled(optimizer))
        split_check = fold_check and self._check_in_merge_call(optimizer)
        decide_on = loss_bad
        if self.guard and is_loss_scaled(optimizer):
            # a non-finite gradient is the loss scaler's business, a non-finite BatchNorm statistic (or any state
            # the forward pass wrote) is not: a NaN input under a relu can leave the loss finite, the scaler skips
            # the update as an overflow, and the statistics would keep the NaN. Agreed through the all-reduce.
            decide_on = loss_bad + tf.cast(tf.logical_not(self._forward_state_finite()), tf.float32)
        reduced_grads, any_loss_bad, present, local, grads_bad = self._all_reduce(
            grads, share, decide_on, batch_size, even=self._static_even(first, model),
            check=fold_check and not split_check)
        self._count_samples(batch_size, reduced_grads)

        if not self.guard:  # no guard: apply, and log what Keras logs                                  (apply.py)
            return self._apply_unguarded(optimizer, reduced_grads, trainable, returned)

        # 3. guard: decide bad or good on the reduced values, the same on every replica                (guard.py)
        if self.atomic_update:
            # accum="auto": an OOM anywhere in the step (a metric, the backward pass) must come before the decision,
            # or the loss-only guard counts a non-finite batch once per attempt
            deps = self._metric_reads() + [g.values if isinstance(g, tf.IndexedSlices) else g
                                           for g in reduced_grads if g is not None]
            with tf.control_dependencies(deps):
                any_loss_bad = tf.identity(any_loss_bad)
        bad = self._decide_bad(optimizer, any_loss_bad, [g for g in reduced_grads if g is not None],
                               grads_bad=tf.constant(False) if split_check else grads_bad)
        apply_now = self._apply_now(bad)
        # the first bad step's diagnosis runs in the guard's own skip branch: one cond per step, not two
        # (the gradients it counts are the reduced ones, as applied: a replica's own gradients, held to the end of the
        # step, kept the all-reduce from reusing their buffers, 5% of a 2-replica MLP step)
        replicas = _replicas(model.distribute_strategy)
        on_bad, inputs = self._on_bad(x, y, sample_weight, pred_bad, loss_bad, [reduced_grads[i] for i in present],
                                      present, trainable, gradient_share=1.0 / replicas, count=False)
        halting = self.halt_after_consecutive > 0

        def on_skip(values: List[Any], grads_bad: Optional[tf.Tensor]) -> Any:
            if not halting:  # skipped exactly when bad
                return on_bad(values[1:])
            bad_here = values[0] if grads_bad is None else tf.logical_or(values[0], grads_bad)
            return tf.cond(bad_here, lambda: on_bad(values[1:]), lambda: tf.constant(False))  # (or halted)

        # 4. apply the update, or skip it and put the snapshot back                                    (apply.py)
        grads_bad = self._conditional_apply(lambda g: optimizer.apply(g, trainable), reduced_grads, apply_now,
                                            snapshot, already_reduced=True, optimizer=optimizer, trainable=trainable,
                                            check_gradients=split_check, on_skip=on_skip, skip_inputs=[bad] + inputs)
        if split_check:
            bad = tf.logical_or(bad, grads_bad)
        self._count(bad)  # the guard's counters                                                       (guard.py)
        self._count_bad(tf.cast(bad, tf.int64))  # (adding 0 on a good step: cheaper than the ops in a branch)
        # 5. what Keras logs: the metrics' results (NaN while no step was taken), nan_skipped            (logs.py)
        return self._logs(self._nan_unless_a_step_was_taken(
            self._with_returned(model.get_metrics_result(), returned)))
