"""Goodput: where the wall-clock of a ``fit`` went — productive steps, input wait, compile, checkpoints, eval —
plus throughput, FLOPs per step (traced, not supplied) and MFU.

Example:
    >>> import keras_scale as ks
    >>> goodput = ks.Goodput()
    >>> model.fit(ds, epochs=3, callbacks=[goodput])          # doctest: +SKIP
    >>> goodput.summary["goodput"], goodput.summary["input_wait_s"]  # doctest: +SKIP
    (0.71, 2.1)

How each figure is measured (see docs/goodput.md):

- Host clock only, no extra device sync: Keras's TF loop already waits for every step (it turns the step's
  logs into Python floats), so the time from this callback's ``on_train_batch_begin`` to its
  ``on_train_batch_end`` is one step call: waiting for the batch (``IteratorGetNext`` inside the traced step)
  plus computing it.
- Input wait is separated from compute with *probes*: now and then (three times per fit, then within a budget
  of ``probe_fraction`` of the wall time) the callback sleeps ~1.5 step-times before a step, so a
  pipeline that works ahead (``prefetch``, parallel ``map``, Keras's per-device prefetch) has the next batch
  ready; that step's time is the compute time. Input wait = calls x (mean call - mean probe), claimed only when
  that difference exceeds three standard errors. The sleeps are reported as ``measure_s``.
- Compile: calls during which Keras's train ``tf.function`` traced (its tracing count grew), first trace and
  re-traces, minus the step they also ran.
- Checkpoint: ``ChiefCheckpoint.blocked_s`` (time the training thread waited on saves and restores). Eval: ``on_test_begin`` to ``on_test_end`` inside ``fit``.
- Counts: ``steps`` = train batches this fit ran through its train step (from the batch indices Keras passes
  the batch hooks; a resume's fast-forwarded batches excluded); ``skipped_steps`` = NaN-skipped ones (the step
  logs' ``nan_skipped``, a Python number already); ``rolled_back_steps`` = updates NanGuard's rollback discarded
  (it reports them); ``productive_steps`` = the rest; ``samples`` = global samples of the steps (the composed
  step's ``samples_seen`` counter, else Keras's loss tracker count; read at epoch ends).
- NaN-skipped steps: their count x compute time per step. Redone work: rolled-back steps x compute time per step,
  plus what a keras_scale piece reports as ``redone_s`` (ChiefCheckpoint: nothing yet).
- Durations are rounded to the microsecond and never negative (no float noise from subtracting clock readings).
"""
from __future__ import annotations

import logging
import math
import statistics
import time
import weakref
import warnings
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import keras
import tensorflow as tf

from keras_scale import events
from keras_scale import state as training_state
from keras_scale._validate import check_int, check_number
from keras_scale.scalars import ChiefScalars, EpochFigures
from keras_scale.distribute import chief_print, is_chief
from keras_scale.step import SKIPPED_LOG_KEY

__all__ = ["Goodput", "PEAK_TFLOPS", "peak_flops_for", "compute_dtype", "traced_flops_per_step", "summarize",
           "format_summary", "CATEGORIES"]

log = logging.getLogger("keras_scale.goodput")

# The categories of wall time; they add up to ``wall_s``.
CATEGORIES = ("productive_s", "skipped_steps_s", "redone_s", "input_wait_s", "compile_s", "checkpoint_s", "eval_s",
              "measure_s", "other_s")

# --------------------------------------------------------------------------------------------------------------
# peak FLOP/s of common GPUs, DENSE figures only (MFU is measured against dense math: a trained model's matmuls
# are not 2:4 sparse), in TFLOP/s. NVIDIA's datasheets print tensor-core figures either as "dense | sparse*" (A100,
# A10, L40, L40S: the dense one is taken as printed) or only "with sparsity*" (H100, H200, L4: halved here). fp32
# is the non-tensor-core FP32 figure (no sparsity). Each row's ``source`` names the document, the column and the
# numbers it prints. ``match`` is a substring of the NVML device name; the first match wins, so specific names
# come before general ones.
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeakEntry:
    """Peak DENSE TFLOP/s of one GPU model by compute dtype, with the datasheet figures it comes from."""

    match: str
    tflops: Dict[str, float]
    source: str
    dense: bool = True  # every figure is dense (sparse datasheet figures halved); MFU divides by these


_SPARSE_HALVED = "; * = with sparsity, dense = half"
PEAK_TFLOPS: Tuple[PeakEntry, ...] = (
    PeakEntry("H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
              "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), H200 NVL column: FP32 60, "
              "TF32 Tensor Core 835*, BFLOAT16/FP16 Tensor Core 1,671*" + _SPARSE_HALVED),
    PeakEntry("H200", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
              "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), H200 SXM column: FP32 67, "
              "TF32 Tensor Core 989*, BFLOAT16/FP16 Tensor Core 1,979*" + _SPARSE_HALVED),
    PeakEntry("H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
              "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), H100 NVL column (per GPU): "
              "FP32 60, TF32 Tensor Core 835*, BFLOAT16/FP16 Tensor Core 1,671*" + _SPARSE_HALVED),
    PeakEntry("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5},
              "NVIDIA H100 PCIe product brief / datasheet (nvidia.com/en-us/data-center/h100), H100 PCIe column: "
              "FP32 51, TF32 Tensor Core 756*, BFLOAT16/FP16 Tensor Core 1,513*" + _SPARSE_HALVED),
    PeakEntry("H100", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},  # SXM5 ("H100 80GB HBM3")
              "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), H100 SXM column: FP32 67, "
              "TF32 Tensor Core 989*, BFLOAT16/FP16 Tensor Core 1,979*" + _SPARSE_HALVED),
    PeakEntry("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
              "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), all A100 "
              "columns (40/80 GB, PCIe/SXM): FP32 19.5, TF32 Tensor Core 156 | 312*, BFLOAT16/FP16 Tensor Core "
              "312 | 624*; the dense (first) figures"),
    PeakEntry("L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
              "NVIDIA L40S GPU datasheet (nvidia.com/en-us/data-center/l40s): FP32 91.6, TF32 Tensor Core 183 | 366*, "
              "BFLOAT16/FP16 Tensor Core 362.05 | 733*; the dense (first) figures"),
    PeakEntry("L40", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp16": 181.05},  # not "L40S" (matched above)
              "NVIDIA L40 GPU datasheet (nvidia.com/en-us/data-center/l40): FP32 90.5, TF32 Tensor Core 90.5 | 181*, "
              "BFLOAT16/FP16 Tensor Core 181.05 | 362.1*; the dense (first) figures"),
    PeakEntry("A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},  # not "A10G" (a different chip)
              "NVIDIA A10 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/products/a10-gpu): FP32 31.2, "
              "TF32 Tensor Core 62.5 | 125*, BFLOAT16/FP16 Tensor Core 125 | 250*; the dense (first) figures"),
    PeakEntry("L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
              "NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4): FP32 30.3, TF32 Tensor Core "
              "120*, BFLOAT16/FP16 Tensor Core 242*" + _SPARSE_HALVED),
    PeakEntry("V100S", {"fp32": 16.4, "fp16": 130.0},
              "NVIDIA V100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/v100), V100S PCIe column: "
              "single-precision 16.4, Tensor Performance 130 (FP16, dense: Volta has no sparsity)"),
    PeakEntry("V100-SXM2", {"fp32": 15.7, "fp16": 125.0},
              "NVIDIA V100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/v100), V100 SXM2 column: "
              "single-precision 15.7, Tensor Performance 125 (FP16, dense)"),
    PeakEntry("V100-SXM3", {"fp32": 15.7, "fp16": 125.0},
              "NVIDIA V100 Tensor Core GPU datasheet has no SXM3 (DGX-2) column: its SXM2 figures, as NVIDIA DGX-2 "
              "spec 2 petaFLOPS tensor / 16 GPUs = 125: single-precision 15.7, Tensor Performance 125 (FP16, dense)"),
    PeakEntry("V100", {"fp32": 14.0, "fp16": 112.0},  # PCIe
              "NVIDIA V100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/v100), V100 PCIe column: "
              "single-precision 14, Tensor Performance 112 (FP16, dense)"),
    PeakEntry("T4", {"fp32": 8.1, "fp16": 65.0},
              "NVIDIA T4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/tesla-t4): single-precision 8.1, "
              "mixed-precision (FP16/FP32) 65 (dense: Turing has no sparsity); no bf16/tf32 tensor cores"),
)


