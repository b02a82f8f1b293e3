"""Check family: the NVIDIA driver and CUDA: the driver against the CUDA the TensorFlow wheel was built for
(the table in ``data_files/cuda_driver_minimums.json``) and each GPU's compute capability against the wheel's
kernels."""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from keras_scale.doctor.facts import CheckResult, Facts, _no_tf, _no_visible, _ver

_DATA_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data_files",
                          "cuda_driver_minimums.json")


def load_driver_minimums(path: str = _DATA_FILE) -> Dict[str, Dict[str, str]]:
    """The driver-minimum table as ``{"toolkit": {"12.5.1": "555.42.06", ...}, "minor_version_compatibility":
    {"12": "525.60.13", ...}}``; the data file also names each row's release and source.

    Example:
        >>> load_driver_minimums()["toolkit"]["12.5.1"]
        '555.42.06'
    """
    with open(path) as f:
        data = json.load(f)
    return {section: {k: row["driver"] for k, row in data[section].items()}
            for section in ("toolkit", "minor_version_compatibility")}


def check_nvidia_driver(f: Facts) -> CheckResult:
    """The NVIDIA driver as NVML reports it — or, plainly, that there is no GPU."""
    if f.nvml_error:
        if f.nvml_error_kind == "no_driver":
            return CheckResult("nvidia_driver", "skip", f"No GPU present: {f.nvml_error}. Training runs on the CPU.")
        if f.nvml_error_kind == "no_module":
            return CheckResult("nvidia_driver", "warn", f"Cannot check the GPUs: {f.nvml_error}.",
                           "pip install nvidia-ml-py")
        if re.search(r"GpuIsLost|GPU is lost|fallen off the bus", f.nvml_error, re.IGNORECASE):
            return CheckResult("nvidia_driver", "error", f"NVML fails because a GPU is lost (fallen off the bus, Xid "
                               f"79): {f.nvml_error}.", "Drain the node: `sudo dmesg | grep -i xid` shows which GPU; "
                               "reset it (`sudo nvidia-smi -r -i <index>`) or reboot; no driver reinstall needed.")
        return CheckResult("nvidia_driver", "error", f"The NVIDIA driver is installed but not usable: {f.nvml_error}.",
                       "Run `nvidia-smi`; reboot after a driver update, or reinstall the driver.")
    if not f.gpus:
        return CheckResult("nvidia_driver", "skip", f"NVIDIA driver {f.driver_version} but no GPU present.")
    cuda = f.cuda_driver_version
    return CheckResult("nvidia_driver", "ok", f"driver {f.driver_version}, supports CUDA up to "
                   f"{'%d.%d' % cuda if cuda else '?'}; {len(f.gpus)} GPU(s): "
                   + ", ".join(sorted({g.name for g in f.gpus})))


