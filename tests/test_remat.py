"""keras_scale.remat: gradients equal the plain model's, in fit, under MirroredStrategy, in a while loop."""
import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_scale as ks
from keras_scale.remat import Remat, remat, remat_model


class CountingDense(keras.layers.Dense):
    """A Dense layer that counts how many times its call is traced/run (to prove recomputation)."""

    calls = 0

    def call(self, inputs):
        CountingDense.calls += 1
        return super().call(inputs)


def _mlp(use_remat, dropout=0.0, width=16, depth=3, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    x = inputs
    for _ in range(depth):
        layer = keras.layers.Dense(width, activation="tanh")
        x = (remat(layer) if use_remat else layer)(x)
        if dropout:
            drop = keras.layers.Dropout(dropout, seed=3)
            x = (remat(drop) if use_remat else drop)(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


def _data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _grads(model, x, y):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    return [g.numpy() for g in step(x, y)]


def _max_diff(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_gradients_equal_plain_model_in_graph_mode(dropout):
    plain, rematted = _mlp(False, dropout), _mlp(True, dropout)
    rematted.set_weights(plain.get_weights())
    x, y = _data()
    g_plain, g_remat = _grads(plain, x, y), _grads(rematted, x, y)
    assert len(g_plain) == len(g_remat) == 8
    assert all(np.any(g != 0) for g in g_remat)
    # Dropout: the recomputation must redraw the forward pass's mask, else the gradients differ.
    assert _max_diff(g_plain, g_remat) < 1e-6


def test_block_is_recomputed_in_backward_pass():
    x, y = _data(8)
    counts = {}
    for use in (False, True):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        layer = CountingDense(4)
        model = keras.Model(inputs, (remat(layer) if use else layer)(inputs))
        CountingDense.calls = 0
        _grads(model, x, y[:, :1].repeat(4, axis=1))
        counts[use] = CountingDense.calls
    # Traced once for the forward pass; with remat once more inside the gradient (the recomputation).
    assert counts[True] == counts[False] + 1


def test_recomputation_uses_the_forward_weights_even_after_an_update():
    """In a train step the optimizer may update a block's variables while other gradients still need the
    recomputation; the recomputation must see the forward pass's weights. Forced here: update the weights
    between two gradient calls of one persistent tape, then ask for the input gradient."""
    x, y = _data(8)
    results = []
    for use in (False, True):
        model = _mlp(use)
        if use:
            model.set_weights(start)
        else:
            start = model.get_weights()

        @tf.function
        def step(x, y):
            x = tf.convert_to_tensor(x)
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(x)
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            for variable, grad in zip(model.trainable_variables, grads):
                variable.assign_sub(0.5 * grad)
            return tape.gradient(loss, x)

        results.append(step(x, y).numpy())
    np.testing.assert_allclose(results[1], results[0], atol=1e-6)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_matches_plain_model_single_device(jit_compile):
    x, y = _data()
    plain, rematted = _mlp(False), _mlp(True)
    rematted.set_weights(plain.get_weights())
    for m in (plain, rematted):
        m.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=jit_compile)
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert _max_diff(plain.get_weights(), rematted.get_weights()) < 1e-6
    assert _max_diff(plain.get_weights(), _mlp(False).get_weights()) > 1e-3  # it did train


def test_fit_under_mirrored_strategy_matches_plain(mirrored):
    x, y = _data()
    with mirrored.scope():
        plain, rematted = _mlp(False, dropout=0.25), _mlp(True, dropout=0.25)
        rematted.set_weights(plain.get_weights())
        for m in (plain, rematted):
            m.compile(keras.optimizers.SGD(0.1), "mse")
    for m in (plain, rematted):
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert _max_diff(plain.get_weights(), rematted.get_weights()) < 1e-5


def test_gradients_equal_inside_while_loop_over_micro_batches():
    """The shape `keras_scale.wrap` uses: gradients summed over micro-batches in a tf.while_loop."""
    x, y = _data(32)
    plain, rematted = _mlp(False, dropout=0.5), _mlp(True, dropout=0.5)
    rematted.set_weights(plain.get_weights())

    def accumulated(model):
        @tf.function
        def step(x, y):
            xs, ys = tf.reshape(x, (4, 8, 8)), tf.reshape(y, (4, 8, 1))
            acc = [tf.zeros_like(v) for v in model.trainable_variables]

            def body(i, acc):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(xs[i], training=True) - ys[i]) ** 2)
                grads = tape.gradient(loss, model.trainable_variables)
                return i + 1, [a + g for a, g in zip(acc, grads)]

            return tf.while_loop(lambda i, _: i < 4, body, (tf.constant(0), acc))[1]

        return [g.numpy() for g in step(x, y)]

    assert _max_diff(accumulated(plain), accumulated(rematted)) < 1e-6


def test_with_keras_scale_wrap(mirrored):
    accumulation = pytest.importorskip("keras_scale.accumulation")
    x, y = _data(32)
    weights = {}
    for use in (False, True):
        with mirrored.scope():
            model = accumulation.wrap(_mlp(use), accum=2)
            model.compile(keras.optimizers.SGD(0.1), "mse")
        if use:
            model.set_weights(weights[False][0])
        start = model.get_weights()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        weights[use] = (start, model.get_weights())
    assert _max_diff(weights[False][1], weights[True][1]) < 1e-5
    assert _max_diff(weights[True][0], weights[True][1]) > 1e-4


