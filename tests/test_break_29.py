"""Break tests of "survive a lost worker" (issue 29), written by a tester as a user would hit them; TF-free fake
workers where the launcher's own logic is what is tested."""
import os
import signal
import sys
import threading
import time

import pytest

from keras_scale.launch import launch_with_restarts

CRASHES = r'''
import os, sys, time
index = __import__("json").loads(os.environ["TF_CONFIG"])["task"]["index"]
open(f"attempt_{index}_{os.getpid()}", "w").close()
time.sleep(0.2)
if index == 1:
    raise RuntimeError("boom in epoch 1")
'''


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_restart_backoff_ends_the_run_cleanly_without_restarting(tmp_path, signum):
    # before: SIGTERM in the backoff killed the launcher outright (no summary, its temporary run dir left behind)
    # and Ctrl-C raised KeyboardInterrupt out of time.sleep with a traceback
    script = tmp_path / "w.py"
    script.write_text(CRASHES)
    lines = []

    def say(line):
        lines.append(line)
        if "restart 1 of" in line:  # the backoff (30 s) starts now
            threading.Timer(0.3, os.kill, (os.getpid(), signum)).start()

    started = time.monotonic()
    outcome = launch_with_restarts([sys.executable, str(script)], num_workers=2, max_restarts=3, backoff_s=30,
                                   grace_s=1, cwd=str(tmp_path), say=say, reraise_signal=False, timeout_s=120)
    assert time.monotonic() - started < 25  # did not sit out the backoff
    assert outcome.status == 128 + signum and len(outcome.restarts) == 1
    assert "received during the restart backoff: not restarting" in lines[-1]
    assert len([f for f in os.listdir(tmp_path) if f.startswith("attempt_")]) == 2  # no second attempt
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are given back
