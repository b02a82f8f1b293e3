"""Rematerialization (gradient checkpointing) that trains in TensorFlow ``model.fit``.

Keras 3's own ``keras.RematScope`` / ``keras.remat`` break ``fit`` on the TensorFlow backend: they hand the
layer's keyword arguments (``training=...``) to ``tf.recompute_grad``, whose graph-mode ``custom_gradient``
accepts positional arguments only ("custom_gradient ... keywords arguments only when eager execution is
enabled", keras-team/keras#21207). :func:`remat` wraps a layer so that its call goes through
``tf.recompute_grad`` over a closure that takes **positional tensors only** (keyword arguments and the
``training`` flag are captured by the closure). The block's activations are then dropped after the forward
pass and recomputed during back-propagation: less peak memory, one extra forward pass of the block.

The block's variables are read once per step and the block runs in a ``keras.StatelessScope`` bound to those
values, so the recomputation sees exactly the forward pass's weights (never a value the optimizer already
updated), random layers (``Dropout``) draw the same numbers in both passes, and ``BatchNormalization`` updates
its moving statistics once per step, not twice.

Example:
    >>> import keras, keras_scale as ks
    >>> inputs = keras.Input((64,))
    >>> x = inputs
    >>> for _ in range(8):
    ...     x = ks.remat(keras.layers.Dense(64, activation="relu"))(x)
    >>> model = keras.Model(inputs, keras.layers.Dense(1)(x))
    >>> model.compile("adam", "mse")  # then model.fit(...) as usual

    or, on an existing functional / Sequential model, recompute chosen blocks (weights are shared):

    >>> from keras_scale.remat import remat_model
    >>> model = remat_model(model, select=lambda layer: isinstance(layer, keras.layers.Dense))
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import keras
import tensorflow as tf
from keras import tree
from keras.src.models.functional import Functional


__all__ = ["remat", "remat_model", "Remat"]


def _is_tensor(x: Any) -> bool:
    return isinstance(x, (tf.Tensor, tf.Variable)) or keras.ops.is_tensor(x)


@keras.saving.register_keras_serializable(package="keras_scale")
class Remat(keras.layers.Wrapper):
    """A layer whose activations are recomputed during back-propagation instead of stored.

    Build it with :func:`remat`. The wrapped layer's variables are the wrapper's variables (same objects), so a
    model with ``Remat`` blocks has the same ``get_weights()`` order as the plain model.

    Args:
        layer: the block to recompute (any Keras layer, including a ``keras.Model`` used as a block).

    Example:
        >>> block = Remat(keras.layers.Dense(64, activation="relu"))
        >>> y = block(keras.ops.ones((2, 32)))
    """

    def __init__(self, layer: keras.layers.Layer, **kwargs: Any) -> None:
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                f"remat() expects a keras Layer (or a Model used as a block); got {layer!r} of type "
                f"{type(layer).__name__}. Wrap the layer object, not its output tensor."
            )
        if isinstance(layer, Remat):
            raise ValueError(f"{layer.name!r} is already rematerialized; wrap it once.")
        kwargs.setdefault("name", f"remat_{layer.name}")
        super().__init__(layer, **kwargs)
        self.supports_masking = getattr(layer, "supports_masking", False)

    # --- building -------------------------------------------------------------------------------------------
    def build(self, input_shape: Any = None) -> None:
        # The inner layer is built the ordinary Keras way (a symbolic call) on first use, see _build_inner:
        # creating variables inside tf.recompute_grad's custom gradient is not allowed.
        self.built = True

    def _build_inner(self, args: tuple, kwargs: dict) -> None:
        if self.layer.built and not _has_unbuilt_sublayers(self.layer):
            return

        def to_symbolic(x: Any) -> Any:
            if _is_tensor(x) or isinstance(x, keras.KerasTensor):
                return keras.KerasTensor(tuple(x.shape), dtype=keras.backend.standardize_dtype(x.dtype))
            return x

        self.layer(*tree.map_structure(to_symbolic, args), **tree.map_structure(to_symbolic, kwargs))

    def compute_output_spec(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("training", None)
        self._build_inner(args, kwargs)
        return self.layer.compute_output_spec(*args, **kwargs)

    def compute_output_shape(self, *args: Any, **kwargs: Any) -> Any:
        return self.layer.compute_output_shape(*args, **kwargs)

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return self.layer.compute_mask(inputs, mask)

    # --- the recomputed call --------------------------------------------------------------------------------
    def call(self, inputs: Any, *args: Any, training: Optional[bool] = None, **kwargs: Any) -> Any:
        call_args = (inputs, *args)
        self._build_inner(call_args, kwargs)
        if training is not None and getattr(self.layer, "_call_has_training_arg", False):
            kwargs = {**kwargs, "training": training}
        if training is None or training is False:
            # Inference (predict/evaluate): nothing to recompute, call the block directly.
            return self.layer(*call_args, **kwargs)

        # Everything tensor-valued travels positionally; the rest (training flag, python options) is closed over.
        leaves = tree.flatten((call_args, kwargs))
        tensor_positions = [i for i, leaf in enumerate(leaves) if _is_tensor(leaf)]
        tensors = [tf.convert_to_tensor(leaves[i]) for i in tensor_positions]
        num_tensors = len(tensors)

        # The block's variables travel positionally too: they are read ONCE, here, and the block (forward and
        # recomputation) runs in a keras.StatelessScope that maps each variable to that value. Re-reading the
        # variables during the recomputation would race with the optimizer: a variable whose own gradient is
        # ready early (say the block's last kernel) can be updated before the recomputation reads it to compute
        # the gradient for the layers below, and nothing in the graph orders that read first. State the block
        # updates (BatchNormalization's moving statistics, random-seed states) comes back as extra outputs and is
        # assigned here, once: the recomputation re-draws the same random numbers and does not apply the
        # moving-statistics update a second time.
        weights = list(self.layer.trainable_variables)
        states = _state_variables(self.layer, exclude=weights)
        mapped = weights + states
        values = [_read(v) for v in weights] + [_as_float(_read(v)) for v in states]
        structure: dict = {}

        def block(*flat: tf.Tensor) -> Any:
            new_leaves = list(leaves)
            for position, tensor in zip(tensor_positions, flat[:num_tensors]):
                new_leaves[position] = tensor
            a, kw = tree.pack_sequence_as((call_args, kwargs), new_leaves)
            mapping = [(v, tf.cast(value, v.dtype)) for v, value in zip(mapped, flat[num_tensors:])]
            # collect_losses: add_loss / activity regularizers inside the block come back as outputs (a plain
            # StatelessScope drops them) and are added once, outside, where their gradient flows as usual
            with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
                outputs = self.layer(*a, **kw)
            _check_updates(scope, mapped, self.layer.name)
            structure["outputs"] = outputs
            structure["num_losses"] = len(scope.losses)
            flat_outputs = list(tree.flatten(outputs))
            new_states = [_as_float(scope.get_current_value(v)) for v in states]
            losses = [tf.cast(loss, tf.float32) for loss in scope.losses]
            results = flat_outputs + new_states + losses
            return results[0] if len(results) == 1 else tuple(results)

        results = tf.recompute_grad(block)(*tensors, *values)
        if not isinstance(results, (list, tuple)):
            results = [results]
        results = list(results)
        num_losses = structure["num_losses"]
        losses = results[len(results) - num_losses:]
        results = results[:len(results) - num_losses]
        num_outputs = len(results) - len(states)
        for variable, new_value in zip(states, results[num_outputs:]):
            variable.assign(tf.cast(new_value, variable.dtype))
        for loss in losses:
            self.add_loss(loss)
        return tree.pack_sequence_as(structure["outputs"], results[:num_outputs])


def _read(variable: Any) -> tf.Tensor:
    """The variable's stored value (no autocast: the block's own layers cast it as they would normally)."""
    raw = getattr(variable, "_value", None)
    return tf.identity(raw if raw is not None else variable)


def _as_float(value: tf.Tensor) -> tf.Tensor:
    # Integer state (random seeds) crosses the custom gradient as float64 (exact below 2**53): integer tensors
    # there make TensorFlow warn about watching non-float tensors.
    return value if value.dtype.is_floating else tf.cast(value, tf.float64)


def _check_updates(scope: Any, mapped: list, name: str) -> None:
    known = {id(v) for v in mapped}
    foreign = [key for key in scope.state_mapping if key not in known]
    if foreign:
        raise ValueError(
            f"remat({name!r}): the block assigns to {len(foreign)} variable(s) it does not own (e.g. a shared or "
            "global random-seed state); such updates cannot be replayed by the recomputation. Give random layers "
            "their own seed (keras.layers.Dropout(rate, seed=...) creates one) or remat a smaller block.")


def _has_unbuilt_sublayers(layer: keras.layers.Layer) -> bool:
    return any(not sub.built for sub in layer._flatten_layers(include_self=False))


def _state_variables(layer: keras.layers.Layer, exclude: Sequence[Any] = ()) -> list:
    """State the block's call may update: non-trainable variables of its trainable layers (BatchNormalization's
    moving statistics) and random-seed states. Frozen layers' weights are left out (they never change)."""
    found: dict = {id(v): None for v in exclude}
    for sub in layer._flatten_layers(include_self=True):
        if sub.trainable:
            for variable in getattr(sub, "_non_trainable_variables", []) or []:
                found.setdefault(id(variable), variable)
        for generator in getattr(sub, "_seed_generators", []) or []:
            found.setdefault(id(generator.state), generator.state)
    return [v for v in found.values() if v is not None]


