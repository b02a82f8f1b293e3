"""What does NanGuard's guarded train step cost per step, and which part costs what?

Issue 15 asks for the guarded graph's parts measured: the finite checks, the update's wait for them, the extra
all-reduce scalar and the cross-replica cond. Each arm below is its own model (same architecture, same initial
weights, same data) whose train function was traced once; the timed loop then calls the train functions
directly, in interleaved rounds (arm order shuffled each round), so tracing, callbacks and Python per-batch work
are out and only the graph differs. Printed: the median over rounds of each arm's step time divided by the bare
arm's in the same round.

Arms:
  bare                       plain Keras ``fit``'s train function
  TerminateOnNaN             identical graph to bare (Keras checks the loss on the host): the noise floor
  bare (again)               a second bare model: the control arm (how far two identical arms differ)
  NanGuard                   the default guard: skip when the loss or any gradient is non-finite (on one replica
                             the update is computed ahead and only its writes wait for the decision:
                             keras_scale/deferred_update.py)
  NanGuard(check_gradients=False)
                             skip when the loss is non-finite (decided before the backward pass)
  ks.wrap(accum=N) + NanGuard
                             the composed step with accumulation (N micro-batches of the same batch) and the guard
  LossScaleOptimizer (Keras) Keras's own skip-if-non-finite update (checks every gradient, then a cond):
                             what the same guarantee costs in Keras itself
  parts (measured by changing one thing in the default guard's graph while it is traced):
    NanGuard, update inside the cond
                                    the whole update inside the guard's cond (not deferred): what it cost before
    guard, update waits, no check   the update waits for every gradient; nothing is checked
    guard, check off the path       every gradient is checked, but the update does not wait for it
    guard, exact check after the all-reduce
                                    (2 replicas) no gradient norms in the all-reduce: every reduced gradient is checked
    guard, norms in the all-reduce  (2 replicas) the check as the previous version made it: each replica adds its
                                    gradients' norms to the all-reduce (MultiWorkerMirroredStrategy still does),
                                    instead of one check of the reduced gradients in the merge_call
    guard, a cond around the update only
                                    (2 replicas) the cross-replica cond with nothing but the update in it (no check,
                                    no restore, nothing recorded): what the cond itself costs
    guard, update waits, no cond    the update waits for every gradient and is applied unconditionally (no
                                    cond, no check): what the wait alone costs, without the cond around it

With ``--replicas 2`` (2 logical CPUs, MirroredStrategy) the guarded arms also carry the flag in the gradients'
all-reduce and the cross-replica cond.

Two identical arms (bare, bare again) can differ by several percent for the whole run, not only from round to
round: each model instance runs at its own speed. ``--copies K`` builds every arm K times (separate models, same
weights) and times each copy in every round; an arm's ratio is then the median over rounds of (its copies' mean
step time ÷ the bare copies' mean), which averages that per-instance luck out. The CPU column is the same ratio of
process CPU time (both cores' work): extra graph work shows there even when the wall time hides it.
``--arms`` keeps only the named arms (names as printed, separated by ``;``; the bare arms are always kept).

Usage: python benchmarks/nan_guard_cost.py [--rounds 21] [--steps 60] [--replicas 1|2] [--size mlp|conv]
       [--copies 1] [--arms "NanGuard;ks.wrap(accum=1) + NanGuard"]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_scale as ks  # noqa: E402
from keras_scale import step as step_lib  # noqa: E402

from callbacks_overhead import make_model  # noqa: E402  (the same MLP / conv net; benchmarks/ is on sys.path)


def make_dataset(size: str) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    batch, shape = (128, (256,)) if size == "mlp" else (64, (32, 32, 3))
    x = rng.random((batch * 16, *shape), dtype=np.float32)
    y = rng.integers(0, 10, batch * 16)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).cache().repeat().prefetch(2)


class _Grab(keras.callbacks.Callback):
    """Keeps the train function the fit runs (the composed one when a keras_scale piece is in the fit)."""

    def on_train_begin(self, logs=None):
        self.train_function = self.model.train_function


@contextlib.contextmanager
def _patched(**methods):
    """Replace ComposedStep methods while an arm's function is traced (the parts arms only)."""
    saved = {name: getattr(step_lib.ComposedStep, name) for name in methods}
    for name, fn in methods.items():
        setattr(step_lib.ComposedStep, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(step_lib.ComposedStep, name, fn)


def _loss_only(self, optimizer, any_loss_bad, reduced_grads, grads_bad=None):
    return any_loss_bad


def _apply_after_all_gradients(original):
    def conditional_apply(self, apply, grads, apply_now, snapshot, already_reduced, optimizer=None, **kwargs):
        with tf.control_dependencies([g for g in grads if g is not None]):
            apply_now = tf.identity(apply_now)
        return original(self, apply, grads, apply_now, snapshot, already_reduced, **kwargs)  # (the update inside the cond)
    return conditional_apply


def _apply_after_all_gradients_no_cond(self, apply, grads, apply_now, snapshot, already_reduced, **_):
    with tf.control_dependencies([g for g in grads if g is not None]), \
            step_lib._ThreadFlag("already_reduced", already_reduced):
        apply(grads)


def _cond_around_the_update_only(self, apply, grads, apply_now, snapshot, already_reduced, **_):
    """(several replicas) the cross-replica cond with the update in one branch and nothing in the other: no check,
    no restore, nothing recorded: what the cond itself costs."""
    def apply_fn(g):
        with step_lib._ThreadFlag("already_reduced", already_reduced):
            apply(g)

    def cross_replica(distribution, apply_now, grads):
        flag = distribution.experimental_local_results(apply_now)[0]

        def yes():
            distribution.extended.call_for_each_replica(apply_fn, args=(grads,))
            return tf.constant(True)
        tf.cond(flag, yes, lambda: tf.constant(False))
    tf.distribute.get_replica_context().merge_call(cross_replica, args=(apply_now, grads))


def _update_in_the_cond(original):
    def conditional_apply(self, apply, grads, apply_now, snapshot, already_reduced, optimizer=None, **kwargs):
        return original(self, apply, grads, apply_now, snapshot, already_reduced, **kwargs)  # (no optimizer: not deferred)
    return conditional_apply


def _no_magnitude(original):
    def all_reduce(self, grads, share, loss_bad, batch_size, even=False, check=False):
        return original(self, grads, share, loss_bad, batch_size, even=even, check=False)
    return all_reduce


def _check_off_the_path(self, optimizer, any_loss_bad, reduced_grads, grads_bad=None):
    """Every gradient is checked, but only the skip counter waits for the verdict (not the update)."""
    grads_bad = tf.logical_not(step_lib._all_gradients_finite(reduced_grads))
    self.incidents.assign_add(tf.cast(grads_bad, tf.int64))
    return any_loss_bad


def arms(size: str):
    adam = lambda: keras.optimizers.Adam(1e-3)  # noqa: E731
    C = step_lib.ComposedStep
    _no_split = {"_check_in_merge_call": lambda self, optimizer: False,  # (arms that decide without the check)
                 "_all_reduce": _no_magnitude(C._all_reduce)}
    return {  # name: (optimizer factory, callbacks factory, patches while tracing)
        "bare": (adam, lambda: [], {}),
        "TerminateOnNaN (Keras)": (adam, lambda: [keras.callbacks.TerminateOnNaN()], {}),
        "NanGuard": (adam, lambda: [ks.NanGuard(verbose=0)], {}),
        "  NanGuard, update inside the cond": (adam, lambda: [ks.NanGuard(verbose=0)],
                                               {"_conditional_apply": _update_in_the_cond(C._conditional_apply)}),
        "bare (again)": (adam, lambda: [], {}),
        "NanGuard(check_gradients=False)": (adam, lambda: [ks.NanGuard(verbose=0, check_gradients=False)], {}),
        "LossScaleOptimizer (Keras)": (lambda: keras.optimizers.LossScaleOptimizer(adam()), lambda: [], {}),
        "  guard, update waits, no check": (adam, lambda: [ks.NanGuard(verbose=0)],
                                            {"_decide_bad": _loss_only, **_no_split,
                                             "_conditional_apply": _apply_after_all_gradients(C._conditional_apply)}),
        "  guard, check off the path": (adam, lambda: [ks.NanGuard(verbose=0)],
                                        {"_decide_bad": _check_off_the_path, **_no_split}),
        "ks.wrap(accum=1) + NanGuard": (adam, lambda: [ks.NanGuard(verbose=0)], {}, 1),
        "ks.wrap(accum=2) + NanGuard": (adam, lambda: [ks.NanGuard(verbose=0)], {}, 2),
        "  guard, exact check after the all-reduce": (adam, lambda: [ks.NanGuard(verbose=0)],
                                                      {"_all_reduce": _no_magnitude(C._all_reduce)}),
        "  guard, norms in the all-reduce": (adam, lambda: [ks.NanGuard(verbose=0)],
                                            {"_check_in_merge_call": lambda self, optimizer: False}),
        "  guard, a cond around the update only": (adam, lambda: [ks.NanGuard(verbose=0)],
                                                   {"_decide_bad": _loss_only, **_no_split,
                                                    "_conditional_apply": _cond_around_the_update_only}),
        "  guard, update waits, no cond": (adam, lambda: [ks.NanGuard(verbose=0)],
                                           {"_decide_bad": _loss_only, **_no_split,
                                            "_conditional_apply": _apply_after_all_gradients_no_cond}),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per arm and round")
    parser.add_argument("--replicas", type=int, default=1, choices=(1, 2))
    parser.add_argument("--size", default="mlp", choices=("mlp", "conv"))
    parser.add_argument("--copies", type=int, default=1, help="models built per arm (their mean is the arm)")
    parser.add_argument("--arms", default="", help="';'-separated arm names: keep only these (and the bare arms)")
    args = parser.parse_args(argv)
    if args.replicas > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.replicas)])
    else:
        strategy = tf.distribute.get_strategy()
    ds = make_dataset(args.size)
    wanted = {w.strip() for w in args.arms.split(";") if w.strip()}
    chosen = {name: arm for name, arm in arms(args.size).items()
              if not wanted or name.startswith("bare") or name.strip() in wanted}
    functions, iterators = {}, {}  # (arm, copy) -> train function / iterator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (optimizer, callbacks, patches, *accum) in chosen.items():
            for copy in range(args.copies):
                keras.utils.set_random_seed(0)  # every arm starts from the same weights
                with strategy.scope():
                    model = make_model(args.size, optimizer())
                    if accum:  # the composed step with accumulation (same global batch, split in micro-batches)
                        model = ks.wrap(model, accum=accum[0])
                grab = _Grab()
                with _patched(**patches):
                    model.fit(ds, epochs=1, steps_per_epoch=3, verbose=0, callbacks=[*callbacks(), grab])
                functions[name, copy] = grab.train_function
                iterators[name, copy] = iter(strategy.experimental_distribute_dataset(ds) if args.replicas > 1 else ds)
    ratios = {name: [] for name in chosen}
    cpu_ratios = {name: [] for name in chosen}
    steps_ms = {name: [] for name in chosen}
    order = list(functions)
    for r in range(args.rounds):
        random.Random(r).shuffle(order)
        took, cpu = {}, {}
        for key in order:
            fn, it = functions[key], iterators[key]
            for _ in range(3):
                fn(it)
            t, c = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                logs = fn(it)
            float(logs["loss"])
            took[key] = (time.perf_counter() - t) / args.steps
            cpu[key] = (time.process_time() - c) / args.steps
        mean = {name: statistics.mean(took[name, c] for c in range(args.copies)) for name in chosen}
        mean_cpu = {name: statistics.mean(cpu[name, c] for c in range(args.copies)) for name in chosen}
        for name in chosen:
            ratios[name].append(mean[name] / mean["bare"])
            cpu_ratios[name].append(mean_cpu[name] / mean_cpu["bare"])
            steps_ms[name].append(mean[name] * 1e3)
    print(f"nan_guard_cost: {args.size}, {args.replicas} replica(s), {args.rounds} interleaved rounds x {args.steps} "
          f"steps, {args.copies} model(s) per arm; median step time and median of the per-round ratios to bare "
          f"(wall, and CPU time)")
    print(f"{'arm':42s} {'ms':>7s} {'ratio':>7s} {'CPU':>7s}")
    for name in chosen:
        print(f"{name:42s} {statistics.median(steps_ms[name]):7.3f} {statistics.median(ratios[name]):7.3f} "
              f"{statistics.median(cpu_ratios[name]):7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
