"""``keras_scale.wrap(model, accum="auto")``: never die of an out-of-memory error; keep the math exact.

The wrapped model starts unsplit (or split so that no micro-batch exceeds ``max_micro_batch_size``). When a
train step raises ``tf.errors.ResourceExhaustedError`` it splits finer (the micro-batch is halved), re-traces
and retries THE SAME batch:

- the data iterator is not advanced by the failed attempt: in auto mode the train function fetches each batch
  itself (``next(iterator)``) and hands it to the traced Keras function as a one-batch list, the form Keras's
  ``_make_function`` accepts beside an iterator (``keras/src/backend/tensorflow/trainer.py``);
- no update is applied twice or lost: the OOM happens in forward/backward, before the optimizer update (checked:
  if ``optimizer.iterations`` moved, the error is re-raised rather than retried); what the failed attempt may
  already have changed (BatchNorm moving statistics, metric accumulators, dropout seed state) is restored from
  an on-device copy taken before each step;
- accumulation is exact for any split (:mod:`keras_scale.step`), so the final weights equal plain big-batch
  training.

Each change is printed once (chief) and, with ``log_dir``, written to TensorBoard (``auto_accum/accum``,
``auto_accum/micro_batch_size`` at the optimizer step). ``wrapped.accum`` reports the value in use.

With ``steps_per_execution > 1`` auto mode fetches and runs the execution's batches one by one (one traced call
per batch): batch callbacks still fire every ``steps_per_execution`` batches, and a retry never replays a batch
that already trained.

What it learns is a SIZE (the largest per-replica micro-batch that fits, checkpointed by ChiefCheckpoint):
each batch of ``b`` samples per replica is split into ``ceil(b / size)`` micro-batches, so a later, smaller
batch is not split needlessly. ``wrapped.accum`` is the number of micro-batches of the latest batch.

Multi-worker: the workers agree on the new size (the MIN of every proposal, exchanged through the coordination
service's key-value store) before retrying, so they can never disagree. Before each step they exchange their per-replica batch
sizes (one more small collective per step): when they differ (an uneven last batch), no worker runs a micro-batch larger
than one every worker already trained with, so one worker cannot run out of memory alone while the others wait
in the step's all-reduce. If one still does (uneven batches at the very first step, uneven hardware), it raises
a clear error after ``AGREE_TIMEOUT_S`` instead of hanging; pass ``max_micro_batch_size`` (e.g. from
:func:`find_micro_batch` on the smallest device) in that case.

Example:
    import keras_scale as ks
    model = ks.wrap(build_model(), accum="auto")
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(ds)          # an OOM at batch 256 retries the batch as 2 x 128, then 4 x 64, ...
    model.accum            # micro-batches of the latest batch, e.g. 4
"""
from __future__ import annotations

import math
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import keras
import tensorflow as tf

__all__ = ["AutoAccum", "AutoAccumGaveUp", "accum_for", "find_micro_batch", "next_accum"]

_ADVICE = ("Try mixed precision (keras.mixed_precision.set_global_policy('mixed_bfloat16') or 'mixed_float16'; "
           "ks.choose_precision() picks one), recompute activations with ks.remat / ks.remat_model, or a smaller "
           "model (or shorter sequences / smaller images).")


class AutoAccumGaveUp(RuntimeError):
    """Even one sample per micro-batch runs out of device memory: splitting cannot help any more.

    Example:
        try:
            model.fit(ds)
        except ks.AutoAccumGaveUp as err:
            print(err)          # says what to try: mixed precision, ks.remat, a smaller model
    """


def micro_batch_size(batch_size: int, accum: int) -> int:
    """The largest micro-batch when ``batch_size`` samples are split into ``accum`` near-equal parts.

    Example:
        >>> micro_batch_size(10, 3)
        4
    """
    return int(math.ceil(batch_size / max(1, min(accum, batch_size))))


def next_accum(batch_size: int, accum: int) -> Optional[int]:
    """The accum to retry with after an OOM: the micro-batch halved (rounded up); ``None`` at one sample.

    Always gives strictly smaller micro-batches than ``accum`` did for ``batch_size`` samples.

    Example:
        >>> next_accum(64, 1), next_accum(64, 2), next_accum(10, 3), next_accum(4, 4)
        (2, 4, 5, None)
    """
    micro = micro_batch_size(batch_size, accum)
    if micro <= 1:
        return None
    target = (micro + 1) // 2
    return int(math.ceil(batch_size / target))