def _name_matches(pattern: str, name: str) -> bool:
    # "A10" must not match "A100"; "L4" must not match "L40S": the character after the match may not be a digit
    # or a letter that continues a model number.
    i = name.find(pattern)
    while i >= 0:
        end = i + len(pattern)
        if end >= len(name) or not name[end].isalnum():
            return True
        i = name.find(pattern, i + 1)
    return False


def peak_flops_for(gpu_name: Optional[str], dtype: str) -> Optional[Tuple[float, str]]:
    """``(peak FLOP/s, source)`` of a GPU by its NVML name and compute dtype (``bf16``/``fp16``/``tf32``/``fp32``),
    or ``None`` when the table does not know it (pass ``Goodput(peak_flops=...)``).

    A dtype the GPU has no tensor-core figure for falls back to ``fp32`` (``tf32`` on a V100 runs as fp32).

    Example:
        >>> peak_flops_for("NVIDIA A100-SXM4-80GB", "bf16")[0]
        312000000000000.0
        >>> peak_flops_for("NVIDIA H100 PCIe", "tf32")[0] / 1e12
        378.0
        >>> peak_flops_for("Tesla V100-SXM2-16GB", "tf32")[0] / 1e12
        15.7
        >>> peak_flops_for("NVIDIA GeForce GTX 1080", "fp32") is None
        True
    """
    if not gpu_name:
        return None
    for entry in PEAK_TFLOPS:
        if _name_matches(entry.match, gpu_name):
            tflops = entry.tflops.get(dtype, entry.tflops.get("fp32"))
            return (tflops * 1e12, entry.source) if tflops else None
    return None


def compute_dtype(model: Any) -> str:
    """``bf16``, ``fp16``, ``tf32`` or ``fp32``: the dtype the model's matmuls run in (its dtype policy; float32
    counts as ``tf32`` when TensorFloat-32 execution is on, TensorFlow's default).

    Example:
        >>> compute_dtype(keras.Sequential([keras.layers.Dense(1, dtype="mixed_bfloat16")]))
        'bf16'
    """
    policy = getattr(model, "dtype_policy", None) or keras.config.dtype_policy()
    name = str(getattr(policy, "compute_dtype", "float32"))
    if name == "float32":
        # a Sequential/functional model reports its own (float32) policy; its layers may compute in another
        layers = [getattr(layer, "dtype_policy", None) for layer in getattr(model, "layers", [])]
        names = {str(getattr(p, "compute_dtype", "float32")) for p in layers if p is not None}
        for candidate in ("bfloat16", "float16"):
            if candidate in names:
                name = candidate
                break
    if name == "bfloat16":
        return "bf16"
    if name == "float16":
        return "fp16"
    return "tf32" if tf.config.experimental.tensor_float_32_execution_enabled() else "fp32"


def _gpu_name() -> Optional[str]:
    """NVML name of the first GPU this process uses, or ``None`` (no GPU for TensorFlow, or no NVML)."""
    if not tf.config.list_physical_devices("GPU"):
        return None
    from keras_scale.nvml import NvmlUnavailable, open_nvml, visible_gpu_indices

    try:
        nv = open_nvml()
    except NvmlUnavailable:
        return None
    try:
        devices = nv.devices()
        visible = visible_gpu_indices(devices)
        by_index = {d.index: d for d in devices}
        return by_index[visible[0]].name if visible else None
    except Exception:  # noqa: BLE001 - a name is a nicety; never break training for it
        return None
    finally:
        nv.close()


# --------------------------------------------------------------------------------------------------------------
# FLOPs per step, from a trace of the model's forward + backward pass
# --------------------------------------------------------------------------------------------------------------

def _traced_functions(fn: Any, depth: int = 12) -> List[Any]:
    """The ``tf.function`` objects inside ``model.train_function`` (Keras's, under any Python wrappers around it,
    such as ChiefCheckpoint's), found through closures."""
    found: List[Any] = []
    seen = set()

    def visit(obj: Any, level: int) -> None:
        if id(obj) in seen or level > depth or len(seen) > 500:
            return
        seen.add(id(obj))
        if hasattr(obj, "experimental_get_tracing_count"):
            found.append(obj)
        for attr in ("__wrapped__", "__func__"):
            inner = getattr(obj, attr, None)
            if inner is not None and callable(inner):
                visit(inner, level + 1)
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if callable(value) and not isinstance(value, (type, keras.Model, keras.callbacks.Callback)):
                visit(value, level + 1)

    visit(fn, 0)
    return found


