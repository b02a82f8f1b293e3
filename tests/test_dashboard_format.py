"""The dashboard's front end prints numbers as they are (290 steps read "290", not "29") and puts its axis ticks on
round values; a checkpoint says where it was taken ("end of epoch 3", not "4 / 0"). The helpers of
``keras_scale/tensorboard_plugin/static/index.js`` run in Node (skipped where there is none)."""
import json
import os
import shutil
import subprocess

import pytest

from keras_scale.tensorboard_plugin import data
from tests.conftest import REPO_ROOT

NODE = shutil.which("node")
INDEX_JS = os.path.join(REPO_ROOT, "keras_scale", "tensorboard_plugin", "static", "index.js")


def _js(tmp_path, expression: str):
    module = tmp_path / "index.mjs"
    shutil.copy(INDEX_JS, module)
    script = f"import('{module.as_uri()}').then((m) => console.log(JSON.stringify({expression})))"
    out = subprocess.run([NODE, "-e", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(NODE is None, reason="no node here")
def test_integers_keep_their_zeros_and_others_lose_trailing_ones(tmp_path):
    shown = _js(tmp_path, "[290, 100, 1, 0, 1234, 0.5, 1.4012, 0.100, 72.5, -0.000745, null].map((x) => m.fmt(x))")
    assert shown == ["290", "100", "1", "0", "1,234", "0.5", "1.4", "0.1", "72.5", "-0.000745", "n/a"]


@pytest.mark.skipif(NODE is None, reason="no node here")
def test_axis_ticks_are_round_and_cover_the_data(tmp_path):
    steps = _js(tmp_path, "m.niceTicks(0, 290, 6, true)")
    assert steps["ticks"][0] == 0 and steps["hi"] >= 290
    gap = steps["ticks"][1] - steps["ticks"][0]
    assert gap in (10, 20, 25, 50, 100) and all(t % gap == 0 for t in steps["ticks"]), steps
    loss = _js(tmp_path, "m.niceTicks(0.0712, 2.3141, 6)")
    assert loss["lo"] <= 0.0712 and loss["hi"] >= 2.3141
    gap = round(loss["ticks"][1] - loss["ticks"][0], 9)
    assert gap in (0.25, 0.5, 1.0), loss
    assert all(abs(t / gap - round(t / gap)) < 1e-9 for t in loss["ticks"]), loss


@pytest.mark.skipif(NODE is None, reason="no node here")
def test_adjacent_tick_labels_never_read_the_same(tmp_path):
    # a loss that moves in its third or fourth digit, around 1000, tiny and signed ranges: each tick labelled with
    # the decimals its step needs, so no two labels of an axis are equal and each reads as its tick's value
    ranges = [[1.1013, 1.1251], [1.0011, 1.0019], [2.3021, 2.3029], [0.5, 0.52], [999.2, 999.9], [999.2, 1000.3],
              [-0.0007, 0.0004], [1e-5, 3e-5], [0.0712, 2.3141], [0, 290]]
    axes = _js(tmp_path, f"{json.dumps(ranges)}.map(([lo, hi]) => {{ const t = m.niceTicks(lo, hi, 6); "
                         "return [t.ticks, t.ticks.map((v) => m.tickLabel(v, t.step))]; })")
    for (lo, hi), (ticks, labels) in zip(ranges, axes):
        assert len(set(labels)) == len(labels), (lo, hi, labels)
        assert [float(t.replace(",", "")) for t in labels] == pytest.approx(ticks, abs=1e-12), (lo, hi, labels)
    assert axes[0][1][:3] == ["1.100", "1.105", "1.110"] and axes[-1][1][:2] == ["0", "100"]


@pytest.mark.skipif(NODE is None, reason="no node here")
def test_every_run_of_a_large_sweep_gets_its_own_colour(tmp_path):
    colours = _js(tmp_path, "Array.from({length: 64}, (_, i) => m.runColor(i))")
    assert len(set(colours)) == 64, colours


@pytest.mark.skipif(NODE is None, reason="no node here")
def test_a_checkpoint_says_where_it_was_taken(tmp_path):
    assert _js(tmp_path, "[m.savedAt(4, 0), m.savedAt(1, 16), m.savedAt(0, 0)]") == [
        "end of epoch 4", "epoch 2, batch 16", "before the first step"]


def test_the_page_says_what_the_loss_curve_is(tmp_path):
    run = tmp_path / "run"
    (run / "keras_scale").mkdir(parents=True)
    (run / "keras_scale" / "events.jsonl").write_text(
        json.dumps({"kind": "epoch", "step": 4, "time": 1.0, "epoch": 0, "logs": {"loss": 0.5}}) + "\n")

    def read_scalars(wanted):
        return {"train": {"batch_loss": [(2, 0.7), (4, 0.5)]}}

    page = data.run_detail("run", str(run), read_scalars=read_scalars)
    assert "since the start of the epoch" in page["loss_notes"]["batch_loss"]
    assert set(page["loss_notes"]) == set(page["loss"])
