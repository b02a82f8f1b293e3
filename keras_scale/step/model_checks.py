"""What the composed step refuses, and the questions its parts ask about the model and its optimizer.

Checked at fit start (:func:`check_supported`: the strategy, Keras's own accumulation) and by ``keras_scale.wrap``
(:func:`check_wrappable`: a model whose own ``train_step``, ``compute_loss`` or loops the wrapper would drop);
:func:`is_loss_scaled` and :func:`_has_synchronized_batchnorm` are asked while the step is traced. Pure Keras
questions, no graph code.

Example:
    >>> import keras
    >>> is_loss_scaled(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    True
"""
from __future__ import annotations

from typing import Any, Optional

import keras

from keras_scale.model_kind import has_own_compute_loss, has_own_train_step
from keras_scale.schedules import inner_optimizer
from keras_scale.sync_bn import batchnorm_layers


def is_loss_scaled(optimizer: Any) -> bool:
    """True for Keras's ``LossScaleOptimizer`` (mixed_float16).

    Example:
        >>> is_loss_scaled(keras.optimizers.SGD())
        False
    """
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


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
