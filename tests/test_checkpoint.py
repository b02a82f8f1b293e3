"""ChiefCheckpoint: exact resume, crash/corruption fallback, retention, optimizer state, strategies, fail-early.

The SIGKILL kill-and-resume loop lives in tests/test_checkpoint_kill.py.
"""
import glob
import json
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.callbacks import checkpoint as checkpoint_module
from keras_scale.callbacks.checkpoint import CheckpointMismatchError, checkpoint_for, list_checkpoints, read_checkpoint
from tests._helpers import BATCH, X, Y, StopAfter, assert_same, fit, make_model, weights

def damage(directory, number, truncate=False):
    """Corrupt checkpoint ``number``'s tensor data: overwrite 128 bytes in its middle (more than the 64-byte
    alignment padding between tensors, so some tensor's bytes change), or cut it to a third."""
    data_file = glob.glob(os.path.join(directory, f"ckpt-{number}.data-*"))[0]
    with open(data_file, "r+b") as f:
        if truncate:
            f.truncate(os.path.getsize(data_file) // 3)
        else:
            f.seek(os.path.getsize(data_file) // 2)
            f.write(b"\xff\x00" * 64)


@pytest.fixture(scope="module")
def reference_weights():
    keras.backend.clear_session()
    model = make_model()
    fit(model, [])
    return weights(model)


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_mid_epoch_equals_uninterrupted_run(tmp_path, reference_weights, async_save):
    d = str(tmp_path / "ckpt")
    first = make_model()
    fit(first, [ks.ChiefCheckpoint(d, save_freq=3, async_save=async_save, verbose=0), StopAfter(14)])
    # 14 batches = epoch 2, batch 4; the last periodic save was at 12, the graceful stop saved 14.
    assert [n for n, _ in list_checkpoints(d)] == [14, 12, 9]

    resumed = make_model()
    ckpt = ks.ChiefCheckpoint(d, save_freq=3, async_save=async_save, verbose=0)
    history = fit(resumed, [ckpt])
    assert ckpt.restored_from.endswith("ckpt-14")
    assert len(history.epoch) == 2  # epochs 2 and 3 ran; epoch 1 was not trained again
    assert ckpt.global_step == 30  # 3 epochs x 10 batches, each trained exactly once
    assert_same(weights(resumed), reference_weights)


def test_epoch_saves_and_a_mid_epoch_stop(tmp_path, reference_weights):
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, verbose=0), StopAfter(15)])
    # the end of epoch 1 (10 batches), and the graceful stop after batch 5 of epoch 2
    assert [n for n, _ in list_checkpoints(d)] == [15, 10]
    resumed = make_model()
    ckpt = ks.ChiefCheckpoint(d, verbose=0)
    finished = fit(resumed, [ckpt])
    assert ckpt.restored_from.endswith("ckpt-15")
    assert [n for n, _ in list_checkpoints(d)] == [30, 20, 15]
    assert_same(weights(resumed), reference_weights)

    # A finished run resumed with the same epochs trains nothing, says so, and its History holds the last
    # epoch's logs (restored from the checkpoint), so history.history["loss"][-1] still works.
    again = make_model()
    ckpt = ks.ChiefCheckpoint(d, verbose=0)
    history = fit(again, [ckpt])
    assert history.epoch == [2] and ckpt.global_step == 30
    assert history.history["loss"] == [finished.history["loss"][-1]]
    assert history.history["mae"] == [finished.history["mae"][-1]]
    assert_same(weights(again), reference_weights)


def test_relative_directory_resumes(tmp_path, monkeypatch, reference_weights):
    monkeypatch.chdir(tmp_path)  # ChiefCheckpoint("ckpt"), as users write it
    fit(make_model(), [ks.ChiefCheckpoint("ckpt", save_freq=4, verbose=0), StopAfter(12)])
    assert [n for n, _ in list_checkpoints("ckpt")][:1] == [12]
    resumed = make_model()
    ckpt = ks.ChiefCheckpoint("ckpt", save_freq=4, verbose=0)
    fit(resumed, [ckpt])
    assert ckpt.restored_from is not None and ckpt.restored_from.endswith("ckpt-12")
    assert_same(weights(resumed), reference_weights)