def remat(layer: keras.layers.Layer) -> Remat:
    """Recompute ``layer``'s activations in the backward pass instead of keeping them (gradient checkpointing).

    Works in ``model.fit`` (graph mode), under ``tf.distribute`` strategies and inside
    ``keras_scale.wrap``'s micro-batch loop; gradients equal the plain layer's. Only training calls
    (``training=True``, as in ``fit``) are recomputed; inference calls run the block directly. A Keras mask
    attached to the input is not forwarded into the block: pass masks as keyword arguments (``mask=...``).
    Costs one extra forward pass of the block per step; saves the block's intermediate activations (choose
    blocks whose *inside* is large relative to their output, e.g. a Transformer block or an MLP with a wide
    hidden layer).

    Args:
        layer: a Keras layer or a ``keras.Model`` used as a block.

    Returns:
        A :class:`Remat` layer to use in place of ``layer`` (it shares ``layer``'s variables).

    Example:
        x = keras_scale.remat(keras.layers.Dense(256, activation="gelu"))(x)
    """
    return Remat(layer)


def remat_model(model: keras.Model, select: Optional[Callable[[keras.layers.Layer], bool]] = None) -> keras.Model:
    """A copy of a functional or Sequential ``model`` whose selected layers are rematerialized.

    The copy shares the original's layer objects (so its weights *are* the original's weights); only the
    selected layers are wrapped in :class:`Remat`. Compile the returned model before ``fit``.

    Args:
        model: a functional or ``Sequential`` Keras model (subclassed models cannot be re-wired: wrap their
            blocks with :func:`remat` in ``__init__`` instead).
        select: ``select(layer) -> bool`` chooses the blocks; default: every layer that has weights.

    Example:
        model = remat_model(model, select=lambda l: l.name.startswith("block"))
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"remat_model() expects a keras.Model; got {type(model).__name__}. Use remat(layer).")
    if not isinstance(model, (keras.Sequential, Functional)):
        raise TypeError(
            f"remat_model() can only re-wire functional or Sequential models; {model.name!r} is a subclassed "
            f"{type(model).__name__}. Wrap its blocks with keras_scale.remat(layer) where they are created."
        )
    if select is None:
        def select(layer: keras.layers.Layer) -> bool:
            return bool(layer.weights) and not isinstance(layer, keras.layers.InputLayer)

    chosen: list = []

    def clone_function(layer: keras.layers.Layer) -> keras.layers.Layer:
        if not isinstance(layer, (keras.layers.InputLayer, Remat)) and select(layer):
            chosen.append(layer.name)
            return Remat(layer)
        return layer

    new_model = keras.models.clone_model(model, clone_function=clone_function)
    if not chosen:
        raise ValueError(
            f"remat_model(): `select` chose no layer of {model.name!r} (layers: "
            f"{[layer.name for layer in model.layers]}). Pass a `select` that returns True for the blocks to recompute."
        )
    return new_model
