"""keras_scale: large-scale TensorFlow training for plain ``model.fit`` users.

Example:
    >>> import keras_scale as ks
    >>> model = ks.wrap(model, accum=4)
    >>> model.compile(optimizer=keras.optimizers.AdamW(ks.WarmupCosine(1e-3, total_steps=10_000)))
    >>> model.fit(ds, callbacks=[ks.NanGuard(), ks.ChiefCheckpoint("ckpt")])

Public names are re-exported here and imported lazily, so ``import keras_scale`` works without TensorFlow
(the NVML-only tools such as ``keras-scale doctor`` run on machines that lack it).
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # schedules
    "WarmupCosine": "keras_scale.schedules",
    "scale_lr": "keras_scale.schedules",
    "scale_learning_rate": "keras_scale.schedules",
    # the composed train step / accumulation
    "wrap": "keras_scale.accumulation",
    "unwrap": "keras_scale.accumulation",
    "AccumulatingModel": "keras_scale.accumulation",
    "find_micro_batch": "keras_scale.auto_accum",
    "AutoAccumGaveUp": "keras_scale.auto_accum",
    # callbacks
    "NanGuard": "keras_scale.callbacks.nan_guard",
    "ChiefCheckpoint": "keras_scale.callbacks.checkpoint",
    "CheckpointMismatchError": "keras_scale.callbacks.checkpoint",
    "NanReport": "keras_scale.callbacks.nan_guard",
    "NanGuardGaveUp": "keras_scale.callbacks.nan_guard",
    "GpuMonitor": "keras_scale.callbacks.gpu_monitor",
    "ProfileWindow": "keras_scale.callbacks.profile_window",
    "HostMemoryWatch": "keras_scale.callbacks.host_memory",
    "HostMemoryGrowthWarning": "keras_scale.callbacks.host_memory",
    "LearningRateLogger": "keras_scale.callbacks.lr_logger",
    # distribution
    "fit": "keras_scale.fit",
    "is_chief": "keras_scale.distribute",
    "choose_strategy": "keras_scale.distribute",
    "patch_keras_multi_worker": "keras_scale.distribute",
    "launch_local_workers": "keras_scale.launch",
    # precision
    "choose_precision": "keras_scale.precision",
    # environment / data / profiling
    "doctor": "keras_scale.doctor",
    "profile_summary": "keras_scale.profiling",
    # speed and memory levers
    "compare_xla": "keras_scale.levers",
    "compare_precision": "keras_scale.levers",
    "remat": "keras_scale.remat",
    "remat_model": "keras_scale.remat",
    "sync_batchnorm": "keras_scale.sync_bn",
}

__all__ = sorted(_EXPORTS) + ["data", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "data":
        return importlib.import_module("keras_scale.data")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_scale' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


# Modules that register Keras-serializable objects must be imported before `keras.models.load_model`
# sees a saved model that uses them. Do it eagerly only where Keras is installed.
# The `keras-scale` command line (doctor, version, ...) skips this: it must start fast and work without TF.
import os as _os
import sys as _sys

_cli = _os.path.basename(_sys.argv[0] if _sys.argv else "") in ("keras-scale", "-m")
if not _cli and importlib.util.find_spec("keras") is not None and importlib.util.find_spec("tensorflow") is not None:
    for _m in ("keras_scale.schedules", "keras_scale.accumulation"):
        if importlib.util.find_spec(_m) is not None:
            importlib.import_module(_m)
