"""The checkpoint directory: which checkpoints it holds (the state file, scanning), its state file kept
sane, stale temporary folders and non-chief workers' scratch folders."""
from __future__ import annotations

import json
import os
import re
import stat
import time
import shutil
import tempfile
import warnings
from typing import Any, Dict, List, Optional, Tuple

import tensorflow as tf

from keras_scale.callbacks.checkpoint.names import _BEST_DIR, _INDEX_RE, _NAME, _PREFIX_RE, _RUN_CONFIG_KEY
from keras_scale.storage import _is_local
from keras_scale.callbacks.checkpoint import format as _io
from keras_scale.callbacks.checkpoint.format import remove_entry
from keras_scale.callbacks.checkpoint.lock import _LOCK_NAME, holder_gone, process_identity
from keras_scale.storage import write_atomic


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


def _state_file_is_dir(directory: str) -> bool:
    """Whether a directory stands where the ``checkpoint`` state file belongs (TensorFlow cannot read it, and logs
    warnings at every attempt)."""
    return tf.io.gfile.isdir(os.path.join(directory, "checkpoint"))


def _checkpoint_state(directory: str) -> Any:
    """``tf.train.get_checkpoint_state(directory)``, read in one piece. TensorFlow's reader takes the file's size
    and then opens it by name, so a state file replaced (renamed over) in between is read torn (the old size of the
    new file): "Checkpoint ignored", or ``tf.train.latest_checkpoint`` returning ``None`` beside a training run
    (TensorFlow's ``read_file_to_string`` tore 51 of 118,491 reads while a thread renamed files of 100 and 300 bytes
    over it; Python's ``open`` none). A local file is read
    here through one open file instead, and parsed as TensorFlow does. ``None`` when missing or unparseable."""
    if not _is_local(directory):
        return tf.train.get_checkpoint_state(directory)
    from google.protobuf import text_format
    from tensorflow.python.checkpoint.checkpoint_management import CheckpointState

    try:
        with open(os.path.join(directory, "checkpoint"), "rb") as f:
            content = f.read()
    except OSError:
        return None
    state = CheckpointState()
    try:
        text_format.Merge(content.decode("utf-8"), state)
    except (text_format.ParseError, UnicodeDecodeError):
        return None
    if not state.model_checkpoint_path:
        return None
    if not os.path.isabs(state.model_checkpoint_path):
        state.model_checkpoint_path = os.path.join(directory, state.model_checkpoint_path)
    for i, p in enumerate(state.all_model_checkpoint_paths):
        if not os.path.isabs(p):
            state.all_model_checkpoint_paths[i] = os.path.join(directory, p)
    return state


def _listed_names(directory: str) -> Tuple[List[str], bool]:
    """``(entries of the state file, the file exists but cannot be parsed)``; a directory in its place is such a
    file (never handed to TensorFlow)."""
    if _state_file_is_dir(directory):
        return [], True
    try:
        state = _checkpoint_state(directory)
    except Exception:  # noqa: BLE001 - a torn/garbled state file: fall back to scanning
        state = None
    listed = list(state.all_model_checkpoint_paths) if state is not None else []
    garbled = state is None and tf.io.gfile.exists(os.path.join(directory, "checkpoint"))
    return listed, garbled


def _indexed(directory: str) -> Dict[int, str]:
    """``{number: prefix}`` of every ``ckpt-N.index`` in ``directory`` whose files all live inside it."""
    found: Dict[int, str] = {}
    for name in tf.io.gfile.listdir(directory):
        m = _INDEX_RE.match(name.rstrip("/"))
        if not m:
            continue
        prefix = os.path.join(directory, name.rstrip("/")[: -len(".index")])
        if _files_inside(directory, prefix):
            found[int(m.group(1))] = prefix
    return found


