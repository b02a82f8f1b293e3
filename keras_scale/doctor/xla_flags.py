"""Check family: ``XLA_FLAGS`` and ``TF_XLA_FLAGS``, tokenised as XLA does and looked up in TensorFlow's own
libraries (flags XLA does not define, or that need a value, abort TensorFlow)."""
from __future__ import annotations

import importlib.util
import mmap
import os
import shlex
from typing import Any, Dict, List, Optional, Sequence, Tuple

from keras_scale.doctor.facts import CheckResult, Facts


def _tf_library_paths(prefix: str = "libtensorflow_framework.so") -> List[str]:
    """TensorFlow's shared library whose name starts with ``prefix``, found without importing TensorFlow:
    ``libtensorflow_framework.so`` defines the XLA flags (``XLA_FLAGS``), ``libtensorflow_cc.so`` TensorFlow's own
    (``TF_XLA_FLAGS``)."""
    try:
        spec = importlib.util.find_spec("tensorflow")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    out = []
    for d in spec.submodule_search_locations:
        try:
            out.extend(os.path.join(d, f) for f in sorted(os.listdir(d)) if f.startswith(prefix))
        except OSError:
            continue
    return out[:1]


def _xla_tokens(value: str) -> Tuple[List[str], Optional[str]]:
    """The tokens of an ``XLA_FLAGS``/``TF_XLA_FLAGS`` value as XLA reads them, and what is wrong with the value as
    a whole. XLA treats a value that does not start with ``-`` as the name of a file holding the flags (and aborts
    with "Could not open file" when there is none); quotes group a value with spaces."""
    value = value.strip()
    problem = None
    if value and not value.startswith("-"):
        if os.path.isfile(value):
            try:
                with open(value) as f:
                    value = f.read().strip()
            except OSError as e:
                return [], f"{value!r} is read as a flags file, which cannot be read ({e})"
        else:
            return [], (f"{value!r} does not start with '--', so XLA reads it as the name of a file holding the "
                        "flags; there is no such file, and XLA aborts ('Could not open file ... to read flags')")
    try:
        return shlex.split(value), problem
    except ValueError as e:
        return value.split(), f"cannot be parsed ({e}): unbalanced quotes"


def _xla_flag_names(value: str) -> List[str]:
    """Flag names in an ``XLA_FLAGS`` value, tokenised as XLA does (quotes group a value with spaces)."""
    return [t[2:].split("=", 1)[0] for t in _xla_tokens(value)[0] if t.startswith("--")]


def unknown_xla_flags(value: str, libraries: Sequence[str], whole_word: bool = False) -> Optional[List[str]]:
    """Names in ``XLA_FLAGS`` (or ``TF_XLA_FLAGS``) that the TensorFlow ``libraries`` do not define (XLA aborts
    on them); None when no library could be read. ``whole_word`` looks for the name as a whole C string.

    Example:
        >>> unknown_xla_flags("--xla_gpu_autotune_level=2", [])  # no library to look in
    """
    names = [n for n in _xla_flag_names(value) if n]
    for path in libraries:
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return [n for n in names if m.find((b"\0" if whole_word else b"") + n.encode() + b"\0") < 0]
        except (OSError, ValueError):
            continue
    return None


# TF_XLA_FLAGS that take a value (tensorflow/compiler/jit/flags.cc; the rest are true/false): given alone, TensorFlow
# aborts ("Unknown flag in TF_XLA_FLAGS: --tf_xla_auto_jit", checked with TF 2.21).
_TF_XLA_VALUE_FLAGS = {"tf_xla_auto_jit", "tf_xla_min_cluster_size", "tf_xla_max_cluster_size",
                       "tf_xla_clustering_fuel", "tf_xla_ops_to_cluster", "tf_xla_cluster_exclude_ops",
                       "tf_xla_persistent_cache_directory", "tf_xla_persistent_cache_device_types",
                       "tf_xla_persistent_cache_prefix"}

# google.protobuf FieldDescriptorProto.Type -> what a flag of that field takes
_PROTO_KINDS = {8: "bool", 1: "float", 2: "float", 3: "integer", 4: "integer", 5: "integer", 13: "integer",
                17: "integer", 18: "integer", 9: "string", 12: "string", 14: "enum", 11: "message"}


