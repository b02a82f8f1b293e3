"""``GpuMonitor``: is the GPU starved, and why — NVML metrics, step time and advice, inside ``model.fit``.

A background thread samples NVML every ``interval_s`` (never the batch hooks); the batch hooks only append a
timestamp. At each epoch end the samples taken during that epoch's training steps are reduced to mean/max per
GPU and written to ``logs`` (``gpu0_util_mean``, ``gpu0_mem_max_mb``, ...), to TensorBoard (chief only), and
checked against a few advice rules (input-bound, GPU idle, compute-bound, memory near full, throttling).

Example:
    >>> import keras_scale as ks
    >>> monitor = ks.GpuMonitor(interval_s=1.0, log_dir="runs/gpu", batch_size=256)
    >>> model.fit(ds, epochs=3, callbacks=[monitor])  # doctest: +SKIP
    >>> monitor.history[-1]["gpu0"]["util_gpu_pct_mean"]  # doctest: +SKIP
    93.5
"""
from __future__ import annotations

import math
import numbers
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import keras

from keras_scale import nvml as nvml_lib
from keras_scale.callbacks._scalars import ChiefScalars
from keras_scale.distribute import is_chief

__all__ = [
    "GpuMonitor", "EpochStats", "Advice", "AdviceThresholds", "aggregate_samples", "step_timing",
    "DEFAULT_RULES", "input_bound_rule", "input_rate_rule", "gpu_idle_rule", "compute_bound_rule", "memory_rule", "throttle_rule",
]

NvmlLike = Any  # anything with the keras_scale.nvml.Nvml methods (devices, sample, processes, close)

# Full metric name -> short name used in logs / TensorBoard, and its unit suffix (placed last, as in
# ``gpu0_mem_max_mb``; percentages carry no suffix, as in ``gpu0_util_mean``).
_SHORT = {
    "util_gpu_pct": ("util", ""),
    "util_mem_pct": ("mem_util", ""),
    "mem_used_mb": ("mem", "_mb"),
    "power_w": ("power", "_w"),
    "temperature_c": ("temp", "_c"),
    "sm_clock_mhz": ("sm_clock", "_mhz"),
    "mem_clock_mhz": ("mem_clock", "_mhz"),
    "pcie_rx_mb_s": ("pcie_rx", "_mb_s"),
    "pcie_tx_mb_s": ("pcie_tx", "_mb_s"),
}
_CONSTANT = {"mem_total_mb": "mem_total_mb", "power_limit_w": "power_limit_w"}
# The few per-GPU values that go into Keras ``logs`` by default (all of them go to TensorBoard/history).
_SUMMARY_KEYS = ("util_mean", "util_max", "mem_util_mean", "mem_max_mb", "mem_total_mb", "power_mean_w",
                 "temp_max_c", "throttle_frac")


# ------------------------------------------------------------------------------------------- aggregation
def aggregate_samples(samples: Sequence[nvml_lib.GpuSample]) -> Dict[str, float]:
    """Mean and max of every metric over ``samples`` of one GPU, keyed by the short names used in logs.

    Throttle reasons become the fraction of samples in which they were active (``throttle_thermal_frac``),
    and ``throttle_frac`` is the fraction with any of them. Missing (unsupported) metrics are left out.

    Example:
        >>> from keras_scale.nvml import GpuSample
        >>> s = [GpuSample(0, 0.0, util_gpu_pct=40.0, mem_used_mb=100.0, throttle_thermal=False),
        ...      GpuSample(0, 1.0, util_gpu_pct=60.0, mem_used_mb=300.0, throttle_thermal=True)]
        >>> a = aggregate_samples(s)
        >>> a["util_mean"], a["util_max"], a["mem_max_mb"], a["throttle_thermal_frac"]
        (50.0, 60.0, 300.0, 0.5)
    """
    out: Dict[str, float] = {}
    if not samples:
        return out
    for name, (short, unit) in _SHORT.items():
        values = [v for v in (getattr(s, name) for s in samples) if v is not None]
        if values:
            out[f"{short}_mean{unit}"] = float(sum(values) / len(values))
            out[f"{short}_max{unit}"] = float(max(values))
    for name, short in _CONSTANT.items():
        values = [v for v in (getattr(s, name) for s in samples) if v is not None]
        if values:
            out[short] = float(max(values))
    any_known = False
    any_active = [False] * len(samples)
    for reason in nvml_lib.THROTTLE_REASONS:
        flags = [getattr(s, f"throttle_{reason}") for s in samples]
        known = [f for f in flags if f is not None]
        if known:
            any_known = True
            out[f"throttle_{reason}_frac"] = sum(1.0 for f in known if f) / len(known)
            any_active = [a or bool(f) for a, f in zip(any_active, flags)]
    if any_known:
        out["throttle_frac"] = sum(1.0 for a in any_active if a) / len(samples)
    return out


