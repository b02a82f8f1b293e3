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
