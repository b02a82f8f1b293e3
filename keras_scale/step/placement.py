"""Which train function Keras gets: the composed one (traced once per configuration) or Keras's own.

At each fit start (through the ``make_train_function`` hook of :mod:`keras_scale.lifecycle`) the step checks
what it cannot train exactly, installs the optimizer switches, and puts the train function for its current
configuration in ``model.train_function``: one traced by an earlier fit with the same configuration and compile
state when there is one; with no part asked for, Keras's own comes back (:meth:`PlacementMixin.give_back_plain`).
"""
from __future__ import annotations

from typing import Any, Callable, Tuple

import keras

from keras_scale import state as training_state
from keras_scale.epoch_logs import epoch_logs_as_keras
from keras_scale.model_kind import has_own_train_step, overrides
from keras_scale.progress_bar import quiet_progress_bar
from keras_scale.step.model_checks import check_supported, check_wrappable
from keras_scale.step.numerics import _unique
from keras_scale.step.optimizer_switches import _install_metric_switch, _install_optimizer_switches


def _make_keras_function(model: keras.Model, step_fn: Callable[[Any], Any]) -> Any:
    """Keras's own train-function machinery around ``step_fn`` (steps_per_execution, jit_compile, strategy)."""
    if hasattr(model, "_make_function"):
        return model._make_function(step_fn)
    # older Keras: build with train_step swapped in (main thread; nothing traces until the first call, when the
    # swap is gone: so trace it through a closure that always calls step_fn)
    saved = vars(model).get("train_function")
    object.__setattr__(model, "train_step", step_fn)
    try:
        type(model).make_train_function(model, force=True)
        return model.train_function
    finally:
        object.__delattr__(model, "train_step")
        if saved is not None:
            model.train_function = saved


class PlacementMixin:
    """The train-function part of :class:`keras_scale.step.ComposedStep` (main thread, at fit start)."""

    # ---------------------------------------------------------------- train functions (main thread)
    def _compile_identity(self) -> Tuple:
        model = self.model
        return (model.optimizer, getattr(model, "_compile_loss", None), getattr(model, "_compile_metrics", None),
                getattr(model, "_loss_tracker", None), model.steps_per_execution, model.jit_compile,
                model.run_eagerly, model.distribute_strategy)

    @staticmethod
    def _same(a: Tuple, b: Tuple) -> bool:
        return len(a) == len(b) and all(x is y or (isinstance(x, (int, bool)) and x == y) for x, y in zip(a, b))

    def _config(self) -> Tuple:
        return (self.accum, self.micro_batch_size, self.unrolled, self.guard, self.halt_after_consecutive,
                self.check_gradients)

    def _ours(self, fn: Any) -> bool:
        return fn is not None and (fn is self._outer_placed or any(fn is cached for _, cached in self._cache.values()))

    def place_train_function(self, force: bool = False) -> Any:
        """Put the composed train function for the current configuration in ``model.train_function``.

        Reuses the function traced by an earlier fit with the same configuration and compile state.

        Example:
            get_step(model).place_train_function()     # at fit start, from the make_train_function hook
        """
        model = self.model
        self._resolve()
        self._check_at_fit_start()
        identity = self._compile_identity()
        current = getattr(model.train_function, "_ks_checkpoint_inner", model.train_function)  # see through it
        if current is not None and not self._ours(current):
            self._plain = (identity, current)  # Keras's own: given back when no part is asked for
        key = self._config()
        cached = self._cache.get(key)
        for optimizer in training_state.optimizers(model).values():  # a GAN's own train_step may use several
            _install_optimizer_switches(model, self, optimizer)  # (also for a cached function: it may retrace)
        if self.guard and has_own_train_step(model):  # its trackers: updated only when its updates were applied
            for metric in _unique(list(model.metrics)):
                _install_metric_switch(model, self, metric)
        quiet_progress_bar(model, self)  # the progress bar shows nan_skipped only when a step was skipped
        # the epoch logs the metrics' results, as plain Keras (also on replicas)
        epoch_logs_as_keras(model, self, nan_when_no_step=not has_own_train_step(model))
        if force or cached is None or not self._same(cached[0], identity):
            if model.optimizer is not None:
                if not model.optimizer.built and model.built and model.trainable_variables:
                    with model.distribute_strategy.scope():  # e.g. a LossScaleOptimizer's dynamic scale
                        model.optimizer.build(model.trainable_variables)
            step_fn = self._foreign_train_step if has_own_train_step(model) else self.train_step
            cached = (identity, _make_keras_function(model, step_fn))
            self._cache[key] = cached
        fn = cached[1]
        if self.outer is not None:  # accum="auto": the OOM-retrying wrapper runs the traced function
            fn = self._outer_placed = self.outer(fn)
        elif self.guard and (has_own_train_step(model) or overrides(getattr(model, "inner", model),
                                                                    "compute_metrics")):
            fn = self._outer_placed = self._logs_of_taken_steps(fn)  # (see there: the trackers are put back)
        model.train_function = fn
        return fn

    def give_back_plain(self) -> None:
        """No part is asked for: give the model Keras's own train function (or None: Keras builds it).

        Example:
            get_step(model).give_back_plain()          # the last request was withdrawn
        """
        model = self.model
        current = getattr(model.train_function, "_ks_checkpoint_inner", model.train_function)
        if current is None or self._ours(current):
            plain = self._plain
            model.train_function = plain[1] if plain and self._same(plain[0], self._compile_identity()) else None

    def _check_at_fit_start(self) -> None:
        model = self.model
        check_supported(model)
        self._resolve()
        if self.guard and not self.check_gradients and not self.wrapped and has_own_train_step(model):
            self._warn_once("foreign_loss_only",
                            f"NanGuard(check_gradients=False): {type(model).__name__} computes its loss in its own "
                            f"train_step, out of the guard's sight; its gradients are checked at the optimizer, as "
                            f"with the default.")
        if self.wrapped:
            inner = model.inner
            check_wrappable(inner)
            if self.splits:
                self._warn_non_mean_losses()
                if overrides(inner, "compute_metrics"):
                    self._warn_once("compute_metrics", (
                        f"keras_scale.wrap: {type(inner).__name__}.compute_metrics runs once per micro-batch, with "
                        f"that micro-batch's predictions: metrics that average over samples log what plain Keras "
                        f"logs; a statistic of the whole batch (its max, a mean of a per-batch value) is taken per "
                        f"micro-batch, and a value it returns beyond the metrics' results is the last "
                        f"micro-batch's."))