def step_timing(batch_ends: Sequence[Tuple[int, float]], epoch_begin_s: float,
                batch_size: Optional[int] = None) -> Dict[str, float]:
    """Step time and throughput from ``(batch_index, perf_counter_s)`` pairs recorded at each batch end.

    The first batch of the epoch is left out when there are others (it carries iterator start-up and, in the
    first epoch, tracing). ``batch_index`` gaps (``steps_per_execution > 1``) count as that many steps.

    Example:
        >>> t = step_timing([(0, 10.0), (1, 10.1), (2, 10.2), (3, 10.3)], epoch_begin_s=9.0, batch_size=32)
        >>> round(t["step_time_mean_ms"]), round(t["steps_per_s"]), round(t["samples_per_s"])
        (100, 10, 320)
    """
    if not batch_ends:
        return {}
    if len(batch_ends) == 1:
        (b, t), = batch_ends
        steps = b + 1
        per_step = [(t - epoch_begin_s) / max(steps, 1)]
        total_steps, total_s = steps, t - epoch_begin_s
    else:
        per_step = []
        for (b0, t0), (b1, t1) in zip(batch_ends, batch_ends[1:]):
            per_step.append((t1 - t0) / max(b1 - b0, 1))
        total_steps = max(batch_ends[-1][0] - batch_ends[0][0], 1)
        total_s = batch_ends[-1][1] - batch_ends[0][1]
    mean_s = total_s / total_steps
    out = {"step_time_mean_ms": 1000.0 * mean_s, "step_time_max_ms": 1000.0 * max(per_step)}
    if mean_s > 0:
        out["steps_per_s"] = 1.0 / mean_s
        if batch_size:
            out["samples_per_s"] = batch_size / mean_s
    return out


# ------------------------------------------------------------------------------------------------ advice
@dataclass(frozen=True)
class AdviceThresholds:
    """When the advice rules speak. Percentages are 0-100; fractions 0-1.

    Example:
        >>> GpuMonitor(advice=AdviceThresholds(low_util_pct=30.0))  # doctest: +SKIP
    """

    low_util_pct: float = 50.0
    busy_host_cpu_pct: float = 80.0
    input_rate_margin: float = 1.25  # pipeline alone <= 1.25x the step rate: the pipeline is the limit
    high_util_pct: float = 85.0
    memory_full_frac: float = 0.95
    throttle_frac: float = 0.2


@dataclass
class EpochStats:
    """What the advice rules look at for one epoch (built by :class:`GpuMonitor`; easy to fabricate in tests).

    ``gpus`` maps NVML index to :func:`aggregate_samples` output. ``memory_readings_meaningful`` is False when
    TensorFlow reserves (almost) all GPU memory up front (its default), so NVML's "used" says nothing.

    Example:
        >>> stats = EpochStats(epoch=0, gpus={0: {"util_mean": 20.0}}, host_cpu_mean_pct=95.0)
        >>> [a.kind for a in input_bound_rule(stats, AdviceThresholds())]
        ['input_bound']
    """

    epoch: int
    gpus: Dict[int, Dict[str, float]]
    host_cpu_mean_pct: Optional[float] = None
    timing: Dict[str, float] = field(default_factory=dict)
    mixed_precision: bool = False
    jit_compile: bool = False
    memory_readings_meaningful: bool = True
    input_batches_per_s: Optional[float] = None  # the pipeline alone (keras_scale.data.benchmark), when given


@dataclass(frozen=True)
class Advice:
    """One piece of advice: ``kind`` (e.g. ``"input_bound"``), the GPU it is about (or None), the message.

    Example:
        >>> Advice("throttling", 0, "GPU 0 is throttled ...").kind
        'throttling'
    """

    kind: str
    gpu_index: Optional[int]
    message: str


Rule = Callable[[EpochStats, AdviceThresholds], List[Advice]]


