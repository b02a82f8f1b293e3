"""The same math on another number of replicas: what ``keras_scale.fit(global_batch_size=B, checkpoint_dir=...)``
does when a run resumes on fewer (or more) replicas than its checkpoint was written with.

The chief records the run's batch arithmetic next to its checkpoints (``keras_scale_elastic.json``: global batch,
replicas, the per-replica micro-batch bound). On a resume with another replica count:

- ``elastic="accum"`` (default): the global batch ``B`` stays exact; each replica's batch ``B / replicas`` is
  split into as few micro-batches as keep every micro-batch within the recorded one (gradient accumulation), so a
  device never holds more samples at once than before. Learning rate and schedule are unchanged. When ``B`` does
  not split over the replicas, fit refuses and names the nearest global batches that do (or use ``"scale_lr"``).
- ``elastic="scale_lr"``: the per-replica batch and accumulation stay; the global batch becomes
  ``per_replica x replicas`` and the learning rate is rescaled by the linear rule (``B_new / B_old``).
- ``elastic=False``: no adjustment (``B / replicas`` per replica, your ``accum``).

The data order does not depend on the replica count (arrays are shuffled by ``(seed, epoch)`` and batched to the
global batch before sharding; file-based pipelines are sharded by DATA, not by file, so a global batch holds the
same samples on any number of workers), and ``ChiefCheckpoint`` keeps its position in samples: a resumed epoch
neither skips nor repeats a sample.

Example:
    >>> plan_elastic({"global_batch_size": 12, "replicas": 3, "micro_batch_size": 2}, 12, 2, 1, "accum")
    (6, 12, 3, 'elastic: checkpoint written on 3 replicas, this run has 2: global batch 12 kept exact by accum 3 micro-batches of 2 per replica (was <= 2); learning rate unchanged')
"""
from __future__ import annotations

import json
from typing import Any, Dict, Optional, Tuple

RECORD_NAME = "keras_scale_elastic.json"
ELASTIC_CHOICES = ("accum", "scale_lr", False)


def check_elastic(elastic: Any) -> Any:
    """``elastic`` if it is one of :data:`ELASTIC_CHOICES`, else a ``ValueError`` saying what to pass.

    Example:
        >>> check_elastic("accum")
        'accum'
    """
    if not any(elastic is c or (isinstance(c, str) and elastic == c) for c in ELASTIC_CHOICES):
        raise ValueError(f"elastic must be 'accum' (keep the global batch, change the accumulation), 'scale_lr' "
                         f"(keep the per-replica batch, rescale the learning rate) or False, got {elastic!r}.")
    return elastic


def record_path(checkpoint_dir: str) -> str:
    """Where the chief records the batch arithmetic of the run in ``checkpoint_dir``.

    Example:
        >>> record_path("ckpt")
        'ckpt/keras_scale_elastic.json'
    """
    return str(checkpoint_dir).rstrip("/") + "/" + RECORD_NAME


def read_record(checkpoint_dir: str) -> Optional[Dict[str, Any]]:
    """The recorded batch arithmetic of the run whose checkpoints are in ``checkpoint_dir``, or ``None`` when there
    is no record or no checkpoint yet (a fresh start).

    Example:
        >>> read_record("/nonexistent/ckpt") is None
        True
    """
    import tensorflow as tf

    from keras_scale.callbacks.checkpoint import list_checkpoints

    path = record_path(checkpoint_dir)
    try:
        if not tf.io.gfile.exists(path) or not list_checkpoints(str(checkpoint_dir)):
            return None
        with tf.io.gfile.GFile(path) as f:
            record = json.loads(f.read())
    except (ValueError, OSError, tf.errors.OpError):
        return None
    keys = ("global_batch_size", "replicas", "micro_batch_size")
    return record if isinstance(record, dict) and all(isinstance(record.get(k), int) for k in keys) else None


