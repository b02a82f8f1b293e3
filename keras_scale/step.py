"""The composed train step: ONE place where everything inside a training step happens.

Parts, each switched on by the piece that needs it and otherwise free:

- **accumulation** (``keras_scale.wrap``): split the batch ``fit`` delivers into micro-batches, run
  forward+backward on one micro-batch at a time, sum the sample-weighted gradients;
- **one all-reduce per update**: the accumulated gradients (plus one "loss was non-finite" flag) are
  all-reduced once, then handed to the optimizer with its own all-reduce switched off, so clipping,
  weight decay, EMA and loss scaling see the global gradient, exactly as on one device;
- **non-finite guard** (``keras_scale.NanGuard``): a step whose loss or gradients are not finite applies no
  update at all (no optimizer moment, no ``iterations`` bump, BatchNorm statistics restored); every replica
  takes the same decision because it is made on reduced values; counters and a diagnosis of the first bad
  step live in variables, read by the host only when it wants to (no per-step sync);
- **loss scaling**: a ``LossScaleOptimizer`` scales each micro-batch, unscales once, and makes one
  finite/non-finite decision per update.

Callbacks never re-implement ``train_step``: they call :func:`get_step` and switch parts on.

Example:
    >>> from keras_scale.step import get_step, install
    >>> step = install(model)              # plain model: its train_step becomes the composed step
    >>> step.configure(guard=True)         # what NanGuard does
    >>> model.make_train_function(force=True)
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, List, Optional, Tuple

import keras
import tensorflow as tf
from keras.src.losses import loss as keras_loss
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_scale.sync_bn import batchnorm_layers

__all__ = ["ComposedStep", "get_step", "install", "uninstall", "state_variables", "DIAG_CAPACITY"]

_STEP_ATTR = "_keras_scale_step"
DIAG_CAPACITY = 4096  # slots of the first-bad-step diagnosis vector


def _flat(structure: Any) -> List[Any]:
    return [t for t in tf.nest.flatten(structure) if t is not None]


def _nonfinite_count(t: Any) -> tf.Tensor:
    t = tf.convert_to_tensor(t)
    if not (t.dtype.is_floating or t.dtype.is_complex):
        return tf.constant(0.0)
    return tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(t)), tf.float32))


def _inner_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "inner_optimizer", optimizer)


def is_loss_scaled(optimizer: Any) -> bool:
    """True for Keras's ``LossScaleOptimizer`` (mixed_float16)."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


@contextlib.contextmanager
def _optimizer_without_all_reduce(optimizer: Any):
    """While tracing, make the (inner) optimizer take already all-reduced gradients as they are."""
    inner = _inner_optimizer(optimizer)
    had = "_all_reduce_sum_gradients" in vars(inner)
    previous = vars(inner).get("_all_reduce_sum_gradients")
    object.__setattr__(inner, "_all_reduce_sum_gradients", lambda grads_and_vars: list(grads_and_vars))
    try:
        yield
    finally:
        if had:
            object.__setattr__(inner, "_all_reduce_sum_gradients", previous)
        else:
            object.__delattr__(inner, "_all_reduce_sum_gradients")


def _has_synchronized_batchnorm(model: keras.Model) -> bool:
    return any(getattr(layer, "synchronized", False) for layer in batchnorm_layers(model))


