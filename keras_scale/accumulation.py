"""Gradient accumulation: ``keras_scale.wrap(model, accum=N)``.

The batch ``fit`` delivers is the batch the optimizer sees. Each train step splits it into ``accum``
near-equal micro-batches, runs forward+backward on one micro-batch at a time (a ``tf.while_loop``, so only
one micro-batch's activations are alive), sums the sample-weighted gradients and applies ONE optimizer update
with ONE all-reduce. ``optimizer.iterations``, schedules, callbacks and checkpoints all count real updates.

Example:
    import keras, keras_scale as ks
    model = ks.wrap(build_model(), accum=4)         # or ks.wrap(model, micro_batch_size=32)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=256)                   # the device holds 64 samples at a time
    inner = ks.unwrap(model)                          # the original model, same variables
    model = ks.wrap(build_model(), accum="auto")      # split finer whenever a step runs out of memory
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Dict, Optional, Union

import keras
import tensorflow as tf

from keras_scale._validate import check_int
from keras_scale import lifecycle
from keras_scale.step import check_wrappable, get_step

__all__ = ["AccumulatingModel", "wrap", "unwrap"]


_LEND_LOCK = threading.RLock()


def _check_positive_int(name: str, value: Any) -> int:
    return check_int(name, value, hint=f"Example: keras_scale.wrap(model, {name}={4 if name == 'accum' else 32}).")


@keras.saving.register_keras_serializable(package="keras_scale")
class AccumulatingModel(keras.Model):
    """A ``keras.Model`` that trains ``inner``'s weights with gradient accumulation (see :func:`wrap`).

    ``call``, ``evaluate`` and ``predict`` behave like the inner model; ``save_weights``/``load_weights``
    read and write the inner model's weights file, so weights files interchange with the unwrapped model.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> wrapped = AccumulatingModel(model, accum=4)
        >>> wrapped.compile(optimizer="sgd", loss="mse")
        >>> wrapped.accum, wrapped.inner is model
        (4, True)
    """

    _keras_scale_composed = True

    def __init__(self, inner: keras.Model, accum: Union[int, str, None] = None,
                 micro_batch_size: Optional[int] = None, unroll: Optional[bool] = None,
                 max_micro_batch_size: Optional[int] = None, log_dir: Optional[str] = None,
                 verbose: int = 1, **kwargs: Any) -> None:
        if not isinstance(inner, keras.Model):
            raise TypeError(
                f"keras_scale.wrap expects a keras.Model, got {type(inner).__name__}. "
                "Build a keras.Sequential / functional / subclassed keras.Model first.")
        if (accum is None) == (micro_batch_size is None):
            raise ValueError(
                "Pass exactly one of accum= (micro-batches per step) or micro_batch_size= (samples per "
                f"micro-batch); got accum={accum!r}, micro_batch_size={micro_batch_size!r}.")
        auto = isinstance(accum, str) and accum == "auto"
        if accum is not None and not auto:
            if isinstance(accum, str):
                raise ValueError(f"accum must be a positive int or 'auto', got {accum!r}. "
                                 "Example: keras_scale.wrap(model, accum='auto').")
            _check_positive_int("accum", accum)
        if max_micro_batch_size is not None:
            if not auto:
                raise ValueError(f"max_micro_batch_size={max_micro_batch_size!r} only applies to accum='auto' "
                                 f"(got accum={accum!r}); use micro_batch_size= for a fixed split.")
            _check_positive_int("max_micro_batch_size", max_micro_batch_size)
        if micro_batch_size is not None:
            _check_positive_int("micro_batch_size", micro_batch_size)
        if log_dir is not None:
            if not auto:
                raise ValueError(f"log_dir={log_dir!r} only applies to accum='auto' (got accum={accum!r}); "
                                 "TensorBoard's own callback logs a fixed split's training.")
            if not isinstance(log_dir, (str, os.PathLike)):
                raise TypeError(f"log_dir must be a directory path (str or os.PathLike), got "
                                f"{type(log_dir).__name__} {log_dir!r}. Example: keras_scale.wrap(model, "
                                f"accum='auto', log_dir='runs/exp1').")
            log_dir = os.fspath(log_dir)
            if not log_dir:
                raise ValueError("log_dir='' is not a directory; pass a path (e.g. log_dir='runs/exp1') or None.")
        if verbose not in (0, 1, True, False):
            raise ValueError(f"verbose must be 0 (silent) or 1 (print each change of the split, chief only), "
                             f"got {verbose!r}.")
        if unroll not in (None, True, False):
            raise ValueError(f"unroll must be None (auto), True or False, got {unroll!r}")
        kwargs.setdefault("name", f"accumulating_{inner.name}")
        super().__init__(**kwargs)
        # train under the strategy the inner model's variables were created in
        self._distribute_strategy = getattr(inner, "_distribute_strategy", None) or self._distribute_strategy
        self.inner = inner
        self.auto_accum = auto
        self.accum = 1 if auto else accum  # accum="auto": the value in use (starts unsplit)
        self.micro_batch_size = micro_batch_size
        self.max_micro_batch_size = max_micro_batch_size
        self.log_dir = log_dir
        self.verbose = int(verbose)
        self.unroll = unroll
        step = get_step(self).configure(accum=self.accum, micro_batch_size=micro_batch_size)
        step.unrolled = unroll
        if auto:  # the OOM-retrying train function runs each traced one (keras_scale.auto_accum)
            from keras_scale.auto_accum import AutoAccum

            object.__setattr__(self, "_keras_scale_auto",
                               AutoAccum(self, max_micro_batch_size=max_micro_batch_size, log_dir=log_dir,
                                         verbose=self.verbose))
            step.outer = self._keras_scale_auto.bind
            step.atomic_update = True
        if inner.built:
            self.built = True

    @property
    def auto_micro_batch_size(self) -> Optional[int]:
        """``accum="auto"``: the largest per-replica micro-batch known to fit (``None``: no limit yet, or not auto).

        Example:
            >>> import keras
            >>> ks_model = wrap(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]), accum="auto")
            >>> ks_model.auto_micro_batch_size is None
            True
        """
        auto = vars(self).get("_keras_scale_auto")
        return None if auto is None else auto.micro_batch_size

    @property
    def output_names(self) -> Any:
        """The inner model's output names: ``compile`` names the per-output losses and metrics after them
        (``a_loss``, ``b_mae``), as for the unwrapped model."""
        return getattr(self.inner, "output_names", None)

    def build(self, input_shape: Any = None) -> None:
        if not self.inner.built and input_shape is not None:
            self.inner.build(input_shape)
        self.built = True

    def call(self, inputs: Any, training: Optional[bool] = None) -> Any:
        return self.inner(inputs, training=training)

    def train_step(self, data: Any) -> Dict[str, Any]:
        return get_step(self).train_step(data)

    # ---- everything else Keras calls runs the inner model's own methods (its overrides included), with the inner
    # model compiled as this one while they run: evaluate/predict/the logs are the unwrapped model's
    def test_step(self, data: Any) -> Any:
        with self.as_inner():
            return self.inner.test_step(data)

    def predict_step(self, data: Any) -> Any:
        with self.as_inner():
            return self.inner.predict_step(data)

    def compute_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        with self.as_inner():
            return self.inner.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    @property
    def metrics(self) -> Any:
        """The inner model's metrics (its own trackers included) as when compiled like this model."""
        inner = vars(self).get("inner")
        if inner is None:  # (during __init__)
            return super().metrics
        with self.as_inner():
            return list(inner.metrics)

    def reset_metrics(self) -> None:
        with self.as_inner():
            self.inner.reset_metrics()

    def get_metrics_result(self) -> Any:
        with self.as_inner():
            return self.inner.get_metrics_result()

    # (the optimizer too: a test_step of the model's own may read its learning rate or iterations)
    _LENT = ("compiled", "_compile_loss", "_compile_metrics", "_loss_tracker", "loss", "optimizer")

    def as_inner(self) -> Any:
        """Context: the inner model holds this model's compilation (loss, metrics, loss tracker, optimizer) while
        its own ``test_step``/``predict_step``/``compute_metrics``/``metrics`` run for this model.

        Re-entrant and shared by the replica threads of one trace: the first entry lends, the last exit gives back.

        Example:
            with wrapped.as_inner():
                logs = unwrap(wrapped).test_step(batch)   # what wrapped.test_step does
        """
        import contextlib

        @contextlib.contextmanager
        def lend() -> Any:
            with _LEND_LOCK:
                depth = vars(self).get("_keras_scale_lent", 0)
                if not depth:
                    missing = object()
                    own = {name: vars(self.inner).get(name, missing) for name in self._LENT}
                    object.__setattr__(self, "_keras_scale_inner_own", (own, missing))
                    for name in self._LENT:
                        object.__setattr__(self.inner, name, getattr(self, name, None))
                object.__setattr__(self, "_keras_scale_lent", depth + 1)
            try:
                yield
            finally:
                with _LEND_LOCK:
                    depth = vars(self)["_keras_scale_lent"] - 1
                    object.__setattr__(self, "_keras_scale_lent", depth)
                    if not depth:
                        own, missing = vars(self)["_keras_scale_inner_own"]
                        for name, value in own.items():
                            if value is missing:
                                vars(self.inner).pop(name, None)
                            else:
                                object.__setattr__(self.inner, name, value)

        return lend()

    def make_train_function(self, force: bool = False) -> Any:
        # a fit starts: undo what a died fit left, then the composed function for this fit's parts (cached)
        if lifecycle.called_by_keras_fit():
            lifecycle.fit_starts(self)
        elif not lifecycle.fit_running(self):
            lifecycle.end(self)  # train_on_batch: what a fit left is undone (the composed step stays)
        return get_step(self).place_train_function(force)

    def fit(self, x: Any = None, y: Any = None, batch_size: Optional[int] = None, **kwargs: Any) -> Any:
        self._check_batch_size(x, batch_size)
        self._warn_sparse_gradients()
        try:
            return super().fit(x, y, batch_size=batch_size, **kwargs)
        finally:  # however the fit ended (returned, raised, interrupted): what its pieces installed is undone
            lifecycle.end(self)

    def _warn_sparse_gradients(self) -> None:
        """Warn once: an Embedding's gradient with a non-SGD optimizer differs from Keras's once split.

        Keras hands the optimizer an Embedding's gradient as sparse rows, one per looked-up token, repeats
        included; Adam, RMSprop, Adagrad... square each repeat separately. Accumulation sums the micro-batches'
        gradients densely: the optimizer sees the true summed gradient (each row once), as for every other
        weight. Plain SGD (with or without momentum) is linear in the gradient: identical either way.
        """
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or getattr(self, "_keras_scale_sparse_warned", False):
            return
        from keras_scale.schedules import inner_optimizer

        if isinstance(inner_optimizer(optimizer), keras.optimizers.SGD):
            return
        embeddings = [layer.name for layer in self.inner._flatten_layers()
                      if isinstance(layer, keras.layers.Embedding) and layer.trainable]
        if not embeddings or (not self.auto_accum and (self.accum or 1) <= 1 and self.micro_batch_size is None):
            return
        object.__setattr__(self, "_keras_scale_sparse_warned", True)
        warnings.warn(
            f"keras_scale.wrap: {embeddings[0]} (Embedding) has a sparse gradient and the optimizer is "
            f"{type(inner_optimizer(optimizer)).__name__}. When a batch is split, the micro-batches' gradients are "
            f"summed densely (each embedding row once: the true batch gradient), while unsplit Keras hands the "
            f"optimizer one sparse row per looked-up token and {type(inner_optimizer(optimizer)).__name__} "
            f"squares repeated rows separately, so the weights differ from unsplit training "
            f"(docs: README 'Embeddings and adaptive optimizers'). Plain SGD is identical either way.",
            UserWarning, stacklevel=3)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().evaluate(*args, **kwargs)
        except tf.errors.ResourceExhaustedError as err:
            in_fit = bool(kwargs.get("_use_cached_eval_dataset"))
            hint = ("pass validation_batch_size= to fit (NumPy/array validation data) or batch the validation "
                    "dataset smaller" if in_fit else "pass a smaller batch_size= to evaluate (or batch the "
                    "dataset smaller)")
            raise tf.errors.ResourceExhaustedError(
                err.node_def, err.op,
                f"keras_scale.wrap splits training batches only, not evaluation ones: "
                f"{'validation during fit' if in_fit else 'evaluate'} ran out of device memory; {hint}. "
                f"{'Training itself recovered and its weights are intact. ' if in_fit else ''}"
                f"Original error: {err.message}") from err

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().predict(*args, **kwargs)
        except tf.errors.ResourceExhaustedError as err:
            raise tf.errors.ResourceExhaustedError(
                err.node_def, err.op,
                f"keras_scale.wrap splits training batches only: predict ran out of device memory; pass a smaller "
                f"batch_size= to predict (or batch the dataset smaller). Original error: {err.message}") from err

    def _check_batch_size(self, x: Any, batch_size: Optional[int]) -> None:
        """Fail at fit start (not mid-epoch): an unbatched dataset, or a per-replica batch smaller than ``accum``."""
        if isinstance(x, tf.data.Dataset):
            specs = [s for s in tf.nest.flatten(x.element_spec) if getattr(s, "shape", None) is not None]
            inputs = getattr(self.inner, "inputs", None) or []
            x_specs = [s for s in tf.nest.flatten(x.element_spec[0] if isinstance(x.element_spec, tuple)
                                                 else x.element_spec) if getattr(s, "shape", None) is not None]
            one_short = bool(inputs and x_specs and x_specs[0].shape.rank is not None
                             and x_specs[0].shape.rank == len(inputs[0].shape) - 1)
            if one_short or any(s.shape.rank == 0 for s in specs):
                raise ValueError(
                    "keras_scale.wrap splits each batch into micro-batches, but this dataset yields single samples "
                    f"(element_spec {x.element_spec}): batch your dataset first, e.g. ds.batch(64).")
            if batch_size is None:
                dims = [s.shape[0] for s in specs if s.shape.rank]
                batch_size = dims[0] if dims and dims[0] is not None else None
        if self.accum is None or batch_size is None or self.auto_accum:
            return
        replicas = self.distribute_strategy.num_replicas_in_sync
        if batch_size // replicas < self.accum:
            raise ValueError(
                f"batch size {batch_size} over {replicas} replica(s) gives {batch_size // replicas} samples per "
                f"replica, fewer than accum={self.accum}: every micro-batch needs at least one sample. "
                f"Use a batch size >= {self.accum * replicas} or lower accum.")

    def compute_output_spec(self, inputs: Any, training: Optional[bool] = None) -> Any:
        return self.inner.compute_output_spec(inputs)

    # weights files interchange with the unwrapped model; like a plain compiled model's, they hold the optimizer
    def save_weights(self, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
        with self._optimizer_on_inner():
            return self.inner.save_weights(filepath, overwrite=overwrite, **kwargs)

    def load_weights(self, filepath: str, skip_mismatch: bool = False, **kwargs: Any) -> None:
        with self._optimizer_on_inner():
            return self.inner.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)

    def _optimizer_on_inner(self) -> Any:
        """While a weights file is written or read, the inner model holds the wrapper's optimizer (the
        attribute a plain compiled model's file stores it under), so the file is a plain model's file."""
        import contextlib

        @contextlib.contextmanager
        def swap() -> Any:
            optimizer = getattr(self, "optimizer", None)
            if optimizer is None:
                yield
                return
            missing = object()
            before = vars(self.inner).get("optimizer", missing)
            object.__setattr__(self.inner, "optimizer", optimizer)
            try:
                yield
            finally:
                if before is missing:
                    object.__delattr__(self.inner, "optimizer")
                else:
                    object.__setattr__(self.inner, "optimizer", before)

        return swap()

    def get_config(self) -> Dict[str, Any]:
        config = {"inner": keras.saving.serialize_keras_object(self.inner),
                  "accum": "auto" if self.auto_accum else self.accum,
                  "micro_batch_size": self.micro_batch_size, "unroll": self.unroll, "name": self.name}
        if self.auto_accum:
            config.update(max_micro_batch_size=self.max_micro_batch_size, log_dir=self.log_dir,
                          verbose=self.verbose)
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and optimizer is getattr(self.inner, "optimizer", None):
            # One optimizer object, compiled into both (keras_scale.fit does so): Keras saves its variables once,
            # under the inner model (visited first), and an empty group under this model.
            config["shares_inner_optimizer"] = True
        return config

    @classmethod
    def from_config(cls, config: Dict[str, Any], custom_objects: Any = None) -> "AccumulatingModel":
        config = dict(config)
        shares = bool(config.pop("shares_inner_optimizer", False))
        inner = keras.saving.deserialize_keras_object(config.pop("inner"), custom_objects=custom_objects)
        model = cls(inner, **config)
        object.__setattr__(model, "_keras_scale_shares_inner_optimizer", shares)
        return model

    def compile_from_config(self, config: Dict[str, Any]) -> None:
        """Keras's ``load_model`` hook; a wrapper saved sharing its inner model's optimizer shares it again.

        Example:
            loaded = keras.models.load_model("wrapped.keras")  # calls it
            assert loaded.optimizer is unwrap(loaded).optimizer
        """
        super().compile_from_config(config)
        inner_optimizer = getattr(self.inner, "optimizer", None)
        if getattr(self, "_keras_scale_shares_inner_optimizer", False) and inner_optimizer is not None:
            # Saved with one optimizer shared with the inner model: share it again, so the loaded state (moments,
            # iterations) is the one this model trains with.
            self.optimizer = inner_optimizer


