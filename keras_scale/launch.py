"""Run a script as N local workers of a ``MultiWorkerMirroredStrategy`` cluster on 127.0.0.1.

Each worker gets ``TF_CONFIG`` with free loopback ports. If a worker dies, the others are killed after
``grace_s`` so a collective never hangs silently; all processes are always cleaned up.

Example:
    >>> from keras_scale.launch import launch_local_workers
    >>> results = launch_local_workers(["python", "train.py"], num_workers=2, timeout_s=600)
    >>> [r.returncode for r in results]
    [0, 0]

Command line: ``keras-scale launch --workers 2 -- python train.py --epochs 3``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence


def free_ports(num_ports: int) -> List[int]:
    """``num_ports`` distinct TCP ports free on 127.0.0.1 right now.

    Example:
        >>> len(free_ports(2))
        2
    """
    sockets, ports = [], []
    try:
        for _ in range(num_ports):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def make_tf_config(ports: Sequence[int], index: int) -> Dict:
    """The ``TF_CONFIG`` dict for worker ``index`` of a loopback cluster on ``ports``.

    Example:
        >>> make_tf_config([2222, 2223], 1)["task"]
        {'type': 'worker', 'index': 1}
    """
    return {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}


@dataclass
class WorkerResult:
    """Exit status and captured output of one worker.

    Example:
        >>> WorkerResult(0, 0, "done", "").ok
        True
    """

    index: int
    returncode: Optional[int]
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class WorkersFailed(RuntimeError):
    """Raised by :func:`launch_local_workers` with ``check=True`` when a worker failed."""


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def launch_local_workers(
    argv: Sequence[str],
    num_workers: int = 2,
    timeout_s: float = 600.0,
    grace_s: float = 30.0,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[str] = None,
    check: bool = False,
) -> List[WorkerResult]:
    """Start ``argv`` ``num_workers`` times with a loopback ``TF_CONFIG`` each; wait; return their results.

    Args:
        argv: the command each worker runs, e.g. ``[sys.executable, "train.py"]``.
        num_workers: how many worker processes.
        timeout_s: kill everything after this many seconds.
        grace_s: after one worker exits non-zero, how long the others may still run before being killed.
        env: extra environment variables for every worker (``TF_CONFIG`` is set per worker).
        cwd: working directory of the workers.
        check: raise :class:`WorkersFailed` (with each worker's output tail) when any worker failed.

    Example:
        >>> launch_local_workers([sys.executable, "-c", "print('hi')"], num_workers=2)[0].stdout
        'hi\\n'
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    ports = free_ports(num_workers)
    procs: List[subprocess.Popen] = []
    outs, errs = [], []
    timed_out = [False] * num_workers
    try:
        for i in range(num_workers):
            worker_env = dict(os.environ)
            worker_env.update(env or {})
            worker_env["TF_CONFIG"] = json.dumps(make_tf_config(ports, i))
            out = tempfile.TemporaryFile(mode="w+")
            err = tempfile.TemporaryFile(mode="w+")
            outs.append(out)
            errs.append(err)
            procs.append(
                subprocess.Popen(
                    list(argv), env=worker_env, cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout_s
        first_failure: Optional[float] = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
                first_failure = now
            if now > deadline or (first_failure is not None and now > first_failure + grace_s):
                for i, p in enumerate(procs):
                    if p.poll() is None:
                        timed_out[i] = now > deadline
                        _kill(p)
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            _kill(p)
    results = []
    for i, p in enumerate(procs):
        outs[i].seek(0)
        errs[i].seek(0)
        results.append(WorkerResult(i, p.returncode, outs[i].read(), errs[i].read(), timed_out[i]))
        outs[i].close()
        errs[i].close()
    if check and not all(r.ok for r in results):
        detail = "\n".join(
            f"--- worker {r.index}: returncode={r.returncode} timed_out={r.timed_out}\n{r.stderr[-3000:]}"
            for r in results
        )
        raise WorkersFailed(f"{sum(not r.ok for r in results)} of {num_workers} workers failed:\n{detail}")
    return results


def cli(argv: Sequence[str]) -> int:
    """``keras-scale launch --workers N [--timeout-s S] -- CMD ...``: run CMD as N local workers.

    Example:
        $ keras-scale launch --workers 2 -- python examples/multi_worker.py
    """
    parser = argparse.ArgumentParser(prog="keras-scale launch", description=cli.__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(list(argv))
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run, e.g. `keras-scale launch --workers 2 -- python train.py`")
    results = launch_local_workers(command, num_workers=args.workers, timeout_s=args.timeout_s)
    for r in results:
        sys.stdout.write(f"===== worker {r.index} (exit {r.returncode}{', timed out' if r.timed_out else ''})\n")
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
    return 0 if all(r.ok for r in results) else 1
