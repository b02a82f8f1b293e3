"""ChiefCheckpoint: all-or-nothing, chief-only, optionally asynchronous checkpoints with exact (mid-epoch) resume.

Example:
    >>> import keras_scale as ks
    >>> model.fit(ds, epochs=90, callbacks=[ks.ChiefCheckpoint("/shared/run1/ckpt", save_freq=1000)])  # doctest: +SKIP
    >>> # killed at any moment? run the same script again: it continues at the same epoch and batch.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import keras
import tensorflow as tf

from keras_scale._validate import check_int
from keras_scale.distribute import is_chief

__all__ = ["ChiefCheckpoint", "CheckpointMismatchError", "list_checkpoints"]

log = logging.getLogger("keras_scale.checkpoint")

_NAME = "ckpt"
_INDEX_RE = re.compile(r"^" + _NAME + r"-(\d+)\.index$")
_SIGNATURE_KEY = "keras_scale_signature/.ATTRIBUTES/VARIABLE_VALUE"


class CheckpointMismatchError(ValueError):
    """A checkpoint in the directory was written for a different model (weight count or shapes differ)."""


def list_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """``(number, prefix)`` of the checkpoints in ``directory``, newest first.

    Committed checkpoints (recorded in the ``checkpoint`` state file, which is only updated after a write has
    completed) are listed; when the state file is missing or unreadable, every ``ckpt-N.index`` found is.

    Example:
        >>> list_checkpoints("ckpt")  # doctest: +SKIP
        [(300, 'ckpt/ckpt-300'), (200, 'ckpt/ckpt-200')]
    """
    if not tf.io.gfile.isdir(directory):
        return []
    prefixes: List[str] = []
    try:
        state = tf.train.get_checkpoint_state(directory)
    except Exception:  # noqa: BLE001 - a torn/garbled state file: fall back to scanning
        state = None
    if state is not None and state.all_model_checkpoint_paths:
        for p in state.all_model_checkpoint_paths:
            # get_checkpoint_state already joins relative entries with `directory`; older files may not
            for candidate in (p, os.path.join(directory, p)):
                if tf.io.gfile.exists(candidate + ".index"):
                    prefixes.append(candidate)
                    break
    else:
        for name in tf.io.gfile.listdir(directory):
            if _INDEX_RE.match(name):
                prefixes.append(os.path.join(directory, name[: -len(".index")]))
    numbered = []
    for p in set(prefixes):
        m = re.search(r"-(\d+)$", p)
        if m:
            numbered.append((int(m.group(1)), p))
    return sorted(numbered, reverse=True)


def _tf_variable(v: Any) -> Any:
    # The tf.Variable (or distributed variable) under a Keras variable. Checkpointing Keras variables directly
    # breaks TensorFlow's async checkpoint from the 2nd save on (KerasVariable._copy_trackable_to_cpu creates a
    # new tf.Variable inside a tf.function on every call).
    return v.value if isinstance(v, keras.Variable) else v


def _optimizer_variables(model: keras.Model) -> List[Any]:
    return list(model.optimizer.variables) if model.optimizer is not None else []


def _signature(model: keras.Model) -> Dict[str, List[List[Any]]]:
    def describe(variables):
        return [[getattr(v, "path", None) or v.name, [int(d) for d in v.shape]] for v in variables]

    return {"model": describe(model.variables), "optimizer": describe(_optimizer_variables(model))}


def _describe(epoch: int, step_in_epoch: int) -> str:
    # Epochs 1-based as Keras prints them.
    if step_in_epoch == 0:
        return f"at the start of epoch {epoch + 1}"
    return f"after batch {step_in_epoch} of epoch {epoch + 1}"


def _skip_batches(iterator: Any, num_batches: int) -> None:
    """Consume ``num_batches`` batches from ``iterator`` without training."""
    for _ in range(int(num_batches)):
        iterator.get_next()


class ChiefCheckpoint(keras.callbacks.Callback):
    """Crash-safe checkpoints of everything training needs, written by the chief only, resumed exactly.

    One ``tf.train.Checkpoint`` per save holds the model, the optimizer (moments, iterations, loss scale),
    keras_scale's step state (NanGuard counters, LR multiplier) and the position in the data (epoch, batch in
    epoch, batches read from the current data iterator). A checkpoint counts only once TensorFlow has finished
    writing it and recorded it in ``directory/checkpoint``, so a kill at any moment leaves the previous one
    usable; a newest checkpoint that fails to load is reported and the one before it is used.

    On ``fit`` start (``restore=True``) the newest checkpoint that loads is restored and training continues at
    the same epoch *and* batch: the batches of the interrupted epoch that were already applied are read from
    the data and dropped, not trained twice. A run killed and restarted any number of times ends with the same
    weights as an uninterrupted one, given the same data order every run (``shuffle=False``, or a
    ``tf.data`` pipeline with a fixed seed) and deterministic ops.

    Under ``MultiWorkerMirroredStrategy`` only the chief (:func:`keras_scale.distribute.is_chief`) writes into
    ``directory``; the other workers take part in each save but write to a private temporary directory that
    is removed. For resuming, every worker must be able to read ``directory`` (a shared file system).

    Args:
        directory: where checkpoints ``ckpt-<global batch>.*`` go (local path or any ``tf.io.gfile`` URL).
        save_freq: ``"epoch"`` (after each epoch's end callbacks) or an int: every that many batches.
        max_to_keep: how many recent checkpoints to keep (>= 1).
        async_save: write in the background (TensorFlow's async checkpoint): the step waits only for the
            copy to host memory; never two writes at once; the last one is flushed at ``on_train_end``.
        restore: resume from the newest checkpoint in ``directory`` at ``fit`` start.
        keep_every_n_hours: additionally keep one checkpoint per this many hours forever (``None``: off).
        verbose: 0 silent, 1 one line per restore and per save (chief only).

    Example:
        >>> ckpt = ChiefCheckpoint("runs/exp1/ckpt", save_freq=500, max_to_keep=3, async_save=True)
        >>> ckpt.save_freq
        500
        >>> model.fit(ds, epochs=10, callbacks=[ckpt])  # doctest: +SKIP
        >>> ckpt.restore_latest()  # e.g. from a NanGuard rollback: back to the newest good state  # doctest: +SKIP
        1500
    """

    def __init__(
        self,
        directory: Union[str, os.PathLike],
        save_freq: Union[str, int] = "epoch",
        max_to_keep: int = 3,
        async_save: bool = False,
        restore: bool = True,
        keep_every_n_hours: Optional[float] = None,
        verbose: int = 1,
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
        if keep_every_n_hours is not None and not (float(keep_every_n_hours) > 0):
            raise ValueError(f"keep_every_n_hours must be > 0 hours or None, got {keep_every_n_hours!r}")
        self.directory = os.fspath(directory)
        self.save_freq = save_freq
        self.max_to_keep = max_to_keep
        self.async_save = bool(async_save)
        self.restore = bool(restore)
        self.keep_every_n_hours = keep_every_n_hours
        self.verbose = int(verbose)
        # Set per fit in on_train_begin.
        self._manager: Optional[tf.train.CheckpointManager] = None
        self._checkpoint: Optional[tf.train.Checkpoint] = None
        self._write_dir: Optional[str] = None
        self._chief = True
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

    def restore_latest(self, restore_keras_scale_state: bool = False) -> Optional[int]:
        """Restore the newest checkpoint that loads into the model and optimizer, mid-training.

        For NanGuard's rollback policy. The data position is *not* rewound: training continues with the next
        batch. keras_scale's own state (NanGuard counters, the LR multiplier) is kept as it is now unless
        ``restore_keras_scale_state=True``, so a rollback neither resets the counters that limit rollbacks nor
        undoes a learning rate lowered just before it. Under multi-worker every worker must call it at the same
        step (it synchronizes them). Returns the restored checkpoint's global batch, or ``None`` if none exists.

        Example:
            >>> step = model._keras_scale_checkpoint.restore_latest()  # doctest: +SKIP
        """
        if self._checkpoint is None:
            if self.model is None or self._write_dir is None or not self._ensure_built():
                raise RuntimeError("restore_latest() needs a ChiefCheckpoint that is part of a running fit().")
            self._build_checkpoint()
        self._wait()
        strategy = self.model.distribute_strategy
        self._sum_over_workers(strategy, 0.0)  # barrier: the chief's last write is recorded before anyone looks
        found = self._restore_newest(everything=restore_keras_scale_state)
        step = self._read_position(found)["global_step"] if found is not None else -1
        self._check_workers_agree(strategy, step)
        return None if found is None else step

    def wait(self) -> None:
        """Block until a background (``async_save``) write has finished.

        Example:
            >>> ckpt.wait()  # doctest: +SKIP
        """
        self._wait()

    # ------------------------------------------------------------------ Keras hooks
    def on_train_begin(self, logs=None):
        model = self.model
        object.__setattr__(model, "_keras_scale_checkpoint", self)
        strategy = model.distribute_strategy
        self._chief = is_chief(strategy)
        self._reset_position()
        self._prepare_write_dir()
        self._checkpoint = self._manager = None
        if self._ensure_built():
            self._build_checkpoint()
        found: Optional[str] = None
        if self.restore and list_checkpoints(self.directory):
            if self._checkpoint is not None:
                found = self._restored_from = self._restore_newest()
            else:
                # The model gets its variables only when its first step is traced: pick the newest checkpoint
                # that reads back completely now (the epoch must be known before the first epoch starts) and
                # restore it right before the first step, once the model is built from the data's spec.
                found = self._deferred_restore = self._restored_from = self._newest_readable()
        position = self._read_position(found) if found is not None else None
        self._check_workers_agree(strategy, position["global_step"] if position else -1)
        if position is not None:
            self._resume(position)
        self._install_wrapper()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = int(epoch)
        self._step_in_epoch = 0
        self._epoch_complete = False

    def on_train_batch_begin(self, batch, logs=None):
        if self.model.train_function is not self._wrapper:  # someone rebuilt it (e.g. make_train_function(force))
            self._install_wrapper()

    def on_train_batch_end(self, batch, logs=None):
        self._step_in_epoch = int(batch) + 1
        if self._last_call_skipped or self.save_freq == "epoch":
            return
        if self._global_step // self.save_freq > self._last_saved_step // self.save_freq:
            self._save(self._epoch, self._step_in_epoch, self._stream_pos)

    def on_epoch_end(self, epoch, logs=None):
        steps = (self.params or {}).get("steps")
        # A stop requested by a batch callback ends the epoch early; EarlyStopping stops after a full epoch.
        self._epoch_complete = not self.model.stop_training or bool(steps and self._step_in_epoch >= steps)
        if self.save_freq == "epoch" and self._epoch_complete:
            # Saved at the first batch of the next epoch (or at train end): only then is it known whether the
            # next epoch reads a fresh data iterator or continues this one (steps_per_epoch + repeat()).
            self._pending_epoch_save = True

    def on_train_end(self, logs=None):
        # The final state is always saved, so a finished (or gracefully stopped) run resumes with nothing lost.
        try:
            if self._global_step != self._last_saved_step:
                if self._epoch_complete:
                    fresh = self._iterator is None or self._iterator_exhausted(self._iterator)
                    self._save(self._epoch + 1, 0, 0 if fresh else self._stream_pos)
                else:
                    self._save(self._epoch, self._step_in_epoch, self._stream_pos)
            self._wait()
        finally:
            self._pending_epoch_save = False
            self._iterator = None
            if getattr(self.model, "train_function", None) is self._wrapper and self._inner is not None:
                self.model.train_function = self._inner
            if self._resumed_epoch is not None and getattr(self.model, "_initial_epoch", None) == self._resumed_epoch:
                self.model._initial_epoch = None  # Keras never resets it: a later fit() would start there too
            if not self._chief and self._write_dir and self._write_dir != self.directory:
                shutil.rmtree(self._write_dir, ignore_errors=True)
        # Files are never deleted here: a graceful stop (EarlyStopping, NanGuard halt) must keep them.

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

    # ------------------------------------------------------------------ internals
    def _reset_position(self) -> None:
        self._epoch = 0
        self._step_in_epoch = 0
        self._stream_pos = 0  # batches read from the data iterator now in use
        self._global_step = 0  # batches trained, over all runs
        self._last_saved_step = 0
        self._iterator: Any = None
        self._skip_prefix = 0
        self._skip_calls = 0
        self._last_call_skipped = False
        self._pending_epoch_save = False
        self._epoch_complete = False
        self._restored_from: Optional[str] = None
        self._deferred_restore: Optional[str] = None
        self._resumed_epoch: Optional[int] = None
        self._wrapper: Any = None
        self._inner: Any = None
        self._in_call = False

    def _prepare_write_dir(self) -> None:
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
            self._remove_stale_temp_dirs()
        else:
            # Other workers write their (identical) share of each save to a private place, removed at the end.
            self._write_dir = tempfile.mkdtemp(prefix="keras_scale_ckpt_worker_")

    def _remove_stale_temp_dirs(self) -> None:
        # TensorFlow writes ckpt-N_temp/ first and merges it into ckpt-N.*; a kill mid-write leaves it behind.
        try:
            for name in tf.io.gfile.listdir(self.directory):
                name = name.rstrip("/")
                if name.startswith(_NAME + "-") and name.endswith("_temp"):
                    tf.io.gfile.rmtree(os.path.join(self.directory, name))
        except tf.errors.OpError:
            pass

    @staticmethod
    def _multi_worker(strategy: Any) -> bool:
        in_multi_worker = getattr(getattr(strategy, "extended", None), "_in_multi_worker_mode", None)
        return bool(in_multi_worker is not None and in_multi_worker())

    def _sum_over_workers(self, strategy: Any, value: float, first_replica_only: bool = False) -> float:
        """All-reduce (SUM) of ``value`` over all replicas of all workers; also a barrier. Local value outside
        multi-worker."""
        if not self._multi_worker(strategy):
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
        if not self._multi_worker(strategy):
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
        try:
            from keras_scale.schedules import lr_multiplier

            mult = lr_multiplier(model.optimizer) if model.optimizer is not None else None
        except ImportError:
            mult = None
        if mult is not None:
            state["lr_multiplier"] = mult
        return state

    def _build_checkpoint(self) -> None:
        model = self.model
        if self._manager is not None:
            self._wait()
        # Position and signature are host-side bookkeeping: plain variables outside any strategy scope.
        with tf.init_scope():
            self._vars = {
                "epoch": tf.Variable(0, dtype=tf.int64, trainable=False, name="ks_epoch"),
                "step_in_epoch": tf.Variable(0, dtype=tf.int64, trainable=False, name="ks_step_in_epoch"),
                "stream_pos": tf.Variable(0, dtype=tf.int64, trainable=False, name="ks_stream_pos"),
                "global_step": tf.Variable(0, dtype=tf.int64, trainable=False, name="ks_global_step"),
            }
            self._signature = tf.Variable("", dtype=tf.string, trainable=False, name="ks_signature")
        # Variables by position (model.variables, optimizer.variables: a deterministic order for a given model
        # and optimizer); the signature saved alongside makes restoring into a different model an error.
        items: Dict[str, Any] = {
            "model_variables": [_tf_variable(v) for v in model.variables],
            "optimizer_variables": [_tf_variable(v) for v in _optimizer_variables(model)],
            "keras_scale_position": self._vars,
            "keras_scale_signature": self._signature,
        }
        state = self._state_variables()
        if state:
            items["keras_scale_state"] = {k: _tf_variable(v) for k, v in state.items()}
        self._checkpoint = tf.train.Checkpoint(**items)
        # Same paths, model and optimizer only: for a mid-training rollback that keeps keras_scale's counters.
        self._weights_only = tf.train.Checkpoint(model_variables=items["model_variables"],
                                                 optimizer_variables=items["optimizer_variables"])

        def manager():
            return tf.train.CheckpointManager(
                self._checkpoint, self._write_dir, max_to_keep=self.max_to_keep if self._chief else 1,
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
        candidates = list_checkpoints(self.directory)
        failures: List[str] = []
        for number, prefix in candidates:
            reader = None
            try:
                reader = tf.train.load_checkpoint(prefix)
                self._check_signature(prefix, reader)  # a different model is an error, not a reason to fall back
                target.read(prefix).expect_partial()
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
        reader = tf.train.load_checkpoint(prefix)
        return {name: int(reader.get_tensor(f"keras_scale_position/{name}/.ATTRIBUTES/VARIABLE_VALUE"))
                for name in ("epoch", "step_in_epoch", "stream_pos", "global_step")}

    def _newest_readable(self) -> Optional[str]:
        """The newest checkpoint whose every tensor reads back (CRC-checked), without needing the model."""
        failures: List[str] = []
        for _, prefix in list_checkpoints(self.directory):
            try:
                reader = tf.train.load_checkpoint(prefix)
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

    def _restore_deferred(self, iterator: Any) -> None:
        prefix, self._deferred_restore = self._deferred_restore, None
        model = self.model
        spec = getattr(iterator, "element_spec", None)
        try:
            model._symbolic_build(data_batch=spec)
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(
                f"ChiefCheckpoint could not build the model from the data ({e}) to restore {prefix!r} before the "
                "first step. Fix: build the model before fit (keras.Input(...) as its first layer, or "
                "model.build(input_shape))."
            ) from e
        self._ensure_built()
        self._build_checkpoint()
        reader = tf.train.load_checkpoint(prefix)
        self._check_signature(prefix, reader)
        self._checkpoint.read(prefix).expect_partial()
        self._restored_from = prefix
        self._say(f"ChiefCheckpoint: restored {prefix}")

    def _resume(self, position: Dict[str, int]) -> None:
        epoch, step_in_epoch = position["epoch"], position["step_in_epoch"]
        stream_pos = position["stream_pos"]
        self._global_step = self._last_saved_step = position["global_step"]
        self._epoch = epoch
        self._resumed_epoch = epoch
        self.model._initial_epoch = epoch
        spe = int(getattr(self.model, "steps_per_execution", 1) or 1)
        self._skip_calls = step_in_epoch // spe
        if step_in_epoch % spe:
            warnings.warn(
                f"ChiefCheckpoint: the checkpoint is at batch {step_in_epoch} of epoch {epoch + 1}, not a multiple of "
                f"steps_per_execution={spe}; resuming at batch {self._skip_calls * spe} (a few batches train twice).",
                RuntimeWarning, stacklevel=2,
            )
        self._skip_prefix = max(stream_pos - self._skip_calls * spe, 0)
        self._say(f"ChiefCheckpoint: resuming {_describe(epoch, self._skip_calls * spe)}"
                  f" (global batch {self._global_step}); skipping {self._skip_prefix + self._skip_calls * spe} "
                  "already-trained batches of data")

    def _install_wrapper(self) -> None:
        inner = self.model.train_function
        if inner is None:
            self.model.make_train_function()
            inner = self.model.train_function
        self._inner = inner

        def train_function(iterator):
            return self._train_call(inner, iterator)

        self._wrapper = train_function
        self.model.train_function = train_function

    def _train_call(self, inner: Any, iterator: Any) -> Any:
        if self._in_call:  # another wrapper around ours was wrapped by us again: count and skip only once
            return inner(iterator)
        self._in_call = True
        try:
            return self._train_call_once(inner, iterator)
        finally:
            self._in_call = False

    def _train_call_once(self, inner: Any, iterator: Any) -> Any:
        spe = int(getattr(self.model, "steps_per_execution", 1) or 1)
        if self._deferred_restore is not None:
            self._restore_deferred(iterator)
        if iterator is not self._iterator:  # a fresh data iterator (a new epoch over a finite dataset)
            self._iterator = iterator
            self._stream_pos = 0
        if self._pending_epoch_save:
            self._pending_epoch_save = False
            self._save(self._epoch, 0, self._stream_pos)
        if self._skip_prefix:
            _skip_batches(iterator, self._skip_prefix)
            self._stream_pos += self._skip_prefix
            self._skip_prefix = 0
        if self._skip_calls > 0:
            self._skip_calls -= 1
            _skip_batches(iterator, spe)
            self._stream_pos += spe
            self._last_call_skipped = True
            return self.model.get_metrics_result()
        self._last_call_skipped = False
        out = inner(iterator)
        self._stream_pos += spe
        self._global_step += spe
        return out

    def _save(self, epoch: int, step_in_epoch: int, stream_pos: int) -> Optional[str]:
        if self._global_step == self._last_saved_step:
            return None  # this exact state is already on disk
        if self._checkpoint is None:  # model built by its first step
            self._ensure_built()
            self._build_checkpoint()
        self._vars["epoch"].assign(epoch)
        self._vars["step_in_epoch"].assign(step_in_epoch)
        self._vars["stream_pos"].assign(stream_pos)
        self._vars["global_step"].assign(self._global_step)
        self._signature.assign(json.dumps(_signature(self.model)))
        path = self._manager.save(checkpoint_number=self._global_step, options=self._options)
        self._last_saved_step = self._global_step
        self._say(f"ChiefCheckpoint: saved {path} ({_describe(epoch, step_in_epoch)})")
        return path

    def _say(self, message: str) -> None:
        log.info(message)
        if self.verbose and self._chief:
            print(message, flush=True)

    def _wait(self) -> None:
        if self._manager is not None:
            self._manager.sync()
