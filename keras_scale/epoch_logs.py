"""An epoch's logs are the ones plain Keras would log, although the composed step's logs carry ``nan_skipped``.

At an epoch's end Keras logs ``model.get_metrics_result()``, the metrics over the whole epoch aggregated over the
replicas, but only when the last step's logs have exactly the metrics' keys
(``Trainer._get_metrics_result_or_logs``); otherwise it keeps the last step's logs, which on several replicas are the
mean of each replica's own results (a Precision or an AUC over one replica's samples is not the epoch's). The
composed step's logs also carry ``nan_skipped``, so for the fit that runs the model's method is given the logs
without keras_scale's keys, and the keys are put back into what it returns. An epoch in which no step was taken
(every one skipped as non-finite) logs NaN, as its steps did (Keras's trackers would say 0.0). Installed through
:func:`keras_scale.lifecycle.patch`: Keras's own method again when the fit ends, however it ends.

Example:
    epoch_logs_as_keras(model, owner)   # at fit start, beside quiet_progress_bar
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import keras
import numpy as np

from keras_scale import lifecycle

__all__ = ["STEP_LOG_KEYS", "epoch_logs_as_keras"]

STEP_LOG_KEYS: Tuple[str, ...] = ("nan_skipped",)  # what the composed step adds to Keras's logs
_MARK = "_keras_scale_epoch_logs"


def _nothing_taken(model: Any) -> bool:
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is None:
        return False
    return float(np.sum(keras.ops.convert_to_numpy(tracker.count))) == 0


def _nan_like(value: Any) -> Any:
    array = np.asarray(value)
    return np.full(array.shape, np.nan, array.dtype) if np.issubdtype(array.dtype, np.floating) else value


def epoch_logs_as_keras(model: Any, owner: Any, nan_when_no_step: bool = True) -> None:
    """Let ``model``'s fit log the model's metric results at each epoch's end, as plain Keras does, with the composed
    step's own keys (:data:`STEP_LOG_KEYS`) kept; for ``owner``'s fit (no-op when already done for it).

    ``nan_when_no_step``: an epoch whose loss tracker counted nothing logs NaN (the composed step's trackers); False
    for a model with its own ``train_step``, whose trackers are its own (Keras's is never updated there).

    Example:
        epoch_logs_as_keras(model, get_step(model))
    """
    current = getattr(model, "_get_metrics_result_or_logs", None)
    if current is None or getattr(current, _MARK, False):
        return
    keras_method: Callable[[Any], Any] = current

    def get_metrics_result_or_logs(logs: Any) -> Any:
        if not isinstance(logs, dict) or not any(key in logs for key in STEP_LOG_KEYS):
            return keras_method(logs)
        ours: Dict[str, Any] = {key: logs[key] for key in STEP_LOG_KEYS if key in logs}
        rest = {key: value for key, value in logs.items() if key not in ours}
        result = keras_method(rest)
        if result is not rest and nan_when_no_step and _nothing_taken(model):  # the metrics' results, of an epoch that took no step
            result = {key: _nan_like(value) for key, value in result.items()}
        return {**result, **ours}

    setattr(get_metrics_result_or_logs, _MARK, True)
    lifecycle.patch(model, owner, model, "_get_metrics_result_or_logs", get_metrics_result_or_logs)
