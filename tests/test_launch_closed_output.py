"""``keras-scale launch ... | head`` ends like any Unix tool when its reader goes away: no BrokenPipeError traceback,
the workers stopped (not left blocked on full pipes), exit status 128 + SIGPIPE; and ``keras-scale`` without a
command is a usage error (usage on stderr, exit 2)."""
import os
import signal
import subprocess
import sys

from tests.conftest import REPO_ROOT

ENV = dict(os.environ, PYTHONPATH=REPO_ROOT)


def _launch_read_three_lines_and_close(stderr):
    """``keras-scale launch`` of two workers printing numbers without end, read like ``| head -3``: three lines,
    then stdout closed. Returns the lines, the launcher's exit status and the process (``stderr`` as given)."""
    endless = "import itertools\nfor i in itertools.count(): print(i, flush=True)"
    launch = subprocess.Popen([sys.executable, "-m", "keras_scale", "launch", "--workers", "2", "--", sys.executable,
                               "-c", endless], stdout=subprocess.PIPE, stderr=stderr, env=ENV, cwd=REPO_ROOT)
    first = [launch.stdout.readline() for _ in range(3)]
    launch.stdout.close()
    try:
        status = launch.wait(timeout=60)
    finally:
        if launch.poll() is None:
            launch.kill()
    return first, status, launch


def test_a_reader_that_stops_early_ends_the_launch_quietly():
    first, status, launch = _launch_read_three_lines_and_close(subprocess.PIPE)
    stderr = launch.stderr.read().decode()
    assert all(line.startswith(b"[worker ") for line in first), first
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert status == 128 + signal.SIGPIPE, (status, stderr)


def test_a_reader_of_stdout_and_stderr_together_that_stops_early_ends_the_launch_with_sigpipe_status():
    # `keras-scale launch ... 2>&1 | head -3`: stderr is the same closed pipe, so the launcher's closing line must not
    # hit it (it did: exit status 1 instead of 128 + SIGPIPE)
    first, status, _ = _launch_read_three_lines_and_close(subprocess.STDOUT)
    assert all(line.startswith(b"[worker ") for line in first), first
    assert status == 128 + signal.SIGPIPE, status


def test_keras_scale_without_a_command_prints_its_usage_and_exits_2():
    out = subprocess.run([sys.executable, "-m", "keras_scale"], capture_output=True, text=True, env=ENV,
                         cwd=REPO_ROOT, timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith("usage: keras-scale") and "commands:" in out.stderr