def _scan(directory: str, at_start: bool = False) -> Tuple[List[Tuple[int, str]], List[str], bool]:
    """``(candidates newest first, problems, from_state_file)``. The problems say what the next ChiefCheckpoint
    start does about each (``at_start``: what this start, the one reporting them, does).

    The ``checkpoint`` state file (updated by TensorFlow only after a write completed) decides which checkpoints
    count. Entries naming files outside ``directory``, or links out of it, are ignored; entries whose ``.index``
    is gone are reported. A complete checkpoint (its index and every data shard, every tensor passing its CRC check)
    newer than the newest one the state file names -- written, then killed before it was recorded, or a state file
    put back from an older copy -- is a candidate too (adopted, reported: never deleted); one that fails the check is
    a torn write (reported; :func:`orphans`). When the state file is missing, unreadable, or names no
    existing checkpoint, every ``ckpt-N.index`` in the directory is a candidate (reported).
    """
    if not tf.io.gfile.isdir(directory):
        return [], [], False
    problems: List[str] = []
    found: Dict[int, str] = {}
    listed, garbled = _listed_names(directory)
    state_file = os.path.join(directory, "checkpoint")
    for p in listed:
        name = os.path.basename(p.rstrip("/"))
        m = _PREFIX_RE.match(name)
        # get_checkpoint_state joins relative entries with the directory already; older files may not
        if not m or not (_inside(directory, p) or _inside(directory, os.path.join(directory, p))):
            problems.append(f"the state file names {p!r}, which is not a checkpoint of this directory (ignored; "
                            + ("this start keeps" if at_start else "the next ChiefCheckpoint start keeps")
                            + " a copy of the state file as 'checkpoint.invalid' and rewrites it to list only "
                            "this directory's checkpoints, or removes it when there are none; nothing there is read "
                            "or deleted)")
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
    if found:
        newest = max(found)
        newer, torn = _newer_than(directory, newest)
        problems.extend(f"{p!r} is newer than the newest checkpoint the state file records but fails its check "
                        f"({why}): a write cut short, {'removed now' if at_start else 'removed at the next start'}"
                        for p, why in torn)
        if newer:
            found.update(newer)
            problems.append(
                f"the state file {state_file!r} names {_NAME}-{newest} as the newest checkpoint, but the complete "
                f"{', '.join(f'{_NAME}-{n}' for n in sorted(newer))} {'is' if len(newer) == 1 else 'are'} newer "
                "(written, then killed before being recorded, or an older copy of the state file): adopted -- "
                + ("this start resumes from the newest that loads and rewrites the state file to list them"
                   if at_start else "a resume starts from the newest that loads, and the next start rewrites the "
                   "state file to list them")
                + ". To resume from an older checkpoint, move the newer ones out of the directory")
    else:
        found = _indexed(directory)
        if listed and found:
            problems.append(f"the state file names no usable checkpoint; found {len(found)} by scanning the "
                            "directory")
        elif garbled:  # TensorFlow logs a parse error and ignores the file: its checkpoints would never rotate
            what = "is a directory, not a file" if _state_file_is_dir(directory) else "cannot be parsed"
            problems.append(f"the state file {state_file!r} {what} ("
                            + ("this start moves it aside to 'checkpoint.invalid'" if at_start else
                               "the next ChiefCheckpoint start moves it aside to 'checkpoint.invalid'")
                            + f"); found {len(found)} checkpoint(s) by scanning the directory")
        elif found and not listed:
            problems.append(f"the state file {state_file!r} is missing; found {len(found)} checkpoint(s) by "
                            "scanning the directory ("
                            + ("this start writes" if at_start else "the next ChiefCheckpoint start writes")
                            + " a new state file listing the newest of them)")
    return sorted(found.items(), reverse=True), problems, from_state


def _names_only(directory: str, prefixes: "set") -> bool:
    """The state file parses and every entry it names is one of ``prefixes`` (this directory's checkpoints)."""
    listed, garbled = _listed_names(directory)
    if garbled or not listed:
        return False
    for p in listed:
        name = os.path.basename(p.rstrip("/"))
        if not (_inside(directory, p) or _inside(directory, os.path.join(directory, p))):
            return False
        if os.path.join(directory, name) not in prefixes:
            return False
    return True


