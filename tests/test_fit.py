"""keras_scale.fit: batch arithmetic, bad input, scope rebuild, data handling, equivalence under 2 replicas."""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.data import dataset_is_batched as _is_batched, dataset_is_file_based as _is_file_based
from keras_scale.fit import _default_callbacks, batch_arithmetic, prepare_dataset

RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 4)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")).astype("float32")


def build(optimizer=None, jit_compile="auto", batchnorm=False):
    def builder():
        keras.utils.set_random_seed(7)
        layers = [keras.Input((4,)), keras.layers.Dense(8, activation="tanh")]
        if batchnorm:
            layers.append(keras.layers.BatchNormalization())
        layers.append(keras.layers.Dense(1))
        model = keras.Sequential(layers)
        model.compile(optimizer=optimizer() if optimizer else keras.optimizers.SGD(0.05), loss="mse",
                      metrics=["mae"], jit_compile=jit_compile)
        return model

    return builder


def max_diff(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


def reference(global_batch=16, epochs=2, **kwargs):
    """Single device, plain fit-equivalent run at the same global batch."""
    return ks.fit(build(**kwargs), X, Y, global_batch_size=global_batch, epochs=epochs, strategy="default",
                  shuffle=False, verbose=0)


# --- batch arithmetic and bad input (all raised before any training) -----------------------------------------

def test_batch_arithmetic():
    # accum splits each replica's batch into micro-batches: it never changes the batch sizes
    assert batch_arithmetic(4, per_replica_batch_size=64, accum=2) == (64, 256)
    assert batch_arithmetic(4, global_batch_size=512, accum=2) == (128, 512)
    assert batch_arithmetic(4, global_batch_size=512) == batch_arithmetic(4, global_batch_size=512, accum=8)
    assert batch_arithmetic(1, global_batch_size=10) == (10, 10)
    with pytest.raises(ValueError, match="multiple of 4"):
        batch_arithmetic(4, global_batch_size=102, accum=2)
    with pytest.raises(ValueError, match="use accum <= 8"):
        batch_arithmetic(2, global_batch_size=16, accum=9)
    with pytest.raises(ValueError, match="exactly one"):
        batch_arithmetic(2, per_replica_batch_size=8, global_batch_size=16)
    with pytest.raises(ValueError, match="exactly one"):
        batch_arithmetic(2)
    with pytest.raises(ValueError, match="accum must be an integer >= 1, got 0"):
        batch_arithmetic(2, per_replica_batch_size=8, accum=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(per_replica_batch_size=8, global_batch_size=16), ValueError, "exactly one"),
        (dict(), ValueError, "exactly one"),
        (dict(per_replica_batch_size=0), ValueError, "per_replica_batch_size must be an integer >= 1, got 0"),
        (dict(global_batch_size=16, batch_size=16), TypeError, "not batch_size="),
        (dict(global_batch_size=16, accum=0), ValueError, "accum must be an integer >= 1, got 0"),
        (dict(global_batch_size=16, lr_scaling=("cubic", 256)), ValueError, "lr_scaling must be"),
        (dict(global_batch_size=16, lr_scaling=0.1), ValueError, "lr_scaling must be"),
        (dict(global_batch_size=16, sync_bn="yes"), ValueError, "sync_bn must be"),
        (dict(global_batch_size=16, strategy="tpu"), ValueError, "unknown strategy 'tpu'"),
        (dict(global_batch_size=16, all_reduce="mpi"), ValueError, "unknown all_reduce 'mpi'"),
        (dict(global_batch_size=16, precision="fp8"), ValueError, "unknown precision 'fp8'"),
        (dict(global_batch_size=15, strategy="mirrored_2cpu"), ValueError, "global_batch_size=15 does not split"),
        (dict(global_batch_size=16, validation_split=1.5), ValueError, "0 < validation_split < 1"),
        (dict(global_batch_size=16, y=Y[:60]), ValueError, "x has 64, y has 60"),
        (dict(global_batch_size=16, sample_weight=np.ones(10)), ValueError, "y has 64, sample_weight has 10"),
    ],
)
def test_bad_arguments_fail_early_with_the_fix(kwargs, error, match, mirrored):
    if kwargs.get("strategy") == "mirrored_2cpu":
        kwargs["strategy"] = mirrored
    y = kwargs.pop("y", Y)
    started = []
    with pytest.raises(error, match=match):
        ks.fit(build(), X, y, verbose=0, callbacks=[keras.callbacks.LambdaCallback(
            on_train_begin=lambda logs: started.append(1))], **kwargs)
    assert not started  # refused before training


