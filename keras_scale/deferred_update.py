"""An optimizer update computed ahead of the guard's decision and written only after it.

Plain Keras lets each variable's update run as soon as that variable's gradient exists, so on a fast step the
optimizer's many small ops (Adam: about 25 per variable, most of them scalar) overlap the rest of the backward
pass. A guard that must see every gradient before it may touch any variable puts all of them after the last
gradient: on a ~2 ms MLP step that wait alone cost 13-15% (``benchmarks/nan_guard_cost.py``, arm "update waits,
no cond"), whatever the finite check costs.

Here the update is computed as values instead: Keras's own :class:`keras.StatelessScope` records what the
optimizer would write (its moments, ``iterations``, the weights) and lets the optimizer's later reads see those
values, exactly as ``stateless_apply`` does on JAX. Nothing is written until the guard's ``tf.cond`` decides;
the committed values are the same tensors the optimizer would have written in place (bit-identical updates), and
a skipped step writes nothing. The guarantee is unchanged: no non-finite gradient ever reaches a variable.

Used only where it is known to be exact (:func:`can_defer`): one replica and no distributed variables, a built-in
Keras optimizer of exactly that class (their ``update_step`` writes only through ``self.assign*``), no EMA, no
``gradient_accumulation_steps`` (Keras runs those in a cond of its own), dense gradients, and state small enough
to hold twice (:data:`MAX_DEFERRED_BYTES`: the pending values live beside the variables until the commit).
Anything else keeps the update inside the cond. A direct write found in the traced update is refused at trace time: the guarantee
would not hold.

Example:
    if can_defer(optimizer, grads, trainable):
        writes = deferred_writes(optimizer, lambda: optimizer.apply(grads, trainable), trainable)
        tf.cond(ok, lambda: commit(writes), lambda: tf.constant(False))
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Sequence, Tuple

import keras
import tensorflow as tf
from keras.src.backend.common.stateless_scope import StatelessScope

__all__ = ["can_defer", "deferred_writes", "commit", "MAX_DEFERRED_BYTES", "DEFERRABLE_OPTIMIZERS"]

# Keras's own optimizers whose update_step writes only through self.assign / assign_add / assign_sub (checked
# against keras/src/optimizers/*.py; Muon writes its weight decay directly, LossScaleOptimizer runs a cond).
DEFERRABLE_OPTIMIZERS: Tuple[type, ...] = tuple(
    getattr(keras.optimizers, name) for name in (
        "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Lamb", "Ftrl",
        "Adafactor") if hasattr(keras.optimizers, name))

# The weights and optimizer state held a second time (as pending values) until the commit. Above it the update
# stays inside the cond: a large model's update is bandwidth-bound and the wait is a small part of its step,
# while a second copy of its state could be the memory it does not have.
MAX_DEFERRED_BYTES = 256 << 20

_WRITE_OPS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "ResourceScatterUpdate",
                        "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterNdUpdate",
                        "ResourceScatterNdAdd", "ResourceScatterNdSub", "ResourceScatterMul",
                        "ResourceScatterDiv", "ResourceScatterMin", "ResourceScatterMax"})


def _nbytes(variables: Sequence[Any]) -> int:
    return sum(math.prod(int(d or 0) for d in tuple(v.shape))
               * tf.as_dtype(keras.backend.standardize_dtype(v.dtype)).size for v in variables)


def can_defer(optimizer: Any, grads: Sequence[Any], trainable_variables: Sequence[Any], replicas: int = 1) -> bool:
    """Whether ``optimizer``'s update of ``grads`` can be computed ahead and committed after a decision, exactly.

    Example:
        >>> import keras, tensorflow as tf
        >>> dense = keras.layers.Dense(1); dense.build((None, 2))
        >>> opt = keras.optimizers.Adam(); opt.build(dense.trainable_variables)
        >>> grads = [tf.zeros(v.shape) for v in dense.trainable_variables]
        >>> can_defer(opt, grads, dense.trainable_variables), can_defer(opt, grads, dense.trainable_variables, 2)
        (True, False)
    """
    if replicas != 1 or type(optimizer) not in DEFERRABLE_OPTIMIZERS or not getattr(optimizer, "built", False):
        return False
    if getattr(optimizer, "use_ema", False) or getattr(optimizer, "gradient_accumulation_steps", None):
        return False
    if any(isinstance(g, tf.IndexedSlices) for g in grads):
        return False
    if any(isinstance(getattr(v, "_value", v), tf.distribute.DistributedValues)
           for v in list(optimizer.variables) + list(trainable_variables)):
        return False  # (a MirroredStrategy of one device: its optimizer updates each device's copy)
    if any(getattr(v, "overwrite_with_gradient", False) for v in trainable_variables):
        return False
    return _nbytes(list(optimizer.variables) + list(trainable_variables)) <= MAX_DEFERRED_BYTES


def deferred_writes(optimizer: Any, apply: Callable[[], Any], trainable_variables: Sequence[Any]
                    ) -> List[Tuple[Any, tf.Tensor]]:
    """Trace ``apply()`` (an ``optimizer.apply``) writing nothing; return ``(variable, value)`` for each write.

    Call inside a traced function, only when :func:`can_defer` said so.

    Example:
        writes = deferred_writes(opt, lambda: opt.apply(grads, trainable), trainable)   # nothing written yet
    """
    known = list({id(v): v for v in list(optimizer.variables) + list(trainable_variables)}.values())
    by_tf = {id(v._value): v for v in known}
    scope = StatelessScope(initialize_variables=False)

    def keras_variable(var: Any) -> Any:
        """The Keras variable behind ``var``: a Keras variable, its tf.Variable, or its pending value (Keras's TF
        optimizer hands ``update_step`` ``variable.value``, which inside the scope is the pending tensor)."""
        if isinstance(var, keras.Variable):
            return var
        if id(var) in by_tf:
            return by_tf[id(var)]
        for k in known:
            if scope.get_current_value(k) is var:
                return k
        raise RuntimeError(f"keras_scale: the optimizer wrote to {getattr(var, 'name', var)}, which it does not "
                           f"own; its update cannot be deferred (please report this)")

    def assign(var: Any, value: Any) -> None:
        k = keras_variable(var)
        k.assign(tf.cast(value, k.dtype))

    def assign_add(var: Any, value: Any) -> None:
        k = keras_variable(var)
        k.assign(k.value + tf.cast(value, k.dtype))

    def assign_sub(var: Any, value: Any) -> None:
        k = keras_variable(var)
        k.assign(k.value - tf.cast(value, k.dtype))

    def apply_weight_decay(variables: Sequence[Any]) -> None:  # Keras's TF version writes the tf.Variable directly
        if optimizer.weight_decay is None:
            return
        for var in variables:
            if optimizer._use_weight_decay(var):
                k = keras_variable(var)
                lr = tf.cast(optimizer.learning_rate, k.dtype)
                wd = tf.cast(optimizer.weight_decay, k.dtype)
                k.assign(k.value - k.value * wd * lr)

    keras_key = type(optimizer)._var_key

    def var_key(variable: Any) -> Any:  # (inside the scope a Keras variable's .value is its pending tensor)
        if not isinstance(variable, keras.Variable) and id(variable) not in by_tf:
            variable = keras_variable(variable)
        return keras_key(optimizer, variable._value if isinstance(variable, keras.Variable) else variable)

    overrides = {"assign": assign, "assign_add": assign_add, "assign_sub": assign_sub,
                 "_apply_weight_decay": apply_weight_decay, "_var_key": var_key}
    saved = {name: vars(optimizer)[name] for name in overrides if name in vars(optimizer)}
    graph = tf.compat.v1.get_default_graph()
    first_op = len(graph.get_operations())
    for name, fn in overrides.items():
        object.__setattr__(optimizer, name, fn)
    try:
        with scope:
            apply()
    finally:
        for name in overrides:
            object.__delattr__(optimizer, name)
        for name, fn in saved.items():
            object.__setattr__(optimizer, name, fn)
    direct = sorted({op.type for op in graph.get_operations()[first_op:] if op.type in _WRITE_OPS})
    if direct:
        raise RuntimeError(f"keras_scale: {type(optimizer).__name__}'s update wrote a variable directly ({direct}); "
                           f"it cannot be deferred past the guard's decision (please report this)")
    writes = [(k, scope.get_current_value(k)) for k in known if scope.get_current_value(k) is not None]
    if len(writes) != len(scope.state_mapping):
        raise RuntimeError("keras_scale: the optimizer's update wrote a variable outside its own state; it cannot "
                           "be deferred past the guard's decision (please report this)")
    return writes


def commit(writes: Sequence[Tuple[Any, tf.Tensor]]) -> tf.Tensor:
    """Write what :func:`deferred_writes` returned (inside the branch of the guard's cond that applies).

    Example:
        tf.cond(ok, lambda: commit(writes), lambda: tf.constant(False))
    """
    for variable, value in writes:
        variable.assign(value)
    return tf.constant(True)
