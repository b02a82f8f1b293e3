"""keras_scale.fit under MultiWorkerMirroredStrategy: 2 real worker processes on 127.0.0.1.

- trains to the end; both workers hold identical weights, equal to one process at the same global batch;
  History metrics are global (equal to the one-process run's);
- Keras's own model.fit works with only ``patch_keras_multi_worker()`` applied;
- Slurm variables (``srun``) lead to the same cluster as TF_CONFIG;
- a worker that dies takes the job down with a clear error in bounded time.
"""
import json
import socket
import sys
import time

import keras
import numpy as np
import pytest

import keras_scale as ks
from keras_scale.launch import launch_local_workers

pytestmark = pytest.mark.slow

COMMON = r'''
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
import numpy as np, keras
import keras_scale as ks

X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")).astype("float32")

def build():
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model

def dump(name, **values):
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with open(f"{name}_{index}.json", "w") as f:
        json.dump(values, f)

def weights(model):
    return [w.tolist() for w in model.get_weights()]
'''

FIT_AND_RAW_FIT = COMMON + r'''
strategy = ks.choose_strategy()  # TF_CONFIG -> MultiWorkerMirroredStrategy (created before any TF op)
hist = ks.fit(build, X, Y, global_batch_size=16, epochs=3, strategy=strategy, verbose=0,
              validation_data=(X[:24], Y[:24]))  # evaluate() runs under the patched reduction too
dump("fit", history=hist.history, weights=weights(hist.model), replicas=strategy.num_replicas_in_sync,
     kind="MWMS" if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) else type(strategy).__name__, chief=ks.is_chief(strategy))

# Keras's own fit under the same strategy, with only the patch (what ChiefCheckpoint & co. rely on)
with strategy.scope():
    model = build()
ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
raw = model.fit(ds.with_options(options), epochs=3, verbose=0)
dump("raw", history=raw.history, weights=weights(model))

# gradient accumulation across workers: the same global batch 16 = 8 per replica x 2 replicas, each split in 2
acc = ks.fit(build, X, Y, per_replica_batch_size=8, accum=2, epochs=3, strategy=strategy, verbose=0)
dump("accum", history=acc.history, weights=weights(ks.unwrap(acc.model)))
'''


def _read(tmp_path, name, num_workers=2):
    return [json.loads((tmp_path / f"{name}_{i}.json").read_text()) for i in range(num_workers)]


def _data():
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")).astype("float32")


def _one_process(shuffle=True, epochs=3, **kwargs):
    def build():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        return model

    x, y = _data()
    return ks.fit(build, x, y, global_batch_size=16, epochs=epochs, strategy="default", shuffle=shuffle, verbose=0,
                  **kwargs)


def _assert_same_weights(worker_weights, model, tol=1e-5):
    for got, want in zip(worker_weights, model.get_weights()):
        np.testing.assert_allclose(np.array(got), want, atol=tol, rtol=0)


def test_two_workers_train_like_one_process_with_global_metrics(run_workers, tmp_path):
    run_workers(FIT_AND_RAW_FIT, num_workers=2, timeout_s=300)
    results = _read(tmp_path, "fit")
    assert [r["kind"] for r in results] == ["MWMS"] * 2
    assert [r["replicas"] for r in results] == [2, 2]
    assert [r["chief"] for r in results] == [True, False]
    # both workers hold identical weights
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        assert np.array_equal(np.array(a), np.array(b))
    # equal to one process training at the same global batch (same seeded shuffle on every worker)
    x, y = _data()
    reference = _one_process(shuffle=True, validation_data=(x[:24], y[:24]))
    _assert_same_weights(results[0]["weights"], reference.model)
    # History metrics are global: equal to the one-process run's, on both workers (validation included)
    for r in results:
        assert len(r["history"]["loss"]) == 3
        for key in ("loss", "mae", "val_loss", "val_mae"):
            np.testing.assert_allclose(r["history"][key], reference.history[key], rtol=1e-5, err_msg=key)

    # with accum=2 (keras_scale.wrap) the update is the same global-batch update
    for r in _read(tmp_path, "accum"):
        _assert_same_weights(r["weights"], reference.model)
        np.testing.assert_allclose(r["history"]["loss"], reference.history["loss"], rtol=1e-5)

    # Keras's own model.fit with only patch_keras_multi_worker() (no shuffling there)
    raw = _read(tmp_path, "raw")
    plain = _one_process(shuffle=False)
    for r in raw:
        _assert_same_weights(r["weights"], plain.model)
        np.testing.assert_allclose(r["history"]["loss"], plain.history["loss"], rtol=1e-5)


