"""`keras-scale checkpoint export --to model.keras`: the .keras file carries the optimizer as training left it
(iterations, moments), not a fresh one; an uncompiled --model says the file holds no optimizer."""
import contextlib
import io
import os
import sys

import keras
import numpy as np
import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint import read_checkpoint
from keras_scale.callbacks.checkpoint.export import load_optimizer_state
from tests._helpers import StopAfter, fit, make_model

FACTORY = '''
import keras
def compiled():
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return m
def bare():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
'''


def _export(tmp_path, monkeypatch, function, directory):
    from keras_scale.cli import main

    module = f"export_factory_{function}"
    (tmp_path / f"{module}.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    target = str(tmp_path / f"{function}.keras")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["checkpoint", "export", directory, "--model", f"{module}:{function}", "--to", target]) == 0
    sys.modules.pop(module, None)
    return target, out.getvalue()


def test_an_exported_keras_file_carries_the_trained_optimizer_state(tmp_path, monkeypatch):
    directory = str(tmp_path / "ckpt")
    trained = make_model()
    fit(trained, [ks.ChiefCheckpoint(directory, save_freq=5), StopAfter(15)], epochs=2)
    target, said = _export(tmp_path, monkeypatch, "compiled", directory)
    assert "with the optimizer state" in said and "iterations 15" in said, said
    loaded = keras.saving.load_model(target)
    assert int(loaded.optimizer.iterations.numpy()) == 15
    reader = read_checkpoint(os.path.join(directory, "ckpt-15"))
    for i, var in enumerate(loaded.optimizer.variables):
        np.testing.assert_array_equal(var.numpy(),
                                      reader.get_tensor(f"optimizer_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE"))
    for a, b in zip(loaded.optimizer.variables, trained.optimizer.variables):  # what training left
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_an_uncompiled_model_exports_the_weights_and_says_there_is_no_optimizer(tmp_path, monkeypatch):
    directory = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=5), StopAfter(5)], epochs=1)
    target, said = _export(tmp_path, monkeypatch, "bare", directory)
    assert "holds no optimizer" in said, said
    assert getattr(keras.saving.load_model(target), "optimizer", None) is None


def test_another_optimizer_is_refused_naming_both(tmp_path):
    directory = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=5), StopAfter(5)], epochs=1)
    other = make_model(optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    with pytest.raises(ks.CheckpointMismatchError, match="Adam.*SGD"):
        load_optimizer_state(other, directory)
