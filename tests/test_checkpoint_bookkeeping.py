"""The checkpoint directory's bookkeeping files under kills, damage and odd paths: best/best.json (keep_best_k), the
`checkpoint` state file (stale, missing), a rotation cut short, pattern characters in the path, and what
`keras-scale checkpoint ls` reports. Kills are real SIGKILLs at a chosen point of a training subprocess."""
import contextlib
import io as _stdio
import json
import os
import signal
import subprocess
import sys
import warnings

import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint import format as ckpt_io
from keras_scale.callbacks.checkpoint import list_checkpoints
from keras_scale.callbacks.checkpoint.export import describe_directory
from tests._helpers import REPO_ROOT, StopAfter, assert_same, fit, make_model, subprocess_env, weights

# Killed at a chosen point: the script patches the function that runs there to SIGKILL its own process.
KILL_SCRIPT = r"""
import os, signal, sys
import keras
from tests._helpers import fit, make_model
import keras_scale as ks
from keras_scale.callbacks.checkpoint import best as ckpt_best, format as ckpt_io
from keras_scale.callbacks.checkpoint.callback import ChiefCheckpoint

directory, point, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
calls = {"n": 0}


def die_on(n):
    calls["n"] += 1
    if calls["n"] == n:
        print("KILLING", point, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


if point == "before_keep_best":       # the epoch-end checkpoint is recorded; keep_best_k has not looked at it yet
    original = ChiefCheckpoint._keep_best
    def keep_best(self, *a):
        die_on(2)
        return original(self, *a)
    ChiefCheckpoint._keep_best = keep_best
elif point == "before_best_json":     # linked into best/, best.json not yet rewritten
    original_write = ckpt_best.write_atomic
    def write(path, data):
        if path.endswith("best.json"):
            die_on(2)
        return original_write(path, data)
    ckpt_best.write_atomic = write
elif point == "before_delete":        # the state file no longer names the retired checkpoint; its files not deleted
    original_delete = ckpt_io.delete_checkpoint
    def delete(prefix):
        die_on(1)
        return original_delete(prefix)
    ckpt_io.delete_checkpoint = delete

ckpt = ks.ChiefCheckpoint(directory, save_freq=int(sys.argv[4]), max_to_keep=2, keep_best_k=1, monitor="loss",
                          mode="min")  # (the loss falls every epoch: each epoch end is the new best)
fit(make_model(), [ckpt], epochs=epochs)
print("DONE", flush=True)
"""


def _killed_run(tmp_path, point, epochs=3, save_freq=10):
    script = tmp_path / "train.py"
    script.write_text(KILL_SCRIPT)
    directory = str(tmp_path / "ckpt")
    out = subprocess.run([sys.executable, str(script), directory, point, str(epochs), str(save_freq)],
                         capture_output=True, text=True, env=subprocess_env(), cwd=REPO_ROOT, timeout=300)
    assert out.returncode == -signal.SIGKILL and "KILLING" in out.stdout, (out.returncode, out.stdout, out.stderr)
    return directory


def _loss_of(prefix):
    reader = ckpt_io.read_checkpoint(prefix)
    raw = reader.get_tensor("keras_scale_epoch_logs/.ATTRIBUTES/VARIABLE_VALUE")
    return json.loads(raw.decode())["logs"]["loss"]


# ------------------------------------------------------------------------------------------------ keep_best_k
@pytest.mark.slow
@pytest.mark.parametrize("point", ["before_keep_best", "before_best_json"])
def test_a_kill_between_an_epoch_end_save_and_best_json_keeps_that_epochs_ranking(tmp_path, point):
    """keep_best_k=1 by the falling loss: epoch 2's checkpoint (ckpt-20) is recorded, then the process is killed
    before keep_best_k copied it into best/, or after that and before best.json said so. The rerun (the run is
    complete: nothing trained) has ckpt-20 as the best, its files in best/, ranked in best.json."""
    directory = _killed_run(tmp_path, point, epochs=3)
    assert os.path.basename(list_checkpoints(directory)[0][1]) == "ckpt-20"  # recorded before the kill
    ckpt = ks.ChiefCheckpoint(directory, save_freq=10, max_to_keep=2, keep_best_k=1, monitor="loss", mode="min")
    with pytest.warns(RuntimeWarning, match="ckpt-20"):
        fit(make_model(), [ckpt], epochs=2)
    (value, prefix), = ckpt.best_checkpoints
    assert prefix == os.path.join(directory, "best", "ckpt-20") and value == pytest.approx(_loss_of(prefix))
    assert os.path.exists(prefix + ".index") and os.path.exists(prefix + ckpt_io.DATA_SUFFIX)
    with open(os.path.join(directory, "best", "best.json")) as f:
        assert [e["number"] for e in json.load(f)] == [20]
    assert not os.path.exists(os.path.join(directory, "best", "ckpt-10.index"))  # ranked out, as k=1 says


