"""Preemption: SIGTERM/SIGUSR1 handling, the workers' agreement on when to stop, the exit status.

Multi-worker, the signal may reach one worker only. The workers agree on the step to stop at through TensorFlow's
coordination service (the key-value store every ``MultiWorkerMirroredStrategy`` cluster runs), as TensorFlow's own
``PreemptionCheckpointHandler`` does, with nothing per step but a look at a local flag:

1. every worker watches one key (``<fit>/target``) in a background thread (a long poll, no traffic per step);
2. the first worker that finds its own signal at a step boundary (after its call ``n``) claims ``<fit>/proposer``
   and publishes ``target = n + 1``; it then waits until every worker acknowledged (a few ms). Each step of
   ``MultiWorkerMirroredStrategy`` holds an all-reduce, so no worker can have finished call ``n + 1`` before the
   proposer starts it: every worker sees the target before it passes it;
3. every worker stops at the boundary after call ``n + 1``: all save the same step and exit 42;
4. at the fit's end one all-reduce (once per fit) settles a signal that came after the last step boundary.

Without a coordination service (a cluster set up another way) the workers agree with a small all-reduce every
``signal_check_every_n_steps`` steps instead.
"""
from __future__ import annotations

import atexit
import itertools
import signal
import sys
import threading
import time
import weakref
from typing import Any, Optional, Tuple

import keras
import tensorflow as tf

from keras_scale import events
from keras_scale.distribute import is_multi_worker
from keras_scale.callbacks.checkpoint.names import log


#: Exit status of a process that ``ChiefCheckpoint`` ended after SIGTERM/SIGUSR1 with its state saved (the
#: convention of TensorFlow's ``PreemptionCheckpointHandler``). Key a restart/requeue on it.
PREEMPTION_EXIT_CODE = 42
_REPEAT_WINDOW_S = 60.0  # after a preemption save, repeats of the signal are ignored this long while exiting
_ACK_TIMEOUT_S = 120.0  # the proposer waits this long at most for every worker to have seen the target step
_POLL_MS = 1000  # the watcher's long poll: how soon it notices the end of the fit when nobody publishes "stop"
_KEY_ROOT = "keras_scale/preemption"
_fit_numbers = itertools.count()  # every worker runs the same fits in the same order: the same number for one fit

# Monotonic time until which this process is exiting with the preemption status after a completed save. Repeats of
# the signal must not turn that exit into 128 + signal: the handler ignores them (also once the callback was freed),
# and at interpreter exit SIGTERM/SIGUSR1 are set to SIG_IGN, because Python puts the default action (terminate) back
# for every signal it handles right after the atexit functions, while TensorFlow still tears down.
_exiting_until = [0.0]
_atexit_registered = [False]


def _signals() -> Tuple[int, ...]:
    return tuple(int(s) for s in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)) if s is not None)


def _exiting_after_save() -> bool:
    return time.monotonic() < _exiting_until[0]


def _ignore_signals_at_exit() -> None:
    if not _exiting_after_save():
        return
    for sig in _signals():
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (ValueError, OSError):
            pass


def _enter_exit_window() -> None:
    _exiting_until[0] = time.monotonic() + _REPEAT_WINDOW_S
    if not _atexit_registered[0]:
        _atexit_registered[0] = True
        atexit.register(_ignore_signals_at_exit)


