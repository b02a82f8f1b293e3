"""The switches the composed step sets on the optimizer (and, for a guarded own ``train_step``, on its metrics).

Part of the **one all-reduce per update** and **non-finite guard** parts: while the composed step traces, it tells
the optimizer, per thread (MirroredStrategy runs each replica in its own thread), that the gradients it hands over
are reduced already (:class:`_GradientsReduced`), or that a model's own ``train_step`` is guarded at its
``apply`` (:class:`_ThreadFlag` ``"guarding"``). Installed from the main thread through
:func:`keras_scale.lifecycle.patch`, so they go with the rest of keras_scale's state however the fit ends, and
transparent (Keras's own methods) unless the tracing thread asks.

Example:
    >>> with _ThreadFlag("already_reduced", True):
    ...     _LOCAL.already_reduced
    True
"""
from __future__ import annotations

import threading
from typing import Any, Dict

import keras
import tensorflow as tf

from keras_scale import lifecycle
from keras_scale.schedules import inner_optimizer

# Per thread (MirroredStrategy runs each replica in its own thread): what the composed step asks the optimizer
# to do while it traces. Nothing shared is mutated from replica threads.
_LOCAL = threading.local()
_INSTALL_LOCK = threading.Lock()


# ---------------------------------------------------------------- the two optimizer switches (installed from the
# main thread while the composed step is in place, through keras_scale.lifecycle; transparent unless the tracing
# thread asks)
def _install_optimizer_switches(model: keras.Model, owner: Any, optimizer: Any) -> None:
    """Let the tracing thread (1) hand already-reduced gradients to the optimizer, (2) guard a foreign step.

    Installed per optimizer from the main thread with :func:`keras_scale.lifecycle.patch` for ``owner`` (the
    model's :class:`ComposedStep`), so they are taken away with the rest of keras_scale's state however the fit
    ends; both forward to Keras's own methods unless the composed step switched them on in the current thread while
    tracing.
    """
    inner = inner_optimizer(optimizer)
    with _INSTALL_LOCK:
        if "_keras_scale_switches" not in vars(inner):
            keras_reduce = type(inner)._all_reduce_sum_gradients

            def _all_reduce_sum_gradients(grads_and_vars):
                if getattr(_LOCAL, "already_reduced", False) or id(inner) in _REDUCED_NOW:
                    return list(grads_and_vars)
                return keras_reduce(inner, grads_and_vars)

            lifecycle.patch(model, owner, inner, "_all_reduce_sum_gradients", _all_reduce_sum_gradients)
            lifecycle.patch(model, owner, inner, "_keras_scale_switches", True)
        if "_keras_scale_guarded_apply" not in vars(optimizer):
            keras_apply = type(optimizer).apply

            def apply(grads, trainable_variables=None):
                step = getattr(_LOCAL, "guarding", None)
                if step is None:
                    return keras_apply(optimizer, grads, trainable_variables)
                return step._guarded_foreign_apply(
                    lambda g: keras_apply(optimizer, g, trainable_variables), optimizer, grads,
                    trainable_variables)

            lifecycle.patch(model, owner, optimizer, "apply", apply)
            lifecycle.patch(model, owner, optimizer, "_keras_scale_guarded_apply", True)


def _install_metric_switch(model: keras.Model, owner: Any, metric: Any) -> None:
    """A guarded foreign step updates ``metric`` only when none of the step's optimizer updates so far was skipped.

    A model's own ``train_step`` (keras-io's VAE, a GAN) updates its ``Mean`` trackers after ``apply``: a skipped
    step must not add its NaN loss to them, or every later log of the epoch is NaN; the step then logs the trackers
    as they were, as plain Keras logs them without that batch. Forwards to Keras's own method unless the tracing
    thread runs a guarded foreign step (installed through :func:`keras_scale.lifecycle.patch`, like the optimizer
    switches).
    """
    from keras_scale import lifecycle

    if "_keras_scale_metric_switch" in vars(metric) or not getattr(metric, "built", True):
        return
    keras_update = metric.update_state

    def update_state(*args: Any, **kwargs: Any) -> Any:
        verdicts = getattr(_LOCAL, "foreign_verdicts", None)
        if getattr(_LOCAL, "guarding", None) is None or not verdicts:
            return keras_update(*args, **kwargs)
        skipped = tf.reduce_any(tf.stack(verdicts))
        return tf.cond(skipped, lambda: tf.constant(False),
                       lambda: (keras_update(*args, **kwargs), tf.constant(True))[1])

    with _INSTALL_LOCK:
        lifecycle.patch(model, owner, metric, "update_state", update_state)
        lifecycle.patch(model, owner, metric, "_keras_scale_metric_switch", True)


# inner optimizers (by id) whose gradients are reduced already while their update is traced: seen by every thread of
# that trace, also the replica threads a LossScaleOptimizer's own merge_call starts (which miss a thread-local flag)
_REDUCED_NOW: Dict[int, int] = {}


class _GradientsReduced:
    """While ``optimizer``'s update of already-reduced gradients is traced: it must not sum them over the replicas
    again, in this thread or any other of the trace."""

    def __init__(self, optimizer: Any) -> None:
        self.key = id(inner_optimizer(optimizer))
        self.flag = _ThreadFlag("already_reduced", True)

    def __enter__(self) -> None:
        with _INSTALL_LOCK:
            _REDUCED_NOW[self.key] = _REDUCED_NOW.get(self.key, 0) + 1
        self.flag.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.flag.__exit__(*exc)
        with _INSTALL_LOCK:
            _REDUCED_NOW[self.key] -= 1
            if not _REDUCED_NOW[self.key]:
                del _REDUCED_NOW[self.key]


class _ThreadFlag:
    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value

    def __enter__(self) -> None:
        self.previous = getattr(_LOCAL, self.name, None)
        setattr(_LOCAL, self.name, self.value)

    def __exit__(self, *exc: Any) -> None:
        setattr(_LOCAL, self.name, self.previous)
