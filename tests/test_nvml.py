"""keras_scale.nvml: the real NVML path up to "no GPU" (this machine), conversions on a fake pynvml,
CUDA_VISIBLE_DEVICES mapping, and ``python keras_scale/nvml.py`` without TensorFlow."""
import dataclasses
import os
import subprocess
import sys

import pytest

from keras_scale import nvml
from keras_scale.nvml import Nvml, visible_gpu_indices
from tests.fakes.fake_nvml import FakeNvml, FakePynvml, sample_fields

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _real_nvml_or_none():
    try:
        return nvml.open_nvml()
    except nvml.NvmlUnavailable:
        return None


def test_real_open_nvml_says_plainly_why_not_or_reads_every_gpu():
    nv = _real_nvml_or_none()
    if nv is None:
        with pytest.raises(nvml.NvmlUnavailable) as e:
            nvml.open_nvml()
        reason = str(e.value)
        assert "NVML" in reason or "driver" in reason
        # the real pynvml error is kept as the cause, for whoever needs the details
        import pynvml

        assert isinstance(e.value.__cause__, pynvml.NVMLError)
        return
    try:  # a GPU machine: the real readings must be sane
        for gpu in nv.devices():
            s = nv.sample(gpu.index)
            assert s.mem_total_mb and s.mem_total_mb > 0
            assert s.util_gpu_pct is None or 0 <= s.util_gpu_pct <= 100
    finally:
        nv.close()


