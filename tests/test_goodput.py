"""ks.Goodput: where the wall-clock of fit went.

- the categories add up to the wall time of the fit (within 5%), and that wall time is the fit's;
- a pipeline that sleeps 20 ms per batch shows most of the time as input wait; an in-memory one does not;
- checkpoint saves and validation land in their own categories, not in input wait or productive time;
- NaN-skipped steps are priced; the first fit's trace is compile time, a second fit has none;
- FLOPs per step come from a trace and match 6 x batch x parameters for a dense MLP; MFU = achieved / peak;
- 2 replicas and 2 workers: the same figures, output (table, TensorBoard) on the chief only.
"""
import glob
import json
import os
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale.callbacks.goodput import CATEGORIES, PEAK_TFLOPS, compute_dtype, peak_flops_for

BATCH = 64
FEATURES = 64


def build(hidden=256):
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(hidden, activation="relu"),
                              keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def data(batches):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * BATCH, FEATURES)).astype("float32")
    return x, rng.integers(0, 10, len(x))


def dataset(batches, sleep_s=0.0):
    x, y = data(batches)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    if sleep_s:
        def slow(a):
            time.sleep(sleep_s)
            return a

        ds = ds.map(lambda a, b: (tf.ensure_shape(tf.numpy_function(slow, [a], tf.float32), [None, FEATURES]), b))
    return ds.prefetch(2)


def assert_adds_up(summary):
    total = sum(summary[c] for c in CATEGORIES)
    assert abs(total - summary["wall_s"]) <= 0.05 * summary["wall_s"], summary
    assert all(summary[c] >= 0 for c in CATEGORIES), summary


def timed_fit(model, *args, **kwargs):
    start = time.perf_counter()
    history = model.fit(*args, **kwargs)
    return history, time.perf_counter() - start


# --- the sum, input wait ---------------------------------------------------------------------------------------

def test_slow_pipeline_is_input_wait_and_categories_add_up():
    model, goodput = build(), ks.Goodput(verbose=0)
    history, elapsed = timed_fit(model, dataset(20, sleep_s=0.1), epochs=3, verbose=0, callbacks=[goodput])
    s = goodput.summary
    assert_adds_up(s)
    assert 0.8 * elapsed <= s["wall_s"] <= elapsed
    # 60 batches x 100 ms of sleeping pipeline, ~1-2 ms of compute each (22 ms seen with 6 busy processes on 2
    # cores; the prefetch overlaps compute with the sleep): most of the time is waiting for data
    assert s["input_wait_s"] > s["productive_s"], s
    assert s["steps"] == 60 and s["samples"] == 60 * BATCH
    # per-epoch figures in the logs; the epochs after the first (which traces) are mostly input wait
    assert len(history.history["goodput_input_wait_fraction"]) == 3
    assert min(history.history["goodput_input_wait_fraction"][1:]) >= 0.4, history.history


@pytest.mark.parametrize("batches,epochs", [(20, 2), (5, 4)])
def test_short_epochs_of_a_slow_pipeline_are_input_wait_too(batches, epochs):
    """20 batches per epoch: a probe would fall on the second epoch's first batch, where Keras's new iterator has no
    batch ready however long Goodput sleeps; such a probe measured the wait and hid it (input wait 0). A fit of 20
    calls: probes 16 calls apart left one probe, and one probe claims nothing (input wait 0)."""
    model, goodput = build(), ks.Goodput(verbose=0)
    model.fit(dataset(batches, sleep_s=0.1), epochs=epochs, verbose=0, callbacks=[goodput])
    s = goodput.summary
    assert_adds_up(s)
    assert s["input_wait_s"] > s["productive_s"], s  # 100 ms of sleeping pipeline per batch, a few ms of compute


