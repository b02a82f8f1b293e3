"""Part 1 of the composed step, **accumulation**: split the batch, forward+backward per micro-batch, sum.

The batch ``fit`` delivers is split into ``accum`` near-equal micro-batches (or micro-batches of
``micro_batch_size``); each runs forward and backward on its own (one micro-batch's activations alive at a time)
and its gradient, weighted by its share of the batch's loss normaliser, is added up. Unrolled (synchronized
BatchNorm, XLA, ``unroll=True``) or in a ``tf.while_loop``. Unsplit (no ``wrap``), one micro-batch is the whole batch.
Also counts non-finite losses and predictions for the guard, and what each micro-batch adds to the logged losses.

Example:
    >>> import tensorflow as tf
    >>> [int(t) for t in _split_bounds(tf.constant(7), tf.constant(3), tf.constant(0))]   # start, size
    [0, 3]
"""
from __future__ import annotations

import functools
import math
from typing import Any, List, Optional, Tuple

import keras
import tensorflow as tf
from keras.src.losses import loss as keras_loss

from keras_scale.model_kind import overrides
from keras_scale.step.model_checks import _has_synchronized_batchnorm
from keras_scale.step.numerics import _dense, _flat, _nonfinite_count, _read, _replicas
from keras_scale.step.optimizer_switches import _LOCAL


