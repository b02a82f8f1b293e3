"""A save that fails stops ``fit`` with a clear error, never read as the end of the data, and the exit status says
the truth: a real per-file size limit (RLIMIT_FSIZE, what ``ulimit -f`` and schedulers set; SIGXFSZ ignored, so
the write fails with EFBIG, which TensorFlow raises as ``OutOfRangeError``, Keras's "the data ran out") set in a
training subprocess at a chosen moment: mid-training, before the last save, together with a preemption signal."""
import errno
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from keras_scale.callbacks.checkpoint import list_checkpoints
from keras_scale.callbacks.checkpoint.errors import CheckpointSaveError, errno_of, save_error
from tests._helpers import subprocess_env

SCRIPT = r"""
import os, resource, signal, sys
import numpy as np, keras
import keras_scale as ks

directory, mode, when = sys.argv[1:4]
keras.utils.set_random_seed(3)
x = np.random.RandomState(0).rand(96, 4).astype("float32")
y = x.sum(1, keepdims=True)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(512, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing the process


def limit():  # a checkpoint's data file is ~40 KB; the state file and the lock are far below the limit
    ckpt.wait()  # (an earlier background write finishes first: it is not the one this test makes fail)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.RLIM_INFINITY))


class Hostile(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        done = int(self.model.optimizer.iterations.numpy())
        print("BATCH", done, flush=True)
        if when in ("batch", "preempt") and done == 6:
            limit()
            if when == "preempt":
                os.kill(os.getpid(), signal.SIGTERM)

    def on_epoch_end(self, epoch, logs=None):
        if when == "train_end" and epoch == self.params["epochs"] - 1:
            limit()


ckpt = ks.ChiefCheckpoint(directory, save_freq="epoch" if when == "train_end" else 4, async_save=mode == "async")
try:
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[ckpt, Hostile()])
except Exception as e:  # what the caller gets: TensorFlow's error on .original (Keras's filtering drops __cause__)
    print("RAISED", type(e).__name__, "ORIGINAL", type(getattr(e, "original", None)).__name__, flush=True)
    raise
print("DONE", int(model.optimizer.iterations.numpy()), len(history.epoch), flush=True)
"""


def _run(tmp_path, directory, mode, when):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = subprocess_env()
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run([sys.executable, str(script), directory, mode, when], capture_output=True, text=True,
                          env=env, timeout=240)


def _batches(out):
    return [int(line.split()[1]) for line in out.splitlines() if line.startswith("BATCH ")]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("when", ["batch", "train_end", "preempt"])
def test_a_save_failing_with_efbig_stops_fit_and_the_exit_status_says_so(tmp_path, mode, when):
    """Mid-training (sync: the save at batch 8; async: its background write), at the last save after the last
    epoch (the final flush at train end), and the preemption save after SIGTERM: the process ends with a
    CheckpointSaveError naming EFBIG, the file and the newest usable checkpoint, no later batch is trained, the exit
    status is 1 (never 0, never 42 'state saved'), and a rerun resumes from that newest usable checkpoint and
    finishes. (Before: async exited 0 with a 3-epoch History after 16 of 36 updates, sync trained epochs 2 and 3 with 0
    batches each; a preempted async run exited 42 saying 'state saved in ckpt-N' with only ckpt-N_temp there.)"""
    d = str(tmp_path / "run 1 ü")  # a space and a non-ASCII letter in the path (a "[" is issue 38 item 8, elsewhere)
    result = _run(tmp_path, d, mode, when)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    assert "DONE" not in result.stdout
    assert "CheckpointSaveError" in out and "EFBIG" in out and "File too large" in out, out[-3000:]
    assert "RAISED CheckpointSaveError ORIGINAL OutOfRangeError" in result.stdout, result.stdout[-2000:]
    assert "Your input ran out of data" not in out  # Keras never took it for the end of the data
    assert "Exception ignored" not in out  # said by fit, not by an atexit hook after the fact
    batches = _batches(result.stdout)
    newest = list_checkpoints(d)[0]
    if when == "batch":
        # the save at batch 8 fails; sync: at once (in its batch-end hook, before the later callback prints 8);
        # async: its write's error is said by the next save, before batch 13
        assert max(batches) == (7 if mode == "sync" else 12), batches
        assert newest[0] == 4
    elif when == "train_end":
        assert max(batches) == 36 and newest[0] == 24
    else:
        # SIGTERM sent in batch 6's hooks after ChiefCheckpoint's: acted on at the next step boundary (batch 7)
        assert max(batches) == 7 and newest[0] == 4
        assert "preemption" in out and "does not exit with the preemption status 42" in out
    assert f"the newest usable checkpoint is {newest[1]!r}" in out, out[-3000:]
    rerun = _run(tmp_path, d, mode, "none")
    assert rerun.returncode == 0 and "DONE 36 " in rerun.stdout, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    # resumed there: the skipped batches report the restored count; then every later batch once
    trained = _batches(rerun.stdout)
    assert min(trained) >= newest[0] and [b for b in trained if b > newest[0]] == list(range(newest[0] + 1, 37))


