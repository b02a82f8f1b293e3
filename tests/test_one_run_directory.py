"""One run directory for every piece, as Keras's ``TensorBoard(log_dir)`` takes one argument: keras_scale's
callbacks given no ``log_dir`` write where a ``keras.callbacks.TensorBoard`` (or another keras_scale callback's
``log_dir``) in the same callback list writes, so the README's first snippet, as written, fills every panel of the
dashboard (goodput, the NaN skips, the checkpoint saves)."""
import os
import re

import numpy as np
import tensorflow as tf

import keras
import keras_scale as ks
from keras_scale.tensorboard_plugin import data
from tests.conftest import REPO_ROOT


def _readme_first_fit() -> str:
    """The README's first code block up to its ``model.fit`` call (the part that trains with the callbacks)."""
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    return block[:block.index("\ndef build_model")]


def _classifier_ds(poisoned_batch: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    y = rng.integers(0, 10, size=128)
    x[poisoned_batch * 16 + 3, 2] = np.nan  # a NaN sample: NanGuard skips that step, in each of the 3 epochs
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def test_the_readme_snippet_fills_every_panel_of_the_dashboard(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    keras.utils.set_random_seed(0)

    def my_model():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(10, activation="softmax")])

    namespace = {"my_model": my_model, "ds": _classifier_ds(poisoned_batch=2)}
    exec(_readme_first_fit(), namespace)  # noqa: S102 - the README's own code
    runs = data.find_runs(str(tmp_path))
    assert list(runs) == ["logs"], runs
    page = data.run_detail("logs", runs["logs"])
    totals = page["summary"]["totals"]
    assert totals is not None and totals["steps"] == 24 and totals["skipped_steps"] == 3   # Goodput
    assert [e["kind"] for e in page["incidents"]].count("nan") == 3                       # NanGuard
    assert len(page["checkpoints"]["saves"]) == 3                                         # ChiefCheckpoint
    assert page["gpu"]["unavailable"]                                                     # GpuMonitor's "no GPU"
    assert page["loss"]["loss (epoch mean)"]
    assert page["profiles"]                                                               # ProfileWindow


def test_callbacks_without_log_dir_write_into_the_keras_tensorboard_directory(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((32, 4), "float32")
    log_dir = str(tmp_path / "run")
    goodput = ks.Goodput(verbose=0)
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0,
              callbacks=[goodput, ks.NanGuard(verbose=0), keras.callbacks.TensorBoard(log_dir)])
    assert goodput.log_dir is None  # the argument stays as given
    assert list(data.find_runs(str(tmp_path))) == ["run"]
    assert data.run_summary("run", log_dir)["totals"]["steps"] == 4
    # a later fit without a TensorBoard writes nowhere
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0, callbacks=[goodput])
    assert data.run_summary("run", log_dir)["totals"]["steps"] == 4
