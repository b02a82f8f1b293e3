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

__all__ = ["HostFacts", "gather_host_facts", "read_text"]


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
    whose rotational flag means nothing), ``network``, ``memory``, ``container`` (overlay) or ``unknown``."""
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
    quota = read_text(root, "sys/fs/cgroup/cpu.max")  # cgroup v2: "max 100000" or "200000 100000"
    quota_cpus = None
    if quota and not quota.startswith("max"):
        q, period = quota.split()[:2]
        quota_cpus = max(1, int(int(q) / int(period)))
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
    limit = (read_text(root, "sys/fs/cgroup/memory.max") or "").strip()
    if limit.isdigit():
        ram = min(ram or float("inf"), int(limit) / 2 ** 20)
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
