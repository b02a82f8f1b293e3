"""Speed levers, measured: train the same model a few steps both ways and print which to use.

- :func:`compare_xla`: ``jit_compile=False`` vs ``jit_compile=True``.
- :func:`compare_precision`: ``float32`` vs a mixed policy (``mixed_float16`` / ``mixed_bfloat16``).

Both runs start from identical initial weights, see the identical batches (the first ``steps + 1`` batches of
``data``, cached in host memory before either run) and the same random seed. The timed steps run in alternating
chunks (baseline, candidate, baseline, ...; 4 rounds at most), so a burst of load on a shared machine hits both
sides alike. Reported per run: median step time after the first step, compile time (first step minus the
median: tracing, plus XLA compilation), peak memory where measurable (during each side's first chunk, on top of
what was in use before it: ``GPU:0`` peak allocation on a GPU; on CPU the growth of host RSS sampled every step,
approximate because freed memory gets reused) and the per-step losses (the running mean Keras logs, restarted
each chunk); the comparison says whether the losses agree (largest relative difference) and recommends one line.

Example:
    >>> import keras, keras_scale as ks
    >>> def build():
    ...     model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, "relu"), keras.layers.Dense(1)])
    ...     model.compile(optimizer="adam", loss="mse")
    ...     return model
    >>> result = ks.compare_xla(build, (x, y), steps=20)       # doctest: +SKIP
    xla: use jit_compile=True: 1.84x faster per step (4.10 -> 2.23 ms), +0.9 s compile (pays off after 481 steps), ...
    >>> result.speedup                                          # doctest: +SKIP
    1.84
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Callable, Iterator, List, Optional, Tuple, Union

import keras
import numpy as np
import tensorflow as tf

from keras_scale._validate import check_int
from keras_scale.distribute import chief_print

__all__ = ["compare_xla", "compare_precision", "LeverRun", "LeverComparison"]

ModelOrBuilder = Union[keras.Model, Callable[[], keras.Model]]


@dataclasses.dataclass
class LeverRun:
    """One side of a comparison.

    Example:
        >>> run = LeverRun("jit_compile=False", median_step_s=0.004, compile_s=0.3, peak_memory_mb=12.0,
        ...                losses=[1.0, 0.9])
    """

    label: str
    median_step_s: float
    compile_s: float
    peak_memory_mb: Optional[float]
    losses: List[float]


@dataclasses.dataclass
class LeverComparison:
    """What :func:`compare_xla` / :func:`compare_precision` measured, and the recommendation.

    ``speedup`` is baseline median step time / candidate median step time (> 1: the candidate is faster);
    ``memory_ratio`` is candidate peak / baseline peak (``None`` when not measurable); ``loss_rel_diff`` is the
    largest relative difference between the two runs' logged losses over the steps.

    Example:
        result = compare_xla(build, (x, y), steps=10)
        result.use_candidate, result.losses_agree
        # (True, True)
    """

    lever: str
    baseline: LeverRun
    candidate: LeverRun
    speedup: float
    memory_ratio: Optional[float]
    memory_source: str
    loss_rel_diff: float
    loss_rtol: float
    losses_agree: bool
    use_candidate: bool
    recommendation: str

    def __str__(self) -> str:
        return f"{self.lever}: {self.recommendation}"


# --- data -------------------------------------------------------------------------------------------------------
def _as_dataset(data: Any, batch_size: int) -> tf.data.Dataset:
    if isinstance(data, tf.data.Dataset):
        return data
    if isinstance(data, (tuple, list)) and 1 <= len(data) <= 3:
        # x may itself be a list/tuple/dict of arrays (multi-input models): keep the structure, as tuples
        arrays = keras.tree.map_structure(np.asarray, keras.tree.lists_to_tuples(tuple(data)))
        lengths = [len(a) for a in keras.tree.flatten(arrays)]
        if len(set(lengths)) != 1:
            raise ValueError(f"data arrays must have the same length (first dimension); got lengths {lengths}.")
        if lengths[0] < batch_size:
            raise ValueError(
                f"data has {lengths[0]} samples, fewer than batch_size={batch_size}; pass more data or a "
                "smaller batch_size.")
        return tf.data.Dataset.from_tensor_slices(arrays).batch(batch_size, drop_remainder=True)
    raise TypeError(
        f"data must be a batched tf.data.Dataset or an (x, y) / (x, y, sample_weight) tuple of arrays; got "
        f"{type(data).__name__}.")


def _fixed_batches(data: Any, batch_size: int, num_batches: int) -> tf.data.Dataset:
    """The first ``num_batches`` batches (repeating short data), cached and pre-read: both runs see the same."""
    dataset = _as_dataset(data, batch_size).repeat().take(num_batches).cache()
    count = sum(1 for _ in dataset)  # fill the cache now, outside both measurements
    if count < num_batches:
        raise ValueError(f"data yielded {count} batches; {num_batches} are needed. Is the dataset empty?")
    return dataset


# --- models -----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _global_policy(policy: Optional[str]) -> Iterator[None]:
    if policy is None:
        yield
        return
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def _check_model(model: Any, where: str) -> keras.Model:
    if not isinstance(model, keras.Model):
        raise TypeError(f"{where} must return a keras.Model; got {type(model).__name__}.")
    if not model.compiled:
        raise ValueError(
            f"{where}: model {model.name!r} is not compiled. Compile it (optimizer and loss) before comparing, "
            "e.g. model.compile(optimizer='adam', loss='mse').")
    return model


def _make_model(model_or_builder: ModelOrBuilder, policy: Optional[str], seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    with _global_policy(policy):
        if isinstance(model_or_builder, keras.Model):
            source = _check_model(model_or_builder, "model_or_builder")

            def clone_function(layer: keras.layers.Layer) -> keras.layers.Layer:
                config = layer.get_config()
                if policy is not None and "dtype" in config:
                    config["dtype"] = policy
                return layer.__class__.from_config(config)

            try:
                model = keras.models.clone_model(source, clone_function=clone_function)
            except Exception as e:  # noqa: BLE001 - subclassed models without get_config
                raise TypeError(
                    f"cannot clone model {source.name!r} ({type(source).__name__}): {e}. Pass a builder instead: "
                    "compare_xla(lambda: build_and_compile_model(), data).") from e
            model.compile(**keras.saving.deserialize_keras_object(source._compile_config.serialize()))
        elif callable(model_or_builder):
            model = _check_model(model_or_builder(), "model_or_builder()")
        else:
            raise TypeError(
                f"model_or_builder must be a compiled keras.Model or a function returning one; got "
                f"{type(model_or_builder).__name__}.")
        if policy is not None and policy != "float32":
            from keras_scale.precision import check_float32_outputs

            check_float32_outputs(model, fix=True)
    return model


# --- measuring --------------------------------------------------------------------------------------------------
def _gpu_name() -> Optional[str]:
    return "GPU:0" if tf.config.list_logical_devices("GPU") else None


class _StepTimer(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        import psutil

        self._process = psutil.Process()
        self.step_s: List[float] = []
        self.losses: List[float] = []
        self.rss_start = 0
        self.rss_peak = 0
        self._t0 = 0.0

    def on_train_begin(self, logs: Any = None) -> None:
        self.rss_start = self.rss_peak = self._process.memory_info().rss

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        loss = float((logs or {}).get("loss", float("nan")))  # reading the loss waits for the step to finish
        self.step_s.append(time.perf_counter() - self._t0)
        self.losses.append(loss)
        self.rss_peak = max(self.rss_peak, self._process.memory_info().rss)


class _Side:
    """One variant being measured: its model, its steps' times and losses, its first-chunk peak memory."""

    def __init__(self, model: keras.Model, label: str) -> None:
        self.model, self.label = model, label
        self.step_s: List[float] = []
        self.losses: List[float] = []
        self.peak_memory_mb: Optional[float] = None

    def run_chunk(self, dataset: tf.data.Dataset, first: bool) -> None:
        gpu = _gpu_name()
        if first and gpu:
            tf.config.experimental.reset_memory_stats(gpu)
            in_use = tf.config.experimental.get_memory_info(gpu)["current"]
        timer = _StepTimer()
        self.model.fit(dataset, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
        self.step_s += timer.step_s
        self.losses += timer.losses
        if first:  # memory the run added on top of what was in use before it (the other side's weights, ...)
            if gpu:
                self.peak_memory_mb = (tf.config.experimental.get_memory_info(gpu)["peak"] - in_use) / 2**20
            else:
                self.peak_memory_mb = (timer.rss_peak - timer.rss_start) / 2**20

    def result(self) -> LeverRun:
        median = statistics.median(self.step_s[1:])
        return LeverRun(self.label, median_step_s=median, compile_s=max(self.step_s[0] - median, 0.0),
                        peak_memory_mb=self.peak_memory_mb, losses=self.losses)


def _chunks(steps: int) -> List[Tuple[int, int]]:
    """``(start, num_batches)`` per round: the first round adds the compile step; 4 rounds at most."""
    rounds = min(4, steps)
    sizes = [steps // rounds + (1 if i < steps % rounds else 0) for i in range(rounds)]
    sizes[0] += 1
    starts = [sum(sizes[:i]) for i in range(rounds)]
    return list(zip(starts, sizes))


def _measure(make_side: Callable[[int], _Side], dataset: tf.data.Dataset, steps: int) -> List[LeverRun]:
    """Measure both sides. Side 0's first chunk (compile step included) runs before side 1 is built; then the
    timed chunks alternate (0, 1, 0, 1, ...), so a burst of load on a shared machine hits both sides alike.
    Both sides see the same batches in the same order."""
    chunks = _chunks(steps)
    sides: List[_Side] = []
    for round_index, (start, size) in enumerate(chunks):
        for index in range(2):
            if round_index == 0:
                sides.append(make_side(index))
            sides[index].run_chunk(dataset.skip(start).take(size), first=round_index == 0)
    return [side.result() for side in sides]


def _loss_rel_diff(a: List[float], b: List[float]) -> float:
    diffs = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)]
    if any(not np.isfinite(x) for x in a + b):
        return float("inf")
    return max(diffs) if diffs else float("inf")


