"""What the host contributes to training: CPU cores, memory, NUMA placement of the GPUs, the storage of the
data/checkpoint paths, ``/dev/shm``, the locked-memory limit, InfiniBand.

Everything is read from ``/proc`` and ``/sys`` under a root directory, so tests point it at a fabricated tree
instead of patching the machine. ``keras-scale doctor`` decides on these facts.

Example:
    >>> from keras_scale.host import gather_host_facts
    >>> facts = gather_host_facts(paths=["."])
    >>> facts.usable_cpus >= 1
    True
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["HostFacts", "CgroupLimits", "cgroup_limits", "gather_host_facts", "read_text"]


@dataclass
class HostFacts:
    """What the host contributes: CPUs, memory, NUMA, storage, ``/dev/shm``, pinned-memory limit, InfiniBand.

    Filled by :func:`gather_host_facts` from ``/proc`` and ``/sys`` under a root directory (tests point it at a
    fabricated tree). ``None`` means "could not be read here".

    Example:
        >>> HostFacts(physical_cores=16, usable_cpus=32, ram_mb=256000.0).physical_cores
        16
    """

    physical_cores: Optional[int] = None  # physical cores this process may run on (affinity and cgroup quota)
    usable_cpus: Optional[int] = None  # logical CPUs this process may run on
    ram_mb: Optional[float] = None  # MemTotal, or the cgroup memory limit when lower
    ram_limit_from: Optional[str] = None  # the cgroup file whose limit ram_mb is (None: MemTotal)
    cpu_limit_from: Optional[str] = None  # the cgroup file whose CPU quota caps the usable CPUs (None: no quota)
    gpu_numa_nodes: Dict[int, int] = field(default_factory=dict)  # GPU index -> NUMA node (-1: none reported)
    affinity_nodes: Optional[List[int]] = None  # NUMA nodes whose CPUs this process may use
    storage: List[Dict[str, Any]] = field(default_factory=list)  # {"path", "mount", "fstype", "device", "kind"}
    shm_mb: Optional[float] = None
    memlock_bytes: Optional[int] = None  # ulimit -l; None: unlimited
    infiniband: List[str] = field(default_factory=list)  # /sys/class/infiniband entries


def read_text(root: str, path: str) -> Optional[str]:
    """The text of ``path`` under ``root`` (``/proc/meminfo`` under ``/`` or a fabricated tree), None if unreadable.

    Example:
        >>> read_text("/", "/nonexistent/file") is None
        True
    """
    try:
        with open(os.path.join(root, path.lstrip("/"))) as f:
            return f.read()
    except OSError:
        return None


def _cpu_list(text: Optional[str]) -> List[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``."""
    out: List[int] = []
    for part in (text or "").strip().split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        elif part.strip().isdigit():
            out.append(int(part))
    return out


_NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "glusterfs", "ceph", "cephfs",
               "9p", "wekafs", "panfs", "fuse.sshfs", "fuse.gcsfuse", "fuse.s3fs", "fuse.rclone", "fuse.juicefs",
               "fuse.mountpoint-s3", "fuse.goofys", "fuse.blobfuse", "fuse.blobfuse2"}


def _storage_of(path: str, root: str, mounts: List[Tuple[str, str, str, str]]) -> Dict[str, Any]:
    """The mount holding ``path`` and what it is: ``nvme``, ``ssd``, ``hdd``, ``virtual`` (a VM's virtio/Xen disk,
    whose rotational flag means nothing), ``network``, ``memory``, ``container`` (overlay), ``missing`` (no such path)
    or ``unknown``."""
    if not path or not os.path.exists(os.path.join(root, path.lstrip("/")) if os.path.isabs(path) else path):
        return {"path": path, "mount": None, "fstype": None, "device": None, "kind": "missing"}
    real = os.path.realpath(path)
    best = max((m for m in mounts if real == m[1] or real.startswith(m[1].rstrip("/") + "/")),
               key=lambda m: len(m[1]), default=None)
    info: Dict[str, Any] = {"path": path, "mount": None, "fstype": None, "device": None, "kind": "unknown"}
    if best is None:
        return info
    device, mountpoint, fstype, _ = best
    info.update(mount=mountpoint, fstype=fstype, device=device)
    if fstype in _NETWORK_FS or fstype.startswith("nfs") or ":" in device or device.startswith("//"):
        info["kind"] = "network"
    elif fstype in ("tmpfs", "ramfs"):
        info["kind"] = "memory"
    elif fstype in ("overlay", "aufs", "fuse-overlayfs"):
        info["kind"] = "container"
    elif device.startswith("/dev/"):
        name = os.path.basename(device)
        if device.startswith("/dev/mapper/"):  # LVM / dm-crypt: find the dm-N device of that name
            for dm in sorted(os.listdir(os.path.join(root, "sys/class/block")) if os.path.isdir(
                    os.path.join(root, "sys/class/block")) else []):
                if (read_text(root, f"sys/class/block/{dm}/dm/name") or "").strip() == name:
                    name = dm
                    break
        candidates = [name, re.sub(r"p?\d+$", "", name) if name.startswith(("nvme", "mmcblk")) else
                      re.sub(r"\d+$", "", name)]
        rotational = next((r.strip() for r in (read_text(root, f"sys/class/block/{c}/queue/rotational")
                                                for c in candidates) if r is not None), None)
        if name.startswith(("vd", "xvd")):
            info["kind"] = "virtual"  # virtio/Xen disks report rotational=1 whatever backs them
        elif rotational == "1":
            info["kind"] = "hdd"
        elif rotational == "0":
            info["kind"] = "nvme" if name.startswith("nvme") else "ssd"
    return info


