"""Keras's progress bar shows keras_scale's step logs only when they say something.

The composed step returns the epoch's count of skipped non-finite steps in its logs (``nan_skipped``), so that
every callback sees it like ``loss`` without a device read of its own. Keras's ``ProgbarLogger`` prints every
key of the logs; ``nan_skipped: 0.0000e+00`` on every epoch line says nothing. For the fit that runs, the
progress bar is given the logs without the keys of :data:`QUIET_WHEN_ZERO` while they are 0; every other
callback (``History``, ``CSVLogger``, ``TensorBoard``, yours) gets the logs unchanged, whatever the order of the
callbacks. Installed through :func:`keras_scale.lifecycle.patch`: the progress bar is Keras's own again when the
fit ends, however it ends.

Example:
    >>> quiet_logs({"loss": 0.25, "nan_skipped": 0})
    {'loss': 0.25}
    >>> quiet_logs({"loss": 0.25, "nan_skipped": 2})
    {'loss': 0.25, 'nan_skipped': 2}
    >>> quiet_logs({"loss": float("nan"), "nan_skipped": 1})   # a skipped first step: no loss counted yet
    {'nan_skipped': 1}
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from keras_scale import lifecycle

__all__ = ["QUIET_WHEN_ZERO", "quiet_logs", "quiet_progress_bar"]

QUIET_WHEN_ZERO = ("nan_skipped",)  # keras_scale's step logs that the progress bar shows only when not 0
_MARK = "_keras_scale_quiet"


def quiet_logs(logs: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """``logs`` without the keys of :data:`QUIET_WHEN_ZERO` whose value is 0 (a new dict; ``None`` stays ``None``).

    Example:
        >>> quiet_logs(None) is None
        True
    """
    if not logs or not any(key in logs for key in QUIET_WHEN_ZERO):
        return logs
    skipped = any(key in logs and not _is_zero(logs[key]) for key in QUIET_WHEN_ZERO)
    # after skipped steps, a metric that is NaN has counted no finite step yet (a skipped first step): not shown
    return {key: value for key, value in logs.items()
            if not (key in QUIET_WHEN_ZERO and _is_zero(value)) and not (skipped and _is_nan(value))}


def _is_nan(value: Any) -> bool:
    try:
        return bool(value != value)
    except Exception:  # noqa: BLE001 - not a number
        return False


def _is_zero(value: Any) -> bool:
    try:
        return bool(value == 0)
    except Exception:  # noqa: BLE001 - not a number: shown as Keras would
        return False


def _quiet(method: Callable[..., Any]) -> Callable[..., Any]:
    def quieted(*args: Any) -> Any:  # _update_progbar(batch, logs) / _finalize_progbar(logs)
        if args:
            args = (*args[:-1], quiet_logs(args[-1]))
        return method(*args)

    return quieted


def quiet_progress_bar(model: Any, owner: Any) -> None:
    """Quiet the ``ProgbarLogger`` of the Keras ``fit`` of ``model`` now running, for ``owner``'s fit (no-op outside
    a fit, without a progress bar, or when already done).

    Example:
        quiet_progress_bar(model, step)    # from the composed step, when Keras's fit asks for the train function
    """
    from keras.callbacks import ProgbarLogger

    callbacks = lifecycle.fit_callbacks(model)
    progbar = getattr(callbacks, "_progbar", None)
    if not isinstance(progbar, ProgbarLogger) or vars(progbar).get(_MARK):
        return
    for name in ("_update_progbar", "_finalize_progbar"):
        if callable(getattr(progbar, name, None)):
            lifecycle.patch(model, owner, progbar, name, _quiet(getattr(progbar, name)))
    lifecycle.patch(model, owner, progbar, _MARK, True)
