"""A run's boundaries: completion (all epochs, or an early stop) recorded in the checkpoint that ends the run, a
rerun of a completed run (``on_completed``), a second ``fit`` of the same callback, and ``restore="weights_only"``
telling its own interrupted run (resumed in full) from a new start.

What a checkpoint records about its run is one small JSON string saved with it (``keras_scale_run_config``): the
learning rate the script set for every optimizer the model trains with, the checkpoint a ``weights_only`` run took its weights from, and, in the checkpoint
that ends a completed run, ``completed`` (the epoch, why, and the file of the weights ``fit`` returned when they
differ from the checkpoint's). It is written in the same save as the state it describes, so a kill at any moment
leaves a checkpoint and its record in step.

Example:
    ckpt = ChiefCheckpoint("run1/ckpt", on_completed="restore")   # the default
    model.fit(ds, epochs=10, callbacks=[ckpt])   # rerun after it completed: prints so, restores, trains 0 epochs
"""
from __future__ import annotations

import json
import os
import re
import sys
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import keras
import tensorflow as tf

from keras_scale import state as training_state
from keras_scale.schedules import ScaledSchedule, inner_optimizer, learning_rate_variable
from keras_scale.distribute import chief_print
from keras_scale.callbacks.checkpoint.names import _NAME, _RUN_CONFIG_KEY, _SIGNATURE_KEY, log
from keras_scale.callbacks.checkpoint import format as _io
from keras_scale.callbacks.checkpoint.directory import _verified, list_checkpoints
from keras_scale.callbacks.checkpoint.errors import RunCompletedError

_FINAL_DIR = "final"  # the weights fit returned, where they differ from the completing checkpoint's (EarlyStopping)
ON_COMPLETED = ("restore", "restart", "error")
_FINAL_FILE_RE = re.compile(r"^" + _NAME + r"-(\d+)(\.index|\.data-\d{5}-of-\d{5})(\.tempstate\d+)?$")


class _Peek:
    """What the newest readable checkpoint says about its run (read without touching the model)."""

    def __init__(self, number: int, prefix: str, config: Dict[str, Any], signature: Dict[str, Any],
                 position: Dict[str, int]) -> None:
        self.number, self.prefix, self.config, self.signature, self.position = (number, prefix, config, signature,
                                                                                 position)

    def completed(self, epochs: Optional[int]) -> Optional[Dict[str, Any]]:
        """The completed run's record; a checkpoint without one (an earlier version's) at the start of epoch
        ``epochs`` or later completed its epochs too."""
        done = self.config.get("completed")
        if isinstance(done, dict):
            try:
                return {**done, "epoch": int(done["epoch"]), "reason": str(done.get("reason", "epochs"))}
            except (KeyError, TypeError, ValueError):  # a damaged record: not trusted, read as none
                pass
        epoch = self.position.get("epoch", 0)
        if epochs is not None and not self.position.get("step_in_epoch") and epoch >= int(epochs) and epoch > 0:
            return {"epoch": epoch, "reason": "epochs"}
        return None


def _json(raw: Any) -> Dict[str, Any]:
    try:
        value = json.loads(raw.decode() if isinstance(raw, bytes) else raw) if raw else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}



def other_learning_rates(model: keras.Model) -> Dict[str, Optional[float]]:
    """The float learning rate (``None``: a schedule) of every optimizer ``model`` trains with but
    ``model.optimizer``, by its path in :func:`keras_scale.state.optimizers` (a GAN's ``d_optimizer``...)."""
    out: Dict[str, Optional[float]] = {}
    for path, opt in training_state.optimizers(model).items():
        if path != "optimizer":
            var = learning_rate_variable(opt)
            out[path] = float(var.numpy()) if var is not None else None
    return out


def _schedule_of(optimizer: Any) -> Any:
    """The schedule the script gave ``optimizer`` (``None``: a float learning rate), unwrapped from the
    :class:`~keras_scale.schedules.ScaledSchedule` that ReduceLROnPlateau/NanGuard put around a schedule to lower it."""
    schedule = getattr(inner_optimizer(optimizer), "_learning_rate", None)
    while isinstance(schedule, ScaledSchedule):
        schedule = schedule.schedule
    return schedule if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule) else None