class PreemptionMixin:
    """Part of :class:`ChiefCheckpoint` (a mixin: it uses the callback's own state)."""

    def _install_signal_handlers(self) -> None:
        self._restore_signal_handlers()
        self._exit_window_until = 0.0
        _exiting_until[0] = 0.0  # a new fit in this process (a caught SystemExit before): not exiting any more
        if threading.current_thread() is not threading.main_thread():
            log.info("ChiefCheckpoint: fit runs outside the main thread; SIGTERM/SIGUSR1 are not handled")
            return
        for sig in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)):
            if sig is None:
                continue
            try:
                handler = _WeakHandler(self)
                handler.previous = signal.signal(sig, handler)
                self._handlers[int(sig)] = handler
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, handler in list(self._handlers.items()):
            try:
                if signal.getsignal(sig) is handler:
                    signal.signal(sig, handler.previous if handler.previous is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        self._handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self._fit_running(frame):
            if self._preempt_requested is None:
                self._preempt_requested = signum  # acted on at the next step boundary
                log.warning("ChiefCheckpoint: received %s; saving at the next step boundary", name)
            else:  # schedulers and launchers repeat signals: a repeat never aborts the save
                log.warning("ChiefCheckpoint: received %s again; the preemption save goes on (ignored; SIGKILL, or "
                            "SIGINT/Ctrl-C, ends the process at once)", name)
            return
        if time.monotonic() < self._exit_window_until:
            # the preemption save is done and the process is on its way out with the preemption exit status
            log.warning("ChiefCheckpoint: received %s while exiting after the preemption save (ignored)", name)
            return
        # Our fit is no longer running (it raised, or ended long ago): behave as if we had never been here.
        handler = self._handlers.get(signum)
        prev = handler.previous if handler is not None else signal.SIG_DFL
        self._restore_signal_handlers()
        _deliver(prev, signum, frame)

    def _release_signal_handlers(self) -> None:
        """At the fit's end: give the handlers back, except when the fit ends the process after a preemption save
        (then repeats of the signal within ``_REPEAT_WINDOW_S`` are still ignored, so the exit status stays 42). A
        preemption save that failed raises :class:`CheckpointSaveError` from ``fit`` instead (exit status 1): the
        handlers are given back."""
        self._close_signal_channel()
        if self._preempting and self.preemption_exit_code is not None and not self._save_error_seen:
            self._exit_window_until = time.monotonic() + _REPEAT_WINDOW_S
            _enter_exit_window()
            return
        self._restore_signal_handlers()

    def _open_signal_channel(self) -> None:
        """Multi-worker, at the fit's start (on every worker, after the start's all-reduce): watch for the step
        the workers stop at, through the coordination service. Nothing when there is none (the fallback)."""
        self._close_signal_channel()
        strategy = self.model.distribute_strategy
        if is_multi_worker(strategy):
            self._channel = SignalChannel.for_strategy(strategy)

    def _close_signal_channel(self) -> None:
        channel, self._channel = getattr(self, "_channel", None), None
        if channel is not None:
            channel.close()

    def _agree_at_train_end(self) -> None:
        """Multi-worker with the coordination service: one all-reduce per fit, at its end, so that a signal that
        came after a worker's last step boundary (or a target step the fit ended before) still ends every worker
        with the preemption status. Every worker calls it once, whatever it saw."""
        channel = getattr(self, "_channel", None)
        if channel is None:
            return
        agreed = channel.agreed()
        signum = agreed[1] if agreed is not None else (self._preempt_requested or 0)
        total = self._sum_over_workers(self.model.distribute_strategy, 1.0 if signum or self._preempting else 0.0)
        channel.close(publish_stop=True)  # everyone is past the agreement: no target can be published any more
        self._channel = None
        if total > 0 and not self._preempting:
            self._start_preemption(int(signum) if signum else int(signal.SIGTERM))

    def _start_preemption(self, signum: int) -> None:
        self._preempting = True
        self.preempted = int(signum)
        events.record("preemption", self._global_step, signal=signal.Signals(signum).name)
        self.model.stop_training = True

    def _check_preemption(self, agree_now: bool) -> None:
        if self._preempting:
            return
        channel = getattr(self, "_channel", None)
        if channel is not None:  # multi-worker: a local flag per step, the agreement through the coordination service
            agreed = channel.agreed()
            if agreed is not None:
                if self._calls >= agreed[0]:
                    self._start_preemption(agreed[1])
            elif self._preempt_requested is not None and not channel.proposed and not self._last_call_skipped:
                # (not in a resume's fast-forward: those calls hold no collective, the workers may be apart there)
                channel.propose(self._calls, self._preempt_requested)
            return
        strategy = self.model.distribute_strategy
        mine = 0.0 if self._preempt_requested is None else float(self._preempt_requested)
        if is_multi_worker(strategy):
            if not agree_now:
                return
            # Every worker asks at the same batch: the signal may have reached only one of them.
            total = self._sum_over_workers(strategy, mine)
        else:
            total = mine
        if total > 0:
            signum = self._preempt_requested
            self._start_preemption(int(signum) if signum is not None else int(signal.SIGTERM))

    def _sum_over_workers(self, strategy: Any, value: float, first_replica_only: bool = False) -> float:
        """All-reduce (SUM) of ``value`` over all replicas of all workers; also a barrier. Local value outside
        multi-worker."""
        if not is_multi_worker(strategy):
            return value

        def fn():
            v = tf.constant(value, tf.float64)
            if not first_replica_only:
                return v
            first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
            return tf.where(first, v, tf.constant(0.0, tf.float64))

        return float(strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(fn), axis=None).numpy())

    def _check_workers_agree(self, strategy: Any, restored_step: int) -> None:
        """Multi-worker: every worker must resume from the same checkpoint (or none), else training diverges or
        hangs in a collective. Two small all-reduces; nothing outside multi-worker."""
        if not is_multi_worker(strategy):
            return
        first_step = int(self._sum_over_workers(strategy, float(restored_step), first_replica_only=True))
        if self._sum_over_workers(strategy, 0.0 if first_step == restored_step else 1.0) > 0:
            mine = f"a checkpoint at global batch {restored_step}" if restored_step >= 0 else "no checkpoint"
            theirs = f"global batch {first_step}" if first_step >= 0 else "no checkpoint"
            raise RuntimeError(
                f"ChiefCheckpoint: the workers would resume from different states (this worker found {mine} in "
                f"{self.directory!r}, the first worker {theirs}). Fix: put the checkpoint directory on a file "
                "system every worker can read (NFS, GCS, ...) at the same path."
            )

    def _exit_after_train_end(self, code: int) -> None:
        """Exit with ``code`` once every callback's ``on_train_end`` has run (Goodput's report, TensorBoard's
        flush, a user's cleanup), not in the middle of them: the last callback of Keras's ``CallbackList`` (the one
        calling this hook) raises it right after its own ``on_train_end``; when this callback is the last, now."""
        caller = sys._getframe(2).f_locals.get("self")  # CallbackList.on_train_end -> on_train_end -> here
        callbacks = list(getattr(caller, "callbacks", None) or []) if isinstance(
            caller, keras.callbacks.CallbackList) else []
        if not callbacks or not any(cb is self for cb in callbacks) or callbacks[-1] is self:
            raise SystemExit(code)
        last = callbacks[-1]
        own = last.on_train_end  # bound: a subclass's own method runs
        had_attribute = "on_train_end" in vars(last)

        def on_train_end(logs=None):
            if had_attribute:
                last.on_train_end = own
            else:
                del last.on_train_end  # the instance attribute: back to the class's method
            try:
                own(logs)
            finally:
                raise SystemExit(code)

        last.on_train_end = on_train_end


