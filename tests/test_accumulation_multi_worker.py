"""wrap(accum) + NanGuard under MultiWorkerMirroredStrategy: 2 worker processes on 127.0.0.1.

Both workers end with identical weights equal to one process training the unwrapped model at the same global
batch on the same data with the poisoned batch removed (the guard skipped it on both workers).
"""
import json

import keras
import numpy as np
import pytest

from tests._helpers import MULTI_WORKER_PREAMBLE

pytestmark = pytest.mark.slow

WORKER = MULTI_WORKER_PREAMBLE + r'''

rng = np.random.default_rng(0)
X = rng.normal(size=(128, 6)).astype("float32")
Y = (X @ rng.normal(size=(6, 1))).astype("float32")
X[2 * 32 + 20, 3] = np.nan          # one sample of batch 2, on worker 1's shard of that batch

with strategy.scope():
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    inner.set_weights([np.linspace(-0.4, 0.4, w.size, dtype="float32").reshape(w.shape) for w in inner.get_weights()])
    model = ks.wrap(inner, accum=2)
    model.compile(optimizer=keras.optimizers.Adam(1e-2, global_clipnorm=0.5), loss="mse")
# each worker reads the whole global batch and keeps its half (DATA sharding): 32 global = 16 per worker
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(32).with_options(options)
guard = ks.NanGuard(verbose=0)
model.fit(ds, epochs=2, verbose=0, callbacks=[guard])
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
with open(f"out_{index}.json", "w") as f:
    json.dump({"weights": [w.tolist() for w in inner.get_weights()], "skipped": guard.skipped_steps,
               "iterations": int(model.optimizer.iterations.numpy()),
               "source": guard.reports[0].source if guard.reports else None}, f)
'''


def test_wrap_and_nan_guard_under_multi_worker(run_workers, tmp_path):
    run_workers(WORKER, num_workers=2, timeout_s=300)
    outs = [json.loads((tmp_path / f"out_{i}.json").read_text()) for i in range(2)]
    assert outs[0]["skipped"] == outs[1]["skipped"] == 2  # both workers skipped the same step, each epoch
    assert outs[0]["iterations"] == outs[1]["iterations"] == 2 * 4 - 2
    w0 = [np.array(w) for w in outs[0]["weights"]]
    w1 = [np.array(w) for w in outs[1]["weights"]]
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)

    # one process, unwrapped, global batch 32, the poisoned batch left out
    rng = np.random.default_rng(0)
    X = rng.normal(size=(128, 6)).astype("float32")
    Y = (X @ rng.normal(size=(6, 1))).astype("float32")
    keep = np.r_[0:64, 96:128]
    ref = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    ref.set_weights([np.linspace(-0.4, 0.4, w.size, dtype="float32").reshape(w.shape) for w in ref.get_weights()])
    ref.compile(optimizer=keras.optimizers.Adam(1e-2, global_clipnorm=0.5), loss="mse")
    ref.fit(X[keep], Y[keep], batch_size=32, epochs=2, verbose=0, shuffle=False)
    for a, b in zip(ref.get_weights(), w0):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
