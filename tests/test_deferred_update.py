"""The guard's deferred update (keras_scale/deferred_update.py): on one replica the optimizer's update is computed
ahead and written only after the decision. It must train exactly as plain Keras, write nothing on a skipped step,
and step aside (update inside the cond) wherever it is not known to be exact."""
import numpy as np
import pytest
import keras
import tensorflow as tf

import keras_scale as ks
from keras_scale import deferred_update
from tests._models import make_gan, gan_weights, GAN_X

BATCH = 16
RNG = np.random.default_rng(3)
X = RNG.normal(size=(96, 6)).astype("float32")
Y = RNG.integers(0, 3, 96)


def _model(optimizer, bn=True, nan_grad_batch=None):
    """A small classifier; ``nan_grad_batch``: a layer whose gradient (not its output, not the loss) is NaN on the
    batch whose first feature is exactly 7.0."""
    keras.utils.set_random_seed(11)
    layers = [keras.Input((6,))]
    if nan_grad_batch is not None:
        layers.append(_NanGradientOn7())
    layers += [keras.layers.Dense(16, activation="relu")]
    if bn:
        layers.append(keras.layers.BatchNormalization())
    layers.append(keras.layers.Dense(3))
    model = keras.Sequential(layers)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


class _NanGradientOn7(keras.layers.Layer):
    """Identity with a trainable scale whose gradient is NaN on a batch holding the value 7.0 (finite loss)."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        @tf.custom_gradient
        def scaled(x, s):
            def grad(dy):
                poisoned = tf.reduce_any(tf.equal(x, 7.0))
                ds = tf.reduce_sum(dy * x)
                return dy * s, tf.where(poisoned, tf.constant(float("nan")), ds)
            return x * s, grad
        return scaled(x, tf.convert_to_tensor(self.scale))


def _state(model):
    return [np.asarray(v.numpy()).copy() for v in list(model.weights) + list(model.optimizer.variables)]


@pytest.fixture
def deferrals(monkeypatch):
    """How many updates were traced deferred."""
    calls = []
    real = deferred_update.deferred_writes

    def spy(*args, **kwargs):
        calls.append(type(args[0]).__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(deferred_update, "deferred_writes", spy)
    return calls


OPTIMIZERS = {
    "SGD(momentum, nesterov)": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "Adam(amsgrad, clipnorm)": lambda: keras.optimizers.Adam(0.01, amsgrad=True, clipnorm=1.0),
    "AdamW(weight_decay, schedule)": lambda: keras.optimizers.AdamW(ks.WarmupCosine(0.01, total_steps=40,
                                                                                      warmup_steps=3),
                                                                      weight_decay=0.1),
    "RMSprop(centered, momentum)": lambda: keras.optimizers.RMSprop(0.01, centered=True, momentum=0.5),
    "Adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "Adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "Adamax": lambda: keras.optimizers.Adamax(0.01),
    "Nadam": lambda: keras.optimizers.Nadam(0.01),
    "Lion(global_clipnorm)": lambda: keras.optimizers.Lion(0.001, global_clipnorm=1.0),
    "Lamb(weight_decay)": lambda: keras.optimizers.Lamb(0.01, weight_decay=0.01),
    "Ftrl": lambda: keras.optimizers.Ftrl(0.05),
    "Adafactor": lambda: keras.optimizers.Adafactor(0.01),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_deferred_optimizer_trains_exactly_as_plain_keras(name, deferrals):
    plain = _model(OPTIMIZERS[name]())
    h_plain = plain.fit(X, Y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    guarded = _model(OPTIMIZERS[name]())
    h_guarded = guarded.fit(X, Y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                            callbacks=[ks.NanGuard(verbose=0)])
    assert deferrals, "the guarded update was not deferred"
    for a, b in zip(_state(plain), _state(guarded)):  # weights, BatchNorm statistics, every optimizer variable
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(h_guarded.history[key], h_plain.history[key], rtol=1e-6)


@pytest.mark.parametrize("optimizer", [lambda: keras.optimizers.AdamW(0.01, weight_decay=0.5),
                                       lambda: keras.optimizers.SGD(0.05, momentum=0.9)], ids=["AdamW", "SGD"])
def test_a_deferred_update_writes_nothing_on_a_skipped_step(optimizer, deferrals):
    """A finite loss with one NaN gradient: the step is skipped; weight decay, moments, ``iterations`` and
    BatchNorm statistics included, the run equals plain Keras on the data without that batch."""
    x = X.copy()
    x[2 * BATCH, 0] = 7.0  # batch 2's scale gradient is NaN
    guarded = _model(optimizer(), nan_grad_batch=2)
    guard = ks.NanGuard(verbose=0)
    history = guarded.fit(x, Y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[guard])
    assert deferrals and guard.skipped_steps == 1 and history.history["nan_skipped"] == [1]
    assert guard.reports[0].source == "gradients"
    keep = np.r_[0:2 * BATCH, 3 * BATCH:len(x)]
    reference = _model(optimizer(), nan_grad_batch=2)
    reference.fit(x[keep], Y[keep], batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    assert int(guarded.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 5
    for a, b in zip(_state(reference), _state(guarded)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def _sparse_model():
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(20, 4),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


class MyAdam(keras.optimizers.Adam):
    """A user's subclass: its update_step could write anything, so its update stays inside the cond."""


