"""wrap(model, accum="auto"): an out-of-memory step is retried on the same batch with a finer split.

The OOM is real: ``OomAbove`` asks the allocator for ~2^35 x batch floats (far beyond any machine) when the
batch it sees is larger than its threshold, which raises a recoverable ``ResourceExhaustedError`` (KERAS_FACTS).
It is a test-only layer, not a fake of hardware.
"""
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.auto_accum import AutoAccumGaveUp, next_accum
from keras_scale.callbacks.checkpoint import list_checkpoints
from tests._helpers import StopAfter

X = np.random.RandomState(0).rand(64, 4).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")
NEVER = 10 ** 9


def _oom_if(batch_size, threshold):
    """A real allocator OOM when ``batch_size > threshold`` (the shape is dynamic: nothing is constant-folded)."""
    def allocate():
        # 2^35 floats per sample; the fill value comes from a random op, so Grappler cannot constant-fold it
        value = tf.random.uniform([]) * 0.0
        return tf.reduce_sum(tf.fill(tf.reshape(tf.cast(batch_size, tf.int64) * (2 ** 35), [1]), value)) * 0.0

    return tf.cond(batch_size > threshold, allocate, lambda: tf.constant(0.0))


@keras.saving.register_keras_serializable(package="test_auto_accum")
class OomAbove(keras.layers.Layer):
    """Identity that runs out of memory on batches larger than ``threshold`` (in the forward or backward pass)."""

    def __init__(self, threshold, in_backward=False, **kwargs):
        super().__init__(**kwargs)
        self.threshold = int(threshold)
        self.in_backward = bool(in_backward)

    def call(self, x):
        threshold = self.threshold
        if not self.in_backward:
            return x + _oom_if(tf.shape(x)[0], threshold)

        @tf.custom_gradient
        def identity(t):
            def grad(dy):
                return dy + _oom_if(tf.shape(dy)[0], threshold)
            return tf.identity(t), grad

        return identity(x)

    def get_config(self):
        return {**super().get_config(), "threshold": self.threshold, "in_backward": self.in_backward}


def build(threshold=NEVER, batchnorm=False, in_backward=False, strategy=None, dropout=False):
    def make():
        layers = [keras.Input((4,)), keras.layers.Dense(8, activation="tanh")]
        if batchnorm:
            layers.append(keras.layers.BatchNormalization())
        if dropout:
            layers.append(keras.layers.Dropout(0.3, seed=3))
        layers += [OomAbove(threshold, in_backward=in_backward), keras.layers.Dense(1)]
        model = keras.Sequential(layers)
        model.set_weights([np.linspace(-0.5, 0.5, w.size, dtype="float32").reshape(w.shape)
                           for w in model.get_weights()])
        return model

    if strategy is None:
        return make()
    with strategy.scope():
        return make()


def compile_(model, strategy=None, metrics=("mae",)):
    def do():
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=list(metrics) or None)
    if strategy is None:
        do()
    else:
        with strategy.scope():
            do()
    return model


def weights(model):
    return [np.array(w) for w in ks.unwrap(model).get_weights()]


def assert_close(a, b, atol=2e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=atol)


def plain_reference(ds, epochs=2, strategy=None):
    model = compile_(build(strategy=strategy), strategy)
    history = model.fit(ds, epochs=epochs, verbose=0, shuffle=False)
    return weights(model), history.history, int(model.optimizer.iterations.numpy())