def _tracing_count(functions: Sequence[Any]) -> int:
    total = 0
    for f in functions:
        try:
            total += int(f.experimental_get_tracing_count())
        except Exception:  # noqa: BLE001
            pass
    return total


def _data_spec(functions: Sequence[Any]) -> Any:
    """The per-replica ``(x, y, sample_weight)`` spec one train step was traced with, or ``None``."""
    for f in functions:
        try:
            concrete = list(f._list_all_concrete_functions())
        except Exception:  # noqa: BLE001 - a private TF API: absent in another version means "unknown"
            continue
        for cf in concrete:
            args = (cf.structured_input_signature or ((), {}))[0]
            if len(args) != 1:
                continue
            spec = args[0]
            flat = tf.nest.flatten(spec, expand_composites=False)
            if any("Iterator" in type(s).__name__ for s in flat):
                continue
            return tf.nest.map_structure(
                lambda s: s._value_specs[0] if hasattr(s, "_value_specs") else s, spec)
    return None


def _with_batch(spec: Any, batch: int) -> Any:
    def fix(s: Any) -> Any:
        if not isinstance(s, tf.TensorSpec):
            raise TypeError(f"cannot count FLOPs for a {type(s).__name__} input")
        shape = s.shape.as_list() if s.shape.rank is not None else None
        if shape is None or any(d is None for d in shape[1:]):
            raise TypeError(f"cannot count FLOPs for an input of unknown shape {s.shape}")
        return tf.TensorSpec([batch] + shape[1:], s.dtype)

    return tf.nest.map_structure(fix, spec)


_FLOPS_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {graph key: FLOPs per step}


def graph_float_ops(graph: Any) -> int:
    """Floating-point operations of a graph with known shapes (TensorFlow's graph cost analysis, the statistics
    registered for MatMul, Conv2D and their gradients, element-wise ops, reductions).

    Example:
        >>> cf = tf.function(lambda a, b: tf.matmul(a, b)).get_concrete_function(
        ...     tf.TensorSpec([4, 8]), tf.TensorSpec([8, 16]))
        >>> graph_float_ops(cf.graph)
        1024
    """
    from tensorflow.python.profiler import model_analyzer, option_builder

    opts = option_builder.ProfileOptionBuilder(
        option_builder.ProfileOptionBuilder.float_operation()).with_empty_output().build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = tf.get_logger().level
        tf.get_logger().setLevel(logging.ERROR)  # the v1 profiler logs a deprecation notice
        try:
            return int(model_analyzer.profile(graph, options=opts).total_float_ops)
        finally:
            tf.get_logger().setLevel(previous)


def traced_flops_per_step(model: keras.Model, data_spec: Any, per_replica_batch: int, num_replicas: int = 1) -> int:
    """FLOPs of one training step over all replicas: the model's forward pass, loss and gradients traced at the
    step's per-replica batch size, counted by :func:`graph_float_ops`, times ``num_replicas``.

    The trace is never run (no weight, metric or BatchNorm statistic moves). The optimizer's update (a few
    element-wise FLOPs per parameter) is left out, as in the usual 6 x batch x parameters count.

    Example:
        >>> spec = (tf.TensorSpec([None, 64]), tf.TensorSpec([None], tf.int64))
        >>> traced_flops_per_step(model, spec, per_replica_batch=32)      # doctest: +SKIP
        3041464
    """
    from keras.src.trainers.data_adapters import data_adapter_utils

    spec = _with_batch(data_spec, int(per_replica_batch))

    def forward_backward(data: Any) -> Any:
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        return tape.gradient(loss, model.trainable_weights)

    concrete = tf.function(forward_backward, autograph=False).get_concrete_function(spec)
    return graph_float_ops(concrete.graph) * int(num_replicas)


# --------------------------------------------------------------------------------------------------------------
# the ledger and the arithmetic (pure Python, no TensorFlow)
# --------------------------------------------------------------------------------------------------------------

@dataclass
class Ledger:
    """Measured seconds and counts; subtract two ledgers for the figures of the time between them."""

    step_s: float = 0.0          # step calls (input wait + compute), checkpoint/redone time taken out
    step_sq_s2: float = 0.0      # sum of their squares (for the noise of their mean)
    calls: int = 0               # train_function calls in step_s
    compile_s: float = 0.0       # calls during which the train function traced
    compile_calls: int = 0
    checkpoint_s: float = 0.0
    redone_s: float = 0.0
    eval_s: float = 0.0
    measure_s: float = 0.0       # Goodput's own probe sleeps and FLOPs trace
    fast_forward_s: float = 0.0  # calls that skipped already-trained batches after a resume (part of other_s)
    steps: int = 0               # train batches this fit ran through the train step (fast-forwarded ones not)
    skipped_steps: int = 0       # of those, NaN-skipped (no update): the step logs' ``nan_skipped``
    rolled_back_steps: int = 0   # updates applied, then discarded by NanGuard(policy="rollback")
    samples: Optional[float] = 0.0  # global samples of the ``steps`` (all replicas, all workers)

    def __sub__(self, other: "Ledger") -> "Ledger":
        out = Ledger()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, None if a is None or b is None else a - b)
        return out

    def copy(self) -> "Ledger":
        return Ledger(**{f.name: getattr(self, f.name) for f in fields(self)})


def compute_time_per_call(probe_s: Sequence[float]) -> Optional[float]:
    """A robust compute time of one step call from probe measurements: the median of three or more, else the mean.
    Used to decide when to probe more often (calls much slower than this look input-bound).

    Example:
        >>> compute_time_per_call([0.002, 0.0021, 0.009])
        0.0021
        >>> compute_time_per_call([]) is None
        True
    """
    if not probe_s:
        return None
    return statistics.median(probe_s) if len(probe_s) >= 3 else sum(probe_s) / len(probe_s)


def compute_per_call(ledger: Ledger, probe_s: Sequence[float]) -> float:
    """Compute time of one step call: the mean of the probes when the calls are slower than the probes by more than
    three standard errors of that difference (then the difference is input wait), else the mean call (no input
    wait is claimed from noise, or without at least two probes).

    Both are means, so a call slowed down by something else (a load spike on a shared machine) counts the same
    whether it was a probe or not.

    Example:
        >>> L = Ledger(step_s=2.0, step_sq_s2=0.04, calls=100)          # 20 ms per call, all alike
        >>> compute_per_call(L, [0.002, 0.0021, 0.0019])                # probes: 2 ms -> 18 ms of input wait per call
        0.002
        >>> compute_per_call(L, [0.002])                                # one probe: no claim
        0.02
    """
    L = ledger
    if not L.calls:
        return 0.0
    mean_call = L.step_s / L.calls
    if len(probe_s) < 2:
        return mean_call
    mean_probe = statistics.fmean(probe_s)
    var_call = max(0.0, L.step_sq_s2 / L.calls - mean_call ** 2)
    se = math.sqrt(statistics.variance(probe_s) / len(probe_s) + var_call / L.calls)
    return mean_probe if mean_call - mean_probe > 3 * se else mean_call


