"""ChiefCheckpoint's synchronous file format (checkpoint/format.py): round trip, damage found before anything is assigned,
retired data files recycled (never one kept in best/), TensorFlow-written checkpoints still resumed."""
import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.callbacks.checkpoint import format as io
from keras_scale.callbacks.checkpoint import list_checkpoints, load_checkpoint
from tests._helpers import StopAfter

NUM_SAMPLES, BATCH = 80, 8  # 10 batches per epoch
X = np.random.RandomState(0).rand(NUM_SAMPLES, 4).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")


def make_model():
    keras.utils.set_random_seed(7)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return m


def fit(model, callbacks, epochs=3):
    return model.fit(X, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)


def weights(model):
    return [v.numpy().copy() for v in model.weights]


def test_round_trip_of_every_kind_of_variable(tmp_path):
    items = {"w": [tf.Variable(np.random.RandomState(1).rand(33, 7).astype("float32")),
                   tf.Variable(np.arange(5, dtype="int32"))],
             "h": tf.Variable(tf.constant([1.5, -2.0], dtype=tf.bfloat16)),
             "flag": tf.Variable(True),
             "pos": {"step": tf.Variable(12345678901, dtype=tf.int64)},
             "text": tf.Variable("päth {json}")}
    prefix = str(tmp_path / "ckpt-1")
    io.write_checkpoint(prefix, io.flatten(items))
    assert io.is_raw(prefix)
    reader = load_checkpoint(prefix)
    assert reader.get_variable_to_shape_map()["w/0/.ATTRIBUTES/VARIABLE_VALUE"] == [33, 7]
    assert reader.get_tensor("text/.ATTRIBUTES/VARIABLE_VALUE").decode() == "päth {json}"
    assert int(reader.get_tensor("pos/step/.ATTRIBUTES/VARIABLE_VALUE")) == 12345678901
    fresh = {"w": [tf.Variable(tf.zeros((33, 7))), tf.Variable(tf.zeros(5, tf.int32))],
             "h": tf.Variable(tf.zeros(2, tf.bfloat16)), "flag": tf.Variable(False),
             "pos": {"step": tf.Variable(0, dtype=tf.int64)}, "text": tf.Variable("")}
    io.read_into(prefix, io.flatten(fresh), None)
    for key, var in io.flatten(items).items():
        np.testing.assert_array_equal(io.flatten(fresh)[key].numpy(), var.numpy())


@pytest.mark.parametrize("truncate", [False, True])
def test_damage_is_found_before_any_variable_is_assigned(tmp_path, truncate):
    first, second = tf.Variable(np.ones((64, 64), "float32")), tf.Variable(np.full((64, 64), 2.0, "float32"))
    prefix = str(tmp_path / "ckpt-1")
    io.write_checkpoint(prefix, io.flatten({"w": [first, second]}))
    data = prefix + io.DATA_SUFFIX
    with open(data, "r+b") as f:
        if truncate:
            f.truncate(os.path.getsize(data) - 100)
        else:
            f.seek(os.path.getsize(data) - 1000)  # inside the second tensor
            f.write(b"\xff\x00\xff\x00")
    target = [tf.Variable(tf.zeros((64, 64))), tf.Variable(tf.zeros((64, 64)))]
    with pytest.raises(io.CorruptCheckpointError, match="truncated" if truncate else "CRC"):
        io.read_into(prefix, io.flatten({"w": target}), None)
    assert not target[0].numpy().any() and not target[1].numpy().any()  # nothing half-restored


def test_a_different_shape_is_a_value_error_naming_both(tmp_path):
    prefix = str(tmp_path / "ckpt-1")
    io.write_checkpoint(prefix, io.flatten({"w": [tf.Variable(tf.ones((3, 4)))]}))
    with pytest.raises(ValueError, match=r"shape \(3, 4\) there .* \(4, 3\)"):
        io.read_into(prefix, io.flatten({"w": [tf.Variable(tf.zeros((4, 3)))]}), None)


def test_sync_saves_recycle_retired_data_files_and_resume_exactly(tmp_path):
    d = str(tmp_path / "ckpt")
    reference = make_model()
    fit(reference, [])
    model = make_model()
    fit(model, [ks.ChiefCheckpoint(d, save_freq=1, max_to_keep=1), StopAfter(17)])
    # 17 saves of one kept checkpoint: each retired data file is kept as the spare the next save overwrites
    spares = glob.glob(os.path.join(d, io.SPARE_PREFIX + "*"))
    assert len(spares) == 1
    assert [n for n, _ in list_checkpoints(d)] == [17]
    resumed = make_model()
    fit(resumed, [ks.ChiefCheckpoint(d, save_freq=1, max_to_keep=1)])  # restores, then overwrites spares
    for a, b in zip(weights(resumed), weights(reference)):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_kept_in_best_is_never_recycled(tmp_path):
    d = str(tmp_path / "ckpt")
    at_epoch_end = {}

    class Snapshot(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            at_epoch_end[epoch] = weights(self.model)

    model = make_model()
    # mode="max" on a falling loss: the best is the first epoch's, which 30 later saves rotate out of the newest
    ckpt = ks.ChiefCheckpoint(d, save_freq=1, max_to_keep=1, keep_best_k=1, monitor="loss", mode="max")
    fit(model, [ckpt, Snapshot()], epochs=4)
    (value, prefix), = ckpt.best_checkpoints
    epoch = int(os.path.basename(prefix).split("-")[1]) // 10 - 1
    assert epoch == 0
    reader = load_checkpoint(prefix)  # later saves recycled other files, never this one (hard-linked)
    saved = [reader.get_tensor(f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE") for i in range(4)]
    for a, b in zip(saved, at_epoch_end[epoch]):
        np.testing.assert_array_equal(a, b)


def test_tensorflow_written_checkpoints_are_resumed_by_sync_saves(tmp_path):
    d = str(tmp_path / "ckpt")
    reference = make_model()
    fit(reference, [])
    first = make_model()
    fit(first, [ks.ChiefCheckpoint(d, save_freq=2, async_save=True), StopAfter(13)])  # TensorFlow's format
    newest = list_checkpoints(d)[0][1]
    assert not io.is_raw(newest)
    resumed = make_model()
    ckpt = ks.ChiefCheckpoint(d, save_freq=2)
    fit(resumed, [ckpt])
    assert ckpt.restored_from == newest
    assert io.is_raw(list_checkpoints(d)[0][1])
    for a, b in zip(weights(resumed), weights(reference)):
        np.testing.assert_array_equal(a, b)


def test_an_async_run_removes_the_spare_a_sync_run_left(tmp_path):
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=1, max_to_keep=1), StopAfter(5)])
    assert len(glob.glob(os.path.join(d, io.SPARE_PREFIX + "*"))) == 1
    fit(make_model(), [ks.ChiefCheckpoint(d, save_freq=1, max_to_keep=1, async_save=True), StopAfter(8)])
    assert glob.glob(os.path.join(d, io.SPARE_PREFIX + "*")) == []  # TensorFlow's writer never reuses it
    assert [n for n, _ in list_checkpoints(d)] == [8]
