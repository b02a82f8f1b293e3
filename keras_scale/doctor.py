"""``keras-scale doctor``: check drivers, CUDA, GPUs, leftover processes and environment variables up front.

Two halves: *gathering* facts (NVML, a TensorFlow probe run in a child process, the environment, installed
packages) and *deciding* — one small function per check, ``check_*(facts) -> Finding`` — so each decision can
be tested with fabricated facts. The NVML checks run without TensorFlow (it is reported missing, the rest goes
on). TensorFlow is probed in a child process, so ``doctor()`` leaves the caller's TensorFlow uninitialised (you
can still set memory growth afterwards) and survives a TensorFlow that crashes on import.

Example:
    $ keras-scale doctor            # a table; exit code 1 only when a check says "error"
    $ keras-scale doctor --json     # the same as JSON

    >>> import keras_scale as ks
    >>> report = ks.doctor()
    >>> [c["name"] for c in report["checks"] if c["status"] == "error"]
    []
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["doctor", "cli", "Finding", "Facts", "gather_facts", "run_checks", "CHECKS", "load_driver_minimums"]

STATUSES = ("ok", "warn", "error", "skip")
_PROBE_FLAG = "--keras-scale-tf-probe"
_PROBE_MARK = "KERAS_SCALE_TF_PROBE "
_DATA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data_files", "cuda_driver_minimums.json")


@dataclass(frozen=True)
class Finding:
    """One check's verdict: ``status`` is ``ok``, ``warn``, ``error`` or ``skip``; ``fix`` says what to do.

    Example:
        >>> Finding("python", "ok", "Python 3.11.9").as_dict()
        {'name': 'python', 'status': 'ok', 'detail': 'Python 3.11.9', 'fix': ''}
    """

    name: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Finding status must be one of {STATUSES}, got {self.status!r}")

    def as_dict(self) -> Dict[str, str]:
        return dataclasses.asdict(self)


@dataclass
class Facts:
    """Everything the checks look at. :func:`gather_facts` fills it from this machine; tests fabricate it.

    ``tf`` is the TensorFlow probe's result (see :func:`_probe_tensorflow`): ``tf["tensorflow"]`` is None when
    TensorFlow is missing, and ``tf["error"]`` then says why. ``nvml_error``/``nvml_error_kind`` come from
    :class:`keras_scale.nvml.NvmlUnavailable` when NVML is unusable.

    Example:
        >>> f = Facts(python_version="3.11.9", env={"TF_CONFIG": "{bad"})
        >>> check_tf_config(f).status
        'error'
    """

    python_version: str = platform.python_version()
    env: Mapping[str, str] = field(default_factory=dict)
    tf: Dict[str, Any] = field(default_factory=dict)
    nvml_error: Optional[str] = None
    nvml_error_kind: Optional[str] = None
    driver_version: Optional[str] = None
    cuda_driver_version: Optional[Tuple[int, int]] = None
    gpus: List[Any] = field(default_factory=list)  # keras_scale.nvml.GpuInfo
    visible_gpu_indices: List[int] = field(default_factory=list)
    processes: List[Any] = field(default_factory=list)  # keras_scale.nvml.GpuProcess, other processes only
    samples: Dict[int, Any] = field(default_factory=dict)  # index -> keras_scale.nvml.GpuSample
    pip_nvidia_packages: List[str] = field(default_factory=list)  # "nvidia-cudnn-cu12==9.3.0.75"
    ld_cuda_dirs: Dict[str, List[str]] = field(default_factory=dict)  # LD_LIBRARY_PATH dir -> CUDA libs in it
    conda_cuda_packages: Dict[str, List[str]] = field(default_factory=dict)  # conda prefix -> CUDA packages
    net_interfaces: Optional[List[str]] = None
    python_executable: str = ""

    @property
    def tf_version(self) -> Optional[str]:
        return self.tf.get("tensorflow")

    @property
    def tf_gpus(self) -> Optional[List[str]]:
        return self.tf.get("gpus") if self.tf_version else None


# ================================================================================================ gathering
def load_driver_minimums(path: str = _DATA_FILE) -> Dict[str, Dict[str, str]]:
    """The driver-minimum table (``{"toolkit": {"12.5": "555.42.02"}, "minor_version_compatibility": ...}``).

    Example:
        >>> load_driver_minimums()["toolkit"]["12.0"]
        '525.60.13'
    """
    with open(path) as f:
        data = json.load(f)
    return {k: v for k, v in data.items() if not k.startswith("_")}


def _probe_tensorflow() -> Dict[str, Any]:
    """Runs in the child process: versions, build info, GPUs, memory growth and a matmul on each device."""
    out: Dict[str, Any] = {"tensorflow": None, "error": None, "keras": None, "keras_backend": None,
                           "keras_error": None, "build": {}, "gpus": [], "memory_growth": {}, "placements": []}
    try:
        import tensorflow as tf
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising anything
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    out["tensorflow"] = tf.__version__
    try:
        info = dict(tf.sysconfig.get_build_info())
        out["build"] = {k: info.get(k) for k in ("cuda_version", "cudnn_version", "is_cuda_build")}
    except Exception as e:  # noqa: BLE001
        out["build"] = {"error": str(e)}
    try:
        import keras

        out["keras"] = keras.__version__
        out["keras_backend"] = keras.config.backend() if hasattr(keras, "config") else "tensorflow"
    except Exception as e:  # noqa: BLE001
        out["keras_error"] = f"{type(e).__name__}: {e}"
    gpus = tf.config.list_physical_devices("GPU")
    out["gpus"] = [g.name for g in gpus]
    for g in gpus:
        try:
            out["memory_growth"][g.name] = bool(tf.config.experimental.get_memory_growth(g))
            # the smoke test must not reserve every GPU's memory under someone else's running job
            tf.config.experimental.set_memory_growth(g, True)
        except Exception:  # noqa: BLE001
            pass
    targets = [d.name for d in tf.config.list_logical_devices("GPU")] or ["/device:CPU:0"]
    for name in targets:
        entry = {"requested": name, "device": None, "ok": False, "error": None}
        try:
            with tf.device(name):
                a = tf.ones((64, 64))
                c = tf.matmul(a, a)
            entry["device"] = c.device
            entry["ok"] = bool(abs(float(c[0, 0]) - 64.0) < 1e-3)
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"[:500]
        out["placements"].append(entry)
    return out


_LOG_HINT = re.compile(
    r"Could not load dynamic library|Cannot dlopen|Could not find cuda drivers|failed call to cuInit|"
    r"Loaded runtime CuDNN library|cuDNN.*version|Could not find TensorRT|libcu\w+\.so", re.IGNORECASE)


def _run_tf_probe(timeout_s: float = 180.0) -> Dict[str, Any]:
    """Run :func:`_probe_tensorflow` in a child Python; collect its result and TensorFlow's telling log lines."""
    cmd = [sys.executable, os.path.abspath(__file__), _PROBE_FLAG]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return {"tensorflow": None, "error": f"TensorFlow did not finish starting within {timeout_s:.0f} s "
                                             "(hung while initialising the GPUs?)", "crashed": True}
    result: Optional[Dict[str, Any]] = None
    for line in proc.stdout.splitlines():
        if line.startswith(_PROBE_MARK):
            result = json.loads(line[len(_PROBE_MARK):])
    hints = [ln.strip()[:300] for ln in proc.stderr.splitlines() if _LOG_HINT.search(ln)]
    if result is None:
        tail = proc.stderr.strip().splitlines()[-5:]
        result = {"tensorflow": None, "crashed": True,
                  "error": f"the TensorFlow probe exited with code {proc.returncode} before reporting: "
                           + " | ".join(tail)[-800:]}
    result["log_hints"] = hints[:12]
    return result


