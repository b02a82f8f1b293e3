"""Moved to :mod:`keras_scale.scalars` (the TensorBoard writer and History figures are used by the train step's
``accum="auto"`` too, and the step imports no callback); kept so that existing imports still work.

Example:
    from keras_scale.scalars import ChiefScalars   # not keras_scale.callbacks._scalars
"""
from keras_scale.scalars import ChiefScalars, EpochFigures, _series_fn

__all__ = ["ChiefScalars", "EpochFigures", "_series_fn"]
