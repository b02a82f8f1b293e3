"""The one place keras_scale talks to NVML (``pynvml``, from the ``nvidia-ml-py`` package).

Everything else (``GpuMonitor``, ``keras-scale doctor``) uses the small interface below, so tests can swap in a
fake and the NVML tools run on machines without TensorFlow. This module imports neither TensorFlow nor Keras.

- :func:`open_nvml` returns an :class:`Nvml` (initialised), or raises :class:`NvmlUnavailable` with a plain
  reason (no driver, no library, no GPU permissions).
- :class:`Nvml` methods: :meth:`~Nvml.driver_version`, :meth:`~Nvml.cuda_driver_version`,
  :meth:`~Nvml.devices`, :meth:`~Nvml.sample`, :meth:`~Nvml.processes`, :meth:`~Nvml.close`.
- :func:`visible_gpu_indices` maps ``CUDA_VISIBLE_DEVICES`` to NVML indices (NVML itself ignores it).

Units are in the field names: ``_pct``, ``_mb`` (MiB), ``_w``, ``_c``, ``_mhz``, ``_mb_s`` (MiB/s).

Example:
    >>> from keras_scale import nvml
    >>> try:
    ...     gpus = nvml.open_nvml()
    ... except nvml.NvmlUnavailable as e:
    ...     print("no GPU:", e)
    ... else:
    ...     print([gpus.sample(d.index).util_gpu_pct for d in gpus.devices()])

Run ``python keras_scale/nvml.py`` for one sample of every metric, throttle reasons and GPU processes.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "NvmlUnavailable", "GpuInfo", "GpuSample", "GpuProcess", "Nvml", "open_nvml", "visible_gpu_indices",
    "THROTTLE_REASONS", "main",
]

_MIB = 1024 * 1024

# The throttle reasons we report (and their NVML bit masks; names stable across nvidia-ml-py versions).
THROTTLE_REASONS: Tuple[str, ...] = ("thermal", "power_cap", "hw_slowdown")
_THROTTLE_BITS = {
    # SW thermal slowdown 0x20, HW thermal slowdown 0x40
    "thermal": 0x20 | 0x40,
    # SW power cap 0x04, HW power brake 0x80
    "power_cap": 0x04 | 0x80,
    # HW slowdown 0x08 (thermal or power brake asserted by the board)
    "hw_slowdown": 0x08,
}


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here: no NVIDIA driver/library, no GPU, or no permission. ``str(e)`` says which.

    Example:
        >>> try:
        ...     open_nvml()
        ... except NvmlUnavailable as e:
        ...     print(f"GPU metrics off: {e}")  # doctest: +SKIP

    ``kind`` says which case it is, for callers that decide on it: ``"no_module"`` (pynvml missing),
    ``"no_driver"`` (no NVML library: no GPU or no driver), ``"driver_not_loaded"``, ``"no_permission"``,
    ``"version_mismatch"`` (driver updated without reboot) or ``"other"``.
    """

    def __init__(self, message: str, kind: str = "other") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class GpuInfo:
    """Static facts about one GPU, as NVML numbers it (the ``nvidia-smi`` index).

    Example:
        >>> GpuInfo(index=0, name="NVIDIA H100", uuid="GPU-1", memory_total_mb=81559.0, pci_bus_id="0:1:0")
        GpuInfo(index=0, name='NVIDIA H100', uuid='GPU-1', memory_total_mb=81559.0, pci_bus_id='0:1:0')
    """

    index: int
    name: str
    uuid: str
    memory_total_mb: float
    pci_bus_id: str = ""


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU. A metric the GPU does not support is ``None``.

    ``throttle_*`` are True when NVML reports that reason for lowering the clocks at the time of the sample.

    Example:
        >>> s = GpuSample(index=0, timestamp_s=0.0, util_gpu_pct=97.0)
        >>> s.util_gpu_pct, s.power_w
        (97.0, None)
    """

    index: int
    timestamp_s: float
    util_gpu_pct: Optional[float] = None
    util_mem_pct: Optional[float] = None
    mem_used_mb: Optional[float] = None
    mem_total_mb: Optional[float] = None
    power_w: Optional[float] = None
    power_limit_w: Optional[float] = None
    temperature_c: Optional[float] = None
    sm_clock_mhz: Optional[float] = None
    mem_clock_mhz: Optional[float] = None
    pcie_rx_mb_s: Optional[float] = None
    pcie_tx_mb_s: Optional[float] = None
    throttle_thermal: Optional[bool] = None
    throttle_power_cap: Optional[bool] = None
    throttle_hw_slowdown: Optional[bool] = None

    def metrics(self) -> Dict[str, float]:
        """The numeric metrics of this sample (booleans as 0/1), ``None`` left out.

        Example:
            >>> GpuSample(index=0, timestamp_s=1.0, util_gpu_pct=50.0, throttle_thermal=True).metrics()
            {'util_gpu_pct': 50.0, 'throttle_thermal': 1.0}
        """
        out = {}
        for field in dataclasses.fields(self):
            if field.name in ("index", "timestamp_s"):
                continue
            value = getattr(self, field.name)
            if value is not None:
                out[field.name] = float(value)
        return out

    def throttle_reasons(self) -> List[str]:
        """Names from :data:`THROTTLE_REASONS` that are active in this sample.

        Example:
            >>> GpuSample(index=0, timestamp_s=0.0, throttle_thermal=True).throttle_reasons()
            ['thermal']
        """
        return [r for r in THROTTLE_REASONS if getattr(self, f"throttle_{r}")]


METRIC_NAMES: Tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(GpuSample) if f.name not in ("index", "timestamp_s")
)


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU.

    Example:
        >>> GpuProcess(gpu_index=0, pid=4242, name="python train.py", used_memory_mb=10240.0)
        GpuProcess(gpu_index=0, pid=4242, name='python train.py', used_memory_mb=10240.0)
    """

    gpu_index: int
    pid: int
    name: str
    used_memory_mb: Optional[float]


