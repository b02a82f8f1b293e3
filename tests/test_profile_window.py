"""ProfileWindow: one capture, exactly the requested steps, real step times in xprof, clean stops."""
import glob
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale import step as ks_step

xprof_convert = pytest.importorskip("xprof.convert.raw_to_tool_data")


def _dataset(num_batches, batch_size=8, unknown_length=False):
    rng = np.random.default_rng(0)
    x = rng.random((num_batches * batch_size, 4), dtype=np.float32)
    y = rng.random((num_batches * batch_size, 1), dtype=np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    if unknown_length:
        ds = ds.filter(lambda a, b: True)  # cardinality unknown: the epoch ends when the iterator runs dry
    return ds


def _model(steps_per_execution=1):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    return model


def _xplanes(log_dir):
    return sorted(glob.glob(os.path.join(str(log_dir), "**", "*.xplane.pb"), recursive=True))


def _overview(paths):
    data = xprof_convert.xspace_to_tool_data(list(paths), "overview_page", {})[0]
    tables = json.loads(data)
    steps = next(t for t in tables if any(c["id"] == "stepTimeMs" for c in t.get("cols", [])))
    ids = [c["id"] for c in steps["cols"]]
    rows = [dict(zip(ids, [cell.get("v") for cell in r["c"]])) for r in steps["rows"]]
    messages = [str(cell.get("v")) for t in tables if [c["id"] for c in t.get("cols", [])] == ["severity", "message"]
                for r in t.get("rows", []) for cell in r["c"]]
    return rows, messages


def _profiler_is_free():
    """True when no profiler session is left running (a new one can start)."""
    try:
        tf.profiler.experimental.start("")
    except tf.errors.AlreadyExistsError:
        return False
    tf.profiler.experimental.stop(save=False)
    return True


def test_one_capture_of_exactly_the_window_steps_with_real_step_times(tmp_path):
    # 8 batches per epoch, window 6..9 crosses the epoch boundary: steps count across epochs
    window = ks.ProfileWindow(tmp_path, start_step=6, num_steps=4, print_summary=False)
    _model().fit(_dataset(8), epochs=2, callbacks=[window], verbose=0)

    runs = glob.glob(str(tmp_path / "plugins" / "profile" / "*"))
    assert len(runs) == 1, runs
    paths = _xplanes(tmp_path)
    assert len(paths) == 1 and os.path.dirname(paths[0]) == window.capture_dir == runs[0]
    assert window.profiled_steps == [6, 7, 8, 9]

    rows, messages = _overview(paths)
    assert [r["stepnum"] for r in rows] == ["train 6", "train 7", "train 8", "train 9"]
    assert all(r["stepTimeMs"] > 0 for r in rows)
    assert not any("No step marker observed" in m for m in messages), messages
    assert _profiler_is_free()


def test_window_counts_steps_across_fit_calls_and_captures_once(tmp_path):
    window = ks.ProfileWindow(tmp_path, start_step=5, num_steps=2, print_summary=False)
    model = _model()
    for _ in range(3):  # 4 + 4 + 4 steps; the window (steps 5, 6) is inside the second call
        model.fit(_dataset(4), epochs=1, callbacks=[window], verbose=0)
    assert window.profiled_steps == [5, 6]
    assert len(_xplanes(tmp_path)) == 1
    rows, _ = _overview(_xplanes(tmp_path))
    assert [r["stepnum"] for r in rows] == ["train 5", "train 6"]


def test_steps_per_execution_is_warned_and_explained(tmp_path, capsys):
    # Keras runs steps_per_execution > 1 in a tf.while_loop; xprof then groups by loop iteration and ignores
    # step markers (its limitation, same for TensorBoard(profile_batch)). Say so up front and in the summary.
    window = ks.ProfileWindow(tmp_path, start_step=4, num_steps=2, verbose=1)
    with pytest.warns(UserWarning, match="steps_per_execution=2"):
        _model(steps_per_execution=2).fit(_dataset(12), epochs=1, callbacks=[window], verbose=0)
    assert window.profiled_steps == [4, 6]  # each hook call runs batches (4, 5), then (6, 7)
    assert len(window.step_times_ms) == 2 and all(t > 0 for t in window.step_times_ms)
    assert window.summary.verdict == "unknown"
    out = capsys.readouterr().out
    assert "tf.while_loop" in out and "steps_per_execution=1" in out
    assert "ProfileWindow measured steps 4..6 on the host" in out


def test_summary_printed_when_window_closes(tmp_path, capsys):
    window = ks.ProfileWindow(tmp_path, start_step=2, num_steps=3, verbose=1)
    _model().fit(_dataset(6), epochs=1, callbacks=[window], verbose=0)
    out = capsys.readouterr().out
    assert "steps 2..4 (3 steps)" in out
    assert "verdict:" in out
    assert window.summary is not None and window.summary.step_numbers == [2, 3, 4]
    assert window.summary.capture_dir == window.capture_dir


def test_summary_on_a_fresh_line_and_quiet_with_verbose_0(tmp_path, capsys):
    window = ks.ProfileWindow(tmp_path / "a", start_step=2, num_steps=2)
    _model().fit(_dataset(5), epochs=1, callbacks=[window], verbose=1)
    out = capsys.readouterr().out
    summary_lines = [line for line in out.splitlines() if "steps 2..3" in line]
    assert summary_lines and not any("loss" in line for line in summary_lines)  # not glued to the progress bar
    quiet = ks.ProfileWindow(tmp_path / "b", start_step=2, num_steps=2)  # verbose="auto": follows fit's
    _model().fit(_dataset(5), epochs=1, callbacks=[quiet], verbose=0)
    assert capsys.readouterr().out == ""
    assert quiet.summary is not None and quiet.summary.step_numbers == [2, 3]  # computed, just not printed


def test_training_ending_inside_the_window_stops_cleanly(tmp_path, capsys):
    window = ks.ProfileWindow(tmp_path, start_step=3, num_steps=10, verbose=1)
    _model().fit(_dataset(5), epochs=1, callbacks=[window], verbose=0)  # only steps 3, 4 exist
    assert window.profiled_steps == [3, 4]
    assert _profiler_is_free()
    rows, _ = _overview(_xplanes(tmp_path))
    assert [r["stepnum"] for r in rows] == ["train 3", "train 4"]
    assert "steps 3..4 (2 steps)" in capsys.readouterr().out


def test_stop_training_inside_the_window_stops_cleanly(tmp_path):
    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                self.model.stop_training = True

    window = ks.ProfileWindow(tmp_path, start_step=3, num_steps=10, print_summary=False)
    _model().fit(_dataset(20), epochs=3, callbacks=[window, StopAt()], verbose=0)
    assert window.profiled_steps == [3, 4]
    assert len(_xplanes(tmp_path)) == 1
    assert _profiler_is_free()


def test_end_of_data_inside_the_window_with_unknown_length(tmp_path):
    # unknown cardinality: step 5 starts (batch-begin hook runs) but the iterator is empty -- no batch-end hook
    window = ks.ProfileWindow(tmp_path, start_step=3, num_steps=10, print_summary=False)
    _model().fit(_dataset(5, unknown_length=True), epochs=1, callbacks=[window], verbose=0)
    assert window.profiled_steps == [3, 4]
    assert window._trace is None
    assert len(_xplanes(tmp_path)) == 1
    assert _profiler_is_free()


def test_nothing_happens_outside_the_window(tmp_path, monkeypatch):
    created = []
    real_trace = tf.profiler.experimental.Trace
    monkeypatch.setattr(tf.profiler.experimental, "Trace", lambda *a, **k: created.append(a) or real_trace(*a, **k))
    window = ks.ProfileWindow(tmp_path / "never", start_step=1000, num_steps=5)
    _model().fit(_dataset(6), epochs=2, callbacks=[window], verbose=0)
    assert created == []
    assert not os.path.exists(tmp_path / "never")
    assert window.profiled_steps == [] and window.capture_dir is None


def test_non_chief_worker_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 1}}))
    window = ks.ProfileWindow(tmp_path / "prof", start_step=1, num_steps=2)
    _model().fit(_dataset(4), epochs=1, callbacks=[window], verbose=0)
    assert not os.path.exists(tmp_path / "prof")
    assert window.profiled_steps == []