def _best_run(tmp_path, epochs=1, mode="max", k=1):
    directory = str(tmp_path / "ckpt")
    ckpt = ks.ChiefCheckpoint(directory, max_to_keep=1, keep_best_k=k, monitor="loss", mode=mode)
    fit(make_model(), [ckpt], epochs=epochs)
    return directory, ckpt


def _write(path, content):
    with open(path, "wb" if isinstance(content, bytes) else "w") as f:
        f.write(content)


@pytest.mark.parametrize("content", ['[{"number": 10, "value": 0.', '{"number": 10, "value": 1.0}',
                                     '[{"number": 10, "epoch": 0}]', '[{"number": 10, "value": null}]', '',
                                     b'\x9f\xff[{"value":'])
def test_a_damaged_best_json_is_named_rebuilt_and_never_costs_the_better_checkpoint(tmp_path, content):
    """Truncated, a dict, an entry without a value, a null value, empty, bytes that are not UTF-8: fit warns naming
    the file, ranks the checkpoints in best/ by the value each records, and keeps the better one through later
    starts; `ls` works."""
    directory, _ = _best_run(tmp_path, epochs=1)  # mode="max": epoch 1 (ckpt-10) is better than any later one
    best_json = os.path.join(directory, "best", "best.json")
    _write(best_json, content)
    for epochs in (2, 3):  # two more starts: the second is where a forgotten checkpoint used to be deleted
        ckpt = ks.ChiefCheckpoint(directory, max_to_keep=1, keep_best_k=1, monitor="loss", mode="max")
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            fit(make_model(), [ckpt], epochs=epochs)
        named = [str(w.message) for w in record if best_json in str(w.message)]
        assert bool(named) == (epochs == 2), [str(w.message) for w in record]  # said once; repaired by then
        (value, prefix), = ckpt.best_checkpoints
        assert os.path.basename(prefix) == "ckpt-10" and os.path.exists(prefix + ".index")
        assert value == pytest.approx(_loss_of(prefix))
    with open(best_json) as f:
        assert [e["number"] for e in json.load(f)] == [10]
    info = describe_directory(directory)
    assert [e["number"] for e in info["best"]] == [10]


@pytest.mark.parametrize("content", ['{"a": 1}', '[{"number": 10}]', '[{"number": 10, "value": null}]', '[1',
                                     b'\x9f\xff[{"value":'])
def test_ls_reports_a_damaged_best_json_instead_of_crashing(tmp_path, content):
    directory, _ = _best_run(tmp_path, epochs=1)
    _write(os.path.join(directory, "best", "best.json"), content)
    out = _ls(directory)
    assert "best.json" in out and "damaged" in out and "ckpt-10" in out, out


def test_ls_checks_best_as_fit_does(tmp_path):
    """best.json listing a checkpoint whose files are not in best/: `ls` names the problem and does not show it as
    kept (fit drops it from the ranking); an entry without monitor or epoch shows neither as 'None' nor made up."""
    directory, _ = _best_run(tmp_path, epochs=1)
    _write(os.path.join(directory, "best", "best.json"), json.dumps(
        [{"number": 12345, "value": -5.0, "epoch": 1, "monitor": "loss"}, {"number": 10, "value": -100.0}]))
    out = _ls(directory)
    assert "best: ckpt-12345" not in out and "problem:" in out and "ckpt-12345" in out, out
    line, = [x for x in out.splitlines() if "best: ckpt-10" in x]
    assert "None" not in line and "(epoch" not in line and "=-100" in line, line
    ckpt = ks.ChiefCheckpoint(directory, max_to_keep=1, keep_best_k=1, monitor="loss", mode="max")
    with pytest.warns(RuntimeWarning, match="ckpt-12345"):
        fit(make_model(), [ckpt], epochs=1)
    assert [os.path.basename(p) for _, p in ckpt.best_checkpoints] == ["ckpt-10"]


