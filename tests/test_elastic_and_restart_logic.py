"""The parts of "survive a lost worker" that need no cluster: the launcher's restart / hang / lost-worker decisions
(with TensorFlow-free fake workers that write heartbeats), the elastic batch arithmetic of ``ks.fit``, the
Heartbeat callback and the doctor's view of the cluster sources.
"""
import json
import os
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_scale as ks
import keras_scale.doctor as _doctor_module  # noqa: F401
dr = sys.modules["keras_scale.doctor"]
from keras_scale.callbacks.heartbeat import Heartbeat
from keras_scale.elastic import plan_elastic, read_record, record_path
from keras_scale.heartbeat_file import read_heartbeat, restart_summary
from keras_scale.launch import launch_with_restarts

_HEARTBEAT_FILE_PY = str(Path(__file__).resolve().parents[1] / "keras_scale" / "heartbeat_file.py")

# A fake worker: writes a start beat, then step beats; its behaviour per attempt is read from argv / marker files.
FAKE = r'''
import json, os, sys, time
import importlib.util
spec = importlib.util.spec_from_file_location("hb", os.environ["KS_HEARTBEAT_FILE_PY"])  # without TensorFlow
hb = importlib.util.module_from_spec(spec); spec.loader.exec_module(hb); write_beat = hb.write_beat
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
n = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
mode = sys.argv[1]
attempt = len([f for f in os.listdir(".") if f.startswith(f"attempt_{index}_")])
open(f"attempt_{index}_{attempt}", "w").close()
if mode == "lost" and index == 2 and attempt > 0:
    sys.exit(5)  # this machine is gone: fails at start, before any beat
if mode in ("silent", "silent_fail"):  # a plain model.fit without the Heartbeat callback: never beats
    time.sleep(2.5)
    sys.exit(0 if mode == "silent" else 3)
if mode == "slow_start":  # imports TensorFlow, builds the model: the first beat comes late
    time.sleep(2.0)
write_beat("start")
if mode == "lost" and n == 3 and attempt > 0:
    time.sleep(600)  # waits for the missing worker forever (as a real cluster start-up would)
for step in range(1, 4):
    time.sleep(0.1)
    write_beat("step", step)
if attempt == 0 and index == 1 and mode in ("crash", "always"):
    sys.exit(17)
if attempt == 0 and index == 2 and mode == "lost":
    sys.exit(9)  # crashes after its steps: not a start failure
if mode == "always" and index == 1:
    sys.exit(17)
if mode == "hang" and attempt == 0 and index == 0:
    time.sleep(600)  # no step progress, still alive
write_beat("end", 3)
print(json.dumps({"index": index, "workers": n, "attempt": attempt}))
'''


def _run(tmp_path, mode, num_workers=2, **kwargs):
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    lines = []
    env = {"KS_HEARTBEAT_FILE_PY": _HEARTBEAT_FILE_PY}
    outcome = launch_with_restarts([sys.executable, str(script), mode], num_workers=num_workers, grace_s=1,
                                   backoff_s=0.1, run_dir=str(tmp_path / "run"), env=env, cwd=str(tmp_path),
                                   say=lines.append, timeout_s=240, **kwargs)
    records = [json.loads(ln) for ln in (tmp_path / "run" / "restarts.jsonl").read_text().splitlines()] \
        if (tmp_path / "run" / "restarts.jsonl").exists() else []
    return outcome, lines, records


def test_a_crashed_worker_restarts_every_worker_once_and_the_restart_is_recorded(tmp_path):
    outcome, lines, records = _run(tmp_path, "crash", max_restarts=3)
    assert outcome.status == 0 and len(outcome.restarts) == 1
    assert lines == ["keras-scale launch: worker 1 failed with exit status 17 (exit 17); restart 1 of 3 with 2 workers",
                     "keras-scale launch: restart 1: the workers started again from step 0, 3 steps are trained "
                     "again: no checkpoint was restored (give keras_scale.fit a checkpoint_dir, or add "
                     "ChiefCheckpoint)"]  # the fake worker keeps no checkpoint
    assert [r["event"] for r in records] == ["restart", "resumed"]
    assert records[0]["last_step"] == 3 and records[1]["redone_steps"] == 3  # no checkpoint: all 3 steps again
    assert records[1]["lost_s"] > 0
    assert restart_summary(str(tmp_path / "run" / "restarts.jsonl"))["restarts"] == 1
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("attempt_")) == [
        "attempt_0_0", "attempt_0_1", "attempt_1_0", "attempt_1_1"]  # both workers started again