def test_next_accum_halves_the_micro_batch_until_one_sample():
    assert [next_accum(16, a) for a in (1, 2, 4, 8)] == [2, 4, 8, 16]
    assert next_accum(16, 16) is None
    assert next_accum(10, 1) == 2 and next_accum(10, 2) == 4 and next_accum(10, 4) == 5 and next_accum(10, 5) == 10
    for b in range(1, 40):
        a = 1
        while (nxt := next_accum(b, a)) is not None:
            assert -(-b // nxt) < -(-b // a)  # strictly smaller micro-batches every time
            a = nxt
        assert a >= b


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_oom_at_the_first_step_retries_the_same_batch_and_equals_big_batch(tmp_path, capsys, steps_per_execution):
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)  # 4 batches per epoch
    ref_w, ref_hist, ref_iters = plain_reference(ds)

    model = compile_(ks.wrap(build(threshold=4), accum="auto", log_dir=str(tmp_path / "tb")))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    assert model.accum == 1  # starts unsplit
    history = model.fit(ds, epochs=2, verbose=0)

    assert model.accum == 4  # 16 -> 8 -> 4 samples per micro-batch: 4 fits
    auto = model._keras_scale_auto
    assert [(old, new) for _, old, new, _ in auto.changes] == [(1, 2), (2, 4)]
    assert all(step == 0 for step, *_ in auto.changes)  # both at the first batch, before any update
    assert int(model.optimizer.iterations.numpy()) == ref_iters == 8  # no update lost or applied twice
    assert_close(weights(model), ref_w)
    np.testing.assert_allclose(history.history["loss"], ref_hist["loss"], rtol=1e-5)
    np.testing.assert_allclose(history.history["mae"], ref_hist["mae"], rtol=1e-5)

    err = capsys.readouterr().err
    assert err.count("accum=1, micro-batches of 16); training with accum=2") == 1  # each change printed once
    assert err.count("training with accum=4") == 1
    events = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "tb") for f in fs if "tfevents" in f]
    values = [float(tf.make_ndarray(v.tensor)) for e in events for ev in tf.compat.v1.train.summary_iterator(e)
              for v in ev.summary.value if v.tag == "auto_accum/accum"]
    assert values == [2.0, 4.0]


def test_oom_appearing_mid_epoch_from_a_larger_batch():
    # 4 batches of 4, then 2 of 16: the first large batch runs out of memory in the middle of epoch 1
    ds = tf.data.Dataset.from_tensor_slices((X[:16], Y[:16])).batch(4).concatenate(
        tf.data.Dataset.from_tensor_slices((X[16:48], Y[16:48])).batch(16))
    ref_w, ref_hist, _ = plain_reference(ds)

    model = compile_(ks.wrap(build(threshold=5), accum="auto"))
    history = model.fit(ds, epochs=2, verbose=0)
    auto = model._keras_scale_auto
    assert [(step, old, new, size) for step, old, new, size in auto.changes] == [(4, 1, 2, 16), (4, 2, 4, 16)]
    assert int(model.optimizer.iterations.numpy()) == 12
    assert_close(weights(model), ref_w)
    np.testing.assert_allclose(history.history["loss"], ref_hist["loss"], rtol=1e-5)
    np.testing.assert_allclose(history.history["mae"], ref_hist["mae"], rtol=1e-5)  # the failed attempts: not counted


def test_max_micro_batch_size_splits_up_front():
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    ref_w, _, _ = plain_reference(ds, epochs=1)
    model = compile_(ks.wrap(build(threshold=4), accum="auto", max_micro_batch_size=4))
    model.fit(ds, epochs=1, verbose=0)
    assert model.accum == 4 and model._keras_scale_auto.recoveries == 0  # never ran out of memory
    assert_close(weights(model), ref_w)


def test_oom_in_the_backward_pass_restores_batchnorm_statistics_metrics_and_dropout_seed():
    """The failed attempt ran the forward pass (BatchNorm moving statistics, loss/metric accumulators, the
    dropout seed) before
    the backward pass ran out of memory: the retry starts from the state before the attempt, so the run equals
    one that used the final split from the start."""
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    reference = compile_(ks.wrap(build(batchnorm=True, dropout=True), accum=2))
    ref_hist = reference.fit(ds, epochs=2, verbose=0).history

    model = compile_(ks.wrap(build(threshold=8, batchnorm=True, in_backward=True, dropout=True), accum="auto"))
    history = model.fit(ds, epochs=2, verbose=0).history
    assert model.accum == 2 and model._keras_scale_auto.recoveries == 1
    assert_close(weights(model), weights(reference))  # includes the moving mean and variance
    np.testing.assert_allclose(history["loss"], ref_hist["loss"], rtol=1e-6)
    np.testing.assert_allclose(history["mae"], ref_hist["mae"], rtol=1e-6)


