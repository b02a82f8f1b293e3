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
    keras_scale: global batch 512 = 64 per replica x 8 replicas x accum 1
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import keras
import numpy as np
import tensorflow as tf

from keras_scale._validate import check_int
from keras_scale.distribute import choose_strategy, is_chief, patch_keras_multi_worker, strategy_name

__all__ = ["fit", "batch_arithmetic", "prepare_dataset"]

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
    """``(per_replica_batch_size, global_batch_size)`` with ``global = per_replica x replicas x accum``.

    Exactly one of the two sizes must be given; a global batch must split evenly.

    Example:
        >>> batch_arithmetic(4, per_replica_batch_size=64, accum=2)
        (64, 512)
        >>> batch_arithmetic(4, global_batch_size=512, accum=2)
        (64, 512)
    """
    accum = _positive_int("accum", accum)
    num_replicas = _positive_int("num_replicas", num_replicas)
    if (per_replica_batch_size is None) == (global_batch_size is None):
        raise ValueError(
            "pass exactly one of per_replica_batch_size= (samples one device holds at once) or global_batch_size= "
            f"(samples per optimizer update); got per_replica_batch_size={per_replica_batch_size!r}, "
            f"global_batch_size={global_batch_size!r}."
        )
    if per_replica_batch_size is not None:
        per = _positive_int("per_replica_batch_size", per_replica_batch_size)
        return per, per * num_replicas * accum
    glob = _positive_int("global_batch_size", global_batch_size)
    if glob % (num_replicas * accum):
        raise ValueError(
            f"global_batch_size={glob} does not split into {num_replicas} replicas x accum {accum}: it must be a "
            f"multiple of {num_replicas * accum}, e.g. {max(1, glob // (num_replicas * accum)) * num_replicas * accum}."
        )
    return glob // (num_replicas * accum), glob


def _key_line(message: str) -> str:
    """The informative line of a TensorFlow runtime error (which task died), not "Graph execution error:"."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    for key in ("unhealthy", "aborted", "unreachable", "Socket closed", "Connection reset"):
        for i, line in enumerate(lines):
            if key in line:
                return " ".join(lines[i:i + 2])[:400]
    return (lines[-1] if lines else "")[:400]


def _say(message: str, verbose: Any = 1, strategy: Any = None) -> None:
    """Log once, and print on the chief so the line shows up next to Keras's progress bar."""
    log.info(message)
    if verbose and is_chief(strategy):
        print(f"keras_scale: {message}", flush=True)


def _dataset_chain(ds: tf.data.Dataset) -> List[str]:
    names = []
    while ds is not None and len(names) < 1000:
        names.append(type(ds).__name__)
        ds = getattr(ds, "_input_dataset", None)
    return names


def _is_batched(ds: tf.data.Dataset) -> bool:
    for name in _dataset_chain(ds):  # outermost first
        if "Unbatch" in name:
            return False
        if "Batch" in name:  # _BatchDataset, _PaddedBatchDataset, _ParallelBatchDataset, _RebatchDataset, ...
            return True
    return False


def _is_file_based(ds: tf.data.Dataset) -> bool:
    return any(k in name for name in _dataset_chain(ds)
               for k in ("TFRecord", "TextLine", "FixedLengthRecord", "Interleave", "FlatMap"))


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
        file_based = _is_file_based(x)
        if _is_batched(x):
            ds = x.rebatch(global_batch_size, drop_remainder=drop_remainder)
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
        ds = ds.rebatch(global_batch_size, drop_remainder=drop_remainder)
        file_based = False
        how = "PyDataset, rebatched"
    elif _is_array_structure(x):
        data = tuple(d for d in (x, y, sample_weight) if d is not None) if (y is not None or sample_weight is not None) \
            else x
        if y is None and sample_weight is not None:
            raise ValueError("sample_weight was given without y; pass y too.")
        n = _num_samples(x)
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


def _num_samples(x: Any) -> int:
    return int(len(tf.nest.flatten(x)[0]))


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


def _inner_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "inner_optimizer", optimizer)


def _apply_lr_scaling(model: keras.Model, lr_scaling: Any, global_batch: int, strategy: Any, verbose: Any) -> None:
    if lr_scaling is None:
        return
    from keras_scale.schedules import WarmupCosine, scale_lr

    rule, base_batch = lr_scaling
    optimizer = _inner_optimizer(model.optimizer)
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
    import importlib

    result = list(callbacks)
    added: List[str] = []

    def missing(cls: type) -> bool:
        return not any(isinstance(cb, cls) for cb in result)

    def add(module: str, name: str, *args: Any) -> None:
        cls = getattr(importlib.import_module(module), name)  # imported lazily: only what this run uses
        if missing(cls):
            result.append(cls(*args))
            added.append(name)

    if monitors:
        add("keras_scale.callbacks.nan_guard", "NanGuard")
        if tf.config.list_physical_devices("GPU"):
            add("keras_scale.callbacks.gpu_monitor", "GpuMonitor")
    if log_dir is not None and missing(keras.callbacks.TensorBoard) and is_chief(strategy):
        result.append(keras.callbacks.TensorBoard(log_dir=str(log_dir)))
        added.append(f"TensorBoard({log_dir})")
    if checkpoint_dir is not None:
        directory = str(checkpoint_dir)
        if "://" not in directory:
            directory = os.path.abspath(directory)  # every worker resolves the same path, whatever its cwd
        add("keras_scale.callbacks.checkpoint", "ChiefCheckpoint", directory)
    return result, added


