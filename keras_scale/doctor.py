"""``keras-scale doctor``: check what breaks or slows training on this machine, before a job starts.

Versions and drivers (driver vs the CUDA of the TensorFlow wheel and of the pip CUDA wheels, compute capability vs
the wheel's kernels), the GPUs themselves (ECC errors, compute mode, PCIe link width, power limit, P2P/NVLink,
MIG, leftover processes, throttling), the host that feeds them (CPU cores per GPU, RAM vs GPU memory, NUMA,
storage of the data/checkpoint path, ``/dev/shm``, ``ulimit -l``) and the environment variables that change
behaviour (``CUDA_VISIBLE_DEVICES``, ``TF_GPU_ALLOCATOR``, ``XLA_FLAGS``, ``NCCL_*`` and ``/etc/nccl.conf``,
``TF_CONFIG``).

Two halves: *gathering* facts (NVML, a TensorFlow probe run in a child process, ``/proc`` and ``/sys`` under a
root directory, the environment, installed packages) and *deciding* — one small function per check,
``check_*(facts) -> CheckResult`` — so each decision is tested with fabricated facts. The NVML and host checks
run without TensorFlow. TensorFlow is probed in a child process started first and collected last, so
``doctor()`` leaves the caller's TensorFlow uninitialised and survives a TensorFlow that crashes on import.

Example:
    $ keras-scale doctor                 # a table; exit code 1 when a check says "error"
    $ keras-scale doctor --strict        # exit code 1 on warnings too (CI)
    $ keras-scale doctor --json --path /data --path /ckpt

    >>> import keras_scale as ks
    >>> report = ks.doctor(probe_tensorflow=False)
    >>> sorted(report)[:3]
    ['checks', 'gpus', 'installed']
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import mmap
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from keras_scale._tf_probe import PROBE_MARK as _PROBE_MARK
from keras_scale._tf_probe import SMOKE_OPS
from keras_scale.advice import leftover_processes_message
from keras_scale.host import HostFacts, gather_host_facts, read_text

__all__ = ["doctor", "cli", "CheckResult", "Facts", "HostFacts", "gather_facts", "gather_host_facts", "run_checks",
           "CHECKS", "SMOKE_OPS", "load_driver_minimums", "unknown_xla_flags"]

STATUSES = ("ok", "warn", "error", "skip")
_PROBE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tf_probe.py")
_DATA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data_files", "cuda_driver_minimums.json")


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict: ``status`` is ``ok``, ``warn``, ``error`` or ``skip``; ``fix`` says what to do.

    Example:
        >>> CheckResult("python", "ok", "Python 3.11.9").as_dict()
        {'name': 'python', 'status': 'ok', 'detail': 'Python 3.11.9', 'fix': ''}
    """

    name: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"CheckResult status must be one of {STATUSES}, got {self.status!r}")

    def as_dict(self) -> Dict[str, str]:
        return dataclasses.asdict(self)


@dataclass
class Facts:
    """Everything the checks look at. :func:`gather_facts` fills it from this machine; tests fabricate it.

    ``tf`` is the TensorFlow probe's result (see :func:`keras_scale._tf_probe.probe_tensorflow`):
    ``tf["tensorflow"]`` is None when
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
    health: Dict[int, Any] = field(default_factory=dict)  # index -> keras_scale.nvml.GpuHealth
    links: List[Any] = field(default_factory=list)  # keras_scale.nvml.GpuLink between visible GPUs
    host: Optional[HostFacts] = None
    installed: Dict[str, str] = field(default_factory=dict)  # distribution -> version (importlib.metadata)
    requirements: Optional[List[str]] = None  # importlib.metadata.requires("keras-scale"); None: not installed
    xla_unknown_flags: Optional[List[str]] = None  # XLA_FLAGS names TensorFlow's XLA does not define; None: unchecked
    xla_flag_kinds: Dict[str, str] = field(default_factory=dict)  # XLA_FLAGS name -> "bool", "integer", "string"...
    tf_xla_unknown_flags: Optional[List[str]] = None  # TF_XLA_FLAGS names TensorFlow does not define; None: unchecked
    nccl_conf: Dict[str, Tuple[str, str]] = field(default_factory=dict)  # NCCL variable -> (value, where it is set)
    gpu_errors: Dict[int, str] = field(default_factory=dict)  # GPU index -> why NVML cannot read it (GPU lost)
    tf_wheel_floors: Dict[str, str] = field(default_factory=dict)  # NVIDIA wheel -> lowest version TensorFlow takes
    gpu_order_uncertain: Optional[str] = None  # why CUDA_VISIBLE_DEVICES' numbers cannot be mapped to NVML's

    @property
    def visible_gpus(self) -> List[Any]:
        if self.gpu_order_uncertain:
            return []  # which GPUs CUDA_VISIBLE_DEVICES selects is unknown: check none rather than the wrong ones
        return [g for g in self.gpus if g.index in set(self.visible_gpu_indices) and g.index not in self.gpu_errors]

    @property
    def tf_version(self) -> Optional[str]:
        return self.tf.get("tensorflow")

    @property
    def tf_gpus(self) -> Optional[List[str]]:
        return self.tf.get("gpus") if self.tf_version else None


# ================================================================================================ gathering
def load_driver_minimums(path: str = _DATA_FILE) -> Dict[str, Dict[str, str]]:
    """The driver-minimum table as ``{"toolkit": {"12.5.1": "555.42.06", ...}, "minor_version_compatibility":
    {"12": "525.60.13", ...}}``; the data file also names each row's release and source.

    Example:
        >>> load_driver_minimums()["toolkit"]["12.5.1"]
        '555.42.06'
    """
    with open(path) as f:
        data = json.load(f)
    return {section: {k: row["driver"] for k, row in data[section].items()}
            for section in ("toolkit", "minor_version_compatibility")}


_LOG_HINT = re.compile(
    r"Could not load dynamic library|Cannot dlopen|Could not find cuda drivers|failed call to cuInit|"
    r"Loaded runtime CuDNN library|cuDNN.*version|Could not find TensorRT|libcu\w+\.so|Unknown flags? in|"
    r"PTX version|UNSUPPORTED_PTX|older than the PTX compiler|no kernel image|to read flags for environment",
    re.IGNORECASE)


# "Created device /job:localhost/replica:0/task:0/device:GPU:0 with 79078 MB memory:  -> device: 0, name: NVIDIA H100
# 80GB HBM3, pci bus id: 0000:18:00.0, compute capability: 9.0"
_CREATED_GPU = re.compile(r"Created device \S*device:GPU:(\d+) with .*?name: (.*?), pci bus id: ([0-9A-Fa-f:.]+)")


class _TfProbe:
    """The TensorFlow probe as a child process: started first, collected after the other facts are gathered."""

    def __init__(self, timeout_s: float = 180.0) -> None:
        self.timeout_s = timeout_s
        self.started_s = time.perf_counter()
        # TensorFlow's INFO log names each GPU's PCI bus id and the libraries it failed to load: keep it on
        self.proc = subprocess.Popen([sys.executable, _PROBE_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0"))

    def result(self) -> Dict[str, Any]:
        left = max(1.0, self.timeout_s - (time.perf_counter() - self.started_s))
        try:
            stdout, stderr = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            stdout, stderr = self.proc.communicate()
            return _probe_result(stdout, stderr, self.proc.returncode, timed_out_s=self.timeout_s)
        return _probe_result(stdout, stderr, self.proc.returncode)


def _probe_result(stdout: str, stderr: str, returncode: Optional[int],
                  timed_out_s: Optional[float] = None) -> Dict[str, Any]:
    """The probe's last reported state, with TensorFlow's telling log lines; a crash or hang said plainly."""
    result: Optional[Dict[str, Any]] = None
    for line in stdout.splitlines():
        if line.startswith(_PROBE_MARK):
            result = json.loads(line[len(_PROBE_MARK):])
    hints = [ln.strip()[:300] for ln in stderr.splitlines() if _LOG_HINT.search(ln)]
    created = [m.groups() for m in _CREATED_GPU.finditer(stderr)]
    finished = result is not None and result.get("stage") in ("done", "import")
    if result is None or not finished:
        stage = (result or {}).get("stage", "start-up")
        why = (f"did not finish within {timed_out_s:.0f} s (hung at: {stage})" if timed_out_s else
               f"exited with code {returncode} at: {stage}")
        tail = " | ".join(stderr.strip().splitlines()[-5:])[-800:]
        if result is None:
            result = {"tensorflow": None}
        result.update(crashed=True, error=f"the TensorFlow probe {why}: {tail}")
    result["log_hints"] = hints[:12]
    if created:
        result["gpu_pci_bus_ids"] = {i: bus for i, _, bus in created}
        result["gpu_names"] = {i: name for i, name, _ in created}
    return result


def _run_tf_probe(timeout_s: float = 180.0) -> Dict[str, Any]:
    """Run :func:`keras_scale._tf_probe.probe_tensorflow` in a child Python and wait for its result."""
    return _TfProbe(timeout_s).result()


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


def _tf_library_paths(prefix: str = "libtensorflow_framework.so") -> List[str]:
    """TensorFlow's shared library whose name starts with ``prefix``, found without importing TensorFlow:
    ``libtensorflow_framework.so`` defines the XLA flags (``XLA_FLAGS``), ``libtensorflow_cc.so`` TensorFlow's own
    (``TF_XLA_FLAGS``)."""
    try:
        spec = importlib.util.find_spec("tensorflow")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    out = []
    for d in spec.submodule_search_locations:
        try:
            out.extend(os.path.join(d, f) for f in sorted(os.listdir(d)) if f.startswith(prefix))
        except OSError:
            continue
    return out[:1]


def _xla_tokens(value: str) -> Tuple[List[str], Optional[str]]:
    """The tokens of an ``XLA_FLAGS``/``TF_XLA_FLAGS`` value as XLA reads them, and what is wrong with the value as
    a whole. XLA treats a value that does not start with ``-`` as the name of a file holding the flags (and aborts
    with "Could not open file" when there is none); quotes group a value with spaces."""
    value = value.strip()
    problem = None
    if value and not value.startswith("-"):
        if os.path.isfile(value):
            try:
                with open(value) as f:
                    value = f.read().strip()
            except OSError as e:
                return [], f"{value!r} is read as a flags file, which cannot be read ({e})"
        else:
            return [], (f"{value!r} does not start with '--', so XLA reads it as the name of a file holding the "
                        "flags; there is no such file, and XLA aborts ('Could not open file ... to read flags')")
    try:
        return shlex.split(value), problem
    except ValueError as e:
        return value.split(), f"cannot be parsed ({e}): unbalanced quotes"


def _xla_flag_names(value: str) -> List[str]:
    """Flag names in an ``XLA_FLAGS`` value, tokenised as XLA does (quotes group a value with spaces)."""
    return [t[2:].split("=", 1)[0] for t in _xla_tokens(value)[0] if t.startswith("--")]


def unknown_xla_flags(value: str, libraries: Sequence[str], whole_word: bool = False) -> Optional[List[str]]:
    """Names in ``XLA_FLAGS`` (or ``TF_XLA_FLAGS``) that the TensorFlow ``libraries`` do not define (XLA aborts
    on them); None when no library could be read. ``whole_word`` looks for the name as a whole C string.

    Example:
        >>> unknown_xla_flags("--xla_gpu_autotune_level=2", [])  # no library to look in
    """
    names = [n for n in _xla_flag_names(value) if n]
    for path in libraries:
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return [n for n in names if m.find((b"\0" if whole_word else b"") + n.encode() + b"\0") < 0]
        except (OSError, ValueError):
            continue
    return None


# TF_XLA_FLAGS that take a value (tensorflow/compiler/jit/flags.cc; the rest are true/false): given alone, TensorFlow
# aborts ("Unknown flag in TF_XLA_FLAGS: --tf_xla_auto_jit", checked with TF 2.21).
_TF_XLA_VALUE_FLAGS = {"tf_xla_auto_jit", "tf_xla_min_cluster_size", "tf_xla_max_cluster_size",
                       "tf_xla_clustering_fuel", "tf_xla_ops_to_cluster", "tf_xla_cluster_exclude_ops",
                       "tf_xla_persistent_cache_directory", "tf_xla_persistent_cache_device_types",
                       "tf_xla_persistent_cache_prefix"}

# google.protobuf FieldDescriptorProto.Type -> what a flag of that field takes
_PROTO_KINDS = {8: "bool", 1: "float", 2: "float", 3: "integer", 4: "integer", 5: "integer", 13: "integer",
                17: "integer", 18: "integer", 9: "string", 12: "string", 14: "enum", 11: "message"}


def _varint(m: Any, i: int) -> Tuple[int, int]:
    value, shift = 0, 0
    while i < len(m):
        b = m[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            break
        shift += 7
    return value, i


def xla_flag_kinds(names: Sequence[str], libraries: Sequence[str]) -> Dict[str, str]:
    """What each XLA flag takes (``"bool"``, ``"integer"``, ``"float"``, ``"string"``, ``"enum"``), read from the
    ``DebugOptions`` protocol-buffer descriptor inside TensorFlow's XLA (each flag is a field of it). Only a
    ``bool`` flag may be given without ``=value``; XLA aborts on ``--xla_gpu_autotune_level`` alone. Names not
    found are left out.

    Example:
        >>> xla_flag_kinds(["xla_gpu_autotune_level"], [])
        {}
    """
    out: Dict[str, str] = {}
    for path in libraries:
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                for name in names:
                    raw = name.encode()
                    if not raw or len(raw) > 127:
                        continue
                    # FieldDescriptorProto: name (1, bytes), number (3, varint), label (4), type (5)
                    at = m.find(b"\n" + bytes([len(raw)]) + raw + b"\x18")
                    if at < 0:
                        continue
                    _, i = _varint(m, at + len(raw) + 3)
                    if m[i:i + 1] != b" ":
                        continue
                    _, i = _varint(m, i + 1)
                    if m[i:i + 1] != b"(":
                        continue
                    kind, _ = _varint(m, i + 1)
                    out[name] = _PROTO_KINDS.get(kind, "other")
            return out
        except (OSError, ValueError):
            continue
    return out


def _read_nccl_conf(env: Mapping[str, str], root: str = "/") -> Dict[str, Tuple[str, str]]:
    """NCCL settings as NCCL sees them: ``/etc/nccl.conf``, then ``~/.nccl.conf`` (or ``NCCL_CONF_FILE``), then
    the environment, each overriding the one before."""
    out: Dict[str, Tuple[str, str]] = {}
    files = ["/etc/nccl.conf", env.get("NCCL_CONF_FILE") or os.path.join(env.get("HOME", "~"), ".nccl.conf")]
    for path in files:
        text = read_text(root, path) if path.startswith("/") else None
        for line in (text or "").splitlines():
            line = line.split("#", 1)[0].strip()
            if "=" in line:
                key, value = (x.strip() for x in line.split("=", 1))
                if key.startswith("NCCL_"):
                    out[key] = (value, path)
    for key, value in env.items():
        if key.startswith("NCCL_") and key != "NCCL_CONF_FILE":
            out[key] = (value, "environment")
    return dict(sorted(out.items()))


_VERSIONED = ("tensorflow", "tensorflow-cpu", "tf-nightly", "keras", "keras-nightly", "nvidia-ml-py", "keras-scale")


def _installed_versions() -> Dict[str, str]:
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _requirements() -> Optional[List[str]]:
    try:
        return list(importlib.metadata.requires("keras-scale") or [])
    except importlib.metadata.PackageNotFoundError:
        return None


def _health_and_links(nv: Any, gpus: Sequence[Any], visible: Sequence[int]) -> Tuple[Dict[int, Any], List[Any]]:
    """Per-GPU state and the links between visible GPUs; a GPU or pair NVML fails on is left out (its checks
    then say "not reported") rather than costing the other readings."""
    health: Dict[int, Any] = {}
    for g in gpus:
        try:
            health[g.index] = nv.health(g.index)
        except Exception:  # noqa: BLE001 - e.g. a GPU fallen off the bus, an nvidia-ml-py without a function
            pass
    links = []
    for i, a in enumerate(visible):
        for b in visible[i + 1:]:
            try:
                links.append(nv.link(a, b))
            except Exception:  # noqa: BLE001
                pass
    return health, links


def gather_facts(nvml: Any = None, probe_tensorflow: bool = True, root: str = "/", paths: Sequence[str] = (),
                 progress: Callable[[str], None] = lambda msg: None) -> Facts:
    """Collect :class:`Facts` from this machine: NVML, the TensorFlow probe, host, environment, packages.

    Args:
        nvml: an object with the :class:`keras_scale.nvml.Nvml` methods (tests pass a fake); default opens
            the real NVML.
        probe_tensorflow: run the TensorFlow probe (a child process, started first and collected last).
        root: where ``/proc``, ``/sys`` and ``/etc`` are read from.
        paths: data/checkpoint paths to classify (default: the working directory).
        progress: called with a short message as each stage starts (the CLI prints them on stderr).

    Example:
        >>> facts = gather_facts(probe_tensorflow=False)
        >>> facts.gpus  # on a machine without GPUs  # doctest: +SKIP
        []
    """
    from keras_scale import nvml as nvml_lib

    env = dict(os.environ)
    facts = Facts(env=env, python_executable=sys.executable)
    probe = None
    if probe_tensorflow:
        progress("starting the TensorFlow probe (a child process: import, GPUs, 4 smoke ops per device)")
        probe = _TfProbe()
    progress("reading the GPUs through NVML")
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
            facts.gpu_errors = dict(getattr(nv, "device_errors", None) or {})
            order, why = nvml_lib.cuda_order(facts.gpus, env)
            facts.visible_gpu_indices = nvml_lib.visible_gpu_indices(facts.gpus, env, order)
            if why and _numbered_entries(env):
                facts.gpu_order_uncertain = why
            skip_pids = {os.getpid()} | ({probe.proc.pid} if probe is not None else set())
            for g in facts.gpus:
                if g.index in facts.gpu_errors:
                    continue
                try:  # per GPU: one GPU fallen off the bus must not cost the others their checks
                    facts.processes.extend(p for p in nv.processes(g.index) if p.pid not in skip_pids)
                    facts.samples[g.index] = nv.sample(g.index)
                except Exception as e:  # noqa: BLE001
                    facts.gpu_errors[g.index] = f"{type(e).__name__}: {e}"
            healthy = [g for g in facts.gpus if g.index not in facts.gpu_errors]
            pairs = [g.index for g in healthy] if facts.gpu_order_uncertain else [
                i for i in facts.visible_gpu_indices if i not in facts.gpu_errors]
            facts.health, facts.links = _health_and_links(nv, healthy, pairs)
        except Exception as e:  # noqa: BLE001 - NVML half-working: report it, keep going
            facts.nvml_error, facts.nvml_error_kind = f"NVML query failed: {type(e).__name__}: {e}", "other"
        finally:
            if owned:
                nv.close()
    progress("reading the host: CPUs, memory, NUMA, storage, /dev/shm")
    facts.host = gather_host_facts(root=root, paths=paths, gpus=facts.gpus)
    progress("reading packages, libraries and settings")
    facts.pip_nvidia_packages = _pip_nvidia_packages()
    facts.tf_wheel_floors = _tf_wheel_floors()
    facts.ld_cuda_dirs = _ld_cuda_dirs(env)
    facts.conda_cuda_packages = _conda_cuda_packages(env, list(facts.ld_cuda_dirs))
    facts.net_interfaces = _net_interfaces()
    facts.installed = _installed_versions()
    facts.requirements = _requirements()
    facts.nccl_conf = _read_nccl_conf(env, root)
    if env.get("XLA_FLAGS", "").strip():
        facts.xla_unknown_flags = unknown_xla_flags(env["XLA_FLAGS"], _tf_library_paths())
        facts.xla_flag_kinds = xla_flag_kinds(_xla_flag_names(env["XLA_FLAGS"]), _tf_library_paths())
    if env.get("TF_XLA_FLAGS", "").strip():
        facts.tf_xla_unknown_flags = unknown_xla_flags(env["TF_XLA_FLAGS"], _tf_library_paths("libtensorflow_cc.so"),
                                                       whole_word=True)
    if probe is not None:
        progress("waiting for the TensorFlow probe")
        facts.tf = probe.result()
        _visible_from_tensorflow(facts)
    return facts


def _numbered_entries(env: Mapping[str, str]) -> bool:
    """``CUDA_VISIBLE_DEVICES`` selects GPUs by number (whose meaning depends on ``CUDA_DEVICE_ORDER``)."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    return raw is not None and any(e.strip().isdigit() for e in raw.split(","))


