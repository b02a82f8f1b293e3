"""ChiefCheckpoint: all-or-nothing, chief-only, optionally asynchronous checkpoints with exact (mid-epoch) resume.

The package's parts: ``callback`` (the Keras callback: hooks and save decisions), ``directory`` (which
checkpoints a directory holds), ``lock`` (one run per directory), ``preemption`` (signals and the exit status),
``state`` (which variables a checkpoint holds), ``restore`` and ``resume`` (loading, fast-forwarding the data),
``best`` (keep_best_k), ``format`` (the synchronous file format) and ``storage`` (local path or URL).

Example:
    >>> import keras_scale as ks
    >>> model.fit(ds, epochs=90, callbacks=[ks.ChiefCheckpoint("/shared/run1/ckpt", save_freq=1000)])  # doctest: +SKIP
    >>> # killed or preempted? run the same script again: it continues at the same epoch and batch.
"""
from keras_scale.callbacks.checkpoint import format as _io
from keras_scale.callbacks.checkpoint.callback import ChiefCheckpoint, checkpoint_for
from keras_scale.callbacks.checkpoint.directory import list_checkpoints
from keras_scale.callbacks.checkpoint.lock import _LOCK_NAME, _hostname  # noqa: F401 - used by tests
from keras_scale.callbacks.checkpoint.names import CheckpointMismatchError
from keras_scale.callbacks.checkpoint.preemption import PREEMPTION_EXIT_CODE

__all__ = ["ChiefCheckpoint", "CheckpointMismatchError", "list_checkpoints", "checkpoint_for", "load_checkpoint",
           "PREEMPTION_EXIT_CODE"]

#: A reader (``has_tensor``, ``get_tensor``, ``get_variable_to_shape_map``) for a checkpoint prefix in either
#: format: synchronous saves are raw bytes + a JSON index (``format``), async ones TensorFlow's bundle.
load_checkpoint = _io.load_checkpoint
