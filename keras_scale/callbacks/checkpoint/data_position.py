"""The input position as training state: the data iterator's state saved in the checkpoint, restored on resume.

A resume used to read (and drop) every batch already trained, O(position): with a ``repeat()``ed dataset the
whole stream since the fit started. A ``tf.data`` iterator can serialize its position (TensorFlow's
``SerializeIterator``: cursors, plus the contents of shuffle/prefetch buffers unless the pipeline sets
``tf.data.Options().experimental_symbolic_checkpoint``). :class:`ChiefCheckpoint` stores those bytes as one string
tensor of the same checkpoint (``keras_scale_data/iterator``: same files, same atomicity, same CRC check) and
restores them into the fresh iterator of the resumed fit, and Keras's batch loop starts at the saved batch instead
of stepping through the trained ones: a resume costs the same at batch 100 and at batch 100,000.

What cannot be saved falls back to reading the batches again (said once, at the first save, with the cost):

- a pipeline with a Python function (``py_function``, ``numpy_function``, ``from_generator``, a Keras
  ``PyDataset`` or generator): its state lives in Python;
- a state larger than :data:`MAX_STATE_BYTES` (a big shuffle buffer is saved with its contents at every save);
- a ``tf.distribute`` iterator (``MirroredStrategy``/``MultiWorkerMirroredStrategy`` with their per-device
  buffers): TensorFlow 2.21 cannot serialize those.

Keras's own pipeline for ``fit(x, y)`` on arrays shuffles with a random op (stateful, so TensorFlow refuses to
serialize it by default); its state is saved anyway: the epoch's permutation is part of the iterator's state, so
the resumed epoch reads exactly the uninterrupted run's batches.

The state carries a fingerprint of the pipeline it was taken from (:func:`pipeline_fingerprint`: its element
spec, its cardinality, each stage's type and the shapes and scalar values of its tensors, e.g. the number of
samples of ``from_tensor_slices`` or ``range``): TensorFlow restores a state into a pipeline whose dataset grew or
shrank without complaint, so :func:`restore_iterator_state` refuses a state whose fingerprint differs
(:class:`PipelineChanged`).

Example:
    state = iterator_state(iterator)          # bytes, or raises NotSaveable with the reason
    restore_iterator_state(fresh_iterator, state)
"""
from __future__ import annotations

import hashlib
import json
import sys
from typing import Any, Iterator, List, Optional

import tensorflow as tf

from keras_scale.data import pipeline_stages

__all__ = ["MAX_STATE_BYTES", "NotSaveable", "declare_saveable", "iterator_state", "restore_iterator_state", "keras_epoch_iterator",
           "skip_loop_steps", "DATA_STATE_KEY", "PipelineChanged", "pipeline_fingerprint"]

#: Largest iterator state saved with every checkpoint (bytes); above it the resume replays the data instead.
MAX_STATE_BYTES = 64 << 20

#: The checkpoint key of the saved iterator state (an empty string: none saved, the resume replays).
DATA_STATE_KEY = "keras_scale_data/iterator/.ATTRIBUTES/VARIABLE_VALUE"


#: Set on a dataset whose stateful ops (an epoch's permutation drawn from a variable) only produce values that the
#: iterator state already holds (see :func:`declare_saveable`).
SAVEABLE_ATTR = "_keras_scale_position_saveable"


def declare_saveable(dataset: Any) -> Any:
    """Mark ``dataset`` (the one handed to ``fit``) as resumable from its iterator state although TensorFlow sees
    stateful ops in it: use only where those ops' results (e.g. an epoch's permutation) are part of the state, as
    in :func:`keras_scale.fit`'s shuffled arrays. Returns ``dataset``.

    Example:
        ds = declare_saveable(indices.map(order).unbatch().batch(8))
    """
    setattr(dataset, SAVEABLE_ATTR, True)
    return dataset