def _pip_nvidia_packages() -> List[str]:
    found = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if name.startswith("nvidia-") and name not in ("nvidia-ml-py", "nvidia-ml-py3"):
            found.add(f"{name}=={dist.version}")
    return sorted(found)


_CUDA_LIB = re.compile(r"^lib(cudart|cudnn|cublas|cublasLt|cufft|cusolver|cusparse|nccl)\.so")
_CONDA_CUDA_PKG = re.compile(r"^(cudatoolkit|cudnn|cuda-toolkit|cuda-cudart|cuda-runtime|nccl|cuda-nvcc)-\d")


def _ld_cuda_dirs(env: Mapping[str, str]) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if not d or not os.path.isdir(d) or d in out:
            continue
        try:
            libs = sorted(f for f in os.listdir(d) if _CUDA_LIB.match(f))
        except OSError:
            continue
        if libs:
            out[d] = libs
    return out


def _conda_cuda_packages(env: Mapping[str, str], ld_dirs: Sequence[str]) -> Dict[str, List[str]]:
    prefixes = {env["CONDA_PREFIX"]} if env.get("CONDA_PREFIX") else set()
    prefixes |= {os.path.dirname(d.rstrip("/")) for d in ld_dirs}
    out: Dict[str, List[str]] = {}
    for prefix in sorted(prefixes):
        meta = os.path.join(prefix, "conda-meta")
        try:
            names = sorted(f[:-5] for f in os.listdir(meta) if f.endswith(".json") and _CONDA_CUDA_PKG.match(f))
        except OSError:
            continue
        if names:
            out[prefix] = names
    return out


def _net_interfaces() -> Optional[List[str]]:
    try:
        return sorted(name for _, name in socket.if_nameindex())
    except (OSError, AttributeError):
        return None


def gather_facts(nvml: Any = None, probe_tensorflow: bool = True) -> Facts:
    """Collect :class:`Facts` from this machine: NVML, the TensorFlow probe, environment, packages.

    Args:
        nvml: an object with the :class:`keras_scale.nvml.Nvml` methods (tests pass a fake); default opens
            the real NVML.
        probe_tensorflow: run the TensorFlow probe (a child process, a few seconds).

    Example:
        >>> facts = gather_facts(probe_tensorflow=False)
        >>> facts.gpus  # on a machine without GPUs  # doctest: +SKIP
        []
    """
    from keras_scale import nvml as nvml_lib

    env = dict(os.environ)
    facts = Facts(env=env, python_executable=sys.executable)
    owned = nvml is None
    try:
        nv = nvml_lib.open_nvml() if nvml is None else nvml
    except nvml_lib.NvmlUnavailable as e:
        nv = None
        facts.nvml_error, facts.nvml_error_kind = str(e), e.kind
    if nv is not None:
        try:
            facts.driver_version = nv.driver_version()
            facts.cuda_driver_version = nv.cuda_driver_version()
            facts.gpus = nv.devices()
            facts.visible_gpu_indices = nvml_lib.visible_gpu_indices(facts.gpus, env)
            me = os.getpid()
            for g in facts.gpus:
                facts.processes.extend(p for p in nv.processes(g.index) if p.pid != me)
                facts.samples[g.index] = nv.sample(g.index)
        except Exception as e:  # noqa: BLE001 - NVML half-working: report it, keep going
            facts.nvml_error, facts.nvml_error_kind = f"NVML query failed: {type(e).__name__}: {e}", "other"
        finally:
            if owned:
                nv.close()
    if probe_tensorflow:
        facts.tf = _run_tf_probe()
    facts.pip_nvidia_packages = _pip_nvidia_packages()
    facts.ld_cuda_dirs = _ld_cuda_dirs(env)
    facts.conda_cuda_packages = _conda_cuda_packages(env, list(facts.ld_cuda_dirs))
    facts.net_interfaces = _net_interfaces()
    return facts