def test_a_changed_monitor_ranks_the_kept_checkpoints_again_by_the_new_one(tmp_path):
    """keep_best_k by "loss", continued by "mae": the kept checkpoints are ranked by the mae each recorded for its
    epoch (a warning names them), never compared across monitors; best.json holds one monitor."""
    directory, _ = _best_run(tmp_path, epochs=2, k=2)
    ckpt = ks.ChiefCheckpoint(directory, max_to_keep=1, keep_best_k=2, monitor="mae", mode="max")
    with pytest.warns(RuntimeWarning, match="another monitor.*ckpt-10.*mae"):
        fit(make_model(), [ckpt], epochs=3)
    with open(os.path.join(directory, "best", "best.json")) as f:
        entries = json.load(f)
    assert {e["monitor"] for e in entries} == {"mae"}, entries
    maes = {}
    for prefix in (os.path.join(directory, "best", f"ckpt-{n}") for n in (10, 20)):
        raw = ckpt_io.read_checkpoint(prefix).get_tensor("keras_scale_epoch_logs/.ATTRIBUTES/VARIABLE_VALUE")
        maes[prefix] = json.loads(raw.decode())["logs"]["mae"]
    for value, prefix in ckpt.best_checkpoints:
        if prefix in maes:
            assert value == pytest.approx(maes[prefix])
    assert [v for v, _ in ckpt.best_checkpoints] == sorted((v for v, _ in ckpt.best_checkpoints), reverse=True)


def test_a_checkpoint_in_best_that_cannot_be_ranked_is_kept_and_named(tmp_path):
    directory, _ = _best_run(tmp_path, epochs=1)
    best_dir = os.path.join(directory, "best")
    os.remove(os.path.join(best_dir, "best.json"))
    index = os.path.join(best_dir, "ckpt-10.index")
    os.remove(index)  # (a hard link to the directory's own ckpt-10: that one stays intact)
    with open(index, "wb") as f:
        f.write(b"\xff" * 64)  # its value cannot be read any more
    ckpt = ks.ChiefCheckpoint(directory, max_to_keep=1, keep_best_k=1, monitor="loss", mode="max")
    with pytest.warns(RuntimeWarning, match="ckpt-10.*kept"):
        fit(make_model(), [ckpt], epochs=2)
    assert os.path.exists(os.path.join(best_dir, "ckpt-10.index"))  # never deleted unranked
    assert [os.path.basename(p) for _, p in ckpt.best_checkpoints] == ["ckpt-20"]


# ------------------------------------------------------------------------------------------------ state file
def _three_checkpoints(tmp_path):
    directory = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=4, max_to_keep=3), StopAfter(12)], epochs=2)
    assert [n for n, _ in list_checkpoints(directory)] == [12, 8, 4]
    return directory


def test_a_stale_state_file_never_deletes_newer_valid_checkpoints(tmp_path):
    """The state file put back from an older copy names only ckpt-4: the complete ckpt-8 and ckpt-12 are adopted
    (a warning names them) and the run resumes from ckpt-12, as if the state file were current."""
    directory = _three_checkpoints(tmp_path)
    reference = make_model()
    fit(reference, [ks.ChiefCheckpoint(str(tmp_path / "ref"), save_freq=4, max_to_keep=3)], epochs=2)
    with open(os.path.join(directory, "checkpoint"), "w") as f:
        f.write('model_checkpoint_path: "ckpt-4"\nall_model_checkpoint_paths: "ckpt-4"\n')
    model = make_model()
    ckpt = ks.ChiefCheckpoint(directory, save_freq=4, max_to_keep=3)
    with pytest.warns(RuntimeWarning, match=r"ckpt-8, ckpt-12 are newer.*adopted"):
        fit(model, [ckpt, StopAfter(13)], epochs=2)
    assert os.path.basename(ckpt.restored_from) == "ckpt-12"
    assert os.path.exists(os.path.join(directory, "ckpt-12.index"))
    fit(model, [ks.ChiefCheckpoint(directory, save_freq=4, max_to_keep=3)], epochs=2)
    assert_same(weights(model), weights(reference))


def test_a_missing_state_file_is_reported_and_rewritten(tmp_path):
    directory = _three_checkpoints(tmp_path)
    os.remove(os.path.join(directory, "checkpoint"))
    ckpt = ks.ChiefCheckpoint(directory, save_freq=4, max_to_keep=3)
    with pytest.warns(RuntimeWarning, match="state file .* is missing; found 3 checkpoint"):
        fit(make_model(), [ckpt, StopAfter(13)], epochs=2)
    assert os.path.basename(ckpt.restored_from) == "ckpt-12"
    with open(os.path.join(directory, "checkpoint")) as f:
        assert "ckpt-12" in f.read()