def schedule_descriptor(schedule: Any) -> str:
    """A stable text naming ``schedule`` and its configuration: ``"<ClassName> <json of its config>"``, or the class
    name alone when it cannot be serialized (its multiplier, lowered during training, is not part of it).

    Example:
        >>> schedule_descriptor(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9))[:16]
        'ExponentialDecay'
    """
    name = type(schedule).__name__
    try:
        config = keras.saving.serialize_keras_object(schedule)
        config = config.get("config", config) if isinstance(config, dict) else config
        return f"{name} {json.dumps(config, sort_keys=True)}"
    except Exception:  # noqa: BLE001 - no get_config (or not JSON): compared by class only
        return name


def schedule_descriptors(model: keras.Model) -> Dict[str, str]:
    """:func:`schedule_descriptor` of every optimizer ``model`` trains with whose learning rate is a schedule, by its
    path in :func:`keras_scale.state.optimizers` (``"optimizer"`` for ``model.optimizer``)."""
    out: Dict[str, str] = {}
    for path, opt in training_state.optimizers(model).items():
        schedule = _schedule_of(opt)
        if schedule is not None:
            out[path] = schedule_descriptor(schedule)
    return out


def short_schedule(descriptor: Any, other: Any = None) -> str:
    """A short form of a schedule descriptor for messages: its class name and the fields that differ from
    ``other``'s (all its fields when ``other`` is of another class or not given, up to a few)."""
    if not isinstance(descriptor, str):
        return "a float" if descriptor is not None else "a schedule"
    name, _, raw = descriptor.partition(" ")
    try:
        mine = json.loads(raw) if raw else None
    except ValueError:
        mine = None
    theirs = None
    if isinstance(other, str) and other.partition(" ")[0] == name:
        try:
            theirs = json.loads(other.partition(" ")[2] or "null")
        except ValueError:
            theirs = None
    if not isinstance(mine, dict):
        return name
    keys = [k for k in sorted(mine) if not isinstance(theirs, dict) or theirs.get(k) != mine.get(k)]
    shown = ", ".join(f"{k}={json.dumps(mine[k])[:40]}" for k in keys[:4]) + (", ..." if len(keys) > 4 else "")
    return f"{name}({shown})"