def _split_bounds(batch_size: tf.Tensor, num_micro: tf.Tensor, k: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """Start and size of micro-batch ``k`` when ``batch_size`` is split into ``num_micro`` near-equal parts."""
    base = batch_size // num_micro
    rem = batch_size % num_micro
    start = k * base + tf.minimum(k, rem)
    size = base + tf.cast(k < rem, batch_size.dtype)
    return start, size


def _slice(structure: Any, start: tf.Tensor, size: tf.Tensor) -> Any:
    return tf.nest.map_structure(lambda t: None if t is None else t[start:start + size], structure)


class ComposedStep:
    """The composed train step of one model, and the state of its parts.

    Created by :func:`get_step` (which attaches it to the model); the wrapper from ``keras_scale.wrap`` and
    the callbacks configure it. Its variables (counters, halt flag, diagnosis) are returned by
    :meth:`variables` so checkpoints carry them.

    Example:
        >>> step = get_step(model)
        >>> step.configure(accum=4, guard=True)
        >>> int(step.skipped_steps.numpy())
        0
    """

    def __init__(self, model: keras.Model) -> None:
        self.model = model
        self.accum: Optional[int] = None
        self.micro_batch_size: Optional[int] = None
        self.guard = False
        self.halt_after_consecutive = 0  # 0: never halt in-graph; N: stop applying after N bad steps in a row
        self.unrolled: Optional[bool] = None  # None: decide (synchronized BN or XLA -> unrolled)
        self.diag_names: List[str] = []
        self.traced_micro_batches: Optional[int] = None  # set while tracing (static count) for tests/benchmarks
        with model.distribute_strategy.scope():
            self.skipped_steps = self._var("skipped_steps", 0, tf.int64)
            self.consecutive_bad = self._var("consecutive_bad", 0, tf.int64)
            self.halted = self._var("halted", 0, tf.int64)
            self.incidents = self._var("incidents", 0, tf.int64)  # bad steps since the host last looked
            self.diag = self._var("diag", tf.zeros([DIAG_CAPACITY]), tf.float32,
                                  aggregation=tf.VariableAggregation.SUM)

    @staticmethod
    def _var(name: str, value: Any, dtype: tf.DType,
             aggregation: tf.VariableAggregation = tf.VariableAggregation.ONLY_FIRST_REPLICA) -> tf.Variable:
        # ON_READ: each replica updates its own copy without a merge_call (legal inside loops and conds);
        # the step updates every copy identically from all-reduced values, so the first replica speaks for all.
        return tf.Variable(value, dtype=dtype, trainable=False, name=f"keras_scale_{name}",
                           synchronization=tf.VariableSynchronization.ON_READ, aggregation=aggregation)

    # ---------------------------------------------------------------- configuration
    def configure(self, accum: Optional[int] = None, micro_batch_size: Optional[int] = None,
                  guard: Optional[bool] = None, halt_after_consecutive: Optional[int] = None) -> "ComposedStep":
        """Switch parts on or off; call ``model.make_train_function(force=True)`` afterwards if already traced.

        Example:
            >>> get_step(model).configure(guard=True, halt_after_consecutive=1)
        """
        if accum is not None:
            self.accum, self.micro_batch_size = int(accum), None
        if micro_batch_size is not None:
            self.micro_batch_size, self.accum = int(micro_batch_size), None
        if guard is not None:
            self.guard = bool(guard)
        if halt_after_consecutive is not None:
            self.halt_after_consecutive = int(halt_after_consecutive)
        return self

    def variables(self) -> Dict[str, tf.Variable]:
        """The step's state, by name (for checkpoints)."""
        return {"skipped_steps": self.skipped_steps, "consecutive_bad": self.consecutive_bad,
                "halted": self.halted}

    @property
    def splits(self) -> bool:
        return (self.accum or 1) > 1 or self.micro_batch_size is not None

    # ---------------------------------------------------------------- the step
    def train_step(self, data: Any) -> Dict[str, Any]:
        """The train step Keras calls once per replica and batch (installed as ``model.train_step``)."""
        model = self.model
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        optimizer = model.optimizer
        trainable = list(model.trainable_weights)
        first = _flat(x)[0]
        batch_size = tf.shape(first)[0]

        snapshot = []
        if self.guard:  # restored on a skipped step: a bad step must not move BatchNorm statistics either
            snapshot = [(v, tf.identity(v)) for v in model.non_trainable_variables]
        with tf.control_dependencies([s for _, s in snapshot]):
            batch_size = tf.identity(batch_size)

        grads, loss_bad, pred_bad = self._accumulate(x, y, sample_weight, batch_size, trainable)

        # ---- one all-reduce for the whole update: gradients + "some replica saw a non-finite loss"
        present = [i for i, g in enumerate(grads) if g is not None]
        local = [grads[i] for i in present]
        ctx = tf.distribute.get_replica_context()
        if model.distribute_strategy.num_replicas_in_sync > 1 or _is_multi_worker(model.distribute_strategy):
            reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, local + [loss_bad])
        else:
            reduced = local + [loss_bad]
        reduced_grads: List[Any] = [None] * len(grads)
        for i, g in zip(present, reduced[:-1]):
            reduced_grads[i] = g
        any_loss_bad = reduced[-1] > 0

        if not self.guard:
            with _optimizer_without_all_reduce(optimizer):
                optimizer.apply(reduced_grads, trainable)
        else:
            if is_loss_scaled(optimizer):
                # a gradient overflow is the loss scaler's business (it skips and lowers the scale);
                # only a non-finite loss is an incident
                bad = any_loss_bad
            else:
                grads_ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in reduced[:-1]])
                bad = tf.logical_or(any_loss_bad, tf.logical_not(grads_ok))
            halted = self.halted.read_value() > 0
            apply_now = tf.logical_and(tf.logical_not(bad), tf.logical_not(halted))
            self._conditional_apply(optimizer, reduced_grads, trainable, apply_now, snapshot)
            self._record(bad, x, y, sample_weight, pred_bad, loss_bad, local, present, trainable)
        return model.get_metrics_result()

    def _accumulate(self, x, y, sample_weight, batch_size, trainable):
        """Sum over micro-batches of ``size_k / batch_size * grad(loss_k)`` (= the big-batch gradient)."""
        if not self.splits:
            grads, loss, y_pred = self._micro_step(x, y, sample_weight, batch_size, tf.constant(1.0))
            self.traced_micro_batches = 1
            return grads, self._loss_bad(loss), self._pred_bad(y_pred)

        if self.accum is not None:
            num_micro_static: Optional[int] = self.accum
            # a trailing (or per-replica) batch smaller than accum is split into fewer micro-batches; the
            # configured batch size is checked against accum at fit start (AccumulatingModel.fit)
            num_micro = tf.minimum(tf.constant(self.accum, batch_size.dtype), batch_size)
        else:
            mbs = self.micro_batch_size
            num_micro = (batch_size + mbs - 1) // mbs
            static_b = tf.get_static_value(batch_size)
            num_micro_static = None if static_b is None else int(math.ceil(static_b / mbs))

        unrolled = self.unrolled
        if unrolled is None:
            unrolled = _has_synchronized_batchnorm(self.model) or bool(self.model.jit_compile)
        fbatch = tf.cast(batch_size, tf.float32)

        if unrolled:
            if num_micro_static is None:
                raise ValueError(
                    "keras_scale.wrap(micro_batch_size=...) with synchronized BatchNorm or jit_compile needs a "
                    "static batch size; batch with drop_remainder=True or use wrap(model, accum=N).")
            self.traced_micro_batches = num_micro_static
            # the unrolled loop has a static number of micro-batches: each must hold at least one sample
            tf.debugging.assert_greater_equal(
                batch_size, tf.constant(num_micro_static, batch_size.dtype),
                message=f"keras_scale.wrap: with synchronized BatchNorm or jit_compile every per-replica batch needs "
                        f">= {num_micro_static} samples (one per micro-batch); batch with drop_remainder=True.")
            acc, loss_bad, pred_bad = None, tf.constant(0.0), tf.constant(0.0)
            deps: List[Any] = []
            for k in range(num_micro_static):
                with tf.control_dependencies(deps):  # one micro-batch's activations alive at a time
                    start, size = _split_bounds(batch_size, num_micro, tf.constant(k, batch_size.dtype))
                    start = tf.identity(start)
                grads, loss, y_pred = self._micro_step(
                    _slice(x, start, size), _slice(y, start, size), _slice(sample_weight, start, size),
                    size, tf.cast(size, tf.float32) / fbatch)
                acc = grads if acc is None else [
                    a if g is None else (g if a is None else a + g) for a, g in zip(acc, grads)]
                loss_bad += self._loss_bad(loss)
                pred_bad += self._pred_bad(y_pred)
                deps = [a for a in acc if a is not None]
            return acc, loss_bad, pred_bad

        self.traced_micro_batches = None  # dynamic (tf.while_loop)
        none_grads: set = set()

        def body(k, acc, loss_bad, pred_bad):
            start, size = _split_bounds(batch_size, num_micro, k)
            grads, loss, y_pred = self._micro_step(
                _slice(x, start, size), _slice(y, start, size), _slice(sample_weight, start, size),
                size, tf.cast(size, tf.float32) / fbatch)
            new_acc = []
            for i, (a, g) in enumerate(zip(acc, grads)):
                if g is None:
                    none_grads.add(i)
                    new_acc.append(a)
                else:
                    new_acc.append(a + tf.cast(tf.convert_to_tensor(g), a.dtype))
            return k + 1, new_acc, loss_bad + self._loss_bad(loss), pred_bad + self._pred_bad(y_pred)

        zeros = [tf.zeros(v.shape, dtype=v.dtype) for v in trainable]
        _, acc, loss_bad, pred_bad = tf.while_loop(
            lambda k, *_: k < num_micro, body,
            [tf.constant(0, batch_size.dtype), zeros, tf.constant(0.0), tf.constant(0.0)],
            parallel_iterations=1)
        acc = [None if i in none_grads else a for i, a in enumerate(acc)]
        return acc, loss_bad, pred_bad

    def _micro_step(self, x, y, sample_weight, size, weight):
        """Forward + backward of one micro-batch; updates loss tracker and metrics (skipping a NaN loss)."""
        model = self.model
        optimizer = model.optimizer
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            scaled = optimizer.scale_loss(loss) if optimizer is not None else loss
            scaled = scaled * tf.cast(weight, scaled.dtype)
        grads = tape.gradient(scaled, list(model.trainable_weights))

        def record():
            model._loss_tracker.update_state(keras_loss.unscale_loss_for_distribution(loss), sample_weight=size)
            model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            return tf.constant(True)

        if self.guard:  # a non-finite loss must not poison the epoch's logged loss
            tf.cond(tf.reduce_all(tf.math.is_finite(loss)), record, lambda: tf.constant(False))
        else:
            record()
        return grads, loss, y_pred

    @staticmethod
    def _loss_bad(loss: tf.Tensor) -> tf.Tensor:
        return tf.cast(tf.logical_not(tf.reduce_all(tf.math.is_finite(loss))), tf.float32)

    def _pred_bad(self, y_pred: Any) -> tf.Tensor:
        if not self.guard:
            return tf.constant(0.0)
        return tf.add_n([_nonfinite_count(t) for t in _flat(y_pred)] or [tf.constant(0.0)])

    def _conditional_apply(self, optimizer, grads, trainable, apply_now, snapshot):
        """Apply the update only when ``apply_now`` (identical on every replica); else restore BN statistics.

        A ``merge_call`` cannot sit inside a replica-context ``tf.cond``, so (like Keras's
        ``LossScaleOptimizer``) merge into the cross-replica context unconditionally and decide there.
        """

        def apply_fn():
            with _optimizer_without_all_reduce(optimizer):
                optimizer.apply(grads, trainable)

        def restore_fn():
            for var, value in snapshot:
                var.assign(value)

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            tf.cond(apply_now, lambda: (apply_fn(), tf.constant(True))[1],
                    lambda: (restore_fn(), tf.constant(False))[1])
            return

        def cross_replica(distribution, apply_now):
            flag = distribution.experimental_local_results(apply_now)[0]

            def yes():
                distribution.extended.call_for_each_replica(apply_fn)
                return tf.constant(True)

            def no():
                distribution.extended.call_for_each_replica(restore_fn)
                return tf.constant(False)

            tf.cond(flag, yes, no)

        tf.distribute.get_replica_context().merge_call(cross_replica, args=(apply_now,))

    def _record(self, bad, x, y, sample_weight, pred_bad, loss_bad, local_grads, present, trainable):
        """Update counters and, on the first bad step since the host last looked, the diagnosis vector."""
        bad_i = tf.cast(bad, tf.int64)
        self.skipped_steps.assign_add(bad_i)
        consecutive = (self.consecutive_bad + bad_i) * bad_i
        self.consecutive_bad.assign(consecutive)
        if self.halt_after_consecutive > 0:
            halt = tf.cast(consecutive >= self.halt_after_consecutive, tf.int64)
            self.halted.assign(tf.maximum(self.halted, halt))

        names: List[str] = []
        tensors: List[Any] = []  # what each diagnosis slot counts; counted only on a bad step (inside the cond)

        def add(name, value):
            names.append(name)
            tensors.append(value)

        for i, t in enumerate(_flat(x)[:64]):
            add(f"inputs[{i}]", t)
        for i, t in enumerate(_flat(y)[:64]):
            add(f"targets[{i}]", t)
        for i, t in enumerate(_flat(sample_weight)[:16]):
            add(f"sample_weight[{i}]", t)
        add("predictions", pred_bad)
        add("loss", loss_bad)
        budget = DIAG_CAPACITY - len(names)
        for i, g in zip(present[:budget], local_grads[:budget]):
            add(f"gradient:{trainable[i].path}", g)
        self.diag_names = names

        first_incident = tf.logical_and(bad, tf.equal(self.incidents, 0))

        def write_diag():
            counts = [t if name in ("predictions", "loss") else _nonfinite_count(t) for name, t in zip(names, tensors)]
            vec = tf.stack([tf.reshape(tf.cast(c, tf.float32), []) for c in counts])
            vec = tf.pad(vec, [[0, DIAG_CAPACITY - len(counts)]])
            self.diag.assign(vec)
            return tf.constant(True)

        tf.cond(first_incident, write_diag, lambda: tf.constant(False))
        self.incidents.assign_add(bad_i)


