"""Check family: which GPUs this job gets: every GPU answering NVML, ``CUDA_VISIBLE_DEVICES`` and MIG against what
NVML and TensorFlow see, other processes holding them, and the smoke test that ops really run on them."""
from __future__ import annotations

import re

from keras_scale.advice import leftover_processes_message
from keras_scale.doctor.facts import CheckResult, Facts, _no_tf


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