def test_save_error_names_the_errno_file_and_fix_and_is_not_a_stop_or_oom():
    """The error says what failed and what to do; it is none of the types Keras or keras_scale read as "the data
    ran out" (OutOfRangeError, StopIteration) or "out of memory" (ResourceExhaustedError, ENOSPC's type in TF)."""
    tf_error = tf.errors.OutOfRangeError(None, None, "{{function_node x}} /d d/ck [1]/ckpt-8.data-00000-of-00001"
                                         ".tempstate1; File too large [Op:SaveV2]")
    assert errno_of(tf_error) == errno.EFBIG
    err = save_error(tf_error, "saving '/d d/ck [1]/ckpt-8'", "/d d/ck [1]/ckpt-4", 4, "/d d/ck [1]/ckpt-8",
                     "/d d/ck [1]")
    assert isinstance(err, CheckpointSaveError)
    assert err.original is tf_error  # what TensorFlow raised, kept where the caller finds it
    assert not isinstance(err, (tf.errors.OpError, StopIteration))
    assert err.errno == errno.EFBIG and err.errno_name == "EFBIG"
    assert err.filename == "/d d/ck [1]/ckpt-8.data-00000-of-00001.tempstate1"
    assert "ulimit -f" in str(err) and "'/d d/ck [1]/ckpt-4' (global batch 4)" in str(err)
    full = save_error(tf.errors.ResourceExhaustedError(None, None, "/x/ckpt-8.index; No space left on device"),
                      "saving", None, None, None)
    assert full.errno == errno.ENOSPC and "disk is full" in str(full) and "starts afresh" in str(full)
    assert save_error(OSError(errno.EROFS, "Read-only file system", "/x/checkpoint"), "saving", None, None,
                      None).filename == "/x/checkpoint"
    assert os.strerror(errno.EIO) and errno_of(RuntimeError("nothing known")) is None


def test_a_read_failing_inside_the_train_function_is_not_the_end_of_the_data(tmp_path, monkeypatch):
    """A model without keras.Input is restored right before its first step, inside the train function: a read that
    fails there with TensorFlow's OutOfRangeError (a file truncated since fit start) stops fit with an error instead
    of ending every epoch at 0 batches."""
    import keras

    import keras_scale as ks
    from keras_scale.callbacks.checkpoint import format as io
    from tests._helpers import StopAfter, fit

    def unbuilt():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        return model

    d = str(tmp_path / "ckpt")
    fit(unbuilt(), [ks.ChiefCheckpoint(d), StopAfter(15)], epochs=3)

    def truncated(*args, **kwargs):
        raise tf.errors.OutOfRangeError(None, None, "Read less bytes than requested")

    monkeypatch.setattr(io, "read_into", truncated)
    model = unbuilt()
    with pytest.raises(RuntimeError, match="before the first step failed"):
        fit(model, [ks.ChiefCheckpoint(d)], epochs=3)