def _per_replica_batch_size(batch: Any, strategy: Any) -> int:
    """The largest per-replica batch in a fetched (possibly distributed) batch."""
    sizes = [0]
    for t in tf.nest.flatten(batch, expand_composites=False):
        for local in strategy.experimental_local_results(t):
            shape = getattr(local, "shape", None)  # a TensorShape, or a tuple for NumPy (train_on_batch)
            dims = None if shape is None else tf.TensorShape(shape).as_list() if tf.TensorShape(
                shape).rank is not None else None
            if dims and dims[0] is not None:
                sizes.append(int(dims[0]))
        if len(sizes) > 1:
            break
    return max(sizes)


def _components(variables: List[Any], strategy: Any) -> List[tf.Variable]:
    """Each variable's per-device TF variables (a distributed variable has one per local replica)."""
    out: List[tf.Variable] = []
    for v in variables:
        tv = getattr(v, "_value", v)  # keras.Variable wraps a tf.Variable (or a distributed one)
        out.extend(strategy.experimental_local_results(tv))
    return out


def _is_multi_worker(strategy: Any) -> bool:
    extended = getattr(strategy, "extended", None)
    return bool(getattr(extended, "_num_workers", 1) > 1)


def _worker_tasks(strategy: Any) -> List[Tuple[str, int]]:
    """Every (task type, index) that runs the training program: chief and workers."""
    spec = strategy.cluster_resolver.cluster_spec().as_dict()
    return [(job, i) for job in ("chief", "worker") for i in range(len(spec.get(job, ())))]