def test_relative_directory_is_resolved_when_the_callback_is_created(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    ckpt = ks.ChiefCheckpoint("ckpt")
    assert ckpt.directory == str(tmp_path / "a" / "ckpt")
    monkeypatch.chdir(tmp_path / "b")  # e.g. a library call in between
    fit(make_model(), [ckpt], epochs=1)
    assert [n for n, _ in list_checkpoints(str(tmp_path / "a" / "ckpt"))] == [10]
    assert not (tmp_path / "b" / "ckpt").exists()


def test_resume_from_an_older_checkpoint_skips_exactly_the_applied_batches(tmp_path, reference_weights):
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=3, max_to_keep=10, verbose=0), StopAfter(17)])
    # Simulate a crash right after the save at batch 15 (epoch 2, batch 5): drop the newer files.
    for f in glob.glob(os.path.join(d, "ckpt-17.*")):
        os.remove(f)
    resumed = make_model()
    ckpt = ks.ChiefCheckpoint(d, save_freq=3, verbose=0)
    with pytest.warns(RuntimeWarning, match=r"ckpt-17' is listed in the state file but its .index file is missing"):
        fit(resumed, [ckpt])
    assert ckpt.restored_from.endswith("ckpt-15")
    assert_same(weights(resumed), reference_weights)


def test_epoch_saves_with_steps_per_epoch_over_a_repeated_dataset(tmp_path):
    # With steps_per_epoch and repeat(), Keras continues one data iterator across epochs; a resume must too.
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH).repeat()
    kw = dict(steps_per_epoch=7, batch_size=None, shuffle=False)
    ref = make_model()
    ref.fit(ds, epochs=3, verbose=0, **kw)

    d = str(tmp_path / "ckpt")
    first = make_model()

    class StopAtEpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                self.model.stop_training = True

    first.fit(ds, epochs=3, verbose=0, callbacks=[ks.ChiefCheckpoint(d, verbose=0), StopAtEpochEnd()], **kw)
    resumed = make_model()
    ckpt = ks.ChiefCheckpoint(d, verbose=0)
    resumed.fit(ds, epochs=3, verbose=0, callbacks=[ckpt], **kw)
    assert ckpt.restored_from.endswith("ckpt-7")
    assert_same(weights(resumed), weights(ref))

    # and mid-epoch, at a batch that is not a multiple of the epoch length
    d2 = str(tmp_path / "ckpt2")
    make_model().fit(ds, epochs=3, verbose=0, callbacks=[ks.ChiefCheckpoint(d2, save_freq=4, verbose=0),
                                                         StopAfter(10)], **kw)
    resumed = make_model()
    make_it = ks.ChiefCheckpoint(d2, save_freq=4, verbose=0)
    resumed.fit(ds, epochs=3, verbose=0, callbacks=[make_it], **kw)
    assert make_it.restored_from.endswith("ckpt-10")
    assert_same(weights(resumed), weights(ref))


def test_resume_with_steps_per_execution(tmp_path):
    def model():
        m = make_model()
        m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"], steps_per_execution=2)
        return m

    ref = model()
    fit(ref, [])
    d = str(tmp_path / "ckpt")
    fit(model(), [ks.ChiefCheckpoint(d, save_freq=4, verbose=0), StopAfter(12)])  # 6 calls
    resumed = model()
    ckpt = ks.ChiefCheckpoint(d, save_freq=4, verbose=0)
    fit(resumed, [ckpt])
    assert ckpt.restored_from.endswith("ckpt-12")
    assert_same(weights(resumed), weights(ref))


def test_resume_of_a_model_built_only_by_its_first_step(tmp_path):
    # No keras.Input: the variables exist only once the first step is traced; the restore happens right before it.
    def model():
        keras.utils.set_random_seed(7)
        m = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
        return m

    ref = model()
    fit(ref, [])
    d = str(tmp_path / "ckpt")
    fit(model(), [ks.ChiefCheckpoint(d, save_freq=3, verbose=0), StopAfter(13)])
    damage(d, 13)  # and the newest one is damaged
    resumed = model()
    ckpt = ks.ChiefCheckpoint(d, save_freq=3, verbose=0)
    with pytest.warns(RuntimeWarning, match=r"ckpt-13.*Resumed from .*ckpt-12"):
        fit(resumed, [ckpt])
    assert ckpt.restored_from.endswith("ckpt-12")
    assert ckpt.global_step == 30
    assert_same(weights(resumed), weights(ref))


