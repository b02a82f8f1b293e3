"""Preemption signals end a run with status 42 once its state is saved, however the signals arrive: repeated
SIGTERMs up to the last moment of the process's exit (one process; ``keras-scale launch`` with two workers), a
SIGTERM to one worker only, and multi-worker agreement with no collective per step (real signals, loopback
workers)."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from keras_scale.callbacks.checkpoint import list_checkpoints
from tests._helpers import REPO_ROOT, SIGNALLED_TRAIN_SCRIPT, subprocess_env


def _signal_repeatedly(pids, proc, every_s):
    """SIGTERM to every pid in ``pids`` every ``every_s`` until ``proc`` has exited: the first one asks for the
    save, the others land in every later moment of the process's life, its exit included."""
    sent = 0
    while proc.poll() is None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
                sent += 1
            except ProcessLookupError:
                pass
        time.sleep(every_s)
    return sent


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterms_until_the_process_is_gone_never_change_the_exit_status_42(tmp_path):
    """A SIGTERM, then one every 5 ms until the process is gone (a scheduler repeating its signal, as in the
    reported two SIGTERMs 50 ms apart, but landing in every moment of the exit, the interpreter's teardown
    included): the state is saved and the status is 42 every time, never 143."""
    script = tmp_path / "train.py"
    script.write_text(SIGNALLED_TRAIN_SCRIPT)
    for run in range(3):
        d = str(tmp_path / f"ckpt{run}")
        proc = subprocess.Popen([sys.executable, str(script), d, "0.02"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=subprocess_env())
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("BATCH 3"):
                break
        reader = threading.Thread(target=lambda: lines.extend(l.rstrip("\n") for l in proc.stdout), daemon=True)
        reader.start()
        sent = _signal_repeatedly([proc.pid], proc, 0.005)
        reader.join(10)
        assert proc.returncode == 42, (run, sent, "\n".join(lines[-15:]))
        assert sent >= 5
        assert not any(l.startswith("DONE") for l in lines)
        assert list_checkpoints(d)[0][0] >= 3


WORKER_SCRIPT = r"""
import json, os, signal, sys, time
import numpy as np, tensorflow as tf, keras
import keras_scale as ks
from keras_scale.distribute import patch_keras_multi_worker, is_chief
patch_keras_multi_worker()
directory, signal_at = sys.argv[1], int(sys.argv[2])
strategy = tf.distribute.MultiWorkerMirroredStrategy()
eager = [0]  # strategy.run/reduce called outside a tf.function: a collective and a host read on every worker
for name in ("run", "reduce"):
    def counted(*args, _original=getattr(strategy, name), **kwargs):
        if tf.executing_eagerly():
            eager[0] += 1
        return _original(*args, **kwargs)
    setattr(strategy, name, counted)
keras.utils.set_random_seed(7)
x = np.random.RandomState(0).rand(128, 4).astype("float32"); y = x.sum(1, keepdims=True)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
seen = {}


class SignalOneWorker(keras.callbacks.Callback):
    # a real SIGTERM to the non-chief worker only, after its step `signal_at`
    def on_train_batch_begin(self, batch, logs=None):
        seen.setdefault("before", eager[0])

    def on_train_batch_end(self, batch, logs=None):
        if not is_chief(strategy) and int(self.model.optimizer.iterations.numpy()) == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)


class Last(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):  # after ChiefCheckpoint's own batch-end work
        per_step.append(eager[0] - seen["before"])
        seen["before"] = eager[0]


per_step = []  # eager collectives in each step (from the previous step's end to this one's)


ckpt = ks.ChiefCheckpoint(directory, save_freq=1000)  # the defaults otherwise
try:
    model.fit(ds, epochs=3, verbose=0, callbacks=[SignalOneWorker(), ckpt, Last()])  # 3 x 8 steps
finally:
    print(json.dumps({"global_step": ckpt.global_step, "preempted": ckpt.preempted, "chief": is_chief(strategy),
                      "iterations": int(model.optimizer.iterations.numpy()),
                      "eager_collectives_per_step": per_step}), flush=True)
"""


def _outs(results):
    return [json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1]) for r in results]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("signal_at", [11, 24])  # mid-run; after the last step (the fit ends before the target)
