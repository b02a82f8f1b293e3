"""keras_scale.wrap: exact, distributed-aware gradient accumulation."""
import numpy as np
import pytest
import keras
import tensorflow as tf

import keras_scale as ks
from keras_scale.step import get_step

RTOL = 1e-5


def _data(n=96, d=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _mlp(d=8, bn=False, sync_bn=False, dropout=False):
    layers = [keras.Input((d,)), keras.layers.Dense(16, activation="tanh")]
    if bn:
        layers.append(keras.layers.BatchNormalization(synchronized=sync_bn))
    layers.append(keras.layers.Dense(1))
    model = keras.Sequential(layers)
    # deterministic, identical initial weights for every run
    model.set_weights([np.linspace(-0.5, 0.5, w.size, dtype="float32").reshape(w.shape) for w in model.get_weights()])
    return model


def _rel_diff(a, b):
    return max(float(np.linalg.norm(p - q) / (np.linalg.norm(p) + 1e-8)) for p, q in zip(a, b))


def _train(accum=None, strategy=None, optimizer=lambda: keras.optimizers.Adam(1e-2), epochs=2, batch_size=32,
           micro_batch_size=None, model_fn=_mlp, fit_kwargs=None, compile_kwargs=None, data=None):
    strategy = strategy or tf.distribute.get_strategy()
    x, y = data or _data()
    with strategy.scope():
        inner = model_fn()
        model = inner
        if accum or micro_batch_size:
            model = ks.wrap(inner, accum=accum, micro_batch_size=micro_batch_size)
        opt = optimizer()
        model.compile(optimizer=opt, loss="mse", metrics=["mae"], **(compile_kwargs or {}))
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=False, **(fit_kwargs or {}))
    return [w.numpy() for w in inner.weights], history.history, int(opt.iterations.numpy()), model


@pytest.mark.parametrize("optimizer", [lambda: keras.optimizers.SGD(0.1), lambda: keras.optimizers.Adam(1e-2)],
                         ids=["sgd", "adam"])
@pytest.mark.parametrize("accum", [2, 3, 4])
def test_equals_big_batch_training_on_one_device(optimizer, accum):
    # batch 32, 96 samples: 3 steps/epoch; accum=3 gives micro-batches 11/11/10 (uneven split)
    base_w, base_h, base_it, _ = _train(None, optimizer=optimizer)
    w, h, it, _ = _train(accum, optimizer=optimizer)
    assert _rel_diff(base_w, w) < RTOL
    assert it == base_it == 6  # one optimizer update per step, not per micro-batch
    np.testing.assert_allclose(h["loss"], base_h["loss"], rtol=1e-5)
    np.testing.assert_allclose(h["mae"], base_h["mae"], rtol=1e-5)


def test_uneven_last_batch_and_micro_batch_size():
    data = _data(n=90)  # last batch of 26 samples; micro_batch_size=12 -> 3 micro-batches of 9/9/8
    base_w, base_h, _, _ = _train(None, data=data)
    w, h, _, _ = _train(micro_batch_size=12, data=data)
    assert _rel_diff(base_w, w) < RTOL
    np.testing.assert_allclose(h["loss"], base_h["loss"], rtol=1e-5)


def test_sample_weight_gives_the_weighted_big_batch_mean():
    x, y = _data()
    sw = np.linspace(0.0, 3.0, len(x)).astype("float32")
    base_w, _, _, _ = _train(None, fit_kwargs=dict(sample_weight=sw))
    w, _, _, _ = _train(4, fit_kwargs=dict(sample_weight=sw))
    assert _rel_diff(base_w, w) < RTOL


@pytest.mark.parametrize("accum", [None, 4])
def test_equals_big_batch_under_mirrored_strategy(mirrored, accum):
    base_w, base_h, _, _ = _train(None)
    w, h, it, _ = _train(accum, strategy=mirrored)
    assert _rel_diff(base_w, w) < RTOL
    assert it == 6
    np.testing.assert_allclose(h["loss"], base_h["loss"], rtol=1e-5)


def test_clipping_applies_to_the_global_accumulated_gradient(mirrored):
    opt = lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.05)  # noqa: E731 - clip is always active
    one_device, _, _, _ = _train(None, optimizer=opt)
    two_replicas, _, _, _ = _train(4, strategy=mirrored, optimizer=opt)
    assert _rel_diff(one_device, two_replicas) < RTOL
    # Keras itself clips per replica before the all-reduce: it differs (the reason this matters)
    keras_two, _, _, _ = _train(None, strategy=mirrored, optimizer=opt, model_fn=_mlp)
    assert _rel_diff(one_device, keras_two) > 1e-3


