"""``ks.fit(build_fn, accum=2, precision="mixed_float16", checkpoint_dir=...)`` trains with one optimizer, the
model's LossScaleOptimizer, and its checkpoints name it by a stable path. Before, the accumulating wrapper was
compiled with the raw optimizer outside the builder's dtype policy: it trained without loss scaling, beside an unused
second LossScaleOptimizer around the same optimizer, listed under the inner model's auto-generated name
(``sequential/optimizer``), so a second ``ks.fit`` in the same process (``sequential_1``) raised
CheckpointMismatchError instead of restoring the completed run."""
import keras
import numpy as np
import pytest

import keras_scale as ks
from keras_scale import state as training_state
from keras_scale.accumulation import unwrap
from keras_scale.callbacks.checkpoint import CheckpointMismatchError

X = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
Y = X[:, :1].copy()


def build():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])  # auto-named
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def ks_fit(d):
    return ks.fit(build, X, Y, global_batch_size=8, epochs=2, accum=2, precision="mixed_float16", checkpoint_dir=d,
                  default_callbacks=False, verbose=0)


def test_mixed_precision_accumulation_trains_with_one_loss_scale_optimizer_and_reruns_in_one_process(tmp_path):
    d = str(tmp_path / "ckpt")
    first = ks_fit(d)
    model = first.model
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)  # loss scaling is on
    assert model.optimizer is unwrap(model).optimizer  # one optimizer object, shared with the inner model
    assert list(training_state.optimizers(model)) == ["optimizer"]
    updates = int(model.optimizer.iterations.numpy())  # 8 steps, less those the loss scale found overflowing
    assert 0 < updates <= 8
    again = ks_fit(d)  # the same call again in this process (the inner model is now "sequential_1")
    assert again.epoch == [1]  # the completed run restored: 0 epochs trained
    assert int(again.model.optimizer.iterations.numpy()) == updates
    for a, b in zip(model.weights, again.model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_a_checkpoint_of_the_earlier_two_optimizer_layout_says_why_it_does_not_resume(tmp_path):
    """A run checkpointed by the earlier layout (bare Adam on the wrapper, an unused LossScaleOptimizer on the inner
    model) cannot resume under loss scaling: the error says so and how to continue from its weights."""
    d = str(tmp_path / "ckpt")
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        inner = build()
    finally:
        keras.config.set_dtype_policy(previous)
    old = ks.wrap(inner, accum=2)
    old.compile(optimizer=inner.optimizer.inner_optimizer, loss="mse")  # what ks.fit compiled the wrapper with
    assert sorted(training_state.optimizers(old)) == ["optimizer", f"{inner.name}/optimizer"]
    old.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[ks.ChiefCheckpoint(d)])
    with pytest.raises(CheckpointMismatchError,
                       match=r"earlier keras_scale.*without loss scaling.*restore='weights_only'"):
        ks_fit(d)