def test_frozen_layers_are_not_copied_before_each_step():
    """A fine-tuned model's frozen backbone is never changed by a step: only the state a step can change is
    copied (the trainable layer's BatchNorm statistics, metric accumulators), not the frozen weights."""
    inner = build(threshold=8, batchnorm=True)
    frozen = keras.layers.Dense(4, name="frozen_backbone")
    model_in = keras.Input((4,))
    full = keras.Model(model_in, inner(frozen(model_in)))
    frozen.trainable = False
    model = compile_(ks.wrap(full, accum="auto"))
    model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), epochs=1, verbose=0)
    assert model.accum == 2
    copied = {c.name for c in model._keras_scale_auto._snapshot_components}
    assert any("moving_mean" in n for n in copied) and any("mean_absolute_error" in n for n in copied)
    assert not any("frozen_backbone" in n for n in copied) and frozen.kernel.path not in copied


def test_gives_up_with_advice_when_one_sample_does_not_fit():
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)
    model = compile_(ks.wrap(build(threshold=0), accum="auto"))
    before = weights(model)
    with pytest.raises(AutoAccumGaveUp, match=r"(?s)one sample per micro-batch.*mixed precision.*ks\.remat.*smaller "
                                              r"model.*The error: .*OOM"):
        model.fit(ds, epochs=1, verbose=0)
    assert model.accum == 8
    assert int(model.optimizer.iterations.numpy()) == 0
    assert_close(weights(model), before, atol=0)
    assert issubclass(ks.AutoAccumGaveUp, RuntimeError)


def test_with_nan_guard_and_chief_checkpoint_a_resume_after_an_accum_change_is_exact(tmp_path):
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    full = compile_(ks.wrap(build(threshold=4), accum="auto"))
    full.fit(ds, epochs=3, verbose=0, callbacks=[ks.NanGuard(verbose=0)])
    assert full.accum == 4

    d = str(tmp_path / "ckpt")
    first = compile_(ks.wrap(build(threshold=4), accum="auto"))
    first.fit(ds, epochs=1, verbose=0, callbacks=[ks.NanGuard(verbose=0), ks.ChiefCheckpoint(d, verbose=0)])
    assert first.accum == 4 and list_checkpoints(d)

    # "killed" after epoch 1: a fresh model (starts unsplit again) restored from the checkpoint directory
    resumed = compile_(ks.wrap(build(threshold=4), accum="auto"))
    ckpt = ks.ChiefCheckpoint(d, verbose=0)
    history = resumed.fit(ds, epochs=3, verbose=0, callbacks=[ks.NanGuard(verbose=0), ckpt])
    assert ckpt.restored_from is not None
    assert len(history.epoch) == 2
    assert resumed.accum == 4
    assert int(resumed.optimizer.iterations.numpy()) == int(full.optimizer.iterations.numpy()) == 12
    assert_close(weights(resumed), weights(full), atol=0)


@pytest.mark.parametrize("metrics", [(), ("mae",)])
def test_a_mid_epoch_resume_skips_exactly_the_trained_batches(tmp_path, metrics):
    """ChiefCheckpoint's fast-forward consumes batches from the iterator before our train function fetches the
    next one: a resume in the middle of an epoch, after an accum change, trains each batch exactly once."""
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    full = compile_(ks.wrap(build(threshold=4), accum="auto"), metrics=metrics)
    full.fit(ds, epochs=3, verbose=0)

    d = str(tmp_path / "ckpt")
    first = compile_(ks.wrap(build(threshold=4), accum="auto"), metrics=metrics)
    first.fit(ds, epochs=3, verbose=0, callbacks=[ks.ChiefCheckpoint(d, save_freq=2, verbose=0), StopAfter(6)])
    assert int(first.optimizer.iterations.numpy()) == 6  # stopped at epoch 2, batch 2 of 4

    resumed = compile_(ks.wrap(build(threshold=4), accum="auto"), metrics=metrics)
    resumed.fit(ds, epochs=3, verbose=0, callbacks=[ks.ChiefCheckpoint(d, save_freq=2, verbose=0)])
    assert int(resumed.optimizer.iterations.numpy()) == 12
    assert resumed.accum == 4
    assert_close(weights(resumed), weights(full), atol=0)


