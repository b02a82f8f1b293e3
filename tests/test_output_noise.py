"""What a run prints is read by people: an incident starts on a line of its own (also when the output is piped,
``python train.py 2>&1 | tee log``), a skipped first step does not show ``loss: nan`` on the progress bar, the same
NaN diagnosis every epoch is said once and then counted, ``nan_skipped: 0`` is not on every verbose=2 line, and
GpuMonitor's warnings point at the user's line, not at keras_scale's source."""
import contextlib
import io
import re
import warnings

import keras
import numpy as np

import keras_scale as ks


def _fit(poisoned_sample: int, verbose: int, epochs: int = 1, callbacks=None):
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int64")
    for sample in [] if poisoned_sample is None else np.atleast_1d(poisoned_sample):
        x[sample, 1] = np.nan
    model = ks.wrap(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), accum=2)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    terminal = io.StringIO()  # stdout and stderr on one pipe, not a terminal
    with contextlib.redirect_stdout(terminal), contextlib.redirect_stderr(terminal):
        model.fit(x, y, batch_size=16, epochs=epochs, verbose=verbose, shuffle=False,
                  callbacks=[ks.NanGuard()] + list(callbacks or []))
    return terminal.getvalue()


def test_an_incident_starts_on_its_own_line_after_a_piped_progress_bar():
    out = _fit(poisoned_sample=20, verbose=1)  # batch 2 of 4: the bar has printed batch 1's line, unended
    assert "NanGuard:" in out
    for match in re.finditer("NanGuard:", out):
        assert match.start() == 0 or out[match.start() - 1] == "\n", repr(out[max(0, match.start() - 80):match.end()])


def test_two_incidents_in_one_epoch_have_no_empty_line_between_them():
    out = _fit(poisoned_sample=[20, 52], verbose=1)  # batches 2 and 4 of 4: the bar prints nothing in between
    assert out.count("NanGuard:") == 2, out
    assert "\n\nNanGuard:" not in out, repr(out)
    for match in re.finditer("NanGuard:", out):
        assert match.start() == 0 or out[match.start() - 1] == "\n", repr(out[max(0, match.start() - 80):match.end()])


def test_a_skipped_first_step_shows_no_nan_metrics_on_the_progress_bar():
    out = _fit(poisoned_sample=0, verbose=1)
    assert "nan_skipped" in out
    assert "loss: nan" not in out and "accuracy: nan" not in out, out


def test_the_same_diagnosis_every_epoch_is_said_once_then_counted():
    out = _fit(poisoned_sample=20, verbose=2, epochs=3)
    assert out.count("Likely fix") == 1, out
    assert out.count("the same diagnosis as at epoch 1") == 2, out
    assert "(3 times so far)" in out


def test_no_nan_skipped_zero_on_verbose_2_lines():
    out = _fit(poisoned_sample=None, verbose=2, epochs=2)
    assert out.count("loss:") == 2 and "nan_skipped" not in out, out


def test_gpu_monitor_warnings_point_at_the_users_line():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    from tests.fakes.fake_nvml import FakeNvml

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0,  # the user's line
                  callbacks=[ks.GpuMonitor(nvml=FakeNvml.with_gpus(0))])
    ours = [w for w in caught if "GpuMonitor" in str(w.message)]
    assert ours and all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in ours]
