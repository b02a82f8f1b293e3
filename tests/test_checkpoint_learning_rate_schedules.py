"""A learning-rate schedule is part of a run's configuration, like a float learning rate: each run records a
descriptor of every optimizer's schedule (its class and config, as the script set it), and a rerun compares it
wherever the float is compared: a completed run rerun with another schedule raises RunCompletedError, a resumed run
with another schedule uses the new one and warns, and ``restore="weights_only"`` with another schedule starts anew
from the weights. Before, every schedule recorded ``None`` and any schedule equalled any other."""
import os
import warnings

import keras
import pytest

import keras_scale as ks
from keras_scale.callbacks.checkpoint import RunCompletedError, list_checkpoints
from keras_scale.callbacks.checkpoint.boundaries import BoundariesMixin, schedule_descriptors
from keras_scale.schedules import scale_learning_rate
from tests._helpers import StopAfter, assert_same, fit, make_model, weights


def cosine(peak):
    return lambda: keras.optimizers.Adam(ks.WarmupCosine(peak, total_steps=20, warmup_steps=2))


def decay(initial):
    return lambda: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(initial, 10, 0.9))


def test_a_completed_run_rerun_with_another_schedule_raises_and_the_same_schedule_restores(tmp_path):
    """A sweep over WarmupCosine's peak reusing a completed folder silently restored the old model."""
    d = str(tmp_path / "ckpt")
    first = make_model(optimizer=cosine(1e-3))
    fit(first, [ks.ChiefCheckpoint(d)], epochs=2)
    sweep = make_model(optimizer=cosine(1e-1))
    start = weights(sweep)
    with pytest.raises(RunCompletedError, match=r"learning_rate WarmupCosine\(peak_lr=0\.001\); this fit sets "
                                                r"WarmupCosine\(peak_lr=0\.1\)"):
        fit(sweep, [ks.ChiefCheckpoint(d)], epochs=2)
    assert int(sweep.optimizer.iterations.numpy()) == 0
    assert_same(start, weights(sweep))
    same = make_model(optimizer=cosine(1e-3))
    fit(same, [ks.ChiefCheckpoint(d)], epochs=2)  # the same schedule: the completed run back, 0 epochs
    assert int(same.optimizer.iterations.numpy()) == 20
    assert_same(weights(first), weights(same))


def test_a_resumed_run_with_another_schedule_uses_it_and_warns(tmp_path):
    d = str(tmp_path / "ckpt")
    fit(make_model(optimizer=decay(1e-3)), [ks.ChiefCheckpoint(d), StopAfter(5)], epochs=2)
    changed = make_model(optimizer=decay(1e-2))
    with pytest.warns(RuntimeWarning, match=r"schedule changed between runs: this run sets "
                                            r"ExponentialDecay\(initial_learning_rate=0\.01\)"):
        fit(changed, [ks.ChiefCheckpoint(d)], epochs=2)
    assert int(changed.optimizer.iterations.numpy()) == 20  # resumed: 5 before, 15 after
    same = make_model(optimizer=decay(1e-3))
    d2 = str(tmp_path / "ckpt2")
    fit(make_model(optimizer=decay(1e-3)), [ks.ChiefCheckpoint(d2), StopAfter(5)], epochs=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*schedule changed", category=RuntimeWarning)
        fit(same, [ks.ChiefCheckpoint(d2)], epochs=2)  # the same schedule: no word
    assert int(same.optimizer.iterations.numpy()) == 20


def test_weights_only_with_another_schedule_starts_anew_from_the_weights(tmp_path):
    d = str(tmp_path / "ckpt")
    fit(make_model(), [ks.ChiefCheckpoint(d)], epochs=1)  # the weights to start from (10 steps)
    fit(make_model(optimizer=decay(1e-3)), [ks.ChiefCheckpoint(d, restore="weights_only"), StopAfter(3)], epochs=2)
    other, ckpt = make_model(optimizer=decay(1e-1)), ks.ChiefCheckpoint(d, restore="weights_only")
    fit(other, [ckpt], epochs=2)
    assert ckpt.restored_from == os.path.join(d, "ckpt-13")
    # a new run from those weights (20 updates numbered after global batch 13), not the old run resumed (ending at 30)
    assert int(other.optimizer.iterations.numpy()) == 20 and list_checkpoints(d)[0][0] == 33
    again = make_model(optimizer=decay(1e-1))
    fit(again, [ks.ChiefCheckpoint(d, restore="weights_only")], epochs=2)  # its own (completed) run: restored
    assert_same(weights(other), weights(again))


def test_lowering_a_schedule_during_training_does_not_change_its_descriptor():
    """ReduceLROnPlateau/NanGuard lower a schedule through its multiplier or a ScaledSchedule wrapper: the run's
    configuration (what the script set) is the same."""
    for make in (cosine(1e-2), decay(1e-2)):
        model = make_model(optimizer=make)
        before = schedule_descriptors(model)
        scale_learning_rate(model.optimizer, 0.5)
        assert schedule_descriptors(model) == before and before["optimizer"].split()[0] in (
            "WarmupCosine", "ExponentialDecay")
    assert schedule_descriptors(make_model(optimizer=cosine(1e-2))) == schedule_descriptors(
        make_model(optimizer=cosine(1e-2)))


def test_a_record_without_schedules_compares_no_schedule(tmp_path, monkeypatch):
    """A checkpoint written by the previous version (no ``schedules`` in its record) still reruns as before."""
    d = str(tmp_path / "ckpt")
    start_config = BoundariesMixin._start_config

    def old(self):
        config = start_config(self)
        config.pop("schedules")
        return config

    with monkeypatch.context() as m:
        m.setattr(BoundariesMixin, "_start_config", old)
        first = make_model(optimizer=decay(1e-3))
        fit(first, [ks.ChiefCheckpoint(d)], epochs=2)
    rerun = make_model(optimizer=decay(1e-2))
    fit(rerun, [ks.ChiefCheckpoint(d)], epochs=2)
    assert int(rerun.optimizer.iterations.numpy()) == 20 and list_checkpoints(d)[0][0] == 20
    assert_same(weights(first), weights(rerun))
