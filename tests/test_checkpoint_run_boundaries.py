"""A run's boundaries in its checkpoint directory: a completed run (all epochs, or stopped by EarlyStopping) is
recorded with the state its fit returned, and a rerun restores it, trains 0 epochs and says so at every verbosity;
a different configuration on a completed directory is an explicit choice (``on_completed``); a second ``fit`` of
the same callback trains like a second plain ``fit``; ``restore="weights_only"`` resumes the run it started in
full after a preemption. Then the same attacked: a kill between the final weights and the completing checkpoint,
a damaged run record, a damaged final-weights file."""
import json
import os
import signal

import keras
import numpy as np
import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint import RunCompletedError, list_checkpoints, read_checkpoint
from keras_scale.callbacks.checkpoint.names import _RUN_CONFIG_KEY
from tests._helpers import StopAfter, assert_same, fit, make_model, weights


def early_stopping():
    """Stops after epoch 2 (the first epoch is the only "improvement": min_delta is huge) and puts epoch 1's
    weights back at train end."""
    return keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=1e9, restore_best_weights=True)


def run_config(prefix):
    raw = read_checkpoint(prefix).get_tensor(_RUN_CONFIG_KEY)
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


@pytest.mark.parametrize("es_first", [False, True])
def test_a_rerun_after_early_stopping_gets_back_what_fit_returned_and_trains_nothing(tmp_path, capsys, es_first):
    """Before: the rerun resumed from the last epoch's weights and trained on (36 updates instead of 12, other
    weights). Now it restores what the completed fit returned (EarlyStopping's restored best weights), trains 0
    epochs, and says so at verbose=0."""
    d = str(tmp_path / "run ü")
    model = make_model()
    cbs = [ks.ChiefCheckpoint(d), early_stopping()]
    first = fit(model, cbs[::-1] if es_first else cbs, epochs=5)
    assert first.epoch == [0, 1] and int(model.optimizer.iterations.numpy()) == 20
    returned = weights(model)
    newest = list_checkpoints(d)[0][1]
    assert run_config(newest)["completed"]["reason"] == "early_stopping"
    capsys.readouterr()

    again = make_model()
    cbs = [ks.ChiefCheckpoint(d), early_stopping()]
    history = fit(again, cbs[::-1] if es_first else cbs, epochs=5)
    out = capsys.readouterr().out
    assert "already completed at epoch 2 (stopped by EarlyStopping" in out and "on_completed='restart'" in out
    assert int(again.optimizer.iterations.numpy()) == 20  # nothing trained, the optimizer state back
    assert_same(returned, weights(again))  # the weights the user got, not the last epoch's
    assert history.epoch == [1] and history.history["loss"] == [first.history["loss"][-1]]


def test_a_completed_run_rerun_with_another_learning_rate_is_an_explicit_choice(tmp_path, capsys):
    """Before: 0 steps, the old model back, not a word at verbose=0 (a sweep reusing a folder). Now: an error at
    fit start, before any update; on_completed='restart' trains the new configuration; 'error' refuses any rerun."""
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d)], epochs=2)
    sweep = make_model(optimizer=lambda: keras.optimizers.Adam(5e-3))
    start = weights(sweep)
    with pytest.raises(RunCompletedError, match=r"completed at epoch 2.*learning_rate 0\.01; this fit sets 0\.005"):
        fit(sweep, [ks.ChiefCheckpoint(d)], epochs=2)
    assert int(sweep.optimizer.iterations.numpy()) == 0
    assert_same(start, weights(sweep))

    restarted = make_model(optimizer=lambda: keras.optimizers.Adam(5e-3))
    capsys.readouterr()
    fit(restarted, [ks.ChiefCheckpoint(d, on_completed="restart")], epochs=2)
    assert "on_completed='restart': starting a new run" in capsys.readouterr().out
    plain = make_model(optimizer=lambda: keras.optimizers.Adam(5e-3))
    fit(plain, [], epochs=2)
    assert_same(weights(plain), weights(restarted))  # the new configuration, trained from the start
    assert [n for n, _ in list_checkpoints(d)][0] == 40  # numbered after the completed run: its newest stays older
    # the restarted run completed in turn; a rerun of it gets it back
    back = make_model(optimizer=lambda: keras.optimizers.Adam(5e-3))
    fit(back, [ks.ChiefCheckpoint(d)], epochs=2)
    assert_same(weights(plain), weights(back)) and int(back.optimizer.iterations.numpy()) == 20
    with pytest.raises(RunCompletedError, match="on_completed='error'"):
        fit(make_model(optimizer=lambda: keras.optimizers.Adam(5e-3)), [ks.ChiefCheckpoint(d, on_completed="error")],
            epochs=2)
    with pytest.raises(ValueError, match="on_completed must be one of"):
        ks.ChiefCheckpoint(d, on_completed="continue")