def test_in_memory_pipeline_has_little_input_wait(capsys):
    model, goodput = build(), ks.Goodput()
    model.fit(dataset(60), epochs=2, verbose=0, callbacks=[goodput])
    assert capsys.readouterr().out == ""  # verbose="auto" follows fit(verbose=0)
    s = goodput.summary
    assert_adds_up(s)
    # (the 20 ms pipeline above: ~90%; a load spike on a shared CPU can look like some input wait)
    assert s["input_wait_s"] < 0.5 * (s["productive_s"] + s["input_wait_s"]), s
    assert s["probes"] >= 2  # measured, not assumed


def test_first_fit_traces_second_does_not():
    model = build()
    first, second = ks.Goodput(verbose=0), ks.Goodput(verbose=0)
    model.fit(dataset(20), epochs=1, verbose=0, callbacks=[first])
    model.fit(dataset(20), epochs=1, verbose=0, callbacks=[second])
    assert first.summary["compile_s"] > 0.1
    assert second.summary["compile_s"] < 0.2 * first.summary["compile_s"], (first.summary, second.summary)
    assert_adds_up(second.summary)


def test_training_is_unchanged():
    """The probes only pause and the FLOPs trace never runs: weights (BatchNorm statistics included) are the
    same with and without Goodput."""
    def bn_model():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32), keras.layers.BatchNormalization(),
                                  keras.layers.Dropout(0.2), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    plain, measured = bn_model(), bn_model()
    plain.fit(dataset(30), epochs=2, verbose=0)
    measured.fit(dataset(30), epochs=2, verbose=0, callbacks=[ks.Goodput(verbose=0)])
    for a, b in zip(plain.get_weights(), measured.get_weights()):
        np.testing.assert_array_equal(a, b)


# --- checkpoint, eval, NaN-skipped -----------------------------------------------------------------------------

class HookClock(keras.callbacks.Callback):
    """Listed right before and right after another callback: the time that callback spends in its batch-end hook."""

    def __init__(self, partner=None):
        super().__init__()
        self.partner, self.total_s = partner, 0.0

    def on_train_batch_end(self, batch, logs=None):
        self.stamp = time.perf_counter()
        if self.partner is not None:
            self.total_s += self.stamp - self.partner.stamp


@pytest.mark.parametrize("goodput_first", [False, True])
def test_checkpoint_and_validation_have_their_own_categories(tmp_path, goodput_first):
    model = build(hidden=1024)  # ~1.1 M parameters + Adam slots: each save takes a while
    ckpt = ks.ChiefCheckpoint(str(tmp_path / "ckpt"), save_freq=2, verbose=0)
    before = HookClock()
    after = HookClock(partner=before)  # measures ChiefCheckpoint's saves from the outside
    goodput = ks.Goodput(verbose=0)
    slow_val = dataset(5, sleep_s=0.02)  # validation: 5 batches x 20 ms per epoch
    # saves inside Goodput's step window (listed after the checkpoint) or between its windows (listed first)
    callbacks = [goodput, before, ckpt, after] if goodput_first else [before, ckpt, after, goodput]
    model.fit(dataset(20), epochs=2, verbose=0, validation_data=slow_val, callbacks=callbacks)
    s = goodput.summary
    assert_adds_up(s)
    assert s["eval_s"] >= 2 * 5 * 0.02, s
    # 20 saves, inside the step's batch hooks: their time is checkpoint time, and only that (were it also counted
    # as step time, the categories would add up to more than the wall time)
    assert 0.8 * after.total_s <= s["checkpoint_s"] <= 1.25 * after.total_s + 0.01, (s, after.total_s)


def test_nan_skipped_steps_are_priced():
    x, y = data(20)
    x[3 * BATCH, 0] = np.nan  # batch 3 is non-finite: NanGuard skips its update
    model, goodput = build(), ks.Goodput(verbose=0)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[ks.NanGuard(), goodput])
    s = goodput.summary
    assert s["skipped_steps"] == 1 and s["steps"] == 20
    assert 0 < s["skipped_steps_s"] < s["productive_s"] / 5
    assert s["redone_s"] == 0.0  # no keras_scale piece reports redone work yet
    assert_adds_up(s)


