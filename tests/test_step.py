"""The composed step under real lifecycles and real models (issue: never train silently wrong, leave no trace).

Each test is a regression test for a way users broke the pack: a second fit, an exception mid-fit, a model
with its own train_step, MirroredStrategy, uneven batches, masks, sparse gradients.
"""
import warnings

import numpy as np
import pytest
import keras
import tensorflow as tf

import keras_scale as ks
from keras_scale import lifecycle
from keras_scale.callbacks.nan_guard import NanGuardGaveUp
from keras_scale.step import get_step
from tests._helpers import linspace_mlp


def _data(n=64, d=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    w = rng.normal(size=(d, 1)).astype("float32")
    return x, (x @ w).astype("float32")


def _compiled(build=linspace_mlp, strategy=None, lr=1e-2, **compile_kwargs):
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.Adam(lr), loss="mse", metrics=["mae"], **compile_kwargs)
    return model


def _rel(a, b):
    return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12)) for x, y in zip(a, b))


def _replica_values(model):
    """Each replica's copy of every model variable (MirroredStrategy)."""
    return [[v.numpy() for v in var.value.values] for var in model.weights]


# ------------------------------------------------------------------------------------------ leave no trace
def test_mirrored_plain_fit_after_nan_guard_keeps_replicas_in_sync(mirrored):
    """The all-reduce switch must not stay behind: a later plain fit still all-reduces (replicas agree)."""
    x, y = _data()
    model = _compiled(strategy=mirrored)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[ks.NanGuard(verbose=0)])
    twin = _compiled(strategy=mirrored)
    twin.set_weights(model.get_weights())
    with mirrored.scope():
        twin.optimizer.build(twin.trainable_variables)
    for a, b in zip(twin.optimizer.variables, model.optimizer.variables):
        a.assign(b)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    twin.fit(x, y, batch_size=16, epochs=2, verbose=0)
    for copies in _replica_values(model):
        np.testing.assert_array_equal(copies[0], copies[1])
    assert _rel(model.get_weights(), twin.get_weights()) < 1e-6


def test_fit_after_nan_guard_gave_up_trains_normally():
    """An exception skips on_train_end; the next plain fit must not inherit the halted guard."""
    x, y = _data()
    bad = x.copy()
    bad[:] = np.nan
    model = _compiled()
    guard = ks.NanGuard(policy="rollback", max_consecutive=1, max_rollbacks=1, verbose=0)
    with pytest.raises(NanGuardGaveUp):
        model.fit(bad, y, batch_size=16, epochs=3, verbose=0, callbacks=[guard])
    assert lifecycle.pending(model) >= 1  # left behind by the died fit (the guard, the step's switches) ...
    before = [w.copy() for w in model.get_weights()]
    iterations = int(model.optimizer.iterations.numpy())
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)  # ... and undone when the next (plain) fit starts
    assert lifecycle.pending(model) == 0
    assert int(model.optimizer.iterations.numpy()) == iterations + 8
    assert _rel(model.get_weights(), before) > 1e-4
    assert "make_train_function" not in vars(model)


def test_exception_in_user_callback_then_plain_fit_equals_untouched_model():
    x, y = _data()

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise KeyboardInterrupt("user pressed Ctrl-C")

    model = _compiled()
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[ks.NanGuard(policy="stop", verbose=0), Boom()])
    twin = _compiled()
    twin.set_weights(model.get_weights())
    twin.optimizer.build(twin.trainable_variables)
    for a, b in zip(twin.optimizer.variables, model.optimizer.variables):
        a.assign(b)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    twin.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in model.get_weights()]),
                                  np.concatenate([w.ravel() for w in twin.get_weights()]))


def test_second_fit_with_the_same_guard_is_like_a_second_keras_fit_and_does_not_retrace():
    x, y = _data()
    model = _compiled()
    guard = ks.NanGuard(verbose=0)
    h1 = model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[guard])
    traces = get_step(model).traces
    h2 = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[guard])
    assert get_step(model).traces == traces  # the guarded function traced by the first fit is reused
    assert len(h1.history["loss"]) == 1 and len(h2.history["loss"]) == 2
    assert int(model.optimizer.iterations.numpy()) == 12
    # plain fit in between and guard again: still no re-trace of the guarded function
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[guard])
    assert get_step(model).traces == traces


def test_stop_policy_then_rerun_on_fixed_data_trains():
    x, y = _data()
    bad = x.copy()
    bad[20:24] = np.nan
    model = _compiled()
    model.fit(bad, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
              callbacks=[ks.NanGuard(policy="stop", verbose=0)])
    iterations = int(model.optimizer.iterations.numpy())
    assert iterations == 1  # stopped at the bad second batch
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[ks.NanGuard(policy="stop", verbose=0)])
    assert int(model.optimizer.iterations.numpy()) == iterations + 4


