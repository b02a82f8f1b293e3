"""GpuMonitor: sampling thread, aggregation, step timing, advice rules, TensorBoard output, no-GPU behaviour.

NVML is faked (tests/fakes/fake_nvml.py); the no-NVML test uses the real pynvml on this GPU-less machine.
"""
import glob
import json
import os
import threading
import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_scale import advice as adv
from keras_scale import nvml as nvml_lib
from keras_scale.callbacks import gpu_monitor as gm
from keras_scale.callbacks.gpu_monitor import GpuMonitor
from keras_scale.nvml import GpuProcess, GpuSample
from tests.fakes.fake_nvml import FakeNvml

THREAD_NAME = "keras_scale-GpuMonitor"


class _SlowSteps(keras.callbacks.Callback):
    """Makes each step last a few ms so the sampler gets readings inside the epoch's steps."""

    def __init__(self, sleep_s):
        super().__init__()
        self.sleep_s = sleep_s

    def on_train_batch_begin(self, batch, logs=None):
        time.sleep(self.sleep_s)


def _fit(monitor, epochs=2, steps=8, sleep_s=0.004, batch_size=8, callbacks_extra=(), **fit_kwargs):
    x = np.random.RandomState(0).rand(steps * batch_size, 4).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=fit_kwargs.pop("verbose", 0),
                        callbacks=[_SlowSteps(sleep_s), monitor, *callbacks_extra], **fit_kwargs)
    return model, history


def _monitor_threads():
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


@pytest.fixture(autouse=True)
def _no_visible_devices_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)
    monkeypatch.delenv("TF_GPU_ALLOCATOR", raising=False)
    monkeypatch.delenv("TF_CONFIG", raising=False)


# --------------------------------------------------------------------------------------- construction
@pytest.mark.parametrize("kwargs,match", [
    (dict(interval_s=0), "interval_s"), (dict(interval_s=-1.0), "interval_s"), (dict(interval_s="1"), "interval_s"),
    (dict(interval_s=float("nan")), "interval_s"), (dict(devices="gpu0"), "devices"), (dict(devices=[]), "devices"),
    (dict(devices=[-1]), "devices"), (dict(devices=[0.5]), "devices"), (dict(batch_size=0), "batch_size"),
    (dict(batch_size=2.5), "batch_size"), (dict(advice=[1, 2]), "advice"), (dict(log_dir=3), "log_dir"),
    (dict(input_batches_per_s=0.0), "input_batches_per_s"), (dict(input_batches_per_s="fast"), "input_batches_per_s"),
    (dict(update_freq="batch"), "update_freq"), (dict(update_freq=0), "update_freq"),
    (dict(update_freq="-5s"), "update_freq"), (dict(update_freq=True), "update_freq"),
])
def test_bad_arguments_fail_at_construction_with_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        GpuMonitor(**kwargs)
    assert repr(next(iter(kwargs.values())))[:4] in str(e.value)


def test_numpy_integers_are_accepted():
    m = GpuMonitor(devices=np.array([1, 0]), batch_size=np.int64(32), interval_s=np.float32(0.5))
    assert m.devices == [0, 1] and m.batch_size == 32 and m.interval_s == 0.5


def test_unknown_device_index_fails_at_fit_start():
    with pytest.raises(ValueError, match=r"GPU\(s\) \[5\] do not exist; NVML sees \[0, 1\]"):
        _fit(GpuMonitor(devices=[0, 5], nvml=FakeNvml.with_gpus(2)), epochs=1)
    assert not _monitor_threads()


