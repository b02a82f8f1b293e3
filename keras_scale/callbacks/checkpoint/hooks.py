"""Method hooks ChiefCheckpoint installs on Keras objects (and takes away again)."""
from __future__ import annotations

import sys
from typing import Any, Optional, Tuple




def _hook_method(obj: Any, name: str, before: Any) -> Tuple[Any, str, Any]:
    """Make ``obj.<name>(...)`` run ``before(caller)`` first (``caller``: the calling function's name), then the
    method it replaces; ``before`` returning ``False`` takes the hook away. Returns what :func:`_unhook` needs."""
    previous = vars(obj).get(name)
    if getattr(previous, "_ks_checkpoint_hook", False):
        previous = previous._ks_previous  # left by a fit that raised: replace it
    original = previous if previous is not None else (
        lambda *args, **kwargs: getattr(type(obj), name)(obj, *args, **kwargs))

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if before(sys._getframe(1).f_code.co_name) is False:
            _unhook((obj, name, hooked))
        return original(*args, **kwargs)

    hooked._ks_checkpoint_hook = True
    hooked._ks_previous = previous
    object.__setattr__(obj, name, hooked)
    return obj, name, hooked


def _unhook(hook: Optional[Tuple[Any, str, Any]]) -> None:
    """Give back what :func:`_hook_method` replaced (if the hook is still the one installed); returns ``None``."""
    if hook is None:
        return None
    obj, name, fn = hook
    if vars(obj).get(name) is fn:
        if fn._ks_previous is not None:
            object.__setattr__(obj, name, fn._ks_previous)
        else:
            object.__delattr__(obj, name)
    return None

