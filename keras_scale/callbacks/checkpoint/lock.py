"""One run per directory: the lock file, its heartbeat and stale-lock takeover.

The lock ``directory/.keras_scale.lock`` names its holder: pid, host, the process's start time and the host's boot
id (Linux: ``/proc``), so a pid that now belongs to an unrelated process, or a lock from before a reboot, is stale
at once. It appears complete (written under a unique temporary name, then hard-linked into place; a link fails
when a lock exists, so two starters can never both create one). A stale lock is taken over by renaming it to a
unique name and checking that what was moved is the very file judged stale (same inode and mtime; the moved file is
kept until the start is decided, so its inode is not reused meanwhile; else it is put back): of two starters
judging one stale lock, exactly one wins. Locks of other hosts are stale once their heartbeat (an ``mtime``
refresh every ``_LOCK_HEARTBEAT_S``) is ``_LOCK_STALE_S`` old. Object-store URLs (no exclusive create) get no lock.

Example:
    ckpt._acquire_lock()   # inside ChiefCheckpoint's fit start; RuntimeError naming the holder if in use
"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import threading
import weakref
import time
import warnings
from typing import Any, Dict, List, Optional

from keras_scale.storage import _is_local, create_exclusive

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
    except (OverflowError, ValueError):
        return False
    return True


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot, Linux ``/proc/<pid>/stat`` field 22); ``None`` where
    unknown. With the pid it names one process: a pid reused by another process has another start time."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _valid_holder(holder: Dict[str, Any]) -> bool:
    """A lock file's content names a process: ``{"pid": int, "host": str, ...}``."""
    return isinstance(holder, dict) and isinstance(holder.get("pid"), int) and bool(holder.get("host"))


def _hostname() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64] or "host"


def process_identity() -> Dict[str, Any]:
    """This process as a lock (or a scratch folder's marker) records it: pid, host, start time, boot id."""
    return {"pid": os.getpid(), "host": _hostname(), "start": _process_start(os.getpid()), "boot": _boot_id()}


def holder_gone(holder: Dict[str, Any]) -> str:
    """Why the process ``holder`` names (a lock's content) no longer runs on this host; ``""`` if it may (or if it is
    another host's)."""
    pid = holder.get("pid")
    if holder.get("host") != _hostname() or not isinstance(pid, int):
        return ""
    if pid <= 0 or isinstance(pid, bool):  # os.kill(0 or -1, 0) probes a group, which always "lives": damaged
        return f"it names no process (pid {pid!r})"
    if not _pid_alive(pid):
        return f"process {pid} on this host is gone"
    boot = holder.get("boot")
    if boot and _boot_id() and boot != _boot_id():
        return f"it was written before this host last rebooted (pid {pid} is another process now)"
    start = holder.get("start")
    if isinstance(start, int):
        now = _process_start(pid)
        if now is not None and now != start:
            return f"pid {pid} now belongs to another process (started at another time than the lock's holder)"
    return ""


def _same(holder: Dict[str, Any], me: Dict[str, Any]) -> bool:
    return (holder.get("pid") == me["pid"] and holder.get("host") == me["host"]
            and holder.get("start", me["start"]) == me["start"])


