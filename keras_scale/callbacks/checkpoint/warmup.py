"""Touch, in the background, the memory the first saves of a run will write into.

Measured on this project's machines (a virtual machine): writing a checkpoint's bytes into memory the process has
not used before costs about 2 ms per MB more than writing them into memory that was used and freed, because the
machine backs a page with real memory only when it is first touched. A run's first ``max_to_keep + 1`` saves all
write new files while the older checkpoints are still kept, so each pays that price on the training thread
(72 MB: 220-310 ms for the first two saves, 50 ms for later ones, which reuse the pages of deleted checkpoints).
:func:`warm_memory` touches that much memory once, in a daemon thread, as a fit starts, and gives it back: the first saves then find pages already backed (72 MB: 65-100 ms). It never blocks training; it never holds
more than a quarter of the memory available now (``MemAvailable``, or the container's memory limit less its usage
when that is smaller) nor :data:`MAX_WARM_BYTES`, and only one warm-up runs at a time in a process (fits in a quick
loop do not pile them up). Its cost is that thread's CPU time: about 2 ms per MB of one core where first touch is
expensive (2 GiB: about 5 s beside the first steps), a fraction of that where it is not.

ChiefCheckpoint asks for it at each fit start (:class:`WarmupMixin`): after its fit-start restore, which it would
slow down, or after the first step for a model whose optimizers are built there.

The second one-time cost is ``async_save=True``'s: TensorFlow's async checkpoint copies the variables to host memory
eagerly at the first save and through a ``tf.function`` (``_copy_to_cpu``, converted by autograph) from the second
on, so the second save traced it, set it up in TensorFlow's runtime at its first run, and paid the full garbage
collection the trace's garbage set off, all on the training thread (a 15 KB model: a median 397 ms blocked, 45x the
median save; ``benchmarks/save_blocking.py --async-save``). :func:`trace_async_copy` does both in a daemon thread
right after the first save (the second save: 4 ms, 1.35x); a save that comes before it is done waits for it, and
the function is never traced twice.

Example:
    thread = warm_memory(planned_bytes(checkpoint_nbytes(variables), max_to_keep=3, available=available_bytes()))
"""
from __future__ import annotations

import atexit
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np

__all__ = ["WarmupMixin", "MAX_WARM_BYTES", "PAGE_BYTES", "checkpoint_nbytes", "planned_bytes", "available_bytes", "warm_memory",
           "trace_async_copy", "join_async_copy", "copy_may_communicate", "COPY_JOIN_TIMEOUT_S"]

MAX_WARM_BYTES = 2 * 2**30  # never touch more than this, whatever the checkpoint
PAGE_BYTES = 4096  # one write per page is what makes the machine back it


def checkpoint_nbytes(variables: Dict[str, Any]) -> int:
    """Bytes of the numeric values of ``variables`` (``{key: variable}``, Keras or TensorFlow): about what one
    checkpoint's data file holds.

    Example:
        >>> import keras, tensorflow as tf
        >>> checkpoint_nbytes({"w": keras.Variable(tf.zeros([256, 4])), "step": tf.Variable(0, dtype=tf.int64)})
        4104
    """
    total = 0
    for variable in variables.values():
        dtype = getattr(variable, "dtype", None)
        dtype = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
        shape = tuple(variable.shape)
        # (kind "V": bfloat16 and float8 from ml_dtypes; strings are a few bytes of bookkeeping)
        if dtype.kind in "biufcV" and all(isinstance(d, int) for d in shape):
            total += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return total


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # (cgroup v2 writes "max" for no limit)
        return None


def available_bytes() -> Optional[int]:
    """Memory this process can still take, in bytes: ``MemAvailable`` of ``/proc/meminfo``, or the container's
    limit less its usage (cgroup v2) when that is smaller; ``None`` where it cannot be read (no warming then).

    Example:
        >>> available_bytes() is None or available_bytes() > 0
        True
    """
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if available is not None and limit is not None and used is not None:
        available = min(available, max(limit - used, 0))
    return available


