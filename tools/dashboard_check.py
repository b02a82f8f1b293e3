"""Render the keras_scale tab in headless Chromium and check the numbers it shows (and retake docs/dashboard.png).

    apt-get install -y chromium                      # once (Debian); any Chromium or Chrome works
    python tools/dashboard_check.py [--screenshot docs/dashboard.png] [--keep DIR]

It trains two things in this process, in a temporary directory (or ``--keep DIR``):

- ``demo``: a demo-like run of 290 steps (5 epochs of 58 batches) with the quickstart's callbacks
  (``examples/quickstart.py``'s ``make_callbacks``: NanGuard, GpuMonitor on a fake GPU, ChiefCheckpoint every 16
  steps, HostMemoryWatch, LearningRateLogger, Keras's TensorBoard, Goodput), one batch poisoned with NaN in every
  epoch;
- ``sweep``: 3 runs of a small regression at 3 learning rates (the last one's data holds a NaN sample: NanGuard
  skips a step in each epoch).

Then it starts TensorBoard with the plugin on each log directory, lets Chromium render the tab
(``/data/plugin_entry.html?name=keras_scale``, as TensorBoard shows it in its frame) with ``--dump-dom``, and checks
the rendered text: "steps 290", one "NaN skip" row per poisoned batch, one checkpoint row per save saying where it
was taken ("end of epoch 5"), round axis ticks, and the sweep's overlaid loss chart naming its 3 runs in the legend.
Exit status 0 when every check passes, 1 with the failures listed, 2 without Chromium.
``tests/test_dashboard_browser.py`` runs it (slow; skipped without Chromium).
"""
from __future__ import annotations

import argparse
import html.parser
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

DEMO_EPOCHS, DEMO_STEPS_PER_EPOCH, BATCH = 5, 58, 8
POISONED_BATCH = 7  # in every epoch
SWEEP_LRS = (("lr_0.003", 0.003), ("lr_0.01", 0.01), ("lr_0.03", 0.03))  # the last one's data has a NaN sample


