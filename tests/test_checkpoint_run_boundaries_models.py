"""A run's boundaries (tests/test_checkpoint_run_boundaries.py) for the models that are not a plain built
``Sequential``: models built by their first step (no ``keras.Input``; keras-io's GAN, whose two optimizers build at
their first ``apply``), models with state that is not a weight (a Dropout's seed), and models that train with
several optimizers (the GAN's ``d_optimizer``/``g_optimizer`` in the run record). Each compared bit-identically
with what plain Keras returns or the same run uninterrupted."""
import os
import shutil
import signal

import keras
import numpy as np
import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint import RunCompletedError, list_checkpoints
from tests._helpers import assert_same, fit, weights
from tests._models import GAN_X, gan_weights, make_gan


def unbuilt_model(optimizer=None, dropout=False):
    """A Sequential without ``keras.Input``: it gets its variables when its first step is traced."""
    keras.utils.set_random_seed(7)
    layers = [keras.layers.Dense(8, activation="relu")] + ([keras.layers.Dropout(0.3)] if dropout else []) + [
        keras.layers.Dense(1)]
    model = keras.Sequential(layers)
    model.compile(optimizer=optimizer() if optimizer else keras.optimizers.Adam(1e-2), loss="mse")
    return model


def dropout_model(optimizer=None):
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dropout(0.3),
                              keras.layers.Dense(1)])
    model.compile(optimizer=optimizer() if optimizer else keras.optimizers.Adam(1e-2), loss="mse")
    return model


def gan_fit(gan, callbacks, epochs=2):
    return gan.fit(GAN_X, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)  # 8 batches


def gan_state(gan):
    return gan_weights(gan) + [gan.seed_generator.state.numpy().copy(), gan.d_optimizer.iterations.numpy(),
                               gan.g_optimizer.iterations.numpy()] + [v.numpy().copy()
                                                                       for v in gan.d_optimizer.variables]


def early_stopping():
    """Stops after epoch 2 and puts epoch 1's weights back at train end."""
    return keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=1e9, restore_best_weights=True)


def test_a_rerun_of_a_completed_run_restores_a_model_built_by_its_first_step(tmp_path, capsys):
    """Before: the rerun said "restoring its final state and training 0 epochs" but restored nothing (the restore
    waited for a first step that a 0-epoch fit never takes): the model stayed unbuilt and evaluate() made fresh
    random weights; a second fit with the callback then trained from scratch and recorded that as the newest
    completed run. Now the model is built from the data's spec at fit start and restored."""
    d = str(tmp_path / "ckpt")
    first = unbuilt_model()
    fit(first, [ks.ChiefCheckpoint(d)], epochs=2)
    returned, loss = weights(first), first.evaluate(*_xy(), verbose=0)

    again = unbuilt_model()
    ckpt = ks.ChiefCheckpoint(d)
    history = fit(again, [ckpt], epochs=2)
    assert "restoring its final state and training 0 epochs" in capsys.readouterr().out
    assert again.built and int(again.optimizer.iterations.numpy()) == 20 and history.epoch == [1]
    assert_same(returned, weights(again))
    assert again.evaluate(*_xy(), verbose=0) == loss
    # a second fit with the same callback continues from the restored state, as a second plain fit of `first` does
    fit(first, [], epochs=2)
    fit(again, [ckpt], epochs=2)
    assert_same(weights(first), weights(again))
    assert list_checkpoints(d)[0][0] == 40


def _xy():
    from tests._helpers import X, Y
    return X, Y


def test_a_rerun_of_a_completed_gan_restores_both_optimizers(tmp_path):
    """keras-io's GAN (no call(), optimizers built by their first apply): before, the rerun kept the fresh weights
    and both optimizers at 0 iterations. Now everything, seed state included, is the completed run's."""
    d = str(tmp_path / "ckpt")
    first = make_gan()
    gan_fit(first, [ks.ChiefCheckpoint(d)])
    again = make_gan()
    ckpt = ks.ChiefCheckpoint(d)
    gan_fit(again, [ckpt])
    assert ckpt.restored_from == list_checkpoints(d)[0][1]
    assert_same(gan_state(first), gan_state(again))
    assert int(again.d_optimizer.iterations.numpy()) == 16


@pytest.mark.parametrize("make", [dropout_model, lambda optimizer=None: unbuilt_model(optimizer, dropout=True)],
                         ids=["built", "unbuilt"])