# --- FLOPs, MFU ------------------------------------------------------------------------------------------------

def test_flops_per_step_match_the_analytic_count_and_mfu_uses_peak_flops():
    model, goodput = build(), ks.Goodput(verbose=0, peak_flops=2e12)
    model.fit(dataset(20), epochs=1, verbose=0, callbacks=[goodput])
    s = goodput.summary
    analytic = 6 * BATCH * model.count_params()
    assert abs(s["flops_per_step"] - analytic) <= 0.15 * analytic, (s["flops_per_step"], analytic)
    achieved = s["flops_per_step"] * s["steps"] / s["productive_s"]
    assert s["tflops_per_s"] == pytest.approx(achieved / 1e12)
    assert s["mfu"] == pytest.approx(achieved / 2e12)
    cpu_only = ks.Goodput(verbose=0)
    model.fit(dataset(5), epochs=1, verbose=0, callbacks=[cpu_only])
    if not tf.config.list_physical_devices("GPU"):
        assert cpu_only.summary["mfu"] is None and cpu_only.summary["tflops_per_s"] > 0


def test_flops_are_counted_once_per_model_graph_not_per_fit(monkeypatch):
    from keras_scale.callbacks import goodput as goodput_lib

    calls = []
    real = goodput_lib.traced_flops_per_step
    monkeypatch.setattr(goodput_lib, "traced_flops_per_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = build()
    counts = []
    for _ in range(3):  # a model fitted in a loop, fresh Goodput each time: one FLOPs trace (~0.1-0.2 s), not three
        goodput = ks.Goodput(verbose=0)
        model.fit(dataset(5), epochs=1, verbose=0, callbacks=[goodput])
        counts.append(goodput.summary["flops_per_step"])
    assert len(calls) == 1 and counts[0] == counts[1] == counts[2] > 0
    model.layers[0].trainable = False  # a different graph: no gradient for the first layer's kernel
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    goodput = ks.Goodput(verbose=0)
    model.fit(dataset(5), epochs=1, verbose=0, callbacks=[goodput])
    assert len(calls) == 2 and goodput.summary["flops_per_step"] > 0  # recounted for the new trainable set


def test_peak_table_lookup_by_nvml_name_and_dtype():
    assert peak_flops_for("NVIDIA A100-SXM4-80GB", "bf16")[0] == 312e12
    assert peak_flops_for("NVIDIA A10", "bf16")[0] == 125e12  # not the A100's figure
    assert peak_flops_for("NVIDIA L40S", "bf16")[0] == 362.05e12  # the datasheet's dense figure, not 366
    assert peak_flops_for("NVIDIA L40", "bf16")[0] == 181.05e12  # not the L40S's
    assert peak_flops_for("NVIDIA L4", "bf16")[0] == 121e12  # 242 "with sparsity", halved
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "bf16")[0] == 989.5e12  # 1,979 with sparsity, halved
    assert peak_flops_for("NVIDIA H100 PCIe", "bf16")[0] < peak_flops_for("NVIDIA H100 80GB HBM3", "bf16")[0]
    assert peak_flops_for("Tesla T4", "bf16")[0] == 8.1e12  # no bf16 tensor cores: its fp32 figure
    assert peak_flops_for("Tesla V100-SXM2-16GB", "fp16")[0] == 125e12  # SXM2, not the PCIe figure
    assert peak_flops_for("Tesla V100-PCIE-32GB", "fp16")[0] == 112e12
    assert peak_flops_for("NVIDIA GeForce GTX 1080", "fp32") is None and peak_flops_for(None, "fp32") is None
    for entry in PEAK_TFLOPS:  # dense figures, each citing the datasheet numbers it comes from
        assert entry.dense and "datasheet" in entry.source
        assert "with sparsity, dense = half" in entry.source or "dense" in entry.source, entry
        for dtype, tflops in entry.tflops.items():
            assert f"{tflops:g}" in entry.source.replace(",", "") or f"{2 * tflops:g}" in entry.source.replace(
                ",", ""), (entry.match, dtype, tflops)
    mixed = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, dtype="mixed_bfloat16")])
    assert compute_dtype(mixed) == "bf16"


