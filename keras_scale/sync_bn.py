"""Synchronized BatchNormalization: batch statistics over the global batch, not each replica's slice.

With a small per-replica batch (say < 16 samples), each replica's ``BatchNormalization`` normalizes with noisy
statistics of its own slice, and the model trains worse than on one device with the same global batch.
:func:`sync_batchnorm` switches every ``BatchNormalization`` layer of a model (nested models included) to
``synchronized=True``: mean and variance are all-reduced across replicas in every training step (one small
all-reduce per BN layer). Weights and inference outputs are unchanged: the conversion happens in place.

Example:
    >>> import keras, tensorflow as tf, keras_scale as ks
    >>> strategy = tf.distribute.MirroredStrategy()
    >>> with strategy.scope():
    ...     model = ks.sync_batchnorm(build_model())     # doctest: +SKIP
    ...     model.compile(optimizer="sgd", loss="mse")
"""
from __future__ import annotations

from typing import List

import keras

__all__ = ["sync_batchnorm", "batchnorm_layers"]


def batchnorm_layers(model: keras.layers.Layer) -> List[keras.layers.BatchNormalization]:
    """Every ``BatchNormalization`` layer in ``model``, nested models and wrapped layers included.

    Example:
        >>> len(batchnorm_layers(keras.Sequential([keras.layers.BatchNormalization()])))
        1
    """
    return [layer for layer in model._flatten_layers(include_self=True, recursive=True)
            if isinstance(layer, keras.layers.BatchNormalization)]


def sync_batchnorm(model: keras.Model) -> keras.Model:
    """Return ``model`` with every ``BatchNormalization`` synchronized across replicas (weights kept).

    The change is made in place (the returned model is ``model``; its variables, optimizer and compile state
    are untouched) and is saved with the model (``synchronized: true`` in each layer's config). Outside a
    multi-replica strategy a synchronized layer behaves exactly like the plain one. Already compiled train/
    predict functions are dropped so the next ``fit`` traces the synchronized layers.

    With ``keras_scale.wrap(model, accum=N)`` the statistics are those of one micro-batch gathered across
    replicas (each micro-batch is normalized on its own, as without synchronization).

    Args:
        model: a Keras model (functional, Sequential or subclassed) or layer.

    Returns:
        ``model``, converted.

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization()])
        >>> model = sync_batchnorm(model)
        >>> model.layers[-1].synchronized
        True
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"sync_batchnorm() expects a keras.Model or Layer; got {type(model).__name__}: {model!r}."
        )
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            f"sync_batchnorm() needs the TensorFlow backend (Keras's synchronized BatchNormalization is TF-only); "
            f"KERAS_BACKEND is {keras.backend.backend()!r}."
        )
    for layer in batchnorm_layers(model):
        layer.synchronized = True
    # Keras caches traced functions; the next fit/predict must trace the synchronized layers.
    for attr in ("train_function", "test_function", "predict_function"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    return model