_MOVED_ASIDE_RE = re.compile(r"^checkpoint\.invalid(\.\d+)?$")


def moved_aside(directory: str) -> List[str]:
    """State files an earlier ChiefCheckpoint start moved aside (``checkpoint.invalid``, ``checkpoint.invalid.1``,
    ...): unparseable, a directory, or naming other places or missing files. Nothing reads or removes them.

    Example:
        moved_aside("ckpt")   # ['ckpt/checkpoint.invalid']
    """
    try:
        names = [n.rstrip("/") for n in tf.io.gfile.listdir(directory)]
    except (tf.errors.OpError, OSError):
        return []
    return sorted(os.path.join(directory, n) for n in names if _MOVED_ASIDE_RE.match(n))


def completed_record(prefix: str) -> Optional[Dict[str, object]]:
    """``{"epoch", "reason", "prefix"}`` when checkpoint ``prefix`` records that its run completed (the record
    ChiefCheckpoint writes in a run's last checkpoint, read as a rerun reads it: a damaged record counts as none),
    else ``None``. ``reason``: ``"epochs"`` (all its epochs trained) or ``"early_stopping"``.

    Example:
        completed_record("ckpt/ckpt-30")   # {'epoch': 3, 'reason': 'epochs', 'prefix': 'ckpt/ckpt-30'}
    """
    try:
        reader = _io.read_checkpoint(prefix)
        raw = reader.get_tensor(_RUN_CONFIG_KEY) if reader.has_tensor(_RUN_CONFIG_KEY) else b""
        config = json.loads(raw.decode() if isinstance(raw, bytes) else raw) if raw else {}
        done = config.get("completed") if isinstance(config, dict) else None
        if isinstance(done, dict):
            return {"epoch": int(done["epoch"]), "reason": str(done.get("reason", "epochs")), "prefix": prefix}
    except Exception:  # noqa: BLE001 - unreadable or a damaged record: none (as boundaries._Peek reads it)
        pass
    return None


def _newer_than(directory: str, newest: int) -> Tuple[Dict[int, str], List[Tuple[str, str]]]:
    """``({number: prefix} of complete checkpoints newer than ``newest`` that load, [(prefix, why)] of those that
    do not)``: what a state file naming ``newest`` last has not recorded."""
    newer: Dict[int, str] = {}
    torn: List[Tuple[str, str]] = []
    for n, p in sorted(_indexed(directory).items()):
        if n > newest and _io.is_complete(p):
            why = _verified(p)
            if why is None:
                newer[n] = p
            else:
                torn.append((p, why))
    return newer, torn


_VERIFIED: Dict[str, Tuple[tuple, Optional[str]]] = {}  # prefix -> (files' identity, failure or None)


def _verified(prefix: str) -> Optional[str]:
    """``None`` when checkpoint ``prefix`` loads (:func:`format.verify_checkpoint`), else why not; remembered
    while its files stay the same (inode, size, mtime)."""
    identity = _io.files_identity(prefix)
    cached = _VERIFIED.get(prefix)
    if identity is not None and cached is not None and cached[0] == identity:
        return cached[1]
    try:
        _io.verify_checkpoint(prefix)
        why = None
    except Exception as e:  # noqa: BLE001 - torn, truncated or bit-flipped
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    if identity is not None:
        _VERIFIED[prefix] = (identity, why)
    return why


