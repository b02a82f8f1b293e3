"""keras_scale.state: one definition of a model's training state, and the pieces that read it.

The keras-io GAN (a subclass without call(), two optimizers as attributes or in a dict) is the model the older
code got wrong: its optimizers were found only as direct attributes (a dict was not guarded), and a step whose
generator update was skipped counted as good when the discriminator's applied."""
import keras
import numpy as np
import pytest

import keras_scale as ks
from keras_scale import state
from tests._models import GAN_X, gan_weights, make_gan


def test_every_optimizer_is_found_once_by_a_stable_path():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name="net")
    main = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    model.compile(optimizer=main, loss="mse")
    extra, listed, same = keras.optimizers.SGD(), keras.optimizers.Adamax(), keras.optimizers.RMSprop()
    model.head_optimizer = extra
    model.schedule = [listed, main.inner_optimizer]  # the inner of the LossScaleOptimizer: not a second one
    model.by_name = {"same": same, "again": same}
    found = state.optimizers(model)
    assert list(found) == ["optimizer", "head_optimizer", "schedule/0", "by_name/same"]
    assert found["optimizer"] is main and found["schedule/0"] is listed and found["by_name/same"] is same


def test_gan_state_holds_both_optimizers_and_building_runs_nothing():
    gan = make_gan(in_dict=True)
    assert list(state.optimizers(gan)) == ["optimizer", "optimizers/disc", "optimizers/gen"]
    assert not state.is_built(gan)  # a model without call() and optimizers not built yet
    before = gan_weights(gan)
    seed = gan.seed_generator.state.numpy().copy()
    iterator = iter(__import__("tensorflow").data.Dataset.from_tensor_slices(GAN_X).batch(8))
    assert state.build(gan, iterator)
    assert gan.optimizers["disc"].built and gan.optimizers["gen"].built
    np.testing.assert_array_equal(gan.seed_generator.state.numpy(), seed)
    for a, b in zip(before, gan_weights(gan)):
        np.testing.assert_array_equal(a, b)
    assert state.iterations(gan) == 0
    np.testing.assert_array_equal(next(iterator).numpy(), GAN_X[:8])  # tracing read no batch
    keys = state.variables(gan)
    assert any(k.startswith("optimizers/optimizers/gen/") and "velocity" in k for k in keys)


@pytest.mark.parametrize("in_dict", [False, True])
def test_gan_with_nan_generator_gradients_is_guarded_and_reported(in_dict):
    gan = make_gan(in_dict=in_dict, gen_nan=True)
    before = gan_weights(gan)
    guard = ks.NanGuard(verbose=0)
    gan.fit(GAN_X, batch_size=8, epochs=1, verbose=0, callbacks=[guard])
    d_opt, g_opt = gan.opt("disc"), gan.opt("gen")
    assert int(d_opt.iterations.numpy()) == 8 and int(g_opt.iterations.numpy()) == 0
    assert guard.skipped_steps == 8  # one per step, not one per optimizer update
    assert guard.reports and guard.reports[0].source == "gradients"
    assert any("generator" in d for d in guard.reports[0].details)
    for a, b in zip(before[-2:], gan_weights(gan)[-2:]):  # the generator never moved, never non-finite
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(w).all() for w in gan_weights(gan))


def test_rollback_counts_a_step_bad_when_any_optimizer_update_was_skipped():
    gan = make_gan(gen_nan=True)
    guard = ks.NanGuard(policy="rollback", max_consecutive=3, max_rollbacks=2, verbose=0)
    gan.fit(GAN_X, batch_size=8, epochs=1, verbose=0, callbacks=[guard])  # 8 steps: rollbacks after 3 and 6
    assert guard.rollbacks == 2
    assert int(gan.d_optimizer.iterations.numpy()) == 2  # rolled back to the start twice, then 2 good d updates


def test_stop_on_a_gan_keeps_the_finite_updates_of_the_bad_step_and_says_so(capsys):
    # each optimizer's apply is guarded on its own: the discriminator's finite update of the bad step applies,
    # the generator's does not, and the stop message says so (docs: NanGuard, README)
    gan = make_gan(gen_nan=True)
    g_start = [w.numpy().copy() for w in gan.generator.weights]
    guard = ks.NanGuard(policy="stop", verbose=1)
    gan.fit(GAN_X, batch_size=8, epochs=1, verbose=0, callbacks=[guard])
    assert int(gan.d_optimizer.iterations.numpy()) == 1 and int(gan.g_optimizer.iterations.numpy()) == 0
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(g_start, gan.generator.weights))
    out = capsys.readouterr()
    assert "own train_step" in out.out + out.err


# ---------------------------------------------------------------- wrap(): refused or carried over, in any order
def test_wrap_refuses_the_gan_in_wrap_itself_before_or_after_its_compile():
    with pytest.raises(ValueError, match="defines its own train_step"):
        ks.wrap(make_gan(), accum=2)  # compiled with its own compile(d_optimizer=...) first
    from tests._models import GAN

    with pytest.raises(ValueError, match="defines its own train_step"):
        ks.wrap(GAN(), accum=2)  # wrap first: refused before the user reaches the GAN's compile


def _two_outputs():
    keras.utils.set_random_seed(11)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(h),
                                "b": keras.layers.Dense(3, activation="softmax", name="b")(h)})


def _compile(model, optimizer):
    model.compile(optimizer=optimizer, loss={"a": "mse", "b": "sparse_categorical_crossentropy"},
                  loss_weights={"a": 0.3, "b": 2.0}, metrics={"b": ["accuracy"]})


def test_compile_then_wrap_trains_as_wrap_then_compile():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = {"a": x[:, :1] * 2.0, "b": (x[:, 1] > 0).astype("int32")}
    first = _two_outputs()
    optimizer = keras.optimizers.Adam(1e-2)
    _compile(first, optimizer)
    wrapped_after = ks.wrap(first, accum=2)  # was: "You must call compile() before using the model" at fit
    assert wrapped_after.optimizer is optimizer
    h1 = wrapped_after.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    wrapped_before = ks.wrap(_two_outputs(), accum=2)
    _compile(wrapped_before, keras.optimizers.Adam(1e-2))
    h2 = wrapped_before.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    assert sorted(h1.history) == sorted(h2.history) and "b_accuracy" in h1.history
    for key in h1.history:
        np.testing.assert_allclose(h1.history[key], h2.history[key], rtol=1e-6)
    for a, b in zip(wrapped_after.get_weights(), wrapped_before.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert int(optimizer.iterations.numpy()) == 8
