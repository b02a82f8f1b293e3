"""Where keras_scale's numbers go: chief-only TensorBoard scalars, and Keras's ``History``.

One layout for the whole pack, the same whatever the order of the callbacks:

- TensorBoard: every keras_scale scalar goes to the ``train`` run under ``log_dir`` (the run Keras's own
  ``TensorBoard(log_dir)`` writes ``epoch_loss`` to, so they sit side by side), with tags named
  ``<piece>/<quantity_unit>`` (``host/rss_mb``, ``optimizer/learning_rate``, ``goodput/input_wait_s``), each
  written by one callback only.
- The epoch logs: keras_scale adds nothing to them (a key added in ``on_epoch_end`` would reach a ``CSVLogger`` or
  ``TensorBoard`` listed after the callback and not one listed before it, and repeat a tag keras_scale writes
  itself). Only the train step's own output, ``nan_skipped``, is there, which every callback sees, like ``loss``.
- ``History``: each callback's per-epoch figures (``host_rss_mb``, ``gpu_util_mean``, ``goodput``, ...) are added to
  the ``History`` that ``fit`` returns, at the end of ``fit`` (:class:`EpochFigures`).

Example:
    writer = ChiefScalars("runs/exp", strategy=model.distribute_strategy)
    writer.write({"nan_guard/skipped_steps": 3}, step=epoch)   # no-op on other workers / without log_dir
    writer.close()
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

from keras_scale import events
from keras_scale.distribute import is_chief

_SERIES_FN: Any = None  # one traced function for every writer, tag and fit (see ChiefScalars.write_series)


def _series_fn() -> Any:
    """A graph function writing ``values[i]`` at ``steps[i]`` for all i into the writer whose resource handle it
    is given. The writer, tag and metadata are inputs, not captures: it is traced once per process, not once per
    fit (a trace costs ~150 ms; eager ``tf.summary.scalar`` costs ~0.1-0.5 ms per point)."""
    global _SERIES_FN
    if _SERIES_FN is None:
        import tensorflow as tf
        from tensorflow.python.ops import gen_summary_ops

        @tf.function(input_signature=[tf.TensorSpec([], tf.resource), tf.TensorSpec([None], tf.int64),
                                      tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.string),
                                      tf.TensorSpec([], tf.string)], autograph=False)
        def write_points(handle, steps, values, tag, metadata):
            def body(i):
                op = gen_summary_ops.write_summary(handle, steps[i], values[i], tag, metadata)
                with tf.control_dependencies([op]):
                    return i + 1

            return tf.while_loop(lambda i: i < tf.shape(steps)[0], body, [tf.constant(0)], parallel_iterations=1)

        _SERIES_FN = write_points
    return _SERIES_FN


class EpochFigures:
    """A callback's per-epoch figures, handed to the ``History`` that ``fit`` returns when the fit ends.

    Keras's ``History`` is the last callback and sets ``model.history`` at each epoch end, so at ``on_train_end``
    ``model.history`` is this fit's; appending there puts the figures in ``history.history`` whatever the order of
    the callbacks, without touching the epoch logs that ``CSVLogger``/``TensorBoard`` read.

    Example:
        >>> figures = EpochFigures()
        >>> figures.add({"host_rss_mb": 812.0})
        >>> figures.pending
        [{'host_rss_mb': 812.0}]
    """

    def __init__(self) -> None:
        self.pending: List[Dict[str, float]] = []

    def clear(self) -> None:
        """Forget the figures of a fit that raised (Keras then skips ``on_train_end`` and returns no History)."""
        self.pending = []

    def add(self, figures: Mapping[str, float]) -> None:
        """Record one epoch's figures (call from ``on_epoch_end``)."""
        self.pending.append(dict(figures))

    def deliver(self, model: Any) -> None:
        """Append the recorded epochs to ``model.history`` (call from ``on_train_end``); nothing without an epoch."""
        rows, self.pending = self.pending, []
        history = getattr(model, "history", None)
        if not rows or not isinstance(getattr(history, "history", None), dict):
            return
        for row in rows:
            for key, value in row.items():
                history.history.setdefault(key, []).append(value)


