"""keras_scale's one printer: every message the pack prints, from a callback or the command line, goes here.

- Routine messages (a save, the goodput table, ``keras-scale checkpoint ls``, the doctor's report) go through
  Keras's ``io_utils.print_msg`` once Keras is loaded: stdout, or Python (absl) logging after
  ``keras.config.disable_interactive_logging()``. The command line starts without TensorFlow or Keras; there
  they go to stdout.
- An ``incident`` (a skipped NaN step, a fallback) goes to stderr, on a line of its own.
- ``verbose=0`` prints nothing. Which process prints in a multi-worker job is decided once, by
  :func:`keras_scale.distribute.chief_print` (the chief only), which calls :func:`say`.

Machine-readable output (``--json``) is printed as it is, not through here.

Example:
    >>> say("checkpoint saved")
    checkpoint saved
    >>> say("not shown", verbose=0)
"""
from __future__ import annotations

import sys

__all__ = ["say"]


def say(message: str, verbose: int = 1, incident: bool = False) -> None:
    """Print ``message`` (see the module docstring); nothing when ``verbose`` is 0.

    Example:
        >>> say("2 checkpoint(s)", verbose=1)
        2 checkpoint(s)
    """
    if not verbose:
        return
    if incident:
        # Keras's progress bar may be mid-line on stdout (on a terminal, or piped: `python train.py 2>&1 | tee`):
        # start the incident on a line of its own
        global _last_incident_mark
        mark = _progress_bar_mark()
        if mark is not None and mark == _last_incident_mark:
            lead = ""  # the bar printed nothing since our last incident: the cursor is still at a line's start
        else:
            lead = "\n" if getattr(sys.stdout, "isatty", lambda: False)() or _progress_bar_mid_line() else ""
        sys.stdout.flush()
        print(lead + message, file=sys.stderr, flush=True)
        _last_incident_mark = mark
        return
    io_utils = sys.modules.get("keras.src.utils.io_utils")  # Keras loaded: honour its interactive-logging switch
    if io_utils is not None and hasattr(io_utils, "print_msg"):
        io_utils.print_msg(message)
        return
    print(message, flush=True)


#: the progress bar's state when the last incident was said (see _progress_bar_mark)
_last_incident_mark: object = None


def _progress_bar_mark() -> object:
    """(the running ``verbose=1`` progress bar, when it last printed), or None: equal marks mean the bar printed
    nothing in between."""
    if "keras" not in sys.modules:
        return None
    try:
        from keras_scale.lifecycle import innermost_fit_callbacks

        bar = getattr(getattr(innermost_fit_callbacks(), "_progbar", None), "progbar", None)
        if bar is None or getattr(bar, "verbose", 0) != 1:
            return None
        return (id(bar), getattr(bar, "_last_update", None))  # Keras sets _last_update when the bar prints
    except Exception:  # noqa: BLE001 - the progress bar's internals changed: no mark
        return None


def _progress_bar_mid_line() -> bool:
    """A Keras ``fit`` on this thread has a ``verbose=1`` progress bar that printed a line not ended yet (Keras ends
    it at the epoch's end)."""
    if "keras" not in sys.modules:
        return False
    try:
        from keras_scale.lifecycle import innermost_fit_callbacks

        callbacks = innermost_fit_callbacks()
        bar = getattr(getattr(callbacks, "_progbar", None), "progbar", None)
        if bar is None or getattr(bar, "verbose", 0) != 1:
            return False
        seen, target = getattr(bar, "_seen_so_far", 0), getattr(bar, "target", None)
        return bool(seen) and (target is None or seen < target)
    except Exception:  # noqa: BLE001 - the progress bar's internals changed: no lead
        return False