# ---------------------------------------------------------------------------------- pure aggregation
def test_aggregate_samples_mean_max_and_throttle_fractions():
    samples = [
        GpuSample(0, 0.0, util_gpu_pct=20.0, mem_used_mb=1000.0, mem_total_mb=8000.0, power_w=100.0,
                  throttle_thermal=False, throttle_power_cap=True, throttle_hw_slowdown=False),
        GpuSample(0, 1.0, util_gpu_pct=40.0, mem_used_mb=3000.0, mem_total_mb=8000.0, power_w=None,
                  throttle_thermal=True, throttle_power_cap=True, throttle_hw_slowdown=False),
        GpuSample(0, 2.0, util_gpu_pct=90.0, mem_used_mb=2000.0, mem_total_mb=8000.0, power_w=200.0,
                  throttle_thermal=False, throttle_power_cap=False, throttle_hw_slowdown=False),
        GpuSample(0, 3.0, util_gpu_pct=10.0, mem_used_mb=2000.0, mem_total_mb=8000.0, power_w=150.0,
                  throttle_thermal=False, throttle_power_cap=False, throttle_hw_slowdown=False),
    ]
    a = gm.aggregate_samples(samples)
    assert a["util_mean"] == 40.0 and a["util_max"] == 90.0
    assert a["mem_mean_mb"] == 2000.0 and a["mem_max_mb"] == 3000.0 and a["mem_total_mb"] == 8000.0
    assert a["power_mean_w"] == 150.0 and a["power_max_w"] == 200.0  # the missing reading is skipped
    assert a["throttle_thermal_frac"] == 0.25 and a["throttle_power_cap_frac"] == 0.5
    assert a["throttle_hw_slowdown_frac"] == 0.0
    assert a["throttle_frac"] == 0.5  # samples 0 and 1 have at least one reason
    assert "temp_mean_c" not in a  # never reported -> absent, not 0
    assert gm.aggregate_samples([]) == {}


def test_step_timing_skips_first_step_and_counts_steps_per_execution():
    ends = [(1, 5.0), (3, 5.2), (5, 5.4), (7, 5.8)]  # steps_per_execution=2: hooks every 2 steps
    t = gm.step_timing(ends, epoch_begin_s=0.0, batch_size=64)
    assert t["step_time_mean_ms"] == pytest.approx(800.0 / 6)  # 0.8 s over 6 steps; the slow first call left out
    assert t["step_time_max_ms"] == pytest.approx(200.0)
    assert t["samples_per_s"] == pytest.approx(64 * 6 / 0.8)
    one = gm.step_timing([(3, 2.0)], epoch_begin_s=1.0)
    assert one["step_time_mean_ms"] == pytest.approx(250.0) and "samples_per_s" not in one
    assert gm.step_timing([], 0.0) == {}


# ------------------------------------------------------------------------------ the callback in fit
def test_fit_logs_per_epoch_mean_max_from_background_thread():
    # util alternates 20 / 60 per reading on GPU 0, constant 90 on GPU 1
    def metrics(index, n):
        return {"util_gpu_pct": (20.0 if n % 2 == 0 else 60.0) if index == 0 else 90.0,
                "mem_used_mb": 1000.0 + 10 * index}

    fake = FakeNvml(FakeNvml.with_gpus(2).devices(), metrics=metrics)
    monitor = GpuMonitor(interval_s=0.002, nvml=fake, batch_size=8, advice=False)
    _, history = _fit(monitor, epochs=2, steps=10, sleep_s=0.01)
    h = history.history
    assert len(h["gpu_util_mean"]) == 2
    for epoch in range(2):
        g0, g1 = monitor.history[epoch]["gpu0"], monitor.history[epoch]["gpu1"]
        assert 20.0 <= g0["util_mean"] <= 60.0 and g0["util_max"] == 60.0 and g1["util_mean"] == 90.0
        assert g1["mem_max_mb"] == 1010.0 and g0["mem_total_mb"] == 16000.0
        # logs: aggregates over the GPUs (mean utilisation, the fullest GPU's memory)
        assert h["gpu_util_mean"][epoch] == pytest.approx((g0["util_mean"] + g1["util_mean"]) / 2)
        assert h["gpu_mem_max_mb"][epoch] == 1010.0 and h["gpu_throttle_frac"][epoch] == 0.0
        assert h["samples_per_s"][epoch] == pytest.approx(8 * h["steps_per_s"][epoch])
        assert h["steps_per_s"][epoch] == pytest.approx(1000.0 / h["step_time_mean_ms"][epoch])
        assert monitor.history[epoch]["num_samples"] >= 2
    # no per-GPU key in logs by default; every metric in monitor.history
    assert not [k for k in h if k.startswith("gpu0") or k.startswith("gpu1")]
    assert "sm_clock_mean_mhz" in monitor.history[0]["gpu0"]
    # sampled by the background thread (at most one fallback reading per GPU per epoch elsewhere)
    threads = [name for _, name in fake.sample_calls]
    assert threads.count(THREAD_NAME) >= 4
    assert len(threads) - threads.count(THREAD_NAME) <= 2 * 2
    # the thread stopped at train end and samples no more; an NVML object passed in is not closed
    assert not _monitor_threads()
    calls = len(fake.sample_calls)
    time.sleep(0.05)
    assert len(fake.sample_calls) == calls
    assert fake.closed is False


