"""The guarded step's all-reduce on 2 replicas: with even (static) per-replica batches no scaling pass at all, and
the gradient check made once on the reduced gradients, each device checking its share (MirroredStrategy: in the
merge_call that decides; the sum of the gradients' norms rides in the all-reduce where there is no merge_call):
still the plain-Keras update, and still no non-finite gradient ever applied, whichever variable's gradient it is and
whichever replica it comes from, including one that overflows only when the replicas' gradients are summed."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.step import get_step

RS = np.random.RandomState(3)
X = RS.rand(32, 4).astype("float32")
Y = RS.rand(32, 1).astype("float32")


def build(strategy, kernel=None):
    with strategy.scope():
        keras.utils.set_random_seed(2)
        if kernel is None:
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                                      keras.layers.Dense(1)])
        else:
            model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(
                1, use_bias=False, kernel_initializer=keras.initializers.Constant(kernel))])
        return model


def compile_(model, strategy):
    with strategy.scope():
        model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


@pytest.mark.parametrize("drop_remainder", [True, False])
@pytest.mark.parametrize("accum", [None, 2])
def test_two_replicas_guarded_step_equals_plain_keras(mirrored, drop_remainder, accum):
    """Even static batches (drop_remainder: the fast path) and dynamic ones (the normaliser path), unsplit and
    split: the guarded step trains to plain Keras's weights under the same strategy."""
    ds = tf.data.Dataset.from_tensor_slices((X[:30], Y[:30])).batch(8, drop_remainder=drop_remainder)
    plain = compile_(build(mirrored), mirrored)
    plain.fit(ds, epochs=2, verbose=0)
    inner = build(mirrored)
    with mirrored.scope():
        model = ks.wrap(inner, accum=accum) if accum else inner
    compile_(model, mirrored)
    guard = ks.NanGuard(verbose=0)
    model.fit(ds, epochs=2, verbose=0, callbacks=[guard])
    assert guard.skipped_steps == 0
    assert int(model.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy())
    for a, b in zip(ks.unwrap(model).get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_a_gradient_that_overflows_only_in_the_all_reduce_is_never_applied(mirrored, drop_remainder):
    """Each replica's gradient is 2.25e38 (finite); their sum, 4.5e38, is not: the step is skipped."""
    x = np.full((2, 1), 1.5e19, "float32")
    y = np.zeros((2, 1), "float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(2, drop_remainder=drop_remainder)
    model = compile_(build(mirrored, kernel=1.0), mirrored)
    guard = ks.NanGuard(verbose=0)
    model.fit(ds, epochs=1, verbose=0, callbacks=[guard])
    assert guard.skipped_steps == 1 and int(model.optimizer.iterations.numpy()) == 0
    assert model.get_weights()[0].item() == 1.0
    assert get_step(model).state_finite()


def test_a_finite_gradient_whose_norm_overflows_is_still_applied(mirrored):
    """Each replica's gradient is 7.5e20 (its square, inside the norm, overflows float32; the reduced 1.5e21 is
    finite): the magnitude is not finite, so the exact check decides, and the step is taken as in plain Keras."""
    x = np.full((2, 1), 1e10, "float32")
    y = np.zeros((2, 1), "float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(2, drop_remainder=True)
    def sgd(model):  # (Adam's squared moment would overflow too and hide the update)
        with mirrored.scope():
            model.compile(keras.optimizers.SGD(1e-21), "mse")
        return model

    plain = sgd(build(mirrored, kernel=7.5))
    plain.fit(ds, epochs=1, verbose=0)
    model = sgd(build(mirrored, kernel=7.5))
    guard = ks.NanGuard(verbose=0)
    model.fit(ds, epochs=1, verbose=0, callbacks=[guard])
    assert guard.skipped_steps == 0 and int(model.optimizer.iterations.numpy()) == 1
    assert model.get_weights()[0].item() != 7.5
    np.testing.assert_array_equal(model.get_weights()[0], plain.get_weights()[0])


@pytest.mark.parametrize("guarded", [False, True])
def test_even_batches_all_reduce_only_the_gradients_and_the_flags(guarded):
    """Static even per-replica batches: one all-reduce per update holding the gradients and the non-finite-loss
    flag (the gradient check reads the reduced gradients); no normaliser (nothing to scale)."""
    from tests.test_accumulation import _CountingReduction

    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8, drop_remainder=True)
    counts = {}
    for arm in ("plain", "ours"):
        ops = _CountingReduction()
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
        inner = build(strategy)
        with strategy.scope():
            model = inner if arm == "plain" else ks.wrap(inner, accum=2)
        compile_(model, strategy)
        callbacks = [ks.NanGuard(verbose=0)] if guarded and arm == "ours" else []
        model.fit(ds, epochs=1, verbose=0, callbacks=callbacks)
        counts[arm] = (ops.calls, ops.tensors)
    assert counts["ours"][0] == counts["plain"][0] > 0
    assert counts["ours"][1] == counts["plain"][1] + 1


class _NanGradientOn7(keras.layers.Layer):
    """``x * scale`` with a trainable vector ``scale`` of ``width`` entries, whose gradient is NaN when ``x`` holds
    7.0 (the loss stays finite)."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.width = width

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(self.width,), initializer="ones", name="scale")

    def call(self, x):
        @tf.custom_gradient
        def scaled(x, s):
            def grad(dy):
                poisoned = tf.reduce_any(tf.equal(x, 7.0))
                ds = tf.reduce_sum(dy * x, axis=0)
                return tf.reduce_sum(dy * s, axis=-1, keepdims=True), tf.where(
                    poisoned, tf.fill(tf.shape(ds), float("nan")), ds)
            return x * s, grad
        return scaled(x, tf.convert_to_tensor(self.scale))


def _branches(strategy, widths=(64, 16, 4, 1)):
    """Parallel branches of different sizes (so the check's shares land on different devices): input column i is
    scaled by branch i's vector of ``widths[i]`` entries, the one that gets the NaN gradient."""
    with strategy.scope():
        keras.utils.set_random_seed(4)
        inp = keras.Input((len(widths),))
        outs = []
        for i, w in enumerate(widths):
            col = keras.layers.Lambda(lambda t, i=i: t[:, i:i + 1])(inp)
            scaled = _NanGradientOn7(w)(col)  # the only trainable variables: 64 entries land on one device, the rest
            outs.append(keras.layers.Lambda(  # on the other
                lambda t: tf.reduce_sum(tf.tanh(t), axis=-1, keepdims=True))(scaled))
        model = keras.Model(inp, keras.layers.Add()(outs))
        model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


@pytest.mark.parametrize("branch", [0, 1, 2, 3])
@pytest.mark.parametrize("replica", [0, 1])
def test_a_non_finite_gradient_of_any_variable_from_either_replica_skips_the_step(mirrored, branch, replica):
    x = RS.rand(16, 4).astype("float32")
    y = RS.rand(16, 1).astype("float32")
    x[8 + replica * 4, branch] = 7.0  # batch 2 (of 8 samples): on replica `replica`, only branch `branch`'s scale
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    model = _branches(mirrored)
    guard = ks.NanGuard(verbose=0)
    model.fit(ds.take(1), epochs=1, verbose=0)
    before = [w.copy() for w in model.get_weights()]
    model.fit(ds.skip(1), epochs=1, verbose=0, callbacks=[guard])
    assert guard.skipped_steps == 1 and int(model.optimizer.iterations.numpy()) == 1
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    assert get_step(model).state_finite()
    # the diagnosis names that variable's gradient alone, with its count (every entry of the replica's gradient)
    report = guard.reports[0]
    assert report.source == "gradients" and len(report.details) == 1, report.details
    assert report.details[0].endswith(f": {(64, 16, 4, 1)[branch]} non-finite values"), report.details


@pytest.mark.parametrize("guarded,accum", [(True, None), (False, 2), (False, 1), (True, 2)])
def test_under_a_loss_scale_optimizer_two_replicas_apply_the_one_device_update(mirrored, guarded, accum):
    """SGD (an update proportional to the gradient, so a gradient summed over the replicas twice shows as 2x):
    the composed step's update under a LossScaleOptimizer on 2 replicas equals plain Keras's on one device, guarded
    or not (the LossScaleOptimizer's own merge_call runs its inner optimizer in replica threads of its own)."""
    rs = np.random.RandomState(0)
    x, y = rs.rand(16, 4).astype("float32"), rs.rand(16, 1).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    models = []
    for strategy in (tf.distribute.get_strategy(), mirrored):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            if accum is not None and strategy is mirrored:
                model = ks.wrap(model, accum=accum)
            model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), "mse")
        models.append(model)
    models[0].fit(ds, epochs=1, verbose=0)
    models[1].fit(ds, epochs=1, verbose=0, callbacks=[ks.NanGuard(verbose=0)] if guarded else [])
    for a, b in zip(models[1].get_weights(), models[0].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad_batch", [False, True])
def test_two_replicas_history_holds_the_epoch_metrics_plain_keras_logs(mirrored, bad_batch):
    """The epoch's logs are the metrics over the epoch, aggregated over the replicas (``get_metrics_result``), as plain
    Keras logs them, not the mean of each replica's own result: the step's extra ``nan_skipped`` key must not make
    Keras fall back to the last step's per-replica logs (a Precision, an AUC or a weighted mean differ). With a
    NaN batch, what plain Keras logs on the data without it."""
    rs = np.random.RandomState(5)
    x = rs.normal(size=(60, 5)).astype("float32")
    y = (rs.uniform(size=(60, 1)) < 0.4).astype("float32")
    w = rs.uniform(0.5, 2.0, size=(60,)).astype("float32")
    xb = x.copy()
    if bad_batch:
        xb[13, 1] = np.nan  # in the second batch of 12
    keep = np.r_[0:12, 24:60] if bad_batch else np.arange(60)

    def fit(data, guarded):
        with mirrored.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1, activation="sigmoid")])
            model.compile(optimizer="sgd", loss="binary_crossentropy",
                          metrics=[keras.metrics.Precision(name="precision"), keras.metrics.AUC(name="auc")],
                          weighted_metrics=["mae"])
        ds = tf.data.Dataset.from_tensor_slices(data).batch(12, drop_remainder=True)
        return model.fit(ds, epochs=2, verbose=0, callbacks=[ks.NanGuard(verbose=0)] if guarded else []).history

    expected = fit((x[keep], y[keep], w[keep]), guarded=False)
    history = fit((xb, y, w), guarded=True)
    assert history["nan_skipped"] == [float(bad_batch)] * 2
    for key in ("loss", "precision", "auc", "mae"):
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-5, err_msg=key)
