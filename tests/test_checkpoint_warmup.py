"""ChiefCheckpoint touches the memory its first saves write into, in the background (checkpoint/warmup.py): once per
fit, sized from the training state, after the fit-start restore (never slowing it), after the first step for a
model that gets its variables there, never beyond a quarter of the available memory, and never on a non-chief."""
import threading

import numpy as np
import pytest

import keras_scale as ks
from keras_scale import state as training_state
from keras_scale.callbacks.checkpoint import warmup
from tests._helpers import StopAfter, fit, make_model, weights
from tests._models import GAN_X, gan_weights, make_gan


@pytest.fixture
def started(monkeypatch):
    """Every warm-up ChiefCheckpoint starts: ``(bytes, the callback's restored_from then)``; each really runs."""
    calls = []
    real = warmup.warm_memory

    def spy(nbytes):
        calls.append(nbytes)
        thread = real(nbytes)
        if thread is not None:
            thread.join(timeout=60)  # (done before the test looks)
        return thread

    monkeypatch.setattr(warmup, "warm_memory", spy)
    return calls


def test_one_warm_up_per_fit_sized_from_the_training_state(tmp_path, started):
    model = make_model(width=64)
    ckpt = ks.ChiefCheckpoint(str(tmp_path / "ck"), save_freq=5, max_to_keep=2)
    fit(model, [ckpt], epochs=2)
    nbytes = warmup.checkpoint_nbytes(training_state.variables(model))
    # weights + both Adam moments are in it (and not much else)
    assert nbytes >= 3 * sum(w.nbytes for w in weights(model))
    # max_to_keep + 1 checkpoints of the state at fit start (a few scalars, e.g. metric counts, come later)
    assert len(started) == 1 and 0 <= 3 * nbytes - started[0] <= 3 * 64
    fit(model, [ks.ChiefCheckpoint(str(tmp_path / "ck"), save_freq=5, max_to_keep=2)], epochs=3)
    assert len(started) == 2  # one more for the second fit, and none per batch


