"""keras-scale doctor: every check's decision on fabricated facts, the gatherers on real files/sockets, the JSON
schema, exit codes and the text table, the real run on this machine and a run without TensorFlow."""
import dataclasses
import json
import os
import socket
import subprocess
import sys

import importlib

import pytest

import keras_scale
from keras_scale.nvml import GpuInfo, GpuProcess, GpuSample
from tests.fakes.fake_nvml import FakeNvml

# `keras_scale.doctor` is both a module and the function it exports; take the module explicitly.
dr = importlib.import_module("keras_scale.doctor")
# the helpers a test pokes directly live in the doctor's family modules
dr_command = importlib.import_module("keras_scale.doctor.command")
dr_cuda_libraries = importlib.import_module("keras_scale.doctor.cuda_libraries")
dr_driver = importlib.import_module("keras_scale.doctor.driver")
dr_env_vars = importlib.import_module("keras_scale.doctor.env_vars")
dr_facts = importlib.import_module("keras_scale.doctor.facts")
dr_gather = importlib.import_module("keras_scale.doctor.gather")
dr_probe = importlib.import_module("keras_scale.doctor.probe")
dr_versions = importlib.import_module("keras_scale.doctor.versions")
dr_xla_flags = importlib.import_module("keras_scale.doctor.xla_flags")
Facts, CheckResult = dr.Facts, dr.CheckResult
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TF_OK = {"tensorflow": "2.21.0", "error": None, "keras": "3.15.1", "keras_backend": "tensorflow",
         "build": {"cuda_version": "12.5.1", "cudnn_version": "9", "is_cuda_build": True},
         "gpus": [], "memory_growth": {}, "placements": [
             {"requested": "/device:CPU:0", "device": "/job:localhost/replica:0/task:0/device:CPU:0", "ok": True,
              "error": None}], "log_hints": []}


def _tf(**over):
    d = json.loads(json.dumps(TF_OK))
    d.update(over)
    return d


def _gpus(n):
    return [GpuInfo(i, "NVIDIA H100", f"GPU-{i:04d}", 81559.0) for i in range(n)]


def _facts(num_gpus=0, tf=None, env=None, **kw):
    gpus = kw.pop("gpus", None) or _gpus(num_gpus)
    base = dict(env=env or {}, tf=_tf() if tf is None else tf, gpus=gpus,
                visible_gpu_indices=[g.index for g in gpus], driver_version="555.42.06" if num_gpus else None,
                cuda_driver_version=(12, 5) if num_gpus else None)
    if not num_gpus:
        base.update(nvml_error="no NVIDIA driver found", nvml_error_kind="no_driver")
    base.update(kw)
    return Facts(**base)


# ------------------------------------------------------------------------------------- versions, driver
def test_finding_rejects_unknown_status():
    with pytest.raises(ValueError, match="'fine'"):
        CheckResult("x", "fine", "")


@pytest.mark.parametrize("version,status", [("3.11.7", "ok"), ("3.13.0", "ok"), ("3.9.18", "warn")])
def test_python(version, status):
    assert dr.check_python(Facts(python_version=version)).status == status


def test_tensorflow_ok_missing_broken_unprobed():
    assert dr.check_tensorflow(_facts()).status == "ok"
    missing = dr.check_tensorflow(_facts(tf={"tensorflow": None, "error": "ModuleNotFoundError: No module named "
                                                                           "'tensorflow'"}))
    assert missing.status == "warn" and "not installed" in missing.detail and "pip install" in missing.fix
    broken = dr.check_tensorflow(_facts(tf={"tensorflow": None, "error": "ImportError: libcudart.so.12: cannot "
                                                                          "open shared object", "crashed": False}))
    assert broken.status == "error" and "libcudart" in broken.detail
    assert dr.check_tensorflow(Facts()).status == "skip"


def test_keras_backend_and_version():
    assert dr.check_keras(_facts()).status == "ok"
    jax = dr.check_keras(_facts(tf=_tf(keras_backend="jax")))
    assert jax.status == "warn" and "'jax'" in jax.detail and "KERAS_BACKEND=tensorflow" in jax.fix
    assert dr.check_keras(_facts(tf=_tf(keras="2.15.0"))).status == "error"
    assert dr.check_keras(_facts(tf=_tf(keras=None, keras_error="ImportError: x"))).status == "error"
    assert dr.check_keras(_facts(tf={"tensorflow": None, "error": "No module named 'tensorflow'"})).status == "skip"


def test_tf_build_cpu_only_wheel_on_gpu_machine_is_an_error():
    cpu = _tf(build={"is_cuda_build": False})
    assert dr.check_tf_build(_facts(tf=cpu)).status == "ok"  # CPU wheel, CPU machine: fine
    bad = dr.check_tf_build(_facts(num_gpus=2, tf=cpu))
    assert bad.status == "error" and "tensorflow[and-cuda]" in bad.fix
    ok = dr.check_tf_build(_facts(num_gpus=1))
    assert ok.status == "ok" and "CUDA 12.5.1" in ok.detail and "cuDNN 9" in ok.detail


@pytest.mark.parametrize("kind,status", [("no_driver", "skip"), ("no_module", "warn"),
                                         ("version_mismatch", "error"), ("no_permission", "error")])
def test_nvidia_driver_error_kinds(kind, status):
    f = _facts(nvml_error="reason text", nvml_error_kind=kind)
    finding = dr.check_nvidia_driver(f)
    assert finding.status == status and "reason text" in finding.detail
    if kind == "no_driver":
        assert finding.detail.startswith("No GPU present")


def test_nvidia_driver_ok_lists_gpus():
    d = dr.check_nvidia_driver(_facts(num_gpus=2))
    assert d.status == "ok" and "555.42.06" in d.detail and "CUDA up to 12.5" in d.detail and "2 GPU(s)" in d.detail


# ----------------------------------------------------------------------------------------- driver vs CUDA
def test_driver_minimum_table_is_well_formed():
    table = dr.load_driver_minimums()
    assert set(table) == {"toolkit", "minor_version_compatibility"}
    for cuda, drv in table["toolkit"].items():
        major, minor = cuda.split(".")[:2]
        assert major in table["minor_version_compatibility"]
        if minor != "0":
            assert dr_facts._ver(drv) >= dr_facts._ver(table["minor_version_compatibility"][major])
    ordered = sorted(table["toolkit"], key=dr_facts._ver)
    assert [dr_facts._ver(table["toolkit"][k]) for k in ordered] == sorted(dr_facts._ver(table["toolkit"][k]) for k in ordered)


@pytest.mark.parametrize("driver,cuda_max,wheel,status", [
    ("555.42.06", (12, 5), "12.5.1", "ok"),
    ("560.35.03", (12, 6), "12.5.1", "ok"),
    ("535.104.05", (12, 2), "12.5.1", "warn"),  # minor version compatibility only
    ("525.60.13", (12, 0), "12.5.1", "warn"),
    ("520.61.05", (11, 8), "12.5.1", "error"),  # CUDA 11 driver, CUDA 12 wheel
    ("470.82.01", None, "12.3", "error"),
    ("470.82.01", (11, 4), "11.8", "warn"),
    ("545.23.06", (12, 3), "12.7", "warn"),  # 12.7 not in the table: the nearest lower minor (12.6) is used
    ("450.51.05", (11, 0), "11.0", "ok"),  # the 11.0 GA driver predates the 11.x compatibility floor
    ("450.36.06", (11, 0), "11.0", "error"),  # 11.0's release-candidate driver: older than GA
    ("450.36.06", (11, 0), "11.2", "error"),
    ("555.42.02", (12, 5), "12.5.1", "warn"),  # TF 2.21's CUDA 12.5 Update 1 shipped with 555.42.06
    ("590.44.01", (13, 1), "13.1", "ok"),
    ("580.65.06", (13, 0), "13.2", "warn"),
])
def test_driver_vs_cuda(driver, cuda_max, wheel, status):
    f = _facts(num_gpus=1, driver_version=driver, cuda_driver_version=cuda_max,
               tf=_tf(build={"cuda_version": wheel, "cudnn_version": "9", "is_cuda_build": True}))
    finding = dr.check_driver_cuda(f)
    assert finding.status == status, finding
    if status != "ok":
        assert "Upgrade the NVIDIA driver to >=" in finding.fix
    if driver == "555.42.02":  # 12.5 GA's driver: same PTX ISA as 12.5.1, so no "PTX JIT can fail" scare
        assert "same PTX ISA" in finding.detail and "UNSUPPORTED_PTX" not in finding.detail


def test_every_driver_row_cites_its_source_and_the_corrected_rows():
    with open(dr_driver._DATA_FILE) as fh:
        data = json.load(fh)
    for section in ("toolkit", "minor_version_compatibility"):
        for version, row in data[section].items():
            assert row["source"] in data["sources"], (version, row)
            assert "https://docs.nvidia.com/" in data["sources"][row["source"]]
    table = dr.load_driver_minimums()["toolkit"]
    assert table["11.0"] == "450.51.05"  # GA, not the 450.36.06 release candidate
    assert table["12.5.1"] == "555.42.06" and table["13.1"] == "590.44.01" and table["13.2"] == "595.45.04"


def test_driver_vs_cuda_skips_without_driver_tf_or_table_entry():
    assert dr.check_driver_cuda(_facts()).status == "skip"
    assert dr.check_driver_cuda(_facts(num_gpus=1, tf={"tensorflow": None, "error": "x"})).status == "skip"
    assert dr.check_driver_cuda(_facts(num_gpus=1, tf=_tf(build={"is_cuda_build": False}))).status == "skip"
    unknown = dr.check_driver_cuda(_facts(num_gpus=1, tf=_tf(build={"cuda_version": "14.1",
                                                                     "is_cuda_build": True})))
    assert unknown.status == "skip" and "cuda_driver_minimums.json" in unknown.detail


# --------------------------------------------------------------------------------------- GPU visibility
def _tf_with_gpus(n, **build):
    return _tf(gpus=[f"/physical_device:GPU:{i}" for i in range(n)],
               build=dict({"cuda_version": "12.5.1", "cudnn_version": "9", "is_cuda_build": True}, **build))


def test_visibility_no_gpu_anywhere_says_so():
    f = dr.check_gpu_visibility(_facts(tf=_tf_with_gpus(0)))
    assert f.status == "skip" and f.detail.startswith("No GPU present")


