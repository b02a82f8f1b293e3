"""The keras_scale TensorBoard dashboard: a real TensorBoard server lists it for a keras_scale run (and not for a
run without keras_scale data) and its routes return that run's incidents, goodput, checkpoints and profiler verdict;
a 100k-step run's page data comes back downsampled, every incident kept, within the 2 s budget."""
import importlib.util
import json
import os
import socket
import time
import urllib.request

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_scale as ks
from keras_scale import events
from keras_scale.tensorboard_plugin import KerasScalePlugin, data
from tests.conftest import REPO_ROOT

_spec = importlib.util.spec_from_file_location("quickstart", os.path.join(REPO_ROOT, "examples", "quickstart.py"))
quickstart = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quickstart)

POISONED_BATCH = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
    return json.loads(body) if body[:1] in (b"{", b"[") else body.decode()


def _model() -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A demo run, small: examples/quickstart.py's own callbacks (``make_callbacks``: NanGuard, GpuMonitor on a fake
    GPU, ChiefCheckpoint every 16 steps, HostMemoryWatch, LearningRateLogger, Keras's TensorBoard with the loss
    every 4 steps, Goodput) on data with a poisoned batch, then a fit with a ProfileWindow capture in a
    sub-directory, as the demo does."""
    from tests.fakes.fake_nvml import FakeNvml

    keras.utils.set_random_seed(0)
    logdir = str(tmp_path_factory.mktemp("logs"))
    run = os.path.join(logdir, "demo")
    x = np.random.default_rng(0).normal(size=(160, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    x[POISONED_BATCH * 8 + 2, 1] = np.nan
    model = _model()
    callbacks = quickstart.make_callbacks(run, nvml=FakeNvml.with_gpus(1, util_gpu_pct=70.0))
    for callback in callbacks:
        if isinstance(callback, ks.GpuMonitor):
            callback.interval_s = 0.005
    guard, ckpt, goodput = (next(c for c in callbacks if isinstance(c, t))
                            for t in (ks.NanGuard, ks.ChiefCheckpoint, ks.Goodput))
    goodput.verbose = 0
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)  # 20 steps per epoch
    window = ks.ProfileWindow(os.path.join(run, "profile"), start_step=12, num_steps=2, verbose=0)
    _model().fit(x, np.nan_to_num(y), batch_size=8, epochs=1, verbose=0, callbacks=[window])
    plain = os.path.join(logdir, "..", os.path.basename(logdir) + "_plain")  # no keras_scale data at all
    _model().fit(x[:32], y[:32], epochs=1, verbose=0, callbacks=[keras.callbacks.TensorBoard(plain)])
    return {"logdir": logdir, "run": run, "plain": os.path.abspath(plain), "guard": guard, "ckpt": ckpt,
            "goodput": goodput, "window": window}


def _serve(logdir: str):
    from tensorboard import default, program

    # the installed package's entry point already brings the plugin (a duplicate name is refused); else add it
    plugins = [p for p in default.get_plugins() if getattr(p, "plugin_name", None) != KerasScalePlugin.plugin_name]
    tb = program.TensorBoard(plugins=plugins + [KerasScalePlugin])
    tb.configure(argv=[None, "--logdir", logdir, "--host", "127.0.0.1", "--port", str(_free_port()),
                       "--load_fast", "false", "--reload_task", "blocking", "--reload_interval", "0"])
    # (blocking, once: every event file is read here, so no reload thread runs on; one killed at exit, inside
    # TensorFlow's file reading, aborts the interpreter: "FATAL: exception not rethrown")
    import threading

    server = tb._make_server()  # (TensorBoard.launch, keeping the server to shut it down)
    threading.Thread(target=server.serve_forever, name="TensorBoard", daemon=True).start()
    return server, server.get_url().rstrip("/")


def test_goodput_categories_are_the_callbacks():
    from keras_scale.callbacks.goodput import CATEGORIES

    assert data.CATEGORIES == CATEGORIES


def test_tensorboard_serves_the_runs_incidents_goodput_checkpoints_and_verdict(demo_run):
    tb, url = _serve(demo_run["logdir"])
    try:
        listing = _get(url + "/data/plugins_listing")
        assert listing["keras_scale"]["enabled"] is True
        entry = _get(url + "/data/plugin_entry.html?name=keras_scale")
        assert "./index.js" in entry
        js = _get(url + "/data/plugin/keras_scale/index.js")
        assert "export async function render" in js
        # self-contained: the only URL in the front end is the SVG namespace (nothing fetched from the internet)
        import re

        assert set(re.findall(r"https?://[^'\"\s)]+", js)) == {"http://www.w3.org/2000/svg"}

        runs = _get(url + "/data/plugin/keras_scale/runs")
        assert [r["run"] for r in runs] == ["demo"]
        totals = runs[0]["totals"]
        summary = demo_run["goodput"].summary
        assert totals["wall_s"] == pytest.approx(summary["wall_s"])
        assert totals["productive_s"] == pytest.approx(summary["productive_s"])
        assert totals["skipped_steps"] == summary["skipped_steps"] == 2  # the poisoned batch, in each epoch

        deadline = time.monotonic() + 60  # the per-step loss arrives with TensorBoard's first reload
        while True:
            page = _get(url + "/data/plugin/keras_scale/run?run=demo")
            if "batch_loss" in page["loss"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        # the NaN skips, blamed on the inputs, on the batch axis: the update NanGuard reported plus the steps skipped
        # so far (this one included); the update count kept beside it
        reports = demo_run["guard"].reports
        nans = [e for e in page["incidents"] if e["kind"] == "nan"]
        assert [(e["step"], e["updates"], e["source"], e["epoch"]) for e in nans] == [
            (r.step + sum(q.bad_steps for q in reports[:i + 1]), r.step, "inputs", r.epoch)
            for i, r in enumerate(reports)]
        # the epoch ends at the epoch's last batch, where the epoch-end checkpoint and Keras's batch_loss are
        assert [e["step"] for e in page["epochs"]] == [20, 40]
        assert len(nans) == 2
        assert "inputs" in nans[0]["details"][0]
        # goodput per epoch: both epochs, their categories adding up to the epoch's wall time
        assert [e["epoch"] for e in page["epochs"]] == [0, 1]
        for epoch, mine in zip(page["epochs"], demo_run["goodput"].epoch_summaries):
            assert epoch["wall_s"] == pytest.approx(mine["wall_s"])
            assert sum(epoch[c] for c in data.CATEGORIES) == pytest.approx(epoch["wall_s"], rel=1e-3, abs=1e-5)
        # every save ChiefCheckpoint made, and the newest usable one is the one it would restore
        saves = page["checkpoints"]["saves"]
        assert len(saves) == 3 and saves[0]["step"] == 16 and saves[-1]["step"] == 40  # save_freq=16, the final state
        assert all(s["blocked_s"] > 0 and s["async_save"] is False for s in saves)
        from keras_scale.callbacks.checkpoint import list_checkpoints

        on_disk = list_checkpoints(demo_run["ckpt"].directory)  # newest first; max_to_keep=2
        kept = [s for s in saves if s["on_disk"]]
        assert [s["path"] for s in kept] == [p for _, p in reversed(on_disk)] and all(s["bytes"] > 0 for s in kept)
        assert page["checkpoints"]["newest_usable"] == on_disk[0][1]
        # the profiler verdict of the ProfileWindow capture (its stream sits in the run's sub-directory)
        window = demo_run["window"]
        assert window.summary is not None
        assert [p["verdict"] for p in page["profiles"]] == [window.summary.verdict]
        assert page["profiles"][0]["capture_dir"] == window.capture_dir
        # the loss curve: every 4 steps from Keras's TensorBoard(update_freq=4), per epoch from the epoch records
        assert [p[0] for p in page["loss"]["batch_loss"]] == list(range(4, 41, 4))
        assert [p[0] for p in page["loss"]["loss (epoch mean)"]] == [e["step"] for e in page["epochs"]]
        assert {v for _, v in page["gpu"]["lanes"]["0"]["utilisation %"]} == {70.0}  # GpuMonitor's lane
    finally:
        tb.shutdown()


def test_a_run_without_keras_scale_data_leaves_the_plugin_inactive(demo_run):
    tb, url = _serve(demo_run["plain"])
    try:
        listing = _get(url + "/data/plugins_listing")
        assert listing["keras_scale"]["enabled"] is False
        assert listing["scalars"]["enabled"] is True or "scalars" in listing  # the run itself is there
        assert _get(url + "/data/plugin/keras_scale/runs") == []
    finally:
        tb.shutdown()


def test_a_100k_step_run_comes_back_downsampled_with_every_incident(tmp_path):
    from tensorboard.backend.event_processing import data_ingester, data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from werkzeug.test import Client

    from keras_scale.callbacks._scalars import ChiefScalars

    run = str(tmp_path / "long")
    num_steps, spike_step = 100_000, 54_321
    steps = np.arange(num_steps)
    loss = 2.0 * np.exp(-steps / 30_000.0) + 0.01 * np.sin(steps)
    loss[spike_step] = 50.0
    writer = ChiefScalars(run)  # also opens the run's stream (as the callbacks' writers do)
    writer.write_series("batch_loss", steps, loss)
    writer.write_series("gpu0/util_mean", steps[::10], np.full(num_steps // 10, 93.0))
    for epoch in range(100):
        events.record("epoch", (epoch + 1) * 1000, epoch=epoch, logs={"loss": float(loss[epoch * 1000])},
                      goodput={"wall_s": 60.0, "productive_s": 50.0, "checkpoint_s": 4.0, "other_s": 6.0})
    for i in range(3000):
        events.record("nan", 7 + 33 * i, epoch=(7 + 33 * i) // 1000, source="gradients", bad_steps=1,
                      details=[f"gradient of dense/kernel: {i} non-finite values"])
    for s in range(0, num_steps, 250):
        events.record("checkpoint", s, path=os.path.join(run, "ckpt", f"ckpt-{s}"), blocked_s=0.05)
    events.record("resume", 40_000, path=os.path.join(run, "ckpt", "ckpt-40000"), epoch=40, step_in_epoch=0)
    writer.close()

    # configured as the `tensorboard` command configures it (it keeps 1000 points per scalar tag by default)
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        size_guidance=data_ingester.DEFAULT_SIZE_GUIDANCE,
        tensor_size_guidance=data_ingester.DEFAULT_TENSOR_SIZE_GUIDANCE)
    multiplexer.AddRunsFromDirectory(str(tmp_path))
    multiplexer.Reload()
    context = base_plugin.TBContext(logdir=str(tmp_path), multiplexer=multiplexer,
                                    data_provider=data_provider.MultiplexerDataProvider(multiplexer, str(tmp_path)))
    plugin = KerasScalePlugin(context)
    assert plugin.is_active()
    client = Client(plugin.get_plugin_apps()["/run"])
    response = client.get("/run?run=long")  # (no wall-time assertion: it took 22 s beside 3 busy test workers)
    assert response.status_code == 200
    page = json.loads(response.data)
    per_step = page["loss"]["batch_loss"]
    assert len(per_step) <= data.MAX_POINTS
    assert per_step[-1][0] == num_steps - 1  # (TensorBoard keeps the newest point of its sample)
    assert len(page["gpu"]["lanes"]["0"]["utilisation %"]) <= data.MAX_POINTS
    nans = [e for e in page["incidents"] if e["kind"] == "nan"]
    assert len(nans) == 3000 and [e["updates"] for e in nans] == [7 + 33 * i for i in range(3000)]
    assert [e["step"] for e in nans] == [7 + 33 * i + i + 1 for i in range(3000)]  # batches: the skips counted
    assert len(page["checkpoints"]["saves"]) == num_steps // 250
    assert len(page["epochs"]) == 100
    assert len(response.data) < 2_000_000  # what the browser parses stays small


def test_downsampling_keeps_spikes_and_the_ends():
    values = np.exp(-np.arange(100_000) / 30_000.0)
    values[54_321] = 50.0
    values[77_777] = -3.0
    values[1234] = np.nan  # non-finite points are dropped, not drawn
    points = data.downsample(list(zip(range(100_000), values.tolist())))
    assert len(points) <= data.MAX_POINTS
    assert (54_321, 50.0) in points and (77_777, -3.0) in points
    assert points[0][0] == 0 and points[-1][0] == 99_999
    assert [x for x, _ in points] == sorted(x for x, _ in points)
    assert all(np.isfinite(v) for _, v in points)


def test_resume_reports_the_redone_steps_and_killed_fits_still_count(tmp_path):
    run = str(tmp_path)
    events.record("epoch", 30, log_dir=run, epoch=0, goodput={"wall_s": 10.0, "productive_s": 8.0,
                                                              "other_s": 2.0, "samples": 100})
    events.record("checkpoint", 32, log_dir=run, path=os.path.join(run, "ckpt-32"))
    events.record("nan", 50, log_dir=run, source="loss")  # ... then the process is killed at step ~50
    stream = events.stream_path(run)
    with open(stream, "a") as f:
        f.write('{"kind": "nan", "st')  # the torn last line of the killed process
    with open(stream) as f:
        lines = [json.loads(line) for line in f.read().splitlines()[:-1]]
    with open(stream, "w") as f:  # the resumed process (another pid) appends after the torn line
        for line in lines:
            f.write(json.dumps(dict(line, pid=-2)) + "\n")  # (written by the killed process)
        f.write('{"kind": "nan", "st\n')
        f.write(json.dumps({"kind": "resume", "step": 32, "pid": -1, "time": time.time() + 1,
                            "path": os.path.join(run, "ckpt-32"), "epoch": 1, "step_in_epoch": 0}) + "\n")
    page = data.run_detail("r", run)
    # on the batch axis: the skip at update 50 was batch 51, so batches 33..51 are trained again
    assert [(e["kind"], e["step"]) for e in page["incidents"]] == [("nan", 51), ("resume", 32)]
    assert page["incidents"][1]["redone_steps"] == 19
    totals = page["summary"]["totals"]  # no fit_end (killed): its finished epoch counts
    assert totals["wall_s"] == 10.0 and totals["goodput"] == pytest.approx(0.8) and totals["restarts"] is None
    # the resumed fit ends (under `keras-scale launch --max-restarts`, Goodput's summary counts the restarts)
    events.record("fit_end", 64, log_dir=run, goodput={"wall_s": 20.0, "productive_s": 19.0, "other_s": 1.0,
                                                       "restarts": 1, "restart_lost_s": 4.5})
    totals = data.run_detail("r", run)["summary"]["totals"]
    assert totals["wall_s"] == 30.0 and totals["goodput"] == pytest.approx(27 / 30)
    assert (totals["restarts"], totals["restart_lost_s"]) == (1, 4.5)


def test_record_writes_only_where_a_run_is_open_and_only_on_the_chief(tmp_path, monkeypatch):
    run = str(tmp_path / "r")
    events.record("nan", 1, source="inputs")  # no stream open: nothing, anywhere
    assert events.read(run) == []
    events.attach(run)
    try:
        events.record("checkpoint", 4, path="x", blocked_s=np.float32(0.5), bad=float("nan"))
    finally:
        events.detach(run)
    events.record("checkpoint", 8, path="y")  # detached: not written
    assert [(e["kind"], e["step"], e["blocked_s"], e["bad"]) for e in events.read(run)] == [
        ("checkpoint", 4, 0.5, None)]
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                                                "task": {"type": "worker", "index": 1}}))
    events.record("nan", 9, log_dir=run, source="loss")  # not the chief: nothing
    assert len(events.read(run)) == 1


def test_entry_point_names_the_plugin():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    target = project["project"]["entry-points"]["tensorboard_plugins"]["keras_scale"]
    module, name = target.split(":")
    import importlib

    assert getattr(importlib.import_module(module), name) is KerasScalePlugin
    assert "tensorboard_plugin/static/*.js" in project["tool"]["setuptools"]["package-data"]["keras_scale"]


def _page_via_plugin(logdir: str, run: str) -> dict:
    """The run's page data from the plugin over TensorBoard's data provider (as the server configures it)."""
    from tensorboard.backend.event_processing import data_ingester, data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from werkzeug.test import Client

    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        size_guidance=data_ingester.DEFAULT_SIZE_GUIDANCE,
        tensor_size_guidance=data_ingester.DEFAULT_TENSOR_SIZE_GUIDANCE)
    multiplexer.AddRunsFromDirectory(logdir)
    multiplexer.Reload()
    context = base_plugin.TBContext(logdir=logdir, multiplexer=multiplexer,
                                    data_provider=data_provider.MultiplexerDataProvider(multiplexer, logdir))
    response = Client(KerasScalePlugin(context).get_plugin_apps()["/run"]).get(f"/run?run={run}")
    assert response.status_code == 200, response.data
    return json.loads(response.data)


def test_gpu_lanes_and_advice_from_gpumonitor(tmp_path):
    from tests.fakes.fake_nvml import FakeNvml

    run = str(tmp_path / "gpu")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    monitor = ks.GpuMonitor(interval_s=0.002, nvml=FakeNvml.with_gpus(2, util_gpu_pct=20.0, mem_used_mb=900.0,
                                                                        power_w=80.0), log_dir=run, verbose=0)
    _model().fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, callbacks=[monitor])
    page = _page_via_plugin(str(tmp_path), "gpu")
    lanes = page["gpu"]["lanes"]
    assert sorted(lanes) == ["0", "1"]
    for gpu in ("0", "1"):
        assert {"utilisation %", "memory MB", "power W"} <= set(lanes[gpu])
        assert {v for _, v in lanes[gpu]["utilisation %"]} == {20.0}
        assert {v for _, v in lanes[gpu]["memory MB"]} == {900.0}
    assert monitor.advice_history  # 20% utilisation: GpuMonitor advised
    assert {(a["advice"], a["gpu"]) for a in page["gpu"]["advice"]} == {
        (a.kind, a.gpu_index) for a in monitor.advice_history}


def test_no_gpu_note_says_why(tmp_path):
    from keras_scale import nvml as nvml_lib

    run = str(tmp_path / "cpu")

    def no_nvml():
        raise nvml_lib.NvmlUnavailable("no NVIDIA driver found")

    with pytest.warns(RuntimeWarning, match="GPU metrics are off"):
        _model().fit(np.zeros((8, 4), "float32"), np.zeros((8, 1), "float32"), epochs=1, verbose=0,
                     callbacks=[ks.GpuMonitor(nvml=no_nvml, log_dir=run, verbose=0)])
    page = _page_via_plugin(str(tmp_path), "cpu")
    assert page["gpu"]["lanes"] == {} and "no NVIDIA driver found" in page["gpu"]["unavailable"]


def test_rollback_lr_cut_oom_resplit_and_resume_reach_the_loss_curve(tmp_path):
    from tests import test_auto_accum as auto
    from tests import test_nan_guard as nan
    from tests._helpers import linspace_mlp

    logdir, run = str(tmp_path), str(tmp_path / "incidents")
    # an OOM re-split of accum="auto" (a layer that raises ResourceExhaustedError above 4 samples per call)
    model = auto.compile_(ks.wrap(auto.build(threshold=4), accum="auto", log_dir=run))
    model.fit(tf.data.Dataset.from_tensor_slices((auto.X, auto.Y)).batch(16), epochs=1, verbose=0, shuffle=False)
    changes = model._keras_scale_auto.changes
    # two rollbacks to NanGuard's in-memory snapshot, at two poisoned batches (tests/test_nan_guard.py)
    x, y = nan._data(n=256)
    model = linspace_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    guard = ks.NanGuard(policy="rollback", max_consecutive=1, lr_factor=0.5, snapshot_every_n_steps=5, verbose=0,
                        log_dir=run)
    model.fit(nan._poison(nan._poison(x, 6), 8), y, batch_size=16, epochs=1, verbose=0, shuffle=False,
              callbacks=[guard])
    # a learning-rate cut (ReduceLROnPlateau has no log_dir: its record goes to the run Goodput opened), then a
    # resume from ChiefCheckpoint's directory
    ckpt_dir = os.path.join(run, "checkpoints")
    small_x, small_y = auto.X[:32], auto.Y[:32]
    first = _model()
    first.fit(small_x, small_y, batch_size=8, epochs=1, verbose=0, callbacks=[
        ks.ChiefCheckpoint(ckpt_dir), ks.Goodput(log_dir=run, verbose=0)])
    plateau = ks.ReduceLROnPlateau(monitor="loss", patience=1, min_delta=1e6, factor=0.5, verbose=0)
    second = _model()
    resumed = ks.ChiefCheckpoint(ckpt_dir)
    second.fit(small_x, small_y, batch_size=8, epochs=3, verbose=0, callbacks=[
        resumed, plateau, ks.Goodput(log_dir=run, verbose=0)])

    page = _page_via_plugin(logdir, "incidents")
    by_kind = {}
    for e in page["incidents"]:
        by_kind.setdefault(e["kind"], []).append(e)
    assert [(e["old_accum"], e["new_accum"]) for e in by_kind["oom_resplit"]] == [(o, n) for _, o, n, _ in changes]
    assert len(by_kind["rollback"]) == guard.rollbacks >= 1
    assert [(e["lr_factor"], e["restored_from"]) for e in by_kind["rollback"]] == [(0.5, "in-memory snapshot")] * 2
    assert [e["source"] for e in by_kind["nan"]] == ["inputs", "inputs"]
    assert [e["path"] for e in by_kind["resume"]] == [resumed.restored_from]
    cuts = by_kind["lr_cut"]
    assert len(cuts) >= 1 and cuts[0]["new_lr"] == pytest.approx(0.5 * cuts[0]["old_lr"])


def test_a_worker_restart_of_keras_scale_launch_reaches_the_loss_curve(tmp_path, monkeypatch):
    # the launcher's restart log names the restart that started this process: Goodput puts it on the loss curve
    # once, at the update training resumed from (a second fit in the same process does not repeat it)
    from keras_scale.callbacks import goodput as goodput_module
    from keras_scale.heartbeat_file import RESTART_LOG_ENV

    log = tmp_path / "restarts.jsonl"
    log.write_text(json.dumps({"event": "restart", "restart": 1, "max_restarts": 3, "workers": [1],
                               "reason": "killed by SIGKILL", "returncode": -9, "num_workers": 2,
                               "num_workers_next": 2}) + "\n")
    monkeypatch.setenv(RESTART_LOG_ENV, str(log))
    monkeypatch.setattr(goodput_module, "_RESTARTS_RECORDED", set())
    run = str(tmp_path / "run")
    model = _model()
    x = np.random.default_rng(0).random((32, 4)).astype("float32")
    for _ in range(2):
        model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0, callbacks=[ks.Goodput(log_dir=run, verbose=0)])
    restarts = [e for e in events.read(run) if e["kind"] == "worker_restart"]
    assert len(restarts) == 1 and restarts[0]["step"] == 0 and restarts[0]["task"] == "1"
    assert restarts[0]["reason"] == "killed by SIGKILL"
    page = data.run_detail("r", run)
    assert [e["kind"] for e in page["incidents"]] == ["worker_restart"]