def test_bad_model_argument():
    with pytest.raises(TypeError, match="zero-argument function that builds and compiles"):
        ks.fit("resnet", X, Y, global_batch_size=16)
    uncompiled = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(TypeError, match="not compiled"):
        ks.fit(uncompiled, X, Y, global_batch_size=16, verbose=0)
    with pytest.raises(TypeError, match="not a keras.Model"):
        ks.fit(lambda: 42, X, Y, global_batch_size=16, verbose=0)
    with pytest.raises(TypeError, match="uncompiled model"):
        ks.fit(lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]), X, Y, global_batch_size=16,
               verbose=0)
    with pytest.raises(TypeError, match="not supported"):
        ks.fit(build(), iter([X]), global_batch_size=16, verbose=0)


# --- equivalence and the log ---------------------------------------------------------------------------------

def test_two_replicas_equal_one_device_at_the_same_global_batch(mirrored, capsys):
    ref = ks.fit(build(), X, Y, global_batch_size=16, epochs=2, strategy="default", verbose=0)  # shuffled
    hist = ks.fit(build(), X, Y, per_replica_batch_size=8, epochs=2, strategy=mirrored, verbose=1)
    out = capsys.readouterr().out
    assert ("global batch 16 = 8 per replica x 2 replicas (MirroredStrategy, precision float32); 4 updates/epoch x "
            "2 epochs = 8 optimizer updates (a schedule's total_steps)") in out
    assert out.count("global batch") == 1  # stated once
    assert max_diff(ref.model, hist.model) < 1e-5
    np.testing.assert_allclose(hist.history["loss"], ref.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(hist.history["mae"], ref.history["mae"], rtol=1e-5)
    assert hist.model.distribute_strategy is mirrored


def test_model_built_outside_the_scope_is_rebuilt_with_weights_and_compile_config(mirrored, capsys):
    outside = build()()
    outside_weights = [w.copy() for w in outside.get_weights()]
    hist = ks.fit(outside, X, Y, per_replica_batch_size=8, epochs=2, strategy=mirrored, shuffle=False, verbose=1)
    assert "built outside the MirroredStrategy scope: rebuilt inside it" in capsys.readouterr().out
    assert hist.model is not outside and hist.model.distribute_strategy is mirrored
    assert [np.array_equal(a, b) for a, b in zip(outside.get_weights(), outside_weights)] == [True] * 4  # untouched
    assert {"loss", "mae"} <= set(hist.history)  # metrics carried over
    assert hist.model.optimizer.get_config()["learning_rate"] == pytest.approx(0.05)
    assert max_diff(reference().model, hist.model) < 1e-5  # started from the same weights, same training


def test_compiled_model_inside_the_scope_is_trained_in_place(mirrored):
    with mirrored.scope():
        model = build()()
    hist = ks.fit(model, X, Y, per_replica_batch_size=8, epochs=1, strategy=mirrored, shuffle=False, verbose=0)
    assert hist.model is model


def test_accum_splits_the_batch_like_wrap_and_changes_nothing_else(mirrored, capsys):
    ref = reference()
    hist = ks.fit(build(), X, Y, per_replica_batch_size=8, accum=2, epochs=2, strategy=mirrored, shuffle=False,
                  verbose=1)
    out = capsys.readouterr().out
    assert ("global batch 16 = 8 per replica x 2 replicas, each split into accum 2 micro-batches of 4 "
            "(MirroredStrategy, precision float32); 4 updates/epoch x 2 epochs = 8 optimizer updates") in out
    assert isinstance(hist.model, ks.AccumulatingModel) and hist.model.accum == 2
    assert max_diff(ref.model, ks.unwrap(hist.model)) < 1e-5  # the same training as without accumulation
    assert int(hist.model.optimizer.iterations.numpy()) == 2 * 64 // 16  # one update per global batch
    with pytest.raises(ValueError, match="use accum <= 8"):
        ks.fit(build(), X, Y, per_replica_batch_size=8, accum=16, strategy=mirrored, verbose=0)


def test_a_builder_returning_a_wrapped_model_is_logged_with_its_accum(mirrored, capsys):
    def wrapped_builder():
        wrapped = ks.wrap(build()(), accum=4)
        wrapped.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        return wrapped

    hist = ks.fit(wrapped_builder, X, Y, global_batch_size=16, epochs=2, strategy=mirrored, shuffle=False,
                  verbose=1)
    assert "each split into accum 4 micro-batches of 2" in capsys.readouterr().out
    assert hist.model.accum == 4 and max_diff(reference().model, ks.unwrap(hist.model)) < 1e-5
    with pytest.raises(ValueError, match="already wrapped by keras_scale.wrap \\(accum=4\\) and fit got accum=2"):
        ks.fit(wrapped_builder, X, Y, global_batch_size=16, accum=2, strategy=mirrored, verbose=0)


def test_jit_compile_is_turned_off_under_multiple_replicas(mirrored, capsys):
    hist = ks.fit(build(jit_compile=True), X, Y, per_replica_batch_size=8, strategy=mirrored, shuffle=False,
                  verbose=1)
    assert "XLA (jit_compile) off under 2 replicas" in capsys.readouterr().out
    assert hist.model.jit_compile is False and np.isfinite(hist.history["loss"][0])


# --- data ----------------------------------------------------------------------------------------------------

def test_datasets_batched_or_not_are_rebatched_to_the_global_batch(mirrored):
    ref = reference()
    unbatched = tf.data.Dataset.from_tensor_slices((X, Y))
    batched = unbatched.batch(5)  # an odd batch that fit must rebatch to 16
    for ds in (unbatched, batched):
        hist = ks.fit(build(), ds, per_replica_batch_size=8, epochs=2, strategy=mirrored, verbose=0)
        assert max_diff(ref.model, hist.model) < 1e-5


def test_prepare_dataset_batches_shards_and_describes():
    ds, how = prepare_dataset(X, Y, global_batch_size=16, shuffle=True)
    assert [int(b[0].shape[0]) for b in ds] == [16, 16, 16, 16]
    assert ds.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.DATA
    assert "auto-shard DATA" in how and "shuffled" in how
    # every worker must shuffle identically for DATA sharding: same seed -> same order
    first = [b[0].numpy() for b in prepare_dataset(X, Y, global_batch_size=16)[0]]
    second = [b[0].numpy() for b in prepare_dataset(X, Y, global_batch_size=16)[0]]
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    assert sorted(np.concatenate(first)[:, 0].tolist()) == sorted(X[:, 0].tolist())  # a permutation, nothing lost
    ds, how = prepare_dataset(X[:60], Y[:60], global_batch_size=16, shuffle=False, drop_remainder=True)
    assert [int(b[0].shape[0]) for b in ds] == [16, 16, 16] and "12 samples per epoch dropped" in how
    with pytest.raises(ValueError, match="y/sample_weight must be None"):
        prepare_dataset(tf.data.Dataset.from_tensor_slices(X), Y, global_batch_size=4)


def test_file_based_pipelines_are_sharded_by_file(tmp_path):
    path = str(tmp_path / "a.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        w.write(b"x")
    files = tf.data.Dataset.list_files(str(tmp_path / "*.tfrecord")).interleave(tf.data.TFRecordDataset)
    assert _is_file_based(files) and not _is_file_based(tf.data.Dataset.range(3))
    _, how = prepare_dataset(files, global_batch_size=2)
    assert "auto-shard FILE" in how
    assert _is_batched(tf.data.Dataset.range(4).batch(2).map(lambda v: v).prefetch(1))
    assert not _is_batched(tf.data.Dataset.range(4).batch(2).unbatch())


def test_pydataset_is_rebatched(mirrored):
    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return X[i * 8:(i + 1) * 8], Y[i * 8:(i + 1) * 8]

    hist = ks.fit(build(), Batches(), per_replica_batch_size=8, epochs=2, strategy=mirrored, shuffle=False,
                  verbose=0)
    assert max_diff(reference().model, hist.model) < 1e-5


class _Batches(keras.utils.PyDataset):
    """X, Y in batches of ``size`` (the last one shorter); ``short`` makes one more batch shorter."""

    def __init__(self, n=len(X), size=5, short=None):
        super().__init__()
        self.n, self.size, self.short = n, size, short

    def __len__(self):
        return -(-self.n // self.size)

    def __getitem__(self, i):
        end = min((i + 1) * self.size, self.n) if i != self.short else i * self.size + 2
        return X[i * self.size:end], Y[i * self.size:end]


def test_pydataset_keeps_its_size_no_ran_out_of_data_warning(recwarn, capsys):
    data = _Batches(n=61)  # 13 batches of 5 (the last 1) -> 4 of 16 (the last 13)
    ds, _ = prepare_dataset(data, global_batch_size=16, shuffle=False)
    assert int(ds.cardinality()) == 4 and [int(b[0].shape[0]) for b in ds] == [16, 16, 16, 13]
    ds, _ = prepare_dataset(data, global_batch_size=16, shuffle=False, drop_remainder=True)
    assert int(ds.cardinality()) == 3 == len(list(ds))
    hist = ks.fit(build(), data, global_batch_size=16, epochs=2, strategy="default", shuffle=False, verbose=1)
    assert not [w for w in recwarn if "ran out of data" in str(w.message)]
    assert "4/4" in capsys.readouterr().out  # Keras's progress bar knows the epoch's length
    ref = ks.fit(build(), X[:61], Y[:61], global_batch_size=16, epochs=2, strategy="default", shuffle=False,
                 verbose=0)
    assert max_diff(ref.model, hist.model) < 1e-6


def test_pydataset_with_uneven_batches_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"a batch of the PyDataset differs in size from its first \(5\) and last "
                                         r"\(4\) batches.*pass a tf.data.Dataset"):
        ks.fit(build(), _Batches(short=3), global_batch_size=16, epochs=1, strategy="default", shuffle=False,
               verbose=0)


def test_the_batch_line_names_the_default_strategy_and_counts_in_words(capsys):
    ks.fit(build(), X, Y, global_batch_size=64, epochs=1, strategy="default", verbose=1)
    out = capsys.readouterr().out
    assert ("global batch 64 = 64 per replica x 1 replica (default strategy, 1 device, precision float32); "
            "1 update/epoch x 1 epoch = 1 optimizer update (a schedule's total_steps)") in out
    assert "_Default" not in out


def test_validation_arrays_and_sample_weight(mirrored):
    weights = np.ones(len(X), dtype="float32")
    hist = ks.fit(build(), X, Y, per_replica_batch_size=8, strategy=mirrored, shuffle=False, verbose=0,
                  sample_weight=weights, validation_data=(X[:20], Y[:20]))
    assert {"loss", "val_loss", "val_mae"} <= set(hist.history)
    assert hist.model.evaluate(X[:20], Y[:20], verbose=0)[0] == pytest.approx(hist.history["val_loss"][0], rel=1e-5)


# --- learning-rate scaling -----------------------------------------------------------------------------------

def test_lr_scaling_scales_a_float_lr_and_a_warmup_cosine_peak(mirrored, capsys):
    hist = ks.fit(build(), X, Y, per_replica_batch_size=8, strategy=mirrored, lr_scaling=("linear", 4),
                  shuffle=False, verbose=1)
    assert float(hist.model.optimizer.learning_rate.numpy()) == pytest.approx(0.05 * 16 / 4)
    assert "learning rate 0.05 -> 0.2 (linear rule: global batch 16 / base batch 4)" in capsys.readouterr().out

    schedule = lambda: keras.optimizers.SGD(ks.WarmupCosine(0.01, total_steps=100))  # noqa: E731
    hist = ks.fit(build(optimizer=schedule), X, Y, per_replica_batch_size=8, strategy=mirrored,
                  lr_scaling=("sqrt", 4), shuffle=False, verbose=0)
    assert hist.model.optimizer._learning_rate.peak_lr == pytest.approx(0.01 * 2)

    other = lambda: keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9))  # noqa: E731
    with pytest.raises(ValueError, match="ExponentialDecay"):
        ks.fit(build(optimizer=other), X, Y, per_replica_batch_size=8, strategy=mirrored, lr_scaling=("sqrt", 4),
               verbose=0)


