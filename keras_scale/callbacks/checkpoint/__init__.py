"""ChiefCheckpoint: all-or-nothing, chief-only, optionally asynchronous checkpoints with exact (mid-epoch) resume.

The package's parts: ``callback`` (the Keras callback: hooks and save decisions), ``directory`` (which
checkpoints a directory holds), ``lock`` (one run per directory), ``preemption`` (signals and the exit status),
``state`` (which variables a checkpoint holds), ``restore`` and ``resume`` (loading, fast-forwarding the data),
``best`` (keep_best_k), ``boundaries`` (completion, reruns of a completed run, ``weights_only`` runs), ``errors``
(a failed save, a rerun of a completed run), ``format`` (the files: TensorFlow's tensor bundle), ``warmup`` (the first saves' memory,
touched in the background), and
``export`` (:func:`load_checkpoint` into a model by path; ``keras-scale checkpoint ls|export``).

Example:
    >>> import keras_scale as ks
    >>> model.fit(ds, epochs=90, callbacks=[ks.ChiefCheckpoint("/shared/run1/ckpt", save_freq=1000)])  # doctest: +SKIP
    >>> # killed or preempted? run the same script again: it continues at the same epoch and batch.
"""
from keras_scale.callbacks.checkpoint.callback import ChiefCheckpoint, checkpoint_for
from keras_scale.callbacks.checkpoint.directory import list_checkpoints
from keras_scale.callbacks.checkpoint.export import load_checkpoint
from keras_scale.callbacks.checkpoint.format import read_checkpoint
from keras_scale.callbacks.checkpoint.errors import CheckpointSaveError, RunCompletedError
from keras_scale.callbacks.checkpoint.names import CheckpointMismatchError
from keras_scale.callbacks.checkpoint.preemption import PREEMPTION_EXIT_CODE

__all__ = ["ChiefCheckpoint", "CheckpointMismatchError", "CheckpointSaveError", "RunCompletedError", "list_checkpoints", "checkpoint_for", "load_checkpoint",
           "read_checkpoint", "PREEMPTION_EXIT_CODE"]
