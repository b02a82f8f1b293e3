"""ChiefCheckpoint where other programs meet its directory: repeated signals (one process; a launcher and its
workers signalled at once), links planted at every name it writes, a user's folders in the temp dir, all index files
gone, and the lock (a reused pid, two starters taking over one stale lock)."""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint import lock as checkpoint_module  # the lock file and its holder
from keras_scale.callbacks.checkpoint import list_checkpoints
from keras_scale.callbacks.checkpoint.lock import _process_start
from tests._helpers import REPO_ROOT, SIGNALLED_TRAIN_SCRIPT, StopAfter, fit, make_model, subprocess_env


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_sigterms_50ms_apart_save_and_exit_42(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SIGNALLED_TRAIN_SCRIPT)
    d = str(tmp_path / "ckpt")
    proc = subprocess.Popen([sys.executable, str(script), d], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=subprocess_env())
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("BATCH 5"):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    lines += rest.splitlines()
    assert proc.returncode == 42, "\n".join(lines[-20:])
    step = list_checkpoints(d)[0][0]
    assert 5 <= step <= 8
    rerun = subprocess.run([sys.executable, str(script), d], capture_output=True, text=True, env=subprocess_env(),
                           timeout=180)
    assert rerun.returncode == 0 and "DONE 60" in rerun.stdout, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    assert f"from '{os.path.join(d, f'ckpt-{step}')}'" in rerun.stdout


WORKER_SCRIPT = r"""
import json, os, sys, time
import numpy as np, tensorflow as tf, keras
import keras_scale as ks
from keras_scale.distribute import patch_keras_multi_worker
patch_keras_multi_worker()
directory = sys.argv[1]
strategy = tf.distribute.MultiWorkerMirroredStrategy()
keras.utils.set_random_seed(7)
x = np.random.RandomState(0).rand(256, 4).astype("float32"); y = x.sum(1, keepdims=True)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


class Report(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print("PID", os.getpid(), "BATCH", int(self.model.optimizer.iterations.numpy()), flush=True)
        time.sleep(0.03 * (1 + strategy.cluster_resolver.task_id))  # the workers are at different moments


ckpt = ks.ChiefCheckpoint(directory, save_freq=1000)
model.fit(ds, epochs=3, verbose=0, callbacks=[ckpt, Report()])  # 3 x 16 steps
print("RESULT", json.dumps({"restored_from": ckpt.restored_from, "iterations": int(model.optimizer.iterations.numpy())}),
      flush=True)
"""