def test_a_changed_monitor_the_kept_checkpoints_never_recorded_removes_them_and_names_them(tmp_path):
    """keep_best_k by "loss" of a model without metrics, continued by "mae": the kept ones record no mae, so they
    are removed from best/ with a warning naming them, and best/ then holds the new monitor's best only."""
    directory = str(tmp_path / "ckpt")
    fit(make_model(metrics=[]), [ks.ChiefCheckpoint(directory, max_to_keep=1, keep_best_k=2, monitor="loss",
                                                    mode="max")], epochs=2)
    ckpt = ks.ChiefCheckpoint(directory, max_to_keep=1, keep_best_k=2, monitor="mae", mode="max")
    with pytest.warns(RuntimeWarning, match=r"ckpt-10, ckpt-20 in best/ were ranked by another monitor.*removed"):
        fit(make_model(), [ckpt], epochs=4)
    with open(os.path.join(directory, "best", "best.json")) as f:
        entries = json.load(f)
    assert {e["monitor"] for e in entries} == {"mae"} and {e["number"] for e in entries} <= {30, 40}, entries
    assert not os.path.exists(os.path.join(directory, "best", "ckpt-10.index"))


def test_a_directory_in_place_of_the_state_file_is_moved_aside_and_the_run_resumes(tmp_path):
    """`ls` says so, truthfully and without TensorFlow's warnings; fit moves it aside (nothing in it deleted),
    finds the checkpoints by scanning, resumes from the newest and writes a state file again."""
    import logging

    directory = _three_checkpoints(tmp_path)
    state_file = os.path.join(directory, "checkpoint")
    os.remove(state_file)
    os.makedirs(os.path.join(state_file, "inside"))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("tensorflow").addHandler(handler)
    try:
        out = _ls(directory)
    finally:
        logging.getLogger("tensorflow").removeHandler(handler)
    assert "is a directory" in out and "ckpt-12" in out, out
    assert not [r.getMessage() for r in records if "checkpoint" in r.getMessage()], [r.getMessage() for r in records]
    ckpt = ks.ChiefCheckpoint(directory, save_freq=4, max_to_keep=3)
    with pytest.warns(RuntimeWarning, match="is a directory.*this start moves it aside to 'checkpoint.invalid'"):
        fit(make_model(), [ckpt, StopAfter(13)], epochs=2)
    assert os.path.basename(ckpt.restored_from) == "ckpt-12"
    assert os.path.isdir(os.path.join(state_file + ".invalid", "inside"))
    with open(state_file) as f:
        assert "ckpt-12" in f.read()
    assert "is a directory" not in _ls(directory)
    os.remove(state_file)
    os.makedirs(state_file)  # again: the first one moved aside is kept, this one goes next to it
    with pytest.warns(RuntimeWarning, match=r"moved aside to .*checkpoint\.invalid\.1"):
        fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=4, max_to_keep=3), StopAfter(14)], epochs=2)
    assert os.path.isdir(os.path.join(state_file + ".invalid", "inside")) and os.path.isdir(state_file + ".invalid.1")
    assert os.path.isfile(state_file)
    _write(state_file, "garbage that is not a state file")  # its copy goes next to the directories moved aside
    fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=4, max_to_keep=3), StopAfter(15)], epochs=2)
    with open(state_file + ".invalid.2") as f:
        assert f.read() == "garbage that is not a state file"


def test_ls_reports_a_missing_state_file(tmp_path):
    directory = _three_checkpoints(tmp_path)
    os.remove(os.path.join(directory, "checkpoint"))
    assert "state file" in _ls(directory) and "missing" in _ls(directory)


# ------------------------------------------------------------------------------------------------ rotation
@pytest.mark.slow
def test_a_kill_between_the_state_file_and_the_deletion_leaves_nothing_behind(tmp_path):
    """max_to_keep=2: the third save retires ckpt-10; killed after the state file stopped naming it and before its
    files were deleted. `ls` shows it as left over, and the next start deletes it."""
    directory = _killed_run(tmp_path, "before_delete", epochs=3)
    assert os.path.exists(os.path.join(directory, "ckpt-10.index"))  # complete, no longer in the state file
    assert "ckpt-10" not in open(os.path.join(directory, "checkpoint")).read()
    out = _ls(directory)
    assert "ckpt-10" in out, out
    fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=10, max_to_keep=2, keep_best_k=1, monitor="loss",
                                          mode="max")], epochs=3)
    names = set(os.listdir(directory))
    assert not any(n.startswith("ckpt-10.") for n in names), sorted(names)
    assert not any("retiring" in n for n in names), sorted(names)


