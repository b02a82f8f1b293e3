"""Run a command as N local workers of a ``MultiWorkerMirroredStrategy`` cluster on 127.0.0.1.

Each worker gets ``TF_CONFIG`` with free loopback ports and runs in its own process group. Nothing is left behind:

- a worker that exits non-zero gives the others ``grace_s`` to stop by themselves (a collective never hangs
  silently), then they are killed;
- SIGTERM or SIGINT to the launcher (``kill``, Ctrl-C, Slurm, Kubernetes) is forwarded to every worker, which then
  has ``grace_s`` to save and exit (``ChiefCheckpoint`` saves on SIGTERM) before SIGKILL; a second signal kills at
  once;
- there is no time limit unless ``timeout_s`` is given (then SIGTERM, ``grace_s``, SIGKILL).

Example:
    >>> from keras_scale.launch import launch_local_workers
    >>> results = launch_local_workers(["python", "train.py"], num_workers=2)      # doctest: +SKIP
    >>> [r.returncode for r in results]                                             # doctest: +SKIP
    [0, 0]

Command line: ``keras-scale launch --workers 2 -- python train.py --epochs 3`` streams each worker's output live,
each line prefixed with ``[worker i]`` (stdout to stdout, stderr to stderr). Its exit status:

- ``0``: every worker exited 0;
- ``128 + signal`` (143 for SIGTERM, 130 for SIGINT): the launcher was signalled (and forwarded the signal),
  whatever the workers then returned;
- ``124``: ``--timeout-s`` ran out;
- otherwise the exit status of the first worker that failed (``128 + N`` for a worker killed by signal N).
"""
from __future__ import annotations

import argparse
import codecs
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any, Dict, List, Optional, Sequence

EXIT_TIMEOUT = 124
MAX_OUTPUT_CHARS = 10_000_000  # per worker and stream: the captured tail kept in WorkerResult


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
    """Exit status and captured output (the last ``MAX_OUTPUT_CHARS`` characters) of one worker.

    ``returncode`` is negative for a worker ended by a signal (``-9``: killed); ``signal_forwarded`` is the signal
    the launcher forwarded to it (SIGTERM/SIGINT it received), if any.

    Example:
        >>> WorkerResult(0, 0, "done", "").ok
        True
    """

    index: int
    returncode: Optional[int]
    stdout: str
    stderr: str
    timed_out: bool = False
    signal_forwarded: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and self.signal_forwarded is None


class WorkersFailed(RuntimeError):
    """Raised by :func:`launch_local_workers` with ``check=True`` when a worker failed."""


