"""Method hooks ChiefCheckpoint installs on Keras objects, through :mod:`keras_scale.lifecycle` (so they are taken
away however the fit ends)."""
from __future__ import annotations

from typing import Any, Optional, Tuple

from keras_scale import lifecycle


def _hook_method(model: Any, owner: Any, obj: Any, name: str, before: Any) -> Tuple[Any, str, Any]:
    """Make ``obj.<name>(...)`` run ``before(from_fit)`` first (``from_fit``: the caller is Keras's own ``fit``,
    see :func:`keras_scale.lifecycle.called_by_keras_fit`), then the method it replaces; ``before`` returning
    ``False`` takes the hook away. Installed with :func:`keras_scale.lifecycle.patch` for ``owner``'s fit on
    ``model``. Returns what :func:`_unhook` needs."""
    previous = vars(obj).get(name)
    if getattr(previous, "_ks_checkpoint_hook", False):
        previous = previous._ks_previous  # (left by a fit whose undo has not run yet: replace it)
    original = previous if previous is not None else (
        lambda *args, **kwargs: getattr(type(obj), name)(obj, *args, **kwargs))

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if before(lifecycle.called_by_keras_fit(depth=2)) is False:
            _unhook((obj, name, hooked))
        return original(*args, **kwargs)

    hooked._ks_checkpoint_hook = True
    hooked._ks_previous = previous
    lifecycle.patch(model, owner, obj, name, hooked)
    return obj, name, hooked


def _unhook(hook: Optional[Tuple[Any, str, Any]]) -> None:
    """Give back what :func:`_hook_method` replaced now (if the hook is still the one installed); returns ``None``.
    (Its lifecycle undo then finds nothing left to do.)"""
    if hook is None:
        return None
    obj, name, fn = hook
    if vars(obj).get(name) is fn:
        if fn._ks_previous is not None:
            object.__setattr__(obj, name, fn._ks_previous)
        else:
            object.__delattr__(obj, name)
    return None
