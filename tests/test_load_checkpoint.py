"""``ks.load_checkpoint`` into a model other than the one that trained: one with an extra layer (the error names
the variables that differ) and one loaded from a ``.keras`` file (its variable paths lack the model's name, yet
match)."""
import pytest

import keras_scale as ks
from tests._helpers import StopAfter, fit, make_model


def test_load_checkpoint_into_a_model_with_an_extra_layer_names_what_differs(tmp_path):
    import keras

    from keras_scale.callbacks.checkpoint import CheckpointMismatchError

    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=2, verbose=0), StopAfter(2)], epochs=1)
    bigger = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(8), keras.layers.Dense(1)])
    # (the names differ only by Keras's numbering: the message must still say which variables are extra)
    with pytest.raises(CheckpointMismatchError, match=r"only in the model: \['dense/bias #3', 'dense/kernel #3'\]"):
        ks.load_checkpoint(bigger, d)


def test_load_checkpoint_into_a_model_loaded_from_a_keras_file(tmp_path):
    # a model loaded with keras.models.load_model has paths without the model's name (d/kernel), a model built in
    # the training script has sequential/d/kernel: they still match (keras-scale checkpoint export --model m.keras)
    import keras
    import numpy as np

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d"), keras.layers.Dense(1, name="e")])
    model.compile(optimizer="sgd", loss="mse")
    model.save(str(tmp_path / "model.keras"))
    d = str(tmp_path / "ckpt")
    fit(model, [ks.ChiefCheckpoint(d, save_freq=2, verbose=0), StopAfter(2)], epochs=1)
    loaded = keras.models.load_model(str(tmp_path / "model.keras"))
    ks.load_checkpoint(loaded, d)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
