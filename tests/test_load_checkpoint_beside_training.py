"""`ks.load_checkpoint(model, DIR)` in an evaluator loop beside a training run: the newest checkpoint can be rotated
away between being chosen and being read. It then reads the new newest one; when every choice vanishes it says so
naming the directory, with the model untouched. The race is made deterministic by rotating the checkpoint right
after the choice (a wrapper around the choose step, `export.resolve_checkpoint`)."""
import os
import shutil

import numpy as np
import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint import export, list_checkpoints
from tests._helpers import StopAfter, assert_same, fit, make_model, weights


@pytest.fixture
def three_checkpoints(tmp_path):
    directory = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=4, max_to_keep=3), StopAfter(12)], epochs=2)
    assert [n for n, _ in list_checkpoints(directory)] == [12, 8, 4]
    return directory


def _rotate(directory, chosen, new_number):
    """What training does to the chosen checkpoint: a newer one is recorded, then the chosen one deleted."""
    base = os.path.basename(chosen)
    for name in os.listdir(directory):
        if name.startswith(base + "."):
            shutil.copy(os.path.join(directory, name),
                        os.path.join(directory, name.replace(base, f"ckpt-{new_number}", 1)))
    kept = [n for n, _ in sorted(list_checkpoints(directory)) if f"ckpt-{n}" != base] + [new_number]
    with open(os.path.join(directory, "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "ckpt-{kept[-1]}"\n'
                + "".join(f'all_model_checkpoint_paths: "ckpt-{n}"\n' for n in kept))
    for name in os.listdir(directory):
        if name.startswith(base + "."):
            os.remove(os.path.join(directory, name))


def test_the_newest_checkpoint_rotated_away_after_the_choice_loads_the_new_newest(three_checkpoints, monkeypatch):
    directory = three_checkpoints
    expected = make_model()
    ks.load_checkpoint(expected, os.path.join(directory, "ckpt-12"))
    choose, chosen = export.resolve_checkpoint, []

    def choose_then_rotate(path, step=None):
        prefix = choose(path, step)
        chosen.append(os.path.basename(prefix))
        if len(chosen) == 1:
            _rotate(directory, prefix, 16)  # ckpt-16 holds ckpt-12's state
        return prefix

    monkeypatch.setattr(export, "resolve_checkpoint", choose_then_rotate)
    model = make_model()
    prefix = ks.load_checkpoint(model, directory)
    assert chosen == ["ckpt-12", "ckpt-16"] and os.path.basename(prefix) == "ckpt-16"
    assert_same(weights(model), weights(expected))


def test_when_every_choice_is_rotated_away_the_error_names_the_directory_and_the_model_is_untouched(
        three_checkpoints, monkeypatch):
    directory = three_checkpoints
    choose, chosen = export.resolve_checkpoint, []

    def choose_then_rotate(path, step=None):
        prefix = choose(path, step)
        chosen.append(os.path.basename(prefix))
        _rotate(directory, prefix, 100 + len(chosen))
        return prefix

    monkeypatch.setattr(export, "resolve_checkpoint", choose_then_rotate)
    model = make_model()
    before = weights(model)
    with pytest.raises(FileNotFoundError, match=r"load_checkpoint: .*ckpt'.*deleted before it could be read, 5 times"):
        ks.load_checkpoint(model, directory)
    assert len(chosen) == 5
    assert all(np.array_equal(a, b) for a, b in zip(weights(model), before))


def test_a_checkpoint_prefix_that_is_gone_is_not_retried(three_checkpoints):
    directory = three_checkpoints
    for name in os.listdir(directory):
        if name.startswith("ckpt-12."):
            os.remove(os.path.join(directory, name))
    with pytest.raises(FileNotFoundError, match="ckpt-12"):
        ks.load_checkpoint(make_model(), os.path.join(directory, "ckpt-12"))


@pytest.mark.parametrize("content", [
    'model_checkpoint_path: "ckpt-12"\nall_model_checkpoint_paths: "ckpt-8"\nall_model_checkpoint_paths: "ckpt-12"\n'
    "all_model_checkpoint_timestamps: 1.5\nall_model_checkpoint_timestamps: 2.5\nlast_preserved_timestamp: 0.5\n",
    'model_checkpoint_path: "/elsewhere/ckpt-3"\nall_model_checkpoint_paths: "/elsewhere/ckpt-3"\n',
    'model_checkpoint_path: "ckpt-12"\nall_mo',  # what TensorFlow's reader gets from a file renamed over mid-read
    "", "all_model_checkpoint_paths: \"ckpt-4\"\n", None])
def test_the_state_file_is_read_in_one_piece_as_tensorflow_parses_it(tmp_path, content):
    """The package reads the state file through one open file (TensorFlow's reader takes the size, then opens the
    file by name again, and tears when training renames a new one over it in between: "Checkpoint ignored" beside a
    running training). What it reads is what `tf.train.get_checkpoint_state` parses from an untorn file."""
    import tensorflow as tf

    from keras_scale.callbacks.checkpoint.directory import _checkpoint_state

    if content is not None:
        with open(tmp_path / "checkpoint", "w") as f:
            f.write(content)
    try:
        theirs = tf.train.get_checkpoint_state(str(tmp_path))
    except ValueError:  # no model_checkpoint_path: unusable, as a file that does not parse
        theirs = None
    ours = _checkpoint_state(str(tmp_path))
    assert (ours is None) == (theirs is None)
    if theirs is not None:
        assert ours.SerializeToString() == theirs.SerializeToString()
