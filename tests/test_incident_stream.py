"""The incident stream (keras_scale.events) as the dashboard reads it: a record without ``log_dir`` (ChiefCheckpoint's
saves and resumes) lands in the run of the fit it happens in, whatever the order of the callbacks, and never in the
run of an earlier fit that raised; records made after the writer closed still arrive; the dashboard finds the
checkpoints of a moved log directory, shows the good records of a damaged stream, and places a resume after NaN
skips in optimizer updates."""
import json
import os
import time

import keras
import numpy as np
import pytest

import keras_scale as ks
from keras_scale import events


def _model() -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")


def _kinds(run):
    return [(e["kind"], e["step"]) for e in events.read(run)]


class _RaiseAtBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 5:
            raise RuntimeError("a user's callback fails mid-epoch")


@pytest.mark.parametrize("same_model", [False, True], ids=["new_model", "same_model"])
def test_a_fit_that_raised_leaves_no_stream_open_for_the_next_fit(tmp_path, same_model):
    x, y = _data()
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    model = _model()
    with pytest.raises(RuntimeError):  # on_train_end never runs: the callbacks' streams are not closed
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
            ks.NanGuard(log_dir=old), ks.Goodput(log_dir=old, verbose=0), ks.HostMemoryWatch(log_dir=old),
            ks.ChiefCheckpoint(str(tmp_path / "old_ckpt"), save_freq=4), _RaiseAtBatch()])
    before = _kinds(old)
    assert before == [("checkpoint", 4)]
    second = model if same_model else _model()
    second.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
        ks.Goodput(log_dir=new, verbose=0), ks.ChiefCheckpoint(str(tmp_path / "new_ckpt"), save_freq=4)])
    assert _kinds(old) == before  # nothing of the second fit in the first run's dashboard
    saves = [e for e in events.read(new) if e["kind"] == "checkpoint"]
    assert [e["step"] for e in saves] == [4, 8]
    assert all(e["directory"] == str(tmp_path / "new_ckpt") for e in saves)


def test_a_fit_with_no_stream_of_its_own_writes_into_no_earlier_run(tmp_path):
    x, y = _data()
    old = str(tmp_path / "old")
    with pytest.raises(RuntimeError):
        _model().fit(x, y, batch_size=8, epochs=1, verbose=0,
                     callbacks=[ks.Goodput(log_dir=old, verbose=0), _RaiseAtBatch()])
    _model().fit(x, y, batch_size=8, epochs=1, verbose=0,
                 callbacks=[ks.ChiefCheckpoint(str(tmp_path / "ckpt"), save_freq=4)])
    assert _kinds(old) == []


@pytest.mark.parametrize("checkpoint_first", [True, False], ids=["checkpoint_first", "checkpoint_last"])
def test_the_resume_is_on_the_dashboard_whatever_the_callback_order(tmp_path, checkpoint_first):
    x, y = _data()
    run, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    for epochs in (1, 2):  # the second fit resumes from the first one's checkpoint
        others = [ks.NanGuard(log_dir=run), ks.Goodput(log_dir=run, verbose=0)]
        checkpoint = ks.ChiefCheckpoint(ckpt, save_freq=4)
        _model().fit(x, y, batch_size=8, epochs=epochs, verbose=0,
                     callbacks=[checkpoint] + others if checkpoint_first else others + [checkpoint])
    resumes = [e for e in events.read(run) if e["kind"] == "resume"]
    assert [(e["step"], e["epoch"], os.path.basename(e["path"])) for e in resumes] == [(8, 1, "ckpt-8")]
    with open(events.stream_path(run)) as f:
        assert all(json.loads(line) for line in f)  # one whole record per line


@pytest.mark.parametrize("goodput_first", [True, False], ids=["goodput_first", "goodput_last"])
def test_records_made_at_train_end_after_the_writer_closed_still_reach_the_run(tmp_path, goodput_first):
    # Goodput (no log_dir of its own) records fit_end in its on_train_end; listed after NanGuard, whose
    # on_train_end closes the run's stream first, that record once waited for a stream forever
    x, y = _data()
    run = str(tmp_path / "run")
    callbacks = [ks.Goodput(verbose=0), ks.NanGuard(log_dir=run)]
    _model().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks if goodput_first else callbacks[::-1])
    assert [kind for kind, _ in _kinds(run)] == ["epoch", "fit_end"]
    other = str(tmp_path / "other")  # and the next fit's records go to its own run only
    _model().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[ks.NanGuard(log_dir=other), ks.Goodput(verbose=0)])
    assert [kind for kind, _ in _kinds(run)] == ["epoch", "fit_end"]
    assert [kind for kind, _ in _kinds(other)] == ["epoch", "fit_end"]