def clean_seconds(value: float) -> float:
    """A duration from differences of clock readings, rounded to the microsecond (below what the host clock
    around a step call resolves) and never negative: ``3.9e-18`` and ``-2e-17`` are ``0.0``.

    Example:
        >>> clean_seconds(3.9e-18), clean_seconds(-2e-17), clean_seconds(1.2345678)
        (0.0, 0.0, 1.234568)
    """
    value = round(float(value), 6)
    return value if value > 0 else 0.0


def summarize(ledger: Ledger, wall_s: float, probe_s: Sequence[float] = (), steps_per_call: int = 1,
              flops_per_step: Optional[float] = None, peak_flops: Optional[float] = None) -> Dict[str, Any]:
    """The goodput figures of one window (a fit, an epoch) from its :class:`Ledger` and the probe measurements
    (compute time per call: :func:`compute_per_call`).

    Example:
        >>> L = Ledger(step_s=10.0, step_sq_s2=1.0, calls=100, compile_s=1.0, compile_calls=1, eval_s=0.5, steps=101)
        >>> s = summarize(L, wall_s=12.0, probe_s=[0.04, 0.041, 0.039])
        >>> round(s["productive_s"], 2), round(s["input_wait_s"], 2), round(s["compile_s"], 2)
        (4.04, 6.0, 0.96)
        >>> round(sum(s[c] for c in CATEGORIES), 6) == 12.0
        True
    """
    L = ledger
    x = compute_per_call(L, probe_s)
    compute = min(L.step_s, L.calls * x)
    input_wait = L.step_s - compute
    compile_step = min(L.compile_s, L.compile_calls * x)
    compile_s = L.compile_s - compile_step
    compute += compile_step
    per_step = x / max(int(steps_per_call), 1)
    steps = max(0, int(L.steps))
    skipped = min(steps, max(0, int(L.skipped_steps)))
    rolled_back = min(steps - skipped, max(0, int(L.rolled_back_steps)))  # a rollback past this fit's start
    productive_steps = steps - skipped - rolled_back
    skipped_s = min(compute, skipped * per_step)
    rolled_back_s = min(compute - skipped_s, rolled_back * per_step)
    productive = compute - skipped_s - rolled_back_s
    out: Dict[str, Any] = {
        "wall_s": float(wall_s),
        "productive_s": productive,
        "skipped_steps_s": skipped_s,
        "redone_s": L.redone_s + rolled_back_s,
        "input_wait_s": input_wait,
        "compile_s": compile_s,
        "checkpoint_s": L.checkpoint_s,
        "eval_s": L.eval_s,
        "measure_s": L.measure_s,
    }
    for c in out:  # differences of clock readings: no float noise (3.9e-18 s) or tiny negatives
        out[c] = clean_seconds(out[c])
    known = sum(out[c] for c in CATEGORIES if c != "other_s")
    out["other_s"] = clean_seconds(wall_s - known)
    productive = out["productive_s"]
    out["goodput"] = round(productive / wall_s, 6) if wall_s > 0 else None
    out["input_wait_fraction"] = round(out["input_wait_s"] / wall_s, 6) if wall_s > 0 else None
    out["steps"] = steps
    out["skipped_steps"] = skipped
    out["rolled_back_steps"] = rolled_back
    out["productive_steps"] = productive_steps
    executed_calls = L.calls + L.compile_calls
    out["step_time_s"] = compute / executed_calls / max(int(steps_per_call), 1) if executed_calls else None
    out["samples"] = None if L.samples is None else int(round(L.samples))
    shown_wall_s = out.get("wall_s", wall_s)  # the rounded figure the summary shows: ratios agree with it
    out["samples_per_s"] = L.samples / shown_wall_s if L.samples and shown_wall_s > 0 else None
    out["flops_per_step"] = flops_per_step
    achieved = (flops_per_step * productive_steps / productive
                if flops_per_step and productive > 0 and productive_steps > 0 else None)
    out["tflops_per_s"] = achieved / 1e12 if achieved is not None else None
    out["peak_flops"] = peak_flops
    out["mfu"] = achieved / peak_flops if achieved is not None and peak_flops else None
    return out


def format_summary(summary: Dict[str, Any], title: str = "Goodput") -> str:
    """The end-of-fit table.

    Example:
        >>> s = summarize(Ledger(step_s=1.0, step_sq_s2=0.1, calls=10, steps=10), wall_s=1.2, probe_s=[0.05, 0.05])
        >>> print(format_summary(s).splitlines()[0])
        Goodput: 41.7% of 1.20 s wall was productive training steps (10 steps, 50.00 ms each)
    """
    wall = summary["wall_s"] or 0.0
    step_ms = summary.get("step_time_s")
    head = f"{title}: {100 * (summary.get('goodput') or 0):.1f}% of {wall:.2f} s wall was productive training steps"
    head += f" ({summary['steps']} steps" + (f", {1e3 * step_ms:.2f} ms each" if step_ms else "")
    for key, label in (("skipped_steps", "NaN-skipped"), ("rolled_back_steps", "rolled back")):
        if summary.get(key):
            head += f", {summary[key]} {label}"
    if summary.get("samples_per_s"):
        head += f", {summary['samples_per_s']:,.0f} samples/s"
    lines = [head + ")"]
    if summary.get("restarts"):
        lines.append(f"  restarts {summary['restarts']}: {summary.get('restart_lost_s', 0):.1f} s lost between a "
                     f"failure and the resumed first step, {summary.get('restart_redone_steps', 0)} steps redone "
                     "(after the last checkpoint)")
    labels = {"productive_s": "productive steps", "input_wait_s": "input wait", "compile_s": "compile / trace",
              "checkpoint_s": "checkpoint (blocked)", "eval_s": "validation", "skipped_steps_s": "NaN-skipped steps",
              "redone_s": "redone work", "measure_s": "Goodput's probes", "other_s": "other (callbacks, rest)"}
    for key in ("productive_s", "input_wait_s", "compile_s", "checkpoint_s", "eval_s", "skipped_steps_s", "redone_s",
                "measure_s", "other_s"):
        value = summary.get(key) or 0.0
        pct = 100 * value / wall if wall > 0 else 0.0
        lines.append(f"  {labels[key]:<24}{value:9.3f} s {pct:6.1f}%")
    flops = summary.get("flops_per_step")
    if flops:
        line = f"  FLOPs/step {flops:.3g} (traced)"
        if summary.get("tflops_per_s") is not None:
            line += f", {summary['tflops_per_s']:.3g} TFLOP/s while stepping"
        if summary.get("mfu") is not None:
            line += f", MFU {100 * summary['mfu']:.1f}% of {summary['peak_flops'] / 1e12:.4g} TFLOP/s"
            if summary.get("peak_source"):
                line += f" ({summary['peak_source']})"
        else:
            line += ", MFU n/a (no known peak: pass Goodput(peak_flops=...))"
        lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# the checkpoint's blocked time, reported or measured
