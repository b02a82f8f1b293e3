"""One lifecycle: whatever a keras_scale piece installed on a model is undone however the fit ends, and
afterwards train_on_batch, test_on_batch, predict_on_batch, evaluate and a plain fit behave as plain Keras."""
import time

import numpy as np
import pytest
import keras

import keras_scale as ks
from keras_scale import lifecycle

N, BATCH = 48, 8
_RNG = np.random.default_rng(1)
X = _RNG.normal(size=(N, 5)).astype("float32")
Y = (X @ _RNG.normal(size=(5, 1))).astype("float32")
X_NAN = X.copy()
X_NAN[2 * BATCH] = np.nan  # the third batch is non-finite


def _model(seed=3):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


class _Interrupt(keras.callbacks.Callback):
    """A user's callback that raises (KeyboardInterrupt: Ctrl-C in a callback; or any error) at a batch end."""

    def __init__(self, at_batch, error=KeyboardInterrupt):
        super().__init__()
        self.at_batch, self.error = at_batch, error

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at_batch:
            raise self.error("simulated")


def _twin_of(model):
    twin = _model()
    twin.set_weights(model.get_weights())
    twin.optimizer.build(twin.trainable_variables)
    for a, b in zip(twin.optimizer.variables, model.optimizer.variables):
        a.assign(b)
    return twin


def _assert_behaves_as_plain_keras(model):
    """train_on_batch x3, test_on_batch, predict_on_batch, evaluate and a plain fit: as on an untouched twin."""
    twin = _twin_of(model)
    before = int(model.optimizer.iterations.numpy())
    for i in range(3):
        got = model.train_on_batch(X[:BATCH], Y[:BATCH], return_dict=True)
        want = twin.train_on_batch(X[:BATCH], Y[:BATCH], return_dict=True)
        assert got == pytest.approx(want, rel=1e-6)
    assert int(model.optimizer.iterations.numpy()) == before + 3  # (was: 0 updates, no error)
    assert model.test_on_batch(X[:BATCH], Y[:BATCH], return_dict=True) == pytest.approx(
        twin.test_on_batch(X[:BATCH], Y[:BATCH], return_dict=True), rel=1e-6)
    np.testing.assert_allclose(model.predict_on_batch(X[:BATCH]), twin.predict_on_batch(X[:BATCH]), rtol=1e-6)
    assert model.evaluate(X, Y, verbose=0, return_dict=True) == pytest.approx(
        twin.evaluate(X, Y, verbose=0, return_dict=True), rel=1e-6)
    h_model = model.fit(X, Y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    h_twin = twin.fit(X, Y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
    np.testing.assert_allclose(h_model.history["loss"], h_twin.history["loss"], rtol=1e-6)
    for a, b in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert lifecycle.pending(model) == 0


def test_keyboard_interrupt_after_a_stop_halt_leaves_no_halted_step_behind():
    """NanGuard(policy="stop") halts the step in-graph; a user callback then raises KeyboardInterrupt: Keras skips
    every on_train_end. The halted step used to stay in place: train_on_batch did 0 updates, silently."""
    model = _model()
    guard = ks.NanGuard(policy="stop", verbose=0)
    with pytest.raises(KeyboardInterrupt):
        model.fit(X_NAN, Y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
                  callbacks=[guard, _Interrupt(at_batch=2)])
    assert guard.skipped_steps == 1
    _assert_behaves_as_plain_keras(model)


_CELLS = [("nan_guard", e) for e in ("done", "raised", "interrupted", "stopped")] + [
    ("checkpoint", "done"), ("checkpoint", "raised"), ("checkpoint", "interrupted"), ("both", "stopped"),
    ("both", "interrupted")]


@pytest.mark.parametrize("piece,ending", _CELLS)
def test_after_any_ending_the_model_behaves_as_plain_keras(piece, ending, tmp_path):
    import signal

    handler = signal.getsignal(signal.SIGTERM)
    model = _model()
    callbacks = []
    if piece in ("nan_guard", "both"):
        callbacks.append(ks.NanGuard(policy="stop" if ending == "stopped" else "skip", verbose=0))
    if piece in ("checkpoint", "both"):
        callbacks.append(ks.ChiefCheckpoint(str(tmp_path / "ckpt"), save_freq=2))
    if ending in ("raised", "interrupted"):
        callbacks.append(_Interrupt(3, RuntimeError if ending == "raised" else KeyboardInterrupt))
    data = X_NAN if ending == "stopped" else X
    try:
        model.fit(data, Y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
    except (RuntimeError, KeyboardInterrupt):
        assert ending in ("raised", "interrupted")
    _assert_behaves_as_plain_keras(model)
    assert signal.getsignal(signal.SIGTERM) == handler  # ChiefCheckpoint's handler is gone
    assert not (tmp_path / "ckpt" / ".keras_scale.lock").exists()  # the directory lock is released
    assert "train_function" not in vars(model) or not hasattr(model.train_function, "_ks_checkpoint_inner")


def test_wrapped_model_fit_undoes_its_optimizer_switches_however_it_ends():
    model = _model()
    wrapped = ks.wrap(model, accum=2)  # compiled before wrap: carried over
    optimizer = wrapped.optimizer
    with pytest.raises(KeyboardInterrupt):
        wrapped.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[_Interrupt(1)])
    assert "apply" not in vars(optimizer) and "_all_reduce_sum_gradients" not in vars(optimizer)
    assert lifecycle.pending(wrapped) == 0
    wrapped.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)  # and trains again
    assert int(optimizer.iterations.numpy()) == 2 + N // BATCH


def test_a_finished_fit_with_every_piece_keeps_nothing_alive(tmp_path):
    """After fit returns, the model, its data and its callbacks are freed once the user drops them (the event
    stream once kept the Keras fit's frame, and with it everything the fit touched, until the next fit)."""
    import gc
    import weakref

    from tests.fakes.fake_nvml import FakeNvml

    def train(wrapped, alone=False):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        if wrapped:
            model = ks.wrap(model, accum=2)
            model.compile(optimizer="adam", loss="mse")
        d = str(tmp_path / f"run{int(wrapped)}")
        callbacks = [ks.NanGuard(verbose=0), ks.ChiefCheckpoint(d + "/ckpt", verbose=0),
                     ks.GpuMonitor(nvml=FakeNvml.with_gpus(1), log_dir=d, verbose=0),
                     ks.ProfileWindow(d + "/profile", start_step=1000), ks.HostMemoryWatch(),
                     ks.LearningRateLogger(d), ks.ReduceLROnPlateau(monitor="loss", verbose=0),
                     ks.Goodput(log_dir=d, verbose=0)]
        if alone:  # no TensorBoard writer: its records wait for a stream of this fit
            callbacks = [None, ks.ChiefCheckpoint(d + "/ckpt_alone", verbose=0)]
        x = np.ones((32, 4), "float32")
        model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0, callbacks=[c for c in callbacks if c])
        return weakref.ref(model), weakref.ref(callbacks[1])

    for wrapped, alone in ((False, True), (False, False), (True, False)):
        refs = train(wrapped, alone)
        keras.backend.clear_session(free_memory=False)
        gc.collect()
        assert all(r() is None for r in refs), f"wrapped={wrapped}: the model or its ChiefCheckpoint is still alive"


