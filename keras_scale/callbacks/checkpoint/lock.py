"""One run per directory: the lock file, its heartbeat and stale-lock takeover."""
from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import warnings
from typing import Any, Dict


from keras_scale.callbacks.checkpoint.storage import _is_local


_LOCK_NAME = ".keras_scale.lock"


_LOCK_HEARTBEAT_S = 30.0


_LOCK_STALE_S = 120.0  # a lock of another host not refreshed for this long is stale


_LOCK_UNREADABLE_S = 2.0  # a lock still empty/unparsable this long after its last write is no live run's


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _valid_holder(holder: Dict[str, Any]) -> bool:
    """A lock file's content names a process: ``{"pid": int, "host": str, ...}``."""
    return isinstance(holder, dict) and isinstance(holder.get("pid"), int) and bool(holder.get("host"))


def _hostname() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64] or "host"


class LockMixin:
    """Part of :class:`ChiefCheckpoint` (a mixin: it uses the callback's own state)."""

    def _acquire_lock(self) -> None:
        if not _is_local(self.directory):
            return  # no exclusive create on object stores; documented
        path = os.path.join(self.directory, _LOCK_NAME)
        me = {"pid": os.getpid(), "host": _hostname(), "since": time.time()}
        for _ in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read_lock_settled(path)
                if holder.get("pid") == me["pid"] and holder.get("host") == me["host"]:
                    break  # ours (e.g. a previous fit of this process that raised): keep it
                stale = self._lock_is_stale(path, holder)
                if stale:
                    warnings.warn(f"ChiefCheckpoint: removing the stale lock {path!r} ({stale}).", RuntimeWarning,
                                  stacklevel=3)
                    try:
                        os.remove(path)
                    except FileNotFoundError:
                        pass
                    continue
                if not _valid_holder(holder):  # rewritten while we looked, still unreadable
                    raise RuntimeError(
                        f"ChiefCheckpoint: the lock file {path!r} of {self.directory!r} is unreadable (empty or "
                        "damaged) and is still being changed, so another process may be starting in this directory. "
                        f"Fix: if no run uses this directory, delete {path!r}; else give this run its own directory."
                    ) from None
                try:
                    started = float(holder.get("since") or 0)
                    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started > 0 \
                        else "an unknown time"
                except (TypeError, ValueError, OverflowError, OSError):
                    since = "an unknown time"
                raise RuntimeError(
                    f"ChiefCheckpoint: {self.directory!r} is in use by another training process (pid "
                    f"{holder.get('pid')} on host {holder.get('host')!r}, since {since}; lock file {path!r}). Two "
                    "runs writing one directory replace each other's checkpoints. Fix: give this run its own "
                    "directory, or stop the other run. A lock whose process is gone is taken over automatically "
                    f"(same host: at once; another host: after {_LOCK_STALE_S:.0f} s without its heartbeat). If that "
                    f"run's fit just ended with an error in a process that is still alive (a notebook), its lock is "
                    f"released within {_LOCK_HEARTBEAT_S:.0f} s: retry then."
                ) from None
            else:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
                break
        else:
            raise RuntimeError(f"ChiefCheckpoint: could not take the lock {path!r}; remove it if no run uses "
                               f"{self.directory!r}.")
        self._lock_path = path
        self._start_heartbeat()

    @staticmethod
    def _read_lock(path: str) -> Dict[str, Any]:
        try:
            with open(path) as f:
                holder = json.load(f)
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    @classmethod
    def _read_lock_settled(cls, path: str) -> Dict[str, Any]:
        """The lock's holder; an empty or unparsable lock is re-read until it is ``_LOCK_UNREADABLE_S`` old (a run
        that has just created it writes its pid right away)."""
        while True:
            holder = cls._read_lock(path)
            if _valid_holder(holder):
                return holder
            try:
                age = time.time() - os.path.getmtime(path)
            except OSError:
                return holder
            if age >= _LOCK_UNREADABLE_S:
                return holder
            time.sleep(min(0.1, _LOCK_UNREADABLE_S - age + 0.01))

    @staticmethod
    def _lock_is_stale(path: str, holder: Dict[str, Any]) -> str:
        try:
            age = time.time() - os.path.getmtime(path)
        except OSError:
            return "it vanished"
        pid, host = holder.get("pid"), holder.get("host")
        if not _valid_holder(holder):
            return (f"it is unreadable (empty or damaged, unchanged for {age:.0f} s), so no live run holds it"
                    if age >= _LOCK_UNREADABLE_S else "")
        if host == _hostname():
            return "" if _pid_alive(pid) else f"process {pid} on this host is gone"
        return f"host {host!r} has not refreshed it for {age:.0f} s" if age > _LOCK_STALE_S else ""

    def _start_heartbeat(self) -> None:
        if self._lock_stop is not None:
            self._lock_stop.set()
        stop = self._lock_stop = threading.Event()
        path = self._lock_path

        def beat():
            while not stop.wait(_LOCK_HEARTBEAT_S):
                if not self._fit_running():  # the fit raised (no on_train_end): let the directory go
                    self._release_lock()
                    return
                try:
                    os.utime(path)
                except OSError:
                    return

        threading.Thread(target=beat, name="keras_scale_ckpt_lock", daemon=True).start()

    def _release_lock(self) -> None:
        if self._lock_stop is not None:
            self._lock_stop.set()
            self._lock_stop = None
        path, self._lock_path = self._lock_path, None
        if path and self._read_lock(path).get("pid") == os.getpid():
            try:
                os.remove(path)
            except OSError:
                pass

