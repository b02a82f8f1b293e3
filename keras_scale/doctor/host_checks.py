"""Check family: the host that feeds the GPUs (facts from :mod:`keras_scale.host`): CPU cores per GPU, RAM
against GPU memory, NUMA, the storage of the data/checkpoint paths, ``/dev/shm`` and ``ulimit -l``."""
from __future__ import annotations

from typing import Any, Optional

from keras_scale.doctor.facts import CheckResult, Facts, _no_visible


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
