"""What a kernel returned, checked with chex against what is expected of it before any
number is compared: one array (not a list, a tuple, a dict or None) of the expected shape,
in the expected dtype.

Used where the output is first seen (``compiled.with_vjp``, at trace time, before the
pullback meets a cotangent of another shape) and per direction against the oracle
(``check.judge``: whatever a spec's ``evaluate`` handed on). A wrong tree or shape cannot
be compared: the record is an error whose reason is chex's message, after the direction
and what came instead of what was expected (chex numbers them: tree or input 0 is what
came). A wrong dtype can be compared: the comparison runs and the record fails, with
chex's message in its reason.

chex's assertions can be switched off for a whole process (``chex.disable_asserts``), and
a user's module may do that; the checks a verdict rests on stay underneath
(``numerics.compare`` refuses another shape, ``check.judge`` compares the dtypes itself),
so without chex's assertions a run loses the messages, never a failure.
"""

from __future__ import annotations

from collections.abc import Sequence

import chex
import jax
import numpy as np


def _one_line(exc: BaseException) -> str:
    """chex's message on one line (its tree messages break lines; a record's reason is one)."""
    return " ".join(str(exc).split())


def mismatch(what: str, got, shape: Sequence[int]) -> str | None:
    """Why ``got`` (an array, a tracer, or anything a kernel returned) is not one array of
    ``shape``, in chex's words after ``what`` it is; None when it is."""
    shape = tuple(int(n) for n in shape)
    try:
        # The dtype is not compared here: a ShapeDtypeStruct is one leaf, as an array is.
        chex.assert_trees_all_equal_structs(got, jax.ShapeDtypeStruct(shape, np.float32))
    except AssertionError as exc:
        return (f"{what}: the implementation returned {type(got).__name__}, expected an array of shape {shape} "
                f"({_one_line(exc)})")
    try:
        chex.assert_shape(got, shape)
    except AssertionError as exc:
        return f"{what}: shapes differ ({_one_line(exc)})"
    return None


def dtype_mismatch(got, dtype) -> str | None:
    """chex's message for an array of another dtype than ``dtype``; None when it is not
    (or chex's assertions are off)."""
    try:
        chex.assert_type(got, np.dtype(dtype))
    except AssertionError as exc:
        return _one_line(exc)
    return None
