"""The training state of a model in ``fit``: the one definition every keras_scale piece reads.

"Where training is" is the set of variables a train step reads and writes: the model's weights (trainable and
not, seed-generator states included), **every optimizer the model trains with** and its slots, the metric
accumulators, and keras_scale's own counters. ``ChiefCheckpoint`` (save, restore, signature), ``NanGuard``
(snapshot, rollback, finite-state check), ``accum="auto"`` (the restore before a retry) and the composed step
(which optimizers to switch) all ask this module; none keeps its own list.

Optimizers are found by walking the model once: ``model.optimizer`` first, then every optimizer held by the model
or a nested layer as an attribute, in a list/tuple or in a dict (the keras-io GAN's ``d_optimizer`` and
``g_optimizer``; ``self.optimizers = {"gen": ...}``). Each is named by a stable path: ``"optimizer"``,
``"d_optimizer"``, ``"optimizers/gen"``, ``"generator/optimizer"``. A ``LossScaleOptimizer`` is one optimizer (its
variables include its inner optimizer's). Like optax's explicit state tuples, what a piece needs is named here.

Example:
    >>> import keras
    >>> from keras_scale import state
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="adam", loss="mse")
    >>> list(state.optimizers(model))
    ['optimizer']
    >>> snapshot = state.TrainingState(model).snapshot()   # host copies of weights + every optimizer's state
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

__all__ = ["optimizers", "optimizer_variables", "model_variables", "metric_variables", "lr_multiplier_variables",
           "variables", "float_variables", "iterations", "primary_optimizer", "signature", "build",
           "is_built", "TrainingState"]

_MAX_DEPTH = 4  # containers inside containers: deep enough for any model seen, bounded for odd objects


def _containers(value: Any, path: str, depth: int) -> Iterator[Tuple[str, Any]]:
    if isinstance(value, keras.optimizers.Optimizer):
        yield path, value
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _containers(item, f"{path}/{key}", depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _containers(item, f"{path}/{i}", depth + 1)


def optimizers(model: keras.Model) -> Dict[str, keras.optimizers.Optimizer]:
    """Every optimizer ``model`` trains with, by stable path, ``model.optimizer`` first (``"optimizer"``).

    Deduplicated by identity (one object shared by a wrapper and its inner model is listed once, under its first
    path). ``model.optimizer`` is listed even when a custom ``train_step`` never uses it (Keras's default from a
    bare ``compile()``): its two variables cost nothing and restoring them is harmless.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> model.extra = {"head": keras.optimizers.Adam()}
        >>> list(optimizers(model))
        ['optimizer', 'extra/head']
    """
    found: Dict[str, keras.optimizers.Optimizer] = {}
    seen: set = set()

    def add(path: str, opt: Any) -> None:
        if id(opt) in seen:
            return
        seen.add(id(opt))
        inner = getattr(opt, "inner_optimizer", None)
        if inner is not None:
            seen.add(id(inner))  # (a LossScaleOptimizer's variables hold its inner optimizer's)
        found[path] = opt

    main = getattr(model, "optimizer", None)
    if isinstance(main, keras.optimizers.Optimizer):
        add("optimizer", main)
    for layer in _layers(model):
        prefix = "" if layer is model else _layer_path(model, layer) + "/"
        for name, value in list(vars(layer).items()):
            if name.startswith("_") or name in ("optimizer",) and layer is model:
                continue
            for path, opt in _containers(value, prefix + name, 0):
                add(path, opt)
    return found


def _layers(model: keras.Model) -> List[Any]:
    try:
        return list(model._flatten_layers(include_self=True, recursive=True))
    except Exception:  # noqa: BLE001 - a half-constructed model
        return [model]


def _layer_path(model: keras.Model, layer: Any) -> str:
    path = getattr(layer, "path", None) or layer.name
    root = getattr(model, "path", None) or model.name
    return path[len(root) + 1:] if path.startswith(root + "/") else path


def primary_optimizer(model: keras.Model) -> Optional[keras.optimizers.Optimizer]:
    """The optimizer whose update count is "the step": the one with the most updates applied (``model.optimizer``
    on ties and for ordinary models; a GAN's ``model.optimizer`` from a bare ``compile()`` never moves).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> primary_optimizer(model) is model.optimizer
        True
    """
    opts = list(optimizers(model).values())
    if not opts:
        return None
    return max(opts, key=lambda o: int(o.iterations.numpy()))  # (max keeps the first of equals)


def iterations(model: keras.Model) -> int:
    """Updates applied so far: the largest ``iterations`` of the model's optimizers (0 without one).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> iterations(model)
        0
    """
    return max([int(o.iterations.numpy()) for o in optimizers(model).values()] or [0])


def _unique(items: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    seen: set = set()
    for key, var in items:
        if id(var) in seen:
            continue
        seen.add(id(var))
        name, n = key, 1
        while name in out:
            n += 1
            name = f"{key}#{n}"
        out[name] = var
    return out


def _path(var: Any) -> str:
    return str(getattr(var, "path", None) or var.name)


def model_variables(model: keras.Model) -> Dict[str, Any]:
    """The model's own variables (weights, BatchNorm statistics, seed-generator states), by variable path.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="out")], name="net")
        >>> sorted(model_variables(model))
        ['net/out/bias', 'net/out/kernel']
    """
    return _unique([(_path(v), v) for v in model.variables])


def optimizer_variables(model: keras.Model) -> Dict[str, Dict[str, Any]]:
    """Each optimizer's variables (iterations, learning rate, slots), by optimizer path then variable name.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> sorted(optimizer_variables(model)["optimizer"])
        ['iteration', 'learning_rate']
    """
    out: Dict[str, Dict[str, Any]] = {}
    for path, opt in optimizers(model).items():
        out[path] = _unique([(str(v.name), v) for v in opt.variables])
    return out


def metric_variables(model: keras.Model) -> List[Any]:
    """The metric accumulators (loss tracker and compiled/own metrics), in Keras's order.

    Example:
        >>> import keras
        >>> metric_variables(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
        []
    """
    try:
        return list(model.metrics_variables)
    except Exception:  # noqa: BLE001 - a model without compiled metrics
        return []


def lr_multiplier_variables(model: keras.Model) -> Dict[str, Any]:
    """Each optimizer's LR multiplier variable (``lr_multiplier`` for ``model.optimizer``, ``lr_multiplier/<path>``
    for another), for those that have one: keras_scale's per-optimizer state a checkpoint must hold.

    Example:
        >>> import keras
        >>> lr_multiplier_variables(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
        {}
    """
    from keras_scale.schedules import lr_multiplier

    out: Dict[str, Any] = {}
    for path, opt in optimizers(model).items():
        mult = lr_multiplier(opt)
        if mult is not None:
            out["lr_multiplier" if path == "optimizer" else f"lr_multiplier/{path}"] = mult
    return out


def variables(model: keras.Model, include_metrics: bool = True) -> Dict[str, Any]:
    """The whole training state, by stable key: ``model/<path>``, ``optimizers/<opt path>/<name>``,
    ``metrics/<i>`` (with ``include_metrics``). keras_scale's counters are :func:`keras_scale.step.state_variables`
    and :func:`lr_multiplier_variables`.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="out")], name="net")
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> sorted(variables(model, include_metrics=False))
        ['model/net/out/bias', 'model/net/out/kernel', 'optimizers/optimizer/iteration', 'optimizers/optimizer/learning_rate']
    """
    items = [(f"model/{k}", v) for k, v in model_variables(model).items()]
    for opt_path, group in optimizer_variables(model).items():
        items += [(f"optimizers/{opt_path}/{k}", v) for k, v in group.items()]
    if include_metrics:
        items += [(f"metrics/{i}", v) for i, v in enumerate(metric_variables(model))]
    return _unique(items)


def float_variables(model: keras.Model) -> List[Any]:
    """The floating-point weights and optimizer variables: what must stay finite (NanGuard, ChiefCheckpoint).

    Example:
        >>> import keras
        >>> len(float_variables(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])))
        2
    """
    return [v for v in variables(model, include_metrics=False).values() if "float" in str(v.dtype)]


def step_mutable_variables(model: keras.Model) -> List[Any]:
    """What a train step may change besides weights and optimizer slots: non-trainable variables of trainable
    layers (BatchNorm moving statistics, counters), seed-generator states, metric accumulators (``accum="auto"``
    restores them before retrying a step that ran out of memory).

    Frozen layers' variables (``layer.trainable = False``) are left out: a train step does not change them.

    Example:
        >>> import keras
        >>> m = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization()])
        >>> len(step_mutable_variables(m))    # moving mean and variance
        2
    """
    frozen = {id(v) for layer in model._flatten_layers() if not layer.trainable for v in layer.variables}
    state = [v for v in model.non_trainable_variables
             if id(v) not in frozen or "seed_generator" in getattr(v, "path", "")]
    return state + metric_variables(model)


def signature(model: keras.Model) -> Dict[str, Any]:
    """What a checkpoint must match to be restored: the model's variables (path, shape) and, per optimizer, its
    class and variables (name, shape).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="adam", loss="mse")
        >>> signature(model)["optimizers"]["optimizer"]["class"]
        'Adam'
    """
    def describe(variables: Any) -> List[List[Any]]:
        return [[_path(v), [int(d) for d in v.shape]] for v in variables]

    opts = optimizers(model)
    main = opts.get("optimizer")
    return {
        "model": describe(model.variables),
        "optimizer": describe(main.variables) if main is not None else [],  # (read by older versions)
        "optimizers": {path: {"class": _class_name(opt),
                              "variables": [[str(v.name), [int(d) for d in v.shape]] for v in opt.variables]}
                       for path, opt in opts.items()},
    }


def _class_name(opt: Any) -> str:
    inner = getattr(opt, "inner_optimizer", None)
    return type(opt).__name__ if inner is None else f"{type(opt).__name__}({type(inner).__name__})"


def is_built(model: keras.Model) -> bool:
    """Every layer that holds variables has them, and every optimizer a step applies has its slots.

    A model without ``call()`` (the keras-io GAN) is never "built" for Keras, but its sub-models are: it counts as
    built when they are. An optimizer that has not been built yet (its first ``apply`` builds it) makes it False.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> is_built(model)    # SGD has no slots, but it is not built before the first step
        False
    """
    layers = [layer for layer in _layers(model) if layer is not model or _has_call(model)]
    if not all(layer.built for layer in layers) or not model.variables:
        return False
    return all(opt.built for path, opt in optimizers(model).items() if _trains(model, path))


def _has_call(model: keras.Model) -> bool:
    return type(model).call is not keras.Model.call and type(model).call is not keras.layers.Layer.call


def _trains(model: keras.Model, path: str) -> bool:
    """Whether the optimizer at ``path`` is one a step applies: Keras's own ``train_step`` applies
    ``model.optimizer`` only (another one held by the model is state, not a trainer); a model with its own
    ``train_step`` applies the others, and ``model.optimizer`` only when it holds no other (else it is the unused
    default of a bare ``compile()``)."""
    from keras_scale.model_kind import has_own_train_step

    if not has_own_train_step(model):
        return path == "optimizer"
    return path != "optimizer" or len(optimizers(model)) == 1


def build(model: keras.Model, data: Any = None) -> bool:
    """Create every variable of the training state before the first step, without training; True when done.

    ``data`` is the fit's data iterator (nothing is read from it) or its element spec. Layers are built from it
    (Keras's symbolic build) when needed; optimizers used by Keras's own ``train_step`` are built for the trainable
    variables (as Keras's symbolic build does); a model with its own ``train_step`` (a GAN whose optimizers build at
    their first ``apply``) has its train step *traced* once on ``data``: tracing creates the variables and runs
    nothing, so no weight, slot, counter or seed moves.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="adam", loss="mse")
        >>> build(model), model.optimizer.built
        (True, True)
    """
    from keras_scale.model_kind import has_own_train_step

    if is_built(model):
        return True
    strategy = model.distribute_strategy
    own_step = has_own_train_step(model) or has_own_train_step(getattr(model, "inner", model))
    layers = [layer for layer in _layers(model) if layer is not model or _has_call(model)]
    spec = _local_spec(getattr(data, "element_spec", data))
    if (not all(layer.built for layer in layers) or not model.variables) and spec is not None and _has_call(model):
        model._symbolic_build(data_batch=spec)
    if not all(layer.built for layer in layers) or not model.variables:
        if not own_step or data is None:
            return False
    main = getattr(model, "optimizer", None)
    if main is not None and not main.built and model.trainable_variables and _trains(model, "optimizer"):
        # (as Keras's symbolic build does; a train_step of its own applying model.optimizer to the model's
        # trainable variables, the usual "customizing fit" example, gets the same slots)
        with strategy.scope():
            main.build(model.trainable_variables)
    if not own_step or is_built(model) or data is None:
        return is_built(model)
    _trace_train_step(model, data)  # other optimizers, built at their first apply (keras-io's GAN)
    return is_built(model)


def _local_spec(spec: Any) -> Any:
    """One replica's spec of a distributed iterator's element spec (Keras's symbolic build takes a local batch)."""
    def local(s: Any) -> Any:
        values = getattr(s, "_value_specs", None)
        return values[0] if values else s

    try:
        return tf.nest.map_structure(local, spec)
    except Exception:  # noqa: BLE001 - not a nest of specs
        return spec


def _trace_train_step(model: keras.Model, data: Any) -> None:
    """Trace ``model.train_step`` once on ``data`` (an iterator: nothing is read; or a spec): creates variables."""
    strategy = model.distribute_strategy
    if hasattr(data, "__next__") or hasattr(data, "get_next"):
        def one_step(iterator: Any) -> Any:
            return strategy.run(type(model).train_step, args=(model, next(iterator)))
    else:
        def one_step(batch: Any) -> Any:
            return strategy.run(type(model).train_step, args=(model, batch))
    tf.function(one_step, autograph=False).get_concrete_function(data)


class TrainingState:
    """Host copies of a model's training state, and putting them back (NanGuard's in-memory rollback).

    ``keep`` names what a restore leaves as it is now (e.g. each optimizer's learning rate, which a rollback must
    not undo).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> state = TrainingState(model)
        >>> saved = state.snapshot()
        >>> state.restore(saved)      # the keys it found no saved value for
        []
    """

    def __init__(self, model: keras.Model) -> None:
        self.model = model

    def variables(self) -> Dict[str, Any]:
        """The variables a snapshot holds: :func:`variables` without the metrics."""
        return variables(self.model, include_metrics=False)

    def snapshot(self) -> Dict[str, np.ndarray]:
        """Host copies of every weight and every optimizer variable, by key."""
        return {k: np.array(v.numpy()) for k, v in self.variables().items()}

    def restore(self, saved: Dict[str, np.ndarray], keep: Tuple[Any, ...] = ()) -> List[str]:
        """Put ``saved`` back (variables created since are left as they are); returns the keys not in ``saved``."""
        kept = {id(v) for v in keep}
        missing = []
        for key, var in self.variables().items():
            if id(var) in kept:
                continue
            if key not in saved:
                missing.append(key)
                continue
            var.assign(saved[key])
        return missing