def test_after_a_fit_that_raised_a_dropped_model_is_freed_and_no_sampler_runs_on(tmp_path):
    """Keras skips on_train_end when fit raises: ChiefCheckpoint's signal handler once kept the model alive, and
    GpuMonitor's sampling thread ran on forever."""
    import gc
    import signal
    import threading
    import weakref

    from tests.fakes.fake_nvml import FakeNvml

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("boom")

    before = signal.getsignal(signal.SIGTERM)

    def crash():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        x = np.ones((32, 4), "float32")
        with pytest.raises(RuntimeError, match="boom"):
            model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0,
                      callbacks=[ks.ChiefCheckpoint(str(tmp_path / "ckpt"), verbose=0),
                                 ks.GpuMonitor(nvml=FakeNvml.with_gpus(1), interval_s=0.01, verbose=0), Boom()])
        return weakref.ref(model)

    ref = crash()
    gc.collect()
    assert ref() is None
    time.sleep(0.1)
    assert not [t for t in threading.enumerate() if t.name == "keras_scale-GpuMonitor" and t.is_alive()]
    if signal.getsignal(signal.SIGTERM) is not before:  # the dead fit's handler hands a signal on as before
        handler = signal.getsignal(signal.SIGTERM)
        assert type(handler).__name__ == "_WeakHandler" and handler._owner() is None
        signal.signal(signal.SIGTERM, before)
