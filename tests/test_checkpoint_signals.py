"""ChiefCheckpoint under a burst of preemption signals (a scheduler and a launcher forwarding its copy): SIGTERMs
50 ms apart still save at the next step boundary and exit 42."""
import os
import sys

import pytest


TWO_SIGTERMS = r'''
import os, signal, sys, time
import keras, numpy as np
import keras_scale as ks
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
x = np.random.default_rng(0).random((64, 4)).astype("float32"); y = x.sum(axis=1, keepdims=True)

class TwoSigterms(keras.callbacks.Callback):  # what a scheduler plus a launcher forwarding it do
    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == 5:
            for _ in range(3):  # its own, the launcher's copy, a second round: one burst
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)

model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[ks.ChiefCheckpoint(sys.argv[1], verbose=0),
                                                               TwoSigterms()])
print("NOT PREEMPTED")
'''


@pytest.mark.slow
def test_sigterms_50_ms_apart_still_save_and_exit_42(tmp_path):
    # before: the second SIGTERM ended the process with -15 and nothing was saved (issue 26)
    import subprocess

    from keras_scale.callbacks.checkpoint import list_checkpoints

    script = tmp_path / "two.py"
    script.write_text(TWO_SIGTERMS)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 42, proc.stderr[-3000:]
    assert list_checkpoints(str(tmp_path / "ckpt"))[0][0] == 6  # saved at the next step boundary
    assert "again; the preemption save goes on" in proc.stderr