def _is_multi_worker(strategy: Any) -> bool:
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def get_step(model: keras.Model, create: bool = True) -> Optional[ComposedStep]:
    """The model's :class:`ComposedStep` (created on first use, in the model's strategy scope).

    Example:
        >>> get_step(model).skipped_steps
    """
    step = getattr(model, _STEP_ATTR, None)
    if step is None and create:
        step = ComposedStep(model)
        object.__setattr__(model, _STEP_ATTR, step)
    return step


def install(model: keras.Model) -> ComposedStep:
    """Make ``model.train_step`` the composed step (no-op for wrapped models, which already use it).

    Call ``model.make_train_function(force=True)`` afterwards when ``fit`` has already built one.

    Example:
        >>> step = install(model)
    """
    step = get_step(model)
    if not _uses_composed_step(model):
        object.__setattr__(model, "train_step", step.train_step)
    return step


def uninstall(model: keras.Model) -> None:
    """Give a plain model back its own ``train_step`` (the next ``fit`` rebuilds its train function).

    Example:
        >>> uninstall(model)
    """
    if "train_step" in vars(model):
        object.__delattr__(model, "train_step")
        model.train_function = None


def _uses_composed_step(model: keras.Model) -> bool:
    bound = getattr(model, "train_step", None)
    return getattr(bound, "__self__", None) is getattr(model, _STEP_ATTR, object()) or getattr(
        type(model), "_keras_scale_composed", False)


def state_variables(model: keras.Model) -> Dict[str, tf.Variable]:
    """keras_scale's per-model training state to checkpoint (counters of the composed step).

    Example:
        >>> sorted(state_variables(model))
        ['consecutive_bad', 'halted', 'skipped_steps']
    """
    return get_step(model).variables()
