"""ChiefCheckpoint: all-or-nothing, chief-only, optionally asynchronous checkpoints with exact (mid-epoch) resume.

Example:
    >>> import keras_scale as ks
    >>> model.fit(ds, epochs=90, callbacks=[ks.ChiefCheckpoint("/shared/run1/ckpt", save_freq=1000)])  # doctest: +SKIP
    >>> # killed or preempted? run the same script again: it continues at the same epoch and batch.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import keras
import tensorflow as tf

from keras_scale import events
from keras_scale._validate import check_int
from keras_scale.callbacks import _checkpoint_io as _io
from keras_scale.distribute import is_chief, is_multi_worker

__all__ = ["ChiefCheckpoint", "CheckpointMismatchError", "list_checkpoints", "checkpoint_for", "load_checkpoint",
           "PREEMPTION_EXIT_CODE"]

#: A reader (``has_tensor``, ``get_tensor``, ``get_variable_to_shape_map``) for a checkpoint prefix in either
#: format: synchronous saves are raw bytes + a JSON index (``_checkpoint_io``), async ones TensorFlow's bundle.
load_checkpoint = _io.load_checkpoint

log = logging.getLogger("keras_scale.checkpoint")

_NAME = "ckpt"
_INDEX_RE = re.compile(r"^" + _NAME + r"-(\d+)\.index$")
_PREFIX_RE = re.compile(r"^" + _NAME + r"-(\d+)$")
_SIGNATURE_KEY = "keras_scale_signature/.ATTRIBUTES/VARIABLE_VALUE"
_EPOCH_LOGS_KEY = "keras_scale_epoch_logs/.ATTRIBUTES/VARIABLE_VALUE"
_RUN_CONFIG_KEY = "keras_scale_run_config/.ATTRIBUTES/VARIABLE_VALUE"
_METRIC_KEY = "metrics_variables/{}/.ATTRIBUTES/VARIABLE_VALUE"
_EPOCH_SKIPPED_KEY = "keras_scale_epoch_skipped/.ATTRIBUTES/VARIABLE_VALUE"
_POSITION = ("epoch", "step_in_epoch", "stream_pos", "global_step", "batch_size")
# Guard state that describes the moment, not the run: never saved, never restored (a restored "halted" flag
# would freeze the resumed run).
_TRANSIENT_STEP_STATE = frozenset({"halted", "consecutive_bad", "incidents", "diag"})
_LOCK_NAME = ".keras_scale.lock"
_LOCK_HEARTBEAT_S = 30.0
_LOCK_STALE_S = 120.0  # a lock of another host not refreshed for this long is stale
_LOCK_UNREADABLE_S = 2.0  # a lock still empty/unparsable this long after its last write is no live run's
_WORKER_PREFIX = "keras_scale_ckpt_worker_"
_BEST_DIR = "best"
_REF_ATTR = "_keras_scale_checkpoint_ref"

#: Exit status of a process that ``ChiefCheckpoint`` ended after SIGTERM/SIGUSR1 with its state saved (the
#: convention of TensorFlow's ``PreemptionCheckpointHandler``). Key a restart/requeue on it.
PREEMPTION_EXIT_CODE = 42


class CheckpointMismatchError(ValueError):
    """A checkpoint in the directory was written for a different model (weight count or shapes differ)."""


# ---------------------------------------------------------------------------------------------------- the directory
def _is_local(path: str) -> bool:
    return "://" not in path


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


def checkpoint_for(model: keras.Model) -> Optional["ChiefCheckpoint"]:
    """The :class:`ChiefCheckpoint` taking part in ``model``'s current ``fit`` (``None`` if there is none).

    Valid from the callbacks' ``set_model`` on, so it does not depend on the order of the callback list. A caller
    that may roll back (``NanGuard(policy="rollback")``) registers itself this way: the checkpoint then also keeps
    the state the fit started from, so :meth:`ChiefCheckpoint.restore_latest` works before the first save.

    Example:
        ckpt = checkpoint_for(model)     # from another callback, during fit
        if ckpt is not None:
            ckpt.restore_latest()
    """
    ref = getattr(model, _REF_ATTR, None)
    ckpt = ref() if ref is not None else None
    if ckpt is None or not ckpt._in_this_fit():
        return None
    ckpt._start_state_wanted = True
    return ckpt


# ---------------------------------------------------------------------------------------------------- small helpers
def _tf_variable(v: Any) -> Any:
    # The tf.Variable (or distributed variable) under a Keras variable. Checkpointing Keras variables directly
    # breaks TensorFlow's async checkpoint from the 2nd save on (KerasVariable._copy_trackable_to_cpu creates a
    # new tf.Variable inside a tf.function on every call).
    return v.value if isinstance(v, keras.Variable) else v


def _optimizer_variables(model: keras.Model) -> List[Any]:
    return list(model.optimizer.variables) if model.optimizer is not None else []


def _metric_variables(model: keras.Model) -> List[Any]:
    try:
        return list(model.metrics_variables)
    except Exception:  # noqa: BLE001 - a model without compiled metrics
        return []


def _lr_variable(model: keras.Model) -> Optional[Any]:
    """The optimizer's learning-rate variable (a float LR; ``None`` for a schedule, which is code, not state)."""
    from keras_scale.schedules import learning_rate_variable

    return learning_rate_variable(getattr(model, "optimizer", None))


def _hook_method(obj: Any, name: str, before: Any) -> Tuple[Any, str, Any]:
    """Make ``obj.<name>(...)`` run ``before(caller)`` first (``caller``: the calling function's name), then the
    method it replaces; ``before`` returning ``False`` takes the hook away. Returns what :func:`_unhook` needs."""
    previous = vars(obj).get(name)
    if getattr(previous, "_ks_checkpoint_hook", False):
        previous = previous._ks_previous  # left by a fit that raised: replace it
    original = previous if previous is not None else (
        lambda *args, **kwargs: getattr(type(obj), name)(obj, *args, **kwargs))

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if before(sys._getframe(1).f_code.co_name) is False:
            _unhook((obj, name, hooked))
        return original(*args, **kwargs)

    hooked._ks_checkpoint_hook = True
    hooked._ks_previous = previous
    object.__setattr__(obj, name, hooked)
    return obj, name, hooked


def _unhook(hook: Optional[Tuple[Any, str, Any]]) -> None:
    """Give back what :func:`_hook_method` replaced (if the hook is still the one installed); returns ``None``."""
    if hook is None:
        return None
    obj, name, fn = hook
    if vars(obj).get(name) is fn:
        if fn._ks_previous is not None:
            object.__setattr__(obj, name, fn._ks_previous)
        else:
            object.__delattr__(obj, name)
    return None


def _signature(model: keras.Model) -> Dict[str, List[List[Any]]]:
    def describe(variables):
        return [[getattr(v, "path", None) or v.name, [int(d) for d in v.shape]] for v in variables]

    return {"model": describe(model.variables), "optimizer": describe(_optimizer_variables(model))}


def _describe(epoch: int, step_in_epoch: int) -> str:
    # Epochs 1-based as Keras prints them.
    if step_in_epoch == 0:
        return f"at the start of epoch {epoch + 1}"
    return f"after batch {step_in_epoch} of epoch {epoch + 1}"


def _batch_samples(batch: Any, strategy: Any) -> int:
    """Samples in one (global) batch read from a Keras data iterator; 0 when unknown."""
    flat = [t for t in tf.nest.flatten(batch) if t is not None]
    if not flat:
        return 0
    first = flat[0]
    if isinstance(first, tf.distribute.DistributedValues):
        local = strategy.experimental_local_results(first)
        n = sum(int(t.shape[0] or 0) for t in local)
        return n * int(strategy.num_replicas_in_sync) // max(len(local), 1)
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) and shape[0] is not None else 0


def _loss_count(model: keras.Model) -> Optional[float]:
    """Samples the loss tracker has seen this epoch (Keras weights it by the batch size); None if unknown."""
    tracker = getattr(model, "_loss_tracker", None)
    count = getattr(tracker, "count", None)
    if count is None:
        return None
    try:
        return float(count.numpy())
    except Exception:  # noqa: BLE001
        return None


def _cardinality(iterator: Any) -> int:
    """Batches in the data behind a Keras data iterator (tf.data's INFINITE/UNKNOWN constants where so)."""
    try:
        known = getattr(iterator, "_cardinality", None)  # tf.distribute iterators
        if known is not None:
            return int(known)
        dataset = getattr(iterator, "_dataset", None)
        if isinstance(dataset, tf.data.Dataset):
            return int(dataset.cardinality())
    except Exception:  # noqa: BLE001
        pass
    return int(tf.data.UNKNOWN_CARDINALITY)


def _datasets_of(iterator: Any) -> List[Any]:
    """The tf.data datasets behind a Keras data iterator, where TensorFlow exposes them."""
    out = []
    for it in [iterator] + list(getattr(iterator, "_iterators", []) or []):
        ds = getattr(it, "_dataset", None)
        if isinstance(ds, tf.data.Dataset):
            out.append(ds)
    return out


def _reshuffling_seeded_shuffle(dataset: Any) -> bool:
    """Some ``shuffle(seed=...)`` in the pipeline reshuffles each iteration (TF's default)."""
    stack, seen = [dataset], set()
    while stack:
        ds = stack.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        if "Shuffle" in type(ds).__name__ and getattr(ds, "_reshuffle_each_iteration", False):
            # an op seed (shuffle(seed=...)) lives in _seed2; _seed is the global seed (0 after set_random_seed(0))
            seeds = [getattr(ds, name, None) for name in ("_seed", "_seed2")]
            try:
                fixed = any(seed is not None and int(tf.get_static_value(seed) or 0) != 0 for seed in seeds)
            except Exception:  # noqa: BLE001
                fixed = any(seed is not None for seed in seeds)
            if fixed:
                return True
        for attr in ("_input_dataset",):
            child = getattr(ds, attr, None)
            if isinstance(child, tf.data.Dataset):
                stack.append(child)
        for child in getattr(ds, "_input_datasets", []) or []:
            if isinstance(child, tf.data.Dataset):
                stack.append(child)
    return False


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