# ------------------------------------------------------------------------------------------ the user's model
class _OwnStep(keras.Model):
    """A keras-io style "customizing fit" model: its own train_step (and a counter proving it ran)."""

    def __init__(self):
        super().__init__(name="own_step")
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)
        self.own_steps = self.add_weight(shape=(), initializer="zeros", trainable=False, name="own_steps")

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.own_steps.assign_add(1.0)
        for metric in self.metrics:
            metric.update_state(loss) if metric.name == "loss" else metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def _own_step_model(strategy=None):
    def build():
        model = _OwnStep()
        model(np.zeros((1, 6), "float32"))
        return model

    return _compiled(build, strategy=strategy)


@pytest.mark.parametrize("replicas", [1, 2])
def test_nan_guard_keeps_the_users_own_train_step_and_guards_it(replicas, mirrored):
    strategy = mirrored if replicas == 2 else None
    x, y = _data()
    bad = x.copy()
    bad[16:20] = np.nan  # the second batch
    model = _own_step_model(strategy)
    ref = _own_step_model(strategy)
    ref.set_weights(model.get_weights())
    guard = ks.NanGuard(verbose=0)
    model.fit(bad, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[guard])
    assert float(model.own_steps.numpy()) == 4  # the user's step ran every batch
    assert guard.skipped_steps == 1 and guard.reports[0].source == "inputs"
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert int(model.optimizer.iterations.numpy()) == 3
    # the skipped batch is exactly a no-op: same as training on the three good batches
    keep = np.r_[0:16, 32:64]
    ref.fit(x[keep], y[keep], batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert _rel(model.trainable_weights and [v.numpy() for v in model.trainable_weights],
                [v.numpy() for v in ref.trainable_weights]) < 1e-5


def test_wrap_refuses_an_own_train_step_or_compute_loss_in_wrap_itself():
    with pytest.raises(ValueError, match="defines its own train_step"):
        ks.wrap(_OwnStep(), accum=2)

    class OwnLoss(keras.Model):
        def __init__(self):
            super().__init__(name="own_loss")
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return keras.ops.mean((y - y_pred) ** 2) * 100.0

    with pytest.raises(ValueError, match="compute_loss"):
        ks.wrap(OwnLoss(), accum=2)


def test_unbuilt_subclassed_model_with_nan_guard_and_wrap():
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="net")
            self.a = keras.layers.Dense(8, activation="relu")
            self.b = keras.layers.Dense(1)

        def call(self, x):
            return self.b(self.a(x))

    x, y = _data()
    for make in (lambda: Net(), lambda: ks.wrap(Net(), accum=2)):
        model = make()
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[ks.NanGuard(verbose=0)])
        assert np.isfinite(history.history["loss"]).all()


# ------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("accum", [None, 2])
def test_uneven_per_replica_batches_give_the_global_mean(mirrored, accum):
    """7 samples, batch 4 on 2 replicas: the last batch splits 2/1 (and 1/0): equal to one device."""
    for n in (7, 5):
        x, y = _data(n=n)
        one = ks.wrap(linspace_mlp(), accum=accum) if accum else linspace_mlp()
        one.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        one.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False, callbacks=[ks.NanGuard(verbose=0)])
        with mirrored.scope():
            two = ks.wrap(linspace_mlp(), accum=accum) if accum else linspace_mlp()
            two.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        two.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False, callbacks=[ks.NanGuard(verbose=0)])
        assert _rel(two.get_weights(), one.get_weights()) < 1e-5, n


def _masked_model(vocab=20):
    model = keras.Sequential([keras.Input((7,), dtype="int32"), keras.layers.Embedding(vocab, 4, mask_zero=True),
                              keras.layers.Dense(vocab)])
    model.set_weights([np.linspace(-0.3, 0.3, w.size, dtype="float32").reshape(w.shape) for w in model.get_weights()])
    return model


def _masked_data(n=32, vocab=20, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, vocab, size=(n, 7)).astype("int32")
    lengths = rng.integers(1, 8, size=n)
    for i, length in enumerate(lengths):
        x[i, length:] = 0  # padding: very different valid counts per micro-batch
    y = rng.integers(0, vocab, size=(n, 7)).astype("int32")
    return x, y


@pytest.mark.parametrize("unroll", [False, True])
def test_masked_loss_accumulates_to_the_big_batch_gradient(unroll):
    """Embedding(mask_zero=True) + unroll (IndexedSlices gradients in the unrolled loop too)."""
    x, y = _masked_data()
    weights = {}
    for accum in (None, 4):
        inner = _masked_model()
        model = ks.wrap(inner, accum=accum, unroll=unroll) if accum else inner
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        weights[accum] = inner.get_weights()
    assert _rel(weights[4], weights[None]) < 1e-5