# ================================================================================================== checks
def _ver(text: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text or ""))


def _no_tf(f: Facts, name: str) -> Optional[Finding]:
    if f.tf_version is None:
        why = "TensorFlow is not installed" if not f.tf.get("crashed") else "TensorFlow failed to start"
        if not f.tf:
            why = "TensorFlow was not probed"
        return Finding(name, "skip", f"{why}; this check needs it.")
    return None


def check_python(f: Facts) -> Finding:
    """Python version (TensorFlow 2.21 wheels exist for 3.10-3.13)."""
    v = _ver(f.python_version)
    detail = f"Python {f.python_version}" + (f" ({f.python_executable})" if f.python_executable else "")
    if v[:2] < (3, 10):
        return Finding("python", "warn", detail, "Recent TensorFlow wheels need Python >= 3.10; use a newer Python.")
    return Finding("python", "ok", detail)


def check_tensorflow(f: Facts) -> Finding:
    """TensorFlow importable (missing: warn and go on; crashing on import: error)."""
    if f.tf_version:
        return Finding("tensorflow", "ok", f"TensorFlow {f.tf_version}")
    if not f.tf:
        return Finding("tensorflow", "skip", "TensorFlow was not probed.")
    err = f.tf.get("error") or "unknown error"
    if "No module named 'tensorflow'" in err:
        return Finding("tensorflow", "warn", "TensorFlow is not installed; the NVML checks still ran, the "
                       "TensorFlow checks are skipped.", "pip install 'tensorflow[and-cuda]' (Linux with GPUs) or "
                       "pip install tensorflow")
    return Finding("tensorflow", "error", f"TensorFlow fails to import: {err}",
                   "Reinstall it in a clean virtualenv: pip install 'tensorflow[and-cuda]'; see the cuda_libraries "
                   "check for library problems.")


def check_keras(f: Facts) -> Finding:
    """Keras 3 with the TensorFlow backend."""
    if no := _no_tf(f, "keras"):
        return no
    if f.tf.get("keras") is None:
        return Finding("keras", "error", f"Keras fails to import: {f.tf.get('keras_error')}",
                       "pip install 'keras>=3.5'")
    version, backend = f.tf["keras"], f.tf.get("keras_backend") or "?"
    if _ver(version)[:1] < (3,):
        return Finding("keras", "error", f"Keras {version}: keras_scale needs Keras 3.", "pip install 'keras>=3.5'")
    if backend != "tensorflow":
        return Finding("keras", "warn", f"Keras {version} uses the {backend!r} backend; keras_scale needs "
                       "'tensorflow'.", "export KERAS_BACKEND=tensorflow (or set \"backend\" in ~/.keras/keras.json)")
    return Finding("keras", "ok", f"Keras {version}, backend tensorflow")


def check_tf_build(f: Facts) -> Finding:
    """How the TensorFlow wheel was built (CUDA/cuDNN versions, or CPU-only)."""
    if no := _no_tf(f, "tf_build"):
        return no
    b = f.tf.get("build") or {}
    if not b.get("is_cuda_build"):
        if f.gpus:
            return Finding("tf_build", "error", f"This TensorFlow {f.tf_version} is a CPU-only build, but the "
                           f"machine has {len(f.gpus)} NVIDIA GPU(s).",
                           "pip install 'tensorflow[and-cuda]' (in a clean virtualenv)")
        return Finding("tf_build", "ok", "CPU-only TensorFlow build (no GPU on this machine either)")
    return Finding("tf_build", "ok", f"built for CUDA {b.get('cuda_version')}, cuDNN {b.get('cudnn_version')}")


def check_nvidia_driver(f: Facts) -> Finding:
    """The NVIDIA driver as NVML reports it — or, plainly, that there is no GPU."""
    if f.nvml_error:
        if f.nvml_error_kind == "no_driver":
            return Finding("nvidia_driver", "skip", f"No GPU present: {f.nvml_error}. Training runs on the CPU.")
        if f.nvml_error_kind == "no_module":
            return Finding("nvidia_driver", "warn", f"Cannot check the GPUs: {f.nvml_error}.",
                           "pip install nvidia-ml-py")
        return Finding("nvidia_driver", "error", f"The NVIDIA driver is installed but not usable: {f.nvml_error}.",
                       "Run `nvidia-smi`; reboot after a driver update, or reinstall the driver.")
    if not f.gpus:
        return Finding("nvidia_driver", "skip", f"NVIDIA driver {f.driver_version} but no GPU present.")
    cuda = f.cuda_driver_version
    return Finding("nvidia_driver", "ok", f"driver {f.driver_version}, supports CUDA up to "
                   f"{'%d.%d' % cuda if cuda else '?'}; {len(f.gpus)} GPU(s): "
                   + ", ".join(sorted({g.name for g in f.gpus})))


