"""Mixed-precision policy by GPU compute capability, and the float32-output check.

- :func:`choose_precision`: ``mixed_bfloat16`` on compute capability >= 8.0 (Ampere, Hopper: bf16 needs no loss
  scaling), ``mixed_float16`` on 7.x (Volta, Turing: Keras's ``compile`` then wraps the optimizer in a
  ``LossScaleOptimizer``), ``float32`` on older GPUs and on CPU.
- :func:`check_float32_outputs`: a model whose last layer computes in float16 returns float16 predictions; a
  softmax or a large regression target in float16 is a classic NaN/inf source. The check finds such output layers
  and sets them to float32 (or warns with the one-line fix when it cannot).

Example:
    >>> import keras, keras_scale as ks
    >>> policy = ks.choose_precision("auto")                  # 'float32' on this CPU
    >>> keras.mixed_precision.set_global_policy(policy)
    >>> model = build_model()                                 # doctest: +SKIP
    >>> check_float32_outputs(model)                          # doctest: +SKIP
    []
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, List, Optional, Sequence, Tuple, Union

import keras

__all__ = ["choose_precision", "gpu_compute_capabilities", "check_float32_outputs", "POLICIES"]

log = logging.getLogger("keras_scale")

#: explicit policies accepted by :func:`choose_precision` (plus any ``keras.DTypePolicy`` object)
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16", "bfloat16", "float16")

_LOW = ("float16", "bfloat16")


def gpu_compute_capabilities() -> List[Tuple[int, int]]:
    """Compute capability ``(major, minor)`` of every visible GPU, ``[]`` on a CPU-only machine.

    Example:
        gpu_compute_capabilities()
        # [(9, 0)]
    """
    import tensorflow as tf

    out = []
    for gpu in tf.config.list_physical_devices("GPU"):
        cc = tf.config.experimental.get_device_details(gpu).get("compute_capability")
        if cc:
            out.append((int(cc[0]), int(cc[1])))
    return out


def choose_precision(
    precision: Union[str, Any] = "auto",
    compute_capabilities: Optional[Sequence[Tuple[int, int]]] = None,
) -> str:
    """The Keras dtype policy name to train with.

    Args:
        precision: ``"auto"``, one of :data:`POLICIES`, or a ``keras.DTypePolicy``.
        compute_capabilities: the GPUs' ``(major, minor)``; default: read from the visible GPUs. With several
            GPUs the weakest decides (all replicas must use one policy).

    Returns:
        ``"mixed_bfloat16"`` (all GPUs >= 8.0), ``"mixed_float16"`` (all >= 7.0), else ``"float32"`` for
        ``"auto"``; the given policy's name otherwise.

    Example:
        >>> choose_precision("auto", compute_capabilities=[(8, 0)])
        'mixed_bfloat16'
        >>> choose_precision("auto", compute_capabilities=[(7, 5)])
        'mixed_float16'
        >>> choose_precision("auto", compute_capabilities=[])
        'float32'
        >>> choose_precision("mixed_float16")
        'mixed_float16'
    """
    if isinstance(precision, keras.DTypePolicy):
        return precision.name
    if not isinstance(precision, str):
        raise TypeError(
            f"precision must be 'auto', a policy name {POLICIES} or a keras.DTypePolicy, got {precision!r}"
        )
    if precision != "auto":
        if precision not in POLICIES:
            raise ValueError(
                f"unknown precision {precision!r}: use 'auto' or one of {POLICIES} "
                "(e.g. precision='mixed_bfloat16' on A100/H100)."
            )
        return precision
    caps = list(gpu_compute_capabilities() if compute_capabilities is None else compute_capabilities)
    if not caps:
        return "float32"
    weakest = min(tuple(c) for c in caps)
    if weakest >= (8, 0):
        return "mixed_bfloat16"
    if weakest >= (7, 0):
        return "mixed_float16"
    return "float32"


def _output_layers(model: keras.Model) -> Optional[list]:
    """Layers producing the model's outputs, or None when they cannot be known (subclassed models)."""
    outputs = getattr(model, "_outputs", None) if isinstance(model, keras.Model) else None
    if isinstance(model, keras.Sequential):
        return [model.layers[-1]] if model.layers else []
    if outputs:
        layers = []
        for t in keras.tree.flatten(outputs):
            history = getattr(t, "_keras_history", None)
            op = getattr(history, "operation", None) if history is not None else None
            if op is not None and op not in layers:
                layers.append(op)
        return layers
    return None


def check_float32_outputs(model: keras.Model, fix: bool = True) -> List[str]:
    """Make sure the model's outputs are computed in float32; return what was found/changed (one line each).

    Output layers whose dtype policy computes in float16/bfloat16 are switched to ``float32`` when ``fix`` (their
    weights are float32 under mixed policies already, so nothing else changes), else a warning with the one-line
    fix is issued. For subclassed models the outputs cannot be located: a warning is issued when the model itself
    computes in a low-precision dtype.

    Example:
        keras.mixed_precision.set_global_policy("mixed_float16")
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        check_float32_outputs(model)
        # ["output layer 'dense' computed in float16; set to float32"]
    """
    findings: List[str] = []
    layers = _output_layers(model)
    if layers is None:
        if getattr(model, "compute_dtype", "float32") in _LOW:
            msg = (
                f"model {model.name!r} computes in {model.compute_dtype} and its output layer cannot be located "
                "(subclassed model): make sure the last layer returns float32, e.g. end call() with "
                "`keras.layers.Activation('linear', dtype='float32')(x)`."
            )
            warnings.warn(msg, stacklevel=2)
            findings.append(msg)
        return findings
    for layer in layers:
        dtype = getattr(layer, "compute_dtype", "float32")
        if dtype not in _LOW:
            continue
        if fix:
            layer.dtype_policy = "float32"
            msg = f"output layer {layer.name!r} computed in {dtype}; set to float32 (fp16/bf16 outputs are a NaN source)"
            log.info(msg)
        else:
            msg = (
                f"output layer {layer.name!r} computes in {dtype}; fp16/bf16 outputs are a NaN source. Fix: build it "
                f"with dtype='float32', e.g. keras.layers.Dense(..., dtype='float32')."
            )
            warnings.warn(msg, stacklevel=2)
        findings.append(msg)
    return findings