class LockMixin:
    """Part of :class:`ChiefCheckpoint` (a mixin: it uses the callback's own state)."""

    def _acquire_lock(self) -> None:
        if not _is_local(self.directory):
            return  # no exclusive create on object stores; documented
        path = os.path.join(self.directory, _LOCK_NAME)
        me = dict(process_identity(), since=time.time())
        graves: List[str] = []
        try:
            self._take_lock(path, me, graves)
        finally:
            for grave in graves:
                try:
                    os.unlink(grave)
                except OSError:
                    pass
        self._lock_path = path
        self._start_heartbeat()

    def _take_lock(self, path: str, me: Dict[str, Any], graves: List[str]) -> None:
        for _ in range(5):
            created = self._create_lock(path, me)
            if created is not None:
                self._lock_ino = created
                break
            try:
                seen = os.lstat(path)
            except FileNotFoundError:
                continue  # released meanwhile: try again
            holder = self._read_lock_settled(path)
            if _same(holder, me):
                self._lock_ino = (seen.st_dev, seen.st_ino)
                break  # ours (e.g. a previous fit of this process that raised): keep it
            stale = self._lock_is_stale(path, holder)
            if stale:
                warnings.warn(f"ChiefCheckpoint: removing the stale lock {path!r} ({stale}).", RuntimeWarning,
                              stacklevel=3)
                self._take_over(path, seen, graves)
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
            raise RuntimeError(f"ChiefCheckpoint: could not take the lock {path!r}; remove it if no run uses "
                               f"{self.directory!r}.")

    @staticmethod
    def _create_lock(path: str, me: Dict[str, Any]) -> Optional[tuple]:
        """Create the lock with its content in one step (a hard link of a complete temporary file); ``None`` when a
        lock (or anything else) exists at ``path``. Returns the lock's ``(st_dev, st_ino)``."""
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
        fd = create_exclusive(tmp)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return None
            except OSError:  # a file system without hard links: exclusive create, content right after
                try:
                    fd2 = create_exclusive(path)
                except FileExistsError:
                    return None
                with os.fdopen(fd2, "w") as f:
                    json.dump(me, f)
            st = os.lstat(path)
            return st.st_dev, st.st_ino
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    @staticmethod
    def _take_over(path: str, judged: os.stat_result, graves: List[str]) -> None:
        """Remove the stale lock ``judged`` atomically: rename it to a unique name, then check the file moved is the
        one judged stale -- same inode and modification time (another starter may have taken over and created a new
        lock meanwhile: that one is put back). The moved file is deleted only once this start is decided (kept in
        ``graves`` until then), so its inode cannot be reused by a new lock in between."""
        grave = f"{path}.stale.{os.getpid()}.{secrets.token_hex(6)}"
        try:
            os.rename(path, grave)
        except FileNotFoundError:
            return
        try:
            moved = os.lstat(grave)
        except OSError:
            return
        if (moved.st_dev, moved.st_ino, moved.st_mtime_ns) != (judged.st_dev, judged.st_ino, judged.st_mtime_ns):
            try:
                os.link(grave, path)  # a live lock: give it back (fails only if yet another one exists)
            except OSError:
                pass
        graves.append(grave)

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
        """The lock's holder; an empty or unparsable lock is re-read until it is ``_LOCK_UNREADABLE_S`` old (an older
        version wrote its pid right after creating the file)."""
        while True:
            holder = cls._read_lock(path)
            if _valid_holder(holder):
                return holder
            try:
                age = time.time() - os.lstat(path).st_mtime
            except OSError:
                return holder
            if age >= _LOCK_UNREADABLE_S:
                return holder
            time.sleep(min(0.1, _LOCK_UNREADABLE_S - age + 0.01))

    @staticmethod
    def _lock_is_stale(path: str, holder: Dict[str, Any]) -> str:
        try:
            age = time.time() - os.lstat(path).st_mtime
        except OSError:
            return "it vanished"
        host = holder.get("host")
        if not _valid_holder(holder):
            return (f"it is unreadable (empty or damaged, unchanged for {age:.0f} s), so no live run holds it"
                    if age >= _LOCK_UNREADABLE_S else "")
        if host == _hostname():
            return holder_gone(holder)
        return f"host {host!r} has not refreshed it for {age:.0f} s" if age > _LOCK_STALE_S else ""

    def _lock_is_mine(self, path: str) -> bool:
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == getattr(self, "_lock_ino", None)

    def _start_heartbeat(self) -> None:
        if self._lock_stop is not None:
            self._lock_stop.set()
        stop = self._lock_stop = threading.Event()
        path = self._lock_path

        owner_ref = weakref.ref(self)  # (weakly: the thread must not keep a dropped model alive)

        def beat():
            while not stop.wait(_LOCK_HEARTBEAT_S):
                owner = owner_ref()
                if owner is None:
                    return
                if not owner._fit_running():  # the fit raised (no on_train_end): let the directory go
                    owner._release_lock()
                    return
                if not owner._lock_is_mine(path):
                    return  # taken over (judged stale elsewhere): never touch another run's lock
                del owner
                try:
                    os.utime(path, follow_symlinks=False)
                except OSError:
                    return

        threading.Thread(target=beat, name="keras_scale_ckpt_lock", daemon=True).start()

    def _release_lock(self) -> None:
        if self._lock_stop is not None:
            self._lock_stop.set()
            self._lock_stop = None
        path, self._lock_path = self._lock_path, None
        if path and self._lock_is_mine(path) and self._read_lock(path).get("pid") == os.getpid():
            try:
                os.remove(path)
            except OSError:
                pass
