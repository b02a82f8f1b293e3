"""ChiefCheckpoint resume semantics with the usual model (metrics compiled): the resumed epoch's metrics, a changed
batch size, tf.data order, no phantom updates, a finished run, rollback before the first save, best-k, output."""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.callbacks.checkpoint import checkpoint_for, list_checkpoints
from tests import _helpers as helpers
from tests._helpers import BATCH, X, Y, StopAfter, assert_same, fit, weights



def make_model(optimizer=None):
    return helpers.make_model(optimizer=optimizer,
                              metrics=["mae", keras.metrics.RootMeanSquaredError(name="rmse")])


@pytest.mark.parametrize("save_freq, stop_at", [(3, 14), (10, 10)])
def test_resumed_epoch_reports_the_metrics_of_the_whole_epoch(tmp_path, save_freq, stop_at):
    """Mid-epoch (14 = epoch 2, batch 4) and at an epoch's end by save_freq=10: the resumed epoch's loss and
    metrics continue from their saved state, so they equal the uninterrupted run's."""
    ref = make_model()
    expected = fit(ref, []).history
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=save_freq), StopAfter(stop_at)])
    resumed = make_model()
    history = fit(resumed, [ks.ChiefCheckpoint(d, save_freq=save_freq)]).history
    assert_same(weights(resumed), weights(ref))
    assert history.keys() == expected.keys()
    # mid-epoch: epochs 2 and 3; at epoch 1's end: the save due at its last batch was taken after the epoch's end,
    # so the resume starts at epoch 2
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key][1:], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("ending", ["stop", "sigterm", "crash"])
def test_resumed_epoch_metrics_are_exact_after_a_mid_epoch_stop_with_validation(tmp_path, ending):
    """Keras validates after the interrupting batch too, and validation resets the metric variables: the final save
    still holds the interrupted epoch's training metrics, so the resumed epoch logs the uninterrupted run's loss and
    metrics (validation ones included). A crash (an exception: no on_train_end, as after a SIGKILL) resumes from
    the last periodic save, taken before that epoch's validation."""
    import signal

    val = (X[:40] + 0.1, Y[:40])
    ref = make_model()
    expected = fit(ref, [], validation_data=val).history

    class Sigterm(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 14:
                os.kill(os.getpid(), signal.SIGTERM)

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 16:
                raise RuntimeError("crash")

    d = str(tmp_path / "ckpt")
    first = ks.ChiefCheckpoint(d, save_freq=3, preemption_exit_code=None)
    ender = {"stop": StopAfter(14), "sigterm": Sigterm(), "crash": Crash()}[ending]
    try:
        fit(make_model(), [first, ender], validation_data=val)
    except RuntimeError:
        assert ending == "crash"
    # the signal is acted on at the next step boundary: after batch 15 (epoch 2, batch 5); the crash at 16 leaves
    # the save at 15
    assert list_checkpoints(d)[0][0] == (14 if ending == "stop" else 15)
    assert (ending == "sigterm") == (first.preempted is not None)
    resumed = make_model()
    history = fit(resumed, [ks.ChiefCheckpoint(d, save_freq=3)], validation_data=val).history
    assert_same(weights(resumed), weights(ref))
    assert history.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key][1:], rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("stop_at", [14, 20])
def test_resumed_epoch_logs_the_nan_skipped_count_of_the_whole_epoch(tmp_path, stop_at):
    """A NaN batch in epoch 2 before the stop (batch 2 = update 12): NanGuard skips it; the resumed epoch's
    ``nan_skipped`` counts it as the uninterrupted run's does; an epoch-boundary resume (20) starts epoch 3 at 0."""
    x = X.copy()
    x[2 * BATCH, 0] = np.nan  # batch 2 of every epoch: NanGuard skips it (updates 2, 11, 20 are not applied)
    ref = make_model()
    expected = fit(ref, [ks.NanGuard(verbose=0)], x=x).history
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.NanGuard(verbose=0), ks.ChiefCheckpoint(d, save_freq=3), StopAfter(stop_at)], x=x)
    resumed = make_model()
    history = fit(resumed, [ks.ChiefCheckpoint(d, save_freq=3), ks.NanGuard(verbose=0)], x=x).history
    assert_same(weights(resumed), weights(ref))
    first = 1 if stop_at == 14 else 2
    assert expected["nan_skipped"] == [1, 1, 1]
    assert history["nan_skipped"] == expected["nan_skipped"][first:]
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key][first:], rtol=1e-6, err_msg=key)