def _deliver(prev: Any, signum: int, frame: Any) -> None:
    """Hand ``signum`` to the handler that was installed before ChiefCheckpoint's (the default: re-raised)."""
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


class _WeakHandler:
    """ChiefCheckpoint's signal handler, holding the callback weakly: after a fit that raised (Keras then skips
    ``on_train_end``, which gives the handlers back), a model the user dropped is freed; a signal that arrives
    after that goes to the handler that was there before, as if ChiefCheckpoint had never been installed."""

    def __init__(self, owner: Any) -> None:
        self._owner = weakref.ref(owner)
        self.previous: Any = signal.SIG_DFL  # the handler installed before this one

    def __call__(self, signum: int, frame: Any) -> None:
        owner = self._owner()
        if owner is not None:
            owner._on_signal(signum, frame)
            return
        if _exiting_after_save():  # the callback was freed while the process exits after its preemption save
            return
        try:
            if signal.getsignal(signum) is self:
                signal.signal(signum, self.previous if self.previous is not None else signal.SIG_DFL)
        except (ValueError, OSError):
            pass
        _deliver(self.previous, signum, frame)


class SignalChannel:
    """The workers' agreement on the step at which a preemption signal stops them, through TensorFlow's coordination
    service (see the module docstring): a watcher thread per worker, nothing per step but :meth:`agreed`.

    Example::

        channel = SignalChannel.for_strategy(strategy)    # every worker, at the fit's start (None: no service)
        if channel.agreed() is None and my_signal:        # at a step boundary, after call `calls`
            channel.propose(calls, signal.SIGTERM)        # every worker then stops after call `calls + 1`
        channel.agreed()                                  # (calls + 1, 15) on every worker
        channel.close(publish_stop=True)                  # at the fit's end, after the last agreement
    """

    def __init__(self, fit_number: int, worker: int, num_workers: int) -> None:
        from tensorflow.python.eager import context

        self._context = context.context()
        self._prefix = f"{_KEY_ROOT}/{fit_number}/"
        self.worker = int(worker)
        self.num_workers = int(num_workers)
        self.proposed = False  # this worker asked (or found another worker had asked first)
        self.proposed_at: Optional[float] = None  # monotonic time this worker published the target
        self._target: Optional[Tuple[int, int]] = None  # (call to stop after, signal number)
        self._agreed = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = threading.Thread(
            target=self._watch, name=f"keras_scale-preemption-watch-{worker}", daemon=True)
        self._thread.start()

    @classmethod
    def for_strategy(cls, strategy: Any) -> Optional["SignalChannel"]:
        """A channel for this fit of a multi-worker ``strategy``; ``None`` when TensorFlow runs no coordination
        service for it (the callers then agree by all-reduce)."""
        from tensorflow.python.eager import context

        extended = getattr(strategy, "extended", None)
        worker = getattr(extended, "_id_in_cluster", None)
        num_workers = getattr(extended, "_num_workers", None)
        if context.context().coordination_service is None or worker is None or not num_workers:
            return None
        return cls(next(_fit_numbers), int(worker), int(num_workers))

    def agreed(self) -> Optional[Tuple[int, int]]:
        """``(call, signum)`` once a worker's signal set the step: stop at the boundary after call ``call``."""
        return self._target if self._agreed.is_set() else None

    def propose(self, calls: int, signum: int) -> None:
        """At a step boundary after call ``calls``, on a worker that got ``signum``: every worker stops after call
        ``calls + 1``. Returns once every worker has seen it (a few ms), or at once when another worker asked
        first (its target then reaches this worker's watcher before this worker can pass it)."""
        self.proposed = True
        ctx = self._context
        try:
            ctx.set_config_key_value(self._prefix + "proposer", str(self.worker))
        except tf.errors.AlreadyExistsError:
            return
        ctx.set_config_key_value(self._prefix + "target", f"{calls + 1}:{int(signum)}")
        self.proposed_at = time.monotonic()
        log.info("ChiefCheckpoint: %s on worker %d: every worker stops after its call %d", signal.Signals(signum).name,
                 self.worker, calls + 1)
        deadline = time.monotonic() + _ACK_TIMEOUT_S
        for j in range(self.num_workers):
            left_ms = int(max(1.0, (deadline - time.monotonic()) * 1000))
            try:
                ctx.get_config_key_value(self._prefix + f"ack/{j}", left_ms)
            except tf.errors.DeadlineExceededError:
                log.warning("ChiefCheckpoint: worker %d did not confirm the preemption step within %.0f s (is it "
                            "alive?); going on", j, _ACK_TIMEOUT_S)
                return

    def _watch(self) -> None:
        ctx = self._context
        while not self._stop.is_set():
            try:
                value = ctx.get_config_key_value(self._prefix + "target", _POLL_MS)
            except tf.errors.DeadlineExceededError:
                continue
            except Exception as e:  # noqa: BLE001 - the cluster is going away: nothing to agree on any more
                log.debug("ChiefCheckpoint: the preemption watcher stops: %s", e)
                return
            if value == "stop":
                return
            call, signum = (int(v) for v in value.split(":"))
            self._target = (call, signum)
            self._agreed.set()  # before the acknowledgement: the proposer goes on only once every flag is set
            try:
                ctx.set_config_key_value(self._prefix + f"ack/{self.worker}", "1")
            except Exception as e:  # noqa: BLE001
                log.debug("ChiefCheckpoint: could not acknowledge the preemption step: %s", e)
            return

    def close(self, publish_stop: bool = False) -> None:
        """Stop watching. ``publish_stop`` (only once every worker is past the last agreement, i.e. after the
        fit-end all-reduce): wake every worker's watcher at once instead of at its next poll."""
        self._stop.set()
        if publish_stop and not self._agreed.is_set():
            try:
                self._context.set_config_key_value(self._prefix + "target", "stop")
            except Exception:  # noqa: BLE001 - already set (by another worker, or a real target)
                pass
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=(_POLL_MS / 1000.0) * 2 if publish_stop else 0.0)
