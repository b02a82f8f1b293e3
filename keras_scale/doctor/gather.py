"""Gathering :class:`~keras_scale.doctor.facts.Facts` from this machine: NVML, the TensorFlow probe (a child
process), the host, packages, libraries and settings; each family module supplies its own readers."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

from keras_scale.doctor.cuda_libraries import (_conda_cuda_packages, _ld_cuda_dirs, _pip_nvidia_packages,
                                               _tf_wheel_floors)
from keras_scale.doctor.env_vars import _net_interfaces, _read_nccl_conf
from keras_scale.doctor.facts import Facts
from keras_scale.doctor.probe import _TfProbe
from keras_scale.doctor.versions import _installed_versions, _requirements
from keras_scale.doctor.xla_flags import _tf_library_paths, _xla_flag_names, unknown_xla_flags, xla_flag_kinds
from keras_scale.host import gather_host_facts


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