def test_full_logs_puts_every_metric_in_logs_and_factory_nvml_is_closed():
    fakes = []

    def factory():
        fakes.append(FakeNvml.with_gpus(1, throttle_thermal=True))
        return fakes[-1]

    _, history = _fit(GpuMonitor(interval_s=0.002, nvml=factory, full_logs=True, advice=False), epochs=1)
    h = history.history
    for key in ("gpu0_sm_clock_mean_mhz", "gpu0_pcie_rx_max_mb_s", "gpu0_power_limit_w", "gpu0_temp_mean_c",
                "gpu0_throttle_power_cap_frac"):
        assert key in h, key
    assert h["gpu0_throttle_thermal_frac"] == [1.0] and h["gpu0_throttle_frac"] == [1.0]
    assert "samples_per_s" not in h  # batch size not given: steps/s only
    assert fakes[0].closed


def test_logs_stay_short_with_eight_gpus():
    one, eight = GpuMonitor(interval_s=0.002, nvml=FakeNvml.with_gpus(1)), GpuMonitor(
        interval_s=0.002, nvml=FakeNvml.with_gpus(8), verbose=0)
    _, h1 = _fit(one, epochs=1, steps=4)
    _, h8 = _fit(eight, epochs=1, steps=4)
    assert set(h8.history) == set(h1.history)  # the same few aggregate keys, whatever the number of GPUs
    assert len(h8.history) <= 9
    assert sorted(k for k in eight.history[0] if k.startswith("gpu")) == [f"gpu{i}" for i in range(8)]


class _Untouchable:
    """A log value that fails when read: a batch hook that reads logs (a device sync on a GPU) would raise."""

    def __float__(self):
        raise AssertionError("GpuMonitor read a log value in a batch hook")

    def numpy(self):
        raise AssertionError("GpuMonitor read a log value in a batch hook")