def test_corrupt_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path):
    d = str(tmp_path / "ckpt")
    snapshots = {}

    class Snapshot(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            snapshots[len(snapshots) + 1] = weights(self.model)

    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=2, verbose=0), Snapshot(), StopAfter(6)], epochs=1)
    damage(d, 6)

    resumed = make_model()
    ckpt = ks.ChiefCheckpoint(d, save_freq=2, verbose=0)
    with pytest.warns(RuntimeWarning, match=r"ckpt-6.*Resumed from .*ckpt-4"):
        fit(resumed, [ckpt, StopAfter(5)], epochs=1)
    assert ckpt.restored_from.endswith("ckpt-4")
    # The run continued from batch 4's weights: one more step from there, not from the corrupt or initial state.
    ref = make_model()
    fit(ref, [StopAfter(5)], epochs=1)
    assert_same(weights(resumed), weights(ref))
    assert_same(snapshots[5], weights(ref))


@pytest.mark.parametrize("state_file", ["missing", "empty"])
def test_truncated_newest_and_a_lost_state_file_fall_back(tmp_path, state_file):
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=2, verbose=0), StopAfter(6)], epochs=1)
    # Without a valid state file every ckpt-N.index is a candidate.
    if state_file == "missing":
        os.remove(os.path.join(d, "checkpoint"))
    else:
        open(os.path.join(d, "checkpoint"), "w").close()
    damage(d, 6, truncate=True)
    ckpt = ks.ChiefCheckpoint(d, save_freq=2, verbose=0)
    with pytest.warns(RuntimeWarning) as record:
        fit(make_model(), [ckpt, StopAfter(5)], epochs=1)
    messages = [str(w.message) for w in record]
    assert any("ckpt-6" in m and "Resumed from" in m for m in messages), messages
    assert any("checkpoint.invalid" in m for m in messages) == (state_file == "empty"), messages
    assert ckpt.restored_from.endswith("ckpt-4")


def test_a_write_killed_before_it_was_recorded_is_ignored(tmp_path):
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=2, verbose=0), StopAfter(4)], epochs=1)
    # What a kill mid-write leaves: a temp dir and files of a checkpoint the state file does not list.
    os.makedirs(os.path.join(d, "ckpt-6_temp"))
    with open(os.path.join(d, "ckpt-6.index"), "wb") as f:
        f.write(b"partial")
    ckpt = ks.ChiefCheckpoint(d, save_freq=2, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fit(make_model(), [ckpt, StopAfter(5)], epochs=1)
    assert ckpt.restored_from.endswith("ckpt-4")
    assert not os.path.exists(os.path.join(d, "ckpt-6_temp"))


def test_max_to_keep_keeps_the_newest(tmp_path):
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=1, max_to_keep=2, verbose=0), StopAfter(7)], epochs=1)
    indexes = sorted(os.path.basename(p) for p in glob.glob(os.path.join(d, "*.index")))
    assert indexes == ["ckpt-6.index", "ckpt-7.index"]
    assert [n for n, _ in list_checkpoints(d)] == [7, 6]


def test_keep_every_n_hours_keeps_old_checkpoints_beyond_max_to_keep(tmp_path):
    d = str(tmp_path / "ckpt")
    # An interval of ~4 microseconds: every checkpoint is "hours" apart from the previous kept one.
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=1, max_to_keep=1, keep_every_n_hours=1e-9, verbose=0),
                       StopAfter(4)], epochs=1)
    assert len(glob.glob(os.path.join(d, "ckpt-*.index"))) == 4
    assert [n for n, _ in list_checkpoints(d)] == [4]  # the recent one in the state file; the others archived


