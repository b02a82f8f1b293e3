"""The input position as training state: ChiefCheckpoint saves the data iterator's position in the checkpoint and a
resume restores it (no batch read again, Keras's loop starts at the saved batch) with the uninterrupted run's
weights; pipelines that cannot be saved read forward as before and say so once; the saved state is CRC-checked like
every tensor."""
import glob
import logging
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.callbacks.checkpoint import data_position, list_checkpoints, read_checkpoint
from tests._helpers import BATCH, X, Y, StopAfter, assert_same, make_model, weights

NOT_SAVEABLE = r"position in the data cannot be saved"


class Batches(keras.callbacks.Callback):
    """The batch numbers Keras's loop runs (its on_train_batch_begin calls)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append(int(batch))


def shuffled_ds(repeat=False):
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(80, seed=1, reshuffle_each_iteration=False)
    ds = ds.map(lambda x, y: (x * 2.0, y), num_parallel_calls=2)
    if repeat:
        ds = ds.repeat()
    return ds.batch(BATCH).prefetch(2)


# kind -> (fit arguments, epochs, stop after this many updates, (epoch, batch in epoch) of that stop)
KINDS = {
    # fit(ds): a shuffle buffer, a parallel map and a prefetch buffer in the saved state; epoch 3, batch 7
    "dataset": (lambda: dict(x=shuffled_ds()), 4, 27),
    # a repeat()ed dataset with steps_per_epoch: one iterator over all epochs; stopped in epoch 5 (23 batches read)
    "repeated": (lambda: dict(x=shuffled_ds(repeat=True), steps_per_epoch=5), 7, 23),
    # fit(x, y) on arrays, shuffled by Keras: the epoch's permutation is in the saved state; epoch 3, batch 6
    "arrays": (lambda: dict(x=X, y=Y, batch_size=BATCH, shuffle=True), 4, 26),
}


def test_an_async_save_holds_the_data_position_too(tmp_path, caplog):
    ref = make_model()
    run(ref, [], "repeated")
    d = str(tmp_path / "ckpt")
    run(make_model(), [ks.ChiefCheckpoint(d, save_freq=4, async_save=True), StopAfter(23)], "repeated")
    assert len(read_checkpoint(list_checkpoints(d)[0][1]).get_tensor(data_position.DATA_STATE_KEY)) > 0
    resumed = make_model()
    with caplog.at_level(logging.INFO, logger="keras_scale.checkpoint"):
        run(resumed, [ks.ChiefCheckpoint(d, save_freq=4, async_save=True)], "repeated")
    assert any("data position restored from the checkpoint" in r.getMessage() for r in caplog.records)
    assert_same(weights(resumed), weights(ref))


def run(model, callbacks, kind):
    kwargs, epochs, _ = KINDS[kind]
    return model.fit(epochs=epochs, verbose=0, callbacks=callbacks, **kwargs())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_resume_restores_the_data_position_and_equals_the_uninterrupted_run(tmp_path, kind, caplog):
    ref = make_model()
    run(ref, [], kind)
    d = str(tmp_path / "ckpt")
    stop = KINDS[kind][2]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a saveable pipeline: no fallback warning
        run(make_model(), [ks.ChiefCheckpoint(d, save_freq=4), StopAfter(stop)], kind)
    state = read_checkpoint(list_checkpoints(d)[0][1]).get_tensor(data_position.DATA_STATE_KEY)
    assert len(state) > 0
    resumed, batches = make_model(), Batches()
    with caplog.at_level(logging.INFO, logger="keras_scale.checkpoint"):
        run(resumed, [ks.ChiefCheckpoint(d, save_freq=4), batches], kind)
    assert any("data position restored from the checkpoint" in r.getMessage() for r in caplog.records)
    assert not any("batches forward" in r.getMessage() for r in caplog.records)
    assert_same(weights(resumed), weights(ref))
    # Keras's loop did not run the trained batches: after the resumed epoch's first call it goes on at the stop
    steps = 5 if kind == "repeated" else 10
    assert batches.seen[:2] == [0, stop % steps]


def test_a_py_function_pipeline_reads_forward_with_one_warning(tmp_path, caplog):
    def data():
        ds = tf.data.Dataset.from_tensor_slices((X, Y)).map(
            lambda x, y: (tf.py_function(lambda v: v * 2.0, [x], tf.float32), y))
        return ds.map(lambda x, y: (tf.ensure_shape(x, [4]), y)).repeat().batch(BATCH)

    ref = make_model()
    ref.fit(data(), epochs=4, steps_per_epoch=5, verbose=0)
    d = str(tmp_path / "ckpt")
    with pytest.warns(RuntimeWarning, match=NOT_SAVEABLE) as record:
        make_model().fit(data(), epochs=4, steps_per_epoch=5, verbose=0,
                         callbacks=[ks.ChiefCheckpoint(d, save_freq=2), StopAfter(13)])
    said = [str(w.message) for w in record if NOT_SAVEABLE in str(w.message)]
    assert len(said) == 1  # once, at the first save, though 6 saves followed
    assert "EagerPyFunc" in said[0] and "py_function" in said[0] and "Fix:" in said[0]
    assert " ms = " in said[0]  # the cost: batches x measured time per batch
    assert read_checkpoint(list_checkpoints(d)[0][1]).get_tensor(data_position.DATA_STATE_KEY) == b""
    resumed = make_model()
    with caplog.at_level(logging.INFO, logger="keras_scale.checkpoint"):
        resumed.fit(data(), epochs=4, steps_per_epoch=5, verbose=0, callbacks=[ks.ChiefCheckpoint(d, save_freq=2)])
    assert any("read 13 batches forward" in r.getMessage() for r in caplog.records)
    assert_same(weights(resumed), weights(ref))


def test_a_state_over_the_size_limit_reads_forward_and_says_its_size(tmp_path, monkeypatch):
    monkeypatch.setattr(data_position, "MAX_STATE_BYTES", 1000)
    ref = make_model()
    run(ref, [], "dataset")
    d = str(tmp_path / "ckpt")
    with pytest.warns(RuntimeWarning, match=NOT_SAVEABLE + r".*MiB.*experimental_symbolic_checkpoint"):
        run(make_model(), [ks.ChiefCheckpoint(d, save_freq=4), StopAfter(27)], "dataset")
    resumed = make_model()
    run(resumed, [ks.ChiefCheckpoint(d, save_freq=4)], "dataset")
    assert_same(weights(resumed), weights(ref))


def test_the_saved_position_restores_into_a_fresh_iterator(tmp_path):
    """The checkpoint's data state is TensorFlow's own iterator state: a fresh iterator over the pipeline continues
    with the batch the run would have read next."""
    d = str(tmp_path / "ckpt")
    run(make_model(), [ks.ChiefCheckpoint(d, save_freq=4), StopAfter(23)], "repeated")
    state = read_checkpoint(list_checkpoints(d)[0][1]).get_tensor(data_position.DATA_STATE_KEY)
    fresh = iter(shuffled_ds(repeat=True))
    data_position.restore_iterator_state(fresh, state)
    expected = iter(shuffled_ds(repeat=True))
    for _ in range(23):
        next(expected)
    np.testing.assert_array_equal(next(fresh)[0].numpy(), next(expected)[0].numpy())


def test_a_damaged_data_state_is_detected_and_the_previous_checkpoint_used(tmp_path):
    ref = make_model()
    run(ref, [], "repeated")
    d = str(tmp_path / "ckpt")
    run(make_model(), [ks.ChiefCheckpoint(d, save_freq=4, max_to_keep=3), StopAfter(23)], "repeated")
    (newest, prefix), (previous, _) = list_checkpoints(d)[:2]
    state = bytes(read_checkpoint(prefix).get_tensor(data_position.DATA_STATE_KEY))
    data_file = glob.glob(prefix + ".data-*")[0]
    with open(data_file, "rb") as f:
        raw = f.read()
    at = raw.find(state)
    assert at >= 0
    with open(data_file, "r+b") as f:  # one byte inside the iterator state, nothing else
        f.seek(at + len(state) // 2)
        f.write(bytes([raw[at + len(state) // 2] ^ 0xFF]))
    resumed = make_model()
    ckpt = ks.ChiefCheckpoint(d, save_freq=4)
    with pytest.warns(RuntimeWarning, match=r"could not be loaded and were skipped.*ckpt-%d" % newest):
        run(resumed, [ckpt], "repeated")
    assert ckpt.restored_from.endswith(f"ckpt-{previous}")
    assert_same(weights(resumed), weights(ref))


def test_mirrored_reads_forward_says_so_once_and_equals_the_uninterrupted_run(tmp_path, mirrored, caplog,
                                                                              monkeypatch):
    """TensorFlow cannot serialize a tf.distribute iterator: the resume reads forward (in one compiled loop, with
    the loop's trained steps skipped) and the result is the uninterrupted run's."""
    from keras_scale.callbacks.checkpoint import resume as resume_module

    monkeypatch.setattr(resume_module, "_COMPILED_SKIP_MIN", 5)  # (1,000 batches by default)
    def model():
        with mirrored.scope():
            return make_model()

    ref = model()
    run(ref, [], "repeated")
    d = str(tmp_path / "ckpt")
    with pytest.warns(RuntimeWarning, match=NOT_SAVEABLE + r".*tf.distribute iterator") as record:
        run(model(), [ks.ChiefCheckpoint(d, save_freq=4), StopAfter(23)], "repeated")
    assert len([w for w in record if NOT_SAVEABLE in str(w.message)]) == 1
    resumed = model()
    with caplog.at_level(logging.INFO, logger="keras_scale.checkpoint"):
        run(resumed, [ks.ChiefCheckpoint(d, save_freq=4)], "repeated")
    assert any("read 23 batches forward" in r.getMessage() for r in caplog.records)
    assert_same(weights(resumed), weights(ref))


def test_a_changed_pipeline_reads_forward_with_a_warning(tmp_path):
    """A state taken from another pipeline is refused (the fresh iterator is left as it was) and the resume reads
    forward, as before the data position was saved."""
    d = str(tmp_path / "ckpt")
    run(make_model(), [ks.ChiefCheckpoint(d, save_freq=4), StopAfter(23)], "repeated")
    other = tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(BATCH)  # no shuffle, no map
    resumed = make_model()
    with pytest.warns(RuntimeWarning, match=r"does not fit this run's data iterator.*reading 23 batches forward"):
        resumed.fit(other, epochs=7, steps_per_epoch=5, verbose=0, callbacks=[ks.ChiefCheckpoint(d, save_freq=4)])
    assert int(resumed.optimizer.iterations.numpy()) == 35
    assert os.path.exists(os.path.join(d, "ckpt-35.index"))


TWO_WORKERS = r'''
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
import numpy as np, keras
import keras_scale as ks

mode = sys.argv[1]
strategy = ks.choose_strategy()  # TF_CONFIG -> MultiWorkerMirroredStrategy
from keras_scale.distribute import patch_keras_multi_worker
patch_keras_multi_worker()  # keras-team/keras#20585 (what ks.fit applies)
X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")).astype("float32")
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
ds = (tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(64, seed=3, reshuffle_each_iteration=False).repeat()
      .batch(16).with_options(options))
keras.utils.set_random_seed(7)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")

class StopAt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if mode == "stop" and int(self.model.optimizer.iterations.numpy()) >= 23:
            self.model.stop_training = True

callbacks = [] if mode == "ref" else [ks.ChiefCheckpoint("ckpt", save_freq=4), StopAt()]
model.fit(ds, epochs=6, steps_per_epoch=4, verbose=0, callbacks=callbacks)
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
with open(f"{mode}_{index}.json", "w") as f:
    json.dump({"weights": [w.tolist() for w in model.get_weights()],
               "iterations": int(model.optimizer.iterations.numpy())}, f)
'''


@pytest.mark.slow
def test_two_workers_stopped_late_resume_to_the_uninterrupted_runs_weights(tmp_path):
    """MultiWorkerMirroredStrategy, a repeat()ed dataset, stopped in epoch 6 (23 batches into one iterator): the
    rerun reads forward (TensorFlow cannot serialize the distributed iterator) and ends with the uninterrupted
    2-worker run's weights, bit for bit."""
    import json
    import sys

    from keras_scale.launch import launch_local_workers
    from tests._helpers import REPO_ROOT

    script = tmp_path / "worker.py"
    script.write_text(TWO_WORKERS)
    env = {"PYTHONPATH": REPO_ROOT, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2",
           "TF_ENABLE_ONEDNN_OPTS": "0"}
    for mode in ("ref", "stop", "resume"):
        launch_local_workers([sys.executable, str(script), mode], num_workers=2, timeout_s=280, env=env,
                             cwd=str(tmp_path), check=True)

    def read(name):
        return [json.loads((tmp_path / f"{name}_{i}.json").read_text()) for i in range(2)]

    assert [r["iterations"] for r in read("stop")] == [23, 23]
    for ref, resumed in zip(read("ref"), read("resume")):
        assert resumed["iterations"] == 24
        for a, b in zip(ref["weights"], resumed["weights"]):
            np.testing.assert_array_equal(np.array(a), np.array(b))


def test_ks_fit_shuffled_arrays_resume_from_the_saved_position(tmp_path, caplog):
    """keras_scale.fit shuffles arrays per epoch from a variable (a stateful read TensorFlow refuses to save by
    default); the epoch's permutation is in the iterator state, so the position is saved and restored exactly."""
    def build():
        return make_model()

    ref = ks.fit(build, X, Y, global_batch_size=BATCH, epochs=3, verbose=0).model
    d = str(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ks.fit(build, X, Y, global_batch_size=BATCH, epochs=3, verbose=0,
               callbacks=[ks.ChiefCheckpoint(d, save_freq=3), StopAfter(13)])
    assert len(read_checkpoint(list_checkpoints(d)[0][1]).get_tensor(data_position.DATA_STATE_KEY)) > 0
    with caplog.at_level(logging.INFO, logger="keras_scale.checkpoint"):
        resumed = ks.fit(build, X, Y, global_batch_size=BATCH, epochs=3, verbose=0,
                         callbacks=[ks.ChiefCheckpoint(d, save_freq=3)]).model
    assert any("data position restored from the checkpoint" in r.getMessage() for r in caplog.records)
    assert_same(weights(resumed), weights(ref))


def test_where_keras_loop_cannot_be_advanced_its_calls_for_trained_batches_train_nothing(tmp_path, monkeypatch):
    """Another Keras (no ``epoch_iterator`` to advance): the loop calls the train function for every trained batch;
    those calls read nothing (the data is already positioned) and train nothing."""
    ref = make_model()
    run(ref, [], "repeated")
    d = str(tmp_path / "ckpt")
    run(make_model(), [ks.ChiefCheckpoint(d, save_freq=4), StopAfter(23)], "repeated")
    monkeypatch.setattr(data_position, "keras_epoch_iterator", lambda model: None)
    resumed, batches = make_model(), Batches()
    run(resumed, [ks.ChiefCheckpoint(d, save_freq=4), batches], "repeated")
    assert batches.seen[:5] == [0, 1, 2, 3, 4]  # epoch 6 (index 5) from its first batch: 3 calls skipped
    assert int(resumed.optimizer.iterations.numpy()) == 35
    assert_same(weights(resumed), weights(ref))


@pytest.mark.parametrize("resumed_samples", [72, 56])
def test_a_dataset_that_grew_or_shrank_is_refused_and_read_forward(tmp_path, resumed_samples):
    """TensorFlow restores a shuffle+batch state saved over 64 samples into the same pipeline over 72 (or 56)
    without complaint: the resumed epoch would run out early (the new samples never seen in it) or read past the
    data. The saved state's pipeline fingerprint refuses it: the resume reads forward in the new data, with the
    warning, and every epoch trains all of the new data's batches."""
    def data(n):
        return tf.data.Dataset.from_tensor_slices((X[:n], Y[:n])).shuffle(n, seed=3).batch(8)

    d = str(tmp_path / "ckpt")
    make_model().fit(data(64), epochs=2, verbose=0, callbacks=[ks.ChiefCheckpoint(d, save_freq=4), StopAfter(4)])
    assert len(read_checkpoint(list_checkpoints(d)[0][1]).get_tensor(data_position.DATA_STATE_KEY)) > 0
    resumed = make_model()
    with pytest.warns(RuntimeWarning, match=r"does not fit this run's data iterator.*reading 4 batches forward"):
        resumed.fit(data(resumed_samples), epochs=2, verbose=0, callbacks=[ks.ChiefCheckpoint(d, save_freq=4)])
    assert int(resumed.optimizer.iterations.numpy()) == 2 * resumed_samples // 8