def test_batch_hooks_never_read_log_values(tmp_path):
    monitor = GpuMonitor(interval_s=0.001, nvml=FakeNvml.with_gpus(1), log_dir=str(tmp_path), update_freq=2)
    monitor.set_model(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    for step in range(6):
        monitor.on_train_batch_end(step, {"loss": _Untouchable(), "accuracy": _Untouchable()})
    monitor.on_epoch_end(0, {})
    monitor.on_train_end()
    assert monitor.history[0]["timing"]["steps_per_s"] > 0


def test_tensorboard_points_every_n_steps_and_every_n_seconds(tmp_path):
    steps = GpuMonitor(interval_s=0.002, nvml=FakeNvml.with_gpus(2), log_dir=str(tmp_path / "steps"),
                       update_freq=4, batch_size=8, advice=False)
    _fit(steps, epochs=2, steps=10)  # 20 steps: points at steps 4, 8, (10: epoch end), 14, 18, 20
    scalars = _read_scalars(str(tmp_path / "steps"))
    assert sorted(scalars["gpu1/util_mean"]) == [4, 8, 10, 14, 18, 20]
    assert sorted(scalars["throughput/steps_per_s"]) == [4, 8, 10, 14, 18, 20]
    assert all(v == 50.0 for v in scalars["gpu0/util_mean"].values())
    assert all(v == pytest.approx(8 * scalars["throughput/steps_per_s"][k])
               for k, v in scalars["throughput/samples_per_s"].items())
    assert "gpu_util_mean" in steps.model.history.history  # logs keep the per-epoch aggregates
    seconds = GpuMonitor(interval_s=0.002, nvml=FakeNvml.with_gpus(1), log_dir=str(tmp_path / "seconds"),
                         update_freq="0.02s", advice=False)
    _fit(seconds, epochs=1, steps=12, sleep_s=0.01)  # ~0.12 s of steps: a point about every 2 steps
    points = sorted(_read_scalars(str(tmp_path / "seconds"))["gpu0/util_mean"])
    assert 3 <= len(points) <= 12 and points[-1] == 12


def test_batch_hooks_never_sample_and_train_end_stops_the_thread_promptly():
    fake = FakeNvml.with_gpus(1)
    monitor = GpuMonitor(interval_s=3600.0, nvml=fake)  # one reading at start, then the thread waits
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    monitor.set_model(model)
    monitor.on_train_begin()
    deadline = time.time() + 10
    while not fake.sample_calls and time.time() < deadline:
        time.sleep(0.001)
    monitor.on_epoch_begin(0)
    before = len(fake.sample_calls)
    for step in range(200):
        monitor.on_train_batch_begin(step)
        monitor.on_train_batch_end(step, {"loss": 1.0})
    assert len(fake.sample_calls) == before == 1
    assert len(monitor._batch_ends) == 200
    monitor.on_train_end()  # must wake the thread from its 1-hour wait
    assert not _monitor_threads()


def test_fits_do_not_pile_up_finalizers_on_a_reused_monitor():
    """The monitor stops its sampler if it is dropped mid-fit (a weakref.finalize per fit); each fit's end detaches
    its own, so a monitor reused for many fits holds none afterwards (they kept the sampler objects alive)."""
    import weakref

    monitor = GpuMonitor(interval_s=0.002, nvml=FakeNvml.with_gpus(1), advice=False)

    def held():
        return [f for f in list(weakref.finalize._registry) if (f.peek() or (None,))[0] is monitor]

    for _ in range(4):
        _fit(monitor, epochs=1, steps=2, sleep_s=0.0)
    assert held() == []


def test_sampling_error_on_one_gpu_does_not_break_training():
    fake = FakeNvml(FakeNvml.with_gpus(2).devices(), fail_sample_for=[1])
    monitor = GpuMonitor(interval_s=0.002, nvml=fake, advice=False)
    _, history = _fit(monitor, epochs=1)
    assert history.history["gpu_util_mean"] == [50.0]  # GPU 1's failed readings are left out, not counted as 0
    assert monitor.history[0]["gpu1"] == {}


def test_leftover_processes_are_listed_with_the_fix_and_own_process_ignored():
    procs = {0: [GpuProcess(0, 999999, "python old_train.py", 10240.0),
                 GpuProcess(0, os.getpid(), "me", 500.0)]}
    fake = FakeNvml.with_gpus(2, processes=procs)
    monitor = GpuMonitor(interval_s=0.01, nvml=fake, advice=False)
    with pytest.warns(RuntimeWarning) as record:
        _fit(monitor, epochs=1)
    text = "\n".join(str(w.message) for w in record)
    assert "GPU 0: pid 999999 (python old_train.py) holds 10240 MiB" in text
    assert "kill 999999" in text and "CUDA_VISIBLE_DEVICES=1" in text
    assert f"pid {os.getpid()} " not in text
    assert [p.pid for p in monitor.leftover_processes] == [999999]


def test_no_leftover_warning_when_gpus_are_free():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _fit(GpuMonitor(interval_s=0.01, nvml=FakeNvml.with_gpus(1), advice=False), epochs=1)


def test_cuda_visible_devices_selects_the_gpus_sampled(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    fake = FakeNvml.with_gpus(3)
    monitor = GpuMonitor(interval_s=0.002, nvml=fake, advice=False)
    _, history = _fit(monitor, epochs=1)
    assert monitor.gpu_indices == [2]
    assert "gpu2" in monitor.history[0] and "gpu0" not in monitor.history[0]
    assert history.history["gpu_util_mean"] == [50.0]
    assert {i for i, _ in fake.sample_calls} == {2}


def test_cuda_visible_devices_empty_means_one_warning_and_nothing_else(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    fake = FakeNvml.with_gpus(2)
    with pytest.warns(RuntimeWarning, match="hides all 2 GPU"):
        _, history = _fit(GpuMonitor(nvml=fake), epochs=1)
    assert fake.sample_calls == [] and not any(k.startswith("gpu") for k in history.history)
    assert "steps_per_s" in history.history  # the host-side numbers stay


# ------------------------------------------------------------------------------------ no NVML at all
def test_without_nvml_one_warning_then_nothing():
    try:
        nvml_lib.open_nvml().close()
        pytest.skip("this machine has a GPU; the no-GPU path is covered on GPU-less machines")
    except nvml_lib.NvmlUnavailable:
        pass
    monitor = GpuMonitor(interval_s=0.001, log_dir=None, batch_size=8)  # the real pynvml: no driver here
    with pytest.warns(RuntimeWarning, match="GPU metrics are off") as record:
        _, history = _fit(monitor, epochs=2)
    assert len([w for w in record if "GpuMonitor" in str(w.message)]) == 1
    assert "no NVIDIA driver found" in str(record[0].message)
    assert monitor.unavailable_reason and len(monitor.history) == 2
    assert not _monitor_threads()
    # no GPU keys, but step time, throughput and host CPU are still logged
    h = history.history
    assert not [k for k in h if k.startswith("gpu")]
    assert {"loss", "step_time_mean_ms", "steps_per_s", "samples_per_s"} <= set(h)
    assert h["samples_per_s"][1] == pytest.approx(8 * h["steps_per_s"][1])
    if monitor.read_host_cpu_pct is not None:
        assert 0.0 <= h["host_cpu_mean_pct"][1] <= 100.0
    with warnings.catch_warnings():  # a second fit with the same monitor: no second warning
        warnings.simplefilter("error", RuntimeWarning)
        _fit(monitor, epochs=1)


# ---------------------------------------------------------------------------------------- advice in fit
def test_advice_printed_once_per_fit_and_recorded_each_epoch(monkeypatch, capsys):
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "true")  # NVML memory readings mean something
    fake = FakeNvml.with_gpus(1, mem_used_mb=15900.0, util_gpu_pct=60.0, throttle_thermal=True,
                              temperature_c=92.0)
    monitor = GpuMonitor(interval_s=0.002, nvml=fake, verbose=1)  # _fit runs fit(verbose=0)
    _fit(monitor, epochs=3)
    out = capsys.readouterr().out
    assert out.count("GPU 0 memory is near full") == 1
    assert out.count("GPU 0 is throttled: thermal 100% of the time (max 92 C") == 1
    kinds = [a.kind for a in monitor.advice_history]
    assert kinds.count("memory_full") == 3 and kinds.count("throttling") == 3
    assert "compute_bound" not in kinds  # 60% util: neither starved nor compute-bound


def test_memory_advice_speaks_under_the_async_allocator(monkeypatch):
    monkeypatch.setenv("TF_GPU_ALLOCATOR", "cuda_malloc_async")  # its pool grows to the peak in use
    monitor = GpuMonitor(interval_s=0.002, nvml=FakeNvml.with_gpus(1, mem_used_mb=15900.0), verbose=0)
    _fit(monitor, epochs=1)
    assert "memory_full" in [a.kind for a in monitor.advice_history]


def test_memory_advice_silent_when_tf_reserves_all_memory(capsys):
    fake = FakeNvml.with_gpus(1, mem_used_mb=15900.0)
    monitor = GpuMonitor(interval_s=0.002, nvml=fake)
    _fit(monitor, epochs=1)
    assert "memory_full" not in [a.kind for a in monitor.advice_history]


def test_verbose_zero_auto_under_quiet_fit_and_non_chief_print_no_advice(monkeypatch, capsys):
    fake = FakeNvml.with_gpus(1, throttle_power_cap=True)
    quiet = GpuMonitor(interval_s=0.002, nvml=fake, verbose=0)
    _fit(quiet, epochs=1, verbose=1)
    assert "throttled" not in capsys.readouterr().out
    auto = GpuMonitor(interval_s=0.002, nvml=FakeNvml.with_gpus(1, throttle_power_cap=True))  # verbose="auto"
    _fit(auto, epochs=1)  # fit(verbose=0): quiet, like Keras's callbacks
    assert "throttled" not in capsys.readouterr().out
    _fit(auto, epochs=1, verbose=2)
    assert capsys.readouterr().out.count("throttled") == 1
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["localhost:1", "localhost:2"]}, '
                                    '"task": {"type": "worker", "index": 1}}')
    worker = GpuMonitor(interval_s=0.002, nvml=FakeNvml.with_gpus(1, throttle_power_cap=True), verbose=1)
    _fit(worker, epochs=1)
    assert "throttled" not in capsys.readouterr().out
    assert [a.kind for a in quiet.advice_history] == ["throttling"]
    assert "throttling" in [a.kind for a in auto.advice_history]
    assert [a.kind for a in worker.advice_history] == ["throttling"]  # the worker still computes it


