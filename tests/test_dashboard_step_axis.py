"""The dashboard puts every marker on one step axis: batches trained (NaN-skipped steps included), the counter of
Keras's progress bar, of TensorBoard's ``batch_loss`` and of ChiefCheckpoint. NanGuard, Goodput and the other
update-counted records are converted when read, so an epoch end, its checkpoint and a NaN skip line up."""
import json
import os

from keras_scale.tensorboard_plugin import data


def _stream(run_dir, events):
    os.makedirs(os.path.join(run_dir, "keras_scale"))
    with open(os.path.join(run_dir, "keras_scale", "events.jsonl"), "w") as f:
        for i, e in enumerate(events):
            f.write(json.dumps({"time": 1000.0 + i, "pid": e.pop("pid", 1), **e}) + "\n")


def test_epoch_ends_checkpoints_and_nan_skips_share_the_batch_axis(tmp_path):
    # what the README snippet records: 20 batches an epoch, the third batch of each epoch NaN-skipped; NanGuard and
    # Goodput count optimizer updates (one fewer per skip), ChiefCheckpoint counts batches
    _stream(str(tmp_path), [
        {"kind": "nan", "step": 2, "epoch": 0, "bad_steps": 1},
        {"kind": "epoch", "step": 19, "epoch": 0, "goodput": {"wall_s": 1.0, "productive_s": 1.0}, "logs": {"loss": 1.5}},
        {"kind": "checkpoint", "step": 20, "epoch": 1, "step_in_epoch": 0, "path": "ckpt/ckpt-20"},
        {"kind": "nan", "step": 21, "epoch": 1, "bad_steps": 1},
        {"kind": "epoch", "step": 38, "epoch": 1, "goodput": {"wall_s": 1.0, "productive_s": 1.0}, "logs": {"loss": 1.4}},
        {"kind": "checkpoint", "step": 40, "epoch": 2, "step_in_epoch": 0, "path": "ckpt/ckpt-40"},
        {"kind": "nan", "step": 40, "epoch": 2, "bad_steps": 1},
        {"kind": "epoch", "step": 57, "epoch": 2, "goodput": {"wall_s": 1.0, "productive_s": 1.0}, "logs": {"loss": 1.3}},
        {"kind": "checkpoint", "step": 60, "epoch": 3, "step_in_epoch": 0, "path": "ckpt/ckpt-60"},
        {"kind": "fit_end", "step": 57},
    ])
    page = data.run_detail("r", str(tmp_path))
    assert [e["step"] for e in page["epochs"]] == [20, 40, 60]
    assert [s["step"] for s in page["checkpoints"]["saves"]] == [20, 40, 60]  # each epoch end and its save: one x
    assert [p[0] for p in page["loss"]["loss (epoch mean)"]] == [20, 40, 60]
    # each skip at the batch that was skipped: the third of its epoch (never on the previous epoch's checkpoint)
    assert [(e["step"], e["updates"]) for e in page["incidents"] if e["kind"] == "nan"] == [(3, 2), (23, 21),
                                                                                          (43, 40)]
    assert page["summary"]["last_step"] == 60


def test_a_resumed_process_continues_on_the_batch_axis(tmp_path):
    # first process: skip at batch 3, saves at 10, killed at batch 14; the second resumes from the save at 10
    # (10 batches, 9 updates) and its records count updates from 9
    _stream(str(tmp_path), [
        {"kind": "nan", "step": 2, "epoch": 0, "bad_steps": 1, "pid": 1},
        {"kind": "checkpoint", "step": 10, "epoch": 0, "step_in_epoch": 10, "path": "c/ckpt-10", "pid": 1},
        {"kind": "nan", "step": 11, "epoch": 0, "bad_steps": 1, "pid": 1},
        {"kind": "resume", "step": 10, "epoch": 0, "step_in_epoch": 10, "path": "c/ckpt-10", "pid": 2},
        {"kind": "epoch", "step": 19, "epoch": 0, "goodput": {"wall_s": 1.0, "productive_s": 1.0}, "pid": 2},
    ])
    page = data.run_detail("r", str(tmp_path))
    assert [e["step"] for e in page["epochs"]] == [20]  # 10 updates after the resume: batch 20
    resume = [e for e in page["incidents"] if e["kind"] == "resume"][0]
    assert resume["step"] == 10 and resume["redone_steps"] == 3  # batches 11..13 of the killed process