def check_driver_cuda(f: Facts, minimums: Optional[Dict[str, Dict[str, str]]] = None) -> CheckResult:
    """Does the driver support the CUDA version the TensorFlow wheel was built for? (table in data_files/)."""
    name = "driver_vs_cuda"
    if not f.driver_version:
        return CheckResult(name, "skip", "No NVIDIA driver to compare.")
    if no := _no_tf(f, name):
        return no
    b = f.tf.get("build") or {}
    if not b.get("is_cuda_build") or not b.get("cuda_version"):
        return CheckResult(name, "skip", "TensorFlow is not a CUDA build.")
    table = minimums or load_driver_minimums()
    wheel = _ver(str(b["cuda_version"]))
    key = str(b["cuda_version"])
    drv = _ver(f.driver_version)
    toolkit_min = _toolkit_minimum(table, key)
    compat_min = table["minor_version_compatibility"].get(str(wheel[0]))
    if toolkit_min is None and compat_min is None:
        return CheckResult(name, "skip", f"No driver minimum known for CUDA {b['cuda_version']}; update "
                       "keras_scale/data_files/cuda_driver_minimums.json.")
    cuda_max = f.cuda_driver_version
    if cuda_max and cuda_max[0] < wheel[0]:
        return CheckResult(name, "error", f"Driver {f.driver_version} supports CUDA up to {cuda_max[0]}.{cuda_max[1]}, "
                       f"but TensorFlow {f.tf_version} was built for CUDA {b['cuda_version']}: no GPU will work.",
                       f"Upgrade the NVIDIA driver to >= {toolkit_min or compat_min}.")
    # the x.0 toolkit's own driver can predate the minor-compatibility floor (11.0 GA: 450.51.05 < 450.80.02)
    floor = min((m for m in (compat_min, toolkit_min) if m), key=_ver)
    if drv < _ver(floor):
        return CheckResult(name, "error", f"Driver {f.driver_version} is too old for CUDA {b['cuda_version']} "
                       f"(TensorFlow {f.tf_version}): CUDA {wheel[0]}.x needs >= {floor}.",
                       f"Upgrade the NVIDIA driver to >= {toolkit_min or floor}.")
    same_minor = _ptx_driver_minimum(table, key)
    if toolkit_min and same_minor and _ver(same_minor) <= drv < _ver(toolkit_min):
        return CheckResult(name, "warn", f"Driver {f.driver_version} is of the same CUDA {wheel[0]}.{wheel[1]} "
                           f"release as TensorFlow's CUDA {key}, which shipped with {toolkit_min}: same PTX ISA, so "
                           "kernels and PTX JIT work; the newer driver's fixes are missing.",
                           f"Upgrade the NVIDIA driver to >= {toolkit_min} when convenient.")
    if toolkit_min and drv < _ver(toolkit_min):
        return CheckResult(name, "warn", f"Driver {f.driver_version} runs CUDA {b['cuda_version']} only through minor "
                       f"version compatibility (CUDA {key} shipped with {toolkit_min}): PTX JIT for newer GPUs and "
                       "some XLA kernels can fail (CUDA_ERROR_UNSUPPORTED_PTX_VERSION).",
                       f"Upgrade the NVIDIA driver to >= {toolkit_min}.")
    return CheckResult(name, "ok", f"driver {f.driver_version} >= {toolkit_min} needed by CUDA {b['cuda_version']}")


def _wheel_archs(build: Mapping[str, Any]) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """``(sass, ptx)`` compute capabilities of the wheel (``sm_80`` -> (8, 0) binary; ``compute_90`` -> PTX)."""
    sass, ptx = [], []
    for arch in build.get("cuda_compute_capabilities") or []:
        m = re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", str(arch))
        if m:
            (sass if m.group(1) == "sm" else ptx).append((int(m.group(2)), int(m.group(3))))
    return sass, ptx


