"""The guarded step's all-reduce on 2 replicas: with even (static) per-replica batches no scaling pass at all, and
the gradient check folded into the all-reduce (the sum of the gradients' norms rides along): still the plain-Keras update, and still
no non-finite gradient ever applied, including one that overflows only when the replicas' gradients are summed."""
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
    """Static even per-replica batches: one all-reduce per update holding the gradients, the non-finite-loss flag
    and (guarded) the gradients' magnitude; no normaliser (nothing to scale)."""
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
    assert counts["ours"][1] == counts["plain"][1] + (2 if guarded else 1)
