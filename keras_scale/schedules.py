"""Learning-rate schedules: :class:`WarmupCosine` and the large-batch scaling rule :func:`scale_lr`.

Example:
    >>> import keras, keras_scale as ks
    >>> peak = ks.scale_lr(1e-3, global_batch=1024, base_batch=256)          # 4e-3
    >>> lr = ks.WarmupCosine(peak, total_steps=10_000, warmup_steps=500)
    >>> optimizer = keras.optimizers.AdamW(lr)
"""
from __future__ import annotations

import math
import os
from typing import Any, Optional

import keras
import tensorflow as tf

__all__ = ["WarmupCosine", "ScaledSchedule", "scale_lr", "scale_learning_rate", "lr_multiplier", "inner_optimizer"]


def _check_lr(name: str, value: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite learning rate >= 0, got {value}. Pass a non-negative number.")
    return value


def _new_multiplier() -> tf.Variable:
    # Host-side state that callbacks (NanGuard rollback, plateau rules) may lower; read by the graph.
    with tf.init_scope():
        return tf.Variable(1.0, trainable=False, dtype=tf.float32, name="lr_multiplier",
                           synchronization=tf.VariableSynchronization.ON_WRITE,
                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


@keras.saving.register_keras_serializable(package="keras_scale")
class WarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup then cosine decay; steps are optimizer updates (``optimizer.iterations``).

    - ``step < warmup_steps``: ``initial_lr + (peak_lr - initial_lr) * (step + 1) / warmup_steps`` (the first
      update already uses a non-zero LR);
    - then ``final_lr + 0.5 * (peak_lr - final_lr) * (1 + cos(pi * (step - warmup_steps) / (total_steps - warmup_steps)))``;
    - ``final_lr`` for every ``step >= total_steps``.

    The result is multiplied by :attr:`lr_multiplier` (a variable, 1.0 by default) so callbacks can lower the
    learning rate of a schedule-driven optimizer (see :func:`scale_learning_rate`).

    Example:
        >>> lr = WarmupCosine(peak_lr=1.0, total_steps=1000, warmup_steps=100)
        >>> [round(float(lr(s)), 4) for s in (0, 99, 100, 550, 1000)]
        [0.01, 1.0, 1.0, 0.5, 0.0]
        >>> model.compile(optimizer=keras.optimizers.AdamW(lr), loss="mse")  # doctest: +SKIP
    """

    def __init__(
        self,
        peak_lr: float,
        total_steps: int,
        warmup_steps: int = 0,
        initial_lr: float = 0.0,
        final_lr: float = 0.0,
        name: str = "WarmupCosine",
    ) -> None:
        super().__init__()
        self.peak_lr = _check_lr("peak_lr", peak_lr)
        self.initial_lr = _check_lr("initial_lr", initial_lr)
        self.final_lr = _check_lr("final_lr", final_lr)
        if isinstance(total_steps, bool) or int(total_steps) != total_steps or total_steps <= 0:
            raise ValueError(
                f"total_steps must be a positive integer (number of optimizer updates), got {total_steps!r}. "
                "Use WarmupCosine.from_epochs(...) to derive it from epochs x steps_per_epoch."
            )
        if isinstance(warmup_steps, bool) or int(warmup_steps) != warmup_steps or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if warmup_steps > total_steps:
            raise ValueError(
                f"warmup_steps ({warmup_steps}) > total_steps ({total_steps}): the warmup would never end. "
                "Lower warmup_steps or raise total_steps."
            )
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.name = name
        self.lr_multiplier = _new_multiplier()

    @classmethod
    def from_epochs(
        cls,
        peak_lr: float,
        epochs: int,
        steps_per_epoch: int,
        warmup_epochs: float = 0,
        initial_lr: float = 0.0,
        final_lr: float = 0.0,
    ) -> "WarmupCosine":
        """Build from epochs: ``total_steps = epochs * steps_per_epoch``, warmup rounded to whole steps.

        Example:
            >>> WarmupCosine.from_epochs(0.1, epochs=90, steps_per_epoch=500, warmup_epochs=5).warmup_steps
            2500
        """
        if steps_per_epoch is None or int(steps_per_epoch) <= 0:
            raise ValueError(
                f"steps_per_epoch must be a positive integer, got {steps_per_epoch!r}. "
                "For a dataset use len(dataset) or dataset.cardinality()."
            )
        if epochs is None or epochs <= 0:
            raise ValueError(f"epochs must be > 0, got {epochs!r}")
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs!r}")
        return cls(
            peak_lr,
            total_steps=int(round(epochs * steps_per_epoch)),
            warmup_steps=int(round(warmup_epochs * steps_per_epoch)),
            initial_lr=initial_lr,
            final_lr=final_lr,
        )

    def __call__(self, step):
        with tf.name_scope(self.name):
            step = tf.cast(step, tf.float32)
            peak = tf.constant(self.peak_lr, tf.float32)
            final = tf.constant(self.final_lr, tf.float32)
            warmup = float(self.warmup_steps)
            decay_steps = float(max(self.total_steps - self.warmup_steps, 1))
            if self.warmup_steps > 0:
                warm = self.initial_lr + (self.peak_lr - self.initial_lr) * (step + 1.0) / warmup
            else:
                warm = peak
            progress = tf.clip_by_value((step - warmup) / decay_steps, 0.0, 1.0)
            cosine = final + 0.5 * (peak - final) * (1.0 + tf.cos(math.pi * progress))
            lr = tf.where(step < warmup, warm, cosine)
            lr = tf.where(step >= float(self.total_steps), final, lr)
            return lr * tf.cast(self.lr_multiplier, tf.float32)

    def get_config(self) -> dict:
        return {
            "peak_lr": self.peak_lr,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "initial_lr": self.initial_lr,
            "final_lr": self.final_lr,
            "name": self.name,
        }

    def values(self, num_steps: Optional[int] = None) -> list:
        """The learning rate at steps ``0 .. num_steps-1`` (default: ``total_steps + 1``), as floats.

        Example:
            >>> [round(v, 4) for v in WarmupCosine(1.0, total_steps=4).values()]
            [1.0, 0.8536, 0.5, 0.1464, 0.0]
        """
        n = self.total_steps + 1 if num_steps is None else int(num_steps)
        return [float(v) for v in self(tf.range(n)).numpy()]

    def plot(self, path: str, num_steps: Optional[int] = None) -> str:
        """Write the curve to a PNG at ``path`` (needs matplotlib: ``pip install keras-scale[plot]``).

        Example:
            WarmupCosine(1e-3, total_steps=1000, warmup_steps=100).plot("lr.png")
            # 'lr.png'
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("plot() needs matplotlib: pip install 'keras-scale[plot]'") from e
        ys = self.values(num_steps)
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot(range(len(ys)), ys)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("learning rate")
        ax.set_title(
            f"WarmupCosine(peak={self.peak_lr:g}, total={self.total_steps}, warmup={self.warmup_steps})"
        )
        ax.grid(alpha=0.3)
        fig.tight_layout()
        if not os.path.splitext(os.fspath(path))[1]:
            path = os.fspath(path) + ".png"  # what matplotlib writes for a name without an extension
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


@keras.saving.register_keras_serializable(package="keras_scale")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Any schedule times a multiplier variable, so a callback can lower a schedule-driven LR.

    Example:
        >>> s = ScaledSchedule(keras.optimizers.schedules.ExponentialDecay(0.1, 100, 0.9))
        >>> s.lr_multiplier.assign(0.5)  # doctest: +SKIP
    """

    def __init__(self, schedule: keras.optimizers.schedules.LearningRateSchedule) -> None:
        super().__init__()
        self.schedule = schedule
        self.lr_multiplier = _new_multiplier()

    def __call__(self, step):
        return tf.cast(self.schedule(step), tf.float32) * self.lr_multiplier

    def get_config(self) -> dict:
        return {"schedule": keras.saving.serialize_keras_object(self.schedule)}

    @classmethod
    def from_config(cls, config: dict) -> "ScaledSchedule":
        return cls(keras.saving.deserialize_keras_object(config["schedule"]))


def scale_lr(base_lr: float, global_batch: int, base_batch: int = 256, rule: str = "linear") -> float:
    """Scale a learning rate tuned at ``base_batch`` to ``global_batch`` (Goyal et al. linear rule, or sqrt).

    Pair a scaled LR with warmup (:class:`WarmupCosine`): large LRs diverge in the first steps without it.

    Example:
        >>> scale_lr(0.1, global_batch=1024, base_batch=256)
        0.4
        >>> scale_lr(0.1, global_batch=1024, base_batch=256, rule="sqrt")
        0.2
    """
    base_lr = _check_lr("base_lr", base_lr)
    if int(global_batch) != global_batch or global_batch <= 0:
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
    if int(base_batch) != base_batch or base_batch <= 0:
        raise ValueError(f"base_batch must be a positive integer, got {base_batch!r}")
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    raise ValueError(f"unknown rule {rule!r}: use 'linear' (SGD, Goyal et al.) or 'sqrt' (Adam-family, Hoffer et al.)")


def lr_multiplier(optimizer: keras.optimizers.Optimizer) -> Optional[tf.Variable]:
    """The multiplier variable of a schedule-driven optimizer's LR, or ``None`` (plain float LR or other schedule).

    Example:
        >>> opt = keras.optimizers.SGD(WarmupCosine(0.1, total_steps=100))
        >>> float(lr_multiplier(opt).numpy())
        1.0
    """
    inner = inner_optimizer(optimizer)
    return getattr(getattr(inner, "_learning_rate", None), "lr_multiplier", None)


def learning_rate_variable(optimizer: Any) -> Optional[Any]:
    """The optimizer's learning-rate variable for a float learning rate; ``None`` for a schedule (code, not state)
    or no optimizer.

    Example:
        >>> float(learning_rate_variable(keras.optimizers.SGD(0.1)).numpy())
        0.1...
        >>> learning_rate_variable(keras.optimizers.SGD(WarmupCosine(0.1, total_steps=100))) is None
        True
    """
    if optimizer is None:
        return None
    lr = getattr(inner_optimizer(optimizer), "_learning_rate", None)
    return lr if isinstance(lr, keras.Variable) else None


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer that owns the update and the learning rate: a ``LossScaleOptimizer``'s inner one, else itself.

    Example:
        >>> inner_optimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())).__class__.__name__
        'SGD'
    """
    return getattr(optimizer, "inner_optimizer", optimizer)


def scale_learning_rate(optimizer: keras.optimizers.Optimizer, factor: float) -> bool:
    """Multiply the optimizer's current learning rate by ``factor``; works when the LR is a schedule.

    Plain LR variable: assigned. :class:`WarmupCosine`/:class:`ScaledSchedule`: their multiplier is lowered
    (no retrace). Any other schedule: wrapped once in :class:`ScaledSchedule`; returns True, meaning an
    already-traced train function must be rebuilt (``model.make_train_function(force=True)``).

    Example:
        >>> opt = keras.optimizers.SGD(WarmupCosine(0.1, total_steps=100))
        >>> scale_learning_rate(opt, 0.5)
        False
    """
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
    inner = inner_optimizer(optimizer)
    mult = lr_multiplier(inner)
    if mult is not None:
        mult.assign(mult * factor)
        return False
    lr = inner._learning_rate
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        wrapped = ScaledSchedule(lr)
        wrapped.lr_multiplier.assign(factor)
        inner.learning_rate = wrapped
        return True
    if callable(lr):
        raise TypeError("cannot scale a callable learning rate; use a LearningRateSchedule or a float")
    lr.assign(lr * factor)
    return False
