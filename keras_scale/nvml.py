"""The one place keras_scale talks to NVML (``pynvml``, from the ``nvidia-ml-py`` package).

Everything else (``GpuMonitor``, ``keras-scale doctor``) uses the small interface below, so tests can swap in a
fake and the NVML tools run on machines without TensorFlow. This module imports neither TensorFlow nor Keras.

- :func:`open_nvml` returns an :class:`Nvml` (initialised), or raises :class:`NvmlUnavailable` with a plain
  reason (no driver, no library, no GPU permissions).
- :class:`Nvml` methods: :meth:`~Nvml.driver_version`, :meth:`~Nvml.cuda_driver_version`,
  :meth:`~Nvml.devices`, :meth:`~Nvml.sample`, :meth:`~Nvml.processes`, :meth:`~Nvml.health` (compute
  capability, ECC, persistence/compute mode, PCIe link, power limits, MIG), :meth:`~Nvml.link` (P2P/NVLink
  between two GPUs), :meth:`~Nvml.close`.
- :func:`visible_gpu_indices` maps ``CUDA_VISIBLE_DEVICES`` to NVML indices (NVML itself ignores it).

Units are in the field names: ``_pct``, ``_mb`` (MiB), ``_w``, ``_c``, ``_mhz``, ``_mb_s`` (MiB/s).

Example:
    from keras_scale import nvml
    try:
        gpus = nvml.open_nvml()
    except nvml.NvmlUnavailable as e:
        print("no GPU:", e)
    else:
        print([gpus.sample(d.index).util_gpu_pct for d in gpus.devices()])

Run ``python keras_scale/nvml.py`` for one sample of every metric, throttle reasons and GPU processes.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "NvmlUnavailable", "GpuInfo", "GpuSample", "GpuProcess", "GpuHealth", "GpuLink", "Nvml", "open_nvml",
    "visible_gpu_indices", "cuda_order", "pci_key", "THROTTLE_REASONS", "COMPUTE_MODES", "TOPOLOGY_LEVELS", "main",
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
        try:
            open_nvml()
        except NvmlUnavailable as e:
            print(f"GPU metrics off: {e}")

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
        GpuInfo(index=0, name='NVIDIA H100', uuid='GPU-1', memory_total_mb=81559.0, pci_bus_id='0:1:0', mig_uuids=(), mig_memory_mb=())
    """

    index: int
    name: str
    uuid: str
    memory_total_mb: float
    pci_bus_id: str = ""
    mig_uuids: Tuple[str, ...] = ()  # the MIG instances' UUIDs ("MIG-..."), when MIG mode is on
    mig_memory_mb: Tuple[Optional[float], ...] = ()  # each MIG instance's memory, in the order of mig_uuids


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


# NVML compute modes and topology levels, named as nvidia-smi names them.
COMPUTE_MODES: Dict[int, str] = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
TOPOLOGY_LEVELS: Dict[int, str] = {0: "same board", 10: "one PCIe switch", 20: "several PCIe switches",
                                   30: "one PCIe host bridge", 40: "one NUMA node (across host bridges)",
                                   50: "across NUMA nodes (SMP interconnect)"}


@dataclass(frozen=True)
class GpuHealth:
    """The state of one GPU that decides whether training works or crawls. ``None``: not reported by this GPU.

    ``compute_capability`` is ``(major, minor)``; ``ecc_uncorrected_volatile`` counts uncorrectable ECC errors
    since the driver loaded; ``pages_pending``: retired pages or remapped rows waiting for a GPU reset;
    ``compute_mode`` is a name from :data:`COMPUTE_MODES`; PCIe ``gen``/``width`` now vs the most the GPU and
    slot allow (``pcie_gen_gpu_max``: the GPU alone); power limits in watts; ``mig_mode`` on/off.

    Example:
        >>> GpuHealth(index=0, compute_capability=(9, 0), pcie_width=4, pcie_width_max=16).compute_capability
        (9, 0)
    """

    index: int
    compute_capability: Optional[Tuple[int, int]] = None
    ecc_uncorrected_volatile: Optional[int] = None
    pages_pending: Optional[bool] = None
    row_remap_failed: Optional[bool] = None
    persistence_mode: Optional[bool] = None
    compute_mode: Optional[str] = None
    pcie_gen: Optional[int] = None
    pcie_gen_max: Optional[int] = None
    pcie_gen_gpu_max: Optional[int] = None
    pcie_width: Optional[int] = None
    pcie_width_max: Optional[int] = None
    power_limit_w: Optional[float] = None
    power_default_limit_w: Optional[float] = None
    mig_mode: Optional[bool] = None