def test_sigterm_to_one_worker_saves_every_worker_at_one_step_with_no_collective_per_step(tmp_path, run_workers,
                                                                                          signal_at):
    """SIGTERM to the non-chief only: both workers stop at the same step (the one after the signalled worker's
    next step boundary), the chief saves it, both exit 42 with ``preempted`` = SIGTERM; between the first and the
    last step no worker called ``strategy.run``/``reduce`` eagerly except where a checkpoint was written (the
    workers agree through the coordination service). A signal after the last step boundary still ends both with 42 (the one agreement at the fit's end)."""
    d = str(tmp_path / "ckpt")
    results = run_workers(WORKER_SCRIPT, args=(d, signal_at), check=False)
    assert [r.returncode for r in results] == [42, 42], [r.stderr[-2000:] for r in results]
    outs = _outs(results)
    assert {o["global_step"] for o in outs} == {min(signal_at + 1, 24)}, outs
    assert {o["iterations"] for o in outs} == {min(signal_at + 1, 24)}
    assert list_checkpoints(d)[0][0] == min(signal_at + 1, 24)
    assert {o["preempted"] for o in outs} == {int(signal.SIGTERM)}
    for o in outs:  # only the epoch-end saves (at each epoch's first step) read the metric variables eagerly
        assert len(o["eager_collectives_per_step"]) == o["iterations"]
        assert [n for step, n in enumerate(o["eager_collectives_per_step"]) if step % 8] == [0] * (
            o["iterations"] - len(range(0, o["iterations"], 8))), o


LAUNCHED_SCRIPT = r"""
import os, sys, time
import numpy as np, tensorflow as tf, keras
import keras_scale as ks
from keras_scale.distribute import patch_keras_multi_worker
patch_keras_multi_worker()
strategy = tf.distribute.MultiWorkerMirroredStrategy()
x = np.random.RandomState(0).rand(256, 4).astype("float32"); y = x.sum(1, keepdims=True)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")


class Report(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print("BATCH", int(self.model.optimizer.iterations.numpy()), flush=True)
        time.sleep(0.02)


model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=3, verbose=0,
          callbacks=[ks.ChiefCheckpoint(sys.argv[1], save_freq=1000), Report()])
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_launcher_exits_42_when_signalled_and_every_worker_saved(tmp_path):
    """``keras-scale launch`` gets SIGTERM, then SIGTERMs every 20 ms until it is gone: it forwards the first, both
    workers save the same step and exit 42, and the launcher's own status is 42 (a scheduler requeues on it), not
    143."""
    script = tmp_path / "worker.py"
    script.write_text(LAUNCHED_SCRIPT)
    d = str(tmp_path / "ckpt")
    launcher = subprocess.Popen([sys.executable, "-m", "keras_scale", "launch", "--workers", "2", "--grace-s", "120",
                                 "--", sys.executable, str(script), d], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=subprocess_env(), cwd=REPO_ROOT)
    lines = []
    for line in launcher.stdout:
        lines.append(line.rstrip("\n"))
        if re.search(r"\[worker \d\] BATCH 4$", line):
            break
    reader = threading.Thread(target=lambda: lines.extend(l.rstrip("\n") for l in launcher.stdout), daemon=True)
    reader.start()
    _signal_repeatedly([launcher.pid], launcher, 0.02)
    reader.join(10)
    text = "\n".join(lines)
    assert "worker 0: exit 42, worker 1: exit 42" in text, text[-3000:]
    assert launcher.returncode == 42, text[-3000:]
    assert len(list_checkpoints(d)) == 1