def default_log_dir() -> Optional[str]:
    """The run directory of the running ``fit`` for a keras_scale callback given no ``log_dir``: the ``log_dir`` of
    a ``keras.callbacks.TensorBoard`` in the same callback list, else the first ``log_dir`` given to another
    keras_scale callback there (``ProfileWindow("logs")``, ``Goodput(log_dir=...)``); None outside a fit or when
    no callback names one. So one directory, as Keras's ``TensorBoard(log_dir)`` takes, holds every piece's data.

    Example:
        >>> default_log_dir() is None   # outside a fit
        True
    """
    try:
        import keras

        from keras_scale.lifecycle import innermost_fit_callbacks

        callback_list = innermost_fit_callbacks()
    except Exception:  # noqa: BLE001 - no fit on this thread's stack
        return None
    if callback_list is None:
        return None
    callbacks = list(getattr(callback_list, "callbacks", None) or [])
    for cb in callbacks:
        if isinstance(cb, keras.callbacks.TensorBoard) and getattr(cb, "log_dir", None):
            return os.fspath(cb.log_dir)
    for cb in callbacks:
        value = getattr(cb, "log_dir", None)
        if type(cb).__module__.startswith("keras_scale.") and isinstance(value, (str, os.PathLike)) and value:
            return os.fspath(value)
    return None


class ChiefScalars:
    """A TensorBoard writer that exists on the chief only (:func:`keras_scale.is_chief`) and when ``log_dir``
    is given, or, given None inside a ``fit``, when that fit's callbacks name a run directory
    (:func:`default_log_dir`); everywhere else :meth:`write` does nothing.

    Example:
        >>> ChiefScalars(None).active
        False
    """

    RUN = "train"

    def __init__(self, log_dir: Optional[str], strategy: Any = None) -> None:
        self._writer: Any = None
        if log_dir is None:
            log_dir = default_log_dir()
        self.log_dir = log_dir  # where this callback's data goes (None: nowhere)
        if log_dir is not None and is_chief(strategy):
            import tensorflow as tf

            self._writer = tf.summary.create_file_writer(os.path.join(os.fspath(log_dir), self.RUN))
            events.attach(log_dir)  # the dashboard's incident stream of this run, open while the writer is
            self._log_dir = log_dir

    @property
    def active(self) -> bool:
        return self._writer is not None

    def write(self, scalars: Mapping[str, float], step: int, flush: bool = True) -> None:
        """Write each ``tag: value`` at ``step``.

        Example:
            >>> ChiefScalars(None).write({"loss": 1.0}, step=0)
        """
        if self._writer is None:
            return
        import tensorflow as tf

        with self._writer.as_default():
            for tag, value in scalars.items():
                tf.summary.scalar(tag, value, step=step)
        if flush:
            self._writer.flush()

    def write_series(self, tag: str, steps: Sequence[int], values: Sequence[float]) -> None:
        """Write ``values[i]`` at ``steps[i]`` under ``tag``, all points in one graph call (no trace after the
        process's first call, whatever the writer, tag or fit).

        Example:
            >>> ChiefScalars(None).write_series("optimizer/learning_rate", [0, 1], [1e-3, 9e-4])
        """
        if self._writer is None or len(steps) == 0:
            return
        import numpy as np
        import tensorflow as tf
        from tensorboard.plugins.scalar import metadata as scalar_metadata

        metadata = scalar_metadata.create_summary_metadata(display_name=None, description=None)
        with tf.device("cpu:0"):
            _series_fn()(self._writer._resource, tf.constant(np.asarray(steps, np.int64)),  # noqa: SLF001
                         tf.constant(np.asarray(values, np.float32)), tf.constant(tag),
                         tf.constant(metadata.SerializeToString()))

    def close(self) -> None:
        """Flush and close (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            events.detach(self._log_dir)