@dataclass(frozen=True)
class GpuLink:
    """How two GPUs talk: ``p2p`` (CUDA peer-to-peer reads possible), ``nvlinks`` (active NVLinks between them),
    ``topology`` (the closest common PCIe ancestor, a value of :data:`TOPOLOGY_LEVELS`).

    Example:
        >>> GpuLink(0, 1, p2p=True, nvlinks=4, topology="same board").nvlinks
        4
    """

    a: int
    b: int
    p2p: Optional[bool] = None
    nvlinks: int = 0
    topology: Optional[str] = None
    nvlink_p2p: Optional[bool] = None  # peer-to-peer over NVLink, direct or through NVSwitch (DGX/HGX boards)


class Nvml:
    """NVML through ``pynvml``. Create it with :func:`open_nvml`; :meth:`close` when done.

    Every reading that a GPU does not support comes back as ``None`` rather than raising.

    Example:
        nv = open_nvml()
        nv.driver_version(), nv.cuda_driver_version()
        # ('550.54.15', (12, 4))
    """

    def __init__(self, pynvml_module: Any) -> None:
        self._nv = pynvml_module
        self._handles: Dict[int, Any] = {}
        self._closed = False
        self.device_errors: Dict[int, str] = {}  # GPU index -> why devices() could not read it (e.g. GPU is lost)

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
        """Static facts of every GPU NVML sees. A GPU NVML fails on (fallen off the bus: Xid 79, "GPU is lost")
        is listed with the name ``"unknown"`` and its error kept in :attr:`device_errors`, so the other GPUs keep
        their facts and the indices stay NVML's."""
        out = []
        self.device_errors = {}
        for i in range(self.device_count()):
            try:
                out.append(self._device(i))
            except Exception as e:  # noqa: BLE001 - one sick GPU must not hide the others
                self.device_errors[i] = f"{type(e).__name__}: {e}"
                out.append(GpuInfo(index=i, name="unknown", uuid="", memory_total_mb=0.0))
        return out

    def _device(self, i: int) -> GpuInfo:
        h = self._handle(i)
        mem = self._try(self._nv.nvmlDeviceGetMemoryInfo, h)
        pci = self._try(self._nv.nvmlDeviceGetPciInfo, h)
        migs = self._migs(h)
        return GpuInfo(
            index=i,
            name=_text(self._nv.nvmlDeviceGetName(h)),
            uuid=_text(self._try(self._nv.nvmlDeviceGetUUID, h) or ""),
            memory_total_mb=float(mem.total) / _MIB if mem is not None else 0.0,
            pci_bus_id=_text(getattr(pci, "busId", "") or "") if pci is not None else "",
            mig_uuids=tuple(u for u, _ in migs),
            mig_memory_mb=tuple(m for _, m in migs),
        )

    def _migs(self, h: Any) -> List[Tuple[str, Optional[float]]]:
        """``(uuid, memory MiB)`` of each MIG instance of the GPU ``h`` (none when MIG mode is off)."""
        nv = self._nv
        mode = self._try(getattr(nv, "nvmlDeviceGetMigMode", None), h)
        if not mode or not mode[0]:
            return []
        out = []
        for i in range(int(self._try(nv.nvmlDeviceGetMaxMigDeviceCount, h) or 0)):
            mig = self._try(nv.nvmlDeviceGetMigDeviceHandleByIndex, h, i)
            uuid = self._try(nv.nvmlDeviceGetUUID, mig) if mig is not None else None
            if uuid:
                mem = self._try(nv.nvmlDeviceGetMemoryInfo, mig)
                out.append((_text(uuid), None if mem is None else float(mem.total) / _MIB))
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

    def health(self, index: int) -> GpuHealth:
        """Compute capability, ECC, persistence and compute mode, PCIe link, power limits, MIG of GPU ``index``."""
        nv, h = self._nv, self._handle(index)
        ecc = self._try(nv.nvmlDeviceGetTotalEccErrors, h, getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                        getattr(nv, "NVML_VOLATILE_ECC", 0))
        rows = self._try(getattr(nv, "nvmlDeviceGetRemappedRows", None), h)  # Ampere+: (corr, unc, pending, failed)
        pending = bool(rows[2]) if rows is not None else None
        if rows is None:  # older GPUs retire pages instead
            retired = self._try(getattr(nv, "nvmlDeviceGetRetiredPagesPendingStatus", None), h)
            pending = None if retired is None else bool(retired)
        cc = self._try(nv.nvmlDeviceGetCudaComputeCapability, h)
        persistence = self._try(nv.nvmlDeviceGetPersistenceMode, h)
        mode = self._try(nv.nvmlDeviceGetComputeMode, h)
        limit = self._try(nv.nvmlDeviceGetPowerManagementLimit, h)
        default = self._try(nv.nvmlDeviceGetPowerManagementDefaultLimit, h)
        mig = self._try(getattr(nv, "nvmlDeviceGetMigMode", None), h)
        return GpuHealth(
            index=index,
            compute_capability=None if cc is None else (int(cc[0]), int(cc[1])),
            ecc_uncorrected_volatile=None if ecc is None else int(ecc),
            pages_pending=pending,
            row_remap_failed=None if rows is None else bool(rows[3]),
            persistence_mode=None if persistence is None else bool(persistence),
            compute_mode=None if mode is None else COMPUTE_MODES.get(int(mode), str(mode)),
            pcie_gen=_int(self._try(nv.nvmlDeviceGetCurrPcieLinkGeneration, h)),
            pcie_gen_max=_int(self._try(nv.nvmlDeviceGetMaxPcieLinkGeneration, h)),
            pcie_gen_gpu_max=_int(self._try(getattr(nv, "nvmlDeviceGetGpuMaxPcieLinkGeneration", None), h)),
            pcie_width=_int(self._try(nv.nvmlDeviceGetCurrPcieLinkWidth, h)),
            pcie_width_max=_int(self._try(nv.nvmlDeviceGetMaxPcieLinkWidth, h)),
            power_limit_w=None if limit is None else float(limit) / 1000.0,
            power_default_limit_w=None if default is None else float(default) / 1000.0,
            mig_mode=None if mig is None else bool(mig[0]),
        )

    def link(self, a: int, b: int) -> GpuLink:
        """Peer-to-peer support, active NVLinks and PCIe topology between GPUs ``a`` and ``b``."""
        nv, ha, hb = self._nv, self._handle(a), self._handle(b)
        p2p = self._try(getattr(nv, "nvmlDeviceGetP2PStatus", None), ha, hb, getattr(nv, "NVML_P2P_CAPS_INDEX_READ", 0))
        level = self._try(getattr(nv, "nvmlDeviceGetTopologyCommonAncestor", None), ha, hb)
        pci_b = self._try(nv.nvmlDeviceGetPciInfo, hb)
        bus_b = _text(getattr(pci_b, "busId", "") or "").lower() if pci_b is not None else ""
        nvlinks = 0
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 0))):
            state = self._try(getattr(nv, "nvmlDeviceGetNvLinkState", None), ha, link)
            if state is None:
                break  # no NVLink on this GPU (or no more links)
            if not state:
                continue
            remote = self._try(nv.nvmlDeviceGetNvLinkRemotePciInfo, ha, link)
            if remote is not None and bus_b and _text(getattr(remote, "busId", "")).lower() == bus_b:
                nvlinks += 1
        # On NVSwitch systems every NVLink ends at a switch, not at GPU b: ask NVML whether P2P over NVLink works
        over_nvlink = self._try(getattr(nv, "nvmlDeviceGetP2PStatus", None), ha, hb,
                                getattr(nv, "NVML_P2P_CAPS_INDEX_NVLINK", 2))
        return GpuLink(a, b, p2p=None if p2p is None else int(p2p) == 0, nvlinks=nvlinks,
                       topology=None if level is None else TOPOLOGY_LEVELS.get(int(level), str(level)),
                       nvlink_p2p=None if over_nvlink is None else int(over_nvlink) == 0)

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

    def _try(self, fn: Optional[Callable[..., Any]], *args: Any) -> Any:
        if fn is None:  # an older nvidia-ml-py without this function
            return None
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
        process_name(os.getpid())
        # 'python -m pytest'
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


