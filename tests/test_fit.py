"""keras_scale.fit: batch arithmetic, bad input, scope rebuild, data handling, equivalence under 2 replicas."""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.fit import _default_callbacks, _is_batched, _is_file_based, batch_arithmetic, prepare_dataset

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
    assert batch_arithmetic(4, per_replica_batch_size=64, accum=2) == (64, 512)
    assert batch_arithmetic(4, global_batch_size=512, accum=2) == (64, 512)
    assert batch_arithmetic(1, global_batch_size=10) == (10, 10)
    with pytest.raises(ValueError, match="multiple of 8"):
        batch_arithmetic(4, global_batch_size=100, accum=2)
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
    ],
)
def test_bad_arguments_fail_early_with_the_fix(kwargs, error, match, mirrored):
    if kwargs.get("strategy") == "mirrored_2cpu":
        kwargs["strategy"] = mirrored
    with pytest.raises(error, match=match):
        ks.fit(build(), X, Y, verbose=0, **kwargs)


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
    assert "global batch 16 = 8 per replica x 2 replicas x accum 1" in out
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


def test_accum_uses_wrap_and_keeps_the_global_batch(mirrored, capsys):
    ref = reference()
    hist = ks.fit(build(), X, Y, per_replica_batch_size=4, accum=2, epochs=2, strategy=mirrored, shuffle=False,
                  verbose=1)
    assert "global batch 16 = 4 per replica x 2 replicas x accum 2" in capsys.readouterr().out
    assert max_diff(ref.model, ks.unwrap(hist.model)) < 1e-5
    assert int(hist.model.optimizer.iterations.numpy()) == 2 * 64 // 16  # one update per global batch


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


def test_validation_split_is_refused_with_the_alternative():
    with pytest.raises(ValueError, match="pass validation_data=\\(x_val, y_val\\)"):
        ks.fit(build(), X, Y, global_batch_size=16, validation_split=0.2)
