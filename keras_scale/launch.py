"""Run a command as N local workers of a ``MultiWorkerMirroredStrategy`` cluster on 127.0.0.1.

Each worker gets ``TF_CONFIG`` with free loopback ports and runs in its own process group. Nothing is left behind:

- a worker that exits non-zero gives the others ``grace_s`` to stop by themselves (a collective never hangs
  silently), then they are killed;
- SIGTERM or SIGINT to the launcher (``kill``, Ctrl-C, Slurm, Kubernetes) is forwarded to every worker, which then
  has ``grace_s`` to save and exit (``ChiefCheckpoint`` saves on SIGTERM) before SIGKILL; a repeated signal is
  not forwarded again (schedulers repeat them), a third kills at once;
- there is no time limit unless ``timeout_s`` is given (then SIGTERM, ``grace_s``, SIGKILL).

Example:
    >>> from keras_scale.launch import launch_local_workers
    >>> results = launch_local_workers(["python", "train.py"], num_workers=2)      # doctest: +SKIP
    >>> [r.returncode for r in results]                                             # doctest: +SKIP
    [0, 0]

Command line: ``keras-scale launch --workers 2 -- python train.py --epochs 3`` streams each worker's output live,
each line prefixed with ``[worker i]`` (stdout to stdout, stderr to stderr).

Restarts (:func:`launch_with_restarts`): ``--max-restarts K`` restarts every worker (fresh ports, after a short
backoff) when one exits non-zero, ``--heartbeat-timeout-s T`` also when one makes no step progress for ``T`` s,
``--min-workers M`` continues with fewer workers when one keeps failing at start; each restart is one console line
and one record in ``restarts.jsonl`` that ``keras_scale.Goodput`` counts (docs/fit.md, "When a worker dies").

Its exit status:

- ``0``: every worker exited 0;
- ``42``: the launcher was signalled (and forwarded the signal) and every worker then exited 42, i.e. saved its
  state after the signal (``ChiefCheckpoint``'s preemption status: a scheduler that requeues on 42 sees 42);
- ``128 + signal`` (143 for SIGTERM, 130 for SIGINT): the launcher was signalled (and forwarded the signal) and
  not every worker exited 42;
- ``124``: ``--timeout-s`` ran out;
- otherwise the exit status of the first worker that failed (``128 + N`` for a worker killed by signal N); with
  restarts, that of the last failure once the restarts are used up.
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
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple

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
    hung: bool = False  # killed by the launcher: its heartbeat showed no step progress for heartbeat_timeout_s
    stopped_by_launcher: bool = False  # still running when the launcher killed the workers (it did not fail itself)
    ended_s: Optional[float] = None  # seconds after the start at which the launcher saw it exit

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and self.signal_forwarded is None and not self.hung


class WorkersFailed(RuntimeError):
    """Raised by :func:`launch_local_workers` with ``check=True`` when a worker failed."""


class _Pump(threading.Thread):
    """Reads one pipe of one worker as it comes: keeps its tail, and optionally echoes it with a line prefix."""

    def __init__(self, pipe: IO[bytes], prefix: str, sink: Optional[IO[str]], lock: threading.Lock,
                 on_sink_closed: Optional[Callable[[], None]] = None) -> None:
        super().__init__(daemon=True)
        self.pipe, self.prefix, self.sink, self.lock = pipe, prefix, sink, lock
        self.on_sink_closed = on_sink_closed  # the reader of the sink went away (`keras-scale launch ... | head`)
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
                        try:
                            self.sink.write("".join(self.prefix + line for line in lines))
                            self.sink.flush()
                        except (BrokenPipeError, ValueError, OSError):  # the reader closed it: stop echoing,
                            self.sink = None                              # keep draining the worker's pipe
                            _silence(sys.stdout)
                            _silence(sys.stderr)
                            if self.on_sink_closed is not None:
                                self.on_sink_closed()
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


def _reader_gone(fd: int) -> bool:
    """``fd`` is a pipe whose reading end is closed (poll reports an error on it); False for files and terminals."""
    try:
        import select

        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _silence(stream: Any) -> None:
    """Point a closed output stream at /dev/null (its buffered text and later writes go nowhere, no
    ``BrokenPipeError`` at exit), as Python's documentation advises for a reader that stops early."""
    try:
        stream.flush()
        if not _reader_gone(stream.fileno()):  # (an empty buffer flushes fine into a pipe nobody reads: `2>&1 | head`)
            return  # still open
    except (BrokenPipeError, ValueError, OSError, AttributeError):
        pass
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


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


