"""What the dashboard shows, computed from what the callbacks left in a run directory (no TensorFlow import).

A *run* is a directory holding ``keras_scale/events.jsonl`` (:mod:`keras_scale.events`); streams in its
sub-directories (e.g. ``ProfileWindow(log_dir=<run>/profile)``) belong to it. Its TensorBoard scalars (GPU lanes,
``batch_loss``) come from the TensorBoard runs inside that directory, through a reader the plugin supplies.

Example:
    >>> find_runs("/nonexistent")
    {}
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["CATEGORIES", "INCIDENT_KINDS", "find_runs", "read_run_events", "run_summary", "run_detail",
           "downsample", "MAX_POINTS"]

STREAM_DIR = "keras_scale"  # keras_scale.events.STREAM_DIR / STREAM_NAME (not imported: that imports TensorFlow)
STREAM_NAME = "events.jsonl"

#: keras_scale.callbacks.goodput.CATEGORIES (a test keeps the two equal), in stacking order
CATEGORIES = ("productive_s", "skipped_steps_s", "redone_s", "input_wait_s", "compile_s", "checkpoint_s", "eval_s",
              "measure_s", "other_s")
#: the kinds drawn on the loss curve (every one kept, never downsampled)
INCIDENT_KINDS = ("nan", "rollback", "lr_cut", "oom_resplit", "preemption", "resume", "worker_restart")
#: points per series sent to the browser (min and max of each bucket: spikes survive)
MAX_POINTS = 2000

_GPU_TAG = re.compile(r"^gpu(\d+)/(.+)$")
#: the GPU lanes, each the first tag of its GPU whose quantity matches (GpuMonitor's names)
_GPU_LANES = (("utilisation %", re.compile(r"^util(_gpu)?(_mean)?(_pct)?$")),
              ("memory MB", re.compile(r"^mem(_used)?(_max)?_mb$")),
              ("power W", re.compile(r"^power(_mean)?_w$")),
              ("throttled (fraction)", re.compile(r"^throttle.*_frac$")))
_LOSS_TAGS = ("batch_loss",)  # Keras's TensorBoard(update_freq=N): per-step loss at the global batch
#: what each loss series is, shown under the curve: Keras logs the loss of a batch as the mean over the epoch so far
LOSS_NOTES = {
    "batch_loss": "Keras's batch_loss: the mean loss since the start of the epoch (not the batch's own loss), so it "
                  "restarts at each epoch's first step (the dotted lines)",
    "loss (epoch mean)": "the epoch's mean training loss, drawn at the epoch's last step",
    "val_loss": "the validation loss after each epoch",
}


def find_runs(logdir: str) -> Dict[str, str]:
    """``{run name: directory}`` of every keras_scale run under ``logdir`` (the name is the path relative to
    ``logdir``, ``"."`` for ``logdir`` itself); a stream inside another run's directory belongs to that run.

    Example:
        >>> find_runs("/nonexistent")
        {}
    """
    found: List[str] = []
    if not logdir or not os.path.isdir(logdir):
        return {}
    for root, dirs, files in os.walk(logdir):
        dirs[:] = [d for d in dirs if d != "plugins"]  # profiler captures: nothing of ours, many files
        if os.path.basename(root) == STREAM_DIR and STREAM_NAME in files:
            found.append(os.path.dirname(root))
    runs: Dict[str, str] = {}
    for run in sorted(found, key=len):
        if any(run == top or run.startswith(top.rstrip(os.sep) + os.sep) for top in runs.values()):
            continue
        rel = os.path.relpath(run, logdir)
        runs[rel.replace(os.sep, "/")] = run
    return runs


def _streams(run_dir: str) -> List[str]:
    paths = []
    for root, dirs, files in os.walk(run_dir):
        dirs[:] = [d for d in dirs if d != "plugins"]
        if os.path.basename(root) == STREAM_DIR and STREAM_NAME in files:
            paths.append(os.path.join(root, STREAM_NAME))
    return paths


_OPTIONAL_DICTS = ("goodput", "logs")
_OPTIONAL_STRS = ("path", "directory", "capture_dir")


def _checked(event: Any) -> Optional[Dict[str, Any]]:
    """The record as the page expects it, or None: a line of the wrong shape (damaged, another version, edited by
    hand) is skipped or its odd fields dropped; it never takes the page down."""
    if not isinstance(event, dict) or not isinstance(event.get("kind"), str):
        return None
    step = event.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        event["step"] = None
    stamp = event.get("time")
    if stamp is not None and (isinstance(stamp, bool) or not isinstance(stamp, (int, float))):
        event["time"] = None
    for key in _OPTIONAL_DICTS:
        if key in event and not isinstance(event[key], dict):
            del event[key]
    for key in _OPTIONAL_STRS:
        if key in event and not isinstance(event[key], str):
            del event[key]
    return event


#: path -> (file identity, bytes parsed, records parsed): a refresh parses only what was appended since the last one
_PARSED: Dict[str, Tuple[Tuple[int, int], int, List[Dict[str, Any]]]] = {}


def _read_stream(path: str) -> List[Dict[str, Any]]:
    """The records of one stream; the complete lines appended since the previous call are the only ones parsed
    (the stream is append-only; a replaced or shortened file is parsed again from its start)."""
    st = os.stat(path)
    ident = (st.st_dev, st.st_ino)
    cached = _PARSED.get(path)
    if cached is None or cached[0] != ident or st.st_size < cached[1]:
        cached = (ident, 0, [])
    _, offset, events = cached
    if st.st_size > offset:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read(st.st_size - offset)
        end = chunk.rfind(b"\n") + 1  # a last line still being written waits for the next refresh
        for line in chunk[:end].decode("utf-8", errors="replace").splitlines():  # junk bytes of a crash: skipped
            try:
                event = json.loads(line)
            except ValueError:
                continue
            event = _checked(event)
            if event is not None:
                events.append(event)
        offset += end
    _PARSED[path] = (ident, offset, events)
    return events


def read_run_events(run_dir: str) -> List[Dict[str, Any]]:
    """Every record of the run (its streams merged), in time order; a torn line of a killed run is skipped.

    The streams grow by a record per checkpoint save, epoch end and incident (never per step); a refresh parses
    only the records appended since the previous one (copies are returned: callers may change them).

    Example:
        >>> read_run_events("/nonexistent")
        []
    """
    events: List[Dict[str, Any]] = []
    for path in _streams(run_dir):
        try:
            events.extend(dict(e) for e in _read_stream(path))
        except OSError:
            continue
    events.sort(key=lambda e: (e.get("time") or 0.0))
    return _on_batch_axis(events)


#: records whose ``step`` is the optimizer update count (NanGuard, Goodput, the LR scheduler, AutoAccum); the others
#: (ChiefCheckpoint's saves and resumes, GpuMonitor, ProfileWindow) count batches
_UPDATE_KINDS = ("nan", "epoch", "fit_end", "rollback", "lr_cut", "worker_restart", "oom_resplit")


def _count(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _on_batch_axis(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Every record's ``step`` as the batches trained (NaN-skipped and rolled-back steps included): the counter of
    Keras's progress bar, of ``TensorBoard``'s ``batch_loss`` and of ChiefCheckpoint. Records counted in optimizer
    updates (fewer by each skipped step and by the steps a rollback discarded) are converted, their update count
    kept as ``updates``; a resumed process starts from its checkpoint's batch less the skips recorded before it."""
    offset: Dict[Any, int] = {}  # pid -> batches trained less optimizer updates, so far
    skips: List[Tuple[int, int]] = []  # (batch of the skip, steps skipped)
    for e in events:
        step, pid, kind = e.get("step"), e.get("pid"), e["kind"]
        if not isinstance(step, int):
            continue
        if kind == "resume":
            offset[pid] = sum(k for batch, k in skips if batch <= step)
        elif kind in _UPDATE_KINDS:
            off = offset.get(pid, 0)
            if kind == "nan":
                off += _count(e.get("bad_steps"), 1)
            elif kind == "rollback":
                off += _count(e.get("discarded_steps"))
            offset[pid] = off
            e["updates"], e["step"] = step, step + off
            if kind == "nan":
                skips.append((e["step"], _count(e.get("bad_steps"), 1)))
    return events


