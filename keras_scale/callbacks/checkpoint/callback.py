"""ChiefCheckpoint: all-or-nothing, chief-only, optionally asynchronous checkpoints with exact (mid-epoch) resume.

The callback holds the hooks and the save decisions; its parts live beside it (directory, lock, preemption,
state, restore, resume, best, format, storage).

Example:
    >>> import keras_scale as ks
    >>> model.fit(ds, epochs=90, callbacks=[ks.ChiefCheckpoint("/shared/run1/ckpt", save_freq=1000)])  # doctest: +SKIP
    >>> # killed or preempted? run the same script again: it continues at the same epoch and batch.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import keras
import tensorflow as tf

from keras_scale import events, lifecycle
from keras_scale import state as training_state
from keras_scale.schedules import learning_rate_variable
from keras_scale._validate import check_int
from keras_scale.distribute import chief_print, is_chief
from keras_scale.callbacks.checkpoint.names import _BEST_DIR, _NAME, _REF_ATTR, log
from keras_scale.callbacks.checkpoint import format as _io
from keras_scale.storage import Storage
from keras_scale.callbacks.checkpoint.best import BestMixin
from keras_scale.callbacks.checkpoint.boundaries import (ON_COMPLETED, BoundariesMixin, other_learning_rates,
                                                         schedule_descriptors)
from keras_scale.callbacks.checkpoint.directory import DirectoryMixin, list_checkpoints
from keras_scale.callbacks.checkpoint.errors import CheckpointSaveError, save_error
from keras_scale.callbacks.checkpoint.hooks import _hook_method, _unhook
from keras_scale.callbacks.checkpoint.lock import LockMixin
from keras_scale.callbacks.checkpoint.preemption import PREEMPTION_EXIT_CODE, PreemptionMixin
from keras_scale.callbacks.checkpoint.restore import RestoreMixin
from keras_scale.callbacks.checkpoint.resume import ResumeMixin, _describe, _ResumeEpoch
from keras_scale.callbacks.checkpoint.warmup import WarmupMixin
from keras_scale.callbacks.checkpoint.state import (StateMixin, _lr_variable, _metric_variables, _other_lr_values,
                                                   _signature)


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


class ChiefCheckpoint(DirectoryMixin, LockMixin, PreemptionMixin, StateMixin, RestoreMixin, ResumeMixin, BestMixin,
                      WarmupMixin, BoundariesMixin, keras.callbacks.Callback):
    """Crash- and preemption-safe checkpoints of everything training needs, written by the chief only, resumed
    exactly.

    One checkpoint per save holds the model, the optimizer (moments, iterations, loss scale),
    keras_scale's persistent step state (NanGuard's skipped-step count, the LR multiplier), the epoch's metric
    state and the position in the data (epoch, batch, batches read from the current iterator, samples per
    batch). A checkpoint counts only once its files are complete and ``tf.train.CheckpointManager`` has recorded
    it in ``directory/checkpoint``, so a kill at any moment leaves the previous one usable; a newest checkpoint that
    fails to load (CRC, dtype or shape check) is reported and the one before it is used. The files are TensorFlow's
    tensor bundle (new files for every save, never rewritten in place; nothing fsynced), read by every TensorFlow
    tool and by :func:`keras_scale.load_checkpoint` (docs/checkpoint.md, "File format and durability").

    On ``fit`` start (``restore=True``) the newest checkpoint that loads is restored and training continues at
    the same epoch *and* batch: the data iterator's saved state is restored (where the pipeline cannot be saved --
    a ``py_function``, a generator, a ``tf.distribute`` iterator -- the already-applied batches are read and dropped,
    said once at the first save with the cost), Keras's loop goes on at the saved batch, and the epoch's metrics
    continue from their saved state. A run killed and restarted any number of
    times ends with the same weights as an uninterrupted one, given the same data order every run
    (``shuffle=False``, or a ``tf.data`` pipeline whose order does not depend on how often it was iterated) and
    deterministic ops.

    On SIGTERM or SIGUSR1 (preemption) the state is saved at the next step boundary (all workers agree on the
    step), training ends, and the process exits with :data:`PREEMPTION_EXIT_CODE` (42); rerunning resumes exactly.
    Repeats of the signal never abort the save (only SIGKILL, or SIGINT/Ctrl-C, ends the process at once).

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
        restore: ``True``: resume from the newest checkpoint in ``directory`` at ``fit`` start (every optimizer's
            class and variables must match: another optimizer is a :class:`CheckpointMismatchError` naming both
            classes). ``"weights_only"``: load only the newest checkpoint's model weights and train with fresh
            optimizer state from epoch 0 (e.g. after changing the optimizer); this run's checkpoints are numbered
            after it and record it, so a rerun after an interruption (same optimizer classes and learning rate)
            resumes this run in full. ``False``: start a new run from the model as it is; in a directory holding
            checkpoints (a finished run's too) its checkpoints are numbered after the newest and its saves rotate
            the older ones out (a ``RuntimeWarning`` at ``fit`` start names them; keep them: another directory).
        keep_every_n_hours: additionally keep one checkpoint per this many hours forever (``None``: off).
        keep_best_k: additionally keep the ``k`` best epoch-end checkpoints by ``monitor`` in ``directory/best``
            (0: off).
        monitor: the epoch log to rank by (e.g. ``"val_loss"``), used with ``keep_best_k``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (``max`` for accuracy/AUC-like names, else ``min``).
        preemption_exit_code: exit status after a SIGTERM/SIGUSR1 save (``None``: ``fit`` returns normally and
            :attr:`preempted` says why it stopped).
        signal_check_every_n_steps: multi-worker without TensorFlow's coordination service only: how often the
            workers agree on whether a signal arrived (one tiny all-reduce each time). With the coordination service
            (every ``MultiWorkerMirroredStrategy`` cluster from ``TF_CONFIG``, Slurm or ``keras-scale launch``) the
            workers agree through it with no per-step cost, and this is unused.
        verbose: 0 quiet (saves, restores and resumes go to the ``keras_scale.checkpoint`` logger at INFO); 1 one
            line on stdout per save, restore and resume (chief only). Preemption and incidents always warn (stderr);
            a boundary that changes what ``fit`` does (a rerun of a completed run, a weights_only run resumed in
            full) is printed at every verbosity.
        on_completed: what a ``fit`` does when the directory's run is completed (all its epochs trained, or stopped
            by ``EarlyStopping``; recorded in its last checkpoint): ``"restore"`` puts back the state that run's
            ``fit`` returned (EarlyStopping's restored best weights included) and trains 0 epochs (a fit with a
            larger ``epochs=`` than a run that trained all its epochs continues it; a different learning rate is a
            :class:`RunCompletedError`); ``"restart"`` starts a new run in the directory from the model as it is;
            ``"error"`` raises :class:`RunCompletedError`. A second ``fit`` with the same callback and model in the
            same process starts a new run, as a second ``fit`` does in plain Keras (docs/checkpoint.md, "Run
            boundaries").

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
        on_completed: str = "restore",
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
        # resolved now: a chdir between construction and fit must not move the checkpoints
        self.storage = Storage(directory)
        self.directory = self.storage.path
        self.save_freq = save_freq
        self.max_to_keep = max_to_keep
        self.async_save = bool(async_save)
        if restore not in (True, False, "weights_only"):
            raise ValueError(f"ChiefCheckpoint: restore must be True (resume everything), False (start fresh) or "
                             f"'weights_only' (the newest checkpoint's model weights, fresh optimizer and position), "
                             f"got {restore!r}.")
        self.restore = restore if restore == "weights_only" else bool(restore)
        self.keep_every_n_hours = keep_every_n_hours
        self.keep_best_k = keep_best_k
        self.monitor = monitor
        if mode == "auto":
            mode = "max" if any(k in monitor.lower() for k in ("acc", "auc", "precision", "recall", "f1")) else "min"
        self.mode = mode
        self.preemption_exit_code = preemption_exit_code
        self.signal_check_every_n_steps = signal_check_every_n_steps
        if isinstance(verbose, bool) or not isinstance(verbose, int) or verbose < 0:
            raise ValueError(f"ChiefCheckpoint: verbose must be an integer >= 0, got {verbose!r}. Use 0 (saves go to "
                             "the keras_scale.checkpoint logger) or 1 (a line per save).")
        self.verbose = int(verbose)
        if on_completed not in ON_COMPLETED:
            raise ValueError(f"ChiefCheckpoint: on_completed must be one of {ON_COMPLETED}, got {on_completed!r}: "
                             "'restore' (a rerun of a completed run gets its final state back, 0 epochs), 'restart' "
                             "(a new run in this directory) or 'error'.")
        self.on_completed = on_completed
        self._completed_here: Any = None  # weakref to the model this callback completed (or restored completed) a run of
        self._completed_prefix: Optional[str] = None
        self._callback_list: Any = None
        self._manager: Optional[tf.train.CheckpointManager] = None
        self._checkpoint: Optional[tf.train.Checkpoint] = None
        self._write_dir: Optional[str] = None
        self._chief = True
        self._fit_history: Any = None
        self._start_state_wanted = False
        self._handlers: Dict[int, Any] = {}  # signal -> the handler installed for this fit (holds the previous one)
        self._exit_window_until = 0.0  # monotonic time until which repeated signals are ignored while exiting
        self._channel: Any = None  # multi-worker: the workers' agreement on a preemption step (preemption.py)
        self._lock_path: Optional[str] = None
        self._lock_ino: Optional[tuple] = None  # (st_dev, st_ino) of the lock this process created
        self._scratch_dir: Optional[str] = None  # a non-chief worker's private folder, made by this process
        self._lock_stop: Optional[threading.Event] = None
        self._fit_thread: Optional[int] = None
        self.blocked_s = 0.0
        self._warned_poisoned = False
        self._check_state = False
        self.preempted: Optional[int] = None
        self._reset_position()

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
        # (and every other optimizer's float learning rate: a GAN's rollback lowers both)
        other_lrs = [] if restore_keras_scale_state else _other_lr_values(self.model)
        found = self._restore_newest(everything=restore_keras_scale_state) if list_checkpoints(self.directory) else None
        if found is not None:
            step = self._read_position(found)["global_step"]
            if restore_keras_scale_state:
                self._run_config_var.assign(json.dumps(self._start_config()))
                if self._lr_override is not None and found == self._restored_from and lr is not None:
                    lr.assign(self._lr_override)  # the checkpoint resumed from predates this run's learning rate
                if found == self._restored_from:
                    optimizers = training_state.optimizers(self.model)
                    for path, value in self._other_lr_overrides.items():
                        var = learning_rate_variable(optimizers.get(path))
                        if var is not None:
                            var.assign(value)
        elif self._start_state is not None:
            for var, value in zip(self._start_variables(), self._start_state):
                var.assign(value)
            step = self._start_step
        else:
            step = -1
        if keep_lr is not None and step >= 0:
            lr.assign(keep_lr)
        if step >= 0:
            for var, value in other_lrs:
                var.assign(value)
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
        reader = _io.read_checkpoint(prefix)
        self._check_signature(prefix, reader)
        _io.read_into(prefix, self._flat_weights, self._weights_only)
        return self._read_position(prefix)["global_step"]

    def wait(self) -> None:
        """Block until a background (``async_save``) write has finished.

        Example:
            ckpt.wait()
        """
        self._timed_wait()

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        # Keras sets model.history to this fit's History right before calling set_model: that identifies the fit.
        self._fit_history = getattr(model, "history", None)
        self.params = None
        self._start_state_wanted = False
        object.__setattr__(model, _REF_ATTR, weakref.ref(self))
        # Everything this callback installs for the fit (train-function wrapper, method hooks, _initial_epoch,
        # signal handlers, lock) is undone by _active_cleanup: at on_train_end, or, when the fit died (Keras skips
        # on_train_end on an exception), at the model's next use (keras_scale.lifecycle).
        lifecycle.join(model, self, undo=self._active_cleanup)
        # State a previous fit that raised may have left behind (Keras skips on_train_end on an exception).
        inner = getattr(getattr(model, "train_function", None), "_ks_checkpoint_inner", None)
        if inner is not None:
            model.train_function = inner
        if isinstance(getattr(model, "_initial_epoch", None), _ResumeEpoch):
            model._initial_epoch = None

    def on_train_begin(self, logs=None):
        try:
            self._on_train_begin(logs)
        except BaseException:  # (RunCompletedError, a mismatch...): Keras calls no on_train_end; nothing is left held
            try:
                self._active_cleanup()  # the lock, the signal handlers, the hooks installed so far
            except Exception:  # noqa: BLE001 - the first error is the one to see; the lock goes in any case
                self._release_lock()
            raise

    def _on_train_begin(self, logs=None):
        model = self.model
        self._find_callback_list()
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
        self._other_lrs_at_start = other_learning_rates(model)  # (a GAN's d_optimizer, g_optimizer...)
        self._schedules_at_start = schedule_descriptors(model)  # the schedules as the script set them (code)
        self._fit_thread = threading.get_ident()
        self.blocked_s = 0.0
        self._warned_poisoned = False
        self.preempted = None
        error: Optional[BaseException] = None
        try:
            self._prepare_write_dir()
        except (OSError, RuntimeError) as e:  # the chief cannot use the directory, or its checkpoints are gone
            error = e
        # Multi-worker: every worker stops when the chief cannot start (instead of waiting in a collective).
        if self._sum_over_workers(strategy, 1.0 if error is not None else 0.0) > 0:
            self._remove_scratch()
            raise error if error is not None else RuntimeError(
                f"ChiefCheckpoint: the chief could not start in {self.directory!r} (see its error); this worker "
                "stops too.")
        self._install_signal_handlers()
        self._open_signal_channel()
        self._checkpoint = self._manager = None
        self._report_directory_problems()
        self._best = self._read_best() if self.keep_best_k else []
        if self._ensure_built():
            self._build_checkpoint()
        found: Optional[str] = None
        self._remove_stale_final()
        peek = self._peek_newest() if self.restore and list_checkpoints(self.directory) else None
        mode, self._completed_record = self._decide_start(peek)
        if not self.restore:
            self._start_fresh_beside_checkpoints()  # numbered after them, warned: they rotate out (directory.py)
        if mode == "new":  # a new run from the model as it is, numbered after the newest checkpoint
            self._global_step = self._last_saved_step = peek.number
            self._weights_from = None
        if mode == "new" or not self.restore:  # keep_best_k ranks the new run only: the old run's best/ set aside
            self._set_best_aside(self._global_step, "on_completed='restart'" if self.restore
                                 else "restore=False")
        elif mode == "weights_only" and peek is not None:
            found = self._newest_readable()
        if mode == "weights_only" and found is not None:
            if self._weights_ready():
                if self._checkpoint is None:
                    self._build_checkpoint()
                self._restore_model_weights(found)
                done = peek.completed(None) if peek is not None and peek.prefix == found else None
                if done is not None:
                    self._load_final_weights(found, done)
            else:
                self._deferred_restore = self._restored_from = found
                self._deferred_weights_only = True
                self._deferred_final = peek.completed(None) if peek is not None and peek.prefix == found else None
            position = self._read_position(found)
            # numbering continues after the checkpoint the weights came from, so this run's checkpoints are newer
            self._global_step = self._last_saved_step = position["global_step"]
            self._weights_from = position["global_step"]  # recorded: a rerun of this run resumes it in full
            self._last_saved_prefix = found
            found = None
        elif mode is True and peek is not None:
            if self._checkpoint is not None:
                found = self._restored_from = self._restore_newest()
                self._reconcile_learning_rate(found)
            else:
                # The model gets its variables only when its first step is traced: pick the newest checkpoint
                # that reads back completely now (the epoch must be known before the first epoch starts) and
                # restore it right before the first step, once the model is built from the data's spec.
                found = self._deferred_restore = self._restored_from = self._newest_readable()
            if self._completed_record is not None:
                if found != peek.prefix:  # the completed run's checkpoint did not load: an older one did
                    self._completed_record = None
                else:
                    self._completed_here, self._completed_prefix = weakref.ref(model), found
        position = self._read_position(found) if found is not None else None
        self._check_workers_agree(strategy, position["global_step"] if position else -1)
        if position is not None:
            self._resume(position, found)
        if self._deferred_restore is not None and self._already_complete is not None:
            self._restore_at_fit_start()  # 0 epochs: no first step to restore before
        self._install_wrapper()
        self._install_final_save_hook()
        self._install_stop_save_hook()
        self._warmup = None
        self._copy_trace_closed = False  # (async_save: the background copy thread may start again, warmup.py)
        self._warm_up_once()  # the first saves' memory, touched in the background (warmup.py)

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
        if self._warmup is None:  # a model whose variables were made by its first step
            self._warm_up_once()
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
        self._end_async_copy()  # no background copy thread runs on into the process's exit (warmup.py)
        self._agree_at_train_end()  # multi-worker: a signal after the last step boundary ends every worker with 42
        # The final state is always saved, so a finished, stopped or preempted run resumes with nothing lost.
        try:
            self._final_save()
            self._timed_wait()
            if self._already_complete is not None:
                if self._completed_record is not None and self._checkpoint is not None and self._restored_from:
                    # after Keras's finalize_variable_values (use_ema), as when the completed run's fit returned
                    self._load_final_weights(self._restored_from, self._completed_record)
                self._fill_history()
        finally:
            if lifecycle.joined(self.model, self):
                lifecycle.leave(self.model, self)  # runs _active_cleanup (and the hooks' undo)
            else:
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

    def _final_save(self) -> None:
        self._completing = self._completion()
        try:
            if (self._global_step != self._last_saved_step or self._pending_best is not None
                    or (self._completing is not None and not self._last_saved_completed)):
                if self._epoch_complete:
                    # (the data position is taken before the look ahead below reads from the iterator)
                    self._data_state_cache = self._data_state_now(self._stream_pos)
                    fresh = self._iterator is None or self._iterator_exhausted(self._iterator)
                    try:
                        self._save(self._epoch + 1, 0, 0 if fresh else self._stream_pos)
                    finally:
                        self._data_state_cache = None
                else:
                    self._save_mid_epoch()
        finally:
            self._completing = None

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

        def before(from_fit: bool) -> None:
            cb = me()
            if cb is not None and cb._in_this_fit() and cb._fit_thread == threading.get_ident():
                cb._final_save()

        self._finalize_hook = _hook_method(self.model, self, optimizer, "finalize_variable_values", before)

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

        def before(from_fit: bool) -> Optional[bool]:
            cb = me()
            if cb is None or not cb._in_this_fit():
                return False  # left by a fit that raised: take it away
            if cb._fit_thread == threading.get_ident() and from_fit:
                cb._save_at_stop()  # (only fit's own call after its batch loop; never evaluate's)
            return None

        self._stop_hook = _hook_method(model, self, model, "_get_metrics_result_or_logs", before)

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
        self._remove_scratch()
        self._release_signal_handlers()
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
        return frame is not None and lifecycle.fit_running(self._model, frame)

    def _reset_position(self) -> None:
        self._epoch = 0
        self._step_in_epoch = 0
        self._stream_pos = 0  # batches read from the data iterator now in use
        self._global_step = 0  # batches trained, over all runs
        self._last_saved_step = 0
        self._last_saved_prefix: Optional[str] = None
        self._async_pending: Optional[str] = None  # an async write started and not yet found complete
        self._weights_from: Optional[int] = None  # the checkpoint a restore="weights_only" run took its weights from
        self._completing: Optional[Dict[str, Any]] = None  # set while the save that completes the run is taken
        self._last_saved_completed = False
        self._completed_record: Optional[Dict[str, Any]] = None  # the completed run this fit restored (0 epochs)
        self._save_error_seen = False
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
        self._deferred_weights_only = False  # the deferred restore is this run's restore="weights_only" start
        self._deferred_final: Optional[Dict[str, Any]] = None  # ... from a completed run: its final weights too
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
        self._preemption_prefix: Optional[str] = None  # the checkpoint the preemption save writes
        self._lr_at_start: Optional[float] = None
        self._lr_override: Optional[float] = None
        self._other_lrs_at_start: Dict[str, Optional[float]] = {}
        self._schedules_at_start: Dict[str, str] = {}
        self._other_lr_overrides: Dict[str, float] = {}  # other optimizers' learning rates changed between runs
        self._skipped_seen = 0.0
        self._finalize_hook: Optional[Tuple[Any, str, Any]] = None  # what _hook_method installed
        self._stop_hook: Optional[Tuple[Any, str, Any]] = None
        self._in_validation = False
        self._iter_backup: Optional[tf.Variable] = None
        self._own_stream: Any = None
        self._may_run_out = True
        self._prefix_skipped_on: Any = None
        self._reset_data_position()

    def _save(self, epoch: int, step_in_epoch: int, stream_pos: int) -> Optional[str]:
        started = time.perf_counter()
        if self._preempting and self._preemption_prefix is None:
            self._preemption_prefix = self._prefix_for(self._global_step)
        try:
            if self.async_save and self._async_pending is not None:
                self._wait()  # the previous background write's error is that write's, said as such
            path = self._save_untimed(epoch, step_in_epoch, stream_pos)
        except CheckpointSaveError:
            raise
        except Exception as e:  # noqa: BLE001 - never let TensorFlow's type out: OutOfRangeError (EFBIG) reads as "no more data"
            raise self._save_failed(e, f"saving {self._prefix_for(self._global_step)!r}",
                                    self._prefix_for(self._global_step)) from e
        finally:
            self.blocked_s += time.perf_counter() - started
        if path:
            events.record("checkpoint", self._global_step, path=path, directory=self.directory, epoch=epoch, step_in_epoch=step_in_epoch, blocked_s=time.perf_counter() - started, async_save=self.async_save, preemption=self._preempting)
            if self.async_save:  # the next save's copy function, traced in a background thread (warmup.py); started
                self._trace_async_copy_once()  # last: the trace holds the GIL ~0.1-0.3 s, TF's steps mostly do not
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
        completing = self._completing if not self._last_saved_completed else None
        # (the state was saved already, without the record that the run is complete: saved again, same number)
        if self._global_step != self._last_saved_step or (completing is not None and self._last_saved_prefix):
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
            self._data_state_var.assign(self._data_state_now(stream_pos))
            completed = None
            if completing is not None:
                completed = dict(completing)
                final = self._write_final_weights(self._global_step)  # first: the checkpoint then names it
                if final:
                    completed["final_weights"] = final
            self._run_config_var.assign(self._run_config_json(completed))
            if self.async_save:
                with self._copy_lock:  # (the background trace's one run of the copy is done: warmup.py)
                    path = self._manager.save(checkpoint_number=self._global_step, options=self._options)
            else:
                path = self._manager.save(checkpoint_number=self._global_step, options=self._options)
            self._last_saved_step = self._global_step
            self._last_saved_prefix = path
            self._last_saved_completed = completed is not None
            if completed is not None:
                self._completed_here, self._completed_prefix = weakref.ref(self.model), path
                self._say(f"ChiefCheckpoint: the run completed at epoch {completed['epoch']} ("
                          f"{'stopped by EarlyStopping' if completed['reason'] == 'early_stopping' else 'all epochs'}); "
                          f"recorded in {path!r}: a rerun restores this state and trains 0 epochs")
            if self.async_save:
                self._async_pending = path  # complete only once _wait() found it so
            self._start_state = None  # a real checkpoint now exists for restore_latest
            # a save at an epoch's start is that of the previous epoch's end (the last one starts no epoch)
            where = f"at the end of epoch {epoch}" if step_in_epoch == 0 and epoch > 0 else \
                _describe(epoch, step_in_epoch)
            if self.async_save:  # said saved once its background write completed (_wait): it may still fail
                self._say(f"ChiefCheckpoint: saving {path} ({where}) in the background")
            else:
                self._say(f"ChiefCheckpoint: saved {path} ({where})")
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

    def _say(self, message: str, routine: bool = True) -> None:
        """Routine news (saves, restores, resumes) like Keras's callbacks: logged at INFO, printed with
        ``io_utils.print_msg`` on the chief only when ``verbose``. Incidents (preemption, a changed batch size)
        are logged as warnings on the chief, which reach stderr even where no logging is configured."""
        if not routine:
            if self._chief:
                log.warning(message)
            return
        log.info(message)
        chief_print(message, self.model.distribute_strategy if self.model is not None else None,
                    verbose=self.verbose)

    def _wait(self) -> None:
        """Wait for a background write; one that failed raises :class:`CheckpointSaveError` (TensorFlow would only
        say so at the next save, or in an atexit hook after the process already exited 0)."""
        if self._manager is None:
            return
        pending, self._async_pending = self._async_pending, None
        try:
            self._manager.sync()
            helper = getattr(self._checkpoint, "_async_checkpointer_impl", None)
            error = getattr(helper, "_async_error", None)
            if error is not None:
                helper._async_error = None  # said here, not again at exit
                raise error
            if pending is not None and self._chief and not tf.io.gfile.exists(pending + ".index"):
                raise FileNotFoundError(f"{pending}.index is missing after its background write")
            if pending is not None:
                self._say(f"ChiefCheckpoint: saved {pending} (its background write completed)")
        except CheckpointSaveError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._save_failed(e, f"the background write of {pending!r}" if pending else "a background write",
                                    pending) from e

    def _prefix_for(self, number: int) -> str:
        return os.path.join(self.directory, f"{_NAME}-{number}")

    def _save_failed(self, error: BaseException, what: str, prefix: Optional[str]) -> CheckpointSaveError:
        """The error a failed save stops ``fit`` with; after a preemption signal also said as the preemption's
        outcome (the process then exits with 1, not the preemption exit status)."""
        self._save_error_seen = True
        newest, step = None, None
        try:
            for number, candidate in list_checkpoints(self.directory):
                if candidate != prefix and tf.io.gfile.exists(candidate + ".index"):
                    newest, step = candidate, number
                    break
        except Exception:  # noqa: BLE001 - the directory itself may be what failed
            pass
        if self._preempting:
            signame = signal.Signals(self.preempted).name if self.preempted else "a signal"
            which = (f"the preemption save after {signame}" if prefix is None or prefix == self._preemption_prefix
                     else f"an earlier save's write, found failed by the preemption save after {signame}")
            what += f" ({which}; the process does not exit with the preemption status {self.preemption_exit_code})"
        err = save_error(error, what, newest, step, prefix, self.directory)
        if self._preempting and self._chief:
            log.warning("%s", err)
        return err

    def _timed_wait(self) -> None:
        started = time.perf_counter()
        try:
            self._wait()
        finally:
            self.blocked_s += time.perf_counter() - started