def _visible_from_tensorflow(facts: Facts) -> None:
    """Where CUDA's numbering is a guess (mixed GPU models, ``FASTEST_FIRST``), take the GPUs TensorFlow actually
    got from the PCI bus ids it logged (or their names, when each is unique here)."""
    if not facts.gpu_order_uncertain or not facts.tf_gpus:
        return
    from keras_scale.nvml import pci_key

    by_bus = {pci_key(g.pci_bus_id): g.index for g in facts.gpus if pci_key(g.pci_bus_id)}
    buses = facts.tf.get("gpu_pci_bus_ids") or {}
    names = facts.tf.get("gpu_names") or {}
    found = []
    for i in range(len(facts.tf_gpus)):
        hit = by_bus.get(pci_key(buses.get(str(i), "")))
        if hit is None:
            same = [g.index for g in facts.gpus if g.name == names.get(str(i))]
            hit = same[0] if len(same) == 1 else None
        if hit is None:
            return  # cannot tell: keep saying so
        found.append(hit)
    facts.visible_gpu_indices = found
    facts.gpu_order_uncertain = None


# ================================================================================================== checks
def _ver(text: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text or ""))


def _no_tf(f: Facts, name: str) -> Optional[CheckResult]:
    if f.tf_version is None:
        why = "TensorFlow is not installed" if not f.tf.get("crashed") else "TensorFlow failed to start"
        if not f.tf:
            why = "TensorFlow was not probed"
        return CheckResult(name, "skip", f"{why}; this check needs it.")
    return None


#: the lowest Python keras_scale supports: pyproject.toml's ``requires-python`` (tests/test_packaging.py checks both)
PYTHON_FLOOR = (3, 10)


def check_python(f: Facts) -> CheckResult:
    """Python version (TensorFlow 2.21 wheels exist for 3.10-3.13; keras_scale requires :data:`PYTHON_FLOOR`)."""
    v = _ver(f.python_version)
    detail = f"Python {f.python_version}" + (f" ({f.python_executable})" if f.python_executable else "")
    if v[:2] < PYTHON_FLOOR:
        floor = ".".join(map(str, PYTHON_FLOOR))
        return CheckResult("python", "warn", detail,
                           f"keras_scale and recent TensorFlow wheels need Python >= {floor}; use a newer Python.")
    return CheckResult("python", "ok", detail)


def check_tensorflow(f: Facts) -> CheckResult:
    """TensorFlow importable (missing: warn and go on; crashing on import: error)."""
    if f.tf_version:
        return CheckResult("tensorflow", "ok", f"TensorFlow {f.tf_version}")
    if not f.tf:
        return CheckResult("tensorflow", "skip", "TensorFlow was not probed.")
    err = f.tf.get("error") or "unknown error"
    if "No module named 'tensorflow'" in err:
        return CheckResult("tensorflow", "warn", "TensorFlow is not installed; the NVML checks still ran, the "
                       "TensorFlow checks are skipped.", "pip install 'tensorflow[and-cuda]' (Linux with GPUs) or "
                       "pip install tensorflow")
    if _flags_kill_tensorflow(f):
        return CheckResult("tensorflow", "error", f"TensorFlow aborts at start-up on its flags, not a broken install "
                           f"(see xla_flags): {err}", "Correct or unset TF_XLA_FLAGS / XLA_FLAGS as the xla_flags "
                           "check says; TensorFlow itself is fine.")
    return CheckResult("tensorflow", "error", f"TensorFlow fails to import: {err}",
                   "Reinstall it in a clean virtualenv: pip install 'tensorflow[and-cuda]'; see the cuda_libraries "
                   "check for library problems.")


def _flags_kill_tensorflow(f: Facts) -> bool:
    """TF_XLA_FLAGS / XLA_FLAGS hold something TensorFlow aborts on (so a crash is theirs, not the install's)."""
    hints = [h for h in f.tf.get("log_hints") or [] if "Unknown flag" in h or "to read flags" in h]
    return bool(hints or _xla_flag_errors(f))


def check_keras(f: Facts) -> CheckResult:
    """Keras 3 with the TensorFlow backend."""
    if no := _no_tf(f, "keras"):
        return no
    if f.tf.get("keras") is None:
        return CheckResult("keras", "error", f"Keras fails to import: {f.tf.get('keras_error')}",
                           f"pip install 'keras>={_floors(f).get('keras', '3')}'")
    version, backend = f.tf["keras"], f.tf.get("keras_backend") or "?"
    if _ver(version)[:1] < (3,):
        return CheckResult("keras", "error", f"Keras {version}: keras_scale needs Keras 3.",
                           f"pip install 'keras>={_floors(f).get('keras', '3')}'")
    if backend != "tensorflow":
        return CheckResult("keras", "warn", f"Keras {version} uses the {backend!r} backend; keras_scale needs "
                       "'tensorflow'.", "export KERAS_BACKEND=tensorflow (or set \"backend\" in ~/.keras/keras.json)")
    return CheckResult("keras", "ok", f"Keras {version}, backend tensorflow")