def test_a_second_fit_with_the_same_callback_trains_like_a_second_plain_fit(tmp_path, capsys):
    """Before: the second fit trained 0 epochs, silently. Keras's BackupAndRestore deletes its backup at train end,
    so its next fit trains; a plain second fit continues the model and optimizer: so does this one (said)."""
    d = str(tmp_path / "ckpt")
    model, ckpt = make_model(), ks.ChiefCheckpoint(d)
    fit(model, [ckpt], epochs=2)
    capsys.readouterr()
    second = fit(model, [ckpt], epochs=2)
    assert "this second fit starts a new run" in capsys.readouterr().out
    plain = make_model()
    fit(plain, [], epochs=2)
    plain_second = fit(plain, [], epochs=2)
    assert int(model.optimizer.iterations.numpy()) == 40 and second.epoch == [0, 1]
    assert_same(weights(plain), weights(model))
    assert second.history["loss"] == plain_second.history["loss"]
    # the directory now holds the second run, completed: a rerun in a fresh model gets it back
    again = make_model()
    fit(again, [ks.ChiefCheckpoint(d)], epochs=2)
    assert_same(weights(plain), weights(again))


def test_weights_only_resumes_its_own_preempted_run_in_full(tmp_path):
    """restore='weights_only' starts a new run from another configuration's weights; preempted and rerun with the
    same command, it resumed from those weights again at epoch 1 (every batch trained again, fresh optimizer).
    Now its own checkpoint resumes in full: bit-identical to the same run uninterrupted."""
    d, ref = str(tmp_path / "ckpt"), str(tmp_path / "ref")
    fit(make_model(), [ks.ChiefCheckpoint(d)], epochs=1)  # the first configuration: Adam
    fit(make_model(), [ks.ChiefCheckpoint(ref)], epochs=1)
    sgd = lambda: keras.optimizers.SGD(1e-2, momentum=0.9)  # noqa: E731 - the new configuration

    uninterrupted = make_model(optimizer=sgd)
    fit(uninterrupted, [ks.ChiefCheckpoint(ref, restore="weights_only")], epochs=2)

    class Preempt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 13:
                os.kill(os.getpid(), signal.SIGTERM)

    first = make_model(optimizer=sgd)
    ckpt = ks.ChiefCheckpoint(d, restore="weights_only", preemption_exit_code=None)
    fit(first, [ckpt, Preempt()], epochs=2)
    assert ckpt.preempted == signal.SIGTERM
    assert list_checkpoints(d)[0][0] == 10 + 14  # numbered after the checkpoint its weights came from
    rerun = make_model(optimizer=sgd)
    again = ks.ChiefCheckpoint(d, restore="weights_only")
    fit(rerun, [again], epochs=2)
    assert again.restored_from == os.path.join(d, "ckpt-24")
    assert int(rerun.optimizer.iterations.numpy()) == 20  # 14 before, 6 after: nothing trained twice
    assert_same(weights(uninterrupted), weights(rerun))
    # the same command once more: that run is complete now, so it is restored, 0 epochs
    done = make_model(optimizer=sgd)
    fit(done, [ks.ChiefCheckpoint(d, restore="weights_only")], epochs=2)
    assert int(done.optimizer.iterations.numpy()) == 20
    assert_same(weights(uninterrupted), weights(done))
    # another configuration (a new learning rate) from that directory is a new start from its weights again
    other = make_model(optimizer=lambda: keras.optimizers.SGD(5e-3, momentum=0.9))
    fit(other, [ks.ChiefCheckpoint(d, restore="weights_only"), StopAfter(3)], epochs=2)
    assert int(other.optimizer.iterations.numpy()) == 3