def _int(value: Any) -> Optional[int]:
    return None if value is None else int(value)


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


def pci_key(bus_id: str) -> Tuple[int, ...]:
    """A PCI bus id as numbers, so NVML's ``"00000000:17:00.0"`` and TensorFlow's ``"0000:17:00.0"`` compare equal.

    Example:
        >>> pci_key("00000000:17:00.0") == pci_key("0000:17:00.0")
        True
    """
    parts = re.split(r"[:.]", (bus_id or "").strip())
    try:
        return tuple(int(p, 16) for p in parts) if len(parts) == 4 else ()
    except ValueError:
        return ()


def cuda_order(devices: Sequence[GpuInfo], env: Optional[Mapping[str, str]] = None) -> Tuple[List[int], Optional[str]]:
    """NVML indices in CUDA's numbering (the numbers ``CUDA_VISIBLE_DEVICES`` uses), and why that is a guess
    (None when it is not).

    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` numbers GPUs by PCI bus id, as NVML and ``nvidia-smi`` do. CUDA's default,
    ``FASTEST_FIRST``, puts the fastest GPU first: the same as PCI order when all GPUs are one model, unknown on a
    box mixing models.

    Example:
        >>> gpus = [GpuInfo(0, "GTX 1650", "GPU-a", 4.0, "0:1:0.0"), GpuInfo(1, "RTX 5090", "GPU-b", 32.0, "0:2:0.0")]
        >>> cuda_order(gpus, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
        ([0, 1], None)
        >>> cuda_order(gpus, {})[1] is not None
        True
    """
    env = os.environ if env is None else env
    by_pci = [d.index for d in sorted(devices, key=lambda d: (pci_key(d.pci_bus_id) or (1 << 40,), d.index))]
    setting = (env.get("CUDA_DEVICE_ORDER") or "FASTEST_FIRST").strip().upper()
    models = sorted({d.name for d in devices})
    if setting == "PCI_BUS_ID" or len(models) <= 1:
        return by_pci, None
    return by_pci, (f"CUDA_DEVICE_ORDER is {env.get('CUDA_DEVICE_ORDER', 'unset')!r} (CUDA's default FASTEST_FIRST): "
                    f"CUDA numbers the fastest GPU 0, NVML and nvidia-smi number by PCI bus, and this box mixes "
                    f"{', '.join(models)}")


