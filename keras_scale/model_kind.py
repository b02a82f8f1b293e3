"""What kind of model this is, for the pieces that train it: its own ``train_step`` or ``compute_loss``.

Example:
    >>> import keras
    >>> has_own_train_step(keras.Sequential([keras.layers.Dense(1)]))
    False
"""
from __future__ import annotations

from typing import Any

import keras


def has_own_train_step(model: keras.Model) -> bool:
    """True when ``model``'s class overrides ``train_step`` (GANs, most "customizing fit" examples).

    Example:
        >>> has_own_train_step(keras.Sequential([keras.layers.Dense(1)]))
        False
    """
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    if getattr(type(model), "_keras_scale_composed", False):  # keras_scale.wrap's model: the composed step
        return False
    return getattr(type(model), "train_step", None) is not TensorFlowTrainer.train_step


def has_own_compute_loss(model: keras.Model) -> bool:
    """True when ``model``'s class overrides ``compute_loss``.

    Example:
        >>> has_own_compute_loss(keras.Sequential([keras.layers.Dense(1)]))
        False
    """
    from keras.src.trainers.trainer import Trainer

    return getattr(type(model), "compute_loss", None) is not Trainer.compute_loss


def overrides(model: Any, name: str) -> bool:
    """True when ``model``'s class overrides Keras's ``keras.Model`` method or property ``name``.

    Example:
        >>> overrides(keras.Sequential([keras.layers.Dense(1)]), "test_step")
        False
    """
    return getattr(type(model), name, None) is not getattr(keras.Model, name, None)
