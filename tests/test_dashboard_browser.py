"""The keras_scale tab as a browser shows it: ``tools/dashboard_check.py`` trains a demo-like run of 290 steps and a
3-run sweep, starts TensorBoard on them, renders the tab in headless Chromium and checks the rendered text (steps
290, one NaN-skip row per poisoned batch, the checkpoint rows saying where each save was taken, round axis ticks,
the sweep's overlaid loss curves with its runs in the legend). Skipped where no Chromium is installed."""
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "tools"))
from dashboard_check import find_chromium  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(find_chromium() is None, reason="no Chromium here (apt-get install -y chromium)")]


def test_the_rendered_tab_shows_the_runs_numbers(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "dashboard_check.py"), "--keep",
                          str(tmp_path / "runs")], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "ok: steps 290" in out.stdout
