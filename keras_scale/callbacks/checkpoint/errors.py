"""The errors ChiefCheckpoint raises at a run's boundaries: a save that failed, a rerun of a completed run.

A failed save is never let out as the error TensorFlow raised: TensorFlow raises ``tf.errors.OutOfRangeError`` for
EFBIG ("File too large"), and Keras's ``fit`` reads that type (and ``StopIteration``) from a callback as "the data
ran out" and ends the epoch quietly. :class:`CheckpointSaveError` is neither, so ``fit`` stops with it.

Example:
    try:
        model.fit(ds, epochs=3, callbacks=[ks.ChiefCheckpoint("ckpt")])
    except CheckpointSaveError as e:
        print(e.errno_name, e.filename)   # e.g. EFBIG /ckpt/ckpt-16.data-00000-of-00001.tempstate...
        print(type(e.original))          # what TensorFlow raised, e.g. tf.errors.OutOfRangeError
"""
from __future__ import annotations

import errno as _errno
import os
import re
from typing import Optional

# errno -> what to do (the errors a checkpoint write meets on a real machine)
_FIXES = {
    _errno.EFBIG: "a file-size limit (`ulimit -f`, RLIMIT_FSIZE, a scheduler's per-file limit) or the file system's "
                  "largest file is smaller than the checkpoint: raise the limit, or give ChiefCheckpoint a directory "
                  "on a file system that takes files this large",
    _errno.ENOSPC: "the disk is full: free space, lower max_to_keep, or give ChiefCheckpoint a directory on another "
                   "disk",
    _errno.EROFS: "the file system is read-only (remounted read-only after an error?): give ChiefCheckpoint a "
                  "writable directory",
    _errno.EIO: "the disk or network file system reported an I/O error: check the device/mount (dmesg) before "
                "trusting it with checkpoints",
    _errno.EACCES: "this process may not write there: fix the directory's permissions or use another directory",
    _errno.EPERM: "this process may not write there: fix the directory's permissions or use another directory",
}
if hasattr(_errno, "EDQUOT"):
    _FIXES[_errno.EDQUOT] = "the disk quota is exhausted: free space in your quota or use another directory"
_DEFAULT_FIX = "fix the cause above (space, limits, permissions, the mount) or give ChiefCheckpoint another directory"


def errno_of(error: BaseException) -> Optional[int]:
    """The errno behind ``error``: an ``OSError``'s own, else found by its text in a TensorFlow error's message
    (TensorFlow keeps only ``strerror``: "File too large", "No space left on device", ...); ``None`` if unknown.

    Example:
        >>> import errno, tensorflow as tf
        >>> errno_of(tf.errors.OutOfRangeError(None, None, "/d/x.tempstate1; File too large")) == errno.EFBIG
        True
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            return int(error.errno)
        text = str(getattr(error, "message", None) or error)
        for code in list(_FIXES) + [_errno.ENOMEM, _errno.ENAMETOOLONG, _errno.EMFILE]:
            if os.strerror(code) in text:
                return code
        error = error.__cause__ or error.__context__
    return None


def _filename_of(error: BaseException, directory: Optional[str] = None) -> Optional[str]:
    """The file a write error names: an ``OSError``'s ``filename``; in a TensorFlow message ("... <path>; File too
    large [Op:SaveV2]") the path inside ``directory`` (found by that prefix, so spaces or brackets in it are kept)."""
    if isinstance(error, OSError) and error.filename:
        return str(error.filename)
    text = str(getattr(error, "message", None) or error)
    if directory:
        start = text.find(directory)
        if start >= 0:
            end = text.find(";", start)
            return text[start:end if end >= 0 else len(text)].split("\n")[0].strip()
    match = re.search(r"(?:^|\s)(/[^\s;]+)", text)
    return match.group(1) if match else None


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (disk full, file too large, read-only, I/O error...): ``fit`` stops.

    Not a ``tf.errors.OutOfRangeError`` nor a ``StopIteration`` (which Keras's ``fit`` reads as the end of the data)
    nor a ``tf.errors.ResourceExhaustedError`` (read as out of memory): whatever TensorFlow raised is its
    ``original`` attribute (not reliably its ``__cause__``: Keras's traceback filtering re-raises the error
    ``from None`` on its way out of ``fit``). Attributes: ``original`` (the exception the save met), ``errno``
    (``None`` if unknown), ``errno_name`` (``"EFBIG"``...), ``filename`` (the file that failed, as the error named
    it), ``prefix`` (the checkpoint being written), ``newest_usable`` (the newest complete checkpoint: what a rerun
    resumes from; ``None``: none).

    Example:
        >>> e = CheckpointSaveError("saving 'ckpt/ckpt-8' failed", errno=27, prefix="ckpt/ckpt-8")
        >>> e.errno_name
        'EFBIG'
    """

    def __init__(self, message: str, errno: Optional[int] = None, filename: Optional[str] = None,
                 prefix: Optional[str] = None, newest_usable: Optional[str] = None,
                 original: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.original = original
        self.errno = errno
        self.errno_name = _errno.errorcode.get(errno, None) if errno is not None else None
        self.filename = filename
        self.prefix = prefix
        self.newest_usable = newest_usable


def save_error(error: BaseException, what: str, newest_usable: Optional[str], newest_step: Optional[int],
               prefix: Optional[str], directory: Optional[str] = None) -> CheckpointSaveError:
    """The :class:`CheckpointSaveError` for ``error`` met while ``what`` (e.g. "saving 'ckpt/ckpt-16'"): names the
    file, the errno, the newest usable checkpoint and what to do."""
    code = errno_of(error)
    filename = _filename_of(error, directory)
    name = _errno.errorcode.get(code, "") if code is not None else ""
    first = (str(getattr(error, "message", None) or error).splitlines() or [""])[0][:400]
    cause = (f"[Errno {code}] {os.strerror(code)} ({name}, raised by TensorFlow as {type(error).__name__})"
             if code is not None else f"{type(error).__name__}: {first}")
    newest = (f"the newest usable checkpoint is {newest_usable!r} (global batch {newest_step}): a rerun resumes there"
              if newest_usable else "no usable checkpoint exists yet: a rerun starts afresh")
    message = (f"ChiefCheckpoint: {what} failed: {cause}" + (f", writing {filename!r}" if filename else "")
               + f". Training stopped (nothing trained from here on could be saved); {newest}. "
               f"Fix: {_FIXES.get(code, _DEFAULT_FIX)}.")
    return CheckpointSaveError(message, errno=code, filename=filename, prefix=prefix, newest_usable=newest_usable,
                               original=error)


class RunCompletedError(RuntimeError):
    """``fit`` on a directory whose run is already completed, where restoring it would not be what was asked:
    ``ChiefCheckpoint(on_completed="error")``, or (the default ``"restore"``) a fit whose configuration differs
    from the completed run's. The message says the completed run's epoch and the options.

    Example:
        try:
            model.fit(ds, epochs=3, callbacks=[ChiefCheckpoint("ckpt", on_completed="error")])
        except RunCompletedError as e:
            print(e)   # ... already completed at epoch 3 ...
    """
