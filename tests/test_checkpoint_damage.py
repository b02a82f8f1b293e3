"""ChiefCheckpoint and the checkpoint tools on a damaged directory, as a user meets it: a garbled state file moved
aside (its checkpoints still found and rotated), a truncated data file read as corrupt, a lock naming pid 0 or -1
taken as stale, and ``keras-scale checkpoint ls`` given a file or a prefix instead of the directory."""
import os
import warnings

import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint import list_checkpoints, read_checkpoint
from keras_scale.callbacks.checkpoint.format import CorruptCheckpointError
from tests._helpers import StopAfter, fit, make_model


def test_a_garbled_state_file_is_moved_aside_said_and_its_checkpoints_still_rotate(tmp_path):
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=2, max_to_keep=2, verbose=0), StopAfter(6)], epochs=1)
    with open(os.path.join(d, "checkpoint"), "w") as f:  # not parseable: TensorFlow logs it and ignores the file
        f.write("garbage{{\n")
    ckpt = ks.ChiefCheckpoint(d, save_freq=2, max_to_keep=2, verbose=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(make_model(), [ckpt, StopAfter(10)], epochs=1)
    assert ckpt.restored_from.endswith("ckpt-6")
    assert any("checkpoint.invalid" in str(w.message) for w in record), [str(w.message) for w in record]
    assert os.path.exists(os.path.join(d, "checkpoint.invalid"))
    # max_to_keep=2 holds: the checkpoints found by scanning are rotated out, not kept forever
    indexes = sorted(n for n in os.listdir(d) if n.endswith(".index"))
    assert indexes == ["ckpt-10.index", "ckpt-8.index"], indexes
    assert [n for n, _ in list_checkpoints(d)] == [10, 8]


def test_a_truncated_data_file_reads_as_corrupt(tmp_path):
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=2, verbose=0), StopAfter(2)], epochs=1)
    prefix = list_checkpoints(d)[0][1]
    data = prefix + ".data-00000-of-00001"
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with pytest.raises(CorruptCheckpointError, match="ckpt-2"):
        reader = read_checkpoint(prefix)
        for key in reader.get_variable_to_shape_map():
            reader.get_tensor(key)


def test_checkpoint_ls_of_a_file_or_a_prefix_says_it_wants_the_directory(tmp_path):
    from keras_scale_cli import main

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "ckpt-3.index").write_bytes(b"")
    for path in (str(d / "ckpt-3"), str(d / "ckpt-3.index")):  # a prefix, a file: not "0 checkpoint(s)", rc 0
        assert main(["checkpoint", "ls", path]) == 2, path


@pytest.mark.parametrize("pid", [0, -1])
def test_a_lock_naming_pid_zero_or_negative_is_stale_not_in_use_forever(tmp_path, pid):
    import json

    from keras_scale.callbacks.checkpoint.lock import process_identity

    d = tmp_path / "ckpt"
    d.mkdir()
    # os.kill(0 or -1, 0) succeeds (it probes a process group), so such a lock looked held by a live process forever
    (d / ".keras_scale.lock").write_text(json.dumps(dict(process_identity(), pid=pid, start=None)))
    with pytest.warns(RuntimeWarning, match="stale lock"):
        fit(make_model(), [ks.ChiefCheckpoint(str(d), save_freq=2, verbose=0), StopAfter(2)], epochs=1)
    assert [n for n, _ in list_checkpoints(str(d))] == [2]
