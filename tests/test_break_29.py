"""Break tests of "survive a lost worker" (issue 29), written by a tester as a user would hit them; TF-free fake
workers where the launcher's own logic is what is tested."""
import os
import signal
import sys
import threading
import time

import pytest

from keras_scale.launch import launch_with_restarts

CRASHES = r'''
import os, sys, time
index = __import__("json").loads(os.environ["TF_CONFIG"])["task"]["index"]
open(f"attempt_{index}_{os.getpid()}", "w").close()
time.sleep(0.2)
if index == 1:
    raise RuntimeError("boom in epoch 1")
'''


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_restart_backoff_ends_the_run_cleanly_without_restarting(tmp_path, signum):
    # before: SIGTERM in the backoff killed the launcher outright (no summary, its temporary run dir left behind)
    # and Ctrl-C raised KeyboardInterrupt out of time.sleep with a traceback
    script = tmp_path / "w.py"
    script.write_text(CRASHES)
    lines = []

    def say(line):
        lines.append(line)
        if "restart 1 of" in line:  # the backoff (30 s) starts now
            threading.Timer(0.3, os.kill, (os.getpid(), signum)).start()

    handlers_before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    started = time.monotonic()
    outcome = launch_with_restarts([sys.executable, str(script)], num_workers=2, max_restarts=3, backoff_s=30,
                                   grace_s=1, cwd=str(tmp_path), say=say, reraise_signal=False, timeout_s=120)
    assert time.monotonic() - started < 25  # did not sit out the backoff
    assert outcome.status == 128 + signum and len(outcome.restarts) == 1
    assert "received during the restart backoff: not restarting" in lines[-1]
    assert len([f for f in os.listdir(tmp_path) if f.startswith("attempt_")]) == 2  # no second attempt
    # the handlers are given back (whatever this process had: an earlier test's fit may have left its own)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers_before


SLURM_STEP = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "node[1-2]",
              "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


def test_a_tf_config_naming_no_cluster_does_not_shadow_the_slurm_step_the_plan_and_is_chief_use(monkeypatch):
    # before: strategy_plan and is_chief read the Slurm step (task 1 of 2) while choose_strategy built the strategy
    # from the TF_CONFIG that names no cluster: every task trained alone, silently
    import keras_scale.distribute as dist

    for key, value in SLURM_STEP.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TF_CONFIG", '{"task": {"type": "worker", "index": 0}}')
    built = {}

    class Built(Exception):
        pass

    def multi_worker(all_reduce, config):  # what choose_strategy would build MultiWorkerMirroredStrategy from
        built["config"] = config
        raise Built

    monkeypatch.setattr(dist, "_multi_worker", multi_worker)
    assert dist.strategy_plan("auto")[0] == "multi_worker" and dist.is_chief() is False
    with pytest.raises(Built):
        dist.choose_strategy()
    assert built["config"] == {"cluster": {"worker": ["node1:8888", "node2:8888"]},
                               "task": {"type": "worker", "index": 1}}


def test_doctor_says_which_cluster_source_wins_when_tf_config_and_slurm_are_both_set():
    import keras_scale.doctor as _doctor  # noqa: F401
    dr = sys.modules["keras_scale.doctor"]
    ignored = dr.check_tf_config(dr.Facts(env={**SLURM_STEP, "TF_CONFIG": '{"task": {"type": "worker"}}'}))
    assert ignored.status == "warn" and "Slurm job step: task 1 of 2" in ignored.detail
    assert "names no cluster" in ignored.detail and "ignored" in ignored.detail
    broken = dr.check_tf_config(dr.Facts(env={**SLURM_STEP, "TF_CONFIG": "{not json"}))
    assert broken.status == "error" and "Unset TF_CONFIG to use a Slurm job step with 2 tasks" in broken.fix
    tf_config = '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}'
    wins = dr.check_tf_config(dr.Facts(env={**SLURM_STEP, "TF_CONFIG": tf_config}), resolve=lambda h: ["127.0.0.1"],
                              port_free=lambda h, p: True)
    assert wins.status == "warn" and "TF_CONFIG wins over a Slurm job step with 2 tasks" in wins.detail
    alone = dr.check_tf_config(dr.Facts(env={"TF_CONFIG": tf_config}), resolve=lambda h: ["127.0.0.1"],
                               port_free=lambda h, p: True)
    assert alone.status == "ok"


