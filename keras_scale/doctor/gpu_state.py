"""Check family: the state of each visible GPU as NVML reports it: ECC errors, compute and persistence mode,
PCIe link, power limit, throttling, and the links between GPUs."""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from keras_scale.doctor.facts import CheckResult, Facts, _no_visible


def _per_gpu(f: Facts, name: str) -> Optional[CheckResult]:
    if not f.visible_gpus:
        return CheckResult(name, "skip", _no_visible(f))
    if not f.health:
        return CheckResult(name, "skip", "NVML did not report the GPUs' state.")
    return None


def _reported(f: Facts) -> List[Tuple[Any, Any]]:
    """``(gpu, health)`` for each visible GPU whose state NVML reported, in the visible order."""
    return [(g, f.health[g.index]) for g in f.visible_gpus if f.health.get(g.index) is not None]


def check_gpu_memory_errors(f: Facts) -> CheckResult:
    """ECC: uncorrectable errors since the driver loaded, failed row remapping, retired pages or remapped rows
    waiting for a GPU reset."""
    name = "gpu_memory_errors"
    if no := _per_gpu(f, name):
        return no
    errors, warns = [], []
    for g, h in _reported(f):
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
    if not any(h.ecc_uncorrected_volatile is not None or h.pages_pending is not None for _, h in _reported(f)):
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
    for g, h in _reported(f):
        if h.pcie_width is None:
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
    for g, h in _reported(f):
        if h.power_limit_w is None or not h.power_default_limit_w:
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
