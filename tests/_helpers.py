"""Helpers shared by the tests (first by the ChiefCheckpoint tests, tests/test_checkpoint*.py): the data, the usual
compiled model (wrapped too), a small model with fixed weights, a graceful stop at an update count, weight
comparison, the environment of training subprocesses, a training script for the signal tests, and the first lines
of the 2-worker scripts."""
import os

import keras
import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NUM_SAMPLES, BATCH = 80, 8  # 10 batches per epoch
X = np.random.RandomState(0).rand(NUM_SAMPLES, 4).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")


def make_model(width=8, optimizer=None, strategy=None, metrics=None, accum=None):
    """The same initial weights every call; compiled with Adam(1e-2) (or ``optimizer()``), mse and ``metrics``
    (default ``["mae"]``: every resume test compiles metrics); with ``accum``, the model is ``ks.wrap(model,
    accum=accum)``, compiled so."""
    keras.utils.set_random_seed(7)

    def build():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(1)])
        if accum is not None:
            import keras_scale as ks

            m = ks.wrap(m, accum=accum)
        m.compile(optimizer=optimizer() if optimizer else keras.optimizers.Adam(1e-2), loss="mse",
                  metrics=list(metrics) if metrics is not None else ["mae"])
        return m

    if strategy is None:
        return build()
    with strategy.scope():
        return build()


class StopAfter(keras.callbacks.Callback):
    """Stops training (gracefully) once the optimizer has applied ``num_steps`` updates in total: a stand-in
    for a crash point. (It counts updates, not batch callbacks: a resume's first call in its epoch trains nothing.)"""

    def __init__(self, num_steps):
        super().__init__()
        self.num_steps = num_steps

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) >= self.num_steps:
            self.model.stop_training = True


def linspace_mlp(bn=False, d=6):
    """``d`` inputs -> Dense(8, tanh) [-> BatchNormalization] -> Dense(1), weights set to a linspace in [-0.4, 0.4]
    (the same model in every process, no seed needed); not compiled."""
    layers = [keras.Input((d,)), keras.layers.Dense(8, activation="tanh")]
    if bn:
        layers.append(keras.layers.BatchNormalization())
    layers.append(keras.layers.Dense(1))
    model = keras.Sequential(layers)
    model.set_weights([np.linspace(-0.4, 0.4, w.size, dtype="float32").reshape(w.shape) for w in model.get_weights()])
    return model


def weights(model):
    return [v.numpy().copy() for v in model.weights]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def fit(model, callbacks, epochs=3, x=X, y=Y, **kw):
    """``model.fit`` on (X, Y), batches of 8 in order, quiet."""
    kw.setdefault("batch_size", BATCH)
    kw.setdefault("shuffle", False)
    return model.fit(x, y, epochs=epochs, verbose=0, callbacks=callbacks, **kw)


def subprocess_env():
    """Environment of a training subprocess: this checkout importable, quiet and deterministic TensorFlow, no GPU."""
    env = dict(os.environ)
    env.update({"PYTHONPATH": REPO_ROOT + os.pathsep + env.get("PYTHONPATH", ""), "TF_CPP_MIN_LOG_LEVEL": "2",
                "TF_ENABLE_ONEDNN_OPTS": "0", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"})
    return env


def load_weights_npz(path):
    """The arrays a subprocess wrote with ``np.savez(out, *weights)``, in order."""
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


#: A training script to signal: ``python train.py DIRECTORY [SLEEP_S]`` trains 3 epochs of 20 batches (60 updates)
#: under a ``ChiefCheckpoint(DIRECTORY, save_freq=1000, verbose=1)`` (it saves on a signal, not on its own before
#: the end) and prints ``STARTED <checkpoint directory>``, ``BATCH <updates>`` after each batch (then sleeps SLEEP_S
#: seconds, default 0.05) and ``DONE <updates>`` at the end.
SIGNALLED_TRAIN_SCRIPT = r"""
import sys, time
import numpy as np, keras
import keras_scale as ks

directory = sys.argv[1]
sleep_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
keras.utils.set_random_seed(3)
x = np.random.RandomState(0).rand(160, 4).astype("float32")
y = x.sum(1, keepdims=True)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")


class Report(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print("BATCH", int(self.model.optimizer.iterations.numpy()), flush=True)
        time.sleep(sleep_s)


ckpt = ks.ChiefCheckpoint(directory, save_freq=1000, verbose=1)
print("STARTED", ckpt.directory, flush=True)
model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[ckpt, Report()])
print("DONE", int(model.optimizer.iterations.numpy()), flush=True)
"""


#: The first lines of a multi-worker test script (run by the ``run_workers`` fixture of tests/conftest.py): one thread
#: per TensorFlow pool, ``strategy``: the ``MultiWorkerMirroredStrategy`` of ``TF_CONFIG`` (made before Keras is
#: imported), Keras's multi-worker fix applied; ``json``, ``os``, ``sys``, ``tf``, ``np``, ``keras`` and ``ks``
#: imported. Use: ``WORKER = MULTI_WORKER_PREAMBLE + r'''...'''``.
MULTI_WORKER_PREAMBLE = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
strategy = tf.distribute.MultiWorkerMirroredStrategy()
import numpy as np, keras
import keras_scale as ks
from keras_scale.distribute import patch_keras_multi_worker
patch_keras_multi_worker()
"""
