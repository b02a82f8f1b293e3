"""NanGuard: non-finite steps never reach the weights, and the user is told why.

The check runs in-graph inside the composed train step (``keras_scale.step``): a step whose loss or
gradients are not finite applies no update at all (no optimizer moment, no ``iterations`` bump, BatchNorm
statistics restored), and every replica takes the same decision. This callback switches that part on, reads
the step's counters, prints one diagnosis per incident and applies the policy.

Example:
    >>> import keras_scale as ks
    >>> guard = ks.NanGuard(policy="rollback", max_consecutive=3, lr_factor=0.5)
    >>> model.fit(ds, epochs=5, callbacks=[guard])
    >>> guard.skipped_steps, guard.reports[0].source
    (2, 'inputs')
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf

from keras_scale import step as step_lib
from keras_scale._validate import check_int
from keras_scale.callbacks._scalars import ChiefScalars
from keras_scale.schedules import scale_learning_rate

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
}
_ORDER = ("inputs", "targets", "sample_weight", "predictions", "loss", "gradients")


class NanGuardGaveUp(RuntimeError):
    """Raised when ``policy="rollback"`` exceeded ``max_rollbacks``."""


@dataclasses.dataclass
class NanReport:
    """One incident: where the non-finite value first appeared and the likely fix.

    Example:
        >>> report = guard.reports[0]
        >>> report.source, report.details[:1]
        ('inputs', ['inputs[0]: 3 non-finite values'])
    """

    epoch: int
    step: int  # optimizer updates applied before the incident
    bad_steps: int  # non-finite steps seen in this incident (since the previous check)
    source: str
    details: List[str]
    loss_scale: Optional[float]
    advice: str

    def __str__(self) -> str:
        scale = f"; loss scale {self.loss_scale:g}" if self.loss_scale is not None else ""
        where = "; ".join(self.details[:8]) + (" ..." if len(self.details) > 8 else "")
        return (f"NanGuard: {self.bad_steps} non-finite step(s) at epoch {self.epoch}, update {self.step}, skipped "
                f"(no update applied). First non-finite values in the {self.source}: {where}{scale}.\n"
                f"  Likely fix: {self.advice}")


class NanGuard(keras.callbacks.Callback):
    """Skip non-finite steps in-graph; diagnose each incident; optionally stop or roll back.

    Args:
        policy: ``"skip"`` (go on), ``"stop"`` (stop training with the weights of the last good step), or
            ``"rollback"`` (after ``max_consecutive`` bad steps in a row restore the last good state — from
            ``ChiefCheckpoint`` when present, else an in-memory snapshot — and multiply the LR by ``lr_factor``).
        max_consecutive: bad steps in a row that trigger a rollback.
        lr_factor: LR multiplier applied at each rollback (works with schedules such as ``WarmupCosine``).
        max_rollbacks: give up with :class:`NanGuardGaveUp` after this many rollbacks.
        snapshot_every_n_steps: cadence of the in-memory snapshot used by ``rollback`` without a checkpoint.
        check_every_n_steps: how often the host reads the step's counters (one scalar). Keras already converts
            the step's logs to Python every batch, so 1 costs nothing measurable; the in-graph halt keeps the
            weights safe between checks whatever the value.
        log_dir: write ``nan_guard/skipped_steps`` per epoch to TensorBoard (chief only).
        verbose: print each report.

    After training: ``skipped_steps`` (total non-finite steps), ``reports`` (one :class:`NanReport` per
    incident), ``rollbacks``; ``logs["nan_skipped"]`` holds each epoch's count.

    Example:
        >>> guard = NanGuard()
        >>> model.fit(x, y, callbacks=[guard])
        >>> print(guard.skipped_steps)
    """

    def __init__(self, policy: str = "skip", max_consecutive: int = 5, lr_factor: float = 0.5,
                 max_rollbacks: int = 3, snapshot_every_n_steps: int = 100, check_every_n_steps: int = 1,
                 log_dir: Optional[str] = None, verbose: int = 1) -> None:
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: use one of {POLICIES}")
        for name, value in (("max_consecutive", max_consecutive), ("max_rollbacks", max_rollbacks),
                            ("snapshot_every_n_steps", snapshot_every_n_steps),
                            ("check_every_n_steps", check_every_n_steps)):
            check_int(name, value, owner="NanGuard")
        if not (isinstance(lr_factor, (int, float)) and 0 < lr_factor <= 1):
            raise ValueError(f"lr_factor must be in (0, 1] (the LR is multiplied by it at a rollback), got {lr_factor!r}")
        self.policy = policy
        self.max_consecutive = max_consecutive
        self.lr_factor = float(lr_factor)
        self.max_rollbacks = max_rollbacks
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.check_every_n_steps = check_every_n_steps
        self.log_dir = log_dir
        self.verbose = verbose
        self.reports: List[NanReport] = []
        self.rollbacks = 0
        self.skipped_steps = 0
        self._epoch = 0
        self._batches = 0
        self._epoch_start_skipped = 0
        self._snapshot: Optional[List[np.ndarray]] = None
        self._snapshot_step = -1
        self._scalars: Optional[ChiefScalars] = None

    # ------------------------------------------------------------------ hooks
    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        # fit builds its train function right after creating the CallbackList (which calls set_model), so
        # switching the guard on here needs no re-trace and never replaces another callback's train function
        halt = {"skip": 0, "stop": 1, "rollback": self.max_consecutive}[self.policy]
        step = step_lib.install(model)
        if not step.guard or step.halt_after_consecutive != halt:
            step.configure(guard=True, halt_after_consecutive=halt)
            model.train_function = None

    def on_train_begin(self, logs: Optional[Dict] = None) -> None:
        step = self._step
        self.skipped_steps = int(step.skipped_steps.numpy())
        step.incidents.assign(0)
        step.halted.assign(0)
        self._scalars = ChiefScalars(self.log_dir, "nan_guard", self.model.distribute_strategy)
        if self.policy == "rollback" and self._checkpoint is None:
            self._take_snapshot()

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict] = None) -> None:
        self._epoch = epoch
        self._epoch_start_skipped = int(self._step.skipped_steps.numpy())

    def on_train_batch_end(self, batch: int, logs: Optional[Dict] = None) -> None:
        self._batches += 1
        if self._batches % self.check_every_n_steps == 0:
            self._check()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict] = None) -> None:
        self._check()
        total = int(self._step.skipped_steps.numpy())
        if logs is not None:
            logs["nan_skipped"] = total - self._epoch_start_skipped
        if self._scalars is not None:
            self._scalars.write({"nan_guard/skipped_steps": total,
                                 "nan_guard/skipped_steps_epoch": total - self._epoch_start_skipped}, step=epoch)

    def on_train_end(self, logs: Optional[Dict] = None) -> None:
        self._check(final=True)
        self.skipped_steps = int(self._step.skipped_steps.numpy())
        # switch the guard off again so a later fit without NanGuard traces the plain step
        self._step.configure(guard=False, halt_after_consecutive=0)
        step_lib.uninstall(self.model)
        self.model.train_function = None
        if self._scalars is not None:
            self._scalars.close()

    # ------------------------------------------------------------------ logic
    @property
    def _step(self) -> step_lib.ComposedStep:
        return step_lib.get_step(self.model)

    @property
    def _checkpoint(self) -> Any:
        from keras_scale.callbacks.checkpoint import checkpoint_for  # order-independent, valid from set_model on

        return checkpoint_for(self.model)

    def _check(self, final: bool = False) -> None:
        step = self._step
        incidents = int(step.incidents.numpy())
        if incidents == 0:
            if self.policy == "rollback" and self._checkpoint is None and not final:
                self._maybe_snapshot()
            return
        report = self._report(incidents)
        self.reports.append(report)
        if self.verbose:
            print(report, flush=True)
        step.diag.assign(tf.zeros_like(step.diag))
        step.incidents.assign(0)
        self.skipped_steps = int(step.skipped_steps.numpy())
        halted = int(step.halted.numpy()) > 0
        if self.policy == "stop" and not final:
            self.model.stop_training = True
            if self.verbose:
                print("NanGuard(policy='stop'): training stopped; the weights are those of the last good step.")
        elif self.policy == "rollback" and halted and not final:
            self._rollback()

    def _report(self, incidents: int) -> NanReport:
        step = self._step
        diag = step.diag.numpy()
        names = step.diag_names
        found: Dict[str, List[str]] = {k: [] for k in _ORDER}
        for name, value in zip(names, diag):
            if value <= 0:
                continue
            if name.startswith("gradient:"):
                found["gradients"].append(f"{name[len('gradient:'):]}: {int(value)} non-finite values")
            elif name in ("predictions", "loss"):
                found[name].append(f"{name}: {int(value)} non-finite value(s)")
            else:
                kind = name.split("[")[0]
                found[kind].append(f"{name}: {int(value)} non-finite values")
        source = next((k for k in _ORDER if found[k]), "gradients")
        details = found[source] or ["(values overflowed after the all-reduce)"]
        optimizer = self.model.optimizer
        scale = None
        if step_lib.is_loss_scaled(optimizer):
            scale = float(optimizer.dynamic_scale.numpy())
        return NanReport(epoch=self._epoch, step=int(optimizer.iterations.numpy()), bad_steps=incidents,
                         source=source, details=details, loss_scale=scale, advice=_ADVICE[source])

    def _state_variables(self) -> List[Any]:
        return list(self.model.variables) + list(self.model.optimizer.variables)

    def _take_snapshot(self) -> None:
        self._snapshot = [np.array(v.numpy()) for v in self._state_variables()]
        self._snapshot_step = int(self.model.optimizer.iterations.numpy())

    def _maybe_snapshot(self) -> None:
        iterations = int(self.model.optimizer.iterations.numpy())
        if iterations - self._snapshot_step >= self.snapshot_every_n_steps and int(self._step.consecutive_bad.numpy()) == 0:
            self._take_snapshot()

    def _rollback(self) -> None:
        self.rollbacks += 1
        if self.rollbacks > self.max_rollbacks:
            self.model.stop_training = True
            raise NanGuardGaveUp(
                f"NanGuard gave up after {self.max_rollbacks} rollbacks: training keeps producing non-finite "
                f"steps even at {self.lr_factor ** self.max_rollbacks:g} x the learning rate. Last report:\n"
                f"{self.reports[-1]}")
        step = self._step
        skipped = int(step.skipped_steps.numpy())  # a restore must not rewind the incident count
        source = "checkpoint"
        restored = self._checkpoint.restore_latest() if self._checkpoint is not None else None
        if restored is None:
            source = "in-memory snapshot"
            if self._snapshot is None:
                raise NanGuardGaveUp("NanGuard(policy='rollback') has no good state to roll back to.")
            for var, value in zip(self._state_variables(), self._snapshot):
                var.assign(value)
        if scale_learning_rate(self.model.optimizer, self.lr_factor):
            self.model.make_train_function(force=True)
        step.skipped_steps.assign(skipped)
        step.halted.assign(0)
        step.consecutive_bad.assign(0)
        if self.verbose:
            print(f"NanGuard: rolled back to the {source} at update {int(self.model.optimizer.iterations.numpy())}"
                  f" and multiplied the learning rate by {self.lr_factor:g} (rollback {self.rollbacks}/"
                  f"{self.max_rollbacks}).", flush=True)
