"""ChiefCheckpoint saves and restores the whole training state as keras_scale.state defines it: every optimizer
(the keras-io GAN's two), its class checked at restore; restore="weights_only" takes the model weights alone."""
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint import CheckpointMismatchError
from tests._helpers import load_weights_npz, subprocess_env
from tests._models import GAN_X, gan_weights, make_gan

_GAN_SCRIPT = r"""
import os, signal, sys
import numpy as np, keras, tensorflow as tf
tf.config.experimental.enable_op_determinism()
import keras_scale as ks
from tests._models import GAN_X, gan_weights, make_gan

directory, out, kill_at, in_dict = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"


class KillAt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if kill_at and int(self.model.opt("gen").iterations.numpy()) >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


gan = make_gan(in_dict=in_dict)
gan.fit(GAN_X, batch_size=8, epochs=2, verbose=0, shuffle=False,
        callbacks=[ks.ChiefCheckpoint(directory, save_freq=2, verbose=1), KillAt()])
np.savez(out, *(gan_weights(gan) + [v.numpy() for v in gan.opt("disc").variables + gan.opt("gen").variables]))
print("DONE", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("in_dict", [False, True])
def test_gan_killed_and_rerun_ends_bit_identical_to_an_uninterrupted_run(tmp_path, in_dict):
    """No 'could not build the model' crash (plain Keras trains the GAN unbuilt); after a SIGKILL the rerun
    restores BOTH optimizers (iterations, Adam moments) and ends with the uninterrupted run's weights."""
    script = tmp_path / "gan.py"
    script.write_text(_GAN_SCRIPT)
    directory, out = str(tmp_path / "ckpt"), str(tmp_path / "out.npz")
    flag = "1" if in_dict else "0"
    killed = subprocess.run([sys.executable, str(script), directory, out, "5", flag], env=subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    resumed = subprocess.run([sys.executable, str(script), directory, out, "0", flag], env=subprocess_env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming after batch 4" in resumed.stdout
    got = load_weights_npz(out)
    reference = make_gan(in_dict=in_dict)  # (small dense CPU ops: deterministic in this process too)
    reference.fit(GAN_X, batch_size=8, epochs=2, verbose=0, shuffle=False)
    want = gan_weights(reference) + [v.numpy() for v in reference.opt("disc").variables +
                                     reference.opt("gen").variables]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert int(reference.opt("gen").iterations.numpy()) == 16


def _adam_model(optimizer):
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def test_resuming_an_adam_run_with_adamax_is_refused_naming_both(tmp_path):
    x = np.random.RandomState(0).rand(32, 4).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = _adam_model(keras.optimizers.Adam(1e-2))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[ks.ChiefCheckpoint(str(tmp_path), save_freq=2)])
    other = _adam_model(keras.optimizers.Adamax(1e-2))  # same slot shapes: used to restore silently
    with pytest.raises(CheckpointMismatchError, match=r"Adam\b.*Adamax|Adamax.*\bAdam\b"):
        other.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[ks.ChiefCheckpoint(str(tmp_path))])

    # restore="weights_only": the weights come back, the Adamax state starts fresh, the run starts at epoch 0
    trained = [w.copy() for w in model.get_weights()]
    fresh = _adam_model(keras.optimizers.Adamax(1e-2))
    ckpt = ks.ChiefCheckpoint(str(tmp_path), restore="weights_only", save_freq=2)

    class Look(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.weights = [w.copy() for w in self.model.get_weights()]

    look = Look()
    history = fresh.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[ckpt, look])
    for a, b in zip(look.weights, trained):
        np.testing.assert_array_equal(a, b)
    assert len(history.history["loss"]) == 1 and int(fresh.optimizer.iterations.numpy()) == 4
    assert ckpt.restored_from.endswith("ckpt-4") and ckpt.global_step == 8  # numbered after the restored one
    with pytest.raises(ValueError, match="weights_only"):
        ks.ChiefCheckpoint(str(tmp_path), restore="weights")


def test_gan_in_a_dict_rolls_back_from_the_checkpoint_with_both_optimizers(tmp_path):
    gan = make_gan(in_dict=True, gen_nan=True)
    start = gan_weights(gan)
    guard = ks.NanGuard(policy="rollback", max_consecutive=2, max_rollbacks=1, verbose=0)
    with pytest.raises(ks.NanGuardGaveUp):
        gan.fit(GAN_X, batch_size=8, epochs=1, verbose=0, shuffle=False,
                callbacks=[ks.ChiefCheckpoint(str(tmp_path), save_freq=1), guard])
    assert guard.rollbacks == 1  # one rollback done; the second incident gave up (max_rollbacks=1)
    for a, b in zip(start[-2:], gan_weights(gan)[-2:]):  # NaN never reached the generator
        np.testing.assert_array_equal(a, b)
    disc, gen = gan.optimizers["disc"], gan.optimizers["gen"]
    assert int(disc.iterations.numpy()) == 2 and int(gen.iterations.numpy()) == 0  # restored to the start once
    assert float(disc.learning_rate.numpy()) == pytest.approx(5e-4)  # every optimizer's LR lowered, and kept
    assert float(gen.learning_rate.numpy()) == pytest.approx(5e-4)
