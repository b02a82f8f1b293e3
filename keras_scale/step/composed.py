"""The composed train step: ONE place where everything inside a training step happens.

Parts, each switched on by the piece that needs it and otherwise free:

- **accumulation** (``keras_scale.wrap``): split the batch ``fit`` delivers into micro-batches, run
  forward+backward on one micro-batch at a time, sum the gradients;
- **one all-reduce per update**: the accumulated gradients (plus a "loss was non-finite" flag, the batch's
  loss normaliser when the replicas' batches can be uneven, and the sum of the gradients' norms when the guard checks
  them) are all-reduced once, then handed to the optimizer with its own all-reduce switched off, so
  clipping, weight decay, EMA and loss scaling see the global gradient, exactly as on one device. The gradient
  is the global mean: each micro-batch on each replica is weighted by its share of the global normaliser (its
  samples, or its valid mask entries for a masked single-output model), so uneven last batches, uneven
  replicas and masks give the big-batch gradient; with a static per-replica batch (even by construction) and
  no mask, Keras's plain sum already is that mean and the gradients are not scaled at all;
- **logged numbers**: the loss and metric trackers record what plain Keras records for the same batch (a split
  batch's loss and per-output losses once per step, from its micro-batches); a skipped step puts them back, and
  while no step of the epoch was taken every logged value is NaN;
- **non-finite guard** (``keras_scale.NanGuard``): a step whose loss or gradients are not finite applies no
  update at all (no optimizer moment, no ``iterations`` bump, BatchNorm statistics restored); every replica
  takes the same decision because it is made on reduced values; counters and a diagnosis of the first bad
  step live in variables; on one replica the update is computed ahead and only its writes wait for the decision
  (:mod:`keras_scale.deferred_update`), so it still runs beside the backward pass as in plain Keras; the epoch's
  count comes back in the step's logs (``nan_skipped``), which Keras
  already brings to the host, so no extra read per step. A model with its own ``train_step`` is guarded at its
  optimizer's ``apply`` instead (where optax's ``apply_if_finite`` sits);
- **loss scaling**: a ``LossScaleOptimizer`` scales each micro-batch, unscales once, and makes one
  finite/non-finite decision per update.

Callbacks never re-implement ``train_step``: they call :func:`get_step` and ask for parts for the fit being set
up (:meth:`ComposedStep.request`); :mod:`keras_scale.lifecycle` withdraws the request when that fit ends,
however it ends. The traced train function is cached per configuration, so switching a part on and off again
between fits does not re-trace, and a model left with no request gets Keras's own train function back.

Example:
    from keras_scale.step import get_step
    step = get_step(model)
    step.request(owner=my_callback, guard=True)   # from my_callback.set_model; withdrawn at the fit's end
"""
from __future__ import annotations

import dataclasses
import functools
import math
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf
from keras.src.losses import loss as keras_loss
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_scale import deferred_update, lifecycle
from keras_scale.model_kind import has_own_compute_loss, has_own_train_step, overrides  # (callers use step.*)
from keras_scale.epoch_logs import epoch_logs_as_keras
from keras_scale import state as training_state
from keras_scale.progress_bar import quiet_progress_bar
from keras_scale.schedules import inner_optimizer
from keras_scale.sync_bn import batchnorm_layers

__all__ = ["ComposedStep", "get_step", "make_train_function", "rebuild", "state_variables", "overrides",
           "is_loss_scaled", "DiagnosisSlot", "DIAG_CAPACITY", "SKIPPED_LOG_KEY"]

_STEP_ATTR = "_keras_scale_step"
DIAG_CAPACITY = 4096  # slots of the first-bad-step diagnosis vector
SKIPPED_LOG_KEY = "nan_skipped"  # the step's logs: non-finite steps skipped so far in this epoch
_LOSS_SCALE_FLOOR = 1.0  # an fp16 overflow at a loss scale <= this is not the scaler's business any more

# Per thread (MirroredStrategy runs each replica in its own thread): what the composed step asks the optimizer
# to do while it traces. Nothing shared is mutated from replica threads.
_LOCAL = threading.local()
_INSTALL_LOCK = threading.Lock()


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


def is_loss_scaled(optimizer: Any) -> bool:
    """True for Keras's ``LossScaleOptimizer`` (mixed_float16).

    Example:
        >>> is_loss_scaled(keras.optimizers.SGD())
        False
    """
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


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


def _has_synchronized_batchnorm(model: keras.Model) -> bool:
    return any(getattr(layer, "synchronized", False) for layer in batchnorm_layers(model))


def check_wrappable(model: keras.Model) -> None:
    """Refuse, with the fix, a model ``keras_scale.wrap`` cannot train (its own ``train_step`` or ``compute_loss``).

    Example:
        >>> check_wrappable(keras.Sequential([keras.layers.Dense(1)]))   # fine: nothing raised
    """
    if has_own_train_step(model):
        raise ValueError(
            f"keras_scale.wrap cannot split the batch of {type(model).__name__}, which defines its own "
            f"train_step: the composed step would silently replace it. Train the model unwrapped (NanGuard "
            f"still guards it, at its optimizer), or accumulate inside your train_step.")
    if has_own_compute_loss(model):
        raise ValueError(
            f"keras_scale.wrap would drop {type(model).__name__}.compute_loss (the wrapper computes the "
            f"compiled loss). Train the model unwrapped, or move the extra loss terms into a layer's "
            f"add_loss / the compiled loss.")
    for name in _PUBLIC_LOOPS:
        owner = _defined_by(model, name)
        if owner is not None:
            raise ValueError(
                f"keras_scale.wrap would bypass {owner.__name__}.{name} (the wrapper runs Keras's own {name}, "
                f"with the model's train/test/predict steps and compute_metrics kept). Move what it adds into "
                f"those steps, call it on the unwrapped model (keras_scale.unwrap(wrapped).{name}(...): the same "
                f"weights), or train the model unwrapped.")


# Keras's loops: a model's own version of one is what its users call, which a wrapper's would silently replace
_PUBLIC_LOOPS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")


def _defined_by(model: keras.Model, name: str) -> Optional[type]:
    """The user class of ``model`` that defines ``name`` (None: Keras's or keras_scale's own)."""
    for cls in type(model).__mro__:
        if name in vars(cls):
            module = cls.__module__ or ""
            return None if module.split(".")[0] in ("keras", "keras_scale", "tf_keras") else cls
    return None


