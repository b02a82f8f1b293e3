"""What a keras_scale piece changes on a model lasts one ``fit``, however that fit ends.

Keras calls ``on_train_end`` only when ``fit`` returns: an exception (``NanGuardGaveUp``, a user's
``KeyboardInterrupt``, an OOM) skips it, and state a callback installed in ``set_model``/``on_train_begin`` would
leak into the next fit. This module makes every install exception-safe with one rule:

- a piece calls :func:`join` from its ``set_model`` (Keras calls it while building the fit's ``CallbackList``,
  before ``make_train_function``), registering an ``undo`` for what it is about to install;
- it calls :func:`leave` from ``on_train_end``, which runs the ``undo`` at once;
- if the fit died (an exception, a ``KeyboardInterrupt`` from a user callback), the next use of the model runs
  the left-over ``undo`` before anything else: a ``fit`` (from the piece's own ``set_model`` when it takes part
  again, else from ``make_train_function``, which Keras calls once per fit after ``set_model``), and
  ``train_on_batch``, ``test_on_batch``, ``predict_on_batch``, ``evaluate`` and ``predict`` (through
  ``make_train_function``/``make_test_function``/``make_predict_function``, which :func:`join` hooks on the model
  until nothing is left to undo); so after any ending the model behaves as plain Keras. A wrapped model's ``fit``
  undoes in a ``finally`` right away.

What a piece changes on a Keras object is installed through :func:`patch` (an instance attribute whose previous
value comes back however the fit ends) or registered with :func:`join`/:func:`add_undo`; nothing else.

Where the stack must be looked at (is this Keras's own ``fit``? which ``CallbackList`` does it run?) it is here
only, in :func:`called_by_keras_fit`, :func:`fit_running` and :func:`fit_callbacks`, guarded by a fingerprint: the code object of the installed Keras's
``TensorFlowTrainer.fit``, found once (a name-based check when that Keras hides it).

The hook also lets :mod:`keras_scale.step` put the right train function in place for the fit that starts. Only
the call from Keras's own ``fit`` counts as a fit start (:func:`called_by_keras_fit`); a callback that calls
``model.make_train_function(force=True)`` mid-fit just gets the function rebuilt (keras_scale's own code calls
``keras_scale.step.rebuild(model)``).

Example:
    >>> import keras
    >>> from keras_scale import lifecycle
    >>> class MyCallback(keras.callbacks.Callback):
    ...     def set_model(self, model):
    ...         super().set_model(model)
    ...         lifecycle.join(model, self, undo=lambda: setattr(model, "_initial_epoch", None))
    ...     def on_train_end(self, logs=None):
    ...         lifecycle.leave(self.model, self)
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Optional, Tuple

__all__ = ["join", "leave", "joined", "patch", "add_undo", "end", "fit_starts", "pending", "called_by_keras_fit",
           "fit_running", "fit_callbacks", "innermost_fit_callbacks", "fit_with_callbacks_running"]

_ATTR = "_keras_scale_lifecycle"


_HOOKED = ("make_train_function", "make_test_function", "make_predict_function")
# keras_scale.step's make_train_function, registered when that module is imported (no step exists before that)
_MAKE_TRAIN_FUNCTION: Optional[Callable[[Any, bool], Any]] = None


def set_train_function_maker(make: Callable[[Any, bool], Any]) -> None:
    """What the hooked ``model.make_train_function`` calls (``keras_scale.step`` registers its own).

    Example:
        set_train_function_maker(step.make_train_function)   # done by keras_scale.step at import
    """
    global _MAKE_TRAIN_FUNCTION
    _MAKE_TRAIN_FUNCTION = make


class _Session:
    def __init__(self) -> None:
        self.undo: Dict[int, Tuple[Any, Callable[[], None]]] = {}
        self.joined: set = set()
        self.extra: Dict[int, list] = {}  # owner -> further undos (patch, add_undo), run last-in first-out


def _session(model: Any, create: bool = False) -> Any:
    session = vars(model).get(_ATTR)
    if session is None and create:
        session = _Session()
        object.__setattr__(model, _ATTR, session)
    return session


def join(model: Any, owner: Any, undo: Callable[[], None]) -> None:
    """``owner`` takes part in the fit being set up and will install state that ``undo`` reverts.

    Runs ``owner``'s own left-over ``undo`` first (its previous fit died), then hooks the model's
    ``make_train_function`` so that the next fit undoes what ``owner`` leaves behind if ``owner`` is not in it.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> owner, undone = object(), []
        >>> join(model, owner, undo=lambda: undone.append("reverted"))
        >>> pending(model)
        1
    """
    session = _session(model, create=True)
    if id(owner) in session.undo:
        _run_undo(session, id(owner))
    session.undo[id(owner)] = (owner, undo)
    session.joined.add(id(owner))
    for name in _HOOKED:
        if name not in vars(model):
            object.__setattr__(model, name, _HookedMake(model, name))


def _run_undo(session: _Session, key: int) -> None:
    """Run ``key``'s undo and its further undos (last installed first); every one runs even if one raises."""
    entry = session.undo.pop(key, None)
    extra = session.extra.pop(key, [])
    errors = []
    for fn in reversed(extra):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the other undos must still run
            errors.append(e)
    if entry is not None:
        try:
            entry[1]()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    if errors:
        raise errors[0]


