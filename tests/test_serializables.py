"""What keras_scale writes loads wherever keras_scale is installed: its classes are registered Keras serializables
(package ``keras_scale``), and the command line, which starts without importing them, imports them before it loads
a ``.keras`` file."""
import importlib
import os
import subprocess
import sys

import keras
import numpy as np

import keras_scale as ks
from keras_scale import serializables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_keras_scale_class_keras_can_save_is_registered_under_keras_scale():
    modules = [importlib.import_module(f"keras_scale.{name}") for name in ("accumulation", "remat", "schedules")]
    ours = {cls for module in modules for cls in vars(module).values()
            if isinstance(cls, type) and cls.__module__ == module.__name__
            and issubclass(cls, (keras.layers.Layer, keras.optimizers.schedules.LearningRateSchedule))}
    assert ours == set(serializables.REGISTERED.values())
    for name, cls in serializables.REGISTERED.items():
        assert name.startswith("keras_scale>") and keras.saving.get_registered_object(name) is cls


def test_checkpoint_export_loads_a_model_saved_from_wrap(tmp_path):
    model = ks.wrap(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]), accum=2)
    model.compile(optimizer=keras.optimizers.Adam(ks.WarmupCosine(1e-2, total_steps=10)), loss="mse")
    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0,
              callbacks=[ks.ChiefCheckpoint(str(tmp_path / "ckpt"), save_freq=2, verbose=0)])
    model.save(str(tmp_path / "model.keras"))
    run = subprocess.run(
        [sys.executable, "-m", "keras_scale", "checkpoint", "export", str(tmp_path / "ckpt"), "--model",
         str(tmp_path / "model.keras"), "--to", str(tmp_path / "out.weights.h5")],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    exported = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    exported.load_weights(str(tmp_path / "out.weights.h5"))
    for a, b in zip(exported.get_weights(), ks.unwrap(model).get_weights()):
        np.testing.assert_array_equal(a, b)
