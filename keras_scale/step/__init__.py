"""The composed train step: ONE place where everything inside a training step happens.

Parts, each switched on by the piece that needs it and otherwise free:

- **accumulation** (``keras_scale.wrap``): split the batch ``fit`` delivers into micro-batches, run
  forward+backward on one micro-batch at a time, sum the gradients;
- **one all-reduce per update**: the accumulated gradients (plus a "loss was non-finite" flag, the batch's
  loss normaliser when the replicas' batches can be uneven, and the sum of the gradients' norms when the guard checks
  them) are all-reduced once, then handed to the optimizer with its own all-reduce switched off, so
  clipping, weight decay, EMA and loss scaling see the global gradient, exactly as on one device. The gradient
  is the global mean: each micro-batch on each replica is weighted by its share of the global normaliser (its
  samples, or its valid mask entries for a masked single-output model), so uneven last batches, uneven
  replicas and masks give the big-batch gradient; with a static per-replica batch (even by construction) and
  no mask, Keras's plain sum already is that mean and the gradients are not scaled at all;
- **logged numbers**: the loss and metric trackers record what plain Keras records for the same batch (a split
  batch's loss and per-output losses once per step, from its micro-batches); a skipped step puts them back, and
  while no step of the epoch was taken every logged value is NaN;
- **non-finite guard** (``keras_scale.NanGuard``): a step whose loss or gradients are not finite applies no
  update at all (no optimizer moment, no ``iterations`` bump, BatchNorm statistics restored); every replica
  takes the same decision because it is made on reduced values; counters and a diagnosis of the first bad
  step live in variables; on one replica the update is computed ahead and only its writes wait for the decision
  (:mod:`keras_scale.deferred_update`), so it still runs beside the backward pass as in plain Keras; the epoch's
  count comes back in the step's logs (``nan_skipped``), which Keras
  already brings to the host, so no extra read per step. A model with its own ``train_step`` is guarded at its
  optimizer's ``apply`` instead (where optax's ``apply_if_finite`` sits);
- **loss scaling**: a ``LossScaleOptimizer`` scales each micro-batch, unscales once, and makes one
  finite/non-finite decision per update.

Callbacks never re-implement ``train_step``: they call :func:`get_step` and ask for parts for the fit being set
up (:meth:`ComposedStep.request`); :mod:`keras_scale.lifecycle` withdraws the request when that fit ends,
however it ends. The traced train function is cached per configuration, so switching a part on and off again
between fits does not re-trace, and a model left with no request gets Keras's own train function back.

Example:
    from keras_scale.step import get_step
    step = get_step(model)
    step.request(owner=my_callback, guard=True)   # from my_callback.set_model; withdrawn at the fit's end

The package holds one module per part, each readable alone; they meet on the step (``self``), never import each
other, and :class:`ComposedStep` (:mod:`keras_scale.step.composed`) assembles them::

    train_step.py   THE ORDER: snapshot -> accumulate -> reduce -> guard -> apply -> logs (one short method)
    accumulate.py   1. split the batch, forward+backward per micro-batch, sum with shares
    reduce.py       2. ONE all-reduce per update (gradients, loss flag, normaliser, gradient norms)
    guard.py        3. decide bad/good, counters, the first bad step's diagnosis, state_finite
    apply.py        4. apply the update or skip it (deferred writes on one replica), put the snapshot back
    logs.py         5. what Keras logs: split-batch losses once, NaN while no step was taken, nan_skipped
    foreign.py      a model with its own train_step: run it, guard at its optimizer's apply
    placement.py    which train function Keras gets: ours (cached per configuration) or its own
    composed.py     ComposedStep (configuration, requests, variables), get_step, make_train_function, rebuild
    optimizer_switches.py, model_checks.py, numerics.py   what the parts share
"""
from __future__ import annotations

from keras_scale.model_kind import has_own_compute_loss, has_own_train_step, overrides  # (callers use step.*)
from keras_scale.step.composed import ComposedStep, get_step, make_train_function, rebuild, state_variables
from keras_scale.step.guard import DIAG_CAPACITY, DiagnosisSlot
from keras_scale.step.logs import SKIPPED_LOG_KEY
from keras_scale.step.model_checks import _has_synchronized_batchnorm, check_supported, check_wrappable, \
    is_loss_scaled
from keras_scale.step.numerics import _all_gradients_finite
from keras_scale.step.optimizer_switches import _ThreadFlag

__all__ = ["ComposedStep", "get_step", "make_train_function", "rebuild", "state_variables", "overrides",
           "is_loss_scaled", "DiagnosisSlot", "DIAG_CAPACITY", "SKIPPED_LOG_KEY"]
# also reached as keras_scale.step.X (private ones by fit.py and benchmarks/nan_guard_cost.py)
_REEXPORTED = (check_supported, check_wrappable, has_own_train_step, has_own_compute_loss,
               _has_synchronized_batchnorm, _ThreadFlag, _all_gradients_finite)