def test_two_replicas_agree_and_equal_big_batch(mirrored):
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)  # 8 per replica
    ref_w, ref_hist, _ = plain_reference(ds, strategy=mirrored)
    model = ks.wrap(build(threshold=2, strategy=mirrored), accum="auto")
    compile_(model, mirrored)
    history = model.fit(ds, epochs=2, verbose=0)
    assert model.accum == 4  # per-replica batch 8 -> 4 -> 2
    assert [size for *_, size in model._keras_scale_auto.changes] == [8, 8]
    assert_close(weights(model), ref_w)
    np.testing.assert_allclose(history.history["loss"], ref_hist["loss"], rtol=1e-5)


def test_config_round_trips_auto(tmp_path):
    model = compile_(ks.wrap(build(threshold=4), accum="auto", max_micro_batch_size=8))
    model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), epochs=1, verbose=0)
    assert model.get_config()["accum"] == "auto"
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.auto_accum and loaded.accum == 1 and loaded.max_micro_batch_size == 8
    loaded.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), epochs=1, verbose=0)
    assert loaded.accum == 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(accum="automatic"), "positive int or 'auto'"),
    (dict(accum=2, max_micro_batch_size=4), "only applies to accum='auto'"),
    (dict(accum="auto", max_micro_batch_size=0), "max_micro_batch_size"),
])
def test_bad_arguments_fail_at_wrap(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ks.wrap(build(), **kwargs)


def test_find_micro_batch_reports_the_largest_that_fits_and_changes_nothing():
    model = compile_(build(threshold=5, batchnorm=True, in_backward=True))
    before = weights(model)
    assert ks.find_micro_batch(model, (X[:16], Y[:16])) == 5
    assert ks.find_micro_batch(model, (X[:4], Y[:4])) == 4
    assert_close(weights(model), before, atol=0)  # BatchNorm statistics included
    with pytest.raises(AutoAccumGaveUp, match="one sample"):
        ks.find_micro_batch(compile_(build(threshold=0)), (X[:8], Y[:8]))


def test_find_micro_batch_on_a_wrapped_model_probes_its_inner_model():
    inner = build(threshold=5, batchnorm=True, in_backward=True)
    wrapped = compile_(ks.wrap(inner, accum=2))
    before = weights(inner)
    assert ks.find_micro_batch(wrapped, (X[:16], Y[:16])) == 5  # as for the unwrapped model
    assert_close(weights(inner), before, atol=0)


def test_ks_fit_accum_auto(capsys):
    ref_w, _, _ = plain_reference(tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), epochs=1)
    model = compile_(build(threshold=4))
    history = ks.fit(model, X, Y, per_replica_batch_size=16, accum="auto", epochs=1, strategy="default",
                     shuffle=False, default_callbacks=False)
    assert "global batch 16 = 16 per replica x 1 replica, split into micro-batches only when a step runs out of " \
           "memory (accum auto)" in capsys.readouterr().out
    assert history.model.accum == 4
    assert_close(weights(history.model), ref_w)


# ---------------------------------------------------------------- what auto learns is a SIZE, not a count
def _mixed_sizes():
    """2 batches of 16 (they run out of memory above 4 samples), then 5 batches of 6."""
    return tf.data.Dataset.from_tensor_slices((X[:32], Y[:32])).batch(16).concatenate(
        tf.data.Dataset.from_tensor_slices((X[32:62], Y[32:62])).batch(6))