class Nvml:
    """NVML through ``pynvml``. Create it with :func:`open_nvml`; :meth:`close` when done.

    Every reading that a GPU does not support comes back as ``None`` rather than raising.

    Example:
        >>> nv = open_nvml()  # doctest: +SKIP
        >>> nv.driver_version(), nv.cuda_driver_version()  # doctest: +SKIP
        ('550.54.15', (12, 4))
    """

    def __init__(self, pynvml_module: Any) -> None:
        self._nv = pynvml_module
        self._handles: Dict[int, Any] = {}
        self._closed = False

    # ----------------------------------------------------------------------------------------------- system
    def driver_version(self) -> str:
        """The NVIDIA driver version, e.g. ``"550.54.15"``."""
        return _text(self._nv.nvmlSystemGetDriverVersion())

    def cuda_driver_version(self) -> Optional[Tuple[int, int]]:
        """The newest CUDA version the driver supports, as ``(major, minor)``, e.g. ``(12, 4)``."""
        try:
            v = int(self._nv.nvmlSystemGetCudaDriverVersion())
        except self._nv.NVMLError:
            return None
        return v // 1000, (v % 1000) // 10

    def device_count(self) -> int:
        """How many GPUs NVML sees (all of them: NVML ignores ``CUDA_VISIBLE_DEVICES``)."""
        return int(self._nv.nvmlDeviceGetCount())

    def devices(self) -> List[GpuInfo]:
        """Static facts of every GPU NVML sees."""
        out = []
        for i in range(self.device_count()):
            h = self._handle(i)
            mem = self._try(self._nv.nvmlDeviceGetMemoryInfo, h)
            pci = self._try(self._nv.nvmlDeviceGetPciInfo, h)
            out.append(GpuInfo(
                index=i,
                name=_text(self._nv.nvmlDeviceGetName(h)),
                uuid=_text(self._try(self._nv.nvmlDeviceGetUUID, h) or ""),
                memory_total_mb=float(mem.total) / _MIB if mem is not None else 0.0,
                pci_bus_id=_text(getattr(pci, "busId", "") or "") if pci is not None else "",
            ))
        return out

    # ---------------------------------------------------------------------------------------------- readings
    def sample(self, index: int) -> GpuSample:
        """One reading of every metric of GPU ``index`` (NVML numbering)."""
        nv, h = self._nv, self._handle(index)
        util = self._try(nv.nvmlDeviceGetUtilizationRates, h)
        mem = self._try(nv.nvmlDeviceGetMemoryInfo, h)
        power_mw = self._try(nv.nvmlDeviceGetPowerUsage, h)
        limit_mw = self._try(nv.nvmlDeviceGetEnforcedPowerLimit, h)
        temp = self._try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
        sm = self._try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
        memclk = self._try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
        rx_kb = self._try(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES)
        tx_kb = self._try(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES)
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons")
        bits = self._try(reasons_fn, h)
        throttle = {r: (None if bits is None else bool(int(bits) & mask)) for r, mask in _THROTTLE_BITS.items()}
        return GpuSample(
            index=index,
            timestamp_s=time.time(),
            util_gpu_pct=_num(getattr(util, "gpu", None)),
            util_mem_pct=_num(getattr(util, "memory", None)),
            mem_used_mb=None if mem is None else float(mem.used) / _MIB,
            mem_total_mb=None if mem is None else float(mem.total) / _MIB,
            power_w=None if power_mw is None else float(power_mw) / 1000.0,
            power_limit_w=None if limit_mw is None else float(limit_mw) / 1000.0,
            temperature_c=_num(temp),
            sm_clock_mhz=_num(sm),
            mem_clock_mhz=_num(memclk),
            pcie_rx_mb_s=None if rx_kb is None else float(rx_kb) / 1024.0,
            pcie_tx_mb_s=None if tx_kb is None else float(tx_kb) / 1024.0,
            throttle_thermal=throttle["thermal"],
            throttle_power_cap=throttle["power_cap"],
            throttle_hw_slowdown=throttle["hw_slowdown"],
        )

    def processes(self, index: int) -> List[GpuProcess]:
        """Processes holding memory on GPU ``index`` (compute and graphics), largest first."""
        nv, h = self._nv, self._handle(index)
        seen: Dict[int, GpuProcess] = {}
        for fn_name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            fn = getattr(nv, fn_name, None)
            procs = self._try(fn, h) if fn is not None else None
            for p in procs or []:
                pid = int(p.pid)
                used = getattr(p, "usedGpuMemory", None)
                # NVML reports "not available" (e.g. no permission in a container) as None or a huge value.
                used_mb = float(used) / _MIB if isinstance(used, int) and 0 <= used < (1 << 60) else None
                if pid not in seen:
                    seen[pid] = GpuProcess(index, pid, self._process_name(pid), used_mb)
        return sorted(seen.values(), key=lambda p: -(p.used_memory_mb or 0.0))

    def close(self) -> None:
        """Shut NVML down (safe to call twice)."""
        if not self._closed:
            self._closed = True
            try:
                self._nv.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down a library that is going away anyway
                pass

    # --------------------------------------------------------------------------------------------- helpers
    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._nv.nvmlDeviceGetHandleByIndex(int(index))
        return self._handles[index]

    def _try(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nv.NVMLError:  # NotSupported, NoPermission, ...: the metric is just missing
            return None

    def _process_name(self, pid: int) -> str:
        try:
            name = _text(self._nv.nvmlSystemGetProcessName(pid))
            if name:
                return name
        except Exception:  # noqa: BLE001 - e.g. a process in another container
            pass
        return process_name(pid)


def process_name(pid: int) -> str:
    """A short command line for ``pid`` from ``/proc`` (``"?"`` when it cannot be read).

    Example:
        >>> process_name(os.getpid())  # doctest: +SKIP
        'python -m pytest'
    """
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            parts = [p.decode(errors="replace") for p in f.read().split(b"\0") if p]
        if parts:
            return " ".join([os.path.basename(parts[0])] + parts[1:])[:120]
    except OSError:
        pass
    return "?"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _num(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def open_nvml() -> Nvml:
    """Initialise NVML and return an :class:`Nvml`; raise :class:`NvmlUnavailable` saying why it cannot be used.

    Example:
        >>> try:
        ...     nv = open_nvml()
        ... except NvmlUnavailable as e:
        ...     reason = str(e)
    """
    try:
        import pynvml
    except ImportError as e:
        raise NvmlUnavailable(
            f"the pynvml module is not installed ({e}); install it with `pip install nvidia-ml-py`",
            "no_module") from e
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise NvmlUnavailable(*_explain_init_error(e)) from e
    except OSError as e:  # a broken libnvidia-ml.so
        raise NvmlUnavailable(f"the NVML library could not be loaded ({e}); reinstall the NVIDIA driver") from e
    return Nvml(pynvml)


def _explain_init_error(error: Exception) -> Tuple[str, str]:
    name = type(error).__name__
    if name == "NVMLError_LibraryNotFound":
        return ("no NVIDIA driver found (NVML library libnvidia-ml.so is not installed): no GPU is present "
                "or the driver is not installed", "no_driver")
    if name == "NVMLError_DriverNotLoaded":
        return ("the NVIDIA kernel driver is not loaded (no GPU, or the driver is broken: check `nvidia-smi`)",
                "driver_not_loaded")
    if name == "NVMLError_NoPermission":
        return ("no permission to talk to the NVIDIA driver (in a container: run with --gpus / the NVIDIA "
                "runtime)", "no_permission")
    if name == "NVMLError_LibRmVersionMismatch":
        return ("the NVIDIA driver library and kernel module versions differ (driver updated without a "
                "reboot): reboot or reload the nvidia kernel module", "version_mismatch")
    return f"NVML failed to initialise: {name}: {error}", "other"


def visible_gpu_indices(devices: Sequence[GpuInfo], env: Optional[Mapping[str, str]] = None) -> List[int]:
    """NVML indices of the GPUs this process may use, following ``CUDA_VISIBLE_DEVICES`` like CUDA does.

    Unset: all. Empty or ``-1``: none. Entries are indices or UUID prefixes (``GPU-...``); CUDA stops at the
    first entry it cannot match, and so does this. Order is the variable's order.

    Example:
        >>> gpus = [GpuInfo(i, "GPU", f"GPU-{i}abc", 1.0) for i in range(4)]
        >>> visible_gpu_indices(gpus, {"CUDA_VISIBLE_DEVICES": "2,0"})
        [2, 0]
        >>> visible_gpu_indices(gpus, {})
        [0, 1, 2, 3]
    """
    env = os.environ if env is None else env
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return [d.index for d in devices]
    out: List[int] = []
    for entry in (e.strip() for e in raw.split(",")):
        match = None
        if entry.lstrip("-").isdigit():
            i = int(entry)
            match = next((d.index for d in devices if d.index == i), None) if i >= 0 else None
        elif entry.upper().startswith("GPU-"):
            hits = [d.index for d in devices if d.uuid.upper().startswith(entry.upper())]
            match = hits[0] if len(hits) == 1 else None
        if match is None or match in out:
            break
        out.append(match)
    return out


# ------------------------------------------------------------------------------------------------ __main__
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print one sample of every metric, the throttle reasons and GPU processes of each GPU (or why not).

    Example:
        $ python keras_scale/nvml.py
    """
    del argv
    try:
        nv = open_nvml()
    except NvmlUnavailable as e:
        print(f"No GPU metrics: {e}.")
        return 0
    try:
        gpus = nv.devices()
        cuda = nv.cuda_driver_version()
        print(f"NVIDIA driver {nv.driver_version()}, supports CUDA up to "
              f"{'%d.%d' % cuda if cuda else 'unknown'}; {len(gpus)} GPU(s) seen by NVML")
        visible = visible_gpu_indices(gpus)
        if "CUDA_VISIBLE_DEVICES" in os.environ:
            print(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} -> NVML indices {visible}")
        if not gpus:
            print("No GPU present.")
        for g in gpus:
            print(f"\nGPU {g.index}: {g.name}  {g.uuid}  pci {g.pci_bus_id}  {g.memory_total_mb:.0f} MiB")
            s = nv.sample(g.index)
            for name in METRIC_NAMES:
                value = getattr(s, name)
                shown = "not supported" if value is None else (value if isinstance(value, bool) else f"{value:.1f}")
                print(f"  {name:<22} {shown}")
            reasons = s.throttle_reasons()
            print(f"  throttle reasons       {', '.join(reasons) if reasons else 'none'}")
            procs = nv.processes(g.index)
            if not procs:
                print("  processes              none")
            for p in procs:
                mem = "?" if p.used_memory_mb is None else f"{p.used_memory_mb:.0f}"
                print(f"  process                pid {p.pid}  {mem} MiB  {p.name}")
    finally:
        nv.close()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
