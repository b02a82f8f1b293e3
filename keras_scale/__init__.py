"""keras_scale: large-scale TensorFlow training for plain ``model.fit`` users.

Example:
    >>> import keras_scale as ks
    >>> model = ks.wrap(model, accum=4)                                                   # doctest: +SKIP
    >>> model.compile(optimizer=keras.optimizers.AdamW(ks.WarmupCosine(1e-3, total_steps=10_000)))  # doctest: +SKIP
    >>> model.fit(ds, callbacks=[ks.NanGuard(), ks.ChiefCheckpoint("ckpt")])               # doctest: +SKIP

``import keras_scale`` imports every public name below with plain imports. Where TensorFlow and Keras are
installed, that includes the Keras-serializable classes (``AccumulatingModel``, ``WarmupCosine``, ...), so
``keras.models.load_model`` finds them in any program that imported keras_scale.

Two cases import only the TensorFlow-free part (``doctor``, ``launch_local_workers``, ``is_chief``,
``choose_strategy``, ...): a machine without TensorFlow or Keras, and the ``keras-scale`` command line, whose entry
module :mod:`keras_scale_cli` is imported before this package, or ``python -m keras_scale`` (so ``keras-scale version``
and every ``--help`` start without TensorFlow, and ``keras-scale doctor`` survives a TensorFlow that crashes or hangs
at import). There,
asking for another name raises an error that says why; a command that needs one imports its module directly.
"""
from __future__ import annotations

import importlib.util as _importlib_util
import sys as _sys
from typing import Any

__version__ = "0.1.0"

# ---- TensorFlow-free: always imported ------------------------------------------------------------------------
from keras_scale.distribute import choose_strategy, is_chief, patch_keras_multi_worker  # noqa: E402
from keras_scale.doctor import doctor  # noqa: E402
from keras_scale.launch import launch_local_workers  # noqa: E402
from keras_scale.profiling import profile_summary  # noqa: E402

_TENSORFLOW_INSTALLED = (_importlib_util.find_spec("tensorflow") is not None
                         and _importlib_util.find_spec("keras") is not None)


def _run_as_python_m() -> bool:
    """``python -m keras_scale ...``: Python imports this package while it looks for ``keras_scale.__main__``
    (``sys.argv[0]`` is then ``"-m"``), before the command runs; treat it as the command line too."""
    argv = list(getattr(_sys, "orig_argv", []))
    if _sys.argv[:1] != ["-m"]:
        return False
    for i, arg in enumerate(argv):
        if arg == "-m":
            return argv[i + 1:i + 2] == ["keras_scale"]
        if arg.startswith("-m"):
            return arg == "-mkeras_scale"
    return False


_COMMAND_LINE = "keras_scale_cli" in _sys.modules or _run_as_python_m()

if _TENSORFLOW_INSTALLED and not _COMMAND_LINE:
    # ---- TensorFlow and Keras: imported here, so Keras knows the serializable classes -------------------------
    from keras_scale import data  # noqa: E402
    from keras_scale.accumulation import AccumulatingModel, unwrap, wrap  # noqa: E402
    from keras_scale.auto_accum import AutoAccumGaveUp, find_micro_batch  # noqa: E402
    from keras_scale.callbacks.checkpoint import ChiefCheckpoint, CheckpointMismatchError, load_checkpoint  # noqa: E402
    from keras_scale.callbacks.goodput import Goodput  # noqa: E402
    from keras_scale.callbacks.gpu_monitor import GpuMonitor  # noqa: E402
    from keras_scale.callbacks.host_memory import HostMemoryGrowthWarning, HostMemoryWatch  # noqa: E402
    from keras_scale.callbacks.lr_logger import LearningRateLogger  # noqa: E402
    from keras_scale.callbacks.nan_guard import NanGuard, NanGuardGaveUp, NanReport  # noqa: E402
    from keras_scale.callbacks.plateau import ReduceLROnPlateau  # noqa: E402
    from keras_scale.callbacks.profile_window import ProfileWindow  # noqa: E402
    from keras_scale.fit import fit  # noqa: E402
    from keras_scale.levers import compare_precision, compare_xla  # noqa: E402
    from keras_scale.precision import choose_precision  # noqa: E402
    from keras_scale.remat import remat, remat_model  # noqa: E402
    from keras_scale.schedules import WarmupCosine, scale_learning_rate, scale_lr  # noqa: E402
    from keras_scale.sync_bn import sync_batchnorm  # noqa: E402

__all__ = [
    "__version__",
    # schedules
    "WarmupCosine", "scale_lr", "scale_learning_rate",
    # the composed train step / accumulation
    "wrap", "unwrap", "AccumulatingModel", "find_micro_batch", "AutoAccumGaveUp",
    # callbacks
    "NanGuard", "NanReport", "NanGuardGaveUp", "ChiefCheckpoint", "CheckpointMismatchError", "load_checkpoint",
    "GpuMonitor",
    "ProfileWindow", "HostMemoryWatch", "HostMemoryGrowthWarning", "LearningRateLogger", "ReduceLROnPlateau",
    "Goodput",
    # distribution
    "fit", "is_chief", "choose_strategy", "patch_keras_multi_worker", "launch_local_workers",
    # precision
    "choose_precision",
    # environment / data / profiling
    "doctor", "data", "profile_summary",
    # speed and memory levers
    "compare_xla", "compare_precision", "remat", "remat_model", "sync_batchnorm",
]


def __getattr__(name: str) -> Any:
    """Explain a public name that was not imported above (no TensorFlow, or the command line's light import)."""
    if name not in __all__:
        raise AttributeError(f"module 'keras_scale' has no attribute {name!r}")
    if not _TENSORFLOW_INSTALLED:
        raise ImportError(f"keras_scale.{name} needs TensorFlow and Keras: pip install tensorflow keras")
    raise AttributeError(f"keras_scale.{name} is not imported in the keras-scale command line (it imports the "
                         "TensorFlow-free part only); import its module, e.g. keras_scale.schedules, directly")