def test_sparse_gradients_with_jit_compile_and_short_last_batch_log_the_right_loss():
    """jit_compile unrolls the loop; a last batch (3) smaller than accum (4) has empty micro-batches that must
    count for nothing, in the update and in the logged loss."""
    x, y = _masked_data(n=35)
    results = {}
    for accum in (None, 4):
        inner = _masked_model()
        model = ks.wrap(inner, accum=accum) if accum else inner
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy",
                      jit_compile=bool(accum))
        history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        results[accum] = (inner.get_weights(), history.history["loss"][0])
    assert _rel(results[4][0], results[None][0]) < 1e-5
    assert np.isfinite(results[4][1])


def test_batch_sum_add_loss_warns_when_accumulating():
    class SumPenalty(keras.layers.Layer):
        def call(self, x):
            self.add_loss(1e-3 * keras.ops.sum(keras.ops.abs(x)))
            return x

    model = ks.wrap(keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), SumPenalty(), keras.layers.Dense(1)]),
                    accum=2)
    model.compile(optimizer="sgd", loss="mse")
    x, y = _data()
    with pytest.warns(UserWarning, match="add_loss"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_skipped_step_restores_each_replicas_own_batchnorm_statistics(mirrored):
    x, y = _data()
    x_bad = x.copy()
    x_bad[16:18] = np.nan  # batch 1, first replica's half
    model = _compiled(lambda: linspace_mlp(bn=True), strategy=mirrored)
    bn = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)][0]
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0, shuffle=False)  # replicas' stats now differ
    before = [v.numpy() for v in bn.moving_mean.value.values]
    assert not np.allclose(before[0], before[1])
    model.fit(x_bad[16:32], y[16:32], batch_size=16, epochs=1, verbose=0, shuffle=False,
              callbacks=[ks.NanGuard(verbose=0)])
    after = [v.numpy() for v in bn.moving_mean.value.values]
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])


# ------------------------------------------------------------------------------------------ refuse clearly
def test_unsupported_strategy_and_native_accumulation_are_refused_at_fit_start():
    x, y = _data()
    central = tf.distribute.experimental.CentralStorageStrategy()
    with central.scope():
        model = linspace_mlp()
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="CentralStorageStrategy"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[ks.NanGuard(verbose=0)])

    model = linspace_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss="mse")
    with pytest.raises(ValueError, match="keras_scale.wrap"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[ks.NanGuard(verbose=0)])


def test_sparse_tensor_and_unbatched_inputs_with_wrap_say_what_to_do():
    x, y = _data()
    model = ks.wrap(linspace_mlp(), accum=2)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="batch your dataset"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y[:, 0])), epochs=1, verbose=0)
    sparse = tf.data.Dataset.from_tensor_slices((tf.sparse.from_dense(x), y)).batch(16)
    with pytest.raises(ValueError, match="SparseTensor"):
        model.fit(sparse, epochs=1, verbose=0)


def test_gradient_non_finite_at_every_loss_scale_is_an_incident():
    """Under mixed_float16 a gradient that stays non-finite would silently collapse the loss scale."""

    class InfGrad(keras.layers.Layer):
        def call(self, x):
            @tf.custom_gradient
            def f(t):
                return t, lambda dy: dy * float("inf")

            return f(x)

    x, y = _data()
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), InfGrad(), keras.layers.Dense(1)])
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0)
    model.compile(optimizer=opt, loss="mse")
    guard = ks.NanGuard(verbose=0)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[guard])
    assert guard.skipped_steps > 0 and guard.reports
    assert guard.reports[0].loss_scale is not None and guard.reports[0].loss_scale <= 1.0
    assert "loss scaling cannot fix" in guard.reports[0].advice


def test_patch_warns_loudly_and_multi_worker_fit_refuses_without_the_fix(monkeypatch):
    from keras_scale import distribute

    monkeypatch.setitem(distribute._FINGERPRINTS, "reduce_per_replica", "a call no Keras has")
    monkeypatch.setattr(distribute, "_patch_state", {"applied": False, "reason": "not attempted"})
    with pytest.warns(RuntimeWarning, match="not patching"):
        assert distribute.patch_keras_multi_worker() is False

    class FakeMultiWorker:  # only is_multi_worker() looks at it
        extended = type("E", (), {"_in_multi_worker_mode": lambda self: True})()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="20585"):
            distribute.require_keras_multi_worker_fix(FakeMultiWorker())


def test_mirrored_validation_batch_that_does_not_split_evenly(mirrored):
    """Keras 3.15 crashes in _maybe_symbolic_build (AddN shape mismatch); the guarded Keras fix handles it."""
    ks.patch_keras_multi_worker()
    x, y = _data(n=64)
    vx, vy = _data(n=7, seed=1)
    model = _compiled(strategy=mirrored)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, validation_data=(vx, vy), validation_batch_size=7)
    assert np.isfinite(history.history["val_loss"]).all()
