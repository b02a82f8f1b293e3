"""Every class keras_scale registers as a Keras serializable (package ``keras_scale``), imported in one place.

``import keras_scale`` imports them; a program that imports only parts of keras_scale (the ``keras-scale`` command
line, which starts without TensorFlow) imports this module before it loads a ``.keras`` file keras_scale wrote
(a wrapped model, a model with a ``WarmupCosine`` schedule or ``Remat`` layers), so Keras finds their classes.

Example:
    >>> from keras_scale import serializables
    >>> sorted(serializables.REGISTERED)
    ['keras_scale>AccumulatingModel', 'keras_scale>Remat', 'keras_scale>ScaledSchedule', 'keras_scale>WarmupCosine']
"""
from __future__ import annotations

from typing import Dict

import keras

from keras_scale.accumulation import AccumulatingModel
from keras_scale.remat import Remat
from keras_scale.schedules import ScaledSchedule, WarmupCosine

__all__ = ["AccumulatingModel", "Remat", "ScaledSchedule", "WarmupCosine", "REGISTERED"]

REGISTERED: Dict[str, type] = {keras.saving.get_registered_name(cls): cls
                               for cls in (AccumulatingModel, Remat, ScaledSchedule, WarmupCosine)}