# ----------------------------------------------------------------------------------------- TensorBoard
def _read_scalars(log_dir):
    scalars = {}
    for path in glob.glob(os.path.join(log_dir, "train", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for v in event.summary.value:
                scalars.setdefault(v.tag, {})[event.step] = float(tf.make_ndarray(v.tensor))
    return scalars


def test_tensorboard_scalars_one_group_per_gpu(tmp_path):
    fake = FakeNvml(FakeNvml.with_gpus(2).devices(), metrics=lambda i, n: {"util_gpu_pct": 30.0 + 40 * i})
    monitor = GpuMonitor(interval_s=0.002, log_dir=str(tmp_path), nvml=fake, batch_size=8, advice=False)
    _, history = _fit(monitor, epochs=2)
    scalars = _read_scalars(str(tmp_path))
    assert scalars["gpu0/util_mean"] == {0: 30.0, 1: 30.0}
    assert scalars["gpu1/util_mean"] == {0: 70.0, 1: 70.0}
    assert set(scalars["gpu1/sm_clock_max_mhz"]) == {0, 1}  # every metric, not only the log summary
    assert scalars["throughput/samples_per_s"][1] == pytest.approx(history.history["samples_per_s"][1], rel=1e-6)
    assert {t.split("/")[0] for t in scalars} >= {"gpu0", "gpu1", "throughput"}


def test_only_the_chief_writes_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["localhost:1", "localhost:2"]}, '
                                    '"task": {"type": "worker", "index": 1}}')
    monitor = GpuMonitor(interval_s=0.002, log_dir=str(tmp_path / "tb"), nvml=FakeNvml.with_gpus(1), advice=False)
    _, history = _fit(monitor, epochs=1)
    assert not glob.glob(str(tmp_path / "tb" / "*"))
    assert history.history["gpu_util_mean"] == [50.0]  # the worker still samples its own GPUs