def _mean_util(stats: EpochStats) -> Optional[float]:
    utils = [g["util_mean"] for g in stats.gpus.values() if "util_mean" in g]
    return sum(utils) / len(utils) if utils else None


def _rate_text(stats: EpochStats) -> str:
    t = stats.timing
    if "samples_per_s" in t:
        return f" (training runs at {t['samples_per_s']:.0f} samples/s, {t['step_time_mean_ms']:.1f} ms/step)"
    if "steps_per_s" in t:
        return f" (training runs at {t['steps_per_s']:.2f} steps/s, {t['step_time_mean_ms']:.1f} ms/step)"
    return ""


def input_bound_rule(stats: EpochStats, th: AdviceThresholds) -> List[Advice]:
    """Low GPU utilisation while the host CPU is busy: the input pipeline is the bottleneck.

    Example:
        >>> input_bound_rule(EpochStats(0, {0: {"util_mean": 90.0}}, host_cpu_mean_pct=95.0), AdviceThresholds())
        []
    """
    util = _mean_util(stats)
    cpu = stats.host_cpu_mean_pct
    if util is None or cpu is None or util >= th.low_util_pct or cpu < th.busy_host_cpu_pct:
        return []
    if _input_ahead(stats, th):
        return []  # measured: the pipeline alone is far faster than the steps, so it is not what starves the GPU
    return [Advice("input_bound", None, (
        f"Input-bound: GPU utilisation is {util:.0f}% while the host CPU is {cpu:.0f}% busy{_rate_text(stats)}. "
        "The GPU waits for data. Fix the tf.data pipeline: `.map(f, num_parallel_calls=tf.data.AUTOTUNE)`, "
        "`.prefetch(tf.data.AUTOTUNE)` at the end, `.cache()` after expensive decoding, no py_function in map "
        "(`keras_scale.data.check(ds)` lists these). Measure the pipeline alone with "
        "`keras_scale.data.benchmark(ds, num_steps=...)` and compare with the step rate; "
        "`keras_scale.ProfileWindow` shows the input-wait share per step."))]


def _input_ahead(stats: EpochStats, th: AdviceThresholds) -> bool:
    steps = stats.timing.get("steps_per_s")
    return bool(stats.input_batches_per_s and steps and stats.input_batches_per_s > 2 * th.input_rate_margin * steps)


def input_rate_rule(stats: EpochStats, th: AdviceThresholds) -> List[Advice]:
    """The pipeline alone (``keras_scale.data.benchmark``) is barely faster than training: input is the limit.

    Only speaks when ``GpuMonitor(input_batches_per_s=...)`` was given.

    Example:
        >>> s = EpochStats(0, {0: {"util_mean": 40.0}}, timing={"steps_per_s": 10.0}, input_batches_per_s=11.0)
        >>> [a.kind for a in input_rate_rule(s, AdviceThresholds())]
        ['input_rate']
    """
    steps = stats.timing.get("steps_per_s")
    rate = stats.input_batches_per_s
    if not rate or not steps or rate > th.input_rate_margin * steps:
        return []
    return [Advice("input_rate", None, (
        f"Input-limited: the input pipeline alone delivers {rate:.1f} batches/s and training runs at "
        f"{steps:.1f} steps/s, so the steps cannot go faster than the data. Speed up the pipeline "
        "(`keras_scale.data.optimize(ds)`: parallel map, prefetch; `.cache()` after expensive decoding) "
        "and measure again with `keras_scale.data.benchmark(ds, num_steps=...)`."))]


def gpu_idle_rule(stats: EpochStats, th: AdviceThresholds) -> List[Advice]:
    """Low GPU utilisation and an idle host: launch-bound, tiny batches, single-threaded input or waiting on I/O.

    Example:
        >>> [a.kind for a in gpu_idle_rule(EpochStats(0, {0: {"util_mean": 10.0}}, 20.0), AdviceThresholds())]
        ['gpu_idle']
    """
    util = _mean_util(stats)
    cpu = stats.host_cpu_mean_pct
    if util is None or cpu is None or util >= th.low_util_pct or cpu >= th.busy_host_cpu_pct:
        return []
    return [Advice("gpu_idle", None, (
        f"GPU mostly idle: utilisation {util:.0f}% and the host CPU only {cpu:.0f}% busy{_rate_text(stats)}. "
        "Likely causes: steps too small to fill the GPU (raise the batch size, or `steps_per_execution`), a "
        "single-threaded input (a Python generator uses one core; use tf.data with parallel map), or reading "
        "from slow storage. `keras_scale.ProfileWindow` tells these apart; "
        "`keras_scale.data.benchmark(ds, num_steps=...)` measures the input alone."))]