@pytest.mark.parametrize("how", ["oom", "max_micro_batch_size"])
def test_later_smaller_batches_are_split_by_size_not_by_count(how):
    """After an OOM on 16 samples (micro-batches of 4 fit), a batch of 6 is split into 2 x 3, not 4 x ~1; with
    BatchNorm + Dropout the run equals wrap(micro_batch_size=4), which splits every batch that way."""
    ds = _mixed_sizes()
    reference = compile_(ks.wrap(build(batchnorm=True, dropout=True), micro_batch_size=4))
    ref_hist = reference.fit(ds, epochs=2, verbose=0).history
    kwargs = dict(max_micro_batch_size=4) if how == "max_micro_batch_size" else {}
    model = compile_(ks.wrap(build(threshold=4, batchnorm=True, dropout=True), accum="auto", **kwargs))
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(self.model.accum)

    history = model.fit(ds, epochs=2, verbose=0, callbacks=[Record()]).history
    assert model.auto_micro_batch_size == 4
    assert seen == [4, 4, 2, 2, 2, 2, 2] * 2  # 16 samples: 4 x 4; 6 samples: 2 x 3 (never 4 micro-batches)
    assert model._keras_scale_auto.recoveries == (2 if how == "oom" else 0)
    assert_close(weights(model), weights(reference), atol=0)  # BatchNorm statistics included
    np.testing.assert_allclose(history["loss"], ref_hist["loss"], rtol=1e-6)


def test_a_batch_that_fits_is_not_split_after_an_oom_on_a_larger_one():
    """A batch of 4 after the OOM on 16 (micro-batches of 4 fit) runs unsplit: the same update as plain Keras."""
    ds = tf.data.Dataset.from_tensor_slices((X[:16], Y[:16])).batch(16).concatenate(
        tf.data.Dataset.from_tensor_slices((X[16:32], Y[16:32])).batch(4))
    ref_w, ref_hist, _ = plain_reference(ds, epochs=1)
    model = compile_(ks.wrap(build(threshold=4), accum="auto"))
    model.fit(ds, epochs=1, verbose=0)
    assert model.accum == 1 and model.auto_micro_batch_size == 4
    assert_close(weights(model), ref_w)


def test_a_resume_restores_the_learned_micro_batch_size_and_is_exact(tmp_path):
    """Killed in epoch 2 among the batches of 6, after an OOM on 16 taught micro-batches of 4: a fresh model
    restored from ChiefCheckpoint splits the 6-sample batches 2 x 3 as the interrupted run did (a fresh
    model without the learned size would run them unsplit: 6 fits). BatchNorm + Dropout: bitwise equal."""
    ds = _mixed_sizes()
    full = compile_(ks.wrap(build(threshold=4, batchnorm=True, dropout=True), accum="auto"))
    full.fit(ds, epochs=2, verbose=0, callbacks=[ks.NanGuard(verbose=0)])

    d = str(tmp_path / "ckpt")
    first = compile_(ks.wrap(build(threshold=4, batchnorm=True, dropout=True), accum="auto"))
    first.fit(ds, epochs=2, verbose=0, callbacks=[ks.NanGuard(verbose=0), ks.ChiefCheckpoint(d, save_freq=2,
                                                                                               verbose=0),
                                                   StopAfter(10)])
    assert int(first.optimizer.iterations.numpy()) == 10  # epoch 2, the first batch of 6 done

    resumed = compile_(ks.wrap(build(threshold=4, batchnorm=True, dropout=True), accum="auto"))
    assert resumed.auto_micro_batch_size is None
    resumed.fit(ds, epochs=2, verbose=0, callbacks=[ks.NanGuard(verbose=0), ks.ChiefCheckpoint(d, save_freq=2,
                                                                                                 verbose=0)])
    assert resumed.auto_micro_batch_size == 4 and resumed._keras_scale_auto.recoveries == 0
    assert int(resumed.optimizer.iterations.numpy()) == 14
    assert_close(weights(resumed), weights(full), atol=0)


def test_max_micro_batch_size_of_a_resumed_run_caps_what_the_checkpoint_learned(tmp_path):
    """The first run learned micro-batches of 4 (or none); the rerun asks for at most 2: the cap holds after the
    restore, so no micro-batch exceeds 2 (the README's remedy for a worker that runs out of memory alone)."""
    ds = _mixed_sizes()
    d = str(tmp_path / "ckpt")
    first = compile_(ks.wrap(build(threshold=4), accum="auto"))
    first.fit(ds, epochs=1, verbose=0, callbacks=[ks.ChiefCheckpoint(d, save_freq=2, verbose=0), StopAfter(4)])
    assert first.auto_micro_batch_size == 4
    resumed = compile_(ks.wrap(build(threshold=2), accum="auto", max_micro_batch_size=2))
    resumed.fit(ds, epochs=2, verbose=0, callbacks=[ks.ChiefCheckpoint(d, save_freq=2, verbose=0)])
    assert resumed.auto_micro_batch_size == 2 and resumed._keras_scale_auto.recoveries == 0


