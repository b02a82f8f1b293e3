"""The keras_scale TensorBoard dashboard (the ``keras_scale`` tab): what happened to a run and why, on one page.

Entry point ``keras_scale = keras_scale.tensorboard_plugin:KerasScalePlugin`` in the ``tensorboard_plugins``
group: ``pip install keras-scale`` and ``tensorboard --logdir runs`` show it; see docs/dashboard.md.

Example:
    $ tensorboard --logdir runs/quickstart        # then the "keras_scale" tab
"""
from keras_scale.tensorboard_plugin.plugin import PLUGIN_NAME, KerasScalePlugin

__all__ = ["KerasScalePlugin", "PLUGIN_NAME"]