def _varint(m: Any, i: int) -> Tuple[int, int]:
    value, shift = 0, 0
    while i < len(m):
        b = m[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            break
        shift += 7
    return value, i


def xla_flag_kinds(names: Sequence[str], libraries: Sequence[str]) -> Dict[str, str]:
    """What each XLA flag takes (``"bool"``, ``"integer"``, ``"float"``, ``"string"``, ``"enum"``), read from the
    ``DebugOptions`` protocol-buffer descriptor inside TensorFlow's XLA (each flag is a field of it). Only a
    ``bool`` flag may be given without ``=value``; XLA aborts on ``--xla_gpu_autotune_level`` alone. Names not
    found are left out.

    Example:
        >>> xla_flag_kinds(["xla_gpu_autotune_level"], [])
        {}
    """
    out: Dict[str, str] = {}
    for path in libraries:
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                for name in names:
                    raw = name.encode()
                    if not raw or len(raw) > 127:
                        continue
                    # FieldDescriptorProto: name (1, bytes), number (3, varint), label (4), type (5)
                    at = m.find(b"\n" + bytes([len(raw)]) + raw + b"\x18")
                    if at < 0:
                        continue
                    _, i = _varint(m, at + len(raw) + 3)
                    if m[i:i + 1] != b" ":
                        continue
                    _, i = _varint(m, i + 1)
                    if m[i:i + 1] != b"(":
                        continue
                    kind, _ = _varint(m, i + 1)
                    out[name] = _PROTO_KINDS.get(kind, "other")
            return out
        except (OSError, ValueError):
            continue
    return out


def _flags_kill_tensorflow(f: Facts) -> bool:
    """TF_XLA_FLAGS / XLA_FLAGS hold something TensorFlow aborts on (so a crash is theirs, not the install's)."""
    hints = [h for h in f.tf.get("log_hints") or [] if "Unknown flag" in h or "to read flags" in h]
    return bool(hints or _xla_flag_errors(f))


def _xla_flag_errors(f: Facts) -> List[str]:
    """What in TF_XLA_FLAGS / XLA_FLAGS makes TensorFlow abort (each parsed by XLA's flag parser, which dies on
    anything it does not know)."""
    errors = []
    for var in ("TF_XLA_FLAGS", "XLA_FLAGS"):
        value = f.env.get(var, "").strip()
        if not value:
            continue
        tokens, problem = _xla_tokens(value)
        if problem:
            errors.append(f"{var}: {problem}")
        for tok in tokens:
            name, has_value = tok[2:].split("=", 1)[0], "=" in tok
            if not tok.startswith("--"):
                errors.append(f"{var}: {tok!r} is not a --flag" + (" (single dash)" if tok.startswith("-") else "")
                              + f"; the parser aborts ('Unknown flag in {var}')")
            elif var == "XLA_FLAGS" and not name.startswith("xla_"):
                errors.append(f"XLA_FLAGS: {tok} is not an XLA flag (they start with --xla_); XLA aborts with "
                              "'Unknown flag in XLA_FLAGS'")
            elif var == "XLA_FLAGS" and not has_value and f.xla_flag_kinds.get(name, "bool") != "bool":
                errors.append(f"XLA_FLAGS: {tok} takes a value ({f.xla_flag_kinds[name]}): only true/false flags may "
                              f"be given alone; XLA aborts with 'Unknown flag in XLA_FLAGS: {tok}'")
            elif var == "TF_XLA_FLAGS" and not has_value and name in _TF_XLA_VALUE_FLAGS:
                errors.append(f"TF_XLA_FLAGS: {tok} takes a value (e.g. {tok}=...): TensorFlow aborts with 'Unknown "
                              f"flag in TF_XLA_FLAGS: {tok}'")
    unknown = [n for n in f.xla_unknown_flags or [] if n.startswith("xla_")]
    if unknown:
        errors.append(f"XLA_FLAGS: {', '.join('--' + n for n in unknown)} not defined by this TensorFlow's XLA: it "
                      "aborts at the first compile ('Unknown flag in XLA_FLAGS')")
    if f.tf_xla_unknown_flags:
        errors.append(f"TF_XLA_FLAGS: {', '.join('--' + n for n in f.tf_xla_unknown_flags)} not defined by this "
                      "TensorFlow: it aborts at its first op ('Unknown flag in TF_XLA_FLAGS')")
    return errors


def check_xla_flags(f: Facts) -> CheckResult:
    """TF_XLA_FLAGS / XLA_FLAGS: flags XLA does not know, a value that is not ``--flags`` (XLA reads it as a file
    name), a numeric flag without its value (all abort), dumps left on, a CUDA data dir that does not exist.
    Values are tokenised as XLA does: quotes group a value with spaces."""
    name = "xla_flags"
    errors, problems, shown = _xla_flag_errors(f), [], []
    for var in ("TF_XLA_FLAGS", "XLA_FLAGS"):
        value = f.env.get(var, "").strip()
        if not value:
            continue
        shown.append(f"{var}={value!r}")
        for tok in _xla_tokens(value)[0]:
            if tok.startswith("--xla_dump_to"):
                problems.append(f"{var}: {tok} dumps every compiled module (slow, fills the disk)")
            elif tok.startswith("--xla_gpu_cuda_data_dir="):
                path = tok.split("=", 1)[1]
                if not os.path.isdir(path):
                    problems.append(f"{var}: --xla_gpu_cuda_data_dir={path} does not exist (XLA cannot find "
                                    "ptxas/libdevice)")
    hints = [h for h in f.tf.get("log_hints") or [] if "Unknown flag" in h or "to read flags" in h]
    if hints and not errors:
        errors.append("TensorFlow said: " + hints[0])
    if errors:
        return CheckResult(name, "error", "; ".join(errors + problems), "Remove or correct those flags (the "
                           "names differ between XLA versions); check spelling against the XLA of your TensorFlow.")
    if problems:
        return CheckResult(name, "warn", "; ".join(problems), "Fix or unset the flags; remove dump flags after "
                           "debugging.")
    if not shown:
        return CheckResult(name, "ok", "No XLA flags set.")
    return CheckResult(name, "ok", "; ".join(shown))