# --------------------------------------------------------------------------------------------------------------

class _ReportedClock:
    """Seconds other keras_scale pieces report (checkpoint blocking, redone work), read as deltas (a few attribute
    reads per step: no device sync)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.ckpt: Any = None
        self._blocked = 0.0
        self._redone = 0.0

    def resolve(self) -> None:
        from keras_scale.callbacks.checkpoint import checkpoint_for

        ckpt = checkpoint_for(self.model)
        if ckpt is not self.ckpt:
            self.ckpt = ckpt
            self._blocked, self._redone = self._read()

    def _read(self) -> Tuple[float, float]:
        ckpt = self.ckpt
        return float(ckpt.blocked_s or 0.0), float(getattr(ckpt, "redone_s", 0.0) or 0.0)

    def delta(self) -> Tuple[float, float]:
        """(checkpoint-blocked s, redone s) since the last call; a counter reset at a fit start counts from 0."""
        if self.ckpt is None:
            return 0.0, 0.0
        blocked, redone = self._read()
        d_blocked, d_redone = blocked - self._blocked, redone - self._redone
        self._blocked, self._redone = blocked, redone
        return (blocked if d_blocked < 0 else d_blocked), (redone if d_redone < 0 else d_redone)

    @property
    def last_call_skipped(self) -> bool:
        return self.ckpt is not None and bool(getattr(self.ckpt, "_last_call_skipped", False))


def _global_sum(strategy: Any, variable: Any) -> Optional[float]:
    """A per-replica counter summed over all replicas, reading only this worker's copies (no cross-worker
    collective at an epoch end that workers may reach at different times): their sum, scaled to all replicas."""
    try:
        local = strategy.experimental_local_results(variable)
        total = float(sum(float(v.numpy()) for v in local))
        return total * strategy.num_replicas_in_sync / max(len(local), 1)
    except Exception:  # noqa: BLE001 - a count is a nicety; never break training for it
        return None


class _StepCounters:
    """The composed step's counters, as deltas since the fit started: samples (``samples_seen``), NaN-skipped
    steps this epoch (``epoch_skipped``, NanGuard resets it per epoch) and rollbacks (host-side). Read at epoch
    ends only. A composed step created after the fit started (it starts at 0) counts from 0."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._step = self._find()
        self._samples0 = self._samples()
        self._rolled0 = int(getattr(self._step, "rolled_back_steps", 0) or 0)

    def _find(self) -> Any:
        from keras_scale.step import get_step

        return get_step(self.model, create=False)

    def _current(self) -> Any:
        step = self._find()
        if step is not self._step:  # created during the fit: it counted from 0
            self._step, self._samples0, self._rolled0 = step, 0.0, 0
        return step

    def _samples(self) -> float:
        step = self._step
        if step is None or getattr(step, "samples_seen", None) is None:
            return 0.0
        return _global_sum(self.model.distribute_strategy, step.samples_seen) or 0.0

    def samples(self) -> float:
        self._current()
        return max(0.0, self._samples() - self._samples0)

    def rolled_back(self) -> int:
        step = self._current()
        return max(0, int(getattr(step, "rolled_back_steps", 0) or 0) - self._rolled0)

    def epoch_skipped(self) -> int:
        step = self._current()
        if step is None or not getattr(step, "guard", False):
            return 0
        try:
            return int(step.epoch_skipped.numpy())
        except Exception:  # noqa: BLE001
            return 0


# --------------------------------------------------------------------------------------------------------------
# the callback
# --------------------------------------------------------------------------------------------------------------

#: restarts of ``keras-scale launch`` this process put on the dashboard already (one record per restart)
_RESTARTS_RECORDED: set = set()