def unlisted_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """``(number, prefix)`` of complete checkpoints older than the newest candidate that no resume uses and that the
    next start keeps: not in the state file (kept forever by ``keep_every_n_hours``, or left by an earlier run).
    Checkpoints a rotation was deleting when a kill cut it short (named in ``checkpoint.retiring``) are not among
    them: they are :func:`orphans`, which the next start deletes. Newest first.

    Example:
        unlisted_checkpoints("ckpt")   # [(100, 'ckpt/ckpt-100')]
    """
    if not tf.io.gfile.isdir(directory):
        return []
    candidates = {n for n, _ in _scan(directory)[0]}
    if not candidates:
        return []
    retiring, _ = _retiring(directory)
    return sorted(((n, p) for n, p in _indexed(directory).items()
                   if n not in candidates and n < max(candidates) and os.path.basename(p) not in retiring
                   and _io.is_complete(p)), reverse=True)


def _retiring(directory: str) -> Tuple[List[str], bool]:
    """``(names in checkpoint.retiring, the file exists)``: what a rotation was deleting when it was cut short."""
    path = os.path.join(directory, _io.RETIRING_NAME)
    if _is_local(path) and os.path.islink(path):  # never read through a link: removed, nothing it names deleted
        return [], True
    try:
        with tf.io.gfile.GFile(path) as f:
            names = json.load(f)
    except (tf.errors.NotFoundError, FileNotFoundError):
        return [], False
    except Exception:  # noqa: BLE001 - torn or garbled: nothing it names is trusted
        return [], True
    if not isinstance(names, list):
        return [], True
    return [n for n in names if isinstance(n, str) and _PREFIX_RE.match(n)], True


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
_SCRATCH_MARKER = ".keras_scale_scratch"  # inside a non-chief worker's scratch folder: which process made it
_ORPHAN_RE = re.compile(r"^" + _NAME + r"-(\d+)(\.index|\.data-\d{5}-of-\d{5})(\.tempstate\d+|\.ks_tmp)?$")
_SPARE_PREFIX = ".ks_spare_"  # retired data files an earlier version kept for reuse
# temporary files of a state-file or probe write cut short: write_atomic's, TensorFlow's atomic_write_string_to_file's
_TEMP_RE = re.compile(r"^(checkpoint|checkpoint\.retiring|\.ks_write_probe_\d+)\.tmp(-\d+-[0-9a-f]{12}|[0-9a-f]{32})$")


def _older_than(path: str, age_s: float) -> bool:
    try:
        return time.time() - os.lstat(path).st_mtime > age_s
    except OSError:
        return False


def make_scratch_dir() -> str:
    """A fresh private folder (``tempfile.mkdtemp``) for a non-chief worker's share of each save, marked with the
    process that made it, so that only that process -- or, once it is gone, a later start on this host -- removes it.

    Example:
        path = make_scratch_dir()
    """
    path = tempfile.mkdtemp(prefix=_WORKER_PREFIX)
    write_atomic(os.path.join(path, _SCRATCH_MARKER), json.dumps(process_identity()))
    return path


def _remove_dead_worker_dirs() -> List[str]:
    """Remove scratch folders that :func:`make_scratch_dir` made for a process of this host that is gone (its marker
    says which). Anything else in the temp dir -- whatever its name -- is never touched."""
    removed = []
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(_WORKER_PREFIX):
            continue
        path = os.path.join(root, name)
        marker = os.path.join(path, _SCRATCH_MARKER)
        try:
            st, mst = os.lstat(path), os.lstat(marker)
        except OSError:
            continue  # no marker: not made by make_scratch_dir
        if (not stat.S_ISDIR(st.st_mode) or not stat.S_ISREG(mst.st_mode) or st.st_uid != os.getuid()
                or mst.st_uid != os.getuid()):
            continue
        try:
            with open(marker) as f:
                holder = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(holder, dict) and holder_gone(holder):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def listed_but_missing(directory: str) -> List[str]:
    """Checkpoints the ``checkpoint`` state file names (in ``directory``) whose ``.index`` file is gone."""
    if _state_file_is_dir(directory):
        return []
    try:
        state = _checkpoint_state(directory)
    except Exception:  # noqa: BLE001 - a torn/garbled state file
        return []
    out = []
    for p in list(state.all_model_checkpoint_paths) if state is not None else []:
        name = os.path.basename(p.rstrip("/"))
        ours = _inside(directory, p) or _inside(directory, os.path.join(directory, p))  # (others: ignored, warned)
        if ours and _PREFIX_RE.match(name) and not tf.io.gfile.exists(os.path.join(directory, name) + ".index"):
            out.append(os.path.join(directory, name))
    return out


