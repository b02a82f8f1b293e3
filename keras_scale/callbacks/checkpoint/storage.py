"""Where checkpoints live: a local directory or a ``tf.io.gfile`` URL (``gs://``, ``s3://``, ...).

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
from typing import Union

__all__ = ["Storage", "is_local"]


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
