"""The ``keras_scale`` TensorBoard plugin: routes serving the dashboard's data and its self-contained front end.

TensorBoard finds it through the ``tensorboard_plugins`` entry point (``pyproject.toml``); it is listed active
when the log directory holds a keras_scale run (a ``keras_scale/events.jsonl`` stream, see
:mod:`keras_scale.events`).

Routes (under ``/data/plugin/keras_scale``):

- ``/index.js``: the front end (plain JavaScript and SVG; nothing fetched from the internet);
- ``/runs``: ``[{"run", "totals", "counts", "last_step"}]``, one per run (the side-by-side goodput comparison);
- ``/run?run=NAME``: the run's page data (:func:`keras_scale.tensorboard_plugin.data.run_detail`).

Example:
    $ tensorboard --logdir runs/quickstart     # then open the "keras_scale" tab
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from typing import Any, Dict, List, Tuple

from tensorboard import errors, plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from keras_scale.tensorboard_plugin import data

__all__ = ["KerasScalePlugin", "PLUGIN_NAME"]

PLUGIN_NAME = "keras_scale"
_STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
_RUNS_CACHE_S = 5.0  # how long one walk of the log directory answers is_active and /runs


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_response(request: Any, value: Any) -> Any:
    body = json.dumps(_finite(value), allow_nan=False, separators=(",", ":"))
    return http_util.Respond(request, body, "application/json")


class KerasScalePlugin(base_plugin.TBPlugin):
    """One page per keras_scale run: goodput bars, the loss curve with every incident, GPU lanes, checkpoints,
    profiler verdicts; the runs' goodput side by side.

    Example:
        from tensorboard import program
        tb = program.TensorBoard(plugins=default.get_plugins() + [KerasScalePlugin])  # the entry point does this
    """

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._logdir = context.logdir or ""
        self._data_provider = context.data_provider
        self._lock = threading.Lock()
        self._runs: Tuple[float, Dict[str, str]] = (-math.inf, {})

    # ------------------------------------------------------------------ TensorBoard interface
    def get_plugin_apps(self) -> Dict[str, Any]:
        return {"/index.js": self._serve_js, "/runs": self._serve_runs, "/run": self._serve_run}

    def is_active(self) -> bool:
        return bool(self._find_runs())

    def data_plugin_names(self) -> Tuple[str, ...]:
        return ()  # no summaries of its own: is_active() decides

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="keras_scale")

    # ------------------------------------------------------------------ data
    def _find_runs(self) -> Dict[str, str]:
        with self._lock:
            stamp, runs = self._runs
            if time.monotonic() - stamp > _RUNS_CACHE_S:
                runs = data.find_runs(self._logdir)  # (a --logdir_spec list finds nothing: inactive)
                self._runs = (time.monotonic(), runs)
            return runs

    def _scalar_reader(self, ctx: Any, experiment: str, run_name: str) -> Any:
        def read(wanted: Any) -> Dict[str, Dict[str, List[Tuple[int, float]]]]:
            if self._data_provider is None:
                return {}
            listing = self._data_provider.list_scalars(ctx, experiment_id=experiment, plugin_name="scalars")
            inside = {tb_run: [t for t in tags if wanted(tb_run, t)] for tb_run, tags in listing.items()
                      if run_name == "." or tb_run == run_name or tb_run.startswith(run_name + "/")}
            inside = {r: t for r, t in inside.items() if t}
            if not inside:
                return {}
            tags = sorted({t for ts in inside.values() for t in ts})
            result = self._data_provider.read_scalars(
                ctx, experiment_id=experiment, plugin_name="scalars", downsample=10 ** 7,
                run_tag_filter=provider.RunTagFilter(runs=sorted(inside), tags=tags))
            return {r: {t: [(d.step, d.value) for d in points] for t, points in by_tag.items() if t in inside[r]}
                    for r, by_tag in result.items() if r in inside}
        return read

    # ------------------------------------------------------------------ routes
    @wrappers.Request.application
    def _serve_js(self, request: Any) -> Any:
        with open(os.path.join(_STATIC, "index.js"), encoding="utf-8") as f:
            return http_util.Respond(request, f.read(), "application/javascript")

    @wrappers.Request.application
    def _serve_runs(self, request: Any) -> Any:
        runs = self._find_runs()
        return _json_response(request, [data.run_summary(name, path) for name, path in sorted(runs.items())])

    @wrappers.Request.application
    def _serve_run(self, request: Any) -> Any:
        name = request.args.get("run")
        runs = self._find_runs()
        if name not in runs:
            raise errors.NotFoundError(f"no keras_scale run {name!r} under the log directory (runs: {sorted(runs)})")
        ctx = plugin_util.context(request.environ)
        experiment = plugin_util.experiment_id(request.environ)
        detail = data.run_detail(name, runs[name], read_scalars=self._scalar_reader(ctx, experiment, name))
        return _json_response(request, detail)