def check_driver_cuda(f: Facts, minimums: Optional[Dict[str, Dict[str, str]]] = None) -> Finding:
    """Does the driver support the CUDA version the TensorFlow wheel was built for? (table in data_files/)."""
    name = "driver_vs_cuda"
    if not f.driver_version:
        return Finding(name, "skip", "No NVIDIA driver to compare.")
    if no := _no_tf(f, name):
        return no
    b = f.tf.get("build") or {}
    if not b.get("is_cuda_build") or not b.get("cuda_version"):
        return Finding(name, "skip", "TensorFlow is not a CUDA build.")
    table = minimums or load_driver_minimums()
    wheel = _ver(str(b["cuda_version"]))
    key = f"{wheel[0]}.{wheel[1] if len(wheel) > 1 else 0}"
    drv = _ver(f.driver_version)
    known = sorted((k for k in table["toolkit"] if _ver(k)[0] == wheel[0] and _ver(k) <= _ver(key)), key=_ver)
    toolkit_min = table["toolkit"].get(key) or (table["toolkit"][known[-1]] if known else None)
    compat_min = table["minor_version_compatibility"].get(str(wheel[0]))
    if toolkit_min is None and compat_min is None:
        return Finding(name, "skip", f"No driver minimum known for CUDA {b['cuda_version']}; update "
                       "keras_scale/data_files/cuda_driver_minimums.json.")
    cuda_max = f.cuda_driver_version
    if cuda_max and cuda_max[0] < wheel[0]:
        return Finding(name, "error", f"Driver {f.driver_version} supports CUDA up to {cuda_max[0]}.{cuda_max[1]}, "
                       f"but TensorFlow {f.tf_version} was built for CUDA {b['cuda_version']}: no GPU will work.",
                       f"Upgrade the NVIDIA driver to >= {toolkit_min or compat_min}.")
    # the x.0 toolkit's own driver can predate the minor-compatibility floor (11.0 GA: 450.36.06 < 450.80.02)
    floor = min((m for m in (compat_min, toolkit_min) if m), key=_ver)
    if drv < _ver(floor):
        return Finding(name, "error", f"Driver {f.driver_version} is too old for CUDA {b['cuda_version']} "
                       f"(TensorFlow {f.tf_version}): CUDA {wheel[0]}.x needs >= {floor}.",
                       f"Upgrade the NVIDIA driver to >= {toolkit_min or floor}.")
    if toolkit_min and drv < _ver(toolkit_min):
        return Finding(name, "warn", f"Driver {f.driver_version} runs CUDA {b['cuda_version']} only through minor "
                       f"version compatibility (CUDA {key} shipped with {toolkit_min}): PTX JIT for newer GPUs and "
                       "some XLA kernels can fail (CUDA_ERROR_UNSUPPORTED_PTX_VERSION).",
                       f"Upgrade the NVIDIA driver to >= {toolkit_min}.")
    return Finding(name, "ok", f"driver {f.driver_version} >= {toolkit_min} needed by CUDA {b['cuda_version']}")


def check_gpu_visibility(f: Facts) -> Finding:
    """GPUs seen by NVML vs by TensorFlow, and why they differ."""
    name = "gpu_visibility"
    n, v = len(f.gpus), len(f.visible_gpu_indices)
    cvd = f.env.get("CUDA_VISIBLE_DEVICES")
    cvd_text = f"CUDA_VISIBLE_DEVICES={cvd!r}" if cvd is not None else "CUDA_VISIBLE_DEVICES unset"
    t = len(f.tf_gpus) if f.tf_gpus is not None else None
    if n == 0 and not t:
        return Finding(name, "skip", "No GPU present (NVML sees none" + (", TensorFlow sees none" if t == 0 else "")
                       + "): training runs on the CPU.")
    if t is None:
        return Finding(name, "skip", f"NVML sees {n} GPU(s), {v} visible ({cvd_text}); TensorFlow not available "
                       "to compare.")
    if n == 0:
        return Finding(name, "warn", f"TensorFlow sees {t} GPU(s) but NVML none ({f.nvml_error or 'no devices'}).",
                       "Install nvidia-ml-py and check `nvidia-smi` works for this user.")
    if v == 0:
        return Finding(name, "warn", f"{cvd_text} hides all {n} GPU(s): TensorFlow sees {t}.",
                       "Unset CUDA_VISIBLE_DEVICES or list the GPU indices to use, e.g. CUDA_VISIBLE_DEVICES=0,1")
    if t == 0:
        build = f.tf.get("build") or {}
        hints = f.tf.get("log_hints") or []
        if not build.get("is_cuda_build"):
            why, fix = "this TensorFlow wheel is CPU-only", "pip install 'tensorflow[and-cuda]'"
        elif hints:
            why = "TensorFlow could not load the CUDA libraries: " + " | ".join(hints[:3])
            fix = ("pip install 'tensorflow[and-cuda]' (brings matching CUDA/cuDNN as pip wheels) and remove "
                   "other CUDA directories from LD_LIBRARY_PATH")
        else:
            why, fix = "TensorFlow found no usable GPU", "Run `nvidia-smi`; reinstall 'tensorflow[and-cuda]'"
        return Finding(name, "error", f"NVML sees {n} GPU(s) ({v} visible, {cvd_text}) but TensorFlow sees none: "
                       f"{why}.", fix)
    if t < v:
        return Finding(name, "warn", f"TensorFlow sees {t} of the {v} visible GPU(s) ({cvd_text}).",
                       "Check `nvidia-smi` for GPUs in a bad state and the TensorFlow log for skipped devices "
                       "(e.g. compute capability too old).")
    return Finding(name, "ok", f"NVML sees {n} GPU(s), {v} visible ({cvd_text}), TensorFlow sees {t}.")