# --- callbacks -----------------------------------------------------------------------------------------------

def test_default_callbacks_are_added_once_per_kind(tmp_path):
    board = keras.callbacks.TensorBoard(str(tmp_path / "mine"))
    callbacks, added = _default_callbacks([board], log_dir=str(tmp_path / "tb"), checkpoint_dir=None,
                                          strategy=None)
    assert [cb for cb in callbacks if isinstance(cb, keras.callbacks.TensorBoard)] == [board]  # user's kept, no 2nd
    callbacks, added = _default_callbacks([], log_dir=str(tmp_path / "tb"), checkpoint_dir=None, strategy=None)
    assert any(isinstance(cb, keras.callbacks.TensorBoard) for cb in callbacks)
    if not tf.config.list_physical_devices("GPU"):
        assert not any("GpuMonitor" in name for name in added)  # only with a GPU
    assert "NanGuard" in added
    guard = ks.NanGuard()
    callbacks, added = _default_callbacks([guard], None, None, None)
    assert "NanGuard" not in added and guard in callbacks


def test_default_callbacks_can_be_switched_off(mirrored):
    hist = ks.fit(build(), X, Y, per_replica_batch_size=8, strategy=mirrored, verbose=0, default_callbacks=False)
    assert "nan_skipped" not in hist.history  # no NanGuard
    callbacks, added = _default_callbacks([], None, None, None, monitors=False)
    assert callbacks == [] and added == []