class HalveLRAtEpochEnd(keras.callbacks.Callback):
    """Stateless (so that the resumed process behaves as the uninterrupted one): halves the learning rate at
    every epoch end, as ReduceLROnPlateau does on a plateau, also on a partial epoch's logs."""

    def on_epoch_end(self, epoch, logs=None):
        lr = self.model.optimizer.learning_rate
        lr.assign(lr * 0.5)


@pytest.mark.parametrize("checkpoint_first", [True, False])
@pytest.mark.parametrize("ending", ["stop", "sigterm"])
def test_a_mid_epoch_stop_is_saved_before_epoch_end_and_train_end_callbacks_change_the_state(
        tmp_path, checkpoint_first, ending):
    """After a stop at update 14 (epoch 2, batch 4) Keras still runs the partial epoch's on_epoch_end (the LR is
    halved) and EarlyStopping(restore_best_weights=True).on_train_end (epoch 1's weights are put back, though it
    did not stop the run): the checkpoint holds the state at the stop, so the resume equals the uninterrupted run."""
    import signal

    def opt():
        return keras.optimizers.Adam(1e-2)

    def early():  # mode="max" on the loss: the best epoch is the first one, whose weights it restores at train end
        return keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=100, restore_best_weights=True)

    ref = make_model(opt)
    fit(ref, [HalveLRAtEpochEnd()])

    class Sigterm(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 14:
                os.kill(os.getpid(), signal.SIGTERM)

    d = str(tmp_path / "ckpt")
    ckpt = ks.ChiefCheckpoint(d, save_freq=3, preemption_exit_code=None)
    others = [HalveLRAtEpochEnd(), early(), StopAfter(14) if ending == "stop" else Sigterm()]
    fit(make_model(opt), [ckpt, *others] if checkpoint_first else [*others, ckpt])
    resumed = make_model(opt)
    fit(resumed, [ks.ChiefCheckpoint(d, save_freq=3), HalveLRAtEpochEnd()])
    assert float(resumed.optimizer.learning_rate.numpy()) == pytest.approx(float(ref.optimizer.learning_rate.numpy()))
    assert_same(weights(resumed), weights(ref))


def test_switching_between_a_schedule_and_a_float_learning_rate_is_refused_with_the_reason(tmp_path):
    from keras_scale.callbacks.checkpoint import CheckpointMismatchError

    d = str(tmp_path / "ckpt")
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, 5, 0.5)
    fit(make_model(lambda: keras.optimizers.Adam(schedule)), [ks.ChiefCheckpoint(d), StopAfter(14)])
    with pytest.raises(CheckpointMismatchError, match="written with a schedule learning rate.*has a float"):
        fit(make_model(lambda: keras.optimizers.Adam(3e-3)), [ks.ChiefCheckpoint(d)])


def test_wrapped_model_with_metrics_resumes_with_exact_metrics(tmp_path):
    ref = helpers.make_model(accum=2)
    expected = fit(ref, [], epochs=2).history
    d = str(tmp_path / "ckpt")
    fit(helpers.make_model(accum=2), [ks.ChiefCheckpoint(d, save_freq=4), StopAfter(6)], epochs=2)
    resumed = helpers.make_model(accum=2)
    history = fit(resumed, [ks.ChiefCheckpoint(d, save_freq=4)], epochs=2).history
    assert_same(weights(resumed), weights(ref))
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-5, err_msg=key)


def test_mirrored_resume_with_metrics(tmp_path, mirrored):
    def model():
        with mirrored.scope():
            return make_model()

    ref = model()
    expected = fit(ref, [], epochs=2).history
    d = str(tmp_path / "ckpt")
    fit(model(), [ks.ChiefCheckpoint(d, save_freq=3), StopAfter(13)], epochs=2)
    resumed = model()
    history = fit(resumed, [ks.ChiefCheckpoint(d, save_freq=3)], epochs=2).history
    assert_same(weights(resumed), weights(ref))
    np.testing.assert_allclose(history["loss"], expected["loss"][1:], rtol=1e-5)
    np.testing.assert_allclose(history["mae"], expected["mae"][1:], rtol=1e-5)