def test_visibility_matches():
    f = dr.check_gpu_visibility(_facts(num_gpus=2, tf=_tf_with_gpus(2)))
    assert f.status == "ok" and "TensorFlow sees 2" in f.detail


def test_visibility_cuda_visible_devices_hides_all():
    f = dr.check_gpu_visibility(_facts(num_gpus=2, tf=_tf_with_gpus(0), visible_gpu_indices=[],
                                       env={"CUDA_VISIBLE_DEVICES": ""}))
    assert f.status == "error" and "CUDA_VISIBLE_DEVICES=''" in f.detail and "hides every GPU" in f.detail


def test_visibility_mig_instance_is_not_hiding_all_gpus():
    gpus = [GpuInfo(0, "NVIDIA A100", "GPU-aaaa", 40960.0, mig_uuids=("MIG-1111", "MIG-2222"))]
    from keras_scale.nvml import visible_gpu_indices
    env = {"CUDA_VISIBLE_DEVICES": "MIG-2222"}
    f = dr.check_gpu_visibility(_facts(num_gpus=1, gpus=gpus, tf=_tf_with_gpus(1), env=env,
                                       visible_gpu_indices=visible_gpu_indices(gpus, env)))
    assert f.status == "ok", f
    # NVML could not list the MIG instances (no permission): still not "hides all"
    unmapped = dr.check_gpu_visibility(_facts(num_gpus=1, tf=_tf_with_gpus(1), env=env, visible_gpu_indices=[]))
    assert unmapped.status == "ok" and "MIG instance" in unmapped.detail and "hides" not in unmapped.detail


def test_visibility_cpu_only_wheel():
    f = dr.check_gpu_visibility(_facts(num_gpus=2, tf=_tf_with_gpus(0, is_cuda_build=False)))
    assert f.status == "error" and "CPU-only" in f.detail and "tensorflow[and-cuda]" in f.fix


def test_visibility_missing_libraries_quotes_tf_log():
    tf = _tf_with_gpus(0)
    tf["log_hints"] = ["W0000 Cannot dlopen some GPU libraries. libcudnn.so.9: cannot open shared object file"]
    f = dr.check_gpu_visibility(_facts(num_gpus=1, tf=tf))
    assert f.status == "error" and "libcudnn.so.9" in f.detail and "LD_LIBRARY_PATH" in f.fix


def test_visibility_fewer_than_visible_and_tf_missing():
    assert dr.check_gpu_visibility(_facts(num_gpus=4, tf=_tf_with_gpus(3))).status == "warn"
    f = dr.check_gpu_visibility(_facts(num_gpus=4, tf={"tensorflow": None, "error": "No module named 'tensorflow'"},
                                       visible_gpu_indices=[1, 2], env={"CUDA_VISIBLE_DEVICES": "1,2"}))
    assert f.status == "skip" and "NVML sees 4 GPU(s), 2 visible" in f.detail


# -------------------------------------------------------------------------------- processes, throttling
def test_gpu_processes_warn_with_kill_and_free_gpu():
    procs = [GpuProcess(0, 4242, "python old.py", 30000.0), GpuProcess(0, 4243, "python old2.py", None)]
    f = dr.check_gpu_processes(_facts(num_gpus=2, processes=procs))
    assert f.status == "warn"
    assert "GPU 0: pid 4242 (python old.py) holds 30000 MiB" in f.detail
    assert "pid 4243 (python old2.py) holds ? MiB" in f.detail
    assert "kill 4242 4243" in f.fix and "CUDA_VISIBLE_DEVICES=1" in f.fix
    assert dr.check_gpu_processes(_facts(num_gpus=2)).status == "ok"
    assert dr.check_gpu_processes(_facts()).status == "skip"


def test_throttling():
    hot = GpuSample(1, 0.0, temperature_c=93.0, throttle_thermal=True, throttle_power_cap=False,
                    throttle_hw_slowdown=False)
    cool = GpuSample(0, 0.0, temperature_c=40.0, throttle_thermal=False, throttle_power_cap=False,
                     throttle_hw_slowdown=False)
    f = dr.check_throttling(_facts(num_gpus=2, samples={0: cool, 1: hot}))
    assert f.status == "warn" and "GPU 1: thermal, 93 C" in f.detail and "GPU 0" not in f.detail
    ok = dr.check_throttling(_facts(num_gpus=1, samples={0: cool}))
    assert ok.status == "ok" and "max 40 C" in ok.detail
    assert dr.check_throttling(_facts()).status == "skip"


# ------------------------------------------------------------------------------------------ libraries
def test_library_conflict_conda_with_pip_wheels():
    f = _facts(pip_nvidia_packages=["nvidia-cudnn-cu12==9.3.0.75"],
               conda_cuda_packages={"/opt/conda/envs/x": ["cudatoolkit-11.8.0-h6a678d5_0"]},
               ld_cuda_dirs={"/opt/conda/envs/x/lib": ["libcudart.so.11.0"]})
    finding = dr.check_library_conflicts(f)
    assert finding.status == "warn" and "cudatoolkit-11.8.0" in finding.detail
    assert "/opt/conda/envs/x/lib" in finding.detail and "conda remove" in finding.fix


def test_library_system_cuda_shadowing_pip_wheels_and_clean_cases():
    shadow = dr.check_library_conflicts(_facts(pip_nvidia_packages=["nvidia-cublas-cu12==12.5"],
                                               ld_cuda_dirs={"/usr/local/cuda/lib64": ["libcudart.so.12"]}))
    assert shadow.status == "warn" and "/usr/local/cuda/lib64" in shadow.detail
    assert dr.check_library_conflicts(_facts(pip_nvidia_packages=["nvidia-cublas-cu12==12.5"])).status == "ok"
    assert dr.check_library_conflicts(_facts(ld_cuda_dirs={"/usr/local/cuda/lib64": ["libcudart.so.12"]})
                                      ).status == "ok"
    assert dr.check_library_conflicts(_facts()).status == "ok"


def test_gatherers_find_cuda_libs_and_conda_packages_on_disk(tmp_path):
    prefix = tmp_path / "miniconda3" / "envs" / "train"
    (prefix / "lib").mkdir(parents=True)
    (prefix / "conda-meta").mkdir()
    for name in ("libcudart.so.11.0", "libcudnn.so.8", "libz.so.1"):
        (prefix / "lib" / name).write_text("")
    for name in ("cudatoolkit-11.8.0-h6a678d5_0.json", "cudnn-8.9.2.26-cuda11_0.json", "numpy-1.26.json"):
        (prefix / "conda-meta" / name).write_text("{}")
    plain = tmp_path / "plain"
    plain.mkdir()
    env = {"LD_LIBRARY_PATH": os.pathsep.join([str(prefix / "lib"), str(plain), "/does/not/exist"])}
    dirs = dr_cuda_libraries._ld_cuda_dirs(env)
    assert dirs == {str(prefix / "lib"): ["libcudart.so.11.0", "libcudnn.so.8"]}
    conda = dr_cuda_libraries._conda_cuda_packages(env, list(dirs))
    assert conda == {str(prefix): ["cudatoolkit-11.8.0-h6a678d5_0", "cudnn-8.9.2.26-cuda11_0"]}
    assert dr_cuda_libraries._conda_cuda_packages({"CONDA_PREFIX": str(prefix)}, []) == conda


def test_cuda_libraries_from_tf_log():
    mism = _tf(log_hints=["E0000 Loaded runtime CuDNN library: 8.6.0 but source was compiled with: 9.3.0."])
    f = dr.check_cuda_libraries(_facts(num_gpus=1, tf=mism))
    assert f.status == "error" and "8.6.0" in f.detail
    miss = _tf(log_hints=["W0000 Could not load dynamic library 'libcudnn.so.9'"])
    assert dr.check_cuda_libraries(_facts(num_gpus=1, tf=miss)).status == "error"
    assert dr.check_cuda_libraries(_facts(tf=miss)).status == "skip"  # no GPU: libraries not needed
    crashed = dr.check_cuda_libraries(_facts(tf={"tensorflow": None, "crashed": True, "error": "exit -11"}))
    assert crashed.status == "error" and "exit -11" in crashed.detail
    assert dr.check_cuda_libraries(_facts(num_gpus=1)).status == "ok"


# ----------------------------------------------------------------------------------------- placement
def test_placement():
    ok = dr.check_placement(_facts())
    assert ok.status == "ok" and "CPU:0" in ok.detail and "no GPU" in ok.detail
    wrong = _tf(placements=[{"requested": "/device:GPU:0", "device": "/job:localhost/replica:0/task:0/device:CPU:0",
                             "ok": True, "error": None}])
    f = dr.check_placement(_facts(num_gpus=1, tf=wrong))
    assert f.status == "error" and "asked for GPU:0" in f.detail
    failed = _tf(placements=[{"requested": "/device:GPU:0", "device": None, "ok": False,
                              "error": "InternalError: CUDA_ERROR_OUT_OF_MEMORY"}])
    assert "OUT_OF_MEMORY" in dr.check_placement(_facts(num_gpus=1, tf=failed)).detail
    assert dr.check_placement(_facts(tf=_tf(placements=[]))).status == "error"
    # a jit_compile function fails where the matmul passes
    ops = [{"requested": "/device:GPU:0", "op": op, "device": "/job:localhost/replica:0/task:0/device:GPU:0",
            "ok": op != "jit_compile", "error": None if op != "jit_compile" else "InternalError: ptxas too old"}
           for op in dr.SMOKE_OPS]
    jit = dr.check_placement(_facts(num_gpus=1, tf=_tf(placements=ops)))
    assert jit.status == "error" and "jit_compile on GPU:0: InternalError: ptxas too old" in jit.detail
    assert "matmul" not in jit.detail
    # the probe died in the middle (an XLA abort): what ran is kept, the crash is the finding
    crashed = _tf(placements=ops[:3], crashed=True,
                  error="the TensorFlow probe exited with code -6 at: jit_compile on /device:GPU:0",
                  log_hints=["F0000 Unknown flags in XLA_FLAGS: --xla_foo"])
    c = dr.check_placement(_facts(num_gpus=1, tf=crashed))
    assert c.status == "error" and "jit_compile on /device:GPU:0" in c.detail and "--xla_foo" in c.detail
    assert dr.check_placement(_facts(tf={"tensorflow": None, "error": "x"})).status == "skip"