@pytest.mark.slow
def test_after_max_restarts_the_launcher_gives_up_with_the_last_failures_status(tmp_path):
    outcome, lines, records = _run(tmp_path, "always", max_restarts=2)
    assert outcome.status == 17 and len(outcome.restarts) == 2
    assert lines[-1].endswith("2 restarts used: giving up with exit status 17")


def test_no_restarts_by_default(tmp_path):
    outcome, lines, records = _run(tmp_path, "crash")
    assert outcome.status == 17 and outcome.restarts == [] and records == []


@pytest.mark.slow
def test_a_worker_without_step_progress_is_killed_after_the_heartbeat_timeout(tmp_path):
    start = time.monotonic()
    outcome, lines, records = _run(tmp_path, "hang", max_restarts=1, heartbeat_timeout_s=3)
    assert outcome.status == 0, lines
    assert time.monotonic() - start < 120
    assert lines[0].startswith("keras-scale launch: worker 0 made no step progress for 3 s (heartbeat: hung, killed)")
    hung_for = records[0]["failed_at_unix"] - records[0]["last_progress_unix"]
    assert 3 <= hung_for < 3 + 10, records


def test_hang_detection_without_any_heartbeat_says_so_once_instead_of_being_silently_off(tmp_path, monkeypatch):
    import keras_scale.launch

    monkeypatch.setattr(keras_scale.launch, "SILENT_HEARTBEAT_WARN_S", 1.0)  # (120 s: start-up is not a hang)
    outcome, lines, _ = _run(tmp_path, "silent", max_restarts=1, heartbeat_timeout_s=1)
    assert outcome.status == 0, lines
    warned = [ln for ln in lines if "no worker has written a heartbeat in the 1 s since it started" in ln]
    assert len(warned) == 1 and "keras_scale.callbacks.heartbeat.Heartbeat()" in warned[0], lines
    # workers that fail before any beat and are restarted: still said once per launch, not once per attempt
    outcome, lines, _ = _run(tmp_path, "silent_fail", max_restarts=2, heartbeat_timeout_s=1)
    assert len([ln for ln in lines if "no worker has written a heartbeat" in ln]) == 1, lines


def test_a_worker_slow_to_start_is_not_said_to_lack_heartbeats(tmp_path, monkeypatch):
    import keras_scale.launch

    monkeypatch.setattr(keras_scale.launch, "SILENT_HEARTBEAT_WARN_S", 4.0)
    outcome, lines, _ = _run(tmp_path, "slow_start", max_restarts=1, heartbeat_timeout_s=1)  # first beat at 2 s
    assert outcome.status == 0, lines
    assert not [ln for ln in lines if "no worker has written a heartbeat" in ln], lines


@pytest.mark.slow
def test_a_worker_failing_at_start_is_dropped_down_to_min_workers(tmp_path):
    outcome, lines, records = _run(tmp_path, "lost", num_workers=3, max_restarts=4, min_workers=2)
    assert outcome.status == 0, lines
    assert outcome.num_workers == 2
    assert [r["num_workers_next"] for r in records if r["event"] == "restart"] == [3, 3, 2]
    assert "before its first step" in lines[1] and lines[2].endswith("(was 3: a worker kept failing at start)")


@pytest.mark.slow
def test_without_min_workers_a_lost_worker_is_never_dropped(tmp_path):
    outcome, lines, records = _run(tmp_path, "lost", num_workers=3, max_restarts=3)
    assert outcome.status == 5 and all(r["num_workers_next"] == 3 for r in records if r["event"] == "restart")


def test_launcher_arguments_are_checked_early(tmp_path):
    with pytest.raises(ValueError, match="min_workers=3 is more than num_workers=2"):
        launch_with_restarts(["true"], num_workers=2, min_workers=3)
    with pytest.raises(ValueError, match="heartbeat_timeout_s must be > 0"):
        launch_with_restarts(["true"], num_workers=2, heartbeat_timeout_s=0)


