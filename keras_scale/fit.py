"""``keras_scale.fit``: one call from a laptop to N GPUs to N machines.

It does the plumbing around ``model.fit`` that large runs get wrong: picks the strategy (``TF_CONFIG`` / Slurm ->
``MultiWorkerMirroredStrategy``, several GPUs -> ``MirroredStrategy``), builds the model and its optimizer inside
the strategy scope, states the batch arithmetic once, batches/shards/prefetches the data for the global batch,
picks the precision policy, scales the learning rate, adds sensible callbacks, and makes Keras's own ``fit`` work
under ``MultiWorkerMirroredStrategy`` (:func:`keras_scale.distribute.patch_keras_multi_worker`).

Example:
    >>> import keras, keras_scale as ks
    >>> def build():
    ...     model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(10)])
    ...     model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
    ...     return model
    >>> history = ks.fit(build, x, y, per_replica_batch_size=64, epochs=3,
    ...                  lr_scaling=("linear", 256), checkpoint_dir="ckpt")      # doctest: +SKIP
    keras_scale: global batch 512 = 64 per replica x 8 replicas (MirroredStrategy, precision bfloat16); ...
"""
from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import keras
import numpy as np
import tensorflow as tf

from keras_scale._validate import check_int
from keras_scale.data import MAIN_CHAIN, dataset_is_batched, dataset_is_file_based, pipeline_stages
from keras_scale.callbacks.checkpoint import ChiefCheckpoint
from keras_scale.storage import Storage
from keras_scale.callbacks.goodput import Goodput
from keras_scale.callbacks.gpu_monitor import GpuMonitor
from keras_scale.callbacks.nan_guard import NanGuard
from keras_scale.distribute import chief_print, choose_strategy, is_chief, is_multi_worker, require_keras_multi_worker_fix, strategy_name

__all__ = ["fit", "batch_arithmetic", "prepare_dataset", "split_for_validation"]

log = logging.getLogger("keras_scale")

SYNC_BN_BELOW_BATCH = 16  # sync_bn="auto" synchronises BatchNorm when the per-replica batch is smaller than this

_WORKER_FAILURE_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError,
                          tf.errors.AbortedError)


# --------------------------------------------------------------------------------------------------------------
# small pieces
# --------------------------------------------------------------------------------------------------------------

def _positive_int(name: str, value: Any) -> int:
    return check_int(name, value)


def batch_arithmetic(num_replicas: int, per_replica_batch_size: Optional[int] = None,
                     global_batch_size: Optional[int] = None, accum: int = 1) -> Tuple[int, int]:
    """``(per_replica_batch_size, global_batch_size)`` with ``global = per_replica x replicas``.

    Exactly one of the two sizes must be given; a global batch must split evenly over the replicas. ``accum`` means
    what it means in :func:`keras_scale.wrap`: each replica's batch is split into ``accum`` micro-batches (one
    optimizer update per global batch, ``per_replica / accum`` samples on a device at once). It never changes the
    batch sizes, so it never changes the learning rate or a schedule's ``total_steps``; it only has to fit.

    Example:
        >>> batch_arithmetic(4, per_replica_batch_size=64, accum=2)
        (64, 256)
        >>> batch_arithmetic(4, global_batch_size=512, accum=2)
        (128, 512)
    """
    accum = _positive_int("accum", accum)
    num_replicas = _positive_int("num_replicas", num_replicas)
    if (per_replica_batch_size is None) == (global_batch_size is None):
        raise ValueError(
            "pass exactly one of per_replica_batch_size= (samples each replica gets per optimizer update) or "
            f"global_batch_size= (samples per optimizer update); got per_replica_batch_size={per_replica_batch_size!r}"
            f", global_batch_size={global_batch_size!r}."
        )
    if per_replica_batch_size is not None:
        per = _positive_int("per_replica_batch_size", per_replica_batch_size)
        glob = per * num_replicas
    else:
        glob = _positive_int("global_batch_size", global_batch_size)
        if glob % num_replicas:
            raise ValueError(
                f"global_batch_size={glob} does not split into {num_replicas} replicas: it must be a multiple of "
                f"{num_replicas}, e.g. {max(1, glob // num_replicas) * num_replicas}."
            )
        per = glob // num_replicas
    if per < accum:
        raise ValueError(
            f"accum={accum} splits each replica's batch of {per} samples into {accum} micro-batches, but a micro-batch "
            f"needs at least one sample: use accum <= {per} or a larger batch (global batch {glob} over "
            f"{num_replicas} replica(s))."
        )
    return per, glob


