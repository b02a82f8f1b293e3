"""Rematerialization (gradient checkpointing) that trains in TensorFlow ``model.fit``.

Keras 3's own ``keras.RematScope`` / ``keras.remat`` break ``fit`` on the TensorFlow backend: they hand the
layer's keyword arguments (``training=...``) to ``tf.recompute_grad``, whose graph-mode ``custom_gradient``
accepts positional arguments only ("custom_gradient ... keywords arguments only when eager execution is
enabled", keras-team/keras#21207). :func:`remat` wraps a layer so that its call goes through
``tf.recompute_grad`` over a closure that takes **positional tensors only** (keyword arguments and the
``training`` flag are captured by the closure). The block's activations are then dropped after the forward
pass and recomputed during back-propagation: less peak memory, one extra forward pass of the block.

State inside a block is handled: random layers (``Dropout``) draw the same numbers in the recomputation as in
the forward pass, and ``BatchNormalization`` updates its moving statistics once per step, not twice (the block's
non-trainable variables and seed states are snapshotted before the forward pass and restored before recomputing).

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

import sys
import types
from typing import Any, Callable, Optional

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
        self._output_structure = None

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

        # Everything tensor-valued travels positionally; the rest (training flag, python options) is closed over.
        leaves = tree.flatten((call_args, kwargs))
        tensor_positions = [i for i, leaf in enumerate(leaves) if _is_tensor(leaf)]
        tensors = [tf.convert_to_tensor(leaves[i]) for i in tensor_positions]
        # Non-trainable state the block updates as it runs (BatchNormalization's moving statistics, random-seed
        # states): snapshot it, and restore it at the start of the block. In the forward pass the restore is a
        # no-op; in the recomputation it rewinds the state, so the block re-draws the same random numbers and
        # re-applies the same moving-statistics update (instead of applying it a second time).
        states = _state_variables(self.layer)
        if any("float" not in keras.backend.standardize_dtype(state.dtype) for state in states):
            _quiet_integer_watch_warning()
        snapshots = [tf.identity(state.value) for state in states]
        num_tensors = len(tensors)
        structure: dict = {}

        def block(*flat: tf.Tensor) -> Any:
            # Restore the random state of the forward pass (a no-op then; the reset during recomputation).
            for state, snapshot in zip(states, flat[num_tensors:]):
                state.assign(snapshot)
            new_leaves = list(leaves)
            for position, tensor in zip(tensor_positions, flat[:num_tensors]):
                new_leaves[position] = tensor
            a, kw = tree.pack_sequence_as((call_args, kwargs), new_leaves)
            outputs = self.layer(*a, **kw)
            structure["outputs"] = outputs
            flat_outputs = tree.flatten(outputs)
            return flat_outputs[0] if len(flat_outputs) == 1 else tuple(flat_outputs)

        flat_outputs = tf.recompute_grad(block)(*tensors, *snapshots)
        if not isinstance(flat_outputs, (list, tuple)):
            flat_outputs = [flat_outputs]
        return tree.pack_sequence_as(structure["outputs"], list(flat_outputs))


def _has_unbuilt_sublayers(layer: keras.layers.Layer) -> bool:
    return any(not sub.built for sub in layer._flatten_layers(include_self=False))


def _state_variables(layer: keras.layers.Layer) -> list:
    """State the block's call may update: non-trainable variables of its trainable layers (BatchNormalization's
    moving statistics) and random-seed states. Frozen layers' weights are left out (no copy per step)."""
    found: dict = {}
    for sub in layer._flatten_layers(include_self=True):
        if sub.trainable:  # a frozen layer's variables are frozen weights, not state its call updates
            for variable in getattr(sub, "_non_trainable_variables", []) or []:
                found.setdefault(id(variable), variable)
        for generator in getattr(sub, "_seed_generators", []) or []:
            found.setdefault(id(generator.state), generator.state)
    return list(found.values())


class _DropIntegerWatchWarning:
    """Drops TF's "watched tensor must be floating" warning, which recomputing a block's (integer) random-seed
    state triggers by design: that state is restored, not differentiated."""

    def filter(self, record: Any) -> bool:
        return "The dtype of the watched tensor must be floating" not in str(record.msg)


_WARNING_FILTER = _DropIntegerWatchWarning()


def _quiet_integer_watch_warning() -> None:
    logger = tf.get_logger()
    if _WARNING_FILTER not in logger.filters:
        logger.addFilter(_WARNING_FILTER)


def remat(layer: keras.layers.Layer) -> Remat:
    """Recompute ``layer``'s activations in the backward pass instead of keeping them (gradient checkpointing).

    Works in ``model.fit`` (graph mode), under ``tf.distribute`` strategies and inside
    ``keras_scale.wrap``'s micro-batch loop; gradients equal the plain layer's. Costs one extra forward pass of
    the block per step; saves the block's intermediate activations (choose blocks whose *inside* is large
    relative to their output, e.g. a Transformer block or an MLP with a wide hidden layer).

    Args:
        layer: a Keras layer or a ``keras.Model`` used as a block.

    Returns:
        A :class:`Remat` layer to use in place of ``layer`` (it shares ``layer``'s variables).

    Example:
        >>> x = keras_scale.remat(keras.layers.Dense(256, activation="gelu"))(x)  # doctest: +SKIP
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
        >>> model = remat_model(model, select=lambda l: l.name.startswith("block"))  # doctest: +SKIP
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


class _CallableModule(types.ModuleType):
    """``keras_scale.remat`` is both this module and the function: once ``import keras_scale.remat`` has run,
    Python binds the package attribute to the module, so the module forwards calls to :func:`remat`."""

    def __call__(self, layer: keras.layers.Layer) -> Remat:
        return remat(layer)


sys.modules[__name__].__class__ = _CallableModule
