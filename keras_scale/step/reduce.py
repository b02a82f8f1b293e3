"""Part 2 of the composed step, **one all-reduce per update**: gradients, flags and normaliser in one collective.

The accumulated gradients, the "a loss was non-finite" flag, the batch's loss normaliser (when the replicas'
batches can be uneven) and, when the guard checks gradients on several replicas, the sum of the gradients' norms
travel in ONE all-reduce; the optimizer then gets the global mean gradient with its own all-reduce switched off
(:mod:`keras_scale.step.optimizer_switches`). Also counts the samples each replica trained on.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import keras
import tensorflow as tf

from keras_scale.step.model_checks import is_loss_scaled
from keras_scale.step.numerics import _SAFE_MAGNITUDE, _all_gradients_finite, _magnitude, _replicas, _scaled


class ReduceMixin:
    """The all-reduce part of :class:`keras_scale.step.ComposedStep`."""

    def _all_reduce(self, grads: List[Any], share: Optional[tf.Tensor], loss_bad: tf.Tensor,
                    batch_size: tf.Tensor, even: bool = False, check: bool = False
                    ) -> Tuple[List[Any], tf.Tensor, List[int], List[Any], Optional[tf.Tensor]]:
        """ONE all-reduce per update: gradients, the non-finite-loss flag and the normaliser; the global mean.

        Each replica holds ``A_r = sum_k f_k grad_k / R`` (``f_k`` a micro-batch's share of the replica's batch,
        times its valid-mask fraction when masked) and ``N_r = sum_k f_k`` (``None``: exactly 1, no mask). With
        ``B_r`` samples per replica the big-batch gradient is ``sum_r B_r A_r / (sum_r B_r N_r / R)``, which is
        Keras's plain sum of ``A_r`` when the replicas' batches are even; uneven last batches (7 samples on 2
        replicas) get the global mean, not the mean of per-replica means.

        ``even``: the per-replica batch has a static size (tf.distribute gives uneven splits an unknown size), so
        every replica holds ``B`` samples and, unmasked, the plain sum IS the global mean: no scaling pass
        before or after the all-reduce and no normaliser in it. ``check`` (a guard that checks gradients, on
        several replicas): each replica adds its gradients' norms (:func:`_magnitude`) to the same all-reduce, so the decision needs no
        pass over the reduced gradients: the reduced sum is finite and far from overflow exactly when no reduced
        gradient element can be non-finite (else the exact per-element check runs). Returns the reduced
        gradients, the any-loss-bad flag, the present indices, this replica's gradients, and (``check``) whether
        a reduced gradient is non-finite (``None``: decide from the reduced gradients).
        """
        present = [i for i, g in enumerate(grads) if g is not None]
        local = [grads[i] for i in present]
        replicas = _replicas(self.model.distribute_strategy)
        reduced_grads: List[Any] = [None] * len(grads)
        if replicas == 1:
            for i in present:
                reduced_grads[i] = grads[i] if share is None else _scaled(grads[i], tf.math.divide_no_nan(1.0, share))
            return reduced_grads, loss_bad > 0, present, local, None
        if even and share is None:
            payload, extra = list(local), [loss_bad]
        else:
            b = tf.cast(batch_size, tf.float32)
            weight = b if share is None else b * share
            payload = [_scaled(g, b, no_nan=True) for g in local]  # an empty replica adds 0, not 0 * NaN
            extra = [loss_bad, weight]
        if check:
            extra.append(_magnitude(payload))
        reduced = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, payload + extra)
        summed, reduced_extra = reduced[:len(payload)], reduced[len(payload):]
        scale = None
        if len(extra) - int(check) == 2:  # the normaliser: scale to the global mean
            scale = tf.math.divide_no_nan(float(replicas), reduced_extra[1])
            summed = [_scaled(g, scale) for g in summed]
        for i, g in zip(present, summed):
            reduced_grads[i] = g
        grads_bad = None
        if check:
            bound = reduced_extra[-1] if scale is None else reduced_extra[-1] * tf.maximum(scale, 1.0)
            safe = tf.logical_and(tf.math.is_finite(bound), bound < _SAFE_MAGNITUDE)
            grads_bad = tf.cond(safe, lambda: tf.constant(False),
                                lambda: tf.logical_not(_all_gradients_finite(summed)))
        return reduced_grads, reduced_extra[0] > 0, present, local, grads_bad

    def _check_in_merge_call(self, optimizer: Any) -> bool:
        """Several replicas in this process (a merge_call decides): check the reduced gradients there, once
        (:func:`_split_check`). Loss-scaled optimizers keep the norms in the all-reduce (their scale floor)."""
        return (not is_loss_scaled(optimizer) and _replicas(self.model.distribute_strategy) > 1
                and not tf.__internal__.distribute.strategy_supports_no_merge_call())

    @staticmethod
    def _static_even(first: Any, model: keras.Model) -> bool:
        """Every replica's batch has the same size: a static per-replica size under one process (tf.distribute gives
        an uneven split an unknown size). Workers shard and batch their own data, so a static size on this worker
        says nothing about the others': multi-worker never counts as even."""
        from keras_scale.distribute import is_multi_worker

        return first.shape[0] is not None and not is_multi_worker(model.distribute_strategy)

    def _count_samples(self, batch_size: tf.Tensor, after: List[Any]) -> None:
        """Add this replica's batch to ``samples_seen``, once the step got that far (an OOM retried by
        ``accum="auto"`` raises before: its batch is counted once, by the retry)."""
        deps = [g.values if isinstance(g, tf.IndexedSlices) else g for g in after if g is not None]
        with tf.control_dependencies(deps):
            self.samples_seen.assign_add(tf.cast(batch_size, tf.int64))