def compute_bound_rule(stats: EpochStats, th: AdviceThresholds) -> List[Advice]:
    """High GPU utilisation: the GPU is the bottleneck; suggest the levers not already on (mixed precision, XLA).

    Example:
        >>> compute_bound_rule(EpochStats(0, {0: {"util_mean": 99.0}}, mixed_precision=True, jit_compile=True),
        ...                    AdviceThresholds())
        []
    """
    util = _mean_util(stats)
    if util is None or util < th.high_util_pct:
        return []
    levers = []
    if not stats.mixed_precision:
        levers.append("mixed precision (`keras.mixed_precision.set_global_policy('mixed_bfloat16')` or "
                      "'mixed_float16' before building the model; `keras_scale.choose_precision()` picks one)")
    if not stats.jit_compile:
        levers.append("XLA (`model.compile(..., jit_compile=True)`; `keras_scale.compare_xla` measures it)")
    if not levers:
        return []
    return [Advice("compute_bound", None, (
        f"Compute-bound: GPU utilisation is {util:.0f}%{_rate_text(stats)}, so more samples/s must come from "
        "doing less work per sample: " + "; ".join(levers) + "."))]


def memory_rule(stats: EpochStats, th: AdviceThresholds) -> List[Advice]:
    """GPU memory close to full (only when readings mean something, see :class:`EpochStats`).

    Example:
        >>> s = EpochStats(0, {0: {"mem_max_mb": 79000.0, "mem_total_mb": 81000.0}})
        >>> [a.kind for a in memory_rule(s, AdviceThresholds())]
        ['memory_full']
    """
    if not stats.memory_readings_meaningful:
        return []
    out = []
    for index, g in sorted(stats.gpus.items()):
        used, total = g.get("mem_max_mb"), g.get("mem_total_mb")
        if used is None or not total or used / total < th.memory_full_frac:
            continue
        out.append(Advice("memory_full", index, (
            f"GPU {index} memory is near full: peak {used:.0f} of {total:.0f} MiB ({100 * used / total:.0f}%). "
            "One larger batch or model will not fit. Keep the global batch and cut per-step memory with gradient "
            "accumulation (`keras_scale.wrap(model, accum=N)` with an N times smaller batch), mixed precision, "
            "or rematerialisation (`keras_scale.remat`).")))
    return out


def throttle_rule(stats: EpochStats, th: AdviceThresholds) -> List[Advice]:
    """Clocks lowered by temperature, the power cap or a hardware slowdown for a noticeable share of the epoch.

    Example:
        >>> s = EpochStats(0, {0: {"throttle_thermal_frac": 0.5, "temp_max_c": 89.0}})
        >>> [a.kind for a in throttle_rule(s, AdviceThresholds())]
        ['throttling']
    """
    out = []
    for index, g in sorted(stats.gpus.items()):
        active = [(r, g[f"throttle_{r}_frac"]) for r in nvml_lib.THROTTLE_REASONS
                  if g.get(f"throttle_{r}_frac", 0.0) >= th.throttle_frac]
        if not active:
            continue
        what = ", ".join(f"{r.replace('_', ' ')} {100 * f:.0f}% of the time" for r, f in active)
        details = []
        if "temp_max_c" in g:
            details.append(f"max {g['temp_max_c']:.0f} C")
        if "power_max_w" in g and "power_limit_w" in g:
            details.append(f"power up to {g['power_max_w']:.0f} of {g['power_limit_w']:.0f} W")
        fixes = []
        reasons = {r for r, _ in active}
        if reasons & {"thermal", "hw_slowdown"}:
            fixes.append("check cooling (airflow, fans, inlet temperature, dust) and `nvidia-smi -q -d "
                         "PERFORMANCE,TEMPERATURE`")
        if reasons & {"power_cap", "hw_slowdown"}:
            fixes.append("check the power limit (`nvidia-smi -q -d POWER`; an admin can raise it with "
                         "`nvidia-smi -pl`) and the PSU/power cables")
        out.append(Advice("throttling", index, (
            f"GPU {index} is throttled: {what}" + (f" ({', '.join(details)})" if details else "") +
            ". Its clocks drop, so steps get slower: " + "; ".join(fixes) + ".")))
    return out