def orphans(directory: str) -> List[str]:
    """Files of this directory's naming scheme that belong to no checkpoint: temporary files of killed writes
    (``*.tempstate<N>``, ``*.ks_tmp``, ``ckpt-N_temp/``, the state file's and the lock's), data files whose ``.index`` is gone (a write or a
    deletion cut short), spares of earlier versions, the files of checkpoints a rotation was deleting when it was
    killed (named in ``checkpoint.retiring``, no longer in the state file) and that record itself, and the index of
    a torn write newer than the newest checkpoint (one with a data shard missing; a complete one is adopted, see
    :func:`list_checkpoints`). Nothing else.

    Example:
        orphans("ckpt")   # ['ckpt/ckpt-12.data-00000-of-00001.tempstate8812...']
    """
    try:
        names = [n.rstrip("/") for n in tf.io.gfile.listdir(directory)]
    except (tf.errors.OpError, OSError):
        return []
    listed, _, from_state = _scan(directory)
    newest = max((n for n, _ in listed), default=None) if from_state else None
    indexes = {n for n in names if _INDEX_RE.match(n)}
    out = []
    torn = set()
    if from_state:  # unrecorded checkpoints that fail their check (adopted ones are candidates, never orphans)
        recorded = [n for n, _ in listed]
        listed_names, _ = _listed_names(directory)
        in_file = {int(m.group(1)) for m in (_PREFIX_RE.match(os.path.basename(p.rstrip("/"))) for p in listed_names)
                   if m}
        recorded = [n for n in recorded if n in in_file]
        if recorded:
            torn = {os.path.basename(p) for p, _ in _newer_than(directory, max(recorded))[1]}
    retiring, journal = _retiring(directory)
    if journal:  # a rotation cut short after the state file stopped naming them: finish it
        still = {os.path.basename(p) for _, p in listed}
        gone = [n for n in retiring if n not in still]
        for name in names:
            m = _ORPHAN_RE.match(name)
            if m and not m.group(3) and f"{_NAME}-{m.group(1)}" in gone:
                out.append(os.path.join(directory, name))
        out.append(os.path.join(directory, _io.RETIRING_NAME))
    for name in names:
        if os.path.join(directory, name) in out:
            continue
        path = os.path.join(directory, name)
        if name.startswith(_SPARE_PREFIX) or _TEMP_RE.match(name):
            out.append(path)
            continue
        if name.startswith(_LOCK_NAME + ".") and _older_than(path, 60.0):  # a lock attempt cut short
            out.append(path)
            continue
        if name.startswith(_NAME + "-") and name.endswith("_temp"):
            out.append(path)
            continue
        m = _ORPHAN_RE.match(name)
        if not m:
            continue
        number, kind, temp = int(m.group(1)), m.group(2), m.group(3)
        if temp or f"{_NAME}-{number}" in torn:
            out.append(path)
        elif newest is not None and number > newest:
            out.append(path)
        elif kind != ".index" and f"{_NAME}-{number}.index" not in indexes:
            out.append(path)
    return out


