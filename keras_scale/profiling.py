"""Read a profiler capture offline and say where the step time goes: :func:`profile_summary`.

A capture is what ``tf.profiler.experimental.start(log_dir)`` / :class:`keras_scale.ProfileWindow` /
``keras.callbacks.TensorBoard(profile_batch=...)`` write: ``<log_dir>/plugins/profile/<run>/<host>.xplane.pb``.
This module finds the newest one under a directory and reads it with xprof (``tensorboard-plugin-profile``,
the ``profile`` extra) -- the same converters TensorBoard's Profile tab uses (``overview_page``,
``input_pipeline_analyzer``, ``framework_op_stats``) -- then prints the mean step time, the share of it spent
waiting for input / computing / launching ops, the top ops, and a one-line verdict with the fix.

It needs neither TensorFlow nor a GPU: summaries can be made on a laptop from a capture copied off a cluster.

Example:
    >>> import keras_scale as ks
    >>> summary = ks.profile_summary("runs/profile")          # doctest: +SKIP
    >>> print(summary)                                        # doctest: +SKIP
    >>> summary.verdict, round(summary.input_percent)         # doctest: +SKIP
    ('input-bound', 87)

    $ keras-scale profile-summary runs/profile
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence

__all__ = [
    "ProfileSummary",
    "OpTime",
    "profile_summary",
    "find_captures",
    "newest_capture",
    "verdict_for",
    "cli",
    "INSTALL_HINT",
]

INSTALL_HINT = (
    "Reading profiler captures needs xprof, from the 'profile' extra: pip install 'keras-scale[profile]' "
    "(or: pip install tensorboard-plugin-profile)."
)

# A step is called input-bound / launch-bound when that share of its time is at least this much: xprof's own
# "HIGHLY input-bound" threshold (input_pipeline_analysis.cc, kHighlyInfeedBoundThresholdInPercent = 20).
BOUND_THRESHOLD_PERCENT = 20.0

FIXES = {
    "input-bound": (
        "the accelerator waits for data: build the tf.data pipeline with "
        "map(..., num_parallel_calls=tf.data.AUTOTUNE) and end it with .prefetch(tf.data.AUTOTUNE); cache "
        "decoded data (.cache()) or move heavy preprocessing offline; keras_scale.data.benchmark(ds) times the "
        "pipeline alone"
    ),
    "launch-bound": (
        "the steps are too small for their per-op overhead: run several steps per call with "
        "model.compile(..., steps_per_execution=32), fuse ops with jit_compile=True (XLA), or use a larger batch"
    ),
    "compute-bound": (
        "the time is spent in the model's own ops (top ops below): use mixed precision "
        "(keras.mixed_precision.set_global_policy('mixed_bfloat16' or 'mixed_float16')) and jit_compile=True; "
        "then look at the top ops"
    ),
    "unknown": (
        "the capture has no step markers: capture with keras_scale.ProfileWindow (it marks each step), or wrap "
        "your steps in tf.profiler.experimental.Trace('train', step_num=step, _r=1)"
    ),
}
# xprof groups events by the iterations of any tf.while_loop that runs more than once and then ignores the step
# markers (xprof group_events.cc, ProcessTensorFlowLoop / CreateEventGroups): no step time at all.
LOOP_FIX = (
    "the step runs a tf.while_loop (ops named 'while/...'), and xprof then ignores step markers -- this happens "
    "with model.compile(steps_per_execution > 1) and keras_scale.wrap(model, accum > 1). Profile a run with "
    "steps_per_execution=1 (and keras_scale.wrap(model, accum=N, unroll=True)) to see the step-time breakdown; the top ops below are still valid"
)


# --------------------------------------------------------------------------------------------------- captures
def find_captures(log_dir: str) -> List[str]:
    """The capture directories (``.../plugins/profile/<run>``) under ``log_dir``, oldest first.

    ``log_dir`` may be the directory given to the profiler, any parent of it (e.g. TensorBoard's ``log_dir``,
    whose captures are under ``train/``), or a capture directory itself. Captures are ordered by the time their
    ``*.xplane.pb`` files were written.

    Example:
        find_captures("runs/profile")
        # ['runs/profile/plugins/profile/2026_11_29_18_58_27']
    """
    log_dir = os.fspath(log_dir)
    if not os.path.isdir(log_dir):
        raise FileNotFoundError(
            f"profile log directory {log_dir!r} does not exist. Pass the log_dir given to ProfileWindow / "
            "TensorBoard (or a parent of it)."
        )
    runs: Dict[str, float] = {}
    for root, _dirs, files in os.walk(log_dir):
        stamps = [os.path.getmtime(os.path.join(root, f)) for f in files if f.endswith(".xplane.pb")]
        if stamps:
            runs[root] = max(stamps)
    return sorted(runs, key=lambda run: (runs[run], run))


def newest_capture(log_dir: str) -> str:
    """The most recent capture directory under ``log_dir``; raises ``FileNotFoundError`` when there is none.

    Example:
        newest_capture("runs/profile")
        # 'runs/profile/plugins/profile/2026_11_29_18_58_27'
    """
    runs = find_captures(log_dir)
    if not runs:
        raise FileNotFoundError(
            f"no profiler capture (*.xplane.pb) under {os.fspath(log_dir)!r}. Capture one with "
            "model.fit(..., callbacks=[keras_scale.ProfileWindow(log_dir)]) and pass that log_dir."
        )
    return runs[-1]


# ------------------------------------------------------------------------------------------------------ xprof
def _converter():
    # xprof's C++ logs every conversion at INFO level; its logger reads TF_CPP_MIN_LOG_LEVEL when it loads.
    # Quieten it for that moment only, leaving the user's environment as it was.
    saved = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    if saved is None:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    try:
        try:
            from xprof.convert import raw_to_tool_data  # tensorboard-plugin-profile >= 2.19
        except ImportError:
            try:
                from tensorboard_plugin_profile.convert import raw_to_tool_data  # older releases
            except ImportError:
                raise ImportError(INSTALL_HINT) from None
    finally:
        if saved is None:
            os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
    return raw_to_tool_data


def _tool_tables(paths: Sequence[str], tool: str) -> List[dict]:
    """xprof's output for ``tool``: a list of gviz DataTables (``{"cols": [...], "rows": [...], "p": {...}}``)."""
    result = _converter().xspace_to_tool_data(list(paths), tool, {})
    data = result[0] if isinstance(result, tuple) else result
    if isinstance(data, bytes):
        data = data.decode("utf-8")
    if not data:
        return []
    parsed = json.loads(data) if isinstance(data, str) else data
    return parsed if isinstance(parsed, list) else [parsed]


