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

The package, one module per concern (each readable alone; :mod:`~keras_scale.doctor.checks` lists the order):

    facts.py           Facts, CheckResult and the helpers every check shares
    gather.py          gather_facts(): NVML, the TensorFlow probe, host, packages, settings
    probe.py           the TensorFlow probe as a child process
    checks.py          CHECKS (the report's order), run_checks(), report()
    command.py         ``keras-scale doctor``: the text table, exit code, progress lines
    check families:    versions.py (Python, TensorFlow, Keras), driver.py (driver vs CUDA, compute capability),
                       cuda_libraries.py (pip wheels, conda/LD_LIBRARY_PATH copies), gpus.py (which GPUs, MIG,
                       other processes, smoke test), gpu_state.py (ECC, modes, PCIe, power, throttling, topology),
                       host_checks.py (CPU, RAM, NUMA, storage, /dev/shm, memlock), xla_flags.py (XLA_FLAGS,
                       TF_XLA_FLAGS), env_vars.py (memory growth/allocator, NCCL_*, TF_CONFIG)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence

from keras_scale._tf_probe import SMOKE_OPS
from keras_scale.doctor.checks import CHECKS, report, run_checks
from keras_scale.doctor.command import cli, exit_code, format_report
from keras_scale.doctor.cuda_libraries import check_cuda_libraries, check_cuda_wheels, check_library_conflicts
from keras_scale.doctor.driver import (check_compute_capability, check_driver_cuda, check_nvidia_driver,
                                       load_driver_minimums)
from keras_scale.doctor.env_vars import check_memory_growth, check_nccl_env, check_tf_config
from keras_scale.doctor.facts import STATUSES, CheckResult, Facts
from keras_scale.doctor.gather import gather_facts
from keras_scale.doctor.gpu_state import (check_gpu_memory_errors, check_gpu_modes, check_gpu_topology,
                                          check_pcie_link, check_power_limit, check_throttling)
from keras_scale.doctor.gpus import (check_gpu_processes, check_gpu_visibility, check_gpus_responding, check_mig,
                                     check_placement)
from keras_scale.doctor.host_checks import (check_cpu_per_gpu, check_host_memory, check_memlock, check_numa,
                                            check_shm, check_storage)
from keras_scale.doctor.versions import (PYTHON_FLOOR, check_keras, check_python, check_tensorflow, check_tf_build,
                                         check_versions)
from keras_scale.doctor.xla_flags import check_xla_flags, unknown_xla_flags, xla_flag_kinds
from keras_scale.host import HostFacts, gather_host_facts

__all__ = ["doctor", "cli", "CheckResult", "Facts", "HostFacts", "gather_facts", "gather_host_facts", "run_checks",
           "CHECKS", "SMOKE_OPS", "load_driver_minimums", "unknown_xla_flags"]

# the rest of the names this module has always had (the checks one by one, the report's parts): kept importable
_ALSO = (STATUSES, PYTHON_FLOOR, report, exit_code, format_report, xla_flag_kinds,
         check_python, check_tensorflow, check_keras, check_versions, check_tf_build, check_nvidia_driver,
         check_driver_cuda, check_compute_capability, check_cuda_wheels, check_library_conflicts, check_cuda_libraries,
         check_gpus_responding, check_gpu_visibility, check_mig, check_gpu_processes, check_gpu_memory_errors,
         check_gpu_modes, check_pcie_link, check_power_limit, check_throttling, check_gpu_topology, check_placement,
         check_cpu_per_gpu, check_host_memory, check_numa, check_storage, check_shm, check_memlock,
         check_memory_growth, check_xla_flags, check_nccl_env, check_tf_config)


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