@pytest.mark.parametrize("case", ["over the size limit", "sparse gradients", "LossScaleOptimizer",
                                  "a subclass of Adam", "use_ema"])
def test_where_deferral_is_not_known_exact_the_update_stays_in_the_cond_and_is_still_exact(case, deferrals,
                                                                                          monkeypatch):
    if case == "over the size limit":
        monkeypatch.setattr(deferred_update, "MAX_DEFERRED_BYTES", 0)
    if case == "sparse gradients":
        make = _sparse_model
        x, y = RNG.integers(0, 20, size=(64, 3)).astype("int32"), RNG.normal(size=(64, 1)).astype("float32")
    else:
        optimizer = {"LossScaleOptimizer": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
                     "a subclass of Adam": lambda: MyAdam(0.01),
                     "use_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True)}.get(
            case, lambda: keras.optimizers.Adam(0.01))
        make = lambda: _model(optimizer())  # noqa: E731
        x, y = X, Y
    plain, guarded = make(), make()
    plain.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    guarded.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[ks.NanGuard(verbose=0)])
    assert deferrals == []
    for a, b in zip(_state(plain), _state(guarded)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_a_gan_with_two_optimizers_defers_both_and_trains_as_unguarded(deferrals):
    plain, guarded = make_gan(), make_gan()
    plain.fit(GAN_X, batch_size=16, epochs=2, verbose=0, shuffle=False)
    guarded.fit(GAN_X, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=[ks.NanGuard(verbose=0)])
    assert deferrals.count("Adam") == 2  # the discriminator's and the generator's update, each deferred
    for a, b in zip(gan_weights(plain), gan_weights(guarded)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    for which in ("d_optimizer", "g_optimizer"):
        assert int(getattr(guarded, which).iterations.numpy()) == int(getattr(plain, which).iterations.numpy())


def test_a_gan_whose_generator_update_is_skipped_still_takes_the_discriminators(deferrals):
    gan = make_gan(gen_nan=True)
    g_before = [v.numpy().copy() for v in gan.generator.weights]
    guard = ks.NanGuard(verbose=0)
    gan.fit(GAN_X, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[guard])
    assert int(gan.d_optimizer.iterations.numpy()) == 4 and int(gan.g_optimizer.iterations.numpy()) == 0
    for a, b in zip(g_before, gan.generator.weights):
        np.testing.assert_array_equal(b.numpy(), a)
    assert guard.skipped_steps == 4


def test_an_update_that_writes_a_variable_directly_is_refused_at_trace_time():
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(dense.trainable_variables)
    stray = tf.Variable(0.0)

    @tf.function
    def step():
        def apply():
            stray.assign_add(1.0)  # not through optimizer.assign*: nothing could hold it back
            optimizer.apply([tf.ones(v.shape) for v in dense.trainable_variables], dense.trainable_variables)
        return deferred_update.deferred_writes(optimizer, apply, dense.trainable_variables)

    with pytest.raises(RuntimeError, match="wrote a variable directly"):
        step()
    assert "assign" not in vars(optimizer)  # the optimizer is given back as it was


def test_can_defer_says_no_to_what_it_cannot_do_exactly():
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    grads = [tf.zeros(v.shape) for v in dense.trainable_variables]
    assert not deferred_update.can_defer(keras.optimizers.Adam(), grads, dense.trainable_variables)  # not built
    built = {name: getattr(keras.optimizers, name)() for name in ("Adam", "Muon")}
    accumulating = keras.optimizers.Adam(gradient_accumulation_steps=2)
    for optimizer in [*built.values(), accumulating]:
        optimizer.build(dense.trainable_variables)
    assert deferred_update.can_defer(built["Adam"], grads, dense.trainable_variables)
    # several replicas: the all-reduce already makes every update wait for every gradient (nothing to win)
    assert not deferred_update.can_defer(built["Adam"], grads, dense.trainable_variables, replicas=2)
    assert not deferred_update.can_defer(built["Muon"], grads, dense.trainable_variables)  # writes directly
    assert not deferred_update.can_defer(accumulating, grads, dense.trainable_variables)
    sparse = [tf.IndexedSlices(tf.zeros((1, 2)), tf.constant([0]), tf.constant([3, 2])), grads[1]]
    assert not deferred_update.can_defer(built["Adam"], sparse, dense.trainable_variables)


def test_distributed_variables_are_never_deferred_even_on_one_replica(mirrored):
    """ks.fit(strategy="mirrored") on a machine with one device: a MirroredStrategy of one replica, whose optimizer
    updates each device's copy of a variable: its update stays in the cond (``test_fit``'s slow test trains it)."""
    with mirrored.scope():
        dense = keras.layers.Dense(2)
        dense.build((None, 3))
        optimizer = keras.optimizers.Adam()
        optimizer.build(dense.trainable_variables)
    grads = [tf.zeros(v.shape) for v in dense.trainable_variables]
    assert not deferred_update.can_defer(optimizer, grads, dense.trainable_variables, replicas=1)


class TwoApplies(keras.Model):
    """Its own train_step applies ONE optimizer twice, to two layers' variables (each with its own gradients)."""

    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(4, activation="tanh")
        self.b = keras.layers.Dense(1)

    def call(self, x):
        return self.b(self.a(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            # the norm of an all-zero vector when asked (x's first value 99): a finite loss, NaN gradients
            zero = tf.cast(tf.reduce_any(tf.equal(x, 99.0)), tf.float32)
            loss_a = tf.reduce_mean(tf.square(self.a(x))) + tf.norm(self.a(x) * (1.0 - zero)) * zero
            loss_b = tf.reduce_mean(tf.square(self(x) - y))
        self.optimizer.apply(tape.gradient(loss_a, self.a.trainable_weights), self.a.trainable_weights)
        self.optimizer.apply(tape.gradient(loss_b, self.b.trainable_weights), self.b.trainable_weights)
        return {"loss": loss_b}


def test_one_optimizer_applied_twice_in_a_step_decides_each_apply_on_its_own_as_documented(deferrals):
    """README: such a step applies the finite call and skips the other (it is not all-or-nothing)."""
    keras.utils.set_random_seed(4)
    model = TwoApplies()
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    model(np.zeros((1, 6), "float32"))
    model.optimizer.build(model.trainable_variables)
    x = RNG.normal(size=(32, 6)).astype("float32")
    y = RNG.normal(size=(32, 1)).astype("float32")
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)  # builds; 2 applies: iterations 2
    a_before = [v.numpy().copy() for v in model.a.weights]
    b_before = [v.numpy().copy() for v in model.b.weights]
    bad = x[8:16].copy()
    bad[0, 0] = 99.0  # layer a's gradients are NaN (its loss finite); layer b's are finite
    guard = ks.NanGuard(verbose=0)
    model.fit(bad, y[8:16], batch_size=8, epochs=1, verbose=0, callbacks=[guard])
    assert deferrals.count("Adam") == 2 and guard.skipped_steps == 1
    for before, v in zip(a_before, model.a.weights):
        np.testing.assert_array_equal(v.numpy(), before)  # a's apply skipped
    assert all(not np.array_equal(v.numpy(), before) for before, v in zip(b_before, model.b.weights))  # b's taken
    assert int(model.optimizer.iterations.numpy()) == 3 and all(np.isfinite(v.numpy()).all() for v in model.weights)
