"""`ChiefCheckpoint(restore=False)` in a directory that holds a finished run: the new run says, at fit start, which
checkpoints its saves will rotate away and how to keep them; its checkpoints are numbered after them, so a later
rerun resumes the new run, never the finished one. Tiny models, in-process."""
import os
import warnings

import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint import list_checkpoints
from tests._helpers import StopAfter, assert_same, fit, make_model, weights


def test_restore_false_beside_a_completed_run_warns_naming_what_it_rotates_away(tmp_path):
    directory = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(directory, max_to_keep=3)], epochs=3)  # completed: ckpt-10, 20, 30
    with pytest.warns(RuntimeWarning, match=r"restore=False.*completed run \(completed at epoch 3, ckpt-30\): "
                                            r"ckpt-10, ckpt-20, ckpt-30.*rotate those out.*another directory"):
        fit(make_model(), [ks.ChiefCheckpoint(directory, max_to_keep=3, restore=False), StopAfter(15)], epochs=2)
    assert [n for n, _ in list_checkpoints(directory)] == [45, 40, 30]  # numbered after the completed run's


def test_a_rerun_after_restore_false_resumes_the_new_run_not_the_finished_one(tmp_path):
    """The new run, interrupted at batch 15 of 20, rerun with the default restore=True: it resumes the new run and
    ends like an uninterrupted 2-epoch run (not restoring the finished run's final state, 0 epochs)."""
    reference = make_model()
    fit(reference, [], epochs=2)
    directory = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(directory, max_to_keep=3)], epochs=3)
    with warnings.catch_warnings():  # (the warning: the test above)
        warnings.simplefilter("ignore")
        fit(make_model(), [ks.ChiefCheckpoint(directory, max_to_keep=3, restore=False), StopAfter(15)], epochs=2)
    model = make_model()
    ckpt = ks.ChiefCheckpoint(directory, max_to_keep=3)
    fit(model, [ckpt], epochs=2)
    assert os.path.basename(ckpt.restored_from) == "ckpt-45"
    assert_same(weights(model), weights(reference))


def test_restore_false_in_an_empty_directory_says_nothing(tmp_path, recwarn):
    fit(make_model(), [ks.ChiefCheckpoint(str(tmp_path / "ckpt"), restore=False)], epochs=1)
    assert not [w for w in recwarn if "restore=False" in str(w.message)]


def test_restore_false_with_keep_every_n_hours_says_which_old_checkpoints_stay(tmp_path):
    """Before: "after 1 save(s) none of them is left" while keep_every_n_hours kept them (and this run's) for good.
    Now the warning says they leave the state file and which files keep_every_n_hours keeps, and all of that holds."""
    directory = str(tmp_path / "ckpt")
    hours = 1e-9  # (every rotated checkpoint is older than the interval: each is kept)
    fit(make_model(), [ks.ChiefCheckpoint(directory, max_to_keep=1, keep_every_n_hours=hours)], epochs=3)
    with pytest.warns(RuntimeWarning) as caught:
        fit(make_model(), [ks.ChiefCheckpoint(directory, max_to_keep=1, keep_every_n_hours=hours, restore=False)],
            epochs=2)
    said = [str(w.message) for w in caught if "restore=False" in str(w.message)]
    assert len(said) == 1 and "none of them is left" not in said[0]
    assert "rotate those out of the state file" in said[0]
    assert "keep_every_n_hours=1e-09 keeps the files of one checkpoint per 1e-09 hour(s)" in said[0]
    assert "(kept so already: ckpt-10, ckpt-20)" in said[0]
    indexed = sorted(int(n[5:-6]) for n in os.listdir(directory) if n.endswith(".index"))
    assert indexed == [10, 20, 30, 40, 50]  # the old ones kept, as said