def test_log_dir_gets_tensorboard_events(mirrored, tmp_path):
    ks.fit(build(), X, Y, per_replica_batch_size=8, strategy=mirrored, verbose=0, log_dir=str(tmp_path / "tb"))
    events = [f for _, _, files in os.walk(tmp_path / "tb") for f in files if "tfevents" in f]
    assert events


def test_checkpoint_dir_resumes_with_chief_checkpoint(mirrored, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = ks.fit(build(), X, Y, per_replica_batch_size=8, epochs=2, strategy=mirrored, shuffle=False, verbose=0,
                   checkpoint_dir=ckpt)
    assert os.listdir(ckpt)
    # rerunning the same command resumes: the finished run trains no further epochs
    again = ks.fit(build(), X, Y, per_replica_batch_size=8, epochs=2, strategy=mirrored, shuffle=False, verbose=0,
                   checkpoint_dir=ckpt)
    assert max_diff(first.model, again.model) < 1e-6


def test_resumed_run_sees_the_same_shuffled_batches_as_an_uninterrupted_one(mirrored, tmp_path):
    straight = ks.fit(build(), X, Y, per_replica_batch_size=8, epochs=3, strategy=mirrored, verbose=0)
    ckpt = str(tmp_path / "ckpt")
    ks.fit(build(), X, Y, per_replica_batch_size=8, epochs=2, strategy=mirrored, verbose=0, checkpoint_dir=ckpt)
    resumed = ks.fit(build(), X, Y, per_replica_batch_size=8, epochs=3, strategy=mirrored, verbose=0,
                     checkpoint_dir=ckpt)
    assert len(resumed.history["loss"]) == 1  # only epoch 3 was trained
    assert resumed.history["loss"][0] == pytest.approx(straight.history["loss"][2], rel=1e-5)
    assert max_diff(straight.model, resumed.model) < 1e-5  # epoch 3 shuffled exactly as without the restart


# --- synchronized BatchNorm ----------------------------------------------------------------------------------

def test_sync_bn_auto_makes_small_per_replica_batches_train_like_one_device(mirrored, capsys):
    ref = ks.fit(build(batchnorm=True), X, Y, global_batch_size=8, epochs=1, strategy="default", shuffle=False,
                 verbose=0)
    synced = ks.fit(build(batchnorm=True), X, Y, per_replica_batch_size=4, epochs=1, strategy=mirrored,
                    shuffle=False, verbose=1)
    assert "BatchNormalization synchronized across replicas (the per-replica batch 4 < 16 over 2 replicas)" in (
        capsys.readouterr().out)
    bn = [layer for layer in synced.model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert bn and all(layer.synchronized for layer in bn)
    assert max_diff(ref.model, synced.model) < 1e-5  # statistics over the global batch, as on one device

    local = ks.fit(build(batchnorm=True), X, Y, per_replica_batch_size=4, epochs=1, strategy=mirrored,
                   shuffle=False, verbose=0, sync_bn=False)
    assert not any(layer.synchronized for layer in local.model.layers
                   if isinstance(layer, keras.layers.BatchNormalization))
    assert max_diff(ref.model, local.model) > 1e-4  # per-replica statistics train differently


def test_sync_bn_auto_leaves_large_per_replica_batches_alone(mirrored, capsys):
    hist = ks.fit(build(batchnorm=True), X, Y, per_replica_batch_size=16, strategy=mirrored, verbose=1)
    assert "synchronized" not in capsys.readouterr().out
    assert not any(getattr(layer, "synchronized", False) for layer in hist.model.layers)


def test_auto_strategy_follows_the_scope_the_model_was_built_in_and_scales_lr_once(mirrored, capsys):
    with mirrored.scope():
        model = build()()
    first = ks.fit(model, X, Y, per_replica_batch_size=8, lr_scaling=("linear", 8), verbose=1)  # strategy="auto"
    assert "16 = 8 per replica x 2 replicas" in capsys.readouterr().out and first.model is model
    again = ks.fit(model, X, Y, per_replica_batch_size=8, lr_scaling=("linear", 8), verbose=0)
    assert again.model is model
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.05 * 2)  # scaled once, not twice


def test_validation_split_takes_the_last_fraction_like_keras(mirrored):
    hist = ks.fit(build(), X, Y, global_batch_size=16, epochs=2, strategy=mirrored, shuffle=False, verbose=0,
                  validation_split=0.25)
    same = ks.fit(build(), X[:48], Y[:48], global_batch_size=16, epochs=2, strategy=mirrored, shuffle=False,
                  verbose=0, validation_data=(X[48:], Y[48:]))
    assert max_diff(hist.model, same.model) < 1e-6  # trained on the first 75% only
    np.testing.assert_allclose(hist.history["val_loss"], same.history["val_loss"], rtol=1e-6)
    with pytest.raises(ValueError, match="validation_split works on arrays only"):
        ks.fit(build(), tf.data.Dataset.from_tensor_slices((X, Y)), global_batch_size=16, validation_split=0.25,
               verbose=0)


def test_batched_dataset_keeps_its_size_when_rebatched(recwarn):
    batched = tf.data.Dataset.from_tensor_slices((X, Y)).batch(5)  # 13 batches of 5 (last 4) -> 4 of 16
    ds, _ = prepare_dataset(batched, global_batch_size=16)
    assert int(ds.cardinality()) == 4 == len(list(ds))
    ds, _ = prepare_dataset(batched.map(lambda a, b: (a * 2, b)), global_batch_size=16, drop_remainder=True)
    assert int(ds.cardinality()) == 4 == len(list(ds))
    ds, _ = prepare_dataset(tf.data.Dataset.from_tensor_slices((X[:60], Y[:60])).batch(5), global_batch_size=16,
                            drop_remainder=True)
    assert int(ds.cardinality()) == 3 == len(list(ds))
    filtered = batched.filter(lambda a, b: True)  # unknown size: rebatched, no false claim
    ds, _ = prepare_dataset(filtered, global_batch_size=16)
    assert int(ds.cardinality()) == tf.data.UNKNOWN_CARDINALITY and len(list(ds)) == 4
    ks.fit(build(), batched, global_batch_size=16, epochs=2, strategy="default", verbose=0)
    assert not [w for w in recwarn if "ran out of data" in str(w.message)]


def test_unbatched_dataset_on_a_wrapped_model_says_batch_your_dataset():
    model = ks.wrap(build()(), accum=2)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    with pytest.raises(ValueError, match="batch your dataset"):  # scalar labels: single samples
        model.fit(tf.data.Dataset.from_tensor_slices((X, Y[:, 0])), epochs=1, verbose=0)
    with pytest.raises(ValueError, match="Batch your dataset as the last step"):
        first_of_each = tf.data.Dataset.from_tensor_slices((X, Y[:, 0])).batch(4).map(lambda a, b: (a[0], b[0]))
        prepare_dataset(first_of_each, global_batch_size=16)
    history = model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


@pytest.mark.slow
def test_mirrored_strategy_probe_prints_no_eager_overhead_warning():
    import subprocess
    import sys

    code = ("import numpy as np, keras, keras_scale as ks\n"
            "def build():\n"
            "    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])\n"
            "    m.compile(optimizer='sgd', loss='mse', metrics=['mae'])\n"
            "    return m\n"
            "ks.fit(build, np.ones((32, 4), 'float32'), np.ones((32, 1), 'float32'), global_batch_size=16, "
            "strategy='mirrored', verbose=0)\n"
            "print('trained')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="0"))
    assert out.returncode == 0 and "trained" in out.stdout, out.stderr[-2000:]
    assert "eagerly has significant overhead" not in out.stderr + out.stdout


def test_sync_bn_under_mixed_precision_keeps_loss_scaling(mirrored):
    """The synchronized-BatchNorm copy is compiled outside the builder's dtype policy: with the model's raw
    optimizer it would train mixed_float16 without loss scaling (Keras wraps an optimizer in a LossScaleOptimizer
    only when the compiled model's own policy is mixed_float16). It trains with the builder's LossScaleOptimizer."""
    result = ks.fit(build(batchnorm=True), X, Y, per_replica_batch_size=4, epochs=1, strategy=mirrored,
                    shuffle=False, verbose=0, precision="mixed_float16")
    assert any(layer.synchronized for layer in result.model.layers
               if isinstance(layer, keras.layers.BatchNormalization))
    assert isinstance(result.model.optimizer, keras.optimizers.LossScaleOptimizer), type(result.model.optimizer)
    assert int(result.model.optimizer.iterations.numpy()) > 0
