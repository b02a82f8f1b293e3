"""``keras-scale launch --max-restarts``: a worker that raises the same error at every start is a bug in the script,
not a lost machine: the launcher stops after the second identical failure with that error, without dropping
workers; a failure that differs (or comes after a step) is restarted as before."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keras_scale.launch import WorkerResult, _deterministic, exception_text

REPO_ROOT = str(Path(__file__).resolve().parents[1])

# No TensorFlow: each attempt takes a fraction of a second. Worker 0 writes a "begin" heartbeat as keras_scale.fit
# does before its first step (so the launcher knows the failures come before any step), then both raise.
BUGGY = r'''
import json, os, sys, time
from keras_scale.heartbeat_file import write_beat
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
attempt_file = f"attempts_{index}"
n = int(open(attempt_file).read()) + 1 if os.path.exists(attempt_file) else 1
open(attempt_file, "w").write(str(n))
write_beat("begin", 0)
if sys.argv[1] == "varying":
    raise ConnectionError(f"peer 127.0.0.1:{20000 + n} unreachable")  # differs every attempt: a machine issue
raise ValueError("learning_rate must be > 0, got -0.1")
'''


def _launch(tmp_path, mode, *extra):
    script = tmp_path / "buggy.py"
    script.write_text(BUGGY)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "keras_scale", "launch", "--workers", "2", "--grace-s", "2", "--backoff-s", "0.1",
           "--run-dir", str(tmp_path / "run"), *extra, "--", sys.executable, str(script), mode]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    log = tmp_path / "run" / "restarts.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, records


@pytest.mark.slow
def test_the_same_error_at_every_start_stops_the_launcher_at_once_with_that_error(tmp_path):
    proc, records = _launch(tmp_path, "same", "--max-restarts", "5", "--min-workers", "1")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert int((tmp_path / "attempts_0").read_text()) == 2  # the first failure is restarted; the identical second ends it
    assert "raised the same error at 2 starts in a row" in proc.stderr, proc.stderr[-3000:]
    assert "ValueError: learning_rate must be > 0, got -0.1" in proc.stderr
    assert "kept failing at start" not in proc.stderr  # no worker dropped as a lost machine
    restarts = [r for r in records if r["event"] == "restart"]
    assert [r["num_workers_next"] for r in restarts] == [2]
    assert records[-1]["event"] == "gave_up" and records[-1]["error"] == "ValueError: learning_rate must be > 0, got -0.1"


@pytest.mark.slow
def test_errors_that_differ_between_starts_are_restarted_as_before(tmp_path):
    proc, records = _launch(tmp_path, "varying", "--max-restarts", "2")
    assert proc.returncode == 1
    assert int((tmp_path / "attempts_0").read_text()) == 3  # every restart used
    assert "same error" not in proc.stderr and "2 restarts used: giving up" in proc.stderr


class _Watch:
    def __init__(self, progressed):
        self.progressed = progressed


def _result(code, text, index=0):
    return WorkerResult(index, code, "", f"Traceback (most recent call last):\n  File \"x.py\", line 3\n    f()\n{text}\n"
                        if text else "")


def test_what_counts_as_the_same_failure_before_a_step():
    bug = "ValueError: bad shape (3, 4)"
    texts, same = _deterministic([_result(1, bug)], _Watch([False]), None)
    assert texts == {bug} and same is None  # one failure proves nothing
    assert _deterministic([_result(1, bug)], _Watch([False]), frozenset([bug]))[1] == bug
    # the same bug, first seen on worker 1, now on worker 0 (which of them fails first varies)
    assert _deterministic([_result(1, bug, 0), _result(-9, None, 1)], _Watch([False, False]), frozenset([bug]))[1] == bug
    assert _deterministic([_result(1, bug)], _Watch([True]), frozenset([bug])) == (None, None)  # a step was made
    assert _deterministic([_result(1, "ValueError: other")], _Watch([False]), frozenset([bug]))[1] is None
    assert _deterministic([_result(-9, None)], _Watch([False]), frozenset([bug]))[1] is None  # SIGKILL: lost machine
    assert _deterministic([_result(42, bug)], _Watch([False]), frozenset([bug]))[1] is None  # preempted
    assert _deterministic([_result(3, None)], _Watch([False]), frozenset([bug])) == (None, None)  # no traceback
    assert exception_text("Traceback (most recent call last):\n  File \"a\", line 1\n    x\nKeyError: 'k'\n"
                          "\nDuring handling of the above exception, another exception occurred:\n\n"
                          "Traceback (most recent call last):\n  File \"a\", line 2\n    y\nRuntimeError: wrapped\n"
                          ) == "RuntimeError: wrapped"
