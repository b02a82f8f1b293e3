"""HostMemoryWatch: RSS per epoch in logs and TensorBoard (chief only); the leak warning fires when a callback
hoards tensors and stays silent otherwise."""
import json
import os
import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_scale as ks
from keras_scale.callbacks.host_memory import HostMemoryGrowthWarning, steady_growth_mb_per_epoch


class TensorHoarder(keras.callbacks.Callback):
    """The classic leak: a list that keeps tensors alive. 48 MiB per epoch: above glibc's 32 MiB mmap threshold,
    so every epoch maps fresh pages instead of reusing memory that earlier tests freed."""

    def __init__(self):
        super().__init__()
        self.kept = []

    def on_epoch_end(self, epoch, logs=None):
        self.kept.append(tf.random.uniform((12 * 2**20,)))


def _fit(callbacks, epochs=6):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    return model.fit(x, y, batch_size=8, epochs=epochs, callbacks=callbacks, verbose=0)


def _watch(**kwargs):
    return ks.HostMemoryWatch(window_epochs=4, min_growth_mb_per_epoch=8.0, warmup_epochs=1, **kwargs)


def test_warns_when_a_callback_hoards_tensors():
    hoarder, watch = TensorHoarder(), _watch()
    with pytest.warns(HostMemoryGrowthWarning, match="grew steadily over the last 4 epochs") as record:
        _fit([hoarder, watch])
    message = str(record[0].message)
    assert "Python list" in message and "clear_session" in message and "retracing" in message and "cache()" in message
    assert watch.warned
    assert watch.rss_mb_history[-1] - watch.rss_mb_history[0] > 4 * 8.0, watch.rss_mb_history


def test_silent_on_ordinary_training():
    watch = _watch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostMemoryGrowthWarning)
        history = _fit([watch])
    assert not watch.warned
    assert len(history.history["host_rss_mb"]) == 6
    assert all(v > 10 for v in history.history["host_rss_mb"])


def _scalars(log_dir):
    values = []
    for root, _, files in os.walk(log_dir):
        for name in files:
            if "tfevents" in name:
                for event in tf.compat.v1.train.summary_iterator(os.path.join(root, name)):
                    for value in event.summary.value:
                        if value.tag == "host/rss_mb":
                            values.append((event.step, float(tf.make_ndarray(value.tensor))))
    return sorted(values)


def test_writes_tensorboard_scalar_on_chief(tmp_path):
    history = _fit([_watch(log_dir=str(tmp_path))], epochs=3)
    scalars = _scalars(tmp_path)
    assert [step for step, _ in scalars] == [0, 1, 2]
    np.testing.assert_allclose([v for _, v in scalars], history.history["host_rss_mb"], rtol=1e-6)


def test_non_chief_worker_writes_nothing(tmp_path, monkeypatch):
    config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    history = _fit([_watch(log_dir=str(tmp_path / "tb"))], epochs=2)
    assert len(history.history["host_rss_mb"]) == 2  # still measured and logged locally
    assert not (tmp_path / "tb").exists()


def test_growth_detection_needs_every_epoch_to_grow():
    assert steady_growth_mb_per_epoch([100, 130, 160, 190, 220], 4, 10) == 30
    assert steady_growth_mb_per_epoch([100, 130, 160, 160, 220], 4, 10) == 30  # one flat epoch: still steady
    assert steady_growth_mb_per_epoch([100, 130, 160, 160, 160], 4, 10) is None  # two flat epochs: it stopped
    assert steady_growth_mb_per_epoch([100, 150, 120, 190, 220], 4, 10) is None  # memory was released
    assert steady_growth_mb_per_epoch([100, 101, 102, 103, 104], 4, 10) is None  # drift below threshold
    assert steady_growth_mb_per_epoch([100, 130, 160], 4, 10) is None  # too few epochs


@pytest.mark.parametrize("kwargs, match", [
    ({"window_epochs": 1}, "window_epochs must be an integer >= 2, got 1"),
    ({"min_growth_mb_per_epoch": -1}, "min_growth_mb_per_epoch must be a number >= 0, got -1"),
    ({"warmup_epochs": 0.5}, "warmup_epochs must be an integer >= 0, got 0.5"),
    ({"log_dir": 3}, "log_dir must be a path or None, got 3"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ks.HostMemoryWatch(**kwargs)