def wrap(model: keras.Model, accum: Union[int, str, None] = None, micro_batch_size: Optional[int] = None,
         unroll: Optional[bool] = None, max_micro_batch_size: Optional[int] = None,
         log_dir: Optional[str] = None, verbose: int = 1) -> AccumulatingModel:
    """Return a model that trains ``model``'s weights with exact gradient accumulation.

    Args:
        model: any Keras model (create it inside the strategy scope for multi-device training) whose class does not
            define its own ``train_step`` or ``compute_loss``, nor its own ``fit``/``evaluate``/``predict``/
            ``*_on_batch`` (refused here: the wrapper would replace them). Its other overrides are kept:
            ``evaluate``/``predict`` run its ``test_step``/``predict_step`` (which may read ``self.optimizer``),
            training calls its ``compute_metrics`` (once per micro-batch; what it returns beyond the metrics is
            logged, split: the last micro-batch's) and ``call(..., training=True)``, and the logs are its
            ``metrics`` (its own trackers included), as for the unwrapped model compiled like the wrapper. A
            model compiled before ``wrap`` passes its compilation on (the same optimizer object, loss,
            ``loss_weights``, metrics); compiling the wrapper afterwards replaces it. While the wrapper's
            ``fit``/``evaluate``/``predict`` runs, the inner model holds the wrapper's compilation
            (:meth:`AccumulatingModel.as_inner`): do not run the inner model's own ``fit``/``evaluate``/
            ``predict`` in another thread meanwhile.
        accum: split each batch into this many micro-batches; ``"auto"``: start unsplit and split finer
            whenever a step runs out of device memory, retrying the same batch (:mod:`keras_scale.auto_accum`);
            what it learns is the largest micro-batch SIZE that fits: each batch of ``b`` samples per replica
            is then split into ``ceil(b / size)`` micro-batches, and ``wrapped.accum`` is the number of
            micro-batches the latest batch was split into (1 while unsplit); ``wrapped.auto_micro_batch_size``
            is the learned size (``None`` while unlimited).
        micro_batch_size: or: micro-batches of (at most) this many samples; ``accum`` follows per step.
        unroll: how the micro-batches are looped. ``None`` (default): a ``tf.while_loop`` (lowest memory), or a
            Python-unrolled loop chained by control dependencies when the model has synchronized BatchNorm or is
            compiled with ``jit_compile`` (both need it), or during a fit with a ``ProfileWindow`` still to come (xprof
            ignores step markers when the step contains a ``tf.while_loop``). ``True`` forces the unrolled loop.
        max_micro_batch_size: ``accum="auto"`` only: never hand the device more than this many samples per
            micro-batch (e.g. from :func:`keras_scale.find_micro_batch`); OOMs still split finer.
        log_dir: ``accum="auto"`` only: write each change of accum to TensorBoard here (chief only); a
            directory that cannot be written costs a warning, never the training.
        verbose: ``accum="auto"``: 1 (default) prints each change of the split once (chief only); 0 is silent.

    The update equals the big-batch update: gradients are the sample-weighted mean over the whole batch
    (uneven last batches included); one optimizer update and one all-reduce per step; clipping, weight decay
    and EMA apply to the accumulated, globally reduced gradient. BatchNorm normalises each micro-batch with its
    own statistics and updates its moving statistics once per micro-batch.

    Example:
        >>> import keras, numpy as np
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> wrapped = wrap(model, accum=4)
        >>> wrapped.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
        >>> history = wrapped.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=8, verbose=0)  # 4 x 2 samples
        >>> int(wrapped.optimizer.iterations.numpy())                                         # one update
        1
        >>> other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> auto = wrap(other, accum="auto")   # split only when a step runs out of memory
        >>> third = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> third.compile(optimizer="adam", loss="mse")
        >>> wrap(third, accum=2).optimizer is third.optimizer   # compiled first: the compilation carries over
        True
    """
    if isinstance(model, AccumulatingModel):
        raise ValueError("model is already wrapped; use keras_scale.unwrap(model) first or keep one wrap.")
    if isinstance(model, keras.Model):
        check_wrappable(model)  # here, not at fit start: whatever order wrap and compile come in
    wrapped = AccumulatingModel(model, accum=accum, micro_batch_size=micro_batch_size, unroll=unroll,
                                max_micro_batch_size=max_micro_batch_size, log_dir=log_dir, verbose=verbose)
    if getattr(model, "compiled", False):
        _carry_compilation(model, wrapped)
    return wrapped


def _carry_compilation(model: keras.Model, wrapped: AccumulatingModel) -> None:
    """``model`` was compiled before ``wrap``: compile the wrapper the same way, with the same optimizer object
    (its state, its schedule), loss, loss_weights, metrics and options, so ``compile; wrap; fit`` just works."""
    config = getattr(model, "_compile_config", None)
    kwargs = dict(config.config) if config is not None else {}
    kwargs["optimizer"] = model.optimizer
    with wrapped.distribute_strategy.scope():
        wrapped.compile(**kwargs)


def unwrap(model: keras.Model) -> keras.Model:
    """The inner model of a wrapped model (same variables); any other model is returned as is.

    The inner model keeps its own compilation: one compiled before ``wrap()`` still is; after ``wrap()`` then
    ``compile()`` only the wrapper is compiled, so compile the inner model before ``evaluate``/``fit`` on it
    (``inner.compile(optimizer=wrapped.optimizer, loss=...)`` shares the trained optimizer state).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> unwrap(wrap(model, accum=2)) is model
        True
    """
    return model.inner if isinstance(model, AccumulatingModel) else model
