"""``keras-scale launch --max-restarts``: a lost worker costs a restart, not the run.

- a worker SIGKILLed mid-epoch: every worker restarts, resumes from the checkpoint, and the run ends with the
  weights of an uninterrupted run; the restart is one console line and one record Goodput counts;
- a worker lost for good (it fails at start after its crash): the run continues on fewer workers, with the same
  global batch (more accumulation), and ends within 1e-5 of an uninterrupted run;
- a hung worker (SIGSTOP): its heartbeat goes stale, it is killed, and the run restarts within the configured time.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_scale as ks

pytestmark = pytest.mark.slow

REPO_ROOT = str(Path(__file__).resolve().parents[1])

WORKER = r'''
import json, os, signal, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
mode, global_batch, accum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if mode == "lose" and index == 2 and os.path.exists("lost"):
    sys.exit(3)  # the machine of worker 2 is gone: it fails at start, every time
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
import numpy as np, keras
import keras_scale as ks

import logging
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")  # fit's lines, also at verbose=0
strategy = ks.choose_strategy()
X = np.random.default_rng(0).normal(size=(48, 4)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")).astype("float32")

def build():
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model

class Chaos(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch != 1 or batch != 1:
            return
        victim = {"kill": 1, "stop": 1, "lose": 2}[mode]
        marker = {"kill": "killed", "stop": "stopped", "lose": "lost"}[mode]
        if index == victim and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(__import__("time").time()))
            os.kill(os.getpid(), signal.SIGSTOP if mode == "stop" else signal.SIGKILL)

goodput = ks.Goodput(verbose=0)
# "lose": a checkpoint after every batch, so the run on fewer workers resumes mid-epoch (position in samples)
save_freq = 1 if mode == "lose" else "epoch"
hist = ks.fit(build, X, Y, global_batch_size=global_batch, accum=accum, epochs=3, strategy=strategy,
              callbacks=[Chaos(), ks.ChiefCheckpoint(os.path.abspath("ckpt"), save_freq=save_freq), goodput],
              checkpoint_dir="ckpt", verbose=0)
with open(f"done_{index}.json", "w") as f:
    json.dump({"weights": [w.tolist() for w in ks.unwrap(hist.model).get_weights()],
               "replicas": strategy.num_replicas_in_sync,
               "restarts": {k: goodput.summary.get(k) for k in ("restarts", "restart_lost_s", "restart_redone_steps")}},
              f)
'''


def _launch(tmp_path, mode, workers, global_batch, accum=1, extra=(), timeout_s=600):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
               TF_ENABLE_ONEDNN_OPTS="0", PYTHONUNBUFFERED="1",
               KERAS_SCALE_HEARTBEAT_INTERVAL_S="0")  # a beat per step: the redone steps are then exact
    cmd = [sys.executable, "-m", "keras_scale", "launch", "--workers", str(workers), "--grace-s", "5",
           "--backoff-s", "0.5", "--run-dir", str(tmp_path / "run"), *extra, "--",
           sys.executable, str(script), mode, str(global_batch), str(accum)]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=timeout_s)
    records = [json.loads(line) for line in (tmp_path / "run" / "restarts.jsonl").read_text().splitlines()] \
        if (tmp_path / "run" / "restarts.jsonl").exists() else []
    return proc, records


def _reference(global_batch, epochs=3):
    """The uninterrupted run: one process, the same global batch, seed and data order."""
    x = np.random.default_rng(0).normal(size=(48, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")).astype("float32")

    def build():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    return ks.fit(build, x, y, global_batch_size=global_batch, epochs=epochs, strategy="default", verbose=0,
                  default_callbacks=False).model.get_weights()


def _done(tmp_path, workers):
    return [json.loads((tmp_path / f"done_{i}.json").read_text()) for i in range(workers)]


def _assert_close(worker_weights, reference, tol):
    for got, want in zip(worker_weights, reference):
        np.testing.assert_allclose(np.array(got), want, atol=tol, rtol=0)


def test_a_killed_worker_restarts_the_run_which_ends_like_an_uninterrupted_one(tmp_path):
    proc, records = _launch(tmp_path, "kill", workers=2, global_batch=12, extra=("--max-restarts", "3"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("keras-scale launch: worker")]
    assert lines[0] == "keras-scale launch: worker 1 was killed by SIGKILL (exit 137); restart 1 of 3 with 2 workers"
    restarts = [r for r in records if r["event"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["workers"] == [1] and restarts[0]["returncode"] == 137
    resumed = [r for r in records if r["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["lost_s"] > 0
    # killed at the end of batch 2 of epoch 2, resumed from the epoch-1 checkpoint (4 steps): steps 5 and 6 are
    # trained again. The record counts the steps whose beat was written: the killed worker's beat for step 6 never
    # is, the surviving worker's is (no per-step collective holds it back since the preemption signal travels
    # through the coordination service) unless the launcher stops it first: 2, or 1
    assert resumed[0]["resumed_step"] == 4 and resumed[0]["redone_steps"] in (1, 2), resumed
    done = _done(tmp_path, 2)
    assert done[0]["restarts"] == {"restarts": 1, "restart_lost_s": resumed[0]["lost_s"],
                                   "restart_redone_steps": resumed[0]["redone_steps"]}  # what Goodput reports
    reference = _reference(12)
    for d in done:
        _assert_close(d["weights"], reference, 1e-6)


def test_a_worker_lost_for_good_continues_on_fewer_workers_with_the_same_global_batch(tmp_path):
    # 3 workers x 4 per replica (accum 2: micro-batches of 2); worker 2 dies, then fails at start twice -> dropped;
    # 2 workers x 6 per replica (accum 3: micro-batches of 2 again): the same global batch 12
    proc, records = _launch(tmp_path, "lose", workers=3, global_batch=12, accum=2,
                            extra=("--max-restarts", "3", "--min-workers", "2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    restarts = [r for r in records if r["event"] == "restart"]
    assert [r["num_workers_next"] for r in restarts] == [3, 3, 2], restarts
    assert all(r["workers"] == [2] for r in restarts)
    assert "before its first step" in restarts[1]["reason"]
    assert "(was 3: a worker kept failing at start)" in proc.stderr
    assert ("elastic: checkpoint written on 3 replicas, this run has 2: global batch 12 kept exact by accum 3 "
            "micro-batches of 2 per replica") in proc.stderr
    # the 2 workers resumed after batch 1 of epoch 2 (the last checkpoint before the kill): a skipped or repeated
    # sample of that epoch would move the weights far more than 1e-5
    assert "resuming after batch 1 of epoch 2" in proc.stdout + proc.stderr
    done = _done(tmp_path, 2)
    assert [d["replicas"] for d in done] == [2, 2]
    reference = _reference(12)
    for d in done:
        _assert_close(d["weights"], reference, 1e-5)


def test_a_hung_worker_is_detected_by_its_heartbeat_and_the_run_restarts(tmp_path):
    # below TensorFlow's own detection of a stopped peer (its coordination service misses the peer's heartbeats
    # after ~10 s); a collective hung in a live process (e.g. NCCL) is only caught by this heartbeat
    timeout_s = 6
    proc, records = _launch(tmp_path, "stop", workers=2, global_batch=12,
                            extra=("--max-restarts", "1", "--heartbeat-timeout-s", str(timeout_s)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    restarts = [r for r in records if r["event"] == "restart"]
    assert len(restarts) == 1, records
    assert "made no step progress for 6 s" in restarts[0]["reason"] and 1 in restarts[0]["workers"]
    stopped_at = float((tmp_path / "stopped").read_text())
    # detected after the timeout (from the last beat, written at most 1 s before the stop) and well before 2x it
    assert timeout_s - 1.5 <= restarts[0]["failed_at_unix"] - stopped_at <= timeout_s + 15
    reference = _reference(12)
    for d in _done(tmp_path, 2):
        _assert_close(d["weights"], reference, 1e-6)
