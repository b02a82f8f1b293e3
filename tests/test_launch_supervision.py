"""``keras-scale launch`` supervising its workers (TensorFlow-free fake workers where the launcher's own logic is
tested): a signal during the restart backoff ends the run cleanly, a repeated SIGTERM does not kill workers that are
saving, a restart from scratch is said on the console, and tracing a validation step or Goodput's FLOP count is not
taken for a hang."""
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
    assert [r.returncode for r in outcome.results] == [42, 42] and outcome.status == 42
    assert len([f for f in os.listdir(tmp_path) if f.startswith("sigterms_") and f.endswith("_1")]) == 2


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
