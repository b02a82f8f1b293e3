"""The keras_scale incident stream: one small JSON-lines file per run, read by the TensorBoard dashboard.

The callbacks already write TensorBoard scalars; what has no scalar shape (a NaN skip and its blamed source, a
rollback, an OOM re-split, a checkpoint save, a resume, a preemption save, a profiler verdict, the goodput of an
epoch) is recorded here, as one JSON object per line in ``<log_dir>/keras_scale/events.jsonl``:
``{"kind": "nan", "step": 5, "time": 1733.2, "pid": 42, ...fields}``. ``step`` is the optimizer update count.

Nothing to enable: a keras_scale callback given a ``log_dir`` (``NanGuard``, ``Goodput``, ``GpuMonitor``,
``LearningRateLogger``, ``HostMemoryWatch``; anything with a :class:`keras_scale.scalars.ChiefScalars`)
opens the stream of that run on the chief for the duration of its fit; :func:`record` without ``log_dir``
appends to the streams opened in the same ``fit`` (so ``ChiefCheckpoint``, which has no ``log_dir``, lands in the
run of the callbacks beside it, whatever their order: a record made in a fit before its streams are open, e.g.
``ChiefCheckpoint``'s resume at train begin when it is listed first, is written when the first one opens; a
stream left open by a fit that raised receives nothing from later fits); with ``log_dir`` it appends to that
run's stream (chief only). Without either, :func:`record` does nothing. Records are small and rare (incidents and epoch ends, never per step); each line is
written and flushed at once, so a killed run keeps everything recorded before the kill.

Example:
    >>> import tempfile
    >>> run = tempfile.mkdtemp()
    >>> record("nan", 5, log_dir=run, source="inputs")
    >>> [(e["kind"], e["step"], e["source"]) for e in read(run)]
    [('nan', 5, 'inputs')]
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

__all__ = ["record", "attach", "detach", "read", "stream_path", "STREAM_DIR", "STREAM_NAME"]

STREAM_DIR = "keras_scale"
STREAM_NAME = "events.jsonl"

_lock = threading.Lock()
_attached: Dict[str, int] = {}  # run directory -> how many open writers (ChiefScalars) point at it
# run directory -> the Keras fits it was attached in (weak references, see _current_fit; None: outside a fit); a fit that raised skips its
# callbacks' on_train_end, so its streams stay attached: records of later fits must not reach them
_attached_fits: Dict[str, List[Any]] = {}
# records made inside a fit while no stream of that fit was open: (fit, line), written when one opens
_pending: List[Any] = []
# run directory -> the fits whose last writer for it closed while they still run: the records those fits make
# afterwards (a callback's on_train_end listed after the one that closed) still reach that stream
_closed_in_fit: Dict[str, List[Any]] = {}
_MAX_PENDING = 1000


def _current_fit() -> Any:
    """The innermost Keras ``fit`` running on this thread, or None (outside a fit, another thread).

    A fit is known by a weak reference to its ``CallbackList`` (the same reference object for the same fit): never
    by its frame, which would keep a finished fit's model, data and callbacks alive in this module."""
    try:
        import weakref

        from keras_scale.lifecycle import innermost_fit_callbacks

        callbacks = innermost_fit_callbacks()
        return None if callbacks is None else weakref.ref(callbacks)
    except Exception:  # noqa: BLE001
        return None


def _on_stack(fit: Any) -> bool:
    """``fit`` (from :func:`_current_fit`) is still running on this thread's stack."""
    from keras_scale.lifecycle import fit_with_callbacks_running

    target = fit()
    return target is not None and fit_with_callbacks_running(target)


def _forget_dead_fits() -> None:
    """Inside a fit (under ``_lock``): drop the attachments and pending records of fits no longer running."""
    for key in list(_attached):
        live = [f for f in _attached_fits.get(key, []) if f is None or _on_stack(f)]
        if live:
            _attached[key], _attached_fits[key] = len(live), live
        else:
            _attached.pop(key, None)
            _attached_fits.pop(key, None)
    _pending[:] = [(f, line) for f, line in _pending if _on_stack(f)]
    for key in list(_closed_in_fit):
        live = [f for f in _closed_in_fit[key] if _on_stack(f)]
        if live:
            _closed_in_fit[key] = live
        else:
            _closed_in_fit.pop(key)


def _write(run: str, lines: List[str]) -> None:
    path = stream_path(run)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(lines))


def stream_path(log_dir: str) -> str:
    """``<log_dir>/keras_scale/events.jsonl``: where the stream of the run in ``log_dir`` lives.

    Example:
        >>> stream_path("runs/exp1")
        'runs/exp1/keras_scale/events.jsonl'
    """
    return os.path.join(os.fspath(log_dir), STREAM_DIR, STREAM_NAME)


