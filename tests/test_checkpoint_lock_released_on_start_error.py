"""A fit that ChiefCheckpoint stops at its start (``RunCompletedError``: a completed run rerun with another learning
rate) leaves no ``.keras_scale.lock`` behind: the next start finds no stale lock to warn about."""
import os
import warnings

import keras
import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint import RunCompletedError
from tests._helpers import fit, make_model


def test_a_run_completed_error_at_fit_start_releases_the_directory_lock(tmp_path):
    """Before: the lock stayed; the next start warned "removing the stale lock ... (process N on this host is
    gone)" (and, within the same process, a live pid: another fit there was refused)."""
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d)], epochs=1)
    with pytest.raises(RunCompletedError):
        fit(make_model(optimizer=lambda: keras.optimizers.Adam(5e-3)), [ks.ChiefCheckpoint(d)], epochs=1)
    assert not os.path.exists(os.path.join(d, ".keras_scale.lock"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no stale lock, nothing else to say
        fit(make_model(), [ks.ChiefCheckpoint(d, verbose=0)], epochs=1)