def test_adam_moments_iterations_and_lr_multiplier_are_restored(tmp_path):
    d = str(tmp_path / "ckpt")

    def opt():
        return keras.optimizers.Adam(ks.WarmupCosine(1e-2, total_steps=100, warmup_steps=5))

    first = make_model(optimizer=opt)
    ks.scale_learning_rate(first.optimizer, 0.25)  # e.g. lowered by a NanGuard rollback
    fit(first, [ks.ChiefCheckpoint(d, save_freq=5, verbose=0), StopAfter(5)], epochs=1)
    saved = [v.numpy() for v in first.optimizer.variables]
    names = [v.path for v in first.optimizer.variables]
    assert any("momentum" in p for p in names) and any("velocity" in p for p in names)

    second = make_model(optimizer=opt)
    fit(second, [ks.ChiefCheckpoint(d, save_freq=5, verbose=0)], epochs=1, initial_epoch=0, steps_per_epoch=5)
    # epochs=1, steps 5: the checkpoint is at the end of that, so nothing more is trained.
    assert int(second.optimizer.iterations.numpy()) == 5
    assert len(second.optimizer.variables) == len(saved)
    for v, value in zip(second.optimizer.variables, saved):
        np.testing.assert_array_equal(v.numpy(), value, err_msg=v.path)
    assert float(ks.schedules.lr_multiplier(second.optimizer).numpy()) == 0.25
    assert_same(weights(second), weights(first))


def test_loss_scale_optimizer_state_is_restored(tmp_path):
    d = str(tmp_path / "ckpt")

    def opt():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=2.0**10,
                                                   dynamic_growth_steps=2)

    first = make_model(optimizer=opt)
    fit(first, [ks.ChiefCheckpoint(d, save_freq=5, verbose=0), StopAfter(5)], epochs=1)
    saved = [v.numpy() for v in first.optimizer.variables]
    assert float(first.optimizer.dynamic_scale.numpy()) != 2.0**10  # it grew: something to restore

    second = make_model(optimizer=opt)
    fit(second, [ks.ChiefCheckpoint(d, verbose=0)], epochs=1, steps_per_epoch=5)
    assert len(second.optimizer.variables) == len(saved)
    for v, value in zip(second.optimizer.variables, saved):
        np.testing.assert_array_equal(v.numpy(), value, err_msg=v.path)


def test_mirrored_strategy_resume_equals_uninterrupted(tmp_path, mirrored):
    ref = make_model(strategy=mirrored)
    fit(ref, [], epochs=2)
    d = str(tmp_path / "ckpt")
    fit(make_model(strategy=mirrored), [ks.ChiefCheckpoint(d, save_freq=3, async_save=True, verbose=0),
                                        StopAfter(7)], epochs=2)
    resumed = make_model(strategy=mirrored)
    ckpt = ks.ChiefCheckpoint(d, save_freq=3, async_save=True, verbose=0)
    fit(resumed, [ckpt], epochs=2)
    assert ckpt.restored_from.endswith("ckpt-7")
    assert_same(weights(resumed), weights(ref))
    for v in resumed.weights:  # both replicas hold the restored values
        values = [t.numpy() for t in mirrored.experimental_local_results(v.value)]
        np.testing.assert_array_equal(values[0], values[1])