class AutoAccum:
    """``accum="auto"`` for one wrapped model: the train function placed in ``model.train_function``.

    Created by ``keras_scale.wrap(model, accum="auto")``; :mod:`keras_scale.step` hands it each traced
    train function (:meth:`bind`), and it runs them one batch at a time, retrying a batch that ran out of memory
    with a finer split.

    What it learns is a SIZE: :attr:`micro_batch_size`, the largest per-replica micro-batch known to fit
    (``None``: no limit yet). Every batch of ``b`` samples per replica is split into ``ceil(b / size)``
    near-equal micro-batches (unsplit when ``b <= size``), so a small batch after a large one that ran out of
    memory is not split needlessly. The size lives in a variable that :class:`keras_scale.ChiefCheckpoint`
    saves and restores (``state_variables``), so a resumed run splits exactly as the interrupted one did.

    Example:
        >>> import keras, keras_scale as ks
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> wrapped = ks.wrap(model, accum="auto", max_micro_batch_size=64)
        >>> auto = wrapped._keras_scale_auto
        >>> auto.changes, auto.micro_batch_size    # [(optimizer step, old accum, new accum, per-replica batch)]
        ([], 64)
    """

    def __init__(self, model: keras.Model, max_micro_batch_size: Optional[int] = None,
                 log_dir: Optional[str] = None, verbose: int = 1) -> None:
        self.model = model
        self.max_micro_batch_size = max_micro_batch_size
        self.log_dir = log_dir
        self.verbose = verbose
        self.changes: List[Tuple[int, int, int, int]] = []
        self.recoveries = 0  # OOMs recovered from (tests, benchmarks)
        self.agreements = 0  # multi-worker: agreements (key-value exchanges) reached on a new micro-batch size
        self.size_exchanges = 0  # multi-worker: per-step collectives exchanging the workers' batch sizes
        self._traced: Any = None
        self._snapshot_fn: Any = None
        self._snapshot_components: List[Any] = []
        self._fresh = True  # the bound function has not run yet: its first call may create variables
        self._sizes_fn: Any = None
        self._scalars: Any = None
        self._scalars_failed = False
        self._built_for: Any = None  # the optimizer whose model and slots were found built
        self._ran: Optional[int] = None  # multi-worker: the largest micro-batch that trained (on every worker)
        # the learned size, checkpointed (0: no limit); a host variable: read without a device round trip
        with tf.init_scope(), tf.device("/cpu:0"):
            self._size_var = tf.Variable(int(max_micro_batch_size or 0), dtype=tf.int64, trainable=False,
                                         name="keras_scale_auto_micro_batch_size")

    # ---------------------------------------------------------------- hook called by ComposedStep
    def bind(self, traced: Any) -> "AutoAccum":
        """Run ``traced`` (the composed Keras train function for the current accum) from now on.

        Example:
            model.train_function = auto.bind(traced)
        """
        self._traced = traced
        self._snapshot_fn = None  # a new trace may have created state (Keras builds compile metrics lazily)
        self._fresh = True
        return self

    @property
    def step(self) -> Any:
        from keras_scale.step import get_step

        return get_step(self.model)

    @property
    def accum(self) -> int:
        """Micro-batches the latest batch was (or the next one is) split into; 1 before any split."""
        return int(self.step.accum or 1)

    @property
    def micro_batch_size(self) -> Optional[int]:
        """The largest per-replica micro-batch known to fit (``None``: no limit found yet)."""
        value = int(self._size_var.numpy())
        cap = self.max_micro_batch_size  # the user's limit holds whatever a restored checkpoint learned
        if cap:
            value = min(value, cap) if value else cap
        return value or None

    def state_variables(self) -> Dict[str, tf.Variable]:
        """What a checkpoint must hold to resume exactly: the learned micro-batch size."""
        return {"auto_micro_batch_size": self._size_var}

    # ---------------------------------------------------------------- the train function
    def __call__(self, iterator: Any) -> Any:
        it = iterator if hasattr(iterator, "__next__") else iter(iterator)
        outputs = None
        for _ in range(max(1, int(self.model.steps_per_execution or 1))):
            try:
                batch = next(it)
            except (StopIteration, tf.errors.OutOfRangeError):
                if outputs is None:
                    raise
                break
            outputs = self._run(batch)
        return outputs

    def _run(self, batch: Any) -> Any:
        strategy = self.model.distribute_strategy
        size = _per_replica_batch_size(batch, strategy)
        self._ensure_built(batch)
        limit = self.micro_batch_size
        sizes = [size]
        if _is_multi_worker(strategy):
            # every worker must take the same decision: a worker whose (uneven, last) batch is larger than the
            # others' must not try a micro-batch no worker has trained with yet, or it would run out of memory
            # alone while the others wait in the step's all-reduce
            sizes = self._exchange_sizes(size)
            if min(sizes) != max(sizes):
                # nothing trained yet: no worker goes beyond the smallest worker's batch, so all of them run out
                # of memory together or none does
                known = self._ran if self._ran is not None else min([s for s in sizes if s > 0] or [0])
                if known:
                    limit = min(limit or known, known)
        while True:
            wanted = accum_for(size, limit)
            if wanted != self.accum:
                self._use(wanted)
            snapshot = self._snapshot()
            try:
                outputs = self._traced([batch])
            except tf.errors.ResourceExhaustedError as err:
                limit = self._recover(err, snapshot, size)
                continue
            if self._fresh:  # its first call built what it builds: list the state again before the next step
                self._fresh, self._snapshot_fn = False, None
            ran = max(micro_batch_size(s, accum_for(s, limit)) for s in sizes)
            self._ran = max(self._ran or 0, ran)
            return outputs

    def _ensure_built(self, batch: Any) -> None:
        """Create an unbuilt model's variables and the optimizer's slots before the first attempt: a first
        attempt that runs out of memory must not leave them half made (the retry would see empty slots)."""
        model = self.model
        optimizer = model.optimizer
        if self._built_for is optimizer:  # checked once per optimizer (compile), not per step
            return
        inner = getattr(model, "inner", model)
        if all(layer.built for layer in inner._flatten_layers()) and inner.variables and (
                optimizer is None or optimizer.built):
            self._built_for = optimizer
            return
        from keras.src.trainers.data_adapters import data_adapter_utils

        strategy = model.distribute_strategy
        x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(batch)
        one = tf.nest.map_structure(lambda t: strategy.experimental_local_results(t)[0][:1], x)
        with strategy.scope():
            if not all(layer.built for layer in inner._flatten_layers()) or not inner.variables:
                inner(one, training=False)
                model.built = True
            if optimizer is not None and not optimizer.built and model.trainable_variables:
                optimizer.build(model.trainable_variables)
        self._built_for = optimizer

    def _use(self, accum: int) -> None:
        """Place the composed function for ``accum`` micro-batches (traced once per value, then cached)."""
        model = self.model
        self.step.configure(accum=accum)
        object.__setattr__(model, "accum", accum)
        previous = model.train_function  # this object, or a callback's wrapper around it (ChiefCheckpoint)
        self.step.place_train_function()  # binds the function here
        if previous is not None:
            model.train_function = previous

    # ---------------------------------------------------------------- recovery
    def _state_variables(self) -> List[Any]:
        """What a failed attempt may have changed besides weights and slots (:mod:`keras_scale.state` defines it)."""
        from keras_scale import state as training_state

        return training_state.step_mutable_variables(self.model)

    def _snapshot(self) -> Tuple[Any, List[tf.Tensor]]:
        """On-device copies of what a failed attempt may have changed, and ``optimizer.iterations``.

        The list of variables is made once per bound function (and again after its first call); each step then
        costs one small traced call that copies them on their devices. The variables are the traced function's
        argument (one trace per list of shapes), not captures (a new function per list would re-trace).
        """
        strategy = self.model.distribute_strategy
        if self._snapshot_fn is None:
            variables = self._state_variables()
            # the last entry: optimizer.iterations (fit needs a compiled model), compared, never restored
            components = _components(variables, strategy)
            components.append(_components([self.model.optimizer.iterations], strategy)[0])
            self._snapshot_fn, self._snapshot_components = _copy_fn(), components
        components = self._snapshot_components
        return components, self._snapshot_fn(components)

    def _recover(self, err: tf.errors.ResourceExhaustedError, snapshot: Tuple[Any, List[tf.Tensor]],
                 size: int) -> int:
        """Undo the failed attempt, agree on a smaller micro-batch size and return it (or give up)."""
        components, values = snapshot
        before, after = int(values[-1].numpy()), int(components[-1].numpy())
        if after != before:  # cannot happen with the composed step's atomic update; never apply a step twice
            raise RuntimeError(
                f"keras_scale accum='auto': the device ran out of memory AFTER the optimizer applied this "
                f"step's update (iterations {before} -> {after}), so retrying would apply it twice. The batch "
                f"trained; set max_micro_batch_size lower to avoid the late allocation. The error: "
                f"{_key_line(err)}") from err
        for c, value in zip(components[:-1], values[:-1]):
            c.assign(value)
        # metrics built by the failed attempt's trace (Keras builds compile metrics lazily) started at zero
        known = {id(c) for c in components}
        for c in _components(list(self.model.metrics_variables), self.model.distribute_strategy):
            if id(c) not in known:
                c.assign(tf.zeros_like(c))
        self._snapshot_fn = None  # list the state again (the failed trace may have created some)
        old = self.accum
        old_micro = micro_batch_size(size, old)
        proposal = (old_micro + 1) // 2 if size and old_micro > 1 else 0
        agreed = self._agree(proposal)
        if agreed <= 0:
            raise AutoAccumGaveUp(
                f"keras_scale accum='auto': out of device memory even with one sample per micro-batch "
                f"(per-replica batch {size}, accum={old}). Splitting the batch cannot help any more. "
                f"{_ADVICE} The error: {_key_line(err)}") from err
        self.recoveries += 1
        self._size_var.assign(agreed)
        self._ran = None if self._ran is None else min(self._ran, agreed)
        new = accum_for(size, agreed)
        self._announce(old, new, size, agreed)
        return agreed

    def _exchange_sizes(self, size: int) -> List[int]:
        """Multi-worker: every worker's per-replica batch size (one small collective per step)."""
        strategy = self.model.distribute_strategy
        if self._sizes_fn is None:
            @tf.function
            def gather(value: tf.Tensor) -> Any:
                def fn(v):
                    return tf.distribute.get_replica_context().all_gather(tf.reshape(v, [1]), axis=0)
                return strategy.run(fn, args=(value,))

            self._sizes_fn = gather
        result = self._sizes_fn(tf.constant(size, tf.int64))
        self.size_exchanges += 1
        return [int(v) for v in strategy.experimental_local_results(result)[0].numpy()]

    def _agree(self, proposal: int) -> int:
        """Multi-worker: the MIN of every worker's proposed micro-batch size (0: give up); else ``proposal``.

        Through the coordination service's key-value store, not a collective: each worker publishes its
        proposal and reads the others' with a time limit. A worker that ran out of memory alone finds the others
        waiting in the step's all-reduce, and says so instead of hanging, without aborting a collective (TF's
        collective abort path can crash the process before the error reaches Python).
        """
        strategy = self.model.distribute_strategy
        if not _is_multi_worker(strategy):
            return proposal
        from tensorflow.python.eager import context

        from keras_scale.distribute import task_identity

        global _AGREEMENTS
        _AGREEMENTS += 1  # (every worker runs the same program: its n-th agreement is theirs)
        task_type, index = task_identity(strategy)
        key = f"keras_scale/auto_accum/agree/{_AGREEMENTS}"
        ctx = context.context()
        ctx.set_config_key_value(f"{key}/{task_type}/{index}", str(int(proposal)))
        deadline = time.monotonic() + AGREE_TIMEOUT_S
        values = [int(proposal)]
        try:
            for other_type, other in _worker_tasks(strategy):
                if (other_type, other) == (task_type, index):
                    continue
                remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))  # (0 would wait forever)
                values.append(int(ctx.get_config_key_value(f"{key}/{other_type}/{other}", remaining_ms)))
        except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError, tf.errors.CancelledError) as err:
            raise RuntimeError(
                f"keras_scale accum='auto': this worker ran out of device memory but the other workers did not "
                f"join the agreement on a smaller micro-batch within {AGREE_TIMEOUT_S:.0f} s: they are waiting "
                f"in the step's all-reduce, so only this worker ran out of memory (different hardware, or memory "
                f"used by something else on this device). Pass max_micro_batch_size= (e.g. from "
                f"ks.find_micro_batch on the smallest device) so that every worker splits alike.") from err
        self.agreements += 1
        return min(values)

    def _announce(self, old: int, new: int, size: int, micro_limit: int) -> None:
        from keras_scale.distribute import chief_print

        model = self.model
        iteration = int(model.optimizer.iterations.numpy()) if model.optimizer is not None else 0
        self.changes.append((iteration, old, new, size))
        micro = micro_batch_size(size, new)
        from keras_scale import events  # (this module imports keras_scale lazily)
        events.record("oom_resplit", iteration, log_dir=self.log_dir, old_accum=old, new_accum=new, old_micro_batch=micro_batch_size(size, old), new_micro_batch=micro, batch_size=size)
        chief_print(f"keras_scale accum='auto': out of memory at optimizer step {iteration} (per-replica batch "
                    f"{size}, accum={old}, micro-batches of {micro_batch_size(size, old)}); training with "
                    f"accum={new} (micro-batches of {micro}) from the same batch on; every later batch is split "
                    f"into micro-batches of at most {micro_limit} samples.",
                    strategy=model.distribute_strategy, verbose=self.verbose, incident=True)
        if self.log_dir is not None and not self._scalars_failed:
            try:
                if self._scalars is None:
                    from keras_scale.scalars import ChiefScalars

                    self._scalars = ChiefScalars(self.log_dir, strategy=model.distribute_strategy)
                self._scalars.write({"auto_accum/accum": new, "auto_accum/micro_batch_size": micro_limit},
                                    step=iteration)
            except (tf.errors.OpError, OSError, TypeError, ValueError) as e:  # never let logging stop training
                self._scalars_failed = True
                warnings.warn(f"keras_scale accum='auto': cannot write TensorBoard scalars to "
                              f"log_dir={self.log_dir!r} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                              f"training goes on without them.", RuntimeWarning, stacklevel=2)


AGREE_TIMEOUT_S = 120.0  # multi-worker: how long a worker that ran out of memory waits for the others
_AGREEMENTS = 0  # multi-worker: agreements this process started (their keys in the coordination service)


def accum_for(batch_size: int, micro_limit: Optional[int]) -> int:
    """Micro-batches for ``batch_size`` samples so that none holds more than ``micro_limit`` (``None``: 1).

    Example:
        >>> accum_for(64, 8), accum_for(8, 8), accum_for(5, 4), accum_for(64, None)
        (8, 1, 2, 1)
    """
    if not micro_limit or batch_size <= micro_limit:
        return 1
    return int(math.ceil(batch_size / micro_limit))


def _key_line(err: BaseException) -> str:
    """The line of an OOM error that says what could not be allocated."""
    lines = [line.strip() for line in str(err).splitlines()
             if line.strip() and not line.strip().startswith(("File ", "Detected at node"))]
    for wanted in ("OOM ", "out of memory", "ResourceExhausted", "failed to allocate"):
        for line in lines:
            if wanted in line:
                return line[:300]
    return lines[0][:300] if lines else type(err).__name__


_COPY_FN: Any = None


def _copy_fn() -> Any:
    """One traced function copying a list of variables on their devices (variables are arguments: it traces
    once per list of shapes and dtypes, never per model or per call)."""
    global _COPY_FN
    if _COPY_FN is None:
        @tf.function(autograph=False, reduce_retracing=True)
        def copy(components: List[tf.Variable]) -> List[tf.Tensor]:
            copies = []
            for c in components:
                with tf.device(c.device):
                    copies.append(tf.identity(c))
            return copies

        _COPY_FN = copy
    return _COPY_FN


def find_micro_batch(model: keras.Model, sample_batch: Any, max_size: Optional[int] = None) -> int:
    """The largest micro-batch (samples) whose forward+backward pass fits in device memory, before training.

    Runs forward and backward passes (no optimizer update) on the first ``m`` samples of ``sample_batch`` for
    halving ``m`` until one fits, then bisects between the largest that fits and the smallest that does not.
    Weights, BatchNorm statistics and metrics are left as they were. Use it to start ``accum="auto"`` at the
    right split (``max_micro_batch_size``) or to pick ``wrap(model, micro_batch_size=...)``. Each size that does
    not fit costs however long the allocator waits before it reports the OOM (10 s with oneDNN's CPU allocator).

    Args:
        model: a compiled model (wrapped or not); the probe runs on one device.
        sample_batch: ``(x, y)`` or ``(x, y, sample_weight)`` with as many samples as the largest micro-batch
            to consider (e.g. one per-replica batch).
        max_size: consider at most this many samples (default: the sample batch's size).

    Raises:
        AutoAccumGaveUp: when even one sample does not fit.

    Example:
        size = ks.find_micro_batch(model, next(iter(ds)))
        wrapped = ks.wrap(model, accum="auto", max_micro_batch_size=size)
    """
    from keras.src.trainers.data_adapters import data_adapter_utils

    from keras_scale._validate import check_int

    # a keras_scale.wrap model trains its inner model: keras_scale.accumulation.unwrap, read from the class marker
    # step.has_own_train_step reads too (keras_scale.accumulation imports this module, so this one cannot import it)
    inner = model.inner if getattr(type(model), "_keras_scale_composed", False) else model
    if getattr(model, "_compile_loss", None) is None and getattr(model, "loss", None) is None:
        raise ValueError("find_micro_batch needs a compiled model (model.compile(optimizer=..., loss=...)) to "
                         "run its loss and backward pass.")
    if isinstance(sample_batch, (tf.data.Dataset, keras.utils.PyDataset)) or hasattr(sample_batch, "__next__"):
        raise TypeError(f"find_micro_batch takes one batch, not a {type(sample_batch).__name__}: pass one batch, "
                        f"e.g. ks.find_micro_batch(model, next(iter(ds))).")
    if max_size is not None:
        check_int("max_size", max_size, hint="Example: ks.find_micro_batch(model, batch, max_size=64).")
    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(tuple(sample_batch)
                                                                      if isinstance(sample_batch, list)
                                                                      else sample_batch)
    first = tf.nest.flatten(x)[0]
    total = int(first.shape[0])
    if max_size is not None:
        total = min(total, int(max_size))
    if total < 1:
        raise ValueError(f"find_micro_batch needs a sample batch with at least one sample, got {total}.")
    from keras_scale import state as training_state

    state = training_state.step_mutable_variables(model)  # the probe must leave BN statistics and metrics as they were
    saved = [v.numpy() for v in state]

    @tf.function(reduce_retracing=True)
    def probe(x, y, sample_weight):
        with tf.GradientTape() as tape:
            y_pred = inner(x, training=True)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        grads = tape.gradient(loss, inner.trainable_weights)
        return tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads if g is not None]
                        or [tf.constant(0.0)])

    def fits(m: int) -> bool:
        take = lambda s: None if s is None else tf.nest.map_structure(lambda t: t[:m], s)  # noqa: E731
        try:
            probe(take(x), take(y), take(sample_weight)).numpy()
            return True
        except tf.errors.ResourceExhaustedError:
            return False

    try:
        with model.distribute_strategy.scope():
            bad = None
            m = total
            while not fits(m):
                bad = m
                if m == 1:
                    raise AutoAccumGaveUp(f"find_micro_batch: one sample does not fit in device memory. {_ADVICE}")
                m = (m + 1) // 2
            good = m
            while bad is not None and bad - good > 1:
                mid = (good + bad) // 2
                if fits(mid):
                    good = mid
                else:
                    bad = mid
            return good
    finally:
        for v, value in zip(state, saved):
            v.assign(value)
