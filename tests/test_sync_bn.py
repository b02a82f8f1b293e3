"""keras_scale.sync_batchnorm: conversion keeps weights and predictions; synchronized BN under 2 replicas trains
like one device on the same global batch (and per-replica BN does not)."""
import numpy as np
import pytest

import keras
import keras_scale as ks
from keras_scale.sync_bn import batchnorm_layers, sync_batchnorm


def _model():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8)(inputs)
    x = keras.layers.BatchNormalization(momentum=0.5)(x)
    x = keras.layers.Activation("relu")(x)
    block = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.BatchNormalization(momentum=0.5)])
    x = block(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


def _data():
    # Replica 0 gets the first half of each global batch, replica 1 the second: give them different
    # distributions, so per-replica statistics differ from the global batch's.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    x[:8] += 3.0
    x[8:] -= 3.0
    y = rng.normal(size=(16, 1)).astype("float32")
    return x, y


def _train(model, x, y):
    model.compile(keras.optimizers.SGD(0.05), "mse")
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    return model.get_weights()


def _max_diff(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))


def test_conversion_keeps_weights_and_predictions_and_finds_nested_layers():
    model = _model()
    x, y = _data()
    _train(model, x, y)  # non-trivial moving statistics
    before_weights = model.get_weights()
    before_pred = model.predict(x, verbose=0)
    assert len(batchnorm_layers(model)) == 2
    assert not any(layer.synchronized for layer in batchnorm_layers(model))

    converted = ks.sync_batchnorm(model)

    assert all(layer.synchronized for layer in batchnorm_layers(converted))
    assert _max_diff(before_weights, converted.get_weights()) == 0.0
    np.testing.assert_allclose(converted.predict(x, verbose=0), before_pred, atol=1e-6)


def test_synchronized_bn_under_two_replicas_trains_like_one_device(mirrored):
    x, y = _data()
    reference = _train(_model(), x, y)  # one device, global batch 16

    with mirrored.scope():
        per_replica = _model()
    per_replica_weights = _train(per_replica, x, y)

    with mirrored.scope():
        synced = sync_batchnorm(_model())
    synced_weights = _train(synced, x, y)

    assert _max_diff(synced_weights, reference) < 1e-4
    # The control: without synchronization each replica normalizes its own (shifted) half.
    assert _max_diff(per_replica_weights, reference) > 1e-2


def test_conversion_survives_save_and_load(tmp_path):
    model = sync_batchnorm(_model())
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert all(layer.synchronized for layer in batchnorm_layers(loaded))


def test_drops_cached_train_function_so_next_fit_uses_synced_layers():
    model = _model()
    x, y = _data()
    _train(model, x, y)
    assert model.train_function is not None
    sync_batchnorm(model)
    assert model.train_function is None


def test_bad_input():
    with pytest.raises(TypeError, match="expects a keras.Model or Layer"):
        sync_batchnorm("model.keras")