def _key_line(message: str) -> str:
    """The informative line of a TensorFlow runtime error (which task died), not "Graph execution error:"."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    for key in ("unhealthy", "aborted", "unreachable", "Socket closed", "Connection reset"):
        for i, line in enumerate(lines):
            if key in line:
                return " ".join(lines[i:i + 2])[:400]
    return (lines[-1] if lines else "")[:400]


def _say(message: str, verbose: Any = 1, strategy: Any = None) -> None:
    """Print on the chief (the line shows up next to Keras's progress bar) and log it on the ``keras_scale`` logger,
    once: with Keras's interactive logging off the print itself is a log record."""
    chief_print(f"keras_scale: {message}", strategy, verbose=verbose)
    if not (verbose and is_chief(strategy)) or keras.config.is_interactive_logging_enabled():
        log.info(message)


def _batch_size_of(element: Any) -> int:
    return int(np.shape(tf.nest.flatten(element)[0])[0])


def _samples_of_py_dataset(x: keras.utils.PyDataset) -> Optional[Tuple[int, int, int]]:
    """``(samples, batch size, last batch size)`` of a PyDataset of known length, read from its first and last
    batches (Keras's convention: every batch full but the last); ``None`` for an infinite or unsized one."""
    try:
        num_batches = x.num_batches
    except NotImplementedError:
        return None
    if not num_batches or num_batches <= 0:
        return None
    first = _batch_size_of(x[0])
    last = _batch_size_of(x[num_batches - 1]) if num_batches > 1 else first
    return (num_batches - 1) * first + last, first, last


_PY_DATASET_BATCH_ERROR = "ks.fit: a batch of the PyDataset differs in size"


def _check_py_dataset_batch(size: int, last: int) -> Callable[..., Any]:
    """A ``map`` function that stops at a batch of another size than the first (or the last) one, which would make
    the counted samples, hence the number of global batches, wrong."""
    def check(*element: Any) -> Any:
        got = tf.shape(tf.nest.flatten(element)[0])[0]
        with tf.control_dependencies([tf.debugging.assert_equal(
                tf.logical_or(tf.equal(got, size), tf.equal(got, last)), True,
                message=f"{_PY_DATASET_BATCH_ERROR} from its first ({size}) and last ({last}) "
                        "batches; ks.fit rebatches a PyDataset to the global batch and needs every batch full but "
                        "the last (pass a tf.data.Dataset for batches of varying size)")]):
            return element[0] if len(element) == 1 else element
    return check


_BATCH_OPS = ("_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset")


def _samples_of_batched(ds: tf.data.Dataset) -> Optional[int]:
    """How many samples a batched dataset holds, when tf.data knows: the cardinality of what its outermost batch op
    reads, provided nothing after that op changes the number of elements. ``None`` when unknown."""
    for node in pipeline_stages(ds, MAIN_CHAIN):
        name = type(node).__name__
        if name in _BATCH_OPS:
            inner = int(node._input_dataset.cardinality())
            outer = int(ds.cardinality())
            return inner if inner >= 0 and outer >= 0 and outer == int(node.cardinality()) else None
        if "Batch" in name:  # a rebatch or an unbatch: the count of samples is not visible from here
            return None
    return None


def _is_batched(ds: tf.data.Dataset) -> bool:
    """Whether ``ds`` yields batches, looking into each component of a ``zip`` (where the main chain ends): a zip
    of batched datasets is batched; a zip mixing batched and unbatched components is refused (it pairs a batch
    with a single sample)."""
    if dataset_is_batched(ds):
        return True
    root: Any = ds
    for node in pipeline_stages(ds, MAIN_CHAIN):
        name = type(node).__name__
        if "Unbatch" in name:
            return False
        if name == "_ZipDataset":
            components = tf.nest.flatten(node._datasets)
            flags = [_is_batched(c) for c in components]
            if all(flags):
                return True
            if any(flags):
                raise ValueError(
                    f"the dataset zips batched and unbatched datasets ({sum(flags)} of {len(flags)} components "
                    "batched): each element pairs a batch with single samples. Batch every component, or zip first "
                    "and batch the zipped dataset (keras_scale.fit then rebatches it to the global batch).")
            return _leading_dims_unknown(ds)
        root = node
    _refuse_ambiguous_elements(ds, root)
    return _leading_dims_unknown(ds)


_SAMPLE_SOURCES = ("_TensorSliceDataset", "RangeDataset", "TFRecordDatasetV2", "TextLineDatasetV2",
                   "FixedLengthRecordDatasetV2", "_ZipDataset")


def _refuse_ambiguous_elements(ds: tf.data.Dataset, root: Any) -> None:
    """No batch operation in sight and no source that yields samples (``from_generator``): elements whose every
    component has the same static leading dimension, ``(16, 4)`` and ``(16, 1)``, are a batch of 16 or one sample
    of 16 steps; refused, with the way to say which."""
    if any(name in type(root).__name__ for name in _SAMPLE_SOURCES):
        return
    shapes = [spec.shape for spec in tf.nest.flatten(ds.element_spec) if getattr(spec, "shape", None) is not None]
    leading = {shape[0] if shape.rank else None for shape in shapes}
    if shapes and len(leading) == 1 and None not in leading and next(iter(leading)) > 1:
        n = next(iter(leading))
        raise ValueError(
            f"keras_scale.fit cannot tell whether this dataset's elements ({', '.join(str(tuple(s)) for s in shapes)}"
            f", e.g. from tf.data.Dataset.from_generator) are batches of {n} or single samples. If they are "
            f"batches, give the batch dimension as None (output_signature=tf.TensorSpec((None, ...))) or pass "
            f"dataset.unbatch() (keras_scale.fit batches it to the global batch); if they are samples, batch it "
            f"yourself: dataset.batch(N) (keras_scale.fit rebatches it to the global batch).")


def _leading_dims_unknown(ds: tf.data.Dataset) -> bool:
    """No batch operation in sight (e.g. ``from_generator``): the elements are batches when every component's
    leading dimension is unknown (``(None, 3)``), as a batch's is; a sample's shape is known (``(3,)``)."""
    shapes = [spec.shape for spec in tf.nest.flatten(ds.element_spec) if getattr(spec, "shape", None) is not None]
    return bool(shapes) and all(shape.rank is not None and shape.rank >= 1 and shape[0] is None for shape in shapes)


def _samples_of(ds: tf.data.Dataset) -> Optional[int]:
    """:func:`_samples_of_batched`, also through a ``zip`` of batched datasets (the fewest samples of its
    components: zip stops at the shortest)."""
    samples = _samples_of_batched(ds)
    if samples is not None or type(ds).__name__ != "_ZipDataset":
        return samples
    counts = [_samples_of(c) for c in tf.nest.flatten(ds._datasets)]
    return None if not counts or any(c is None for c in counts) else min(counts)


def _check_batched_elements(ds: tf.data.Dataset) -> None:
    """A batched dataset's elements have a batch dimension: a scalar leaf means the dataset is not batched."""
    scalars = [str(spec) for spec in tf.nest.flatten(ds.element_spec)
               if getattr(spec, "shape", None) is not None and spec.shape.rank == 0]
    if scalars:
        raise ValueError(
            f"the dataset's elements hold scalars ({scalars[0]}): it looks unbatched, yet it contains a batch "
            "operation. Batch your dataset as the last step: dataset.batch(N) (keras_scale.fit rebatches it to the "
            "global batch)."
        )


def _check_same_length(**arrays: Any) -> int:
    """The common number of samples of every array in ``arrays`` (x, y, sample_weight), or a ValueError naming each."""
    lengths = {}
    for name, value in arrays.items():
        if value is None:
            continue
        for k, leaf in enumerate(tf.nest.flatten(value)):
            shape = getattr(leaf, "shape", None)
            n = int(shape[0]) if shape is not None and len(shape) else (len(leaf) if hasattr(leaf, "__len__") else 1)
            leaves = len(tf.nest.flatten(value))
            lengths[name if leaves == 1 else f"{name}[{k}]"] = n
    if len(set(lengths.values())) > 1:
        detail = ", ".join(f"{name} has {n}" for name, n in lengths.items())
        raise ValueError(
            f"x, y and sample_weight must hold the same number of samples (first dimension): {detail}. Keras refuses "
            "this too; fix the arrays (e.g. y = y[:len(x)]) rather than train on a prefix."
        )
    return next(iter(lengths.values()))


def _check_validation_split(validation_split: Any) -> None:
    if isinstance(validation_split, bool) or not isinstance(validation_split, (int, float)) or \
            not 0 < validation_split < 1:
        raise ValueError(f"validation_split must be a fraction with 0 < validation_split < 1 (as in Keras), got "
                         f"{validation_split!r}; e.g. validation_split=0.1 keeps the last 10% for validation.")


def split_for_validation(validation_split: float, x: Any, y: Any = None, sample_weight: Any = None
                         ) -> Tuple[Tuple[Any, Any, Any], Tuple[Any, Any, Any]]:
    """Split arrays as Keras's ``validation_split`` does: the LAST ``validation_split`` fraction, before shuffling.

    Returns ``((x, y, sample_weight), (x_val, y_val, sample_weight_val))``.

    Example:
        >>> (x_tr, _, _), (x_val, _, _) = split_for_validation(0.25, np.arange(8))
        >>> x_tr.tolist(), x_val.tolist()
        ([0, 1, 2, 3, 4, 5], [6, 7])
    """
    _check_validation_split(validation_split)
    if not _is_array_structure(x):
        raise ValueError(
            f"validation_split works on arrays only (as in Keras), not on {type(x).__name__}: pass "
            "validation_data=(x_val, y_val) or a validation tf.data.Dataset instead."
        )
    n = _check_same_length(x=x, y=y, sample_weight=sample_weight)
    split_at = int(np.floor(n * (1.0 - validation_split)))
    if split_at == 0 or split_at == n:
        raise ValueError(f"validation_split={validation_split} of {n} samples leaves "
                         f"{'no training' if split_at == 0 else 'no validation'} samples: use a fraction that keeps "
                         "both non-empty.")

    def part(data: Any, sl: slice) -> Any:
        return None if data is None else tf.nest.map_structure(lambda a: a[sl], data)

    head, tail = slice(0, split_at), slice(split_at, None)
    return ((part(x, head), part(y, head), part(sample_weight, head)),
            (part(x, tail), part(y, tail), part(sample_weight, tail)))


def _shard_and_prefetch(ds: tf.data.Dataset, file_based: bool) -> Tuple[tf.data.Dataset, str]:
    options = tf.data.Options()
    current = ds.options().experimental_distribute.auto_shard_policy
    if current != tf.data.experimental.AutoShardPolicy.AUTO:
        policy_name = f"{current.name} (set by you)"
    elif file_based:
        # TF's AUTO shards by file and falls back to DATA when there are fewer files than workers
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.AUTO
        policy_name = "FILE (AUTO: by file, DATA if fewer files than workers)"
    else:
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        policy_name = "DATA"
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE), policy_name