def check_tf_build(f: Facts) -> CheckResult:
    """How the TensorFlow wheel was built (CUDA/cuDNN versions, or CPU-only)."""
    if no := _no_tf(f, "tf_build"):
        return no
    b = f.tf.get("build") or {}
    if not b.get("is_cuda_build"):
        if f.gpus:
            return CheckResult("tf_build", "error", f"This TensorFlow {f.tf_version} is a CPU-only build, but the "
                           f"machine has {len(f.gpus)} NVIDIA GPU(s).",
                           "pip install 'tensorflow[and-cuda]' (in a clean virtualenv)")
        return CheckResult("tf_build", "ok", "CPU-only TensorFlow build (no GPU on this machine either)")
    return CheckResult("tf_build", "ok", f"built for CUDA {b.get('cuda_version')}, cuDNN {b.get('cudnn_version')}")


def check_nvidia_driver(f: Facts) -> CheckResult:
    """The NVIDIA driver as NVML reports it — or, plainly, that there is no GPU."""
    if f.nvml_error:
        if f.nvml_error_kind == "no_driver":
            return CheckResult("nvidia_driver", "skip", f"No GPU present: {f.nvml_error}. Training runs on the CPU.")
        if f.nvml_error_kind == "no_module":
            return CheckResult("nvidia_driver", "warn", f"Cannot check the GPUs: {f.nvml_error}.",
                           "pip install nvidia-ml-py")
        if re.search(r"GpuIsLost|GPU is lost|fallen off the bus", f.nvml_error, re.IGNORECASE):
            return CheckResult("nvidia_driver", "error", f"NVML fails because a GPU is lost (fallen off the bus, Xid "
                               f"79): {f.nvml_error}.", "Drain the node: `sudo dmesg | grep -i xid` shows which GPU; "
                               "reset it (`sudo nvidia-smi -r -i <index>`) or reboot; no driver reinstall needed.")
        return CheckResult("nvidia_driver", "error", f"The NVIDIA driver is installed but not usable: {f.nvml_error}.",
                       "Run `nvidia-smi`; reboot after a driver update, or reinstall the driver.")
    if not f.gpus:
        return CheckResult("nvidia_driver", "skip", f"NVIDIA driver {f.driver_version} but no GPU present.")
    cuda = f.cuda_driver_version
    return CheckResult("nvidia_driver", "ok", f"driver {f.driver_version}, supports CUDA up to "
                   f"{'%d.%d' % cuda if cuda else '?'}; {len(f.gpus)} GPU(s): "
                   + ", ".join(sorted({g.name for g in f.gpus})))


def check_driver_cuda(f: Facts, minimums: Optional[Dict[str, Dict[str, str]]] = None) -> CheckResult:
    """Does the driver support the CUDA version the TensorFlow wheel was built for? (table in data_files/)."""
    name = "driver_vs_cuda"
    if not f.driver_version:
        return CheckResult(name, "skip", "No NVIDIA driver to compare.")
    if no := _no_tf(f, name):
        return no
    b = f.tf.get("build") or {}
    if not b.get("is_cuda_build") or not b.get("cuda_version"):
        return CheckResult(name, "skip", "TensorFlow is not a CUDA build.")
    table = minimums or load_driver_minimums()
    wheel = _ver(str(b["cuda_version"]))
    key = str(b["cuda_version"])
    drv = _ver(f.driver_version)
    toolkit_min = _toolkit_minimum(table, key)
    compat_min = table["minor_version_compatibility"].get(str(wheel[0]))
    if toolkit_min is None and compat_min is None:
        return CheckResult(name, "skip", f"No driver minimum known for CUDA {b['cuda_version']}; update "
                       "keras_scale/data_files/cuda_driver_minimums.json.")
    cuda_max = f.cuda_driver_version
    if cuda_max and cuda_max[0] < wheel[0]:
        return CheckResult(name, "error", f"Driver {f.driver_version} supports CUDA up to {cuda_max[0]}.{cuda_max[1]}, "
                       f"but TensorFlow {f.tf_version} was built for CUDA {b['cuda_version']}: no GPU will work.",
                       f"Upgrade the NVIDIA driver to >= {toolkit_min or compat_min}.")
    # the x.0 toolkit's own driver can predate the minor-compatibility floor (11.0 GA: 450.51.05 < 450.80.02)
    floor = min((m for m in (compat_min, toolkit_min) if m), key=_ver)
    if drv < _ver(floor):
        return CheckResult(name, "error", f"Driver {f.driver_version} is too old for CUDA {b['cuda_version']} "
                       f"(TensorFlow {f.tf_version}): CUDA {wheel[0]}.x needs >= {floor}.",
                       f"Upgrade the NVIDIA driver to >= {toolkit_min or floor}.")
    same_minor = _ptx_driver_minimum(table, key)
    if toolkit_min and same_minor and _ver(same_minor) <= drv < _ver(toolkit_min):
        return CheckResult(name, "warn", f"Driver {f.driver_version} is of the same CUDA {wheel[0]}.{wheel[1]} "
                           f"release as TensorFlow's CUDA {key}, which shipped with {toolkit_min}: same PTX ISA, so "
                           "kernels and PTX JIT work; the newer driver's fixes are missing.",
                           f"Upgrade the NVIDIA driver to >= {toolkit_min} when convenient.")
    if toolkit_min and drv < _ver(toolkit_min):
        return CheckResult(name, "warn", f"Driver {f.driver_version} runs CUDA {b['cuda_version']} only through minor "
                       f"version compatibility (CUDA {key} shipped with {toolkit_min}): PTX JIT for newer GPUs and "
                       "some XLA kernels can fail (CUDA_ERROR_UNSUPPORTED_PTX_VERSION).",
                       f"Upgrade the NVIDIA driver to >= {toolkit_min}.")
    return CheckResult(name, "ok", f"driver {f.driver_version} >= {toolkit_min} needed by CUDA {b['cuda_version']}")


def _no_visible(f: Facts) -> str:
    if f.gpu_order_uncertain:
        return "Which GPU(s) CUDA_VISIBLE_DEVICES selects is uncertain (see gpu_visibility); not checked."
    return "No visible GPU."


def _mig_known(f: Facts, entry: str) -> bool:
    """A ``MIG-<uuid>`` (or ``MIG-GPU-<uuid>/<gi>/<ci>``) entry that names an instance NVML lists here."""
    e = entry.strip().upper()
    if e.startswith("MIG-GPU-"):
        return any(g.uuid.upper() == e[4:].split("/")[0] for g in f.gpus)
    return any(m.upper().startswith(e) for g in f.gpus for m in g.mig_uuids)


def check_gpus_responding(f: Facts) -> CheckResult:
    """Each GPU answers NVML: one that does not (fallen off the bus: Xid 79, "GPU is lost") is reported by number,
    and the other GPUs are still checked."""
    name = "gpus_responding"
    if not f.gpus:
        return CheckResult(name, "skip", "No GPU present.")
    if f.gpu_errors:
        lost = []
        for i, why in sorted(f.gpu_errors.items()):
            gone = re.search(r"lost|fallen|off the bus|Unknown Error", why, re.IGNORECASE)
            lost.append(f"GPU {i} does not answer NVML ({why})" + (": fallen off the bus (Xid 79?)" if gone else ""))
        return CheckResult(name, "error", f"{'; '.join(lost)}. The other {len(f.gpus) - len(f.gpu_errors)} GPU(s) "
                           "were checked.",
                           "Drain the node: `nvidia-smi` and `sudo dmesg | grep -i xid` show what happened; reset the "
                           "GPU (`sudo nvidia-smi -r -i <index>`) or reboot; if it returns, RMA it. Meanwhile "
                           "exclude it with CUDA_VISIBLE_DEVICES.")
    return CheckResult(name, "ok", f"All {len(f.gpus)} GPU(s) answer NVML.")


def check_gpu_visibility(f: Facts) -> CheckResult:
    """GPUs seen by NVML vs by TensorFlow, and why they differ."""
    name = "gpu_visibility"
    n, v = len(f.gpus), len(f.visible_gpu_indices)
    cvd = f.env.get("CUDA_VISIBLE_DEVICES")
    cvd_text = f"CUDA_VISIBLE_DEVICES={cvd!r}" if cvd is not None else "CUDA_VISIBLE_DEVICES unset"
    t = len(f.tf_gpus) if f.tf_gpus is not None else None
    if n == 0 and not t:
        return CheckResult(name, "skip", "No GPU present (NVML sees none" + (", TensorFlow sees none" if t == 0 else "")
                       + "): training runs on the CPU.")
    if n == 0:
        if t is None:
            return CheckResult(name, "skip", "NVML sees no GPU; TensorFlow not available to compare.")
        fix = ("Install nvidia-ml-py and check `nvidia-smi` works for this user." if f.nvml_error_kind == "no_module"
               else "Run `nvidia-smi`: a GPU in a bad state (Xid errors in `sudo dmesg`) makes NVML fail for all.")
        return CheckResult(name, "warn", f"TensorFlow sees {t} GPU(s) but NVML none ({f.nvml_error or 'no devices'}).",
                           fix)
    tf_text = "" if t is None else f"; TensorFlow sees {t}"
    if f.gpu_order_uncertain:
        return CheckResult(name, "warn", f"{cvd_text} selects GPUs by number, but {f.gpu_order_uncertain}: which "
                           f"GPU(s) it selects cannot be told without TensorFlow's view, so the per-GPU checks are "
                           f"skipped{tf_text}.",
                           "export CUDA_DEVICE_ORDER=PCI_BUS_ID (numbers then match nvidia-smi), or select GPUs by "
                           "UUID (CUDA_VISIBLE_DEVICES=GPU-..., `nvidia-smi -L`); run the doctor with TensorFlow to "
                           "see which GPU it gets.")
    if v == 0 and cvd is not None:
        migs = [e.strip() for e in cvd.split(",") if e.strip().upper().startswith("MIG-")]
        if migs and (_mig_known(f, migs[0]) or t):  # TensorFlow got it, or NVML knows it but not which GPU
            return CheckResult(name, "ok" if t else "warn", f"{cvd_text} selects MIG instance(s) that NVML could not "
                               f"map to one GPU here{tf_text}; the per-GPU checks are skipped.",
                               "" if t else "Compare with `nvidia-smi -L` (inside the container, if any).")
        if migs:
            why = f"names MIG instance {migs[0]}, which no GPU here has (a stale or mistyped UUID)"
            fix = "List the MIG instances with `nvidia-smi -L` and use one of their MIG-<uuid> names."
        elif cvd.strip() in ("", "-1"):
            why = "hides every GPU"
            fix = ("Unset CUDA_VISIBLE_DEVICES or list the GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0,1 (if this job "
                   "is meant to run on the CPU, ignore this)")
        else:
            why = f"matches none of the {n} GPU(s) (indices 0-{n - 1}; CUDA stops at the first entry it cannot match)"
            fix = "List valid GPU indices or UUIDs (`nvidia-smi -L`), e.g. CUDA_VISIBLE_DEVICES=0,1"
        return CheckResult(name, "error", f"{cvd_text} {why}: training runs on the CPU although NVML sees {n} "
                           f"GPU(s){tf_text}.", fix)
    if t is None:
        return CheckResult(name, "skip", f"NVML sees {n} GPU(s), {v} visible ({cvd_text}); TensorFlow not available "
                       "to compare.")
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
        return CheckResult(name, "error", f"NVML sees {n} GPU(s) ({v} visible, {cvd_text}) but TensorFlow sees none: "
                       f"{why}.", fix)
    if t < v:
        return CheckResult(name, "warn", f"TensorFlow sees {t} of the {v} visible GPU(s) ({cvd_text}).",
                       "Check `nvidia-smi` for GPUs in a bad state and the TensorFlow log for skipped devices "
                       "(e.g. compute capability too old).")
    return CheckResult(name, "ok", f"NVML sees {n} GPU(s), {v} visible ({cvd_text}), TensorFlow sees {t}.")


def check_gpu_processes(f: Facts) -> CheckResult:
    """Other processes already holding GPU memory (the leftover-run trap)."""
    name = "gpu_processes"
    if not f.gpus:
        return CheckResult(name, "skip", "No GPU present.")
    visible = set(f.visible_gpu_indices)
    procs = f.processes if f.gpu_order_uncertain else [p for p in f.processes if p.gpu_index in visible]
    hidden = len({p.pid for p in f.processes} - {p.pid for p in procs})
    if not procs:
        return CheckResult(name, "ok", "No other process holds memory on the visible GPU(s)" + (
            f" ({hidden} process(es) use GPUs hidden by CUDA_VISIBLE_DEVICES)." if hidden else "."))
    what, fix = leftover_processes_message(procs, f.visible_gpu_indices)
    return CheckResult(name, "warn", f"Processes already hold GPU memory: {what}.", fix + ".")