SLURM_WORKER = COMMON + r'''
# pretend to be task SLURM_PROCID of `srun --ntasks=2` on one node: no TF_CONFIG, only Slurm variables
index = json.loads(os.environ.pop("TF_CONFIG"))["task"]["index"]
os.environ.update({"SLURM_PROCID": str(index), "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost",
                   "SLURM_STEP_TASKS_PER_NODE": "2", "KERAS_SCALE_PORT_BASE": sys.argv[1]})
hist = ks.fit(build, X, Y, global_batch_size=16, epochs=2, verbose=0)  # strategy="auto"
strategy = hist.model.distribute_strategy
dump("slurm", weights=weights(hist.model), replicas=strategy.num_replicas_in_sync, kind="MWMS" if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) else type(strategy).__name__,
     chief=ks.is_chief(), loss=hist.history["loss"])
'''


def _two_free_consecutive_ports():
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    pytest.skip("no two consecutive free ports")


def test_slurm_variables_give_the_same_multi_worker_training(run_workers, tmp_path):
    run_workers(SLURM_WORKER, num_workers=2, args=(_two_free_consecutive_ports(),), timeout_s=300)
    results = _read(tmp_path, "slurm")
    assert [r["kind"] for r in results] == ["MWMS"] * 2
    assert [r["replicas"] for r in results] == [2, 2]
    assert [r["chief"] for r in results] == [True, False]  # is_chief() sees the cluster fit derived from Slurm
    reference = _one_process(shuffle=True, epochs=2)
    for r in results:
        _assert_same_weights(r["weights"], reference.model)


DYING_WORKER = COMMON + r'''
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
strategy = ks.choose_strategy()

class DieOnWorker1(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if index == 1 and batch == 2:
            print("worker 1 dies now", flush=True)
            os._exit(17)

ks.fit(build, np.concatenate([X] * 8), np.concatenate([Y] * 8), global_batch_size=16, epochs=100,
       strategy=strategy, callbacks=[DieOnWorker1()], verbose=0)
print("worker finished training?!", flush=True)
'''


def test_a_dying_worker_takes_the_job_down_with_a_clear_error(tmp_path):
    script = tmp_path / "dying.py"
    script.write_text(DYING_WORKER)
    env = {"PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[1]), "CUDA_VISIBLE_DEVICES": "",
           "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}
    start = time.monotonic()
    # grace_s is long on purpose: the survivor must stop by itself, not be killed by the launcher
    results = launch_local_workers([sys.executable, str(script)], num_workers=2, timeout_s=280, grace_s=240,
                                   env=env, cwd=str(tmp_path))
    elapsed_s = time.monotonic() - start
    dead, survivor = results[1], results[0]
    assert dead.returncode == 17, dead.stderr[-2000:]
    assert not survivor.timed_out and survivor.returncode not in (0, None), survivor.stderr[-2000:]
    assert "worker finished training" not in survivor.stdout
    assert "multi-worker training stopped: a worker of the cluster failed" in survivor.stderr, survivor.stderr[-3000:]
    assert "task:1" in survivor.stderr  # names the task that died
    assert elapsed_s < 200, f"the survivor took {elapsed_s:.0f} s to notice"


RESUMABLE_WORKER = COMMON + r'''
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
strategy = ks.choose_strategy()
die = sys.argv[1] == "die"

class DieInEpoch2(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if die and index == 1 and self.epoch == 1 and batch == 2:
            os._exit(17)

hist = ks.fit(build, X, Y, global_batch_size=16, epochs=3, strategy=strategy, callbacks=[DieInEpoch2()],
              checkpoint_dir="ckpt", verbose=0)
dump("resumed", weights=weights(hist.model), epochs_trained=len(hist.history["loss"]))
'''


def test_rerunning_after_a_worker_died_resumes_and_ends_like_an_uninterrupted_run(tmp_path):
    script = tmp_path / "resumable.py"
    script.write_text(RESUMABLE_WORKER)
    env = {"PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[1]), "CUDA_VISIBLE_DEVICES": "",
           "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}
    crashed = launch_local_workers([sys.executable, str(script), "die"], num_workers=2, timeout_s=280, grace_s=120,
                                   env=env, cwd=str(tmp_path))
    assert crashed[1].returncode == 17 and crashed[0].returncode not in (0, None)
    assert (tmp_path / "ckpt").is_dir()
    # the same command again (without the crash) resumes at the checkpoint and finishes
    rerun = launch_local_workers([sys.executable, str(script), "ok"], num_workers=2, timeout_s=280, env=env,
                                 cwd=str(tmp_path), check=True)
    assert all(r.ok for r in rerun)
    results = _read(tmp_path, "resumed")
    assert [r["epochs_trained"] for r in results] == [2, 2]  # epochs 2 and 3 only: epoch 1 was restored
    reference = _one_process(shuffle=True, epochs=3)
    for r in results:
        _assert_same_weights(r["weights"], reference.model)
