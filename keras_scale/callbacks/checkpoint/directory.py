"""The checkpoint directory: which checkpoints it holds (the state file, scanning), its state file kept
sane, stale temporary folders and non-chief workers' scratch folders."""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import warnings
from typing import Dict, List, Tuple

import tensorflow as tf

from keras_scale.callbacks.checkpoint.names import _INDEX_RE, _NAME, _PREFIX_RE
from keras_scale.callbacks.checkpoint.storage import _is_local
from keras_scale.callbacks.checkpoint.lock import _hostname, _pid_alive


def _inside(directory: str, path: str) -> bool:
    """``path`` is directly inside ``directory`` once links are resolved (remote URLs: by name)."""
    if not _is_local(directory):
        return os.path.dirname(path.rstrip("/")) == directory.rstrip("/")
    return os.path.dirname(os.path.realpath(path)) == os.path.realpath(directory)


def _files_inside(directory: str, prefix: str) -> bool:
    """The checkpoint's ``.index`` and data files all live in ``directory`` (no link leads out of it)."""
    if not _is_local(directory):
        return True
    index = prefix + ".index"
    data = [os.path.join(directory, n) for n in os.listdir(directory)
            if n.startswith(os.path.basename(prefix) + ".data-")]
    return all(_inside(directory, p) for p in [index] + data)


def _scan(directory: str) -> Tuple[List[Tuple[int, str]], List[str], bool]:
    """``(candidates newest first, problems, from_state_file)``.

    The ``checkpoint`` state file (updated by TensorFlow only after a write completed) decides which checkpoints
    count. Entries naming files outside ``directory``, or links out of it, are ignored; entries whose ``.index``
    is gone are reported. When the state file is missing, unreadable, or names no existing checkpoint, every
    ``ckpt-N.index`` in the directory is a candidate.
    """
    if not tf.io.gfile.isdir(directory):
        return [], [], False
    problems: List[str] = []
    found: Dict[int, str] = {}
    try:
        state = tf.train.get_checkpoint_state(directory)
    except Exception:  # noqa: BLE001 - a torn/garbled state file: fall back to scanning
        state = None
    listed = list(state.all_model_checkpoint_paths) if state is not None else []
    for p in listed:
        name = os.path.basename(p.rstrip("/"))
        m = _PREFIX_RE.match(name)
        # get_checkpoint_state joins relative entries with the directory already; older files may not
        if not m or not (_inside(directory, p) or _inside(directory, os.path.join(directory, p))):
            problems.append(f"the state file names {p!r}, which is not a checkpoint of this directory (ignored)")
            continue
        prefix = os.path.join(directory, name)
        if not tf.io.gfile.exists(prefix + ".index"):
            problems.append(f"{prefix!r} is listed in the state file but its .index file is missing")
            continue
        if not _files_inside(directory, prefix):
            problems.append(f"{prefix!r} links to files outside the directory (ignored)")
            continue
        found[int(m.group(1))] = prefix
    from_state = bool(found)
    if not found:
        for name in tf.io.gfile.listdir(directory):
            m = _INDEX_RE.match(name.rstrip("/"))
            if not m:
                continue
            prefix = os.path.join(directory, name[: -len(".index")])
            if _files_inside(directory, prefix):
                found[int(m.group(1))] = prefix
        if listed and found:
            problems.append(f"the state file names no usable checkpoint; found {len(found)} by scanning the "
                            "directory")
    return sorted(found.items(), reverse=True), problems, from_state


def list_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """``(number, prefix)`` of the checkpoints in ``directory``, newest first.

    Committed checkpoints (recorded in the ``checkpoint`` state file, which is only updated after a write has
    completed) are listed; when the state file is missing, unreadable or names no existing checkpoint, every
    ``ckpt-N.index`` found is. Nothing outside ``directory`` is ever listed (links and foreign paths are ignored).

    Example:
        list_checkpoints("ckpt")
        # [(300, 'ckpt/ckpt-300'), (200, 'ckpt/ckpt-200')]
    """
    return _scan(directory)[0]


_WORKER_PREFIX = "keras_scale_ckpt_worker_"


