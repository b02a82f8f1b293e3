"""``ks.load_checkpoint(model, directory)`` (and ``keras-scale checkpoint export``) load what a rerun restores: a
completed run's final state (the weights its fit returned, EarlyStopping's restored best, from ``final/``), and,
when the newest checkpoint is damaged, the newest one that reads back whole (a warning naming the skipped one), as
``fit`` does. An explicit ``step=`` or prefix loads that checkpoint as saved, and a damaged one raises."""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.callbacks.checkpoint import list_checkpoints
from keras_scale.callbacks.checkpoint.format import CorruptCheckpointError
from keras_scale.cli import main
from tests._helpers import assert_same, fit, make_model, weights


def _flip_a_kernel_byte(prefix):
    kernel = tf.train.load_checkpoint(prefix).get_tensor("model_variables/0/.ATTRIBUTES/VARIABLE_VALUE").tobytes()
    data = prefix + ".data-00000-of-00001"
    raw = bytearray(open(data, "rb").read())
    at = bytes(raw).find(kernel)
    assert at >= 0
    raw[at + 2] ^= 0xFF
    open(data, "wb").write(bytes(raw))


def test_load_checkpoint_of_a_directory_gives_what_an_early_stopped_fit_returned(tmp_path, capsys):
    """Before: the top-level ckpt-20 (the last epoch's weights) while a rerun restored final/ckpt-20."""
    d = str(tmp_path / "ckpt")
    model = make_model()
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=1e9, restore_best_weights=True)
    fit(model, [ks.ChiefCheckpoint(d), es], epochs=5)
    returned = weights(model)
    newest = list_checkpoints(d)[0][1]
    assert os.path.exists(os.path.join(d, "final", os.path.basename(newest) + ".index"))

    loaded = make_model()
    assert ks.load_checkpoint(loaded, d) == os.path.join(d, "final", os.path.basename(newest))
    assert_same(returned, weights(loaded))
    as_saved = make_model()
    assert ks.load_checkpoint(as_saved, d, step=int(newest.rsplit("-", 1)[1])) == newest  # step=: as saved
    assert not all(np.array_equal(a, b) for a, b in zip(returned, weights(as_saved)))

    out = str(tmp_path / "exported.keras")
    capsys.readouterr()
    assert main(["checkpoint", "ls", d]) == 0
    listing = capsys.readouterr().out
    assert "final/ckpt-20: the completed run's final state (the weights its fit returned" in listing
    model_file = str(tmp_path / "m.keras")
    make_model().save(model_file)
    assert main(["checkpoint", "export", d, "--model", model_file, "--to", out]) == 0
    exported = keras.saving.load_model(out)
    assert_same(returned, weights(exported))
    assert int(exported.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())


def test_load_checkpoint_of_a_directory_skips_a_damaged_newest_checkpoint_as_fit_does(tmp_path):
    """Before: CorruptCheckpointError, while fit and ls fell back to the checkpoint before it."""
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, max_to_keep=3)], epochs=3)
    (_, newest), (n_before, before) = list_checkpoints(d)[:2]
    _flip_a_kernel_byte(newest)

    expected = make_model()
    ks.load_checkpoint(expected, before)
    loaded = make_model()
    with pytest.warns(RuntimeWarning, match=rf"{os.path.basename(newest)}' is damaged .* skipped, as fit skips it"):
        assert ks.load_checkpoint(loaded, d) == before
    assert_same(weights(expected), weights(loaded))
    with pytest.raises(CorruptCheckpointError):  # asked for by name: never another one
        ks.load_checkpoint(make_model(), newest)
    with pytest.raises(CorruptCheckpointError):
        ks.load_checkpoint(make_model(), d, step=int(newest.rsplit("-", 1)[1]))


def test_a_damaged_last_checkpoint_of_a_completed_run_is_one_story_rerun_and_load_resume_the_one_before(
        tmp_path, capsys):
    """An EarlyStopping-completed run whose last checkpoint is damaged: its final state cannot be restored (its
    optimizer state and position are in that checkpoint). Before: the rerun said "restoring its final state and
    training 0 epochs", then resumed the checkpoint before and trained on; load_checkpoint loaded final/ silently."""
    d = str(tmp_path / "ckpt")
    es = keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=1e9, restore_best_weights=True)
    fit(make_model(), [ks.ChiefCheckpoint(d, max_to_keep=3), es], epochs=5)
    (_, newest), (_, before) = list_checkpoints(d)[:2]
    assert os.path.exists(os.path.join(d, "final", os.path.basename(newest) + ".index"))
    _flip_a_kernel_byte(newest)

    expected = make_model()
    ks.load_checkpoint(expected, before)
    loaded = make_model()
    with pytest.warns(RuntimeWarning, match="damaged"):
        assert ks.load_checkpoint(loaded, d) == before  # what the rerun resumes, not final/
    assert_same(weights(expected), weights(loaded))

    capsys.readouterr()
    rerun = make_model()
    history = fit(rerun, [ks.ChiefCheckpoint(d, max_to_keep=3, verbose=1)], epochs=5)
    said = capsys.readouterr().out
    assert "training 0 epochs" not in said, said
    assert len(history.history["loss"]) > 0  # it resumed the checkpoint before, and trained on
