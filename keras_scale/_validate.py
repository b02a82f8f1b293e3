"""Argument checks shared by every keras_scale piece: one wording for "what was wrong, what to do".

Example:
    >>> check_int("accum", 4)
    4
    >>> check_int("num_steps", 0, hint="It is how many steps to profile (e.g. 5).")
    Traceback (most recent call last):
    ValueError: num_steps must be an integer >= 1, got 0. It is how many steps to profile (e.g. 5).
"""
from __future__ import annotations

import numbers
from typing import Any


def check_int(name: str, value: Any, minimum: int = 1, hint: str = "", owner: str = "") -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) ``>= minimum``; else a ``ValueError`` naming it.

    Example:
        >>> check_int("max_to_keep", 3)
        3
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        prefix = f"{owner}: " if owner else ""
        suffix = f" {hint}" if hint else ""
        raise ValueError(f"{prefix}{name} must be an integer >= {minimum}, got {value!r}.{suffix}")
    return int(value)


def check_number(name: str, value: Any, minimum: float, hint: str = "", owner: str = "") -> float:
    """``value`` as a ``float`` if it is a real number (not a bool) ``>= minimum``; else a ``ValueError``.

    Example:
        >>> check_number("min_growth_mb_per_epoch", 32.0, 0)
        32.0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= minimum:
        prefix = f"{owner}: " if owner else ""
        suffix = f" {hint}" if hint else ""
        raise ValueError(f"{prefix}{name} must be a number >= {minimum}, got {value!r}.{suffix}")
    return float(value)
