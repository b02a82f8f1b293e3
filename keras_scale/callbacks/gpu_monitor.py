"""``GpuMonitor``: is the GPU starved, and why — NVML metrics, step time and advice, inside ``model.fit``.

A background thread samples NVML and the host CPU every ``interval_s`` (never the batch hooks); the batch hooks
only append a timestamp and never read a tensor. At each epoch end the samples taken during that epoch's
training steps are reduced to mean/max per GPU. A few aggregates go to the ``History`` that ``fit`` returns
(``gpu_util_mean``, ``gpu_mem_max_mb``, step time, host CPU; not to the epoch logs), the per-GPU detail to
TensorBoard (chief only) and ``history``, and the advice rules of :mod:`keras_scale.advice` look at them
(input-bound, GPU idle, compute-bound, memory near full, throttling). Without NVML (no GPU) step time, throughput and host CPU are still logged.

Example:
    >>> import keras_scale as ks
    >>> monitor = ks.GpuMonitor(interval_s=1.0, log_dir="runs/gpu", batch_size=256)
    >>> model.fit(ds, epochs=3, callbacks=[monitor])  # doctest: +SKIP
    >>> monitor.history[-1]["gpu0"]["util_mean"]  # doctest: +SKIP
    93.5
"""
from __future__ import annotations

import numbers
import os
import re
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import keras

from keras_scale import nvml as nvml_lib
from keras_scale.advice import DEFAULT_RULES, Advice, AdviceThresholds, EpochStats, Rule, leftover_processes_message
from keras_scale import events, lifecycle
from keras_scale._validate import check_int, check_number
from keras_scale.scalars import ChiefScalars, EpochFigures
from keras_scale.distribute import chief_print

__all__ = ["GpuMonitor", "aggregate_samples", "step_timing"]

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
_MIN_INTERVAL_S = 0.001


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

    def since(self, t0: float) -> Tuple[List[Tuple[float, nvml_lib.GpuSample]], List[Tuple[float, float]]]:
        """Copies of the readings taken after ``t0`` (perf_counter seconds); the buffers stay as they are."""
        with self.lock:
            return [x for x in self.samples if x[0] > t0], [x for x in self.host_cpu if x[0] > t0]

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


# ---------------------------------------------------------------------------------------------- callback
def _check_devices(devices: Union[str, Iterable[int]]) -> Union[str, List[int]]:
    bad = ValueError(f"GpuMonitor: devices must be 'all' or a non-empty list of GPU indices >= 0 (as nvidia-smi "
                     f"numbers them), got {devices!r}")
    if isinstance(devices, str):
        if devices != "all":
            raise bad
        return "all"
    try:
        devs = list(devices)
    except TypeError:
        raise bad from None
    if not devs or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0 for d in devs):
        raise bad
    return sorted({int(d) for d in devs})


def _check_rules(advice: Union[bool, AdviceThresholds, Sequence[Rule]]) -> Tuple[AdviceThresholds, Tuple[Rule, ...]]:
    if advice is True:
        return AdviceThresholds(), tuple(DEFAULT_RULES)
    if advice is False or advice is None:
        return AdviceThresholds(), ()
    if isinstance(advice, AdviceThresholds):
        return advice, tuple(DEFAULT_RULES)
    rules = tuple(advice)
    if not all(callable(r) for r in rules):
        raise ValueError(f"GpuMonitor: advice must be True/False, an AdviceThresholds, or a list of rule functions "
                         f"(stats, thresholds) -> list[Advice]; got {advice!r}")
    return AdviceThresholds(), rules


def _check_update_freq(update_freq: Union[str, int]) -> Tuple[Optional[int], Optional[float]]:
    """``(every_n_steps, every_s)``; both None for ``"epoch"``."""
    if update_freq == "epoch":
        return None, None
    if isinstance(update_freq, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*s\s*", update_freq)
        if m and float(m.group(1)) > 0:
            return None, float(m.group(1))
    elif isinstance(update_freq, numbers.Integral) and not isinstance(update_freq, bool) and update_freq >= 1:
        return int(update_freq), None
    raise ValueError(f"GpuMonitor: update_freq must be 'epoch', a number of steps (e.g. 100) or seconds as a "
                     f"string (e.g. '30s'), got {update_freq!r}")


def _psutil_cpu_reader() -> Optional[Callable[[], float]]:
    try:
        import psutil
    except ImportError:
        return None
    return lambda: psutil.cpu_percent(interval=None)


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                      for m in (sys.modules.get("keras"), sys.modules.get("tensorflow"))
                      if m is not None and getattr(m, "__file__", None)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # keras, tensorflow, keras_scale


def _user_stacklevel() -> int:
    """The ``stacklevel`` for :func:`warnings.warn` (called right here) that points at the user's line (their
    ``model.fit(...)``), past the frames of keras_scale, Keras and TensorFlow."""
    frame, level = sys._getframe(1), 1  # the caller of this function: warn's stacklevel 1
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_LIBRARY_DIRS) and not frame.f_code.co_filename.startswith("<frozen"):
            return level
        frame, level = frame.f_back, level + 1
    return 1