class Goodput(keras.callbacks.Callback):
    """Where the wall-clock of ``fit`` went, for any model and strategy: goodput, input wait, compile,
    checkpoints, validation, throughput, FLOPs per step (traced from the model, not supplied) and MFU.

    After ``fit``, :attr:`summary` holds ``wall_s`` and its parts ``productive_s``, ``input_wait_s``,
    ``compile_s``, ``checkpoint_s``, ``eval_s``, ``skipped_steps_s``, ``redone_s``, ``measure_s`` (this
    callback's own probes) and ``other_s`` (callbacks and the rest), which add up to ``wall_s``; ``goodput``
    (= productive_s / wall_s), ``input_wait_fraction`` (of wall_s), ``steps`` (train batches run), ``skipped_steps``,
    ``rolled_back_steps``, ``productive_steps``, ``samples`` (global), ``samples_per_s``, ``step_time_s``,
    ``flops_per_step``, ``tflops_per_s`` (while stepping), ``mfu`` and ``peak_flops``. Each epoch adds
    ``goodput``, ``goodput_input_wait_fraction``, ``goodput_samples_per_s``, ``goodput_tflops_per_s`` and ``goodput_mfu``
    (those known) to the ``History`` that ``fit`` returns (at its end, not to the epoch logs), and with ``log_dir``
    the chief writes ``goodput/...`` scalars, one tag per quantity: ``goodput/goodput``, ``goodput/samples_per_s``,
    ``goodput/tflops_per_s``, ``goodput/mfu`` and each time part in seconds (``goodput/input_wait_s``, ...; the
    input wait's fraction is History's only).
    Under ``keras-scale launch --max-restarts`` the summary also holds ``restarts``, ``restart_lost_s`` and
    ``restart_redone_steps``, read from the launcher's restart record (:mod:`keras_scale.heartbeat_file`).
    The chief prints a table at the end of fit (unless ``fit(verbose=0)``).

    List it last (``keras_scale.fit`` does): it then also sees the final checkpoint other callbacks write at
    the end of training.

    Args:
        log_dir: TensorBoard directory (scalars under ``log_dir/goodput``); ``None``: none.
        peak_flops: the accelerator's peak FLOP/s for MFU; ``None`` looks the GPU up in :data:`PEAK_TFLOPS` by
            its NVML name and the model's compute dtype (``mfu`` stays ``None`` on CPU or an unknown GPU).
        verbose: ``"auto"`` prints the end-of-fit table (chief only) unless ``fit`` runs with ``verbose=0``;
            1 always prints it, 0 never.
        probe_fraction: at most this fraction of the wall time goes into the probes that separate input wait
            from compute (besides the first one), in [0, 0.1].

    Example:
        >>> goodput = Goodput(peak_flops=312e12)
        >>> model.fit(ds, epochs=2, callbacks=[goodput])        # doctest: +SKIP
        >>> goodput.summary["mfu"]                                # doctest: +SKIP
        0.41
    """

    MIN_PROBE_GAP_CALLS = 16  # calls between two probes (fewer in a fit of few calls: _probe_gap_calls)
    FREE_PROBES = 3  # probes per fit outside the probe_fraction budget

    def __init__(self, log_dir: Optional[str] = None, peak_flops: Optional[float] = None,
                 verbose: Union[str, int] = "auto",
                 probe_fraction: float = 0.005) -> None:
        super().__init__()
        if log_dir is not None and not isinstance(log_dir, (str, bytes)) and not hasattr(log_dir, "__fspath__"):
            raise ValueError(f"Goodput: log_dir must be a path or None, got {log_dir!r}.")
        if peak_flops is not None:
            hint = "It is the accelerator's peak FLOP/s (not TFLOP/s), e.g. 989e12 for an H100 in bf16."
            peak_flops = check_number("peak_flops", peak_flops, 1e9, owner="Goodput", hint=hint)
            if not math.isfinite(peak_flops):
                raise ValueError(f"Goodput: peak_flops must be finite, got {peak_flops!r}. {hint}")
        self.log_dir = None if log_dir is None else str(log_dir)
        self.peak_flops = peak_flops
        if verbose != "auto":
            verbose = check_int("verbose", verbose, 0, owner="Goodput", hint='Use 0, 1 or "auto".')
        self.verbose = verbose
        self.probe_fraction = check_number("probe_fraction", probe_fraction, 0.0, owner="Goodput")
        if self.probe_fraction > 0.1:
            raise ValueError(f"Goodput: probe_fraction must be in [0, 0.1], got {probe_fraction!r}.")
        self.summary: Dict[str, Any] = {}
        self.epoch_summaries: List[Dict[str, Any]] = []  # of the last fit
        self._t_set_model: Optional[float] = None
        self._active = False

    # ------------------------------------------------------------------ Keras hooks (small; they delegate)
    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._t_set_model = time.perf_counter()  # fit builds its CallbackList (set_model) right before train begin

    def on_train_begin(self, logs: Optional[Dict] = None) -> None:
        now = time.perf_counter()
        self._start = self._t_set_model if self._t_set_model is not None and now - self._t_set_model < 600 else now
        self._t_set_model = None
        strategy = self.model.distribute_strategy
        self._chief = is_chief(strategy)
        self._scalars = ChiefScalars(self.log_dir, strategy)
        self._figures = EpochFigures()
        self._ledger = Ledger()
        self.epoch_summaries = []
        self._probes: List[float] = []
        self._clock = _ReportedClock(self.model)
        self._clock.resolve()
        self._fn: Any = None
        self._functions: List[Any] = []
        self._trace_count = 0
        self._ema: Optional[float] = None
        self._regular_calls = 0
        self._since_probe = 0
        self._probe_gap = self.MIN_PROBE_GAP_CALLS  # (set at each epoch begin: _probe_gap_calls)
        self._epoch_calls: Optional[int] = None  # calls of the last finished epoch (an epoch of unknown length)
        self._sleep_s = 0.0
        self._probes_run = 0
        self._x_hat: Optional[float] = None
        self._probe = False
        self._t_call = 0.0
        self._t_last_end: Optional[float] = None
        self._t_test: Optional[float] = None
        self._epoch_samples: Optional[float] = None
        self._flops: Optional[float] = None
        self._flops_tried = False
        self._peak: Optional[Tuple[float, str]] = None
        self._call_begin = 0
        self._epoch_skipped: Optional[float] = None
        self._epoch_batches = 0
        self._tracker_base = 0.0
        self._skipped_base = 0.0  # the epoch's NaN-skipped count a resume restored (steps of an earlier run)
        self._rebase_tracker = False
        self._step_counters = _StepCounters(self.model)
        self._active = True
        self._record_restart()

    def _record_restart(self) -> None:
        """Under ``keras-scale launch --max-restarts``: the restart that started this process (the newest in the
        launcher's log) goes on the dashboard's loss curve, once per process, at the update training resumes from."""
        from keras_scale.heartbeat_file import read_restart_log

        restarts = [r for r in read_restart_log() if r.get("event") == "restart"]
        if not restarts or restarts[-1].get("restart") in _RESTARTS_RECORDED:
            return
        latest = restarts[-1]
        _RESTARTS_RECORDED.add(latest.get("restart"))
        workers = latest.get("workers") or []
        events.record("worker_restart", training_state.iterations(self.model), log_dir=self.log_dir,
                      task=",".join(str(w) for w in workers) if isinstance(workers, list) else workers,
                      reason=latest.get("reason"), restart=latest.get("restart"),
                      max_restarts=latest.get("max_restarts"), num_workers=latest.get("num_workers_next"))

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict] = None) -> None:
        if not self._active:
            return
        self._clock.resolve()
        self._take_reported()
        self._epoch_start = time.perf_counter()
        self._epoch_ledger = self._ledger.copy()
        self._epoch_samples = None
        self._epoch_skipped = None  # NanGuard resets its per-epoch count (the step logs' ``nan_skipped``)
        self._epoch_batches = int((self.params or {}).get("steps") or 0)  # 0: unknown length
        self._probe_gap = self._probe_gap_calls(int(epoch))  # (from this epoch: a fit resumed at initial_epoch)
        self._tracker_base = 0.0  # Keras resets its loss tracker at each epoch start
        self._skipped_base = 0.0
        self._rebase_tracker = False

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict] = None) -> None:
        if not self._active:
            return
        fn = self.model.train_function
        if fn is not self._fn:
            self._new_train_function(fn)
        if self._rebase_tracker:  # after fast-forwarded calls (a resume): ChiefCheckpoint restored the epoch's
            self._rebase_tracker = False  # metrics, the loss tracker's count included: count from here
            self._tracker_base = self._loss_tracker_samples() or 0.0
            self._skipped_base = float(self._step_counters.epoch_skipped())  # (restored with the checkpoint)
        self._call_begin = int(batch)
        self._probe = self._plan_probe()
        self._take_reported()
        self._t_call = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Optional[Dict] = None) -> None:
        if not self._active:
            return
        now = time.perf_counter()
        if self._record_call(now - self._t_call):
            self._ledger.steps += self._batches_in_call(int(batch))
            skipped = (logs or {}).get(SKIPPED_LOG_KEY)  # already a Python number: no device read
            if skipped is not None:
                self._epoch_skipped = float(skipped)
        else:
            self._rebase_tracker = True
        self._t_last_end = now

    def on_test_begin(self, logs: Optional[Dict] = None) -> None:
        if not self._active:
            return
        # validation inside fit: the loss tracker still counts this epoch's training samples (evaluate resets it
        # right after this hook)
        self._epoch_samples = self._loss_tracker_samples()
        last = self._t_last_end if self._t_last_end is not None else time.perf_counter()
        self._t_test = max(last, self._epoch_start)
        # a save by a callback listed after this one, since the last batch end, is checkpoint time, not eval
        self._t_test += sum(self._take_reported())

    def on_test_end(self, logs: Optional[Dict] = None) -> None:
        if not self._active or self._t_test is None:
            return
        checkpoint_s, redone_s = self._clock.delta()
        self._ledger.checkpoint_s += checkpoint_s
        self._ledger.redone_s += redone_s
        self._ledger.eval_s += max(0.0, time.perf_counter() - self._t_test - checkpoint_s - redone_s)
        self._t_test = None

    def on_epoch_end(self, epoch: int, logs: Optional[Dict] = None) -> None:
        if not self._active:
            return
        if self._epoch_skipped is None and (logs or {}).get(SKIPPED_LOG_KEY) is not None:
            self._epoch_skipped = float(logs[SKIPPED_LOG_KEY])  # NanGuard's, for a step with no dict of logs
        self._close_epoch()
        self._epoch_calls = self._ledger.calls - self._epoch_ledger.calls
        summary = self._summarize(self._ledger - self._epoch_ledger, time.perf_counter() - self._epoch_start)
        self.epoch_summaries.append(summary)
        figures = {"goodput": summary["goodput"], "goodput_input_wait_fraction": summary["input_wait_fraction"],
                   "goodput_samples_per_s": summary["samples_per_s"], "goodput_tflops_per_s": summary["tflops_per_s"],
                   "goodput_mfu": summary["mfu"]}
        figures = {k: float(v) for k, v in figures.items() if v is not None}
        self._figures.add(figures)  # History gets them at the end of fit; the epoch logs stay Keras's
        # TensorBoard: one tag per quantity. The input wait is a time part like the others, goodput/input_wait_s
        # (in seconds, beside productive_s, compile_s, ...); its share of the epoch stays History's
        # goodput_input_wait_fraction and is not a second chart of the same wait.
        scalars = {f"goodput/{k[len('goodput_'):] if k.startswith('goodput_') else k}": v for k, v in figures.items()
                   if k != "goodput_input_wait_fraction"}
        scalars.update({f"goodput/{c}": float(summary[c]) for c in CATEGORIES})
        self._scalars.write(scalars, step=epoch)
        events.record("epoch", training_state.iterations(self.model), log_dir=self.log_dir, epoch=epoch,
                      goodput=summary, logs={k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))})

    def on_train_end(self, logs: Optional[Dict] = None) -> None:
        if not self._active:
            return
        self._active = False
        self._take_reported()
        self.summary = self._summarize(self._ledger, time.perf_counter() - self._start)
        from keras_scale.heartbeat_file import restart_summary

        self.summary.update(restart_summary())  # `keras-scale launch --max-restarts`: what the restarts cost
        events.record("fit_end", training_state.iterations(self.model), log_dir=self.log_dir, goodput=self.summary)
        self._scalars.close()
        self._figures.deliver(self.model)
        verbose = (self.params or {}).get("verbose", 1) if self.verbose == "auto" else self.verbose
        # the pack's one chief-only printer: Keras's print_msg (stdout, or absl logging when Keras's interactive
        # logging is off), nothing on other workers or at verbose=0
        chief_print(format_summary(self.summary), self.model.distribute_strategy, verbose=verbose)

    # ------------------------------------------------------------------ logic
    def _new_train_function(self, fn: Any) -> None:
        self._fn = fn
        self._functions = _traced_functions(fn)
        # a function seen for the first time may have traced already (an earlier fit): only growth counts
        self._trace_count = _tracing_count(self._functions)

    def _probe_gap_calls(self, epoch: int) -> int:
        """Calls between two probes from epoch ``epoch`` on: ``MIN_PROBE_GAP_CALLS``, or fewer when the calls left
        in this fit are few (short epochs, ``steps_per_execution``, a fit resumed at ``initial_epoch``), so that
        the probes still due run (two are needed to claim any wait). An epoch of unknown length counts as long as
        the last one (none finished yet: ``MIN_PROBE_GAP_CALLS``)."""
        params = self.params or {}
        steps, epochs = params.get("steps"), params.get("epochs")
        per_call = max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))
        calls_per_epoch = math.ceil(int(steps) / per_call) if steps else self._epoch_calls
        if not calls_per_epoch or not epochs:
            return self.MIN_PROBE_GAP_CALLS
        due = max(1, self.FREE_PROBES - self._probes_run)
        calls_left = max(0, int(epochs) - int(epoch)) * int(calls_per_epoch)
        return max(2, min(self.MIN_PROBE_GAP_CALLS, calls_left // (due + 2)))

    def _plan_probe(self) -> bool:
        """Whether the coming call is a probe: sleep ~1.5 step-times first, so that a pipeline working ahead has
        the next batch ready and the call measures compute alone. The first ``FREE_PROBES`` probes always run
        (a few step-times per fit); later ones only within ``probe_fraction`` of the elapsed wall time. An epoch's
        first call is never a probe: Keras starts a new iterator over a dataset at each epoch, so no batch is ready
        however long one sleeps (that probe would measure the input wait it is meant to separate)."""
        self._since_probe += 1
        if self._ema is None or self._regular_calls < 3 or self._call_begin == 0:
            return False
        if self._probes_run and self._since_probe < self._probe_gap:
            return False
        sleep_s = min(1.0, max(5e-4, 1.5 * self._ema))
        if self._probes_run >= self.FREE_PROBES:
            # Calls slower than the probes so far suggest input wait: then a probe mostly overlaps time the step
            # would have waited anyway, and more probes (up to 10x the budget) make the estimate robust to load
            # that changes during the run. Otherwise probes stay within probe_fraction of the wall time.
            suspect = self._x_hat is not None and self._ema > 1.25 * self._x_hat
            budget = self.probe_fraction * (10 if suspect else 1) * (time.perf_counter() - self._start)
            if self._sleep_s + sleep_s > budget:
                return False
        start = time.perf_counter()
        time.sleep(sleep_s)
        slept = time.perf_counter() - start
        self._sleep_s += slept
        self._ledger.measure_s += slept
        self._since_probe = 0
        self._probes_run += 1
        return True

    def _take_reported(self) -> Tuple[float, float]:
        checkpoint_s, redone_s = self._clock.delta()
        if checkpoint_s or redone_s:
            self._ledger.checkpoint_s += checkpoint_s
            self._ledger.redone_s += redone_s
        return checkpoint_s, redone_s

    def _batches_in_call(self, end: int) -> int:
        """Train batches one call ran: ``steps_per_execution`` of them, fewer at the end of an epoch of known
        length (Keras passes the first and the last index of the call's batches)."""
        if self._epoch_batches:
            end = min(end, self._epoch_batches - 1)
        return max(0, end - self._call_begin + 1)

    def _record_call(self, duration_s: float) -> bool:
        """Book one train-function call; False for a call that trained nothing (a resume's fast-forward)."""
        L = self._ledger
        checkpoint_s, redone_s = self._take_reported()
        duration_s = max(0.0, duration_s - checkpoint_s - redone_s)
        if self._clock.last_call_skipped:  # ChiefCheckpoint fast-forwarding over already-trained batches
            L.fast_forward_s += duration_s
            return False
        if self._ema is None or duration_s > 3 * self._ema:  # only a long call can have traced
            count = _tracing_count(self._functions)
            traced, self._trace_count = count > self._trace_count, count
            if traced:
                L.compile_s += duration_s
                L.compile_calls += 1
                return True
        L.step_s += duration_s
        L.step_sq_s2 += duration_s * duration_s
        L.calls += 1
        if self._probe and checkpoint_s == 0 and redone_s == 0:
            self._probes.append(duration_s)
            self._x_hat = compute_time_per_call(self._probes)
        else:
            self._regular_calls += 1
            self._ema = duration_s if self._ema is None else 0.9 * self._ema + 0.1 * duration_s
        return True

    def _loss_tracker_samples(self) -> Optional[float]:
        """Training samples Keras's loss tracker counted this epoch (it adds each replica's batch size; reset per
        epoch), all replicas; ``None`` without one. Keras's own train step records every batch; the composed step
        (NanGuard) leaves non-finite ones out, so :class:`_StepCounters` counts for it."""
        tracker = getattr(self.model, "_loss_tracker", None)
        count = getattr(tracker, "count", None)
        if count is None:
            return None
        return _global_sum(self.model.distribute_strategy, getattr(count, "value", count))

    def _close_epoch(self) -> None:
        self._take_reported()
        L = self._ledger
        steps = L.steps - self._epoch_ledger.steps
        skipped = self._epoch_skipped
        if skipped is None:  # no step logs with the count (a foreign step): the variable (one read per epoch)
            skipped = self._step_counters.epoch_skipped()
        L.skipped_steps += int(round(max(0.0, skipped - self._skipped_base)))
        L.rolled_back_steps = self._step_counters.rolled_back()
        counted = self._step_counters.samples()
        if counted:  # the composed step ran this fit: its own count (cumulative since the fit started)
            L.samples = counted
        elif L.samples is not None:
            samples = self._epoch_samples if self._epoch_samples is not None else self._loss_tracker_samples()
            L.samples = None if samples is None else L.samples + max(0.0, samples - self._tracker_base)
        samples = None if L.samples is None else L.samples - (self._epoch_ledger.samples or 0.0)
        if not self._flops_tried and steps > 0:
            self._flops_tried = True
            start = time.perf_counter()
            self._flops = self._trace_flops(samples, steps)
            self._ledger.measure_s += time.perf_counter() - start

    def _trace_flops(self, samples: Optional[float], steps: int) -> Optional[float]:
        strategy = self.model.distribute_strategy
        replicas = int(strategy.num_replicas_in_sync)
        spec = _data_spec(self._functions)
        if spec is None:
            log.info("Goodput: no traced train step found; FLOPs per step unknown")
            return None
        first = tf.nest.flatten(spec)[0]
        static = first.shape[0] if getattr(first, "shape", None) is not None and first.shape.rank else None
        if static is not None:
            batch = int(static)
        elif samples:
            batch = max(1, round(samples / steps / replicas))
        else:
            return None
        # the count depends on the model's graph, not on the fit: a model fitted in a loop traces it once
        key = (repr(spec), batch, replicas, tuple(id(v) for v in self.model.trainable_weights))
        cached = _FLOPS_CACHE.setdefault(self.model, {})
        if key in cached:
            return cached[key]
        try:
            from keras_scale.heartbeat_file import write_beat

            # a trace as long as the train step's compile: `keras-scale launch --heartbeat-timeout-s` must not take
            # it for a hang (the Heartbeat callback's next beat, at this epoch's end, restarts the clock)
            write_beat("trace", training_state.iterations(self.model))
            cached[key] = float(traced_flops_per_step(self.model, spec, batch, replicas))
            return cached[key]
        except Exception as e:  # noqa: BLE001 - a FLOP count must never stop training
            log.info("Goodput: could not count FLOPs per step (%s: %s)", type(e).__name__, e)
            return None

    def _peak_flops(self) -> Optional[Tuple[float, str]]:
        if self.peak_flops is not None:
            return self.peak_flops, "peak_flops"
        if self._peak is None:
            name = _gpu_name()
            dtype = compute_dtype(self.model)
            found = peak_flops_for(name, dtype)
            self._peak = (found[0], f"{name}, {dtype}") if found else (0.0, "")
        return self._peak if self._peak[0] else None

    def _summarize(self, ledger: Ledger, wall_s: float) -> Dict[str, Any]:
        peak = self._peak_flops() if self._flops else None
        spe = int(getattr(self.model, "steps_per_execution", 1) or 1)
        out = summarize(ledger, wall_s, self._probes, spe, self._flops,
                        peak[0] if peak else None)
        out["peak_source"] = peak[1] if peak else None
        out["probes"] = len(self._probes)
        return out