def test_real_library_not_found_is_explained_as_no_gpu(monkeypatch):
    import pynvml

    def not_found():
        raise pynvml.NVMLError_LibraryNotFound(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", not_found)
    with pytest.raises(nvml.NvmlUnavailable, match="no NVIDIA driver found") as e:
        nvml.open_nvml()
    assert e.value.kind == "no_driver"


@pytest.mark.parametrize("error_name,kind,needle", [
    ("NVMLError_DriverNotLoaded", "driver_not_loaded", "kernel driver is not loaded"),
    ("NVMLError_NoPermission", "no_permission", "--gpus"),
    ("NVMLError_LibRmVersionMismatch", "version_mismatch", "reboot"),
    ("NVMLError_Unknown", "other", "NVMLError_Unknown"),
])
def test_real_init_errors_are_explained(monkeypatch, error_name, kind, needle):
    import pynvml

    def fail():
        raise getattr(pynvml, error_name)()

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    with pytest.raises(nvml.NvmlUnavailable, match=needle) as e:
        nvml.open_nvml()
    assert e.value.kind == kind


def test_missing_pynvml_module_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(nvml.NvmlUnavailable, match="pip install nvidia-ml-py") as e:
        nvml.open_nvml()
    assert e.value.kind == "no_module"


def test_sample_converts_raw_nvml_units():
    nv = nvml.Nvml(FakePynvml(throttle_bits=0x20 | 0x04 | 0x01))  # sw thermal + sw power cap + idle
    s = nv.sample(0)
    assert (s.util_gpu_pct, s.util_mem_pct) == (87.0, 41.0)
    assert s.mem_used_mb == 2048.0 and s.mem_total_mb == 80 * 1024.0
    assert s.power_w == 312.5 and s.power_limit_w == 700.0
    assert s.temperature_c == 71.0 and s.sm_clock_mhz == 1755.0 and s.mem_clock_mhz == 2619.0
    assert s.pcie_rx_mb_s == 2.0 and s.pcie_tx_mb_s == 0.5
    assert s.throttle_reasons() == ["thermal", "power_cap"]  # "idle" is not a throttle reason
    assert s.throttle_hw_slowdown is False
    assert set(s.metrics()) == set(nvml.METRIC_NAMES)


@pytest.mark.parametrize("bits,expected", [(0x40, ["thermal"]), (0x80, ["power_cap"]), (0x08, ["hw_slowdown"]),
                                           (0x01 | 0x10, [])])
def test_throttle_bits_map_to_reasons(bits, expected):
    assert nvml.Nvml(FakePynvml(throttle_bits=bits)).sample(0).throttle_reasons() == expected


def test_unsupported_metrics_are_none_not_errors():
    fake = FakePynvml(unsupported=["nvmlDeviceGetPowerUsage", "nvmlDeviceGetPcieThroughput",
                                   "nvmlDeviceGetCurrentClocksEventReasons", "nvmlSystemGetCudaDriverVersion"])
    nv = nvml.Nvml(fake)
    s = nv.sample(0)
    assert s.power_w is None and s.pcie_rx_mb_s is None and s.throttle_thermal is None
    assert s.util_gpu_pct == 87.0
    assert nv.cuda_driver_version() is None
    assert "power_w" not in s.metrics()


def test_devices_processes_driver_and_close():
    fake = FakePynvml(procs=[(11, 1024 ** 3), (12, 5 * 1024 ** 3), (13, None)])
    nv = nvml.Nvml(fake)
    assert nv.driver_version() == "550.54.15" and nv.cuda_driver_version() == (12, 4)
    (gpu,) = nv.devices()
    assert gpu.name == "NVIDIA Fake H100" and gpu.pci_bus_id == "00000000:17:00.0"
    assert gpu.memory_total_mb == 80 * 1024.0
    procs = nv.processes(0)
    assert [p.pid for p in procs] == [12, 11, 13]  # largest first; unknown memory last
    assert procs[0].used_memory_mb == 5120.0 and procs[2].used_memory_mb is None
    assert procs[0].name == "python old_run.py"
    nv.close()
    nv.close()
    assert fake.shutdown_calls == 1


def test_fake_covers_every_real_metric():
    fake = FakeNvml.with_gpus(1)
    assert set(fake.sample(0).metrics()) == set(sample_fields()) == set(nvml.METRIC_NAMES)


@pytest.mark.parametrize("value,expected", [
    (None, [0, 1, 2, 3]), ("", []), ("-1", []), ("2,0", [2, 0]), ("1,7,2", [1]), ("GPU-bbb", [1]),
    ("GPU-", []), ("0,0", [0]), (" 3 ", [3]),
])
def test_visible_gpu_indices_follows_cuda_rules(value, expected):
    gpus = [nvml.GpuInfo(i, "g", uuid, 1.0) for i, uuid in enumerate(["GPU-aaa", "GPU-bbb", "GPU-ccc", "GPU-ddd"])]
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert nvml.visible_gpu_indices(gpus, env) == expected


def test_process_name_reads_proc():
    assert "python" in nvml.process_name(os.getpid()).lower()
    assert nvml.process_name(2 ** 22 + 12345) == "?"


def test_nvml_script_runs_without_tensorflow():
    # Block TensorFlow and Keras: the module must import and run on a GPU box that has only nvidia-ml-py.
    code = (
        "import sys, runpy\n"
        "sys.modules['tensorflow'] = None\nsys.modules['keras'] = None\n"
        f"runpy.run_path({os.path.join(REPO_ROOT, 'keras_scale', 'nvml.py')!r}, run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    if _real_nvml_or_none() is None:
        assert proc.stdout.startswith("No GPU metrics:"), proc.stdout
        assert "no NVIDIA driver found" in proc.stdout
    else:
        assert "NVIDIA driver" in proc.stdout and "util_gpu_pct" in proc.stdout


def test_main_prints_every_metric_throttle_and_processes(monkeypatch, capsys):
    monkeypatch.setattr(nvml, "open_nvml", lambda: nvml.Nvml(FakePynvml(throttle_bits=0x40)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert nvml.main([]) == 0
    out = capsys.readouterr().out
    for name in nvml.METRIC_NAMES:
        assert name in out
    assert "supports CUDA up to 12.4" in out
    assert "throttle reasons       thermal" in out
    assert "pid 4242  3072 MiB  python old_run.py" in out
    assert "CUDA_VISIBLE_DEVICES='0' -> NVML indices [0]" in out


def test_health_converts_raw_nvml_values():
    nv = Nvml(FakePynvml())
    h = nv.health(0)
    assert h.compute_capability == (9, 0) and h.ecc_uncorrected_volatile == 2
    assert h.pages_pending is True and h.row_remap_failed is False  # remapped rows: (corr, unc, pending, failed)
    assert h.persistence_mode is False and h.compute_mode == "Exclusive_Process"
    assert (h.pcie_gen, h.pcie_gen_max, h.pcie_gen_gpu_max, h.pcie_width, h.pcie_width_max) == (3, 4, 5, 4, 16)
    assert h.power_limit_w == 450.0 and h.power_default_limit_w == 700.0  # milliwatts -> watts
    assert h.mig_mode is False


def test_health_fields_a_gpu_does_not_support_are_none():
    h = Nvml(FakePynvml(unsupported=["nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows",
                                     "nvmlDeviceGetMigMode"])).health(0)
    assert h.ecc_uncorrected_volatile is None and h.mig_mode is None
    assert h.pages_pending is False and h.row_remap_failed is None  # falls back to retired-pages status


def test_link_counts_nvlinks_to_that_gpu_and_reads_p2p_and_topology():
    nv = Nvml(FakePynvml(num_gpus=2, nvlinks_to_gpu1=4))
    link = nv.link(0, 1)
    assert link.nvlinks == 4 and link.p2p is True and link.topology == "across NUMA nodes (SMP interconnect)"
    pcie = Nvml(FakePynvml(num_gpus=2)).link(0, 1)  # no NVLink at all
    assert pcie.nvlinks == 0 and pcie.p2p is False


def test_mig_instances_are_listed_and_cuda_visible_devices_maps_them():
    nv = Nvml(FakePynvml(num_gpus=2, mig_uuids=["MIG-aaaa-1111", "MIG-bbbb-2222"]))
    gpus = nv.devices()
    assert gpus[0].mig_uuids == ("MIG-aaaa-1111", "MIG-bbbb-2222") and gpus[1].mig_uuids == ()
    assert visible_gpu_indices(gpus, {"CUDA_VISIBLE_DEVICES": "MIG-bbbb"}) == [0]
    assert visible_gpu_indices(gpus, {"CUDA_VISIBLE_DEVICES": "MIG-aaaa-1111,MIG-bbbb-2222"}) == [0]
    assert visible_gpu_indices(gpus, {"CUDA_VISIBLE_DEVICES": "MIG-GPU-0f0f1/1/0"}) == [1]  # pre-R470 form
    assert visible_gpu_indices(gpus, {"CUDA_VISIBLE_DEVICES": "MIG-cccc"}) == []


def test_fake_nvml_serves_health_and_links_like_the_real_one():
    from keras_scale.nvml import GpuHealth, GpuLink

    fake = FakeNvml.with_gpus(2, health={1: {"pcie_width": 8}}, links={(0, 1): {"nvlinks": 2}})
    assert isinstance(fake.health(0), GpuHealth) and fake.health(1).pcie_width == 8
    assert fake.link(1, 0) == GpuLink(1, 0, p2p=True, nvlinks=2, topology="one PCIe switch")
    assert {f.name for f in dataclasses.fields(GpuHealth)} >= set(dataclasses.asdict(fake.health(0)))