# ------------------------------------------------------------------------------------- env variables
def test_memory_growth():
    bad = dr.check_memory_growth(_facts(num_gpus=1, env={"TF_FORCE_GPU_ALLOW_GROWTH": "True"}))
    assert bad.status == "warn" and "'True'" in bad.detail
    on = dr.check_memory_growth(_facts(num_gpus=1, env={"TF_FORCE_GPU_ALLOW_GROWTH": "true"}))
    assert on.status == "ok" and "on" in on.detail and not on.fix
    api = dr.check_memory_growth(_facts(num_gpus=1, tf=_tf(memory_growth={"/physical_device:GPU:0": True})))
    assert api.status == "ok" and not api.fix
    off = dr.check_memory_growth(_facts(num_gpus=1))
    assert off.status == "ok" and "reserves nearly all" in off.detail and "TF_FORCE_GPU_ALLOW_GROWTH=true" in off.fix
    assert dr.check_memory_growth(_facts()).status == "skip"
    asy = dr.check_memory_growth(_facts(num_gpus=1, env={"TF_GPU_ALLOCATOR": "cuda_malloc_async"}))
    assert asy.status == "ok" and "pool grows to the peak" in asy.detail and not asy.fix
    typo = dr.check_memory_growth(_facts(num_gpus=1, env={"TF_GPU_ALLOCATOR": "cuda_malloc_asnyc"}))
    assert typo.status == "warn" and "cuda_malloc_asnyc" in typo.detail
    for debug in ("cuda_malloc", "memory_guard"):  # TensorFlow's debugging allocators: known, but slow
        d = dr.check_memory_growth(_facts(num_gpus=1, env={"TF_GPU_ALLOCATOR": debug}))
        assert "not a value TensorFlow knows" not in d.detail and "debugging allocator" in d.detail, d


def test_xla_flags(tmp_path):
    assert dr.check_xla_flags(_facts()).detail == "No XLA flags set."
    good = dr.check_xla_flags(_facts(env={"XLA_FLAGS": f"--xla_gpu_cuda_data_dir={tmp_path}"}))
    assert good.status == "ok" and str(tmp_path) in good.detail
    for env, needle in [({"XLA_FLAGS": "--xla_dump_to=/tmp/dump"}, "dumps"),
                        ({"XLA_FLAGS": "--xla_gpu_cuda_data_dir=/nope/cuda"}, "does not exist")]:
        f = dr.check_xla_flags(_facts(env=env))
        assert f.status == "warn" and needle in f.detail, (env, f)
    # a quoted value with spaces is one token, as XLA reads it: no false warning
    quoted = dr.check_xla_flags(_facts(env={"XLA_FLAGS": f"--xla_gpu_cuda_data_dir='{tmp_path}'"}))
    assert quoted.status == "ok", quoted
    # not an XLA flag at all: XLA aborts
    foreign = dr.check_xla_flags(_facts(env={"XLA_FLAGS": "--tf_xla_auto_jit=2"}))
    assert foreign.status == "error" and "Unknown flag in XLA_FLAGS" in foreign.detail


def test_unknown_xla_flag_is_found_in_tensorflows_own_library(tmp_path):
    lib = tmp_path / "libtensorflow_framework.so.2"  # a stand-in holding two flag names as C strings
    lib.write_bytes(b"\x7fELF...\0xla_gpu_autotune_level\0xla_dump_to\0...")
    value = "--xla_gpu_autotune_level=0 --xla_gpu_autotun_level=2 --xla_dump_to='/tmp/a b'"
    assert dr.unknown_xla_flags(value, [str(lib)]) == ["xla_gpu_autotun_level"]
    assert dr.unknown_xla_flags(value, [str(tmp_path / "missing.so")]) is None
    f = dr.check_xla_flags(_facts(env={"XLA_FLAGS": value}, xla_unknown_flags=["xla_gpu_autotun_level"]))
    assert f.status == "error" and "--xla_gpu_autotun_level" in f.detail
    assert "--xla_gpu_autotune_level=0" not in f.detail.split("not defined")[0]
    if dr_xla_flags._tf_library_paths():  # the real TensorFlow here: its XLA knows autotune_level, not the typo
        assert dr.unknown_xla_flags(value, dr_xla_flags._tf_library_paths()) == ["xla_gpu_autotun_level"]


@pytest.mark.parametrize("env,status,needle", [
    ({}, "ok", "No NCCL_* variables set."),
    ({"NCCL_DEBUG": "INFO"}, "ok", "NCCL_DEBUG=INFO"),
    ({"NCCL_P2P_DISABLE": "1"}, "warn", "peer-to-peer"),
    ({"NCCL_IB_DISABLE": "1"}, "warn", "InfiniBand"),
    ({"NCCL_P2P_DISABLE": "0"}, "ok", "NCCL_P2P_DISABLE=0"),
    ({"NCCL_SOCKET_IFNAME": "ib0"}, "warn", "matches no interface"),
    ({"NCCL_SOCKET_IFNAME": "eth"}, "ok", "eth"),  # prefix match
    ({"NCCL_SOCKET_IFNAME": "=eth"}, "warn", "matches no interface"),  # exact match wanted
    ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, "ok", "^docker"),  # exclusion list: not checked
    ({"NCCL_DEBUG": "TRACE"}, "warn", "TRACE"),
    ({"NCCL_P2P_LEVEL": "LOC"}, "warn", "silently off"),
    ({"NCCL_P2P_LEVEL": "NVL"}, "ok", "NCCL_P2P_LEVEL=NVL"),
])
def test_nccl_env(env, status, needle):
    f = dr.check_nccl_env(_facts(env=env, net_interfaces=["eth0", "lo"]))
    assert f.status == status and needle in f.detail, f
    if not env:
        assert "NCCL_DEBUG=INFO" in f.fix


def test_nccl_conf_files_are_read_and_the_environment_wins(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "nccl.conf").write_text("# site defaults\nNCCL_P2P_LEVEL=LOC\nNCCL_IB_DISABLE = 1\n")
    conf = dr_env_vars._read_nccl_conf({"HOME": "/nonexistent"}, root=str(tmp_path))
    assert conf == {"NCCL_IB_DISABLE": ("1", "/etc/nccl.conf"), "NCCL_P2P_LEVEL": ("LOC", "/etc/nccl.conf")}
    f = dr.check_nccl_env(_facts(nccl_conf=conf))
    assert f.status == "warn" and "NCCL_P2P_LEVEL=LOC (from /etc/nccl.conf)" in f.detail and "InfiniBand" in f.detail
    _write(tmp_path, "/home/u/.nccl.conf", "NCCL_DEBUG=TRACE\n")  # the user's file, read after /etc/nccl.conf
    assert dr_env_vars._read_nccl_conf({"HOME": "/home/u"}, root=str(tmp_path))["NCCL_DEBUG"] == ("TRACE", "/home/u/.nccl.conf")
    env = {"NCCL_P2P_LEVEL": "NVL", "NCCL_IB_DISABLE": "0", "HOME": "/nonexistent"}
    overridden = dr_env_vars._read_nccl_conf(env, root=str(tmp_path))
    assert dr.check_nccl_env(_facts(env=env, nccl_conf=overridden)).status == "ok"


def _cfg(cluster, task_type="worker", index=0):
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("raw,needle", [
    ("{bad json", "not valid JSON"),
    ('{"task": {"type": "worker", "index": 0}}', "no \"cluster\""),
    ('{"cluster": {"worker": ["localhost:1234"]}}', "no \"task\""),
    ('{"cluster": {"worker": ["localhost:1234"]}, "task": {"type": "chief", "index": 0}}', "'chief' is not in"),
    ('{"cluster": {"worker": ["localhost:1234"]}, "task": {"type": "worker", "index": 1}}', "outside the cluster"),
    ('{"cluster": {"worker": ["localhost:1234"]}, "task": {"type": "worker", "index": "a"}}', "not an integer"),
    ('{"cluster": {"worker": ["localhost"]}, "task": {"type": "worker", "index": 0}}', "not host:port"),
    ('{"cluster": {"worker": ["localhost:70000"]}, "task": {"type": "worker", "index": 0}}', "not host:port"),
    ('{"cluster": {"worker": ["localhost:5000", "localhost:5000"]}, "task": {"type": "worker", "index": 0}}',
     "same address twice"),
])
def test_tf_config_errors(raw, needle):
    f = dr.check_tf_config(_facts(env={"TF_CONFIG": raw}))
    assert f.status == "error" and needle in f.detail, f
    assert "keras-scale launch" in f.fix


def test_tf_config_unresolvable_host():
    def resolve(host):
        if host == "node-that-does-not-exist":
            raise socket.gaierror(-2, "Name or service not known")
        return ["127.0.0.1"]

    f = dr.check_tf_config(_facts(env=_cfg({"worker": ["localhost:1111", "node-that-does-not-exist:2222"]})),
                           resolve=resolve)
    assert f.status == "error" and "'node-that-does-not-exist' does not resolve" in f.detail


def test_tf_config_port_in_use_free_and_foreign_address():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        f = dr.check_tf_config(_facts(env=_cfg({"worker": [f"127.0.0.1:{port}", "127.0.0.1:1"]})))
        assert f.status == "warn" and f"port {port} is already in use" in f.detail
    free = _free_port()
    ok = dr.check_tf_config(_facts(env=_cfg({"chief": [f"localhost:{free}"], "worker": ["localhost:1"]},
                                            task_type="chief")))
    assert ok.status == "ok" and "this is chief:0" in ok.detail and f"port {free} free" in ok.detail
    foreign = dr.check_tf_config(_facts(env=_cfg({"worker": ["10.255.0.7:2222", "localhost:1"]})),
                                 resolve=lambda h: [h] if h[0].isdigit() else ["127.0.0.1"])
    assert foreign.status == "warn" and "not an address of this machine" in foreign.detail
    assert dr.check_tf_config(_facts()).status == "ok"


# -------------------------------------------------------------------------------- report, exit, table
def test_a_crashing_check_becomes_an_error_finding_not_a_crash():
    def check_boom(facts):
        raise KeyError("oops")

    (f,) = dr.run_checks(Facts(), [check_boom])
    assert f.status == "error" and f.name == "boom" and "KeyError" in f.detail


