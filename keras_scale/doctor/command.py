"""``keras-scale doctor`` on the command line: the text table, the exit code, progress lines on stderr."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import textwrap
import time
from typing import Any, Dict, Optional, Sequence

from keras_scale.doctor.checks import report
from keras_scale.doctor.facts import STATUSES
from keras_scale.doctor.gather import gather_facts
from keras_scale.doctor.versions import _TF_DISTS

_MARK = {"ok": "ok", "warn": "WARN", "error": "ERROR", "skip": "skip"}


def _version_text(rep: Dict[str, Any], name: str) -> str:
    probed = rep.get(name)
    if probed:
        return probed
    installed = rep.get("installed") or {}
    have = next((installed[d] for d in ((name,) + (_TF_DISTS if name == "tensorflow" else ())) if d in installed), None)
    if not rep.get("tensorflow_probed", True):
        return f"{have} (not probed)" if have else "not probed"
    return "not installed" if have is None else f"{have} (fails to start)"


def format_report(rep: Dict[str, Any], width: Optional[int] = None) -> str:
    """The human-readable table of a :func:`doctor` report, wrapped to ``width`` (default: the terminal's).

    Example:
        print(format_report(ks.doctor(probe_tensorflow=False), width=100))
    """
    width = max(40, width or shutil.get_terminal_size((100, 24)).columns)
    lines = ["keras-scale doctor", ""]
    head = (f"python {rep['python']}   tensorflow {_version_text(rep, 'tensorflow')}   "
            f"keras {_version_text(rep, 'keras')}")
    lines.extend("  " + ln for ln in textwrap.wrap(head, width - 2))
    if rep["gpus"]:
        lines.append(f"  NVIDIA driver {rep['nvidia_driver']}")
        for g in rep["gpus"]:
            lines.append(f"  GPU {g['index']}: {g['name']}, {g['memory_total_mb']:.0f} MiB"
                         + ("" if g["visible"] else "  (hidden by CUDA_VISIBLE_DEVICES)"))
    else:
        why = next((c["detail"] for c in rep["checks"] if c["name"] == "nvidia_driver"), "")
        text = "GPUs: none. " + (why if why.startswith("No GPU") else "No GPU present. " + why).strip()
        lines.extend("  " + ln for ln in textwrap.wrap(text, width - 2, subsequent_indent="  "))
    lines.append("")
    name_w = max(len(c["name"]) for c in rep["checks"]) + 2
    narrow = width - 10 - name_w < 30  # no room for a detail column: details go under each check, indented
    detail_w = width - 6 if narrow else width - 10 - name_w
    pad = " " * (6 if narrow else 10 + name_w)
    lines.append((f"  {'status':<6}  {'check':<{name_w}}" + ("" if narrow else "detail")).rstrip())
    lines.append(f"  {'-' * 6}  {'-' * (name_w - 2)}" + ("" if narrow else f"  {'-' * min(detail_w, 60)}"))
    for c in rep["checks"]:
        body = textwrap.wrap(c["detail"], detail_w, break_on_hyphens=False) or [""]
        if narrow:
            lines.append(f"  {_MARK[c['status']]:<6}  {c['name']}")
            lines.extend(pad + b for b in body)
        else:
            lines.append(f"  {_MARK[c['status']]:<6}  {c['name']:<{name_w}}{body[0]}")
            lines.extend(pad + b for b in body[1:])
        if c["fix"]:
            lines.extend(pad + b for b in textwrap.wrap("fix: " + c["fix"], detail_w, break_on_hyphens=False))
    counts = {s: sum(1 for c in rep["checks"] if c["status"] == s) for s in STATUSES}
    lines.append("")
    summary = f"{counts['error']} error(s), {counts['warn']} warning(s), {counts['ok']} ok, {counts['skip']} skipped"
    lines.extend("  " + ln for ln in textwrap.wrap(summary, width - 2))
    return "\n".join(lines)


def exit_code(rep: Dict[str, Any], strict: bool = False) -> int:
    """1 when any check is ``error`` (or, with ``strict``, ``warn``), else 0.

    Example:
        >>> exit_code({"checks": [{"status": "warn"}, {"status": "ok"}]})
        0
        >>> exit_code({"checks": [{"status": "warn"}]}, strict=True)
        1
    """
    failing = ("error", "warn") if strict else ("error",)
    return 1 if any(c["status"] in failing for c in rep["checks"]) else 0


class _Progress:
    """Progress lines on stderr: rewritten in place on a terminal, one line each otherwise; timed."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.shown = False

    def __call__(self, msg: str) -> None:
        text = f"keras-scale doctor [{time.perf_counter() - self.t0:4.1f} s]: {msg}"
        if self.tty:
            cols = shutil.get_terminal_size((100, 24)).columns
            self.stream.write("\r\033[K" + text[:cols - 1])
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


def cli(argv: Sequence[str]) -> int:
    """``keras-scale doctor [--json] [--strict] [--no-tensorflow] [--path P ...] [--quiet]``.

    Prints the report (progress on stderr while it runs); exit code 1 when a check says ``error``, or with
    ``--strict`` also ``warn`` (for CI).

    Example:
        $ keras-scale doctor --json | python -c "import json,sys; print(json.load(sys.stdin)['gpus'])"
    """
    parser = argparse.ArgumentParser(prog="keras-scale doctor",
                                     description="Check what breaks or slows training here: drivers and CUDA, GPU "
                                                 "state, the host (CPU, RAM, NUMA, storage, /dev/shm), env variables.")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--strict", action="store_true", help="exit with 1 on warnings too (for CI)")
    parser.add_argument("--no-tensorflow", action="store_true",
                        help="skip the TensorFlow probe (only NVML, host and environment checks)")
    parser.add_argument("--path", action="append", default=[], metavar="P",
                        help="data or checkpoint path whose storage to check (repeatable; default: the working "
                             "directory)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress messages on stderr")
    args = parser.parse_args(list(argv))
    progress = _Progress()
    rep = report(gather_facts(probe_tensorflow=not args.no_tensorflow, paths=args.path,  # what doctor() returns
                              progress=(lambda msg: None) if args.quiet else progress))
    progress.done()
    try:
        if args.json:
            print(json.dumps(rep, indent=2))  # machine-readable: as it is
        else:
            from keras_scale.output import say

            say(format_report(rep))
        sys.stdout.flush()
    except BrokenPipeError:  # `keras-scale doctor | head`: the reader has what it wanted; no traceback
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the flush at exit does not raise again
        except (OSError, ValueError, AttributeError):
            pass
    return exit_code(rep, strict=args.strict)