def _compare(lever: str, baseline: LeverRun, candidate: LeverRun, loss_rtol: float, use_text: str,
             keep_text: str, min_speedup: float) -> LeverComparison:
    speedup = baseline.median_step_s / max(candidate.median_step_s, 1e-12)
    memory_ratio = None
    if baseline.peak_memory_mb and candidate.peak_memory_mb is not None and baseline.peak_memory_mb > 0:
        memory_ratio = candidate.peak_memory_mb / baseline.peak_memory_mb
    rel = _loss_rel_diff(baseline.losses, candidate.losses)
    agree = rel <= loss_rtol
    steps_ms = f"{baseline.median_step_s * 1e3:.2f} -> {candidate.median_step_s * 1e3:.2f} ms"
    memory = "" if memory_ratio is None else f", peak memory x{memory_ratio:.2f}"
    extra_compile_s = candidate.compile_s - baseline.compile_s
    if not agree:
        use, text = False, (f"keep {keep_text}: losses differ by {rel:.2%} (> loss_rtol={loss_rtol:.0%}) within "
                            f"{len(baseline.losses)} steps; step {steps_ms}")
    elif speedup >= min_speedup:
        saved_s = baseline.median_step_s - candidate.median_step_s
        payoff = f", pays off after {max(extra_compile_s, 0.0) / saved_s:.0f} steps" if extra_compile_s > 0 else ""
        use, text = True, (f"use {use_text}: {speedup:.2f}x faster per step ({steps_ms}), "
                           f"{extra_compile_s:+.1f} s compile{payoff}{memory}, losses agree within {rel:.1e}")
    else:
        use, text = False, (f"keep {keep_text}: {use_text} is not faster here ({speedup:.2f}x, {steps_ms}), "
                            f"{extra_compile_s:+.1f} s compile{memory}, losses agree within {rel:.1e}")
    source = f"{_gpu_name()} peak allocation" if _gpu_name() else "host RSS growth during the run (approximate)"
    return LeverComparison(lever, baseline, candidate, speedup, memory_ratio, source, rel, loss_rtol, agree, use, text)


