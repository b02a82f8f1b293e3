"""Quiet like Keras's callbacks: fit(verbose=0) with every keras_scale callback at its defaults writes nothing to
stdout (saves, resumes, advice, summaries go to loggers or stay silent); incidents still reach stderr."""
import logging

import keras
import numpy as np
import pytest

import keras_scale as ks
from tests.fakes.fake_nvml import FakeNvml

X = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
Y = X.sum(axis=1, keepdims=True)
X_NAN = X.copy()
X_NAN[20, 0] = np.nan  # one non-finite sample: the batch holding it is an incident for NanGuard


def make_model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def every_callback(tmp_path):
    """Each keras_scale callback with its defaults (paths are required arguments; a fake GPU that is throttled,
    so GpuMonitor has advice to give)."""
    return [ks.NanGuard(), ks.ChiefCheckpoint(str(tmp_path / "ckpt")),
            ks.GpuMonitor(nvml=FakeNvml.with_gpus(1, throttle_power_cap=True)),
            ks.ProfileWindow(str(tmp_path / "profile")), ks.HostMemoryWatch(),
            ks.LearningRateLogger(str(tmp_path / "lr")), ks.ReduceLROnPlateau(monitor="loss"), ks.Goodput()]


def test_fit_verbose_0_prints_nothing_with_every_callback_at_defaults_resume_included(tmp_path, capfd, caplog):
    caplog.set_level(logging.INFO, logger="keras_scale")
    callbacks = every_callback(tmp_path)
    # 2 epochs of 8 steps: ProfileWindow profiles steps 10-14, the checkpoint saves twice, NanGuard skips a step
    # per epoch
    make_model().fit(X_NAN, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    assert callbacks[0].skipped_steps == 2 and callbacks[3].summary is not None
    assert any("throttling" == a.kind for a in callbacks[2].advice_history)
    first = capfd.readouterr()
    assert first.out == ""
    assert "NanGuard" in first.err  # the incident still says what happened, on stderr

    resumed = make_model()
    resumed.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=every_callback(tmp_path))
    assert int(resumed.optimizer.iterations.numpy()) == 3 * 8 - 2  # resumed: only the third epoch trained
    assert capfd.readouterr().out == ""
    # a rerun of the completed run changes what fit does (0 epochs): said at every verbosity, in one line
    make_model().fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=every_callback(tmp_path))
    out = capfd.readouterr().out
    assert out.count("\n") == 1 and "already completed at epoch 3" in out, out
    logged = [r.getMessage() for r in caplog.records if r.name == "keras_scale.checkpoint"]
    assert any("ChiefCheckpoint: resuming" in m for m in logged)  # the notices are logged, not lost
    assert any("already completed" in m for m in logged)


def test_ks_fit_verbose_0_with_its_default_callbacks_and_a_resume_prints_nothing(tmp_path, capfd):
    kw = dict(global_batch_size=16, strategy="default", checkpoint_dir=str(tmp_path / "ckpt"),
              log_dir=str(tmp_path / "tb"), verbose=0)
    ks.fit(make_model, X, Y, epochs=1, **kw)
    history = ks.fit(make_model, X, Y, epochs=2, **kw)  # resumes at epoch 2
    assert history.epoch == [1]
    assert capfd.readouterr().out == ""


def _guarded_fit(x, verbose, callbacks=()):
    rng = np.random.RandomState(0)
    y = rng.rand(len(x), 1).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=verbose,
                        callbacks=[ks.NanGuard(verbose=0), *callbacks])
    return model, history


@pytest.mark.parametrize("verbose", [1, 2])
def test_progress_bar_shows_nan_skipped_only_when_a_step_was_skipped(verbose, tmp_path, capsys):
    x = np.random.RandomState(1).rand(32, 4).astype("float32")
    csv = tmp_path / "log.csv"
    model, history = _guarded_fit(x, verbose, callbacks=[keras.callbacks.CSVLogger(str(csv))])
    printed = capsys.readouterr().out
    assert "loss:" in printed and "nan_skipped" not in printed, printed
    assert history.history["nan_skipped"] == [0, 0]  # History and CSVLogger keep the key, as the step logs it
    assert "nan_skipped" in csv.read_text().splitlines()[0]

    x[9, 0] = np.nan  # one bad batch in each epoch
    _, history = _guarded_fit(x, verbose)
    printed = capsys.readouterr().out
    assert "nan_skipped: 1" in printed, printed
    assert history.history["nan_skipped"] == [1, 1]


def test_progress_bar_is_keras_own_again_after_the_fit(capsys):
    progbar = keras.callbacks.ProgbarLogger()
    model, _ = _guarded_fit(np.random.RandomState(1).rand(16, 4).astype("float32"), 2, callbacks=[progbar])
    assert not {"_update_progbar", "_finalize_progbar"} & set(vars(progbar)), vars(progbar).keys()
    capsys.readouterr()
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), epochs=1, verbose=2, callbacks=[progbar])
    assert "nan_skipped" not in capsys.readouterr().out  # a plain fit again: Keras's own progress bar and logs


def test_one_printer_callbacks_and_cli_reports_follow_keras_interactive_logging(tmp_path, capsys, caplog):
    from keras_scale import cli
    from keras_scale.distribute import chief_print

    model = make_model()
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[ks.ChiefCheckpoint(str(tmp_path / "ckpt"))])
    assert cli.main(["checkpoint", "ls", str(tmp_path / "ckpt")]) == 0
    assert "1 checkpoint(s)" in capsys.readouterr().out  # interactive: stdout
    keras.config.disable_interactive_logging()
    try:
        with caplog.at_level(logging.INFO):
            chief_print("a routine message")
            assert cli.main(["checkpoint", "ls", str(tmp_path / "ckpt")]) == 0
        out = capsys.readouterr().out
        assert "a routine message" not in out and "checkpoint(s)" not in out, out
        logged = caplog.text
        assert "a routine message" in logged and "1 checkpoint(s)" in logged, logged
    finally:
        keras.config.enable_interactive_logging()
