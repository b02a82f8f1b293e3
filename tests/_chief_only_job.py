"""ONE 2-worker MultiWorkerMirroredStrategy job shared by the chief-only tests of several callbacks.

Started once per test session by the ``chief_only_job`` fixture (tests/conftest.py) as 2 loopback workers: each
part below is one callback's multi-worker scenario, and each part writes ``<part>_<worker index>.json`` into the
directory given as ``sys.argv[1]`` for its test to read. One pair of TensorFlow start-ups serves them all.

- goodput: ``ks.Goodput(log_dir=..., verbose=1)`` under ``ks.fit`` (tests/test_goodput.py)
- gpu_monitor: ``ks.GpuMonitor`` on each worker's own fake GPU under plain ``model.fit`` (tests/test_gpu_monitor.py)
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_scale as ks  # noqa: E402
from keras_scale.distribute import is_chief, task_identity  # noqa: E402
from tests.fakes.fake_nvml import FakeNvml  # noqa: E402

out = sys.argv[1]
strategy = ks.choose_strategy()  # MultiWorkerMirroredStrategy from TF_CONFIG (one per process)
_, index = task_identity(strategy)


def dump(part, value):
    with open(os.path.join(out, f"{part}_{index}.json"), "w") as f:
        json.dump(value, f)


# ---- goodput: ks.fit adds nothing here (Goodput given), the chief prints the table and writes TensorBoard
x = np.random.default_rng(0).normal(size=(512, 16)).astype("float32")
y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")


def build():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


goodput = ks.Goodput(log_dir=os.path.join(out, "goodput_tb"), verbose=1)
ks.fit(build, x, y, global_batch_size=64, epochs=2, strategy=strategy, verbose=0, callbacks=[goodput])
dump("goodput", goodput.summary)

# ---- gpu_monitor: each worker's own (fake) GPU: worker 0 at 20% util, worker 1 at 70%; both thermally throttled
fake = FakeNvml.with_gpus(1, util_gpu_pct=20.0 + 50.0 * index, throttle_thermal=True)
x = np.random.RandomState(0).rand(64, 4).astype("float32")
y = x.sum(1, keepdims=True)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
monitor = ks.GpuMonitor(interval_s=0.005, log_dir=os.path.join(out, "gpu_tb"), nvml=fake, devices=[0],
                        verbose=1)  # prints under fit(verbose=0) too: only the chief may
h = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=2, verbose=0, callbacks=[monitor])
dump("gpu_monitor", {"chief": is_chief(strategy), "util": h.history["gpu_util_mean"],
                     "advice": [a.kind for a in monitor.advice_history]})