def _remove_dead_worker_dirs() -> List[str]:
    """Remove private save folders of non-chief workers on this host whose process is gone."""
    removed = []
    root = tempfile.gettempdir()
    me = _hostname()
    pattern = re.compile(r"^" + _WORKER_PREFIX + r"(?P<host>[A-Za-z0-9.-]+)_(?P<pid>\d+)_")
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(_WORKER_PREFIX):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
            continue
        m = pattern.match(name)
        if m:
            dead = m.group("host") == me and not _pid_alive(int(m.group("pid")))
        else:  # older naming without host/pid: only when untouched for a day
            dead = time.time() - st.st_mtime > 86400
        if dead:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class DirectoryMixin:
    """Part of :class:`ChiefCheckpoint` (a mixin: it uses the callback's own state)."""

    def _prepare_write_dir(self) -> None:
        _remove_dead_worker_dirs()
        if self._chief:
            self._write_dir = self.directory
            probe = os.path.join(self.directory, f".ks_write_probe_{os.getpid()}")
            try:
                tf.io.gfile.makedirs(self.directory)
                with tf.io.gfile.GFile(probe, "w") as f:
                    f.write("ok")
                tf.io.gfile.remove(probe)
            except Exception as e:  # noqa: BLE001 - any failure here means we cannot save
                raise PermissionError(
                    f"ChiefCheckpoint cannot write to directory {self.directory!r}: {e}. Fix: pass a directory "
                    "this process can create and write (check permissions, disk space and the mount)."
                ) from e
            self._acquire_lock()
            self._remove_stale_temp_dirs()
        else:
            # Other workers write their (identical) share of each save to a private place, removed at the end;
            # host and pid in the name let the next start on this host remove it if this process dies.
            self._write_dir = tempfile.mkdtemp(prefix=f"{_WORKER_PREFIX}{_hostname()}_{os.getpid()}_")

    def _remove_stale_temp_dirs(self) -> None:
        # TensorFlow writes ckpt-N_temp/ first and merges it into ckpt-N.*; a kill mid-write leaves it behind.
        # Only real folders directly inside the directory: a link is never followed.
        try:
            for name in tf.io.gfile.listdir(self.directory):
                name = name.rstrip("/")
                if not (name.startswith(_NAME + "-") and name.endswith("_temp")):
                    continue
                path = os.path.join(self.directory, name)
                if _is_local(path):
                    if os.path.islink(path):
                        os.remove(path)  # the link only, never its target
                    elif os.path.isdir(path):
                        shutil.rmtree(path, ignore_errors=True)
                else:
                    tf.io.gfile.rmtree(path)
        except (tf.errors.OpError, OSError):
            pass

    def _report_directory_problems(self) -> None:
        if not self._chief:
            return
        _, problems, _ = _scan(self.directory)
        if problems:
            warnings.warn(f"ChiefCheckpoint: {self.directory!r}: " + "; ".join(problems) + ".", RuntimeWarning,
                          stacklevel=3)

    def _sanitize_state_file(self) -> None:
        """The CheckpointManager deletes what the state file lists: make it list only this directory's real
        checkpoints (a state file naming other places, or only missing files, is rewritten; the original is kept
        as ``checkpoint.invalid``)."""
        state_file = os.path.join(self.directory, "checkpoint")
        if not tf.io.gfile.exists(state_file):
            return
        candidates, problems, from_state = _scan(self.directory)
        if not problems:
            return
        if not from_state:  # nothing listed is usable: the scanned ones, newest max_to_keep, become the list
            candidates = candidates[: self.max_to_keep]
        kept = sorted(candidates)
        names = [os.path.basename(p) for _, p in kept]
        tf.io.gfile.rename(state_file, state_file + ".invalid", overwrite=True)
        if not names:
            return
        # with timestamps (newer than last_preserved_timestamp), the manager rotates them as its own again
        stamps = [tf.io.gfile.stat(p + ".index").mtime_nsec / 1e9 for _, p in kept]
        text = (f'model_checkpoint_path: "{names[-1]}"\n'
                + "".join(f'all_model_checkpoint_paths: "{n}"\n' for n in names)
                + "".join(f"all_model_checkpoint_timestamps: {t:.6f}\n" for t in stamps)
                + f"last_preserved_timestamp: {min(stamps) - 1.0:.6f}\n")
        tmp = state_file + ".tmp"
        with tf.io.gfile.GFile(tmp, "w") as f:
            f.write(text)
        tf.io.gfile.rename(tmp, state_file, overwrite=True)