@pytest.mark.parametrize("new_batch", [16, 4])
def test_batch_size_change_keeps_the_position_in_samples(tmp_path, new_batch):
    """Saved after 4 batches of 8 (sample 32); resumed with 16 or 4 samples per batch, training continues at
    sample 32: every sample of every epoch is trained exactly once."""
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=4), StopAfter(4)], epochs=2)
    resumed = make_model()
    ckpt = ks.ChiefCheckpoint(d, save_freq=4)
    fit(resumed, [ckpt], epochs=2, batch_size=new_batch)

    # the same schedule by hand: 4 batches of 8, then the rest of epoch 1 and epoch 2 with the new batch size
    ref = make_model()
    fit(ref, [StopAfter(4)], epochs=1)
    fit(ref, [], epochs=1, x=X[32:], y=Y[32:], batch_size=new_batch)
    fit(ref, [], epochs=1, batch_size=new_batch)
    assert int(resumed.optimizer.iterations.numpy()) == 4 + 48 // new_batch + 80 // new_batch
    np.testing.assert_allclose(np.concatenate([w.ravel() for w in weights(resumed)]),
                               np.concatenate([w.ravel() for w in weights(ref)]), rtol=1e-5, atol=1e-6)


def test_batch_size_that_does_not_divide_the_position_is_refused_before_training(tmp_path):
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=4), StopAfter(4)], epochs=2)
    resumed = make_model()
    with pytest.raises(ValueError, match=r"8 samples per batch, 32 samples into epoch 1.*12 samples per batch.*"
                                         r"divides 32 \(e\.g\. 8\)"):
        fit(resumed, [ks.ChiefCheckpoint(d, save_freq=4)], epochs=2, batch_size=12)
    assert int(resumed.optimizer.iterations.numpy()) == 4  # the restored state; nothing trained


def test_no_phantom_update_on_data_of_unknown_length(tmp_path):
    """Keras calls the train function once more on an exhausted iterator of unknown length, and that call bumps
    optimizer.iterations (Adam's bias correction and schedules count it). With ChiefCheckpoint: one update per
    batch, the same weights as on data of known length."""
    unknown = tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: True).batch(BATCH)
    known = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    ref = make_model()
    ref.fit(known, epochs=2, verbose=0)
    model = make_model()
    model.fit(unknown, epochs=2, verbose=0, callbacks=[ks.ChiefCheckpoint(str(tmp_path / "ckpt"))])
    assert int(model.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy()) == 20
    assert_same(weights(model), weights(ref))


def test_resume_with_steps_per_epoch_over_finite_data_without_repeat(tmp_path):
    """steps_per_epoch=5 over 10 batches without repeat(): Keras continues one iterator over 2 epochs and renews
    it by its own count, which a resumed process does not have. Resumed mid-epoch 2: exact, 15 updates."""
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    ref = make_model()
    ref.fit(ds, epochs=3, steps_per_epoch=5, verbose=0)
    d = str(tmp_path / "ckpt")
    make_model().fit(ds, epochs=3, steps_per_epoch=5, verbose=0,
                     callbacks=[ks.ChiefCheckpoint(d, save_freq=3), StopAfter(7)])
    resumed = make_model()
    resumed.fit(ds, epochs=3, steps_per_epoch=5, verbose=0, callbacks=[ks.ChiefCheckpoint(d, save_freq=3)])
    assert int(resumed.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy()) == 15
    assert_same(weights(resumed), weights(ref))