def _split_bounds(batch_size: tf.Tensor, num_micro: tf.Tensor, k: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """Start and size of micro-batch ``k`` when ``batch_size`` is split into ``num_micro`` near-equal parts."""
    base = batch_size // tf.maximum(num_micro, 1)
    rem = batch_size % tf.maximum(num_micro, 1)
    start = tf.minimum(k * base + tf.minimum(k, rem), batch_size)
    size = base + tf.cast(k < rem, batch_size.dtype)
    # an unrolled loop traces ``accum`` micro-batches; a batch smaller than accum has fewer: the surplus ones are
    # empty (size 0: no forward pass, no BatchNorm update, no loss, no gradient), never "size 1" of an empty slice
    return start, tf.where(k < num_micro, size, tf.zeros_like(size))


def _slice(structure: Any, start: tf.Tensor, size: tf.Tensor) -> Any:
    return tf.nest.map_structure(lambda t: None if t is None else t[start:start + size], structure)


_SUPPORTED_STRATEGIES = ("_DefaultDistributionStrategy", "OneDeviceStrategy", "OneDeviceStrategyV1",
                         "MirroredStrategy", "MirroredStrategyV1", "MultiWorkerMirroredStrategy",
                         "CollectiveAllReduceStrategy", "CollectiveAllReduceStrategyV1",
                         "_CollectiveAllReduceStrategyExperimental")


def check_supported(model: keras.Model) -> None:
    """Refuse, with the fix, what the composed step cannot train exactly (called at fit start).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> check_supported(model)   # raises ValueError for what it cannot train exactly, e.g. CentralStorageStrategy
    """
    strategy = model.distribute_strategy
    name = type(strategy).__name__
    if name not in _SUPPORTED_STRATEGIES:
        raise ValueError(
            f"keras_scale (NanGuard, wrap, ks.fit) supports the default strategy, OneDeviceStrategy, "
            f"MirroredStrategy and MultiWorkerMirroredStrategy; this model trains under {name}. Use one of those "
            f"(ks.choose_strategy() picks one), or train without wrap/NanGuard.")
    optimizer = model.optimizer
    steps = getattr(inner_optimizer(optimizer), "gradient_accumulation_steps", None) if optimizer is not None else None
    if steps:
        raise ValueError(
            f"the optimizer uses Keras's own gradient_accumulation_steps={steps}, which keras_scale's step cannot "
            f"combine with (and which crashes under MirroredStrategy). Remove it and use keras_scale.wrap(model, "
            f"accum={steps}) with a {steps}x larger batch size instead: Keras's option applies one update per {steps} "
            f"batches, wrap splits each batch into {steps} micro-batches and applies one update per batch, so the "
            f"same update needs batch_size={steps} x your batch size (exact: the big-batch gradient).")


@dataclasses.dataclass(frozen=True)
class DiagnosisSlot:
    """What one entry of the step's diagnosis vector counts: non-finite values of ``label`` in ``source``.

    ``source`` is one of ``inputs``, ``targets``, ``sample_weight``, ``predictions``, ``loss``, ``gradients``;
    ``label`` names the tensor (``inputs[0]``, or a variable's path for gradients).

    Example:
        >>> DiagnosisSlot("gradients", "dense/kernel").source
        'gradients'
    """

    source: str
    label: str

    @property
    def counted(self) -> bool:
        """True when the traced value already is a count (predictions, loss), not a tensor to count."""
        return self.source in ("predictions", "loss")


class ComposedStep:
    """The composed train step of one model, and the state of its parts.

    Created by :func:`get_step` (which attaches it to the model); the wrapper from ``keras_scale.wrap``
    configures accumulation, callbacks :meth:`request` parts for one fit. Its checkpointed state is
    :meth:`variables` (the skipped-step count); transient state (halt flag, consecutive bad steps, pending
    incidents) is reset when a fit starts and never checkpointed.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> step = get_step(model).configure(accum=4)
        >>> step.accum, int(step.skipped_steps.numpy())
        (4, 0)
    """

    def __init__(self, model: keras.Model) -> None:
        self.model = model
        self.accum: Optional[int] = None
        self.micro_batch_size: Optional[int] = None
        self.unrolled: Optional[bool] = None  # None: decide (synchronized BN or XLA -> unrolled)
        self.guard = False
        self.halt_after_consecutive = 0  # 0: never halt in-graph; N: stop applying after N bad steps in a row
        self.check_gradients = True  # False: the guard decides on the loss alone (no wait for every gradient)
        self._requests: Dict[int, Tuple[bool, int, bool]] = {}
        self._layouts: List[List[DiagnosisSlot]] = []  # per trace: what each entry of ``diag`` counts
        self.traced_micro_batches: Optional[int] = None  # set while tracing (static count) for tests/benchmarks
        self.traces = 0  # how many times a train function of this model was traced (tests, benchmarks)
        self._cache: Dict[Tuple, Tuple[Tuple, Any]] = {}
        self._plain: Optional[Tuple[Tuple, Any]] = None  # Keras's own train function, kept while ours is in place
        self._warned: set = set()
        self._masked = False  # set while tracing: a masked single-output model
        # accum="auto" (keras_scale.auto_accum): wraps each placed traced function (fn -> the train function)
        self.outer: Optional[Callable[[Any], Any]] = None
        # accum="auto": the update waits for every gradient, so a step that fails (OOM) changes no weight, no
        # optimizer slot and not `iterations` (otherwise TF runs each variable's update as soon as ITS gradient
        # is ready, and `iterations.assign_add` depends on no gradient at all)
        self.atomic_update = False
        self._outer_placed: Any = None
        # a guarded own train_step: the logs of this epoch's last call whose step was taken, and its skip count
        # (a skipped step logs them again, as plain Keras without that batch would; NanGuard resets per epoch)
        self.previous_logs: Optional[Tuple[Any, Any]] = None
        self._state_finite_fn: Optional[Tuple[Tuple[int, ...], Any]] = None
        # updates NanGuard(policy="rollback") discarded (restored to an earlier state), host-side, for ks.Goodput
        self.rolled_back_steps = 0
        with model.distribute_strategy.scope():
            self.skipped_steps = self._var("skipped_steps", 0, tf.int64)
            self.epoch_skipped = self._var("epoch_skipped", 0, tf.int64)
            # samples this step trained on (skipped steps included), each replica adding its own: read lazily
            # (ks.Goodput, at epoch ends); never reset, never checkpointed, untouched by a rollback
            self.samples_seen = self._var("samples_seen", 0, tf.int64, aggregation=tf.VariableAggregation.SUM)
            self.consecutive_bad = self._var("consecutive_bad", 0, tf.int64)
            self.halted = self._var("halted", 0, tf.int64)
            self.incidents = self._var("incidents", 0, tf.int64)  # bad steps since the host last looked
            self.diag = self._var("diag", tf.zeros([DIAG_CAPACITY]), tf.float32,
                                  aggregation=tf.VariableAggregation.SUM)  # every replica's local counts

    @staticmethod
    def _var(name: str, value: Any, dtype: tf.DType,
             aggregation: tf.VariableAggregation = tf.VariableAggregation.ONLY_FIRST_REPLICA) -> tf.Variable:
        # ON_READ: each replica updates its own copy without a merge_call (legal inside loops and conds);
        # the step updates every copy identically from all-reduced values, so the first replica speaks for all.
        return tf.Variable(value, dtype=dtype, trainable=False, name=f"keras_scale_{name}",
                           synchronization=tf.VariableSynchronization.ON_READ,
                           aggregation=aggregation)

    # ---------------------------------------------------------------- configuration
    def configure(self, accum: Optional[int] = None, micro_batch_size: Optional[int] = None) -> "ComposedStep":
        """Set accumulation (what ``wrap`` does); takes effect at the next fit (or :func:`rebuild`).

        Example:
            >>> import keras
            >>> get_step(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])).configure(accum=4).accum
            4
        """
        if accum is not None:
            self.accum, self.micro_batch_size = int(accum), None
        if micro_batch_size is not None:
            self.micro_batch_size, self.accum = int(micro_batch_size), None
        return self

    def request(self, owner: Any, guard: bool = True, halt_after_consecutive: int = 0,
                check_gradients: bool = True) -> None:
        """``owner`` (a callback, from its ``set_model``) wants the non-finite guard in the fit being set up.

        ``check_gradients=False``: decide on the loss alone (see ``NanGuard(check_gradients=...)``); the
        gradients are checked when any guarding owner asks for it.

        The owner withdraws it when that fit ends, however it ends: register ``withdraw`` as (part of) its
        :func:`keras_scale.lifecycle.join` undo.

        Example:
            lifecycle.join(model, guard_callback, undo=lambda: get_step(model).withdraw(guard_callback))
            get_step(model).request(guard_callback, guard=True, halt_after_consecutive=1)
        """
        self._requests[id(owner)] = (bool(guard), int(halt_after_consecutive), bool(check_gradients))
        self.reset_transient()

    def withdraw(self, owner: Any) -> None:
        """Forget ``owner``'s request (the fit it was made for ended).

        Example:
            get_step(model).withdraw(guard_callback)      # from guard_callback's undo
        """
        self._requests.pop(id(owner), None)
        self.reset_transient()
        if not self.active:
            self.give_back_plain()
            lifecycle.leave(self.model, self)  # the optimizer switches go

    def reset_transient(self) -> None:
        """Clear the halt flag, the consecutive-bad count and pending incidents (never carried across fits).

        Example:
            >>> import keras
            >>> get_step(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])).reset_transient()
        """
        # (epoch_skipped is not: NanGuard zeroes it at each epoch begin, and a save at train end must hold it)
        for var in (self.halted, self.consecutive_bad, self.incidents):
            var.assign(0)
        self.diag.assign(tf.zeros_like(self.diag))

    def _resolve(self) -> None:
        requests = list(self._requests.values())
        self.guard = any(g for g, _, _ in requests)
        self.halt_after_consecutive = max([h for g, h, _ in requests if g] or [0])
        self.check_gradients = any(c for g, _, c in requests if g) or not self.guard

    def variables(self) -> Dict[str, tf.Variable]:
        """The step's state to checkpoint, by name (transient guard state is never checkpointed).

        Example:
            >>> import keras
            >>> sorted(get_step(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])).variables())
            ['skipped_steps']
        """
        state = {"skipped_steps": self.skipped_steps}
        auto = vars(self.model).get("_keras_scale_auto")  # accum="auto": the learned micro-batch size
        if auto is not None:
            state.update(auto.state_variables())
        return state

    @property
    def splits(self) -> bool:
        return (self.accum or 1) > 1 or self.micro_batch_size is not None

    @property
    def wrapped(self) -> bool:
        return bool(getattr(type(self.model), "_keras_scale_composed", False))

    @property
    def active(self) -> bool:
        """Whether the model trains with the composed step in the fit being set up."""
        self._resolve()
        return self.wrapped or self.guard

    # ---------------------------------------------------------------- train functions (main thread)
    def _compile_identity(self) -> Tuple:
        model = self.model
        return (model.optimizer, getattr(model, "_compile_loss", None), getattr(model, "_compile_metrics", None),
                getattr(model, "_loss_tracker", None), model.steps_per_execution, model.jit_compile,
                model.run_eagerly, model.distribute_strategy)

    @staticmethod
    def _same(a: Tuple, b: Tuple) -> bool:
        return len(a) == len(b) and all(x is y or (isinstance(x, (int, bool)) and x == y) for x, y in zip(a, b))

    def _config(self) -> Tuple:
        return (self.accum, self.micro_batch_size, self.unrolled, self.guard, self.halt_after_consecutive,
                self.check_gradients)

    def _ours(self, fn: Any) -> bool:
        return fn is not None and (fn is self._outer_placed or any(fn is cached for _, cached in self._cache.values()))

    def place_train_function(self, force: bool = False) -> Any:
        """Put the composed train function for the current configuration in ``model.train_function``.

        Reuses the function traced by an earlier fit with the same configuration and compile state.

        Example:
            get_step(model).place_train_function()     # at fit start, from the make_train_function hook
        """
        model = self.model
        self._resolve()
        self._check_at_fit_start()
        identity = self._compile_identity()
        current = getattr(model.train_function, "_ks_checkpoint_inner", model.train_function)  # see through it
        if current is not None and not self._ours(current):
            self._plain = (identity, current)  # Keras's own: given back when no part is asked for
        key = self._config()
        cached = self._cache.get(key)
        for optimizer in training_state.optimizers(model).values():  # a GAN's own train_step may use several
            _install_optimizer_switches(model, self, optimizer)  # (also for a cached function: it may retrace)
        if self.guard and has_own_train_step(model):  # its trackers: updated only when its updates were applied
            for metric in _unique(list(model.metrics)):
                _install_metric_switch(model, self, metric)
        quiet_progress_bar(model, self)  # the progress bar shows nan_skipped only when a step was skipped
        # the epoch logs the metrics' results, as plain Keras (also on replicas)
        epoch_logs_as_keras(model, self, nan_when_no_step=not has_own_train_step(model))
        if force or cached is None or not self._same(cached[0], identity):
            if model.optimizer is not None:
                if not model.optimizer.built and model.built and model.trainable_variables:
                    with model.distribute_strategy.scope():  # e.g. a LossScaleOptimizer's dynamic scale
                        model.optimizer.build(model.trainable_variables)
            step_fn = self._foreign_train_step if has_own_train_step(model) else self.train_step
            cached = (identity, _make_keras_function(model, step_fn))
            self._cache[key] = cached
        fn = cached[1]
        if self.outer is not None:  # accum="auto": the OOM-retrying wrapper runs the traced function
            fn = self._outer_placed = self.outer(fn)
        elif self.guard and (has_own_train_step(model) or overrides(getattr(model, "inner", model),
                                                                    "compute_metrics")):
            fn = self._outer_placed = self._logs_of_taken_steps(fn)  # (see there: the trackers are put back)
        model.train_function = fn
        return fn

    def give_back_plain(self) -> None:
        """No part is asked for: give the model Keras's own train function (or None: Keras builds it).

        Example:
            get_step(model).give_back_plain()          # the last request was withdrawn
        """
        model = self.model
        current = getattr(model.train_function, "_ks_checkpoint_inner", model.train_function)
        if current is None or self._ours(current):
            plain = self._plain
            model.train_function = plain[1] if plain and self._same(plain[0], self._compile_identity()) else None

    def _check_at_fit_start(self) -> None:
        model = self.model
        check_supported(model)
        self._resolve()
        if self.guard and not self.check_gradients and not self.wrapped and has_own_train_step(model):
            self._warn_once("foreign_loss_only",
                            f"NanGuard(check_gradients=False): {type(model).__name__} computes its loss in its own "
                            f"train_step, out of the guard's sight; its gradients are checked at the optimizer, as "
                            f"with the default.")
        if self.wrapped:
            inner = model.inner
            check_wrappable(inner)
            if self.splits:
                self._warn_non_mean_losses()
                if overrides(inner, "compute_metrics"):
                    self._warn_once("compute_metrics", (
                        f"keras_scale.wrap: {type(inner).__name__}.compute_metrics runs once per micro-batch, with "
                        f"that micro-batch's predictions: metrics that average over samples log what plain Keras "
                        f"logs; a statistic of the whole batch (its max, a mean of a per-batch value) is taken per "
                        f"micro-batch, and a value it returns beyond the metrics' results is the last "
                        f"micro-batch's."))

    # ---------------------------------------------------------------- the step (replica threads)
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

        snapshot = []
        if self.guard:  # restored on a skipped step: a bad step must not move BatchNorm statistics, nor the
            # logged loss and metrics (a step not taken contributes nothing to them, finite micro-batches included)
            snapshot = [(v, tf.identity(v)) for v in _unique(list(model.non_trainable_variables)
                                                              + list(model.metrics_variables))]
        outputs = self._output_trackers() if self.splits else []
        logged = [(_read(m.total), _read(m.count)) for m in outputs]  # per-output trackers before this step
        with tf.control_dependencies([s for _, s in snapshot] + [t for pair in logged for t in pair]):
            batch_size = tf.identity(batch_size)

        _LOCAL.metric_logs = None
        grads, trainable, share, loss_bad, pred_bad, stats = self._accumulate(x, y, sample_weight, batch_size)
        returned, _LOCAL.metric_logs = _LOCAL.metric_logs, None
        if stats is not None:
            self._record_split_logs(stats, batch_size, x, outputs, logged)
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

        if not self.guard:  # (guarded: the update sits in a cond on all reduced gradients, atomic already)
            barrier = [g.values if isinstance(g, tf.IndexedSlices) else g
                       for g in reduced_grads if g is not None] if self.atomic_update else []
            if self.atomic_update:  # and on the metric updates: an OOM in a metric must come before the update
                barrier += [tf.identity(v) for v in self._metric_reads()]
            with _GradientsReduced(optimizer), tf.control_dependencies(barrier):
                optimizer.apply(reduced_grads, trainable)
            return self._with_returned(model.get_metrics_result(), returned)

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

        grads_bad = self._conditional_apply(lambda g: optimizer.apply(g, trainable), reduced_grads, apply_now,
                                            snapshot, already_reduced=True, optimizer=optimizer, trainable=trainable,
                                            check_gradients=split_check, on_skip=on_skip, skip_inputs=[bad] + inputs)
        if split_check:
            bad = tf.logical_or(bad, grads_bad)
        self._count(bad)
        self._count_bad(tf.cast(bad, tf.int64))  # (adding 0 on a good step: cheaper than the ops in a branch)
        return self._logs(self._nan_unless_a_step_was_taken(
            self._with_returned(model.get_metrics_result(), returned)))

    @staticmethod
    def _with_returned(logs: Any, returned: Any) -> Any:
        """The step's logs: the metrics' results plus what the model's ``compute_metrics`` returned beyond them
        (keras.io's ``return {**logs, "max_abs_err": ...}``), which plain Keras's ``train_step`` returns as is."""
        if not isinstance(logs, dict) or not isinstance(returned, dict):
            return logs
        extra = {key: value for key, value in returned.items() if key not in logs}
        return {**logs, **extra} if extra else logs

    def _forward_state_finite(self) -> tf.Tensor:
        """Whether the model's floating non-trainable variables (BatchNorm statistics, ...) are finite, as this
        replica's forward pass left them."""
        state = [v for v in _unique(list(self.model.non_trainable_variables))
                 if tf.as_dtype(keras.backend.standardize_dtype(v.dtype)).is_floating]
        return _values_finite(state) if state else tf.constant(True)

    def _check_in_merge_call(self, optimizer: Any) -> bool:
        """Several replicas in this process (a merge_call decides): check the reduced gradients there, once
        (:func:`_split_check`). Loss-scaled optimizers keep the norms in the all-reduce (their scale floor)."""
        return (not is_loss_scaled(optimizer) and _replicas(self.model.distribute_strategy) > 1
                and not tf.__internal__.distribute.strategy_supports_no_merge_call())

    def _nan_unless_a_step_was_taken(self, logs: Any) -> Any:
        """NaN for every logged value while no step of the epoch was taken (all skipped): Keras's trackers would
        show 0.0, a number plain Keras never logs for those batches (and ``ModelCheckpoint(save_best_only=True)``
        would keep that model as the best)."""
        tracker = getattr(self.model, "_loss_tracker", None)
        if tracker is None or not isinstance(logs, dict):
            return logs
        taken = _read(tracker.count) > 0

        def nan_unless_taken(value: Any) -> Any:
            t = tf.convert_to_tensor(value)
            if not t.dtype.is_floating:
                return value
            return tf.where(taken, t, tf.fill(tf.shape(t), tf.constant(float("nan"), t.dtype)))

        return tf.nest.map_structure(nan_unless_taken, logs)

    def _output_trackers(self) -> List[Any]:
        """Keras's per-output loss trackers (``<output>_loss``) of a multi-output model; ``[]`` for one output."""
        compile_loss = getattr(self.model, "_compile_loss", None)
        trackers = list(getattr(compile_loss, "metrics", None) or [])
        flat_losses = list(getattr(compile_loss, "_flat_losses", None) or [])
        if not trackers or len(trackers) != len(flat_losses) or not all(
                hasattr(m, "total") and hasattr(m, "count") for m in trackers):
            return []
        return trackers

    def _record_split_logs(self, stats: tf.Tensor, batch_size: tf.Tensor, x: Any, outputs: List[Any],
                           logged: List[Tuple[tf.Tensor, tf.Tensor]]) -> None:
        """Record a split batch's losses once, as Keras records the unsplit batch (see ``_log_stats``).

        The loss tracker gets the batch's loss weighted by its size; each per-output tracker is put back to its
        value before the step and gets the batch's loss of that output with Keras's own weight (the static batch
        size, or 1), so History, the progress bar and CSVLogger show what plain Keras shows for the same batch.
        """
        model = self.model
        n = len(outputs)
        shares = stats[1]
        if n:
            weights = [1.0 if w is None else float(w) for _, _, w, _ in model._compile_loss._flat_losses]
            per_output = tf.math.divide_no_nan(stats[3:3 + n], stats[3 + n:])
            # the outputs' losses as Keras averages them over the batch, plus the model's other terms
            # (regularizers, add_loss) as the share-weighted mean
            loss = tf.math.divide_no_nan(stats[0] - stats[2], shares) + tf.reduce_sum(
                per_output * tf.constant(weights, tf.float32))
        else:
            loss = tf.math.divide_no_nan(stats[0], shares)
        model._loss_tracker.update_state(loss, sample_weight=batch_size)
        static_batch = _flat(x)[0].shape[0]  # Keras weighs per-output losses by the static batch size, or 1
        for o, (tracker, (total, count)) in enumerate(zip(outputs, logged)):
            tracker.total.assign(total)
            tracker.count.assign(count)
            tracker.update_state(per_output[o], sample_weight=static_batch)

    def _metric_reads(self) -> List[tf.Tensor]:
        """This replica's metric (and loss tracker) values, read after this step's updates of them."""
        reads = []
        for v in self.model.metrics_variables:
            tv = getattr(v, "_value", v)
            reads.append(tv.read_value() if hasattr(tv, "read_value") else tf.convert_to_tensor(tv))
        return reads

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

    def _count_samples(self, batch_size: tf.Tensor, after: List[Any]) -> None:
        """Add this replica's batch to ``samples_seen``, once the step got that far (an OOM retried by
        ``accum="auto"`` raises before: its batch is counted once, by the retry)."""
        deps = [g.values if isinstance(g, tf.IndexedSlices) else g for g in after if g is not None]
        with tf.control_dependencies(deps):
            self.samples_seen.assign_add(tf.cast(batch_size, tf.int64))

    @staticmethod
    def _static_even(first: Any, model: keras.Model) -> bool:
        """Every replica's batch has the same size: a static per-replica size under one process (tf.distribute gives
        an uneven split an unknown size). Workers shard and batch their own data, so a static size on this worker
        says nothing about the others': multi-worker never counts as even."""
        from keras_scale.distribute import is_multi_worker

        return first.shape[0] is not None and not is_multi_worker(model.distribute_strategy)

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

    def _logs_of_taken_steps(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn`` whose logs, when its (last) step was skipped, are those of the epoch's previous taken step.

        An own ``train_step`` may return raw per-batch values (keras.io's GANs: ``{"d_loss": loss}``), and an own
        ``compute_metrics`` values beyond the metrics, which Keras logs as they come: a skipped batch's would be
        non-finite, at the epoch's end too, where plain Keras without that batch logs the previous batch's (the
        trackers are put back on a skip: their results are the previous step's anyway). Eager ops on the
        returned tensors: no device sync.
        (With ``steps_per_execution`` > 1 the previous logs are those of the previous call.)
        """
        def train_function(iterator: Any) -> Any:
            logs = fn(iterator)
            if not isinstance(logs, dict) or SKIPPED_LOG_KEY not in logs:
                return logs
            skipped_count = logs[SKIPPED_LOG_KEY]
            previous = self.previous_logs
            if previous is not None:
                before, before_count = previous
                skipped = tf.convert_to_tensor(skipped_count) > tf.convert_to_tensor(before_count)
                kept = {}
                for key, value in logs.items():
                    old = before.get(key)
                    if key != SKIPPED_LOG_KEY and old is not None and tf.is_tensor(value) and tf.is_tensor(old) \
                            and value.dtype == old.dtype and value.shape == old.shape:
                        value = tf.where(skipped, old, value)
                    kept[key] = value
                logs = kept
            # (the first steps of an epoch, all skipped: their own logs, as Keras gives them)
            self.previous_logs = (logs, skipped_count)
            return logs

        return train_function

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

    def _apply_now(self, bad: tf.Tensor) -> tf.Tensor:
        if self.halt_after_consecutive <= 0:  # no policy halts in-graph: nothing to read
            return tf.logical_not(bad)
        return tf.logical_and(tf.logical_not(bad), tf.logical_not(self.halted.read_value() > 0))

    def _logs(self, logs: Any) -> Any:
        if isinstance(logs, dict):
            logs = dict(logs)
            logs[SKIPPED_LOG_KEY] = self.epoch_skipped.read_value()
        return logs

    def _decide_bad(self, optimizer: Any, any_loss_bad: tf.Tensor, reduced_grads: List[Any],
                    grads_bad: Optional[tf.Tensor] = None) -> tf.Tensor:
        if grads_bad is None:
            # (loss only: the update need not wait for every gradient; a non-finite gradient under a finite
            # loss is then applied, and NanGuard finds the non-finite state on the host)
            # (a LossScaleOptimizer waits for every gradient anyway, and its scale floor needs them: checked)
            check = self.check_gradients or is_loss_scaled(optimizer)
            grads_bad = tf.logical_not(_all_gradients_finite(reduced_grads)) if check else tf.constant(False)
        if is_loss_scaled(optimizer):
            # a gradient overflow is the loss scaler's business (it skips and lowers the scale) until the scale
            # is so low that scaling cannot be the cause: then it is an incident (else the scale collapses
            # silently and half the updates are dropped)
            dynamic_scale = getattr(optimizer, "dynamic_scale", None)  # None until the optimizer is built
            if dynamic_scale is None:
                grads_bad = tf.constant(False)
            else:
                grads_bad = tf.logical_and(grads_bad, tf.cast(dynamic_scale, tf.float32) <= _LOSS_SCALE_FLOOR)
        return tf.logical_or(any_loss_bad, grads_bad)

    def _accumulate(self, x, y, sample_weight, batch_size):
        """``sum_k f_k grad(loss_k)`` over micro-batches (``f_k``: the micro-batch's share, see ``_all_reduce``).

        Returns the gradients, the trainable variables, the summed share (``None`` when no output is masked: it
        is 1), and the non-finite counts of loss and predictions.
        """
        model = self.model
        self._masked = False
        if not self.splits:
            grads, share, loss, y_pred, _ = self._micro_step(x, y, sample_weight, batch_size, batch_size)
            self.traced_micro_batches = 1
            weighted = self._masked and _replicas(model.distribute_strategy) > 1  # else the share was not applied
            pred_bad = functools.partial(self._pred_bad, y_pred)  # (counted in the diagnosis cond: bad steps only)
            return (grads, list(model.trainable_weights), share if weighted else None,
                    self._loss_bad(loss, batch_size), pred_bad, None)

        if any(not layer.built for layer in model._flatten_layers()):
            model(_slice(x, 0, 1), training=False)  # create the variables outside the micro-batch loop
        trainable = list(model.trainable_weights)
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
        sync_bn = _has_synchronized_batchnorm(model)
        if unrolled is None:
            unrolled = sync_bn or bool(model.jit_compile)

        if unrolled:
            if num_micro_static is None:
                raise ValueError(
                    "keras_scale.wrap(micro_batch_size=...) with unroll=True, synchronized BatchNorm or jit_compile "
                    "needs a static batch size; batch with drop_remainder=True or use wrap(model, accum=N).")
            self.traced_micro_batches = num_micro_static
            if sync_bn:  # its all-reduce cannot sit in a cond: every micro-batch must hold a sample
                tf.debugging.assert_greater_equal(
                    batch_size, tf.constant(num_micro_static, batch_size.dtype),
                    message=f"keras_scale.wrap: with synchronized BatchNorm every per-replica batch needs "
                            f">= {num_micro_static} samples (one per micro-batch); batch with drop_remainder=True.")
            acc: List[Any] = [None] * len(trainable)
            count, loss_bad, pred_bad = tf.constant(0.0), tf.constant(0.0), tf.constant(0.0)
            stats = tf.zeros([self._num_log_stats()])
            deps: List[Any] = []
            # a compute_metrics of the model's own may return logs of its own: the last (non-empty) micro-batch
            # runs outside the conds, where what it returns can reach the step's logs
            peel = overrides(getattr(model, "inner", model), "compute_metrics")
            for k in range(num_micro_static + (1 if peel else 0)):
                last = peel and k == num_micro_static
                if peel and sync_bn and k == num_micro_static - 1:
                    continue  # (every micro-batch holds a sample: this one is the last, run below)
                with tf.control_dependencies(deps):  # one micro-batch's activations alive at a time
                    index = num_micro - 1 if last else tf.constant(k, batch_size.dtype)
                    start, size = _split_bounds(batch_size, num_micro, index)
                    start = tf.identity(start)
                if last:
                    _LOCAL.metric_logs = None  # (made in a cond)
                grads, c, l_bad, p_bad, st = self._guarded_micro_step(
                    _slice(x, start, size), _slice(y, start, size), _slice(sample_weight, start, size), size,
                    batch_size, trainable, skip_empty=not sync_bn and not last,
                    before_last=index < num_micro - 1 if peel and not last else None)
                acc = [a if g is None else (_dense(g) if a is None else a + _dense(g)) for a, g in zip(acc, grads)]
                count, loss_bad, pred_bad, stats = count + c, loss_bad + l_bad, pred_bad + p_bad, stats + st
                deps = [a for a in acc if a is not None]
            if not peel:
                _LOCAL.metric_logs = None  # (made in a cond)
            return acc, trainable, count if self._masked else None, loss_bad, pred_bad, stats

        self.traced_micro_batches = None  # dynamic (tf.while_loop)
        none_grads: set = set()

        def body(k, acc, count, loss_bad, pred_bad, stats):
            start, size = _split_bounds(batch_size, num_micro, k)
            grads, c, loss, y_pred, st = self._micro_step(
                _slice(x, start, size), _slice(y, start, size), _slice(sample_weight, start, size), size, batch_size)
            new_acc = []
            for i, (a, g) in enumerate(zip(acc, grads)):
                if g is None:
                    none_grads.add(i)
                    new_acc.append(a)
                else:
                    new_acc.append(a + tf.cast(_dense(g), a.dtype))
            return (k + 1, new_acc, count + c, loss_bad + self._loss_bad(loss, size),
                    pred_bad + self._pred_bad(y_pred), stats + st)

        zeros = [tf.zeros(v.shape, dtype=v.dtype) for v in trainable]
        # a compute_metrics of the model's own may return logs of its own: the last micro-batch runs after the
        # loop, where what it returns can reach the step's logs (a tensor made in the loop cannot)
        peel = overrides(getattr(model, "inner", model), "compute_metrics")
        loop_vars = tf.while_loop(
            lambda k, *_: k < num_micro - (1 if peel else 0), body,
            [tf.constant(0, batch_size.dtype), zeros, tf.constant(0.0), tf.constant(0.0), tf.constant(0.0),
             tf.zeros([self._num_log_stats()])],
            parallel_iterations=1)
        _LOCAL.metric_logs = None
        if peel:
            loop_vars = body(*loop_vars)
        _, acc, count, loss_bad, pred_bad, stats = loop_vars
        acc = [None if i in none_grads else a for i, a in enumerate(acc)]
        return acc, trainable, count if self._masked else None, loss_bad, pred_bad, stats

    def _guarded_micro_step(self, x, y, sample_weight, size, batch_size, trainable, skip_empty,
                            before_last: Optional[tf.Tensor] = None):
        """One unrolled micro-batch; an empty one (batch smaller than accum) contributes nothing at all, nor one
        where ``before_last`` is False (the last micro-batch, run on its own after the others)."""
        def run():
            grads, c, loss, y_pred, stats = self._micro_step(x, y, sample_weight, size, batch_size)
            grads = [tf.zeros(v.shape, v.dtype) if g is None else tf.cast(_dense(g), v.dtype)
                     for g, v in zip(grads, trainable)]
            return grads, c, self._loss_bad(loss, size), self._pred_bad(y_pred), stats

        if not skip_empty:
            return run()

        def empty():
            return ([tf.zeros(v.shape, v.dtype) for v in trainable], tf.constant(0.0), tf.constant(0.0),
                    tf.constant(0.0), tf.zeros([self._num_log_stats()]))

        runs = size > 0 if before_last is None else tf.logical_and(size > 0, before_last)
        return tf.cond(runs, run, empty)

    def _micro_step(self, x, y, sample_weight, size, batch_size):
        """Forward + backward of one micro-batch: ``grad(f * loss)``, its share ``f`` of the replica's batch, the
        loss, the predictions and (split batches) what it adds to the logged losses (``_log_stats``)."""
        model = self.model
        optimizer = model.optimizer
        outputs = self._output_trackers() if self.splits else []
        before = [(_read(m.total), _read(m.count)) for m in outputs]
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            self._warn_batch_dependent_losses()
            scaled = optimizer.scale_loss(loss) if optimizer is not None else loss
            share = self._share(y_pred, size, batch_size)
            if self.splits or _replicas(model.distribute_strategy) > 1:
                scaled = scaled * tf.cast(share, scaled.dtype)  # <= 1: never overflows where Keras would not
        grads = tape.gradient(scaled, list(model.trainable_weights))
        # (a step the guard skips puts the trackers back: ComposedStep.train_step's snapshot)
        stats = None
        if self.splits:  # the loss trackers are recorded once per step, from these (_record_split_logs)
            stats = self._log_stats(loss, share, size, y_pred, outputs, before)
        else:
            model._loss_tracker.update_state(keras_loss.unscale_loss_for_distribution(loss), sample_weight=size)
        # (sums over samples: split-exact)
        returned = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        _LOCAL.metric_logs = returned  # (what it returns beyond the metrics' results is logged, as by Keras)
        return grads, share, loss, y_pred, stats

    def _num_log_stats(self) -> int:
        return 3 + 2 * len(self._output_trackers())

    def _log_stats(self, loss: tf.Tensor, share: tf.Tensor, size: tf.Tensor, y_pred: Any, outputs: List[Any],
                   before: List[Tuple[tf.Tensor, tf.Tensor]]) -> tf.Tensor:
        """What one micro-batch adds to its step's logged losses, summed over the micro-batches of the step:
        ``[f L, f, f sum_o w_o l_o, c_1 l_1 .. c_n l_n, c_1 .. c_n]``, with ``L`` the (unscaled) loss, ``f`` the
        micro-batch's share of the batch, ``l_o`` output ``o``'s loss as Keras's per-output tracker just recorded
        it, ``w_o`` its loss weight and ``c_o`` what Keras averages it over: the micro-batch's samples, or the
        valid entries of that output's mask.
        """
        total = tf.cast(keras_loss.unscale_loss_for_distribution(loss), tf.float32)
        f = tf.cast(share, tf.float32)
        predictions = _flat(y_pred)
        weights = [1.0 if w is None else float(w) for _, _, w, _ in self.model._compile_loss._flat_losses] \
            if outputs else []
        values, counts = [], []
        for o, (tracker, (t0, c0)) in enumerate(zip(outputs, before)):
            value = tf.cast(tf.math.divide_no_nan(_read(tracker.total) - t0, _read(tracker.count) - c0), tf.float32)
            c = tf.cast(size, tf.float32)
            mask = getattr(predictions[o], "_keras_mask", None) if len(predictions) == len(outputs) else None
            if mask is not None:
                c = tf.reduce_sum(tf.cast(mask, tf.float32))
            values.append(value)
            counts.append(c)
        weighted = tf.add_n([w * v for w, v in zip(weights, values)]) if values else tf.constant(0.0)
        return tf.stack([f * total, f, f * weighted] + [c * v for c, v in zip(counts, values)] + counts)

    def _share(self, y_pred: Any, size: tf.Tensor, batch_size: tf.Tensor) -> tf.Tensor:
        """The micro-batch's share of the replica's loss normaliser: its samples over the batch's, times its
        valid-mask fraction for a masked single-output model (Keras divides a masked loss by the valid count)."""
        share = tf.math.divide_no_nan(tf.cast(size, tf.float32), tf.cast(batch_size, tf.float32))
        outputs = _flat(y_pred)
        masks = [m for m in (getattr(t, "_keras_mask", None) for t in outputs) if m is not None]
        if masks and len(outputs) == 1:
            self._masked = True
            mask = tf.cast(masks[0], tf.float32)
            return share * tf.math.divide_no_nan(tf.reduce_sum(mask), tf.cast(tf.size(mask), tf.float32))
        if masks and (self.splits or _replicas(self.model.distribute_strategy) > 1):
            self._warn_once("masks", "keras_scale: several outputs, some masked: each masked output's loss is "
                            "normalised by its own micro-batch's valid count, so the gradient differs slightly "
                            "from the big-batch one. Single-output masked models are exact.")
        return share

    def _warn_batch_dependent_losses(self) -> None:
        if not self.splits:
            return
        call_losses = [loss for layer in self.model._flatten_layers() for loss in getattr(layer, "_losses", [])]
        if call_losses:
            self._warn_once("add_loss", "keras_scale.wrap: the model adds losses in call() (add_loss / "
                            "activity_regularizer). They are averaged over micro-batches weighted by size: exact for "
                            "a per-sample mean, but a loss that sums over the batch shrinks by 1/accum. Write such "
                            "losses as means over the batch to keep accumulation exact.")

    def _warn_non_mean_losses(self) -> None:
        losses = [loss for loss in tf.nest.flatten(getattr(self.model, "loss", None))
                  if isinstance(loss, keras.losses.Loss) and loss.reduction not in ("sum_over_batch_size", None)]
        if losses:
            self._warn_once("reduction", f"keras_scale.wrap: {losses[0].name} uses reduction={losses[0].reduction!r}; "
                            "accumulation is exact for the default 'sum_over_batch_size' (a per-sample mean), so the "
                            "update differs from big-batch training. Use the default reduction (and a custom loss "
                            "function returning a mean, not a sum).")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=2)

    @staticmethod
    def _loss_bad(loss: tf.Tensor, size: tf.Tensor) -> tf.Tensor:
        bad = tf.logical_and(tf.logical_not(tf.reduce_all(tf.math.is_finite(loss))), size > 0)
        return tf.cast(bad, tf.float32)

    def _pred_bad(self, y_pred: Any) -> tf.Tensor:
        if not self.guard:
            return tf.constant(0.0)
        return tf.add_n([_nonfinite_count(t) for t in _flat(y_pred)] or [tf.constant(0.0)])

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

    def _state(self) -> List[Any]:
        return training_state.float_variables(self.model)  # weights and every optimizer's variables

    def state_finite(self) -> bool:
        """Whether every floating weight and optimizer variable is finite: one in-graph pass, a bool to the host.

        ``NanGuard(check_gradients=False)`` lets a finite-loss step with non-finite gradients through; it and
        ``ChiefCheckpoint`` ask this before trusting (snapshotting, saving, calling good) the current state.

        Example:
            >>> import keras
            >>> get_step(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])).state_finite()
            True
        """
        variables = self._state()
        key = tuple(id(v) for v in variables)
        if self._state_finite_fn is None or self._state_finite_fn[0] != key:
            # traced once per model (a partial, not a lambda: TF counts retraces per code object, and a loop
            # building many models would warn of "excessive retracing")
            fn = functools.partial(_values_finite, [getattr(v, "value", v) for v in variables])
            self._state_finite_fn = (key, tf.function(fn, autograph=False))
        return bool(self._state_finite_fn[1]())

    def non_finite_state(self) -> List[str]:
        """The paths of the weights and optimizer variables holding a non-finite value (reads them all).

        Example:
            >>> import keras
            >>> get_step(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])).non_finite_state()
            []
        """
        return [getattr(v, "path", v.name) for v in self._state() if not np.isfinite(np.asarray(v.numpy())).all()]

    @property
    def loss_only(self) -> bool:
        """A guard is on in this fit and it decides on the loss alone (``NanGuard(check_gradients=False)``)."""
        self._resolve()
        return self.guard and not self.check_gradients

    def read_diagnosis(self) -> List[Tuple[DiagnosisSlot, float]]:
        """The first bad step's diagnosis since the last reset: ``(slot, non-finite count)`` for each slot > 0.

        Example:
            [(slot.label, n) for slot, n in get_step(model).read_diagnosis()]   # after a non-finite step
            # [('inputs[0]', 3.0)]
        """
        diag = self.diag.numpy()
        layout = int(round(diag[0] / max(_replicas(self.model.distribute_strategy), 1)))
        if not 1 <= layout <= len(self._layouts):
            return []
        return [(slot, float(v)) for slot, v in zip(self._layouts[layout - 1], diag[1:]) if v > 0]

    def _record(self, bad, x, y, sample_weight, pred_bad, loss_bad, local_grads, present, trainable,
                count: bool = True, diagnose: Optional[tf.Tensor] = None):
        """Update counters and, on the first bad step since the host last looked, the diagnosis vector.

        ``count=False`` (one of several optimizer updates of a foreign step): write the diagnosis only (when
        ``diagnose``, i.e. no earlier update of this step was bad); the step is counted once, by :meth:`_count`.
        """
        if count:
            self._count(bad)
        on_bad, inputs = self._on_bad(x, y, sample_weight, pred_bad, loss_bad, local_grads, present, trainable,
                                      count=count, diagnose=diagnose)
        tf.cond(bad, lambda: on_bad(inputs), lambda: tf.constant(False))

    def _on_bad(self, x, y, sample_weight, pred_bad, loss_bad, grads, present, trainable,
                count: bool = True, diagnose: Optional[tf.Tensor] = None, gradient_share: float = 1.0
                ) -> Tuple[Callable[[List[Any]], Any], List[Any]]:
        """What a bad step records (the skip counters, the first bad step's diagnosis), as ``(on_bad, inputs)``:
        ``on_bad(inputs)`` builds it from this replica's ``inputs`` (tensors only, so that a merge_call can hand each
        replica its own), inside whatever branch runs on a bad step. ``gradient_share``: what each replica's count
        of ``grads`` weighs in the diagnosis (summed over replicas): ``1/R`` when every replica counts the same
        reduced gradients."""
        slots: List[DiagnosisSlot] = []
        tensors: List[Any] = []  # what each diagnosis slot counts; counted only on a bad step

        def add(source, label, value):
            slots.append(DiagnosisSlot(source, label))
            tensors.append(value)

        for i, t in enumerate(_flat(x)[:64]):
            add("inputs", f"inputs[{i}]", t)
        for i, t in enumerate(_flat(y)[:64]):
            add("targets", f"targets[{i}]", t)
        for i, t in enumerate(_flat(sample_weight)[:16]):
            add("sample_weight", f"sample_weight[{i}]", t)
        # predictions: a count already, or (unsplit) the predictions themselves, counted on a bad step only
        add("predictions", "predictions", _flat(pred_bad.args[0]) if isinstance(pred_bad, functools.partial)
            else [pred_bad])
        add("loss", "loss", loss_bad)
        budget = DIAG_CAPACITY - 1 - len(slots)
        for i, g in zip(present[:budget], grads[:budget]):
            add("gradients", trainable[i].path, g)
        # which trace wrote the vector: a fit can reuse a function traced for other data (with/without
        # sample_weight), so the labels travel as a layout id in slot 0, not as "the latest trace's"
        self._layouts.append(slots)
        layout_id = float(len(self._layouts))
        predictions_counted = not isinstance(pred_bad, functools.partial)

        def write_diag(values):
            counts = [tf.constant(layout_id)]
            for slot, t in zip(slots, values):
                if slot.source == "predictions":
                    counts.append(t[0] if predictions_counted else tf.add_n(
                        [_nonfinite_count(p) for p in t] or [tf.constant(0.0)]))
                elif slot.source == "gradients" and gradient_share != 1.0:
                    counts.append(_nonfinite_count(t) * gradient_share)
                else:
                    counts.append(t if slot.counted else _nonfinite_count(t))
            vec = tf.stack([tf.reshape(tf.cast(c, tf.float32), []) for c in counts])
            vec = tf.pad(vec, [[0, DIAG_CAPACITY - len(counts)]])
            self.diag.assign(vec)
            return tf.constant(True)

        def on_bad(values):  # (a good step touches no counter)
            first = tf.equal(self.incidents, 0)
            if diagnose is not None:
                first = tf.logical_and(first, diagnose)
            tf.cond(first, lambda: write_diag(values), lambda: tf.constant(False))
            if count:
                self._count_bad()
            return tf.constant(True)

        return on_bad, tensors

    def _count(self, bad: tf.Tensor) -> None:
        """One step's verdict: the consecutive-bad count (policies that halt) and, when bad, the skip counters."""
        bad_i = tf.cast(bad, tf.int64)
        if self.halt_after_consecutive > 0:  # (bad steps in a row matter only to a policy that halts)
            consecutive = (self.consecutive_bad + bad_i) * bad_i
            self.consecutive_bad.assign(consecutive)
            halt = tf.cast(consecutive >= self.halt_after_consecutive, tf.int64)
            self.halted.assign(tf.maximum(self.halted, halt))

    def _count_bad(self, n: Optional[tf.Tensor] = None) -> None:
        """Count ``n`` skipped steps (default one)."""
        n = tf.constant(1, tf.int64) if n is None else n
        self.skipped_steps.assign_add(n)
        self.epoch_skipped.assign_add(n)
        self.incidents.assign_add(n)


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


def _make_keras_function(model: keras.Model, step_fn: Callable[[Any], Any]) -> Any:
    """Keras's own train-function machinery around ``step_fn`` (steps_per_execution, jit_compile, strategy)."""
    if hasattr(model, "_make_function"):
        return model._make_function(step_fn)
    # older Keras: build with train_step swapped in (main thread; nothing traces until the first call, when the
    # swap is gone: so trace it through a closure that always calls step_fn)
    saved = vars(model).get("train_function")
    object.__setattr__(model, "train_step", step_fn)
    try:
        type(model).make_train_function(model, force=True)
        return model.train_function
    finally:
        object.__delattr__(model, "train_step")
        if saved is not None:
            model.train_function = saved


def get_step(model: keras.Model, create: bool = True) -> Optional[ComposedStep]:
    """The model's :class:`ComposedStep` (created on first use, in the model's strategy scope).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> get_step(model) is get_step(model), get_step(model, create=False) is not None
        (True, True)
    """
    step = vars(model).get(_STEP_ATTR)
    if step is None and create:
        step = ComposedStep(model)
        object.__setattr__(model, _STEP_ATTR, step)
    return step


def make_train_function(model: keras.Model, force: bool = False) -> Any:
    """The train function for the fit that starts: the composed one when a part is asked for, else Keras's.

    Called through the ``make_train_function`` hook of :mod:`keras_scale.lifecycle` and by wrapped models.

    Example:
        make_train_function(model)        # from the hooked model.make_train_function
    """
    step = get_step(model, create=False)
    if step is not None and step.active:
        return step.place_train_function(force)
    if step is not None:
        step.give_back_plain()
    return type(model).make_train_function(model, force)


lifecycle.set_train_function_maker(make_train_function)  # the hooked model.make_train_function calls it


def rebuild(model: keras.Model) -> None:
    """Re-trace the model's train function mid-fit (e.g. after a learning-rate schedule was replaced).

    Example:
        rebuild(model)                    # after changing what the step traces (e.g. a wrapped schedule)
    """
    step = get_step(model, create=False)
    if step is not None:
        step._cache.clear()
        step._plain = None
    if step is not None and step.active:
        step.place_train_function(force=True)
    else:
        type(model).make_train_function(model, force=True)


def state_variables(model: keras.Model) -> Dict[str, tf.Variable]:
    """keras_scale's per-model training state to checkpoint (counters of the composed step).

    Example:
        >>> import keras
        >>> sorted(state_variables(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])))
        ['skipped_steps']
    """
    return get_step(model).variables()