# ------------------------------------------------------------------------------------------------ odd paths
@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("name", ["exp[1]", "a*b?c", "back\\slash"])
def test_pattern_characters_in_the_path_are_plain_characters(tmp_path, name, async_save):
    """A `[`, `*`, `?` or `\\` in the directory: retired checkpoints are deleted (none leaks), the rerun resumes
    exactly, `ls` and ks.load_checkpoint read it."""
    directory = str(tmp_path / name / "ckpt")
    reference = make_model()
    fit(reference, [], epochs=3)
    model = make_model()
    fit(model, [ks.ChiefCheckpoint(directory, save_freq=3, max_to_keep=2, async_save=async_save), StopAfter(16)])
    files = sorted(n for n in os.listdir(directory) if n.startswith("ckpt-"))
    assert files == ["ckpt-15.data-00000-of-00001", "ckpt-15.index", "ckpt-16.data-00000-of-00001",
                     "ckpt-16.index"], files  # (the stop at 16 is saved too)
    model = make_model()
    ckpt = ks.ChiefCheckpoint(directory, save_freq=3, max_to_keep=2, async_save=async_save)
    fit(model, [ckpt])
    assert ckpt.restored_from == os.path.join(directory, "ckpt-16")
    assert_same(weights(model), weights(reference))
    assert "the completed run's final state" in _ls(directory)  # (the rerun completed the run)
    ks.load_checkpoint(make_model(), directory)


# ------------------------------------------------------------------------------------------------ ls
def _ls(directory):
    from keras_scale.cli import main

    buffer = _stdio.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["checkpoint", "ls", directory]) == 0
    return buffer.getvalue()


def test_ls_marks_where_a_resume_starts_as_fit_finds_it(tmp_path):
    """A newest checkpoint with a flipped byte in its data (CRC): fit skips it, and so does `ls`."""
    directory = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(directory, save_freq=5, max_to_keep=2), StopAfter(10)])
    data = os.path.join(directory, "ckpt-10" + ckpt_io.DATA_SUFFIX)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = _ls(directory)
    line_10 = next(l for l in out.splitlines() if l.strip().startswith("ckpt-10 "))
    line_5 = next(l for l in out.splitlines() if l.strip().startswith("ckpt-5 "))
    assert "resumed fit starts here" not in line_10, out
    assert "resumed fit starts here" in line_5, out
    assert any("ckpt-10" in l and "a resumed fit skips it" in l for l in out.splitlines() if "problem:" in l), out
    ckpt = ks.ChiefCheckpoint(directory, save_freq=5, max_to_keep=2)
    with pytest.warns(RuntimeWarning, match="could not be loaded"):
        fit(make_model(), [ckpt, StopAfter(11)])
    assert ckpt.restored_from == os.path.join(directory, "ckpt-5")


# ------------------------------------------------------------------------------------------------ TensorFlow's reader
def test_the_documented_tf_train_checkpoint_structure_reads_everything_and_the_keras_graph_fails_loudly(tmp_path):
    """docs/checkpoint.md: tf.train.Checkpoint(model_variables=..., optimizer_variables=...).read restores every
    weight and the optimizer (TensorFlow's own reader and assertion); the Keras object graph matches nothing and
    assert_existing_objects_matched says so."""
    import tensorflow as tf

    directory = str(tmp_path / "ckpt")
    trained = make_model()
    fit(trained, [ks.ChiefCheckpoint(directory, save_freq=5), StopAfter(15)], epochs=2)
    fresh = make_model(width=8)
    fresh.optimizer.build(fresh.trainable_variables)
    status = tf.train.Checkpoint(model_variables=[v.value for v in fresh.variables],
                                 optimizer_variables=[v.value for v in fresh.optimizer.variables],
                                 ).read(tf.train.latest_checkpoint(directory))
    status.expect_partial().assert_existing_objects_matched()
    assert_same(weights(fresh), weights(trained))
    assert int(fresh.optimizer.iterations.numpy()) == 15
    other = make_model()
    other.optimizer.build(other.trainable_variables)
    with pytest.raises(AssertionError):
        tf.train.Checkpoint(model=other, optimizer=other.optimizer).read(
            tf.train.latest_checkpoint(directory)).assert_existing_objects_matched()
