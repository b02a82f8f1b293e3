"""Advice rules: what a training run's numbers mean and what to change — pure functions, no TensorFlow, no NVML.

Two kinds live here, so that a new rule has one home:

- *epoch rules* for :class:`keras_scale.GpuMonitor`: ``rule(stats: EpochStats, th: AdviceThresholds) ->
  list[Advice]`` (input-bound, GPU idle, compute-bound, memory full, throttling, input rate);
- shared messages both ``GpuMonitor`` and ``keras-scale doctor`` print, such as
  :func:`leftover_processes_message` (other processes holding GPU memory).

Example:
    >>> from keras_scale.advice import EpochStats, AdviceThresholds, DEFAULT_RULES
    >>> stats = EpochStats(epoch=0, gpus={0: {"util_mean": 20.0}}, host_cpu_mean_pct=95.0)
    >>> [a.kind for rule in DEFAULT_RULES for a in rule(stats, AdviceThresholds())]
    ['input_bound']
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from keras_scale.nvml import THROTTLE_REASONS, GpuProcess

__all__ = [
    "Advice", "AdviceThresholds", "EpochStats", "Rule", "DEFAULT_RULES", "input_bound_rule", "input_rate_rule",
    "gpu_idle_rule", "compute_bound_rule", "memory_rule", "throttle_rule", "leftover_processes_message",
]


# ------------------------------------------------------------------------------------------ epoch rules
@dataclass(frozen=True)
class AdviceThresholds:
    """When the advice rules speak. Percentages are 0-100; fractions 0-1.

    Example:
        >>> AdviceThresholds(low_util_pct=30.0).low_util_pct
        30.0
    """

    low_util_pct: float = 50.0
    busy_host_cpu_pct: float = 80.0
    input_rate_margin: float = 1.25  # pipeline alone <= 1.25x the step rate: the pipeline is the limit
    high_util_pct: float = 85.0
    memory_full_frac: float = 0.95
    throttle_frac: float = 0.2


@dataclass
class EpochStats:
    """What the advice rules look at for one epoch (built by ``GpuMonitor``; easy to fabricate in tests).

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
        active = [(r, g[f"throttle_{r}_frac"]) for r in THROTTLE_REASONS
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


# ------------------------------------------------------------------------------------------ shared messages
def leftover_processes_message(processes: Sequence[GpuProcess], gpu_indices: Sequence[int]) -> Tuple[str, str]:
    """``(what, fix)`` for other processes holding memory on the GPUs ``gpu_indices`` (often a leftover run).

    ``what`` lists each process with its GPU and memory; ``fix`` says how to check, stop them, or which free
    GPUs to use instead. ``GpuMonitor`` warns with it, ``keras-scale doctor`` reports it.

    Example:
        >>> what, fix = leftover_processes_message([GpuProcess(0, 4242, "python old.py", 10240.0)], [0, 1])
        >>> what
        'GPU 0: pid 4242 (python old.py) holds 10240 MiB'
        >>> print(fix)
        If they are leftovers of an earlier run (check with `ps -fp 4242`): kill 4242, or use the free GPU(s): \
CUDA_VISIBLE_DEVICES=1
    """
    what = "; ".join(f"GPU {p.gpu_index}: pid {p.pid} ({p.name}) holds "
                     f"{'?' if p.used_memory_mb is None else f'{p.used_memory_mb:.0f}'} MiB" for p in processes)
    pids = sorted({p.pid for p in processes})
    busy = {p.gpu_index for p in processes}
    free = [i for i in gpu_indices if i not in busy]
    steer = (f", or use the free GPU(s): CUDA_VISIBLE_DEVICES={','.join(map(str, free))}" if free
             else ", or choose other GPUs with CUDA_VISIBLE_DEVICES")
    fix = (f"If they are leftovers of an earlier run (check with `ps -fp {','.join(map(str, pids))}`): "
           f"kill {' '.join(map(str, pids))}{steer}")
    return what, fix