def check_compute_capability(f: Facts, minimums: Optional[Dict[str, Dict[str, str]]] = None) -> CheckResult:
    """Each visible GPU's compute capability against the kernels in the TensorFlow wheel (``sm_XY`` binaries run
    on the same major version; ``compute_XY`` PTX needs the driver to JIT-compile it)."""
    name = "compute_capability"
    if not f.visible_gpus:
        return CheckResult(name, "skip", _no_visible(f))
    if no := _no_tf(f, name):
        return no
    build = f.tf.get("build") or {}
    sass, ptx = _wheel_archs(build)
    if not sass and not ptx:
        return CheckResult(name, "skip", "The TensorFlow wheel does not report its CUDA architectures.")
    wheel = ", ".join(str(a) for a in build.get("cuda_compute_capabilities") or [])
    table = minimums or load_driver_minimums()
    need = _ptx_driver_minimum(table, str(build.get("cuda_version") or ""))
    errors, jit, native, fixes = [], [], [], {}
    newest = max(sass + ptx)
    oldest = min(sass + ptx)
    for g in f.visible_gpus:
        cc = getattr(f.health.get(g.index), "compute_capability", None)
        if cc is None:
            continue
        label = f"GPU {g.index} ({g.name}, {cc[0]}.{cc[1]})"
        if any(s[0] == cc[0] and s[1] <= cc[1] for s in sass):
            native.append(label)
        elif cc[0] >= 10 and not any(a[0] >= 10 for a in sass + ptx):
            errors.append(f"{label}: Blackwell is not supported by this wheel (its newest kernels are for "
                          f"{newest[0]}.{newest[1]}; TensorFlow issues report 'PTX version ... does not support "
                          "sm_100/sm_120'); no driver changes that")
            fixes["arch"] = (f"No driver helps for compute capability {cc[0]}.{cc[1]}: use a TensorFlow build with "
                             f"kernels for sm_{cc[0]}{cc[1]} (NVIDIA's NGC TensorFlow container, or TensorFlow built "
                             f"from source with TF_CUDA_COMPUTE_CAPABILITIES={cc[0]}.{cc[1]}), or a GPU this wheel "
                             f"supports ({oldest[0]}.{oldest[1]} to {newest[0]}.{newest[1]})")
        elif any(p <= cc for p in ptx):
            if need and f.driver_version and _ver(f.driver_version) < _ver(need):
                errors.append(f"{label}: runs only on PTX JIT-compiled by the driver, and driver "
                              f"{f.driver_version} cannot compile CUDA {build.get('cuda_version')} PTX "
                              f"(needs >= {need}):"
                              " the first kernel fails (CUDA_ERROR_UNSUPPORTED_PTX_VERSION)")
                fixes["driver"] = f"Upgrade the NVIDIA driver to >= {need} (it then JIT-compiles the wheel's PTX)"
            else:
                jit.append(label)
        else:
            errors.append(f"{label}: older than every kernel in the wheel (it starts at {oldest[0]}.{oldest[1]}); "
                          "TensorFlow skips this GPU, and no driver changes that")
            fixes["old"] = (f"No driver helps for compute capability {cc[0]}.{cc[1]}: use a GPU of compute capability "
                            f">= {oldest[0]}.{oldest[1]}, or TensorFlow {f.tf_version} built from source with "
                            f"TF_CUDA_COMPUTE_CAPABILITIES={cc[0]}.{cc[1]} (if its CUDA still supports it)")
    detail_tail = f" Wheel kernels: {wheel}."
    if errors:
        return CheckResult(name, "error", "; ".join(errors) + "." + detail_tail, "; ".join(fixes.values()) + ".")
    if not native and not jit:
        return CheckResult(name, "skip", "NVML does not report the compute capability of the visible GPUs.")
    detail = "; ".join(filter(None, [f"native kernels: {', '.join(native)}" if native else "",
                                     f"PTX JIT by the driver: {', '.join(jit)}" if jit else ""])) + "." + detail_tail
    return CheckResult(name, "ok", detail, "The first run JIT-compiles PTX (minutes); keep the cache: export "
                       "CUDA_CACHE_MAXSIZE=4294967296" if jit else "")


def _ptx_driver_minimum(table: Dict[str, Dict[str, str]], cuda_version: str) -> Optional[str]:
    """The oldest driver that JIT-compiles the PTX of a CUDA version: PTX ISA versions follow CUDA's major.minor
    (CUDA 12.5 GA and 12.5 Update 1 both emit PTX ISA 8.5, per the PTX ISA release history), so the GA driver of
    that minor release (555.42.02 for 12.5.1) is enough."""
    want = _ver(cuda_version)[:2]
    same = sorted((row for k, row in table["toolkit"].items() if _ver(k)[:2] == want), key=_ver)
    return same[0] if same else _toolkit_minimum(table, cuda_version)


def _toolkit_minimum(table: Dict[str, Dict[str, str]], cuda_version: str) -> Optional[str]:
    """The driver a CUDA version's toolkit shipped with: the row of that version, or the nearest lower one of the
    same major version."""
    want = _ver(cuda_version)
    if not want:
        return None
    known = sorted((k for k in table["toolkit"] if _ver(k)[0] == want[0] and _ver(k) <= want), key=_ver)
    return table["toolkit"][known[-1]] if known else None