DEFAULT_RULES: Tuple[Rule, ...] = (input_bound_rule, input_rate_rule, gpu_idle_rule, compute_bound_rule,
                                   memory_rule, throttle_rule)


# ---------------------------------------------------------------------------------------------- sampling
class _Sampler:
    """The background thread: samples every GPU (and the host CPU) every ``interval_s`` into a buffer."""

    def __init__(self, nvml: NvmlLike, indices: Sequence[int], interval_s: float,
                 read_host_cpu_pct: Optional[Callable[[], float]]) -> None:
        self.nvml = nvml
        self.indices = list(indices)
        self.interval_s = interval_s
        self.read_host_cpu_pct = read_host_cpu_pct
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.samples: List[Tuple[float, nvml_lib.GpuSample]] = []
        self.host_cpu: List[Tuple[float, float]] = []
        self.errors: List[str] = []
        self.thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self.read_host_cpu_pct is not None:
            self.read_host_cpu_pct()  # psutil's first reading is meaningless; prime it
        self.thread = threading.Thread(target=self._run, name="keras_scale-GpuMonitor", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.is_set():
            self.take()
            self.stop_event.wait(self.interval_s)

    def take(self) -> None:
        now = time.perf_counter()
        taken = []
        for index in self.indices:
            try:
                taken.append((now, self.nvml.sample(index)))
            except Exception as e:  # noqa: BLE001 - a GPU lost mid-run must not kill training
                if len(self.errors) < 10:
                    self.errors.append(f"GPU {index}: {type(e).__name__}: {e}")
        cpu = None
        if self.read_host_cpu_pct is not None:
            try:
                cpu = float(self.read_host_cpu_pct())
            except Exception:  # noqa: BLE001
                cpu = None
        with self.lock:
            self.samples.extend(taken)
            if cpu is not None:
                self.host_cpu.append((now, cpu))

    def drain(self) -> Tuple[List[Tuple[float, nvml_lib.GpuSample]], List[Tuple[float, float]]]:
        with self.lock:
            samples, cpu = self.samples, self.host_cpu
            self.samples, self.host_cpu = [], []
        return samples, cpu

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


def _psutil_cpu_reader() -> Optional[Callable[[], float]]:
    try:
        import psutil
    except ImportError:
        return None
    return lambda: psutil.cpu_percent(interval=None)


# ---------------------------------------------------------------------------------------------- callback
class GpuMonitor(keras.callbacks.Callback):
    """Sample the GPUs in a background thread during ``fit``; per epoch, log mean/max, step time and advice.

    Per epoch (over the epoch's training steps; the first step, which carries tracing, is left out):

    - ``logs`` (and so ``History``/``CSVLogger``) get, per GPU ``i``: ``gpu{i}_util_mean``, ``gpu{i}_util_max``,
      ``gpu{i}_mem_util_mean``, ``gpu{i}_mem_max_mb``, ``gpu{i}_mem_total_mb``, ``gpu{i}_power_mean_w``,
      ``gpu{i}_temp_max_c``, ``gpu{i}_throttle_frac``; plus ``step_time_mean_ms``, ``steps_per_s``,
      ``samples_per_s`` (when ``batch_size`` is given) and ``host_cpu_mean_pct``. ``full_logs=True`` adds every
      metric (clocks, PCIe, each throttle reason).
    - TensorBoard (``log_dir``, chief only): every metric as ``gpu{i}/<name>`` (one tag group per GPU),
      ``throughput/<name>`` and ``host/cpu_mean_pct``, step = epoch.
    - ``history``: a list with one dict per epoch holding all of it; ``advice_history``: every :class:`Advice`.

    At train start it lists processes that already hold memory on the GPUs it watches (a leftover run) and
    warns. GPU indices are NVML's (as ``nvidia-smi`` shows them); ``devices="all"`` means the GPUs this process
    may use after ``CUDA_VISIBLE_DEVICES``. Without NVML or GPUs it warns once and does nothing else.

    Args:
        interval_s: seconds between samples (> 0).
        log_dir: TensorBoard directory, or None for no TensorBoard output.
        devices: ``"all"`` or a list of NVML GPU indices.
        batch_size: global samples per step, for ``samples_per_s`` (Keras callbacks do not see the batch size).
        advice: True (default rules), False, an :class:`AdviceThresholds`, or a list of rule functions.
        full_logs: put every metric into ``logs``, not only the summary above.
        verbose: 0 silences the printed advice (warnings still go through ``warnings``).
        input_batches_per_s: the input pipeline's own rate, e.g. ``keras_scale.data.benchmark(ds).batches_per_s``
            (a number, or the benchmark result itself); lets the advice tell input-bound from other stalls.
        nvml: an object with the :class:`keras_scale.nvml.Nvml` methods, or a callable returning one; default
            :func:`keras_scale.nvml.open_nvml`. An object passed in is not closed by the monitor.

    Example:
        >>> monitor = GpuMonitor(interval_s=0.5, log_dir="runs/gpu", batch_size=128)
        >>> model.fit(ds, epochs=2, callbacks=[monitor])  # doctest: +SKIP
        >>> model.history.history["gpu0_util_mean"]  # doctest: +SKIP
        [41.0, 88.5]
    """

    def __init__(
        self,
        interval_s: float = 1.0,
        log_dir: Optional[Union[str, os.PathLike]] = None,
        devices: Union[str, Iterable[int]] = "all",
        batch_size: Optional[int] = None,
        advice: Union[bool, AdviceThresholds, Sequence[Rule]] = True,
        full_logs: bool = False,
        verbose: int = 1,
        input_batches_per_s: Any = None,
        nvml: Optional[Union[NvmlLike, Callable[[], NvmlLike]]] = None,
    ) -> None:
        super().__init__()
        if isinstance(interval_s, bool) or not isinstance(interval_s, numbers.Real) or not (
                math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be a number of seconds > 0, got {interval_s!r}. "
                             "Use e.g. interval_s=1.0.")
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ValueError(f"log_dir must be a path or None, got {log_dir!r}")
        if isinstance(devices, str):
            if devices != "all":
                raise ValueError(f"devices must be 'all' or a list of NVML GPU indices, got {devices!r}")
            self.devices: Union[str, List[int]] = "all"
        else:
            try:
                devs = list(devices)
            except TypeError:
                raise ValueError(f"devices must be 'all' or a list of NVML GPU indices, got {devices!r}") from None
            if not devs or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0 for d in devs):
                raise ValueError(f"devices must be 'all' or a non-empty list of GPU indices >= 0 (as nvidia-smi "
                                 f"numbers them), got {devices!r}")
            self.devices = sorted({int(d) for d in devs})
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral)
                                       or batch_size <= 0):
            raise ValueError(f"batch_size must be a positive integer (global samples per step) or None, "
                             f"got {batch_size!r}")
        if advice is True:
            self.thresholds, self.rules = AdviceThresholds(), tuple(DEFAULT_RULES)
        elif advice is False or advice is None:
            self.thresholds, self.rules = AdviceThresholds(), ()
        elif isinstance(advice, AdviceThresholds):
            self.thresholds, self.rules = advice, tuple(DEFAULT_RULES)
        else:
            rules = tuple(advice)
            if not all(callable(r) for r in rules):
                raise ValueError(f"advice must be True/False, an AdviceThresholds, or a list of rule functions "
                                 f"(stats, thresholds) -> list[Advice]; got {advice!r}")
            self.thresholds, self.rules = AdviceThresholds(), rules
        rate = getattr(input_batches_per_s, "batches_per_s", input_batches_per_s)
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, numbers.Real) or
                                 not math.isfinite(rate) or rate <= 0):
            raise ValueError(f"input_batches_per_s must be a positive number (batches/s) or the result of "
                             f"keras_scale.data.benchmark(ds), got {input_batches_per_s!r}")
        self.input_batches_per_s = None if rate is None else float(rate)
        self.interval_s = float(interval_s)
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.full_logs = bool(full_logs)
        self.verbose = int(verbose)
        self._nvml_source = nvml
        self.read_host_cpu_pct: Optional[Callable[[], float]] = _psutil_cpu_reader()

        self.history: List[Dict[str, Any]] = []
        self.advice_history: List[Advice] = []
        self.leftover_processes: List[nvml_lib.GpuProcess] = []
        self.unavailable_reason: Optional[str] = None
        self.gpu_indices: List[int] = []
        self._warned_unavailable = False
        self._active = False
        self._nvml: Optional[NvmlLike] = None
        self._owns_nvml = False
        self._sampler: Optional[_Sampler] = None
        self._scalars: Optional[ChiefScalars] = None
        self._batch_ends: List[Tuple[int, float]] = []
        self._epoch_begin_s = 0.0
        self._advised_kinds: set = set()
        self._context: Dict[str, bool] = {}

    # ------------------------------------------------------------------------------------------- hooks
    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self._shutdown()  # a previous fit that raised never reached on_train_end
        self._advised_kinds = set()
        self._active = self._open()
        if not self._active:
            return
        self.leftover_processes = self._find_leftover_processes()
        self._context = self._training_context()
        self._scalars = ChiefScalars(self.log_dir, strategy=getattr(self.model, "distribute_strategy", None))
        self._sampler = _Sampler(self._nvml, self.gpu_indices, self.interval_s, self.read_host_cpu_pct)
        self._sampler.start()

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        if not self._active:
            return
        self._sampler.drain()  # samples from between epochs (validation, other callbacks) are not this epoch's
        self._batch_ends = []
        self._epoch_begin_s = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self._active:
            self._batch_ends.append((batch, time.perf_counter()))

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if not self._active:
            return
        record = self._summarise_epoch(epoch)
        self.history.append(record)
        if logs is not None:
            logs.update(self._log_values(record))
        if self._scalars is not None:
            self._write_tensorboard(epoch, record)
        self._advise(record["stats"])

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        self._shutdown()

    # ----------------------------------------------------------------------------------------- helpers
    def _open(self) -> bool:
        source = self._nvml_source
        try:
            if source is None:
                self._nvml, self._owns_nvml = nvml_lib.open_nvml(), True
            elif callable(source) and not hasattr(source, "sample"):
                self._nvml, self._owns_nvml = source(), True
            else:
                self._nvml, self._owns_nvml = source, False
            gpus = self._nvml.devices()
        except nvml_lib.NvmlUnavailable as e:
            return self._unavailable(str(e))
        except Exception as e:  # noqa: BLE001 - any NVML failure means "no metrics", never a crashed fit
            return self._unavailable(f"NVML failed: {type(e).__name__}: {e}")
        known = {g.index for g in gpus}
        if self.devices == "all":
            self.gpu_indices = nvml_lib.visible_gpu_indices(gpus)
            if not self.gpu_indices:
                why = ("no GPU present" if not gpus else
                       f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} hides all "
                       f"{len(gpus)} GPU(s)")
                return self._unavailable(why)
        else:
            missing = [d for d in self.devices if d not in known]
            if missing:
                self._close_nvml()
                raise ValueError(f"GpuMonitor(devices={self.devices}): GPU(s) {missing} do not exist; NVML sees "
                                 f"{sorted(known)}. Use devices='all' or indices nvidia-smi lists.")
            self.gpu_indices = list(self.devices)
        self.unavailable_reason = None
        return True

    def _unavailable(self, reason: str) -> bool:
        self._close_nvml()
        self.unavailable_reason = reason
        if not self._warned_unavailable:
            self._warned_unavailable = True
            warnings.warn(f"GpuMonitor: GPU metrics are off ({reason}). Training continues; GpuMonitor does "
                          "nothing in this run.", RuntimeWarning, stacklevel=3)
        return False

    def _close_nvml(self) -> None:
        if self._nvml is not None and self._owns_nvml:
            try:
                self._nvml.close()
            except Exception:  # noqa: BLE001
                pass
        self._nvml, self._owns_nvml = None, False

    def _shutdown(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        if self._scalars is not None:
            self._scalars.close()
            self._scalars = None
        self._close_nvml()
        self._active = False

    def _find_leftover_processes(self) -> List[nvml_lib.GpuProcess]:
        me = os.getpid()
        found: List[nvml_lib.GpuProcess] = []
        for index in self.gpu_indices:
            try:
                found.extend(p for p in self._nvml.processes(index) if p.pid != me)
            except Exception:  # noqa: BLE001 - process listing not permitted: nothing to report
                continue
        if found:
            lines = "\n".join(
                f"  GPU {p.gpu_index}: pid {p.pid} ({p.name}) holds "
                f"{'?' if p.used_memory_mb is None else f'{p.used_memory_mb:.0f}'} MiB" for p in found)
            pids = " ".join(sorted({str(p.pid) for p in found}))
            others = sorted(set(self.gpu_indices) - {p.gpu_index for p in found})
            steer = (f" or run on the free GPU(s) with CUDA_VISIBLE_DEVICES={','.join(map(str, others))}"
                     if others else " or choose other GPUs with CUDA_VISIBLE_DEVICES")
            warnings.warn(
                "GpuMonitor: other processes already hold memory on the GPUs this job uses (often a leftover "
                f"run):\n{lines}\nThey slow this run or make it run out of memory. If they are stale: "
                f"`kill {pids}`{steer}.", RuntimeWarning, stacklevel=3)
        return found

    def _training_context(self) -> Dict[str, bool]:
        model = self.model
        policy = getattr(getattr(model, "dtype_policy", None), "name", "") or ""
        jit = getattr(model, "jit_compile", False)
        meaningful = os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH", "").strip().lower() == "true"
        if not meaningful:
            try:
                import tensorflow as tf

                gpus = tf.config.list_physical_devices("GPU")
                meaningful = bool(gpus) and all(tf.config.experimental.get_memory_growth(g) for g in gpus)
            except Exception:  # noqa: BLE001
                meaningful = False
        return {"mixed_precision": policy.startswith("mixed"), "jit_compile": jit is True,
                "memory_readings_meaningful": meaningful}

    def _summarise_epoch(self, epoch: int) -> Dict[str, Any]:
        samples, cpu = self._sampler.drain()
        ends = self._batch_ends
        window = (ends[0][1], ends[-1][1]) if len(ends) >= 2 else None
        in_window = [s for s in samples if window and window[0] <= s[0] <= window[1]]
        if not in_window:
            in_window = samples  # short epoch: use what there is
        if not in_window:  # shorter than one interval: one reading now (an epoch hook, not a step hook)
            self._sampler.take()
            in_window, cpu = self._sampler.drain()
        cpu_in = [c for t, c in cpu if window and window[0] <= t <= window[1]] or [c for _, c in cpu]
        per_gpu: Dict[int, List[nvml_lib.GpuSample]] = {i: [] for i in self.gpu_indices}
        for _, s in in_window:
            per_gpu.setdefault(s.index, []).append(s)
        gpus = {i: aggregate_samples(v) for i, v in per_gpu.items()}
        timing = step_timing(ends, self._epoch_begin_s, self.batch_size)
        host_cpu = sum(cpu_in) / len(cpu_in) if cpu_in else None
        stats = EpochStats(epoch=epoch, gpus=gpus, host_cpu_mean_pct=host_cpu, timing=timing,
                           input_batches_per_s=self.input_batches_per_s, **self._context)
        record: Dict[str, Any] = {"epoch": epoch, "num_samples": len(in_window), "timing": timing,
                                  "host_cpu_mean_pct": host_cpu, "stats": stats}
        record.update({f"gpu{i}": g for i, g in gpus.items()})
        return record

    def _log_values(self, record: Dict[str, Any]) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for i in self.gpu_indices:
            for key, value in record[f"gpu{i}"].items():
                if self.full_logs or key in _SUMMARY_KEYS:
                    out[f"gpu{i}_{key}"] = value
        out.update(record["timing"])
        if record["host_cpu_mean_pct"] is not None:
            out["host_cpu_mean_pct"] = record["host_cpu_mean_pct"]
        return out

    def _write_tensorboard(self, epoch: int, record: Dict[str, Any]) -> None:
        scalars = {f"gpu{i}/{key}": value for i in self.gpu_indices for key, value in record[f"gpu{i}"].items()}
        scalars.update({f"throughput/{key}": value for key, value in record["timing"].items()})
        if record["host_cpu_mean_pct"] is not None:
            scalars["host/cpu_mean_pct"] = record["host_cpu_mean_pct"]
        self._scalars.write(scalars, step=epoch)

    def _advise(self, stats: EpochStats) -> None:
        chief = is_chief(getattr(self.model, "distribute_strategy", None))
        for rule in self.rules:
            for advice in rule(stats, self.thresholds):
                self.advice_history.append(advice)
                key = (advice.kind, advice.gpu_index)
                if key in self._advised_kinds:
                    continue  # say each thing once per fit; advice_history keeps every epoch
                self._advised_kinds.add(key)
                if chief and self.verbose:
                    print(f"GpuMonitor (epoch {stats.epoch + 1}): {advice.message}", flush=True)
