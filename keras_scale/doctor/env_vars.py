"""Check family: the other environment variables that change training: ``TF_FORCE_GPU_ALLOW_GROWTH`` and
``TF_GPU_ALLOCATOR``, ``NCCL_*`` (and ``/etc/nccl.conf``, ``~/.nccl.conf``), ``TF_CONFIG`` (and the Slurm and
Kubernetes variables it competes with)."""
from __future__ import annotations

import json
import os
import re
import socket
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from keras_scale.doctor.facts import CheckResult, Facts
from keras_scale.host import read_text


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


def _net_interfaces() -> Optional[List[str]]:
    try:
        return sorted(name for _, name in socket.if_nameindex())
    except (OSError, AttributeError):
        return None


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
