"""Touch, in the background, the memory the first saves of a run will write into.

Measured on this project's machines (a virtual machine): writing a checkpoint's bytes into memory the process has
not used before costs about 2 ms per MB more than writing them into memory that was used and freed, because the
machine backs a page with real memory only when it is first touched. A run's first ``max_to_keep + 1`` saves all
write new files while the older checkpoints are still kept, so each pays that price on the training thread
(72 MB: 220-310 ms for the first two saves, 50 ms for later ones, which reuse the pages of deleted checkpoints).
:func:`warm_memory` touches that much memory once, in a daemon thread, when the checkpoint is set up, and gives it
back: the first saves then find pages already backed (72 MB: 65-100 ms). It never blocks training and never holds
more than a quarter of the memory available now (and at most :data:`MAX_WARM_BYTES`); on a machine where first
touch is cheap it costs only that thread's few hundred milliseconds of CPU.

ChiefCheckpoint starts it once per fit (:class:`WarmupMixin`): after its fit-start restore, which it would slow
down, or after the first step for a model that gets its variables there.

Example:
    thread = warm_memory(planned_bytes(checkpoint_nbytes(variables), max_to_keep=3, available=available_bytes()))
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional

import numpy as np

__all__ = ["WarmupMixin", "MAX_WARM_BYTES", "PAGE_BYTES", "checkpoint_nbytes", "planned_bytes", "available_bytes", "warm_memory"]

MAX_WARM_BYTES = 2 * 2**30  # never touch more than this, whatever the checkpoint
PAGE_BYTES = 4096  # one write per page is what makes the machine back it


def checkpoint_nbytes(variables: Dict[str, Any]) -> int:
    """Bytes of the numeric values of ``variables`` (``{key: variable}``, Keras or TensorFlow): about what one
    checkpoint's data file holds.

    Example:
        >>> import keras, tensorflow as tf
        >>> checkpoint_nbytes({"w": keras.Variable(tf.zeros([256, 4])), "step": tf.Variable(0, dtype=tf.int64)})
        4104
    """
    total = 0
    for variable in variables.values():
        dtype = getattr(variable, "dtype", None)
        dtype = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
        if dtype.kind in "biufc":  # (strings are a few bytes of bookkeeping)
            total += int(np.prod(tuple(variable.shape), dtype=np.int64)) * dtype.itemsize
    return total


def available_bytes() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (``None`` where it cannot be read: no warming then).

    Example:
        >>> available_bytes() is None or available_bytes() > 0
        True
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def planned_bytes(checkpoint_bytes: int, max_to_keep: int, available: Optional[int] = None) -> int:
    """How much memory to touch for the first saves of a run: ``max_to_keep + 1`` checkpoints (each written while
    the older ones are kept), at most a quarter of ``available`` memory and :data:`MAX_WARM_BYTES`; 0 when the
    available memory is unknown.

    Example:
        >>> planned_bytes(100 * 2**20, max_to_keep=1, available=64 * 2**30) // 2**20
        200
        >>> planned_bytes(100 * 2**20, max_to_keep=1, available=400 * 2**20) // 2**20
        100
    """
    if available is None or checkpoint_bytes <= 0:
        return 0
    return int(min(checkpoint_bytes * (max(int(max_to_keep), 1) + 1), available // 4, MAX_WARM_BYTES))


def _touch(nbytes: int) -> None:
    try:
        pages = np.empty(nbytes, dtype=np.uint8)
        pages[::PAGE_BYTES] = 1  # (numpy lets other threads run during the fill)
        del pages  # a buffer this large is its own mapping: freed, its pages go back to the system, backed
    except MemoryError:
        pass


def warm_memory(nbytes: int) -> Optional[threading.Thread]:
    """Touch ``nbytes`` of memory once in a daemon thread and free it; the thread (``None`` when ``nbytes`` is 0).

    Example:
        >>> warm_memory(8 * 2**20).join()
        >>> warm_memory(0) is None
        True
    """
    if nbytes <= 0:
        return None
    thread = threading.Thread(target=_touch, args=(int(nbytes),), name="keras_scale-checkpoint-warmup", daemon=True)
    thread.start()
    return thread


class WarmupMixin:
    """ChiefCheckpoint's part: start :func:`warm_memory` once per fit, on the chief, for a local directory.

    Example:
        self._warmup = None                  # at fit start (ChiefCheckpoint.on_train_begin), then:
        self._warm_up_once()                 # after the restore; again after the first step if nothing was built
    """

    _warmup: Any = None  # None: not started in this fit; False: nothing to touch; else the thread

    def _warm_up_once(self) -> None:
        from keras_scale import state as training_state
        from keras_scale.storage import _is_local

        if self._warmup is not None:
            return
        if not (getattr(self, "_chief", False) and _is_local(self.directory)):
            self._warmup = False
            return
        nbytes = checkpoint_nbytes(training_state.variables(self.model))
        if nbytes and any(getattr(v, "built", True) for v in training_state.optimizers(self.model).values()):
            self._warmup = warm_memory(planned_bytes(nbytes, self.max_to_keep, available_bytes())) or False
