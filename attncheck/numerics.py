"""Error metrics and the tolerance policy.

A kernel output is judged against the float64 oracle relative to how well the naive
same-precision XLA implementation (the *yardstick*, ``attncheck.yardstick``) does on the
same rounded inputs:

    err_k   = max |kernel - oracle64|      over the elements the spec cares about
    err_y   = max |yardstick - oracle64|
    allowed = R * err_y + A
    pass   <=> err_k <= allowed  and  NaN/Inf positions (and Inf signs) agree exactly

R is a property of the direction (outputs vs gradients: gradients go through one more
reduction over the sequence, whose order differs legitimately between implementations).
A is a floor of a few ulps of the *output* dtype at the oracle's magnitude, so that a
yardstick that happens to be exact (err_y == 0) cannot make the rule impossible to meet.
Nothing here is tuned per test: a case that needs a wider tolerance is a finding.

A direction that is a copy, not a computation (a KV cache the kernel writes new tokens
into), is compared exactly (``exact=True``): R = A = 0, every element equal to the oracle's
and NaN where it has NaN.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

# Outputs are a softmax-weighted average: the kernel may reassociate it (online softmax) but
# should not be more than twice as far from the truth as the naive computation.
R_OUTPUT = 2.0
# Gradients add a reduction over the other sequence axis whose order is implementation
# defined (blockwise accumulation vs one dot), so they get more room.
R_GRADIENT = 3.0
# The floor: this many ulps of the output dtype at the oracle's largest magnitude.
FLOOR_ULPS = 4.0


def r_for_direction(direction: str) -> float:
    return R_OUTPUT if direction in ("out", "lse") else R_GRADIENT


def dtype_eps(dtype) -> float:
    return float(ml_dtypes.finfo(np.dtype(dtype)).eps)


def dtype_tiny(dtype) -> float:
    return float(ml_dtypes.finfo(np.dtype(dtype)).smallest_normal)


def ulp_of(values: np.ndarray, dtype) -> np.ndarray:
    """Spacing of `dtype` at each (float64) value: the size of one ulp there."""
    finfo = ml_dtypes.finfo(np.dtype(dtype))
    mantissa_bits = int(finfo.nmant)
    magnitude = np.maximum(np.abs(values), float(finfo.smallest_normal))
    exponent = np.floor(np.log2(magnitude))
    return np.exp2(exponent - mantissa_bits)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Everything a report needs about one kernel-vs-oracle comparison."""

    passed: bool
    reason: str
    max_abs: float
    max_rel: float
    mean_abs: float
    ulp_p50: float
    ulp_p99: float
    ulp_max: float
    cosine: float
    yardstick_err: float
    yardstick_ulps: float  # yardstick error in ulps of the dtype at the oracle's magnitude
    r: float
    a: float
    allowed: float
    budget: float
    worst_index: tuple[int, ...] | None
    worst_kernel: float | None
    worst_oracle: float | None
    compared: int

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["worst_index"] = list(self.worst_index) if self.worst_index is not None else None
        return {k: json_float(v) for k, v in out.items()}

    @classmethod
    def from_json(cls, data: dict) -> Comparison:
        values = {k: (float(v) if isinstance(v, str) else v) for k, v in data.items() if k != "reason"}
        if values.get("worst_index") is not None:
            values["worst_index"] = tuple(values["worst_index"])
        return cls(reason=data["reason"], **values)