def test_ema_and_weight_decay_step_once_per_update():
    opt = lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1, use_ema=True, ema_momentum=0.9)  # noqa: E731
    base_w, _, _, base_model = _train(None, optimizer=opt)
    w, _, _, model = _train(4, optimizer=opt)
    assert _rel_diff(base_w, w) < RTOL
    ema = [v.numpy() for v in model.optimizer._model_variables_moving_average]
    base_ema = [v.numpy() for v in base_model.optimizer._model_variables_moving_average]
    assert _rel_diff(base_ema, ema) < RTOL


def test_steps_per_execution_and_jit_compile():
    base_w, _, _, _ = _train(None)
    w, _, _, _ = _train(4, compile_kwargs=dict(steps_per_execution=3))
    assert _rel_diff(base_w, w) < RTOL
    w, _, _, model = _train(4, compile_kwargs=dict(jit_compile=True))
    assert _rel_diff(base_w, w) < RTOL
    assert get_step(model).traced_micro_batches == 4  # XLA uses the statically unrolled micro-batch loop


def test_unrolled_loop_equals_while_loop_and_round_trips(tmp_path):
    base_w, _, _, _ = _train(None)
    w, _, _, model = _train(None, model_fn=lambda: ks.wrap(_mlp(), accum=4, unroll=True))
    assert get_step(model).traced_micro_batches == 4
    assert _rel_diff(base_w, w) < RTOL
    path = str(tmp_path / "u.keras")
    model.save(path)
    assert keras.models.load_model(path).unroll is True
    with pytest.raises(ValueError, match="unroll"):
        ks.wrap(_mlp(), accum=2, unroll="yes")


def _multi_io_model():
    a = keras.Input((5,), name="a")
    b = keras.Input((3,), name="b")
    h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b}, {"out1": keras.layers.Dense(1, name="out1")(h),
                                           "out2": keras.layers.Dense(2, name="out2")(h)})
    model.set_weights([np.linspace(-0.3, 0.3, w.size, dtype="float32").reshape(w.shape) for w in model.get_weights()])
    return model


def test_dict_inputs_and_multi_output():
    rng = np.random.default_rng(3)
    x = {"a": rng.normal(size=(64, 5)).astype("float32"), "b": rng.normal(size=(64, 3)).astype("float32")}
    y = {"out1": rng.normal(size=(64, 1)).astype("float32"), "out2": rng.normal(size=(64, 2)).astype("float32")}
    results = []
    for accum in (None, 4):
        inner = _multi_io_model()
        model = ks.wrap(inner, accum=accum) if accum else inner
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss={"out1": "mse", "out2": "mae"})
        h = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        results.append(([w.numpy() for w in inner.weights], h.history["loss"]))
    assert _rel_diff(results[0][0], results[1][0]) < RTOL
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5)