class GpuMonitor(keras.callbacks.Callback):
    """Sample the GPUs in a background thread during ``fit``; per epoch, log aggregates, step time and advice.

    Per epoch (over the epoch's training steps; the first step, which carries tracing, is left out):

    - the ``History`` that ``fit`` returns gets a few aggregates over all watched GPUs (added when ``fit`` ends;
      the epoch logs, which ``CSVLogger``/Keras's ``TensorBoard`` read, stay Keras's whatever the callback order):
      ``gpu_util_mean`` (mean utilisation), ``gpu_mem_max_mb`` (the fullest GPU's peak), ``gpu_throttle_frac``
      (the most throttled GPU's share of samples); plus ``step_time_mean_ms``, ``steps_per_s``,
      ``samples_per_s`` (when ``batch_size`` is given) and ``host_cpu_mean_pct``. The last four stay when NVML
      is absent. ``full_logs=True`` adds every per-GPU metric as ``gpu{i}_<metric>``.
    - TensorBoard (``log_dir``, chief only): every per-GPU metric as ``gpu{i}/<metric>``, ``throughput/<name>``
      and ``host/cpu_mean_pct``. ``update_freq="epoch"``: one point per epoch (step = epoch); ``update_freq=N``
      (steps) or ``"30s"`` (seconds): one point per window, step = training steps since the monitor was made.
    - ``history``: one dict per epoch with every per-GPU aggregate; ``advice_history``: every :class:`Advice`.

    At train start it lists processes that already hold memory on the GPUs it watches (a leftover run) and
    warns. GPU indices are NVML's (as ``nvidia-smi`` shows them); ``devices="all"`` means the GPUs this process
    may use after ``CUDA_VISIBLE_DEVICES``. Without NVML or GPUs it warns once and keeps the host-side numbers.
    Advice is printed once per kind per fit through ``keras_scale.distribute.chief_print`` (Keras's ``print_msg``, chief only, when ``verbose``).

    Args:
        interval_s: seconds between samples (>= 0.001).
        log_dir: TensorBoard directory, or None for no TensorBoard output.
        devices: ``"all"`` or a list of NVML GPU indices.
        batch_size: global samples per step, for ``samples_per_s`` (Keras callbacks do not see the batch size).
        advice: True (default rules), False, an :class:`AdviceThresholds`, or a list of rule functions.
        update_freq: ``"epoch"``, a number of steps, or seconds as ``"30s"``: how often TensorBoard gets a point.
        full_logs: also put every per-GPU metric into ``History`` as ``gpu{i}_<metric>``.
        verbose: ``"auto"`` prints the advice when ``fit`` shows progress (not under ``fit(verbose=0)``), like
            Keras's callbacks; 1 always; 0 never (``advice_history`` records it either way; incidents still go
            through ``warnings``).
        input_batches_per_s: the input pipeline's own rate, e.g. ``keras_scale.data.benchmark(ds).batches_per_s``
            (a number, or the benchmark result itself); lets the advice tell input-bound from other stalls.
        nvml: an object with the :class:`keras_scale.nvml.Nvml` methods, or a callable returning one; default
            :func:`keras_scale.nvml.open_nvml`. An object passed in is not closed by the monitor.

    Example:
        >>> monitor = GpuMonitor(interval_s=0.5, log_dir="runs/gpu", batch_size=128, update_freq=100)
        >>> model.fit(ds, epochs=2, callbacks=[monitor])  # doctest: +SKIP
        >>> model.history.history["gpu_util_mean"]  # doctest: +SKIP
        [41.0, 88.5]
    """

    def __init__(
        self,
        interval_s: float = 1.0,
        log_dir: Optional[Union[str, os.PathLike]] = None,
        devices: Union[str, Iterable[int]] = "all",
        batch_size: Optional[int] = None,
        advice: Union[bool, AdviceThresholds, Sequence[Rule]] = True,
        update_freq: Union[str, int] = "epoch",
        full_logs: bool = False,
        verbose: Union[int, str] = "auto",
        input_batches_per_s: Any = None,
        nvml: Optional[Union[NvmlLike, Callable[[], NvmlLike]]] = None,
    ) -> None:
        super().__init__()
        owner = "GpuMonitor"
        self.interval_s = check_number("interval_s", interval_s, _MIN_INTERVAL_S, owner=owner,
                                       hint="It is the seconds between samples, e.g. interval_s=1.0.")
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ValueError(f"{owner}: log_dir must be a path or None, got {log_dir!r}")
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.devices = _check_devices(devices)
        self.batch_size = None if batch_size is None else check_int(
            "batch_size", batch_size, owner=owner, hint="It is the global samples per step, or None.")
        self.thresholds, self.rules = _check_rules(advice)
        self.update_freq = update_freq
        self._every_steps, self._every_s = _check_update_freq(update_freq)
        rate = getattr(input_batches_per_s, "batches_per_s", input_batches_per_s)
        self.input_batches_per_s = None if rate is None else check_number(
            "input_batches_per_s", rate, 1e-9, owner=owner,
            hint="Give a positive rate (batches/s) or the result of keras_scale.data.benchmark(ds).")
        if verbose != "auto":
            verbose = check_int("verbose", verbose, 0, owner=owner, hint='Use 0, 1 or "auto".')
        self.full_logs, self.verbose = bool(full_logs), verbose
        self._nvml_source = nvml
        self.read_host_cpu_pct: Optional[Callable[[], float]] = _psutil_cpu_reader()
        self.history: List[Dict[str, Any]] = []
        self.advice_history: List[Advice] = []
        self.leftover_processes: List[nvml_lib.GpuProcess] = []
        self.unavailable_reason: Optional[str] = None
        self.gpu_indices: List[int] = []
        self._warned_unavailable = False
        self._nvml: Optional[NvmlLike] = None
        self._owns_nvml = False
        self._sampler: Optional[_Sampler] = None
        self._stop_on_drop: Optional[weakref.finalize] = None  # stops the sampler if this callback is dropped
        self._scalars: Optional[ChiefScalars] = None
        self._figures = EpochFigures()
        self._batch_ends: List[Tuple[int, float]] = []
        self._epoch_begin_s = 0.0
        self._advised_kinds: set = set()
        self._context: Dict[str, bool] = {}
        self._global_step = 0  # training steps seen by this monitor (all fits): the x-axis of per-window points
        self._point = (0, 0.0)  # (global step, perf_counter) of the last TensorBoard point

    # ------------------------------------------------------------------------------------------- hooks
    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self._shutdown()  # a previous fit that raised never reached on_train_end
        self._figures.clear()
        self._advised_kinds = set()
        if self._open():
            self.leftover_processes = self._find_leftover_processes()
        self._context = self._training_context()
        self._scalars = ChiefScalars(self.log_dir, strategy=getattr(self.model, "distribute_strategy", None))
        self._sampler = _Sampler(self._nvml, self.gpu_indices, self.interval_s, self.read_host_cpu_pct)
        self._sampler.start()
        # the sampler stops however the fit ends: at on_train_end, at the model's next use after a fit that
        # raised (keras_scale.lifecycle, which holds this callback until then), or when the callback and its model
        # are dropped
        self._stop_on_drop = weakref.finalize(self, self._sampler.stop_event.set)  # (one per fit: detached at its end)
        lifecycle.join(self.model, self, undo=self._shutdown)

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self._sampler is None:
            return
        self._sampler.drain()  # samples from between epochs (validation, other callbacks) are not this epoch's
        self._batch_ends = []
        self._epoch_begin_s = time.perf_counter()
        self._point = (self._global_step, self._epoch_begin_s)

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self._sampler is None:
            return
        now = time.perf_counter()  # no tensor is read here: nothing waits for the device
        last = self._batch_ends[-1][0] if self._batch_ends else -1
        self._global_step += max(batch - last, 1)
        self._batch_ends.append((batch, now))
        if self._scalars.active and self._point_due(now):
            self._write_point(now)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self._sampler is None:
            return
        windows = bool(self._every_steps or self._every_s)
        if windows and self._scalars.active and self._global_step > self._point[0]:
            self._write_point(time.perf_counter())  # the epoch's last window (before the epoch drains the buffer)
        record = self._summarise_epoch(epoch)
        self.history.append(record)
        self._figures.add(self._log_values(record))  # History gets them at the end of fit, not the epoch logs
        if not windows and self._scalars.active:
            self._scalars.write(self._scalar_values(record), step=epoch)
        self._advise(record["stats"])

    def on_train_end(self, logs: Optional[dict] = None) -> None:
        self._figures.deliver(self.model)
        lifecycle.leave(self.model, self)  # runs _shutdown (joined in on_train_begin)

    # ----------------------------------------------------------------------------------------- helpers
    def _open(self) -> bool:
        source = self._nvml_source
        self.gpu_indices = []
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
        except Exception as e:  # noqa: BLE001 - any NVML failure means "no GPU metrics", never a crashed fit
            return self._unavailable(f"NVML failed: {type(e).__name__}: {e}")
        known = {g.index for g in gpus}
        if self.devices == "all":
            indices = nvml_lib.visible_gpu_indices(gpus)
            if not indices:
                return self._unavailable("no GPU present" if not gpus else
                                         f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} hides "
                                         f"all {len(gpus)} GPU(s)")
        else:
            missing = [d for d in self.devices if d not in known]
            if missing:
                self._close_nvml()
                raise ValueError(f"GpuMonitor(devices={self.devices}): GPU(s) {missing} do not exist; NVML sees "
                                 f"{sorted(known)}. Use devices='all' or indices nvidia-smi lists.")
            indices = list(self.devices)
        self.gpu_indices, self.unavailable_reason = indices, None
        return True

    def _unavailable(self, reason: str) -> bool:
        self._close_nvml()
        self.unavailable_reason = reason
        events.record("gpu_unavailable", None, log_dir=self.log_dir, reason=reason)
        if not self._warned_unavailable:
            self._warned_unavailable = True
            warnings.warn(f"GpuMonitor: GPU metrics are off ({reason}). Training continues; only step time, "
                          "throughput and host CPU are recorded.", RuntimeWarning, stacklevel=_user_stacklevel())
        return False

    def _close_nvml(self) -> None:
        if self._nvml is not None and self._owns_nvml:
            try:
                self._nvml.close()
            except Exception:  # noqa: BLE001
                pass
        self._nvml, self._owns_nvml = None, False

    def _shutdown(self) -> None:
        if self._stop_on_drop is not None:
            self._stop_on_drop.detach()
            self._stop_on_drop = None
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        if self._scalars is not None:
            self._scalars.close()
            self._scalars = None
        self._close_nvml()

    def _find_leftover_processes(self) -> List[nvml_lib.GpuProcess]:
        me = os.getpid()
        found: List[nvml_lib.GpuProcess] = []
        for index in self.gpu_indices:
            try:
                found.extend(p for p in self._nvml.processes(index) if p.pid != me)
            except Exception:  # noqa: BLE001 - process listing not permitted: nothing to report
                continue
        if found:
            what, fix = leftover_processes_message(found, self.gpu_indices)
            warnings.warn("GpuMonitor: other processes already hold memory on the GPUs this job uses: "
                          f"{what}. They slow this run or make it run out of memory. {fix}.",
                          RuntimeWarning, stacklevel=_user_stacklevel())
        return found

    def _training_context(self) -> Dict[str, bool]:
        model = self.model
        policy = getattr(getattr(model, "dtype_policy", None), "name", "") or ""
        jit = getattr(model, "jit_compile", False)
        # NVML's "used" means something when TensorFlow does not reserve all memory up front: memory growth on,
        # or CUDA's async allocator, whose pool grows to the peak in use.
        meaningful = (os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH", "").strip().lower() == "true"
                      or os.environ.get("TF_GPU_ALLOCATOR", "").strip() == "cuda_malloc_async")
        if not meaningful and self.gpu_indices:
            try:
                import tensorflow as tf

                gpus = tf.config.list_physical_devices("GPU")
                meaningful = bool(gpus) and all(tf.config.experimental.get_memory_growth(g) for g in gpus)
            except Exception:  # noqa: BLE001
                meaningful = False
        return {"mixed_precision": policy.startswith("mixed"), "jit_compile": jit is True,
                "memory_readings_meaningful": meaningful}

    def _window(self, samples: List[Tuple[float, nvml_lib.GpuSample]], cpu: List[Tuple[float, float]],
                window: Optional[Tuple[float, float]]) -> Tuple[Dict[int, Dict[str, float]], Optional[float]]:
        """Per-GPU aggregates and mean host CPU of the readings inside ``window`` (all of them when too few)."""
        inside = [s for s in samples if window and window[0] <= s[0] <= window[1]] or samples
        cpu_in = [c for t, c in cpu if window and window[0] <= t <= window[1]] or [c for _, c in cpu]
        per_gpu: Dict[int, List[nvml_lib.GpuSample]] = {i: [] for i in self.gpu_indices}
        for _, s in inside:
            per_gpu.setdefault(s.index, []).append(s)
        return {i: aggregate_samples(v) for i, v in per_gpu.items()}, _mean(cpu_in)

    def _summarise_epoch(self, epoch: int) -> Dict[str, Any]:
        samples, cpu = self._sampler.drain()
        ends = self._batch_ends
        if not samples and not cpu:  # shorter than one interval: one reading now (an epoch hook, not a step hook)
            self._sampler.take()
            samples, cpu = self._sampler.drain()
        window = (ends[0][1], ends[-1][1]) if len(ends) >= 2 else None
        gpus, host_cpu = self._window(samples, cpu, window)
        timing = step_timing(ends, self._epoch_begin_s, self.batch_size)
        stats = EpochStats(epoch=epoch, gpus=gpus, host_cpu_mean_pct=host_cpu, timing=timing,
                           input_batches_per_s=self.input_batches_per_s, **self._context)
        record: Dict[str, Any] = {"epoch": epoch, "num_samples": sum(1 for s in samples if window is None
                                                                     or window[0] <= s[0] <= window[1]),
                                  "timing": timing, "host_cpu_mean_pct": host_cpu, "stats": stats}
        record.update({f"gpu{i}": g for i, g in gpus.items()})
        return record

    def _log_values(self, record: Dict[str, Any]) -> Dict[str, float]:
        gpus = [record[f"gpu{i}"] for i in self.gpu_indices]
        out: Dict[str, float] = {}
        for key, values, reduce in (("gpu_util_mean", [g["util_mean"] for g in gpus if "util_mean" in g], _mean),
                                    ("gpu_mem_max_mb", [g["mem_max_mb"] for g in gpus if "mem_max_mb" in g], max),
                                    ("gpu_throttle_frac", [g["throttle_frac"] for g in gpus if "throttle_frac" in g],
                                     max)):
            if values:
                out[key] = float(reduce(values))
        if self.full_logs:
            out.update({f"gpu{i}_{k}": v for i, g in zip(self.gpu_indices, gpus) for k, v in g.items()})
        out.update(record["timing"])
        if record["host_cpu_mean_pct"] is not None:
            out["host_cpu_mean_pct"] = record["host_cpu_mean_pct"]
        return out

    def _scalar_values(self, record: Dict[str, Any]) -> Dict[str, float]:
        scalars = {f"gpu{i}/{key}": value for i in self.gpu_indices for key, value in record[f"gpu{i}"].items()}
        scalars.update({f"throughput/{key}": value for key, value in record["timing"].items()})
        if record["host_cpu_mean_pct"] is not None:
            scalars["host/cpu_mean_pct"] = record["host_cpu_mean_pct"]
        return scalars

    def _point_due(self, now: float) -> bool:
        step0, t0 = self._point
        if self._every_steps:
            return self._global_step - step0 >= self._every_steps
        return bool(self._every_s) and now - t0 >= self._every_s

    def _write_point(self, now: float) -> None:
        """One TensorBoard point for the window since the last one (host-side numbers only; no device sync)."""
        step0, t0 = self._point
        samples, cpu = self._sampler.since(t0)
        gpus, host_cpu = self._window(samples, cpu, None)
        steps = self._global_step - step0
        timing: Dict[str, float] = {}
        if steps > 0 and now > t0:
            timing = {"steps_per_s": steps / (now - t0), "step_time_mean_ms": 1000.0 * (now - t0) / steps}
            if self.batch_size:
                timing["samples_per_s"] = self.batch_size * timing["steps_per_s"]
        window = {"timing": timing, "host_cpu_mean_pct": host_cpu}
        window.update({f"gpu{i}": g for i, g in gpus.items()})
        self._scalars.write(self._scalar_values(window), step=self._global_step)
        self._point = (self._global_step, now)

    def _advise(self, stats: EpochStats) -> None:
        strategy = getattr(self.model, "distribute_strategy", None)
        for rule in self.rules:
            for advice in rule(stats, self.thresholds):
                self.advice_history.append(advice)
                events.record("gpu_advice", self._global_step, log_dir=self.log_dir, epoch=stats.epoch, advice=advice.kind, gpu=advice.gpu_index, message=advice.message)
                key = (advice.kind, advice.gpu_index)
                if key in self._advised_kinds:
                    continue  # say each thing once per fit; advice_history keeps every epoch
                self._advised_kinds.add(key)
                verbose = (self.params or {}).get("verbose", 1) if self.verbose == "auto" else self.verbose
                chief_print(f"GpuMonitor (epoch {stats.epoch + 1}): {advice.message}", strategy, verbose=verbose)