def planned_bytes(checkpoint_bytes: int, max_to_keep: int, available: Optional[int] = None) -> int:
    """How much memory to touch for the first saves of a run: ``max_to_keep + 1`` checkpoints (each written while
    the older ones are kept), at most a quarter of ``available`` memory and :data:`MAX_WARM_BYTES`; 0 when the
    available memory is unknown.

    Example:
        >>> planned_bytes(100 * 2**20, max_to_keep=1, available=64 * 2**30) // 2**20
        200
        >>> planned_bytes(100 * 2**20, max_to_keep=1, available=400 * 2**20) // 2**20
        100
    """
    if available is None or checkpoint_bytes <= 0:
        return 0
    return max(0, int(min(checkpoint_bytes * (max(int(max_to_keep), 1) + 1), available // 4, MAX_WARM_BYTES)))


def _touch(nbytes: int) -> None:
    try:
        pages = np.empty(nbytes, dtype=np.uint8)
        pages[::PAGE_BYTES] = 1  # (numpy lets other threads run during the fill)
        del pages  # a buffer this large is its own mapping: freed, its pages go back to the system, backed
    except MemoryError:
        pass


_running: List[threading.Thread] = []  # the warm-up now running in this process, if any


def warm_memory(nbytes: int) -> Optional[threading.Thread]:
    """Touch ``nbytes`` of memory once in a daemon thread and free it; the thread, or ``None`` when ``nbytes`` is 0
    or an earlier warm-up is still running (one at a time, so the caps hold for the process).

    Example:
        >>> warm_memory(8 * 2**20).join()
        >>> warm_memory(0) is None
        True
    """
    if nbytes <= 0 or any(t.is_alive() for t in _running):
        return None
    thread = threading.Thread(target=_touch, args=(int(nbytes),), name="keras_scale-checkpoint-warmup", daemon=True)
    _running[:] = [thread]
    thread.start()
    return thread


#: The background copy threads still running (:func:`join_async_copy` waits for them; so does the process's exit).
_copy_threads: List[threading.Thread] = []
_exit_hook_registered = [False]
COPY_JOIN_TIMEOUT_S = 60.0  # how long a fit's end or the process's exit waits for a background trace/run of the copy
_COLLECTIVE_OPS = ("Collective", "Nccl")  # op types that talk to other replicas or workers


def copy_may_communicate(strategy: Any) -> bool:
    """Whether TensorFlow's async copy function, traced or run under ``strategy``, may hold an op that talks to other
    devices or workers (a collective, an NCCL all-reduce): any strategy with more than one replica in sync, any
    multi-worker, TPU or parameter-server strategy. Such a function must be traced and run on the training thread,
    in step with the other workers' (a background trace took a collective instance key out of turn: "Collective
    instance 141 expected type 0 and data_type 1 but got ... data_type 9").

    Example:
        copy_may_communicate(tf.distribute.get_strategy())           # False: the default strategy
        copy_may_communicate(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))   # True
    """
    if strategy is None:
        return False
    try:
        if int(getattr(strategy, "num_replicas_in_sync", 1)) != 1:
            return True
        name = type(strategy).__name__
        if any(kind in name for kind in ("MultiWorker", "Collective", "TPU", "ParameterServer", "CentralStorage")):
            return True
        extended = getattr(strategy, "extended", None)
        try:
            devices = tuple(getattr(extended, "worker_devices", ()) or ())
        except RuntimeError:  # the default strategy: no devices of its own
            devices = ()
        if len(devices) > 1:
            return True
        resolver = getattr(extended, "_cluster_resolver", None)
        if resolver is not None and resolver.cluster_spec().as_dict():
            return True
    except Exception:  # noqa: BLE001 - a strategy we cannot read: assume the worst
        return True
    return False


def _graph_communicates(concrete: Any) -> bool:
    """Whether a traced function's graph (or a function it calls) holds a collective or NCCL op."""
    graphs = [concrete.graph]
    graphs += [f.graph for f in getattr(concrete.graph, "_functions", {}).values() if hasattr(f, "graph")]
    return any(op.type.startswith(_COLLECTIVE_OPS) for graph in graphs for op in graph.get_operations())


def join_async_copy(timeout_s: float = COPY_JOIN_TIMEOUT_S) -> bool:
    """Wait (at most ``timeout_s`` seconds in all) for the background threads of :func:`trace_async_copy`; whether
    none is left running. Called at a fit's end, before the preemption save's exit, and at the process's exit (before
    Python's clean-up: a thread inside TensorFlow then aborted the process, "FATAL: exception not rethrown", exit
    status 134 instead of 0 or 42).

    Example:
        trace_async_copy(ckpt)
        join_async_copy()    # nothing of ours runs inside TensorFlow any more
    """
    deadline = time.monotonic() + timeout_s
    for thread in list(_copy_threads):
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    _copy_threads[:] = [t for t in _copy_threads if t.is_alive()]
    return not _copy_threads


def _register_exit_hook() -> None:
    """Join the background copy threads when the process exits: Python's threading shutdown hooks run before the
    atexit handlers (TensorFlow's among them) and before the interpreter stops threads inside C++ code."""
    if _exit_hook_registered[0]:
        return
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(join_async_copy)
        else:  # (another Python: atexit handlers run last-registered first, after TensorFlow's: the latest we can)
            atexit.register(join_async_copy)
        _exit_hook_registered[0] = True
    except RuntimeError:  # the interpreter is shutting down already
        pass


def trace_async_copy(tf_checkpoint: Any, lock: Optional[Any] = None) -> Optional[threading.Thread]:
    """Trace the copy function of ``tf_checkpoint``'s async writer (TensorFlow's ``AsyncCheckpointHelper``) in a
    daemon thread, under the distribution strategy of the calling thread, and with ``lock`` (held by every save
    around its copy) run it once, after the write in flight: its first run sets the function up in TensorFlow's
    runtime, the other half of a first call's cost. Its copies are overwritten by the next save's before they are
    written. Returns the thread, or ``None`` when there is no initialized async writer (before its first save), its
    copy function is traced already, or the strategy has more than one replica or worker
    (:func:`copy_may_communicate`: the copy then goes through collectives, which must run in step on the training
    thread). The thread is joined at the process's exit (:func:`join_async_copy`); it does not run a traced
    function holding a collective op.

    Example:
        ckpt.write("ck/a", options=tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True))
        trace_async_copy(ckpt).join()   # the next async write copies through the traced function
    """
    import tensorflow as tf

    helper = getattr(tf_checkpoint, "_async_checkpointer_impl", None)
    copy = getattr(helper, "_copy_to_cpu", None) if getattr(helper, "_initialized", False) else None
    if copy is None or not hasattr(copy, "get_concrete_function"):
        return None
    try:
        if copy.experimental_get_tracing_count():
            return None
    except Exception:  # noqa: BLE001 - another TensorFlow: trace anyway (get_concrete_function never retraces)
        pass
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if copy_may_communicate(strategy):
        return None
    queue = getattr(helper, "_queue", None)

    def prepare() -> None:
        concrete = copy.get_concrete_function()
        if _graph_communicates(concrete):
            return  # (never run out of step with the training thread's collectives)
        if lock is not None and queue is not None:
            with lock:  # no save copies meanwhile; the write in flight reads the copies: wait for it first
                queue.join()
                copy()

    def run() -> None:
        try:
            if strategy is None:
                prepare()
            else:
                with strategy.scope():
                    prepare()
        except Exception:  # noqa: BLE001 - a speed-up only: the next save traces it as TensorFlow would
            pass

    _register_exit_hook()
    thread = threading.Thread(target=run, name="keras_scale-checkpoint-trace", daemon=True)
    _copy_threads[:] = [t for t in _copy_threads if t.is_alive()] + [thread]
    thread.start()
    return thread


class WarmupMixin:
    """ChiefCheckpoint's part: start :func:`warm_memory` once per fit, on the chief, for a local directory; with
    ``async_save``, :func:`trace_async_copy` after the first save.

    Example:
        self._warmup = None                  # at fit start (ChiefCheckpoint.on_train_begin), then:
        self._warm_up_once()                 # after the restore; again after the first step if nothing was built
        self._trace_async_copy_once()        # after each async save: starts once per tf.train.Checkpoint
    """

    _warmup: Any = None  # None: not started in this fit; False: nothing to touch; else the thread
    _copy_trace: Any = None  # async_save: (the tf.train.Checkpoint, the thread tracing its writer's copy function)
    _copy_trace_closed = False  # set at the fit's end (no more background copies), reset at its start
    _copy_lock = threading.Lock()  # async saves copy only with it (one per process: saves of two fits never overlap)

    def _trace_async_copy_once(self) -> None:
        """After an async save: trace the copy function the next one calls, off the training thread (once per
        ``tf.train.Checkpoint``: a fit builds a new one). Not after the fit's last save (at its end, the preemption
        save: no save of this checkpoint follows, and the process may exit next), nor where the copy may talk to
        other replicas or workers (:func:`copy_may_communicate`)."""
        checkpoint = getattr(self, "_checkpoint", None)
        if not getattr(self, "async_save", False) or checkpoint is None or (
                self._copy_trace is not None and self._copy_trace[0] is checkpoint):
            return
        if self._copy_trace_closed or getattr(self, "_preempting", False):
            return
        try:
            model = getattr(self, "model", None)
            if copy_may_communicate(getattr(model, "distribute_strategy", None)):
                thread = None
            else:
                thread = trace_async_copy(checkpoint, self._copy_lock)
        except Exception:  # noqa: BLE001 - a speed-up only
            thread = None
        self._copy_trace = (checkpoint, thread)

    def _end_async_copy(self) -> None:
        """At the fit's end, before its last save: start no more background copy threads and wait (at most
        :data:`COPY_JOIN_TIMEOUT_S`) for the one running, so none is inside TensorFlow when the process exits."""
        self._copy_trace_closed = True
        if self._copy_trace is not None and self._copy_trace[1] is not None:
            join_async_copy()

    def _warm_up_once(self) -> None:
        from keras_scale import state as training_state
        from keras_scale.storage import _is_local

        if self._warmup is not None:
            return
        if not (getattr(self, "_chief", False) and _is_local(self.directory)):
            self._warmup = False
            return
        try:
            nbytes = checkpoint_nbytes(training_state.variables(self.model))
            if nbytes and any(getattr(v, "built", True) for v in training_state.optimizers(self.model).values()):
                self._warmup = warm_memory(planned_bytes(nbytes, self.max_to_keep, available_bytes())) or False
        except Exception:  # noqa: BLE001 - a speed-up only: whatever fails here must not stop the fit
            self._warmup = False