# ------------------------------------------------------------------------------------------ attacked
def test_a_kill_between_the_final_weights_and_the_completing_checkpoint(tmp_path, monkeypatch):
    """The final weights are written first, the checkpoint naming them last: killed between them (simulated: the
    checkpoint write dies), the directory holds an unfinished run whose rerun resumes it and an orphan in final/,
    removed at the next start."""
    d = str(tmp_path / "ckpt")
    from keras_scale.callbacks.checkpoint import format as io

    model = make_model()
    real = io.CheckpointManager.save

    def dies_at_the_completing_save(self, *args, **kwargs):
        if os.path.isdir(os.path.join(d, "final")):
            raise KeyboardInterrupt("killed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(io.CheckpointManager, "save", dies_at_the_completing_save)
    with pytest.raises(KeyboardInterrupt):
        fit(model, [ks.ChiefCheckpoint(d), early_stopping()], epochs=5)
    monkeypatch.undo()
    final_dir = os.path.join(d, "final")
    assert sorted(os.listdir(final_dir)) == ["ckpt-20.data-00000-of-00001", "ckpt-20.index"]
    newest = list_checkpoints(d)[0][1]
    assert run_config(newest)["completed"] is None  # epoch 1's: the run is not complete
    again = make_model()
    fit(again, [ks.ChiefCheckpoint(d), early_stopping()], epochs=5)  # resumes it (not completed): trains on
    assert int(again.optimizer.iterations.numpy()) > 20
    assert not [n for n in os.listdir(final_dir) if n.startswith("ckpt-20.")]  # the orphan went
    done = run_config(list_checkpoints(d)[0][1])["completed"]
    assert done["reason"] == "early_stopping" and os.path.exists(os.path.join(d, done["final_weights"] + ".index"))


def test_a_damaged_final_weights_file_or_run_record_is_said_not_trusted(tmp_path, capsys):
    d = str(tmp_path / "ckpt")
    first = make_model()
    fit(first, [ks.ChiefCheckpoint(d), early_stopping()], epochs=5)
    newest = list_checkpoints(d)[0][1]
    final = os.path.join(d, run_config(newest)["completed"]["final_weights"])
    with open(final + ".data-00000-of-00001", "r+b") as f:  # one flipped byte: its CRC fails
        f.seek(8)
        byte = f.read(1)
        f.seek(8)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = make_model()
    with pytest.warns(RuntimeWarning, match="final weights of the completed run .* could not be read"):
        fit(again, [ks.ChiefCheckpoint(d), early_stopping()], epochs=5)
    assert int(again.optimizer.iterations.numpy()) == 20  # still completed: nothing trained
    ckpt_weights = make_model()
    ks.load_checkpoint(ckpt_weights, newest)
    assert_same(weights(ckpt_weights), weights(again))  # the checkpoint's own (last epoch's) weights, said
    assert not np.array_equal(weights(first)[0], weights(again)[0])


def test_a_damaged_run_record_is_read_as_none(tmp_path):
    """A run record that is not the JSON this version writes (an older version's, a damaged one) never crashes
    fit nor marks a run complete: the checkpoint resumes as usual."""
    from keras_scale.callbacks.checkpoint.boundaries import _json, _Peek

    mid_run = {"epoch": 1, "step_in_epoch": 5}
    for raw in (b"{not json", b'["a list"]', b'{"completed": {"epoch": "x"}}', b'{"completed": 7}', b"\xff", b""):
        assert _Peek(15, "ckpt-15", _json(raw), {}, mid_run).completed(3) is None
    outside = ks.ChiefCheckpoint(str(tmp_path / "x"))
    with pytest.warns(RuntimeWarning, match="not a file of this directory"):  # a record never leads a read outside
        assert not outside._load_final_weights("p", {"final_weights": "../../elsewhere/ckpt-1"})
    assert _Peek(30, "ckpt-30", _json(b"{}"), {}, {"epoch": 3, "step_in_epoch": 0}).completed(3) == {
        "epoch": 3, "reason": "epochs"}  # an earlier version's finished run: complete by its position
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d), StopAfter(15)], epochs=3)
    model = make_model()
    fit(model, [ks.ChiefCheckpoint(d)], epochs=3)
    assert int(model.optimizer.iterations.numpy()) == 30


def test_final_folder_planted_as_a_file_or_holding_a_cut_write(tmp_path):
    """A user's file named ``final`` is neither written through nor removed (the record then names no final
    weights, with a warning); a write of final weights cut short (TensorFlow's temporary names) and files of
    checkpoints no longer recorded are removed at the next start, nothing else."""
    d = str(tmp_path / "ckpt")
    os.makedirs(d)
    with open(os.path.join(d, "final"), "w") as f:
        f.write("mine")
    with pytest.warns(RuntimeWarning, match="is a link or a file"):
        fit(make_model(), [ks.ChiefCheckpoint(d), early_stopping()], epochs=5)
    assert open(os.path.join(d, "final")).read() == "mine"
    assert "final_weights" not in run_config(list_checkpoints(d)[0][1])["completed"]

    d2 = str(tmp_path / "ckpt2")
    fit(make_model(), [ks.ChiefCheckpoint(d2), early_stopping()], epochs=5)
    final_dir = os.path.join(d2, "final")
    kept = sorted(os.listdir(final_dir))
    for name in ("ckpt-20.data-00000-of-00001.tempstate123", "ckpt-7.index", "notes.txt"):
        with open(os.path.join(final_dir, name), "w") as f:
            f.write("x")
    again = make_model()
    fit(again, [ks.ChiefCheckpoint(d2)], epochs=5)
    assert sorted(os.listdir(final_dir)) == sorted(kept + ["notes.txt"])
    assert int(again.optimizer.iterations.numpy()) == 20