def test_records_outside_a_fit_still_follow_attach_and_detach(tmp_path):
    run = str(tmp_path / "r")
    events.record("nan", 1)  # nothing open, outside a fit: nothing kept for later
    events.attach(run)
    try:
        events.record("checkpoint", 4, path="x")
    finally:
        events.detach(run)
    assert _kinds(run) == [("checkpoint", 4)]


def test_checkpoints_are_found_after_the_log_directory_is_moved(tmp_path):
    from keras_scale.tensorboard_plugin import data

    x, y = _data()
    run = str(tmp_path / "cluster" / "exp")
    _model().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
        ks.Goodput(log_dir=run, verbose=0), ks.ChiefCheckpoint(os.path.join(run, "ckpt"), save_freq=4,
                                                               max_to_keep=1)])
    moved = str(tmp_path / "laptop" / "exp")
    os.makedirs(os.path.dirname(moved))
    os.rename(run, moved)  # copied off the cluster: the stream still holds the old absolute paths
    saves = data.run_detail("exp", moved)["checkpoints"]
    assert [(s["step"], s["on_disk"]) for s in saves["saves"]] == [(4, False), (8, True)]  # max_to_keep=1
    assert saves["newest_usable"] == os.path.join(moved, "ckpt", "ckpt-8")


def test_a_damaged_stream_still_shows_its_good_records(tmp_path):
    """Junk bytes (a crash on some file systems), records of the wrong shape: skipped, never a failed page."""
    from keras_scale.tensorboard_plugin import data

    run = str(tmp_path)
    events.record("epoch", 8, log_dir=run, epoch=0, goodput={"wall_s": 10.0, "productive_s": 8.0, "other_s": 2.0})
    with open(events.stream_path(run), "ab") as f:
        f.write(b'\x00\x00\xff\xfe junk\n[1, 2]\n{"kind": 7}\n{"kind": "nan", "step": "x", "time": "abc"}\n'
                b'{"kind": "epoch", "step": 9, "goodput": "n/a"}\n{"kind": "checkpoint", "step": 9, "path": 123}\n'
                b'{"kind": "fit_end", "step": 9, "pid": %d, "time": %f, "goodput": {"wall_s": "abc", "productive_s": 1.0}}\n'
                % (os.getpid(), time.time()))
    events.record("nan", 5, log_dir=run, source="loss")
    assert [e["kind"] for e in events.read(run)][0] == "epoch"
    page = data.run_detail("r", run)
    json.dumps(page, allow_nan=False)
    # (the skip at update 5 is batch 6 on the dashboard's batch axis)
    assert [(e["kind"], e["step"]) for e in page["incidents"]] == [("nan", None), ("nan", 6)]
    assert [e["epoch"] for e in page["epochs"]] == [0]
    assert page["summary"]["totals"]["productive_s"] == 1.0  # the fit's summary, its damaged wall time dropped


def test_a_resume_after_nan_skips_is_placed_and_counted_in_batches(tmp_path):
    """The stream of a real kill (quickstart: a NaN skip per epoch, 32 batches per epoch, killed after epoch 3's
    end before the save at global batch 96, resumed from ckpt-80): 16 batches are trained again."""
    from keras_scale.tensorboard_plugin import data

    run, t = str(tmp_path), [1000.0]

    def line(kind, step, pid, **fields):
        t[0] += 1
        return json.dumps(dict(kind=kind, step=step, pid=pid, time=t[0], **fields)) + "\n"

    lines = []
    for epoch, nan_update in enumerate((5, 36, 67)):  # killed process: each epoch's poisoned batch is skipped
        lines.append(line("nan", nan_update, 1, epoch=epoch, bad_steps=1, source="inputs"))
        lines += [line("checkpoint", 32 * epoch + 16, 1, epoch=epoch, step_in_epoch=16),
                  line("epoch", 31 * (epoch + 1), 1, epoch=epoch)]
    lines.append(line("resume", 80, 2, path=os.path.join(run, "ckpt-80"), epoch=2, step_in_epoch=16))
    os.makedirs(os.path.dirname(events.stream_path(run)))
    with open(events.stream_path(run), "w") as f:
        f.writelines(lines)
    page = data.run_detail("r", run)
    resume = [e for e in page["incidents"] if e["kind"] == "resume"][0]
    # on the batch axis: the killed process had reached batch 96 (update 93 plus its 3 skipped steps)
    assert (resume["step"], resume["redone_steps"]) == (80, 16)
    assert [e["step"] for e in page["incidents"] if e["kind"] == "nan"] == [6, 38, 70]  # each epoch's 6th batch