def _check_common(steps: Any, batch_size: Any, loss_rtol: Any) -> None:
    check_int("steps", steps, 3, hint="It counts the steps timed after the compile step.")
    check_int("batch_size", batch_size)
    if not isinstance(loss_rtol, (int, float)) or loss_rtol <= 0:
        raise ValueError(f"loss_rtol must be a number > 0 (e.g. 0.01 for 1%), got {loss_rtol!r}.")


def _report(result: LeverComparison, verbose: bool) -> LeverComparison:
    chief_print(str(result), verbose=verbose)
    return result


# --- the levers -------------------------------------------------------------------------------------------------
def compare_xla(model_or_builder: ModelOrBuilder, data: Any, steps: int = 20, *, batch_size: int = 32,
                loss_rtol: float = 1e-2, min_speedup: float = 1.05, seed: int = 0, verbose: bool = True
                ) -> LeverComparison:
    """Train the same model ``steps`` steps with ``jit_compile=False`` and with ``jit_compile=True``; compare.

    Args:
        model_or_builder: a compiled functional/Sequential model (it is cloned twice and not trained itself), or
            a function returning a freshly built and compiled model (called twice; the second gets the first's
            initial weights).
        data: a batched ``tf.data.Dataset`` or an ``(x, y)`` tuple of arrays; the first ``steps + 1`` batches
            are used (repeated if shorter). Use a deterministic dataset (no unseeded shuffle).
        steps: timed steps after the first (compile) step, >= 3.
        batch_size: batch size when ``data`` is arrays.
        loss_rtol: relative loss difference above which the losses "disagree" and XLA is not recommended.
        min_speedup: the step-time ratio XLA must reach to be recommended.
        seed: random seed for both runs.
        verbose: print the one-line recommendation (chief only).

    Returns:
        A :class:`LeverComparison` (baseline: ``jit_compile=False``, candidate: ``jit_compile=True``).

    Example:
        result = compare_xla(build, (x, y), steps=20)
        # xla: keep jit_compile=False: jit_compile=True is not faster here (0.97x, 1.10 -> 1.13 ms), ...
    """
    _check_common(steps, batch_size, loss_rtol)
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1:
        raise ValueError(
            f"compare_xla measures one device, but it was called inside a strategy scope with {replicas} replicas "
            "(Keras does not force jit_compile under tf.distribute). Call it outside `strategy.scope()`.")
    dataset = _fixed_batches(data, batch_size, steps + 1)
    initial_weights: list = []

    def make_side(index: int) -> _Side:
        jit = index == 1
        model = _make_model(model_or_builder, None, seed)
        if index == 0:
            initial_weights.extend(model.get_weights())
        else:
            model.set_weights(initial_weights)
        model.jit_compile = jit
        if model.jit_compile != jit:
            raise ValueError(
                f"model {model.name!r} does not support jit_compile=True (Keras refused it); nothing to compare.")
        model.train_function = None
        return _Side(model, f"jit_compile={jit}")

    runs = _measure(make_side, dataset, steps)
    result = _compare("xla", runs[0], runs[1], loss_rtol, "jit_compile=True", "jit_compile=False", min_speedup)
    return _report(result, verbose)


