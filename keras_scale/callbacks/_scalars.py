"""Chief-only TensorBoard scalars, expressed once for every keras_scale callback.

One layout for the whole pack: every keras_scale scalar goes to the ``train`` run under ``log_dir`` (the run
Keras's own ``TensorBoard`` callback writes ``epoch_loss`` to, so they sit side by side), with tags named
``<piece>/<quantity_unit>`` (``nan_guard/skipped_steps``, ``host/rss_mb``, ``optimizer/learning_rate``), each
written by one callback only.

Example:
    writer = ChiefScalars("runs/exp", strategy=model.distribute_strategy)
    writer.write({"nan_guard/skipped_steps": 3}, step=epoch)   # no-op on other workers / without log_dir
    writer.close()
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from keras_scale.distribute import is_chief


class ChiefScalars:
    """A TensorBoard writer that exists on the chief only (:func:`keras_scale.is_chief`) and when ``log_dir``
    is given; everywhere else :meth:`write` does nothing.

    Example:
        >>> ChiefScalars(None).active
        False
    """

    RUN = "train"

    def __init__(self, log_dir: Optional[str], strategy: Any = None) -> None:
        self._writer: Any = None
        if log_dir is not None and is_chief(strategy):
            import tensorflow as tf

            self._writer = tf.summary.create_file_writer(os.path.join(os.fspath(log_dir), self.RUN))

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

    def close(self) -> None:
        """Flush and close (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