def test_remat_model_rewires_selected_layers_and_shares_weights():
    plain = _mlp(False)
    rematted = remat_model(plain, select=lambda layer: isinstance(layer, keras.layers.Dense) and layer.units == 16)
    kinds = [type(layer).__name__ for layer in rematted.layers]
    assert kinds.count("Remat") == 3
    assert rematted.trainable_variables[0] is plain.trainable_variables[0]
    x, y = _data()
    np.testing.assert_allclose(rematted.predict(x, verbose=0), plain.predict(x, verbose=0), atol=1e-6)
    assert _max_diff(_grads(plain, x, y), _grads(rematted, x, y)) < 1e-6


def test_saved_model_round_trip(tmp_path):
    model = _mlp(True)
    x, _ = _data()
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert any(isinstance(layer, Remat) for layer in loaded.layers)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)


def test_public_name_is_callable_even_after_module_import():
    import keras_scale.remat  # noqa: F401  (binds the package attribute to the module)

    assert isinstance(ks.remat(keras.layers.Dense(2)), Remat)


def test_bad_input_raises_clear_errors():
    with pytest.raises(TypeError, match="expects a keras Layer"):
        remat(keras.ops.ones((2, 2)))
    with pytest.raises(ValueError, match="already rematerialized"):
        remat(remat(keras.layers.Dense(2)))
    with pytest.raises(ValueError, match="chose no layer"):
        remat_model(_mlp(False), select=lambda layer: False)

    class Sub(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(TypeError, match="subclassed"):
        remat_model(Sub())


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_multi_input_attention_block_with_dropout_trains_like_plain(policy):
    """Several tensor inputs (query, value), dropout inside the block, a mixed policy: same weights after fit."""
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(16, 6, 16)).astype("float32"), rng.normal(size=(16, 5, 16)).astype("float32")]
    y = rng.normal(size=(16, 1)).astype("float32")

    def build(use):
        keras.utils.set_random_seed(0)
        query, value = keras.Input((6, 16)), keras.Input((5, 16))
        attention = keras.layers.MultiHeadAttention(2, 8, dropout=0.3, dtype=policy)
        h = (remat(attention) if use else attention)(query, value)
        out = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(h))
        model = keras.Model([query, value], out)
        model.compile(keras.optimizers.SGD(0.1), "mse")
        return model

    plain, rematted = build(False), build(True)
    rematted.set_weights(plain.get_weights())
    start = plain.get_weights()
    for model in (plain, rematted):
        keras.utils.set_random_seed(1)
        model.fit(xs, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert _max_diff(plain.get_weights(), rematted.get_weights()) < 1e-6
    assert _max_diff(plain.get_weights(), start) > 1e-3


def test_subclassed_model_with_remat_blocks_built_on_first_eager_call():
    class Net(keras.Model):
        def __init__(self, use):
            super().__init__()
            wrap = remat if use else (lambda layer: layer)
            self.blocks = [wrap(keras.Sequential([keras.layers.Dense(32, activation="relu"), keras.layers.Dense(8)]))
                           for _ in range(3)]
            self.head = keras.layers.Dense(1)

        def call(self, x, training=False):
            for block in self.blocks:
                x = x + block(x, training=training)
            return self.head(x)

    x, y = _data()
    models = []
    for use in (False, True):
        keras.utils.set_random_seed(0)
        model = Net(use)
        model(x[:2])  # eager first call builds the blocks (outside the recomputed function)
        models.append(model)
    models[1].set_weights(models[0].get_weights())
    for model in models:
        model.compile(keras.optimizers.SGD(0.01), "mse")
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert _max_diff(models[0].get_weights(), models[1].get_weights()) < 1e-6


def _bn_model(use_remat, synchronized=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    block = keras.Sequential([
        keras.layers.Dense(16),
        keras.layers.BatchNormalization(momentum=0.5, synchronized=synchronized),
        keras.layers.Activation("relu"),
    ])
    h = (remat(block) if use_remat else block)(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(h))


@pytest.mark.parametrize("where", ["one_device", "mirrored", "mirrored_sync_bn", "wrap"])
def test_batchnorm_inside_block_updates_moving_statistics_once(where, mirrored):
    """The recomputation must not apply the moving-statistics update a second time."""
    x, y = _data()
    x = x * 3.0 + 1.0
    scope = mirrored.scope() if where != "one_device" else tf.distribute.get_strategy().scope()
    models = []
    with scope:
        for use in (False, True):
            model = _bn_model(use, synchronized=where == "mirrored_sync_bn")
            if where == "wrap":
                model = pytest.importorskip("keras_scale.accumulation").wrap(model, accum=2)
            model.compile(keras.optimizers.SGD(0.05), "mse")
            models.append(model)
        models[1].set_weights(models[0].get_weights())
    start = models[0].get_weights()
    for model in models:
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    moving = [i for i, v in enumerate(models[0].weights) if "moving" in v.path]
    assert len(moving) == 2
    plain, rematted = models[0].get_weights(), models[1].get_weights()
    assert _max_diff([plain[i] for i in moving], [start[i] for i in moving]) > 1e-2  # statistics did move
    assert _max_diff(plain, rematted) < 1e-5


def test_activity_regularizer_and_add_loss_inside_a_block_are_kept():
    """StatelessScope drops add_loss; remat collects the block's losses and adds them outside."""

    def build(use_remat):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        block = keras.layers.Dense(16, activation="tanh", activity_regularizer=keras.regularizers.L2(0.1))
        x = (remat(block) if use_remat else block)(inputs)
        return keras.Model(inputs, keras.layers.Dense(1)(x))

    x, y = _data()
    plain, rematted = build(False), build(True)
    rematted.set_weights(plain.get_weights())
    losses = {}
    for name, m in (("plain", plain), ("remat", rematted)):
        m.compile(keras.optimizers.SGD(0.1), "mse")
        losses[name] = m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(losses["remat"], losses["plain"], rtol=1e-5)
    assert _max_diff(plain.get_weights(), rematted.get_weights()) < 1e-6
