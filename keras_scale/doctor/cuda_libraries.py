"""Check family: the CUDA libraries TensorFlow loads: pip NVIDIA wheels against the driver, conda or
``LD_LIBRARY_PATH`` copies shadowing them, and what TensorFlow said while loading them."""
from __future__ import annotations

import importlib.metadata
import os
import re
from typing import Dict, List, Mapping, Sequence

from keras_scale.doctor.facts import CheckResult, Facts, _ver
from keras_scale.doctor.versions import _REQ, _TF_DISTS
from keras_scale.doctor.xla_flags import _flags_kill_tensorflow


def _pip_nvidia_packages() -> List[str]:
    found = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if name.startswith("nvidia-") and name not in ("nvidia-ml-py", "nvidia-ml-py3"):
            found.add(f"{name}=={dist.version}")
    return sorted(found)


_CUDA_LIB = re.compile(r"^lib(cudart|cudnn|cublas|cublasLt|cufft|cusolver|cusparse|nccl)\.so")
_CONDA_CUDA_PKG = re.compile(r"^(cudatoolkit|cudnn|cuda-toolkit|cuda-cudart|cuda-runtime|nccl|cuda-nvcc)-\d")


def _ld_cuda_dirs(env: Mapping[str, str]) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if not d or not os.path.isdir(d) or d in out:
            continue
        try:
            libs = sorted(f for f in os.listdir(d) if _CUDA_LIB.match(f))
        except OSError:
            continue
        if libs:
            out[d] = libs
    return out


def _conda_cuda_packages(env: Mapping[str, str], ld_dirs: Sequence[str]) -> Dict[str, List[str]]:
    prefixes = {env["CONDA_PREFIX"]} if env.get("CONDA_PREFIX") else set()
    prefixes |= {os.path.dirname(d.rstrip("/")) for d in ld_dirs}
    out: Dict[str, List[str]] = {}
    for prefix in sorted(prefixes):
        meta = os.path.join(prefix, "conda-meta")
        try:
            names = sorted(f[:-5] for f in os.listdir(meta) if f.endswith(".json") and _CONDA_CUDA_PKG.match(f))
        except OSError:
            continue
        if names:
            out[prefix] = names
    return out


_CUDA_WHEELS = {"nvidia-cuda-runtime": "CUDA runtime", "nvidia-cublas": "cuBLAS", "nvidia-cuda-nvcc": "ptxas (nvcc)",
                "nvidia-cuda-nvrtc": "NVRTC", "nvidia-nvjitlink": "nvJitLink"}


def _tf_wheel_floors() -> Dict[str, str]:
    """``{"nvidia-cuda-nvcc-cu12": "12.5.82", ...}``: the lowest NVIDIA wheel versions the installed TensorFlow
    accepts (its ``Requires-Dist``, extra ``and-cuda``), read without importing it."""
    for dist in _TF_DISTS:
        try:
            reqs = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        out = {}
        for req in reqs:
            m = _REQ.match(req)
            floor = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", (m.group(2) or "") if m else "")
            if m and floor and m.group(1).lower().startswith("nvidia-"):
                out[m.group(1).lower()] = floor.group(1)
        return out
    return {}


def check_cuda_wheels(f: Facts) -> CheckResult:
    """The pip CUDA wheels ``tensorflow[and-cuda]`` installed (newest ``nvidia-*-cu12`` by default) against the
    driver: a newer CUDA major needs a newer driver; a newer minor runs through minor version compatibility. The
    pins it suggests never go below what the installed TensorFlow requires."""
    name = "cuda_wheels"
    wheels = []
    for spec in f.pip_nvidia_packages:
        dist, _, version = spec.partition("==")
        base = re.sub(r"-cu\d+$", "", dist)
        if base in _CUDA_WHEELS and len(_ver(version)) >= 2:
            wheels.append((base, dist, version))
    if not wheels:
        return CheckResult(name, "skip", "No pip CUDA wheels (CUDA comes from the system or conda, or no GPU stack).")
    listed = ", ".join(f"{d}=={v}" for _, d, v in wheels)
    if not f.cuda_driver_version:
        return CheckResult(name, "skip", f"{listed}; no NVIDIA driver to compare with.")
    drv = f.cuda_driver_version
    errors, warns, pins, newest = [], [], [], (0, 0)
    for base, dist, version in wheels:
        cuda = _ver(version)[:2]
        what = f"{_CUDA_WHEELS[base]} {dist}=={version} (CUDA {cuda[0]}.{cuda[1]})"
        if cuda[0] > drv[0]:
            errors.append(f"{what} needs a CUDA {cuda[0]} driver; driver {f.driver_version} supports CUDA up to "
                          f"{drv[0]}.{drv[1]}")
        elif cuda[0] == drv[0] and cuda[1] > drv[1]:
            warns.append(f"{what} is newer than driver {f.driver_version} (CUDA {drv[0]}.{drv[1]})" + (
                ": XLA warns that the driver is older than the PTX compiler and compiles serially, and PTX it "
                "emits may not load (CUDA_ERROR_UNSUPPORTED_PTX_VERSION)" if base == "nvidia-cuda-nvcc" else
                ": runs through CUDA minor version compatibility only"))
        else:
            continue
        newest = max(newest, cuda)
        floor = f.tf_wheel_floors.get(dist)
        if floor and _ver(floor)[:2] > drv:
            pins.append(f"'{dist}=={floor}'")  # TensorFlow needs at least this: the closest to the driver it takes
        elif floor is None and cuda[0] > drv[0]:
            continue  # not TensorFlow's: nothing to pin it to; upgrade the driver or remove it
        else:
            pins.append(f"'{dist}=={drv[0]}.{drv[1]}.*'")
    build = (f.tf.get("build") or {}).get("cuda_version")
    runtimes = [v for b, d, v in wheels if b == "nvidia-cuda-runtime" and d in f.tf_wheel_floors] or [
        v for b, _, v in wheels if b == "nvidia-cuda-runtime"]
    if build and runtimes and all(_ver(v)[:1] != _ver(build)[:1] for v in runtimes):
        errors.append(f"the CUDA runtime wheel {runtimes[0]} is not CUDA {_ver(build)[0]}, which TensorFlow "
                      f"{f.tf_version} was built for")
    floors_above = [p for p in pins if "*" not in p]
    fix = f"Upgrade the NVIDIA driver to one supporting CUDA {newest[0]}.{newest[1]}"
    if pins:
        fix += ", or pin the wheels: pip install " + " ".join(pins)
        if floors_above:
            fix += (f" (the lowest versions this TensorFlow accepts; they still need minor version compatibility "
                    f"with the driver's CUDA {drv[0]}.{drv[1]})")
    if errors:
        return CheckResult(name, "error", "; ".join(errors + warns) + ".", fix + ".")
    if warns:
        return CheckResult(name, "warn", "; ".join(warns) + ".", fix + ".")
    return CheckResult(name, "ok", f"{listed}: all within the driver's CUDA {drv[0]}.{drv[1]}.")


