"""What keras_scale says when it refuses or gives up is true: the fix it names gives the same training, the counts
it names are the counts."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.callbacks.nan_guard import NanGuardGaveUp

X = np.random.default_rng(4).normal(size=(64, 3)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5]], "float32")).astype("float32")


def _model(optimizer):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def test_native_gradient_accumulation_refusal_names_the_equivalent_wrap_and_batch_size():
    native = _model(keras.optimizers.SGD(0.1, gradient_accumulation_steps=4))
    with pytest.raises(ValueError, match=r"accum=4\) with a 4x larger batch size.*batch_size=4 x your batch size"):
        native.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[ks.NanGuard(verbose=0)])
    # what the message says is the same training: Keras's option at batch 8 == wrap(accum=4) at batch 32
    native = _model(keras.optimizers.SGD(0.1, gradient_accumulation_steps=4))
    native.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    wrapped = ks.wrap(_model(keras.optimizers.SGD(0.1)), accum=4)
    wrapped.fit(X, Y, batch_size=32, epochs=1, verbose=0, shuffle=False, callbacks=[ks.NanGuard(verbose=0)])
    for a, b in zip(native.get_weights(), ks.unwrap(wrapped).get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_nan_guard_gives_up_naming_the_rollbacks_it_did():
    x = X.copy()
    x[:] = np.nan  # every step is bad
    guard = ks.NanGuard(policy="rollback", max_consecutive=1, max_rollbacks=1, verbose=0)
    with pytest.raises(NanGuardGaveUp, match=r"gave up after 1 rollback \(max_rollbacks=1\)"):
        _model(keras.optimizers.SGD(0.01)).fit(x, Y, batch_size=16, epochs=2, verbose=0, callbacks=[guard])
    assert guard.rollbacks == 1


class _Probabilities(keras.Model):
    def __init__(self):
        super().__init__(name="probabilities")
        self.dense = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.dense(x)


class _ClassIds(_Probabilities):
    """Its own predict (class ids, not probabilities): what its users call, which a wrapper would bypass."""

    def predict(self, x, **kwargs):
        return np.argmax(super().predict(x, **kwargs), axis=-1)


@pytest.mark.parametrize("method", ["predict", "evaluate", "fit", "train_on_batch", "test_on_batch",
                                    "predict_on_batch"])
def test_wrap_refuses_a_model_whose_own_loop_it_would_bypass_and_the_named_fix_keeps_it(method):
    cls = _ClassIds if method == "predict" else type("Own" + method.title().replace("_", ""), (_Probabilities,), {
        method: lambda self, *args, **kwargs: getattr(keras.Model, method)(self, *args, **kwargs)})
    keras.utils.set_random_seed(3)
    model = cls()
    model(X[:1])
    with pytest.raises(ValueError, match=rf"would bypass {cls.__name__}\.{method}.*keras_scale\.unwrap\(wrapped\)"
                                         rf"\.{method}"):
        ks.wrap(model, accum=2)
    if method == "predict":  # the named fix: the model's own predict, on the same weights
        np.testing.assert_array_equal(model.predict(X, verbose=0),
                                      np.argmax(model(X).numpy(), axis=-1))


def _generated(batch_dim):
    def gen():
        rng = np.random.default_rng(0)
        for _ in range(4):
            x = rng.normal(size=(16, 3)).astype("float32")
            yield x, x @ np.array([[1.0], [-2.0], [0.5]], "float32")
    return tf.data.Dataset.from_generator(gen, output_signature=(
        tf.TensorSpec((batch_dim, 3), tf.float32), tf.TensorSpec((batch_dim, 1), tf.float32)))


def test_fit_refuses_generator_elements_that_may_be_batches_or_samples_and_each_named_fix_fits_as_keras():
    def build():
        return _model(keras.optimizers.SGD(0.05))

    with pytest.raises(ValueError, match=r"batches of 16 or single samples.*TensorSpec\(\(None, \.\.\.\)\).*"
                                         r"dataset\.unbatch\(\)"):
        ks.fit(build, _generated(16), per_replica_batch_size=16, epochs=1, verbose=0, default_callbacks=False)
    plain = build()
    plain.fit(_generated(16), epochs=1, verbose=0)  # plain Keras: batches of 16
    for data in (_generated(None), _generated(16).unbatch()):
        models = []
        ks.fit(lambda: models.append(build()) or models[-1], data, per_replica_batch_size=16, epochs=1, verbose=0,
               default_callbacks=False)
        for a, b in zip(models[-1].get_weights(), plain.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