def test_the_warm_up_comes_after_the_restore_and_changes_nothing_in_training(tmp_path, monkeypatch):
    seen = []
    real = warmup.warm_memory

    def spy(nbytes):
        seen.append(ckpt.restored_from)
        return real(nbytes)

    monkeypatch.setattr(warmup, "warm_memory", spy)
    directory = str(tmp_path / "ck")
    reference = make_model()
    fit(reference, [], epochs=3)
    first = make_model()
    ckpt = ks.ChiefCheckpoint(directory, save_freq=3)
    fit(first, [ckpt, StopAfter(14)], epochs=3)
    second = make_model()
    ckpt = ks.ChiefCheckpoint(directory, save_freq=3)
    fit(second, [ckpt], epochs=3)
    assert seen[0] is None and seen[1] is not None  # the resumed fit: started once the checkpoint was restored
    for a, b in zip(weights(reference), weights(second)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_model_whose_optimizers_are_built_by_its_first_step_is_warmed_after_it(tmp_path, started):
    gan = make_gan()
    assert not any(opt.built for opt in training_state.optimizers(gan).values())  # (keras-io's GAN: no call())
    gan.fit(GAN_X, epochs=1, batch_size=8, verbose=0, callbacks=[ks.ChiefCheckpoint(str(tmp_path / "ck"))])
    assert len(started) == 1
    assert started[0] >= 4 * 3 * sum(w.nbytes for w in gan_weights(gan))  # both optimizers' moments, 4 checkpoints


def test_a_non_chief_or_a_remote_directory_touches_nothing(tmp_path, monkeypatch, started):
    monkeypatch.setattr("keras_scale.callbacks.checkpoint.callback.is_chief", lambda strategy: False)
    fit(make_model(), [ks.ChiefCheckpoint(str(tmp_path / "ck"), save_freq=5)], epochs=1)
    assert started == []


def test_never_more_than_a_quarter_of_the_available_memory_nor_the_cap():
    gib = 2**30
    assert warmup.planned_bytes(10 * gib, max_to_keep=3, available=8 * gib) == 2 * gib
    assert warmup.planned_bytes(10 * gib, max_to_keep=3, available=1024 * gib) == warmup.MAX_WARM_BYTES
    assert warmup.planned_bytes(10 * 2**20, max_to_keep=0, available=1024 * gib) == 20 * 2**20  # at least 1 kept
    assert warmup.planned_bytes(10 * gib, max_to_keep=3, available=None) == 0  # unknown: touch nothing
    assert warmup.warm_memory(0) is None
    thread = warmup.warm_memory(32 * 2**20)
    assert isinstance(thread, threading.Thread) and thread.daemon
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_bfloat16_and_float8_values_are_counted():
    import keras
    import ml_dtypes

    assert warmup.checkpoint_nbytes({"w": keras.Variable(np.zeros((256, 4)), dtype="bfloat16")}) == 2048
    assert warmup.checkpoint_nbytes({"f8": np.zeros((10,), ml_dtypes.float8_e4m3fn)}) == 10
    assert warmup.checkpoint_nbytes({"s": keras.Variable(np.zeros((3,)), dtype="float32")}) == 12


def test_one_warm_up_at_a_time_in_a_process(monkeypatch):
    """Fits in a quick loop: a warm-up still running means no second one (the caps hold for the process)."""
    gate = threading.Event()
    monkeypatch.setattr(warmup, "_touch", lambda nbytes: gate.wait(30))
    first = warmup.warm_memory(2**20)
    assert first is not None and warmup.warm_memory(2**20) is None
    gate.set()
    first.join(timeout=30)
    again = warmup.warm_memory(2**20)
    assert again is not None
    again.join(timeout=30)


def test_a_failure_while_planning_never_stops_the_fit(tmp_path, monkeypatch):
    def broken(variables):
        raise TypeError("a shape that cannot be counted")

    monkeypatch.setattr(warmup, "checkpoint_nbytes", broken)
    model = make_model()
    reference = make_model()
    fit(reference, [], epochs=1)
    fit(model, [ks.ChiefCheckpoint(str(tmp_path / "ck"), save_freq=5)], epochs=1)
    for a, b in zip(weights(model), weights(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _async_copy_function(ckpt):
    """TensorFlow's async writer's copy function (a tf.function), once the first async save initialized it."""
    helper = getattr(ckpt._checkpoint, "_async_checkpointer_impl", None)
    return helper._copy_to_cpu if getattr(helper, "_initialized", False) else None


def test_no_async_save_traces_tensorflows_copy_function_on_the_training_thread(tmp_path):
    """TensorFlow's async checkpoint copies the variables eagerly at the first save and through a tf.function from
    the second on: traced there, on the training thread, with the full garbage collection its garbage set off, the
    second save blocked 45x the median save (0.4 s for a 15 KB model; benchmarks/save_blocking.py --async-save). It
    is traced in a background thread after the first save: no save traces it, and the saves still hold the state
    (the resume test below reads them back)."""
    ckpt = ks.ChiefCheckpoint(str(tmp_path / "ck"), async_save=True)
    traced_in_save = []
    real = ckpt._save

    def save(*args):
        copy = _async_copy_function(ckpt)
        started = getattr(ckpt, "_copy_trace", None)
        if started and started[1] is not None:
            started[1].join(timeout=120)  # (the background trace is not timed here: only what the save itself does)
        before = copy.experimental_get_tracing_count() if copy is not None else None
        try:
            return real(*args)
        finally:
            if before is not None:
                traced_in_save.append(_async_copy_function(ckpt).experimental_get_tracing_count() - before)

    ckpt._save = save  # (ChiefCheckpoint calls self._save)
    model = make_model()
    fit(model, [ckpt], epochs=4)
    assert len(traced_in_save) == 3, traced_in_save  # the saves after the first (epochs 2-4: the last at train end)
    assert traced_in_save == [0, 0, 0]
    assert _async_copy_function(ckpt).experimental_get_tracing_count() == 1  # traced once, in the background
    assert not any(t.is_alive() for t in warmup._copy_threads)  # joined at the fit's end
    resumed = make_model()
    fit(resumed, [ks.ChiefCheckpoint(str(tmp_path / "ck"))], epochs=4)  # a completed run: its final state back
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in weights(resumed)]),
                                  np.concatenate([w.ravel() for w in weights(model)]))


def test_no_background_copy_of_the_state_across_replicas(tmp_path, mirrored):
    """With more than one replica TensorFlow's copy function may hold collectives (NCCL on GPUs): traced or run in
    a background thread, out of step with the training step's all-reduces, it took collective instance keys out of
    turn ("Collective instance 141 expected type 0 ... data_type 9" under MultiWorkerMirroredStrategy). No
    background thread is started there (the second save traces it, as TensorFlow does); the saves hold the state."""
    ckpt = ks.ChiefCheckpoint(str(tmp_path / "ck"), async_save=True)
    seen = []
    real = ckpt._save

    def save(*args):
        try:
            return real(*args)
        finally:
            seen.append([t.name for t in threading.enumerate() if t.name == "keras_scale-checkpoint-trace"])

    ckpt._save = save
    model = make_model(strategy=mirrored)
    fit(model, [ckpt], epochs=3)
    assert len(seen) == 3 and seen == [[], [], []], seen
    assert ckpt._copy_trace is None or ckpt._copy_trace[1] is None
    assert warmup.copy_may_communicate(mirrored)
    resumed = make_model(strategy=mirrored)
    fit(resumed, [ks.ChiefCheckpoint(str(tmp_path / "ck"))], epochs=3)
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in weights(resumed)]),
                                  np.concatenate([w.ravel() for w in weights(model)]))