def check_gpu_processes(f: Facts) -> Finding:
    """Other processes already holding GPU memory (the leftover-run trap)."""
    name = "gpu_processes"
    if not f.gpus:
        return Finding(name, "skip", "No GPU present.")
    if not f.processes:
        return Finding(name, "ok", "No other process holds GPU memory.")
    lines = "; ".join(f"GPU {p.gpu_index}: pid {p.pid} ({p.name}) "
                      f"{'?' if p.used_memory_mb is None else '%.0f' % p.used_memory_mb} MiB" for p in f.processes)
    busy = {p.gpu_index for p in f.processes}
    free = [i for i in f.visible_gpu_indices if i not in busy]
    pids = " ".join(sorted({str(p.pid) for p in f.processes}))
    steer = f" or use the free GPU(s): CUDA_VISIBLE_DEVICES={','.join(map(str, free))}" if free else ""
    return Finding(name, "warn", f"Processes already hold GPU memory: {lines}.",
                   f"If they are leftovers of an earlier run (check with `ps -fp {pids.replace(' ', ',')}`): "
                   f"kill {pids}{steer}.")


def check_throttling(f: Facts) -> Finding:
    """Clocks currently lowered by temperature, power cap or hardware slowdown."""
    name = "throttling"
    if not f.samples:
        return Finding(name, "skip", "No GPU present.")
    bad = []
    for index, s in sorted(f.samples.items()):
        reasons = s.throttle_reasons()
        if reasons:
            extra = f", {s.temperature_c:.0f} C" if s.temperature_c is not None else ""
            bad.append(f"GPU {index}: {', '.join(reasons)}{extra}")
    if bad:
        return Finding(name, "warn", "Throttled now: " + "; ".join(bad) + ".",
                       "Check cooling and the power limit: nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER")
    temps = [s.temperature_c for s in f.samples.values() if s.temperature_c is not None]
    return Finding(name, "ok", "No GPU is throttled" + (f" (max {max(temps):.0f} C)." if temps else "."))


def check_library_conflicts(f: Facts) -> Finding:
    """conda CUDA/cuDNN libraries on LD_LIBRARY_PATH together with pip NVIDIA wheels."""
    name = "library_conflicts"
    pip = f.pip_nvidia_packages
    conda = {p: pkgs for p, pkgs in f.conda_cuda_packages.items()}
    conda_dirs = [d for d in f.ld_cuda_dirs if any(d.startswith(p.rstrip("/") + "/") for p in conda)
                  or re.search(r"conda|mamba|miniforge", d, re.IGNORECASE)]
    other_dirs = [d for d in f.ld_cuda_dirs if d not in conda_dirs]
    if pip and (conda_dirs or conda):
        where = "; ".join(f"{p}: {', '.join(v)}" for p, v in conda.items()) or ", ".join(conda_dirs)
        return Finding(name, "warn", f"conda CUDA packages ({where}) alongside pip NVIDIA wheels "
                       f"({', '.join(pip[:4])}{'...' if len(pip) > 4 else ''})"
                       + (f"; on LD_LIBRARY_PATH: {', '.join(conda_dirs)}" if conda_dirs else "")
                       + ". The first library found wins, so TensorFlow may load a cuDNN/CUDA other than the one "
                         "it was built for.",
                       "Use one source: `conda remove cudatoolkit cudnn` (keep the pip wheels from "
                       "'tensorflow[and-cuda]'), or drop the conda lib dir from LD_LIBRARY_PATH.")
    if pip and other_dirs:
        return Finding(name, "warn", f"CUDA libraries on LD_LIBRARY_PATH ({', '.join(other_dirs)}) shadow the pip "
                       "NVIDIA wheels TensorFlow was built with.",
                       "Remove those directories from LD_LIBRARY_PATH unless you built TensorFlow against them.")
    src = "pip NVIDIA wheels" if pip else ("LD_LIBRARY_PATH: " + ", ".join(f.ld_cuda_dirs) if f.ld_cuda_dirs
                                           else "no CUDA libraries installed outside the driver")
    return Finding(name, "ok", f"One source of CUDA libraries ({src}).")


def check_cuda_libraries(f: Facts) -> Finding:
    """What TensorFlow said while loading CUDA/cuDNN (missing libraries, cuDNN version mismatch)."""
    name = "cuda_libraries"
    if not f.tf:
        return Finding(name, "skip", "TensorFlow was not probed.")
    hints = f.tf.get("log_hints") or []
    mismatch = [h for h in hints if "Loaded runtime CuDNN library" in h]
    missing = [h for h in hints if re.search(r"Could not load dynamic library|Cannot dlopen", h)]
    if mismatch:
        return Finding(name, "error", "cuDNN version mismatch: " + mismatch[0],
                       "Install the cuDNN TensorFlow was built for (pip install 'tensorflow[and-cuda]') and remove "
                       "other cuDNN copies from LD_LIBRARY_PATH.")
    if missing and f.gpus:
        return Finding(name, "error", "TensorFlow could not load CUDA libraries: " + " | ".join(missing[:3]),
                       "pip install 'tensorflow[and-cuda]' (CUDA, cuDNN as pip wheels), or install the CUDA/cuDNN "
                       "versions of the tf_build check and put them on LD_LIBRARY_PATH.")
    if f.tf.get("crashed"):
        return Finding(name, "error", f"TensorFlow crashed while starting: {f.tf.get('error')}",
                       "Reinstall 'tensorflow[and-cuda]' in a clean virtualenv; check library_conflicts.")
    if not f.gpus:
        return Finding(name, "skip", "No GPU present: CUDA libraries not needed.")
    return Finding(name, "ok", "TensorFlow loaded its CUDA libraries without complaint.")


