"""What fit logs (History, progress bar, CSVLogger, TensorBoard) equals what plain Keras logs for the same batches,
or is NaN for steps not taken; and the edges of the split itself (empty micro-batches, OOM retries, partial last
batches, already-batched zips) change nothing silently. Each test compares against plain Keras on the same batches.
"""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.step import get_step

RS = np.random.RandomState(0)
X = RS.rand(24, 4).astype("float32")
Y = RS.rand(24, 1).astype("float32")
Y2 = RS.rand(24, 2).astype("float32")


def dense():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])


def two_outputs():
    keras.utils.set_random_seed(1)
    i = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh")(i)
    return keras.Model(i, [keras.layers.Dense(1, name="a")(h), keras.layers.Dense(2, name="b")(h)])


def masked_sequence():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6, 3)), keras.layers.Masking(), keras.layers.Dense(4),
                             keras.layers.Dense(1)])


def batchnorm():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                             keras.layers.Dense(1)])


def weights(model):
    return [np.array(w) for w in ks.unwrap(model).get_weights()]


def assert_history_equal(plain, ours, rtol=1e-5):
    ours = {k: v for k, v in ours.items() if k != "nan_skipped"}
    assert sorted(plain) == sorted(ours)
    for key in plain:
        np.testing.assert_allclose(ours[key], plain[key], rtol=rtol, err_msg=key)


def fit(model, x, y, batch_size, **kw):
    kw.setdefault("verbose", 0)
    return model.fit(x, y, batch_size=batch_size, shuffle=False, **kw).history


# ------------------------------------------------------------------------------------------- logged numbers
@pytest.mark.parametrize("how", ["nan_targets", "poisoned_state_loss_only_guard"])
def test_an_epoch_with_every_step_skipped_logs_nan_and_is_never_the_best(how, tmp_path):
    """A good fit, then one whose every step is skipped: its epoch logs NaN (not 0.0, which plain Keras never logs
    for those batches), so ModelCheckpoint(save_best_only=True) keeps the good model as the best."""
    model = ks.wrap(dense(), accum=2)
    model.compile("sgd", "mse", metrics=["mae"])
    best = str(tmp_path / "best.weights.h5")
    saver = keras.callbacks.ModelCheckpoint(best, monitor="loss", save_best_only=True, save_weights_only=True)
    good = fit(model, X, Y, 8, callbacks=[ks.NanGuard(verbose=0), saver])
    assert saver.best == good["loss"][0]
    y = Y
    if how == "nan_targets":
        guard, y = ks.NanGuard(verbose=0), np.full_like(Y, np.nan)
    else:
        guard = ks.NanGuard(check_gradients=False, verbose=0)
        kernel = ks.unwrap(model).layers[0].kernel
        kernel.assign(np.full(kernel.shape, np.nan, "float32"))
    history = fit(model, X, y, 8, callbacks=[guard, saver])
    assert history["nan_skipped"] == [3.0]
    assert np.isnan(history["loss"][0]) and np.isnan(history["mae"][0])  # not 0.0: no step was taken
    assert saver.best == good["loss"][0]  # the all-skipped epoch is never "the best"
    saved = dense()
    saved.load_weights(best)
    assert all(np.isfinite(w).all() for w in saved.get_weights())