class _Pump(threading.Thread):
    """Reads one pipe of one worker as it comes: keeps its tail, and optionally echoes it with a line prefix."""

    def __init__(self, pipe: IO[bytes], prefix: str, sink: Optional[IO[str]], lock: threading.Lock) -> None:
        super().__init__(daemon=True)
        self.pipe, self.prefix, self.sink, self.lock = pipe, prefix, sink, lock
        self.chunks: List[str] = []
        self.size = 0

    def run(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        partial = ""  # the start of a line not complete yet: held back so lines of two workers never mix
        while True:
            data = self.pipe.read1(65536) if hasattr(self.pipe, "read1") else self.pipe.read(65536)
            text = decoder.decode(data, final=not data)
            self._keep(text)
            if self.sink is not None:
                lines = (partial + text).splitlines(keepends=True)  # "\r" progress-bar updates are lines too
                partial = lines.pop() if lines and not lines[-1].endswith(("\n", "\r")) else ""
                if not data and partial:
                    lines.append(partial + "\n")
                if lines:
                    with self.lock:
                        self.sink.write("".join(self.prefix + line for line in lines))
                        self.sink.flush()
            if not data:
                break
        self.pipe.close()

    def _keep(self, text: str) -> None:
        self.chunks.append(text)
        self.size += len(text)
        if self.size > 2 * MAX_OUTPUT_CHARS:
            joined = "".join(self.chunks)[-MAX_OUTPUT_CHARS:]
            self.chunks, self.size = [joined], len(joined)

    def text(self) -> str:
        return "".join(self.chunks)[-MAX_OUTPUT_CHARS:]


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    # the whole process group (its own session), even when the direct child is gone: a wrapper such as
    # `bash -c "python train.py"` may have exited while its Python child lives on
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_all(procs: Sequence[subprocess.Popen], until: float, stop: Optional[threading.Event] = None) -> bool:
    """Wait until every process exited (True) or ``until`` (monotonic) passed / ``stop`` was set (False)."""
    while any(p.poll() is None for p in procs):
        if time.monotonic() > until or (stop is not None and stop.is_set()):
            return False
        time.sleep(0.05)
    return True


def launch_local_workers(
    argv: Sequence[str],
    num_workers: int = 2,
    timeout_s: Optional[float] = None,
    grace_s: float = 30.0,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[str] = None,
    check: bool = False,
    stream: bool = False,
    forward_signals: bool = True,
    reraise_signal: bool = True,
) -> List[WorkerResult]:
    """Start ``argv`` ``num_workers`` times with a loopback ``TF_CONFIG`` each; wait; return their results.

    Args:
        argv: the command each worker runs, e.g. ``[sys.executable, "train.py"]``.
        num_workers: how many worker processes.
        timeout_s: stop everything after this many seconds (SIGTERM, ``grace_s``, SIGKILL); ``None``: no limit.
        grace_s: how long workers may still run after one of them failed, after a forwarded signal or after the
            timeout, before SIGKILL.
        env: extra environment variables for every worker (``TF_CONFIG`` is set per worker;
            ``PYTHONUNBUFFERED=1`` unless given, so output arrives as it is printed).
        cwd: working directory of the workers.
        check: raise :class:`WorkersFailed` (with each worker's output tail) when any worker failed.
        stream: echo each worker's output live, each line prefixed ``[worker i] `` (stdout to ``sys.stdout``,
            stderr to ``sys.stderr``); it is captured either way.
        forward_signals: while running (in the main thread), forward SIGTERM/SIGINT received by this process to
            every worker, wait ``grace_s``, then SIGKILL; a second signal kills at once. The handlers are
            restored on return.
        reraise_signal: once the workers are gone, deliver the received signal again to this process's own
            handler (Ctrl-C then raises ``KeyboardInterrupt``, SIGTERM ends the process as it would have);
            ``False`` returns the results instead (their ``signal_forwarded`` says which signal).

    Example:
        >>> launch_local_workers([sys.executable, "-c", "print('hi')"], num_workers=2)[0].stdout
        'hi\\n'
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds or None (no limit), got {timeout_s!r}")
    if not grace_s >= 0:
        raise ValueError(f"grace_s must be >= 0 seconds, got {grace_s!r}")
    ports = free_ports(num_workers)
    procs: List[subprocess.Popen] = []
    pumps: List[_Pump] = []
    lock = threading.Lock()
    received: List[int] = []  # signals this process received while the workers ran
    second_signal = threading.Event()
    alive_at_deadline: List[bool] = []

    def on_signal(signum: int, frame: Any) -> None:
        if received:
            second_signal.set()
            for p in procs:
                _signal_group(p, signal.SIGKILL)
        received.append(signum)
        for p in procs:
            _signal_group(p, signum)

    previous: Dict[int, Any] = {}
    if forward_signals and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, on_signal)
    try:
        for i in range(num_workers):
            worker_env = dict(os.environ)
            worker_env.setdefault("PYTHONUNBUFFERED", "1")
            worker_env.update(env or {})
            worker_env["TF_CONFIG"] = json.dumps(make_tf_config(ports, i))
            proc = subprocess.Popen(list(argv), env=worker_env, cwd=cwd, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append(proc)
            for pipe, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                pump = _Pump(pipe, f"[worker {i}] ", sink if stream else None, lock)
                pump.start()
                pumps.append(pump)
            if received:  # a signal arrived while starting: forward it to this one too
                _signal_group(proc, received[0])
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        first_failure: Optional[float] = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if received:
                _wait_all(procs, now + grace_s, second_signal)
                break
            if deadline is not None and now > deadline:
                alive_at_deadline = [p.poll() is None for p in procs]
                for p in procs:
                    _signal_group(p, signal.SIGTERM)
                _wait_all(procs, now + grace_s)
                break
            if first_failure is None and any(p.poll() not in (None, 0) for p in procs):
                first_failure = now
            if first_failure is not None and now > first_failure + grace_s:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            _signal_group(p, signal.SIGKILL)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pump in pumps:
            pump.join(timeout=10)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received and reraise_signal and previous:
        signal.raise_signal(received[0])  # the workers are gone: now this process reacts as it would have
    forwarded = received[0] if received else None
    results = [WorkerResult(i, p.returncode, pumps[2 * i].text(), pumps[2 * i + 1].text(),
                            bool(alive_at_deadline) and alive_at_deadline[i], forwarded)
               for i, p in enumerate(procs)]
    if check and not all(r.ok for r in results):
        detail = "\n".join(
            f"--- worker {r.index}: returncode={r.returncode} timed_out={r.timed_out}\n{r.stderr[-3000:]}"
            for r in results
        )
        raise WorkersFailed(f"{sum(not r.ok for r in results)} of {num_workers} workers failed:\n{detail}")
    return results


def exit_status(results: Sequence[WorkerResult]) -> int:
    """The launcher's exit status for ``results`` (see the module docstring).

    Example:
        >>> exit_status([WorkerResult(0, 0, "", ""), WorkerResult(1, -9, "", "")])
        137
    """
    for r in results:
        if r.signal_forwarded is not None:
            return 128 + r.signal_forwarded
    if any(r.timed_out for r in results):
        return EXIT_TIMEOUT
    for r in results:
        if r.returncode:
            return r.returncode if r.returncode > 0 else 128 - r.returncode
    return 0 if all(r.returncode == 0 for r in results) else 1


def cli(argv: Sequence[str]) -> int:
    """``keras-scale launch --workers N [--timeout-s S] [--grace-s G] -- CMD ...``: run CMD as N local workers.

    Example:
        $ keras-scale launch --workers 2 -- python examples/multi_worker.py
    """
    parser = argparse.ArgumentParser(
        prog="keras-scale launch",
        description="Run CMD as N local MultiWorkerMirroredStrategy workers on 127.0.0.1 (TF_CONFIG set for "
                    "each), streaming their output with a [worker i] prefix. SIGTERM/SIGINT are forwarded to the "
                    "workers. Exit status: 0 all workers ok; 128+signal when signalled; 124 on --timeout-s; "
                    "else the first failing worker's status.")
    parser.add_argument("--workers", type=int, default=2, help="number of worker processes (default 2)")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="stop the workers after this many seconds (default: no limit)")
    parser.add_argument("--grace-s", type=float, default=30.0,
                        help="seconds the workers get to exit after a signal, a failed worker or the timeout, "
                             "before SIGKILL (default 30)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS ...]")
    args = parser.parse_args(list(argv))
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run, e.g. `keras-scale launch --workers 2 -- python train.py`")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.timeout_s is not None and args.timeout_s <= 0:
        parser.error(f"--timeout-s must be > 0, got {args.timeout_s}")
    if args.grace_s < 0:
        parser.error(f"--grace-s must be >= 0, got {args.grace_s}")
    import shutil

    if os.sep not in command[0] and shutil.which(command[0]) is None or os.sep in command[0] and not os.access(
            command[0], os.X_OK):
        parser.error(f"cannot run {command[0]!r}: not found or not executable (give the command to run on each "
                     "worker, e.g. `-- python train.py`)")
    results = launch_local_workers(command, num_workers=args.workers, timeout_s=args.timeout_s,
                                   grace_s=args.grace_s, stream=True, reraise_signal=False)
    status = exit_status(results)
    summary = ", ".join(f"worker {r.index}: exit {r.returncode}{' (timed out)' if r.timed_out else ''}"
                        for r in results)
    print(f"keras-scale launch: {summary}; exit status {status}", file=sys.stderr, flush=True)
    return status
