"""Helpers shared by the ChiefCheckpoint tests (tests/test_checkpoint*.py; StopAfter by others too): the data, the
usual compiled model, a graceful stop at an update count, weight comparison, and the environment of training
subprocesses."""
import os

import keras
import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NUM_SAMPLES, BATCH = 80, 8  # 10 batches per epoch
X = np.random.RandomState(0).rand(NUM_SAMPLES, 4).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")


def make_model(width=8, optimizer=None, strategy=None, metrics=None):
    """The same initial weights every call; compiled with Adam(1e-2) (or ``optimizer()``), mse and ``metrics``
    (default ``["mae"]``: every resume test compiles metrics)."""
    keras.utils.set_random_seed(7)

    def build():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(1)])
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