def test_unwritable_directory_fails_at_fit_start(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    model = make_model()
    with pytest.raises(PermissionError, match=r"a_file.*Fix"):
        fit(model, [ks.ChiefCheckpoint(str(blocker / "ckpt"))])
    assert int(model.optimizer.iterations.numpy()) == 0  # before any step


def test_checkpoint_of_a_different_model_fails_at_fit_start(tmp_path):
    d = str(tmp_path / "ckpt")
    fit(make_model(width=8), [ks.ChiefCheckpoint(d, save_freq=2, verbose=0), StopAfter(2)], epochs=1)
    other = make_model(width=16)
    with pytest.raises(CheckpointMismatchError, match=r"ckpt-2.*shape \(4, 8\).*\(4, 16\).*rm -r"):
        fit(other, [ks.ChiefCheckpoint(d, verbose=0)])
    assert int(other.optimizer.iterations.numpy()) == 0

    sgd = make_model(width=8, optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    with pytest.raises(CheckpointMismatchError, match="different optimizer"):
        fit(sgd, [ks.ChiefCheckpoint(d, verbose=0)])


@pytest.mark.parametrize("kwargs, match", [
    (dict(save_freq=0), "save_freq.*0"),
    (dict(save_freq="batch"), "save_freq.*'batch'"),
    (dict(max_to_keep=0), "max_to_keep.*0"),
    (dict(keep_every_n_hours=-1), "keep_every_n_hours.*-1"),
])
def test_bad_arguments_fail_at_construction(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ks.ChiefCheckpoint(str(tmp_path), **kwargs)


def test_graceful_stop_keeps_files_and_restore_latest_rolls_back(tmp_path):
    d = str(tmp_path / "ckpt")
    result = {}

    class Rollback(keras.callbacks.Callback):
        """What NanGuard's rollback policy does: find the callback on the model, restore the newest checkpoint."""

        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                saved = weights(self.model)
                for v in self.model.trainable_weights:
                    v.assign(v * np.nan)
                result["step"] = checkpoint_for(self.model).restore_latest()
                result["restored"] = weights(self.model)
                result["saved"] = saved
                self.model.stop_training = True

    model = make_model()
    fit(model, [ks.ChiefCheckpoint(d, save_freq=5, verbose=0), Rollback()], epochs=1)
    assert result["step"] == 5
    assert_same(result["restored"], result["saved"])  # batch index 4 = 5th batch = the checkpoint at 5
    assert [n for n, _ in list_checkpoints(d)] == [5]  # not deleted at train end
    assert model._initial_epoch is None


def test_only_committed_state_counts_with_async_and_final_flush(tmp_path):
    d = str(tmp_path / "ckpt")
    model = make_model()
    ckpt = ks.ChiefCheckpoint(d, save_freq=1, async_save=True, verbose=0)
    fit(model, [ckpt], epochs=1)
    # on_train_end flushed the last background write: it is recorded and loads.
    assert list_checkpoints(d)[0][0] == 10
    reader = read_checkpoint(os.path.join(d, "ckpt-10"))
    position = {k.split("/")[1]: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
                if k.startswith("keras_scale_position/")}
    # the save due at the epoch's last batch is taken after the epoch's end: a checkpoint at the start of epoch 2
    assert position == {"epoch": 1, "step_in_epoch": 0, "stream_pos": 0, "global_step": 10, "batch_size": 8}
    signature = json.loads(reader.get_tensor("keras_scale_signature/.ATTRIBUTES/VARIABLE_VALUE"))
    assert [s for _, s in signature["model"]] == [[4, 8], [8], [8, 1], [1]]


WORKER_SCRIPT = r"""
import json, os, sys
import numpy as np, tensorflow as tf, keras
import keras_scale as ks
from keras_scale.distribute import patch_keras_multi_worker, is_chief
patch_keras_multi_worker()
directory, epochs = sys.argv[1], int(sys.argv[2])
strategy = tf.distribute.MultiWorkerMirroredStrategy()
if sys.argv[3:] == ["unshared"] and not is_chief(strategy):
    directory += "_not_shared"  # what a worker sees when the directory is on the chief's local disk only
keras.utils.set_random_seed(7)
x = np.random.RandomState(0).rand(64, 4).astype("float32"); y = x.sum(1, keepdims=True)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
ckpt = ks.ChiefCheckpoint(directory, save_freq=2, verbose=0)
model.fit(ds, epochs=epochs, verbose=0, callbacks=[ckpt])
rolled_back_to = ckpt.restore_latest()  # synchronizes the workers, then both read the chief's newest
print(json.dumps({"rolled_back_to": rolled_back_to, "chief": is_chief(strategy), "write_dir": ckpt._write_dir,
                  "write_dir_exists": os.path.exists(ckpt._write_dir), "restored_from": ckpt.restored_from,
                  "global_step": ckpt.global_step, "kernel_sum": float(np.sum(model.weights[0].numpy()))}))
"""


@pytest.mark.slow
def test_multi_worker_only_the_chief_writes_into_the_directory(tmp_path, run_workers):
    d = str(tmp_path / "shared_ckpt")
    outs = [json.loads(r.stdout.strip().splitlines()[-1]) for r in run_workers(WORKER_SCRIPT, args=(d, 1))]
    chief, worker = sorted(outs, key=lambda o: not o["chief"])
    assert chief["chief"] and not worker["chief"]
    assert chief["write_dir"] == d and worker["write_dir"] != d
    assert not worker["write_dir_exists"]  # the worker's private copy is removed
    assert not worker["write_dir"].startswith(d)
    files = sorted(os.listdir(d))
    assert files == ["checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index",
                     "ckpt-4.data-00000-of-00001", "ckpt-4.index"]
    assert chief["kernel_sum"] == worker["kernel_sum"]
    assert chief["rolled_back_to"] == worker["rolled_back_to"] == 4

    # Both workers resume from the chief's checkpoint and continue in step.
    outs = [json.loads(r.stdout.strip().splitlines()[-1]) for r in run_workers(WORKER_SCRIPT, args=(d, 2))]
    assert all(o["restored_from"] == os.path.join(d, "ckpt-4") for o in outs)
    assert all(o["global_step"] == 8 for o in outs)
    assert outs[0]["kernel_sum"] == outs[1]["kernel_sum"]

    # A worker that cannot see the chief's checkpoints: both fail at fit start instead of diverging or hanging.
    results = run_workers(WORKER_SCRIPT, args=(d, 3, "unshared"), check=False)
    assert all(r.returncode not in (0, None) for r in results)
    assert all("workers would resume from different states" in r.stderr for r in results), results[0].stderr[-2000:]
    assert not os.path.exists(d + "_not_shared")


def test_a_run_nanguard_stopped_resumes_training_on_fixed_data(tmp_path, monkeypatch):
    """NanGuard(policy="stop") ends a run on bad data; rerun on fixed data, it must train (a restored transient
    'halted' flag froze it: 0 updates per epoch). Checkpoints of older versions hold that flag: they still load,
    and the flag is not restored. NanGuard's count of skipped steps is restored."""
    step = pytest.importorskip("keras_scale.step")
    d = str(tmp_path / "ckpt")
    every = step.ComposedStep.variables
    # what older versions saved: the transient guard flags too
    monkeypatch.setattr(step, "state_variables", lambda model: {
        "skipped_steps": step.get_step(model).skipped_steps, "halted": step.get_step(model).halted,
        "consecutive_bad": step.get_step(model).consecutive_bad})
    monkeypatch.setattr(checkpoint_module.state, "_TRANSIENT_STEP_STATE", frozenset())
    bad = X.copy()
    bad[40:48] = np.nan  # batch 6 of each epoch
    first = make_model()
    first.fit(bad, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[ks.ChiefCheckpoint(d, save_freq=2), ks.NanGuard(policy="stop", verbose=0)])
    prefix = list_checkpoints(d)[0][1]
    names = set(read_checkpoint(prefix).get_variable_to_shape_map())
    assert "keras_scale_state/halted/.ATTRIBUTES/VARIABLE_VALUE" in names
    assert int(read_checkpoint(prefix).get_tensor("keras_scale_state/halted/.ATTRIBUTES/VARIABLE_VALUE")) == 1
    stopped_at = int(first.optimizer.iterations.numpy())
    assert stopped_at == 5
    monkeypatch.undo()

    second = make_model()
    ckpt = ks.ChiefCheckpoint(d, save_freq=2)
    second.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
               callbacks=[ckpt, ks.NanGuard(policy="stop", verbose=0)])
    assert ckpt.restored_from == prefix
    # 6 batches were consumed (5 applied, 1 skipped as non-finite): the other 14 of 2 epochs train now
    assert int(second.optimizer.iterations.numpy()) == stopped_at + 14
    assert int(step.get_step(second).skipped_steps.numpy()) == 1  # the persistent count was restored
    # and new checkpoints never hold the transient flags
    names = set(read_checkpoint(list_checkpoints(d)[0][1]).get_variable_to_shape_map())
    assert not any("halted" in n or "consecutive_bad" in n for n in names)
    assert every is step.ComposedStep.variables


def test_async_checkpoint_holds_the_state_at_the_save_not_a_later_one(tmp_path):
    d = str(tmp_path / "ckpt")
    snapshots = {}

    class Snapshot(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            snapshots[int(self.model.optimizer.iterations.numpy())] = weights(self.model)

    model = make_model()
    fit(model, [ks.ChiefCheckpoint(d, save_freq=3, max_to_keep=10, async_save=True, verbose=0), Snapshot()],
        epochs=1)
    assert [n for n, _ in list_checkpoints(d)] == [10, 9, 6, 3]
    for n in (3, 6, 9):  # written in the background while the next steps already updated the weights
        reader = read_checkpoint(os.path.join(d, f"ckpt-{n}"))
        saved = [reader.get_tensor(f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE") for i in range(4)]
        assert_same(saved, snapshots[n])


def test_wrapped_accumulating_model_resumes_exactly(tmp_path):
    if not hasattr(pytest.importorskip("keras_scale.accumulation"), "wrap"):
        pytest.skip("keras_scale.wrap is not available")

    ref = make_model(accum=2)
    fit(ref, [])
    d = str(tmp_path / "ckpt")
    fit(make_model(accum=2), [ks.ChiefCheckpoint(d, save_freq=4, verbose=0), StopAfter(11)])
    resumed = make_model(accum=2)
    ckpt = ks.ChiefCheckpoint(d, save_freq=4, verbose=0)
    fit(resumed, [ckpt])
    assert ckpt.restored_from.endswith("ckpt-11")
    assert_same(weights(resumed), weights(ref))


def test_rollback_keeps_keras_scale_state_unless_asked(tmp_path):
    d = str(tmp_path / "ckpt")
    seen = {}

    class Rollback(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch != 6:
                return
            ckpt = checkpoint_for(self.model)
            multiplier = ks.schedules.lr_multiplier(self.model.optimizer)
            multiplier.assign(0.5)  # NanGuard lowers the LR, then rolls back
            seen["step"] = ckpt.restore_latest()
            seen["kept"] = float(multiplier.numpy())
            seen["iterations"] = int(self.model.optimizer.iterations.numpy())
            ckpt.restore_latest(restore_keras_scale_state=True)
            seen["restored"] = float(multiplier.numpy())
            self.model.stop_training = True

    model = make_model(optimizer=lambda: keras.optimizers.Adam(ks.WarmupCosine(1e-2, total_steps=100)))
    fit(model, [ks.ChiefCheckpoint(d, save_freq=5, verbose=0), Rollback()], epochs=1)
    assert seen == {"step": 5, "kept": 0.5, "iterations": 5, "restored": 1.0}


def test_another_wrapper_around_the_train_function_does_not_double_count(tmp_path, reference_weights):
    calls = []

    class OuterWrapper(keras.callbacks.Callback):
        """Replaces model.train_function with a wrapper of whatever was there (ours), after we installed it."""

        def on_train_begin(self, logs=None):
            previous = self.model.train_function

            def train_function(iterator):
                calls.append(1)
                return previous(iterator)

            self.model.train_function = train_function

    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=3, verbose=0), OuterWrapper(), StopAfter(14)])
    resumed = make_model()
    ckpt = ks.ChiefCheckpoint(d, save_freq=3, verbose=0)
    fit(resumed, [ckpt, OuterWrapper()])
    # Each trained batch went through the other wrapper once (14 + 16); the 4 skipped ones were not trained.
    assert ckpt.global_step == 30 and len(calls) == 14 + 16
    assert_same(weights(resumed), reference_weights)


def test_model_save_after_ks_fit_with_accum_keeps_the_optimizer_state(tmp_path):
    """ks.fit(..., accum=2) compiles one optimizer into the wrapper and the inner model. model.save / load_model of
    the wrapped model keeps its state (Keras used to save it once, under the inner model, and load the wrapper's
    from an empty group: 0 variables, iterations 0, a WarmupCosine back in warmup): training then continues
    exactly as the saved model's would."""
    def build():
        keras.utils.set_random_seed(7)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.Adam(ks.WarmupCosine(1e-2, warmup_steps=4, total_steps=40)),
                  loss="mse", metrics=["mae"])
        return m

    model = ks.fit(build, X, Y, global_batch_size=16, accum=2, epochs=2, verbose=0,
                   default_callbacks=False).model
    assert isinstance(model, ks.AccumulatingModel)
    path = str(tmp_path / "wrapped.keras")
    model.save(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*optimizer.*variables")
        loaded = keras.models.load_model(path)
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 10
    assert loaded.optimizer is ks.unwrap(loaded).optimizer
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for m in (model, loaded):  # one more epoch on each: the same update (moments, schedule position)
        m.fit(X[:32], Y[:32], batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_same(weights(loaded), weights(model))