def check_throttling(f: Facts) -> CheckResult:
    """Clocks currently lowered by temperature, power cap or hardware slowdown."""
    name = "throttling"
    if not f.samples:
        return CheckResult(name, "skip", "No GPU present.")
    bad = []
    for index, s in sorted(f.samples.items()):
        reasons = s.throttle_reasons()
        if reasons:
            extra = f", {s.temperature_c:.0f} C" if s.temperature_c is not None else ""
            bad.append(f"GPU {index}: {', '.join(reasons)}{extra}")
    if bad:
        return CheckResult(name, "warn", "Throttled now: " + "; ".join(bad) + ".",
                       "Check cooling and the power limit: nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER")
    temps = [s.temperature_c for s in f.samples.values() if s.temperature_c is not None]
    return CheckResult(name, "ok", "No GPU is throttled" + (f" (max {max(temps):.0f} C)." if temps else "."))


def check_library_conflicts(f: Facts) -> CheckResult:
    """conda CUDA/cuDNN libraries on LD_LIBRARY_PATH together with pip NVIDIA wheels."""
    name = "library_conflicts"
    pip = f.pip_nvidia_packages
    conda = {p: pkgs for p, pkgs in f.conda_cuda_packages.items()}
    conda_dirs = [d for d in f.ld_cuda_dirs if any(d.startswith(p.rstrip("/") + "/") for p in conda)
                  or re.search(r"conda|mamba|miniforge", d, re.IGNORECASE)]
    other_dirs = [d for d in f.ld_cuda_dirs if d not in conda_dirs]
    if pip and (conda_dirs or conda):
        where = "; ".join(f"{p}: {', '.join(v)}" for p, v in conda.items()) or ", ".join(conda_dirs)
        return CheckResult(name, "warn", f"conda CUDA packages ({where}) alongside pip NVIDIA wheels "
                       f"({', '.join(pip[:4])}{'...' if len(pip) > 4 else ''})"
                       + (f"; on LD_LIBRARY_PATH: {', '.join(conda_dirs)}" if conda_dirs else "")
                       + ". The first library found wins, so TensorFlow may load a cuDNN/CUDA other than the one "
                         "it was built for.",
                       "Use one source: `conda remove cudatoolkit cudnn` (keep the pip wheels from "
                       "'tensorflow[and-cuda]'), or drop the conda lib dir from LD_LIBRARY_PATH.")
    if pip and other_dirs:
        return CheckResult(name, "warn", f"CUDA libraries on LD_LIBRARY_PATH ({', '.join(other_dirs)}) shadow the pip "
                       "NVIDIA wheels TensorFlow was built with.",
                       "Remove those directories from LD_LIBRARY_PATH unless you built TensorFlow against them.")
    src = "pip NVIDIA wheels" if pip else ("LD_LIBRARY_PATH: " + ", ".join(f.ld_cuda_dirs) if f.ld_cuda_dirs
                                           else "no CUDA libraries installed outside the driver")
    return CheckResult(name, "ok", f"One source of CUDA libraries ({src}).")


def check_cuda_libraries(f: Facts) -> CheckResult:
    """What TensorFlow said while loading CUDA/cuDNN (missing libraries, cuDNN version mismatch)."""
    name = "cuda_libraries"
    if not f.tf:
        return CheckResult(name, "skip", "TensorFlow was not probed.")
    hints = f.tf.get("log_hints") or []
    mismatch = [h for h in hints if "Loaded runtime CuDNN library" in h]
    missing = [h for h in hints if re.search(r"Could not load dynamic library|Cannot dlopen", h)]
    if mismatch:
        return CheckResult(name, "error", "cuDNN version mismatch: " + mismatch[0],
                       "Install the cuDNN TensorFlow was built for (pip install 'tensorflow[and-cuda]') and remove "
                       "other cuDNN copies from LD_LIBRARY_PATH.")
    if missing and f.gpus:
        return CheckResult(name, "error", "TensorFlow could not load CUDA libraries: " + " | ".join(missing[:3]),
                       "pip install 'tensorflow[and-cuda]' (CUDA, cuDNN as pip wheels), or install the CUDA/cuDNN "
                       "versions of the tf_build check and put them on LD_LIBRARY_PATH.")
    if f.tf.get("crashed") and _flags_kill_tensorflow(f):
        return CheckResult(name, "skip", "TensorFlow aborted on TF_XLA_FLAGS / XLA_FLAGS before loading its CUDA "
                           "libraries (see xla_flags); not a library problem.")
    if f.tf.get("crashed") and not f.tf_version:
        return CheckResult(name, "error", f"TensorFlow crashed while starting: {f.tf.get('error')}",
                       "Reinstall 'tensorflow[and-cuda]' in a clean virtualenv; check library_conflicts.")
    if not f.gpus:
        return CheckResult(name, "skip", "No GPU present: CUDA libraries not needed.")
    return CheckResult(name, "ok", "TensorFlow loaded its CUDA libraries without complaint.")


def check_placement(f: Facts) -> CheckResult:
    """Smoke test on each visible GPU (or the CPU): element-wise ops, a matmul, a convolution and a
    ``jit_compile`` function — each can fail where the others pass (kernels, cuBLAS, cuDNN, XLA/PTX)."""
    name = "placement"
    if no := _no_tf(f, name):
        return no
    runs = f.tf.get("placements") or []
    if not runs and not f.tf.get("crashed"):
        return CheckResult(name, "error", "The smoke test did not run.", "Run with TensorFlow logging on: "
                           "TF_CPP_MIN_LOG_LEVEL=0 keras-scale doctor")
    bad, good = [], {}
    for r in runs:
        op = r.get("op", "matmul")
        want = r["requested"].split("device:")[-1].upper()
        got = (r.get("device") or "").upper()
        if r.get("error"):
            bad.append(f"{op} on {want}: {r['error']}")
        elif not got.endswith(want):
            bad.append(f"{op}: asked for {want}, ran on {r.get('device')}")
        elif not r.get("ok"):
            bad.append(f"{op} on {want} gave a wrong result")
        else:
            good.setdefault(want, []).append(op)
    if f.tf.get("crashed"):
        bad.append(f.tf.get("error") or "the probe crashed")
    hints = [h for h in f.tf.get("log_hints") or [] if re.search(r"PTX|no kernel image|Unknown flag", h)]
    if bad:
        return CheckResult(name, "error", "Smoke test failed: " + "; ".join(bad) + (
            " | TensorFlow said: " + " | ".join(hints[:2]) if hints else ""),
            "See compute_capability, driver_vs_cuda, cuda_wheels, cuda_libraries and xla_flags; `nvidia-smi` for "
            "a GPU in a bad state.")
    ran = "; ".join(f"{d}: {', '.join(ops)}" for d, ops in good.items()) + " ran"
    if all("CPU" in d for d in good):
        if f.gpus:
            return CheckResult(name, "error", f"{ran} on the CPU only, although NVML sees {len(f.gpus)} GPU(s): "
                               "training would run on the CPU.", "See gpu_visibility (CUDA_VISIBLE_DEVICES, the "
                               "TensorFlow build, CUDA libraries).")
        return CheckResult(name, "ok", ran + " (no GPU: CPU only)")
    return CheckResult(name, "ok", ran)


def check_memory_growth(f: Facts) -> CheckResult:
    """TF_FORCE_GPU_ALLOW_GROWTH and per-GPU memory growth (TensorFlow reserves almost all GPU memory by default)."""
    name = "memory_growth"
    raw = f.env.get("TF_FORCE_GPU_ALLOW_GROWTH")
    if raw is not None and raw not in ("true", "false"):
        return CheckResult(name, "warn", f"TF_FORCE_GPU_ALLOW_GROWTH={raw!r} is ignored: TensorFlow accepts only "
                       "'true' or 'false' (lower case).", "export TF_FORCE_GPU_ALLOW_GROWTH=true")
    if not f.gpus and not f.tf_gpus:
        shown = f" (TF_FORCE_GPU_ALLOW_GROWTH={raw})" if raw else ""
        return CheckResult(name, "skip", f"No GPU present{shown}.")
    growth = f.tf.get("memory_growth") or {}
    allocator = f.env.get("TF_GPU_ALLOCATOR", "").strip()
    if allocator == "cuda_malloc_async":
        return CheckResult(name, "ok", "TF_GPU_ALLOCATOR=cuda_malloc_async: CUDA's stream-ordered allocator manages "
                           "GPU memory; its pool grows to the peak in use and keeps it, so nvidia-smi shows the peak, "
                           "not a full GPU, and out-of-memory reports come from CUDA rather than TensorFlow's BFC "
                           "allocator.")
    if allocator in ("cuda_malloc", "memory_guard"):
        return CheckResult(name, "warn", f"TF_GPU_ALLOCATOR={allocator}: a debugging allocator ("
                           + ("plain cudaMalloc/cudaFree per tensor, no pooling" if allocator == "cuda_malloc" else
                              "guard bytes around every allocation to catch out-of-bounds writes")
                           + "): correct but much slower than the default BFC allocator.",
                           "unset TF_GPU_ALLOCATOR after debugging (or use cuda_malloc_async)")
    if allocator:
        return CheckResult(name, "warn", f"TF_GPU_ALLOCATOR={allocator!r} is not a value TensorFlow knows "
                           "('cuda_malloc_async', or 'cuda_malloc' / 'memory_guard' for debugging); TensorFlow "
                           "falls back to its default allocator.",
                           "unset TF_GPU_ALLOCATOR, or export TF_GPU_ALLOCATOR=cuda_malloc_async")
    if raw == "true" or (growth and all(growth.values())):
        return CheckResult(name, "ok", "Memory growth on: TensorFlow allocates GPU memory as needed; nvidia-smi shows "
                       "real use.")
    return CheckResult(name, "ok", "Memory growth off (default): TensorFlow reserves nearly all memory of each GPU at "
                   "start, so nvidia-smi shows the GPUs full and a second process on the same GPU runs out of memory.",
                   "To share GPUs or see real use: export TF_FORCE_GPU_ALLOW_GROWTH=true")


def _xla_flag_errors(f: Facts) -> List[str]:
    """What in TF_XLA_FLAGS / XLA_FLAGS makes TensorFlow abort (each parsed by XLA's flag parser, which dies on
    anything it does not know)."""
    errors = []
    for var in ("TF_XLA_FLAGS", "XLA_FLAGS"):
        value = f.env.get(var, "").strip()
        if not value:
            continue
        tokens, problem = _xla_tokens(value)
        if problem:
            errors.append(f"{var}: {problem}")
        for tok in tokens:
            name, has_value = tok[2:].split("=", 1)[0], "=" in tok
            if not tok.startswith("--"):
                errors.append(f"{var}: {tok!r} is not a --flag" + (" (single dash)" if tok.startswith("-") else "")
                              + f"; the parser aborts ('Unknown flag in {var}')")
            elif var == "XLA_FLAGS" and not name.startswith("xla_"):
                errors.append(f"XLA_FLAGS: {tok} is not an XLA flag (they start with --xla_); XLA aborts with "
                              "'Unknown flag in XLA_FLAGS'")
            elif var == "XLA_FLAGS" and not has_value and f.xla_flag_kinds.get(name, "bool") != "bool":
                errors.append(f"XLA_FLAGS: {tok} takes a value ({f.xla_flag_kinds[name]}): only true/false flags may "
                              f"be given alone; XLA aborts with 'Unknown flag in XLA_FLAGS: {tok}'")
            elif var == "TF_XLA_FLAGS" and not has_value and name in _TF_XLA_VALUE_FLAGS:
                errors.append(f"TF_XLA_FLAGS: {tok} takes a value (e.g. {tok}=...): TensorFlow aborts with 'Unknown "
                              f"flag in TF_XLA_FLAGS: {tok}'")
    unknown = [n for n in f.xla_unknown_flags or [] if n.startswith("xla_")]
    if unknown:
        errors.append(f"XLA_FLAGS: {', '.join('--' + n for n in unknown)} not defined by this TensorFlow's XLA: it "
                      "aborts at the first compile ('Unknown flag in XLA_FLAGS')")
    if f.tf_xla_unknown_flags:
        errors.append(f"TF_XLA_FLAGS: {', '.join('--' + n for n in f.tf_xla_unknown_flags)} not defined by this "
                      "TensorFlow: it aborts at its first op ('Unknown flag in TF_XLA_FLAGS')")
    return errors