def _split_bounds(batch_size: tf.Tensor, num_micro: tf.Tensor, k: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """Start and size of micro-batch ``k`` when ``batch_size`` is split into ``num_micro`` near-equal parts."""
    base = batch_size // tf.maximum(num_micro, 1)
    rem = batch_size % tf.maximum(num_micro, 1)
    start = tf.minimum(k * base + tf.minimum(k, rem), batch_size)
    size = base + tf.cast(k < rem, batch_size.dtype)
    # an unrolled loop traces ``accum`` micro-batches; a batch smaller than accum has fewer: the surplus ones are
    # empty (size 0: no forward pass, no BatchNorm update, no loss, no gradient), never "size 1" of an empty slice
    return start, tf.where(k < num_micro, size, tf.zeros_like(size))


def _slice(structure: Any, start: tf.Tensor, size: tf.Tensor) -> Any:
    return tf.nest.map_structure(lambda t: None if t is None else t[start:start + size], structure)


class AccumulateMixin:
    """The accumulation part of :class:`keras_scale.step.ComposedStep` (methods on the step: they read its
    configuration, ``self.accum`` / ``self.micro_batch_size`` / ``self.unrolled``)."""

    def _accumulate(self, x, y, sample_weight, batch_size):
        """``sum_k f_k grad(loss_k)`` over micro-batches (``f_k``: the micro-batch's share, see ``_all_reduce``).

        Returns the gradients, the trainable variables, the summed share (``None`` when no output is masked: it
        is 1), and the non-finite counts of loss and predictions.
        """
        model = self.model
        self._masked = False
        if not self.splits:
            grads, share, loss, y_pred, _ = self._micro_step(x, y, sample_weight, batch_size, batch_size)
            self.traced_micro_batches = 1
            weighted = self._masked and _replicas(model.distribute_strategy) > 1  # else the share was not applied
            pred_bad = functools.partial(self._pred_bad, y_pred)  # (counted in the diagnosis cond: bad steps only)
            return (grads, list(model.trainable_weights), share if weighted else None,
                    self._loss_bad(loss, batch_size), pred_bad, None)

        if any(not layer.built for layer in model._flatten_layers()):
            model(_slice(x, 0, 1), training=False)  # create the variables outside the micro-batch loop
        trainable = list(model.trainable_weights)
        if self.accum is not None:
            num_micro_static: Optional[int] = self.accum
            # a trailing (or per-replica) batch smaller than accum is split into fewer micro-batches; the
            # configured batch size is checked against accum at fit start (AccumulatingModel.fit)
            num_micro = tf.minimum(tf.constant(self.accum, batch_size.dtype), batch_size)
        else:
            mbs = self.micro_batch_size
            num_micro = (batch_size + mbs - 1) // mbs
            static_b = tf.get_static_value(batch_size)
            num_micro_static = None if static_b is None else int(math.ceil(static_b / mbs))

        unrolled = self.unrolled
        sync_bn = _has_synchronized_batchnorm(model)
        if unrolled is None:
            unrolled = sync_bn or bool(model.jit_compile)

        if unrolled:
            if num_micro_static is None:
                raise ValueError(
                    "keras_scale.wrap(micro_batch_size=...) with unroll=True, synchronized BatchNorm or jit_compile "
                    "needs a static batch size; batch with drop_remainder=True or use wrap(model, accum=N).")
            self.traced_micro_batches = num_micro_static
            if sync_bn:  # its all-reduce cannot sit in a cond: every micro-batch must hold a sample
                tf.debugging.assert_greater_equal(
                    batch_size, tf.constant(num_micro_static, batch_size.dtype),
                    message=f"keras_scale.wrap: with synchronized BatchNorm every per-replica batch needs "
                            f">= {num_micro_static} samples (one per micro-batch); batch with drop_remainder=True.")
            acc: List[Any] = [None] * len(trainable)
            count, loss_bad, pred_bad = tf.constant(0.0), tf.constant(0.0), tf.constant(0.0)
            stats = tf.zeros([self._num_log_stats()])
            deps: List[Any] = []
            # a compute_metrics of the model's own may return logs of its own: the last (non-empty) micro-batch
            # runs outside the conds, where what it returns can reach the step's logs
            peel = overrides(getattr(model, "inner", model), "compute_metrics")
            for k in range(num_micro_static + (1 if peel else 0)):
                last = peel and k == num_micro_static
                if peel and sync_bn and k == num_micro_static - 1:
                    continue  # (every micro-batch holds a sample: this one is the last, run below)
                with tf.control_dependencies(deps):  # one micro-batch's activations alive at a time
                    index = num_micro - 1 if last else tf.constant(k, batch_size.dtype)
                    start, size = _split_bounds(batch_size, num_micro, index)
                    start = tf.identity(start)
                if last:
                    _LOCAL.metric_logs = None  # (made in a cond)
                grads, c, l_bad, p_bad, st = self._guarded_micro_step(
                    _slice(x, start, size), _slice(y, start, size), _slice(sample_weight, start, size), size,
                    batch_size, trainable, skip_empty=not sync_bn and not last,
                    before_last=index < num_micro - 1 if peel and not last else None)
                acc = [a if g is None else (_dense(g) if a is None else a + _dense(g)) for a, g in zip(acc, grads)]
                count, loss_bad, pred_bad, stats = count + c, loss_bad + l_bad, pred_bad + p_bad, stats + st
                deps = [a for a in acc if a is not None]
            if not peel:
                _LOCAL.metric_logs = None  # (made in a cond)
            return acc, trainable, count if self._masked else None, loss_bad, pred_bad, stats

        self.traced_micro_batches = None  # dynamic (tf.while_loop)
        none_grads: set = set()

        def body(k, acc, count, loss_bad, pred_bad, stats):
            start, size = _split_bounds(batch_size, num_micro, k)
            grads, c, loss, y_pred, st = self._micro_step(
                _slice(x, start, size), _slice(y, start, size), _slice(sample_weight, start, size), size, batch_size)
            new_acc = []
            for i, (a, g) in enumerate(zip(acc, grads)):
                if g is None:
                    none_grads.add(i)
                    new_acc.append(a)
                else:
                    new_acc.append(a + tf.cast(_dense(g), a.dtype))
            return (k + 1, new_acc, count + c, loss_bad + self._loss_bad(loss, size),
                    pred_bad + self._pred_bad(y_pred), stats + st)

        zeros = [tf.zeros(v.shape, dtype=v.dtype) for v in trainable]
        # a compute_metrics of the model's own may return logs of its own: the last micro-batch runs after the
        # loop, where what it returns can reach the step's logs (a tensor made in the loop cannot)
        peel = overrides(getattr(model, "inner", model), "compute_metrics")
        loop_vars = tf.while_loop(
            lambda k, *_: k < num_micro - (1 if peel else 0), body,
            [tf.constant(0, batch_size.dtype), zeros, tf.constant(0.0), tf.constant(0.0), tf.constant(0.0),
             tf.zeros([self._num_log_stats()])],
            parallel_iterations=1)
        _LOCAL.metric_logs = None
        if peel:
            loop_vars = body(*loop_vars)
        _, acc, count, loss_bad, pred_bad, stats = loop_vars
        acc = [None if i in none_grads else a for i, a in enumerate(acc)]
        return acc, trainable, count if self._masked else None, loss_bad, pred_bad, stats

    def _guarded_micro_step(self, x, y, sample_weight, size, batch_size, trainable, skip_empty,
                            before_last: Optional[tf.Tensor] = None):
        """One unrolled micro-batch; an empty one (batch smaller than accum) contributes nothing at all, nor one
        where ``before_last`` is False (the last micro-batch, run on its own after the others)."""
        def run():
            grads, c, loss, y_pred, stats = self._micro_step(x, y, sample_weight, size, batch_size)
            grads = [tf.zeros(v.shape, v.dtype) if g is None else tf.cast(_dense(g), v.dtype)
                     for g, v in zip(grads, trainable)]
            return grads, c, self._loss_bad(loss, size), self._pred_bad(y_pred), stats

        if not skip_empty:
            return run()

        def empty():
            return ([tf.zeros(v.shape, v.dtype) for v in trainable], tf.constant(0.0), tf.constant(0.0),
                    tf.constant(0.0), tf.zeros([self._num_log_stats()]))

        runs = size > 0 if before_last is None else tf.logical_and(size > 0, before_last)
        return tf.cond(runs, run, empty)

    def _micro_step(self, x, y, sample_weight, size, batch_size):
        """Forward + backward of one micro-batch: ``grad(f * loss)``, its share ``f`` of the replica's batch, the
        loss, the predictions and (split batches) what it adds to the logged losses (``_log_stats``)."""
        model = self.model
        optimizer = model.optimizer
        outputs = self._output_trackers() if self.splits else []
        before = [(_read(m.total), _read(m.count)) for m in outputs]
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            self._warn_batch_dependent_losses()
            scaled = optimizer.scale_loss(loss) if optimizer is not None else loss
            share = self._share(y_pred, size, batch_size)
            if self.splits or _replicas(model.distribute_strategy) > 1:
                scaled = scaled * tf.cast(share, scaled.dtype)  # <= 1: never overflows where Keras would not
        grads = tape.gradient(scaled, list(model.trainable_weights))
        # (a step the guard skips puts the trackers back: ComposedStep.train_step's snapshot)
        stats = None
        if self.splits:  # the loss trackers are recorded once per step, from these (_record_split_logs)
            stats = self._log_stats(loss, share, size, y_pred, outputs, before)
        else:
            model._loss_tracker.update_state(keras_loss.unscale_loss_for_distribution(loss), sample_weight=size)
        # (sums over samples: split-exact)
        returned = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        _LOCAL.metric_logs = returned  # (what it returns beyond the metrics' results is logged, as by Keras)
        return grads, share, loss, y_pred, stats

    def _share(self, y_pred: Any, size: tf.Tensor, batch_size: tf.Tensor) -> tf.Tensor:
        """The micro-batch's share of the replica's loss normaliser: its samples over the batch's, times its
        valid-mask fraction for a masked single-output model (Keras divides a masked loss by the valid count)."""
        share = tf.math.divide_no_nan(tf.cast(size, tf.float32), tf.cast(batch_size, tf.float32))
        outputs = _flat(y_pred)
        masks = [m for m in (getattr(t, "_keras_mask", None) for t in outputs) if m is not None]
        if masks and len(outputs) == 1:
            self._masked = True
            mask = tf.cast(masks[0], tf.float32)
            return share * tf.math.divide_no_nan(tf.reduce_sum(mask), tf.cast(tf.size(mask), tf.float32))
        if masks and (self.splits or _replicas(self.model.distribute_strategy) > 1):
            self._warn_once("masks", "keras_scale: several outputs, some masked: each masked output's loss is "
                            "normalised by its own micro-batch's valid count, so the gradient differs slightly "
                            "from the big-batch one. Single-output masked models are exact.")
        return share

    def _warn_batch_dependent_losses(self) -> None:
        if not self.splits:
            return
        call_losses = [loss for layer in self.model._flatten_layers() for loss in getattr(layer, "_losses", [])]
        if call_losses:
            self._warn_once("add_loss", "keras_scale.wrap: the model adds losses in call() (add_loss / "
                            "activity_regularizer). They are averaged over micro-batches weighted by size: exact for "
                            "a per-sample mean, but a loss that sums over the batch shrinks by 1/accum. Write such "
                            "losses as means over the batch to keep accumulation exact.")

    def _warn_non_mean_losses(self) -> None:
        losses = [loss for loss in tf.nest.flatten(getattr(self.model, "loss", None))
                  if isinstance(loss, keras.losses.Loss) and loss.reduction not in ("sum_over_batch_size", None)]
        if losses:
            self._warn_once("reduction", f"keras_scale.wrap: {losses[0].name} uses reduction={losses[0].reduction!r}; "
                            "accumulation is exact for the default 'sum_over_batch_size' (a per-sample mean), so the "
                            "update differs from big-batch training. Use the default reduction (and a custom loss "
                            "function returning a mean, not a sum).")

    @staticmethod
    def _loss_bad(loss: tf.Tensor, size: tf.Tensor) -> tf.Tensor:
        bad = tf.logical_and(tf.logical_not(tf.reduce_all(tf.math.is_finite(loss))), size > 0)
        return tf.cast(bad, tf.float32)

    def _pred_bad(self, y_pred: Any) -> tf.Tensor:
        if not self.guard:
            return tf.constant(0.0)
        return tf.add_n([_nonfinite_count(t) for t in _flat(y_pred)] or [tf.constant(0.0)])