def find_chromium() -> Optional[str]:
    """The Chromium (or Chrome) executable on PATH, or None.

    Example:
        >>> find_chromium() is None or os.path.isabs(find_chromium())
        True
    """
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def make_demo_run(run: str) -> Dict[str, int]:
    """Train the demo-like run into ``run``; returns what the page must show (steps, NaN skips, saves)."""
    import keras
    import numpy as np

    import keras_scale as ks
    from tests.fakes.fake_nvml import FakeNvml

    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(ROOT, "examples", "quickstart.py"))
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    keras.utils.set_random_seed(0)
    n = DEMO_STEPS_PER_EPOCH * BATCH
    x = np.random.default_rng(0).normal(size=(n, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    x[POISONED_BATCH * BATCH + 2, 1] = np.nan
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    callbacks = quickstart.make_callbacks(run, nvml=FakeNvml.with_gpus(1, util_gpu_pct=70.0))
    for callback in callbacks:
        if isinstance(callback, ks.GpuMonitor):
            callback.interval_s = 0.05
        if isinstance(callback, ks.Goodput):
            callback.verbose = 0
        if isinstance(callback, ks.NanGuard):
            callback.verbose = 0
        if isinstance(callback, ks.ChiefCheckpoint):
            callback.verbose = 0
            checkpoint = callback
    model.fit(x, y, batch_size=BATCH, epochs=DEMO_EPOCHS, verbose=0, callbacks=callbacks)
    steps = DEMO_EPOCHS * DEMO_STEPS_PER_EPOCH
    saves = len([e for e in _events(run) if e["kind"] == "checkpoint"])
    del checkpoint
    return {"steps": steps, "nan_skips": DEMO_EPOCHS, "saves": saves}


def _events(run: str) -> List[dict]:
    from keras_scale import events

    return events.read(run)


def make_sweep(root: str) -> List[str]:
    """Three runs of one regression at three learning rates under ``root``; returns their names."""
    import keras
    import numpy as np

    import keras_scale as ks

    x = np.random.default_rng(1).normal(size=(256, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
    names = []
    for i, (name, lr) in enumerate(SWEEP_LRS):
        if i == len(SWEEP_LRS) - 1:
            x = x.copy()
            x[37, 2] = np.nan
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
        run = os.path.join(root, name)
        model.fit(x, y, batch_size=16, epochs=4, verbose=0, validation_split=0.25,
                  callbacks=[keras.callbacks.TensorBoard(run, update_freq=2), ks.NanGuard(verbose=0),
                             ks.Goodput(verbose=0)])
        names.append(name)
    return names


class _Text(html.parser.HTMLParser):
    """The text of a DOM dump, and the text of the elements carrying given classes."""

    def __init__(self, classes: List[str]) -> None:
        super().__init__()
        self.classes, self.stack, self.parts = classes, [], []
        self.by_class: Dict[str, List[str]] = {c: [] for c in classes}
        self.open: List[tuple] = []  # (class, depth, chunks)

    def handle_starttag(self, tag, attrs):
        self.stack.append(tag)
        cls = (dict(attrs).get("class") or "").split()
        for c in self.classes:
            if c in cls:
                self.open.append((c, len(self.stack), []))

    def handle_endtag(self, tag):
        depth = len(self.stack)
        while self.open and self.open[-1][1] >= depth:
            c, _, chunks = self.open.pop()
            self.by_class[c].append(" ".join("".join(chunks).split()))
        if self.stack:
            self.stack.pop()

    def handle_data(self, data):
        self.parts.append(data)
        for _, _, chunks in self.open:
            chunks.append(data)

    @property
    def text(self) -> str:
        return " ".join(" ".join(self.parts).split())


def render(chromium: str, url: str, screenshot: Optional[str] = None, height: int = 2300) -> str:
    """The DOM of ``url`` after Chromium ran its scripts (and the screenshot when asked)."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
             "--hide-scrollbars", "--virtual-time-budget=30000", f"--window-size=1150,{height}"]
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run([chromium, *flags, f"--user-data-dir={profile}", "--dump-dom", url],
                             capture_output=True, text=True, timeout=240)
        if screenshot:
            subprocess.run([chromium, *flags, f"--user-data-dir={profile}",
                            f"--screenshot={os.path.abspath(screenshot)}", url],
                           capture_output=True, text=True, timeout=240)
    return out.stdout


def _serve(logdir: str):
    from dashboard_screenshot import serve

    return serve(logdir)


def _wait_for_scalars(url: str, runs: int) -> None:
    import json
    import time
    import urllib.request

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/data/plugin/scalars/tags", timeout=30) as r:
            listing = json.loads(r.read())
        if sum(1 for tags in listing.values() if "batch_loss" in tags or "epoch_loss" in tags) >= runs:
            time.sleep(2)
            return
        time.sleep(1)


def check_demo(chromium: str, logdir: str, expected: Dict[str, int], screenshot: Optional[str]) -> List[str]:
    server, url = _serve(logdir)
    try:
        _wait_for_scalars(url, 1)
        dom = render(chromium, url + "/data/plugin_entry.html?name=keras_scale", screenshot, height=2000)
    finally:
        server.shutdown()
    page = _Text(["totals", "tag", "xtick", "ytick", "note", "saved-at"])
    page.feed(dom)
    text, failures = page.text, []
    if "data-loaded" not in dom:
        return [f"the page did not finish loading its run: {text[:500]!r}"]
    totals = " ".join(page.by_class["totals"])
    if f"steps {expected['steps']}" not in totals:
        failures.append(f"the totals do not say 'steps {expected['steps']}': {totals!r}")
    nan_rows = page.by_class["tag"].count("NaN skip")
    if nan_rows != expected["nan_skips"]:
        failures.append(f"{nan_rows} 'NaN skip' rows, expected {expected['nan_skips']}")
    rows = page.by_class["saved-at"]
    if len(rows) != expected["saves"]:
        failures.append(f"{len(rows)} checkpoint rows saying where they were saved, expected {expected['saves']}: "
                        f"{rows}")
    if f"end of epoch {DEMO_EPOCHS}" not in rows:
        failures.append(f"no checkpoint row says 'end of epoch {DEMO_EPOCHS}': {rows}")
    if f"epoch {DEMO_EPOCHS + 1}" in " ".join(rows):
        failures.append(f"a checkpoint row names epoch {DEMO_EPOCHS + 1} of a {DEMO_EPOCHS}-epoch run: {rows}")
    xticks = [float(t.replace(",", "")) for t in page.by_class["xtick"]]
    if not xticks or max(xticks) < expected["steps"] or any(t % 10 for t in xticks):
        failures.append(f"the step axis' ticks are not round or end before the last step: {page.by_class['xtick']}")
    failures += _tick_failures("loss", page.by_class["ytick"])
    if not any("mean loss since the start of the epoch" in n for n in page.by_class["note"]):
        failures.append(f"no note says what the loss curve is: {page.by_class['note']}")
    return failures


def _tick_failures(axis: str, labels: List[str]) -> List[str]:
    """The y axis' tick labels (in tick order, lowest first) tell adjacent ticks apart: each a number, strictly
    increasing, none repeated ("1.1, 1.1, 1.11" fails)."""
    try:
        values = [float(t.replace(",", "")) for t in labels]
    except ValueError:
        return [f"the {axis} axis has a tick label that is not a number: {labels}"]
    if len(values) < 2 or any(b <= a for a, b in zip(values, values[1:])):
        return [f"the {axis} axis' tick labels are not distinct and increasing: {labels}"]
    return []


def check_sweep(chromium: str, logdir: str, names: List[str]) -> List[str]:
    server, url = _serve(logdir)
    try:
        _wait_for_scalars(url, len(names))
        dom = render(chromium, url + "/data/plugin_entry.html?name=keras_scale")
    finally:
        server.shutdown()
    page = _Text(["sweep-run", "sweep-legend", "sweep-ytick"])
    page.feed(dom)
    failures = []
    if f'data-compared="{len(names)}"' not in dom:
        return [f"the overlaid loss chart of the {len(names)} runs was not drawn: {page.text[:500]!r}"]
    legend = page.by_class["sweep-run"]
    if [entry.split(" (")[0] for entry in legend] != names:
        failures.append(f"the sweep's legend names {legend}, expected {names}")
    if not any("incident" in entry for entry in legend):
        failures.append(f"no run of the sweep shows its incidents in the legend: {legend}")
    failures += _tick_failures("sweep's loss", page.by_class["sweep-ytick"])
    if "polyline" not in dom.split("sweep-loss", 1)[-1]:
        failures.append("no loss curve drawn in the sweep's chart")
    return failures


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--screenshot", default=None, help="also write the demo page's screenshot here (PNG)")
    p.add_argument("--keep", default=None, help="train into this directory and keep it (default: a temporary one)")
    p.add_argument("--reuse", action="store_true", help="with --keep: render the runs already there, no training")
    p.add_argument("--chromium", default=find_chromium())
    args = p.parse_args(argv)
    if not args.chromium:
        print("no Chromium found: apt-get install -y chromium", file=sys.stderr)
        return 2
    root = args.keep or tempfile.mkdtemp(prefix="keras_scale_dashboard_")
    try:
        demo_logdir, sweep_logdir = os.path.join(root, "demo"), os.path.join(root, "sweep")
        if args.reuse and os.path.isdir(demo_logdir) and os.path.isdir(sweep_logdir):
            run = os.path.join(demo_logdir, "quickstart")
            expected = {"steps": DEMO_EPOCHS * DEMO_STEPS_PER_EPOCH, "nan_skips": DEMO_EPOCHS,
                        "saves": len([e for e in _events(run) if e["kind"] == "checkpoint"])}
            names = [name for name, _ in SWEEP_LRS]
        else:
            expected = make_demo_run(os.path.join(demo_logdir, "quickstart"))
            names = make_sweep(sweep_logdir)
        failures = check_demo(args.chromium, demo_logdir, expected, args.screenshot)
        failures += check_sweep(args.chromium, sweep_logdir, names)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    if not failures:
        print(f"ok: steps {expected['steps']}, {expected['nan_skips']} NaN skip rows, {expected['saves']} checkpoint "
              f"rows, a sweep of {len(names)} runs in the legend" + (f"; wrote {args.screenshot}" if args.screenshot
                                                                      else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