def test_early_stoppings_best_weights_are_kept_with_a_dropout_layer(tmp_path, make):
    """Before: with a Dropout (its seed is a variable, not a weight) the weights EarlyStopping(restore_best_weights)
    put back were not written to final/: a rerun and a weights_only start got the last epoch's. Now both get the
    weights fit returned."""
    d = str(tmp_path / "ckpt")
    first = make()
    fit(first, [ks.ChiefCheckpoint(d), early_stopping()], epochs=5)
    returned = weights(first)
    assert os.listdir(os.path.join(d, "final"))
    again = make()
    fit(again, [ks.ChiefCheckpoint(d), early_stopping()], epochs=5)
    assert_same(returned, weights(again))
    # a new configuration started from its weights (learning rate 0: the weights stay as loaded)
    start = make(optimizer=lambda: keras.optimizers.SGD(0.0))
    fit(start, [ks.ChiefCheckpoint(d, restore="weights_only")], epochs=1)
    assert_same(returned, weights(start))


class _StopGan(keras.callbacks.Callback):
    """A graceful stop (no completion) after ``num_steps`` updates of the GAN's discriminator."""

    def __init__(self, num_steps):
        super().__init__()
        self.num_steps = num_steps

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.d_optimizer.iterations.numpy()) >= self.num_steps:
            self.model.stop_training = True


class _Preempt(keras.callbacks.Callback):
    def __init__(self, iterations):
        super().__init__()
        self.iterations = iterations

    def on_train_batch_end(self, batch, logs=None):
        if int(self.iterations().numpy()) == 13:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("kind", ["unbuilt", "gan"])
def test_weights_only_resumes_its_own_preempted_run_in_full_for_first_step_models(tmp_path, kind):
    """Before: for a model built by its first step the deferred restore read the constructor's restore argument,
    so the run's own checkpoint gave back only its weights (optimizer state fresh, 27 updates instead of 20)."""
    d, ref = str(tmp_path / "ckpt"), str(tmp_path / "ref")
    if kind == "gan":
        def make(lr=1e-3):
            gan = make_gan()
            gan.compile(d_optimizer=keras.optimizers.Adam(lr), g_optimizer=keras.optimizers.Adam(lr),
                        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
            return gan
        run, state = (lambda m, cbs: gan_fit(m, cbs, epochs=2)), gan_state
        iterations = (lambda m: m.d_optimizer.iterations)
        total = 16
    else:
        def make(lr=1e-2):
            return unbuilt_model(lambda: keras.optimizers.Adam(lr))
        run, state = (lambda m, cbs: fit(m, cbs, epochs=2)), weights
        iterations = (lambda m: m.optimizer.iterations)
        total = 20
    run(make(), [ks.ChiefCheckpoint(d)])
    shutil.copytree(d, ref)
    uninterrupted = make(5e-3)
    run(uninterrupted, [ks.ChiefCheckpoint(ref, restore="weights_only")])

    first = make(5e-3)
    ckpt = ks.ChiefCheckpoint(d, restore="weights_only", preemption_exit_code=None)
    run(first, [ckpt, _Preempt(lambda: iterations(first))])
    assert ckpt.preempted == signal.SIGTERM
    rerun = make(5e-3)
    again = ks.ChiefCheckpoint(d, restore="weights_only")
    run(rerun, [again])
    assert int(iterations(rerun).numpy()) == total
    assert_same(state(uninterrupted), state(rerun))


def test_a_gans_optimizers_learning_rates_are_in_the_run_record(tmp_path):
    """Before: the run record held model.optimizer's learning rate only (a GAN's unused default): a completed GAN
    folder rerun with another learning rate restored the old run, and a resumed GAN kept the saved rate silently.
    Now a completed one raises RunCompletedError, a resumed one uses the new rate and says so."""
    d = str(tmp_path / "done")
    gan_fit(make_gan(), [ks.ChiefCheckpoint(d)])

    def with_lr(lr):
        gan = make_gan()
        gan.compile(d_optimizer=keras.optimizers.Adam(lr), g_optimizer=keras.optimizers.Adam(1e-3),
                    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
        return gan

    sweep = with_lr(5e-4)
    with pytest.raises(RunCompletedError, match=r"d_optimizer's learning_rate 0\.001; this fit sets 0\.0005"):
        gan_fit(sweep, [ks.ChiefCheckpoint(d)])
    assert int(sweep.d_optimizer.iterations.numpy()) == 0

    d = str(tmp_path / "stopped")
    gan_fit(make_gan(), [ks.ChiefCheckpoint(d), _StopGan(5)])
    resumed = with_lr(5e-4)
    with pytest.warns(RuntimeWarning, match=r"d_optimizer's learning_rate changed between runs: this run starts "
                                            r"with 0\.0005"):
        gan_fit(resumed, [ks.ChiefCheckpoint(d)])
    assert np.float32(resumed.d_optimizer.learning_rate.numpy()) == np.float32(5e-4)
    assert np.float32(resumed.g_optimizer.learning_rate.numpy()) == np.float32(1e-3)
    assert int(resumed.d_optimizer.iterations.numpy()) == 16
