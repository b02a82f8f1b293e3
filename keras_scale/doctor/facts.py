"""What the doctor's checks look at (:class:`Facts`) and what each says (:class:`CheckResult`), with the small
helpers every check family shares (version tuples, "TensorFlow was not probed", "no visible GPU")."""
from __future__ import annotations

import dataclasses
import platform
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from keras_scale.host import HostFacts

STATUSES = ("ok", "warn", "error", "skip")


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
        >>> from keras_scale.doctor import check_tf_config
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


def _ver(text: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text or ""))


def _no_tf(f: Facts, name: str) -> Optional[CheckResult]:
    if f.tf_version is None:
        why = "TensorFlow is not installed" if not f.tf.get("crashed") else "TensorFlow failed to start"
        if not f.tf:
            why = "TensorFlow was not probed"
        return CheckResult(name, "skip", f"{why}; this check needs it.")
    return None


def _no_visible(f: Facts) -> str:
    if f.gpu_order_uncertain:
        return "Which GPU(s) CUDA_VISIBLE_DEVICES selects is uncertain (see gpu_visibility); not checked."
    return "No visible GPU."