# A one-epoch async fit whose only save is its last (EXIT), or that gets a SIGTERM before any save (SIGTERM: the
# preemption save is its first), then the interpreter exits; or the copy thread started directly, then the exit
# (DIRECT: only the process's exit hook joins it). A thread left inside TensorFlow at exit aborted the process
# ("FATAL: exception not rethrown", status 134).
_EXIT_SCRIPT = r"""
import os, signal, sys
import numpy as np, tensorflow as tf, keras
import keras_scale as ks
from keras_scale.callbacks.checkpoint import warmup

case, directory = sys.argv[1], sys.argv[2]
if case == "DIRECT":
    ck = tf.train.Checkpoint(v=[tf.Variable(tf.zeros((256, 256))) for _ in range(20)])
    ck.write(directory + "/a", options=tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True))
    assert warmup.trace_async_copy(ck, warmup.WarmupMixin._copy_lock) is not None
    sys.exit(0)


class Term(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if case == "SIGTERM" and batch == 2:
            os.kill(os.getpid(), signal.SIGTERM)


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(64), keras.layers.Dense(64), keras.layers.Dense(1)])
model.compile("adam", "mse")
x = np.ones((80, 5), "float32")
model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0,
          callbacks=[ks.ChiefCheckpoint(directory, save_freq="epoch", async_save=True, verbose=0), Term()])
"""


@pytest.mark.slow
def test_async_save_process_exits_with_its_own_status(tmp_path):
    """The exit statuses users and schedulers rely on: 0 after a fit, 42 after a preemption save (Slurm requeue,
    keras-scale launch), whatever background copy thread an async save started. Each case twice (one in two
    aborted before the fix, most runs)."""
    import subprocess
    import sys

    from tests._helpers import subprocess_env

    script = tmp_path / "exit_after_async_save.py"
    script.write_text(_EXIT_SCRIPT)
    cases = [("EXIT", 0), ("SIGTERM", 42), ("DIRECT", 0)] * 2
    procs = [(case, code, subprocess.Popen([sys.executable, str(script), case, str(tmp_path / f"ck{i}")],
                                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True))
             for i, (case, code) in enumerate(cases)]
    results = []
    for case, code, proc in procs:
        out, _ = proc.communicate(timeout=600)
        results.append((case, proc.returncode, code, out[-600:] if proc.returncode != code else ""))
    assert all(rc == code for _, rc, code, _ in results), results


@pytest.mark.slow
def test_multi_worker_async_save_runs_in_step(run_workers, tmp_path):
    """Two MultiWorkerMirroredStrategy workers, an async save every batch: the fit finishes on both (a background
    trace of TensorFlow's copy function took collective instance keys out of turn: 4 of 13 runs crashed), no
    background copy thread ever started, and both end with the same weights."""
    import json

    from tests._helpers import MULTI_WORKER_PREAMBLE

    worker = MULTI_WORKER_PREAMBLE + r"""
import threading
keras.utils.set_random_seed(0)
x = np.random.RandomState(1).randn(96, 5).astype("float32"); y = x.sum(1, keepdims=True)
options = tf.data.Options(); options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).with_options(options)
with strategy.scope():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(1e-2), "mse")
seen = []
class Watch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        seen.extend(t.name for t in threading.enumerate() if t.name == "keras_scale-checkpoint-trace")
ckpt = ks.ChiefCheckpoint(sys.argv[1], save_freq=1, max_to_keep=100, async_save=True, verbose=0)
model.fit(ds, epochs=2, verbose=0, callbacks=[ckpt, Watch()])
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
with open(f"out_{index}.json", "w") as f:
    json.dump({"threads": seen, "weights": [w.tolist() for w in model.get_weights()]}, f)
"""
    run_workers(worker, num_workers=2, args=(str(tmp_path / "ck"),), timeout_s=300)
    outs = [json.loads((tmp_path / f"out_{i}.json").read_text()) for i in range(2)]
    assert outs[0]["threads"] == outs[1]["threads"] == []
    for a, b in zip(outs[0]["weights"], outs[1]["weights"]):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    assert (tmp_path / "ck").is_dir() and any((tmp_path / "ck").iterdir())