def check_xla_flags(f: Facts) -> CheckResult:
    """TF_XLA_FLAGS / XLA_FLAGS: flags XLA does not know, a value that is not ``--flags`` (XLA reads it as a file
    name), a numeric flag without its value (all abort), dumps left on, a CUDA data dir that does not exist.
    Values are tokenised as XLA does: quotes group a value with spaces."""
    name = "xla_flags"
    errors, problems, shown = _xla_flag_errors(f), [], []
    for var in ("TF_XLA_FLAGS", "XLA_FLAGS"):
        value = f.env.get(var, "").strip()
        if not value:
            continue
        shown.append(f"{var}={value!r}")
        for tok in _xla_tokens(value)[0]:
            if tok.startswith("--xla_dump_to"):
                problems.append(f"{var}: {tok} dumps every compiled module (slow, fills the disk)")
            elif tok.startswith("--xla_gpu_cuda_data_dir="):
                path = tok.split("=", 1)[1]
                if not os.path.isdir(path):
                    problems.append(f"{var}: --xla_gpu_cuda_data_dir={path} does not exist (XLA cannot find "
                                    "ptxas/libdevice)")
    hints = [h for h in f.tf.get("log_hints") or [] if "Unknown flag" in h or "to read flags" in h]
    if hints and not errors:
        errors.append("TensorFlow said: " + hints[0])
    if errors:
        return CheckResult(name, "error", "; ".join(errors + problems), "Remove or correct those flags (the "
                           "names differ between XLA versions); check spelling against the XLA of your TensorFlow.")
    if problems:
        return CheckResult(name, "warn", "; ".join(problems), "Fix or unset the flags; remove dump flags after "
                           "debugging.")
    if not shown:
        return CheckResult(name, "ok", "No XLA flags set.")
    return CheckResult(name, "ok", "; ".join(shown))


_NCCL_SLOW = {"NCCL_P2P_DISABLE": "GPU peer-to-peer copies", "NCCL_IB_DISABLE": "InfiniBand",
              "NCCL_SHM_DISABLE": "shared-memory transport"}


def check_nccl_env(f: Facts) -> CheckResult:
    """NCCL settings from the environment and ``/etc/nccl.conf`` / ``~/.nccl.conf``: transports disabled (slow
    all-reduce), P2P or GPUDirect limited to nothing, an unknown socket interface, a trace-level debug log."""
    name = "nccl_env"
    nccl = {k: v for k, (v, _) in f.nccl_conf.items()} or {k: v for k, v in sorted(f.env.items())
                                                          if k.startswith("NCCL_")}
    where = {k: src for k, (_, src) in f.nccl_conf.items() if src != "environment"}

    def shown(var: str) -> str:
        return f"{var}={nccl[var]}" + (f" (from {where[var]})" if var in where else "")

    problems, notes = [], []
    no_ib = f.host is not None and not f.host.infiniband
    for var, what in _NCCL_SLOW.items():
        if nccl.get(var, "0").strip() not in ("", "0"):
            if var == "NCCL_IB_DISABLE" and no_ib:
                notes.append(f"{shown(var)} changes nothing here (no InfiniBand device)")
                continue
            problems.append(f"{shown(var)} turns off {what}: all-reduce gets slower")
    for var, what in (("NCCL_P2P_LEVEL", "GPU peer-to-peer"), ("NCCL_NET_GDR_LEVEL", "GPUDirect RDMA")):
        if nccl.get(var, "").strip().upper() in ("LOC", "0"):
            problems.append(f"{shown(var)} allows {what} nowhere (LOC): it is silently off and all-reduce slower")
    ifname = nccl.get("NCCL_SOCKET_IFNAME", "").strip()
    if ifname and not ifname.startswith("^") and f.net_interfaces is not None:
        exact = ifname.startswith("=")
        wanted = [w for w in ifname.lstrip("=").split(",") if w]
        hits = [w for w in wanted if any((i == w) if exact else i.startswith(w) for i in f.net_interfaces)]
        if not hits:
            problems.append(f"{shown('NCCL_SOCKET_IFNAME')} matches no interface here "
                            f"({', '.join(f.net_interfaces)})")
    if nccl.get("NCCL_DEBUG", "").upper() == "TRACE":
        problems.append(f"{shown('NCCL_DEBUG')} logs every call (slow); INFO is enough to debug")
    listed = ", ".join(shown(k) for k in nccl)
    if problems:
        return CheckResult(name, "warn", "; ".join(problems) + ".", "Unset these unless you are debugging a hang "
                           "(environment variables override the nccl.conf files); NCCL_DEBUG=INFO shows which "
                           "transports NCCL picked.")
    return CheckResult(name, "ok", (listed or "No NCCL_* variables set.") + "".join(f"; {n}" for n in notes),
                       "" if "NCCL_DEBUG" in nccl else
                       "When debugging multi-GPU hangs or slowness: export NCCL_DEBUG=INFO")


# ------------------------------------------------------------------------------- versions, wheels, GPU kinds
_REQ = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*([^;]*)(?:;(.*))?$")
_TF_DISTS = ("tensorflow", "tensorflow-cpu", "tf-nightly")


def _floors(f: Facts) -> Dict[str, str]:
    """``{"tensorflow": "2.16", "keras": "3.8"}``: the ``>=`` floors keras_scale declares (not in extras)."""
    out: Dict[str, str] = {}
    for req in f.requirements or []:
        m = _REQ.match(req)
        if not m or (m.group(3) and "extra" in m.group(3)):
            continue
        floor = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", m.group(2) or "")
        if floor:
            out[m.group(1).lower().replace("_", "-")] = floor.group(1)
    return out


def check_versions(f: Facts) -> CheckResult:
    """Installed TensorFlow and Keras against the floors keras_scale declares (its installed metadata)."""
    name = "versions"
    if f.requirements is None:
        return CheckResult(name, "skip", "keras-scale is not installed as a package (running from a checkout), so "
                           "its declared version floors cannot be read.",
                           "pip install -e . (or pip install keras-scale)")
    shown, low, upgrades = [], [], []
    for dist, floor in _floors(f).items():
        candidates = _TF_DISTS if dist == "tensorflow" else (dist,)
        have = next(((d, f.installed[d]) for d in candidates if d in f.installed), None)
        if have is None:
            continue
        shown.append(f"{have[0]} {have[1]} (needs >= {floor})")
        if _ver(have[1])[:len(_ver(floor))] < _ver(floor):
            low.append(f"{have[0]} {have[1]} is below keras_scale's floor {floor}")
            upgrades.append(f"'{have[0]}>={floor}'")
    if low:
        return CheckResult(name, "error", "; ".join(low) + ".", "pip install " + " ".join(upgrades))
    return CheckResult(name, "ok", ", ".join(shown) or "No versioned requirement installed to compare.")


def _wheel_archs(build: Mapping[str, Any]) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """``(sass, ptx)`` compute capabilities of the wheel (``sm_80`` -> (8, 0) binary; ``compute_90`` -> PTX)."""
    sass, ptx = [], []
    for arch in build.get("cuda_compute_capabilities") or []:
        m = re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", str(arch))
        if m:
            (sass if m.group(1) == "sm" else ptx).append((int(m.group(2)), int(m.group(3))))
    return sass, ptx


def check_compute_capability(f: Facts, minimums: Optional[Dict[str, Dict[str, str]]] = None) -> CheckResult:
    """Each visible GPU's compute capability against the kernels in the TensorFlow wheel (``sm_XY`` binaries run
    on the same major version; ``compute_XY`` PTX needs the driver to JIT-compile it)."""
    name = "compute_capability"
    if not f.visible_gpus:
        return CheckResult(name, "skip", _no_visible(f))
    if no := _no_tf(f, name):
        return no
    build = f.tf.get("build") or {}
    sass, ptx = _wheel_archs(build)
    if not sass and not ptx:
        return CheckResult(name, "skip", "The TensorFlow wheel does not report its CUDA architectures.")
    wheel = ", ".join(str(a) for a in build.get("cuda_compute_capabilities") or [])
    table = minimums or load_driver_minimums()
    need = _ptx_driver_minimum(table, str(build.get("cuda_version") or ""))
    errors, jit, native, fixes = [], [], [], {}
    newest = max(sass + ptx)
    oldest = min(sass + ptx)
    for g in f.visible_gpus:
        cc = getattr(f.health.get(g.index), "compute_capability", None)
        if cc is None:
            continue
        label = f"GPU {g.index} ({g.name}, {cc[0]}.{cc[1]})"
        if any(s[0] == cc[0] and s[1] <= cc[1] for s in sass):
            native.append(label)
        elif cc[0] >= 10 and not any(a[0] >= 10 for a in sass + ptx):
            errors.append(f"{label}: Blackwell is not supported by this wheel (its newest kernels are for "
                          f"{newest[0]}.{newest[1]}; TensorFlow issues report 'PTX version ... does not support "
                          "sm_100/sm_120'); no driver changes that")
            fixes["arch"] = (f"No driver helps for compute capability {cc[0]}.{cc[1]}: use a TensorFlow build with "
                             f"kernels for sm_{cc[0]}{cc[1]} (NVIDIA's NGC TensorFlow container, or TensorFlow built "
                             f"from source with TF_CUDA_COMPUTE_CAPABILITIES={cc[0]}.{cc[1]}), or a GPU this wheel "
                             f"supports ({oldest[0]}.{oldest[1]} to {newest[0]}.{newest[1]})")
        elif any(p <= cc for p in ptx):
            if need and f.driver_version and _ver(f.driver_version) < _ver(need):
                errors.append(f"{label}: runs only on PTX JIT-compiled by the driver, and driver "
                              f"{f.driver_version} cannot compile CUDA {build.get('cuda_version')} PTX "
                              f"(needs >= {need}):"
                              " the first kernel fails (CUDA_ERROR_UNSUPPORTED_PTX_VERSION)")
                fixes["driver"] = f"Upgrade the NVIDIA driver to >= {need} (it then JIT-compiles the wheel's PTX)"
            else:
                jit.append(label)
        else:
            errors.append(f"{label}: older than every kernel in the wheel (it starts at {oldest[0]}.{oldest[1]}); "
                          "TensorFlow skips this GPU, and no driver changes that")
            fixes["old"] = (f"No driver helps for compute capability {cc[0]}.{cc[1]}: use a GPU of compute capability "
                            f">= {oldest[0]}.{oldest[1]}, or TensorFlow {f.tf_version} built from source with "
                            f"TF_CUDA_COMPUTE_CAPABILITIES={cc[0]}.{cc[1]} (if its CUDA still supports it)")
    detail_tail = f" Wheel kernels: {wheel}."
    if errors:
        return CheckResult(name, "error", "; ".join(errors) + "." + detail_tail, "; ".join(fixes.values()) + ".")
    if not native and not jit:
        return CheckResult(name, "skip", "NVML does not report the compute capability of the visible GPUs.")
    detail = "; ".join(filter(None, [f"native kernels: {', '.join(native)}" if native else "",
                                     f"PTX JIT by the driver: {', '.join(jit)}" if jit else ""])) + "." + detail_tail
    return CheckResult(name, "ok", detail, "The first run JIT-compiles PTX (minutes); keep the cache: export "
                       "CUDA_CACHE_MAXSIZE=4294967296" if jit else "")


def _ptx_driver_minimum(table: Dict[str, Dict[str, str]], cuda_version: str) -> Optional[str]:
    """The oldest driver that JIT-compiles the PTX of a CUDA version: PTX ISA versions follow CUDA's major.minor
    (CUDA 12.5 GA and 12.5 Update 1 both emit PTX ISA 8.5, per the PTX ISA release history), so the GA driver of
    that minor release (555.42.02 for 12.5.1) is enough."""
    want = _ver(cuda_version)[:2]
    same = sorted((row for k, row in table["toolkit"].items() if _ver(k)[:2] == want), key=_ver)
    return same[0] if same else _toolkit_minimum(table, cuda_version)


def _toolkit_minimum(table: Dict[str, Dict[str, str]], cuda_version: str) -> Optional[str]:
    """The driver a CUDA version's toolkit shipped with: the row of that version, or the nearest lower one of the
    same major version."""
    want = _ver(cuda_version)
    if not want:
        return None
    known = sorted((k for k in table["toolkit"] if _ver(k)[0] == want[0] and _ver(k) <= want), key=_ver)
    return table["toolkit"][known[-1]] if known else None


_CUDA_WHEELS = {"nvidia-cuda-runtime": "CUDA runtime", "nvidia-cublas": "cuBLAS", "nvidia-cuda-nvcc": "ptxas (nvcc)",
                "nvidia-cuda-nvrtc": "NVRTC", "nvidia-nvjitlink": "nvJitLink"}


def _tf_wheel_floors() -> Dict[str, str]:
    """``{"nvidia-cuda-nvcc-cu12": "12.5.82", ...}``: the lowest NVIDIA wheel versions the installed TensorFlow
    accepts (its ``Requires-Dist``, extra ``and-cuda``), read without importing it."""
    for dist in _TF_DISTS:
        try:
            reqs = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        out = {}
        for req in reqs:
            m = _REQ.match(req)
            floor = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", (m.group(2) or "") if m else "")
            if m and floor and m.group(1).lower().startswith("nvidia-"):
                out[m.group(1).lower()] = floor.group(1)
        return out
    return {}