# --------------------------------------------------------------------------------------------------------------
# fit
# --------------------------------------------------------------------------------------------------------------

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
    **fit_kwargs: Any,
) -> keras.callbacks.History:
    """Train with the right strategy, batch, precision and callbacks; return Keras's ``History``.

    Args:
        model_or_builder: a zero-argument function that builds AND compiles the model (called inside the strategy
            scope, under the chosen precision policy), or a compiled model; a model built outside the scope is
            rebuilt inside it with its weights and compile configuration (logged).
        x, y: arrays (+ ``y``), a ``tf.data.Dataset`` (batched or not; rebatched to the global batch) or a
            ``keras.utils.PyDataset``. Datasets get DATA auto-sharding (FILE for file-based pipelines) and AUTOTUNE
            prefetch.
        per_replica_batch_size / global_batch_size: exactly one; ``global = per_replica x replicas x accum``.
        epochs: as in ``model.fit``.
        accum: gradient-accumulation micro-batches per update (``keras_scale.wrap``); each replica holds
            ``per_replica_batch_size`` samples at a time. ``"auto"``: each replica's batch is
            ``per_replica_batch_size``, split only when a step runs out of memory (``wrap(model, accum="auto")``).
        strategy: ``"auto"``, ``"default"``, ``"mirrored"``, ``"multi_worker"`` or a ``tf.distribute.Strategy``
            (see :func:`keras_scale.distribute.choose_strategy`).
        precision: ``"auto"`` (bf16 on compute capability >= 8.0, fp16 + loss scaling on 7.x, float32 on CPU) or a
            policy name; output layers are kept in float32.
        lr_scaling: ``("linear" | "sqrt", base_batch)``: scale the optimizer's learning rate (or a
            ``WarmupCosine`` peak) from ``base_batch`` to the global batch.
        callbacks: your callbacks; NanGuard, GpuMonitor (with a GPU), TensorBoard (``log_dir``) and ChiefCheckpoint
            (``checkpoint_dir``, resumes) are added when none of their kind is given.
        all_reduce: ``"auto"``, ``"nccl"``, ``"hierarchical_copy"``, ``"one_device"`` or ``"ring"``.
        sync_bn: ``"auto"`` synchronizes BatchNorm when the per-replica batch < 16 on several replicas;
            ``True``/``False`` force it.
        jit_compile: ``"auto"`` keeps the model's setting but turns XLA off under multi-replica strategies;
            ``True``/``False`` force it.
        default_callbacks: ``False`` adds none of the default callbacks (only yours, plus TensorBoard /
            ChiefCheckpoint when ``log_dir`` / ``checkpoint_dir`` ask for them).
        **fit_kwargs: passed to ``model.fit`` (``validation_data``, ``sample_weight``, ``shuffle``,
            ``steps_per_epoch``, ``verbose``, ...). ``batch_size`` is not accepted (use the two sizes above).

    Returns:
        The ``keras.callbacks.History``; ``history.model`` is the trained model (``keras_scale.unwrap`` gives the
        inner one when ``accum > 1``).

    Example:
        >>> history = fit(build_model, x, y, per_replica_batch_size=32, epochs=2)     # doctest: +SKIP
        keras_scale: global batch 64 = 32 per replica x 2 replicas x accum 1
    """
    # ---- bad input, early ------------------------------------------------------------------------------------
    if "batch_size" in fit_kwargs:
        raise TypeError(
            f"keras_scale.fit takes per_replica_batch_size= or global_batch_size=, not batch_size= "
            f"(got batch_size={fit_kwargs['batch_size']!r}). global = per_replica x replicas x accum."
        )
    if not (isinstance(model_or_builder, keras.Model) or callable(model_or_builder)):
        _build_in_scope(model_or_builder, None, "float32", 0)  # raises the TypeError with the fix
    auto_accum = isinstance(accum, str) and accum == "auto"  # accum="auto": split on OOM, global = per x replicas
    accum = 1 if auto_accum else _positive_int("accum", accum)
    epochs = _positive_int("epochs", epochs)
    if (per_replica_batch_size is None) == (global_batch_size is None):
        batch_arithmetic(1, per_replica_batch_size, global_batch_size, accum)  # raises with the explanation
    for name, value in (("per_replica_batch_size", per_replica_batch_size), ("global_batch_size", global_batch_size)):
        if value is not None:
            _positive_int(name, value)
    _check_lr_scaling(lr_scaling)
    if sync_bn not in ("auto", True, False):
        raise ValueError(f"sync_bn must be 'auto', True or False, got {sync_bn!r}")
    if jit_compile not in ("auto", True, False):
        raise ValueError(f"jit_compile must be 'auto', True or False, got {jit_compile!r}")
    if fit_kwargs.get("validation_split"):
        raise ValueError(
            f"validation_split={fit_kwargs['validation_split']!r} is not supported by keras_scale.fit (Keras cannot "
            "split a distributed dataset): pass validation_data=(x_val, y_val) instead."
        )
    verbose = fit_kwargs.get("verbose", "auto")

    from keras_scale.precision import check_float32_outputs, choose_precision

    policy = choose_precision(precision)

    # ---- strategy and model ----------------------------------------------------------------------------------
    patch_keras_multi_worker()
    if isinstance(strategy, str) and strategy == "auto":
        # a model built inside a strategy scope, or an enclosing scope, already says which strategy to use
        if isinstance(model_or_builder, keras.Model) and getattr(model_or_builder, "_distribute_strategy", None):
            strategy = model_or_builder._distribute_strategy
        elif tf.distribute.has_strategy():
            strategy = tf.distribute.get_strategy()
    strategy = choose_strategy(strategy, all_reduce)
    if "verbose" not in fit_kwargs and not is_chief(strategy):
        fit_kwargs["verbose"] = 0  # one progress bar per cluster, on the chief
    replicas = strategy.num_replicas_in_sync
    per_replica, global_batch = batch_arithmetic(replicas, per_replica_batch_size, global_batch_size, accum)
    _say(f"global batch {global_batch} = {per_replica} per replica x {replicas} replica{'s' if replicas > 1 else ''}"
         f" x accum {'auto (split on OOM)' if auto_accum else accum} ({strategy_name(strategy)}, precision {policy})",
         verbose, strategy)

    model = _build_in_scope(model_or_builder, strategy, policy, verbose)
    for finding in check_float32_outputs(model, fix=True):
        _say(finding, verbose, strategy)
    model = _apply_sync_bn(model, sync_bn, replicas, per_replica, strategy, verbose)
    if jit_compile == "auto":
        if replicas > 1 and model.jit_compile:
            model.jit_compile = False
            _say(f"XLA (jit_compile) off under {replicas} replicas; pass jit_compile=True to force it",
                 verbose, strategy)
    else:
        model.jit_compile = jit_compile
    _apply_lr_scaling(model, lr_scaling, global_batch, strategy, verbose)
    if accum > 1 or auto_accum:
        from keras_scale.accumulation import wrap

        with strategy.scope():
            wrapped = wrap(model, accum="auto" if auto_accum else accum)
            _compile_like(wrapped, model)
            wrapped.jit_compile = model.jit_compile
        model = wrapped

    # ---- data ------------------------------------------------------------------------------------------------
    sample_weight = fit_kwargs.pop("sample_weight", None)
    shuffle = fit_kwargs.pop("shuffle", True)
    drop_remainder = bool(model.jit_compile)  # XLA wants static shapes
    epoch_variable = tf.Variable(0, dtype=tf.int64, trainable=False, name="keras_scale_data_epoch")
    dataset, how = prepare_dataset(x, y, sample_weight, global_batch_size=global_batch, shuffle=bool(shuffle),
                                   drop_remainder=drop_remainder, epoch_variable=epoch_variable)
    _say(f"data: {how}", verbose, strategy)
    validation_data = fit_kwargs.get("validation_data")
    if validation_data is not None and not isinstance(validation_data, tf.data.Dataset) and not isinstance(
            validation_data, keras.utils.PyDataset):
        if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
            raise ValueError("validation_data must be (x_val, y_val), (x_val, y_val, sample_weight), a "
                             f"tf.data.Dataset or a PyDataset; got {type(validation_data).__name__}")
        fit_kwargs["validation_data"], _ = prepare_dataset(*validation_data, global_batch_size=global_batch,
                                                           shuffle=False)
    elif isinstance(validation_data, (tf.data.Dataset, keras.utils.PyDataset)):
        fit_kwargs["validation_data"], _ = prepare_dataset(validation_data, global_batch_size=global_batch,
                                                           shuffle=False)

    # ---- callbacks and training ------------------------------------------------------------------------------
    all_callbacks, added = _default_callbacks(callbacks or [], log_dir, checkpoint_dir, strategy,
                                              monitors=bool(default_callbacks))
    all_callbacks.insert(0, _EpochCounter(epoch_variable))
    if added:
        _say(f"default callbacks: {', '.join(added)}", verbose, strategy)
    try:
        # shuffle=False: the dataset is already shuffled (identically on every worker); Keras would only warn
        return model.fit(dataset, epochs=epochs, callbacks=all_callbacks, shuffle=False, **fit_kwargs)
    except _WORKER_FAILURE_ERRORS as e:
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            raise RuntimeError(
                f"multi-worker training stopped: a worker of the cluster failed or became unreachable "
                f"({type(e).__name__}: {_key_line(str(e))}). Check the other workers' "
                "logs, then rerun the same command on every worker"
                + (" (it resumes from checkpoint_dir)." if checkpoint_dir else
                   "; pass checkpoint_dir= to resume instead of restarting.")
            ) from e
        raise


from keras_scale._modules import forward_calls_to  # noqa: E402

forward_calls_to(__name__, "fit")  # ks.fit stays the function after `import keras_scale.fit`