@pytest.mark.slow  # (timed: run with the slow tests, fewer processes share the CPU)
def test_tracing_the_validation_step_or_goodputs_flop_count_is_not_taken_for_a_hang(tmp_path, monkeypatch):
    # before: with --heartbeat-timeout-s below the compile time, the first validation pass (it traces the test
    # function) or Goodput's FLOP count at the first epoch end (it traces the model once more) had the worker
    # killed as hung -- on every restart again, so the run never got past its first epoch
    import keras
    import numpy as np

    import keras_scale as ks
    from keras_scale.launch import _HeartbeatWatch

    # the trace outlasts the timeout; the timeout is long against a loaded machine's gaps between steps
    trace_s, timeout_s = 4.0, 2.5

    class SlowTrace(keras.layers.Layer):  # Python in call() runs only while tracing: a slow compile
        def call(self, x, training=None):
            if not keras.backend.is_keras_tensor(x):
                time.sleep(trace_s)
            return x

    path = str(tmp_path / "worker-0.json")
    monkeypatch.setenv("KERAS_SCALE_HEARTBEAT_FILE", path)
    monkeypatch.setenv("KERAS_SCALE_HEARTBEAT_INTERVAL_S", "0")
    watch = _HeartbeatWatch([path], timeout_s)
    stale, done = [], threading.Event()

    def poll():
        while not done.is_set():
            stale.extend(watch.poll())
            time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def build():
        model = keras.Sequential([keras.Input((4,)), SlowTrace(), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    try:
        ks.fit(build, x, y, global_batch_size=8, epochs=2, validation_data=(x[:8], y[:8]), verbose=0)
    finally:
        done.set()
        poller.join()
    assert watch.progressed[0] and stale == []


RESUMES = r'''
import json, os, sys, time, importlib.util
spec = importlib.util.spec_from_file_location("hb", os.environ["KS_HEARTBEAT_FILE_PY"])
hb = importlib.util.module_from_spec(spec); spec.loader.exec_module(hb)
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
keeps_checkpoint = sys.argv[1] == "checkpoint"
saved = int(open("saved").read()) if keeps_checkpoint and os.path.exists("saved") else 0
first = not os.path.exists(f"ran_{index}"); open(f"ran_{index}", "w").close()
hb.write_beat("begin", saved)
for step in range(saved + 1, 7):
    time.sleep(0.05)
    hb.write_beat("step", step)
    if step == 4 and index == 0 and keeps_checkpoint and first:
        open("saved", "w").write("4")
    if step == 5 and index == 1 and first:
        sys.exit(3)
hb.write_beat("end", 6)
'''


@pytest.mark.slow
@pytest.mark.parametrize("keeps_checkpoint", [True, False])
def test_the_user_is_told_when_a_restart_starts_from_scratch(tmp_path, keeps_checkpoint):
    # before: a train script without a checkpoint restarted from step 0 with nothing said on the console
    from keras_scale.launch import _HeartbeatWatch  # noqa: F401 - the launcher's own heartbeat reader
    script = tmp_path / "w.py"
    script.write_text(RESUMES)
    heartbeat_py = os.path.join(os.path.dirname(__import__("keras_scale").__file__), "heartbeat_file.py")
    lines = []
    outcome = launch_with_restarts([sys.executable, str(script), "checkpoint" if keeps_checkpoint else "none"],
                                   num_workers=2, max_restarts=2, backoff_s=0.1, grace_s=1, cwd=str(tmp_path),
                                   env={"KS_HEARTBEAT_FILE_PY": heartbeat_py}, say=lines.append, timeout_s=120)
    assert outcome.status == 0 and len(outcome.restarts) == 1
    scratch = [ln for ln in lines if "started again from step 0" in ln]
    assert len(scratch) == (0 if keeps_checkpoint else 1)
    if scratch:
        assert "no checkpoint was restored" in scratch[0]


def test_a_second_resume_on_the_same_fewer_replicas_keeps_what_scale_lr_chose(tmp_path, capsys):
    # a run written on 2 replicas with global batch 6, resumed on 1 with elastic="scale_lr" (global 3, lr x 1/2),
    # then restarted once more on 1 replica: the math must not jump back to global batch 6 at the full rate
    import json as _json
    import warnings

    import keras
    import numpy as np

    import keras_scale as ks
    from keras_scale.elastic import record_path

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    x = np.random.default_rng(0).random((24, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    ckpt = str(tmp_path / "ckpt")
    common = dict(global_batch_size=6, strategy="default", checkpoint_dir=ckpt, verbose=0, default_callbacks=False)
    ks.fit(build, x, y, epochs=1, **common)
    with open(record_path(ckpt), "w") as f:  # as if written by 2 replicas
        _json.dump({"global_batch_size": 6, "replicas": 2, "micro_batch_size": 3}, f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = ks.fit(build, x, y, epochs=2, elastic="scale_lr", **common)
        second = ks.fit(build, x, y, epochs=3, elastic="scale_lr", **common)
    assert float(first.model.optimizer.learning_rate.numpy()) == pytest.approx(0.05)
    assert float(second.model.optimizer.learning_rate.numpy()) == pytest.approx(0.05)
    assert first.model.optimizer.iterations.numpy() == 4 + 8  # epoch 2 at global batch 3: 8 steps
    assert second.model.optimizer.iterations.numpy() == 4 + 8 + 8  # epoch 3 still at global batch 3


TWO_SIGTERMS = r'''
import os, signal, sys, time
import keras, numpy as np
import keras_scale as ks
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
x = np.random.default_rng(0).random((64, 4)).astype("float32"); y = x.sum(axis=1, keepdims=True)

class TwoSigterms(keras.callbacks.Callback):  # what a scheduler plus a launcher forwarding it do
    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == 5:
            for _ in range(3):  # its own, the launcher's copy, a second round: one burst
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)

model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[ks.ChiefCheckpoint(sys.argv[1], verbose=0),
                                                               TwoSigterms()])
print("NOT PREEMPTED")
'''


@pytest.mark.slow
def test_sigterms_50_ms_apart_still_save_and_exit_42(tmp_path):
    # before: the second SIGTERM ended the process with -15 and nothing was saved (issue 26)
    import subprocess

    from keras_scale.callbacks.checkpoint import list_checkpoints

    script = tmp_path / "two.py"
    script.write_text(TWO_SIGTERMS)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 42, proc.stderr[-3000:]
    assert list_checkpoints(str(tmp_path / "ckpt"))[0][0] == 6  # saved at the next step boundary
    assert "again; the preemption save goes on" in proc.stderr


COUNTS_SIGTERMS = r'''
import os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
open(f"started_{os.getpid()}", "w").close()
deadline = time.time() + 60
while not got and time.time() < deadline:
    time.sleep(0.01)
time.sleep(0.5)  # the save
open(f"sigterms_{os.getpid()}_{len(got)}", "w").close()
sys.exit(42)
'''


@pytest.mark.slow
def test_a_repeated_sigterm_to_the_launcher_does_not_kill_the_saving_workers(tmp_path):
    # before: the launcher took the second SIGTERM (e.g. `timeout` forwarding its own copy, Slurm signalling every
    # process) for "kill now" and SIGKILLed the workers in the middle of their preemption save
    script = tmp_path / "w.py"
    script.write_text(COUNTS_SIGTERMS)

    def signal_twice_when_started():
        deadline = time.monotonic() + 60
        while len([f for f in os.listdir(tmp_path) if f.startswith("started_")]) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        for _ in range(4):  # signalled directly and through a wrapper (`timeout`, a shell), twice: one burst
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)

    threading.Thread(target=signal_twice_when_started, daemon=True).start()
    outcome = launch_with_restarts([sys.executable, str(script)], num_workers=2, max_restarts=2, grace_s=20,
                                   cwd=str(tmp_path), say=lambda line: None, reraise_signal=False, timeout_s=120)
    assert [r.returncode for r in outcome.results] == [42, 42] and outcome.status == 143
    assert len([f for f in os.listdir(tmp_path) if f.startswith("sigterms_") and f.endswith("_1")]) == 2
