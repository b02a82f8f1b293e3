"""Part 4 of the composed step, **apply or skip**: the optimizer's update, or the state put back.

Before the step, :meth:`ApplyMixin._snapshot` keeps what a skipped step must put back (BatchNorm statistics,
the logged loss and metrics); unguarded, the reduced gradients go straight to the optimizer
(:meth:`ApplyMixin._apply_unguarded`); guarded, :meth:`ApplyMixin._conditional_apply` applies the update only
when the guard's decision says so, identical on every replica (in a cross-replica ``merge_call`` when the
strategy needs one), and on one replica with an optimizer :mod:`keras_scale.deferred_update` knows, computes
the update ahead and lets only its writes wait for the decision.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from keras_scale import deferred_update
from keras_scale.step.numerics import _read, _replicas, _split_check, _unique
from keras_scale.step.optimizer_switches import _GradientsReduced, _ThreadFlag


class ApplyMixin:
    """The apply-or-skip part of :class:`keras_scale.step.ComposedStep`."""

    def _snapshot(self, batch_size: tf.Tensor) -> Tuple[List[Tuple[Any, Any]], List[Any], List[Tuple[Any, Any]],
                                                        tf.Tensor]:
        """Before the step: ``(snapshot, outputs, logged, batch_size)``: what a skipped step puts back (guarded:
        ``(variable, value)`` of the BatchNorm statistics and metric variables), the per-output loss trackers of a
        split batch and their values, and ``batch_size`` made to wait for those reads."""
        model = self.model
        snapshot = []
        if self.guard:  # restored on a skipped step: a bad step must not move BatchNorm statistics, nor the
            # logged loss and metrics (a step not taken contributes nothing to them, finite micro-batches included)
            snapshot = [(v, tf.identity(v)) for v in _unique(list(model.non_trainable_variables)
                                                              + list(model.metrics_variables))]
        outputs = self._output_trackers() if self.splits else []
        logged = [(_read(m.total), _read(m.count)) for m in outputs]  # per-output trackers before this step
        with tf.control_dependencies([s for _, s in snapshot] + [t for pair in logged for t in pair]):
            batch_size = tf.identity(batch_size)
        return snapshot, outputs, logged, batch_size

    def _apply_unguarded(self, optimizer: Any, reduced_grads: List[Any], trainable: List[Any],
                         returned: Any) -> Dict[str, Any]:
        """No guard: hand the reduced gradients to the optimizer (its own all-reduce switched off); the step's logs.

        ``accum="auto"`` (``atomic_update``): the update waits for every gradient and metric update, so a step that
        fails (OOM) changes nothing."""
        model = self.model
        barrier = [g.values if isinstance(g, tf.IndexedSlices) else g
                   for g in reduced_grads if g is not None] if self.atomic_update else []
        if self.atomic_update:  # and on the metric updates: an OOM in a metric must come before the update
            barrier += [tf.identity(v) for v in self._metric_reads()]
        with _GradientsReduced(optimizer), tf.control_dependencies(barrier):
            optimizer.apply(reduced_grads, trainable)
        return self._with_returned(model.get_metrics_result(), returned)

    def _conditional_apply(self, apply: Callable[[Any], Any], grads: List[Any], apply_now: tf.Tensor,
                           snapshot: List[Tuple[Any, Any]], already_reduced: bool, optimizer: Any = None,
                           trainable: Optional[List[Any]] = None, check_gradients: bool = False,
                           on_skip: Optional[Callable[[List[Any], Optional[tf.Tensor]], Any]] = None,
                           skip_inputs: List[Any] = ()) -> Optional[tf.Tensor]:
        """Apply the update only when ``apply_now`` (identical on every replica); else restore BN statistics.

        ``check_gradients`` (several replicas in this process, ``grads`` already reduced): also skip when a reduced
        gradient is not finite, checked once inside the merge_call (:func:`_split_check`); returns that verdict
        (``None`` otherwise). ``on_skip(skip_inputs, grads_bad)`` runs in the skip branch, on each replica with its
        own ``skip_inputs`` (tensors; they travel as merge_call arguments).

        On one replica, with an optimizer :mod:`keras_scale.deferred_update` knows to be exact, the update is
        computed ahead (overlapping the backward pass, as in plain Keras) and only its writes wait in the cond.

        A ``merge_call`` cannot sit inside a replica-context ``tf.cond``, so (like Keras's
        ``LossScaleOptimizer``) merge into the cross-replica context unconditionally and decide there. Each
        replica's own gradients and snapshot travel as ``merge_call`` arguments (a closure would hand replica
        0's values to every replica).
        """
        variables = [v for v, _ in snapshot]

        def apply_fn(grads):
            # (reduced gradients: also for the replica threads of an optimizer that merges again, as
            # LossScaleOptimizer does, which must not sum them over the replicas a second time)
            with _GradientsReduced(optimizer) if already_reduced and optimizer is not None \
                    else _ThreadFlag("already_reduced", already_reduced):
                apply(grads)

        def restore_fn(values):
            for var, value in zip(variables, values):
                var.assign(value)

        values = [s for _, s in snapshot]

        skip_inputs = list(skip_inputs)

        def restore_and_record(values, inputs, grads_bad=None):
            restore_fn(values)
            if on_skip is not None:
                on_skip(inputs, grads_bad)

        def skip():
            restore_and_record(values, skip_inputs)
            return tf.constant(False)

        trainable = list(trainable or [])
        if optimizer is not None and not check_gradients and deferred_update.can_defer(
                optimizer, grads, trainable, replicas=_replicas(self.model.distribute_strategy)):
            writes = deferred_update.deferred_writes(optimizer, lambda: apply_fn(grads), trainable)
            tf.cond(apply_now, lambda: deferred_update.commit(writes), skip)
            return None
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            tf.cond(apply_now, lambda: (apply_fn(grads), tf.constant(True))[1], skip)
            return None

        def cross_replica(distribution, apply_now, grads, values, inputs):
            flag = distribution.experimental_local_results(apply_now)[0]
            grads_bad = None
            if check_gradients:
                grads_bad = _split_check(distribution, grads)
                flag = tf.logical_and(flag, tf.logical_not(grads_bad))

            def yes():
                distribution.extended.call_for_each_replica(apply_fn, args=(grads,))
                return tf.constant(True)

            def no():
                distribution.extended.call_for_each_replica(
                    lambda v, i: restore_and_record(v, i, grads_bad), args=(values, inputs))
                return tf.constant(False)

            tf.cond(flag, yes, no)
            return grads_bad

        return tf.distribute.get_replica_context().merge_call(cross_replica,
                                                              args=(apply_now, grads, values, skip_inputs))
