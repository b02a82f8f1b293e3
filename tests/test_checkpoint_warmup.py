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


@pytest.mark.parametrize("replicas", [1, 2])
def test_no_async_save_traces_tensorflows_copy_function_on_the_training_thread(tmp_path, replicas, request):
    """TensorFlow's async checkpoint copies the variables eagerly at the first save and through a tf.function from
    the second on: traced there, on the training thread, with the full garbage collection its garbage set off, the
    second save blocked 45x the median save (0.4 s for a 15 KB model; benchmarks/save_blocking.py --async-save). It
    is traced in a background thread after the first save: no save traces it, and the saves still hold the state
    (the resume test below reads them back)."""
    strategy = request.getfixturevalue("mirrored") if replicas == 2 else None
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
    model = make_model(strategy=strategy)
    fit(model, [ckpt], epochs=4)
    assert len(traced_in_save) == 3, traced_in_save  # the saves after the first (epochs 2-4: the last at train end)
    assert traced_in_save == [0, 0, 0]
    assert _async_copy_function(ckpt).experimental_get_tracing_count() == 1  # traced once, in the background
    resumed = make_model(strategy=strategy)
    fit(resumed, [ks.ChiefCheckpoint(str(tmp_path / "ck"))], epochs=4)  # a completed run: its final state back
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in weights(resumed)]),
                                  np.concatenate([w.ravel() for w in weights(model)]))
