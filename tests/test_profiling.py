"""profile_summary / `keras-scale profile-summary` on real captures made here with model.fit."""
import glob
import json
import os
import shutil
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale import cli as ks_cli
from keras_scale import profiling

xprof_convert = pytest.importorskip("xprof.convert.raw_to_tool_data")


def _dataset(num_batches, slow_input_s=0.0):
    rng = np.random.default_rng(0)
    x = rng.random((num_batches * 8, 4), dtype=np.float32)
    y = rng.random((num_batches * 8, 1), dtype=np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    if slow_input_s:
        def slow(a):
            time.sleep(slow_input_s)  # an expensive Python preprocessing step, no prefetch: the step waits
            return a

        @tf.autograph.experimental.do_not_convert
        def preprocess(a, b):
            a = tf.py_function(slow, [a], tf.float32)
            return tf.ensure_shape(a, [None, 4]), b

        ds = ds.map(preprocess)
    return ds


def _fit_with_window(log_dir, ds, start_step, num_steps, print_summary=False):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    window = ks.ProfileWindow(log_dir, start_step=start_step, num_steps=num_steps, print_summary=print_summary,
                              verbose=1)
    model.fit(ds, epochs=1, callbacks=[window], verbose=0)
    return window


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """One real capture of steps 3..6 of a tiny model."""
    log_dir = tmp_path_factory.mktemp("profile")
    window = _fit_with_window(log_dir, _dataset(8), start_step=3, num_steps=4)
    return str(log_dir), window


def _overview_step_rows(capture_dir):
    paths = glob.glob(os.path.join(capture_dir, "*.xplane.pb"))
    tables = json.loads(xprof_convert.xspace_to_tool_data(paths, "overview_page", {})[0])
    table = next(t for t in tables if any(c["id"] == "stepTimeMs" for c in t.get("cols", [])))
    ids = [c["id"] for c in table["cols"]]
    return [dict(zip(ids, [cell.get("v") for cell in r["c"]])) for r in table["rows"]]


def test_summary_of_a_real_capture_matches_xprof(capture):
    log_dir, window = capture
    s = ks.profile_summary(log_dir)
    assert s.capture_dir == window.capture_dir
    assert s.step_numbers == [3, 4, 5, 6] and s.num_steps == 4
    rows = _overview_step_rows(s.capture_dir)
    times = [r["stepTimeMs"] for r in rows]
    assert s.step_time_ms == pytest.approx(sum(times) / len(times))
    assert 0 < s.step_time_ms_min <= s.step_time_ms <= s.step_time_ms_max
    input_ms = sum(r["infeedTimeMs"] for r in rows)
    assert s.input_percent == pytest.approx(100 * input_ms / sum(times))
    shares = s.input_percent + s.compute_percent + s.launch_percent + s.other_percent
    assert shares == pytest.approx(100, abs=2)  # xprof's categories cover the step
    assert s.top_ops and any("dense" in op.name for op in s.top_ops)
    assert all(op.type not in ("IDLE", "Dataset") for op in s.top_ops)
    assert [op.self_time_ms for op in s.top_ops] == sorted((op.self_time_ms for op in s.top_ops), reverse=True)
    assert s.verdict in ("input-bound", "compute-bound", "launch-bound")
    assert s.fix == profiling.FIXES[s.verdict] and s.fix in s.verdict_line


def test_slow_input_pipeline_is_called_input_bound(tmp_path):
    _fit_with_window(tmp_path, _dataset(6, slow_input_s=0.03), start_step=2, num_steps=3)
    s = ks.profile_summary(tmp_path)
    assert s.step_numbers == [2, 3, 4]
    # each step waits for the 30 ms preprocessing (the tiny model computes in ~1 ms); the next batch's sleep may
    # start before the step does (Keras's iterator runs ahead), so a step can read a little under 30 ms
    assert s.step_time_ms >= 25
    assert s.input_percent > 50
    assert s.verdict == "input-bound"
    assert "prefetch(tf.data.AUTOTUNE)" in s.verdict_line


def test_keras_tensorboard_capture_has_no_step_time(tmp_path):
    # Keras's own profiler callback marks batches without `_r=1`: xprof finds no steps (tensorboard#6210).
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(_dataset(6), epochs=1, verbose=0,
              callbacks=[keras.callbacks.TensorBoard(str(tmp_path), profile_batch=(2, 4))])
    s = ks.profile_summary(tmp_path)  # finds the capture under tmp_path/train/plugins/profile
    assert os.sep + "train" + os.sep in s.capture_dir
    assert s.step_numbers == [] and s.verdict == "unknown"
    assert any("No step marker observed" in m for m in s.xprof_messages)
    assert "ProfileWindow" in s.verdict_line


def test_cli_prints_the_summary(capture, capsys):
    log_dir, _ = capture
    assert ks_cli.main(["profile-summary", log_dir]) == 0
    out = capsys.readouterr().out
    assert "steps 3..6 (4 steps): step time" in out
    assert "input " in out and "compute " in out and "top ops" in out and "verdict: " in out


def test_cli_json(capture, capsys):
    log_dir, _ = capture
    assert profiling.cli([log_dir, "--json", "--top", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step_numbers"] == [3, 4, 5, 6] and len(data["top_ops"]) == 2
    assert data["verdict_line"].startswith("verdict: ")


def test_newest_capture_is_read(capture, tmp_path):
    log_dir, window = capture
    for name in ("a", "b"):  # two copies of the same capture; make "a" the newer by mtime (not by name)
        shutil.copytree(window.capture_dir, tmp_path / name / "plugins" / "profile" / "run")
    future = time.time() + 60
    for f in glob.glob(str(tmp_path / "a" / "**" / "*.xplane.pb"), recursive=True):
        os.utime(f, (future, future))
    assert profiling.find_captures(tmp_path)[-1] == str(tmp_path / "a" / "plugins" / "profile" / "run")
    assert ks.profile_summary(tmp_path).capture_dir == str(tmp_path / "a" / "plugins" / "profile" / "run")


def test_no_capture_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no profiler capture"):
        ks.profile_summary(tmp_path)
    assert profiling.cli([str(tmp_path)]) == 1
    assert f"no profiler capture (*.xplane.pb) under {str(tmp_path)!r}" in capsys.readouterr().err
    assert profiling.cli([str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_without_the_profile_extra_says_how_to_install(capture, tmp_path, monkeypatch, capsys):
    log_dir, _ = capture
    for name in ("xprof", "xprof.convert", "xprof.convert.raw_to_tool_data",
                 "tensorboard_plugin_profile", "tensorboard_plugin_profile.convert"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    assert profiling.cli([log_dir]) == 1
    assert "pip install 'keras-scale[profile]'" in capsys.readouterr().err
    with pytest.raises(ImportError, match=r"pip install 'keras-scale\[profile\]'"):
        ks.profile_summary(log_dir)
    # ProfileWindow still writes its capture, and prints the hint instead of the summary
    window = _fit_with_window(tmp_path, _dataset(4), start_step=1, num_steps=2, print_summary=True)
    assert window.capture_dir and glob.glob(os.path.join(window.capture_dir, "*.xplane.pb"))
    assert window.summary is None
    out = capsys.readouterr().out
    assert f"capture written to {window.capture_dir}" in out and "pip install 'keras-scale[profile]'" in out


@pytest.mark.parametrize(
    "input_pct, launch_pct, num_steps, expected",
    [
        (20.0, 0.0, 3, "input-bound"),  # xprof's "highly input-bound" threshold, inclusive
        (19.9, 0.0, 3, "compute-bound"),
        (35.0, 40.0, 3, "input-bound"),  # waiting for data comes first: faster ops would not help
        (5.0, 20.0, 3, "launch-bound"),
        (5.0, 19.9, 3, "compute-bound"),
        (90.0, 0.0, 0, "unknown"),
    ],
)
def test_verdict_rules(input_pct, launch_pct, num_steps, expected):
    assert profiling.verdict_for(input_pct, launch_pct, num_steps) == expected


def test_bad_top_n_raises(capture):
    with pytest.raises(ValueError, match="top_n must be an integer >= 0, got -1"):
        ks.profile_summary(capture[0], top_n=-1)