def add_undo(model: Any, owner: Any, undo: Callable[[], None]) -> None:
    """One more thing ``owner`` (already joined) installed; undone with the rest of its state, before its own undo.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> owner, undone = object(), []
        >>> join(model, owner, undo=lambda: undone.append("joined"))
        >>> add_undo(model, owner, lambda: undone.append("extra"))
        >>> leave(model, owner)
        >>> undone
        ['extra', 'joined']
    """
    session = _session(model, create=True)
    if id(owner) not in session.undo:
        join(model, owner, undo=lambda: None)
    session.extra.setdefault(id(owner), []).append(undo)


_MISSING = object()


def patch(model: Any, owner: Any, obj: Any, name: str, value: Any) -> None:
    """Set ``obj.<name> = value`` as an instance attribute for ``owner``'s fit; the previous value (or the class's
    attribute) comes back when that state is undone, unless someone replaced ``value`` since.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> owner = object()
        >>> patch(model, owner, model, "_initial_epoch", 2)
        >>> model._initial_epoch
        2
        >>> leave(model, owner)
        >>> model._initial_epoch is None
        True
    """
    previous = vars(obj).get(name, _MISSING)
    object.__setattr__(obj, name, value)

    def undo() -> None:
        if vars(obj).get(name, _MISSING) is not value:
            return  # replaced since: not ours to take back
        if previous is _MISSING:
            object.__delattr__(obj, name)
        else:
            object.__setattr__(obj, name, previous)

    add_undo(model, owner, undo)


def end(model: Any) -> None:
    """Everything any piece installed on ``model`` is undone now (the fit that installed it is over).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> owner, undone = object(), []
        >>> join(model, owner, undo=lambda: undone.append("reverted"))
        >>> end(model)
        >>> undone, pending(model)
        (['reverted'], 0)
    """
    session = _session(model)
    if session is None:
        return
    errors = []
    for key in list(session.undo):
        try:
            _run_undo(session, key)
        except Exception as e:  # noqa: BLE001 - every piece's undo runs
            errors.append(e)
    session.joined.clear()
    _maybe_unhook(model, session)
    if errors:
        raise errors[0]


def leave(model: Any, owner: Any) -> None:
    """``owner``'s fit ended normally: undo what it installed now.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> owner, undone = object(), []
        >>> join(model, owner, undo=lambda: undone.append("reverted"))
        >>> leave(model, owner)   # from owner's on_train_end
        >>> undone, pending(model)
        (['reverted'], 0)
    """
    session = _session(model)
    if session is None:
        return
    session.joined.discard(id(owner))
    try:
        _run_undo(session, id(owner))
    finally:
        _maybe_unhook(model, session)


def joined(model: Any, owner: Any) -> bool:
    """Whether ``owner`` has state installed on ``model`` (joined and not left yet).

    Example:
        >>> import keras
        >>> joined(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]), object())
        False
    """
    session = _session(model)
    return session is not None and id(owner) in session.undo


def pending(model: Any) -> int:
    """How many pieces still have state installed on ``model`` (0 after a clean fit).

    Example:
        >>> import keras
        >>> pending(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
        0
    """
    session = _session(model)
    return 0 if session is None else len(session.undo)


def fit_starts(model: Any) -> None:
    """A fit of ``model`` starts: undo what pieces that are not part of it left behind.

    Called by the ``make_train_function`` hook (and by ``AccumulatingModel.make_train_function``).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> owner, undone = object(), []
        >>> join(model, owner, undo=lambda: undone.append("reverted"))
        >>> fit_starts(model)          # owner joined this fit: its state stays
        >>> fit_starts(model)          # the next fit starts without owner: what it left is undone
        >>> undone
        ['reverted']
    """
    session = _session(model)
    if session is None:
        return
    for key in list(session.undo):
        if key not in session.joined:
            _run_undo(session, key)
    session.joined.clear()


def _maybe_unhook(model: Any, session: _Session) -> None:
    if session.undo:
        return
    for name in _HOOKED:
        if isinstance(vars(model).get(name), _HookedMake):
            object.__delattr__(model, name)