class _ResumeEpoch(int):
    """The epoch a resumed ``fit`` starts at, for ``model._initial_epoch``: truthy only while the fit that set it
    is starting, so a ``fit`` that raised before clearing it never makes a later plain ``fit`` skip epochs."""

    def __new__(cls, value: int, owner: "ChiefCheckpoint") -> "_ResumeEpoch":
        obj = int.__new__(cls, value)
        obj._owner = weakref.ref(owner)
        return obj

    def __bool__(self) -> bool:
        owner = self._owner()
        return bool(int(self)) and owner is not None and owner._resume_pending and owner._in_this_fit()


# ---------------------------------------------------------------------------------------------------- the callback
class ChiefCheckpoint(keras.callbacks.Callback):
    """Crash- and preemption-safe checkpoints of everything training needs, written by the chief only, resumed
    exactly.

    One checkpoint per save holds the model, the optimizer (moments, iterations, loss scale),
    keras_scale's persistent step state (NanGuard's skipped-step count, the LR multiplier), the epoch's metric
    state and the position in the data (epoch, batch, batches read from the current iterator, samples per
    batch). A checkpoint counts only once its files are complete and ``tf.train.CheckpointManager`` has recorded
    it in ``directory/checkpoint``, so a kill at any moment leaves the previous one usable; a newest checkpoint that
    fails to load (size or CRC check) is reported and the one before it is used. Synchronous saves are written by
    ``_checkpoint_io`` (raw tensor bytes + a JSON index, into a recycled file; nothing fsynced), async ones by
    TensorFlow; :func:`load_checkpoint` reads both (docs/checkpoint.md, "File format and durability").

    On ``fit`` start (``restore=True``) the newest checkpoint that loads is restored and training continues at
    the same epoch *and* batch: the already-applied batches of the interrupted epoch are read from the data and
    dropped, and the epoch's metrics continue from their saved state. A run killed and restarted any number of
    times ends with the same weights as an uninterrupted one, given the same data order every run
    (``shuffle=False``, or a ``tf.data`` pipeline whose order does not depend on how often it was iterated) and
    deterministic ops.

    On SIGTERM or SIGUSR1 (preemption) the state is saved at the next step boundary (all workers agree on the
    step), training ends, and the process exits with :data:`PREEMPTION_EXIT_CODE` (42); rerunning resumes exactly.

    Under ``MultiWorkerMirroredStrategy`` only the chief (:func:`keras_scale.distribute.is_chief`) writes into
    ``directory``; the other workers take part in each save but write to a private temporary directory that
    is removed. For resuming, every worker must be able to read ``directory`` (a shared file system).

    Args:
        directory: where checkpoints ``ckpt-<global batch>.*`` go (local path or any ``tf.io.gfile`` URL). A relative
            local path is resolved against the working directory when the callback is created.
        save_freq: ``"epoch"`` (after each epoch's end callbacks) or an int: every that many batches (a save due at
            an epoch's last batch is taken after that epoch's end callbacks, as an epoch-end checkpoint).
        max_to_keep: how many recent checkpoints to keep (>= 1).
        async_save: write in the background (TensorFlow's async checkpoint): the step waits only for the
            copy to host memory; never two writes at once; the last one is flushed at ``on_train_end``.
        restore: resume from the newest checkpoint in ``directory`` at ``fit`` start.
        keep_every_n_hours: additionally keep one checkpoint per this many hours forever (``None``: off).
        keep_best_k: additionally keep the ``k`` best epoch-end checkpoints by ``monitor`` in ``directory/best``
            (0: off).
        monitor: the epoch log to rank by (e.g. ``"val_loss"``), used with ``keep_best_k``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (``max`` for accuracy/AUC-like names, else ``min``).
        preemption_exit_code: exit status after a SIGTERM/SIGUSR1 save (``None``: ``fit`` returns normally and
            :attr:`preempted` says why it stopped).
        signal_check_every_n_steps: multi-worker only: how often the workers agree on whether a signal arrived
            (one tiny all-reduce each time).
        verbose: 0 quiet (saves, restores and resumes go to the ``keras_scale.checkpoint`` logger at INFO); 1 one
            line on stdout per save, restore and resume (chief only). Preemption and incidents always warn (stderr).

    Example:
        >>> ckpt = ChiefCheckpoint("runs/exp1/ckpt", save_freq=500, max_to_keep=3, async_save=True)
        >>> ckpt.save_freq
        500
        >>> model.fit(ds, epochs=10, callbacks=[ckpt])  # doctest: +SKIP
    """

    def __init__(
        self,
        directory: Union[str, os.PathLike],
        save_freq: Union[str, int] = "epoch",
        max_to_keep: int = 3,
        async_save: bool = False,
        restore: bool = True,
        keep_every_n_hours: Optional[float] = None,
        keep_best_k: int = 0,
        monitor: str = "val_loss",
        mode: str = "auto",
        preemption_exit_code: Optional[int] = PREEMPTION_EXIT_CODE,
        signal_check_every_n_steps: int = 1,
        verbose: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise ValueError(f"directory must be a non-empty path, got {directory!r}")
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq <= 0
        ):
            raise ValueError(
                f"save_freq must be 'epoch' or a positive number of batches, got {save_freq!r}. "
                "Example: save_freq=1000 saves every 1000 batches."
            )
        check_int("max_to_keep", max_to_keep, owner="ChiefCheckpoint")
        check_int("keep_best_k", keep_best_k, minimum=0, owner="ChiefCheckpoint",
                  hint="It is how many best epoch-end checkpoints to keep besides the newest (0: off).")
        check_int("signal_check_every_n_steps", signal_check_every_n_steps, owner="ChiefCheckpoint")
        if keep_every_n_hours is not None and not (float(keep_every_n_hours) > 0):
            raise ValueError(f"keep_every_n_hours must be > 0 hours or None, got {keep_every_n_hours!r}")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"ChiefCheckpoint: mode must be 'auto', 'min' or 'max', got {mode!r}.")
        if keep_best_k and (not isinstance(monitor, str) or not monitor):
            raise ValueError(f"ChiefCheckpoint: keep_best_k={keep_best_k} needs monitor= (a name in the epoch logs, "
                             f"e.g. 'val_loss'), got {monitor!r}.")
        if preemption_exit_code is not None and (isinstance(preemption_exit_code, bool)
                                                 or not isinstance(preemption_exit_code, int)
                                                 or not 0 <= preemption_exit_code <= 255):
            raise ValueError(f"ChiefCheckpoint: preemption_exit_code must be an exit status 0..255 or None, got "
                             f"{preemption_exit_code!r}.")
        self.directory = os.fspath(directory)
        if _is_local(self.directory):
            # resolved now: a chdir between construction and fit must not move the checkpoints
            self.directory = os.path.abspath(self.directory)
        self.save_freq = save_freq
        self.max_to_keep = max_to_keep
        self.async_save = bool(async_save)
        self.restore = bool(restore)
        self.keep_every_n_hours = keep_every_n_hours
        self.keep_best_k = keep_best_k
        self.monitor = monitor
        if mode == "auto":
            mode = "max" if any(k in monitor.lower() for k in ("acc", "auc", "precision", "recall", "f1")) else "min"
        self.mode = mode
        self.preemption_exit_code = preemption_exit_code
        self.signal_check_every_n_steps = signal_check_every_n_steps
        self.verbose = int(verbose)
        self._manager: Optional[tf.train.CheckpointManager] = None
        self._checkpoint: Optional[tf.train.Checkpoint] = None
        self._write_dir: Optional[str] = None
        self._chief = True
        self._fit_history: Any = None
        self._start_state_wanted = False
        self._prev_handlers: Dict[int, Any] = {}
        self._lock_path: Optional[str] = None
        self._lock_stop: Optional[threading.Event] = None
        self._fit_thread: Optional[int] = None
        self.blocked_s = 0.0
        self._warned_poisoned = False
        self._check_state = False
        self.preempted: Optional[int] = None
        self._reset_position()

    # ------------------------------------------------------------------ public API
    @property
    def restored_from(self) -> Optional[str]:
        """Path prefix of the checkpoint restored at the last ``fit`` start (``None``: started fresh)."""
        return self._restored_from

    @property
    def global_step(self) -> int:
        """Batches trained so far over all (resumed) runs; checkpoints are numbered by it."""
        return self._global_step

    @property
    def best_checkpoints(self) -> List[Tuple[float, str]]:
        """``(monitored value, prefix)`` of the kept best checkpoints, best first (``keep_best_k``).

        Example:
            ckpt.best_checkpoints
            # [(0.031, 'ckpt/best/ckpt-300'), (0.035, 'ckpt/best/ckpt-200')]
        """
        return [(e["value"], os.path.join(self.directory, _BEST_DIR, f"{_NAME}-{e['number']}"))
                for e in self._read_best()]

    def restore_latest(self, restore_keras_scale_state: bool = False) -> Optional[int]:
        """Restore the newest checkpoint that loads into the model and optimizer, mid-training.

        For NanGuard's rollback policy (find the callback with :func:`checkpoint_for`). Before this fit's first
        save it restores the state the fit started from: the checkpoint it resumed from, or, in a fresh run, the
        initial state kept in host memory when a caller registered through :func:`checkpoint_for` before the
        first step (dropped at the first save). The data position is *not* rewound: training continues with the
        next batch. keras_scale's own state (NanGuard's count, the LR multiplier) and a float learning rate (an
        optimizer variable) are kept as they are now unless ``restore_keras_scale_state=True``, so a rollback neither
        resets the counters that limit rollbacks nor undoes a learning rate lowered by an earlier rollback. Under
        multi-worker every worker must call it at the same step (it synchronizes them). Returns the restored state's
        global batch, or ``None`` if there is none.

        Example:
            step = checkpoint_for(model).restore_latest()
        """
        if self._checkpoint is None:
            if self.model is None or self._write_dir is None or not self._ensure_built():
                raise RuntimeError("restore_latest() needs a ChiefCheckpoint that is part of a running fit().")
            self._build_checkpoint()
        self._timed_wait()
        strategy = self.model.distribute_strategy
        self._sum_over_workers(strategy, 0.0)  # barrier: the chief's last write is recorded before anyone looks
        # A float learning rate is an optimizer variable: kept as it is now, like keras_scale's LR multiplier (a
        # rollback to a state saved before an earlier rollback must not undo that rollback's lowering).
        lr = _lr_variable(self.model)
        keep_lr = lr.numpy() if lr is not None and not restore_keras_scale_state else None
        found = self._restore_newest(everything=restore_keras_scale_state) if list_checkpoints(self.directory) else None
        if found is not None:
            step = self._read_position(found)["global_step"]
            if restore_keras_scale_state:
                self._run_config_var.assign(json.dumps({"learning_rate": self._lr_at_start}))
                if self._lr_override is not None and found == self._restored_from and lr is not None:
                    lr.assign(self._lr_override)  # the checkpoint resumed from predates this run's learning rate
        elif self._start_state is not None:
            for var, value in zip(self._start_variables(), self._start_state):
                var.assign(value)
            step = self._start_step
        else:
            step = -1
        if keep_lr is not None and step >= 0:
            lr.assign(keep_lr)
        self._check_workers_agree(strategy, step)
        return None if step < 0 else step

    def restore_checkpoint(self, prefix: str) -> int:
        """Load a checkpoint of this directory (e.g. one of :attr:`best_checkpoints`) into the model and
        optimizer; returns its global batch.

        Example:
            value, prefix = ckpt.best_checkpoints[0]
            ckpt.restore_checkpoint(prefix)
        """
        if self.model is None or not self._ensure_built():
            raise RuntimeError("restore_checkpoint() needs the model this ChiefCheckpoint was used with, built.")
        if self._checkpoint is None:
            self._write_dir = self._write_dir or self.directory
            self._build_checkpoint(with_manager=False)
        reader = _io.load_checkpoint(prefix)
        self._check_signature(prefix, reader)
        _io.read_into(prefix, self._flat_weights, self._weights_only)
        return self._read_position(prefix)["global_step"]

    def wait(self) -> None:
        """Block until a background (``async_save``) write has finished.

        Example:
            ckpt.wait()
        """
        self._timed_wait()

    # ------------------------------------------------------------------ Keras hooks
    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        # Keras sets model.history to this fit's History right before calling set_model: that identifies the fit.
        self._fit_history = getattr(model, "history", None)
        self.params = None
        self._start_state_wanted = False
        object.__setattr__(model, _REF_ATTR, weakref.ref(self))
        # State a previous fit that raised may have left behind (Keras skips on_train_end on an exception).
        inner = getattr(getattr(model, "train_function", None), "_ks_checkpoint_inner", None)
        if inner is not None:
            model.train_function = inner
        if isinstance(getattr(model, "_initial_epoch", None), _ResumeEpoch):
            model._initial_epoch = None

    def on_train_begin(self, logs=None):
        model = self.model
        ref = getattr(model, _REF_ATTR, None)
        other = ref() if ref is not None else None
        if other is not None and other is not self:  # set_model of a second ChiefCheckpoint in this callback list
            raise ValueError(
                f"two ChiefCheckpoints in one fit ({self.directory!r} and {other.directory!r}): each would resume and "
                "fast-forward on its own and batches would be skipped. Pass one ChiefCheckpoint.")
        strategy = model.distribute_strategy
        self._chief = is_chief(strategy)
        self._reset_position()
        from keras_scale.step import get_step

        step = get_step(model, create=False)  # (a loss-only NanGuard withdraws at its on_train_end: latched here)
        self._check_state = bool(step is not None and step.loss_only)
        lr = _lr_variable(model)
        self._lr_at_start = float(lr.numpy()) if lr is not None else None  # as this run's script sets it
        self._fit_thread = threading.get_ident()
        self.blocked_s = 0.0
        self._warned_poisoned = False
        self.preempted = None
        error: Optional[BaseException] = None
        try:
            self._prepare_write_dir()
        except (PermissionError, RuntimeError) as e:  # the chief cannot use the directory
            error = e
        # Multi-worker: every worker stops when the chief cannot start (instead of waiting in a collective).
        if self._sum_over_workers(strategy, 1.0 if error is not None else 0.0) > 0:
            if not self._chief and self._write_dir and self._write_dir != self.directory:
                shutil.rmtree(self._write_dir, ignore_errors=True)
            raise error if error is not None else RuntimeError(
                f"ChiefCheckpoint: the chief could not start in {self.directory!r} (see its error); this worker "
                "stops too.")
        self._install_signal_handlers()
        self._checkpoint = self._manager = None
        self._report_directory_problems()
        self._best = self._read_best() if self.keep_best_k else []
        if self._ensure_built():
            self._build_checkpoint()
        found: Optional[str] = None
        if self.restore and list_checkpoints(self.directory):
            if self._checkpoint is not None:
                found = self._restored_from = self._restore_newest()
                self._reconcile_learning_rate(found)
            else:
                # The model gets its variables only when its first step is traced: pick the newest checkpoint
                # that reads back completely now (the epoch must be known before the first epoch starts) and
                # restore it right before the first step, once the model is built from the data's spec.
                found = self._deferred_restore = self._restored_from = self._newest_readable()
        position = self._read_position(found) if found is not None else None
        self._check_workers_agree(strategy, position["global_step"] if position else -1)
        if position is not None:
            self._resume(position, found)
        self._install_wrapper()
        self._install_final_save_hook()
        self._install_stop_save_hook()

    def on_epoch_begin(self, epoch, logs=None):
        if self._resume_pending:
            # Keras has read model._initial_epoch by now: take it back so no later fit starts there.
            self._resume_pending = False
            if isinstance(getattr(self.model, "_initial_epoch", None), _ResumeEpoch):
                self.model._initial_epoch = None
        self._epoch = int(epoch)
        self._step_in_epoch = 0
        self._epoch_complete = False
        self._train_metric_values = None
        self._stopped_before_validation = None
        self._validation_cut = False
        self._skipped_seen = 0.0  # NanGuard's per-epoch count starts again

    def on_train_batch_begin(self, batch, logs=None):
        if self.model.train_function is not self._wrapper:  # someone rebuilt it (e.g. make_train_function(force))
            self._install_wrapper()

    def on_train_batch_end(self, batch, logs=None):
        self._step_in_epoch = int(batch) + 1
        self._calls += 1
        self._check_preemption(self._calls % self.signal_check_every_n_steps == 0)
        flagged = self._flagged_non_finite(logs)
        if self._last_call_skipped or self.save_freq == "epoch" or self._preempting:
            return
        if flagged:
            # NanGuard flagged this step non-finite: a rollback (now or later in this step's callbacks, whatever
            # their order) must not find this moment as the newest state; the due save is taken at the next good step.
            return
        if self._save_due():
            steps = (self.params or {}).get("steps")
            if steps and self._step_in_epoch >= int(steps):
                # The epoch's last batch: saved after the epoch's end callbacks (at the next epoch's first batch or
                # at train end), as an epoch-end checkpoint holding the epoch's logs, so that a finished run's last
                # checkpoint says "complete" and a resume starts at the next epoch.
                return
            self._save(self._epoch, self._step_in_epoch, self._stream_pos)

    def _flagged_non_finite(self, logs: Any) -> bool:
        """The composed step's logs count this epoch's non-finite steps (``nan_skipped``): it grew in this call."""
        from keras_scale.step import SKIPPED_LOG_KEY

        value = (logs or {}).get(SKIPPED_LOG_KEY)
        if value is None:
            return False
        try:
            value = float(value)
        except (TypeError, ValueError):
            return False
        grew = value > self._skipped_seen
        self._skipped_seen = value
        return grew

    def _save_due(self) -> bool:
        freq = self.save_freq
        return freq != "epoch" and self._global_step // freq > self._last_saved_step // freq

    def on_test_begin(self, logs=None):
        self._in_validation = True
        # Validation inside fit runs after the epoch's last (or interrupting) batch and resets the metric variables
        # that a mid-epoch save at train end must hold: keep this epoch's training metric state (a few scalars).
        if self._fit_thread is not None and self._checkpoint is not None:
            self._train_metric_values = [v.numpy() for v in _metric_variables(self.model)]
            self._stopped_before_validation = bool(self.model.stop_training)

    def on_test_end(self, logs=None):
        self._in_validation = False

    def on_test_batch_end(self, batch, logs=None):
        if self._preempting:  # no validation run after a preemption signal: save and go
            self.model.stop_evaluating = True
            self._validation_cut = True

    def on_epoch_end(self, epoch, logs=None):
        steps = (self.params or {}).get("steps")
        self._check_preemption(True)
        # A stop requested by a batch callback ends the epoch early; EarlyStopping stops after a full epoch. When
        # validation ran, whether the stop came before it (from a batch) is known exactly.
        stopped = self.model.stop_training if self._stopped_before_validation is None else \
            self._stopped_before_validation
        self._epoch_complete = not stopped or bool(steps and self._step_in_epoch >= steps)
        if self._epoch_complete and self._validation_cut:
            # its batches all trained but its validation was cut short by the signal: saved as "the last batch,
            # before the epoch's end", so the rerun runs validation and the epoch-end callbacks again, and a
            # one-batch val_loss never becomes the epoch's result (nor ranks a best checkpoint)
            self._epoch_complete = False
        if self._epoch_complete:
            self._last_epoch_logs = (int(epoch), logs)  # the dict itself: callbacks after us add keys to it
            if self.save_freq == "epoch" or self._save_due():
                # Saved at the first batch of the next epoch (or at train end): only then is it known whether the
                # next epoch reads a fresh data iterator or continues this one (steps_per_epoch + repeat()).
                self._pending_epoch_save = True
            self._consider_best(int(epoch), logs)

    def on_train_end(self, logs=None):
        # The final state is always saved, so a finished, stopped or preempted run resumes with nothing lost.
        try:
            self._final_save()
            self._timed_wait()
            if self._already_complete is not None:
                self._fill_history()
        finally:
            self._active_cleanup()
        if self._preempting:
            signame = signal.Signals(self.preempted).name if self.preempted else "a signal"
            where = f"{self._last_saved_prefix!r}" if self._last_saved_prefix else "the newest checkpoint"
            code = self.preemption_exit_code
            saved = (f"state saved in {where} (global batch {self._global_step})"
                     if self._last_saved_step == self._global_step else
                     f"state at global batch {self._global_step} NOT saved (non-finite, see above); " + (
                         f"the newest checkpoint is {where} (global batch {self._last_saved_step})"
                         if self._last_saved_prefix else
                         f"this fit wrote no checkpoint: a rerun resumes from the newest one in {self.directory!r} "
                         f"if there is one, else starts afresh"))
            self._say(f"ChiefCheckpoint: {signame} received; {saved}. " + (f"Exiting with status {code}: rerun the same command to resume."
                                                   if code is not None else "Rerun to resume."), routine=False)
            if code is not None:
                self._exit_after_train_end(code)
        # Files are never deleted here: a graceful stop (EarlyStopping, NanGuard halt) must keep them.

    def _exit_after_train_end(self, code: int) -> None:
        """Exit with ``code`` once every callback's ``on_train_end`` has run (Goodput's report, TensorBoard's
        flush, a user's cleanup), not in the middle of them: the last callback of Keras's ``CallbackList`` (the one
        calling this hook) raises it right after its own ``on_train_end``; when this callback is the last, now."""
        caller = sys._getframe(2).f_locals.get("self")  # CallbackList.on_train_end -> on_train_end -> here
        callbacks = list(getattr(caller, "callbacks", None) or []) if isinstance(
            caller, keras.callbacks.CallbackList) else []
        if not callbacks or not any(cb is self for cb in callbacks) or callbacks[-1] is self:
            raise SystemExit(code)
        last = callbacks[-1]
        own = last.on_train_end  # bound: a subclass's own method runs
        had_attribute = "on_train_end" in vars(last)

        def on_train_end(logs=None):
            if had_attribute:
                last.on_train_end = own
            else:
                del last.on_train_end  # the instance attribute: back to the class's method
            try:
                own(logs)
            finally:
                raise SystemExit(code)

        last.on_train_end = on_train_end

    def _final_save(self) -> None:
        if self._global_step != self._last_saved_step or self._pending_best is not None:
            if self._epoch_complete:
                fresh = self._iterator is None or self._iterator_exhausted(self._iterator)
                self._save(self._epoch + 1, 0, 0 if fresh else self._stream_pos)
            else:
                self._save_mid_epoch()

    def _install_final_save_hook(self) -> None:
        """Keras's fit calls ``optimizer.finalize_variable_values`` after its last epoch, right before any
        ``on_train_end``: the final save is taken there, so it holds the state training continues from whatever
        other callbacks do at train end (``EarlyStopping(restore_best_weights=True)`` puts an earlier epoch's weights
        back, whatever the order) and whatever the optimizer does there (``use_ema=True`` overwrites the weights
        with their moving averages; the averages are optimizer variables, saved too)."""
        optimizer = self.model.optimizer
        if optimizer is None:
            return
        me = weakref.ref(self)

        def before(caller: str) -> None:
            cb = me()
            if cb is not None and cb._in_this_fit() and cb._fit_thread == threading.get_ident():
                cb._final_save()

        self._finalize_hook = _hook_method(optimizer, "finalize_variable_values", before)

    def _install_stop_save_hook(self) -> None:
        """A stop in the middle of an epoch (a callback's ``stop_training``, SIGTERM, NanGuard) is saved where the
        training loop stops, before anything else runs: validation, ``on_epoch_end`` callbacks that would change the
        learning rate on a partial epoch (ReduceLROnPlateau), or ``EarlyStopping(restore_best_weights=True)``
        putting older weights back at train end. Keras's fit calls ``model._get_metrics_result_or_logs`` right
        after its batch loop ends; the save runs there, on the first call after a mid-epoch stop."""
        model = self.model
        if not hasattr(type(model), "_get_metrics_result_or_logs"):
            return  # another Keras: the stop is saved at train end, as before
        me = weakref.ref(self)

        def before(caller: str) -> Optional[bool]:
            cb = me()
            if cb is None or not cb._in_this_fit():
                return False  # left by a fit that raised: take it away
            if cb._fit_thread == threading.get_ident() and caller == "fit":
                cb._save_at_stop()  # (only fit's own call after its batch loop; never evaluate's)
            return None

        self._stop_hook = _hook_method(model, "_get_metrics_result_or_logs", before)

    def _save_at_stop(self) -> None:
        model = self.model
        if not model.stop_training or self._already_complete is not None or self._in_validation:
            return
        steps = (self.params or {}).get("steps")
        if steps and self._step_in_epoch >= steps:
            return  # the epoch is complete: saved at its end with its logs, as without a stop
        if self._global_step != self._last_saved_step:
            self._save(self._epoch, self._step_in_epoch, self._stream_pos)

    def _save_mid_epoch(self) -> None:
        """Save the interrupted epoch's position with its *training* metric state: validation (which Keras runs
        after the interrupting batch too) reset the metric variables, so the values kept before it are saved, and
        the validation values are put back afterwards."""
        kept = self._train_metric_values
        variables = _metric_variables(self.model)
        if kept is None or len(kept) != len(variables):
            self._save(self._epoch, self._step_in_epoch, self._stream_pos)
            return
        now = [v.numpy() for v in variables]
        try:
            for var, value in zip(variables, kept):
                var.assign(value)
            self._save(self._epoch, self._step_in_epoch, self._stream_pos)
            self._timed_wait()
        finally:
            for var, value in zip(variables, now):
                var.assign(value)

    def _active_cleanup(self) -> None:
        self._finalize_hook = _unhook(self._finalize_hook)
        self._stop_hook = _unhook(self._stop_hook)
        self._pending_epoch_save = False
        self._iterator = self._own_stream = self._prefix_skipped_on = None
        self._start_state = None
        model = self.model
        if getattr(model, "train_function", None) is self._wrapper and self._inner is not None:
            model.train_function = self._inner
        if isinstance(getattr(model, "_initial_epoch", None), _ResumeEpoch):
            model._initial_epoch = None  # Keras never resets it: a later fit() would start there too
        self._resume_pending = False
        if not self._chief and self._write_dir and self._write_dir != self.directory:
            shutil.rmtree(self._write_dir, ignore_errors=True)
        self._restore_signal_handlers()
        self._release_lock()

    @staticmethod
    def _iterator_exhausted(iterator: Any) -> bool:
        # Only at train end, when nobody reads the iterator any more: Keras starts the next epoch on a fresh
        # iterator exactly when this one ran out (finite data), and continues it otherwise (repeat()).
        try:
            return not bool(iterator.get_next_as_optional().has_value())
        except (tf.errors.OutOfRangeError, StopIteration):
            return True
        except Exception:  # noqa: BLE001 - an iterator type without optionals: assume per-epoch iterators
            return True

    # ------------------------------------------------------------------ fit identity
    def _in_this_fit(self) -> bool:
        """True while the fit this callback was set up for is the model's newest fit (a later fit creates a new
        History and hands it new params)."""
        model = self._model
        if model is None or self._fit_history is None:
            return False
        history = getattr(model, "history", None)
        if history is not self._fit_history:
            return False
        return not self.params or getattr(history, "params", None) is self.params

    def _fit_running(self, frame: Any = None) -> bool:
        """This callback's fit is on the stack of the thread that started it (or of ``frame``)."""
        if frame is None:
            frame = sys._current_frames().get(self._fit_thread) if self._fit_thread is not None else None
        model = self._model
        while frame is not None:
            if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
                return True
            frame = frame.f_back
        return False

    # ------------------------------------------------------------------ internals
    def _reset_position(self) -> None:
        self._epoch = 0
        self._step_in_epoch = 0
        self._stream_pos = 0  # batches read from the data iterator now in use
        self._global_step = 0  # batches trained, over all runs
        self._last_saved_step = 0
        self._last_saved_prefix: Optional[str] = None
        self._iterator: Any = None
        self._skip_prefix = 0
        self._skip_calls = 0
        self._preread = 0
        self._last_call_skipped = False
        self._pending_epoch_save = False
        self._epoch_complete = False
        self._train_metric_values: Optional[List[Any]] = None  # this epoch's metric state kept before validation
        self._stopped_before_validation: Optional[bool] = None
        self._validation_cut = False  # a preemption signal cut this epoch's validation short
        self._restored_from: Optional[str] = None
        self._deferred_restore: Optional[str] = None
        self._resume_position: Optional[Dict[str, int]] = None
        self._resume_pending = False
        self._already_complete: Optional[int] = None
        self._wrapper: Any = None
        self._inner: Any = None
        self._in_call = False
        self._first_call = True
        self._calls = 0
        self._batch_size = 0  # samples per (global) batch; 0 unknown
        self._measure_tries = 0
        self._last_epoch_logs: Optional[Tuple[int, Any]] = None
        self._saved_epoch_logs: Optional[Dict[str, Any]] = None
        self._pending_best: Optional[Tuple[float, int]] = None
        self._warned_monitor = False
        self._best: List[Dict[str, Any]] = []
        self._saved_batch_size = 0
        self._start_state: Optional[List[Any]] = None
        self._start_step = 0
        self._preempt_requested: Optional[int] = None
        self._preempting = False
        self._lr_at_start: Optional[float] = None
        self._lr_override: Optional[float] = None
        self._skipped_seen = 0.0
        self._finalize_hook: Optional[Tuple[Any, str, Any]] = None  # what _hook_method installed
        self._stop_hook: Optional[Tuple[Any, str, Any]] = None
        self._in_validation = False
        self._iter_backup: Optional[tf.Variable] = None
        self._own_stream: Any = None
        self._may_run_out = True
        self._prefix_skipped_on: Any = None

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

    # ------------------------------------------------------------------ lock (one run per directory)
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

    # ------------------------------------------------------------------ preemption
    def _install_signal_handlers(self) -> None:
        self._restore_signal_handlers()
        if threading.current_thread() is not threading.main_thread():
            log.info("ChiefCheckpoint: fit runs outside the main thread; SIGTERM/SIGUSR1 are not handled")
            return
        for sig in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)):
            if sig is None:
                continue
            try:
                self._prev_handlers[int(sig)] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, prev in list(self._prev_handlers.items()):
            try:
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        self._prev_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._preempt_requested is None and self._fit_running(frame):
            self._preempt_requested = signum  # acted on at the next step boundary
            log.warning("ChiefCheckpoint: received %s; saving at the next step boundary",
                        signal.Signals(signum).name)
            return
        # A second signal, or our fit is no longer running (it raised): behave as if we had never been here.
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        self._restore_signal_handlers()
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def _check_preemption(self, agree_now: bool) -> None:
        if self._preempting:
            return
        strategy = self.model.distribute_strategy
        mine = 0.0 if self._preempt_requested is None else float(self._preempt_requested)
        if is_multi_worker(strategy):
            if not agree_now:
                return
            # Every worker asks at the same batch: the signal may have reached only one of them.
            total = self._sum_over_workers(strategy, mine)
        else:
            total = mine
        if total > 0:
            self._preempting = True
            signum = self._preempt_requested
            if signum is None:
                signum = int(signal.SIGTERM)
            self.preempted = int(signum)
            events.record("preemption", self._global_step, signal=signal.Signals(signum).name)
            self.model.stop_training = True

    # ------------------------------------------------------------------ multi-worker agreement
    def _sum_over_workers(self, strategy: Any, value: float, first_replica_only: bool = False) -> float:
        """All-reduce (SUM) of ``value`` over all replicas of all workers; also a barrier. Local value outside
        multi-worker."""
        if not is_multi_worker(strategy):
            return value

        def fn():
            v = tf.constant(value, tf.float64)
            if not first_replica_only:
                return v
            first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
            return tf.where(first, v, tf.constant(0.0, tf.float64))

        return float(strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(fn), axis=None).numpy())

    def _check_workers_agree(self, strategy: Any, restored_step: int) -> None:
        """Multi-worker: every worker must resume from the same checkpoint (or none), else training diverges or
        hangs in a collective. Two small all-reduces; nothing outside multi-worker."""
        if not is_multi_worker(strategy):
            return
        first_step = int(self._sum_over_workers(strategy, float(restored_step), first_replica_only=True))
        if self._sum_over_workers(strategy, 0.0 if first_step == restored_step else 1.0) > 0:
            mine = f"a checkpoint at global batch {restored_step}" if restored_step >= 0 else "no checkpoint"
            theirs = f"global batch {first_step}" if first_step >= 0 else "no checkpoint"
            raise RuntimeError(
                f"ChiefCheckpoint: the workers would resume from different states (this worker found {mine} in "
                f"{self.directory!r}, the first worker {theirs}). Fix: put the checkpoint directory on a file "
                "system every worker can read (NFS, GCS, ...) at the same path."
            )

    # ------------------------------------------------------------------ building and restoring
    def _ensure_built(self) -> bool:
        """Create the optimizer's variables now (as Keras's symbolic build does under a strategy) so they can be
        restored before the first step. False when the model itself has no variables yet."""
        model = self.model
        if not all(layer.built for layer in model._flatten_layers()) or not model.variables:
            return False
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            with model.distribute_strategy.scope():
                optimizer.build(model.trainable_variables)
        return True

    def _state_variables(self) -> Dict[str, tf.Variable]:
        model = self.model
        state: Dict[str, tf.Variable] = {}
        try:
            from keras_scale import step as ks_step

            state.update(dict(ks_step.state_variables(model) or {}))
        except (ImportError, AttributeError):
            pass
        for name in _TRANSIENT_STEP_STATE:
            state.pop(name, None)
        try:
            from keras_scale.schedules import lr_multiplier

            mult = lr_multiplier(model.optimizer) if model.optimizer is not None else None
        except ImportError:
            mult = None
        if mult is not None:
            state["lr_multiplier"] = mult
        return state

    def _build_checkpoint(self, with_manager: bool = True) -> None:
        model = self.model
        if self._manager is not None:
            self._wait()
        # Position and signature are host-side bookkeeping: plain variables outside any strategy scope.
        with tf.init_scope():
            self._vars = {name: tf.Variable(0, dtype=tf.int64, trainable=False, name=f"ks_{name}")
                          for name in _POSITION}
            self._signature = tf.Variable("", dtype=tf.string, trainable=False, name="ks_signature")
            self._epoch_logs_var = tf.Variable("", dtype=tf.string, trainable=False, name="ks_epoch_logs")
            # what this run's script set (not what training made of it): tells a deliberate change at the next resume
            self._run_config_var = tf.Variable(json.dumps({"learning_rate": self._lr_at_start}), dtype=tf.string,
                                               trainable=False, name="ks_run_config")
        # Variables by position (model.variables, optimizer.variables: a deterministic order for a given model
        # and optimizer); the signature saved alongside makes restoring into a different model an error.
        items: Dict[str, Any] = {
            "model_variables": [_tf_variable(v) for v in model.variables],
            "optimizer_variables": [_tf_variable(v) for v in _optimizer_variables(model)],
            "keras_scale_position": self._vars,
            "keras_scale_signature": self._signature,
            "keras_scale_epoch_logs": self._epoch_logs_var,
            "keras_scale_run_config": self._run_config_var,
        }
        metrics = _metric_variables(model)
        self._num_metric_vars = len(metrics)
        if metrics:  # the interrupted epoch's metric state; restored separately, after Keras resets metrics
            items["metrics_variables"] = [_tf_variable(v) for v in metrics]
        state = self._state_variables()
        if state:
            items["keras_scale_state"] = {k: _tf_variable(v) for k, v in state.items()}
        epoch_skipped = self._epoch_skipped_variable()
        if epoch_skipped is not None:  # the interrupted epoch's NaN-skipped count (its logs' nan_skipped)
            items["keras_scale_epoch_skipped"] = epoch_skipped
        self._checkpoint = tf.train.Checkpoint(**items)
        # Same paths, model and optimizer only: for a mid-training rollback that keeps keras_scale's counters.
        weights = {"model_variables": items["model_variables"], "optimizer_variables": items["optimizer_variables"]}
        self._weights_only = tf.train.Checkpoint(**weights)
        # Synchronous saves are written by _checkpoint_io (raw bytes + JSON index); these are the same variables
        # under the same keys, for its writer and for restoring either format.
        self._flat, self._flat_weights = _io.flatten(items), _io.flatten(weights)
        if not with_manager:
            return
        if self._chief:
            self._sanitize_state_file()

        if self.async_save:  # TensorFlow's async checkpoint; spares kept by earlier synchronous runs go
            _io.remove_spares(self._write_dir)

        def manager():
            if self.async_save:
                cls, target = tf.train.CheckpointManager, self._checkpoint
            else:  # same numbering, state file and rotation; the bytes written by _checkpoint_io
                cls, target = _io.RecyclingCheckpointManager, _io.RawCheckpoint(self._checkpoint, self._flat)
            return cls(
                target, self._write_dir, max_to_keep=self.max_to_keep if self._chief else 1,
                keep_checkpoint_every_n_hours=self.keep_every_n_hours if self._chief else None,
                checkpoint_name=_NAME,
            )

        try:
            self._manager = manager()
        except ValueError as e:  # an empty/invalid state file; the checkpoints themselves are found by scanning
            state_file = os.path.join(self._write_dir, "checkpoint")
            warnings.warn(f"ChiefCheckpoint: {e}; moving the invalid {state_file!r} aside to "
                          f"{state_file + '.invalid'!r}.", RuntimeWarning, stacklevel=2)
            tf.io.gfile.rename(state_file, state_file + ".invalid", overwrite=True)
            self._manager = manager()
        self._options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=self.async_save)

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

    def _check_signature(self, prefix: str, reader: Any) -> None:
        if not reader.has_tensor(_SIGNATURE_KEY):
            return
        raw = reader.get_tensor(_SIGNATURE_KEY)
        saved = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        mine = _signature(self.model)
        fix = (f"Fix: give ChiefCheckpoint a new directory for this model, or remove the old checkpoints "
               f"(rm -r {self.directory!r}) if you meant to start over.")
        for part, what in (("model", "model weights"), ("optimizer", "optimizer variables")):
            theirs, ours = saved.get(part, []), mine[part]
            if len(theirs) != len(ours):
                def without_lr(entries):  # a float learning rate is one scalar variable ".../learning_rate"
                    return [list(shape) for path, shape in entries
                            if not (str(path).endswith("learning_rate") and not list(shape))]

                if part == "optimizer" and without_lr(theirs) == without_lr(ours):
                    kind = "a float" if len(theirs) > len(ours) else "a schedule"
                    raise CheckpointMismatchError(
                        f"checkpoint {prefix!r} was written with {kind} learning rate and this optimizer has "
                        f"{'a schedule' if kind == 'a float' else 'a float'}: a float learning rate is an optimizer "
                        f"variable, a schedule is not, so the two cannot be resumed into each other. Fix: keep the "
                        f"first run's kind (a float can be changed between runs: the new value is used, with a "
                        f"warning), or start over in a new directory."
                    )
                raise CheckpointMismatchError(
                    f"checkpoint {prefix!r} was written for a different {part}: it holds {len(theirs)} {what}, "
                    f"this {part} has {len(ours)}. {fix}"
                )
            for (s_path, s_shape), (m_path, m_shape) in zip(theirs, ours):
                if list(s_shape) != list(m_shape):
                    raise CheckpointMismatchError(
                        f"checkpoint {prefix!r} was written for a different {part}: {s_path!r} has shape "
                        f"{tuple(s_shape)} there but {m_path!r} has shape {tuple(m_shape)} here. {fix}"
                    )

    def _restore_newest(self, everything: bool = True) -> Optional[str]:
        target = self._checkpoint if everything else self._weights_only
        flat = self._flat if everything else self._flat_weights
        candidates = list_checkpoints(self.directory)
        failures: List[str] = []
        for number, prefix in candidates:
            reader = None
            try:
                reader = _io.load_checkpoint(prefix)
                self._check_signature(prefix, reader)  # a different model is an error, not a reason to fall back
                # expect_partial: older checkpoints may hold objects this version no longer restores
                _io.read_into(prefix, flat, target)
            except CheckpointMismatchError:
                raise
            except ValueError as e:
                if "shape" in str(e) and reader is not None and not reader.has_tensor(_SIGNATURE_KEY):
                    raise CheckpointMismatchError(
                        f"checkpoint {prefix!r} does not fit this model: {e}. Fix: give ChiefCheckpoint a new "
                        f"directory, or remove the old checkpoints (rm -r {self.directory!r})."
                    ) from e
                failures.append(f"{prefix}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                continue
            except Exception as e:  # noqa: BLE001 - torn, truncated or bit-flipped files: try the previous one
                failures.append(f"{prefix}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
                continue
            self._report_fallback(failures, prefix)
            self._say(f"ChiefCheckpoint: restored {prefix}")
            return prefix
        self._raise_none_loads(failures)
        return None

    @staticmethod
    def _report_fallback(failures: List[str], prefix: str) -> None:
        if failures:
            warnings.warn(
                "ChiefCheckpoint: newer checkpoint(s) could not be loaded and were skipped: "
                + "; ".join(failures) + f". Resumed from {prefix!r} instead.", RuntimeWarning, stacklevel=3,
            )

    def _raise_none_loads(self, failures: List[str]) -> None:
        if failures:
            raise RuntimeError(
                f"ChiefCheckpoint: no checkpoint in {self.directory!r} could be loaded (the model may now hold "
                "partially restored values): " + "; ".join(failures) + ". Fix: move the damaged files away, or "
                "point ChiefCheckpoint at an empty directory to start over."
            )

    @staticmethod
    def _read_position(prefix: str) -> Dict[str, int]:
        reader = _io.load_checkpoint(prefix)
        out = {}
        for name in _POSITION:
            key = f"keras_scale_position/{name}/.ATTRIBUTES/VARIABLE_VALUE"
            out[name] = int(reader.get_tensor(key)) if reader.has_tensor(key) else 0
        return out

    def _newest_readable(self) -> Optional[str]:
        """The newest checkpoint whose every tensor reads back (CRC-checked), without needing the model."""
        failures: List[str] = []
        for _, prefix in list_checkpoints(self.directory):
            try:
                reader = _io.load_checkpoint(prefix)
                for key in reader.get_variable_to_shape_map():
                    reader.get_tensor(key)
                self._read_position(prefix)
            except Exception as e:  # noqa: BLE001 - torn, truncated or bit-flipped files
                failures.append(f"{prefix}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
                continue
            self._report_fallback(failures, prefix)
            return prefix
        self._raise_none_loads(failures)
        return None

    def _build_from_data(self, iterator: Any, why: str) -> None:
        spec = getattr(iterator, "element_spec", None)
        try:
            self.model._symbolic_build(data_batch=spec)
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(
                f"ChiefCheckpoint could not build the model from the data ({e}) {why}. Fix: build the model before "
                "fit (keras.Input(...) as its first layer, or model.build(input_shape))."
            ) from e

    def _restore_deferred(self, iterator: Any) -> None:
        prefix, self._deferred_restore = self._deferred_restore, None
        self._build_from_data(iterator, f"to restore {prefix!r} before the first step")
        self._ensure_built()
        self._build_checkpoint()
        reader = _io.load_checkpoint(prefix)
        self._check_signature(prefix, reader)
        _io.read_into(prefix, self._flat, self._checkpoint)
        self._restored_from = prefix
        self._say(f"ChiefCheckpoint: restored {prefix}")
        self._reconcile_learning_rate(prefix)

    def _reconcile_learning_rate(self, prefix: str) -> None:
        """A learning rate changed in the script between runs is used, with a warning naming both values; one changed
        during training (ReduceLROnPlateau, NanGuard's rollback) is resumed as saved."""
        self._run_config_var.assign(json.dumps({"learning_rate": self._lr_at_start}))  # the read overwrote it
        var, new = _lr_variable(self.model), self._lr_at_start
        if var is None or new is None:
            return
        restored = float(var.numpy())
        try:
            raw = _io.load_checkpoint(prefix).get_tensor(_RUN_CONFIG_KEY)
            started = json.loads(raw.decode() if isinstance(raw, bytes) else raw).get("learning_rate")
        except Exception:  # noqa: BLE001 - written by an older version: the run's starting value is unknown
            started = None
        if started is None:
            if restored != new:
                warnings.warn(
                    f"ChiefCheckpoint: the optimizer's learning_rate is {new:g} in this run but {restored:g} in "
                    f"{prefix!r}, which does not record the value its run started with; the checkpoint's {restored:g} "
                    "is restored (as keras.callbacks.BackupAndRestore does; a callback such as ReduceLROnPlateau may "
                    "have set it). To train with a new value, assign it after the restore, e.g. "
                    f"model.optimizer.learning_rate.assign({new:g}) in the on_train_begin of a callback listed after "
                    "ChiefCheckpoint.", RuntimeWarning, stacklevel=3)
            return
        if float(started) == new:
            return  # unchanged in the script: the saved value (possibly lowered during training) continues
        var.assign(new)
        self._lr_override = new
        warnings.warn(
            f"ChiefCheckpoint: learning_rate changed between runs: this run starts with {new:g}; the run in "
            f"{prefix!r} was started with {float(started):g} and was at {restored:g} when saved. Using this run's "
            f"{new:g} (everything else resumes exactly). To continue with the checkpoint's value, pass the "
            f"learning rate as before ({float(started):g}).", RuntimeWarning, stacklevel=3)

    def _epoch_skipped_variable(self) -> Optional[tf.Variable]:
        from keras_scale import step as ks_step

        step = ks_step.get_step(self.model, create=False)
        return None if step is None else step.epoch_skipped

    def _restore_epoch_skipped(self, prefix: str, mid_epoch: bool) -> None:
        """The resumed epoch's NaN-skipped count continues from the saved one (a fresh epoch starts at 0)."""
        var = self._epoch_skipped_variable()
        if var is None:
            return
        reader = _io.load_checkpoint(prefix)
        value = reader.get_tensor(_EPOCH_SKIPPED_KEY) if mid_epoch and reader.has_tensor(_EPOCH_SKIPPED_KEY) else 0
        var.assign(tf.cast(value, var.dtype))

    def _restore_metrics(self, prefix: str) -> bool:
        """Continue the interrupted epoch's metrics (loss included) from their saved state."""
        reader = _io.load_checkpoint(prefix)
        variables = _metric_variables(self.model)
        keys = [_METRIC_KEY.format(i) for i in range(len(variables))]
        if not variables or not all(reader.has_tensor(k) for k in keys) or reader.has_tensor(
                _METRIC_KEY.format(len(variables))):
            return False
        values = [reader.get_tensor(k) for k in keys]
        if any(tuple(v.shape) != tuple(int(d) for d in var.shape) for v, var in zip(values, variables)):
            return False
        for var, value in zip(variables, values):
            var.assign(value)
        return True

    def _resume(self, position: Dict[str, int], prefix: str) -> None:
        epoch, step_in_epoch = position["epoch"], position["step_in_epoch"]
        self._global_step = self._last_saved_step = position["global_step"]
        self._last_saved_prefix = prefix
        self._epoch = epoch
        self._resume_position = position
        self._saved_batch_size = position["batch_size"]
        self._batch_size = 0  # measured again in this run (it may differ: the position is kept in samples)
        epochs = (self.params or {}).get("epochs")
        try:
            raw = _io.load_checkpoint(prefix).get_tensor(_EPOCH_LOGS_KEY)
            self._saved_epoch_logs = json.loads(raw.decode() if isinstance(raw, bytes) else raw) if raw else None
        except Exception:  # noqa: BLE001 - older checkpoints have no epoch logs
            self._saved_epoch_logs = None
        if epoch:
            self.model._initial_epoch = _ResumeEpoch(epoch, self)
            self._resume_pending = True
        if epochs is not None and epoch >= int(epochs) and step_in_epoch == 0:
            self._already_complete = epoch
            self._say(f"ChiefCheckpoint: the run in {self.directory!r} is already complete ({epoch} epochs, global "
                      f"batch {self._global_step}): nothing to train. Pass a larger epochs= to train further, or a "
                      "new directory to start over.")
            return
        spe = int(getattr(self.model, "steps_per_execution", 1) or 1)
        self._skip_calls = step_in_epoch // spe
        if step_in_epoch % spe:
            warnings.warn(
                f"ChiefCheckpoint: the checkpoint is at batch {step_in_epoch} of epoch {epoch + 1}, not a multiple of "
                f"steps_per_execution={spe}; resuming at batch {self._skip_calls * spe} (a few batches train twice).",
                RuntimeWarning, stacklevel=2,
            )
        self._skip_prefix = max(position["stream_pos"] - self._skip_calls * spe, 0)
        steps = (self.params or {}).get("steps")
        if epochs is not None and steps and epoch + 1 >= int(epochs) and step_in_epoch >= int(steps):
            # Written at the last epoch's last batch, before its end callbacks (older versions saved so with an int
            # save_freq): every batch is trained; only the epoch's end (validation, callbacks) runs again.
            self._say(f"ChiefCheckpoint: the run in {self.directory!r} is already complete ({epoch + 1} epochs, "
                      f"global batch {self._global_step}): nothing to train. Its newest checkpoint {prefix!r} was "
                      f"written at the last batch of epoch {epoch + 1}, before that epoch's end, so the epoch's end "
                      "(validation, epoch-end callbacks) runs again with its saved metrics. Pass a larger epochs= to "
                      "train further, or a new directory to start over.", routine=False)
            return
        maybe_done = (epochs is not None and not steps and step_in_epoch and epoch + 1 >= int(epochs))
        events.record("resume", self._global_step, path=prefix, directory=self.directory, epoch=epoch, step_in_epoch=self._skip_calls * spe)
        self._say(f"ChiefCheckpoint: resuming {_describe(epoch, self._skip_calls * spe)} from {prefix!r} "
                  f"(global batch {self._global_step})" + (
                      "; this is the last epoch and the data's length is unknown: if that was its last batch, the run "
                      "is already complete and only the epoch's end (validation, epoch-end callbacks) runs again"
                      if maybe_done else ""))

    def _fill_history(self) -> None:
        """A rerun of a finished run trains nothing: its History holds the last epoch's logs from the checkpoint."""
        history = getattr(self.model, "history", None)
        saved = self._saved_epoch_logs
        if history is None or not saved or getattr(history, "epoch", None):
            return
        history.epoch = [int(saved["epoch"])]
        history.history = {k: [v] for k, v in saved["logs"].items()}

    # ------------------------------------------------------------------ the train-function wrapper
    def _install_wrapper(self) -> None:
        model = self.model
        inner = model.train_function
        if inner is None:
            model.make_train_function()
            inner = model.train_function
        self._inner = inner
        me, model_ref = weakref.ref(self), weakref.ref(model)

        def train_function(iterator):
            cb = me()
            if cb is None or not cb._in_this_fit():
                # Left behind by a fit that raised: step aside for good.
                m = model_ref()
                if m is not None and m.train_function is train_function:
                    m.train_function = inner
                return inner(iterator)
            return cb._train_call(inner, iterator)

        train_function._ks_checkpoint_inner = inner
        self._wrapper = train_function
        model.train_function = train_function

    def _train_call(self, inner: Any, iterator: Any) -> Any:
        if self._in_call:  # another wrapper around ours was wrapped by us again: count and skip only once
            return inner(iterator)
        self._in_call = True
        try:
            return self._train_call_once(inner, iterator)
        finally:
            self._in_call = False

    def _on_first_call(self, iterator: Any) -> None:
        model = self.model
        if self._deferred_restore is not None:
            self._restore_deferred(iterator)
        # Without a strategy Keras builds metrics only when the first step is traced: build them now, so that
        # skipped batches can report them and every checkpoint holds them.
        compile_metrics = getattr(model, "_compile_metrics", None)
        if getattr(model, "_distribute_strategy", None) is None and (
                (compile_metrics is not None and not compile_metrics.built) or not self._ensure_built()):
            self._build_from_data(iterator, "before the first step")
            self._ensure_built()
        if self._checkpoint is None or self._num_metric_vars != len(_metric_variables(model)):
            self._build_checkpoint()
        position = self._resume_position
        if position is not None and (self._skip_calls or self._skip_prefix):
            if position["step_in_epoch"] and not self._restore_metrics(self._restored_from):
                log.info("ChiefCheckpoint: no metric state to restore; the resumed epoch's metrics cover the "
                         "batches trained after the resume")
            self._plan_for_batch_size(iterator)
        if position is not None and self._restored_from is not None:
            self._restore_epoch_skipped(self._restored_from, bool(
                position["step_in_epoch"] and (self._skip_calls or self._skip_prefix)))
        if position is not None and (position["epoch"] or self._skip_prefix):
            if any(_reshuffling_seeded_shuffle(ds) for ds in _datasets_of(iterator)):
                warnings.warn(
                    "ChiefCheckpoint: the data pipeline has shuffle(seed=...) with reshuffle_each_iteration=True: "
                    f"its order in epoch {self._epoch + 1} of this process differs from the uninterrupted run's, so "
                    "the resume is not exact. Fix: shuffle(..., reshuffle_each_iteration=False) over a dataset "
                    "re-shuffled per epoch with a seed derived from the epoch, or keras_scale.fit's shuffling.",
                    RuntimeWarning, stacklevel=2)
        if self._start_state_wanted and self._restored_from is None:
            self._start_state = [v.numpy() for v in self._start_variables()]
            self._start_step = self._global_step
        optimizer = model.optimizer
        if optimizer is not None:
            with tf.init_scope():
                self._iter_backup = tf.Variable(0, dtype=optimizer.iterations.dtype, trainable=False,
                                                name="ks_iterations_backup")

    def _start_variables(self) -> List[Any]:
        return list(self.model.variables) + _optimizer_variables(self.model)

    def _plan_for_batch_size(self, iterator: Any) -> None:
        """Position is kept in samples: convert the batches to skip to the batch size of this run."""
        old = self._saved_batch_size
        if not old:
            return  # unknown (older checkpoint): assume the batch size is unchanged
        new = _batch_samples(iterator.get_next(), self.model.distribute_strategy)
        self._preread = 1
        if not new or new == old:
            self._batch_size = new
            return
        spe = int(getattr(self.model, "steps_per_execution", 1) or 1)
        prefix_samples = self._skip_prefix * old
        epoch_samples = self._skip_calls * spe * old
        steps = (self.params or {}).get("steps")
        if not prefix_samples and steps and epoch_samples > (int(steps) - 1) * new:
            # saved at the end of its epoch (its last batch may have been short): this whole epoch is done
            self._skip_calls = -(-int(steps) // spe)
            self._batch_size = new
            return
        if prefix_samples % new or epoch_samples % (new * spe):
            raise ValueError(
                f"ChiefCheckpoint: {self._restored_from!r} was written with {old} samples per batch, "
                f"{epoch_samples} samples into epoch {self._epoch + 1}"
                + (f" ({prefix_samples} more read by earlier epochs from the same iterator)" if prefix_samples else "")
                + f"; this run has {new} samples per batch, which does not divide that position, so resuming would "
                f"skip or repeat samples. Fix: resume with a batch size that divides {epoch_samples} (e.g. {old}), "
                "or start over in a new directory.")
        self._skip_prefix = prefix_samples // new
        self._skip_calls = epoch_samples // (new * spe)
        self._batch_size = new
        self._say(f"ChiefCheckpoint: batch size {old} -> {new}: skipping {self._skip_prefix + self._skip_calls * spe}"
                  " batches", routine=False)

    def _fresh_iterator(self, exhausted: Any) -> Any:
        if exhausted is not self._prefix_skipped_on and exhausted is not self._own_stream:
            return None
        self._prefix_skipped_on = None
        datasets = [getattr(exhausted, "_dataset", None)] if not hasattr(exhausted, "_iterators") else []
        if not datasets or not isinstance(datasets[0], tf.data.Dataset):
            warnings.warn(
                "ChiefCheckpoint: the resumed run's data iterator ran out where the uninterrupted run would have "
                "started a new one (steps_per_epoch over a dataset without repeat()); this epoch ends early. Fix: "
                "add .repeat() to the dataset when you pass steps_per_epoch.", RuntimeWarning, stacklevel=3)
            return None
        return iter(datasets[0])

    def _skip(self, iterator: Any, num_batches: int) -> None:
        take = min(self._preread, num_batches)
        self._preread -= take
        for _ in range(int(num_batches - take)):
            iterator.get_next()

    def _train_call_once(self, inner: Any, iterator: Any) -> Any:
        spe = int(getattr(self.model, "steps_per_execution", 1) or 1)
        if self._first_call:
            self._first_call = False
            self._on_first_call(iterator)
        use = self._own_stream if self._own_stream is not None else iterator
        if use is not self._iterator:  # a fresh data iterator (a new epoch over a finite dataset)
            self._iterator = use
            self._stream_pos = 0
            self._may_run_out = _cardinality(use) == tf.data.UNKNOWN_CARDINALITY
        if self._pending_epoch_save:
            self._pending_epoch_save = False
            self._save(self._epoch, 0, self._stream_pos)
        if self._skip_prefix:
            self._skip(use, self._skip_prefix)
            self._stream_pos += self._skip_prefix
            self._skip_prefix = 0
            self._prefix_skipped_on = use
        if self._skip_calls > 0:
            self._skip_calls -= 1
            self._skip(use, spe)
            self._stream_pos += spe
            self._last_call_skipped = True
            return self.model.get_metrics_result()
        self._last_call_skipped = False
        measure = not self._batch_size and self._measure_tries < 5
        before = _loss_count(self.model) if measure else None
        # Only where Keras may call past the end: data of unknown length, or an iterator we skipped into.
        backup = self._iter_backup if (self._may_run_out or use is self._prefix_skipped_on
                                       or use is self._own_stream) else None
        if backup is not None:
            backup.assign(self.model.optimizer.iterations)
        try:
            out = inner(use)
        except tf.errors.OutOfRangeError:
            # Keras calls the train function once more on an exhausted iterator of unknown length; that call
            # still bumps optimizer.iterations (a phantom update that schedules would count): undo it.
            if backup is not None:
                self.model.optimizer.iterations.assign(backup)
            else:
                log.warning("ChiefCheckpoint: a data iterator of known length ran out; optimizer.iterations may "
                            "count one phantom update")
            fresh = self._fresh_iterator(use)
            if fresh is None:
                raise
            # steps_per_epoch over finite data: Keras renews its iterator by its own count of batches, which in a
            # resumed process misses the batches skipped from earlier epochs. From here on read the data the way
            # the uninterrupted run did: a fresh pass when one runs out, at an epoch start or ending the epoch.
            self._own_stream = fresh
            self._iterator, self._stream_pos, use = fresh, 0, fresh
            if self._step_in_epoch:
                raise
            out = inner(use)
        self._stream_pos += spe
        self._global_step += spe
        if measure:
            self._measure_tries += 1
            after = _loss_count(self.model)
            if before is not None and after is not None and after > before:
                per_batch = (after - before) / spe
                if per_batch == int(per_batch):
                    self._batch_size = int(per_batch)
        return out

    # ------------------------------------------------------------------ saving
    def _save(self, epoch: int, step_in_epoch: int, stream_pos: int) -> Optional[str]:
        started = time.perf_counter()
        try:
            path = self._save_untimed(epoch, step_in_epoch, stream_pos)
        finally:
            self.blocked_s += time.perf_counter() - started
        if path:
            events.record("checkpoint", self._global_step, path=path, directory=self.directory, epoch=epoch, step_in_epoch=step_in_epoch, blocked_s=time.perf_counter() - started, async_save=self.async_save, preemption=self._preempting)
        return path

    def _state_poisoned(self) -> bool:
        """NanGuard(check_gradients=False) let a non-finite gradient through: the state must not be saved."""
        if not self._check_state:
            return False
        from keras_scale.step import get_step

        step = get_step(self.model, create=False)
        if step is None or step.state_finite():
            return False
        if not self._warned_poisoned:
            self._warned_poisoned = True
            self._say("ChiefCheckpoint: not saving: the weights or optimizer state hold non-finite values (a "
                      "finite-loss step applied non-finite gradients under NanGuard(check_gradients=False)); the "
                      "newest checkpoint stays the last finite state.", routine=False)
        return True

    def _save_untimed(self, epoch: int, step_in_epoch: int, stream_pos: int) -> Optional[str]:
        path = None
        if self._global_step != self._last_saved_step:
            if self._state_poisoned():
                self._pending_best = None  # (its score is not of a state on disk)
                return None
            if self._checkpoint is None:  # model built by its first step
                self._ensure_built()
                self._build_checkpoint()
            self._vars["epoch"].assign(epoch)
            self._vars["step_in_epoch"].assign(step_in_epoch)
            self._vars["stream_pos"].assign(stream_pos)
            self._vars["global_step"].assign(self._global_step)
            self._vars["batch_size"].assign(self._batch_size)
            self._signature.assign(json.dumps(_signature(self.model)))
            self._epoch_logs_var.assign(self._epoch_logs_json())
            path = self._manager.save(checkpoint_number=self._global_step, options=self._options)
            self._last_saved_step = self._global_step
            self._last_saved_prefix = path
            self._start_state = None  # a real checkpoint now exists for restore_latest
            self._say(f"ChiefCheckpoint: saved {path} ({_describe(epoch, step_in_epoch)})")
        if self._pending_best is not None:
            self._keep_best(*self._pending_best)
            self._pending_best = None
        return path

    def _epoch_logs_json(self) -> str:
        if self._last_epoch_logs is None:
            return json.dumps(self._saved_epoch_logs) if self._saved_epoch_logs else ""
        epoch, logs = self._last_epoch_logs
        clean = {}
        for k, v in dict(logs or {}).items():
            try:
                clean[str(k)] = float(v)
            except (TypeError, ValueError):
                continue
        return json.dumps({"epoch": epoch, "logs": clean})

    # ------------------------------------------------------------------ best-k
    def _consider_best(self, epoch: int, logs: Any) -> None:
        if not self.keep_best_k:
            return
        value = (logs or {}).get(self.monitor)
        if value is None:
            if not self._warned_monitor:
                self._warned_monitor = True
                warnings.warn(f"ChiefCheckpoint: keep_best_k needs {self.monitor!r} in the epoch logs, which hold "
                              f"{sorted(logs or {})}; no best checkpoint kept for this epoch.", RuntimeWarning,
                              stacklevel=3)
            return
        value = float(value)
        if math.isnan(value):
            return
        best = self._best
        if len(best) >= self.keep_best_k and not self._better(value, best[-1]["value"]):
            return
        self._pending_best = (value, epoch)
        self._pending_epoch_save = True  # the epoch-end state is saved (at the next step or at train end)

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    def _best_dir(self) -> str:
        return os.path.join(self.directory, _BEST_DIR)

    def _read_best(self) -> List[Dict[str, Any]]:
        try:
            with tf.io.gfile.GFile(os.path.join(self._best_dir(), "best.json")) as f:
                entries = json.load(f)
        except Exception:  # noqa: BLE001 - none yet
            return []
        return sorted(entries, key=lambda e: e["value"], reverse=self.mode == "max")

    def _keep_best(self, value: float, epoch: int) -> None:
        """Copy (hard-link where possible) the checkpoint just saved for this epoch's end into ``best/``."""
        if self._last_saved_prefix is None:
            return
        number = self._last_saved_step
        entries = [e for e in self._best if e["number"] != number]
        entries.append({"number": number, "value": value, "epoch": epoch, "monitor": self.monitor})
        entries.sort(key=lambda e: e["value"], reverse=self.mode == "max")
        self._best, drop = entries[: self.keep_best_k], entries[self.keep_best_k:]
        if not self._chief:  # every worker keeps the same list; only the chief writes files
            return
        self._wait()  # the files must be complete before they are linked
        best_dir = self._best_dir()
        if os.path.islink(best_dir):  # never follow a link out of the directory
            warnings.warn(f"ChiefCheckpoint: {best_dir!r} is a symbolic link; keep_best_k does not write through it. "
                          "Remove the link.", RuntimeWarning, stacklevel=2)
            return
        tf.io.gfile.makedirs(best_dir)
        src_name = os.path.basename(self._last_saved_prefix)
        for name in tf.io.gfile.listdir(self.directory):
            if name == src_name + ".index" or name.startswith(src_name + ".data-"):
                src, dst = os.path.join(self.directory, name), os.path.join(best_dir, name)
                try:
                    if not _is_local(src):
                        raise OSError
                    if os.path.exists(dst):
                        os.remove(dst)
                    os.link(src, dst)
                except OSError:
                    tf.io.gfile.copy(src, dst, overwrite=True)
        for e in drop:
            for name in tf.io.gfile.listdir(best_dir):
                if name.startswith(f"{_NAME}-{e['number']}."):
                    tf.io.gfile.remove(os.path.join(best_dir, name))
        tmp = os.path.join(best_dir, "best.json.tmp")
        with tf.io.gfile.GFile(tmp, "w") as f:
            json.dump(self._best, f)
        tf.io.gfile.rename(tmp, os.path.join(best_dir, "best.json"), overwrite=True)
        self._say(f"ChiefCheckpoint: {self.monitor}={value:.6g} at epoch {epoch + 1}: kept as "
                  f"{os.path.join(best_dir, src_name)!r}")

    # ------------------------------------------------------------------ output and waiting
    def _say(self, message: str, routine: bool = True) -> None:
        """Routine news (saves, restores, resumes) like Keras's callbacks: logged at INFO, printed with
        ``io_utils.print_msg`` on the chief only when ``verbose``. Incidents (preemption, a changed batch size)
        are logged as warnings on the chief, which reach stderr even where no logging is configured."""
        if not routine:
            if self._chief:
                log.warning(message)
            return
        log.info(message)
        if self._chief and self.verbose:
            from keras.src.utils.io_utils import print_msg

            print_msg(message)

    def _wait(self) -> None:
        if self._manager is not None:
            self._manager.sync()

    def _timed_wait(self) -> None:
        started = time.perf_counter()
        try:
            self._wait()
        finally:
            self.blocked_s += time.perf_counter() - started