def downsample(points: Sequence[Tuple[float, float]], max_points: int = MAX_POINTS) -> List[Tuple[float, float]]:
    """At most ``max_points`` of ``(x, y)`` points in x order: the first and last, and the minimum and maximum of
    each of ``max_points // 2`` equal buckets (a spike is never smoothed away). Non-finite y values are dropped.

    Example:
        >>> downsample([(i, i % 7) for i in range(10_000)], max_points=100)[:3]  # each bucket's min and max
        [(0, 0), (6, 6), (202, 6)]
        >>> len(downsample([(i, float(i)) for i in range(10_000)], max_points=100)) <= 100
        True
    """
    pts = [(x, y) for x, y in points if y is not None and math.isfinite(y)]
    if len(pts) <= max_points:
        return pts
    buckets = max(1, max_points // 2)
    size = len(pts) / buckets
    out: List[Tuple[float, float]] = []
    for b in range(buckets):
        chunk = pts[int(b * size):int((b + 1) * size)]
        if not chunk:
            continue
        lo = min(range(len(chunk)), key=lambda i: chunk[i][1])
        hi = max(range(len(chunk)), key=lambda i: chunk[i][1])
        for i in sorted({lo, hi}):
            out.append(chunk[i])
    return out[:max_points]


# --------------------------------------------------------------------------------------------------------------
# goodput
# --------------------------------------------------------------------------------------------------------------

def _number(value: Any) -> Optional[float]:
    """``value`` if it is a finite number (a damaged record's string or NaN: None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def _goodput_row(goodput: Dict[str, Any]) -> Dict[str, Any]:
    row = {c: float(_number(goodput.get(c)) or 0.0) for c in CATEGORIES}
    row["wall_s"] = float(_number(goodput.get("wall_s")) or sum(row.values()))
    for key in ("goodput", "samples_per_s", "mfu", "tflops_per_s", "steps", "samples", "skipped_steps",
                "rolled_back_steps", "restarts", "restart_lost_s"):
        row[key] = _number(goodput.get(key))
    return row


def _totals(events: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The sum over the run's fits: each finished fit's ``fit_end`` summary, else (killed) its epochs."""
    fits: List[Dict[str, Any]] = []
    epochs_since_end: Dict[Any, List[Dict[str, Any]]] = {}  # per process: the epochs of its fit still running
    for e in events:
        if e["kind"] == "epoch" and isinstance(e.get("goodput"), dict):
            epochs_since_end.setdefault(e.get("pid"), []).append(e["goodput"])
        elif e["kind"] == "fit_end" and isinstance(e.get("goodput"), dict):
            fits.append(e["goodput"])
            epochs_since_end.pop(e.get("pid"), None)
    for epochs in epochs_since_end.values():  # a fit that never ended (killed): its finished epochs
        fits.extend(epochs)
    if not fits:
        return None
    rows = [_goodput_row(g) for g in fits]
    total: Dict[str, Any] = {c: sum(r[c] for r in rows) for c in CATEGORIES}
    total["wall_s"] = sum(r["wall_s"] for r in rows)
    total["goodput"] = total["productive_s"] / total["wall_s"] if total["wall_s"] > 0 else None
    samples = [r["samples"] for r in rows if r.get("samples")]
    total["samples"] = sum(samples) if samples else None
    for key in ("steps", "skipped_steps", "rolled_back_steps"):
        vals = [r[key] for r in rows if r.get(key) is not None]
        total[key] = sum(vals) if vals else None
    for key in ("restarts", "restart_lost_s"):  # `keras-scale launch --max-restarts`: the run's, so far (the last)
        vals = [r[key] for r in rows if r.get(key) is not None]
        total[key] = vals[-1] if vals else None
    rates = [(r["samples_per_s"], r["wall_s"]) for r in rows if r.get("samples_per_s")]
    total["samples_per_s"] = (total["samples"] / total["wall_s"] if total["samples"] and total["wall_s"] > 0
                              else (rates[-1][0] if rates else None))
    mfus = [(r["mfu"], r["wall_s"]) for r in rows if r.get("mfu") is not None]
    total["mfu"] = (sum(m * w for m, w in mfus) / sum(w for _, w in mfus)) if mfus and sum(w for _, w in mfus) else None
    return total


def run_summary(name: str, run_dir: str, events: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    """One run for the side-by-side comparison: its goodput totals and incident counts.

    Example:
        >>> run_summary("exp", "/nonexistent")["totals"] is None
        True
    """
    events = read_run_events(run_dir) if events is None else events
    counts: Dict[str, int] = {}
    for e in events:
        counts[e["kind"]] = counts.get(e["kind"], 0) + 1
    label = name if name != "." else (os.path.basename(os.path.abspath(run_dir)) or name)
    return {"run": name, "label": label, "totals": _totals(events), "counts": counts,
            "last_step": max((e["step"] for e in events if isinstance(e.get("step"), int)), default=None)}


# --------------------------------------------------------------------------------------------------------------
# the run's page
# --------------------------------------------------------------------------------------------------------------

def _incidents(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    last_step_by_pid: Dict[Any, int] = {}
    for e in events:
        step = e.get("step")  # batches trained (read_run_events)
        if e["kind"] == "resume":
            earlier = [s for pid, s in last_step_by_pid.items() if pid != e.get("pid")]
            if earlier and isinstance(step, int):
                e["redone_steps"] = max(0, max(earlier) - step)
        if e["kind"] in INCIDENT_KINDS:
            out.append(e)
        if isinstance(step, int):
            pid = e.get("pid")
            last_step_by_pid[pid] = max(step, last_step_by_pid.get(pid, step))
    return out


def _checkpoint_files(prefix: str) -> Tuple[bool, Optional[int]]:
    """(the checkpoint's files are there: index and data, their bytes)."""
    directory, base = os.path.split(prefix)
    try:
        names = os.listdir(directory)
    except OSError:
        return False, None
    mine = [n for n in names if n == base + ".index" or n.startswith(base + ".data-")]
    if base + ".index" not in mine or len(mine) < 2:
        return False, None
    size = 0
    for n in mine:
        try:
            size += os.path.getsize(os.path.join(directory, n))
        except OSError:
            return False, None
    return True, size


def _state_file_entries(directory: str) -> Optional[List[str]]:
    """The checkpoint names TensorFlow's ``checkpoint`` state file lists (written after a save completed)."""
    try:
        with open(os.path.join(directory, "checkpoint"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    return [os.path.basename(m) for m in re.findall(r'all_model_checkpoint_paths:\s*"([^"]+)"', text)]


def _relocated(directory: str, run_dir: Optional[str]) -> str:
    """Where a checkpoint directory recorded with an absolute path is now: the same path, or, when the log
    directory was moved or copied (``rsync`` off the cluster), the longest tail of that path found under
    ``run_dir`` (``/old/runs/exp/ckpt`` -> ``<run_dir>/ckpt``)."""
    if not directory or run_dir is None or os.path.isdir(directory):
        return directory
    parts = [p for p in os.path.normpath(directory).split(os.sep) if p]
    for i in range(len(parts)):
        candidate = os.path.join(run_dir, *parts[i:])
        if os.path.isdir(candidate):
            return candidate
    return directory


def _checkpoints(events: List[Dict[str, Any]], run_dir: Optional[str] = None) -> Dict[str, Any]:
    saves = [e for e in events if e["kind"] == "checkpoint"]
    best: Dict[str, Dict[str, Any]] = {}
    states: Dict[str, Optional[List[str]]] = {}
    moved: Dict[str, str] = {}
    rows = []
    for e in saves:
        path = e.get("path") or ""
        directory = e.get("directory") or os.path.dirname(path)
        if directory not in moved:
            moved[directory] = _relocated(directory, run_dir)
        if moved[directory] != directory:
            path = os.path.join(moved[directory], os.path.basename(path)) if path else path
            directory = moved[directory]
        if directory not in best:
            try:
                with open(os.path.join(directory, "best", "best.json"), encoding="utf-8") as f:
                    best[directory] = {f"ckpt-{b['number']}": b for b in json.load(f)}
            except (OSError, ValueError, TypeError, KeyError):
                best[directory] = {}
            states[directory] = _state_file_entries(directory)
        on_disk, size = _checkpoint_files(path) if path else (False, None)
        listed = states[directory]
        usable = on_disk and (listed is None or os.path.basename(path) in listed)
        b = best[directory].get(os.path.basename(path))
        rows.append({"step": e.get("step"), "epoch": e.get("epoch"), "step_in_epoch": e.get("step_in_epoch"),
                     "blocked_s": e.get("blocked_s"), "async_save": bool(e.get("async_save")),
                     "preemption": bool(e.get("preemption")), "path": path, "on_disk": on_disk, "bytes": size,
                     "usable": usable, "best": None if b is None else {"monitor": b.get("monitor"),
                                                                       "value": b.get("value")},
                     "time": e.get("time")})
    usable_rows = [r for r in rows if r["usable"]]
    newest = max(usable_rows, key=lambda r: (r["step"] or -1, r["time"] or 0.0))["path"] if usable_rows else None
    return {"saves": rows, "newest_usable": newest,
            "blocked_s_total": sum(r["blocked_s"] or 0.0 for r in rows)}


def _profiles(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    keep = ("step", "capture_dir", "hardware_type", "step_numbers", "step_time_ms", "input_percent",
            "compute_percent", "launch_percent", "other_percent", "verdict", "verdict_line", "fix", "time")
    return [{k: e.get(k) for k in keep} for e in events if e["kind"] == "profile"]


ScalarReader = Callable[[Callable[[str, str], bool]], Dict[str, Dict[str, List[Tuple[int, float]]]]]


def _loss(events: List[Dict[str, Any]], scalars: Dict[str, Dict[str, List[Tuple[int, float]]]],
          max_points: int) -> Dict[str, Any]:
    series: Dict[str, List[Tuple[float, float]]] = {}
    per_step = []
    for run, tags in sorted(scalars.items()):
        for tag in _LOSS_TAGS:
            if tag in tags:
                per_step.extend(tags[tag])
    if per_step:
        per_step.sort()
        series["batch_loss"] = downsample(per_step, max_points)
    epoch_loss, epoch_val = [], []
    for e in events:
        if e["kind"] != "epoch" or not isinstance(e.get("step"), int):
            continue
        logs = e.get("logs") or {}
        if logs.get("loss") is not None:
            epoch_loss.append((e["step"], logs["loss"]))
        if logs.get("val_loss") is not None:
            epoch_val.append((e["step"], logs["val_loss"]))
    if epoch_loss:
        series["loss (epoch mean)"] = downsample(epoch_loss, max_points)
    if epoch_val:
        series["val_loss"] = downsample(epoch_val, max_points)
    return series


def _gpu(events: List[Dict[str, Any]], scalars: Dict[str, Dict[str, List[Tuple[int, float]]]],
         max_points: int) -> Dict[str, Any]:
    lanes: Dict[int, Dict[str, List[Tuple[float, float]]]] = {}
    for run, tags in sorted(scalars.items()):
        for tag, points in sorted(tags.items()):
            m = _GPU_TAG.match(tag)
            if not m:
                continue
            gpu, quantity = int(m.group(1)), m.group(2)
            for label, pattern in _GPU_LANES:
                if pattern.match(quantity) and label not in lanes.setdefault(gpu, {}):
                    lanes[gpu][label] = downsample(sorted(points), max_points)
    advice = {}
    for e in events:
        if e["kind"] == "gpu_advice":
            advice[(e.get("advice"), e.get("gpu"))] = {"advice": e.get("advice"), "gpu": e.get("gpu"),
                                                       "message": e.get("message"), "epoch": e.get("epoch"),
                                                       "step": e.get("step")}
    reasons = [e.get("reason") for e in events if e["kind"] == "gpu_unavailable"]
    return {"lanes": {str(g): v for g, v in sorted(lanes.items()) if v}, "advice": list(advice.values()),
            "unavailable": reasons[-1] if reasons else None}


def run_detail(name: str, run_dir: str, read_scalars: Optional[ScalarReader] = None,
               max_points: int = MAX_POINTS) -> Dict[str, Any]:
    """Everything the run's page draws: goodput per epoch and totals, loss series with every incident, GPU lanes,
    checkpoints, profiler verdicts. ``read_scalars(wanted)`` returns ``{tb_run: {tag: [(step, value)]}}`` of the
    TensorBoard runs inside ``run_dir`` whose tags ``wanted(tb_run, tag)`` accepts (the plugin passes its data
    provider's).

    Example:
        >>> run_detail("exp", "/nonexistent")["incidents"]
        []
    """
    started = time.perf_counter()
    events = read_run_events(run_dir)

    def wanted(tb_run: str, tag: str) -> bool:
        return tag in _LOSS_TAGS or bool(_GPU_TAG.match(tag))

    scalars = read_scalars(wanted) if read_scalars is not None else {}
    epochs = []
    for e in events:
        if e["kind"] == "epoch" and isinstance(e.get("goodput"), dict):
            row = _goodput_row(e["goodput"])
            row.update({"epoch": e.get("epoch"), "step": e.get("step"), "pid": e.get("pid")})
            epochs.append(row)
    saves = _checkpoints(events, run_dir)
    loss = _loss(events, scalars, max_points)
    detail = {
        "run": name,
        "categories": list(CATEGORIES),
        "summary": run_summary(name, run_dir, events),
        "epochs": epochs,
        "loss": loss,
        "loss_notes": {k: v for k, v in LOSS_NOTES.items() if k in loss},
        "incidents": _incidents(events),
        "checkpoints": saves,
        "profiles": _profiles(events),
        "gpu": _gpu(events, scalars, max_points),
    }
    detail["elapsed_s"] = time.perf_counter() - started
    return detail
