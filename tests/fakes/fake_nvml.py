"""FakeNvml: a FAKE of keras_scale.nvml.Nvml for tests on machines without a GPU.

It implements the same methods (driver_version, cuda_driver_version, device_count, devices, sample,
processes, health, link, close) and returns fabricated readings, recording which thread asked for each sample so
tests can check that sampling happens off the training thread. Only the hardware edge is faked: everything above
it (GpuMonitor, doctor) runs for real.

Example:
    >>> fake = FakeNvml.with_gpus(2, util_gpu_pct=35.0, mem_used_mb=1000.0)
    >>> fake.sample(1).util_gpu_pct
    35.0
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from keras_scale.nvml import GpuHealth, GpuInfo, GpuLink, GpuProcess, GpuSample

SampleSource = Union[Dict[str, object], Callable[[int, int], Dict[str, object]]]

_DEFAULT_METRICS = dict(
    util_gpu_pct=50.0, util_mem_pct=20.0, mem_used_mb=2000.0, mem_total_mb=16000.0, power_w=150.0,
    power_limit_w=300.0, temperature_c=60.0, sm_clock_mhz=1500.0, mem_clock_mhz=5000.0, pcie_rx_mb_s=100.0,
    pcie_tx_mb_s=50.0, throttle_thermal=False, throttle_power_cap=False, throttle_hw_slowdown=False,
)
# A healthy data-center GPU: Ampere, no ECC errors, persistence on, default compute mode, PCIe 4 x16 at full
# width, power limit at its default.
_DEFAULT_HEALTH = dict(
    compute_capability=(8, 0), ecc_uncorrected_volatile=0, pages_pending=False, row_remap_failed=False,
    persistence_mode=True, compute_mode="Default", pcie_gen=4, pcie_gen_max=4, pcie_gen_gpu_max=4, pcie_width=16,
    pcie_width_max=16, power_limit_w=300.0, power_default_limit_w=300.0, mig_mode=False,
)


class FakeNvml:
    """A fake NVML: ``metrics`` is a dict of GpuSample fields, or ``f(gpu_index, call_number) -> dict``.

    ``health`` maps a GPU index to GpuHealth fields that differ from a healthy GPU; ``links`` maps ``(a, b)``
    (a < b) to GpuLink fields (default: P2P over one PCIe switch, no NVLink).

    Attributes recorded for assertions: ``sample_calls`` (list of ``(gpu_index, thread_name)``), ``closed``.
    """

    def __init__(
        self,
        devices: Sequence[GpuInfo],
        metrics: SampleSource = None,
        processes: Optional[Dict[int, List[GpuProcess]]] = None,
        driver: str = "550.54.15",
        cuda: Optional[Tuple[int, int]] = (12, 4),
        fail_sample_for: Sequence[int] = (),
        health: Optional[Dict[int, Dict[str, object]]] = None,
        links: Optional[Dict[Tuple[int, int], Dict[str, object]]] = None,
        lost: Sequence[int] = (),
    ) -> None:
        self._devices = list(devices)
        self._metrics = metrics if metrics is not None else {}
        self._processes = processes or {}
        self._driver = driver
        self._cuda = cuda
        self._fail = set(fail_sample_for)
        self._health = health or {}
        self._links = links or {}
        self._lost = set(lost)  # GPUs fallen off the bus: NVML raises for every query about them
        self.device_errors: Dict[int, str] = {}
        self._lock = threading.Lock()
        self._count: Dict[int, int] = {}
        self.sample_calls: List[Tuple[int, str]] = []
        self.closed = False

    @classmethod
    def with_gpus(cls, num_gpus: int = 1, processes: Optional[Dict[int, List[GpuProcess]]] = None,
                  mem_total_mb: float = 16000.0, health: Optional[Dict[int, Dict[str, object]]] = None,
                  links: Optional[Dict[Tuple[int, int], Dict[str, object]]] = None, lost: Sequence[int] = (),
                  **metrics: object) -> "FakeNvml":
        devices = [GpuInfo(i, "Fake GPU", f"GPU-fake-{i:04d}", mem_total_mb, f"00000000:{i + 1:02X}:00.0")
                   for i in range(num_gpus)]
        return cls(devices, metrics=dict(mem_total_mb=mem_total_mb, **metrics), processes=processes,
                   health=health, links=links, lost=lost)

    # --- the keras_scale.nvml.Nvml interface ----------------------------------------------------------
    def driver_version(self) -> str:
        return self._driver

    def cuda_driver_version(self) -> Optional[Tuple[int, int]]:
        return self._cuda

    def device_count(self) -> int:
        return len(self._devices)

    def devices(self) -> List[GpuInfo]:
        # as keras_scale.nvml.Nvml.devices(): a lost GPU keeps its index, its error goes to device_errors
        self.device_errors = {d.index: "NVMLError_GpuIsLost: GPU is lost" for d in self._devices
                              if d.index in self._lost}
        return [GpuInfo(d.index, "unknown", "", 0.0) if d.index in self._lost else d for d in self._devices]

    def _check_lost(self, index: int) -> None:
        if index in self._lost:
            raise RuntimeError("NVMLError_GpuIsLost: GPU is lost")

    def sample(self, index: int) -> GpuSample:
        if index not in {d.index for d in self._devices}:
            raise ValueError(f"fake NVML has no GPU {index}")
        with self._lock:
            n = self._count.get(index, 0)
            self._count[index] = n + 1
            self.sample_calls.append((index, threading.current_thread().name))
        self._check_lost(index)
        if index in self._fail:
            raise RuntimeError(f"fake NVML: GPU {index} fell off the bus")
        values = dict(_DEFAULT_METRICS)
        values.update(self._metrics(index, n) if callable(self._metrics) else self._metrics)
        return GpuSample(index=index, timestamp_s=time.time(), **values)

    def processes(self, index: int) -> List[GpuProcess]:
        self._check_lost(index)
        return list(self._processes.get(index, []))

    def health(self, index: int) -> GpuHealth:
        if index not in {d.index for d in self._devices}:
            raise ValueError(f"fake NVML has no GPU {index}")
        self._check_lost(index)
        return GpuHealth(index=index, **{**_DEFAULT_HEALTH, **self._health.get(index, {})})

    def link(self, a: int, b: int) -> GpuLink:
        values = dict(p2p=True, nvlinks=0, topology="one PCIe switch")
        values.update(self._links.get((min(a, b), max(a, b)), {}))
        return GpuLink(a, b, **values)

    def close(self) -> None:
        self.closed = True


def sample_fields() -> List[str]:
    """The GpuSample metric fields (to check a fake sample covers every real metric)."""
    return [f.name for f in dataclasses.fields(GpuSample) if f.name not in ("index", "timestamp_s")]


class FakePynvml:
    """A FAKE of the ``pynvml`` module itself (one level lower), to test keras_scale.nvml.Nvml's conversions.

    Raw NVML units: memory in bytes, power in milliwatts, PCIe throughput in KB/s, throttle reasons as a bit
    mask, CUDA driver version as ``major * 1000 + minor * 10``. ``unsupported`` names functions that raise
    ``NVMLError_NotSupported``.
    """

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_P2P_CAPS_INDEX_READ = 0
    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_NVLINK_MAX_LINKS = 36

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def __init__(self, unsupported: Sequence[str] = (), throttle_bits: int = 0,
                 procs: Sequence[Tuple[int, int]] = ((4242, 3 * 1024 ** 3),), num_gpus: int = 1,
                 mig_uuids: Sequence[str] = (), nvlinks_to_gpu1: int = 0, nvswitch: bool = False) -> None:
        self.unsupported = set(unsupported)
        self.num_gpus = num_gpus
        self.mig_uuids = list(mig_uuids)
        self.nvlinks_to_gpu1 = nvlinks_to_gpu1
        self.nvswitch = nvswitch  # NVLinks end at an NVSwitch: P2P over NVLink works, no link names GPU 1
        self.throttle_bits = throttle_bits
        self.procs = list(procs)
        self.shutdown_calls = 0

    def _check(self, name: str) -> None:
        if name in self.unsupported:
            raise self.NVMLError_NotSupported(f"{name} not supported")

    def nvmlSystemGetDriverVersion(self):
        return b"550.54.15"

    def nvmlSystemGetCudaDriverVersion(self):
        self._check("nvmlSystemGetCudaDriverVersion")
        return 12040

    def nvmlDeviceGetCount(self):
        return self.num_gpus

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetName(self, h):
        return "NVIDIA Fake H100"

    def nvmlDeviceGetUUID(self, h):
        if h[0] == "mig":
            return self.mig_uuids[h[2]]
        return f"GPU-0f0f{h[1]}" if h[1] else "GPU-0f0f"

    def nvmlDeviceGetPciInfo(self, h):
        return type("Pci", (), {"busId": f"00000000:{0x17 + h[1]:02X}:00.0".encode()})()

    # --- health: raw NVML units (mW, enum values, tuples) ---
    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (9, 0)

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        self._check("nvmlDeviceGetTotalEccErrors")
        assert (error_type, counter_type) == (1, 0)  # uncorrected, volatile
        return 2

    def nvmlDeviceGetRemappedRows(self, h):
        self._check("nvmlDeviceGetRemappedRows")
        return (0, 1, 1, 0)  # corrected, uncorrected, pending, failure

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return 0

    def nvmlDeviceGetPersistenceMode(self, h):
        return 0

    def nvmlDeviceGetComputeMode(self, h):
        return 3

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 3

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 4

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 4

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetPowerManagementLimit(self, h):
        return 450_000

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h):
        return 700_000

    def nvmlDeviceGetMigMode(self, h):
        self._check("nvmlDeviceGetMigMode")
        return [1 if self.mig_uuids and h[1] == 0 else 0, 0]  # MIG mode on GPU 0 only

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return len(self.mig_uuids) + 2  # some slots empty

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, i):
        if i >= len(self.mig_uuids):
            raise self.NVMLError_NotSupported("no MIG device at this index")
        return ("mig", h[1], i)

    def nvmlDeviceGetP2PStatus(self, h1, h2, index):
        if index == self.NVML_P2P_CAPS_INDEX_NVLINK:
            return 0 if self.nvlinks_to_gpu1 or self.nvswitch else 4
        return 0 if self.nvlinks_to_gpu1 else 4  # 4: NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, h1, h2):
        return 50

    def nvmlDeviceGetNvLinkState(self, h, link):
        if not self.nvlinks_to_gpu1:
            raise self.NVMLError_NotSupported("no NVLink")
        if link >= 18:
            raise self.NVMLError("invalid link")
        return 1 if link < self.nvlinks_to_gpu1 + 1 else 0  # one more active link goes to another GPU

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        bus = "00000000:18:00.0" if link < self.nvlinks_to_gpu1 else "00000000:99:00.0"
        return type("Pci", (), {"busId": bus})()

    def nvmlDeviceGetMemoryInfo(self, h):
        self._check("nvmlDeviceGetMemoryInfo")
        return type("Mem", (), {"used": 2 * 1024 ** 3, "total": 80 * 1024 ** 3})()

    def nvmlDeviceGetUtilizationRates(self, h):
        self._check("nvmlDeviceGetUtilizationRates")
        return type("Util", (), {"gpu": 87, "memory": 41})()

    def nvmlDeviceGetPowerUsage(self, h):
        self._check("nvmlDeviceGetPowerUsage")
        return 312_500

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        self._check("nvmlDeviceGetEnforcedPowerLimit")
        return 700_000

    def nvmlDeviceGetTemperature(self, h, sensor):
        self._check("nvmlDeviceGetTemperature")
        return 71

    def nvmlDeviceGetClockInfo(self, h, clock):
        self._check("nvmlDeviceGetClockInfo")
        return {self.NVML_CLOCK_SM: 1755, self.NVML_CLOCK_MEM: 2619}[clock]

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        self._check("nvmlDeviceGetPcieThroughput")
        return {self.NVML_PCIE_UTIL_RX_BYTES: 2048, self.NVML_PCIE_UTIL_TX_BYTES: 512}[counter]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        self._check("nvmlDeviceGetCurrentClocksEventReasons")
        return self.throttle_bits

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [type("P", (), {"pid": pid, "usedGpuMemory": used})() for pid, used in self.procs]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return []

    def nvmlSystemGetProcessName(self, pid):
        return b"python old_run.py"

    def nvmlShutdown(self):
        self.shutdown_calls += 1