class _HookedMake:
    """``model.make_{train,test,predict}_function`` while keras_scale state is installed on the model."""

    def __init__(self, model: Any, name: str) -> None:
        self.model, self.name = model, name

    def __call__(self, force: bool = False) -> Any:
        model = self.model
        if self.name == "make_train_function" and called_by_keras_fit():
            fit_starts(model)  # a fit starts: what pieces not taking part left is undone
        elif not fit_running(model):
            end(model)  # train_on_batch, evaluate, predict... after a fit that died: plain Keras again
        session = _session(model)
        if session is not None:
            _maybe_unhook(model, session)
        if self.name == "make_train_function" and _MAKE_TRAIN_FUNCTION is not None:
            return _MAKE_TRAIN_FUNCTION(model, force)
        return getattr(type(model), self.name)(model, force)


def _keras_fit_code() -> Any:
    """The code object of the installed Keras's ``TensorFlowTrainer.fit`` (the fingerprint), or None."""
    global _FIT_CODE
    if _FIT_CODE is _MISSING:
        code = None
        try:
            from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

            fn = TensorFlowTrainer.fit
            while hasattr(fn, "__wrapped__"):
                fn = fn.__wrapped__
            code = fn.__code__
            if code.co_name != "fit" or "make_train_function" not in code.co_names:
                code = None  # not the fit this module was written against: fall back to the name check
        except Exception:  # noqa: BLE001 - another Keras layout
            code = None
        _FIT_CODE = code
    return _FIT_CODE


_FIT_CODE: Any = _MISSING


def _is_keras_fit(code: Any) -> bool:
    fingerprint = _keras_fit_code()
    if fingerprint is not None:
        return code is fingerprint
    return code.co_name == "fit" and "keras" in code.co_filename and code.co_filename.endswith(
        ("trainer.py", "trainer.pyc"))


def called_by_keras_fit(depth: int = 2) -> bool:
    """True when the caller's caller is Keras's own ``fit`` (a fit starts), False for a rebuild mid-fit.

    Keras calls ``make_train_function`` once per fit from ``TensorFlowTrainer.fit``; a callback that calls
    ``model.make_train_function(force=True)`` mid-fit (e.g. to apply a new learning-rate schedule) must not be
    taken for the start of a new fit.

    Example:
        >>> called_by_keras_fit()
        False
    """
    import sys

    try:
        code = sys._getframe(depth).f_code
    except ValueError:  # a shallower stack: not Keras's fit
        return False
    return _is_keras_fit(code)


def _keras_fits(frame: Any) -> Iterator[Tuple[Any, Any]]:
    """``(model, callbacks)`` of every Keras ``fit`` on the stack from ``frame`` outwards, innermost first: the one
    place the stack is read for a fit (its locals ``self`` and ``callbacks``)."""
    while frame is not None:
        if _is_keras_fit(frame.f_code):
            f_locals = frame.f_locals
            yield f_locals.get("self"), f_locals.get("callbacks")
        frame = frame.f_back


def fit_running(model: Any, frame: Any = None) -> bool:
    """True while a Keras ``fit`` of ``model`` is on the stack (of this thread, or above ``frame``).

    Example:
        >>> import keras
        >>> fit_running(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
        False
    """
    import sys

    return any(m is model for m, _ in _keras_fits(sys._getframe(1) if frame is None else frame))


def fit_callbacks(model: Any) -> Any:
    """The ``CallbackList`` of the Keras ``fit`` of ``model`` running in this thread (its local ``callbacks``), or None.

    Keras builds it, its ``ProgbarLogger`` and ``History`` included, before it calls ``make_train_function``.

    Example:
        >>> import keras
        >>> fit_callbacks(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])) is None
        True
    """
    import sys

    from keras.callbacks import CallbackList

    for m, callbacks in _keras_fits(sys._getframe(1)):
        if m is model:
            return callbacks if isinstance(callbacks, CallbackList) else None
    return None


def innermost_fit_callbacks() -> Any:
    """The ``callbacks`` local of the innermost Keras ``fit`` running in this thread (any model), or None.

    Example:
        >>> innermost_fit_callbacks() is None
        True
    """
    import sys

    for _, callbacks in _keras_fits(sys._getframe(1)):
        return callbacks
    return None


def fit_with_callbacks_running(callbacks: Any) -> bool:
    """True while the Keras ``fit`` whose ``callbacks`` local is ``callbacks`` is on this thread's stack.

    Example:
        >>> fit_with_callbacks_running(object())
        False
    """
    import sys

    return any(c is callbacks for _, c in _keras_fits(sys._getframe(1)))
