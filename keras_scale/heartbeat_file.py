"""The heartbeat file and the launcher's restart record, TensorFlow-free (the launcher reads them).

A heartbeat file is one JSON object, replaced atomically: ``{"step": optimizer updates so far, "time": unix
seconds, "phase": ..., "pid": ...}``. Phases: ``"start"`` (the process reached strategy creation:
:func:`keras_scale.choose_strategy`), ``"begin"`` (train begin, after a resume restored the step), ``"step"`` (train
or validation batches, an epoch end), ``"trace"`` (a function is about to be traced: the first validation batch,
``Goodput``'s FLOP count; no step progress until the next ``"step"`` beat), ``"end"`` (train end: no step progress is
expected afterwards).
:class:`keras_scale.callbacks.heartbeat.Heartbeat` writes it; ``keras-scale launch`` reads it.

Example:
    >>> write_beat("start", path="/tmp/ks_doc_beat.json")
    >>> read_heartbeat("/tmp/ks_doc_beat.json")["phase"]
    'start'
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

__all__ = ["HEARTBEAT_FILE_ENV", "RESTART_LOG_ENV", "write_beat", "read_heartbeat", "read_restart_log",
           "restart_summary"]

#: Environment variable naming this worker's heartbeat file (set per worker by ``keras-scale launch``).
HEARTBEAT_FILE_ENV = "KERAS_SCALE_HEARTBEAT_FILE"
#: Environment variable naming the launcher's restart record (JSON lines), read by ``Goodput``.
RESTART_LOG_ENV = "KERAS_SCALE_RESTART_LOG"


def write_beat(phase: str, step: int = 0, path: Optional[str] = None) -> None:
    """Replace the heartbeat file (``path``, default ``KERAS_SCALE_HEARTBEAT_FILE``; nothing when unset) with one
    beat. Never raises for a file system error: a missing beat is what the supervisor then sees.

    Example:
        >>> write_beat("step", step=10, path="/tmp/ks_doc_beat.json")
    """
    path = path if path is not None else (os.environ.get(HEARTBEAT_FILE_ENV) or None)
    if not path:
        return
    beat = {"step": int(step), "time": time.time(), "phase": phase, "pid": os.getpid()}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(beat, f)
        os.replace(tmp, path)
    except OSError:
        pass


def read_heartbeat(path: str) -> Optional[Dict[str, Any]]:
    """The last heartbeat written to ``path``, or ``None`` when there is none (yet) or it cannot be read.

    Example:
        >>> read_heartbeat("/nonexistent/worker-0.json") is None
        True
    """
    try:
        with open(path) as f:
            beat = json.load(f)
    except (OSError, ValueError):
        return None
    return beat if isinstance(beat, dict) and "time" in beat else None


def read_restart_log(path: Optional[str] = None) -> List[Dict[str, Any]]:
    """The records of the launcher's restart log (``path``, default ``KERAS_SCALE_RESTART_LOG``); ``[]`` if none.

    Two kinds of line: ``{"event": "restart", "restart": i, "max_restarts": K, "workers": [..], "reason": ..,
    "returncode": .., "last_step": .., "last_progress_unix": .., "num_workers_next": ..}`` when the launcher
    restarts, and ``{"event": "resumed", "restart": i, "first_step": .., "lost_s": .., "redone_steps": ..}`` once the
    restarted workers made their first step.

    Example:
        >>> read_restart_log("/nonexistent/restarts.jsonl")
        []
    """
    path = path if path is not None else os.environ.get(RESTART_LOG_ENV)
    if not path:
        return []
    records = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line torn by a killed launcher
                if isinstance(record, dict):
                    records.append(record)
    except OSError:
        return []
    return records


def restart_summary(path: Optional[str] = None) -> Dict[str, Any]:
    """What the restarts of this run cost: ``{"restarts", "restart_lost_s", "restart_redone_steps"}``, or ``{}``
    when there is no restart log (not launched by ``keras-scale launch --max-restarts``).

    ``restart_lost_s``: per restart, from the failed workers' last step to the restarted workers' first step
    (stopping, backoff, start-up, restore); ``restart_redone_steps``: steps trained again because they came after
    the last checkpoint.

    Example:
        >>> restart_summary("/nonexistent/restarts.jsonl")
        {}
    """
    path = path if path is not None else os.environ.get(RESTART_LOG_ENV)
    if not path or not os.path.exists(path):
        return {}
    records = read_restart_log(path)
    resumed = [r for r in records if r.get("event") == "resumed"]
    return {
        "restarts": sum(r.get("event") == "restart" for r in records),
        "restart_lost_s": round(sum(float(r.get("lost_s") or 0.0) for r in resumed), 6),
        "restart_redone_steps": sum(int(r.get("redone_steps") or 0) for r in resumed),
    }