def check_library_conflicts(f: Facts) -> CheckResult:
    """conda CUDA/cuDNN libraries on LD_LIBRARY_PATH together with pip NVIDIA wheels."""
    name = "library_conflicts"
    pip = f.pip_nvidia_packages
    conda = {p: pkgs for p, pkgs in f.conda_cuda_packages.items()}
    conda_dirs = [d for d in f.ld_cuda_dirs if any(d.startswith(p.rstrip("/") + "/") for p in conda)
                  or re.search(r"conda|mamba|miniforge", d, re.IGNORECASE)]
    other_dirs = [d for d in f.ld_cuda_dirs if d not in conda_dirs]
    if pip and (conda_dirs or conda):
        where = "; ".join(f"{p}: {', '.join(v)}" for p, v in conda.items()) or ", ".join(conda_dirs)
        return CheckResult(name, "warn", f"conda CUDA packages ({where}) alongside pip NVIDIA wheels "
                       f"({', '.join(pip[:4])}{'...' if len(pip) > 4 else ''})"
                       + (f"; on LD_LIBRARY_PATH: {', '.join(conda_dirs)}" if conda_dirs else "")
                       + ". The first library found wins, so TensorFlow may load a cuDNN/CUDA other than the one "
                         "it was built for.",
                       "Use one source: `conda remove cudatoolkit cudnn` (keep the pip wheels from "
                       "'tensorflow[and-cuda]'), or drop the conda lib dir from LD_LIBRARY_PATH.")
    if pip and other_dirs:
        return CheckResult(name, "warn", f"CUDA libraries on LD_LIBRARY_PATH ({', '.join(other_dirs)}) shadow the pip "
                       "NVIDIA wheels TensorFlow was built with.",
                       "Remove those directories from LD_LIBRARY_PATH unless you built TensorFlow against them.")
    src = "pip NVIDIA wheels" if pip else ("LD_LIBRARY_PATH: " + ", ".join(f.ld_cuda_dirs) if f.ld_cuda_dirs
                                           else "no CUDA libraries installed outside the driver")
    return CheckResult(name, "ok", f"One source of CUDA libraries ({src}).")


def check_cuda_libraries(f: Facts) -> CheckResult:
    """What TensorFlow said while loading CUDA/cuDNN (missing libraries, cuDNN version mismatch)."""
    name = "cuda_libraries"
    if not f.tf:
        return CheckResult(name, "skip", "TensorFlow was not probed.")
    hints = f.tf.get("log_hints") or []
    mismatch = [h for h in hints if "Loaded runtime CuDNN library" in h]
    missing = [h for h in hints if re.search(r"Could not load dynamic library|Cannot dlopen", h)]
    if mismatch:
        return CheckResult(name, "error", "cuDNN version mismatch: " + mismatch[0],
                       "Install the cuDNN TensorFlow was built for (pip install 'tensorflow[and-cuda]') and remove "
                       "other cuDNN copies from LD_LIBRARY_PATH.")
    if missing and f.gpus:
        return CheckResult(name, "error", "TensorFlow could not load CUDA libraries: " + " | ".join(missing[:3]),
                       "pip install 'tensorflow[and-cuda]' (CUDA, cuDNN as pip wheels), or install the CUDA/cuDNN "
                       "versions of the tf_build check and put them on LD_LIBRARY_PATH.")
    if f.tf.get("crashed") and _flags_kill_tensorflow(f):
        return CheckResult(name, "skip", "TensorFlow aborted on TF_XLA_FLAGS / XLA_FLAGS before loading its CUDA "
                           "libraries (see xla_flags); not a library problem.")
    if f.tf.get("crashed") and not f.tf_version:
        return CheckResult(name, "error", f"TensorFlow crashed while starting: {f.tf.get('error')}",
                       "Reinstall 'tensorflow[and-cuda]' in a clean virtualenv; check library_conflicts.")
    if not f.gpus:
        return CheckResult(name, "skip", "No GPU present: CUDA libraries not needed.")
    return CheckResult(name, "ok", "TensorFlow loaded its CUDA libraries without complaint.")
