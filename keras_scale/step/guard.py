"""Part 3 of the composed step, the **non-finite guard**: decide bad or good, count, diagnose the first bad step.

The decision is made on reduced values (the all-reduced loss flag and gradients), so every replica takes the same
one; a ``LossScaleOptimizer``'s own overflows stay its business until its scale reaches the floor. Counters
(skipped steps, in this epoch, in a row; the halt flag) and the first bad step's diagnosis (non-finite counts per
input, target, prediction, loss and gradient: :class:`DiagnosisSlot`) live in the step's variables; the host
reads them lazily (:meth:`read_diagnosis`, :meth:`state_finite`). Applying or skipping the update is
:mod:`keras_scale.step.apply`.

Example:
    >>> DIAG_CAPACITY
    4096
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, List, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from keras_scale import state as training_state
from keras_scale.step.model_checks import is_loss_scaled
from keras_scale.step.numerics import _all_gradients_finite, _flat, _nonfinite_count, _replicas, _unique, \
    _values_finite

DIAG_CAPACITY = 4096  # slots of the first-bad-step diagnosis vector
_LOSS_SCALE_FLOOR = 1.0  # an fp16 overflow at a loss scale <= this is not the scaler's business any more


@dataclasses.dataclass(frozen=True)
class DiagnosisSlot:
    """What one entry of the step's diagnosis vector counts: non-finite values of ``label`` in ``source``.

    ``source`` is one of ``inputs``, ``targets``, ``sample_weight``, ``predictions``, ``loss``, ``gradients``;
    ``label`` names the tensor (``inputs[0]``, or a variable's path for gradients).

    Example:
        >>> DiagnosisSlot("gradients", "dense/kernel").source
        'gradients'
    """

    source: str
    label: str

    @property
    def counted(self) -> bool:
        """True when the traced value already is a count (predictions, loss), not a tensor to count."""
        return self.source in ("predictions", "loss")


class GuardMixin:
    """The guard part of :class:`keras_scale.step.ComposedStep` (its counters are the step's variables)."""

    def _forward_state_finite(self) -> tf.Tensor:
        """Whether the model's floating non-trainable variables (BatchNorm statistics, ...) are finite, as this
        replica's forward pass left them."""
        state = [v for v in _unique(list(self.model.non_trainable_variables))
                 if tf.as_dtype(keras.backend.standardize_dtype(v.dtype)).is_floating]
        return _values_finite(state) if state else tf.constant(True)

    def _decide_bad(self, optimizer: Any, any_loss_bad: tf.Tensor, reduced_grads: List[Any],
                    grads_bad: Optional[tf.Tensor] = None) -> tf.Tensor:
        if grads_bad is None:
            # (loss only: the update need not wait for every gradient; a non-finite gradient under a finite
            # loss is then applied, and NanGuard finds the non-finite state on the host)
            # (a LossScaleOptimizer waits for every gradient anyway, and its scale floor needs them: checked)
            check = self.check_gradients or is_loss_scaled(optimizer)
            grads_bad = tf.logical_not(_all_gradients_finite(reduced_grads)) if check else tf.constant(False)
        if is_loss_scaled(optimizer):
            # a gradient overflow is the loss scaler's business (it skips and lowers the scale) until the scale
            # is so low that scaling cannot be the cause: then it is an incident (else the scale collapses
            # silently and half the updates are dropped)
            dynamic_scale = getattr(optimizer, "dynamic_scale", None)  # None until the optimizer is built
            if dynamic_scale is None:
                grads_bad = tf.constant(False)
            else:
                grads_bad = tf.logical_and(grads_bad, tf.cast(dynamic_scale, tf.float32) <= _LOSS_SCALE_FLOOR)
        return tf.logical_or(any_loss_bad, grads_bad)

    def _apply_now(self, bad: tf.Tensor) -> tf.Tensor:
        if self.halt_after_consecutive <= 0:  # no policy halts in-graph: nothing to read
            return tf.logical_not(bad)
        return tf.logical_and(tf.logical_not(bad), tf.logical_not(self.halted.read_value() > 0))

    def _state(self) -> List[Any]:
        return training_state.float_variables(self.model)  # weights and every optimizer's variables

    def state_finite(self) -> bool:
        """Whether every floating weight and optimizer variable is finite: one in-graph pass, a bool to the host.

        ``NanGuard(check_gradients=False)`` lets a finite-loss step with non-finite gradients through; it and
        ``ChiefCheckpoint`` ask this before trusting (snapshotting, saving, calling good) the current state.

        Example:
            >>> import keras
            >>> from keras_scale.step import get_step
            >>> get_step(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])).state_finite()
            True
        """
        variables = self._state()
        key = tuple(id(v) for v in variables)
        if self._state_finite_fn is None or self._state_finite_fn[0] != key:
            # traced once per model (a partial, not a lambda: TF counts retraces per code object, and a loop
            # building many models would warn of "excessive retracing")
            fn = functools.partial(_values_finite, [getattr(v, "value", v) for v in variables])
            self._state_finite_fn = (key, tf.function(fn, autograph=False))
        return bool(self._state_finite_fn[1]())

    def non_finite_state(self) -> List[str]:
        """The paths of the weights and optimizer variables holding a non-finite value (reads them all).

        Example:
            >>> import keras
            >>> from keras_scale.step import get_step
            >>> get_step(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])).non_finite_state()
            []
        """
        return [getattr(v, "path", v.name) for v in self._state() if not np.isfinite(np.asarray(v.numpy())).all()]

    @property
    def loss_only(self) -> bool:
        """A guard is on in this fit and it decides on the loss alone (``NanGuard(check_gradients=False)``)."""
        self._resolve()
        return self.guard and not self.check_gradients

    def read_diagnosis(self) -> List[Tuple[DiagnosisSlot, float]]:
        """The first bad step's diagnosis since the last reset: ``(slot, non-finite count)`` for each slot > 0.

        Example:
            [(slot.label, n) for slot, n in get_step(model).read_diagnosis()]   # after a non-finite step
            # [('inputs[0]', 3.0)]
        """
        diag = self.diag.numpy()
        layout = int(round(diag[0] / max(_replicas(self.model.distribute_strategy), 1)))
        if not 1 <= layout <= len(self._layouts):
            return []
        return [(slot, float(v)) for slot, v in zip(self._layouts[layout - 1], diag[1:]) if v > 0]

    def _record(self, bad, x, y, sample_weight, pred_bad, loss_bad, local_grads, present, trainable,
                count: bool = True, diagnose: Optional[tf.Tensor] = None):
        """Update counters and, on the first bad step since the host last looked, the diagnosis vector.

        ``count=False`` (one of several optimizer updates of a foreign step): write the diagnosis only (when
        ``diagnose``, i.e. no earlier update of this step was bad); the step is counted once, by :meth:`_count`.
        """
        if count:
            self._count(bad)
        on_bad, inputs = self._on_bad(x, y, sample_weight, pred_bad, loss_bad, local_grads, present, trainable,
                                      count=count, diagnose=diagnose)
        tf.cond(bad, lambda: on_bad(inputs), lambda: tf.constant(False))

    def _on_bad(self, x, y, sample_weight, pred_bad, loss_bad, grads, present, trainable,
                count: bool = True, diagnose: Optional[tf.Tensor] = None, gradient_share: float = 1.0
                ) -> Tuple[Callable[[List[Any]], Any], List[Any]]:
        """What a bad step records (the skip counters, the first bad step's diagnosis), as ``(on_bad, inputs)``:
        ``on_bad(inputs)`` builds it from this replica's ``inputs`` (tensors only, so that a merge_call can hand each
        replica its own), inside whatever branch runs on a bad step. ``gradient_share``: what each replica's count
        of ``grads`` weighs in the diagnosis (summed over replicas): ``1/R`` when every replica counts the same
        reduced gradients."""
        slots: List[DiagnosisSlot] = []
        tensors: List[Any] = []  # what each diagnosis slot counts; counted only on a bad step

        def add(source, label, value):
            slots.append(DiagnosisSlot(source, label))
            tensors.append(value)

        for i, t in enumerate(_flat(x)[:64]):
            add("inputs", f"inputs[{i}]", t)
        for i, t in enumerate(_flat(y)[:64]):
            add("targets", f"targets[{i}]", t)
        for i, t in enumerate(_flat(sample_weight)[:16]):
            add("sample_weight", f"sample_weight[{i}]", t)
        # predictions: a count already, or (unsplit) the predictions themselves, counted on a bad step only
        add("predictions", "predictions", _flat(pred_bad.args[0]) if isinstance(pred_bad, functools.partial)
            else [pred_bad])
        add("loss", "loss", loss_bad)
        budget = DIAG_CAPACITY - 1 - len(slots)
        for i, g in zip(present[:budget], grads[:budget]):
            add("gradients", trainable[i].path, g)
        # which trace wrote the vector: a fit can reuse a function traced for other data (with/without
        # sample_weight), so the labels travel as a layout id in slot 0, not as "the latest trace's"
        self._layouts.append(slots)
        layout_id = float(len(self._layouts))
        predictions_counted = not isinstance(pred_bad, functools.partial)

        def write_diag(values):
            counts = [tf.constant(layout_id)]
            for slot, t in zip(slots, values):
                if slot.source == "predictions":
                    counts.append(t[0] if predictions_counted else tf.add_n(
                        [_nonfinite_count(p) for p in t] or [tf.constant(0.0)]))
                elif slot.source == "gradients" and gradient_share != 1.0:
                    counts.append(_nonfinite_count(t) * gradient_share)
                else:
                    counts.append(t if slot.counted else _nonfinite_count(t))
            vec = tf.stack([tf.reshape(tf.cast(c, tf.float32), []) for c in counts])
            vec = tf.pad(vec, [[0, DIAG_CAPACITY - len(counts)]])
            self.diag.assign(vec)
            return tf.constant(True)

        def on_bad(values):  # (a good step touches no counter)
            first = tf.equal(self.incidents, 0)
            if diagnose is not None:
                first = tf.logical_and(first, diagnose)
            tf.cond(first, lambda: write_diag(values), lambda: tf.constant(False))
            if count:
                self._count_bad()
            return tf.constant(True)

        return on_bad, tensors

    def _count(self, bad: tf.Tensor) -> None:
        """One step's verdict: the consecutive-bad count (policies that halt) and, when bad, the skip counters."""
        bad_i = tf.cast(bad, tf.int64)
        if self.halt_after_consecutive > 0:  # (bad steps in a row matter only to a policy that halts)
            consecutive = (self.consecutive_bad + bad_i) * bad_i
            self.consecutive_bad.assign(consecutive)
            halt = tf.cast(consecutive >= self.halt_after_consecutive, tf.int64)
            self.halted.assign(tf.maximum(self.halted, halt))

    def _count_bad(self, n: Optional[tf.Tensor] = None) -> None:
        """Count ``n`` skipped steps (default one)."""
        n = tf.constant(1, tf.int64) if n is None else n
        self.skipped_steps.assign_add(n)
        self.epoch_skipped.assign_add(n)
        self.incidents.assign_add(n)