class NotSaveable(Exception):
    """The data iterator's position cannot be saved; ``str()`` says why and ``fix`` what to do."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.fix = fix


class PipelineChanged(ValueError):
    """A saved data position was taken from another pipeline than the one it is restored into (e.g. its dataset
    grew or shrank between runs); ``str()`` says what differs."""


#: Prefix of a saved state that carries the pipeline's fingerprint: MAGIC + fingerprint (hex) + b"\n" + state.
_FINGERPRINT_MAGIC = b"KSDP1:"


def _scalar_or_shape(name: str, value: Any) -> Optional[List[Any]]:
    if not isinstance(value, (tf.Tensor, tf.Variable)) and not hasattr(value, "shape"):
        return None
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    try:
        dims = [d if d is None else int(d) for d in tf.TensorShape(shape).as_list()]
    except (ValueError, TypeError):
        dims = ["?"]
    if "seed" in name:  # a random seed (drawn per process where not given) is not the pipeline's identity
        return [name, dims]
    if dims == [] and isinstance(value, tf.Tensor) and value.dtype.is_integer and hasattr(value, "numpy"):
        try:
            return [name, int(value.numpy())]  # range bounds, batch and buffer sizes, take/skip counts
        except Exception:  # noqa: BLE001 - a symbolic tensor
            pass
    return [name, dims]


def pipeline_fingerprint(dataset: Any) -> str:
    """A short hash of ``dataset``'s structure: element spec, cardinality, and per stage its type and the shapes
    (scalars: the values) of its tensors, random seeds excepted. Equal for the same pipeline built again in
    another process; differs when the dataset grew or shrank (``from_tensor_slices`` of 72 samples instead of
    64), a stage was added or removed, or a batch size changed. Cheap (no graph serialized, no data hashed).

    Example:
        pipeline_fingerprint(tf.data.Dataset.range(64).batch(8)) != pipeline_fingerprint(
            tf.data.Dataset.range(72).batch(8))   # True
    """
    parts: List[Any] = []
    try:
        parts.append(int(dataset.cardinality()))
    except Exception:  # noqa: BLE001
        parts.append("?")
    parts.append(repr(getattr(dataset, "element_spec", None)))
    for ds in pipeline_stages(dataset):  # the order of the stages is part of the fingerprint
        stage: List[Any] = [type(ds).__name__]
        for name, value in sorted(vars(ds).items()):
            if name in ("_variant_tensor_attr", "_graph_attr", "_options_attr") or name.startswith("__"):
                continue
            for i, leaf in enumerate(tf.nest.flatten(value) if isinstance(value, (tuple, list, dict)) else [value]):
                item = _scalar_or_shape(f"{name}.{i}", leaf)
                if item is not None:
                    stage.append(item)
        parts.append(stage)
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def _split_state(state: bytes) -> "tuple[Optional[str], bytes]":
    """(fingerprint or None for a state saved without one, TensorFlow's serialized iterator state)."""
    state = bytes(state)
    if state.startswith(_FINGERPRINT_MAGIC):
        head, _, rest = state[len(_FINGERPRINT_MAGIC):].partition(b"\n")
        return head.decode("ascii", "replace"), rest
    return None, state


def _resource(iterator: Any) -> Any:
    """The iterator resource of a plain ``tf.data`` iterator (``iter(dataset)``); raises :class:`NotSaveable`."""
    if isinstance(iterator, tf.distribute.DistributedIterator) or hasattr(iterator, "_iterators"):
        raise NotSaveable(
            f"the data iterator is a tf.distribute iterator ({type(iterator).__name__}, which TensorFlow "
            f"{tf.__version__} cannot serialize: its per-device buffers have no saved state)",
            "nothing to change in the pipeline; the resume reads the data again up to the saved batch (the cost is "
            "the pipeline's time per batch, without training)")
    resource = getattr(iterator, "_iterator_resource", None)
    if resource is None:
        raise NotSaveable(f"the data iterator ({type(iterator).__name__}) is not a tf.data iterator",
                          "pass a tf.data.Dataset to fit")
    return resource


def iterator_state(iterator: Any, keras_arrays: bool = False) -> bytes:
    """The serialized position of ``iterator`` (a ``tf.data`` iterator) as bytes.

    ``keras_arrays``: the iterator is Keras's own pipeline over arrays (``fit(x, y)``), whose only stateful op is
    the epoch's shuffle, already materialized in the state. Raises :class:`NotSaveable` (with the reason and the
    fix) for a pipeline whose state lives in Python, a distributed iterator, or a state over
    :data:`MAX_STATE_BYTES`.

    Example:
        it = iter(tf.data.Dataset.range(10).batch(2)); next(it)
        state = iterator_state(it)   # ~2 KB
    """
    from tensorflow.python.data.ops import options as options_lib
    from tensorflow.python.ops import gen_dataset_ops

    resource = _resource(iterator)
    declared = bool(getattr(getattr(iterator, "_dataset", None), SAVEABLE_ATTR, False))
    policy = options_lib.ExternalStatePolicy.IGNORE if (keras_arrays or declared) else \
        options_lib.ExternalStatePolicy.FAIL
    try:
        variant = gen_dataset_ops.serialize_iterator(resource, external_state_policy=policy.value)
        data = tf.io.serialize_tensor(variant).numpy()
    except tf.errors.OpError as e:
        first = (str(e).split("}}")[-1].strip().splitlines() or [""])[0][:200]
        raise NotSaveable(
            f"the data pipeline holds state TensorFlow cannot save ({first}: a py_function, numpy_function, "
            "from_generator, a Keras PyDataset or generator, or another stateful op)",
            "move the Python step out of the pipeline (precompute it, or write the data as TFRecords and decode with "
            "TensorFlow ops)") from None
    if len(data) > MAX_STATE_BYTES:
        raise NotSaveable(
            f"the data iterator's state is {len(data) / 2**20:.1f} MiB (over {MAX_STATE_BYTES >> 20} MiB per "
            "save: shuffle or prefetch buffers are saved with their contents)",
            "set options = tf.data.Options(); options.experimental_symbolic_checkpoint = True; "
            "ds = ds.with_options(options) (cursors instead of buffer contents, where the pipeline allows it), or a "
            "smaller shuffle buffer")
    dataset = getattr(iterator, "_dataset", None)
    if isinstance(dataset, tf.data.Dataset):
        data = _FINGERPRINT_MAGIC + pipeline_fingerprint(dataset).encode("ascii") + b"\n" + data
    return data


def restore_iterator_state(iterator: Any, state: bytes) -> None:
    """Put ``iterator`` (a fresh ``tf.data`` iterator over the same pipeline) at the position ``state`` was taken at.

    Raises (``iterator`` unchanged) when the state was taken from another pipeline: :class:`PipelineChanged` when
    the pipeline's fingerprint differs (a dataset that grew or shrank, which TensorFlow itself would accept),
    TensorFlow's error when the state does not parse into it.

    Example:
        restore_iterator_state(iter(dataset), state)
    """
    from tensorflow.python.ops import gen_dataset_ops

    resource = _resource(iterator)
    saved_fingerprint, state = _split_state(state)
    dataset = getattr(iterator, "_dataset", None)
    if saved_fingerprint is not None and isinstance(dataset, tf.data.Dataset):
        now = pipeline_fingerprint(dataset)
        if now != saved_fingerprint:
            raise PipelineChanged(
                f"the pipeline differs from the one the position was saved from (fingerprint {now} != "
                f"{saved_fingerprint}: its length ({int(dataset.cardinality())} batches now), a stage or a "
                "size changed)")
    variant = tf.io.parse_tensor(state, tf.variant)
    if isinstance(dataset, tf.data.Dataset):
        # A state that does not fit the pipeline can fail half-way and leave the iterator broken: try a scratch
        # iterator over the same dataset first.
        gen_dataset_ops.deserialize_iterator(_resource(iter(dataset)), variant)
    gen_dataset_ops.deserialize_iterator(resource, variant)


def keras_epoch_iterator(model: Any) -> Any:
    """Keras's ``EpochIterator`` of the ``fit`` of ``model`` running in this thread (its local ``epoch_iterator``),
    or ``None`` (another Keras layout).

    Example:
        keras_epoch_iterator(model)   # inside a train_function call: a TFEpochIterator
    """
    from keras_scale.lifecycle import _is_keras_fit

    frame = sys._getframe(1)
    while frame is not None:
        if _is_keras_fit(frame.f_code):
            f_locals = frame.f_locals
            if f_locals.get("self") is model:
                it = f_locals.get("epoch_iterator")
                ok = it is not None and hasattr(it, "_epoch_iterator") and hasattr(it, "steps_per_execution")
                return it if ok else None
        frame = frame.f_back
    return None


def is_keras_array_pipeline(epoch_iterator: Any) -> bool:
    """The data of this fit are arrays that Keras itself batches and shuffles (``fit(x, y)``)."""
    try:
        from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter
    except ImportError:  # another Keras layout
        return False
    return isinstance(getattr(epoch_iterator, "data_adapter", None), ArrayDataAdapter)


def _skipping(steps: Iterator[Any], num_items: int) -> Iterator[Any]:
    for _ in range(num_items):
        try:
            next(steps)
        except StopIteration:
            return
    yield from steps


def skip_loop_steps(epoch_iterator: Any, num_items: int) -> bool:
    """Make Keras's batch loop (the running epoch of ``epoch_iterator``) skip its next ``num_items`` steps: their
    batch callbacks and train-function calls never happen, the next step Keras runs is ``num_items`` further. The
    data iterator is not read (its position is restored, or read forward, by the caller). False when this Keras's
    loop cannot be advanced so.

    Example:
        skip_loop_steps(keras_epoch_iterator(model), 999)
    """
    steps = getattr(epoch_iterator, "_epoch_iterator", None)
    if steps is None or not hasattr(steps, "__next__"):
        return False
    epoch_iterator._epoch_iterator = _skipping(steps, int(num_items))
    return True
