"""Resuming at the same epoch and batch: the train-function wrapper that fast-forwards the data, batch-size
changes, iterators that run out."""
from __future__ import annotations

import json
import time
import warnings
import weakref
from typing import Any, Dict, List, Optional

import keras
import tensorflow as tf

from keras_scale import events
from keras_scale.data import pipeline_stages
from keras_scale.callbacks.checkpoint.names import _EPOCH_LOGS_KEY, log
from keras_scale.callbacks.checkpoint import format as _io
from keras_scale.callbacks.checkpoint import data_position as _data
from keras_scale.callbacks.checkpoint.state import _state_size


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
    # the inputs named on each stage: the main chain and the sides of a concatenate (not a zip's components)
    for ds in pipeline_stages(dataset, follow=("_input_dataset", "_input_datasets")):
        if "Shuffle" in type(ds).__name__ and getattr(ds, "_reshuffle_each_iteration", False):
            # an op seed (shuffle(seed=...)) lives in _seed2; _seed is the global seed (0 after set_random_seed(0))
            seeds = [getattr(ds, name, None) for name in ("_seed", "_seed2")]
            try:
                fixed = any(seed is not None and int(tf.get_static_value(seed) or 0) != 0 for seed in seeds)
            except Exception:  # noqa: BLE001
                fixed = any(seed is not None for seed in seeds)
            if fixed:
                return True
    return False


_COMPILED_SKIP_MIN = 1000  # batches to read forward from which one compiled loop beats eager get_next calls


@tf.function(autograph=False)
def _read_forward(iterator: Any, num_batches: Any) -> Any:
    """Read and drop ``num_batches`` batches from ``iterator`` in one call (a tf.data or tf.distribute iterator)."""
    def body(i):
        with tf.control_dependencies(tf.nest.flatten(iterator.get_next(), expand_composites=True)):
            return i + 1

    return tf.while_loop(lambda i: i < num_batches, body, [tf.constant(0, tf.int64)])


class _ResumeEpoch(int):
    """The epoch a resumed ``fit`` starts at, for ``model._initial_epoch``: truthy only while the fit that set it
    is starting, so a ``fit`` that raised before clearing it never makes a later plain ``fit`` skip epochs."""

    def __new__(cls, value: int, owner: Any) -> "_ResumeEpoch":
        obj = int.__new__(cls, value)
        obj._owner = weakref.ref(owner)
        return obj

    def __bool__(self) -> bool:
        owner = self._owner()
        return bool(int(self)) and owner is not None and owner._resume_pending and owner._in_this_fit()


