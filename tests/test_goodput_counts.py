"""ks.Goodput's counts, exact in every case a user meets:

- ``steps``: train batches this fit ran through the train step (a resume's fast-forwarded batches are not);
- ``skipped_steps``: of those, NaN-skipped by NanGuard (no update); ``rolled_back_steps``: updates applied, then
  discarded by NanGuard(policy="rollback"); ``productive_steps`` = steps - skipped - rolled back (= the optimizer
  updates this fit kept);
- ``samples``: global samples of the ``steps`` (all replicas), NaN-skipped batches included;
- ``samples_per_s`` = samples / wall_s; ``tflops_per_s`` (and MFU) = flops_per_step x productive_steps /
  productive_s; no duration is float noise.
"""
import keras
import numpy as np
import pytest

import keras_scale as ks
from keras_scale.callbacks.goodput import CATEGORIES, Ledger, clean_seconds, format_summary, summarize
from tests._helpers import StopAfter

BATCH = 64
FEATURES = 16


def build(strategy=None):
    def make():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    if strategy is None:
        return make()
    with strategy.scope():
        return make()


def data(batches, nan_batches=(), short_by=0):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * BATCH - short_by, FEATURES)).astype("float32")
    for b in nan_batches:
        x[b * BATCH, 0] = np.nan  # one sample: on 2 replicas only one of them sees it
    return x, rng.integers(0, 10, len(x))


def fit(model, x, y, callbacks, epochs=2):
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False, callbacks=callbacks)


def assert_consistent(s):
    total = sum(s[c] for c in CATEGORIES)
    assert abs(total - s["wall_s"]) <= 0.05 * s["wall_s"], s
    assert all(s[c] == 0.0 or s[c] >= 1e-6 for c in CATEGORIES), s  # no 3.9e-18
    assert s["productive_steps"] == s["steps"] - s["skipped_steps"] - s["rolled_back_steps"]
    assert s["samples_per_s"] == pytest.approx(s["samples"] / s["wall_s"])
    if s["tflops_per_s"] is not None:
        assert s["tflops_per_s"] == pytest.approx(
            s["flops_per_step"] * s["productive_steps"] / s["productive_s"] / 1e12)
    if s["peak_flops"]:
        assert s["mfu"] == pytest.approx(s["tflops_per_s"] * 1e12 / s["peak_flops"])


def test_plain_fit_with_a_short_last_batch():
    model, goodput = build(), ks.Goodput(verbose=0, peak_flops=1e12)
    x, y = data(20, short_by=10)
    history = fit(model, x, y, [goodput])
    s = goodput.summary
    assert (s["steps"], s["skipped_steps"], s["rolled_back_steps"], s["productive_steps"]) == (40, 0, 0, 40)
    assert s["samples"] == 2 * len(x)
    assert int(model.optimizer.iterations.numpy()) == s["productive_steps"]
    assert_consistent(s)
    assert all(v == 0.0 or v >= 1e-6 for v in history.history["goodput_input_wait_fraction"]), history.history


def test_two_replicas_count_global_samples(mirrored):
    model, goodput = build(mirrored), ks.Goodput(verbose=0)
    x, y = data(20, short_by=10)
    fit(model, x, y, [goodput])
    s = goodput.summary
    assert (s["steps"], s["productive_steps"]) == (40, 40)
    assert s["samples"] == 2 * len(x)  # both replicas' halves, not one replica's
    assert_consistent(s)


@pytest.mark.parametrize("replicas", [1, 2])
def test_nan_skipped_steps_are_counted_and_their_samples_too(replicas, request):
    strategy = request.getfixturevalue("mirrored") if replicas == 2 else None
    model, goodput = build(strategy), ks.Goodput(verbose=0, peak_flops=1e12)
    x, y = data(20, nan_batches=(3, 7))
    fit(model, x, y, [ks.NanGuard(verbose=0), goodput])
    s = goodput.summary
    assert (s["steps"], s["skipped_steps"], s["rolled_back_steps"], s["productive_steps"]) == (40, 4, 0, 36)
    assert int(model.optimizer.iterations.numpy()) == 36
    assert s["samples"] == 2 * 20 * BATCH  # processed samples: the skipped batches' too, on every replica
    assert s["skipped_steps_s"] > 0 and s["redone_s"] == 0.0
    assert_consistent(s)


