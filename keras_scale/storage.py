"""Where files live: a local directory or a ``tf.io.gfile`` URL (``gs://``, ``s3://``, ...). Imports no TensorFlow.

One place decides which operations a location supports (exclusive create, links, rename-over, ``mmap``) instead
of ``"://" in path`` checks spread over the pack.

Example:
    >>> Storage("gs://bucket/run1").is_local
    False
    >>> Storage("ckpt").is_local
    True
"""
from __future__ import annotations

import os
import secrets
from typing import Union

__all__ = ["Storage", "create_exclusive", "is_local", "write_atomic"]


def is_local(path: Union[str, os.PathLike]) -> bool:
    """``path`` names the local file system (not a ``scheme://`` URL that ``tf.io.gfile`` resolves).

    Example:
        >>> is_local("/data/ckpt"), is_local("gs://b/ckpt")
        (True, False)
    """
    return "://" not in os.fspath(path)


_is_local = is_local


class Storage:
    """A checkpoint location and what it supports.

    Args:
        path: a local path (resolved to an absolute one now, so a later ``chdir`` does not move it) or a URL.

    Example:
        >>> Storage("gs://bucket/ckpt").path
        'gs://bucket/ckpt'
    """

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        path = os.fspath(path)
        self.is_local = is_local(path)
        self.path = os.path.abspath(path) if self.is_local else path

    def __repr__(self) -> str:
        return f"Storage({self.path!r})"


def create_exclusive(path: str, mode: int = 0o644) -> int:
    """Create ``path`` as a new file and return its descriptor: ``FileExistsError`` if anything (a file, a link)
    is there already; a link is never followed (``O_EXCL | O_NOFOLLOW``).

    Example:
        fd = create_exclusive("ckpt/.tmp-123"); os.write(fd, b"..."); os.close(fd)
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags, mode)


def write_atomic(path: str, data: Union[str, bytes]) -> None:
    """Replace file ``path`` with ``data`` all at once: written to a new, uniquely named temporary file beside it
    (created exclusively: a planted file or link at any fixed temporary name is never written through), then renamed
    over ``path`` (a link at ``path`` is replaced, not followed). ``tf.io.gfile`` URLs: written, then renamed.

    Example:
        write_atomic("ckpt/best/best.json", "[]")
    """
    raw = data.encode() if isinstance(data, str) else data
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
    if not is_local(path):
        import tensorflow as tf

        with tf.io.gfile.GFile(tmp, "wb") as f:
            f.write(raw)
        tf.io.gfile.rename(tmp, path, overwrite=True)
        return
    fd = create_exclusive(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