def test_reshuffling_seeded_pipeline_is_reported_at_resume(tmp_path):
    """Resumed at an epoch's start, a fresh process's iterator over shuffle(seed) (reshuffled each iteration) draws
    the first epoch's order, not this epoch's: said at fit start."""
    d = str(tmp_path / "ckpt")

    def data(reshuffle):
        return tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(80, seed=1, reshuffle_each_iteration=reshuffle
                                                                  ).batch(BATCH)

    fit_kw = dict(epochs=2, verbose=0)
    make_model().fit(data(True), callbacks=[ks.ChiefCheckpoint(d, save_freq="epoch"), StopAfter(10)], **fit_kw)
    with pytest.warns(RuntimeWarning, match=r"reshuffle_each_iteration=True.*not exact"):
        make_model().fit(data(True), callbacks=[ks.ChiefCheckpoint(d, save_freq="epoch")], **fit_kw)

    # reshuffle_each_iteration=False resumes exactly, without a warning
    d2 = str(tmp_path / "ckpt2")
    ref = make_model()
    ref.fit(data(False), **fit_kw)
    make_model().fit(data(False), callbacks=[ks.ChiefCheckpoint(d2, save_freq=4), StopAfter(12)], **fit_kw)
    resumed = make_model()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        resumed.fit(data(False), callbacks=[ks.ChiefCheckpoint(d2, save_freq=4)], **fit_kw)
    assert_same(weights(resumed), weights(ref))


def test_finished_run_says_already_complete(tmp_path, capsys):
    d = str(tmp_path / "ckpt")
    done = fit(make_model(), [ks.ChiefCheckpoint(d)], epochs=2)
    capsys.readouterr()
    again = make_model()
    history = fit(again, [ks.ChiefCheckpoint(d)], epochs=2)  # said at the default verbose=0 too
    out = capsys.readouterr().out
    assert "already completed at epoch 2 (all its epochs trained" in out and "larger epochs=" in out
    assert "on_completed='restart'" in out
    assert "resuming" not in out
    assert history.epoch == [1]
    assert history.history["rmse"] == [done.history["rmse"][-1]]
    assert int(again.optimizer.iterations.numpy()) == 20
    # a larger epochs= continues
    history = fit(again, [ks.ChiefCheckpoint(d)], epochs=3)
    assert history.epoch == [2] and int(again.optimizer.iterations.numpy()) == 30