@pytest.mark.parametrize("restore_from", ["snapshot", "checkpoint"])
def test_rollback_counts_every_batch_and_prices_the_discarded_updates(restore_from, tmp_path):
    model, goodput = build(), ks.Goodput(verbose=0, peak_flops=1e12)
    guard = ks.NanGuard(policy="rollback", max_consecutive=1, snapshot_every_n_steps=4, verbose=0)
    if restore_from == "snapshot":
        # in-memory snapshots after 4 and 8 updates; batch 10 is bad: the updates of batches 8 and 9 are discarded
        x, y = data(20, nan_batches=(10,))
        callbacks = [guard, goodput]
    else:
        # checkpoints after 5 and 10 updates; batch 12 is bad: the updates of batches 10 and 11 are discarded
        x, y = data(20, nan_batches=(12,))
        callbacks = [ks.ChiefCheckpoint(str(tmp_path), save_freq=5, verbose=0), guard, goodput]
    fit(model, x, y, callbacks, epochs=1)
    s = goodput.summary
    assert guard.rollbacks == 1
    assert (s["steps"], s["skipped_steps"], s["rolled_back_steps"], s["productive_steps"]) == (20, 1, 2, 17)
    assert int(model.optimizer.iterations.numpy()) == 17
    assert s["samples"] == 20 * BATCH
    assert s["redone_s"] > 0  # the two discarded steps' compute
    assert "(20 steps" in format_summary(s) and "1 NaN-skipped, 2 rolled back" in format_summary(s)
    assert_consistent(s)


def test_accumulation_counts_batches_not_micro_batches():
    inner = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    model = ks.wrap(inner, accum=4)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    goodput = ks.Goodput(verbose=0)
    x, y = data(20)
    fit(model, x, y, [goodput])
    s = goodput.summary
    assert (s["steps"], s["productive_steps"], s["samples"]) == (40, 40, 2 * 20 * BATCH)
    assert int(model.optimizer.iterations.numpy()) == 40
    assert_consistent(s)


def test_resumed_run_counts_only_what_it_trained(tmp_path):
    x, y = data(20)
    first = ks.Goodput(verbose=0)
    fit(build(), x, y, [ks.ChiefCheckpoint(str(tmp_path), save_freq=3, verbose=0), StopAfter(26), first], epochs=3)
    assert (first.summary["steps"], first.summary["samples"]) == (26, 26 * BATCH)
    resumed, goodput = build(), ks.Goodput(verbose=0)
    fit(resumed, x, y, [ks.ChiefCheckpoint(str(tmp_path), save_freq=3, verbose=0), goodput], epochs=3)
    s = goodput.summary
    # resumes after batch 6 of epoch 2: 14 + 20 batches trained; the 6 fast-forwarded ones (and the restored
    # metric state, which includes the loss tracker's count of them) are not counted
    assert (s["steps"], s["productive_steps"], s["samples"]) == (34, 34, 34 * BATCH)
    assert int(resumed.optimizer.iterations.numpy()) == 26 + 34
    assert_consistent(s)


def test_durations_carry_no_float_noise():
    assert clean_seconds(3.9e-18) == 0.0 and clean_seconds(-2e-17) == 0.0 and clean_seconds(0.25) == 0.25
    # 0.1 + 0.2 s of calls, 0.15 s of compute each by the probes: input wait is 0.0, not 5.6e-17
    L = Ledger(step_s=0.1 + 0.2, step_sq_s2=0.045, calls=2, steps=2)
    s = summarize(L, wall_s=0.31, probe_s=[0.15, 0.15])
    assert s["input_wait_s"] == 0.0 and s["input_wait_fraction"] == 0.0
    assert all(s[c] == 0.0 or s[c] >= 1e-6 for c in CATEGORIES), s
    assert abs(sum(s[c] for c in CATEGORIES) - 0.31) < 1e-5


def test_resumed_mid_epoch_counts_only_the_nan_skipped_steps_it_ran(tmp_path):
    x, y = data(20, nan_batches=(1, 3, 12))  # per epoch: 2 bad batches before the resume point, 1 after
    first = ks.Goodput(verbose=0)
    fit(build(), x, y, [ks.NanGuard(verbose=0), ks.ChiefCheckpoint(str(tmp_path), save_freq=2, verbose=0),
                        StopAfter(26), first], epochs=2)
    resumed, goodput, guard = build(), ks.Goodput(verbose=0), ks.NanGuard(verbose=0)
    fit(resumed, x, y, [guard, ks.ChiefCheckpoint(str(tmp_path), save_freq=2, verbose=0), goodput], epochs=2)
    s = goodput.summary
    # resumes mid-epoch 1, after the bad batches 1 and 3 (the restored epoch count holds them: the first run's)
    start = 20 - s["steps"]
    assert 3 < start <= 12
    assert (s["skipped_steps"], s["productive_steps"]) == (1, s["steps"] - 1)  # batch 12 only
    assert guard.skipped_steps == 2 * 3  # NanGuard's own total spans both runs
    assert_consistent(s)
