"""What a keras_scale piece changes on a model lasts one ``fit``, however that fit ends.

Keras calls ``on_train_end`` only when ``fit`` returns: an exception (``NanGuardGaveUp``, a user's
``KeyboardInterrupt``, an OOM) skips it, and state a callback installed in ``set_model``/``on_train_begin`` would
leak into the next fit. This module makes every install exception-safe with one rule:

- a piece calls :func:`join` from its ``set_model`` (Keras calls it while building the fit's ``CallbackList``,
  before ``make_train_function``), registering an ``undo`` for what it is about to install;
- it calls :func:`leave` from ``on_train_end``, which runs the ``undo`` at once;
- if the fit died, the next ``fit`` of the model runs the left-over ``undo`` at its start: from the piece's own
  ``set_model`` when it takes part again, else from ``make_train_function`` (Keras calls it once per fit, after
  ``set_model``), which :func:`join` hooks on the model until nothing is left to undo.

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

from typing import Any, Callable, Dict, Tuple

__all__ = ["join", "leave", "fit_starts", "pending", "called_by_keras_fit"]

_ATTR = "_keras_scale_lifecycle"


class _Session:
    def __init__(self) -> None:
        self.undo: Dict[int, Tuple[Any, Callable[[], None]]] = {}
        self.joined: set = set()


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
    stale = session.undo.pop(id(owner), None)
    if stale is not None:
        stale[1]()
    session.undo[id(owner)] = (owner, undo)
    session.joined.add(id(owner))
    if "make_train_function" not in vars(model):
        object.__setattr__(model, "make_train_function", _HookedMakeTrainFunction(model))


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
    entry = session.undo.pop(id(owner), None)
    if entry is not None:
        entry[1]()
    _maybe_unhook(model, session)


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
    for key, (_, undo) in list(session.undo.items()):
        if key not in session.joined:
            del session.undo[key]
            undo()
    session.joined.clear()


def _maybe_unhook(model: Any, session: _Session) -> None:
    if not session.undo and isinstance(vars(model).get("make_train_function"), _HookedMakeTrainFunction):
        object.__delattr__(model, "make_train_function")


class _HookedMakeTrainFunction:
    """``model.make_train_function`` while keras_scale state is installed on the model."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, force: bool = False) -> Any:
        from keras_scale import step as step_lib  # the step module imports this one

        model = self.model
        if called_by_keras_fit():
            fit_starts(model)
            session = _session(model)
            if session is not None:
                _maybe_unhook(model, session)
        return step_lib.make_train_function(model, force)


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
    return code.co_name == "fit" and "keras" in code.co_filename and code.co_filename.endswith(
        ("trainer.py", "trainer.pyc"))