def check_placement(f: Facts) -> Finding:
    """Smoke test: a matmul placed on each visible GPU (or the CPU) and where it ran."""
    name = "placement"
    if no := _no_tf(f, name):
        return no
    runs = f.tf.get("placements") or []
    if not runs:
        return Finding(name, "error", "The matmul smoke test did not run.", "Run with TensorFlow logging on: "
                       "TF_CPP_MIN_LOG_LEVEL=0 keras-scale doctor")
    bad, good = [], []
    for r in runs:
        want = r["requested"].split("device:")[-1].upper()
        got = (r.get("device") or "").upper()
        if r.get("error"):
            bad.append(f"{r['requested']}: {r['error']}")
        elif not got.endswith(want):
            bad.append(f"{r['requested']}: asked for {want}, ran on {r.get('device')}")
        elif not r.get("ok"):
            bad.append(f"{r['requested']}: ran on {r.get('device')} but gave a wrong result")
        else:
            good.append(f"{want} -> {r['device']}")
    if bad:
        return Finding(name, "error", "Matmul smoke test failed: " + "; ".join(bad),
                       "See cuda_libraries and driver_vs_cuda; `nvidia-smi` for a GPU in a bad state.")
    suffix = " (no GPU: CPU only)" if all("CPU" in g for g in good) else ""
    return Finding(name, "ok", "matmul ran: " + "; ".join(good) + suffix)


def check_memory_growth(f: Facts) -> Finding:
    """TF_FORCE_GPU_ALLOW_GROWTH and per-GPU memory growth (TensorFlow reserves almost all GPU memory by default)."""
    name = "memory_growth"
    raw = f.env.get("TF_FORCE_GPU_ALLOW_GROWTH")
    if raw is not None and raw not in ("true", "false"):
        return Finding(name, "warn", f"TF_FORCE_GPU_ALLOW_GROWTH={raw!r} is ignored: TensorFlow accepts only "
                       "'true' or 'false' (lower case).", "export TF_FORCE_GPU_ALLOW_GROWTH=true")
    if not f.gpus and not f.tf_gpus:
        return Finding(name, "skip", "No GPU present" + (f" (TF_FORCE_GPU_ALLOW_GROWTH={raw})" if raw else "") + ".")
    growth = f.tf.get("memory_growth") or {}
    if raw == "true" or (growth and all(growth.values())):
        return Finding(name, "ok", "Memory growth on: TensorFlow allocates GPU memory as needed; nvidia-smi shows "
                       "real use.")
    return Finding(name, "ok", "Memory growth off (default): TensorFlow reserves nearly all memory of each GPU at "
                   "start, so nvidia-smi shows the GPUs full and a second process on the same GPU runs out of memory.",
                   "To share GPUs or see real use: export TF_FORCE_GPU_ALLOW_GROWTH=true")


def check_xla_flags(f: Facts) -> Finding:
    """TF_XLA_FLAGS / XLA_FLAGS: malformed entries, dumps left on, CUDA data dir that does not exist."""
    name = "xla_flags"
    problems, shown = [], []
    for var in ("TF_XLA_FLAGS", "XLA_FLAGS"):
        value = f.env.get(var, "").strip()
        if not value:
            continue
        shown.append(f"{var}={value!r}")
        for tok in value.split():
            if not tok.startswith("--"):
                problems.append(f"{var}: {tok!r} is not a --flag (XLA aborts on unknown or malformed flags)")
            elif tok.startswith("--xla_dump_to"):
                problems.append(f"{var}: {tok} dumps every compiled module (slow, fills the disk)")
            elif tok.startswith("--xla_gpu_cuda_data_dir="):
                path = tok.split("=", 1)[1]
                if not os.path.isdir(path):
                    problems.append(f"{var}: --xla_gpu_cuda_data_dir={path} does not exist (XLA cannot find "
                                    "ptxas/libdevice)")
    if problems:
        return Finding(name, "warn", "; ".join(problems), "Fix or unset the flags; remove dump flags after "
                       "debugging.")
    if not shown:
        return Finding(name, "ok", "No XLA flags set.")
    return Finding(name, "ok", "; ".join(shown))


_NCCL_SLOW = {"NCCL_P2P_DISABLE": "GPU peer-to-peer copies", "NCCL_IB_DISABLE": "InfiniBand",
              "NCCL_SHM_DISABLE": "shared-memory transport"}


def check_nccl_env(f: Facts) -> Finding:
    """NCCL_* variables: transports disabled (slow all-reduce), unknown socket interface, debug level."""
    name = "nccl_env"
    nccl = {k: v for k, v in sorted(f.env.items()) if k.startswith("NCCL_")}
    problems = []
    for var, what in _NCCL_SLOW.items():
        if nccl.get(var, "0").strip() not in ("", "0"):
            problems.append(f"{var}={nccl[var]} turns off {what}: all-reduce gets slower")
    ifname = nccl.get("NCCL_SOCKET_IFNAME", "").strip()
    if ifname and not ifname.startswith("^") and f.net_interfaces is not None:
        exact = ifname.startswith("=")
        wanted = [w for w in ifname.lstrip("=").split(",") if w]
        hits = [w for w in wanted if any((i == w) if exact else i.startswith(w) for i in f.net_interfaces)]
        if not hits:
            problems.append(f"NCCL_SOCKET_IFNAME={ifname} matches no interface here ({', '.join(f.net_interfaces)})")
    if nccl.get("NCCL_DEBUG", "").upper() == "TRACE":
        problems.append("NCCL_DEBUG=TRACE logs every call (slow); INFO is enough to debug")
    listed = ", ".join(f"{k}={v}" for k, v in nccl.items())
    if problems:
        return Finding(name, "warn", "; ".join(problems) + ".", "Unset these unless you are debugging a hang; "
                       "NCCL_DEBUG=INFO shows which transports NCCL picked.")
    return Finding(name, "ok", listed or "No NCCL_* variables set.",
                   "" if "NCCL_DEBUG" in nccl else "When debugging multi-GPU hangs or slowness: export NCCL_DEBUG=INFO")