def visible_gpu_indices(devices: Sequence[GpuInfo], env: Optional[Mapping[str, str]] = None,
                        order: Optional[Sequence[int]] = None) -> List[int]:
    """NVML indices of the GPUs this process may use, following ``CUDA_VISIBLE_DEVICES`` like CUDA does.

    Unset: all. Empty or ``-1``: none. Entries are indices, UUID prefixes (``GPU-...``) or MIG instances
    (``MIG-<uuid>``, or the older ``MIG-GPU-<uuid>/<gi>/<ci>``), which map to the GPU holding them; CUDA stops at
    the first entry it cannot match, and so does this. Order is the variable's order. ``order`` lists NVML indices
    in CUDA's numbering (see :func:`cuda_order`); default: CUDA number = NVML index.

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
            if order is not None:
                match = order[i] if 0 <= i < len(order) else None
            else:
                match = next((d.index for d in devices if d.index == i), None) if i >= 0 else None
        elif entry.upper().startswith("GPU-"):
            hits = [d.index for d in devices if d.uuid.upper().startswith(entry.upper())]
            match = hits[0] if len(hits) == 1 else None
        elif entry.upper().startswith("MIG-GPU-"):  # MIG-GPU-<parent uuid>/<gi>/<ci> (drivers before R470)
            parent = entry[4:].split("/")[0].upper()
            hits = [d.index for d in devices if d.uuid.upper() == parent]
            match = hits[0] if hits else None
        elif entry.upper().startswith("MIG-"):
            hits = [d.index for d in devices if any(m.upper().startswith(entry.upper()) for m in d.mig_uuids)]
            match = hits[0] if len(hits) == 1 else None
        if match is None:
            break
        if match in out:
            if entry.upper().startswith("MIG-"):
                continue  # a second MIG instance of the same GPU
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
            for name, value in dataclasses.asdict(nv.health(g.index)).items():
                if name != "index":
                    print(f"  {name:<22} {'not supported' if value is None else value}")
            procs = nv.processes(g.index)
            if not procs:
                print("  processes              none")
            for p in procs:
                mem = "?" if p.used_memory_mb is None else f"{p.used_memory_mb:.0f}"
                print(f"  process                pid {p.pid}  {mem} MiB  {p.name}")
        for a, b in ((a.index, b.index) for i, a in enumerate(gpus) for b in gpus[i + 1:]):
            link = nv.link(a, b)
            print(f"GPU {a} <-> GPU {b}: p2p {link.p2p}, {link.nvlinks} NVLink(s), {link.topology}")
    finally:
        nv.close()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
