"""The composed step of one model: :class:`ComposedStep`, assembled from its parts, and how callers reach it.

:class:`ComposedStep` holds the configuration (accumulation, from ``wrap``), the requests of the fit being set up
(the guard, from ``NanGuard``) and the state of every part (its variables); its methods come from one mixin per
part (the order: :mod:`keras_scale.step.train_step`). :func:`get_step` attaches it to a model;
:func:`make_train_function` and :func:`rebuild` put its train function in place.

Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> type(get_step(model)).__name__
    'ComposedStep'
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import keras
import tensorflow as tf

from keras_scale import lifecycle
from keras_scale.step.accumulate import AccumulateMixin
from keras_scale.step.apply import ApplyMixin
from keras_scale.step.foreign import ForeignStepMixin
from keras_scale.step.guard import DIAG_CAPACITY, DiagnosisSlot, GuardMixin
from keras_scale.step.logs import LogsMixin
from keras_scale.step.placement import PlacementMixin
from keras_scale.step.reduce import ReduceMixin
from keras_scale.step.train_step import TrainStepMixin

_STEP_ATTR = "_keras_scale_step"


class ComposedStep(TrainStepMixin, AccumulateMixin, ReduceMixin, GuardMixin, ApplyMixin, LogsMixin, ForeignStepMixin,
                   PlacementMixin):
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

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=2)


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
