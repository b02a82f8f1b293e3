"""Every public callback at verbose=0, 1 and 2, driven into the branch that prints.

One small model and dataset; each case makes its callback print something (a reduction, a skipped NaN step, GPU
advice, a save, a profile verdict, the goodput table). verbose=0 prints nothing of it; 1 and 2 print it (on the chief). A callback that crashes while printing (ReduceLROnPlateau once called a missing Keras function) fails here.
HostMemoryWatch and LearningRateLogger have no ``verbose``: they print nothing, only warn (tested in their files).
"""
import keras
import numpy as np
import pytest

import keras_scale as ks
from tests.fakes.fake_nvml import FakeNvml

X = np.random.RandomState(0).rand(32, 4).astype("float32")
Y = X.sum(axis=1, keepdims=True)
X_NAN = X.copy()
X_NAN[9, 0] = np.nan  # in the second batch of 8


def _model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def _plateau(tmp_path, v):
    # min_delta=1e9: only the first epoch improves, so epoch 2 reduces
    return ks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=1e9, verbose=v), {}


def _nan_guard(tmp_path, v):
    return ks.NanGuard(verbose=v), {"x": X_NAN}


def _gpu_monitor(tmp_path, v):
    fake = FakeNvml.with_gpus(1, util_gpu_pct=60.0, throttle_thermal=True, temperature_c=92.0)
    return ks.GpuMonitor(interval_s=0.002, nvml=fake, verbose=v), {}


def _checkpoint(tmp_path, v):
    return ks.ChiefCheckpoint(str(tmp_path / "ckpt"), verbose=v), {}


def _profile_window(tmp_path, v):
    return ks.ProfileWindow(str(tmp_path / "profile"), start_step=1, num_steps=2, verbose=v), {"epochs": 1}


def _goodput(tmp_path, v):
    return ks.Goodput(verbose=v), {}


CASES = {  # name: (make(tmp_path, verbose) -> (callback, fit overrides), what its printing branch writes)
    "ReduceLROnPlateau": (_plateau, "ReduceLROnPlateau: loss did not improve for 1 epoch(s)"),
    "NanGuard": (_nan_guard, "NanGuard: 1 non-finite step(s) at epoch 1"),
    "GpuMonitor": (_gpu_monitor, "GpuMonitor (epoch 1): GPU 0 is throttled"),
    "ChiefCheckpoint": (_checkpoint, "ChiefCheckpoint: saved"),  # each epoch end
    "ProfileWindow": (_profile_window, "profile summary: "),
    "Goodput": (_goodput, "Goodput: "),
}


@pytest.mark.parametrize("verbose", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_callback_prints_at_verbose_1_and_2_and_is_quiet_at_0(name, verbose, tmp_path, capsys):
    make, expected = CASES[name]
    callback, overrides = make(tmp_path, verbose)
    kwargs = dict(x=X, y=Y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # fit itself quiet
    kwargs.update(overrides)
    _model().fit(callbacks=[callback], **kwargs)
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    if verbose:
        assert expected in printed, printed
    else:
        assert expected not in printed, printed