def write_record(checkpoint_dir: str, global_batch_size: int, replicas: int, micro_batch_size: int,
                 requested_global_batch_size: Optional[int] = None) -> None:
    """Record the run's batch arithmetic (chief only; atomic rename). ``requested_global_batch_size``: the
    ``global_batch_size`` the user asked for, when ``elastic="scale_lr"`` made the run use another one (a later
    resume on the same replicas keeps that choice instead of going back to the asked batch at the full rate).

    Example::

        write_record("/shared/run1/ckpt", global_batch_size=12, replicas=3, micro_batch_size=2)
    """
    import tensorflow as tf

    tf.io.gfile.makedirs(str(checkpoint_dir))
    path = record_path(checkpoint_dir)
    tmp = path + ".tmp"
    with tf.io.gfile.GFile(tmp, "w") as f:
        record = {"global_batch_size": int(global_batch_size), "replicas": int(replicas),
                  "micro_batch_size": int(micro_batch_size)}
        if requested_global_batch_size is not None and int(requested_global_batch_size) != int(global_batch_size):
            record["requested_global_batch_size"] = int(requested_global_batch_size)
        f.write(json.dumps(record))
    tf.io.gfile.rename(tmp, path, overwrite=True)


def _nearest_that_split(global_batch: int, replicas: int) -> Tuple[int, int]:
    below = max(replicas, global_batch // replicas * replicas)
    return below, below + replicas if below <= global_batch else below


def plan_elastic(record: Optional[Dict[str, Any]], global_batch_size: int, replicas: int, accum: int,
                 elastic: Any) -> Tuple[int, int, int, Optional[str]]:
    """``(per_replica_batch, global_batch, accum, message)`` for a run on ``replicas`` resuming from ``record``.

    ``message`` is the one line to print when something was adjusted (``None``: nothing changed). Raises a
    ``ValueError`` naming the nearest global batches that work when ``elastic="accum"`` cannot keep the batch.

    Example:
        >>> plan_elastic(None, 12, 3, 2, "accum")          # a fresh start: nothing to adjust
        (4, 12, 2, None)
    """
    per, accum = global_batch_size // replicas, accum
    if (record is not None and elastic == "scale_lr" and record["replicas"] == replicas
            and record.get("requested_global_batch_size") == global_batch_size
            and record["global_batch_size"] != global_batch_size):  # a restart after a scale_lr resume: keep it
        kept = record["global_batch_size"]
        return kept // replicas, kept, accum, (
            f"elastic: resumed on {replicas} replicas as the checkpoint: global batch {kept} (chosen by "
            f"elastic='scale_lr' instead of {global_batch_size}) kept; learning rate x {kept}/{global_batch_size} "
            "(linear rule)")
    if record is None or elastic is False or record["replicas"] == replicas:
        return per, global_batch_size, accum, None
    old_replicas, bound = record["replicas"], max(1, record["micro_batch_size"])
    head = f"elastic: checkpoint written on {old_replicas} replicas, this run has {replicas}"
    if elastic == "scale_lr":
        old_per = record["global_batch_size"] // old_replicas
        new_global = old_per * replicas
        return old_per, new_global, accum, (
            f"{head}: per-replica batch {old_per} kept (accum {accum}), global batch {record['global_batch_size']} "
            f"-> {new_global}; learning rate x {new_global}/{global_batch_size} (linear rule)")
    if global_batch_size != record["global_batch_size"]:
        return per, global_batch_size, accum, None  # the user changed the batch on purpose: nothing to keep
    if global_batch_size % replicas:
        low, high = _nearest_that_split(global_batch_size, replicas)
        raise ValueError(
            f"{head}: the global batch {global_batch_size} does not split over {replicas} replicas, so it cannot be "
            f"kept exact. Use global_batch_size={low} or {high} (the nearest that split), or elastic='scale_lr' to "
            f"keep the per-replica batch {global_batch_size // old_replicas} and rescale the learning rate "
            "(linear rule).")
    per = global_batch_size // replicas
    new_accum = next(a for a in range(1, per + 1) if per % a == 0 and per // a <= bound)
    return per, global_batch_size, new_accum, (
        f"{head}: global batch {global_batch_size} kept exact by accum {new_accum} micro-batches of "
        f"{per // new_accum} per replica (was <= {bound}); learning rate unchanged")
