"""Precision policy choice and the float32-output check (keras_scale.precision) and their use in fit."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.precision import check_float32_outputs, choose_precision


@pytest.fixture
def global_policy():
    previous = keras.config.dtype_policy()
    yield keras.config.set_dtype_policy
    keras.config.set_dtype_policy(previous)


def test_auto_follows_compute_capability():
    assert choose_precision("auto", compute_capabilities=[(9, 0)]) == "mixed_bfloat16"
    assert choose_precision("auto", compute_capabilities=[(8, 0), (8, 6)]) == "mixed_bfloat16"
    assert choose_precision("auto", compute_capabilities=[(7, 0)]) == "mixed_float16"
    assert choose_precision("auto", compute_capabilities=[(8, 0), (7, 5)]) == "mixed_float16"  # weakest GPU decides
    assert choose_precision("auto", compute_capabilities=[(6, 1)]) == "float32"
    assert choose_precision("auto", compute_capabilities=[]) == "float32"


def test_auto_on_this_machine_matches_its_gpus():
    expected = "float32" if not tf.config.list_physical_devices("GPU") else choose_precision(
        "auto", compute_capabilities=ks.precision.gpu_compute_capabilities())
    assert choose_precision() == expected


def test_explicit_policies_and_bad_input():
    assert choose_precision("mixed_float16") == "mixed_float16"
    assert choose_precision(keras.DTypePolicy("mixed_bfloat16")) == "mixed_bfloat16"
    with pytest.raises(ValueError, match="unknown precision 'half'"):
        choose_precision("half")
    with pytest.raises(TypeError, match="precision must be"):
        choose_precision(16)


def test_float16_output_layer_is_fixed_and_predictions_are_float32(global_policy):
    global_policy("mixed_float16")
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3, activation="softmax", name="head")(keras.layers.Dense(8)(inputs))
    model = keras.Model(inputs, outputs)
    assert model(np.zeros((2, 4), "float32")).dtype == "float16"  # the classic NaN source
    findings = check_float32_outputs(model)
    assert len(findings) == 1 and "'head'" in findings[0] and "float16" in findings[0]
    assert model.get_layer("head").compute_dtype == "float32"
    assert model(np.zeros((2, 4), "float32")).dtype == "float32"
    assert check_float32_outputs(model) == []  # nothing left to fix
    assert model.layers[1].compute_dtype == "float16"  # the body keeps the fast dtype


def test_warns_without_fixing_and_for_subclassed_models(global_policy):
    global_policy("mixed_bfloat16")
    seq = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.warns(UserWarning, match="dtype='float32'"):
        findings = check_float32_outputs(seq, fix=False)
    assert findings and seq.layers[-1].compute_dtype == "bfloat16"

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    with pytest.warns(UserWarning, match="Activation\\('linear', dtype='float32'\\)"):
        check_float32_outputs(Net())


def test_fit_builds_under_the_chosen_policy_with_float32_outputs(capsys):
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1, name="out")])
        model.compile(optimizer="sgd", loss="mse")
        return model

    before = keras.config.dtype_policy().name
    hist = ks.fit(build, x, y, global_batch_size=16, precision="mixed_float16", strategy="default", verbose=1)
    out = capsys.readouterr().out
    assert "precision mixed_float16" in out and "output layer 'out' computed in float16; set to float32" in out
    model = hist.model
    assert model.layers[0].compute_dtype == "float16" and model.get_layer("out").compute_dtype == "float32"
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)  # fp16 gets loss scaling
    assert np.isfinite(hist.history["loss"][0])
    assert keras.config.dtype_policy().name == before  # global policy restored