def _rows(table: dict) -> List[Dict[str, Any]]:
    ids = [col.get("id") for col in table.get("cols", [])]
    out = []
    for row in table.get("rows", []):
        cells = row.get("c", [])
        out.append({ids[i]: (cell or {}).get("v") for i, cell in enumerate(cells) if i < len(ids)})
    return out


def _table_with(tables: List[dict], column: str) -> Optional[dict]:
    for table in tables:
        if any(col.get("id") == column for col in table.get("cols", [])):
            return table
    return None


def _messages(tables: List[dict]) -> List[str]:
    table = _table_with(tables, "message")
    return [str(r.get("message")) for r in _rows(table)] if table else []


# ---------------------------------------------------------------------------------------------------- summary
@dataclasses.dataclass(frozen=True)
class OpTime:
    """One TensorFlow op's self time over the captured steps.

    Example:
        >>> OpTime("dense/MatMul", "MatMul", "Device", 12.5, 40.0).percent
        40.0
    """

    name: str
    type: str
    where: str  # "Host" or "Device"
    self_time_ms: float  # summed over the captured steps
    percent: float  # of all non-idle op self time on the same side (host or device)


@dataclasses.dataclass(frozen=True)
class ProfileSummary:
    """Where the step time of one capture went. ``str(summary)`` is the printed report.

    Shares are of the summed step time of the captured steps: ``input_percent`` (waiting for the input
    pipeline), ``compute_percent`` (device and host op execution, device-to-device copies, collectives),
    ``launch_percent`` (kernel launch plus the host/Python overhead between ops, xprof's "All others"),
    ``other_percent`` (compilation, outfeed).

    Example:
        s = profile_summary("runs/profile")
        s.step_numbers, s.verdict
        # ([10, 11, 12, 13, 14], 'compute-bound')
    """

    capture_dir: str
    hardware_type: str
    step_numbers: List[int]
    step_time_ms: float  # mean over the captured steps
    step_time_ms_min: float
    step_time_ms_max: float
    input_percent: float
    compute_percent: float
    launch_percent: float
    other_percent: float
    top_ops: List[OpTime]
    slowest_input_stage: Optional[str]
    verdict: str  # "input-bound" | "compute-bound" | "launch-bound" | "unknown"
    fix: str
    xprof_messages: List[str]

    @property
    def num_steps(self) -> int:
        """How many marked steps the capture holds."""
        return len(self.step_numbers)

    @property
    def verdict_line(self) -> str:
        """The one-line verdict with its fix."""
        if self.verdict == "unknown":
            return f"verdict: unknown -- {self.fix}"
        share = {
            "input-bound": f"{self.input_percent:.0f}% of the step time waits for input",
            "launch-bound": f"{self.launch_percent:.0f}% of the step time is op launch / host overhead",
            "compute-bound": f"{self.compute_percent:.0f}% of the step time is compute",
        }[self.verdict]
        return f"verdict: {self.verdict} ({share}) -- fix: {self.fix}"

    def to_dict(self) -> dict:
        """A JSON-ready dict (what ``keras-scale profile-summary --json`` prints).

        Example:
            json.dumps(profile_summary("runs/profile").to_dict())
        """
        out = dataclasses.asdict(self)
        out["num_steps"] = self.num_steps
        out["verdict_line"] = self.verdict_line
        return out

    def __str__(self) -> str:
        lines = [f"profile summary: {self.capture_dir} ({self.hardware_type})"]
        if not self.step_numbers:
            lines.append("  no step markers in this capture, so no step time")
        else:
            first, last = self.step_numbers[0], self.step_numbers[-1]
            lines.append(
                f"  steps {first}..{last} ({self.num_steps} steps): step time {self.step_time_ms:.2f} ms mean "
                f"(min {self.step_time_ms_min:.2f}, max {self.step_time_ms_max:.2f})"
            )
            lines.append(
                f"  input {self.input_percent:.1f}% | compute {self.compute_percent:.1f}% | "
                f"launch/overhead {self.launch_percent:.1f}% | other {self.other_percent:.1f}%"
            )
            if self.slowest_input_stage:
                lines.append(f"  slowest input stage: {self.slowest_input_stage}")
        if self.top_ops:
            lines.append("  top ops (self time over the captured steps):")
            for op in self.top_ops:
                lines.append(
                    f"    {op.percent:5.1f}%  {op.self_time_ms:9.3f} ms  {op.where:<6} {op.type:<24} {op.name}"
                )
        lines.append("  " + self.verdict_line)
        return "\n".join(lines)