def test_input_rate_from_a_real_data_benchmark_feeds_the_advice():
    data = pytest.importorskip("keras_scale.data")
    ds = tf.data.Dataset.range(64).batch(8).repeat()
    result = data.benchmark(ds, num_steps=20, warmup_steps=2)
    monitor = GpuMonitor(nvml=FakeNvml.with_gpus(1), input_batches_per_s=result)
    assert monitor.input_batches_per_s == pytest.approx(result.batches_per_s)
    # a pipeline that is barely faster than training is reported as the limit
    slow = adv.EpochStats(0, {0: {"util_mean": 30.0}}, timing={"steps_per_s": 4.0}, input_batches_per_s=4.4)
    (advice,) = adv.input_rate_rule(slow, adv.AdviceThresholds())
    assert "4.4 batches/s" in advice.message and "4.0 steps/s" in advice.message


def test_fit_that_raises_leaves_no_thread_after_the_next_fit():
    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                raise RuntimeError("boom")

    fake = FakeNvml.with_gpus(1)
    monitor = GpuMonitor(interval_s=0.01, nvml=fake, advice=False)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(monitor, epochs=1, callbacks_extra=[Boom()])
    assert len(_monitor_threads()) == 1  # Keras calls no hook on an exception: the sampler still runs
    _, history = _fit(monitor, epochs=1)
    assert not _monitor_threads() and history.history["gpu_util_mean"] == [50.0]


@pytest.mark.slow
def test_multi_worker_each_samples_its_own_gpu_only_chief_writes_and_prints(chief_only_job):
    results, directory = chief_only_job  # tests/_chief_only_job.py, part "gpu_monitor"
    log_dir = str(directory / "gpu_tb")
    outs = [json.loads((directory / f"gpu_monitor_{i}.json").read_text()) for i in range(2)]
    (chief_i,) = [i for i, o in enumerate(outs) if o["chief"]]
    chief, worker = outs[chief_i], outs[1 - chief_i]
    assert chief["util"] == [20.0, 20.0] and worker["util"] == [70.0, 70.0]
    assert chief["advice"].count("throttling") == 2 and worker["advice"].count("throttling") == 2
    assert "is throttled" in results[chief_i].stdout and "is throttled" not in results[1 - chief_i].stdout
    files = glob.glob(os.path.join(log_dir, "train", "events.out.tfevents.*"))
    assert len(files) == 1
    assert _read_scalars(log_dir)["gpu0/util_mean"] == {0: 20.0, 1: 20.0}  # the chief's own GPU


def test_without_gpus_tensorboard_still_gets_throughput_and_host_cpu(tmp_path):
    def no_driver():
        raise nvml_lib.NvmlUnavailable("no NVIDIA driver found (fake)", "no_driver")

    monitor = GpuMonitor(interval_s=0.002, log_dir=str(tmp_path), nvml=no_driver, batch_size=8, advice=False)
    with pytest.warns(RuntimeWarning, match="only step time, throughput and host CPU"):
        _fit(monitor, epochs=2)
    tags = set(_read_scalars(str(tmp_path)))
    assert {"throughput/steps_per_s", "throughput/samples_per_s"} <= tags
    assert not [t for t in tags if t.startswith("gpu")]
    if monitor.read_host_cpu_pct is not None:
        assert "host/cpu_mean_pct" in tags