def prepare_dataset(x: Any, y: Any = None, sample_weight: Any = None, *, global_batch_size: int,
                    shuffle: bool = True, drop_remainder: bool = False, seed: int = 1234,
                    epoch_variable: Optional[tf.Variable] = None) -> Tuple[tf.data.Dataset, str]:
    """A ``tf.data.Dataset`` of global batches for ``model.fit`` under any strategy, and a one-line description.

    - arrays (NumPy, tensors, dicts/tuples of them): shuffled with a fixed ``seed`` (every worker must shuffle
      identically for DATA sharding to split the data), batched to ``global_batch_size``. With ``epoch_variable``
      (an int variable :func:`fit` sets at each epoch begin) the order is a pure function of ``(seed, epoch)``:
      a resumed run (``ChiefCheckpoint``) sees exactly the batches the interrupted run would have seen;
    - ``tf.data.Dataset``: batched if unbatched, else rebatched to ``global_batch_size``;
    - ``keras.utils.PyDataset``: turned into a ``tf.data.Dataset`` by Keras's adapter, then rebatched.

    Auto-shard policy: FILE for file-based pipelines (TFRecord/TextLine/interleave), DATA otherwise (a policy you set
    yourself is kept); prefetched with AUTOTUNE. ``tf.distribute`` splits each global batch over the replicas.

    Example:
        >>> ds, how = prepare_dataset(np.zeros((10, 3)), np.zeros((10,)), global_batch_size=4, shuffle=False)
        >>> [int(b[0].shape[0]) for b in ds]
        [4, 4, 2]
    """
    global_batch_size = _positive_int("global_batch_size", global_batch_size)
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise ValueError("x is a tf.data.Dataset, so y/sample_weight must be None: put them in the dataset's "
                             "elements as (x, y) or (x, y, sample_weight).")
        file_based = dataset_is_file_based(x)
        if _is_batched(x):
            _check_batched_elements(x)
            samples = _samples_of(x)
            ds = x.rebatch(global_batch_size, drop_remainder=drop_remainder)
            if samples is not None:  # rebatch forgets the cardinality; Keras then warns "ran out of data"
                batches = samples // global_batch_size if drop_remainder else -(-samples // global_batch_size)
                ds = ds.apply(tf.data.experimental.assert_cardinality(batches))
            how = "batched tf.data.Dataset, rebatched"
        else:
            ds = x.batch(global_batch_size, drop_remainder=drop_remainder)
            how = "unbatched tf.data.Dataset, batched"
    elif isinstance(x, keras.utils.PyDataset):
        if y is not None or sample_weight is not None:
            raise ValueError("x is a keras.utils.PyDataset, so y/sample_weight must be None: return them from "
                             "__getitem__ as (x, y) or (x, y, sample_weight).")
        from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

        ds = PyDatasetAdapter(x, shuffle=shuffle).get_tf_dataset()
        samples = _samples_of_py_dataset(x)
        if samples is not None:
            ds = ds.map(_check_py_dataset_batch(samples[1], samples[2]))
        ds = ds.rebatch(global_batch_size, drop_remainder=drop_remainder)
        if samples is not None:  # a generator has no cardinality; Keras then warns "ran out of data" each epoch
            n = samples[0]
            ds = ds.apply(tf.data.experimental.assert_cardinality(
                n // global_batch_size if drop_remainder else -(-n // global_batch_size)))
        file_based = False
        how = "PyDataset, rebatched"
    elif _is_array_structure(x):
        data = tuple(d for d in (x, y, sample_weight) if d is not None) if (y is not None or sample_weight is not None) \
            else x
        if y is None and sample_weight is not None:
            raise ValueError("sample_weight was given without y; pass y too.")
        n = _check_same_length(x=x, y=y, sample_weight=sample_weight)
        if shuffle and epoch_variable is not None:
            ds = _epoch_shuffled_batches(data, n, global_batch_size, drop_remainder, seed, epoch_variable)
        else:
            ds = tf.data.Dataset.from_tensor_slices(data)
            if shuffle:
                ds = ds.shuffle(n, seed=seed, reshuffle_each_iteration=True)
            ds = ds.batch(global_batch_size, drop_remainder=drop_remainder)
        file_based = False
        how = f"{n} samples from arrays{', shuffled' if shuffle else ''}" + (
            " (order fixed per epoch)" if shuffle and epoch_variable is not None else "") + ", batched"
        if drop_remainder and n % global_batch_size:
            how += f" ({n % global_batch_size} samples per epoch dropped: drop_remainder)"
    else:
        raise TypeError(
            f"x of type {type(x).__name__} is not supported: pass NumPy arrays/tensors (or a dict/tuple of them) "
            "with y, a tf.data.Dataset, or a keras.utils.PyDataset."
        )
    ds, policy = _shard_and_prefetch(ds, file_based)
    if shuffle and epoch_variable is not None and _is_array_structure(x):
        from keras_scale.callbacks.checkpoint.data_position import declare_saveable

        declare_saveable(ds)  # the epoch's permutation (read from the variable) is in the iterator's saved state
    return ds, f"{how} to {global_batch_size}; auto-shard {policy}; prefetch AUTOTUNE"


def _epoch_shuffled_batches(data: Any, n: int, global_batch_size: int, drop_remainder: bool, seed: int,
                            epoch_variable: tf.Variable) -> tf.data.Dataset:
    """Batches of ``data`` in an order that depends only on ``(seed, epoch_variable)`` read when iteration starts."""
    tensors = tf.nest.map_structure(tf.convert_to_tensor, data)

    def order(_: Any) -> tf.Tensor:
        key = tf.stack([tf.constant(seed, tf.int64), tf.cast(epoch_variable.read_value(), tf.int64)])
        return tf.random.experimental.stateless_shuffle(tf.range(n, dtype=tf.int64), seed=key)

    indices = tf.data.Dataset.range(1).map(order).unbatch().apply(tf.data.experimental.assert_cardinality(n))
    batches = indices.batch(global_batch_size, drop_remainder=drop_remainder)
    return batches.map(lambda idx: tf.nest.map_structure(lambda t: tf.gather(t, idx), tensors),
                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


class _EpochCounter(keras.callbacks.Callback):
    """Sets the variable :func:`prepare_dataset` shuffles by to the epoch about to start (before its iterator)."""

    def __init__(self, variable: tf.Variable) -> None:
        super().__init__()
        self.variable = variable

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.variable.assign(epoch)


def _is_array_structure(x: Any) -> bool:
    leaves = tf.nest.flatten(x)
    return bool(leaves) and all(isinstance(v, (np.ndarray, tf.Tensor, list)) or hasattr(v, "__array__")
                                for v in leaves) and not isinstance(x, str)


# --------------------------------------------------------------------------------------------------------------
# the model, inside the scope
# --------------------------------------------------------------------------------------------------------------

def _raw_compile_kwargs(model: keras.Model) -> dict:
    config = getattr(model, "_compile_config", None)
    return dict(config.config) if config is not None else {}


def _build_in_scope(model_or_builder: Any, strategy: Any, policy: str, verbose: Any) -> keras.Model:
    if isinstance(model_or_builder, keras.Model):
        model = model_or_builder
        if not model.compiled:
            raise TypeError(
                f"model {model.name!r} is not compiled: compile it first, or (better) pass a zero-argument function "
                "that builds AND compiles it, e.g. fit(lambda: build_and_compile(), ...), so the model and its "
                "optimizer are created inside the strategy scope."
            )
        if policy != model.dtype_policy.name:
            _say(f"precision {policy!r} applies to models fit builds; {model.name!r} keeps its policy "
                 f"{model.dtype_policy.name!r} (pass a builder function to change it)", verbose, strategy)
        if getattr(model, "_distribute_strategy", None) is strategy or (
                getattr(model, "_distribute_strategy", None) is None
                and strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy()):
            return model
        return _rebuild(model, strategy, verbose)
    if callable(model_or_builder):
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(policy)
        try:
            with strategy.scope():
                model = model_or_builder()
        finally:
            keras.config.set_dtype_policy(previous)
        if not isinstance(model, keras.Model):
            raise TypeError(f"the builder returned {type(model).__name__}, not a keras.Model: it must build AND "
                            "compile the model and return it.")
        if not model.compiled:
            raise TypeError(f"the builder returned an uncompiled model {model.name!r}: call model.compile(...) "
                            "inside the builder, so the optimizer is created inside the strategy scope.")
        return model
    raise TypeError(
        f"model_or_builder must be a compiled keras.Model or a zero-argument function that builds and compiles one, "
        f"got {type(model_or_builder).__name__}: {model_or_builder!r}. Example: fit(build_model, x, y, ...)."
    )


def _rebuild(model: keras.Model, strategy: Any, verbose: Any) -> keras.Model:
    """Clone ``model`` inside ``strategy.scope()`` with its weights and compile configuration."""
    try:
        compile_config = model.get_compile_config()
    except Exception as e:  # noqa: BLE001 - any serialization failure: tell the user what to do
        raise TypeError(
            f"model {model.name!r} was built outside the strategy scope and its compile configuration cannot be "
            f"serialized ({e}); pass a zero-argument function that builds and compiles it instead."
        ) from e
    with strategy.scope():
        try:
            clone = keras.models.clone_model(model)
        except Exception as e:  # noqa: BLE001
            raise TypeError(
                f"model {model.name!r} was built outside the strategy scope and cannot be cloned ({e}); pass a "
                "zero-argument function that builds and compiles it instead: fit(build_model, ...)."
            ) from e
        if model.built:
            if not clone.built:
                clone.build(model.inputs[0].shape if getattr(model, "inputs", None) else None)
            clone.set_weights(model.get_weights())
        clone.compile_from_config(compile_config)
    iterations = int(model.optimizer.iterations.numpy()) if model.optimizer is not None else 0
    note = f"; its optimizer state after {iterations} updates is NOT carried over" if iterations else ""
    _say(f"model {model.name!r} was built outside the {strategy_name(strategy)} scope: rebuilt inside it with "
         f"its weights and compile configuration{note}", verbose, strategy)
    return clone


def _compile_like(target: keras.Model, source: keras.Model) -> None:
    """Compile ``target`` with ``source``'s compile arguments (same optimizer object)."""
    target.compile(**_raw_compile_kwargs(source))


def _has_plain_batchnorm(model: keras.Model) -> bool:
    from keras_scale.sync_bn import batchnorm_layers

    return any(not getattr(layer, "synchronized", False) for layer in batchnorm_layers(model))


def _apply_sync_bn(model: keras.Model, sync_bn: Any, replicas: int, per_replica: int, strategy: Any,
                   verbose: Any) -> keras.Model:
    if sync_bn is False or not _has_plain_batchnorm(model):
        return model
    if sync_bn == "auto" and not (replicas > 1 and per_replica < SYNC_BN_BELOW_BATCH):
        return model
    from keras_scale.sync_bn import sync_batchnorm

    with strategy.scope():
        converted = sync_batchnorm(model)
        if not converted.compiled:
            _compile_like(converted, model)
    why = (f"the per-replica batch {per_replica} < {SYNC_BN_BELOW_BATCH} over {replicas} replicas"
           if sync_bn == "auto" else "sync_bn=True")
    _say(f"BatchNormalization synchronized across replicas ({why}); pass sync_bn=False to keep per-replica "
         "statistics", verbose, strategy)
    return converted


def _apply_lr_scaling(model: keras.Model, lr_scaling: Any, global_batch: int, strategy: Any, verbose: Any) -> None:
    if lr_scaling is None:
        return
    from keras_scale.schedules import WarmupCosine, inner_optimizer, scale_lr

    rule, base_batch = lr_scaling
    optimizer = inner_optimizer(model.optimizer)
    done = getattr(optimizer, "_keras_scale_lr_scaling", None)
    if done is not None:  # a second fit() on the same model must not scale again
        if done != (rule, base_batch, global_batch):
            warnings.warn(f"the learning rate was already scaled by an earlier fit() with {done}; not scaling it "
                          f"again for {(rule, base_batch, global_batch)}", stacklevel=3)
        return
    optimizer._keras_scale_lr_scaling = (rule, base_batch, global_batch)
    lr = optimizer._learning_rate
    if isinstance(lr, WarmupCosine):
        old = lr.peak_lr
        lr.peak_lr = scale_lr(old, global_batch, base_batch, rule)
        what, new = "WarmupCosine peak_lr", lr.peak_lr
    elif isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        raise ValueError(
            f"lr_scaling scales a float learning rate or a keras_scale.WarmupCosine peak; the optimizer uses "
            f"{type(lr).__name__}. Scale it yourself with keras_scale.scale_lr(base_lr, {global_batch}, "
            f"{base_batch}, {rule!r}) in the builder, or pass lr_scaling=None."
        )
    else:
        old = float(optimizer.learning_rate.numpy())
        new = scale_lr(old, global_batch, base_batch, rule)
        optimizer.learning_rate = new
        what = "learning rate"
    _say(f"{what} {old:g} -> {new:g} ({rule} rule: global batch {global_batch} / base batch {base_batch})",
         verbose, strategy)


def _check_lr_scaling(lr_scaling: Any) -> None:
    if lr_scaling is None:
        return
    ok = isinstance(lr_scaling, (tuple, list)) and len(lr_scaling) == 2 and lr_scaling[0] in ("linear", "sqrt")
    if ok:
        base = lr_scaling[1]
        ok = not isinstance(base, bool) and isinstance(base, (int, np.integer)) and base > 0
    if not ok:
        raise ValueError(
            f"lr_scaling must be ('linear' | 'sqrt', base_batch) with base_batch the batch size the learning rate was "
            f"tuned at, got {lr_scaling!r}. Example: lr_scaling=('linear', 256)."
        )


# --------------------------------------------------------------------------------------------------------------
# callbacks
# --------------------------------------------------------------------------------------------------------------

def _default_callbacks(callbacks: Sequence[Any], log_dir: Optional[str], checkpoint_dir: Optional[str],
                       strategy: Any, monitors: bool = True) -> Tuple[List[Any], List[str]]:
    """User callbacks plus one of each default kind the user did not pass; returns (callbacks, added names)."""
    result = list(callbacks)
    added: List[str] = []

    def add(callback_class: type, *args: Any) -> None:
        if not any(isinstance(cb, callback_class) for cb in result):
            result.append(callback_class(*args))
            added.append(callback_class.__name__)

    if monitors:
        add(NanGuard)
        if tf.config.list_physical_devices("GPU"):
            add(GpuMonitor)
    if log_dir is not None and is_chief(strategy) and not any(isinstance(cb, keras.callbacks.TensorBoard)
                                                              for cb in result):
        result.append(keras.callbacks.TensorBoard(log_dir=str(log_dir)))
        added.append(f"TensorBoard({log_dir})")
    if checkpoint_dir is not None:
        directory = Storage(checkpoint_dir).path  # every worker resolves the same path, whatever its cwd
        add(ChiefCheckpoint, directory)
    if monitors:  # last, so that it also sees the final checkpoint written at train end
        add(Goodput, log_dir)
    from keras_scale.heartbeat_file import HEARTBEAT_FILE_ENV

    if os.environ.get(HEARTBEAT_FILE_ENV):  # `keras-scale launch` watches for hung workers: after ChiefCheckpoint
        from keras_scale.callbacks.heartbeat import Heartbeat

        add(Heartbeat)
    return result, added


# --------------------------------------------------------------------------------------------------------------
# fit, in stages: validate -> plan -> build -> data -> callbacks -> train
# --------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Plan:
    """What fit decided before building anything: the strategy, the batch arithmetic, the precision."""

    strategy: Any
    replicas: int
    per_replica: int
    global_batch: int
    accum: int
    policy: str
    verbose: Any
    auto_accum: bool = False  # accum="auto": split each replica's batch only when a step runs out of memory
    elastic_message: Optional[str] = None  # what a resume on another replica count adjusted (keras_scale.elastic)
    shard_by_data: bool = False  # elastic resumable run: file-based data sharded by DATA (same samples per batch)


def _validate(model_or_builder: Any, x: Any, per_replica_batch_size: Optional[int], global_batch_size: Optional[int],
              epochs: int, accum: int, lr_scaling: Any, sync_bn: Any, jit_compile: Any,
              fit_kwargs: Dict[str, Any]) -> None:
    """Bad input, early: every argument checked before a strategy or a model exists."""
    if "batch_size" in fit_kwargs:
        raise TypeError(
            f"keras_scale.fit takes per_replica_batch_size= or global_batch_size=, not batch_size= "
            f"(got batch_size={fit_kwargs['batch_size']!r}). global = per_replica x replicas."
        )
    if not (isinstance(model_or_builder, keras.Model) or callable(model_or_builder)):
        _build_in_scope(model_or_builder, None, "float32", 0)  # raises the TypeError with the fix
    _positive_int("accum", accum)
    _positive_int("epochs", epochs)
    if (per_replica_batch_size is None) == (global_batch_size is None):
        batch_arithmetic(1, per_replica_batch_size, global_batch_size)  # raises with the explanation
    for name, value in (("per_replica_batch_size", per_replica_batch_size), ("global_batch_size", global_batch_size)):
        if value is not None:
            _positive_int(name, value)
    _check_lr_scaling(lr_scaling)
    if sync_bn not in ("auto", True, False):
        raise ValueError(f"sync_bn must be 'auto', True or False, got {sync_bn!r}")
    if jit_compile not in ("auto", True, False):
        raise ValueError(f"jit_compile must be 'auto', True or False, got {jit_compile!r}")
    if fit_kwargs.get("validation_split") is not None:
        _check_validation_split(fit_kwargs["validation_split"])
        if fit_kwargs.get("validation_data") is None and not _is_array_structure(x):
            split_for_validation(fit_kwargs["validation_split"], x)  # raises: arrays only, as in Keras


def _plan(model_or_builder: Any, strategy: Any, all_reduce: str, precision: Any, per_replica_batch_size: Optional[int],
          global_batch_size: Optional[int], accum: int, fit_kwargs: Dict[str, Any]) -> _Plan:
    """Choose the strategy (following a model's or an enclosing scope's), the precision and the batch sizes."""
    from keras_scale.precision import choose_precision

    policy = choose_precision(precision)
    if isinstance(strategy, str) and strategy == "auto":
        # a model built inside a strategy scope, or an enclosing scope, already says which strategy to use
        if isinstance(model_or_builder, keras.Model) and getattr(model_or_builder, "_distribute_strategy", None):
            strategy = model_or_builder._distribute_strategy
        elif tf.distribute.has_strategy():
            strategy = tf.distribute.get_strategy()
    strategy = choose_strategy(strategy, all_reduce)
    require_keras_multi_worker_fix(strategy)  # Keras's fit crashes under multi-worker without it: refuse, say why
    if "verbose" not in fit_kwargs and not is_chief(strategy):
        fit_kwargs["verbose"] = 0  # one progress bar per cluster, on the chief
    replicas = strategy.num_replicas_in_sync
    per_replica, global_batch = batch_arithmetic(replicas, per_replica_batch_size, global_batch_size, accum)
    return _Plan(strategy, replicas, per_replica, global_batch, accum, policy, fit_kwargs.get("verbose", "auto"))


def _model_accum(model: keras.Model) -> Optional[Tuple[Optional[int], Optional[int]]]:
    """``(accum, micro_batch_size)`` of a model already wrapped with :func:`keras_scale.wrap`, else ``None``."""
    from keras_scale.accumulation import AccumulatingModel

    if isinstance(model, AccumulatingModel):
        return model.accum, model.micro_batch_size
    return None


def _build(model_or_builder: Any, plan: _Plan, sync_bn: Any, jit_compile: Any, lr_scaling: Any,
           log_dir: Optional[str] = None) -> keras.Model:
    """The model inside the strategy scope: float32 outputs, synchronized BatchNorm, XLA choice, LR scaling, wrap."""
    from keras_scale.precision import check_float32_outputs

    strategy, verbose = plan.strategy, plan.verbose
    model = _build_in_scope(model_or_builder, strategy, plan.policy, verbose)
    wrapped_by_user = _model_accum(model)
    if wrapped_by_user is not None:
        accum, micro = wrapped_by_user
        if plan.accum > 1 and accum != plan.accum:
            how = f"accum={accum}" if accum else f"micro_batch_size={micro}"
            raise ValueError(f"the model is already wrapped by keras_scale.wrap ({how}) and fit got "
                             f"accum={plan.accum}: pass accum= to one of them only.")
        if accum:
            plan.accum = accum
            batch_arithmetic(plan.replicas, per_replica_batch_size=plan.per_replica, accum=accum)  # it must fit
    for finding in check_float32_outputs(model, fix=True):
        _say(finding, verbose, strategy)
    model = _apply_sync_bn(model, sync_bn, plan.replicas, max(1, plan.per_replica // plan.accum), strategy, verbose)
    if jit_compile == "auto":
        if plan.replicas > 1 and model.jit_compile:
            model.jit_compile = False
            _say(f"XLA (jit_compile) off under {plan.replicas} replicas; pass jit_compile=True to force it",
                 verbose, strategy)
    else:
        model.jit_compile = jit_compile
    _apply_lr_scaling(model, lr_scaling, plan.global_batch, strategy, verbose)
    if (plan.accum > 1 or plan.auto_accum) and wrapped_by_user is None:
        from keras_scale.accumulation import wrap

        with strategy.scope():
            if plan.auto_accum:  # each change of the split goes to TensorBoard beside the training curves
                wrapped = wrap(model, accum="auto", log_dir=None if log_dir is None else str(log_dir),
                               verbose=0 if plan.verbose == 0 else 1)
            else:
                wrapped = wrap(model, accum=plan.accum)
            # the same optimizer object as the model's (a LossScaleOptimizer under mixed_float16: the wrapper is
            # created outside the builder's dtype policy, so compiling it with the raw optimizer would train without
            # loss scaling, beside a second, unused LossScaleOptimizer around the same optimizer)
            wrapped.compile(**{**_raw_compile_kwargs(model), "optimizer": model.optimizer})
            wrapped.jit_compile = model.jit_compile
        model = wrapped
    return model


def _data(x: Any, y: Any, model: keras.Model, plan: _Plan, fit_kwargs: Dict[str, Any]
          ) -> Tuple[tf.data.Dataset, tf.Variable, str]:
    """The training (and validation) datasets of global batches; pops the data arguments from ``fit_kwargs``."""
    sample_weight = fit_kwargs.pop("sample_weight", None)
    shuffle = fit_kwargs.pop("shuffle", True)
    validation_split = fit_kwargs.pop("validation_split", None)
    if validation_split is not None and fit_kwargs.get("validation_data") is None:
        (x, y, sample_weight), validation = split_for_validation(validation_split, x, y, sample_weight)
        fit_kwargs["validation_data"] = tuple(v for v in validation if v is not None)
    drop_remainder = bool(model.jit_compile) or _drop_for_synchronized_batchnorm(
        model, plan, x, y, sample_weight)  # XLA wants static shapes; synchronized BN one sample per micro-batch
    epoch_variable = tf.Variable(0, dtype=tf.int64, trainable=False, name="keras_scale_data_epoch")
    dataset, how = prepare_dataset(x, y, sample_weight, global_batch_size=plan.global_batch, shuffle=bool(shuffle),
                                   drop_remainder=drop_remainder, epoch_variable=epoch_variable)
    if plan.shard_by_data and how.find("auto-shard FILE") >= 0:
        dataset = _shard_by_data(dataset)
        how = how.split("auto-shard FILE")[0] + ("auto-shard DATA (elastic: a global batch holds the same samples on any "
                                                 "number of workers; pass elastic=False to shard by file); "
                                                 "prefetch AUTOTUNE")
    if validation_split is not None and fit_kwargs.get("validation_data") is not None:
        how += f"; validation: the last {validation_split:g} of the arrays (as Keras's validation_split)"
    validation_data = fit_kwargs.get("validation_data")
    if validation_data is not None and not isinstance(validation_data, tf.data.Dataset) and not isinstance(
            validation_data, keras.utils.PyDataset):
        if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
            raise ValueError("validation_data must be (x_val, y_val), (x_val, y_val, sample_weight), a "
                             f"tf.data.Dataset or a PyDataset; got {type(validation_data).__name__}")
        fit_kwargs["validation_data"], _ = prepare_dataset(*validation_data, global_batch_size=plan.global_batch,
                                                           shuffle=False)
    elif isinstance(validation_data, (tf.data.Dataset, keras.utils.PyDataset)):
        fit_kwargs["validation_data"], _ = prepare_dataset(validation_data, global_batch_size=plan.global_batch,
                                                           shuffle=False)
    return dataset, epoch_variable, how


def _samples_in(x: Any, y: Any, sample_weight: Any) -> Optional[int]:
    """The training samples ``x`` holds when known before training (arrays, datasets of known size), else None."""
    if _is_array_structure(x):
        return _check_same_length(x=x, y=y, sample_weight=sample_weight)
    if isinstance(x, tf.data.Dataset):
        if _is_batched(x):
            return _samples_of(x)
        n = int(x.cardinality())
        return n if n >= 0 else None
    if isinstance(x, keras.utils.PyDataset):
        samples = _samples_of_py_dataset(x)
        return None if samples is None else samples[0]
    return None


def _drop_for_synchronized_batchnorm(model: keras.Model, plan: _Plan, x: Any, y: Any, sample_weight: Any) -> bool:
    """Synchronized BatchNorm with a split batch needs a sample in every micro-batch on every replica (its
    all-reduce cannot sit in a cond): a last global batch too small for that is dropped each epoch, said once.
    ``False`` when there is no such model or the last batch is large enough."""
    from keras_scale.step import _has_synchronized_batchnorm

    wrapped = _model_accum(model)
    if wrapped is None or not _has_synchronized_batchnorm(model):
        return False
    accum, micro_batch_size = wrapped
    if micro_batch_size is None and (accum or 1) <= 1:
        return False
    n = _samples_in(x, y, sample_weight)
    remainder = None if n is None else n % plan.global_batch
    if remainder == 0:
        return False
    if remainder is not None and micro_batch_size is None and remainder // plan.replicas >= accum:
        return False  # every replica's share of the last batch still fills every micro-batch
    need = (f"accum {accum} micro-batches" if micro_batch_size is None
            else f"micro-batches of {micro_batch_size} (a static batch size)")
    what = ("the last batch of each epoch (size unknown before training) is dropped" if remainder is None else
            f"the last batch of each epoch ({remainder} samples: {remainder // plan.replicas} per replica) is dropped")
    _say(f"synchronized BatchNorm with {need} needs every micro-batch to hold a sample on every replica: {what}. "
         f"Choose a batch size that divides the data to train on every sample.", plan.verbose, plan.strategy)
    return True


def _shard_by_data(dataset: tf.data.Dataset) -> tf.data.Dataset:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)  # the later option wins


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _batch_line(plan: _Plan, model: keras.Model, dataset: tf.data.Dataset, epochs: int,
                fit_kwargs: Dict[str, Any]) -> str:
    """``global batch G = P per replica x R replicas[, each split into accum A micro-batches of M]`` + the updates."""
    replicas = f"{plan.replicas} replica{'s' if plan.replicas > 1 else ''}"
    line = f"global batch {plan.global_batch} = {plan.per_replica} per replica x {replicas}"
    wrapped = _model_accum(model)
    if wrapped is not None and wrapped[0] is None:
        line += f", each split into micro-batches of {wrapped[1]}"
    elif plan.auto_accum:
        line += ", split into micro-batches only when a step runs out of memory (accum auto)"
    elif plan.accum > 1:
        micro = -(-plan.per_replica // plan.accum)
        size = str(micro) if plan.per_replica % plan.accum == 0 else f"<= {micro}"
        line += f", each split into accum {plan.accum} micro-batches of {size}"
    name = strategy_name(plan.strategy)
    line += f" ({name + ', 1 device' if name == 'default strategy' else name}, precision {plan.policy})"
    steps = fit_kwargs.get("steps_per_epoch") or (int(dataset.cardinality()) if int(dataset.cardinality()) > 0
                                                   else None)
    if steps is not None:
        total = steps * epochs
        line += (f"; {_count(steps, 'update')}/epoch x {_count(epochs, 'epoch')} = {_count(total, 'optimizer update')} "
                 f"(a schedule's total_steps)")
    else:
        line += "; updates per epoch unknown (dataset of unknown size): pass steps_per_epoch= to know total_steps"
    return line


def _plan_elastic(plan: _Plan, checkpoint_dir: Optional[str], global_batch_size: Optional[int],
                  elastic: Any) -> float:
    """On a resume on another replica count: the batch arithmetic that keeps the math (keras_scale.elastic);
    returns the learning-rate factor (1.0 unless ``elastic="scale_lr"`` changed the global batch)."""
    if checkpoint_dir is None or global_batch_size is None or elastic is False or plan.auto_accum:
        return 1.0
    from keras_scale.elastic import plan_elastic, read_record

    plan.shard_by_data = True

    old_global = plan.global_batch
    per, glob, accum, message = plan_elastic(read_record(_checkpoint_path(checkpoint_dir)), plan.global_batch,
                                             plan.replicas, plan.accum, elastic)
    if message is None:
        return 1.0
    plan.per_replica, plan.global_batch, plan.accum = per, glob, accum
    plan.elastic_message = message
    _say(message, plan.verbose, plan.strategy)
    return glob / old_global


def _checkpoint_path(checkpoint_dir: Any) -> str:
    directory = str(checkpoint_dir)
    return os.path.abspath(directory) if "://" not in directory else directory


def _finish_elastic(model: keras.Model, plan: _Plan, checkpoint_dir: Optional[str], global_batch_size: Optional[int],
                    elastic: Any, lr_factor: float, lr_scaling: Any) -> None:
    """Rescale the learning rate for ``elastic="scale_lr"`` (unless ``lr_scaling`` already scaled it to the new
    global batch) and, on the chief, record this run's batch arithmetic next to the checkpoints. The model was built
    (a collective under multi-worker), so every worker has read the previous record by now."""
    if checkpoint_dir is None or global_batch_size is None or elastic is False or plan.auto_accum:
        return
    from keras_scale.elastic import read_record, write_record

    if lr_factor != 1.0 and lr_scaling is None:
        from keras_scale.schedules import WarmupCosine, inner_optimizer

        optimizer = inner_optimizer(model.optimizer)
        lr = optimizer._learning_rate
        if isinstance(lr, WarmupCosine):
            lr.peak_lr = lr.peak_lr * lr_factor
        elif isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            raise ValueError(f"elastic='scale_lr' rescales a float learning rate or a keras_scale.WarmupCosine peak; "
                             f"the optimizer uses {type(lr).__name__}. Use elastic='accum' (keeps the global batch) "
                             "or scale it yourself in the builder.")
        else:
            optimizer.learning_rate = float(optimizer.learning_rate.numpy()) * lr_factor
    if is_chief(plan.strategy):
        directory = _checkpoint_path(checkpoint_dir)
        old = read_record(directory)
        bound = old["micro_batch_size"] if old is not None and elastic == "accum" else \
            -(-plan.per_replica // max(plan.accum, 1))
        write_record(directory, plan.global_batch, plan.replicas, bound,
                     requested_global_batch_size=global_batch_size if elastic == "scale_lr" else None)


def _train(model: keras.Model, dataset: tf.data.Dataset, epochs: int, callbacks: List[Any], plan: _Plan,
           checkpoint_dir: Optional[str], fit_kwargs: Dict[str, Any]) -> keras.callbacks.History:
    try:
        # shuffle=False: the dataset is already shuffled (identically on every worker); Keras would only warn
        return model.fit(dataset, epochs=epochs, callbacks=callbacks, shuffle=False, **fit_kwargs)
    except tf.errors.InvalidArgumentError as e:
        if _PY_DATASET_BATCH_ERROR in str(e):
            raise ValueError(_PY_DATASET_BATCH_ERROR + str(e).split(_PY_DATASET_BATCH_ERROR, 1)[1].split("]", 1)[0]
                             ) from None
        raise
    except _WORKER_FAILURE_ERRORS as e:
        if is_multi_worker(plan.strategy):
            raise RuntimeError(
                f"multi-worker training stopped: a worker of the cluster failed or became unreachable "
                f"({type(e).__name__}: {_key_line(str(e))}). Check the other workers' "
                "logs, then rerun the same command on every worker"
                + (" (it resumes from checkpoint_dir)." if checkpoint_dir else
                   "; pass checkpoint_dir= to resume instead of restarting.")
            ) from e
        raise


def fit(
    model_or_builder: Union[keras.Model, Callable[[], keras.Model]],
    x: Any,
    y: Any = None,
    *,
    per_replica_batch_size: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    epochs: int = 1,
    accum: Union[int, str] = 1,
    strategy: Any = "auto",
    precision: Any = "auto",
    lr_scaling: Optional[Tuple[str, int]] = None,
    callbacks: Optional[Sequence[keras.callbacks.Callback]] = None,
    log_dir: Optional[str] = None,
    checkpoint_dir: Optional[str] = None,
    all_reduce: str = "auto",
    sync_bn: Union[str, bool] = "auto",
    jit_compile: Union[str, bool] = "auto",
    default_callbacks: bool = True,
    elastic: Union[str, bool] = "accum",
    **fit_kwargs: Any,
) -> keras.callbacks.History:
    """Train with the right strategy, batch, precision and callbacks; return Keras's ``History``.

    Args:
        model_or_builder: a zero-argument function that builds AND compiles the model (called inside the strategy
            scope, under the chosen precision policy), or a compiled model; a model built outside the scope is
            rebuilt inside it with its weights and compile configuration (logged). It may return a model already
            wrapped with :func:`keras_scale.wrap` (its ``accum`` is used and logged).
        x, y: arrays (+ ``y``; all of the same length), a ``tf.data.Dataset`` (batched or not; rebatched to the
            global batch, its size kept) or a ``keras.utils.PyDataset``. Datasets get DATA auto-sharding (FILE for
            file-based pipelines) and AUTOTUNE prefetch.
        per_replica_batch_size / global_batch_size: exactly one; ``global = per_replica x replicas`` samples per
            optimizer update.
        epochs: as in ``model.fit``.
        accum: as in :func:`keras_scale.wrap`: each replica's batch is split into ``accum`` micro-batches, one
            update per global batch. It lowers memory (``per_replica / accum`` samples on a device at once) and
            changes neither the batch, nor the learning rate, nor a schedule's ``total_steps``. ``"auto"``: split
            only when a step runs out of memory (``wrap(model, accum="auto")``).
        strategy: ``"auto"``, ``"default"``, ``"mirrored"``, ``"multi_worker"`` or a ``tf.distribute.Strategy``
            (see :func:`keras_scale.distribute.choose_strategy`).
        precision: ``"auto"`` (bf16 on compute capability >= 8.0, fp16 + loss scaling on 7.x, float32 on CPU) or a
            policy name; output layers are kept in float32.
        lr_scaling: ``("linear" | "sqrt", base_batch)``: scale the optimizer's learning rate (or a
            ``WarmupCosine`` peak) from ``base_batch`` to the global batch.
        callbacks: your callbacks; NanGuard, GpuMonitor (with a GPU), TensorBoard (``log_dir``), ChiefCheckpoint
            (``checkpoint_dir``, resumes) and Goodput (last) are added when none of their kind is given.
        all_reduce: ``"auto"``, ``"nccl"``, ``"hierarchical_copy"``, ``"one_device"`` or ``"ring"``.
        sync_bn: ``"auto"`` synchronizes BatchNorm when the per-replica micro-batch < 16 on several replicas;
            ``True``/``False`` force it.
        jit_compile: ``"auto"`` keeps the model's setting but turns XLA off under multi-replica strategies;
            ``True``/``False`` force it.
        default_callbacks: ``False`` adds none of the default callbacks (only yours, plus TensorBoard /
            ChiefCheckpoint when ``log_dir`` / ``checkpoint_dir`` ask for them).
        elastic: what a resume with ``global_batch_size`` and ``checkpoint_dir`` does on another number of replicas
            than the checkpoint was written with (see :mod:`keras_scale.elastic`): ``"accum"`` keeps the global
            batch exact by changing the accumulation (micro-batches no larger than before); ``"scale_lr"`` keeps
            the per-replica batch and rescales the learning rate linearly; ``False`` adjusts nothing.
        **fit_kwargs: passed to ``model.fit`` (``validation_data``, ``validation_split`` (arrays: the last
            fraction, as Keras), ``sample_weight``, ``shuffle``, ``steps_per_epoch``, ``verbose``, ...).
            ``batch_size`` is not accepted (use the two sizes above).

    Returns:
        The ``keras.callbacks.History``; ``history.model`` is the trained model (``keras_scale.unwrap`` gives the
        inner one when ``accum > 1``).

    Example:
        history = fit(build_model, x, y, per_replica_batch_size=32, epochs=2)
        # keras_scale: global batch 64 = 32 per replica x 2 replicas (MirroredStrategy, precision float32); ...
    """
    auto_accum = isinstance(accum, str) and accum == "auto"
    accum = 1 if auto_accum else accum
    _validate(model_or_builder, x, per_replica_batch_size, global_batch_size, epochs, accum, lr_scaling, sync_bn,
              jit_compile, fit_kwargs)
    from keras_scale.elastic import check_elastic

    check_elastic(elastic)
    plan = _plan(model_or_builder, strategy, all_reduce, precision, per_replica_batch_size, global_batch_size, accum,
                 fit_kwargs)
    plan.auto_accum = auto_accum
    lr_factor = _plan_elastic(plan, checkpoint_dir, global_batch_size, elastic)
    model = _build(model_or_builder, plan, sync_bn, jit_compile, lr_scaling, log_dir)
    _finish_elastic(model, plan, checkpoint_dir, global_batch_size, elastic, lr_factor, lr_scaling)
    dataset, epoch_variable, how = _data(x, y, model, plan, fit_kwargs)
    _say(_batch_line(plan, model, dataset, epochs, fit_kwargs), plan.verbose, plan.strategy)
    _say(f"data: {how}", plan.verbose, plan.strategy)
    all_callbacks, added = _default_callbacks(callbacks or [], log_dir, checkpoint_dir, plan.strategy,
                                              monitors=bool(default_callbacks))
    all_callbacks.insert(0, _EpochCounter(epoch_variable))
    if added:
        _say(f"default callbacks: {', '.join(added)}", plan.verbose, plan.strategy)
    return _train(model, dataset, epochs, all_callbacks, plan, checkpoint_dir, fit_kwargs)