@pytest.mark.parametrize("kwargs", [{"peak_flops": 0}, {"peak_flops": "fast"}, {"peak_flops": 312}, {"peak_flops": float("inf")}, {"probe_fraction": 0.5},
                                    {"verbose": 2.5}, {"log_dir": 3}])
def test_bad_input(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ks.Goodput(**kwargs)


# --- output: logs, TensorBoard, table, ks.fit ------------------------------------------------------------------

def test_table_tensorboard_and_ks_fit_default(tmp_path, capsys):
    x, y = data(10)
    history = ks.fit(build, x, y, global_batch_size=BATCH, epochs=2, strategy="default", verbose=1,
                     log_dir=str(tmp_path / "tb"), checkpoint_dir=str(tmp_path / "ckpt"))
    out = capsys.readouterr().out
    assert "productive training steps" in out and "input wait" in out and "FLOPs/step" in out
    assert len(history.history["goodput"]) == 2
    events = glob.glob(str(tmp_path / "tb" / "train" / "events.*"))
    assert events
    tags = {v.tag for path in events for e in tf.compat.v1.train.summary_iterator(path) for v in e.summary.value}
    assert {"goodput/goodput", "goodput/input_wait_s", "goodput/checkpoint_s"} <= tags
    # one tag per quantity: the input wait once, in seconds like the other time parts (its fraction is History's)
    assert [t for t in tags if t.startswith("goodput/input_wait")] == ["goodput/input_wait_s"], sorted(tags)
    assert "goodput_input_wait_fraction" in history.history


# --- 2 replicas, 2 workers -------------------------------------------------------------------------------------

def test_two_replicas(mirrored):
    with mirrored.scope():
        model = build()
    goodput = ks.Goodput(verbose=0)
    model.fit(dataset(20), epochs=2, verbose=0, callbacks=[goodput])
    s = goodput.summary
    assert_adds_up(s)
    assert s["samples"] == 2 * 20 * BATCH and s["steps"] == 40
    analytic = 6 * BATCH * model.count_params()  # the global batch over both replicas
    assert abs(s["flops_per_step"] - analytic) <= 0.15 * analytic


@pytest.mark.slow
def test_two_workers_chief_only_output(chief_only_job):
    results, tmp_path = chief_only_job  # tests/_chief_only_job.py, part "goodput"
    summaries = [json.loads((tmp_path / f"goodput_{i}.json").read_text()) for i in range(2)]
    for s in summaries:
        assert_adds_up(s)
        assert s["steps"] == 16 and s["samples"] == 2 * 512 and s["flops_per_step"] > 0
    assert "productive training steps" in results[0].stdout
    assert "productive training steps" not in results[1].stdout
    event_files = glob.glob(str(tmp_path / "goodput_tb" / "**" / "events.out.tfevents.*"), recursive=True)
    # the chief's only, in the one run: Goodput's writer and, since every keras_scale callback of the fit writes to
    # the run directory a callback names, ks.fit's default callbacks' writers too (file names end .<pid>.<n>.v2)
    assert event_files and all(os.sep + "train" + os.sep in f for f in event_files), event_files
    assert len({os.path.basename(f).split(".")[-3] for f in event_files}) == 1, event_files  # one process wrote
    from keras_scale import events  # the dashboard's stream: the chief's records only

    records = events.read(str(tmp_path / "goodput_tb"))
    assert {e["kind"] for e in records} == {"epoch", "fit_end"} and len({e["pid"] for e in records}) == 1