def test_train_on_batch_with_numpy_arrays():
    wrapped = compile_(ks.wrap(build(threshold=8), accum="auto"))
    plain = compile_(build())
    for start in range(0, 48, 16):
        wrapped.train_on_batch(X[start:start + 16], Y[start:start + 16])
        plain.train_on_batch(X[start:start + 16], Y[start:start + 16])
    assert wrapped.auto_micro_batch_size == 8
    assert_close(weights(wrapped), weights(plain))


class SubclassedNet(keras.Model):
    def __init__(self, threshold, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(8, activation="tanh", kernel_initializer=keras.initializers.Constant(0.1))
        self.oom = OomAbove(threshold)
        self.d2 = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(-0.2))

    def call(self, x):
        return self.d2(self.oom(self.d1(x)))


@pytest.mark.parametrize("make", [
    lambda t: SubclassedNet(t),
    lambda t: keras.Sequential([keras.layers.Dense(8, activation="tanh",
                                                   kernel_initializer=keras.initializers.Constant(0.1)),
                                OomAbove(t),
                                keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(-0.2))]),
], ids=["subclassed", "sequential_without_input"])
def test_an_unbuilt_model_with_adam_recovers_from_an_oom_at_the_first_step(make):
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    reference = make(NEVER)
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    reference.fit(ds, epochs=1, verbose=0)
    model = ks.wrap(make(4), accum="auto")
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    model.fit(ds, epochs=1, verbose=0)
    assert model.accum == 4 and int(model.optimizer.iterations.numpy()) == 4
    assert_close(weights(model), [np.array(w) for w in reference.get_weights()])


class OomMetric(keras.metrics.Metric):
    """Mean prediction; its update runs out of memory on batches larger than ``threshold``."""

    def __init__(self, threshold=NEVER, name="mean_pred", **kwargs):
        super().__init__(name=name, **kwargs)
        self.threshold = threshold
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        n = tf.shape(y_pred)[0]
        self.total.assign_add(tf.reduce_sum(y_pred) + _oom_if(n, self.threshold))
        self.count.assign_add(tf.cast(n, "float32"))

    def result(self):
        return self.total / self.count


def test_an_oom_in_a_metric_of_an_unsplit_step_is_retried_before_the_update():
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    reference = ks.wrap(build(), accum=4)
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=[OomMetric()])
    ref_hist = reference.fit(ds, epochs=2, verbose=0).history
    model = ks.wrap(build(), accum="auto")
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=[OomMetric(4)])
    history = model.fit(ds, epochs=2, verbose=0).history
    assert model.accum == 4 and int(model.optimizer.iterations.numpy()) == 8
    assert_close(weights(model), weights(reference), atol=0)
    np.testing.assert_allclose(history["mean_pred"], ref_hist["mean_pred"], rtol=1e-6)


def test_ks_fit_accum_auto_writes_the_changes_to_its_log_dir(tmp_path):
    model = compile_(build(threshold=4))
    ks.fit(model, X, Y, per_replica_batch_size=16, accum="auto", epochs=1, strategy="default", shuffle=False,
           default_callbacks=False, log_dir=str(tmp_path / "tb"), verbose=0)
    events = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "tb") for f in fs if "tfevents" in f]
    tags = [v.tag for e in events for ev in tf.compat.v1.train.summary_iterator(e) for v in ev.summary.value]
    assert tags.count("auto_accum/accum") == 2 and tags.count("auto_accum/micro_batch_size") == 2


