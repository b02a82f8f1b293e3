"""keras-scale doctor: every check's decision on fabricated facts, the gatherers on real files/sockets, the JSON
schema, exit codes and the text table, the real run on this machine and a run without TensorFlow."""
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
    gpus = _gpus(num_gpus)
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
        major, minor = cuda.split(".")
        assert major in table["minor_version_compatibility"]
        if minor != "0":
            assert dr._ver(drv) >= dr._ver(table["minor_version_compatibility"][major])
    ordered = sorted(table["toolkit"], key=dr._ver)
    assert [dr._ver(table["toolkit"][k]) for k in ordered] == sorted(dr._ver(table["toolkit"][k]) for k in ordered)


@pytest.mark.parametrize("driver,cuda_max,wheel,status", [
    ("555.42.06", (12, 5), "12.5.1", "ok"),
    ("560.35.03", (12, 6), "12.5.1", "ok"),
    ("535.104.05", (12, 2), "12.5.1", "warn"),  # minor version compatibility only
    ("525.60.13", (12, 0), "12.5.1", "warn"),
    ("520.61.05", (11, 8), "12.5.1", "error"),  # CUDA 11 driver, CUDA 12 wheel
    ("470.82.01", None, "12.3", "error"),
    ("470.82.01", (11, 4), "11.8", "warn"),
    ("545.23.06", (12, 3), "12.7", "warn"),  # 12.7 not in the table: the nearest lower minor (12.6) is used
    ("450.36.06", (11, 0), "11.0", "ok"),  # the 11.0 GA driver predates the 11.x compatibility floor
    ("450.36.06", (11, 0), "11.2", "error"),
])
def test_driver_vs_cuda(driver, cuda_max, wheel, status):
    f = _facts(num_gpus=1, driver_version=driver, cuda_driver_version=cuda_max,
               tf=_tf(build={"cuda_version": wheel, "cudnn_version": "9", "is_cuda_build": True}))
    finding = dr.check_driver_cuda(f)
    assert finding.status == status, finding
    if status != "ok":
        assert "Upgrade the NVIDIA driver to >=" in finding.fix


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
    assert f.status == "warn" and "CUDA_VISIBLE_DEVICES=''" in f.detail


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
    assert "GPU 0: pid 4242 (python old.py) 30000 MiB" in f.detail and "pid 4243 (python old2.py) ? MiB" in f.detail
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
    dirs = dr._ld_cuda_dirs(env)
    assert dirs == {str(prefix / "lib"): ["libcudart.so.11.0", "libcudnn.so.8"]}
    conda = dr._conda_cuda_packages(env, list(dirs))
    assert conda == {str(prefix): ["cudatoolkit-11.8.0-h6a678d5_0", "cudnn-8.9.2.26-cuda11_0"]}
    assert dr._conda_cuda_packages({"CONDA_PREFIX": str(prefix)}, []) == conda


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


def test_xla_flags(tmp_path):
    assert dr.check_xla_flags(_facts()).detail == "No XLA flags set."
    good = dr.check_xla_flags(_facts(env={"XLA_FLAGS": f"--xla_gpu_cuda_data_dir={tmp_path}"}))
    assert good.status == "ok" and str(tmp_path) in good.detail
    for env, needle in [({"XLA_FLAGS": "--xla_dump_to=/tmp/dump"}, "dumps"),
                        ({"XLA_FLAGS": "--xla_gpu_cuda_data_dir=/nope/cuda"}, "does not exist"),
                        ({"TF_XLA_FLAGS": "tf_xla_auto_jit=2"}, "not a --flag")]:
        f = dr.check_xla_flags(_facts(env=env))
        assert f.status == "warn" and needle in f.detail, (env, f)


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
])
def test_nccl_env(env, status, needle):
    f = dr.check_nccl_env(_facts(env=env, net_interfaces=["eth0", "lo"]))
    assert f.status == status and needle in f.detail, f
    if not env:
        assert "NCCL_DEBUG=INFO" in f.fix


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
    assert "1 error(s), 1 warning(s)" in out
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
