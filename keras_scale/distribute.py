"""Who am I in the cluster, and which strategy to use.

Chief-only behaviour (who writes files, who prints) is decided here, in :func:`is_chief`, and nowhere else.

Example:
    >>> from keras_scale.distribute import is_chief
    >>> if is_chief():
    ...     print("I write the checkpoints")
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional, Tuple


def tf_config() -> Optional[dict]:
    """The parsed ``TF_CONFIG`` environment variable, or ``None`` when unset or empty.

    Example:
        >>> tf_config()  # doctest: +SKIP
        {'cluster': {'worker': ['127.0.0.1:2222', '127.0.0.1:2223']}, 'task': {'type': 'worker', 'index': 0}}
    """
    raw = os.environ.get("TF_CONFIG", "").strip()
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e}): {raw[:200]!r}. Fix the variable or unset it.") from e
    return config or None


def task_identity(strategy: Any = None) -> Tuple[Optional[str], int]:
    """``(task_type, task_id)`` of this process; ``(None, 0)`` outside a multi-worker cluster.

    Uses the strategy's cluster resolver when given, else ``TF_CONFIG``.

    Example:
        >>> task_identity()
        (None, 0)
    """
    resolver = getattr(strategy, "cluster_resolver", None) if strategy is not None else None
    if resolver is not None and getattr(resolver, "task_type", None):
        return resolver.task_type, int(resolver.task_id or 0)
    config = tf_config()
    if not config or "task" not in config:
        return None, 0
    task = config["task"]
    return task.get("type"), int(task.get("index", 0))


def _has_chief_task(strategy: Any = None) -> bool:
    resolver = getattr(strategy, "cluster_resolver", None) if strategy is not None else None
    if resolver is not None:
        try:
            return "chief" in resolver.cluster_spec().as_dict()
        except Exception:  # noqa: BLE001 - resolver without a spec
            pass
    config = tf_config() or {}
    return "chief" in config.get("cluster", {})


def is_chief(strategy: Any = None) -> bool:
    """True in the one process that writes files and prints summaries.

    Single process and ``MirroredStrategy``: always True. Multi-worker: the ``chief`` task, or ``worker`` 0
    when the cluster has no ``chief`` (TensorFlow's convention).

    Example:
        >>> is_chief()
        True
    """
    task_type, task_id = task_identity(strategy)
    if task_type is None:
        return True
    if task_type == "chief":
        return True
    return task_type == "worker" and task_id == 0 and not _has_chief_task(strategy)


# --------------------------------------------------------------------------------------------------------------
# The small Keras multi-worker fix (keras-team/keras#20585)
# --------------------------------------------------------------------------------------------------------------
# Keras 3's TensorFlow trainer crashes under MultiWorkerMirroredStrategy in two places:
#   1. ``TensorFlowTrainer._maybe_symbolic_build`` calls ``strategy.reduce("MEAN", data_batch, axis=None)`` on a
#      PerReplica *data batch* ("Attempt to convert a value (PerReplica...)"). Only the batch's shapes matter
#      there, so one local replica's value does the same job.
#   2. ``reduce_per_replica`` (module function) calls ``strategy.reduce("MEAN", v, axis=0)`` on scalar metric
#      results in its multi-worker branch ("Invalid reduction dimension 0"). ``axis=None`` (mean across replicas,
#      element-wise) is what the single-worker branch computes too.
# The patch wraps both and changes only the multi-worker case; everything else is delegated to the originals.

_KERAS_PATCH_MIN = (3, 0)  # the trainer layout these fingerprints were read from exists since Keras 3.0
_KERAS_PATCH_TESTED_MAX = (3, 15)  # newest minor version the fix was verified on (2-process equivalence test)

# What the patch expects to find in the original Keras sources; `keras_internals_report()` checks them.
_FINGERPRINTS = {
    "reduce_per_replica": 'strategy.reduce("MEAN", v, axis=0)',
    "_maybe_symbolic_build": "self.distribute_strategy.reduce(",
}

_patch_state: dict = {"applied": False, "reason": "not attempted"}


def _keras_version() -> Tuple[int, int]:
    import keras

    major, minor = (keras.__version__.split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def keras_internals_report() -> dict:
    """What :func:`patch_keras_multi_worker` needs from Keras, and whether this Keras still has it.

    Returns a dict ``{"keras_version", "backend", "missing": [...], "changed": [...]}``: ``missing`` names
    internals that no longer exist, ``changed`` names functions whose source no longer contains the crashing call
    (a newer Keras may have fixed it). Both empty means the patch applies as written.

    Example:
        >>> keras_internals_report()["missing"]
        []
    """
    import inspect

    import keras

    report = {"keras_version": keras.__version__, "backend": keras.backend.backend(), "missing": [], "changed": []}
    try:
        from keras.src.backend.tensorflow import trainer as tf_trainer
    except ImportError:
        report["missing"].append("keras.src.backend.tensorflow.trainer")
        return report
    targets = {
        "reduce_per_replica": getattr(tf_trainer, "reduce_per_replica", None),
        "_maybe_symbolic_build": getattr(tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build", None),
    }
    for helper in ("_collective_all_reduce_multi_worker", "_is_per_replica_instance"):
        if not callable(getattr(tf_trainer, helper, None)):
            report["missing"].append(helper)
    for name, fn in targets.items():
        fn = getattr(fn, "__wrapped__", fn)  # look through our own wrapper
        if fn is None:
            report["missing"].append(name)
            continue
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            report["missing"].append(f"{name} (source)")
            continue
        if _FINGERPRINTS[name] not in source:
            report["changed"].append(name)
    return report


def patch_keras_multi_worker() -> bool:
    """Make Keras's own ``model.fit`` / ``evaluate`` work under ``MultiWorkerMirroredStrategy`` (idempotent).

    Fixes the two crashes of keras-team/keras#20585 in the TensorFlow trainer, only for the multi-worker case:
    the symbolic build uses one local replica's data batch instead of reducing it, and metric results are
    averaged across replicas with ``axis=None`` instead of ``axis=0``. Single-process behaviour is unchanged.

    Guarded: it patches only the TensorFlow backend of Keras >= 3.0 whose sources still contain the crashing calls
    (see :func:`keras_internals_report`); on a newer Keras that no longer has them it does nothing and says why.
    :func:`keras_scale.fit` calls it for you.

    Returns:
        True when the fix is in place (now or from an earlier call), False when it was not applied.

    Example:
        >>> import keras_scale.distribute as ksd
        >>> ksd.patch_keras_multi_worker()
        True
        >>> strategy = tf.distribute.MultiWorkerMirroredStrategy()  # doctest: +SKIP
        >>> with strategy.scope():                                  # doctest: +SKIP
        ...     model = build_and_compile()
        >>> model.fit(ds)                                           # doctest: +SKIP
    """
    import functools
    import logging
    import warnings

    if _patch_state["applied"]:
        return True
    log = logging.getLogger("keras_scale")
    report = keras_internals_report()
    version = _keras_version()
    if report["backend"] != "tensorflow":
        _patch_state["reason"] = f"Keras backend is {report['backend']!r}, the fix is for the TensorFlow backend"
        return False
    if version < _KERAS_PATCH_MIN:
        _patch_state["reason"] = f"Keras {report['keras_version']} predates the Keras 3 trainer this fix targets"
        return False
    if report["missing"]:
        _patch_state["reason"] = (
            f"Keras {report['keras_version']} no longer has {report['missing']}; multi-worker fit is NOT patched. "
            "Check keras-team/keras#20585 and update keras_scale."
        )
        warnings.warn(_patch_state["reason"], RuntimeWarning, stacklevel=2)
        return False
    if report["changed"]:
        _patch_state["reason"] = (
            f"Keras {report['keras_version']} changed {report['changed']} (the crashing calls are gone); "
            "not patching. If multi-worker fit still fails, update keras_scale."
        )
        log.info(_patch_state["reason"])
        return False
    if version > _KERAS_PATCH_TESTED_MAX:
        log.info("Keras %s is newer than the newest version the multi-worker fix was tested on (%d.%d); "
                 "applying it because the patched internals are unchanged.", report["keras_version"],
                 *_KERAS_PATCH_TESTED_MAX)

    import tensorflow as tf
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src import tree

    original_reduce = tf_trainer.reduce_per_replica
    original_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build
    is_multi_worker = tf_trainer._collective_all_reduce_multi_worker

    @functools.wraps(original_reduce)
    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and is_multi_worker(strategy):
            return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original_reduce(values, strategy, reduction)

    @functools.wraps(original_build)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if strategy is None or iterator is None or not is_multi_worker(strategy):
            return original_build(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(
                lambda x: (strategy.experimental_local_results(x)[0]
                           if isinstance(x, tf.distribute.DistributedValues) else x),
                batch,
            )
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    tf_trainer.reduce_per_replica = reduce_per_replica
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    _patch_state.update(applied=True, reason=f"patched Keras {report['keras_version']} (keras-team/keras#20585)")
    log.debug(_patch_state["reason"])
    return True