def test_log_dir_is_checked_at_wrap_and_an_unwritable_one_only_warns(tmp_path):
    with pytest.raises(TypeError, match="log_dir must be a directory path"):
        ks.wrap(build(), accum="auto", log_dir=123)
    with pytest.raises(ValueError, match="log_dir='' is not a directory"):
        ks.wrap(build(), accum="auto", log_dir="")
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    model = compile_(ks.wrap(build(threshold=4), accum="auto", log_dir=str(blocker / "tb"), verbose=0))
    with pytest.warns(RuntimeWarning, match="cannot write TensorBoard scalars"):
        model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), epochs=1, verbose=0)
    assert model.accum == 4 and int(model.optimizer.iterations.numpy()) == 4


def test_verbose_0_prints_no_change(capsys):
    model = compile_(ks.wrap(build(threshold=4), accum="auto", verbose=0))
    model.fit(tf.data.Dataset.from_tensor_slices((X, Y)).batch(16), epochs=1, verbose=0)
    assert model.accum == 4 and "accum='auto'" not in capsys.readouterr().err


def test_an_oom_in_validation_says_to_lower_the_validation_batch():
    model = compile_(ks.wrap(build(threshold=4), accum="auto"))
    with pytest.raises(tf.errors.ResourceExhaustedError, match="validation during fit.*validation_batch_size"):
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0, validation_data=(X[:16], Y[:16]),
                  validation_batch_size=16)
    assert model.accum == 4 and int(model.optimizer.iterations.numpy()) == 4  # training itself recovered
    history = model.fit(X, Y, batch_size=16, epochs=1, verbose=0, validation_data=(X[:16], Y[:16]),
                        validation_batch_size=4)
    assert "val_loss" in history.history


def test_wrapped_weights_files_hold_the_optimizer_like_a_plain_models(tmp_path):
    """Keras's BackupAndRestore (and any save_weights/load_weights resume) gets Adam's state back, and the file
    is a plain model's file: it loads into the unwrapped model, optimizer included."""
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    trained = compile_(ks.wrap(build(threshold=4), accum="auto"))
    trained.fit(ds, epochs=1, verbose=0)
    path = str(tmp_path / "w.weights.h5")
    trained.save_weights(path)
    for fresh in (ks.wrap(build(threshold=4), accum="auto"), build()):
        compile_(fresh)
        fresh.optimizer.build(fresh.trainable_variables)
        fresh.load_weights(path)
        assert int(fresh.optimizer.iterations.numpy()) == 4
        assert_close([np.array(v) for v in fresh.optimizer.variables],
                     [np.array(v) for v in trained.optimizer.variables], atol=0)
        assert_close(weights(fresh), weights(trained), atol=0)
    assert "optimizer" not in vars(trained.inner)  # the inner model only held it while the file was written


def test_embedding_with_adam_warns_once_that_a_split_sums_sparse_rows():
    tokens = np.random.RandomState(1).randint(0, 5, size=(32, 6))
    target = np.random.RandomState(2).rand(32, 1).astype("float32")

    def make():
        return keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(5, 3),
                                 keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])

    model = ks.wrap(make(), accum="auto")
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    with pytest.warns(UserWarning, match="Embedding.*sparse gradient.*Adam"):
        model.fit(tokens, target, batch_size=16, epochs=1, verbose=0)
    sgd = ks.wrap(make(), accum=2)
    sgd.compile(optimizer=keras.optimizers.SGD(1e-2, momentum=0.9), loss="mse", metrics=["mae"])
    import warnings as _warnings
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        sgd.fit(tokens, target, batch_size=16, epochs=1, verbose=0)
    assert not [w for w in caught if "sparse gradient" in str(w.message)]


def test_find_micro_batch_refuses_a_dataset_and_a_bad_max_size():
    model = compile_(build(threshold=5))
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    with pytest.raises(TypeError, match=r"pass one batch, e\.g\. ks\.find_micro_batch\(model, next\(iter\(ds\)\)\)"):
        ks.find_micro_batch(model, ds)
    with pytest.raises(ValueError, match="max_size must be an integer >= 1, got 0"):
        ks.find_micro_batch(model, (X[:8], Y[:8]), max_size=0)
    assert ks.find_micro_batch(model, next(iter(ds))) == 5