@pytest.mark.parametrize("accum", [1, 2])
def test_a_skipped_step_contributes_nothing_to_the_logged_loss_and_metrics(accum):
    """Batch 0 holds one NaN target among finite ones: the guard skips the step, and the logged loss and MAE are
    those of plain Keras trained on batches 1-2 only (the skipped step's finite micro-batch is not counted)."""
    y = Y.copy()
    y[2] = np.nan
    plain = dense()
    plain.compile("sgd", "mse", metrics=["mae"])
    expected = fit(plain, X[8:], Y[8:], 8)
    model = ks.wrap(dense(), accum=accum) if accum > 1 else dense()
    model.compile("sgd", "mse", metrics=["mae"])
    guard = ks.NanGuard(verbose=0)
    history = fit(model, X, y, 8, callbacks=[guard])
    assert history["nan_skipped"] == [1.0]
    assert_history_equal(expected, history)
    np.testing.assert_allclose(weights(model)[0], weights(plain)[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("unroll", [False, True])
def test_per_output_losses_of_a_two_output_model_equal_plain_keras(unroll):
    """Batches of 10, 10, 4 split into 3 micro-batches each (4+3+3, 2+1+1): History keys and values as plain."""
    plain = two_outputs()
    plain.compile("sgd", ["mse", "mae"], loss_weights=[1.0, 0.5], metrics=[["mae"], ["mse"]])
    expected = fit(plain, X, [Y, Y2], 10, epochs=2)
    model = ks.wrap(two_outputs(), accum=3, unroll=unroll)
    model.compile("sgd", ["mse", "mae"], loss_weights=[1.0, 0.5], metrics=[["mae"], ["mse"]])
    history = fit(model, X, [Y, Y2], 10, epochs=2)
    assert_history_equal(expected, history)
    for a, b in zip(weights(model), weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_masked_sequence_models_logged_loss_equals_plain_keras():
    lengths = RS.randint(1, 7, size=24)
    seqs = np.zeros((24, 6, 3), "float32")
    for i, t in enumerate(lengths):
        seqs[i, :t] = RS.rand(t, 3) + 0.1
    targets = RS.rand(24, 6, 1).astype("float32")
    plain = masked_sequence()
    plain.compile("sgd", "mse")
    expected = fit(plain, seqs, targets, 12, epochs=2)
    model = ks.wrap(masked_sequence(), accum=3)
    model.compile("sgd", "mse")
    history = fit(model, seqs, targets, 12, epochs=2)
    assert_history_equal(expected, history)
    for a, b in zip(weights(model), weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------- edges of the split
@pytest.mark.parametrize("how", ["unroll", "jit_compile"])
@pytest.mark.parametrize("guarded", [False, True])
def test_a_batch_smaller_than_accum_leaves_the_surplus_micro_batches_empty(how, guarded):
    """10 samples in batches of 8 with accum=4: the last batch (2 samples) runs 2 micro-batches of 1; the 2
    surplus unrolled micro-batches do nothing (no BatchNorm update, no gradient, no incident): the model equals
    the while-loop split of the same batches."""
    def train(jit_compile=False, **wrap_kw):
        model = ks.wrap(batchnorm(), accum=4, **wrap_kw)
        model.compile("sgd", "mse", jit_compile=jit_compile)
        guard = ks.NanGuard(verbose=0)
        fit(model, X[:10], Y[:10], 8, callbacks=[guard] if guarded else [])
        return model, guard

    reference, _ = train(unroll=False)
    model, guard = train(unroll=True) if how == "unroll" else train(jit_compile=True, unroll=None)
    if how == "jit_compile":
        assert get_step(model).traced_micro_batches == 4  # XLA: the unrolled loop
    assert guard.reports == [] and int(get_step(model).skipped_steps.numpy()) == 0
    for a, b in zip(weights(model), weights(reference)):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_auto_accum_counts_a_nan_batch_retried_after_an_oom_once_with_the_loss_only_guard():
    """accum="auto", NanGuard(check_gradients=False, policy="rollback", max_consecutive=2): batch 0 has NaN
    targets and its first (unsplit) attempt runs out of memory in the backward pass; the retry skips it. It is ONE
    bad step, as with the fixed split: no rollback."""
    from tests.test_auto_accum import build, compile_

    y = Y.copy()
    y[:8] = np.nan
    model = compile_(ks.wrap(build(threshold=4, in_backward=True), accum="auto", verbose=0))
    guard = ks.NanGuard(policy="rollback", max_consecutive=2, check_gradients=False, verbose=0)
    model.fit(X, y, batch_size=8, shuffle=False, verbose=0, callbacks=[guard])
    assert model._keras_scale_auto.recoveries >= 1  # the OOM really happened
    assert int(get_step(model).skipped_steps.numpy()) == 1
    assert guard.rollbacks == 0


def test_ks_fit_with_synchronized_batchnorm_and_accum_drops_a_last_batch_too_small_once(mirrored, capsys):
    """2 replicas, per-replica 8, accum 4, 34 samples: the last global batch (2 samples, 1 per replica) cannot fill
    4 micro-batches with synchronized BatchNorm: dropped each epoch, said once, instead of crashing after the
    epoch trained."""
    def build():
        model = batchnorm()
        model.compile(keras.optimizers.SGD(0.01), "mse")
        return model

    x = np.concatenate([X, X[:10]])
    y = np.concatenate([Y, Y[:10]])
    history = ks.fit(build, x, y, per_replica_batch_size=8, accum=4, sync_bn=True, strategy=mirrored, epochs=2,
                     default_callbacks=False, verbose=1)
    out = capsys.readouterr().out
    assert out.count("is dropped") == 1 and "2 samples: 1 per replica" in out
    assert int(history.model.optimizer.iterations.numpy()) == 4  # 2 full batches x 2 epochs
    assert all(np.isfinite(w).all() for w in weights(history.model))


def test_ks_fit_does_not_batch_a_zip_of_batched_datasets_again():
    xs = tf.data.Dataset.from_tensor_slices(X).batch(4)
    ys = tf.data.Dataset.from_tensor_slices(Y).batch(4)
    model = dense()
    model.compile("sgd", "mse")
    ks.fit(model, tf.data.Dataset.zip((xs, ys)), global_batch_size=8, epochs=1, default_callbacks=False, verbose=0)
    plain = dense()
    plain.compile("sgd", "mse")
    plain.fit(X, Y, batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(weights(model), weights(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_ks_fit_refuses_a_zip_of_batched_and_unbatched_datasets():
    zipped = tf.data.Dataset.zip((tf.data.Dataset.from_tensor_slices(X).batch(4), tf.data.Dataset.from_tensor_slices(Y)))
    model = dense()
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="zips batched and unbatched"):
        ks.fit(model, zipped, global_batch_size=8, default_callbacks=False, verbose=0)
