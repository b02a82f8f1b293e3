"""Tensor helpers the composed step's parts share (no part of the step itself).

Counting and checking non-finite values, scaling possibly sparse gradients, reading (distributed) variables, the
number of replicas. Each is a small pure function of tensors; :func:`_split_check` is the guard's once-per-process
check of all-reduced gradients inside a ``merge_call``.

Example:
    >>> import tensorflow as tf
    >>> bool(_all_gradients_finite([tf.constant([1.0, 2.0]), tf.constant([float("nan")])]))
    False
"""
from __future__ import annotations

from typing import Any, List

import tensorflow as tf


def _flat(structure: Any) -> List[Any]:
    return [t for t in tf.nest.flatten(structure) if t is not None]


def _nonfinite_count(t: Any) -> tf.Tensor:
    if isinstance(t, tf.IndexedSlices):
        t = t.values
    t = tf.convert_to_tensor(t)
    if not (t.dtype.is_floating or t.dtype.is_complex):
        return tf.constant(0.0)
    return tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(t)), tf.float32))


def _dense(g: Any) -> Any:
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _scaled(g: Any, factor: tf.Tensor, no_nan: bool = False) -> Any:
    """``g * factor`` keeping ``IndexedSlices`` sparse (Keras's optimizers treat sparse gradients their own way)."""
    mul = tf.math.multiply_no_nan if no_nan else tf.multiply
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(mul(g.values, tf.cast(factor, g.values.dtype)), g.indices, g.dense_shape)
    return mul(g, tf.cast(factor, g.dtype))


def _all_finite(g: Any) -> tf.Tensor:
    return tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))


def _all_gradients_finite(grads: List[Any]) -> tf.Tensor:
    """True when every element of every gradient is finite.

    One summing pass per gradient (a NaN or inf element makes the sum non-finite): about half the work of
    ``is_finite`` + ``reduce_all``, which writes a boolean tensor first. Only when the sum is not finite (an
    element is, or large finite values overflowed the sum) does the exact per-element check run.
    """
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    values = [v for v in values if v.dtype.is_floating]
    if not values:
        return tf.constant(True)
    sums = [tf.cast(tf.reduce_sum(v if v.dtype in (tf.float32, tf.float64) else tf.cast(v, tf.float32)),
                    tf.float32) for v in values]  # (a float64 sum beyond float32's range takes the exact path)
    total = tf.add_n(sums) if len(sums) > 1 else sums[0]
    return tf.cond(tf.math.is_finite(total), lambda: tf.constant(True),
                   lambda: tf.reduce_all([_all_finite(v) for v in values]))


_SAFE_MAGNITUDE = 1e38  # a sum of |gradients| below this (float32 max 3.4e38): no reduced element overflowed


def _magnitude(grads: List[Any]) -> tf.Tensor:
    """``sum_g ||g||_2`` over ``grads`` (float32): non-finite when an element is, and an upper bound of every
    element of the gradients' sum over replicas (``|sum_r g_r| <= sum_r |g_r| <= sum_r ||g_r||_2``), so it also
    catches an overflow in the all-reduce. One reading pass per gradient (no ``|g|`` tensor written first); a
    finite norm whose square overflowed only sends the decision to the exact check."""
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    sums = [tf.cast(tf.math.reduce_euclidean_norm(
        v if v.dtype in (tf.float32, tf.float64) else tf.cast(v, tf.float32)), tf.float32)
        for v in values if v.dtype.is_floating]
    if not sums:
        return tf.constant(0.0)
    return tf.add_n(sums) if len(sums) > 1 else sums[0]


def _values_finite(variables: List[Any]) -> tf.Tensor:
    return _all_gradients_finite([tf.convert_to_tensor(v) for v in variables])


def _split_check(distribution: Any, grads: List[Any]) -> tf.Tensor:
    """True when an all-reduced gradient holds a non-finite element: checked once, not once per replica.

    Called in the cross-replica context of several replicas in one process (MirroredStrategy), where every device
    holds an identical copy of each reduced gradient: the gradients are dealt out to the devices by size and each
    device checks its share on its own copy, in parallel, so the check reads every reduced element exactly once
    (the magnitude in the all-reduce, :func:`_magnitude`, costs one pass per replica). An overflow in the
    all-reduce shows as an inf in the reduced gradient, so it is caught too.
    """
    per_gradient = [distribution.experimental_local_results(g) for g in grads if g is not None]
    if not per_gradient:
        return tf.constant(False)
    num_devices = len(per_gradient[0])

    def size(t: Any) -> int:
        t = t.values if isinstance(t, tf.IndexedSlices) else t
        return t.shape.num_elements() or 0

    shares: List[List[Any]] = [[] for _ in range(num_devices)]
    loads = [0] * num_devices
    for copies in sorted(per_gradient, key=lambda c: -size(c[0])):  # largest first, to the least-loaded device
        d = loads.index(min(loads))
        shares[d].append(copies[d])
        loads[d] += size(copies[d])
    verdicts = []
    for share in shares:
        if share:
            with tf.device(share[0].device if not isinstance(share[0], tf.IndexedSlices) else share[0].values.device):
                verdicts.append(tf.logical_not(_all_gradients_finite(share)))
    return tf.reduce_any(tf.stack(verdicts))


def _replicas(strategy: Any) -> int:
    return int(strategy.num_replicas_in_sync)


def _read(variable: Any) -> tf.Tensor:
    """The current value of a (Keras or TF, possibly distributed) variable: this replica's in a replica context."""
    v = getattr(variable, "_value", variable)
    return v.read_value() if hasattr(v, "read_value") else tf.convert_to_tensor(v)


def _unique(variables: List[Any]) -> List[Any]:
    seen: set = set()
    return [v for v in variables if not (id(v) in seen or seen.add(id(v)))]