def check_cuda_wheels(f: Facts) -> CheckResult:
    """The pip CUDA wheels ``tensorflow[and-cuda]`` installed (newest ``nvidia-*-cu12`` by default) against the
    driver: a newer CUDA major needs a newer driver; a newer minor runs through minor version compatibility. The
    pins it suggests never go below what the installed TensorFlow requires."""
    name = "cuda_wheels"
    wheels = []
    for spec in f.pip_nvidia_packages:
        dist, _, version = spec.partition("==")
        base = re.sub(r"-cu\d+$", "", dist)
        if base in _CUDA_WHEELS and len(_ver(version)) >= 2:
            wheels.append((base, dist, version))
    if not wheels:
        return CheckResult(name, "skip", "No pip CUDA wheels (CUDA comes from the system or conda, or no GPU stack).")
    listed = ", ".join(f"{d}=={v}" for _, d, v in wheels)
    if not f.cuda_driver_version:
        return CheckResult(name, "skip", f"{listed}; no NVIDIA driver to compare with.")
    drv = f.cuda_driver_version
    errors, warns, pins, newest = [], [], [], (0, 0)
    for base, dist, version in wheels:
        cuda = _ver(version)[:2]
        what = f"{_CUDA_WHEELS[base]} {dist}=={version} (CUDA {cuda[0]}.{cuda[1]})"
        if cuda[0] > drv[0]:
            errors.append(f"{what} needs a CUDA {cuda[0]} driver; driver {f.driver_version} supports CUDA up to "
                          f"{drv[0]}.{drv[1]}")
        elif cuda[0] == drv[0] and cuda[1] > drv[1]:
            warns.append(f"{what} is newer than driver {f.driver_version} (CUDA {drv[0]}.{drv[1]})" + (
                ": XLA warns that the driver is older than the PTX compiler and compiles serially, and PTX it "
                "emits may not load (CUDA_ERROR_UNSUPPORTED_PTX_VERSION)" if base == "nvidia-cuda-nvcc" else
                ": runs through CUDA minor version compatibility only"))
        else:
            continue
        newest = max(newest, cuda)
        floor = f.tf_wheel_floors.get(dist)
        if floor and _ver(floor)[:2] > drv:
            pins.append(f"'{dist}=={floor}'")  # TensorFlow needs at least this: the closest to the driver it takes
        elif floor is None and cuda[0] > drv[0]:
            continue  # not TensorFlow's: nothing to pin it to; upgrade the driver or remove it
        else:
            pins.append(f"'{dist}=={drv[0]}.{drv[1]}.*'")
    build = (f.tf.get("build") or {}).get("cuda_version")
    runtimes = [v for b, d, v in wheels if b == "nvidia-cuda-runtime" and d in f.tf_wheel_floors] or [
        v for b, _, v in wheels if b == "nvidia-cuda-runtime"]
    if build and runtimes and all(_ver(v)[:1] != _ver(build)[:1] for v in runtimes):
        errors.append(f"the CUDA runtime wheel {runtimes[0]} is not CUDA {_ver(build)[0]}, which TensorFlow "
                      f"{f.tf_version} was built for")
    floors_above = [p for p in pins if "*" not in p]
    fix = f"Upgrade the NVIDIA driver to one supporting CUDA {newest[0]}.{newest[1]}"
    if pins:
        fix += ", or pin the wheels: pip install " + " ".join(pins)
        if floors_above:
            fix += (f" (the lowest versions this TensorFlow accepts; they still need minor version compatibility "
                    f"with the driver's CUDA {drv[0]}.{drv[1]})")
    if errors:
        return CheckResult(name, "error", "; ".join(errors + warns) + ".", fix + ".")
    if warns:
        return CheckResult(name, "warn", "; ".join(warns) + ".", fix + ".")
    return CheckResult(name, "ok", f"{listed}: all within the driver's CUDA {drv[0]}.{drv[1]}.")


# --------------------------------------------------------------------------------------- GPU state (NVML)
def _per_gpu(f: Facts, name: str) -> Optional[CheckResult]:
    if not f.visible_gpus:
        return CheckResult(name, "skip", _no_visible(f))
    if not f.health:
        return CheckResult(name, "skip", "NVML did not report the GPUs' state.")
    return None


def check_mig(f: Facts) -> CheckResult:
    """MIG mode: a process uses one MIG instance (CUDA enumerates only one); which one ``CUDA_VISIBLE_DEVICES``
    selects."""
    name = "mig"
    on = [g for g in f.gpus if getattr(f.health.get(g.index), "mig_mode", None) or g.mig_uuids]
    cvd = f.env.get("CUDA_VISIBLE_DEVICES")
    mig_entries = [e.strip() for e in (cvd or "").split(",") if e.strip().upper().startswith("MIG-")]
    if not on and not mig_entries:
        return CheckResult(name, "skip" if not f.gpus else "ok", "No GPU in MIG mode." if f.gpus else "No GPU present.")
    listing = "; ".join(f"GPU {g.index}: {len(g.mig_uuids)} MIG instance(s)" for g in on)
    stale = [e for e in mig_entries[:1] if f.gpus and not _mig_known(f, e)]
    if stale and not f.tf_gpus:
        head = f"{listing}; " if listing else ""
        return CheckResult(name, "error", f"{head}CUDA_VISIBLE_DEVICES selects {stale[0]}, which no GPU here has "
                           "(stale or mistyped): CUDA sees no GPU.",
                           "Use a MIG-<uuid> from `nvidia-smi -L`.")
    if len(mig_entries) == 1:
        return CheckResult(name, "ok", f"{listing}; CUDA_VISIBLE_DEVICES selects {mig_entries[0]}.".lstrip("; "))
    why = ("CUDA_VISIBLE_DEVICES lists several MIG instances but a CUDA process uses only the first"
           if mig_entries else "CUDA_VISIBLE_DEVICES does not name a MIG instance, so CUDA picks one for you")
    return CheckResult(name, "warn", f"{listing}; {why}: tf.distribute cannot spread one process over several MIG "
                       "instances.", "Run one process per instance with CUDA_VISIBLE_DEVICES=MIG-<uuid> "
                       "(`nvidia-smi -L` lists them), or disable MIG for multi-GPU training: nvidia-smi -mig 0")


def check_gpu_memory_errors(f: Facts) -> CheckResult:
    """ECC: uncorrectable errors since the driver loaded, failed row remapping, retired pages or remapped rows
    waiting for a GPU reset."""
    name = "gpu_memory_errors"
    if no := _per_gpu(f, name):
        return no
    errors, warns = [], []
    for g in f.visible_gpus:
        h = f.health.get(g.index)
        if h is None:
            continue
        if h.ecc_uncorrected_volatile:
            errors.append(f"GPU {g.index}: {h.ecc_uncorrected_volatile} uncorrectable ECC error(s) since the driver "
                          "loaded (results may be wrong; jobs crash with Xid 48/63/64)")
        if h.row_remap_failed:
            errors.append(f"GPU {g.index}: row remapping failed (the GPU needs service)")
        if h.pages_pending:
            warns.append(f"GPU {g.index}: retired pages / remapped rows pending until the GPU is reset")
    fix = "Drain the GPU from jobs; reset it (`sudo nvidia-smi -r -i <index>`) or reboot; if errors return, RMA it. " \
          "Details: nvidia-smi -q -d ECC,ROW_REMAPPER,PAGE_RETIREMENT"
    if errors:
        return CheckResult(name, "error", "; ".join(errors + warns) + ".", fix)
    if warns:
        return CheckResult(name, "warn", "; ".join(warns) + ".", fix)
    read = [f.health[g.index] for g in f.visible_gpus if g.index in f.health]
    if not any(h.ecc_uncorrected_volatile is not None or h.pages_pending is not None for h in read):
        return CheckResult(name, "ok", "ECC not reported by NVML (a GPU without ECC, or ECC turned off): no memory "
                           "error counts to check.")
    return CheckResult(name, "ok", "No uncorrectable ECC errors, nothing pending.")


def check_gpu_modes(f: Facts) -> CheckResult:
    """Compute mode (Exclusive_Process: a second process on the GPU fails; Prohibited: none may run) and
    persistence mode (off: the driver reinitialises the GPU for each process)."""
    name = "gpu_modes"
    if no := _per_gpu(f, name):
        return no
    prohibited = [g.index for g in f.visible_gpus if getattr(f.health.get(g.index), "compute_mode", "") == "Prohibited"]
    exclusive = [g.index for g in f.visible_gpus
                 if getattr(f.health.get(g.index), "compute_mode", "") in ("Exclusive_Process", "Exclusive_Thread")]
    no_persist = [g.index for g in f.visible_gpus if getattr(f.health.get(g.index), "persistence_mode", None) is False]
    unknown_persist = [g.index for g in f.visible_gpus
                       if getattr(f.health.get(g.index), "persistence_mode", None) is None]
    unknown_mode = [g.index for g in f.visible_gpus if getattr(f.health.get(g.index), "compute_mode", None) is None]
    note = (f"Persistence mode off on GPU(s) {no_persist}: the driver sets each GPU up again for every new process "
            "(slower start)." if no_persist else "Persistence mode not reported." if unknown_persist
            else "Persistence mode on.")
    persist_fix = "sudo nvidia-smi -pm 1 (or enable the nvidia-persistenced service)" if no_persist else ""
    if prohibited:
        return CheckResult(name, "error", f"GPU(s) {prohibited} in compute mode Prohibited: no CUDA process can use "
                           f"them. {note}", "sudo nvidia-smi -c DEFAULT -i <index>, or hide them with "
                           "CUDA_VISIBLE_DEVICES")
    if exclusive:
        return CheckResult(name, "warn", f"GPU(s) {exclusive} in compute mode Exclusive_Process: a second process on "
                           "the same GPU (a second worker, an evaluation job, this doctor's smoke test) fails with "
                           f"'all CUDA-capable devices are busy or unavailable'. {note}",
                           "One process per GPU (CUDA_VISIBLE_DEVICES), or sudo nvidia-smi -c DEFAULT -i <index>")
    if len(unknown_mode) == len(f.visible_gpus):
        return CheckResult(name, "ok", f"Compute mode not reported by NVML (vGPU or restricted container). {note}",
                           persist_fix)
    mode = "Default" + (f" (not reported for GPU(s) {unknown_mode})" if unknown_mode else "")
    return CheckResult(name, "ok", f"Compute mode {mode}. {note}", persist_fix)


def check_pcie_link(f: Facts) -> CheckResult:
    """PCIe link width now vs the most the GPU and slot allow (a x16 card at x4 is the "adding GPUs makes it
    slower" case), and a slot that holds the GPU below its PCIe generation."""
    name = "pcie_link"
    if no := _per_gpu(f, name):
        return no
    problems, shown = [], []
    for g in f.visible_gpus:
        h = f.health.get(g.index)
        if h is None or h.pcie_width is None:
            continue
        shown.append(f"GPU {g.index}: gen {h.pcie_gen}/{h.pcie_gen_max} x{h.pcie_width}/x{h.pcie_width_max}")
        if h.pcie_width_max and h.pcie_width < h.pcie_width_max:
            problems.append(f"GPU {g.index} links at x{h.pcie_width} of x{h.pcie_width_max}: host-device copies and "
                            f"PCIe all-reduce run at {h.pcie_width}/{h.pcie_width_max} of the bandwidth")
        if h.pcie_gen_gpu_max and h.pcie_gen_max and h.pcie_gen_max < h.pcie_gen_gpu_max:
            problems.append(f"GPU {g.index} supports PCIe gen {h.pcie_gen_gpu_max} but the slot allows gen "
                            f"{h.pcie_gen_max}")
    if not shown:
        return CheckResult(name, "skip", "NVML does not report the PCIe link here (SXM/NVLink-only or virtual GPU).")
    if problems:
        return CheckResult(name, "warn", "; ".join(problems) + ".", "Reseat the card or move it to a full-width "
                           "slot; check BIOS lane bifurcation and riser cables. nvidia-smi -q -d PCIE shows the link.")
    return CheckResult(name, "ok", "; ".join(shown) + " (idle GPUs lower the link generation to save power; that "
                       "is normal).")


def check_power_limit(f: Facts) -> CheckResult:
    """A power limit set below the GPU's default: clocks drop under load."""
    name = "power_limit"
    if no := _per_gpu(f, name):
        return no
    low, shown = [], []
    for g in f.visible_gpus:
        h = f.health.get(g.index)
        if h is None or h.power_limit_w is None or not h.power_default_limit_w:
            continue
        shown.append(f"GPU {g.index}: {h.power_limit_w:.0f} W")
        if h.power_limit_w < 0.95 * h.power_default_limit_w:
            low.append(f"GPU {g.index}: {h.power_limit_w:.0f} W of its default {h.power_default_limit_w:.0f} W")
    if not shown:
        return CheckResult(name, "skip", "NVML does not report power limits here.")
    if low:
        return CheckResult(name, "warn", "Power limit below default (clocks drop under load): " + "; ".join(low) + ".",
                           "sudo nvidia-smi -pl <watts> -i <index> (the default is in nvidia-smi -q -d POWER), unless "
                           "the limit is deliberate (power or cooling budget).")
    return CheckResult(name, "ok", "Power limits at their defaults: " + "; ".join(shown) + ".")