def test_finished_run_whose_save_freq_is_the_epoch_length_says_already_complete(tmp_path, capsys):
    """save_freq = batches per epoch: the save due at the last epoch's last batch is taken after that epoch's end,
    so a rerun finds a complete run: nothing trained, nothing replayed, the last epoch's logs in History."""
    val = (X[:40] + 0.1, Y[:40])
    d = str(tmp_path / "ckpt")
    done = fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=10)], epochs=2, validation_data=val)
    assert [n for n, _ in list_checkpoints(d)] == [20, 10]
    capsys.readouterr()
    ends = []

    class EpochEnds(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            ends.append(epoch)

    again = make_model()
    history = fit(again, [ks.ChiefCheckpoint(d, save_freq=10, verbose=1), EpochEnds()], epochs=2,
                  validation_data=val)
    out = capsys.readouterr().out
    assert "already completed at epoch 2 (all its epochs trained" in out and "resuming" not in out
    assert ends == [] and int(again.optimizer.iterations.numpy()) == 20
    assert history.epoch == [1]
    assert history.history == {k: [v[-1]] for k, v in done.history.items()}


def test_a_checkpoint_from_the_last_batch_before_the_epoch_end_says_already_complete(tmp_path, capsys):
    """Data of unknown length (so the last batch is not known as such): the save due at the last batch of the last
    epoch is taken before its end; when the run completes, that state is saved again (same number) with the epoch's
    logs and the record that the run is complete. A rerun says "already completed", trains nothing, runs no epoch
    end again: History equals the finished run's last epoch."""
    val = (X[:40] + 0.1, Y[:40])
    d = str(tmp_path / "ckpt")
    unknown_length = tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: True).batch(BATCH)
    done = make_model().fit(unknown_length, epochs=2, verbose=0, validation_data=val,
                            callbacks=[ks.ChiefCheckpoint(d, save_freq=10)])
    assert [n for n, _ in list_checkpoints(d)] == [20, 10]
    again = make_model()
    capsys.readouterr()
    history = fit(again, [ks.ChiefCheckpoint(d, save_freq=10)], epochs=2, validation_data=val)
    out = capsys.readouterr().out
    assert "already completed at epoch 2 (all its epochs trained" in out and "resuming" not in out
    assert int(again.optimizer.iterations.numpy()) == 20
    assert history.epoch == [1]
    for key, values in done.history.items():
        np.testing.assert_allclose(history.history[key], values[-1:], rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("guard_first", [False, True])
def test_rollback_before_the_first_save_works_in_either_callback_order(tmp_path, guard_first):
    """A NaN streak before the first save: NanGuard(policy="rollback") restores the state the fit started from
    (kept by ChiefCheckpoint until its first save), whichever of the two callbacks comes first."""
    bad = X.copy()
    bad[16:40] = np.nan  # batches 3..5 of epoch 1: 3 bad steps in a row
    guard = ks.NanGuard(policy="rollback", max_consecutive=3, max_rollbacks=2, verbose=0)
    ckpt = ks.ChiefCheckpoint(str(tmp_path / "ckpt"), save_freq="epoch")
    seen = {}

    class Probe(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen["found"] = checkpoint_for(self.model)
            seen["initial"] = weights(self.model)

        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                seen["after_rollback"] = weights(self.model)

    model = make_model()
    callbacks = [guard, ckpt, Probe()] if guard_first else [ckpt, guard, Probe()]
    fit(model, callbacks, epochs=1, x=bad)
    assert seen["found"] is ckpt
    assert guard.rollbacks == 1 and guard.reports[0].source == "inputs"
    assert_same(seen["after_rollback"], seen["initial"])  # rolled back to the start state (weights + optimizer)


def test_rollback_outcome_does_not_depend_on_the_callback_order(tmp_path):
    """Two NaN streaks per epoch, the first ending on a batch where a save is due (save_freq=6): ChiefCheckpoint
    never saves a step NanGuard flagged (the step's `nan_skipped` log grew), so whichever callback comes first the
    rollbacks restore the same states: same weights, optimizer state, checkpoints and learning rate, and each
    rollback's lowering of a float learning rate is kept (a restore does not undo an earlier one)."""
    bad = X.copy()
    bad[24:48] = np.nan  # batches 4..6 of each epoch
    bad[56:80] = np.nan  # batches 8..10
    outcome = {}
    for guard_first in (False, True):
        d = str(tmp_path / f"ckpt_{guard_first}")
        guard = ks.NanGuard(policy="rollback", max_consecutive=3, max_rollbacks=5, verbose=0)
        ckpt = ks.ChiefCheckpoint(d, save_freq=6)
        model = make_model()
        fit(model, [guard, ckpt] if guard_first else [ckpt, guard], epochs=2, x=bad)
        outcome[guard_first] = (weights(model) + [v.numpy() for v in model.optimizer.variables],
                                [n for n, _ in list_checkpoints(d)], guard.rollbacks)
    (state_a, saved_a, rollbacks_a), (state_b, saved_b, rollbacks_b) = outcome[False], outcome[True]
    assert rollbacks_a == rollbacks_b == 4
    assert saved_a == saved_b
    assert_same(state_a, state_b)
    lr = float(model.optimizer.learning_rate.numpy())
    assert lr == pytest.approx(1e-2 * 0.5 ** 4)


def test_checkpoint_for_is_none_outside_its_fit(tmp_path):
    model = make_model()
    ckpt = ks.ChiefCheckpoint(str(tmp_path / "ckpt"))
    fit(model, [ckpt], epochs=1)
    found = {}

    class Probe(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            found["ckpt"] = checkpoint_for(self.model)

    fit(model, [Probe()], epochs=1)  # a later fit without it
    assert found["ckpt"] is None


def test_keep_best_k_by_monitor_beside_the_newest(tmp_path):
    d = str(tmp_path / "ckpt")
    ckpt = ks.ChiefCheckpoint(d, max_to_keep=1, keep_best_k=2, monitor="val_loss")
    model = make_model(optimizer=lambda: keras.optimizers.SGD(0.3))  # a noisy val_loss: not monotone
    at_epoch_end = {}

    class Keep(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            at_epoch_end[epoch] = weights(self.model)

    history = fit(model, [ckpt, Keep()], epochs=6, validation_data=(X[:40] + 0.1, Y[:40])).history
    order = sorted(range(6), key=lambda e: history["val_loss"][e])[:2]
    best = ckpt.best_checkpoints
    assert [v for v, _ in best] == pytest.approx([history["val_loss"][e] for e in order], rel=1e-6)
    assert [int(p.rsplit("-", 1)[1]) for _, p in best] == [10 * (e + 1) for e in order]
    assert [n for n, _ in list_checkpoints(d)] == [60]  # max_to_keep=1 for the newest, unaffected
    assert sorted(f for f in os.listdir(os.path.join(d, "best")) if f.endswith(".index")) == sorted(
        f"ckpt-{10 * (e + 1)}.index" for e in order)
    # a kept best checkpoint loads: the weights of that epoch's end
    assert ckpt.restore_checkpoint(best[0][1]) == 10 * (order[0] + 1)
    assert_same(weights(model), at_epoch_end[order[0]])


def test_quiet_by_default_and_verbose_prints_saves(tmp_path, capsys):
    fit(make_model(), [ks.ChiefCheckpoint(str(tmp_path / "a"), save_freq=5)], epochs=1)
    assert "ChiefCheckpoint" not in capsys.readouterr().out
    fit(make_model(), [ks.ChiefCheckpoint(str(tmp_path / "b"), save_freq=5, verbose=1)], epochs=1)
    out = capsys.readouterr().out
    assert "ChiefCheckpoint: saved" in out and out.count("saved") == 2


def test_verbose_says_an_async_save_saved_only_once_written_and_the_last_save_ends_its_epoch(tmp_path, capsys):
    """A background write may still fail: verbose says "saving" when it starts and "saved" once it completed. The
    save after the last epoch is "at the end of epoch 2", not "at the start of epoch 3" (which never runs)."""
    d = str(tmp_path / "a")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq="epoch", async_save=True, verbose=1)], epochs=2)
    lines = [l.strip() for l in capsys.readouterr().out.splitlines() if l.startswith("ChiefCheckpoint: sav")]
    first, last = os.path.join(d, "ckpt-10"), os.path.join(d, "ckpt-20")
    assert lines == [f"ChiefCheckpoint: saving {first} (at the end of epoch 1) in the background",
                     f"ChiefCheckpoint: saved {first} (its background write completed)",
                     f"ChiefCheckpoint: saving {last} (at the end of epoch 2) in the background",
                     f"ChiefCheckpoint: saved {last} (its background write completed)"], lines


def test_blocked_s_counts_saves_and_is_reset_each_fit(tmp_path):
    d = str(tmp_path / "ckpt")
    ckpt = ks.ChiefCheckpoint(d, save_freq=1, async_save=True)
    fit(make_model(), [ckpt], epochs=1)
    first = ckpt.blocked_s
    assert first > 0
    ckpt2 = ks.ChiefCheckpoint(d, save_freq=1, async_save=True)
    fit(make_model(), [ckpt2], epochs=1)  # already complete: nothing saved
    assert 0 <= ckpt2.blocked_s < first


def test_reshuffling_seeded_pipeline_resumed_from_its_saved_position_is_exact_and_not_reported(tmp_path):
    """Mid-epoch, the checkpoint holds the iterator's state, the shuffle's seeds included: the resumed order is the
    uninterrupted run's in this epoch and the next (bit-identical weights), so no "not exact" warning."""
    def data():
        return tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(80, seed=1).batch(BATCH)

    ref = make_model()
    ref.fit(data(), epochs=3, verbose=0)
    d = str(tmp_path / "ckpt")
    make_model().fit(data(), epochs=3, verbose=0, callbacks=[ks.ChiefCheckpoint(d, save_freq=3), StopAfter(13)])
    resumed = make_model()
    import warnings
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        resumed.fit(data(), epochs=3, verbose=0, callbacks=[ks.ChiefCheckpoint(d, save_freq=3)])
    assert not [w for w in record if "not exact" in str(w.message)], [str(w.message) for w in record]
    assert_same(weights(resumed), weights(ref))


def test_reshuffling_seeded_pipeline_is_reported_with_global_seed_zero(tmp_path):
    """keras.utils.set_random_seed(0) sets the global seed to 0: the op seed (shuffle(seed=1)) must still count."""
    d = str(tmp_path / "ckpt")
    keras.utils.set_random_seed(0)

    def data():
        return tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(80, seed=1).batch(BATCH)

    make_model().fit(data(), epochs=2, verbose=0, callbacks=[ks.ChiefCheckpoint(d, save_freq="epoch"), StopAfter(10)])
    keras.utils.set_random_seed(0)
    with pytest.warns(RuntimeWarning, match=r"reshuffle_each_iteration=True.*not exact"):
        make_model().fit(data(), epochs=2, verbose=0, callbacks=[ks.ChiefCheckpoint(d, save_freq="epoch")])


def test_two_checkpoints_in_one_fit_are_refused(tmp_path):
    model = make_model()
    with pytest.raises(ValueError, match="two ChiefCheckpoints in one fit"):
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[ks.ChiefCheckpoint(str(tmp_path / "a")), ks.ChiefCheckpoint(str(tmp_path / "b"))])
    history = model.fit(X, Y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[ks.ChiefCheckpoint(str(tmp_path / "a"))])
    assert len(history.history["loss"]) == 2  # one is fine, also right after the refusal