def _resolve(host: str) -> List[str]:
    return sorted({ai[4][0] for ai in socket.getaddrinfo(host, None)})


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _local_addresses() -> set:
    addrs = {"127.0.0.1", "::1", "0.0.0.0"}
    try:
        import psutil

        for entries in psutil.net_if_addrs().values():
            addrs.update(e.address.split("%")[0] for e in entries)
    except Exception:  # noqa: BLE001 - psutil missing: loopback only
        pass
    return addrs


def check_tf_config(f: Facts, resolve: Callable[[str], List[str]] = _resolve,
                    port_free: Callable[[str, int], bool] = _port_free) -> Finding:
    """TF_CONFIG: valid JSON, this task inside the cluster, addresses host:port, resolvable, own port free."""
    name = "tf_config"
    raw = f.env.get("TF_CONFIG", "").strip()
    if not raw:
        return Finding(name, "ok", "TF_CONFIG unset: single-machine training.")
    fix = ('TF_CONFIG looks like {"cluster": {"worker": ["host1:port", "host2:port"]}, "task": {"type": "worker", '
           '"index": 0}}; `keras-scale launch` sets it for local workers.')
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        return Finding(name, "error", f"TF_CONFIG is not valid JSON ({e}): {raw[:120]!r}", fix)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("cluster"), dict) or not cfg["cluster"]:
        return Finding(name, "error", f"TF_CONFIG has no \"cluster\" mapping: {raw[:120]!r}", fix)
    task = cfg.get("task")
    if not isinstance(task, dict) or "type" not in task:
        return Finding(name, "error", "TF_CONFIG has no \"task\": {\"type\", \"index\"}: each process must say which "
                       "cluster member it is.", fix)
    cluster, ttype = cfg["cluster"], task["type"]
    try:
        index = int(task.get("index", 0))
    except (TypeError, ValueError):
        return Finding(name, "error", f"TF_CONFIG task index {task.get('index')!r} is not an integer.", fix)
    if ttype not in cluster:
        return Finding(name, "error", f"TF_CONFIG task type {ttype!r} is not in the cluster {sorted(cluster)}.", fix)
    members = cluster[ttype] if isinstance(cluster[ttype], list) else []
    if not 0 <= index < len(members):
        return Finding(name, "error", f"TF_CONFIG task {ttype}:{index} is outside the cluster: {ttype!r} has "
                       f"{len(members)} address(es).", fix)
    addresses, problems = [], []
    for role, addrs in cluster.items():
        for addr in addrs if isinstance(addrs, list) else [addrs]:
            m = re.fullmatch(r"\[?([^\]]+?)\]?:(\d+)", str(addr))
            if not m or not 0 < int(m.group(2)) < 65536:
                return Finding(name, "error", f"TF_CONFIG address {addr!r} of {role!r} is not host:port.", fix)
            addresses.append((role, m.group(1), int(m.group(2))))
    dupes = sorted({f"{h}:{p}" for _, h, p in addresses if sum(1 for _, h2, p2 in addresses if (h2, p2) == (h, p)) > 1})
    if dupes:
        return Finding(name, "error", f"TF_CONFIG lists the same address twice: {', '.join(dupes)}.", fix)
    resolved = {}
    for _, host, _ in addresses:
        if host in resolved:
            continue
        try:
            resolved[host] = resolve(host)
        except (OSError, UnicodeError):
            problems.append(f"host {host!r} does not resolve")
            resolved[host] = []
    if problems:
        return Finding(name, "error", f"TF_CONFIG: {'; '.join(problems)}.", "Use resolvable hostnames or IPs.")
    m = re.fullmatch(r"\[?([^\]]+?)\]?:(\d+)", str(members[index]))
    my_host, my_port = m.group(1), int(m.group(2))
    n_tasks = len(addresses)
    detail = f"{n_tasks} task(s) ({', '.join(f'{r}: {len(a)}' for r, a in cluster.items())}); this is {ttype}:{index}"
    local = _local_addresses()
    if set(resolved.get(my_host, [])) & local:
        if not port_free("0.0.0.0" if ":" not in my_host else "::", my_port):
            return Finding(name, "warn", f"{detail}; its port {my_port} is already in use here (a previous worker "
                           "still running?).", f"Find it with `ss -ltnp 'sport = :{my_port}'`, stop it, or pick "
                           "another port.")
    else:
        return Finding(name, "warn", f"{detail}; its address {my_host} is not an address of this machine "
                       f"({', '.join(resolved.get(my_host, []))}).", "Set task.index to this machine's entry.")
    return Finding(name, "ok", detail + f", port {my_port} free.")


CHECKS: Tuple[Callable[[Facts], Finding], ...] = (
    check_python, check_tensorflow, check_keras, check_tf_build, check_nvidia_driver, check_driver_cuda,
    check_gpu_visibility, check_gpu_processes, check_throttling, check_library_conflicts, check_cuda_libraries,
    check_placement, check_memory_growth, check_xla_flags, check_nccl_env, check_tf_config,
)


def run_checks(facts: Facts, checks: Sequence[Callable[[Facts], Finding]] = CHECKS) -> List[Finding]:
    """Run each check on ``facts``; a check that raises becomes an ``error`` finding rather than a crash.

    Example:
        >>> [f.status for f in run_checks(Facts(), [check_python])]
        ['ok']
    """
    out = []
    for check in checks:
        try:
            out.append(check(facts))
        except Exception as e:  # noqa: BLE001 - a bug in one check must not hide the others
            name = check.__name__.replace("check_", "")
            out.append(Finding(name, "error", f"the check itself failed: {type(e).__name__}: {e}",
                               "Report this as a keras_scale bug."))
    return out