def check_gpu_topology(f: Facts) -> CheckResult:
    """How the visible GPUs talk: NVLink, PCIe peer-to-peer, or through host memory (no P2P: all-reduce slower)."""
    name = "gpu_topology"
    if len(f.visible_gpu_indices) < 2:
        return CheckResult(name, "skip", "Fewer than 2 visible GPUs.")
    visible = {g.index for g in f.visible_gpus}
    links = [link for link in f.links if link.a in visible and link.b in visible]
    if len(visible) < 2:
        return CheckResult(name, "skip", "Fewer than 2 visible GPUs." if not f.gpu_order_uncertain else
                           _no_visible(f))
    if not links:
        return CheckResult(name, "skip", "NVML did not report how the GPUs are connected.")
    pairs, no_p2p = [], []
    for link in links:
        via_switch = not link.nvlinks and getattr(link, "nvlink_p2p", None)
        how = (f"NVLink x{link.nvlinks}" if link.nvlinks else "NVLink (through NVSwitch)" if via_switch
               else f"PCIe ({link.topology or '?'})")
        pairs.append(f"{link.a}-{link.b} {how}")
        if link.p2p is False and not link.nvlinks and not via_switch:
            no_p2p.append(f"{link.a}-{link.b}")
    detail = "; ".join(pairs)
    if no_p2p:
        return CheckResult(name, "warn", f"No peer-to-peer between GPU pair(s) {', '.join(no_p2p)}: NCCL copies "
                           f"through host memory, all-reduce is slower. {detail}.",
                           "Check `nvidia-smi topo -m` and `nvidia-smi topo -p2p r`; IOMMU/ACS settings in the BIOS or "
                           "kernel (iommu=pt) often block P2P; in VMs P2P needs passthrough support.")
    return CheckResult(name, "ok", detail + ".")


# ------------------------------------------------------------------------------------------------ the host
def _host(f: Facts, name: str, needs_gpu: bool = True) -> Optional[CheckResult]:
    if f.host is None:
        return CheckResult(name, "skip", "Host facts were not gathered.")
    if needs_gpu and not f.visible_gpus:
        return CheckResult(name, "skip", _no_visible(f))
    return None


def check_cpu_per_gpu(f: Facts, min_cores_per_gpu: int = 4) -> CheckResult:
    """Physical CPU cores this process may use per visible GPU (common guidance: 4-6 per GPU to feed it)."""
    name = "cpu_per_gpu"
    if no := _host(f, name):
        return no
    n = len(f.visible_gpus)
    cores = f.host.physical_cores or f.host.usable_cpus
    kind = "physical cores" if f.host.physical_cores else "CPUs"
    if not cores:
        return CheckResult(name, "skip", "The CPU count could not be read.")
    per = cores / n
    capped = f", capped by the cgroup CPU quota in {f.host.cpu_limit_from}" if f.host.cpu_limit_from else ""
    detail = f"{cores} {kind} usable ({f.host.usable_cpus} logical CPUs{capped}) for {n} GPU(s): {per:.1f} per GPU"
    if per < min_cores_per_gpu:
        return CheckResult(name, "warn", detail + f", below the usual {min_cores_per_gpu}-6: input pipelines "
                           "(decoding, augmentation) may not keep the GPUs busy.",
                           "Ask for more cores (Slurm: --cpus-per-task; docker: --cpus), cache decoded data, or move "
                           "preprocessing offline; GpuMonitor's input-bound advice confirms it during training.")
    return CheckResult(name, "ok", detail + ".")


def check_host_memory(f: Facts) -> CheckResult:
    """Host RAM vs the visible GPUs' memory (less RAM than GPU memory: data loading, pinned buffers and
    checkpoint saves run out first)."""
    name = "host_memory"
    if no := _host(f, name):
        return no
    if not f.host.ram_mb:
        return CheckResult(name, "skip", "Host memory could not be read.")
    gpu_mb, slices = 0.0, []
    for g in f.visible_gpus:
        mb = _mig_slice_mb(f, g)
        gpu_mb += g.memory_total_mb if mb is None else mb
        if mb is not None:
            slices.append(f"GPU {g.index}: a {mb / 1024:.0f} GiB MIG instance")
    limit = f" (the cgroup memory limit in {f.host.ram_limit_from})" if f.host.ram_limit_from else ""
    detail = (f"{f.host.ram_mb / 1024:.0f} GiB RAM{limit} for {gpu_mb / 1024:.0f} GiB of GPU memory "
              f"({len(f.visible_gpus)} GPU(s){': ' + ', '.join(slices) if slices else ''})")
    if f.host.ram_mb < gpu_mb:
        return CheckResult(name, "warn", detail + ": less RAM than GPU memory; shuffle buffers, caches, pinned "
                           "transfer buffers and checkpoint saves can exhaust it.",
                           "Give the job more memory (container/Slurm limit), shrink shuffle/cache buffers; "
                           "HostMemoryWatch tracks it during training.")
    return CheckResult(name, "ok", detail + ".")


def _mig_slice_mb(f: Facts, g: Any) -> Optional[float]:
    """The memory of the MIG instance of GPU ``g`` that ``CUDA_VISIBLE_DEVICES`` selects (None: not a MIG
    instance, or its size not reported): a process sees that slice, not the whole GPU."""
    for entry in (f.env.get("CUDA_VISIBLE_DEVICES") or "").split(","):
        e = entry.strip().upper()
        if e.startswith("MIG-") and not e.startswith("MIG-GPU-"):
            for uuid, mb in zip(g.mig_uuids, getattr(g, "mig_memory_mb", ()) or ()):
                if uuid.upper().startswith(e) and mb:
                    return mb
    return None


def check_numa(f: Facts) -> CheckResult:
    """The NUMA node of each GPU vs the CPUs this process may run on (input threads on the far socket cross
    the SMP interconnect for every batch)."""
    name = "numa"
    if no := _host(f, name):
        return no
    nodes = {g.index: f.host.gpu_numa_nodes.get(g.index, -1) for g in f.visible_gpus}
    if all(n < 0 for n in nodes.values()):
        return CheckResult(name, "ok", "Single NUMA node (or none reported).")
    detail = ", ".join(f"GPU {i}: node {n}" for i, n in nodes.items())
    allowed = f.host.affinity_nodes
    far = [i for i, n in nodes.items() if n >= 0 and allowed is not None and n not in allowed]
    if far:
        return CheckResult(name, "warn", f"{detail}; this process may only run on node(s) {f.host.affinity_nodes}, "
                           f"so GPU(s) {far} are fed across sockets.",
                           "Bind each worker to its GPU's node: numactl --cpunodebind=<node> --membind=<node>, or "
                           "widen the CPU set (taskset / Slurm --cpu-bind).")
    return CheckResult(name, "ok", detail + (f"; process may run on node(s) {f.host.affinity_nodes}"
                                             if f.host.affinity_nodes is not None else "") + ".")


def check_storage(f: Facts) -> CheckResult:
    """The filesystem of the data/checkpoint path(s): NVMe/SSD fine; spinning disk, network or a container's
    overlay layer slow input or lose checkpoints."""
    name = "storage"
    if no := _host(f, name, needs_gpu=False):
        return no
    notes, shown = [], []
    missing = []
    for s in f.host.storage:
        if s["kind"] == "missing":
            missing.append(f"{s['path']!r} does not exist" if s["path"] else "an empty --path was given")
            continue
        shown.append(f"{s['path']}: {s['kind']} ({s['fstype'] or '?'} on {s['device'] or '?'})")
        if s["kind"] == "hdd":
            notes.append(f"{s['path']} is on a spinning disk: random reads starve the GPU")
        elif s["kind"] == "network":
            notes.append(f"{s['path']} is on a network filesystem ({s['fstype']}): per-file latency and shared "
                         "bandwidth slow input; checkpoints save slowly")
        elif s["kind"] == "container":
            notes.append(f"{s['path']} is in the container's overlay layer: slow writes, and checkpoints vanish "
                         "with the container")
    rest = f" Others: {'; '.join(shown)}." if shown else ""
    if missing:
        return CheckResult(name, "warn", "; ".join(missing + notes) + "." + rest, "Check the spelling of the path (or "
                           "mount it): training would fail reading data or writing checkpoints there.")
    if notes:
        return CheckResult(name, "warn", "; ".join(notes) + "." + rest, "Stage data on local NVMe (or read it as "
                           "large sharded TFRecords with `.cache()`/`.prefetch()`); write checkpoints to a mounted "
                           "volume.")
    return CheckResult(name, "ok", "; ".join(shown) + ".")


def check_shm(f: Facts, min_mb: float = 1024.0) -> CheckResult:
    """``/dev/shm`` size: NCCL's shared-memory transport between GPUs of one machine lives there (Docker's
    default is 64 MB)."""
    name = "shm"
    if no := _host(f, name, needs_gpu=False):
        return no
    if f.host.shm_mb is None:
        return CheckResult(name, "skip", "/dev/shm is not mounted here.")
    detail = f"/dev/shm is {f.host.shm_mb:.0f} MiB"
    if f.host.shm_mb < min_mb and len(f.visible_gpus) > 1:
        return CheckResult(name, "warn", detail + f" with {len(f.visible_gpus)} GPUs: NCCL's shared-memory buffers "
                           "can run out ('unhandled system error' / bus error).",
                           "docker run --shm-size=16g (or --ipc=host); Kubernetes: an emptyDir with medium: Memory "
                           "mounted at /dev/shm.")
    return CheckResult(name, "ok", detail + ".")


