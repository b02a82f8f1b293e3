"""One TensorBoard layout whatever the callback order, read back from a real TensorBoard server over HTTP.

The callbacks are the demo's (``examples/quickstart.py``'s ``make_callbacks``: keras_scale's and Keras's
``TensorBoard`` on one ``log_dir``), plus a ``CSVLogger``, with keras_scale's listed before and after Keras's.

The run keras_scale's callbacks write to is the run Keras's ``TensorBoard(log_dir)`` writes to (``train``), each
quantity has one tag, and keras_scale adds nothing to the epoch logs, so Keras's ``CSVLogger`` and ``TensorBoard``
get the same columns and tags with keras_scale's callbacks listed before or after them.
"""
import csv
import importlib.util
import json
import os
import urllib.request

import keras
import numpy as np
import pytest

import keras_scale as ks
from tests.conftest import REPO_ROOT
from tests.fakes.fake_nvml import FakeNvml

_spec = importlib.util.spec_from_file_location("quickstart", os.path.join(REPO_ROOT, "examples", "quickstart.py"))
quickstart = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quickstart)

X = np.random.RandomState(0).rand(64, 4).astype("float32")
Y = X.sum(axis=1, keepdims=True)
X[17, 1] = np.nan  # one NaN batch: NanGuard skips it

# Keras's own TensorBoard callback writes the optimizer's LR once per epoch as ``epoch_learning_rate``
# (keras/src/callbacks/tensorboard.py ``_collect_learning_rate``, always on); LearningRateLogger's
# ``optimizer/learning_rate`` is the same LR at every update. The one repeat keras_scale cannot switch off.
KERAS_OWN_REPEAT = {"learning_rate"}


def _run(log_dir, keras_scale_first):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    schedule = ks.WarmupCosine(0.01, total_steps=24, warmup_steps=4)
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse", metrics=["mae"])
    demo = quickstart.make_callbacks(log_dir, nvml=FakeNvml.with_gpus(1))
    for callback in demo:
        if isinstance(callback, ks.GpuMonitor):
            callback.interval_s = 0.005
    ours = [c for c in demo if type(c).__module__.startswith("keras_scale")]
    keras_loggers = [keras.callbacks.CSVLogger(f"{log_dir}/log.csv")] + [c for c in demo if c not in ours]
    assert len(ours) == 6 and len(keras_loggers) == 2
    history = model.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0, validation_data=(X[:16], Y[:16]),
                        callbacks=ours + keras_loggers if keras_scale_first else keras_loggers + ours)
    with open(f"{log_dir}/log.csv") as f:
        columns = next(csv.reader(f))
    return history, columns


def _get(url, path):
    with urllib.request.urlopen(url.rstrip("/") + path, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tb")
    results = {order: _run(str(root / order), order == "first") for order in ("first", "last")}
    from tensorboard import program

    board = program.TensorBoard()
    # blocking, once: every event file is read inside launch(), so no reload thread runs on (one killed at exit,
    # inside TensorFlow's file reading, aborts the interpreter)
    board.configure(argv=[None, "--logdir", str(root), "--host", "127.0.0.1", "--port", "0", "--load_fast", "false",
                          "--reload_task", "blocking", "--reload_interval", "0"])
    url = board.launch()  # serves from a daemon thread; shut down below
    try:
        yield results, _get(url, "/data/runs"), _get(url, "/data/plugin/scalars/tags")
    finally:
        server = getattr(board, "_server", None)
        if server is not None:
            server.shutdown()


def test_one_run_per_phase_shared_by_keras_and_keras_scale(runs):
    _, run_list, tags = runs
    assert sorted(run_list) == ["first/train", "first/validation", "last/train", "last/validation"]
    for order in ("first", "last"):
        train = set(tags[f"{order}/train"])
        assert {"epoch_loss", "host/rss_mb", "optimizer/learning_rate", "goodput/goodput", "gpu0/util_mean",
                "throughput/steps_per_s", "epoch_nan_skipped"} <= train, sorted(train)


def test_the_same_tags_in_both_callback_orders(runs):
    _, _, tags = runs
    for phase in ("train", "validation"):
        assert sorted(tags[f"first/{phase}"]) == sorted(tags[f"last/{phase}"])


def test_one_tag_per_quantity(runs):
    """No keras_scale quantity also comes back as a Keras ``epoch_<name>`` tag (it used to: ``epoch_host_rss_mb``
    beside ``host/rss_mb``, ``epoch_nan_skipped`` beside ``nan_guard/skipped_steps``, ``epoch_steps_per_s`` beside
    ``throughput/steps_per_s``). Within keras_scale the piece says what was measured: ``throughput/samples_per_s``
    (GpuMonitor: batch size / mean step time) and ``goodput/samples_per_s`` (samples / the epoch's wall-clock)."""
    _, _, tags = runs
    train = list(tags["first/train"])
    keras_names = {t[len("epoch_"):] for t in train if t.startswith("epoch_")}
    ours = [t for t in train if "/" in t]
    assert len(ours) >= 20, ours
    repeated = [t for t in ours if t.split("/")[-1] in keras_names - KERAS_OWN_REPEAT]
    assert not repeated, (repeated, sorted(keras_names))
    assert "epoch_nan_skipped" in train and not [t for t in ours if "nan" in t]  # the step's count, once


def test_csv_columns_and_history_the_same_in_both_orders(runs):
    results, _, _ = runs
    (first, first_columns), (last, last_columns) = results["first"], results["last"]
    assert first_columns == last_columns
    assert "nan_skipped" in first_columns and "host_rss_mb" not in first_columns  # the epoch logs stay Keras's
    assert sorted(first.history) == sorted(last.history)
    for key in ("host_rss_mb", "gpu_util_mean", "goodput", "steps_per_s"):  # keras_scale's figures in History
        assert len(first.history[key]) == 3 and len(last.history[key]) == 3, key
    assert first.history["nan_skipped"] == last.history["nan_skipped"] == [1, 1, 1]  # the NaN batch in each epoch