# ------------------------------------------------------------------------------------------------- elastic
def test_elastic_keeps_the_global_batch_by_accumulation_or_refuses_with_sizes_that_work():
    record = {"global_batch_size": 12, "replicas": 3, "micro_batch_size": 2}
    assert plan_elastic(record, 12, 2, 1, "accum")[:3] == (6, 12, 3)   # 2 x 3 x 2 = 12
    assert plan_elastic(record, 12, 4, 1, "accum")[:3] == (3, 12, 3)   # micro-batches of 1 <= 2
    assert plan_elastic(record, 12, 3, 2, "accum") == (4, 12, 2, None)  # same replicas: nothing changes
    with pytest.raises(ValueError, match="Use global_batch_size=10 or 15"):
        plan_elastic(record, 12, 5, 1, "accum")
    per, glob, accum, message = plan_elastic(record, 12, 2, 1, "scale_lr")
    assert (per, glob, accum) == (4, 8, 1) and "learning rate x 8/12 (linear rule)" in message
    assert plan_elastic(record, 12, 2, 1, False) == (6, 12, 1, None)


def _build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _xy():
    x = np.random.default_rng(0).random((24, 4)).astype("float32")
    return x, (x.sum(axis=1, keepdims=True)).astype("float32")


def test_fit_resumed_on_fewer_replicas_keeps_the_global_batch_with_more_accumulation(tmp_path, capsys):
    x, y = _xy()
    ckpt = str(tmp_path / "ckpt")
    ks.fit(_build, x, y, global_batch_size=6, epochs=1, strategy="default", checkpoint_dir=ckpt, verbose=0,
           default_callbacks=False)
    assert json.loads(open(record_path(ckpt)).read()) == {"global_batch_size": 6, "replicas": 1,
                                                           "micro_batch_size": 6}
    # pretend the checkpoint was written by 3 replicas with micro-batches of 2 (the resumed run has 1 replica)
    with open(record_path(ckpt), "w") as f:
        json.dump({"global_batch_size": 6, "replicas": 3, "micro_batch_size": 2}, f)
    history = ks.fit(_build, x, y, global_batch_size=6, epochs=2, strategy="default", checkpoint_dir=ckpt, verbose=1,
                     default_callbacks=False)
    out = capsys.readouterr().out
    assert ("keras_scale: elastic: checkpoint written on 3 replicas, this run has 1: global batch 6 kept exact by "
            "accum 3 micro-batches of 2 per replica (was <= 2); learning rate unchanged") in out
    assert history.model.accum == 3 and len(history.history["loss"]) == 1  # epoch 2 only: epoch 1 was restored
    assert read_record(ckpt) == {"global_batch_size": 6, "replicas": 1, "micro_batch_size": 2}  # the bound stays


def test_fit_elastic_scale_lr_rescales_the_learning_rate_linearly(tmp_path, capsys):
    x, y = _xy()
    ckpt = str(tmp_path / "ckpt")
    ks.fit(_build, x, y, global_batch_size=6, epochs=1, strategy="default", checkpoint_dir=ckpt, verbose=0,
           default_callbacks=False)
    with open(record_path(ckpt), "w") as f:
        json.dump({"global_batch_size": 6, "replicas": 2, "micro_batch_size": 3}, f)
    with pytest.warns(RuntimeWarning, match="learning_rate changed between runs"):
        history = ks.fit(_build, x, y, global_batch_size=6, epochs=2, strategy="default", checkpoint_dir=ckpt,
                         verbose=1, default_callbacks=False, elastic="scale_lr")
    assert "global batch 6 -> 3; learning rate x 3/6 (linear rule)" in capsys.readouterr().out
    assert float(history.model.optimizer.learning_rate.numpy()) == pytest.approx(0.05)


def test_fit_rejects_an_unknown_elastic_mode():
    x, y = _xy()
    with pytest.raises(ValueError, match="elastic must be 'accum'"):
        ks.fit(_build, x, y, global_batch_size=6, elastic="yes")