def verdict_for(input_percent: float, launch_percent: float, num_steps: int = 1) -> str:
    """The bottleneck named by the step-time shares.

    ``input-bound`` when at least 20% of the step waits for input (xprof's "highly input-bound" threshold);
    else ``launch-bound`` when at least 20% is op launch / host overhead; else ``compute-bound``; ``unknown``
    without steps.

    Example:
        >>> verdict_for(input_percent=35.0, launch_percent=30.0)
        'input-bound'
        >>> verdict_for(input_percent=2.0, launch_percent=5.0)
        'compute-bound'
    """
    if num_steps <= 0:
        return "unknown"
    if input_percent >= BOUND_THRESHOLD_PERCENT:
        return "input-bound"
    if launch_percent >= BOUND_THRESHOLD_PERCENT:
        return "launch-bound"
    return "compute-bound"


_STEP_NUMBER = re.compile(r"(\d+)\s*$")


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _step_breakdown(overview: List[dict]) -> dict:
    table = _table_with(overview, "stepTimeMs")
    rows = _rows(table) if table else []
    step_numbers, step_times = [], []
    sums = {"input": 0.0, "compute": 0.0, "launch": 0.0, "other": 0.0}
    for row in rows:
        match = _STEP_NUMBER.search(str(row.get("stepnum", "")))
        step_numbers.append(int(match.group(1)) if match else len(step_numbers))
        step_times.append(_num(row.get("stepTimeMs")))
        sums["input"] += _num(row.get("infeedTimeMs"))
        sums["compute"] += sum(
            _num(row.get(k))
            for k in ("deviceComputeTimeMs", "deviceToDeviceTimeMs", "deviceCollectivesTimeMs", "hostComputeTimeMs")
        )
        sums["launch"] += _num(row.get("kernelLaunchTimeMs")) + _num(row.get("otherTimeMs"))
        sums["other"] += _num(row.get("compileTimeMs")) + _num(row.get("outfeedTimeMs"))
    total = sum(step_times)
    percents = {k: (100.0 * v / total if total > 0 else 0.0) for k, v in sums.items()}
    hardware = (table or {}).get("p", {}).get("hardware_type", "unknown") if table else "unknown"
    return {
        "step_numbers": step_numbers,
        "step_times": step_times,
        "percents": percents,
        "hardware_type": hardware,
    }


def _runs_while_loop(op_stats: List[dict]) -> bool:
    table = _table_with(op_stats, "operation")
    return any(
        str(r.get("operation", "")).startswith("while/") or "/while/" in str(r.get("operation", ""))
        for r in (_rows(table) if table else [])
    )