def _launch(script, d):
    return subprocess.Popen([sys.executable, "-m", "keras_scale", "launch", "--workers", "2", "--grace-s", "60", "--",
                             sys.executable, str(script), d], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=subprocess_env(), cwd=REPO_ROOT)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_sigterm_to_the_launcher_and_its_workers_at_once(tmp_path):
    """What cgroup-wide signalling does: SIGTERM reaches the launcher (which forwards it) and both workers, at
    different steps of each. The workers agree on one step, save once, and both exit 42; the rerun resumes there."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    d = str(tmp_path / "ckpt")
    launcher = _launch(script, d)
    lines, pids = [], set()
    for line in launcher.stdout:
        lines.append(line.rstrip("\n"))
        m = re.search(r"\[worker \d\] PID (\d+) BATCH (\d+)", line)
        if m:
            pids.add(int(m.group(1)))
            if len(pids) == 2 and int(m.group(2)) >= 6:
                for pid in [launcher.pid, *pids]:
                    os.kill(pid, signal.SIGTERM)
                break
    rest, _ = launcher.communicate(timeout=300)
    lines += rest.splitlines()
    text = "\n".join(lines)
    assert "worker 0: exit 42, worker 1: exit 42" in text, text[-4000:]
    assert launcher.returncode == 42  # signalled, and every worker saved
    (step, _), = list_checkpoints(d)[:1]
    assert 6 <= step < 48
    rerun = _launch(script, d)
    out, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, out[-4000:]
    results = [json.loads(l.split("RESULT ", 1)[1]) for l in out.splitlines() if "RESULT " in l]
    assert len(results) == 2 and all(r["restored_from"] == os.path.join(d, f"ckpt-{step}") for r in results), out[-3000:]
    assert all(r["iterations"] == 48 for r in results)


def test_no_write_follows_a_planted_link_out_of_the_directory(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    d = tmp_path / "ckpt"
    (d / "best").mkdir(parents=True)
    for name in ("ckpt-4.index.ks_tmp", "best/best.json.tmp", "ckpt-4.index", "ckpt-3.data-00000-of-00001",
                 ".ks_write_probe_%d" % os.getpid()):
        os.symlink(outside, d / name)
    fit(make_model(), [ks.ChiefCheckpoint(str(d), save_freq=2, keep_best_k=1, monitor="loss")], epochs=1)
    assert outside.read_text() == "keep me"
    assert 4 not in [n for n, _ in list_checkpoints(str(d))] or not os.path.islink(d / "ckpt-4.index")
    # a state file naming a missing checkpoint is rewritten (it was written through checkpoint.tmp)
    (d / "checkpoint").write_text('model_checkpoint_path: "ckpt-90"\nall_model_checkpoint_paths: "ckpt-10"\n'
                                  'all_model_checkpoint_paths: "ckpt-90"\n')
    os.symlink(outside, d / "checkpoint.tmp")
    with pytest.warns(RuntimeWarning, match="ckpt-90"):
        fit(make_model(), [ks.ChiefCheckpoint(str(d), save_freq=2)], epochs=2)
    assert outside.read_text() == "keep me"
    # a pre-existing async checkpoint name that links outside
    d2 = tmp_path / "async"
    d2.mkdir()
    os.symlink(outside, d2 / "ckpt-12.index")
    os.symlink(outside, d2 / "ckpt-12.data-00000-of-00001")
    fit(make_model(), [ks.ChiefCheckpoint(str(d2), save_freq=4, async_save=True)], epochs=2)
    assert outside.read_text() == "keep me"
    assert 12 in [n for n, _ in list_checkpoints(str(d2))] and not os.path.islink(d2 / "ckpt-12.index")


@pytest.mark.slow
def test_a_users_folders_in_the_temp_dir_are_never_removed(tmp_path, monkeypatch):
    root = str(tmp_path / "tmp")  # a temp dir of its own (other processes on this machine use the system one)
    os.mkdir(root)
    monkeypatch.setattr(tempfile, "tempdir", root)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = checkpoint_module._hostname()
    mine = [tempfile.mkdtemp(prefix=f"keras_scale_ckpt_worker_{host}_{dead.pid}_", dir=root),
            tempfile.mkdtemp(prefix="keras_scale_ckpt_worker_old_", dir=root)]
    old = time.time() - 2 * 86400
    for path in mine:
        with open(os.path.join(path, "results.csv"), "w") as f:
            f.write("a user's data")
        os.utime(path, (old, old))
    # a scratch folder the pack made for a worker process that has died since: removed
    made = subprocess.run([sys.executable, "-c", "from keras_scale.callbacks.checkpoint.directory import "
                           "make_scratch_dir; print(make_scratch_dir())"], capture_output=True, text=True,
                          env=dict(subprocess_env(), TMPDIR=root), timeout=120).stdout.strip().splitlines()[-1]
    try:
        fit(make_model(), [ks.ChiefCheckpoint(str(tmp_path / "ckpt"))], epochs=1)
        for path in mine:
            assert os.path.exists(os.path.join(path, "results.csv"))
        assert not os.path.exists(made)
    finally:
        import shutil
        for path in mine + [made]:
            shutil.rmtree(path, ignore_errors=True)


def test_all_index_files_deleted_is_an_error_naming_them(tmp_path):
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=5, max_to_keep=2), StopAfter(10)])
    for name in os.listdir(d):
        if name.endswith(".index"):
            os.remove(os.path.join(d, name))
    model = make_model()
    with pytest.raises(FileNotFoundError, match=r"records 2 checkpoint\(s\) \(ckpt-5, ckpt-10\) but their .index "
                                                r"files are missing"):
        fit(model, [ks.ChiefCheckpoint(d, save_freq=5)])
    assert int(model.optimizer.iterations.numpy()) == 0
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=5, restore=False), StopAfter(5)])  # the documented way out


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()


def test_a_lock_whose_pid_now_belongs_to_another_process_is_stale(tmp_path, live_pid):
    d = tmp_path / "ckpt"
    d.mkdir()
    lock = d / checkpoint_module._LOCK_NAME
    start = _process_start(live_pid)
    assert start is not None
    lock.write_text(json.dumps({"pid": live_pid, "host": checkpoint_module._hostname(), "start": start - 1,
                                "since": 0}))
    with pytest.warns(RuntimeWarning, match=rf"stale lock.*pid {live_pid} now belongs to another process"):
        fit(make_model(), [ks.ChiefCheckpoint(str(d))], epochs=1)
    assert list_checkpoints(str(d)) and not lock.exists()
    lock.write_text(json.dumps({"pid": live_pid, "host": checkpoint_module._hostname(), "start": start,
                                "since": 0}))
    with pytest.raises(RuntimeError, match=rf"in use by another training process \(pid {live_pid}"):
        fit(make_model(), [ks.ChiefCheckpoint(str(d))], epochs=1)


RACE_SCRIPT = r"""
import sys, time
from keras_scale.callbacks.checkpoint import ChiefCheckpoint
from keras_scale.callbacks.checkpoint import lock as lock_module

judge = lock_module.LockMixin._lock_is_stale


def slow_judge(path, holder):
    verdict = judge(path, holder)
    time.sleep(1.5)  # the window between judging a lock stale and taking it over, widened
    return verdict


lock_module.LockMixin._lock_is_stale = staticmethod(slow_judge)
ckpt = ChiefCheckpoint(sys.argv[1])
ckpt._fit_running = lambda frame=None: True
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # both start taking the lock at the same moment
try:
    ckpt._acquire_lock()
    print("WON", flush=True)
    time.sleep(4)
    ckpt._release_lock()
except RuntimeError as e:
    print("REFUSED", str(e)[:200], flush=True)
"""


@pytest.mark.slow
def test_two_starters_taking_over_one_stale_lock_never_both_win(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / checkpoint_module._LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": checkpoint_module._hostname(),
                                                              "since": 0}))
    script = tmp_path / "race.py"
    script.write_text(RACE_SCRIPT)
    at = str(time.time() + 25)
    procs = [subprocess.Popen([sys.executable, str(script), str(d), at], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=subprocess_env()) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    verdicts = sorted(o[0].split()[0] if o[0].strip() else o[1][-500:] for o in outs)
    assert verdicts == ["REFUSED", "WON"], outs