def _assert_schema(rep):
    assert set(rep) >= {"python", "tensorflow", "keras", "gpus", "checks"}
    assert isinstance(rep["gpus"], list)
    names = [c["name"] for c in rep["checks"]]
    assert len(names) == len(set(names)) == len(dr.CHECKS)
    for c in rep["checks"]:
        assert set(c) == {"name", "status", "detail", "fix"}
        assert c["status"] in dr.STATUSES and c["detail"]
    json.dumps(rep)  # JSON-serialisable


def test_report_with_fake_nvml_gpus_and_leftover_process(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvml.with_gpus(2, processes={1: [GpuProcess(1, 999999, "python stale.py", 4096.0)]})
    rep = dr.doctor(nvml=fake, probe_tensorflow=False)
    _assert_schema(rep)
    assert [g["index"] for g in rep["gpus"]] == [0, 1] and all(g["visible"] for g in rep["gpus"])
    assert rep["nvidia_driver"] == "550.54.15"
    by = {c["name"]: c for c in rep["checks"]}
    assert by["gpu_processes"]["status"] == "warn" and "pid 999999" in by["gpu_processes"]["detail"]
    assert "CUDA_VISIBLE_DEVICES=0" in by["gpu_processes"]["fix"]
    assert by["nvidia_driver"]["status"] == "ok" and by["throttling"]["status"] == "ok"
    assert by["tensorflow"]["status"] == "skip"
    assert fake.closed is False  # passed in: the caller closes it


def test_exit_code_and_text_table(monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", "{not json")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert dr.cli(["--no-tensorflow"]) == 1  # an error
    out = capsys.readouterr().out
    assert out.startswith("keras-scale doctor")
    lines = out.splitlines()
    assert any(ln.split()[:2] == ["ERROR", "tf_config"] for ln in lines)
    assert any(ln.split()[:2] == ["WARN", "nccl_env"] for ln in lines)
    assert any("fix:" in ln for ln in lines)
    assert "1 error(s)" in out
    for check in dr.CHECKS:
        assert check.__name__.replace("check_", "") in out or check is dr.check_driver_cuda
    monkeypatch.delenv("TF_CONFIG")
    assert dr.cli(["--no-tensorflow"]) == 0  # warnings alone do not fail
    capsys.readouterr()
    assert dr.exit_code({"checks": [{"status": "skip"}, {"status": "ok"}]}) == 0


def test_real_doctor_on_this_machine_in_process():
    rep = dr.doctor()
    _assert_schema(rep)
    import tensorflow as tf

    assert rep["tensorflow"] == tf.__version__ and rep["keras"]
    by = {c["name"]: c for c in rep["checks"]}
    assert by["placement"]["status"] == "ok"
    assert dr.exit_code(rep) == 0, [c for c in rep["checks"] if c["status"] == "error"]
    if not rep["gpus"]:
        assert by["nvidia_driver"]["detail"].startswith("No GPU present")
        assert by["gpu_visibility"]["detail"].startswith("No GPU present")
        assert "GPUs: none. No GPU present" in dr.format_report(rep)


@pytest.mark.slow
def test_cli_json_subprocess_exit_zero_here():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "keras_scale", "doctor", "--json"], capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT, env=env)
    rep = json.loads(proc.stdout)  # stdout is pure JSON
    _assert_schema(rep)
    assert proc.returncode == dr.exit_code(rep) == 0, rep["checks"]
    if not rep["gpus"]:
        assert rep["nvidia_driver"] is None


_NO_TF_SITE = '''
import importlib.machinery
_orig = importlib.machinery.PathFinder.find_spec.__func__
def _find_spec(cls, name, path=None, target=None):
    if name.split(".")[0] in ("tensorflow", "keras", "tf_keras"):
        return None
    return _orig(cls, name, path, target)
importlib.machinery.PathFinder.find_spec = classmethod(_find_spec)
'''


def test_doctor_without_tensorflow_reports_it_missing_and_goes_on(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_NO_TF_SITE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO_ROOT]))
    env.pop("TF_CONFIG", None)
    check = subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True, text=True, env=env)
    assert "No module named 'tensorflow'" in check.stderr  # the simulation works
    proc = subprocess.run([sys.executable, "-m", "keras_scale", "doctor", "--json"], capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    _assert_schema(rep)
    by = {c["name"]: c for c in rep["checks"]}
    assert rep["tensorflow"] is None and by["tensorflow"]["status"] == "warn"
    assert "not installed" in by["tensorflow"]["detail"]
    assert by["placement"]["status"] == "skip"
    assert by["nvidia_driver"]["status"] in ("ok", "skip")  # the NVML checks still ran
    if not rep["gpus"]:
        assert by["nvidia_driver"]["detail"].startswith("No GPU present")


def test_keras_scale_doctor_is_callable_however_it_was_imported():
    # importing the module (as `keras-scale doctor` does) binds keras_scale.doctor to the module; it must still
    # be the function users call
    importlib.import_module("keras_scale.doctor")
    rep = keras_scale.doctor(probe_tensorflow=False)
    assert set(rep) >= {"python", "gpus", "checks"}


# ------------------------------------------------------------------------- versions and the CUDA stack
def test_versions_below_the_declared_floor_from_installed_metadata():
    reqs = ["tensorflow>=2.16", "keras>=3.8", "numpy", 'matplotlib; extra == "plot"', "pytest>=9; extra == 'test'"]
    low = dr.check_versions(_facts(requirements=reqs, installed={"tensorflow": "2.21.0", "keras": "3.5.0"}))
    assert low.status == "error" and "keras 3.5.0 is below keras_scale's floor 3.8" in low.detail
    assert low.fix == "pip install 'keras>=3.8'"
    cpu = dr.check_versions(_facts(requirements=reqs, installed={"tensorflow-cpu": "2.15.1", "keras": "3.15.1"}))
    assert cpu.status == "error" and "tensorflow-cpu 2.15.1" in cpu.detail  # the CPU wheel counts as tensorflow
    ok = dr.check_versions(_facts(requirements=reqs, installed={"tensorflow": "2.21.0", "keras": "3.15.1"}))
    assert ok.status == "ok" and "keras 3.15.1 (needs >= 3.8)" in ok.detail and "pytest" not in ok.detail
    assert dr.check_versions(_facts(requirements=None)).status == "skip"
    # the floors come from the installed distribution's metadata (pyproject.toml is the one source)
    assert dr_versions._requirements() is None or "tensorflow" in dr_versions._floors(_facts(requirements=dr_versions._requirements()))


def _health(**kw):
    from keras_scale.nvml import GpuHealth

    base = dict(compute_capability=(8, 0), ecc_uncorrected_volatile=0, pages_pending=False, row_remap_failed=False,
                persistence_mode=True, compute_mode="Default", pcie_gen=4, pcie_gen_max=4, pcie_gen_gpu_max=4,
                pcie_width=16, pcie_width_max=16, power_limit_w=300.0, power_default_limit_w=300.0, mig_mode=False)
    base.update(kw)
    return GpuHealth(index=kw.pop("index", 0), **{k: v for k, v in base.items() if k != "index"})


TF_221_ARCHS = ["sm_60", "sm_70", "sm_80", "sm_89", "compute_90"]


@pytest.mark.parametrize("cc,driver,status,needle", [
    ((8, 0), "555.42.06", "ok", "native kernels"),
    ((8, 6), "555.42.06", "ok", "native kernels"),  # sm_80 binaries run on 8.6
    ((9, 0), "555.42.06", "ok", "PTX JIT"),  # Hopper: compute_90 PTX, driver can compile CUDA 12.5.1 PTX
    ((9, 0), "535.104.05", "error", "UNSUPPORTED_PTX_VERSION"),  # R535 cannot compile 12.5 PTX
    ((9, 0), "550.54.15", "error", "UNSUPPORTED_PTX_VERSION"),  # R550 (CUDA 12.4) cannot either
    ((9, 0), "555.42.02", "ok", "PTX JIT"),  # 12.5 GA's driver: 12.5 and 12.5.1 both emit PTX ISA 8.5
    ((12, 0), "575.51.03", "error", "Blackwell"),
    ((10, 0), "575.51.03", "error", "Blackwell"),
    ((5, 2), "555.42.06", "error", "older than every kernel"),
])
def test_compute_capability_against_the_wheels_kernels(cc, driver, status, needle):
    tf = _tf(build={"cuda_version": "12.5.1", "cudnn_version": "9", "is_cuda_build": True,
                    "cuda_compute_capabilities": TF_221_ARCHS})
    f = dr.check_compute_capability(_facts(num_gpus=1, tf=tf, driver_version=driver,
                                           health={0: _health(compute_capability=cc)}))
    assert f.status == status and needle in f.detail, f
    assert "sm_89, compute_90" in f.detail
    if status == "error" and cc == (9, 0):
        assert "Upgrade the NVIDIA driver to >= 555.42.02" in f.fix and "No driver helps" not in f.fix
    elif status == "error":  # the wheel has no kernels for it: a driver upgrade is no fix
        assert "No driver helps" in f.fix and "Upgrade the NVIDIA driver" not in f.fix, f.fix
        assert f"TF_CUDA_COMPUTE_CAPABILITIES={cc[0]}.{cc[1]}" in f.fix


def test_compute_capability_skips_without_gpu_tf_or_arch_list():
    assert dr.check_compute_capability(_facts()).status == "skip"
    assert dr.check_compute_capability(_facts(num_gpus=1, health={0: _health()})).status == "skip"  # no arch list


@pytest.mark.parametrize("wheels,cuda_max,status,needle", [
    (["nvidia-cuda-runtime-cu12==12.5.82", "nvidia-cublas-cu12==12.5.3.2", "nvidia-cuda-nvcc-cu12==12.5.82"],
     (12, 5), "ok", "within the driver's CUDA 12.5"),
    (["nvidia-cuda-runtime-cu12==12.9.79", "nvidia-cuda-nvcc-cu12==12.9.86", "nvidia-cudnn-cu12==9.10.2.21"],
     (12, 4), "warn", "older than the PTX compiler"),
    (["nvidia-cuda-runtime-cu13==13.0.88"], (12, 8), "error", "needs a CUDA 13 driver"),
    (["nvidia-cudnn-cu12==9.3.0.75"], (12, 5), "ok", ""),
])
def test_cuda_wheels_against_the_driver(wheels, cuda_max, status, needle):
    f = dr.check_cuda_wheels(_facts(num_gpus=1, pip_nvidia_packages=wheels, cuda_driver_version=cuda_max))
    if wheels == ["nvidia-cudnn-cu12==9.3.0.75"]:
        assert f.status == "skip"  # no runtime/cuBLAS/nvcc wheel to compare
        return
    assert f.status == status and needle in f.detail, f
    if status != "ok":
        assert "driver" in f.fix
    assert dr.check_cuda_wheels(_facts(pip_nvidia_packages=wheels, cuda_driver_version=None)).status == "skip"


# ------------------------------------------------------------------------------------ GPU state (NVML)
def test_mig_mode_reported_and_which_instance_is_used():
    gpus = [GpuInfo(0, "NVIDIA A100", "GPU-aaaa", 40960.0, mig_uuids=("MIG-1111", "MIG-2222"))]
    unset = dr.check_mig(_facts(num_gpus=1, gpus=gpus, health={0: _health(mig_mode=True)}))
    assert unset.status == "warn" and "2 MIG instance(s)" in unset.detail and "MIG-<uuid>" in unset.fix
    one = dr.check_mig(_facts(num_gpus=1, gpus=gpus, env={"CUDA_VISIBLE_DEVICES": "MIG-2222"}))
    assert one.status == "ok" and "MIG-2222" in one.detail
    two = dr.check_mig(_facts(num_gpus=1, gpus=gpus, env={"CUDA_VISIBLE_DEVICES": "MIG-1111,MIG-2222"}))
    assert two.status == "warn" and "only the first" in two.detail
    assert dr.check_mig(_facts(num_gpus=1, health={0: _health()})).status == "ok"
    assert dr.check_mig(_facts()).status == "skip"


def test_gpu_memory_errors():
    bad = dr.check_gpu_memory_errors(_facts(num_gpus=2, health={0: _health(), 1: _health(ecc_uncorrected_volatile=3)}))
    assert bad.status == "error" and "GPU 1: 3 uncorrectable" in bad.detail and "GPU 0" not in bad.detail
    pending = dr.check_gpu_memory_errors(_facts(num_gpus=1, health={0: _health(pages_pending=True)}))
    assert pending.status == "warn" and "nvidia-smi -r" in pending.fix
    assert dr.check_gpu_memory_errors(_facts(num_gpus=1, health={0: _health(row_remap_failed=True)})).status == "error"
    assert dr.check_gpu_memory_errors(_facts(num_gpus=1, health={0: _health()})).status == "ok"
    assert dr.check_gpu_memory_errors(_facts(num_gpus=1)).status == "skip"  # NVML gave no state


def test_gpu_modes():
    ex = dr.check_gpu_modes(_facts(num_gpus=2, health={0: _health(), 1: _health(compute_mode="Exclusive_Process")}))
    assert ex.status == "warn" and "GPU(s) [1]" in ex.detail and "busy or unavailable" in ex.detail
    assert dr.check_gpu_modes(_facts(num_gpus=1, health={0: _health(compute_mode="Prohibited")})).status == "error"
    off = dr.check_gpu_modes(_facts(num_gpus=1, health={0: _health(persistence_mode=False)}))
    assert off.status == "ok" and "Persistence mode off" in off.detail and "nvidia-smi -pm 1" in off.fix


def test_pcie_link_width_and_slot_generation():
    x4 = dr.check_pcie_link(_facts(num_gpus=2, health={0: _health(), 1: _health(pcie_width=4)}))
    assert x4.status == "warn" and "GPU 1 links at x4 of x16" in x4.detail and "GPU 0 links" not in x4.detail
    slot = dr.check_pcie_link(_facts(num_gpus=1, health={0: _health(pcie_gen_max=3, pcie_gen_gpu_max=4)}))
    assert slot.status == "warn" and "slot allows gen 3" in slot.detail
    idle = dr.check_pcie_link(_facts(num_gpus=1, health={0: _health(pcie_gen=1)}))  # idle downshift is normal
    assert idle.status == "ok" and "gen 1/4 x16/x16" in idle.detail
    assert dr.check_pcie_link(_facts(num_gpus=1, health={0: _health(pcie_width=None)})).status == "skip"


def test_power_limit_below_default():
    low = dr.check_power_limit(_facts(num_gpus=1, health={0: _health(power_limit_w=200.0)}))
    assert low.status == "warn" and "200 W of its default 300 W" in low.detail and "nvidia-smi -pl" in low.fix
    assert dr.check_power_limit(_facts(num_gpus=1, health={0: _health(power_limit_w=290.0)})).status == "ok"


def test_gpu_topology_p2p_and_nvlink():
    from keras_scale.nvml import GpuLink

    links = [GpuLink(0, 1, p2p=True, nvlinks=4, topology="same board"),
             GpuLink(0, 2, p2p=False, nvlinks=0, topology="across NUMA nodes (SMP interconnect)"),
             GpuLink(1, 2, p2p=True, nvlinks=0, topology="one PCIe switch")]
    f = dr.check_gpu_topology(_facts(num_gpus=3, links=links))
    assert f.status == "warn" and "pair(s) 0-2" in f.detail and "0-1 NVLink x4" in f.detail
    assert "1-2 PCIe (one PCIe switch)" in f.detail and "topo" in f.fix
    assert dr.check_gpu_topology(_facts(num_gpus=2, links=links[:1])).status == "ok"
    assert dr.check_gpu_topology(_facts(num_gpus=1)).status == "skip"


# ---------------------------------------------------------------------------------------------- the host
def _write(root, path, text):
    full = root / path.lstrip("/")
    full.parent.mkdir(parents=True, exist_ok=True)
    full.write_text(text)


def _fake_host_tree(root, shm_size="65536k", rotational="1", cpus=8, nodes=2):
    """A fabricated /proc and /sys: `cpus` logical CPUs as cpus/2 cores (2 threads each), 2 NUMA nodes, a GPU
    on each node, a data disk, a docker-sized /dev/shm, an NFS mount."""
    per = cpus // nodes
    for cpu in range(cpus):
        _write(root, f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id", str(cpu // per))
        _write(root, f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id", str((cpu % per) // 2))
    for n in range(nodes):
        _write(root, f"/sys/devices/system/node/node{n}/cpulist", f"{n * per}-{n * per + per - 1}")
    _write(root, "/proc/meminfo", "MemTotal:       33554432 kB\nMemFree:         1000 kB\n")
    _write(root, "/sys/bus/pci/devices/0000:01:00.0/numa_node", "0")
    _write(root, "/sys/bus/pci/devices/0000:02:00.0/numa_node", "1")
    _write(root, "/sys/class/block/sdb/queue/rotational", rotational)
    _write(root, "/sys/class/block/nvme0n1/queue/rotational", "0")
    _write(root, "/proc/mounts", "\n".join([
        "overlay / overlay rw,relatime 0 0",
        f"shm /dev/shm tmpfs rw,nosuid,nodev,noexec,relatime,size={shm_size} 0 0",
        "/dev/sdb1 /data ext4 rw,relatime 0 0",
        "/dev/nvme0n1p2 /scratch xfs rw 0 0",
        "server:/export /nfs nfs4 rw,vers=4.2 0 0",
        "/dev/vda1 /vm ext4 rw 0 0"]) + "\n")
    _write(root, "/sys/class/block/vda/queue/rotational", "1")  # virtio says 1 whatever backs it
    for d in ("data/train", "scratch", "nfs/x", "etc", "vm/d"):  # the data/checkpoint paths exist in the tree
        (root / d).mkdir(parents=True, exist_ok=True)


def test_gather_host_facts_from_a_fabricated_tree(tmp_path):
    _fake_host_tree(tmp_path)
    gpus = [GpuInfo(0, "G", "GPU-0", 81920.0, "00000000:01:00.0"),
            GpuInfo(1, "G", "GPU-1", 81920.0, "00000000:02:00.0")]
    host = dr.gather_host_facts(root=str(tmp_path), paths=["/data/train", "/scratch", "/nfs/x", "/etc", "/vm/d"],
                                gpus=gpus, affinity=[0, 1, 2, 3], memlock_bytes=64 * 1024)
    assert host.usable_cpus == 4 and host.physical_cores == 2  # 4 hyperthreads on node 0 = 2 cores
    assert host.ram_mb == 32768.0 and host.shm_mb == 64.0
    assert host.gpu_numa_nodes == {0: 0, 1: 1} and host.affinity_nodes == [0]
    assert [s["kind"] for s in host.storage] == ["hdd", "nvme", "network", "container", "virtual"]
    assert host.memlock_bytes == 64 * 1024 and host.infiniband == []
    _write(tmp_path, "/sys/fs/cgroup/cpu.max", "100000 100000")  # a 1-CPU container quota
    _write(tmp_path, "/sys/fs/cgroup/memory.max", str(8 * 2 ** 30))
    (tmp_path / "sys/class/infiniband/mlx5_0").mkdir(parents=True)
    capped = dr.gather_host_facts(root=str(tmp_path), gpus=gpus, affinity=list(range(8)), memlock_bytes=None)
    assert capped.usable_cpus == 1 and capped.physical_cores == 1 and capped.ram_mb == 8192.0
    assert capped.infiniband == ["mlx5_0"] and capped.memlock_bytes is None


def test_host_checks_on_fabricated_host_facts(tmp_path):
    _fake_host_tree(tmp_path)
    gpus = [GpuInfo(0, "G", "GPU-0", 81920.0, "00000000:01:00.0"),
            GpuInfo(1, "G", "GPU-1", 81920.0, "00000000:02:00.0")]
    host = dr.gather_host_facts(root=str(tmp_path), paths=["/data", "/nfs/x"], gpus=gpus, affinity=[0, 1, 2, 3],
                                memlock_bytes=64 * 1024)
    f = _facts(num_gpus=2, gpus=gpus, host=host)
    cpu = dr.check_cpu_per_gpu(f)
    assert cpu.status == "warn" and "2 physical cores usable (4 logical CPUs) for 2 GPU(s): 1.0 per GPU" in cpu.detail
    mem = dr.check_host_memory(f)
    assert mem.status == "warn" and "32 GiB RAM for 160 GiB of GPU memory" in mem.detail
    numa = dr.check_numa(f)
    assert numa.status == "warn" and "GPU(s) [1] are fed across sockets" in numa.detail and "numactl" in numa.fix
    storage = dr.check_storage(f)
    assert storage.status == "warn" and "/data is on a spinning disk" in storage.detail and "nfs4" in storage.detail
    shm = dr.check_shm(f)
    assert shm.status == "warn" and "64 MiB with 2 GPUs" in shm.detail and "--shm-size" in shm.fix
    assert dr.check_memlock(f).status == "ok"  # no InfiniBand: the limit does not matter
    ib = dataclasses.replace(host, infiniband=["mlx5_0"])
    lock = dr.check_memlock(_facts(num_gpus=2, gpus=gpus, host=ib))
    assert lock.status == "warn" and "ulimit -l 64 KiB" in lock.detail and "unlimited" in lock.fix
    # a roomy host: all fine
    (tmp_path / "sys/class/block/sdb/queue/rotational").write_text("0")
    good = dr.gather_host_facts(root=str(tmp_path), paths=["/scratch"], gpus=gpus[:1], affinity=list(range(8)))
    g = _facts(num_gpus=1, gpus=gpus[:1], host=dataclasses.replace(good, ram_mb=512000.0, physical_cores=8))
    for check in (dr.check_cpu_per_gpu, dr.check_host_memory, dr.check_numa, dr.check_storage, dr.check_shm):
        assert check(g).status == "ok", check(g)
    for check in (dr.check_cpu_per_gpu, dr.check_host_memory, dr.check_numa):
        assert check(_facts(host=good)).status == "skip"  # no GPU: nothing to feed


def test_report_from_fake_nvml_flags_sick_gpus_end_to_end(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _fake_host_tree(tmp_path)
    fake = FakeNvml.with_gpus(2, health={1: dict(pcie_width=4, ecc_uncorrected_volatile=1,
                                                 compute_mode="Exclusive_Process", power_limit_w=150.0)},
                              links={(0, 1): dict(p2p=False)})
    rep = dr.doctor(nvml=fake, probe_tensorflow=False, root=str(tmp_path), paths=["/data"])
    _assert_schema(rep)
    by = {c["name"]: c for c in rep["checks"]}
    assert by["pcie_link"]["status"] == "warn" and "GPU 1 links at x4" in by["pcie_link"]["detail"]
    assert by["gpu_memory_errors"]["status"] == "error" and by["gpu_modes"]["status"] == "warn"
    assert by["power_limit"]["status"] == "warn" and by["gpu_topology"]["status"] == "warn"
    assert by["storage"]["status"] == "warn" and by["shm"]["status"] == "warn"
    assert by["compute_capability"]["status"] == "skip"  # TensorFlow not probed


def test_probe_result_keeps_the_stages_before_a_crash():
    partial = dict(TF_OK, stage="jit_compile on /device:GPU:0")
    out = dr_probe._probe_result(dr_probe._PROBE_MARK + json.dumps(partial) + "\n", "F0000 Unknown flags in XLA_FLAGS: --xla_x\n",
                           -6)
    assert out["crashed"] and "code -6 at: jit_compile on /device:GPU:0" in out["error"]
    assert out["tensorflow"] == "2.21.0" and out["log_hints"] == ["F0000 Unknown flags in XLA_FLAGS: --xla_x"]
    done = dr_probe._probe_result(dr_probe._PROBE_MARK + json.dumps(dict(TF_OK, stage="done")) + "\n", "", 0)
    assert not done.get("crashed")
    hung = dr_probe._probe_result("", "", None, timed_out_s=180.0)
    assert hung["tensorflow"] is None and "did not finish within 180 s (hung at: start-up)" in hung["error"]


def test_strict_width_and_header_without_tensorflow(monkeypatch, capsys):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("COLUMNS", "72")
    assert dr.cli(["--no-tensorflow", "-q"]) == 0
    assert dr.cli(["--no-tensorflow", "--strict", "-q"]) == 1  # the warning fails CI
    out = capsys.readouterr().out
    assert max(len(ln) for ln in out.splitlines()) <= 72
    header = out.splitlines()[2]
    assert "not installed" not in header and "(not probed)" in header  # TensorFlow is installed here


def test_progress_on_stderr_and_path_option(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert dr.cli(["--no-tensorflow", "--json", "--path", str(tmp_path)]) in (0, 1)
    captured = capsys.readouterr()
    rep = json.loads(captured.out)  # stdout stays pure JSON
    storage = next(c for c in rep["checks"] if c["name"] == "storage")
    assert str(tmp_path) in storage["detail"]
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("keras-scale doctor [")]
    assert any("reading the GPUs through NVML" in ln for ln in lines)
    assert any("reading the host" in ln for ln in lines)


def test_progress_rewrites_one_line_on_a_terminal():
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    progress = dr_command._Progress(stream)
    progress("reading the GPUs")
    progress("reading the host")
    progress.done()
    text = stream.getvalue()
    assert "\n" not in text and text.count("\r\033[K") == 3 and "reading the host" in text


def test_a_gpu_nvml_fails_on_costs_only_its_own_state(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvml.with_gpus(2, health={1: dict(pcie_width=4)})
    real_health = fake.health

    def health(index):
        if index == 0:
            raise RuntimeError("fake NVML: GPU 0 fell off the bus")
        return real_health(index)

    monkeypatch.setattr(fake, "health", health)  # the fake's own method, not the world
    facts = dr.gather_facts(nvml=fake, probe_tensorflow=False)
    assert sorted(facts.health) == [1] and facts.nvml_error is None and len(facts.samples) == 2
    assert "GPU 1 links at x4" in dr.check_pcie_link(facts).detail


# ------------------------------------------------------------------- findings of the second break-it round
@pytest.mark.parametrize("files,self_cgroup,mem_gib,cpus,source", [
    # docker on a cgroup-v1 host: the container's own cgroup is mounted at each controller's root
    ({"/sys/fs/cgroup/memory/memory.limit_in_bytes": str(16 * 2 ** 30),
      "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "200000",
      "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000"},
     "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n", 16, 2, "/sys/fs/cgroup/memory/memory.limit_in_bytes"),
    # a Slurm job on a cgroup-v2 host, not namespaced: the limits sit in the job's cgroup, a parent is tighter
    ({"/sys/fs/cgroup/system.slice/slurmstepd.scope/job_42/memory.max": str(16 * 2 ** 30),
      "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_42/cpu.max": "max 100000",
      "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_42/step_0/cpu.max": "300000 100000",
      "/sys/fs/cgroup/system.slice/slurmstepd.scope/memory.max": str(64 * 2 ** 30)},
     "0::/system.slice/slurmstepd.scope/job_42/step_0\n", 16, 3,
     "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_42/memory.max"),
    # v1 "unlimited" and a v2 "max" are no limits
    ({"/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712", "/sys/fs/cgroup/cpu.max": "max 100000"},
     "", 32, 8, None),
])
def test_cgroup_limits_deep_in_the_tree_and_v1_are_found(tmp_path, files, self_cgroup, mem_gib, cpus, source):
    _fake_host_tree(tmp_path, nodes=1)  # 8 logical CPUs, 4 cores, 32 GiB
    _write(tmp_path, "/proc/self/cgroup", self_cgroup)
    for path, text in files.items():
        _write(tmp_path, path, text)
    gpus = [GpuInfo(0, "G", "GPU-0", 81920.0, "00000000:01:00.0")]
    host = dr.gather_host_facts(root=str(tmp_path), gpus=gpus, affinity=list(range(8)), memlock_bytes=None)
    assert host.ram_mb == mem_gib * 1024.0 and host.usable_cpus == cpus and host.ram_limit_from == source
    f = _facts(num_gpus=1, gpus=gpus, host=host)
    mem, cpu = dr.check_host_memory(f), dr.check_cpu_per_gpu(f)
    if source:
        assert mem.status == "warn" and source in mem.detail and f"{mem_gib} GiB RAM" in mem.detail
        assert cpu.status == "warn" and "cgroup CPU quota" in cpu.detail


@pytest.mark.parametrize("env,needle", [
    ({"TF_XLA_FLAGS": "tf_xla_auto_jit=2"}, "reads it as the name of a file"),  # no leading --: a flags file
    ({"XLA_FLAGS": "xla_gpu_autotune_level=0"}, "reads it as the name of a file"),
    ({"XLA_FLAGS": "-xla_gpu_autotune_level=0"}, "single dash"),
    ({"XLA_FLAGS": "--xla_gpu_autotune_level=0 xla_hlo_profile"}, "'xla_hlo_profile' is not a --flag"),
    ({"TF_XLA_FLAGS": "--tf_xla_auto_jit"}, "takes a value"),
])
def test_xla_flags_that_make_tensorflow_abort_are_errors_without_tensorflow(env, needle):
    f = dr.check_xla_flags(_facts(tf={}, env=env))  # --no-tensorflow: no probe to say so
    assert f.status == "error" and needle in f.detail, f


def test_xla_flags_from_a_file_and_unknown_tf_xla_flags(tmp_path):
    flags = tmp_path / "xla.flags"
    flags.write_text("--xla_gpu_autotune_level=2\n")
    assert dr.check_xla_flags(_facts(env={"XLA_FLAGS": str(flags)})).status == "ok"  # a real flags file
    typo = dr.check_xla_flags(_facts(env={"TF_XLA_FLAGS": "--tf_xla_nonsense=1"},
                                     tf_xla_unknown_flags=["tf_xla_nonsense"]))
    assert typo.status == "error" and "--tf_xla_nonsense" in typo.detail and "TF_XLA_FLAGS" in typo.detail
    lib = tmp_path / "libtensorflow_cc.so.2"
    lib.write_bytes(b"\x7fELF\0tf_xla_auto_jit\0tf_xla_cpu_global_jit\0")
    value = "--tf_xla_auto_jit=2 --tf_xla_auto --tf_xla_cpu_global_jit"
    assert dr.unknown_xla_flags(value, [str(lib)], whole_word=True) == ["tf_xla_auto"]  # a prefix is not the name
    if dr_xla_flags._tf_library_paths("libtensorflow_cc.so"):  # the real TensorFlow here
        real = dr_xla_flags._tf_library_paths("libtensorflow_cc.so")
        assert dr.unknown_xla_flags("--tf_xla_nonsense=1 --tf_xla_auto_jit=2", real, whole_word=True) == [
            "tf_xla_nonsense"]


def test_numeric_xla_flag_without_value_read_from_the_flag_descriptor(tmp_path):
    # FieldDescriptorProto bytes as protoc embeds them: name, number 123, label optional, type (5 int32 / 8 bool)
    lib = tmp_path / "libtensorflow_framework.so.2"
    lib.write_bytes(b"\0\n\x16xla_gpu_autotune_level\x18{ \x01(\x05H\0\n\x0fxla_hlo_profile\x18\t \x01(\x08H\0")
    kinds = dr.xla_flag_kinds(["xla_gpu_autotune_level", "xla_hlo_profile", "xla_nope"], [str(lib)])
    assert kinds == {"xla_gpu_autotune_level": "integer", "xla_hlo_profile": "bool"}
    bare = dr.check_xla_flags(_facts(tf={}, env={"XLA_FLAGS": "--xla_gpu_autotune_level --xla_hlo_profile"},
                                     xla_flag_kinds=kinds))
    assert bare.status == "error" and "--xla_gpu_autotune_level takes a value (integer)" in bare.detail
    assert "--xla_hlo_profile" not in bare.detail  # a true/false flag may stand alone
    if dr_xla_flags._tf_library_paths():  # the real XLA of this TensorFlow
        real = dr.xla_flag_kinds(["xla_gpu_autotune_level", "xla_hlo_profile", "xla_dump_to"], dr_xla_flags._tf_library_paths())
        assert real == {"xla_gpu_autotune_level": "integer", "xla_hlo_profile": "bool", "xla_dump_to": "string"}


def _gather(monkeypatch, fake, env, tf=None):
    """The real gathering on a fake NVML with ``env`` as the environment; ``tf``: a probe result to add."""
    for k in list(os.environ):
        if k.startswith(("CUDA_", "NCCL_", "XLA_", "TF_")):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    facts = dr.gather_facts(nvml=fake, probe_tensorflow=False)
    if tf is not None:
        facts.tf = tf
        dr_gather._visible_from_tensorflow(facts)
    return facts, {c.name: c for c in dr.run_checks(facts)}


@pytest.mark.parametrize("cvd", ["", "-1", "8", "MIG-0c0ffee0-dead-beef-0000-000000000000"])
def test_cuda_visible_devices_hiding_every_gpu_is_an_error(monkeypatch, cvd):
    fake = FakeNvml.with_gpus(8)
    facts, by = _gather(monkeypatch, fake, {"CUDA_VISIBLE_DEVICES": cvd}, tf=_tf_with_gpus(0))
    assert facts.visible_gpu_indices == []
    assert by["gpu_visibility"].status == "error", by["gpu_visibility"]
    assert by["placement"].status == "error" and "CPU only" in by["placement"].detail  # not "ok"
    assert dr.exit_code(dr.report(facts)) == 1
    if cvd.startswith("MIG-"):
        assert by["mig"].status == "error" and "no GPU here has" in by["mig"].detail
        assert "no GPU here has" in by["gpu_visibility"].detail
    # without TensorFlow (--no-tensorflow) the same verdict
    facts.tf = {}
    assert dr.check_gpu_visibility(facts).status == "error"


def test_a_lost_gpu_is_named_and_the_others_are_still_checked(monkeypatch):
    fake = FakeNvml.with_gpus(4, lost=[3], health={1: dict(pcie_width=4)})
    facts, by = _gather(monkeypatch, fake, {}, tf=_tf_with_gpus(3))
    assert facts.nvml_error is None and sorted(facts.health) == [0, 1, 2] and 3 in facts.gpu_errors
    lost = by["gpus_responding"]
    assert lost.status == "error" and "GPU 3 does not answer NVML" in lost.detail and "Xid 79" in lost.detail
    assert "other 3 GPU(s)" in lost.detail and "dmesg" in lost.fix
    assert by["nvidia_driver"].status == "ok" and "nvidia-ml-py" not in by["gpu_visibility"].fix
    assert "GPU 1 links at x4" in by["pcie_link"].detail  # the healthy GPUs keep their checks
    # a sample that fails for one GPU (not at devices()) costs only that GPU too
    fake = FakeNvml.with_gpus(2, health={0: dict(pcie_width=8)})
    fake._fail = {1}
    facts, by = _gather(monkeypatch, fake, {})
    assert facts.nvml_error is None and list(facts.gpu_errors) == [1] and by["gpus_responding"].status == "error"
    assert by["pcie_link"].status == "warn" and "GPU 0 links at x8" in by["pcie_link"].detail


def test_nvml_failing_as_a_whole_does_not_advise_installing_nvidia_ml_py():
    f = _facts(num_gpus=0, tf=_tf_with_gpus(2), nvml_error="NVML query failed: GPU is lost", nvml_error_kind="other")
    vis = dr.check_gpu_visibility(f)
    assert vis.status == "warn" and "nvidia-ml-py" not in vis.fix and "nvidia-smi" in vis.fix
    drv = dr.check_nvidia_driver(_facts(num_gpus=0, nvml_error="NVML query failed: NVMLError_GpuIsLost: GPU is lost",
                                        nvml_error_kind="other"))
    assert drv.status == "error" and "Xid 79" in drv.detail and "reinstall" not in drv.fix.replace("no driver re", "")
    f = _facts(num_gpus=0, tf=_tf_with_gpus(2), nvml_error="no pynvml", nvml_error_kind="no_module")
    assert "nvidia-ml-py" in dr.check_gpu_visibility(f).fix


def _mixed_box():
    # NVML numbers by PCI bus: 0 = a GTX 1650 (7.5), 1 = an RTX 5090 (12.0, not supported by the wheel)
    return FakeNvml([GpuInfo(0, "NVIDIA GeForce GTX 1650", "GPU-aaaa", 4096.0, "00000000:17:00.0"),
                     GpuInfo(1, "NVIDIA GeForce RTX 5090", "GPU-bbbb", 32768.0, "00000000:65:00.0")],
                    health={0: dict(compute_capability=(7, 5)), 1: dict(compute_capability=(12, 0))})


def test_cuda_device_order_pci_bus_id_maps_numbers_like_nvidia_smi(monkeypatch):
    facts, by = _gather(monkeypatch, _mixed_box(), {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert facts.visible_gpu_indices == [1] and facts.gpu_order_uncertain is None


def test_cuda_default_order_on_a_mixed_box_is_not_guessed(monkeypatch):
    tf = dict(_tf_with_gpus(1), build=dict(cuda_version="12.5.1", cudnn_version="9", is_cuda_build=True,
                                           cuda_compute_capabilities=TF_221_ARCHS))
    # no TensorFlow view: CUDA's FASTEST_FIRST makes "0" the RTX 5090, not NVML's GPU 0 -> say it is uncertain
    facts, by = _gather(monkeypatch, _mixed_box(), {"CUDA_VISIBLE_DEVICES": "0"})
    assert facts.gpu_order_uncertain and by["gpu_visibility"].status == "warn"
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in by["gpu_visibility"].fix
    assert by["compute_capability"].status == "skip" and "uncertain" in by["compute_capability"].detail
    # TensorFlow logged the PCI bus id of the GPU it got: the RTX 5090, which the wheel cannot run
    tf_log = dr_probe._probe_result(dr_probe._PROBE_MARK + json.dumps(dict(tf, stage="done")) + "\n",
                              "I0000 gpu_device.cc:2020] Created device /job:localhost/replica:0/task:0/device:GPU:0 "
                              "with 31000 MB memory:  -> device: 0, name: NVIDIA GeForce RTX 5090, pci bus id: "
                              "0000:65:00.0, compute capability: 12.0\n", 0)
    assert tf_log["gpu_pci_bus_ids"] == {"0": "0000:65:00.0"}
    facts, by = _gather(monkeypatch, _mixed_box(), {"CUDA_VISIBLE_DEVICES": "0"}, tf=tf_log)
    assert facts.visible_gpu_indices == [1] and facts.gpu_order_uncertain is None
    assert by["compute_capability"].status == "error" and "RTX 5090" in by["compute_capability"].detail
    # one model only: CUDA's order is the PCI order, nothing uncertain
    facts, _ = _gather(monkeypatch, FakeNvml.with_gpus(2), {"CUDA_VISIBLE_DEVICES": "1"})
    assert facts.visible_gpu_indices == [1] and facts.gpu_order_uncertain is None


def test_gpu_processes_ignore_hidden_gpus_and_the_doctors_own_probe(monkeypatch):
    procs = {0: [GpuProcess(0, 31337, "python alice_train.py", 70000.0)],
             2: [GpuProcess(2, 4242, "python old_run.py", 1000.0)]}
    facts, by = _gather(monkeypatch, FakeNvml.with_gpus(4, processes=procs), {"CUDA_VISIBLE_DEVICES": "2,3"})
    p = by["gpu_processes"]
    assert p.status == "warn" and "4242" in p.detail and "31337" not in p.detail and "alice" not in p.fix
    facts, by = _gather(monkeypatch, FakeNvml.with_gpus(4, processes={0: procs[0]}), {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert by["gpu_processes"].status == "ok"  # another user's job on a GPU this job does not use


def test_the_doctors_own_probe_child_is_not_a_leftover_process(tmp_path, monkeypatch):
    """The TensorFlow probe (a child process) holds GPU memory while NVML is read: it is not someone else's job."""
    probe = tmp_path / "probe.py"  # stands in for _tf_probe.py: holds "GPU memory" a moment, then reports
    probe.write_text(f"import json, time\ntime.sleep(1.0)\nprint({dr_probe._PROBE_MARK!r} + json.dumps({json.dumps(TF_OK)!r}"
                     f" and dict(json.loads({json.dumps(TF_OK)!r}), stage='done')))\n")
    monkeypatch.setattr(dr_probe, "_PROBE_SCRIPT", str(probe))

    class ProbeOnGpu(FakeNvml):
        def processes(self, index):  # NVML lists this process's children as GPU users (the probe)
            children = []
            for task in os.listdir(f"/proc/{os.getpid()}/task"):
                text = open(f"/proc/{os.getpid()}/task/{task}/children").read()
                children += [int(p) for p in text.split()]
            return [GpuProcess(index, pid, "python _tf_probe.py", 500.0) for pid in children]

    fake = ProbeOnGpu.with_gpus(2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    facts = dr.gather_facts(nvml=fake, probe_tensorflow=True)
    assert facts.tf.get("stage") == "done"
    assert dr.check_gpu_processes(facts).status == "ok", dr.check_gpu_processes(facts)


def test_cuda_wheel_pins_never_go_below_what_tensorflow_requires():
    newest = ["nvidia-cublas-cu12==12.9.1.4", "nvidia-cuda-nvcc-cu12==12.9.86", "nvidia-cuda-runtime-cu12==12.9.79",
              "nvidia-nvjitlink-cu12==12.9.86", "nvidia-cuda-runtime==13.0.96"]
    floors = {"nvidia-cublas-cu12": "12.5.3.2", "nvidia-cuda-nvcc-cu12": "12.5.82",
              "nvidia-cuda-runtime-cu12": "12.5.82", "nvidia-nvjitlink-cu12": "12.5.82"}
    f = dr.check_cuda_wheels(_facts(num_gpus=1, pip_nvidia_packages=newest, cuda_driver_version=(12, 4),
                                    driver_version="550.54.15", tf_wheel_floors=floors))
    assert f.status == "error" and "nvidia-cuda-runtime==13.0.96" in f.detail  # the un-suffixed CUDA 13 wheel
    for dist, floor in floors.items():  # every wheel it warns about, pinned to TensorFlow's floor, not to 12.4
        assert f"'{dist}=={floor}'" in f.fix, f.fix
    assert "12.4.*" not in f.fix
    # a driver between TensorFlow's floor and the wheels: pin to the driver's CUDA
    g = dr.check_cuda_wheels(_facts(num_gpus=1, pip_nvidia_packages=newest[:4], cuda_driver_version=(12, 6),
                                    driver_version="560.35.03", tf_wheel_floors=floors))
    assert g.status == "warn" and "'nvidia-cuda-nvcc-cu12==12.6.*'" in g.fix and "nvJitLink" in g.detail
    if dr_cuda_libraries._tf_wheel_floors():  # this TensorFlow's own metadata
        assert dr_facts._ver(dr_cuda_libraries._tf_wheel_floors()["nvidia-cuda-nvcc-cu12"]) >= (12, 5)


def test_a_tf_xla_flags_typo_is_blamed_on_the_flag_not_the_install():
    crashed = {"tensorflow": None, "crashed": True, "error": "the TensorFlow probe exited with code 1 at: start-up",
               "log_hints": ["F0000 parse_flags_from_env.cc:234] Unknown flag in TF_XLA_FLAGS: --tf_xla_nonsense=1"]}
    f = _facts(num_gpus=1, tf=crashed, env={"TF_XLA_FLAGS": "--tf_xla_nonsense=1"})
    by = {c.name: c for c in dr.run_checks(f)}
    assert by["xla_flags"].status == "error" and "--tf_xla_nonsense" in by["xla_flags"].detail
    assert by["tensorflow"].status == "error" and "xla_flags" in by["tensorflow"].detail
    assert "einstall" not in by["tensorflow"].fix and "TF_XLA_FLAGS" in by["tensorflow"].fix
    assert by["cuda_libraries"].status != "error" and "einstall" not in by["cuda_libraries"].fix
    # the same crash without a flag to blame: the install is the suspect
    plain = {c.name: c for c in dr.run_checks(_facts(num_gpus=1, tf=dict(crashed, log_hints=[])))}
    assert "einstall" in plain["tensorflow"].fix and plain["cuda_libraries"].status == "error"


def test_storage_of_a_path_that_does_not_exist_is_said_and_other_paths_keep_their_kind(tmp_path):
    _fake_host_tree(tmp_path)
    host = dr.gather_host_facts(root=str(tmp_path), paths=["/dtaa/imagenet", "", "/scratch", "/data/train"],
                                affinity=[0], memlock_bytes=None)
    assert [s["kind"] for s in host.storage] == ["missing", "missing", "nvme", "hdd"]
    f = dr.check_storage(_facts(host=host))
    assert f.status == "warn" and "'/dtaa/imagenet' does not exist" in f.detail and "empty --path" in f.detail
    assert "/data/train is on a spinning disk" in f.detail and "/scratch: nvme" in f.detail  # others still told
    assert "spelling" in f.fix


def test_nccl_ib_disable_without_infiniband_is_no_warning(tmp_path):
    host = dr.HostFacts(infiniband=[])
    f = dr.check_nccl_env(_facts(env={"NCCL_IB_DISABLE": "1"}, host=host,
                                 nccl_conf={"NCCL_IB_DISABLE": ("1", "environment")}))
    assert f.status == "ok" and "no InfiniBand" in f.detail
    ib = dr.check_nccl_env(_facts(env={"NCCL_IB_DISABLE": "1"}, host=dr.HostFacts(infiniband=["mlx5_0"]),
                                  nccl_conf={"NCCL_IB_DISABLE": ("1", "environment")}))
    assert ib.status == "warn" and "InfiniBand" in ib.detail


def test_host_memory_counts_the_mig_slice_not_the_whole_gpu():
    gpus = [GpuInfo(0, "NVIDIA A100-SXM4-80GB", "GPU-aaaa", 81920.0, mig_uuids=("MIG-1111", "MIG-2222"),
                    mig_memory_mb=(9856.0, 40192.0))]
    env = {"CUDA_VISIBLE_DEVICES": "MIG-1111"}
    host = dr.HostFacts(ram_mb=24 * 1024.0, physical_cores=8, usable_cpus=8)
    f = dr.check_host_memory(_facts(num_gpus=1, gpus=gpus, env=env, host=host))
    assert f.status == "ok" and "24 GiB RAM for 10 GiB of GPU memory" in f.detail and "MIG instance" in f.detail
    whole = dr.check_host_memory(_facts(num_gpus=1, gpus=gpus, host=host))  # no MIG instance named: whole GPU
    assert whole.status == "warn" and "80 GiB of GPU memory" in whole.detail


def test_nvml_reads_each_mig_instances_memory():
    from keras_scale.nvml import Nvml
    from tests.fakes.fake_nvml import FakePynvml

    gpus = Nvml(FakePynvml(num_gpus=1, mig_uuids=["MIG-aaaa-1111"])).devices()
    assert gpus[0].mig_uuids == ("MIG-aaaa-1111",) and gpus[0].mig_memory_mb == (80 * 1024.0,)


def test_nvml_devices_keeps_the_other_gpus_when_one_is_lost():
    from keras_scale.nvml import Nvml
    from tests.fakes.fake_nvml import FakePynvml

    class OneLost(FakePynvml):
        class NVMLError_GpuIsLost(FakePynvml.NVMLError):
            pass

        def nvmlDeviceGetName(self, h):
            if h[1] == 1:
                raise self.NVMLError_GpuIsLost("GPU is lost")
            return super().nvmlDeviceGetName(h)

    nv = Nvml(OneLost(num_gpus=3))
    gpus = nv.devices()
    assert [g.index for g in gpus] == [0, 1, 2] and gpus[1].name == "unknown" and gpus[2].name == "NVIDIA Fake H100"
    assert list(nv.device_errors) == [1] and "GPU is lost" in nv.device_errors[1]


@pytest.mark.parametrize("columns", [40, 52, 72, 120])
def test_text_table_fits_narrow_terminals(monkeypatch, capsys, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")  # a warning with a fix, wrapped too
    dr.cli(["--no-tensorflow", "-q"])
    out = capsys.readouterr().out
    assert max(len(ln) for ln in out.splitlines()) <= columns, out
    assert "nccl_env" in out and "fix:" in out


def test_readings_nvml_does_not_report_are_not_stated_as_facts():
    blank = _health(compute_mode=None, persistence_mode=None, ecc_uncorrected_volatile=None, pages_pending=None,
                    row_remap_failed=None)
    f = _facts(num_gpus=1, health={0: blank})
    modes, ecc = dr.check_gpu_modes(f), dr.check_gpu_memory_errors(f)
    assert "Default" not in modes.detail and "Persistence mode on" not in modes.detail
    assert "not reported" in modes.detail and "ECC not reported" in ecc.detail and "No uncorrectable" not in ecc.detail
    known = _facts(num_gpus=1, health={0: _health()})
    assert "Compute mode Default. Persistence mode on." in dr.check_gpu_modes(known).detail
    assert "No uncorrectable ECC errors" in dr.check_gpu_memory_errors(known).detail


def test_docs_name_every_check_and_only_real_ones():
    """docs/doctor.md's table lists each check once; the troubleshooting table names only checks that exist."""
    import re

    names = [c.__name__.replace("check_", "") for c in dr.CHECKS]
    names = [{"driver_cuda": "driver_vs_cuda"}.get(n, n) for n in names]
    got = {r.name for r in dr.run_checks(_facts(), dr.CHECKS)}
    assert got == set(names)
    doc = open(os.path.join(REPO_ROOT, "docs", "doctor.md")).read()
    rows = re.findall(r"^\| `([a-z_0-9]+)` \|", doc, re.MULTILINE)
    assert sorted(rows) == sorted(got), set(rows) ^ got
    trouble = open(os.path.join(REPO_ROOT, "docs", "troubleshooting.md")).read()
    for row in trouble.splitlines():
        if row.startswith("| **"):
            assert row.count(" | ") == 2, row[:80]  # symptom | what diagnoses it | what it tells you
    doctor_part = " ".join(re.findall(r"`keras-scale doctor[^`]*`: (.*?)(?:;\s*`keras_scale\.|\s\|)", trouble))
    mentioned = set(re.findall(r"`([a-z_]+)`(?= \()", doctor_part))  # "`gpu_processes` (what it finds)"
    assert mentioned and mentioned <= got, mentioned - got


def test_gpus_joined_through_nvswitch_are_not_called_pcie():
    """On DGX/HGX boards every NVLink ends at an NVSwitch, so no link names the other GPU; NVML's P2P-over-NVLink
    status tells that they are NVLink-connected."""
    from keras_scale.nvml import Nvml
    from tests.fakes.fake_nvml import FakePynvml

    link = Nvml(FakePynvml(num_gpus=2, nvswitch=True)).link(0, 1)
    assert link.nvlinks == 0 and link.nvlink_p2p is True
    f = dr.check_gpu_topology(_facts(num_gpus=2, links=[link]))
    assert f.status == "ok" and "0-1 NVLink (through NVSwitch)" in f.detail and "PCIe" not in f.detail
    plain = Nvml(FakePynvml(num_gpus=2)).link(0, 1)  # a PCIe box without P2P
    assert plain.nvlink_p2p is False and dr.check_gpu_topology(_facts(num_gpus=2, links=[plain])).status == "warn"
