"""ChiefCheckpoint leaves nothing behind and touches nothing outside its directory: exception-safe install, links
and foreign state files, a missing newest file, one run per directory (lock), dead workers' temp folders, and
preemption by SIGTERM/SIGUSR1 (real signals, 1 process and 2 loopback workers)."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import keras
import numpy as np
import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint import lock as checkpoint_module  # the lock file and its holder
from keras_scale.callbacks.checkpoint import PREEMPTION_EXIT_CODE, list_checkpoints, read_checkpoint
from tests import _helpers as helpers
from tests._helpers import X, Y, StopAfter, assert_same, make_model, weights
from tests._helpers import load_weights_npz as _load, subprocess_env as _env



def fit(model, callbacks, epochs=2, **kw):
    return helpers.fit(model, callbacks, epochs=epochs, **kw)


class Boom(keras.callbacks.Callback):
    def __init__(self, at_step):
        super().__init__()
        self.at_step = at_step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) >= self.at_step:
            raise RuntimeError("boom")


def _state(model):
    return weights(model), [v.numpy().copy() for v in model.optimizer.variables]


def _untouched_like(state):
    """A fresh model holding ``state`` (weights and optimizer variables) that never saw ChiefCheckpoint."""
    model = make_model()
    model.optimizer.build(model.trainable_variables)
    for v, value in zip(model.weights, state[0]):
        v.assign(value)
    for v, value in zip(model.optimizer.variables, state[1]):
        v.assign(value)
    return model


@pytest.mark.parametrize("ending", ["finished", "raised_mid_epoch", "raised_while_resuming", "stopped"])
def test_any_ending_leaves_a_plain_model_for_the_next_fit(tmp_path, ending):
    """After a fit with ChiefCheckpoint ends in any way (an exception skips Keras's on_train_end), a later plain
    fit(epochs=2) runs 2 epochs and ends with exactly the weights it would have on an untouched model."""
    d = str(tmp_path / "ckpt")
    model = make_model()
    if ending == "raised_while_resuming":
        fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=4), StopAfter(14)])  # resumable at epoch 2
        with pytest.raises(RuntimeError, match="boom"):
            fit(model, [ks.ChiefCheckpoint(d, save_freq=4), Boom(15)], epochs=3)
    elif ending == "raised_mid_epoch":
        with pytest.raises(RuntimeError, match="boom"):
            fit(model, [ks.ChiefCheckpoint(d, save_freq=4), Boom(13)])
    elif ending == "stopped":
        fit(model, [ks.ChiefCheckpoint(d, save_freq=4), StopAfter(13)])
    else:
        fit(model, [ks.ChiefCheckpoint(d, save_freq=4)])
    state = _state(model)
    history = fit(model, [], epochs=2)
    reference = _untouched_like(state)
    expected = fit(reference, [], epochs=2)
    assert history.epoch == expected.epoch == [0, 1]
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    assert_same(weights(model), weights(reference))
    assert getattr(model, "_initial_epoch", None) in (None, 0) or not model._initial_epoch


def test_stale_temp_link_is_never_followed(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.txt").write_text("keep me")
    os.symlink(outside, d / "ckpt-7_temp")  # looks like a leftover of a killed write
    fit(make_model(), [ks.ChiefCheckpoint(str(d))], epochs=1)
    assert (outside / "data.txt").read_text() == "keep me"
    assert not os.path.lexists(d / "ckpt-7_temp")  # the link itself is removed


def test_state_file_naming_other_places_is_neither_read_nor_rotated(tmp_path):
    other = str(tmp_path / "other_run")
    fit(make_model(), [ks.ChiefCheckpoint(other, save_freq=2, max_to_keep=5)], epochs=1)
    other_files = sorted(os.listdir(other))
    d = tmp_path / "ckpt"
    d.mkdir()
    entries = [os.path.join(other, f"ckpt-{n}") for n in (6, 8, 10)]
    (d / "checkpoint").write_text(f'model_checkpoint_path: "{entries[-1]}"\n'
                                  + "".join(f'all_model_checkpoint_paths: "{e}"\n' for e in entries))
    ckpt = ks.ChiefCheckpoint(str(d), save_freq=1, max_to_keep=1)
    with pytest.warns(RuntimeWarning, match="not a checkpoint of this directory"):
        fit(make_model(), [ckpt], epochs=1)
    assert ckpt.restored_from is None  # started fresh: nothing read from elsewhere
    assert sorted(os.listdir(other)) == other_files  # nothing deleted there
    assert [n for n, _ in list_checkpoints(str(d))] == [10]


def test_state_file_naming_only_missing_checkpoints_resumes_from_the_real_newest(tmp_path):
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=2, max_to_keep=2), StopAfter(6)], epochs=2)
    assert [n for n, _ in list_checkpoints(d)] == [6, 4]
    with open(os.path.join(d, "checkpoint"), "w") as f:  # parses, but names files that do not exist
        f.write('model_checkpoint_path: "ckpt-90"\nall_model_checkpoint_paths: "ckpt-80"\n'
                'all_model_checkpoint_paths: "ckpt-90"\n')
    ckpt = ks.ChiefCheckpoint(d, save_freq=2, max_to_keep=2)
    with pytest.warns(RuntimeWarning, match=r"ckpt-90' is listed in the state file but its .index file is missing"
                                            r".*found 2 by scanning"):
        fit(make_model(), [ckpt, StopAfter(8)], epochs=2)
    assert ckpt.restored_from.endswith("ckpt-6")
    assert [n for n, _ in list_checkpoints(d)] == [8, 6]


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_a_second_run_in_the_same_directory_is_refused_naming_the_holder(tmp_path, live_pid):
    d = tmp_path / "ckpt"
    d.mkdir()
    host = checkpoint_module._hostname()
    (d / checkpoint_module._LOCK_NAME).write_text(json.dumps({"pid": live_pid, "host": host, "since": time.time()}))
    model = make_model()
    with pytest.raises(RuntimeError, match=rf"in use by another training process \(pid {live_pid} on host '{host}'"):
        fit(model, [ks.ChiefCheckpoint(str(d))])
    assert int(model.optimizer.iterations.numpy()) == 0
    assert not list_checkpoints(str(d))


@pytest.mark.slow
def test_a_stale_lock_is_taken_over_and_released_at_the_end(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = d / checkpoint_module._LOCK_NAME
    lock.write_text(json.dumps({"pid": dead.pid, "host": checkpoint_module._hostname(), "since": 0}))
    seen = {}

    class Peek(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.setdefault("holder", json.loads(lock.read_text()))

    with pytest.warns(RuntimeWarning, match=rf"stale lock.*process {dead.pid} on this host is gone"):
        fit(make_model(), [ks.ChiefCheckpoint(str(d)), Peek()], epochs=1)
    assert seen["holder"]["pid"] == os.getpid()
    assert not lock.exists()
    # another host's lock: stale only once its heartbeat is old
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": 0}))
    with pytest.raises(RuntimeError, match="in use by another training process"):
        fit(make_model(), [ks.ChiefCheckpoint(str(d))], epochs=1)
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="host 'elsewhere' has not refreshed it"):
        fit(make_model(), [ks.ChiefCheckpoint(str(d))], epochs=2)


@pytest.mark.parametrize("content", ["", "{\"pid\": 12", "[1, 2]"])
def test_an_empty_or_damaged_lock_is_taken_over_naming_it_unreadable(tmp_path, content):
    """A lock file that names no process (empty, torn, not the lock format) is not a running fit's: fresh from a
    writer, it is re-read for a moment; then it is taken over with a warning that says why (no "pid None")."""
    d = tmp_path / "ckpt"
    d.mkdir()
    lock = d / checkpoint_module._LOCK_NAME
    lock.write_text(content)
    with pytest.warns(RuntimeWarning, match=r"stale lock .*unreadable \(empty or damaged"):
        history = fit(make_model(), [ks.ChiefCheckpoint(str(d))], epochs=1)
    assert len(history.history["loss"]) == 1 and list_checkpoints(str(d))
    assert not lock.exists()


def test_dead_workers_temp_folders_are_removed_on_the_next_start(tmp_path, live_pid, monkeypatch):
    """Scratch folders the pack made (marked with their process) are removed once that process is gone; a live
    worker's stays. (Folders without the pack's marker are never touched: tests/test_checkpoint_edges.py.)"""
    from keras_scale.callbacks.checkpoint.directory import _SCRATCH_MARKER, make_scratch_dir
    from keras_scale.callbacks.checkpoint.lock import _boot_id, _process_start

    root = str(tmp_path / "tmp")
    os.mkdir(root)
    monkeypatch.setattr(tempfile, "tempdir", root)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = checkpoint_module._hostname()
    gone, alive = make_scratch_dir(), make_scratch_dir()
    for path, pid in ((gone, dead.pid), (alive, live_pid)):
        with open(os.path.join(path, _SCRATCH_MARKER), "w") as f:
            json.dump({"pid": pid, "host": host, "start": _process_start(pid), "boot": _boot_id()}, f)
    open(os.path.join(gone, "ckpt-1.index"), "w").close()
    fit(make_model(), [ks.ChiefCheckpoint(str(tmp_path / "ckpt"))], epochs=1)
    assert not os.path.exists(gone)
    assert os.path.isdir(alive)  # its worker still runs


def test_lock_heartbeat_refreshes_and_a_raised_fit_lets_the_directory_go(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_module, "_LOCK_HEARTBEAT_S", 0.05)
    d = tmp_path / "ckpt"
    lock = d / checkpoint_module._LOCK_NAME
    seen = []

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch in (0, 3):
                seen.append(os.path.getmtime(lock))
                time.sleep(0.3)

    with pytest.raises(RuntimeError, match="boom"):
        fit(make_model(), [ks.ChiefCheckpoint(str(d)), Watch(), Boom(5)], epochs=1)
    assert seen[1] > seen[0]  # refreshed while training
    deadline = time.monotonic() + 10
    while lock.exists() and time.monotonic() < deadline:  # no on_train_end after an exception: the heartbeat
        time.sleep(0.05)                                  # sees the fit is gone and releases the lock
    assert not lock.exists()


def test_preemption_with_exit_code_none_returns_from_fit(tmp_path):
    """A real SIGTERM to this process mid-epoch: the step finishes, no validation runs, the state is saved, fit
    returns (preemption_exit_code=None), and the previous SIGTERM handler is back."""
    before = signal.getsignal(signal.SIGTERM)
    tested = []

    class SendSigterm(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                os.kill(os.getpid(), signal.SIGTERM)

        def on_test_batch_end(self, batch, logs=None):
            tested.append(batch)

    d = str(tmp_path / "ckpt")
    ckpt = ks.ChiefCheckpoint(d, preemption_exit_code=None)
    model = make_model()
    history = fit(model, [SendSigterm(), ckpt], epochs=3, validation_data=(X, Y))
    assert ckpt.preempted == signal.SIGTERM
    assert int(model.optimizer.iterations.numpy()) == 4 and list_checkpoints(d)[0][0] == 4
    assert len(tested) <= 1  # validation stopped after its first batch
    assert len(history.epoch) == 1
    assert signal.getsignal(signal.SIGTERM) == before


def test_preemption_exits_after_every_callbacks_train_end(tmp_path):
    """The exit status 42 comes once every callback's on_train_end ran, whatever the order: Goodput listed after
    ChiefCheckpoint (ks.fit's default order) still reports, a user's cleanup still runs."""
    ended = []

    class SendSigterm(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    class Cleanup(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            ended.append("cleanup")

    goodput = ks.Goodput(verbose=0)
    d = str(tmp_path / "ckpt")
    with pytest.raises(SystemExit) as exit_info:
        fit(make_model(), [SendSigterm(), ks.ChiefCheckpoint(d), goodput, Cleanup()], epochs=2)
    assert exit_info.value.code == PREEMPTION_EXIT_CODE
    assert ended == ["cleanup"] and goodput.summary["steps"] == 4
    assert list_checkpoints(d)[0][0] == 4
    # a later fit of the same model is not affected by the exit hook
    history = fit(make_model(), [], epochs=1)
    assert len(history.epoch) == 1


@pytest.mark.parametrize("epoch", [0, 1])
def test_a_signal_in_an_epochs_last_step_never_records_a_cut_validation(tmp_path, epoch):
    """SIGTERM during the last step of an epoch: its batches all trained, its validation is cut after one batch
    (save and go). The rerun runs that validation again: History's val_loss equals the uninterrupted run's, and the
    best checkpoint is ranked by the true value (last epoch: "already complete" with the true val_loss)."""
    val = (X[:40] + 0.1, Y[:40])

    class TermInLastStep(keras.callbacks.Callback):
        def on_epoch_begin(self, e, logs=None):
            self.epoch = e

        def on_train_batch_begin(self, batch, logs=None):
            if self.epoch == epoch and batch == 9:
                os.kill(os.getpid(), signal.SIGTERM)

    expected = helpers.fit(make_model(), [], epochs=2, validation_data=val, validation_batch_size=8).history
    d = str(tmp_path / "ckpt")
    helpers.fit(make_model(), [ks.ChiefCheckpoint(d, preemption_exit_code=None, keep_best_k=2), TermInLastStep()],
                epochs=2, validation_data=val, validation_batch_size=8)
    again = ks.ChiefCheckpoint(d, preemption_exit_code=None, keep_best_k=2)
    history = helpers.fit(make_model(), [again], epochs=2, validation_data=val, validation_batch_size=8).history
    np.testing.assert_allclose(history["val_loss"], expected["val_loss"][epoch:], rtol=1e-6)
    best = [value for value, _ in again.best_checkpoints]
    assert best == sorted(best) and best[0] == pytest.approx(min(expected["val_loss"][epoch:]), rel=1e-6)


class _HistoryToDisk(keras.callbacks.History):
    def on_train_end(self, logs=None):
        self.written = True


@pytest.mark.parametrize("order", ["user_history_first", "history_subclass_after"])
def test_preemption_exit_with_a_users_history_anywhere_in_the_list(tmp_path, order):
    """The exit comes after the LAST callback's on_train_end, whatever it is: a user History listed before
    ChiefCheckpoint does not swallow it, a History subclass's own on_train_end still runs, and nothing is left
    patched for a later fit."""
    ended = []

    class SendSigterm(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    class After(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            ended.append("after")

    hist = keras.callbacks.History() if order == "user_history_first" else _HistoryToDisk()
    ckpt = ks.ChiefCheckpoint(str(tmp_path / "ckpt"))
    callbacks = [hist, ckpt, SendSigterm(), After()] if order == "user_history_first" else \
        [ckpt, SendSigterm(), hist, After()]
    model = make_model()
    with pytest.raises(SystemExit) as exit_info:
        helpers.fit(model, callbacks, epochs=2)
    assert exit_info.value.code == PREEMPTION_EXIT_CODE and ended == ["after"]
    if order == "history_subclass_after":
        assert hist.written
    assert all("on_train_end" not in vars(cb) for cb in callbacks)
    helpers.fit(model, [hist, After()], epochs=1)  # a later plain fit with the same callbacks: no exit
    assert ended == ["after", "after"]


def test_after_a_fit_that_raised_evaluate_writes_no_checkpoint_and_the_next_fit_drops_the_hook(tmp_path):
    d = str(tmp_path / "ckpt")

    class StopThenRaise(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 6:
                self.model.stop_training = True
                raise KeyboardInterrupt

    model = make_model()
    with pytest.raises(KeyboardInterrupt):
        helpers.fit(model, [ks.ChiefCheckpoint(d, save_freq=5), StopThenRaise()], epochs=2)
    saved = [n for n, _ in list_checkpoints(d)]
    model.set_weights([w * 0 for w in model.get_weights()])
    model.evaluate(X, Y, verbose=0)
    assert [n for n, _ in list_checkpoints(d)] == saved
    helpers.fit(model, [], epochs=1)  # the next fit takes the died fit's hook away
    assert [n for n, _ in list_checkpoints(d)] == saved
    assert "_get_metrics_result_or_logs" not in vars(model)


def test_early_stopping_restoring_weights_before_the_checkpoint_changes_no_checkpoint(tmp_path):
    """EarlyStopping(restore_best_weights=True) puts its best epoch's weights back in on_train_end (Keras 3.15:
    even when it did not stop the run). Listed before ChiefCheckpoint, the final save and the last epoch's best
    checkpoint still hold the trained weights: the final save is taken before any on_train_end."""
    d = str(tmp_path / "ckpt")
    trained = {}

    class Capture(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            trained[epoch] = weights(self.model)

    early = keras.callbacks.EarlyStopping(monitor="val_loss", mode="max", patience=100, restore_best_weights=True)
    ckpt = ks.ChiefCheckpoint(d, keep_best_k=3)
    helpers.fit(make_model(), [Capture(), early, ckpt], epochs=3, validation_data=(X[:40], Y[:40]))
    newest = read_checkpoint(list_checkpoints(d)[0][1])
    saved = [newest.get_tensor(f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE") for i in range(4)]
    assert_same(saved, trained[2])
    assert len(ckpt.best_checkpoints) == 3
    for _, path in ckpt.best_checkpoints:  # each best checkpoint holds its own epoch's trained weights
        epoch = int(os.path.basename(path).split("-")[1]) // 10 - 1  # ckpt-10, -20, -30: epochs 0, 1, 2
        reader = read_checkpoint(path)
        assert_same([reader.get_tensor(f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE") for i in range(4)],
                    trained[epoch])


def test_keep_best_mode_and_missing_monitor(tmp_path):
    assert ks.ChiefCheckpoint(str(tmp_path), keep_best_k=1, monitor="val_accuracy").mode == "max"
    assert ks.ChiefCheckpoint(str(tmp_path), keep_best_k=1, monitor="val_loss").mode == "min"
    with pytest.raises(ValueError, match="mode must be"):
        ks.ChiefCheckpoint(str(tmp_path), mode="best")
    with pytest.warns(RuntimeWarning, match="keep_best_k needs 'val_loss' in the epoch logs") as record:
        fit(make_model(), [ks.ChiefCheckpoint(str(tmp_path / "ckpt"), keep_best_k=2)], epochs=2)
    assert sum("keep_best_k" in str(w.message) for w in record) == 1


# ------------------------------------------------------------------------------------------------ preemption
TRAIN_SCRIPT = r"""
import os, sys, time
import numpy as np, tensorflow as tf, keras
import keras_scale as ks

