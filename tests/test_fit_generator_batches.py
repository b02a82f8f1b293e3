"""keras_scale.fit on a ``from_generator`` dataset: its elements are batches when every component's leading dimension
is unknown (``(None, 3)``), as a batch's is; they are rebatched to the global batch, never batched a second time."""
import keras
import numpy as np
import tensorflow as tf

import keras_scale as ks
from keras_scale.fit import prepare_dataset

X = np.random.default_rng(2).normal(size=(64, 3)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5]], "float32")).astype("float32")


def _generator_dataset(batch, leading_none=True):
    def batches():
        for start in range(0, len(X), batch):
            yield X[start:start + batch], Y[start:start + batch]

    first = None if leading_none else batch
    return tf.data.Dataset.from_generator(batches, output_signature=(
        tf.TensorSpec((first, 3), tf.float32), tf.TensorSpec((first, 1), tf.float32)))


def _builder():
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def test_a_generator_of_batches_is_rebatched_and_trains_as_plain_keras():
    ds, how = prepare_dataset(_generator_dataset(8), global_batch_size=16, shuffle=False)
    assert how.startswith("batched tf.data.Dataset, rebatched to 16"), how
    assert [tuple(b[0].shape) for b in ds] == [(16, 3)] * 4

    history = ks.fit(_builder, _generator_dataset(8), global_batch_size=16, epochs=2, strategy="default", verbose=0)
    plain = _builder()
    plain_history = plain.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)
    for a, b in zip(history.model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_generator_of_samples_is_still_batched():
    def samples():
        yield from zip(X, Y)

    ds = tf.data.Dataset.from_generator(samples, output_signature=(tf.TensorSpec((3,), tf.float32),
                                                                  tf.TensorSpec((1,), tf.float32)))
    ds, how = prepare_dataset(ds, global_batch_size=16, shuffle=False)
    assert how.startswith("unbatched tf.data.Dataset, batched to 16"), how
    assert [tuple(b[0].shape) for b in ds] == [(16, 3)] * 4