def _default_mixed_policy() -> str:
    from keras_scale.precision import choose_precision

    chosen = choose_precision("auto")
    return chosen if chosen != "float32" else "mixed_bfloat16"


def compare_precision(model_or_builder: ModelOrBuilder, data: Any, steps: int = 20, *, policy: Optional[str] = None,
                      batch_size: int = 32, loss_rtol: float = 5e-2, min_speedup: float = 1.05, seed: int = 0,
                      verbose: bool = True) -> LeverComparison:
    """Train the same model ``steps`` steps in ``float32`` and under a mixed-precision ``policy``; compare.

    The model (or builder) is built under each global dtype policy (a model instance is cloned with every layer
    set to the policy); output layers are kept in float32 (:func:`keras_scale.precision.check_float32_outputs`);
    with ``mixed_float16`` Keras wraps the optimizer in a ``LossScaleOptimizer``. Variables stay float32 under
    mixed policies, so both runs start from identical weights.

    Args:
        model_or_builder: as in :func:`compare_xla`; a builder must build its layers inside the call (so they
            pick up the policy).
        data: a batched ``tf.data.Dataset`` or an ``(x, y)`` tuple of arrays.
        steps: timed steps after the first, >= 3.
        policy: ``"mixed_float16"`` or ``"mixed_bfloat16"``; default: :func:`keras_scale.choose_precision`'s
            choice for the visible GPUs, ``"mixed_bfloat16"`` on CPU.
        batch_size: batch size when ``data`` is arrays.
        loss_rtol: relative loss difference above which the mixed policy is not recommended (low precision
            differs a little by design: 5% by default).
        min_speedup: the step-time ratio the mixed policy must reach to be recommended.
        seed: random seed for both runs.
        verbose: print the one-line recommendation (chief only).

    Returns:
        A :class:`LeverComparison` (baseline: ``float32``, candidate: ``policy``).

    Example:
        result = compare_precision(build, (x, y), policy="mixed_float16")
        # precision: use policy mixed_float16: 2.71x faster per step (...), peak memory x0.58, ...
    """
    _check_common(steps, batch_size, loss_rtol)
    policy = _default_mixed_policy() if policy is None else policy
    if policy not in ("mixed_float16", "mixed_bfloat16"):
        raise ValueError(
            f"policy must be 'mixed_float16' or 'mixed_bfloat16' (compared against float32), got {policy!r}.")
    dataset = _fixed_batches(data, batch_size, steps + 1)
    initial_weights: list = []

    def make_side(index: int) -> _Side:
        run_policy = ("float32", policy)[index]
        model = _make_model(model_or_builder, run_policy, seed)
        if index == 0:
            initial_weights.extend(model.get_weights())
        else:
            if len(model.get_weights()) != len(initial_weights):
                raise ValueError(
                    f"the {run_policy} model has {len(model.get_weights())} weight arrays, the float32 one "
                    f"{len(initial_weights)}: the builder must build the same architecture each call.")
            model.set_weights(initial_weights)
        return _Side(model, f"policy={run_policy}")

    runs = _measure(make_side, dataset, steps)
    result = _compare("precision", runs[0], runs[1], loss_rtol, f"policy {policy}", "float32", min_speedup)
    return _report(result, verbose)