class ResumeMixin:
    """Part of :class:`ChiefCheckpoint` (a mixin: it uses the callback's own state)."""

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
            raw = _io.read_checkpoint(prefix).get_tensor(_EPOCH_LOGS_KEY)
            self._saved_epoch_logs = json.loads(raw.decode() if isinstance(raw, bytes) else raw) if raw else None
        except Exception:  # noqa: BLE001 - older checkpoints have no epoch logs
            self._saved_epoch_logs = None
        self._resume_data_state = self._read_data_state(prefix)
        completed = getattr(self, "_completed_record", None)  # (boundaries.py: said already, at every verbosity)
        if completed is not None and epochs is not None:
            epoch = max(epoch, int(epochs))  # an early-stopped run trains 0 epochs too
        if epoch:
            self.model._initial_epoch = _ResumeEpoch(epoch, self)
            self._resume_pending = True
        if completed is not None or (epochs is not None and epoch >= int(epochs) and step_in_epoch == 0):
            self._already_complete = epoch
            if completed is None:
                self._announce(f"ChiefCheckpoint: the run in {self.directory!r} is already complete ({epoch} epochs, "
                               f"global batch {self._global_step}): nothing to train. Pass a larger epochs= to train "
                               "further, or a new directory to start over.")
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
        epoch_iterator = _data.keras_epoch_iterator(model)
        self._epoch_iterator_ref = weakref.ref(epoch_iterator) if epoch_iterator is not None else None
        self._keras_arrays = _data.is_keras_array_pipeline(epoch_iterator)
        if self._deferred_restore is not None:
            self._restore_deferred(iterator)
        # Without a strategy Keras builds metrics only when the first step is traced: build them now, so that
        # skipped batches can report them and every checkpoint holds them.
        # And every optimizer the model trains with must have its slots before the first save (keras_scale.state):
        # a model with its own train_step builds them at their first apply, so one trace of the step builds them.
        compile_metrics = getattr(model, "_compile_metrics", None)
        if (getattr(model, "_distribute_strategy", None) is None and compile_metrics is not None
                and not compile_metrics.built) or not self._ensure_built():
            self._build_from_data(iterator, "before the first step")
            self._ensure_built()
        if self._checkpoint is None or self._state_size != _state_size(model):
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
                message = (
                    "ChiefCheckpoint: the data pipeline has shuffle(seed=...) with reshuffle_each_iteration=True: "
                    f"its order in epoch {self._epoch + 1} of this process differs from the uninterrupted run's, so "
                    "the resume is not exact. Fix: shuffle(..., reshuffle_each_iteration=False) over a dataset "
                    "re-shuffled per epoch with a seed derived from the epoch, or keras_scale.fit's shuffling.")
                if (self._skip_calls or self._skip_prefix) and self._resume_data_state:
                    # The saved iterator state holds the shuffle's seeds and position: restored, the order is the
                    # uninterrupted run's (this epoch and the next). Said only if the resume reads forward instead.
                    self._reshuffle_warning = message
                else:
                    warnings.warn(message, RuntimeWarning, stacklevel=2)
        if self._start_state_wanted and self._restored_from is None:
            self._start_state = [v.numpy() for v in self._start_variables()]
            self._start_step = self._global_step
        optimizer = model.optimizer
        if optimizer is not None:
            with tf.init_scope():
                self._iter_backup = tf.Variable(0, dtype=optimizer.iterations.dtype, trainable=False,
                                                name="ks_iterations_backup")

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

    # ------------------------------------------------------------------ the data position (data_position.py)
    def _reset_data_position(self) -> None:
        self._resume_data_state: bytes = b""
        self._data_not_saveable: Optional[str] = None  # why the position cannot be saved (said once per fit)
        self._data_state_cache: Optional[bytes] = None
        self._epoch_iterator_ref: Any = None
        self._keras_arrays = False
        self._trained_calls = 0
        self._train_started_at = 0.0
        self._loop_skips = 0  # calls of Keras's loop still to skip (the data position is already set)
        self._reshuffle_warning: Optional[str] = None  # said if the saved data position is not restored after all

    @staticmethod
    def _read_data_state(prefix: str) -> bytes:
        try:
            reader = _io.read_checkpoint(prefix)
            if not reader.has_tensor(_data.DATA_STATE_KEY):
                return b""  # an older checkpoint: the resume reads the data forward
            raw = reader.get_tensor(_data.DATA_STATE_KEY)  # CRC-checked (and by the restore that chose prefix)
        except Exception as e:  # noqa: BLE001
            log.warning("ChiefCheckpoint: the data position in %r cannot be read (%s); reading the data forward "
                        "instead", prefix, e)
            return b""
        return bytes(raw) if raw else b""

    def _keras_epoch_iterator(self) -> Any:
        ref = self._epoch_iterator_ref
        return ref() if ref is not None else None

    def _data_state_now(self, stream_pos: int) -> bytes:
        """The bytes to save as the data position (``b""``: none, a resume reads the data forward)."""
        if stream_pos <= 0 or self._iterator is None:
            return b""  # a resume here starts on a fresh iterator, which is already right
        if self._data_state_cache is not None:
            return self._data_state_cache
        if self._data_not_saveable is not None:
            return b""
        try:
            return _data.iterator_state(self._iterator, keras_arrays=self._keras_arrays)
        except _data.NotSaveable as e:
            self._data_not_saveable = str(e)
            self._warn_replay(e, stream_pos)
            return b""

    def _warn_replay(self, why: "_data.NotSaveable", stream_pos: int) -> None:
        if not self._chief:
            return
        per_batch_s = None
        spe = int(getattr(self.model, "steps_per_execution", 1) or 1)
        if self._trained_calls:
            per_batch_s = (time.perf_counter() - self._train_started_at) / (self._trained_calls * spe)
        cost = (f"about {stream_pos} x {per_batch_s * 1e3:.2f} ms = {stream_pos * per_batch_s:.1f} s at this save "
                "(this run's measured time per batch, training included: an upper bound)") if per_batch_s else \
            f"{stream_pos} batches at this save"
        warnings.warn(
            f"ChiefCheckpoint: the position in the data cannot be saved: {why}. A resume reads the batches already "
            f"trained from this data iterator again and drops them: {cost}; it grows with the position in the "
            f"iterator (a repeat()ed dataset: every batch since fit started). Fix: {why.fix}.",
            RuntimeWarning, stacklevel=2)

    def _restore_data_position(self, iterator: Any, num_batches: int) -> bool:
        """Put the resumed fit's fresh data iterator at the saved position; False: read forward instead."""
        state = self._resume_data_state
        position = self._resume_position or {}
        if not state or num_batches != position.get("stream_pos"):
            return False  # none saved, or the batch size changed (the position is then converted into batches)
        if self._saved_batch_size and self._batch_size and self._batch_size != self._saved_batch_size:
            return False
        try:
            _data.restore_iterator_state(iterator, state)
        except Exception as e:  # noqa: BLE001 - another pipeline than the one saved, a TensorFlow that differs
            warnings.warn(
                f"ChiefCheckpoint: the data position saved in {self._restored_from!r} does not fit this run's data "
                f"iterator ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}); reading {num_batches} "
                "batches forward instead. (A changed pipeline resumes where the old one would have been only if "
                "it yields the same batches.)", RuntimeWarning, stacklevel=3)
            return False
        return True

    def _position_data(self, use: Any, spe: int) -> bool:
        """At the resumed fit's first call: put the data where the checkpoint was taken (its saved iterator state,
        or by reading the trained batches forward) and make Keras's loop skip the trained steps. True: this call
        is one of the trained steps (it trains nothing)."""
        if self._loop_skips:  # Keras's loop could not be advanced: its calls for trained steps read nothing
            self._loop_skips -= 1
            self._skip_calls = self._loop_skips
            return True
        calls, prefix = max(self._skip_calls, 0), self._skip_prefix
        batches = prefix + calls * spe
        started = time.perf_counter()
        if self._restore_data_position(use, batches):
            self._preread = 0
            how = f"data position restored from the checkpoint in {time.perf_counter() - started:.2f} s (no batch read)"
        else:
            if self._reshuffle_warning:
                warnings.warn(self._reshuffle_warning, RuntimeWarning, stacklevel=3)
            self._skip(use, batches)
            how = f"read {batches} batches forward in {time.perf_counter() - started:.2f} s"
        self._reshuffle_warning = None
        self._say(f"ChiefCheckpoint: {how}")
        self._stream_pos += batches
        self._skip_prefix = 0
        if prefix:
            self._prefix_skipped_on = use
        self._skip_calls = 0
        if calls == 0:
            return False
        if calls > 1:
            epoch_iterator = self._keras_epoch_iterator()
            if epoch_iterator is None or not _data.skip_loop_steps(epoch_iterator, calls - 1):
                self._loop_skips = self._skip_calls = calls - 1
        return True

    def _skip(self, iterator: Any, num_batches: int) -> None:
        take = min(self._preread, num_batches)
        self._preread -= take
        left = int(num_batches - take)
        if left > _COMPILED_SKIP_MIN and isinstance(iterator, tf.distribute.DistributedIterator):
            # one call (traced once, ~1 s): a distributed iterator's eager get_next costs ~1.5 ms per batch
            _read_forward(iterator, tf.constant(left, tf.int64))
            return
        for _ in range(left):
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
        if self._skip_prefix or self._skip_calls > 0:
            if self._position_data(use, spe):
                self._last_call_skipped = True
                return self.model.get_metrics_result()
        self._last_call_skipped = False
        if self._trained_calls == 0:
            self._train_started_at = time.perf_counter()
        self._trained_calls += 1
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

