"""Preemption: SIGTERM/SIGUSR1 handling, the workers' agreement on when to stop, the exit status."""
from __future__ import annotations

import signal
import sys
import threading
import time
import weakref
from typing import Any

import keras
import tensorflow as tf

from keras_scale import events
from keras_scale.distribute import is_multi_worker
from keras_scale.callbacks.checkpoint.names import log


#: Exit status of a process that ``ChiefCheckpoint`` ended after SIGTERM/SIGUSR1 with its state saved (the
#: convention of TensorFlow's ``PreemptionCheckpointHandler``). Key a restart/requeue on it.
PREEMPTION_EXIT_CODE = 42
_REPEAT_WINDOW_S = 60.0  # after a preemption save, repeats of the signal are ignored this long while exiting


class PreemptionMixin:
    """Part of :class:`ChiefCheckpoint` (a mixin: it uses the callback's own state)."""

    def _install_signal_handlers(self) -> None:
        self._restore_signal_handlers()
        self._exit_window_until = 0.0
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
        if self._preempting and self.preemption_exit_code is not None and not self._save_error_seen:
            self._exit_window_until = time.monotonic() + _REPEAT_WINDOW_S
            return
        self._restore_signal_handlers()

    def _check_preemption(self, agree_now: bool) -> None:
        if self._preempting:
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
            self._preempting = True
            signum = self._preempt_requested
            if signum is None:
                signum = int(signal.SIGTERM)
            self.preempted = int(signum)
            events.record("preemption", self._global_step, signal=signal.Signals(signum).name)
            self.model.stop_training = True

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
        try:
            if signal.getsignal(signum) is self:
                signal.signal(signum, self.previous if self.previous is not None else signal.SIG_DFL)
        except (ValueError, OSError):
            pass
        _deliver(self.previous, signum, frame)