class DirectoryMixin:
    """Part of :class:`ChiefCheckpoint` (a mixin: it uses the callback's own state)."""

    def _prepare_write_dir(self) -> None:
        _remove_dead_worker_dirs()
        if self._chief:
            self._write_dir = self.directory
            probe = os.path.join(self.directory, f".ks_write_probe_{os.getpid()}")
            try:
                tf.io.gfile.makedirs(self.directory)
                write_atomic(probe, "ok")
                remove_entry(probe)
            except Exception as e:  # noqa: BLE001 - any failure here means we cannot save
                raise PermissionError(
                    f"ChiefCheckpoint cannot write to directory {self.directory!r}: {e}. Fix: pass a directory "
                    "this process can create and write (check permissions, disk space and the mount)."
                ) from e
            self._acquire_lock()
            self._remove_orphans()
        else:
            # Other workers write their (identical) share of each save to a private place, removed at the end; its
            # marker lets a later start on this host remove it if this process dies.
            self._write_dir = make_scratch_dir()
            self._scratch_dir = self._write_dir
        missing = listed_but_missing(self.directory) if self.restore else []
        if missing and not list_checkpoints(self.directory):
            raise FileNotFoundError(
                f"ChiefCheckpoint: {os.path.join(self.directory, 'checkpoint')!r} records {len(missing)} "
                f"checkpoint(s) ({', '.join(os.path.basename(p) for p in missing)}) but their .index files are "
                f"missing ({', '.join(repr(p + '.index') for p in missing)}), and no other checkpoint is in the "
                "directory: resuming is impossible and starting over would silently discard the run. Fix: restore "
                "the files (e.g. from a backup), or, to start over, delete the directory's 'checkpoint' state file "
                "or pass restore=False or another directory.")

    def _remove_scratch(self) -> None:
        """Remove the scratch folder this process made (nothing else)."""
        path, self._scratch_dir = self._scratch_dir, None
        if path:
            shutil.rmtree(path, ignore_errors=True)

    def _remove_orphans(self) -> None:
        """Delete what :func:`orphans` finds (a link is removed itself, never followed), here and in ``best/``."""
        for path in orphans(self.directory) + self._best_orphans():
            try:
                if _is_local(path) and os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif not _is_local(path) and tf.io.gfile.isdir(path):
                    tf.io.gfile.rmtree(path)
                else:
                    remove_entry(path)
            except (tf.errors.OpError, OSError):
                pass
        self._repair_best()

    def _best_orphans(self) -> List[str]:
        """Temporary files of killed writes in ``best/``, and data files whose index is gone. (Checkpoints there
        are ranked, kept or dropped by keep_best_k's own start-up repair, never deleted as orphans.)"""
        best_dir = os.path.join(self.directory, _BEST_DIR)
        if not _is_local(best_dir) or os.path.islink(best_dir) or not os.path.isdir(best_dir):
            return []
        names = os.listdir(best_dir)
        out = []
        for name in names:
            m = _ORPHAN_RE.match(name)
            if (m and (m.group(3) or (m.group(2) != ".index" and f"{_NAME}-{m.group(1)}.index" not in names)
                       or (m.group(2) == ".index" and not _io.is_complete(os.path.join(best_dir, name[:-6])))
                       ) or name.startswith("best.json.tmp")):
                out.append(os.path.join(best_dir, name))
        return out

    def _start_fresh_beside_checkpoints(self) -> None:
        """``restore=False`` in a directory that holds checkpoints: this new run's are numbered after the newest
        (so a later rerun resumes this run, never the older one), and the chief warns that they rotate the older
        ones out, naming them (a completed run's included) and how to keep them: another directory."""
        found = list_checkpoints(self.directory)
        if not found:
            return
        newest, prefix = found[0]
        self._global_step = self._last_saved_step = newest
        if not self._chief:
            return
        done = completed_record(prefix)
        what = (f"a completed run (completed at epoch {done['epoch']}, {os.path.basename(prefix)})" if done
                else "an earlier run")
        names = ", ".join(os.path.basename(p) for _, p in sorted(found))
        if self.keep_every_n_hours:  # rotated out of the state file, but the manager keeps one per interval for good
            kept = ", ".join(os.path.basename(p) for _, p in sorted(unlisted_checkpoints(self.directory)))
            fate = (f"its saves rotate those out of the state file (after {self.max_to_keep} save(s) none of them is "
                    "listed; a rerun then resumes this new run); keep_every_n_hours="
                    f"{self.keep_every_n_hours} keeps the files of one checkpoint per {self.keep_every_n_hours} "
                    "hour(s) of save time for good and deletes the others as they rotate out"
                    + (f" (kept so already: {kept})" if kept else ""))
        else:
            fate = (f"its saves rotate those out (after {self.max_to_keep} save(s) none of them is left; a rerun then "
                    "resumes this new run)")
        warnings.warn(
            f"ChiefCheckpoint(restore=False): {self.directory!r} holds the checkpoints of {what}: {names}. This fit "
            f"starts a new run from the model as it is; its checkpoints are numbered after {_NAME}-{newest} and, with "
            f"max_to_keep={self.max_to_keep}, {fate}. To keep them all, give this run another directory "
            "(or copy them elsewhere first).", RuntimeWarning, stacklevel=3)

    def _report_directory_problems(self) -> None:
        if not self._chief:
            return
        _, problems, _ = _scan(self.directory, at_start=True)
        if problems:
            warnings.warn(f"ChiefCheckpoint: {self.directory!r}: " + "; ".join(problems) + ".", RuntimeWarning,
                          stacklevel=3)

    def _sanitize_state_file(self) -> None:
        """The CheckpointManager deletes what the state file lists: make it list only this directory's real
        checkpoints (a state file naming other places, or only missing files, is rewritten; the original is kept
        as ``checkpoint.invalid``), the complete ones newer than it names included (adopted: the old file named
        only real checkpoints, all still listed, so no copy of it is kept), and write one when it is missing but
        checkpoints are there (the newest ``max_to_keep`` become its list, rotated as usual)."""
        state_file = os.path.join(self.directory, "checkpoint")
        exists = tf.io.gfile.exists(state_file)
        candidates, problems, from_state = _scan(self.directory)
        if not problems or (not exists and not candidates):
            return
        if not from_state:  # nothing listed is usable: the scanned ones, newest max_to_keep, become the list
            candidates = candidates[: self.max_to_keep]
        kept = sorted(candidates)
        names = [os.path.basename(p) for _, p in kept]
        if exists and from_state and _names_only(self.directory, {p for _, p in kept}):
            exists = False  # stale, not wrong: every entry is still listed; nothing worth keeping a copy of
        aside, n = state_file + ".invalid", 1
        while tf.io.gfile.isdir(aside) or (_state_file_is_dir(self.directory) and tf.io.gfile.exists(aside)):
            aside, n = f"{state_file}.invalid.{n}", n + 1  # (an earlier one is never overwritten by a directory)
        if exists and _state_file_is_dir(self.directory):  # moved aside whole (nothing in it is deleted)
            tf.io.gfile.rename(state_file, aside)
            if n > 1:  # (otherwise _report_directory_problems said it already, naming 'checkpoint.invalid')
                warnings.warn(f"ChiefCheckpoint: the state file {state_file!r} is a directory, not a file: moved "
                              f"aside to {aside!r}; the checkpoints were found by scanning the directory.",
                              RuntimeWarning, stacklevel=3)
        elif exists:  # (kept as a copy: the state file is then replaced in one rename, never missing in between)
            with tf.io.gfile.GFile(state_file, "rb") as f:
                write_atomic(aside, f.read())
        if not names:
            remove_entry(state_file)
            return
        # with timestamps (newer than last_preserved_timestamp), the manager rotates them as its own again
        stamps = [tf.io.gfile.stat(p + ".index").mtime_nsec / 1e9 for _, p in kept]
        text = (f'model_checkpoint_path: "{names[-1]}"\n'
                + "".join(f'all_model_checkpoint_paths: "{n}"\n' for n in names)
                + "".join(f"all_model_checkpoint_timestamps: {t:.6f}\n" for t in stamps)
                + f"last_preserved_timestamp: {min(stamps) - 1.0:.6f}\n")
        write_atomic(state_file, text)

