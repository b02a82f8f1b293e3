"""The TensorFlow probe of ``keras-scale doctor``, run as a bare child process: ``python _tf_probe.py``.

It imports TensorFlow, reads the build info (CUDA, cuDNN, the wheel's GPU architectures), lists the GPUs, turns
memory growth on (so it never reserves memory of GPUs another job uses) and runs four smoke ops on each device.
After each stage it prints a line ``KERAS_SCALE_TF_PROBE {json}`` with the result so far, so the parent keeps
what was learnt when a later stage crashes (an XLA abort, a segfault in a kernel). It imports nothing from
keras_scale: it runs as a script, with this directory taken off ``sys.path``.

Example:
    $ python keras_scale/_tf_probe.py | tail -1
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Dict

PROBE_MARK = "KERAS_SCALE_TF_PROBE "
SMOKE_OPS = ("elementwise", "matmul", "conv", "jit_compile")


def _smoke(tf: Any, op: str) -> bool:
    """One small op of each kind that can fail where another passes (different kernels, libraries, compilers)."""
    if op == "elementwise":
        x = tf.fill((256, 256), 2.0)
        y = tf.exp(tf.math.log(x)) * x + 1.0  # element-wise kernels, compiled per architecture
        return abs(float(tf.reduce_mean(y)) - 5.0) < 1e-3
    if op == "matmul":
        a = tf.ones((64, 64))
        return abs(float(tf.matmul(a, a)[0, 0]) - 64.0) < 1e-3  # cuBLAS
    if op == "conv":
        img, kernel = tf.ones((1, 8, 8, 4)), tf.ones((3, 3, 4, 2))
        return abs(float(tf.nn.conv2d(img, kernel, 1, "VALID")[0, 0, 0, 0]) - 36.0) < 1e-3  # cuDNN
    fn = tf.function(lambda v: tf.reduce_sum(tf.nn.relu(v) * 2.0), jit_compile=True)  # XLA: ptxas / PTX JIT
    return abs(float(fn(tf.ones((32, 32)))) - 2048.0) < 1e-3


def probe_tensorflow(report: Callable[[Dict[str, Any]], None] = lambda out: None) -> Dict[str, Any]:
    """Runs in the child process: versions, build info, GPUs, memory growth, and four smoke ops per device.

    ``report`` is called after each stage with the result so far, so a crash in a later stage (an XLA abort on a
    bad flag, a segfault in a kernel) keeps what was learnt before it.
    """
    out: Dict[str, Any] = {"tensorflow": None, "error": None, "keras": None, "keras_backend": None,
                           "keras_error": None, "build": {}, "gpus": [], "memory_growth": {}, "placements": [],
                           "stage": "import"}
    try:
        import tensorflow as tf
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising anything
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    out["tensorflow"] = tf.__version__
    try:
        info = dict(tf.sysconfig.get_build_info())
        out["build"] = {k: info.get(k) for k in ("cuda_version", "cudnn_version", "is_cuda_build",
                                                 "cuda_compute_capabilities")}
    except Exception as e:  # noqa: BLE001
        out["build"] = {"error": str(e)}
    try:
        import keras

        out["keras"] = keras.__version__
        out["keras_backend"] = keras.config.backend() if hasattr(keras, "config") else "tensorflow"
    except Exception as e:  # noqa: BLE001
        out["keras_error"] = f"{type(e).__name__}: {e}"
    gpus = tf.config.list_physical_devices("GPU")
    out["gpus"] = [g.name for g in gpus]
    for g in gpus:
        try:
            out["memory_growth"][g.name] = bool(tf.config.experimental.get_memory_growth(g))
            # the smoke test must not reserve every GPU's memory under someone else's running job
            tf.config.experimental.set_memory_growth(g, True)
        except Exception:  # noqa: BLE001
            pass
    targets = [d.name for d in tf.config.list_logical_devices("GPU")] or ["/device:CPU:0"]
    for name in targets:
        for op in SMOKE_OPS:
            out["stage"] = f"{op} on {name}"
            report(out)
            entry = {"requested": name, "op": op, "device": None, "ok": False, "error": None}
            try:
                with tf.device(name):
                    entry["ok"] = bool(_smoke(tf, op))
                    entry["device"] = tf.identity(tf.constant(1.0)).device
            except Exception as e:  # noqa: BLE001
                entry["error"] = f"{type(e).__name__}: {e}"[:500]
            out["placements"].append(entry)
    out["stage"] = "done"
    return out


def main() -> int:
    """Print the probe's result line after each stage."""

    def report(out: Dict[str, Any]) -> None:
        print(PROBE_MARK + json.dumps(out), flush=True)

    report(probe_tensorflow(report))
    return 0


if __name__ == "__main__":
    # Run as a script: modules next to this file (data.py, profiling.py, ...) must not shadow top-level imports.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(main())