def json_float(value):
    """JSON has no inf/nan: written as the strings "inf", "-inf", "nan" (readable, lossless)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _nonfinite_mismatch(kernel: np.ndarray, oracle: np.ndarray, care: np.ndarray) -> str | None:
    for name, predicate in (("NaN", np.isnan), ("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        k, o = predicate(kernel) & care, predicate(oracle) & care
        if not np.array_equal(k, o):
            where = np.argwhere(k != o)[0]
            return (f"{name} positions differ: kernel has {int(k.sum())}, oracle has {int(o.sum())}; "
                    f"first mismatch at index {tuple(int(i) for i in where)}")
    return None


def distance(values, oracle: np.ndarray, where=None) -> float:
    """max |values - oracle| over the elements ``where`` says (all with None) at which both
    are finite; 0 where there are none."""
    values, oracle = np.asarray(values, dtype=np.float64), np.asarray(oracle, dtype=np.float64)
    where = (np.ones(oracle.shape, dtype=bool) if where is None
             else np.broadcast_to(np.asarray(where, bool), oracle.shape))
    difference = np.abs(values[where] - oracle[where])
    return float(np.max(difference[np.isfinite(difference)], initial=0.0))


def compare(kernel, oracle, yardstick, *, dtype, direction: str, care=None, exact: bool = False) -> Comparison:
    """Judge `kernel` (any float dtype) against `oracle` (float64) using the `yardstick`.

    `yardstick` is one array or a tuple of them (the same naive computation summed in
    several orders): its error is the largest of theirs. `dtype` is the dtype the kernel's
    output is delivered in (ulps are counted in it); `care` is an optional boolean mask
    broadcastable to the arrays: False marks don't-care elements (padding rows) that are
    excluded from every metric; ``exact``: no tolerance at all (a copied direction).
    """
    kernel = np.asarray(kernel, dtype=np.float64)
    oracle = np.asarray(oracle, dtype=np.float64)
    yardsticks = [np.asarray(y, dtype=np.float64)
                  for y in (yardstick if isinstance(yardstick, tuple) else (yardstick,))]
    if kernel.shape != oracle.shape or any(y.shape != oracle.shape for y in yardsticks):
        raise ValueError(f"{direction}: shapes differ: kernel {kernel.shape}, oracle {oracle.shape}, "
                         f"yardstick {', '.join(str(y.shape) for y in yardsticks)}")
    if care is None:
        care = np.ones(oracle.shape, dtype=bool)
    care = np.broadcast_to(np.asarray(care, dtype=bool), oracle.shape)
    k, o = kernel[care], oracle[care]
    r = 0.0 if exact else r_for_direction(direction)
    finite_o = o[np.isfinite(o)]
    scale = float(np.max(np.abs(finite_o))) if finite_o.size else 0.0
    a = 0.0 if exact else FLOOR_ULPS * dtype_eps(dtype) * scale + dtype_tiny(dtype)

    mismatch = _nonfinite_mismatch(kernel, oracle, care)
    both_finite = np.isfinite(k) & np.isfinite(o)
    kf, of = k[both_finite], o[both_finite]
    abs_err = np.abs(kf - of)
    judged = np.zeros(oracle.shape, dtype=bool)
    judged[care] = both_finite
    yardstick_err = max(distance(y, oracle, judged) for y in yardsticks)
    allowed = r * yardstick_err + a
    max_abs = float(np.max(abs_err, initial=0.0))
    rel_denominator = np.maximum(np.abs(of), dtype_eps(dtype) * max(scale, dtype_tiny(dtype)))
    ulps = abs_err / ulp_of(of, dtype) if abs_err.size else np.zeros(1)
    # einsum, not np.dot or np.linalg.norm: those call the BLAS library, whose kernels sum in
    # an order that depends on the host's CPU.
    norm = math.sqrt(float(np.einsum("i,i->", kf, kf)) * float(np.einsum("i,i->", of, of)))
    cosine = float(np.einsum("i,i->", kf, of) / norm) if norm > 0 else (1.0 if max_abs == 0 else 0.0)

    worst_index = worst_kernel = worst_oracle = None
    if abs_err.size:
        flat_care = np.flatnonzero(care)[np.flatnonzero(both_finite)]
        flat = int(flat_care[int(np.argmax(abs_err))])
        worst_index = tuple(int(i) for i in np.unravel_index(flat, oracle.shape))
        worst_kernel, worst_oracle = float(kernel[worst_index]), float(oracle[worst_index])

    if mismatch:
        passed, reason, budget = False, mismatch, math.inf
    elif exact:
        differing = int(np.count_nonzero(abs_err))
        passed, budget = differing == 0, (0.0 if differing == 0 else math.inf)
        reason = "ok" if passed else (f"{differing} of {abs_err.size} elements differ from the oracle (max abs "
                                      f"{max_abs:.3g}); {direction} is compared exactly")
    else:
        budget = max_abs / allowed
        passed = max_abs <= allowed
        reason = ("ok" if passed else
                  f"max abs error {max_abs:.3g} > allowed {allowed:.3g} "
                  f"(= {r:g} x yardstick error {yardstick_err:.3g} + floor {a:.3g})")
    return Comparison(
        passed=passed, reason=reason, max_abs=max_abs,
        max_rel=float(np.max(abs_err / rel_denominator, initial=0.0)),
        mean_abs=float(np.mean(abs_err)) if abs_err.size else 0.0,
        ulp_p50=float(np.percentile(ulps, 50)), ulp_p99=float(np.percentile(ulps, 99)),
        ulp_max=float(np.max(ulps)), cosine=cosine, yardstick_err=yardstick_err,
        yardstick_ulps=yardstick_err / float(ulp_of(np.array(scale), dtype)) if scale > 0 else 0.0,
        r=r, a=a,
        allowed=allowed, budget=float(budget), worst_index=worst_index,
        worst_kernel=worst_kernel, worst_oracle=worst_oracle, compared=int(care.sum()))
