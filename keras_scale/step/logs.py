"""Part 5 of the composed step, **logged numbers**: what Keras logs for the step.

The loss and metric trackers record what plain Keras records for the same batch: a split batch's loss and
per-output losses once per step, from its micro-batches (:meth:`LogsMixin._record_split_logs`); while no step
of the epoch was taken every logged value is NaN; the epoch's skipped-step count rides along as
``nan_skipped`` (:data:`SKIPPED_LOG_KEY`), which Keras brings to the host anyway. A guarded model with its own
``train_step`` logs, for a skipped step, the previous taken step's logs (:meth:`LogsMixin._logs_of_taken_steps`).

Example:
    >>> SKIPPED_LOG_KEY
    'nan_skipped'
"""
from __future__ import annotations

from typing import Any, Callable, List, Tuple

import tensorflow as tf
from keras.src.losses import loss as keras_loss

from keras_scale.step.numerics import _flat, _read

SKIPPED_LOG_KEY = "nan_skipped"  # the step's logs: non-finite steps skipped so far in this epoch


class LogsMixin:
    """The logged-numbers part of :class:`keras_scale.step.ComposedStep`."""

    def _output_trackers(self) -> List[Any]:
        """Keras's per-output loss trackers (``<output>_loss``) of a multi-output model; ``[]`` for one output."""
        compile_loss = getattr(self.model, "_compile_loss", None)
        trackers = list(getattr(compile_loss, "metrics", None) or [])
        flat_losses = list(getattr(compile_loss, "_flat_losses", None) or [])
        if not trackers or len(trackers) != len(flat_losses) or not all(
                hasattr(m, "total") and hasattr(m, "count") for m in trackers):
            return []
        return trackers

    def _num_log_stats(self) -> int:
        return 3 + 2 * len(self._output_trackers())

    def _log_stats(self, loss: tf.Tensor, share: tf.Tensor, size: tf.Tensor, y_pred: Any, outputs: List[Any],
                   before: List[Tuple[tf.Tensor, tf.Tensor]]) -> tf.Tensor:
        """What one micro-batch adds to its step's logged losses, summed over the micro-batches of the step:
        ``[f L, f, f sum_o w_o l_o, c_1 l_1 .. c_n l_n, c_1 .. c_n]``, with ``L`` the (unscaled) loss, ``f`` the
        micro-batch's share of the batch, ``l_o`` output ``o``'s loss as Keras's per-output tracker just recorded
        it, ``w_o`` its loss weight and ``c_o`` what Keras averages it over: the micro-batch's samples, or the
        valid entries of that output's mask.
        """
        total = tf.cast(keras_loss.unscale_loss_for_distribution(loss), tf.float32)
        f = tf.cast(share, tf.float32)
        predictions = _flat(y_pred)
        weights = [1.0 if w is None else float(w) for _, _, w, _ in self.model._compile_loss._flat_losses] \
            if outputs else []
        values, counts = [], []
        for o, (tracker, (t0, c0)) in enumerate(zip(outputs, before)):
            value = tf.cast(tf.math.divide_no_nan(_read(tracker.total) - t0, _read(tracker.count) - c0), tf.float32)
            c = tf.cast(size, tf.float32)
            mask = getattr(predictions[o], "_keras_mask", None) if len(predictions) == len(outputs) else None
            if mask is not None:
                c = tf.reduce_sum(tf.cast(mask, tf.float32))
            values.append(value)
            counts.append(c)
        weighted = tf.add_n([w * v for w, v in zip(weights, values)]) if values else tf.constant(0.0)
        return tf.stack([f * total, f, f * weighted] + [c * v for c, v in zip(counts, values)] + counts)

    def _record_split_logs(self, stats: tf.Tensor, batch_size: tf.Tensor, x: Any, outputs: List[Any],
                           logged: List[Tuple[tf.Tensor, tf.Tensor]]) -> None:
        """Record a split batch's losses once, as Keras records the unsplit batch (see ``_log_stats``).

        The loss tracker gets the batch's loss weighted by its size; each per-output tracker is put back to its
        value before the step and gets the batch's loss of that output with Keras's own weight (the static batch
        size, or 1), so History, the progress bar and CSVLogger show what plain Keras shows for the same batch.
        """
        model = self.model
        n = len(outputs)
        shares = stats[1]
        if n:
            weights = [1.0 if w is None else float(w) for _, _, w, _ in model._compile_loss._flat_losses]
            per_output = tf.math.divide_no_nan(stats[3:3 + n], stats[3 + n:])
            # the outputs' losses as Keras averages them over the batch, plus the model's other terms
            # (regularizers, add_loss) as the share-weighted mean
            loss = tf.math.divide_no_nan(stats[0] - stats[2], shares) + tf.reduce_sum(
                per_output * tf.constant(weights, tf.float32))
        else:
            loss = tf.math.divide_no_nan(stats[0], shares)
        model._loss_tracker.update_state(loss, sample_weight=batch_size)
        static_batch = _flat(x)[0].shape[0]  # Keras weighs per-output losses by the static batch size, or 1
        for o, (tracker, (total, count)) in enumerate(zip(outputs, logged)):
            tracker.total.assign(total)
            tracker.count.assign(count)
            tracker.update_state(per_output[o], sample_weight=static_batch)

    def _metric_reads(self) -> List[tf.Tensor]:
        """This replica's metric (and loss tracker) values, read after this step's updates of them."""
        reads = []
        for v in self.model.metrics_variables:
            tv = getattr(v, "_value", v)
            reads.append(tv.read_value() if hasattr(tv, "read_value") else tf.convert_to_tensor(tv))
        return reads

    @staticmethod
    def _with_returned(logs: Any, returned: Any) -> Any:
        """The step's logs: the metrics' results plus what the model's ``compute_metrics`` returned beyond them
        (keras.io's ``return {**logs, "max_abs_err": ...}``), which plain Keras's ``train_step`` returns as is."""
        if not isinstance(logs, dict) or not isinstance(returned, dict):
            return logs
        extra = {key: value for key, value in returned.items() if key not in logs}
        return {**logs, **extra} if extra else logs

    def _nan_unless_a_step_was_taken(self, logs: Any) -> Any:
        """NaN for every logged value while no step of the epoch was taken (all skipped): Keras's trackers would
        show 0.0, a number plain Keras never logs for those batches (and ``ModelCheckpoint(save_best_only=True)``
        would keep that model as the best)."""
        tracker = getattr(self.model, "_loss_tracker", None)
        if tracker is None or not isinstance(logs, dict):
            return logs
        taken = _read(tracker.count) > 0

        def nan_unless_taken(value: Any) -> Any:
            t = tf.convert_to_tensor(value)
            if not t.dtype.is_floating:
                return value
            return tf.where(taken, t, tf.fill(tf.shape(t), tf.constant(float("nan"), t.dtype)))

        return tf.nest.map_structure(nan_unless_taken, logs)

    def _logs(self, logs: Any) -> Any:
        if isinstance(logs, dict):
            logs = dict(logs)
            logs[SKIPPED_LOG_KEY] = self.epoch_skipped.read_value()
        return logs

    def _logs_of_taken_steps(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn`` whose logs, when its (last) step was skipped, are those of the epoch's previous taken step.

        An own ``train_step`` may return raw per-batch values (keras.io's GANs: ``{"d_loss": loss}``), and an own
        ``compute_metrics`` values beyond the metrics, which Keras logs as they come: a skipped batch's would be
        non-finite, at the epoch's end too, where plain Keras without that batch logs the previous batch's (the
        trackers are put back on a skip: their results are the previous step's anyway). Eager ops on the
        returned tensors: no device sync.
        (With ``steps_per_execution`` > 1 the previous logs are those of the previous call.)
        """
        def train_function(iterator: Any) -> Any:
            logs = fn(iterator)
            if not isinstance(logs, dict) or SKIPPED_LOG_KEY not in logs:
                return logs
            skipped_count = logs[SKIPPED_LOG_KEY]
            previous = self.previous_logs
            if previous is not None:
                before, before_count = previous
                skipped = tf.convert_to_tensor(skipped_count) > tf.convert_to_tensor(before_count)
                kept = {}
                for key, value in logs.items():
                    old = before.get(key)
                    if key != SKIPPED_LOG_KEY and old is not None and tf.is_tensor(value) and tf.is_tensor(old) \
                            and value.dtype == old.dtype and value.shape == old.shape:
                        value = tf.where(skipped, old, value)
                    kept[key] = value
                logs = kept
            # (the first steps of an epoch, all skipped: their own logs, as Keras gives them)
            self.previous_logs = (logs, skipped_count)
            return logs

        return train_function