@dataclass
class CgroupLimits:
    """The tightest cgroup limits on this process: ``memory_bytes`` and ``cpus`` (a CPU quota, e.g. 2.5), with the
    file each came from; None where no limit is set.

    Example:
        >>> CgroupLimits(memory_bytes=2 ** 34, memory_from="/sys/fs/cgroup/memory.max").memory_bytes
        17179869184
    """

    memory_bytes: Optional[int] = None
    memory_from: Optional[str] = None
    cpus: Optional[float] = None
    cpu_from: Optional[str] = None


_UNLIMITED_BYTES = 2 ** 60  # cgroup v1 writes "unlimited" as 9223372036854771712


def _cgroup_paths(root: str) -> Dict[str, str]:
    """``/proc/self/cgroup`` as ``{"": v2 path, "memory": v1 path, "cpu": v1 path, ...}``."""
    out: Dict[str, str] = {}
    for line in (read_text(root, "proc/self/cgroup") or "").splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for c in controllers.split(",") if controllers else [""]:
            out[c.replace("name=", "")] = path
    return out


def _up_the_tree(base: str, path: str) -> List[str]:
    """``base/a/b``, ``base/a``, ``base``: a cgroup and its ancestors (limits of each apply)."""
    parts = [p for p in (path or "/").split("/") if p and p not in (".", "..")]
    return [base + "".join("/" + p for p in parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_limits(root: str = "/") -> CgroupLimits:
    """The memory and CPU limits of this process's cgroup, the lowest up its tree (a Slurm job or systemd unit
    sets them deep in the tree; a container sees its own at the root), for cgroup v2 (``memory.max``,
    ``cpu.max``) and v1 (``memory.limit_in_bytes``, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``).

    Example:
        >>> cgroup_limits("/nonexistent").memory_bytes is None
        True
    """
    paths = _cgroup_paths(root)
    out = CgroupLimits()

    def memory(where: str, text: Optional[str]) -> None:
        value = (text or "").strip()
        if value.isdigit() and int(value) < _UNLIMITED_BYTES and (
                out.memory_bytes is None or int(value) < out.memory_bytes):
            out.memory_bytes, out.memory_from = int(value), where

    def cpu(where: str, quota: Optional[str], period: Optional[str]) -> None:
        try:
            q, p = int((quota or "").strip()), int((period or "").strip())
        except ValueError:
            return
        if q > 0 and p > 0 and (out.cpus is None or q / p < out.cpus):
            out.cpus, out.cpu_from = q / p, where

    # cgroup v2: one unified tree
    for d in _up_the_tree("/sys/fs/cgroup", paths.get("", "/")):
        memory(f"{d}/memory.max", read_text(root, f"{d}/memory.max"))
        text = (read_text(root, f"{d}/cpu.max") or "").split()
        if len(text) >= 2:
            cpu(f"{d}/cpu.max", text[0], text[1])
    # cgroup v1: one tree per controller (a container sees its own cgroup mounted at the controller's root)
    for d in _up_the_tree("/sys/fs/cgroup/memory", paths.get("memory", "/")):
        memory(f"{d}/memory.limit_in_bytes", read_text(root, f"{d}/memory.limit_in_bytes"))
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for d in _up_the_tree(f"/sys/fs/cgroup/{mount}", paths.get("cpu", "/")):
            cpu(f"{d}/cpu.cfs_quota_us", read_text(root, f"{d}/cpu.cfs_quota_us"),
                read_text(root, f"{d}/cpu.cfs_period_us"))
    return out


def gather_host_facts(root: str = "/", paths: Sequence[str] = (), gpus: Sequence[Any] = (),
                      affinity: Optional[Sequence[int]] = None, memlock_bytes: Any = "read") -> HostFacts:
    """Read the host's CPUs, memory, NUMA placement of ``gpus``, storage of ``paths``, ``/dev/shm``, InfiniBand.

    Args:
        root: where ``/proc`` and ``/sys`` are (tests pass a fabricated tree).
        paths: data/checkpoint paths whose filesystem to classify (default: the working directory).
        gpus: :class:`keras_scale.nvml.GpuInfo` of the GPUs (for their PCI bus ids).
        affinity: CPUs this process may run on (default: ``os.sched_getaffinity(0)``).
        memlock_bytes: ``ulimit -l`` in bytes, None for unlimited (default: read with ``resource``).

    Example:
        >>> gather_host_facts().usable_cpus >= 1
        True
    """
    host = HostFacts()
    if affinity is None:
        try:
            affinity = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            affinity = list(range(os.cpu_count() or 1))
    cpus = set(affinity)
    limits = cgroup_limits(root)
    quota_cpus = None
    if limits.cpus is not None:
        quota_cpus = max(1, int(limits.cpus))
        if quota_cpus < len(cpus):
            host.cpu_limit_from = limits.cpu_from
    host.usable_cpus = min(len(cpus), quota_cpus or len(cpus))
    cores = set()
    for cpu in cpus:
        pkg = read_text(root, f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id")
        core = read_text(root, f"sys/devices/system/cpu/cpu{cpu}/topology/core_id")
        if pkg is not None and core is not None:
            cores.add((pkg.strip(), core.strip()))
    if cores:
        host.physical_cores = min(len(cores), quota_cpus or len(cores))
    meminfo = read_text(root, "proc/meminfo") or ""
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", meminfo, re.MULTILINE)
    ram = int(m.group(1)) / 1024.0 if m else None
    if limits.memory_bytes is not None and (ram is None or limits.memory_bytes / 2 ** 20 < ram):
        ram = limits.memory_bytes / 2 ** 20
        host.ram_limit_from = limits.memory_from
    host.ram_mb = ram
    for g in gpus:
        bus = (g.pci_bus_id or "").lower()
        if bus:
            sysfs_bus = bus[-12:] if len(bus) > 12 else bus  # NVML "00000000:17:00.0" -> sysfs "0000:17:00.0"
            node = read_text(root, f"sys/bus/pci/devices/{sysfs_bus}/numa_node")
            if node is not None and node.strip().lstrip("-").isdigit():
                host.gpu_numa_nodes[g.index] = int(node)
    nodes_dir = os.path.join(root, "sys/devices/system/node")
    if os.path.isdir(nodes_dir):
        nodes = {}
        for name in os.listdir(nodes_dir):
            if re.fullmatch(r"node\d+", name):
                nodes[int(name[4:])] = set(_cpu_list(read_text(root, f"sys/devices/system/node/{name}/cpulist")))
        host.affinity_nodes = sorted(n for n, node_cpus in nodes.items() if node_cpus & cpus)
    mounts = []
    for line in (read_text(root, "proc/mounts") or "").splitlines():
        parts = line.split()
        if len(parts) >= 4:
            mounts.append((parts[0], parts[1].replace("\\040", " "), parts[2], parts[3]))
    host.storage = [_storage_of(p, root, mounts) for p in (paths or [os.getcwd()])]
    shm = next((m for m in mounts if m[1] == "/dev/shm"), None)
    if shm is not None:
        size = re.search(r"(?:^|,)size=(\d+)([kmg]?)", shm[3])
        if size:
            host.shm_mb = int(size.group(1)) * {"": 1 / 2 ** 20, "k": 1 / 1024, "m": 1, "g": 1024}[size.group(2)]
        elif ram is not None:
            host.shm_mb = ram / 2  # tmpfs default: half of RAM
    if memlock_bytes == "read":
        try:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
            memlock_bytes = None if soft == resource.RLIM_INFINITY else int(soft)
        except (ImportError, OSError, ValueError):
            memlock_bytes = None
    host.memlock_bytes = memlock_bytes
    ib = os.path.join(root, "sys/class/infiniband")
    host.infiniband = sorted(os.listdir(ib)) if os.path.isdir(ib) else []
    return host