def test_evaluate_predict_save_load_and_unwrap(tmp_path):
    x, y = _data()
    _, _, _, model = _train(4)
    inner = ks.unwrap(model)
    assert inner is model.inner and all(a is b for a, b in zip(inner.weights, model.weights))
    np.testing.assert_allclose(model.predict(x, verbose=0), inner.predict(x, verbose=0))
    path = str(tmp_path / "wrapped.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, ks.AccumulatingModel) and loaded.accum == 4
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    assert loaded.evaluate(x, y, verbose=0)[0] == pytest.approx(model.evaluate(x, y, verbose=0)[0], rel=1e-6)
    # weights files interchange between wrapped and unwrapped models
    wpath = str(tmp_path / "w.weights.h5")
    model.save_weights(wpath)
    fresh = _mlp()
    fresh.set_weights([np.zeros_like(w) for w in fresh.get_weights()])
    fresh.load_weights(wpath)
    np.testing.assert_allclose(fresh.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)


def test_loss_scale_optimizer_skips_an_overflowing_update_once():
    """mixed_float16: scale per micro-batch, unscale once, one finite decision per update."""
    x, y = _data()
    y = y * 100.0  # gradients ~1e2: times the initial scale 2^127 they overflow float32 (3.4e38)
    results = {}
    for accum in (None, 4):
        inner = _mlp()
        model = ks.wrap(inner, accum=accum) if accum else inner
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0 ** 127)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
        weights = [w.numpy() for w in inner.weights]
        assert all(np.isfinite(w).all() for w in weights)
        results[accum] = (weights, float(opt.dynamic_scale.numpy()), int(opt.iterations.numpy()))
    # overflowing updates are skipped and the scale halved until finite, exactly as unwrapped
    assert results[4][1] == results[None][1] < 2.0 ** 127
    assert results[4][2] == results[None][2] < 6  # skipped updates do not count
    assert _rel_diff(results[None][0], results[4][0]) < RTOL


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_policies_train_finite(policy):
    keras.mixed_precision.set_global_policy(policy)
    try:
        x, y = _data()
        inner = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1, dtype="float32")])
        model = ks.wrap(inner, accum=4)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) == (policy == "mixed_float16")
        h = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
        assert np.isfinite(h.history["loss"]).all()
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_batchnorm_per_micro_batch_and_synchronized_bn(mirrored):
    # BatchNorm: each micro-batch normalised with its own statistics, moving stats updated per micro-batch
    x, y = _data()
    _, _, _, model = _train(4, model_fn=lambda: _mlp(bn=True), epochs=1)
    bn = [l for l in model.inner.layers if isinstance(l, keras.layers.BatchNormalization)][0]
    assert not np.allclose(bn.moving_mean.numpy(), 0.0)
    # synchronized BN all-reduces inside the forward pass: the step unrolls the micro-batch loop
    w, h, it, model = _train(4, strategy=mirrored, model_fn=lambda: _mlp(bn=True, sync_bn=True), epochs=1)
    assert get_step(model).traced_micro_batches == 4 and it == 3
    assert np.isfinite(h["loss"]).all()
    # synchronized BN normalises each micro-batch over both replicas (2 x 4 samples = 8): the same statistics
    # as unsynchronized BN on one device with 8-sample micro-batches, so the weights match
    # one device, 4 micro-batches of 8: order each batch so micro-batch k holds the samples that replica 0 and
    # replica 1 put in their micro-batch k (replica r holds batch rows 16r..16r+15)
    x, y = _data()
    order = np.concatenate([b * 32 + np.r_[4 * k:4 * k + 4, 16 + 4 * k:16 + 4 * k + 4]
                            for b in range(3) for k in range(4)])
    one, _, _, _ = _train(None, model_fn=lambda: ks.wrap(_mlp(bn=True), accum=4), epochs=1, batch_size=32,
                          data=(x[order], y[order]))
    assert _rel_diff(one, w) < 1e-5


class _CountingReduction(tf.distribute.ReductionToOneDevice):
    """Cross-device ops that count the all-reduces traced into the train step (and the tensors in them)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.tensors = 0

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self.calls += 1
        self.tensors += len(value_destination_pairs)
        self._nested = True
        try:
            return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)
        finally:
            self._nested = False

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        if not getattr(self, "_nested", False):  # the batch version reduces tensor by tensor through here
            self.calls += 1
            self.tensors += 1
        return super().reduce_implementation(reduce_op, per_replica_value, destinations, options)


@pytest.mark.parametrize("accum, samples", [(4, 96), (8, 96), (4, 90)])
def test_one_all_reduce_per_update_whatever_accum(accum, samples):
    """Communication: the traced step all-reduces once per update (like plain Keras), never per micro-batch."""
    counts = {}
    for a in (None, accum):
        ops = _CountingReduction()
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
        _train(a, strategy=strategy, epochs=1, data=_data(n=samples))
        counts[a] = (ops.calls, ops.tensors)
    plain_calls, plain_tensors = counts[None]
    calls, tensors = counts[accum]
    assert plain_calls > 0
    # same number of all-reduce calls as Keras's own step; extra scalars ride along in the same call: the
    # non-finite-loss flag and, when the replicas' batches can be uneven (90 samples: a last batch of 26, so the
    # batch size is not static), the batch's normaliser for the global mean
    assert calls == plain_calls and tensors == plain_tensors + (1 if samples % 32 == 0 else 2)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(accum=0), ValueError),
        (dict(accum=2.5), ValueError),
        (dict(accum="4"), ValueError),
        (dict(), ValueError),
        (dict(accum=2, micro_batch_size=8), ValueError),
        (dict(micro_batch_size=0), ValueError),
    ],
)
def test_bad_input(kwargs, error):
    with pytest.raises(error, match="accum|micro_batch_size"):
        ks.wrap(_mlp(), **kwargs)


def test_not_a_model_and_batch_smaller_than_accum():
    with pytest.raises(TypeError, match="keras.Model"):
        ks.wrap(keras.layers.Dense(3), accum=2)
    model = ks.wrap(_mlp(), accum=8)
    model.compile(optimizer="sgd", loss="mse")
    x, y = _data()
    with pytest.raises(ValueError, match="fewer than accum=8"):
        model.fit(x, y, batch_size=4, verbose=0)
