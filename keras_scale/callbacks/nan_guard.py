"""NanGuard: non-finite steps never reach the weights, and the user is told why.

The check runs in-graph inside the composed train step (``keras_scale.step``): a step whose loss or
gradients are not finite applies no update at all (no optimizer moment, no ``iterations`` bump, BatchNorm
statistics restored), and every replica takes the same decision. This callback switches that part on, reads
the step's counters, prints one diagnosis per incident and applies the policy.

Example:
    import keras_scale as ks
    guard = ks.NanGuard(policy="rollback", max_consecutive=3, lr_factor=0.5)
    model.fit(ds, epochs=5, callbacks=[guard])
    guard.skipped_steps, guard.reports[0].source      # e.g. (2, 'inputs')
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf

from keras_scale import events, lifecycle
from keras_scale import state as training_state
from keras_scale import step as step_lib
from keras_scale._validate import check_int
from keras_scale.distribute import chief_print
from keras_scale.scalars import ChiefScalars
from keras_scale.schedules import learning_rate_variable, scale_learning_rate


__all__ = ["NanGuard", "NanReport", "NanGuardGaveUp"]

POLICIES = ("skip", "stop", "rollback")

_ADVICE = {
    "inputs": "clean the data: the batch itself holds NaN/Inf. Fix the preprocessing, or drop such rows with "
              "dataset.filter(lambda x, y: tf.reduce_all(tf.math.is_finite(x))); keras_scale.data.check(ds) "
              "lints the pipeline.",
    "targets": "clean the labels: the targets hold NaN/Inf (missing values encoded as NaN?). Fill or drop them.",
    "sample_weight": "the sample weights hold NaN/Inf: fix how they are computed.",
    "predictions": "the forward pass overflowed on finite inputs: lower the learning rate or add warmup "
                   "(keras_scale.WarmupCosine; large batches need it with the linear scaling rule); under "
                   "mixed_float16 keep the output layer and the loss in float32 (dtype='float32') or use "
                   "mixed_bfloat16; look for exp/log/division in custom layers.",
    "loss": "the loss is non-finite on finite predictions: a log(0) or division in the loss; use from_logits=True "
            "with raw logits, clip probabilities, and compute the loss in float32.",
    "gradients": "the gradients overflowed: lower the learning rate or add warmup, clip with "
                 "global_clipnorm, and under float16 use loss scaling (LossScaleOptimizer) or mixed_bfloat16.",
    "weights": "a step with a finite loss applied non-finite gradients: NanGuard(check_gradients=False) checks the "
               "loss only. Use the default check_gradients=True (each such step is then skipped), or remove the "
               "cause (sqrt/norm of an all-zero vector: add an epsilon; an overflow: lower the LR, global_clipnorm).",
}
_ORDER = ("inputs", "targets", "sample_weight", "predictions", "loss", "gradients")
_DATA_SOURCES = ("inputs", "targets", "sample_weight")  # what a batch brings, whatever the state


class NanGuardGaveUp(RuntimeError):
    """Raised when ``policy="rollback"`` exceeded ``max_rollbacks``."""


@dataclasses.dataclass
class NanReport:
    """One incident: where the non-finite value first appeared and the likely fix.

    Example:
        report = guard.reports[0]              # after a fit with NanGuard that skipped a step
        report.source, report.details[:1]      # e.g. ('inputs', ['inputs[0]: 3 non-finite values'])
    """

    epoch: int  # 0-based, as Keras's hooks count; the message prints it from 1, as Keras's progress bar does
    step: int  # optimizer updates applied before the incident
    bad_steps: int  # non-finite steps seen in this incident (since the previous check)
    source: str
    details: List[str]
    loss_scale: Optional[float]
    advice: str

    def __str__(self) -> str:
        scale = f"; loss scale {self.loss_scale:g}" if self.loss_scale is not None else ""
        where = "; ".join(self.details[:8]) + (" ..." if len(self.details) > 8 else "")
        if self.source == "weights":
            return (f"NanGuard: non-finite weights at epoch {self.epoch + 1}, update {self.step} "
                    f"({self.bad_steps} non-finite step(s) skipped since the last check): {where}{scale}.\n"
                    f"  Likely fix: {self.advice}")
        return (f"NanGuard: {self.bad_steps} non-finite step(s) at epoch {self.epoch + 1}, update {self.step}, skipped "
                f"(no update applied). First non-finite values in the {self.source}: {where}{scale}.\n"
                f"  Likely fix: {self.advice}")


class NanGuard(keras.callbacks.Callback):
    """Skip non-finite steps in-graph; diagnose each incident; optionally stop or roll back.

    Args:
        policy: ``"skip"`` (go on), ``"stop"`` (stop training with the weights of the last good step; for a model
            with its own ``train_step`` each optimizer's ``apply`` is guarded on its own: the finite updates of the
            other optimizers in the bad step are applied, as its step wrote them), or
            ``"rollback"`` (after ``max_consecutive`` bad steps in a row restore the last good state — from
            ``ChiefCheckpoint`` when present, else an in-memory snapshot — and multiply the LR by ``lr_factor``).
        max_consecutive: bad steps in a row that trigger a rollback.
        lr_factor: LR multiplier applied at each rollback (works with schedules such as ``WarmupCosine``).
        max_rollbacks: give up with :class:`NanGuardGaveUp` after this many rollbacks.
        snapshot_every_n_steps: cadence (in batches) of the in-memory snapshot used by ``rollback`` without a
            checkpoint.
        log_dir: accepted for compatibility; NanGuard writes no scalar of its own: the epoch's skipped count is the
            train step's ``nan_skipped`` log, which Keras's ``TensorBoard`` writes as ``epoch_nan_skipped`` and
            ``CSVLogger`` as a column, whatever the callback order (one tag per quantity).
        verbose: print each report (chief only, on stderr: an incident).
        check_gradients: ``True`` (default): a step is skipped when its loss **or any gradient** is not finite.
            No variable changes before every gradient is checked; on one replica the update is computed
            ahead and only its writes wait (:mod:`keras_scale.deferred_update`), so it still runs beside the
            backward pass: 6-7% of a 1.8 ms MLP step on 2 CPU cores (3% at 5 ms), against ~19% with the whole
            update waiting (``benchmarks/nan_guard_cost.py``). ``False``: decide on the loss alone, known before the
            backward pass, and still skipped.
            A finite loss with non-finite gradients (``sqrt``/``norm`` at 0, an overflow in the backward pass)
            is then applied and the weights turn non-finite. What still holds: the state (weights and optimizer
            variables) is checked at every skipped step, epoch end and train end, and a non-finite one is
            reported once as source ``"weights"``; ``policy="rollback"`` rolls back at once (also at train
            end), ``"stop"`` stops and says the weights are not usable; ``ChiefCheckpoint`` never saves it,
            the rollback snapshot never keeps it.
            Under a ``LossScaleOptimizer`` (which waits for every gradient anyway) and for models with their
            own ``train_step`` the gradients are checked either way.

    No extra device-to-host read per step: the step returns the epoch's count in its logs (``nan_skipped``, which
    Keras already brings to the host for every batch and every callback, whatever their order); the host reads
    the diagnosis only when that count grows. Its gradient counts are those of the all-reduced gradient, the one the
    step would have applied (on several replicas a NaN from one replica is NaN there). The in-graph halt (``stop``, ``rollback``) keeps the weights safe
    until then. Works on any model: plain, wrapped, or with its own ``train_step`` (then checked at its
    optimizer's ``apply``: gradients only).

    After training: ``skipped_steps`` (the model's non-finite steps over its whole training, every fit and resume
    included: the count lives with the model and its checkpoints, not with this callback), ``reports`` (one
    :class:`NanReport` per incident), ``rollbacks``; ``logs["nan_skipped"]`` holds each epoch's count.

    Example:
        >>> import keras, numpy as np
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        >>> x = np.ones((8, 3)); x[2, 0] = np.nan            # one non-finite sample in the second batch
        >>> guard = NanGuard(verbose=0)
        >>> history = model.fit(x, np.ones((8, 1)), batch_size=2, callbacks=[guard], verbose=0)
        >>> guard.skipped_steps, int(model.optimizer.iterations.numpy())   # that step applied no update
        (1, 3)
    """

    def __init__(self, policy: str = "skip", max_consecutive: int = 5, lr_factor: float = 0.5,
                 max_rollbacks: int = 3, snapshot_every_n_steps: int = 100,
                 log_dir: Optional[str] = None, verbose: int = 1, check_gradients: bool = True) -> None:
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: use one of {POLICIES}")
        for name, value in (("max_consecutive", max_consecutive), ("max_rollbacks", max_rollbacks),
                            ("snapshot_every_n_steps", snapshot_every_n_steps)):
            check_int(name, value, owner="NanGuard")
        if not (isinstance(lr_factor, (int, float)) and 0 < lr_factor <= 1):
            raise ValueError(f"lr_factor must be in (0, 1] (the LR is multiplied by it at a rollback), got {lr_factor!r}")
        if not isinstance(check_gradients, (bool, np.bool_)):
            raise TypeError(f"check_gradients must be True or False, got {check_gradients!r}")
        check_gradients = bool(check_gradients)
        self.policy = policy
        self.check_gradients = check_gradients
        self.max_consecutive = max_consecutive
        self.lr_factor = float(lr_factor)
        self.max_rollbacks = max_rollbacks
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.log_dir = log_dir
        self.verbose = verbose
        self.reports: List[NanReport] = []
        self.rollbacks = 0
        self.skipped_steps = 0
        self._epoch = 0
        self._batches = 0
        self._seen_in_epoch = 0.0
        self._snapshot: Optional[Dict[str, np.ndarray]] = None
        self._snapshot_batch = -1
        self._scalars: Optional[ChiefScalars] = None
        self._fitting = False
        self._poison_reported = False  # the current non-finite state is reported (until finite or rolled back)

    # ------------------------------------------------------------------ hooks
    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        # Keras calls set_model while building the fit's callback list, before make_train_function: ask the
        # composed step for the guard for this fit; lifecycle withdraws the request however the fit ends
        lifecycle.join(model, self, undo=lambda: self._finish(model))
        halt = {"skip": 0, "stop": 1, "rollback": self.max_consecutive}[self.policy]
        step_lib.get_step(model).request(self, guard=True, halt_after_consecutive=halt,
                                         check_gradients=self.check_gradients)

    def on_train_begin(self, logs: Optional[Dict] = None) -> None:
        self._fitting = True
        self._said_diagnoses = {}  # diagnosis -> [epoch, update, times] of this fit: a repeat is said in one line
        self._poison_reported = False
        self.skipped_steps = int(self._step.skipped_steps.numpy())
        self._batches = 0
        self._snapshot, self._snapshot_batch = None, -1
        self._scalars = ChiefScalars(self.log_dir, self.model.distribute_strategy)
        if self.policy == "rollback" and self._checkpoint is None:
            self._take_snapshot()

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict] = None) -> None:
        self._epoch = epoch
        self._seen_in_epoch = 0.0
        self._step.epoch_skipped.assign(0)  # host-to-device, no sync
        self._step.previous_logs = None  # (an own train_step's last taken logs: this epoch's only)

    def on_train_batch_end(self, batch: int, logs: Optional[Dict] = None) -> None:
        self._batches += 1
        skipped = (logs or {}).get(step_lib.SKIPPED_LOG_KEY)
        if skipped is not None and skipped > self._seen_in_epoch:
            self._seen_in_epoch = skipped
            self._check()
        elif self.policy == "rollback" and self._checkpoint is None:
            self._maybe_snapshot()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict] = None) -> None:
        self._check(epoch_end=True)
        total = int(self._step.skipped_steps.numpy())
        self.skipped_steps = total
        if logs is not None and step_lib.SKIPPED_LOG_KEY not in logs:  # a foreign step returning no dict
            logs[step_lib.SKIPPED_LOG_KEY] = int(self._step.epoch_skipped.numpy())

    def on_train_end(self, logs: Optional[Dict] = None) -> None:
        self._check(final=True)
        self.skipped_steps = int(self._step.skipped_steps.numpy())
        lifecycle.leave(self.model, self)

    def on_test_end(self, logs: Optional[Dict] = None) -> None:
        # model.evaluate(..., callbacks=[guard]) calls set_model too: outside a fit, that request ends here
        if not self._fitting:
            lifecycle.leave(self.model, self)

    on_predict_end = on_test_end

    def _finish(self, model: keras.Model) -> None:
        """Undo this fit's changes on ``model`` (from on_train_end, or at its next fit if this one died)."""
        self._fitting = False
        step = step_lib.get_step(model, create=False)
        if step is not None:
            step.withdraw(self)
        if self._scalars is not None:
            self._scalars.close()
            self._scalars = None

    # ------------------------------------------------------------------ logic
    @property
    def _step(self) -> step_lib.ComposedStep:
        return step_lib.get_step(self.model)

    @property
    def _checkpoint(self) -> Any:
        from keras_scale.callbacks.checkpoint import checkpoint_for  # order-independent, valid from set_model on

        return checkpoint_for(self.model)

    def _message(self, report: NanReport) -> str:
        """The full diagnosis the first time this fit sees it; a repeat (the same bad batch every epoch) is one line
        that counts it."""
        said = vars(self).setdefault("_said_diagnoses", {})
        key = (report.source, tuple(report.details), report.advice)
        if key not in said:
            said[key] = [report.epoch, report.step, 1]
            return str(report)
        said[key][2] += 1
        epoch, step, times = said[key]
        return (f"NanGuard: {report.bad_steps} non-finite step(s) at epoch {report.epoch + 1}, update {report.step}, "
                f"skipped: the same diagnosis as at epoch {epoch + 1}, update {step} ({times} times so far).")

    def _say(self, message: str, incident: bool = False) -> None:
        chief_print(message, self.model.distribute_strategy, verbose=self.verbose, incident=incident)

    def _poisoned(self) -> bool:
        """Loss-only checking let a non-finite gradient through: the state itself is no longer finite."""
        step = self._step
        return step.loss_only and not step.state_finite()

    def _check(self, final: bool = False, epoch_end: bool = False) -> None:
        step = self._step
        incidents = int(step.incidents.numpy())
        # (loss only: the state is looked at when a step was skipped, and once per epoch: a non-finite row an
        # Embedding rarely reads never makes a run of skipped steps)
        looked = incidents > 0 or epoch_end or final
        poisoned = looked and self._poisoned()
        if looked and not poisoned:
            self._poison_reported = False  # (the state is finite again)
        if incidents == 0 and not poisoned:
            return
        blame_state = poisoned
        if poisoned and self._poison_reported and self.policy != "rollback":
            # the non-finite state already reported, not rolled back since: the steps it makes non-finite (every
            # later loss) are counted, not reported again; a step with non-finite data of its own is its own incident
            if incidents == 0 or not any(slot.source in _DATA_SOURCES for slot, _ in step.read_diagnosis()):
                self._acknowledge(step)
                return
            blame_state = False
        elif incidents == 0 and self._poison_reported:
            return  # the non-finite state already reported, not rolled back since
        self._poison_reported = poisoned
        report = self._report(incidents, blame_state)
        self.reports.append(report)
        events.record("nan", report.step, log_dir=self.log_dir, **{k: v for k, v in vars(report).items() if k != "step"})
        self._say(self._message(report), incident=True)
        self._acknowledge(step)
        halted = int(step.halted.numpy()) > 0
        if self.policy == "stop" and not final:
            self.model.stop_training = True
            self._say("NanGuard(policy='stop'): training stopped; " + (
                "the weights are NOT usable (non-finite, see above): restore a checkpoint (ChiefCheckpoint never "
                "saves a non-finite state) or train again with check_gradients=True." if poisoned else
                "the weights are those of the last good step." + (
                    " (A model with its own train_step: each optimizer's apply is guarded on its own, so the finite "
                    "updates other optimizers made in the bad step were applied.)"
                    if step_lib.has_own_train_step(self.model) else "")), incident=True)
        elif self.policy == "rollback" and poisoned and final and self.rollbacks >= self.max_rollbacks:
            # (no NanGuardGaveUp from on_train_end: the callbacks after this one must still end their fit)
            self._say("NanGuard(policy='rollback'): the state is non-finite at train end and all "
                      f"{self.max_rollbacks} rollbacks are spent: the model is NOT usable; restore a checkpoint "
                      "(ChiefCheckpoint never saves a non-finite state).", incident=True)
        elif self.policy == "rollback" and ((halted and not final) or poisoned):
            self._rollback()  # (a non-finite state even at train end: the fit must not leave the model so)

    def _acknowledge(self, step: step_lib.ComposedStep) -> None:
        """The host has seen the incidents so far: clear them and the diagnosis (the next bad step writes its own)."""
        step.diag.assign(tf.zeros_like(step.diag))
        step.incidents.assign(0)
        self.skipped_steps = int(step.skipped_steps.numpy())

    def _report(self, incidents: int, poisoned: bool = False) -> NanReport:
        step = self._step
        found: Dict[str, List[str]] = {k: [] for k in _ORDER}
        for slot, value in step.read_diagnosis():
            unit = "value(s)" if slot.counted else "values"
            found[slot.source].append(f"{slot.label}: {int(round(value))} non-finite {unit}")
        source = next((k for k in _ORDER if found[k]), "gradients")
        details = found[source] or ["(values overflowed after the all-reduce)"]
        if poisoned:
            source, details = "weights", [f"{path} holds non-finite values" for path in step.non_finite_state()]
        scaled = [o for o in training_state.optimizers(self.model).values() if step_lib.is_loss_scaled(o)]
        scale = None
        if scaled and getattr(scaled[0], "dynamic_scale", None) is not None:
            scale = float(scaled[0].dynamic_scale.numpy())
        advice = _ADVICE[source]
        if scale is not None and source == "gradients":
            advice = ("the gradients are non-finite even at loss scale " f"{scale:g}: loss scaling cannot fix "
                      "them. " + advice)
        return NanReport(epoch=self._epoch, step=training_state.iterations(self.model), bad_steps=incidents,
                         source=source, details=details, loss_scale=scale, advice=advice)

    def _take_snapshot(self) -> None:
        if self._poisoned():  # never keep a non-finite state as the one to roll back to
            return
        # the model's weights and EVERY optimizer's state (a GAN's two), as keras_scale.state defines them
        self._snapshot = training_state.TrainingState(self.model).snapshot()
        self._snapshot_batch = self._batches

    def _maybe_snapshot(self) -> None:
        if self._batches - self._snapshot_batch >= self.snapshot_every_n_steps and int(
                self._step.consecutive_bad.numpy()) == 0:
            self._take_snapshot()

    def _rollback(self) -> None:
        self._poison_reported = False
        if self.rollbacks >= self.max_rollbacks:  # (self.rollbacks: the rollbacks done, as the message says)
            self.model.stop_training = True
            raise NanGuardGaveUp(
                f"NanGuard gave up after {self.rollbacks} rollback{'' if self.rollbacks == 1 else 's'} "
                f"(max_rollbacks={self.max_rollbacks}): training keeps producing non-finite "
                f"steps even at {self.lr_factor ** self.max_rollbacks:g} x the learning rate. Last report:\n"
                f"{self.reports[-1]}")
        self.rollbacks += 1
        step = self._step
        skipped = int(step.skipped_steps.numpy())  # a restore must not rewind the incident count
        updates_before = training_state.iterations(self.model)
        optimizers = list(training_state.optimizers(self.model).values())
        source = "checkpoint"
        restored = self._checkpoint.restore_latest() if self._checkpoint is not None else None
        if restored is None:
            source = "in-memory snapshot"
            if self._snapshot is None:
                raise NanGuardGaveUp("NanGuard(policy='rollback') has no good state to roll back to.")
            # the learning rates in force now (earlier rollbacks may have lowered them) survive the restore (a
            # float LR is an optimizer variable, in the snapshot)
            keep = tuple(lr for lr in (learning_rate_variable(o) for o in optimizers) if lr is not None)
            training_state.TrainingState(self.model).restore(self._snapshot, keep=keep)
        rebuild = False
        for optimizer in optimizers:  # every optimizer the model trains with
            rebuild = scale_learning_rate(optimizer, self.lr_factor) or rebuild
        if rebuild:
            step_lib.rebuild(self.model)
        step.skipped_steps.assign(skipped)
        # the updates the restore discarded (ks.Goodput prices them as redone work)
        step.rolled_back_steps += max(0, updates_before - training_state.iterations(self.model))
        step.halted.assign(0)
        step.consecutive_bad.assign(0)
        self._say(f"NanGuard: rolled back to the {source} at update {training_state.iterations(self.model)}"
                  f" and multiplied the learning rate by {self.lr_factor:g} (rollback {self.rollbacks}/"
                  f"{self.max_rollbacks}).", incident=True)
        events.record("rollback", training_state.iterations(self.model), log_dir=self.log_dir, restored_from=source, lr_factor=self.lr_factor, rollback=self.rollbacks, discarded_steps=max(0, updates_before - training_state.iterations(self.model)))