class BoundariesMixin:
    """Part of :class:`ChiefCheckpoint` (a mixin: it uses the callback's own state)."""

    # ---------------------------------------------------------------------------------------- what a run records
    def _start_config(self) -> Dict[str, Any]:
        """The learning rates this run's script set: ``learning_rate`` (``model.optimizer``'s, the key it always had)
        and ``learning_rates`` (every other optimizer the model trains with, by path: a GAN's ``d_optimizer`` and
        ``g_optimizer``), ``None`` for a schedule."""
        config: Dict[str, Any] = {"learning_rate": self._lr_at_start}
        if self._other_lrs_at_start:
            config["learning_rates"] = dict(self._other_lrs_at_start)
        config["schedules"] = dict(getattr(self, "_schedules_at_start", None) or {})
        return config

    def _run_config_json(self, completed: Optional[Dict[str, Any]] = None) -> str:
        return json.dumps({**self._start_config(), "weights_from": self._weights_from, "completed": completed})

    def _lr_changes(self, config: Dict[str, Any]) -> List[Tuple[str, Any, Any]]:
        """``(optimizer path, learning rate its run started with, this fit's)`` for every optimizer whose recorded
        starting learning rate differs from this fit's (a record without an optimizer's value compares nothing)."""
        out: List[Tuple[str, Any, Any]] = []
        if "learning_rate" in config and config.get("learning_rate") != self._lr_at_start:
            out.append(("optimizer", config.get("learning_rate"), self._lr_at_start))
        recorded = config.get("learning_rates")
        if isinstance(recorded, dict):
            for path, mine in (self._other_lrs_at_start or {}).items():
                if path in recorded and recorded[path] != mine:
                    out.append((path, recorded[path], mine))
        out.extend(self._schedule_changes(config))
        return out

    def _schedule_changes(self, config: Dict[str, Any]) -> List[Tuple[str, str, str]]:
        """``(optimizer path, schedule descriptor its run started with, this fit's)`` for every optimizer with a
        schedule in both (a schedule against a float is a learning-rate change already; a record without
        ``schedules``, written by an older version, compares nothing)."""
        recorded = config.get("schedules")
        if not isinstance(recorded, dict):
            return []
        mine = getattr(self, "_schedules_at_start", None) or {}
        return [(path, recorded[path], new) for path, new in mine.items()
                if isinstance(recorded.get(path), str) and recorded[path] != new]

    def _peek_newest(self) -> Optional[_Peek]:
        for number, prefix in list_checkpoints(self.directory):
            if _verified(prefix) is not None:  # damaged: the restore skips it too (and says so); what it restores
                continue                       # decides whether the run completed
            try:
                reader = _io.read_checkpoint(prefix)
                config = _json(reader.get_tensor(_RUN_CONFIG_KEY)) if reader.has_tensor(_RUN_CONFIG_KEY) else {}
                signature = _json(reader.get_tensor(_SIGNATURE_KEY)) if reader.has_tensor(_SIGNATURE_KEY) else {}
                position = self._read_position(prefix)
            except Exception:  # noqa: BLE001 - damaged: the restore skips it too (and says so)
                continue
            return _Peek(number, prefix, config, signature, position)
        return None

    def _announce(self, message: str) -> None:
        """Said at every verbosity (printed on the chief, and logged): a boundary that changes what ``fit`` does."""
        log.info(message)
        chief_print(message, self.model.distribute_strategy if self.model is not None else None, verbose=1)

    def _find_callback_list(self) -> None:
        """The fit's ``CallbackList`` (for the EarlyStopping that may end the run), from the caller's frames."""
        self._callback_list = None
        frame = sys._getframe(1)
        for _ in range(8):
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            if isinstance(owner, keras.callbacks.CallbackList) and any(cb is self for cb in owner.callbacks):
                self._callback_list = weakref.ref(owner)
                return
            frame = frame.f_back

    def _callbacks(self) -> List[Any]:
        owner = self._callback_list() if self._callback_list is not None else None
        return list(getattr(owner, "callbacks", None) or [])

    # ---------------------------------------------------------------------------------------- completing a run
    def _early_stopper(self) -> Optional[Any]:
        """The EarlyStopping that stopped this fit at the end of the current epoch, if one did."""
        if not self.model.stop_training:
            return None
        for cb in self._callbacks():
            if isinstance(cb, keras.callbacks.EarlyStopping) and cb.stopped_epoch == self._epoch and self._epoch > 0:
                return cb
        return None

    def _completion(self) -> Optional[Dict[str, Any]]:
        """``{"epoch", "reason"}`` when the state about to be saved last ends the run: all epochs trained, or
        stopped by ``EarlyStopping``. A preemption, a stop mid-epoch or another callback's stop is no completion: the
        run resumes."""
        if self._preempting or not self._epoch_complete or self._already_complete is not None:
            return None
        stopper = self._early_stopper()
        if stopper is not None:
            return {"epoch": self._epoch + 1, "reason": "early_stopping"}
        epochs = (self.params or {}).get("epochs")
        if epochs is not None and self._epoch + 1 >= int(epochs):
            return {"epoch": self._epoch + 1, "reason": "epochs"}
        return None

    def _final_weights_of(self, stopper: Optional[Any]) -> Optional[List[Any]]:
        """The model weights ``fit`` will return when they are not the ones saved now: those
        ``EarlyStopping(restore_best_weights=True)`` puts back at train end (in ``model.weights`` order)."""
        for cb in reversed(self._callbacks()):
            if (isinstance(cb, keras.callbacks.EarlyStopping) and cb.restore_best_weights
                    and cb.best_weights is not None):
                return list(cb.best_weights)
        return None

    def _write_final_weights(self, number: int) -> Optional[str]:
        """Write the weights ``fit`` will return (where they differ from the checkpoint's) as ``final/ckpt-N``
        before the completing checkpoint names them; returns its path relative to the directory."""
        values = self._final_weights_of(None)
        if values is None or not self._chief:
            return None
        model = self.model
        weights = list(model.weights)
        if len(values) != len(weights):
            warnings.warn(
                f"ChiefCheckpoint: EarlyStopping holds {len(values)} best weights but the model has {len(weights)} "
                "(the model changed during fit?): the weights fit returns are not recorded in final/; a rerun of this "
                "completed run restores its last checkpoint's weights.", RuntimeWarning, stacklevel=3)
            return None
        by_id = {id(v): value for v, value in zip(weights, values)}
        # model.variables also holds state that is not a weight (a Dropout's or a GAN's SeedGenerator state):
        # EarlyStopping leaves it as it is, so fit returns it as it is now
        variables = {f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE":
                     tf.constant(by_id[id(v)] if id(v) in by_id else v.numpy())
                     for i, v in enumerate(model.variables)}
        missing = [v.path for v in weights if id(v) not in {id(u) for u in model.variables}]
        if missing:
            warnings.warn(
                f"ChiefCheckpoint: the weights {missing[:5]} are not among the model's variables; the weights fit "
                "returns are not recorded in final/; a rerun of this completed run restores its last checkpoint's "
                "weights.", RuntimeWarning, stacklevel=3)
            return None
        final_dir = os.path.join(self.directory, _FINAL_DIR)
        if os.path.islink(final_dir) or (tf.io.gfile.exists(final_dir) and not tf.io.gfile.isdir(final_dir)):
            warnings.warn(f"ChiefCheckpoint: {final_dir!r} is a link or a file, not ChiefCheckpoint's folder; the "
                          "weights fit returns (EarlyStopping's restored best weights) are not recorded there, a rerun "
                          "of this completed run restores its last checkpoint's weights. Remove it.", RuntimeWarning,
                          stacklevel=3)
            return None
        tf.io.gfile.makedirs(final_dir)
        name = f"{_NAME}-{number}"
        _io.write_checkpoint(os.path.join(final_dir, name), variables)
        return f"{_FINAL_DIR}/{name}"

    def _remove_stale_final(self) -> None:
        """``final/`` keeps only the files of recorded checkpoints (a completed run's, until rotated away); temporary
        files of a write cut short go too."""
        final_dir = os.path.join(self.directory, _FINAL_DIR)
        if not self._chief or not tf.io.gfile.isdir(final_dir) or os.path.islink(final_dir):
            return
        keep = {n for n, _ in list_checkpoints(self.directory)}
        for name in tf.io.gfile.listdir(final_dir):
            match = _FINAL_FILE_RE.match(name)  # only this scheme's names: nothing else is ever removed
            if match and (int(match.group(1)) not in keep or match.group(3)):
                _io.remove_entry(os.path.join(final_dir, name))

    def _load_final_weights(self, prefix: str, completed: Dict[str, Any]) -> bool:
        """Put the weights the completed run's ``fit`` returned into the model (when the run recorded them)."""
        relative = completed.get("final_weights")
        if not relative:
            return False
        if not isinstance(relative, str) or not re.fullmatch(_FINAL_DIR + "/" + _NAME + r"-\d+", relative):
            relative = f"<not a file of this directory: {str(relative)[:80]!r}>"  # never read outside the directory
        path = os.path.join(self.directory, relative)
        try:
            items = {"model_variables": self._model_only["model_variables"]}
            _io.read_into(path, _io.flatten(items), tf.train.Checkpoint(**items))
        except Exception as e:  # noqa: BLE001 - missing or damaged: the checkpoint's own weights, said
            warnings.warn(f"ChiefCheckpoint: the final weights of the completed run ({path!r}, what its fit returned, "
                          f"e.g. EarlyStopping's restored best weights) could not be read ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]}); the model holds {prefix!r}'s weights (its "
                          "last epoch's) instead.", RuntimeWarning, stacklevel=3)
            return False
        return True

    # ---------------------------------------------------------------------------------------- at fit start
    def _decide_start(self, peek: Optional[_Peek]) -> Tuple[Any, Optional[Dict[str, Any]]]:
        """How this fit starts, given the newest checkpoint: returns ``(mode, completed)`` where mode is ``True``
        (restore everything), ``"weights_only"`` or ``"new"`` (a new run from the model as it is, numbered after the
        newest checkpoint); ``completed`` is the completed run's record when the fit restores one to train 0 epochs."""
        mode: Any = self.restore
        if peek is None or not mode:
            return mode, None
        epochs = (self.params or {}).get("epochs")
        done = peek.completed(epochs)
        where = f"the run in {self.directory!r}"
        if mode == "weights_only":
            if not self._own_weights_only_run(peek):
                return "weights_only", None
            self._weights_from = int(peek.config["weights_from"])
            if done is None:
                self._announce(f"ChiefCheckpoint: {peek.prefix!r} was written by the run that restore='weights_only' "
                               f"started from the weights of checkpoint {self._weights_from} (same optimizers and "
                               "learning rate): resuming that run in full (optimizer state and position), not from "
                               "its weights again.")
                return True, None
            # that run completed: a rerun of it is a rerun of a completed run (below)
        source = peek.config.get("weights_from")
        self._weights_from = source if isinstance(source, int) and not isinstance(source, bool) else None
        if done is None:
            return True, None
        how = ("stopped by EarlyStopping" if done["reason"] == "early_stopping" else "all its epochs trained")
        head = f"ChiefCheckpoint: {where} already completed at epoch {done['epoch']} ({how}; {peek.prefix!r})"
        options = ("pass ChiefCheckpoint(..., on_completed='restart') to start a new run in this directory, or give "
                   "ChiefCheckpoint a new directory")
        if self._completed_here is not None and self._completed_here() is self.model \
                and self._completed_prefix == peek.prefix:
            self._announce(f"{head} in this process with this callback: this second fit starts a new run from the "
                           f"model's current weights and trains epochs={epochs} (its checkpoints are numbered after "
                           f"global batch {peek.number}), as a second fit does without ChiefCheckpoint.")
            return "new", None
        if self.on_completed == "error":
            raise RunCompletedError(f"{head}; on_completed='error'. To get its final state back pass "
                                    f"on_completed='restore'; to train again, pass on_completed='restart' (a new run "
                                    "in this directory) or give ChiefCheckpoint a new directory.")
        if self.on_completed == "restart":
            self._announce(f"{head}; on_completed='restart': starting a new run here from the model's current "
                           f"weights (its checkpoints are numbered after global batch {peek.number}; the completed "
                           "run's are rotated out as it saves).")
            return "new", None
        if done["reason"] == "epochs" and epochs is not None and int(epochs) > done["epoch"]:
            # what was asked (more epochs): routine news, like a resume
            self._say(f"{head}; epochs={epochs} continues it from that checkpoint at epoch {done['epoch'] + 1}.")
            return True, None
        changes = self._lr_changes(peek.config)
        if changes:
            def show(lr: Any, other: Any = None) -> str:
                if isinstance(lr, str):
                    return short_schedule(lr, other)
                return "a schedule" if lr is None else f"{float(lr):g}"

            def name(path: str) -> str:
                return "learning_rate" if path == "optimizer" else f"{path}'s learning_rate"

            was = ", ".join(f"{name(p)} {show(a, b)}" for p, a, b in changes)
            now = ", ".join(f"{show(b, a)}" + ("" if p == "optimizer" else f" ({p})") for p, a, b in changes)
            raise RunCompletedError(
                f"{head} with {was}; this fit sets {now}: a different configuration "
                f"would not be trained (restoring the completed run trains 0 epochs). To train it, {options}; to get "
                f"the completed run back, set the learning rate as it was ({', '.join(show(a, b) for _, a, b in changes)}).")
        more = " (a larger epochs= continues it)" if done["reason"] == "epochs" else ""
        self._announce(f"{head}: restoring its final state and training 0 epochs. To train again{more}, {options}.")
        return True, done

    def _own_weights_only_run(self, peek: _Peek) -> bool:
        """``peek`` was written by a run that ``restore="weights_only"`` started (it records the checkpoint it took
        its weights from) with this fit's configuration: the same optimizer classes and learning rate."""
        source = peek.config.get("weights_from")
        if not isinstance(source, int) or isinstance(source, bool) or peek.number <= source:
            return False
        if peek.config.get("learning_rate") != self._lr_at_start or self._lr_changes(peek.config):
            return False
        theirs = {p: e.get("class") for p, e in (peek.signature.get("optimizers") or {}).items()
                  if isinstance(e, dict)}
        ours = {p: e["class"] for p, e in training_state.signature(self.model)["optimizers"].items()}
        return theirs == ours