mode, directory, out = sys.argv[1], sys.argv[2], sys.argv[3]
keras.utils.set_random_seed(3)
x = np.random.RandomState(0).rand(160, 4).astype("float32")
y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="mse", metrics=["mae"])


class Report(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print("BATCH", int(self.model.optimizer.iterations.numpy()), flush=True)
        time.sleep(0.05)
        if mode == "raise" and batch == 2:
            raise RuntimeError("boom")


callbacks = [Report()]
if mode != "reference":
    callbacks.insert(0, ks.ChiefCheckpoint(directory, save_freq=1000, verbose=1))  # prints its resume notice
try:
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)  # 3 x 20 batches
except RuntimeError:
    print("RAISED", flush=True)
    time.sleep(60)  # a SIGTERM now must end the process as if ChiefCheckpoint had never been there
np.savez(out, *[v.numpy() for v in model.weights])
print("DONE", flush=True)
"""


def _run(script, *args, signal_after=None, sig=signal.SIGTERM, timeout_s=120):
    """Run the script; with ``signal_after=(prefix, n)`` send ``sig`` once ``n`` lines starting with prefix
    appeared. Returns (returncode, lines, seconds from the signal to the exit)."""
    proc = subprocess.Popen([sys.executable, script, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env())
    lines, sent = [], []

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if signal_after and not sent and sum(l.startswith(signal_after[0]) for l in lines) >= signal_after[1]:
                sent.append(time.monotonic())
                proc.send_signal(sig)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    try:
        proc.wait(timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    thread.join(5)
    return proc.returncode, lines, (time.monotonic() - sent[0]) if sent else None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_signals_save_at_the_next_step_exit_42_and_reruns_resume_exactly(tmp_path):
    """SIGUSR1 (Slurm's early warning) in epoch 2, SIGTERM in epoch 3 of the resumed run, then a rerun to the
    end: each signalled run saves at the next step boundary and exits with status 42 within seconds; the final
    weights equal an uninterrupted run's."""
    script = str(tmp_path / "train.py")
    with open(script, "w") as f:
        f.write(TRAIN_SCRIPT)
    d = str(tmp_path / "ckpt")
    rc, lines, _ = _run(script, "reference", d + "_unused", str(tmp_path / "reference.npz"))
    assert rc == 0, "\n".join(lines[-20:])

    resumed_at = None
    for sig, after in ((signal.SIGUSR1, 5), (signal.SIGTERM, 12)):
        rc, lines, exit_s = _run(script, "train", d, str(tmp_path / "final.npz"), signal_after=("BATCH", after),
                                 sig=sig)
        assert rc == PREEMPTION_EXIT_CODE == 42, "\n".join(lines[-20:])
        assert any(f"{sig.name} received" in l and "Exiting with status 42" in l for l in lines), lines[-5:]
        assert exit_s < 30
        assert not any(l == "DONE" for l in lines)
        steps = [int(l.split()[1]) for l in lines if l.startswith("BATCH")]
        saved = list_checkpoints(d)[0][0]
        assert saved == steps[-1]  # the step boundary right after the signal, nothing trained after it
        assert steps.index(saved) - (after - 1) <= 2, steps
        if resumed_at is not None:
            assert any(f"resuming after batch {resumed_at % 20} of epoch {resumed_at // 20 + 1}" in l
                       for l in lines), lines[:5]
        resumed_at = saved
        assert not os.path.exists(os.path.join(d, checkpoint_module._LOCK_NAME))

    rc, lines, _ = _run(script, "train", d, str(tmp_path / "final.npz"))
    assert rc == 0 and lines[-1] == "DONE", "\n".join(lines[-20:])
    for a, b in zip(_load(tmp_path / "final.npz"), _load(tmp_path / "reference.npz")):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_after_a_fit_that_raised_terminates_as_usual(tmp_path):
    script = str(tmp_path / "train.py")
    with open(script, "w") as f:
        f.write(TRAIN_SCRIPT)
    rc, lines, exit_s = _run(script, "raise", str(tmp_path / "ckpt"), str(tmp_path / "x.npz"),
                             signal_after=("RAISED", 1))
    assert rc == -signal.SIGTERM, "\n".join(lines[-20:])
    assert exit_s < 10


WORKER_SCRIPT = r"""
import json, os, signal, sys, time
import numpy as np, tensorflow as tf, keras
import keras_scale as ks
from keras_scale.distribute import patch_keras_multi_worker, is_chief
patch_keras_multi_worker()
directory, mode = sys.argv[1], sys.argv[2]
strategy = tf.distribute.MultiWorkerMirroredStrategy()
keras.utils.set_random_seed(7)
x = np.random.RandomState(0).rand(128, 4).astype("float32"); y = x.sum(1, keepdims=True)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


class SignalOneWorker(keras.callbacks.Callback):
    # a real SIGTERM to the non-chief worker only, in the middle of epoch 2
    def on_train_batch_end(self, batch, logs=None):
        if mode == "signal" and not is_chief(strategy) and int(self.model.optimizer.iterations.numpy()) == 11:
            os.kill(os.getpid(), signal.SIGTERM)


ckpt = ks.ChiefCheckpoint(directory, save_freq=100)
callbacks = [SignalOneWorker(), ckpt] if mode != "reference" else []
try:
    model.fit(ds, epochs=3, verbose=0, callbacks=callbacks)  # 3 x 8 steps
except SystemExit as e:
    print(json.dumps({"exit": e.code, "global_step": ckpt.global_step, "preempted": ckpt.preempted,
                      "chief": is_chief(strategy)}), flush=True)
    raise
print(json.dumps({"exit": 0, "restored_from": ckpt.restored_from, "chief": is_chief(strategy),
                  "iterations": int(model.optimizer.iterations.numpy()),
                  "weights": [w.numpy().ravel().tolist() for w in model.weights]}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_multi_worker_sigterm_to_one_worker_stops_both_at_the_same_step(tmp_path, run_workers):
    d = str(tmp_path / "shared_ckpt")

    def outs(results):
        return [json.loads([l for l in r.stdout.strip().splitlines() if l.startswith("{")][-1]) for r in results]

    reference = outs(run_workers(WORKER_SCRIPT, args=(d + "_unused", "reference")))
    results = run_workers(WORKER_SCRIPT, args=(d, "signal"), check=False)
    assert [r.returncode for r in results] == [42, 42], [r.stderr[-2000:] for r in results]
    stopped = outs(results)
    assert stopped[0]["global_step"] == stopped[1]["global_step"]
    step = stopped[0]["global_step"]
    assert 11 <= step <= 12
    assert list_checkpoints(d)[0][0] == step
    assert {o["preempted"] for o in stopped} == {int(signal.SIGTERM)}

    resumed = outs(run_workers(WORKER_SCRIPT, args=(d, "resume")))
    assert all(o["restored_from"] == os.path.join(d, f"ckpt-{step}") for o in resumed)
    assert all(o["iterations"] == 24 for o in resumed)
    for o in resumed:
        for a, b in zip(o["weights"], reference[0]["weights"]):
            np.testing.assert_array_equal(np.array(a), np.array(b))