def check_memlock(f: Facts) -> CheckResult:
    """``ulimit -l`` (locked memory) with InfiniBand: RDMA registers pinned buffers and fails under a small limit."""
    name = "memlock"
    if no := _host(f, name, needs_gpu=False):
        return no
    limit = f.host.memlock_bytes
    shown = "unlimited" if limit is None else f"{limit // 1024} KiB"
    if not f.host.infiniband:
        return CheckResult(name, "ok", f"ulimit -l {shown}; no InfiniBand device, so RDMA is not used.")
    if limit is not None and limit < 2 ** 30:
        return CheckResult(name, "warn", f"ulimit -l {shown} with InfiniBand ({', '.join(f.host.infiniband)}): NCCL "
                           "cannot pin enough memory for RDMA ('ibv_reg_mr failed') and falls back or fails.",
                           "ulimit -l unlimited (limits.conf memlock, docker --ulimit memlock=-1, Slurm "
                           "PropagateResourceLimits)")
    return CheckResult(name, "ok", f"ulimit -l {shown} with InfiniBand ({', '.join(f.host.infiniband)}).")


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
                    port_free: Callable[[str, int], bool] = _port_free) -> CheckResult:
    """TF_CONFIG: valid JSON, this task inside the cluster, addresses host:port, resolvable, own port free."""
    name = "tf_config"
    raw = f.env.get("TF_CONFIG", "").strip()
    fix = ('TF_CONFIG looks like {"cluster": {"worker": ["host1:port", "host2:port"]}, "task": {"type": "worker", '
           '"index": 0}}; `keras-scale launch` sets it for local workers.')
    from keras_scale.distribute import _kubernetes_task, _slurm_task, cluster_task, kubernetes_tf_config, tf_config

    slurm, pod = _slurm_task(f.env), _kubernetes_task(f.env)
    other = (f"a Slurm job step with {slurm[1]} tasks" if slurm is not None else
             f"a Kubernetes Indexed Job of {pod[1]} workers" if pod is not None else None)
    shadowed = ""
    if raw:
        try:
            named = bool((tf_config({"TF_CONFIG": raw}) or {}).get("cluster"))
        except (ValueError, AttributeError):
            named = True  # malformed: choose_strategy and is_chief stop on it, so it is checked (an error) below
            if other is not None:
                fix = f"Unset TF_CONFIG to use {other} (also in this environment), or fix it: " + fix
        if not named and other is not None:  # it does not shadow the other sources: they are what training uses
            shadowed = f" TF_CONFIG is set but names no cluster ({raw[:80]!r}): it is ignored."
            raw = ""
        elif named and other is not None:
            shadowed = (f" TF_CONFIG wins over {other} also in this environment (TF_CONFIG is read first); if it "
                        "is left over (e.g. exported before sbatch), unset it.")
    if not raw:  # the other cluster sources, in the order choose_strategy and is_chief read them
        source, _, index, num_workers = cluster_task(f.env)
        if source == "Slurm":
            return CheckResult(name, "warn" if shadowed else "ok", f"Slurm job step: task {index} of {num_workers} "
                               f"({'the chief' if index == 0 else 'not the chief'}); choose_strategy() derives "
                               "TF_CONFIG from it." + shadowed, "Unset TF_CONFIG." if shadowed else "")
        if source != "Kubernetes":
            return CheckResult(name, "ok", "TF_CONFIG unset: single-machine training.")
        raw = json.dumps(kubernetes_tf_config(f.env))  # checked below like a TF_CONFIG
        fix = ("In a Kubernetes Indexed Job set KERAS_SCALE_NUM_WORKERS to the Job's completions and "
               "KERAS_SCALE_K8S_SUBDOMAIN to the headless Service (see examples/kubernetes/train-job.yaml).")

    try:
        cfg = tf_config({"TF_CONFIG": raw})
    except ValueError as e:
        return CheckResult(name, "error", str(e), fix)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("cluster"), dict) or not cfg["cluster"]:
        return CheckResult(name, "error", f"TF_CONFIG has no \"cluster\" mapping: {raw[:120]!r}", fix)
    task = cfg.get("task")
    if not isinstance(task, dict) or "type" not in task:
        return CheckResult(name, "error", "TF_CONFIG has no \"task\": {\"type\", \"index\"}: each process must say "
                           "which "
                       "cluster member it is.", fix)
    cluster, ttype = cfg["cluster"], task["type"]
    try:
        index = int(task.get("index", 0))
    except (TypeError, ValueError):
        return CheckResult(name, "error", f"TF_CONFIG task index {task.get('index')!r} is not an integer.", fix)
    if ttype not in cluster:
        return CheckResult(name, "error", f"TF_CONFIG task type {ttype!r} is not in the cluster {sorted(cluster)}.",
                           fix)
    members = cluster[ttype] if isinstance(cluster[ttype], list) else []
    if not 0 <= index < len(members):
        return CheckResult(name, "error", f"TF_CONFIG task {ttype}:{index} is outside the cluster: {ttype!r} has "
                       f"{len(members)} address(es).", fix)
    addresses, problems = [], []
    for role, addrs in cluster.items():
        for addr in addrs if isinstance(addrs, list) else [addrs]:
            m = re.fullmatch(r"\[?([^\]]+?)\]?:(\d+)", str(addr))
            if not m or not 0 < int(m.group(2)) < 65536:
                return CheckResult(name, "error", f"TF_CONFIG address {addr!r} of {role!r} is not host:port.", fix)
            addresses.append((role, m.group(1), int(m.group(2))))
    dupes = sorted({f"{h}:{p}" for _, h, p in addresses if sum(1 for _, h2, p2 in addresses if (h2, p2) == (h, p)) > 1})
    if dupes:
        return CheckResult(name, "error", f"TF_CONFIG lists the same address twice: {', '.join(dupes)}.", fix)
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
        return CheckResult(name, "error", f"TF_CONFIG: {'; '.join(problems)}.", "Use resolvable hostnames or IPs.")
    m = re.fullmatch(r"\[?([^\]]+?)\]?:(\d+)", str(members[index]))
    my_host, my_port = m.group(1), int(m.group(2))
    n_tasks = len(addresses)
    detail = f"{n_tasks} task(s) ({', '.join(f'{r}: {len(a)}' for r, a in cluster.items())}); this is {ttype}:{index}"
    local = _local_addresses()
    if set(resolved.get(my_host, [])) & local:
        if not port_free("0.0.0.0" if ":" not in my_host else "::", my_port):
            return CheckResult(name, "warn", f"{detail}; its port {my_port} is already in use here (a previous worker "
                           "still running?).", f"Find it with `ss -ltnp 'sport = :{my_port}'`, stop it, or pick "
                           "another port.")
    else:
        return CheckResult(name, "warn", f"{detail}; its address {my_host} is not an address of this machine "
                       f"({', '.join(resolved.get(my_host, []))}).", "Set task.index to this machine's entry.")
    if shadowed:
        return CheckResult(name, "warn", detail + f", port {my_port} free." + shadowed, "Unset TF_CONFIG if it is "
                           "not meant for this run.")
    return CheckResult(name, "ok", detail + f", port {my_port} free.")


CHECKS: Tuple[Callable[[Facts], CheckResult], ...] = (
    # versions and the CUDA stack
    check_python, check_tensorflow, check_keras, check_versions, check_tf_build, check_nvidia_driver,
    check_driver_cuda, check_compute_capability, check_cuda_wheels, check_library_conflicts, check_cuda_libraries,
    # the GPUs
    check_gpus_responding, check_gpu_visibility, check_mig, check_gpu_processes, check_gpu_memory_errors,
    check_gpu_modes, check_pcie_link, check_power_limit, check_throttling, check_gpu_topology, check_placement,
    # the host that feeds them
    check_cpu_per_gpu, check_host_memory, check_numa, check_storage, check_shm, check_memlock,
    # environment variables
    check_memory_growth, check_xla_flags, check_nccl_env, check_tf_config,
)


def run_checks(facts: Facts, checks: Sequence[Callable[[Facts], CheckResult]] = CHECKS) -> List[CheckResult]:
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
            out.append(CheckResult(name, "error", f"the check itself failed: {type(e).__name__}: {e}",
                               "Report this as a keras_scale bug."))
    return out


def report(facts: Facts, checks: Sequence[Callable[[Facts], CheckResult]] = CHECKS) -> Dict[str, Any]:
    """The JSON-ready report of :func:`doctor` for given facts."""
    visible = set(facts.visible_gpu_indices)
    return {
        "python": facts.python_version,
        "tensorflow": facts.tf_version,
        "keras": facts.tf.get("keras"),
        "tensorflow_probed": bool(facts.tf),
        "installed": dict(facts.installed),
        "nvidia_driver": facts.driver_version,
        "gpus": [dict(dataclasses.asdict(g), visible=g.index in visible) for g in facts.gpus],
        "checks": [f.as_dict() for f in run_checks(facts, checks)],
    }


def doctor(nvml: Any = None, probe_tensorflow: bool = True, paths: Sequence[str] = (), root: str = "/",
           progress: Callable[[str], None] = lambda msg: None) -> Dict[str, Any]:
    """Check this machine for training: versions and drivers, the GPUs' state, the host, environment variables.

    Returns ``{"python", "tensorflow", "keras", "tensorflow_probed", "installed", "nvidia_driver", "gpus": [...],
    "checks": [{"name", "status", "detail", "fix"}]}`` with ``status`` in ``ok``/``warn``/``error``/``skip``.
    TensorFlow is probed in a child process (a few seconds, in parallel with the other checks), so this
    process's TensorFlow stays uninitialised.

    Args:
        nvml: an object with the :class:`keras_scale.nvml.Nvml` methods (tests); default: the real NVML.
        probe_tensorflow: False skips the TensorFlow probe (its checks report ``skip``).
        paths: data/checkpoint paths whose storage to check (default: the working directory).
        root: where ``/proc``, ``/sys`` and ``/etc`` are read (tests pass a fabricated tree).
        progress: called with a message as each stage starts.

    Example:
        >>> report = doctor(probe_tensorflow=False)
        >>> report["gpus"]  # on a machine without GPUs  # doctest: +SKIP
        []
        >>> any(c["status"] == "error" for c in report["checks"])  # doctest: +SKIP
        False
    """
    return report(gather_facts(nvml=nvml, probe_tensorflow=probe_tensorflow, root=root, paths=paths,
                               progress=progress))


# ================================================================================================= output
_MARK = {"ok": "ok", "warn": "WARN", "error": "ERROR", "skip": "skip"}


def _version_text(rep: Dict[str, Any], name: str) -> str:
    probed = rep.get(name)
    if probed:
        return probed
    installed = rep.get("installed") or {}
    have = next((installed[d] for d in ((name,) + (_TF_DISTS if name == "tensorflow" else ())) if d in installed), None)
    if not rep.get("tensorflow_probed", True):
        return f"{have} (not probed)" if have else "not probed"
    return "not installed" if have is None else f"{have} (fails to start)"


def format_report(rep: Dict[str, Any], width: Optional[int] = None) -> str:
    """The human-readable table of a :func:`doctor` report, wrapped to ``width`` (default: the terminal's).

    Example:
        print(format_report(doctor(probe_tensorflow=False), width=100))
    """
    width = max(40, width or shutil.get_terminal_size((100, 24)).columns)
    lines = ["keras-scale doctor", ""]
    head = (f"python {rep['python']}   tensorflow {_version_text(rep, 'tensorflow')}   "
            f"keras {_version_text(rep, 'keras')}")
    lines.extend("  " + ln for ln in textwrap.wrap(head, width - 2))
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
    narrow = width - 10 - name_w < 30  # no room for a detail column: details go under each check, indented
    detail_w = width - 6 if narrow else width - 10 - name_w
    pad = " " * (6 if narrow else 10 + name_w)
    lines.append((f"  {'status':<6}  {'check':<{name_w}}" + ("" if narrow else "detail")).rstrip())
    lines.append(f"  {'-' * 6}  {'-' * (name_w - 2)}" + ("" if narrow else f"  {'-' * min(detail_w, 60)}"))
    for c in rep["checks"]:
        body = textwrap.wrap(c["detail"], detail_w, break_on_hyphens=False) or [""]
        if narrow:
            lines.append(f"  {_MARK[c['status']]:<6}  {c['name']}")
            lines.extend(pad + b for b in body)
        else:
            lines.append(f"  {_MARK[c['status']]:<6}  {c['name']:<{name_w}}{body[0]}")
            lines.extend(pad + b for b in body[1:])
        if c["fix"]:
            lines.extend(pad + b for b in textwrap.wrap("fix: " + c["fix"], detail_w, break_on_hyphens=False))
    counts = {s: sum(1 for c in rep["checks"] if c["status"] == s) for s in STATUSES}
    lines.append("")
    summary = f"{counts['error']} error(s), {counts['warn']} warning(s), {counts['ok']} ok, {counts['skip']} skipped"
    lines.extend("  " + ln for ln in textwrap.wrap(summary, width - 2))
    return "\n".join(lines)


def exit_code(rep: Dict[str, Any], strict: bool = False) -> int:
    """1 when any check is ``error`` (or, with ``strict``, ``warn``), else 0.

    Example:
        >>> exit_code({"checks": [{"status": "warn"}, {"status": "ok"}]})
        0
        >>> exit_code({"checks": [{"status": "warn"}]}, strict=True)
        1
    """
    failing = ("error", "warn") if strict else ("error",)
    return 1 if any(c["status"] in failing for c in rep["checks"]) else 0


class _Progress:
    """Progress lines on stderr: rewritten in place on a terminal, one line each otherwise; timed."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.shown = False

    def __call__(self, msg: str) -> None:
        text = f"keras-scale doctor [{time.perf_counter() - self.t0:4.1f} s]: {msg}"
        if self.tty:
            cols = shutil.get_terminal_size((100, 24)).columns
            self.stream.write("\r\033[K" + text[:cols - 1])
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


def cli(argv: Sequence[str]) -> int:
    """``keras-scale doctor [--json] [--strict] [--no-tensorflow] [--path P ...] [--quiet]``.

    Prints the report (progress on stderr while it runs); exit code 1 when a check says ``error``, or with
    ``--strict`` also ``warn`` (for CI).

    Example:
        $ keras-scale doctor --json | python -c "import json,sys; print(json.load(sys.stdin)['gpus'])"
    """
    parser = argparse.ArgumentParser(prog="keras-scale doctor",
                                     description="Check what breaks or slows training here: drivers and CUDA, GPU "
                                                 "state, the host (CPU, RAM, NUMA, storage, /dev/shm), env variables.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--strict", action="store_true", help="exit with 1 on warnings too (for CI)")
    parser.add_argument("--no-tensorflow", action="store_true",
                        help="skip the TensorFlow probe (only NVML, host and environment checks)")
    parser.add_argument("--path", action="append", default=[], metavar="P",
                        help="data or checkpoint path whose storage to check (repeatable; default: the working "
                             "directory)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress messages on stderr")
    args = parser.parse_args(list(argv))
    progress = _Progress()
    rep = doctor(probe_tensorflow=not args.no_tensorflow, paths=args.path,
                 progress=(lambda msg: None) if args.quiet else progress)
    progress.done()
    try:
        if args.json:
            print(json.dumps(rep, indent=2))  # machine-readable: as it is
        else:
            from keras_scale.output import say

            say(format_report(rep))
        sys.stdout.flush()
    except BrokenPipeError:  # `keras-scale doctor | head`: the reader has what it wanted; no traceback
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the flush at exit does not raise again
        except (OSError, ValueError, AttributeError):
            pass
    return exit_code(rep, strict=args.strict)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
