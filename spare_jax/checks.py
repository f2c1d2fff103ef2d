"""Argument checks shared by the library and the binaries.

Every public function validates what it is given with these, so a bad value
raises one `ValueError` that names the argument and the rule it broke, and
NaN or infinity never slips through a comparison (``nan < 0`` is False).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["bool_mask", "choice", "integer", "no_arguments", "number"]


def integer(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int, or ValueError if it is not an integer in ``[low, high]``.

    Floats are refused even when integral (``2.0``), and so are bools: a
    redundancy of ``2.7`` or ``True`` is a mistake, not a request.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    out = int(value)
    if low is not None and out < low:
        raise ValueError(f"{name} must be >= {low}, got {out}")
    if high is not None and out > high:
        raise ValueError(f"{name} must be <= {high}, got {out}")
    return out


def number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    allow_inf: bool = False,
) -> float:
    """``value`` as a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``).

    NaN is always refused; infinity only with ``allow_inf``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    out = float(value)
    if math.isnan(out) or (math.isinf(out) and not allow_inf):
        raise ValueError(f"{name} must be finite, got {out}")
    if low is not None:
        if low_open and not out > low:
            raise ValueError(f"{name} must be > {low:g}, got {out:g}")
        if not low_open and not out >= low:
            raise ValueError(f"{name} must be >= {low:g}, got {out:g}")
    if high is not None and not out <= high:
        raise ValueError(f"{name} must be <= {high:g}, got {out:g}")
    return out


def choice(name: str, value: Any, options: Iterable[str]) -> str:
    """``value`` if it is one of ``options``, else ValueError listing them."""
    allowed = tuple(options)
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def bool_mask(name: str, value: Any, length: int) -> np.ndarray:
    """``value`` as a bool array of shape ``(length,)``; no silent casts from other dtypes."""
    mask = np.asarray(value)
    if mask.dtype != bool or mask.shape != (length,):
        raise ValueError(
            f"{name} must be a bool array of shape ({length},), got {mask.dtype} {mask.shape}"
        )
    return mask


def no_arguments(name: str, fn: Any) -> None:
    """A function the caller will call with no arguments takes none (ValueError otherwise)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call will say
        return
    try:
        signature.bind()
    except TypeError:
        raise ValueError(
            f"{name}: a function given here is called with no arguments; {fn!r} takes {signature}"
        ) from None