def test_another_running_profiler_is_reported_not_crashed(tmp_path):
    tf.profiler.experimental.start(str(tmp_path / "other"))
    try:
        window = ks.ProfileWindow(tmp_path / "mine", start_step=1, num_steps=2)
        with pytest.warns(UserWarning, match="another profiler session"):
            history = _model().fit(_dataset(4), epochs=1, callbacks=[window], verbose=0)
        assert len(history.history["loss"]) == 1
        assert window.profiled_steps == [] and not os.path.exists(tmp_path / "mine")
    finally:
        tf.profiler.experimental.stop(save=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"log_dir": ""}, "log_dir must be a non-empty path"),
        ({"log_dir": None}, "log_dir must be a non-empty path to write the profile under, got None"),
        ({"log_dir": "x", "start_step": -1}, "start_step must be an integer >= 0, got -1"),
        ({"log_dir": "x", "start_step": 2.5}, "start_step must be an integer >= 0, got 2.5"),
        ({"log_dir": "x", "start_step": True}, "start_step must be an integer >= 0, got True"),
        ({"log_dir": "x", "num_steps": 0}, "num_steps must be an integer >= 1, got 0"),
        ({"log_dir": "x", "num_steps": "5"}, "num_steps must be an integer >= 1, got '5'"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        ks.ProfileWindow(**kwargs)


def test_log_dir_that_is_a_file_raises(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        ks.ProfileWindow(path)


def test_start_step_zero_warns_about_tracing():
    with pytest.warns(UserWarning, match="traces the tf.function"):
        ks.ProfileWindow("x", start_step=0)


WORKER_SCRIPT = r"""
import json, sys
import numpy as np, tensorflow as tf, keras
import keras_scale as ks
from keras_scale.distribute import patch_keras_multi_worker, is_chief
patch_keras_multi_worker()
strategy = tf.distribute.MultiWorkerMirroredStrategy()
x = np.random.RandomState(0).rand(64, 4).astype("float32"); y = x.sum(1, keepdims=True)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
window = ks.ProfileWindow(sys.argv[1], start_step=1, num_steps=2, print_summary=False)
model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, verbose=0, callbacks=[window])
print(json.dumps({"chief": is_chief(strategy), "steps": window.profiled_steps, "capture": window.capture_dir}))
"""


@pytest.mark.slow
def test_multi_worker_only_the_chief_profiles(tmp_path, run_workers):
    log_dir = str(tmp_path / "shared_profile")
    outs = [json.loads(r.stdout.strip().splitlines()[-1]) for r in run_workers(WORKER_SCRIPT, args=(log_dir,))]
    chief, worker = sorted(outs, key=lambda o: not o["chief"])
    assert chief["steps"] == [1, 2] and worker["steps"] == [] and worker["capture"] is None
    paths = _xplanes(log_dir)
    assert len(paths) == 1 and os.path.dirname(paths[0]) == chief["capture"]
    rows, _ = _overview(paths)
    assert [r["stepnum"] for r in rows] == ["train 1", "train 2"]


def test_fit_that_raises_inside_the_window_is_closed_by_the_next_fit(tmp_path):
    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                raise RuntimeError("boom")

    window = ks.ProfileWindow(tmp_path, start_step=3, num_steps=10, print_summary=False)
    model = _model()
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(_dataset(8), epochs=1, callbacks=[window, Boom()], verbose=0)
    assert window._active  # Keras calls no hook on an exception: the session is still open
    model.fit(_dataset(2), epochs=1, callbacks=[window], verbose=0)
    assert not window._active and _profiler_is_free()
    assert window.profiled_steps == [3, 4] and len(_xplanes(tmp_path)) == 1


def test_with_gradient_accumulation_the_window_has_a_step_marker_per_update(tmp_path, capsys):
    # ks.wrap(accum > 1) accumulates in a tf.while_loop, and xprof ignores step markers when such a loop runs; the
    # README's first snippet combines the two: while a window is to come, the fit loops unrolled (same update), so
    # the capture has one step per update with its time, and the model gets its while_loop back after the fit.
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model = ks.wrap(inner, accum=4)
    model.compile(optimizer="sgd", loss="mse")
    window = ks.ProfileWindow(tmp_path, start_step=2, num_steps=3, verbose=1)
    model.fit(_dataset(6), epochs=1, callbacks=[window], verbose=0)
    assert window.profiled_steps == [2, 3, 4] and len(_xplanes(tmp_path)) == 1
    assert window.summary.step_numbers == [2, 3, 4] and window.summary.verdict != "unknown"
    rows, messages = _overview(_xplanes(tmp_path))
    assert [r["stepnum"] for r in rows] == ["train 2", "train 3", "train 4"] and all(r["stepTimeMs"] > 0 for r in rows)
    assert ks_step.get_step(model).unrolled is None  # given back


def test_with_accumulation_that_cannot_unroll_the_window_warns_at_fit_start(tmp_path, capsys):
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model = ks.wrap(inner, micro_batch_size=2)  # (a dynamic batch size: the loop cannot be unrolled)
    model.compile(optimizer="sgd", loss="mse")
    window = ks.ProfileWindow(tmp_path, start_step=2, num_steps=3, verbose=1)
    with pytest.warns(UserWarning, match="micro_batch_size=2.*tf.while_loop.*no step time"):
        model.fit(_dataset(6), epochs=1, callbacks=[window], verbose=0)
    assert window.profiled_steps == [2, 3, 4]
    assert "ProfileWindow measured steps 2..4 on the host" in capsys.readouterr().out
