"""The checks in the order the report lists them (one family per line), and running them on gathered facts."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Sequence, Tuple

from keras_scale.doctor.cuda_libraries import check_cuda_libraries, check_cuda_wheels, check_library_conflicts
from keras_scale.doctor.driver import check_compute_capability, check_driver_cuda, check_nvidia_driver
from keras_scale.doctor.env_vars import check_memory_growth, check_nccl_env, check_tf_config
from keras_scale.doctor.facts import CheckResult, Facts
from keras_scale.doctor.gpu_state import (check_gpu_memory_errors, check_gpu_modes, check_gpu_topology,
                                          check_pcie_link, check_power_limit, check_throttling)
from keras_scale.doctor.gpus import (check_gpu_processes, check_gpu_visibility, check_gpus_responding, check_mig,
                                     check_placement)
from keras_scale.doctor.host_checks import (check_cpu_per_gpu, check_host_memory, check_memlock, check_numa,
                                            check_shm, check_storage)
from keras_scale.doctor.versions import check_keras, check_python, check_tensorflow, check_tf_build, check_versions
from keras_scale.doctor.xla_flags import check_xla_flags


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