def test_keep_best_does_not_write_through_a_link_out_of_the_directory(tmp_path):
    d, outside = tmp_path / "ckpt", tmp_path / "outside"
    d.mkdir()
    outside.mkdir()
    os.symlink(outside, d / "best")
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        make_model().fit(X, Y, batch_size=BATCH, epochs=2, verbose=0,
                         callbacks=[ks.ChiefCheckpoint(str(d), keep_best_k=1, monitor="loss")])
    assert os.listdir(outside) == []


def test_learning_rate_changed_between_runs_is_used_and_named(tmp_path):
    """The script's learning rate changed between runs (1e-2 -> 5e-3): the new one is used, with a warning naming
    both; a learning rate changed during training (as ReduceLROnPlateau does) with the script unchanged resumes as
    saved, silently."""
    d = str(tmp_path / "ckpt")

    class Lower(keras.callbacks.Callback):  # what ReduceLROnPlateau does to a float learning rate
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 5:
                self.model.optimizer.learning_rate.assign(2e-3)

    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=3), Lower(), StopAfter(9)])
    seen = {}

    class Probe(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen["lr"] = float(self.model.optimizer.learning_rate.numpy())

    import warnings
    same = make_model()  # Adam(1e-2) as before
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(same, [ks.ChiefCheckpoint(d, save_freq=3), Probe(), StopAfter(12)])
    assert not [w for w in record if "learning_rate" in str(w.message)]
    assert seen["lr"] == pytest.approx(2e-3)

    changed = make_model(optimizer=lambda: keras.optimizers.Adam(5e-3))
    with pytest.warns(RuntimeWarning, match=r"learning_rate changed between runs: this run starts with 0\.005; .*"
                                             r"started with 0\.01 and was at 0\.002 when saved"):
        fit(changed, [ks.ChiefCheckpoint(d, save_freq=3), Probe()])
    assert seen["lr"] == pytest.approx(5e-3)
    assert float(changed.optimizer.learning_rate.numpy()) == pytest.approx(5e-3)
    assert int(changed.optimizer.iterations.numpy()) == 30  # everything else resumed


def test_use_ema_resumes_from_the_trained_weights_not_their_averages(tmp_path):
    """With use_ema=True Keras's fit overwrites the weights with their moving averages right before on_train_end:
    the final save of a stopped run holds the trained weights (and the averages, optimizer variables), so the
    resumed run ends exactly like the uninterrupted one."""
    def model():
        return make_model(optimizer=lambda: keras.optimizers.Adam(1e-2, use_ema=True))

    ref = model()
    expected = fit(ref, []).history
    d = str(tmp_path / "ckpt")
    fit(model(), [ks.ChiefCheckpoint(d, save_freq=3), StopAfter(14)])
    resumed = model()
    history = fit(resumed, [ks.ChiefCheckpoint(d, save_freq=3)]).history
    assert_same(weights(resumed), weights(ref))
    np.testing.assert_allclose(history["loss"], expected["loss"][1:], rtol=1e-6)
    assert "finalize_variable_values" not in vars(resumed.optimizer)  # nothing left on the optimizer
