"""Check family: Python, TensorFlow and Keras: importable, built how, and at the versions keras_scale declares."""
from __future__ import annotations

import importlib.metadata
import re
from typing import Dict, List, Optional

from keras_scale.doctor.facts import CheckResult, Facts, _no_tf, _ver
from keras_scale.doctor.xla_flags import _flags_kill_tensorflow

_VERSIONED = ("tensorflow", "tensorflow-cpu", "tf-nightly", "keras", "keras-nightly", "nvidia-ml-py", "keras-scale")


def _installed_versions() -> Dict[str, str]:
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _requirements() -> Optional[List[str]]:
    try:
        return list(importlib.metadata.requires("keras-scale") or [])
    except importlib.metadata.PackageNotFoundError:
        return None


#: the lowest Python keras_scale supports: pyproject.toml's ``requires-python`` (tests/test_packaging.py checks both)
PYTHON_FLOOR = (3, 10)


def check_python(f: Facts) -> CheckResult:
    """Python version (TensorFlow 2.21 wheels exist for 3.10-3.13; keras_scale requires :data:`PYTHON_FLOOR`)."""
    v = _ver(f.python_version)
    detail = f"Python {f.python_version}" + (f" ({f.python_executable})" if f.python_executable else "")
    if v[:2] < PYTHON_FLOOR:
        floor = ".".join(map(str, PYTHON_FLOOR))
        return CheckResult("python", "warn", detail,
                           f"keras_scale and recent TensorFlow wheels need Python >= {floor}; use a newer Python.")
    return CheckResult("python", "ok", detail)


def check_tensorflow(f: Facts) -> CheckResult:
    """TensorFlow importable (missing: warn and go on; crashing on import: error)."""
    if f.tf_version:
        return CheckResult("tensorflow", "ok", f"TensorFlow {f.tf_version}")
    if not f.tf:
        return CheckResult("tensorflow", "skip", "TensorFlow was not probed.")
    err = f.tf.get("error") or "unknown error"
    if "No module named 'tensorflow'" in err:
        return CheckResult("tensorflow", "warn", "TensorFlow is not installed; the NVML checks still ran, the "
                       "TensorFlow checks are skipped.", "pip install 'tensorflow[and-cuda]' (Linux with GPUs) or "
                       "pip install tensorflow")
    if _flags_kill_tensorflow(f):
        return CheckResult("tensorflow", "error", f"TensorFlow aborts at start-up on its flags, not a broken install "
                           f"(see xla_flags): {err}", "Correct or unset TF_XLA_FLAGS / XLA_FLAGS as the xla_flags "
                           "check says; TensorFlow itself is fine.")
    return CheckResult("tensorflow", "error", f"TensorFlow fails to import: {err}",
                   "Reinstall it in a clean virtualenv: pip install 'tensorflow[and-cuda]'; see the cuda_libraries "
                   "check for library problems.")


def check_keras(f: Facts) -> CheckResult:
    """Keras 3 with the TensorFlow backend."""
    if no := _no_tf(f, "keras"):
        return no
    if f.tf.get("keras") is None:
        return CheckResult("keras", "error", f"Keras fails to import: {f.tf.get('keras_error')}",
                           f"pip install 'keras>={_floors(f).get('keras', '3')}'")
    version, backend = f.tf["keras"], f.tf.get("keras_backend") or "?"
    if _ver(version)[:1] < (3,):
        return CheckResult("keras", "error", f"Keras {version}: keras_scale needs Keras 3.",
                           f"pip install 'keras>={_floors(f).get('keras', '3')}'")
    if backend != "tensorflow":
        return CheckResult("keras", "warn", f"Keras {version} uses the {backend!r} backend; keras_scale needs "
                       "'tensorflow'.", "export KERAS_BACKEND=tensorflow (or set \"backend\" in ~/.keras/keras.json)")
    return CheckResult("keras", "ok", f"Keras {version}, backend tensorflow")


def check_tf_build(f: Facts) -> CheckResult:
    """How the TensorFlow wheel was built (CUDA/cuDNN versions, or CPU-only)."""
    if no := _no_tf(f, "tf_build"):
        return no
    b = f.tf.get("build") or {}
    if not b.get("is_cuda_build"):
        if f.gpus:
            return CheckResult("tf_build", "error", f"This TensorFlow {f.tf_version} is a CPU-only build, but the "
                           f"machine has {len(f.gpus)} NVIDIA GPU(s).",
                           "pip install 'tensorflow[and-cuda]' (in a clean virtualenv)")
        return CheckResult("tf_build", "ok", "CPU-only TensorFlow build (no GPU on this machine either)")
    return CheckResult("tf_build", "ok", f"built for CUDA {b.get('cuda_version')}, cuDNN {b.get('cudnn_version')}")


_REQ = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*([^;]*)(?:;(.*))?$")
_TF_DISTS = ("tensorflow", "tensorflow-cpu", "tf-nightly")


def _floors(f: Facts) -> Dict[str, str]:
    """``{"tensorflow": "2.16", "keras": "3.8"}``: the ``>=`` floors keras_scale declares (not in extras)."""
    out: Dict[str, str] = {}
    for req in f.requirements or []:
        m = _REQ.match(req)
        if not m or (m.group(3) and "extra" in m.group(3)):
            continue
        floor = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", m.group(2) or "")
        if floor:
            out[m.group(1).lower().replace("_", "-")] = floor.group(1)
    return out


def check_versions(f: Facts) -> CheckResult:
    """Installed TensorFlow and Keras against the floors keras_scale declares (its installed metadata)."""
    name = "versions"
    if f.requirements is None:
        return CheckResult(name, "skip", "keras-scale is not installed as a package (running from a checkout), so "
                           "its declared version floors cannot be read.",
                           "pip install -e . (or pip install keras-scale)")
    shown, low, upgrades = [], [], []
    for dist, floor in _floors(f).items():
        candidates = _TF_DISTS if dist == "tensorflow" else (dist,)
        have = next(((d, f.installed[d]) for d in candidates if d in f.installed), None)
        if have is None:
            continue
        shown.append(f"{have[0]} {have[1]} (needs >= {floor})")
        if _ver(have[1])[:len(_ver(floor))] < _ver(floor):
            low.append(f"{have[0]} {have[1]} is below keras_scale's floor {floor}")
            upgrades.append(f"'{have[0]}>={floor}'")
    if low:
        return CheckResult(name, "error", "; ".join(low) + ".", "pip install " + " ".join(upgrades))
    return CheckResult(name, "ok", ", ".join(shown) or "No versioned requirement installed to compare.")
