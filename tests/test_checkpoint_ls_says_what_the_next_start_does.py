"""`keras-scale checkpoint ls` says what the next ChiefCheckpoint start will do with each file, and the start then
does exactly that: a checkpoint a killed rotation was deleting, a completed run, a stale state file adopted, a state
file moved aside. Tiny models, in-process."""
import contextlib
import io as _stdio
import json
import os
import warnings

import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint import list_checkpoints
from keras_scale.callbacks.checkpoint.export import describe_directory
from tests._helpers import StopAfter, fit, make_model


def _ls(directory, *extra):
    from keras_scale.cli import main

    buffer = _stdio.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["checkpoint", "ls", directory, *extra]) == 0
    return buffer.getvalue()


def _three_checkpoints(tmp_path):
    directory = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=4, max_to_keep=3), StopAfter(12)], epochs=2)
    assert [n for n, _ in list_checkpoints(directory)] == [12, 8, 4]
    return directory


def _state_file(directory, names):
    stamps = [os.stat(os.path.join(directory, n + ".index")).st_mtime for n in names]
    with open(os.path.join(directory, "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "{names[-1]}"\n' + "".join(f'all_model_checkpoint_paths: "{n}"\n' for n in names)
                + "".join(f"all_model_checkpoint_timestamps: {t:.6f}\n" for t in stamps)
                + f"last_preserved_timestamp: {min(stamps) - 1.0:.6f}\n")


def test_a_checkpoint_a_killed_rotation_was_deleting_is_listed_once_as_deleted_at_the_next_start(tmp_path):
    """SIGKILL between the state file dropping ckpt-4 and its deletion (checkpoint.retiring names it): `ls` lists it
    only as deleted by the next start (never also as kept), and the next start deletes it."""
    directory = _three_checkpoints(tmp_path)
    _state_file(directory, ["ckpt-8", "ckpt-12"])
    with open(os.path.join(directory, "checkpoint.retiring"), "w") as f:
        json.dump(["ckpt-4"], f)
    out = _ls(directory)
    lines = [line for line in out.splitlines() if "ckpt-4 " in line or "ckpt-4:" in line]
    assert len(lines) == 1 and "deletes it" in lines[0] and "kept" not in out, out
    info = describe_directory(directory)
    assert info["unlisted"] == [] and info["retired"] == [os.path.join(directory, "ckpt-4")], info
    fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=4, max_to_keep=3), StopAfter(13)], epochs=2)
    assert not any(n.startswith("ckpt-4.") for n in os.listdir(directory)), sorted(os.listdir(directory))


def test_a_checkpoint_no_rotation_was_deleting_is_listed_as_kept_and_the_next_start_keeps_it(tmp_path):
    """The same files without checkpoint.retiring (keep_every_n_hours, an earlier run): kept, and really kept."""
    directory = _three_checkpoints(tmp_path)
    _state_file(directory, ["ckpt-8", "ckpt-12"])
    out = _ls(directory)
    assert "ckpt-4 " in out and "kept" in out and "deletes" not in out, out
    fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=4, max_to_keep=3), StopAfter(13)], epochs=2)
    assert os.path.exists(os.path.join(directory, "ckpt-4.index"))


@pytest.mark.parametrize("early_stopping", [False, True])
def test_ls_of_a_completed_run_says_it_completed_and_what_a_rerun_does(tmp_path, early_stopping):
    """Not "a resumed fit starts here (continues at epoch 3, batch 1)": the run completed, a rerun restores its final
    state and trains 0 epochs (as the rerun then does); --json has `completed`."""
    import keras

    directory = str(tmp_path / "ckpt")
    stop = [keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=1e9)] if early_stopping else []
    fit(make_model(), [ks.ChiefCheckpoint(directory), *stop], epochs=3)
    out = _ls(directory)
    assert "completed at epoch" in out and "trains 0 epochs" in out and "a resumed fit starts here" not in out, out
    assert ("EarlyStopping" in out) == early_stopping, out
    info = json.loads(_ls(directory, "--json"))
    done = info["completed"]
    assert done["reason"] == ("early_stopping" if early_stopping else "epochs") and done["prefix"] == info["resumes"]
    model = make_model()
    history = fit(model, [ks.ChiefCheckpoint(directory)], epochs=3)  # what ls promised: 0 epochs trained
    assert len(history.epoch) <= 1 and int(model.optimizer.iterations.numpy()) == int(info["resumes"].rsplit("-", 1)[1])


def test_ls_of_an_interrupted_run_has_no_completion(tmp_path):
    directory = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=5), StopAfter(15)], epochs=3)
    assert json.loads(_ls(directory, "--json"))["completed"] is None
    assert "a resumed fit starts here (continues at epoch 2, batch 6)" in _ls(directory)


def test_adopting_a_stale_state_file_leaves_no_file_named_invalid_and_the_warning_says_what_this_start_does(tmp_path):
    """A state file put back from an older copy (naming only ckpt-4, which exists) is valid, only stale: the start
    adopts ckpt-8 and ckpt-12, rewrites it, and keeps no 'checkpoint.invalid'; its warning is in the present tense."""
    directory = _three_checkpoints(tmp_path)
    _state_file(directory, ["ckpt-4"])
    assert "the next start rewrites the state file" in _ls(directory)
    with pytest.warns(RuntimeWarning, match=r"adopted -- this start resumes from the newest that loads and rewrites"):
        fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=4, max_to_keep=3), StopAfter(13)], epochs=2)
    assert not [n for n in os.listdir(directory) if n.startswith("checkpoint.")], sorted(os.listdir(directory))
    assert "moved aside" not in _ls(directory)


def test_a_state_file_moved_aside_is_named_by_ls_and_the_start_says_it_moves_it_now(tmp_path):
    directory = _three_checkpoints(tmp_path)
    with open(os.path.join(directory, "checkpoint"), "w") as f:
        f.write("garbage that is not a state file")
    assert "the next ChiefCheckpoint start moves it aside" in _ls(directory)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=4, max_to_keep=3), StopAfter(13)], epochs=2)
    said = " ".join(str(w.message) for w in record)
    assert "this start moves it aside to 'checkpoint.invalid'" in said and "the next" not in said, said
    out = _ls(directory)
    assert "checkpoint.invalid: a state file an earlier ChiefCheckpoint start could not use" in out, out
    assert json.loads(_ls(directory, "--json"))["moved_aside"] == [os.path.join(directory, "checkpoint.invalid")]