def report(facts: Facts, checks: Sequence[Callable[[Facts], Finding]] = CHECKS) -> Dict[str, Any]:
    """The JSON-ready report of :func:`doctor` for given facts."""
    visible = set(facts.visible_gpu_indices)
    return {
        "python": facts.python_version,
        "tensorflow": facts.tf_version,
        "keras": facts.tf.get("keras"),
        "nvidia_driver": facts.driver_version,
        "gpus": [dict(dataclasses.asdict(g), visible=g.index in visible) for g in facts.gpus],
        "checks": [f.as_dict() for f in run_checks(facts, checks)],
    }


def doctor(nvml: Any = None, probe_tensorflow: bool = True) -> Dict[str, Any]:
    """Check this machine for training: versions, driver vs CUDA, GPUs, leftover processes, libraries, env vars.

    Returns ``{"python", "tensorflow", "keras", "nvidia_driver", "gpus": [...], "checks": [{"name", "status",
    "detail", "fix"}]}`` with ``status`` in ``ok``/``warn``/``error``/``skip``. TensorFlow is probed in a child
    process (a few seconds), so this process's TensorFlow stays uninitialised.

    Args:
        nvml: an object with the :class:`keras_scale.nvml.Nvml` methods (tests); default: the real NVML.
        probe_tensorflow: False skips the TensorFlow probe (its checks report ``skip``).

    Example:
        >>> report = doctor()
        >>> report["gpus"]  # on a machine without GPUs
        []
        >>> any(c["status"] == "error" for c in report["checks"])
        False
    """
    return report(gather_facts(nvml=nvml, probe_tensorflow=probe_tensorflow))


# ================================================================================================= output
_MARK = {"ok": "ok", "warn": "WARN", "error": "ERROR", "skip": "skip"}


def format_report(rep: Dict[str, Any], width: int = 110) -> str:
    """The human-readable table of a :func:`doctor` report.

    Example:
        >>> print(format_report(doctor()))  # doctest: +SKIP
    """
    lines = ["keras-scale doctor", ""]
    lines.append(f"  python {rep['python']}   tensorflow {rep['tensorflow'] or 'not installed'}   "
                 f"keras {rep['keras'] or 'not installed'}")
    if rep["gpus"]:
        lines.append(f"  NVIDIA driver {rep['nvidia_driver']}")
        for g in rep["gpus"]:
            lines.append(f"  GPU {g['index']}: {g['name']}, {g['memory_total_mb']:.0f} MiB"
                         + ("" if g["visible"] else "  (hidden by CUDA_VISIBLE_DEVICES)"))
    else:
        why = next((c["detail"] for c in rep["checks"] if c["name"] == "nvidia_driver"), "")
        text = "GPUs: none. " + (why if why.startswith("No GPU") else "No GPU present. " + why).strip()
        lines.extend("  " + ln for ln in textwrap.wrap(text, width - 2, subsequent_indent="  "))
    lines.append("")
    name_w = max(len(c["name"]) for c in rep["checks"]) + 2
    detail_w = max(40, width - 8 - name_w)
    lines.append(f"  {'status':<6}  {'check':<{name_w}}detail")
    lines.append(f"  {'-' * 6}  {'-' * (name_w - 2)}  {'-' * min(detail_w, 60)}")
    pad = " " * (10 + name_w)
    for c in rep["checks"]:
        body = textwrap.wrap(c["detail"], detail_w) or [""]
        lines.append(f"  {_MARK[c['status']]:<6}  {c['name']:<{name_w}}{body[0]}")
        lines.extend(pad + b for b in body[1:])
        if c["fix"]:
            fix = textwrap.wrap("fix: " + c["fix"], detail_w)
            lines.extend(pad + b for b in fix)
    counts = {s: sum(1 for c in rep["checks"] if c["status"] == s) for s in STATUSES}
    lines.append("")
    lines.append(f"  {counts['error']} error(s), {counts['warn']} warning(s), {counts['ok']} ok, "
                 f"{counts['skip']} skipped")
    return "\n".join(lines)


def exit_code(rep: Dict[str, Any]) -> int:
    """1 when any check is ``error``, else 0 (warnings do not fail).

    Example:
        >>> exit_code({"checks": [{"status": "warn"}, {"status": "ok"}]})
        0
    """
    return 1 if any(c["status"] == "error" for c in rep["checks"]) else 0


def cli(argv: Sequence[str]) -> int:
    """``keras-scale doctor [--json]``: print the report; exit code 1 only when a check says ``error``.

    Example:
        $ keras-scale doctor --json | python -c "import json,sys; print(json.load(sys.stdin)['gpus'])"
    """
    parser = argparse.ArgumentParser(prog="keras-scale doctor",
                                     description="Check drivers, CUDA, GPUs, leftover processes and env variables.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-tensorflow", action="store_true",
                        help="skip the TensorFlow probe (only NVML and environment checks)")
    args = parser.parse_args(list(argv))
    rep = doctor(probe_tensorflow=not args.no_tensorflow)
    print(json.dumps(rep, indent=2) if args.json else format_report(rep))
    return exit_code(rep)


if __name__ == "__main__":
    if _PROBE_FLAG in sys.argv[1:]:
        # Child process: never import keras_scale modules that sit next to this file as top-level modules.
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        print(_PROBE_MARK + json.dumps(_probe_tensorflow()), flush=True)
        sys.exit(0)
    sys.exit(cli(sys.argv[1:]))