def _say_stderr(message: str) -> None:
    """The launcher's default ``say``: one line on stderr."""
    print(message, file=sys.stderr, flush=True)


#: ``--heartbeat-timeout-s``: say so when no worker has written a heartbeat this long (or the timeout, if longer)
#: after the start, since hang detection cannot work for such a run (start-up time is not a hang).
SILENT_HEARTBEAT_WARN_S = 120.0


class _HeartbeatWatch:
    """Reads the workers' heartbeat files (:mod:`keras_scale.callbacks.heartbeat`) while they run.

    A worker is *stale* once it wrote a step beat and then none for ``timeout_s`` seconds (a "begin" beat does not
    start the clock: the first step traces the train function; an "end" beat stops it: the script may do other
    work after ``fit``). ``on_first_progress(index, first_beat, begin_beat)`` is called once, at the first step beat
    of any worker.
    """

    def __init__(self, files: Sequence[str], timeout_s: Optional[float], on_first_progress: Any = None,
                 say: Any = None, said: Optional[set] = None) -> None:
        self.files = list(files)
        self.say = say if say is not None else _say_stderr
        self.timeout_s = timeout_s
        self.on_first_progress = on_first_progress
        self.latest: List[Optional[Dict[str, Any]]] = [None] * len(self.files)  # newest beat of each worker
        self.begin: List[Optional[Dict[str, Any]]] = [None] * len(self.files)
        self.progressed: List[bool] = [False] * len(self.files)  # wrote a step beat (made a step) in this attempt
        self._mtimes: List[Optional[float]] = [None] * len(self.files)
        self._first_done = False
        self._started = time.monotonic()
        self._said = said if said is not None else set()  # messages said once per launch (shared by attempts)
        for path in self.files:  # a beat of an earlier attempt must not count for this one
            try:
                os.remove(path)
            except OSError:
                pass

    def poll(self) -> List[int]:
        """Read changed files; return the indices of stale workers (empty without a timeout)."""
        from keras_scale.heartbeat_file import read_heartbeat

        for i, path in enumerate(self.files):
            try:
                mtime = os.stat(path).st_mtime
            except OSError:
                continue
            if mtime == self._mtimes[i]:
                continue
            beat = read_heartbeat(path)
            if beat is None:
                continue
            self._mtimes[i] = mtime
            self.latest[i] = beat
            if beat.get("phase") == "begin":
                self.begin[i] = beat
            elif beat.get("phase") == "step":
                self.progressed[i] = True
                if not self._first_done:
                    self._first_done = True
                    if self.on_first_progress is not None:
                        self.on_first_progress(i, beat, self.begin[i])
        if self.timeout_s is None:
            return []
        silent_s = max(self.timeout_s, SILENT_HEARTBEAT_WARN_S)  # (start-up: imports, data, building the model)
        if ("silent" not in self._said and all(b is None for b in self.latest)
                and time.monotonic() - self._started > silent_s):
            self._said.add("silent")  # (hang detection would otherwise be off without a word)
            self.say(f"keras-scale launch: --heartbeat-timeout-s {self.timeout_s:g} is set, but no worker has written "
                     f"a heartbeat in the {silent_s:g} s since it started; hang detection starts at a worker's first "
                     f"heartbeat. If the script trains with a plain model.fit, add "
                     f"keras_scale.callbacks.heartbeat.Heartbeat() to its callbacks (ks.fit adds it itself).")
        now = time.time()
        return [i for i, beat in enumerate(self.latest)
                if beat is not None and beat.get("phase") == "step" and now - float(beat["time"]) > self.timeout_s]

    def last_step(self) -> Optional[int]:
        steps = [int(b["step"]) for b in self.latest if b is not None and "step" in b]
        return max(steps) if steps else None

    def last_progress_unix(self) -> Optional[float]:
        times = [float(b["time"]) for b in self.latest if b is not None and b.get("phase") == "step"]
        return max(times) if times else None


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
    heartbeat: Optional[_HeartbeatWatch] = None,
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
            every worker, wait ``grace_s``, then SIGKILL; a second signal is ignored, a third kills at once. The
            handlers are restored on return.
        reraise_signal: once the workers are gone, deliver the received signal again to this process's own
            handler (Ctrl-C then raises ``KeyboardInterrupt``, SIGTERM ends the process as it would have);
            ``False`` returns the results instead (their ``signal_forwarded`` says which signal).
        heartbeat: used by :func:`launch_with_restarts`: worker ``i`` gets ``KERAS_SCALE_HEARTBEAT_FILE`` set to
            the watch's file ``i``; a worker whose heartbeat goes stale is SIGKILLed (``hung=True``) and counts as
            failed.

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
    hung: List[bool] = [False] * num_workers
    ended: List[Optional[float]] = [None] * num_workers
    started = time.monotonic()

    burst_s = [0.0, -1.0]  # [bursts of signals so far, monotonic time of the last signal]

    def on_signal(signum: int, frame: Any) -> None:
        now = time.monotonic()
        repeat = bool(received) and now - burst_s[1] < 1.0  # one signal sent by several senders (a cgroup, a wrapper)
        burst_s[1] = now
        received.append(signum)
        if repeat and burst_s[0] < 3:
            return
        burst_s[0] += 1
        if burst_s[0] == 2:  # a repeat (schedulers and wrappers repeat signals): the workers are saving already
            print(f"keras-scale launch: {_signal_name(signum)} again: the workers are still saving (a third signal "
                  "kills them at once)", file=sys.stderr, flush=True)
            return
        if burst_s[0] > 2:
            second_signal.set()
            for p in procs:
                _signal_group(p, signal.SIGKILL)
            return
        for p in procs:
            _signal_group(p, signum)

    def output_closed() -> None:
        # the reader of our output went away (`| head`): end the launch as a Unix tool ends on SIGPIPE (the workers
        # stopped like on a forwarded SIGTERM, exit status 128 + SIGPIPE, never restarted)
        if not received:
            received.append(signal.SIGPIPE)
            for p in procs:
                _signal_group(p, signal.SIGTERM)

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
            if heartbeat is not None:
                from keras_scale.heartbeat_file import HEARTBEAT_FILE_ENV

                worker_env[HEARTBEAT_FILE_ENV] = heartbeat.files[i]
            proc = subprocess.Popen(list(argv), env=worker_env, cwd=cwd, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append(proc)
            for pipe, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                pump = _Pump(pipe, f"[worker {i}] ", sink if stream else None, lock, output_closed)
                pump.start()
                pumps.append(pump)
            if received:  # a signal arrived while starting: forward it to this one too
                _signal_group(proc, received[0])
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        first_failure: Optional[float] = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = now - started
            if heartbeat is not None and first_failure is None and not received:
                for i in heartbeat.poll():
                    if procs[i].poll() is None:
                        hung[i] = True
                        _signal_group(procs[i], signal.SIGKILL)  # SIGKILL also ends a stopped (SIGSTOP) process
            if received:
                _wait_all(procs, now + grace_s, second_signal)
                break
            if deadline is not None and now > deadline:
                alive_at_deadline = [p.poll() is None for p in procs]
                for p in procs:
                    _signal_group(p, signal.SIGTERM)
                _wait_all(procs, now + grace_s)
                break
            if first_failure is None and (any(hung) or any(p.poll() not in (None, 0) for p in procs)):
                first_failure = now
            if first_failure is not None and now > first_failure + grace_s:
                break
            time.sleep(0.1)
    finally:
        alive_at_kill = [p.poll() is None for p in procs]
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
    end_s = time.monotonic() - started
    results = [WorkerResult(i, p.returncode, pumps[2 * i].text(), pumps[2 * i + 1].text(),
                            bool(alive_at_deadline) and alive_at_deadline[i], forwarded, hung[i],
                            alive_at_kill[i] and not hung[i], ended[i] if ended[i] is not None else end_s)
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
            if results and all(w.returncode == PREEMPTED_EXIT_CODE for w in results):
                return PREEMPTED_EXIT_CODE  # every worker saved after the forwarded signal: requeue, not a failure
            return 128 + r.signal_forwarded
    if any(r.timed_out for r in results):
        return EXIT_TIMEOUT
    for r in results:
        if r.returncode:
            return r.returncode if r.returncode > 0 else 128 - r.returncode
    return 0 if all(r.returncode == 0 for r in results) else 1


#: A worker index that fails before its first step this many attempts in a row is lost (``--min-workers``).
START_FAILURES_TO_DROP = 2
PREEMPTED_EXIT_CODE = 42  # ChiefCheckpoint's exit status after a SIGTERM/SIGUSR1 save (PREEMPTION_EXIT_CODE)


@dataclass
class Restart:
    """One restart of :func:`launch_with_restarts`: which workers failed, why, and what came next.

    Example:
        >>> Restart(1, 3, [1], "killed by SIGKILL", 137, 2, 2).line()
        'keras-scale launch: worker 1 killed by SIGKILL (exit 137); restart 1 of 3 with 2 workers'
    """

    restart: int
    max_restarts: int
    workers: List[int]
    reason: str
    status: int
    num_workers_before: int
    num_workers_next: int
    last_step: Optional[int] = None
    last_progress_unix: Optional[float] = None
    failed_at_unix: float = 0.0

    def line(self) -> str:
        who = ("worker " if len(self.workers) == 1 else "workers ") + ", ".join(map(str, self.workers))
        line = f"keras-scale launch: {who} {self.reason} (exit {self.status}); restart {self.restart} of " \
               f"{self.max_restarts} with {self.num_workers_next} workers"
        if self.num_workers_next < self.num_workers_before:
            line += f" (was {self.num_workers_before}: a worker kept failing at start)"
        return line


@dataclass
class LaunchOutcome:
    """What :func:`launch_with_restarts` did: the last attempt's results, the restarts, the exit status.

    Example:
        >>> LaunchOutcome([WorkerResult(0, 0, "", "")], [], 0).num_workers
        1
    """

    results: List[WorkerResult]
    restarts: List[Restart]
    status: int

    @property
    def num_workers(self) -> int:
        return len(self.results)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _failure(results: Sequence[WorkerResult], watch: _HeartbeatWatch, heartbeat_timeout_s: Optional[float],
             beats_seen: bool) -> Tuple[List[int], str, int, bool]:
    """``(failed worker indices, why, exit status, failed before its first step)`` of a failed attempt.

    "Before its first step" needs heartbeats: it is only claimed when some worker of this run wrote one (the
    script uses ``keras_scale.fit`` / ``choose_strategy`` or the ``Heartbeat`` callback)."""
    hung = [r for r in results if r.hung]
    if hung:
        return ([r.index for r in hung], f"made no step progress for {heartbeat_timeout_s:g} s (heartbeat: hung, "
                "killed)", 128 + signal.SIGKILL, False)
    failed = [r for r in results if r.returncode not in (0, None) and not r.stopped_by_launcher] or \
        [r for r in results if not r.ok]
    first = min(failed, key=lambda r: (r.ended_s if r.ended_s is not None else float("inf"), r.index))
    code = first.returncode if first.returncode is not None else 1
    status = code if code > 0 else 128 - code
    if code == PREEMPTED_EXIT_CODE:
        why = "was preempted (exit 42: state saved)"
    elif code < 0:
        why = f"was killed by {_signal_name(-code)}"
    else:
        why = f"failed with exit status {code}"
    at_start = beats_seen and not watch.progressed[first.index]
    if at_start:
        why += " before its first step"
    return [first.index], why, status, at_start


def exception_text(output: str) -> Optional[str]:
    """The exception line of the last Python traceback in a worker's output (``"ValueError: bad shape"``);
    ``None`` when it shows no traceback (a plain ``sys.exit(3)``, a signal).

    Example:
        >>> exception_text("Traceback (most recent call last):\\n  File \\"t.py\\", line 1\\nValueError: bad shape\\n")
        'ValueError: bad shape'
    """
    start = output.rfind("Traceback (most recent call last):")
    if start < 0:
        return None
    for line in output[start:].splitlines()[1:]:
        if line.strip() and not line.startswith((" ", "\t")):  # (frames and their code lines are indented)
            return line.strip()
    return None


def _deterministic(results: Sequence[WorkerResult], watch: _HeartbeatWatch,
                   previous: Optional[frozenset]) -> Tuple[Optional[frozenset], Optional[str]]:
    """``(this attempt's exception texts, the text it shares with the previous attempt)``.

    A worker that raises the same exception (same text) at two starts in a row, with no step made in either
    attempt (no worker wrote a step heartbeat), fails the same way every time: a bug in the script or its input,
    not a lost machine. The texts are those of the workers that failed by themselves with an exit status of an
    error (a signal's, a preemption's 42 and workers the launcher stopped never count); ``None`` when a step was
    made or no such worker printed a traceback."""
    if any(watch.progressed):
        return None, None
    texts = set()
    for r in results:
        if r.returncode is None or r.returncode <= 0 or r.returncode == PREEMPTED_EXIT_CODE or r.stopped_by_launcher:
            continue
        text = exception_text(r.stderr or "") or exception_text(r.stdout or "")
        if text is not None:
            texts.add(text)
    if not texts:
        return None, None
    common = sorted(texts & previous) if previous else []
    return frozenset(texts), (common[0] if common else None)


def launch_with_restarts(
    argv: Sequence[str],
    num_workers: int = 2,
    max_restarts: int = 0,
    min_workers: Optional[int] = None,
    heartbeat_timeout_s: Optional[float] = None,
    backoff_s: float = 1.0,
    run_dir: Optional[str] = None,
    timeout_s: Optional[float] = None,
    grace_s: float = 30.0,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[str] = None,
    stream: bool = False,
    forward_signals: bool = True,
    reraise_signal: bool = True,
    say: Any = None,
) -> LaunchOutcome:
    """Run ``argv`` as ``num_workers`` local workers and restart them all when one fails, up to ``max_restarts``.

    A failure is a worker exiting non-zero (a crash, SIGKILL, exit 42 after a preemption save) or, with
    ``heartbeat_timeout_s``, a worker that made no step progress for that long (its heartbeat file, written by
    :class:`keras_scale.callbacks.heartbeat.Heartbeat`, which :func:`keras_scale.fit` adds by itself). The others
    get ``grace_s`` to stop, then SIGKILL; after ``backoff_s * 2**(i-1)`` seconds (at most 30) all workers start
    again with fresh ports and resume from their checkpoint. A worker index that fails before its first step
    :data:`START_FAILURES_TO_DROP` attempts in a row is a lost machine: the run continues with one worker fewer,
    down to ``min_workers`` (default ``num_workers``: never fewer). A worker that raises the *same* exception (same
    text) at two starts in a row with no training step made in either is a bug, not a lost machine: the launcher
    stops at once with that error and its exit status (no more restarts, no worker dropped).

    Each restart prints one line (``say``, default stderr) and appends a record to ``run_dir/restarts.jsonl``
    (``KERAS_SCALE_RESTART_LOG`` in the workers; :class:`keras_scale.Goodput` counts it). A signal to the launcher
    (SIGTERM, Ctrl-C) is forwarded and ends the run: it is not restarted.

    Args:
        run_dir: where the heartbeats and the restart record go; ``None``: a temporary directory, removed at the end.
        (the other arguments as in :func:`launch_local_workers`; ``timeout_s`` is for the whole run)

    Returns:
        A :class:`LaunchOutcome`: its ``status`` is 0 when the last attempt succeeded, else the exit status of the
        last failure (when the launcher itself was signalled: 42 if every worker then exited 42, else
        ``128 + signal``; 124 on the timeout).

    Example::

        outcome = launch_with_restarts([sys.executable, "train.py"], num_workers=2, max_restarts=3,
                                       heartbeat_timeout_s=300)
        outcome.status, len(outcome.restarts)        # (0, 1) after one worker was killed and the run resumed
    """
    import shutil
    import tempfile

    from keras_scale._validate import check_int
    from keras_scale.heartbeat_file import RESTART_LOG_ENV

    num_workers = check_int("num_workers", num_workers)
    max_restarts = check_int("max_restarts", max_restarts, 0)
    min_workers = num_workers if min_workers is None else check_int("min_workers", min_workers)
    if min_workers > num_workers:
        raise ValueError(f"min_workers={min_workers} is more than num_workers={num_workers}: use 1 <= min_workers "
                         "<= num_workers.")
    if heartbeat_timeout_s is not None and not heartbeat_timeout_s > 0:
        raise ValueError(f"heartbeat_timeout_s must be > 0 seconds or None (no hang detection), got "
                         f"{heartbeat_timeout_s!r}")
    if not backoff_s >= 0:
        raise ValueError(f"backoff_s must be >= 0 seconds, got {backoff_s!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds or None (no limit), got {timeout_s!r}")
    say = say if say is not None else _say_stderr
    own_dir = run_dir is None
    run_dir = tempfile.mkdtemp(prefix="keras_scale_launch_") if own_dir else os.path.abspath(run_dir)
    os.makedirs(os.path.join(run_dir, "heartbeat"), exist_ok=True)
    said_once: set = set()  # what the heartbeat watches of all attempts have said once
    record_path = os.path.join(run_dir, "restarts.jsonl")
    worker_env = dict(env or {})
    worker_env[RESTART_LOG_ENV] = record_path
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    restarts: List[Restart] = []
    start_failures: Dict[int, int] = {}
    current = num_workers
    beats_seen = False
    last_errors: Optional[frozenset] = None  # the previous attempt's exception texts, if it failed before a step

    def record(entry: Dict[str, Any]) -> None:
        with open(record_path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    # Between attempts (the restart backoff, while no worker runs) a SIGTERM/SIGINT ends the run cleanly: no
    # restart, the status 128 + signal, the run directory cleaned up (without this handler SIGTERM killed the
    # launcher outright and Ctrl-C raised KeyboardInterrupt out of the backoff's sleep).
    between: List[int] = []
    woken = threading.Event()

    def on_signal_between(signum: int, frame: Any) -> None:
        between.append(signum)
        woken.set()

    previous_handlers: Dict[int, Any] = {}

    def restore_handlers() -> None:
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        previous_handlers.clear()

    if forward_signals and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous_handlers[signum] = signal.signal(signum, on_signal_between)
    try:
        while True:
            previous = restarts[-1] if restarts else None

            def on_first_progress(index: int, beat: Dict[str, Any], begin: Optional[Dict[str, Any]],
                                  previous: Optional[Restart] = previous) -> None:
                if previous is None:
                    return
                resumed_step = int(begin["step"]) if begin is not None else max(int(beat["step"]) - 1, 0)
                since = previous.last_progress_unix or previous.failed_at_unix
                record({"event": "resumed", "restart": previous.restart, "first_step_unix": float(beat["time"]),
                        "resumed_step": resumed_step, "lost_s": round(max(0.0, float(beat["time"]) - since), 6),
                        "redone_steps": max(0, (previous.last_step or 0) - resumed_step)})
                if resumed_step == 0 and (previous.last_step or 0) > 0:  # the user must know the work is lost
                    say(f"keras-scale launch: restart {previous.restart}: the workers started again from step 0, "
                        f"{previous.last_step} steps are trained again: no checkpoint was restored (give "
                        "keras_scale.fit a checkpoint_dir, or add ChiefCheckpoint)")

            files = [os.path.join(run_dir, "heartbeat", f"worker-{i}.json") for i in range(current)]
            watch = _HeartbeatWatch(files, heartbeat_timeout_s, on_first_progress, say=say, said=said_once)
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            results = launch_local_workers(argv, num_workers=current, timeout_s=left, grace_s=grace_s,
                                           env=worker_env, cwd=cwd, stream=stream, forward_signals=forward_signals,
                                           reraise_signal=False, heartbeat=watch)
            watch.poll()  # the last beats, for the record
            beats_seen = beats_seen or any(b is not None for b in watch.latest)
            status = exit_status(results)
            if all(r.ok for r in results):
                return LaunchOutcome(results, restarts, 0)
            if results[0].signal_forwarded is not None:
                if reraise_signal and previous_handlers:
                    restore_handlers()
                    signal.raise_signal(results[0].signal_forwarded)
                return LaunchOutcome(results, restarts, status)
            if any(r.timed_out for r in results):
                return LaunchOutcome(results, restarts, status)
            workers, why, status, at_start = _failure(results, watch, heartbeat_timeout_s, beats_seen)
            texts, text = _deterministic(results, watch, last_errors)
            last_errors = texts
            if text is not None:  # the same error at every start: restarting (or dropping a worker) cannot help
                who = [r.index for r in results if text in (exception_text(r.stderr or "") or "",
                                                             exception_text(r.stdout or "") or "")]
                say(f"keras-scale launch: worker{'s' if len(who) > 1 else ''} {', '.join(map(str, who))} raised "
                    f"the same error at {len(restarts) + 1} starts in a row, "
                    f"{'before any training step' if beats_seen else 'with no step heartbeat seen'}: {text}\n"
                    f"keras-scale launch: a failure that repeats identically is a bug in the script or its input, "
                    f"not a lost machine: not restarting (exit {status}). Fix the error above (the worker's "
                    f"traceback is above it) and run again.")
                record({"event": "gave_up", "reason": "deterministic failure", "workers": who, "error": text,
                        "returncode": status, "attempts": len(restarts) + 1})
                return LaunchOutcome(results, restarts, status)
            if len(restarts) >= max_restarts:
                if max_restarts:
                    say(f"keras-scale launch: worker{'s' if len(workers) > 1 else ''} "
                        f"{', '.join(map(str, workers))} {why} (exit {status}); {max_restarts} "
                        f"restart{'s' if max_restarts != 1 else ''} used: giving up with exit status {status}")
                return LaunchOutcome(results, restarts, status)
            next_workers = current
            if at_start:
                index = workers[0]
                start_failures = {index: start_failures.get(index, 0) + 1}
                if start_failures[index] >= START_FAILURES_TO_DROP and current - 1 >= min_workers:
                    next_workers, start_failures = current - 1, {}
            else:
                start_failures = {}
            restart = Restart(len(restarts) + 1, max_restarts, workers, why, status, current, next_workers,
                              watch.last_step(), watch.last_progress_unix(), time.time())
            restarts.append(restart)
            say(restart.line())
            record({"event": "restart", "restart": restart.restart, "max_restarts": max_restarts,
                    "workers": workers, "reason": why, "returncode": status, "num_workers": current,
                    "num_workers_next": next_workers, "last_step": restart.last_step,
                    "last_progress_unix": restart.last_progress_unix, "failed_at_unix": restart.failed_at_unix})
            current = next_workers
            woken.wait(min(backoff_s * 2 ** (restart.restart - 1), 30.0))
            if between:  # no worker runs now: nothing to forward
                say(f"keras-scale launch: {_signal_name(between[0])} received during the restart backoff: not "
                    f"restarting (exit {128 + between[0]})")
                if reraise_signal and previous_handlers:
                    restore_handlers()
                    signal.raise_signal(between[0])
                return LaunchOutcome(results, restarts, 128 + between[0])
    finally:
        restore_handlers()
        if own_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


def cli(argv: Sequence[str]) -> int:
    """``keras-scale launch --workers N [--max-restarts K] [--min-workers M] [--heartbeat-timeout-s T] -- CMD``.

    Example:
        $ keras-scale launch --workers 2 --max-restarts 3 --heartbeat-timeout-s 300 -- python train.py
    """
    parser = argparse.ArgumentParser(
        prog="keras-scale launch",
        description="Run CMD as N local MultiWorkerMirroredStrategy workers on 127.0.0.1 (TF_CONFIG set for "
                    "each), streaming their output with a [worker i] prefix. SIGTERM/SIGINT are forwarded to the "
                    "workers. With --max-restarts, a failed or hung worker restarts all workers (they resume from "
                    "their checkpoint). Exit status: 0 all workers ok; 42 when signalled and every worker saved "
                    "(exited 42); else 128+signal when signalled; 124 on --timeout-s; else the status of the "
                    "(last) failing worker.")
    parser.add_argument("--workers", type=int, default=2, help="number of worker processes (default 2)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart all workers this many times at most when one fails (default 0)")
    parser.add_argument("--min-workers", type=int, default=None,
                        help="a worker that keeps failing before its first step is dropped, down to this many "
                             "workers (default: --workers, never fewer)")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=None,
                        help="a worker with no step progress for this many seconds is hung: kill it and restart "
                             "(default: no hang detection)")
    parser.add_argument("--backoff-s", type=float, default=1.0,
                        help="seconds to wait before restart i: backoff * 2**(i-1), at most 30 (default 1)")
    parser.add_argument("--run-dir", default=os.environ.get("KERAS_SCALE_RUN_DIR"),
                        help="directory for the heartbeats and the restart record restarts.jsonl (default: "
                             "$KERAS_SCALE_RUN_DIR, else a temporary directory)")
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
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.min_workers is not None and not 1 <= args.min_workers <= args.workers:
        parser.error(f"--min-workers must be between 1 and --workers ({args.workers}), got {args.min_workers}")
    if args.heartbeat_timeout_s is not None and args.heartbeat_timeout_s <= 0:
        parser.error(f"--heartbeat-timeout-s must be > 0, got {args.heartbeat_timeout_s}")
    if args.backoff_s < 0:
        parser.error(f"--backoff-s must be >= 0, got {args.backoff_s}")
    if args.timeout_s is not None and args.timeout_s <= 0:
        parser.error(f"--timeout-s must be > 0, got {args.timeout_s}")
    if args.grace_s < 0:
        parser.error(f"--grace-s must be >= 0, got {args.grace_s}")
    import shutil

    if os.sep not in command[0] and shutil.which(command[0]) is None or os.sep in command[0] and not os.access(
            command[0], os.X_OK):
        parser.error(f"cannot run {command[0]!r}: not found or not executable (give the command to run on each "
                     "worker, e.g. `-- python train.py`)")
    # A SIGTERM after launch_with_restarts gave its handlers back (the launcher is ending) lands here: once every
    # worker saved after a forwarded signal (status 42) it is ignored, so a repeated signal never turns 42 into 143.
    late: List[int] = []
    in_main = threading.current_thread() is threading.main_thread()
    previous_term = signal.signal(signal.SIGTERM, lambda signum, frame: late.append(signum)) if in_main else None
    try:
        outcome = launch_with_restarts(command, num_workers=args.workers, max_restarts=args.max_restarts,
                                       min_workers=args.min_workers, heartbeat_timeout_s=args.heartbeat_timeout_s,
                                       backoff_s=args.backoff_s, run_dir=args.run_dir, timeout_s=args.timeout_s,
                                       grace_s=args.grace_s, stream=True, reraise_signal=False)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous_term)
    if in_main and outcome.status == PREEMPTED_EXIT_CODE and outcome.results and \
            outcome.results[0].signal_forwarded is not None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # exiting with 42: also through the interpreter's teardown
    elif late:
        signal.raise_signal(late[0])  # a SIGTERM while the launcher was ending otherwise: as it would have
    summary = ", ".join(f"worker {r.index}: exit {r.returncode}{' (timed out)' if r.timed_out else ''}"
                        f"{' (hung)' if r.hung else ''}" for r in outcome.results)
    restarts = f"{len(outcome.restarts)} restart{'s' if len(outcome.restarts) != 1 else ''}; " \
        if args.max_restarts else ""
    print(f"keras-scale launch: {summary}; {restarts}exit status {outcome.status}", file=sys.stderr, flush=True)
    return outcome.status