def _top_ops(op_stats: List[dict], top_n: int) -> List[OpTime]:
    table = _table_with(op_stats, "total_self_time")
    # IDLE is not an op; tf.data iterator stages are reported on their own (slowest input stage)
    rows = [r for r in (_rows(table) if table else []) if str(r.get("type")) not in ("IDLE", "Dataset")]
    if not rows:
        return []
    on_device = [r for r in rows if str(r.get("host_or_device")) == "Device"]
    rows = on_device or rows  # on an accelerator the device ops are the ones that bound the step
    total_us = sum(_num(r.get("total_self_time")) for r in rows)
    rows.sort(key=lambda r: _num(r.get("total_self_time")), reverse=True)
    return [
        OpTime(
            name=str(r.get("operation")),
            type=str(r.get("type")),
            where=str(r.get("host_or_device")),
            self_time_ms=_num(r.get("total_self_time")) / 1000.0,
            percent=100.0 * _num(r.get("total_self_time")) / total_us if total_us > 0 else 0.0,
        )
        for r in rows[:top_n]
    ]


def _slowest_input_stage(input_tables: List[dict]) -> Optional[str]:
    table = _table_with(input_tables, "opName")
    rows = _rows(table) if table else []
    if not rows:
        return None
    row = max(rows, key=lambda r: _num(r.get("selfTimeInMs")))
    return f"{row.get('opName')} ({_num(row.get('selfTimeInMs')):.3f} ms self time)"


def profile_summary(log_dir: str, top_n: int = 5) -> ProfileSummary:
    """Summarize the newest profiler capture under ``log_dir`` (see the module docstring).

    Raises ``FileNotFoundError`` when there is no capture and ``ImportError`` (saying
    ``pip install 'keras-scale[profile]'``) when xprof is not installed.

    Example:
        s = profile_summary("runs/profile")
        print(s.verdict_line)
        # verdict: input-bound (87% of the step time waits for input) -- fix: ...
    """
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise ValueError(f"top_n must be an integer >= 0, got {top_n!r}")
    capture = newest_capture(log_dir)
    _converter()  # fail with the install hint before anything else
    paths = sorted(os.path.join(capture, f) for f in os.listdir(capture) if f.endswith(".xplane.pb"))
    overview = _tool_tables(paths, "overview_page")
    steps = _step_breakdown(overview)
    input_tables = _tool_tables(paths, "input_pipeline_analyzer")
    op_stats = _tool_tables(paths, "framework_op_stats")
    times = steps["step_times"]
    pct = steps["percents"]
    verdict = verdict_for(pct["input"], pct["launch"], num_steps=len(times))
    return ProfileSummary(
        capture_dir=capture,
        hardware_type=str(steps["hardware_type"]),
        step_numbers=steps["step_numbers"],
        step_time_ms=sum(times) / len(times) if times else 0.0,
        step_time_ms_min=min(times) if times else 0.0,
        step_time_ms_max=max(times) if times else 0.0,
        input_percent=pct["input"],
        compute_percent=pct["compute"],
        launch_percent=pct["launch"],
        other_percent=pct["other"],
        top_ops=_top_ops(op_stats, top_n),
        slowest_input_stage=_slowest_input_stage(input_tables) if times else None,
        verdict=verdict,
        fix=LOOP_FIX if verdict == "unknown" and _runs_while_loop(op_stats) else FIXES[verdict],
        xprof_messages=_messages(overview),
    )


# -------------------------------------------------------------------------------------------------------- cli
def cli(argv: Sequence[str]) -> int:
    """``keras-scale profile-summary LOGDIR [--top N] [--json]``: print the summary of the newest capture.

    Exit status 0 on success, 1 when there is no capture or xprof is missing (with what to do), 2 on bad usage.

    Example:
        cli(["runs/profile"])
        # 0
    """
    parser = argparse.ArgumentParser(
        prog="keras-scale profile-summary",
        description="Summarize the newest TensorFlow profiler capture (*.xplane.pb) under LOGDIR.",
    )
    parser.add_argument("logdir", help="the log_dir given to ProfileWindow / TensorBoard, or a parent of it")
    parser.add_argument("--top", type=int, default=5, help="how many top ops to list (default 5)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(list(argv))
    if args.top < 0:
        parser.error(f"--top must be >= 0, got {args.top}")
    try:
        summary = profile_summary(args.logdir, top_n=args.top)
    except (FileNotFoundError, ImportError) as e:
        print(f"keras-scale profile-summary: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))  # machine-readable: as it is
    else:
        from keras_scale.output import say

        say(str(summary))
    return 0