def test_heartbeat_callback_writes_the_optimizer_step_and_ends_with_an_end_beat(tmp_path):
    x, y = _xy()
    path = str(tmp_path / "beat.json")
    model = _build()
    model.fit(x, y, batch_size=6, epochs=2, verbose=0, callbacks=[Heartbeat(path, interval_s=0)])
    beat = read_heartbeat(path)
    assert beat["phase"] == "end" and beat["step"] == 8 == int(model.optimizer.iterations.numpy())


def test_fit_adds_the_heartbeat_when_the_launcher_asks_for_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_SCALE_HEARTBEAT_FILE", str(tmp_path / "w0.json"))
    x, y = _xy()
    ks.fit(_build, x, y, global_batch_size=6, epochs=1, strategy="default", verbose=0, default_callbacks=False)
    assert read_heartbeat(str(tmp_path / "w0.json"))["step"] == 4


# -------------------------------------------------------------------------------------------------- doctor
def test_doctor_reads_the_same_cluster_sources():
    slurm = dr.check_tf_config(dr.Facts(env={"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4"}))
    assert slurm.status == "ok" and "Slurm job step: task 1 of 4 (not the chief)" in slurm.detail
    pod = {"JOB_COMPLETION_INDEX": "0", "KERAS_SCALE_NUM_WORKERS": "2", "HOSTNAME": "train-0",
           "KERAS_SCALE_WORKER_ADDRESS": "127.0.0.1:{index_port}", "KERAS_SCALE_PORT_BASE": "1"}
    result = dr.check_tf_config(dr.Facts(env=pod), resolve=lambda h: ["127.0.0.1"], port_free=lambda h, p: True)
    assert "2 task(s)" in result.detail and "worker:0" in result.detail


def test_a_resumable_fit_shards_file_based_data_by_data_not_by_file(tmp_path, capsys):
    import tensorflow as tf

    path = tmp_path / "data.csv"
    path.write_text("\n".join(f"{i},{i % 3}" for i in range(24)))

    def parse(line):
        values = tf.strings.to_number(tf.strings.split(line, ","))
        return tf.stack([values[0]] * 4), values[1:]

    ds = tf.data.TextLineDataset(str(path)).map(parse)
    ks.fit(_build, ds, global_batch_size=6, epochs=1, strategy="default", checkpoint_dir=str(tmp_path / "ckpt"),
           verbose=1, default_callbacks=False)
    out = capsys.readouterr().out
    assert "auto-shard DATA (elastic: a global batch holds the same samples on any number of workers" in out
    ks.fit(_build, ds, global_batch_size=6, epochs=1, strategy="default", checkpoint_dir=str(tmp_path / "ckpt2"),
           verbose=1, default_callbacks=False, elastic=False)
    assert "auto-shard FILE" in capsys.readouterr().out


SAVES_ON_SIGTERM = r'''
import os, signal, sys, time
import importlib.util
spec = importlib.util.spec_from_file_location("hb", os.environ["KS_HEARTBEAT_FILE_PY"])  # without TensorFlow
hb = importlib.util.module_from_spec(spec); spec.loader.exec_module(hb); write_beat = hb.write_beat
signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))  # what ChiefCheckpoint does: save, exit 42
write_beat("start")
open(f"started_{os.getpid()}", "w").close()
time.sleep(600)
'''


def test_a_signal_to_the_launcher_is_forwarded_once_and_never_restarts(tmp_path):
    import signal
    import threading

    script = tmp_path / "w.py"
    script.write_text(SAVES_ON_SIGTERM)
    env = {"KS_HEARTBEAT_FILE_PY": _HEARTBEAT_FILE_PY}

    def signal_when_started():
        deadline = time.monotonic() + 60
        while len([f for f in os.listdir(tmp_path) if f.startswith("started_")]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_when_started, daemon=True).start()
    lines = []
    outcome = launch_with_restarts([sys.executable, str(script)], num_workers=2, max_restarts=3, grace_s=10,
                                   env=env, cwd=str(tmp_path), say=lines.append, reraise_signal=False, timeout_s=120)
    assert [r.returncode for r in outcome.results] == [42, 42]
    assert outcome.status == 42 and outcome.restarts == [] and lines == []  # every worker saved: 42, not 143