def attach(log_dir: Optional[str]) -> None:
    """Open the stream of ``log_dir`` for :func:`record` calls without a ``log_dir`` (counted: each
    :func:`attach` needs one :func:`detach`). Callers decide chief-ness (``ChiefScalars`` attaches on the chief
    only).

    Example:
        >>> attach(None)  # nothing to open
    """
    if log_dir is None:
        return
    key = os.path.abspath(os.fspath(log_dir))
    fit = _current_fit()
    with _lock:
        if fit is not None:
            _forget_dead_fits()
        _attached[key] = _attached.get(key, 0) + 1
        _attached_fits.setdefault(key, []).append(fit)
        if fit is not None:
            mine = [line for f, line in _pending if f is fit]
            _pending[:] = [(f, line) for f, line in _pending if f is not fit]
            if mine:
                try:
                    _write(key, mine)
                except OSError:
                    pass


def detach(log_dir: Optional[str]) -> None:
    """Undo one :func:`attach` of ``log_dir``.

    Example:
        >>> detach(None)
    """
    if log_dir is None:
        return
    key = os.path.abspath(os.fspath(log_dir))
    fit = _current_fit()
    with _lock:
        count = _attached.get(key, 0) - 1
        if count > 0:
            _attached[key] = count
            fits = _attached_fits.get(key, [])
            mine = [i for i, f in enumerate(fits) if f is fit]
            if mine:
                del fits[mine[0]]
            elif fits:
                fits.pop()
        else:
            _attached.pop(key, None)
            _attached_fits.pop(key, None)
            if fit is not None:
                _closed_in_fit.setdefault(key, []).append(fit)


def _clean(value: Any) -> Any:
    """JSON-safe: numpy scalars and arrays to Python, non-finite floats to None, unknown objects to str."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "tolist"):  # numpy scalar / array, or an eager tensor's numpy()
        return _clean(value.tolist())
    if hasattr(value, "numpy"):
        try:
            return _clean(value.numpy())
        except Exception:  # noqa: BLE001
            pass
    return str(value)


def record(kind: str, step: Optional[int] = None, log_dir: Optional[str] = None, **fields: Any) -> None:
    """Append one incident ``{"kind", "step", "time", "pid", **fields}`` to the run's stream (see the module
    docstring for which stream). Never raises: a dashboard record must not end a training run.

    Args:
        kind: what happened: ``"nan"``, ``"rollback"``, ``"lr_cut"``, ``"oom_resplit"``, ``"checkpoint"``,
            ``"resume"``, ``"preemption"``, ``"worker_restart"``, ``"profile"``, ``"epoch"``, ``"fit_end"``,
            ``"gpu_advice"``.
        step: optimizer updates applied when it happened (the x axis of the loss curve), or None.
        log_dir: the run directory; None: every stream a keras_scale callback opened in this process.
        **fields: JSON-able details (numpy values and non-finite floats are converted).

    Example:
        >>> record("nan", 5, source="inputs")  # no stream open here: nothing written
    """
    try:
        if log_dir is not None:
            from keras_scale.distribute import is_chief

            if not is_chief():
                return
            targets = [os.path.abspath(os.fspath(log_dir))]
            fit = None
        else:
            fit = _current_fit()
            with _lock:
                if fit is not None:
                    _forget_dead_fits()  # what is left was attached in this fit (or in an enclosing one)
                targets = list(_attached)
                if fit is not None:  # streams this fit closed already (its on_train_end goes on)
                    targets += [k for k, fits in _closed_in_fit.items() if k not in targets
                                and any(f is fit for f in fits)]
            if not targets and fit is None:
                return
        event = {"kind": str(kind), "step": None if step is None else int(step), "time": time.time(),
                 "pid": os.getpid()}
        event.update({k: _clean(v) for k, v in fields.items() if k not in event})
        line = json.dumps(event, allow_nan=False, separators=(",", ":")) + "\n"
        with _lock:
            if not targets:  # inside a fit whose streams are not open yet: written when the first one opens
                if len(_pending) < _MAX_PENDING:
                    _pending.append((fit, line))
                return
            for run in targets:
                _write(run, [line])
    except Exception:  # noqa: BLE001 - never end a run over a dashboard record
        pass


def _lines(path: str) -> Iterator[Dict[str, Any]]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:  # junk bytes of a crash: that line skipped
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    event = json.loads(line)
                except ValueError:  # a torn last line of a killed run
                    continue
                if isinstance(event, dict) and "kind" in event:
                    yield event
    except OSError:
        return


def read(log_dir: str) -> List[Dict[str, Any]]:
    """Every record of the run in ``log_dir``, in the order written (a torn line of a killed run skipped).

    Example:
        >>> read("/nonexistent")
        []
    """
    return list(_lines(stream_path(log_dir)))
