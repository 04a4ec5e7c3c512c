"""``interpreter_limitation(exc)``, ``callback_error_line(exc)``: a known interpreter
limitation (``KNOWN_LIMITATIONS``), or an error raised inside an interpreter callback, named
in one line, so a kernel that interpret mode cannot run is reported as such, not as a stack
trace or as a kernel bug; ``limitation_lines(records)`` sums them up per backend.

Imports nothing of jax: the report classifies without loading the patches.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Limitation:
    """An operation interpret mode cannot run, recognised by its exception."""

    operation: str  # what the kernel does that the interpreter cannot run
    types: tuple[str, ...]  # exception type names (anywhere in the cause/context chain)
    pattern: str  # regex on that exception's message or on the innermost traceback text


UNSUPPORTED_PREFIX = "unsupported by interpret mode: "

_VIEW_IN_A_DMA = "where the interpreter takes only indexers (a semaphore)"
KNOWN_LIMITATIONS = (
    # ref_views() covers loads, stores and the two ends of a DMA; semaphores still reach
    # to_range.
    Limitation(f"ref reshape (ReshapeTransform) {_VIEW_IN_A_DMA}", ("AttributeError",),
               r"'ReshapeTransform' object has no attribute 'indices'"),
    Limitation(f"ref bitcast (BitcastTransform) {_VIEW_IN_A_DMA}", ("AttributeError",),
               r"'BitcastTransform' object has no attribute 'indices'"),
    Limitation(f"ref transpose (TransposeTransform) {_VIEW_IN_A_DMA}", ("AttributeError",),
               r"'TransposeTransform' object has no attribute 'indices'"),
    Limitation("store through a ref view that is not one strided box of whole elements", ("NotImplementedError",),
               r"store through a (reshaped ref whose elements|reshaped or bitcast ref that writes part|bitcast ref "
               r"that masks part)"),
    Limitation("sub-byte ref bitcast", ("NotImplementedError",), r"ref bitcast of \w+: sub-byte"),
    # The interpreter's own NotImplementedErrors (interpret_pallas_call.py).
    Limitation("masked load (load_p with mask)", ("NotImplementedError",), r"masked load_p"),
    Limitation("run_scoped with collective axes", ("NotImplementedError",),
               r"run_scoped_p with collective axes is not supported"),
    Limitation("non-decrementing semaphore wait", ("NotImplementedError",),
               r"Non-decrementing wait is not supported"),
    Limitation("a memory space the interpreter does not model", ("NotImplementedError",),
               r"Unsupported memory space"),
    # A kernel that asks the TPU generation in a way emulated_tpu() does not answer.
    Limitation("TPU generation query outside a TPU", ("NotImplementedError", "ValueError"),
               r"TPU version must be 4 or higher|Unsupported TPU device kind"),
)


def exception_chain(exc: BaseException | None) -> list[BaseException]:
    """The exception and its causes (or the exceptions it was raised while handling)."""
    seen, out = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def interpreter_limitation(exc: BaseException) -> str | None:
    """One line naming the interpret-mode limitation that ``exc`` is, or None when it is not
    a known one. The interpreter wraps callback errors (``JaxRuntimeError: INTERNAL:
    CpuCallback error ... AttributeError: ...``), so messages are searched too."""
    for error in exception_chain(exc):
        text = f"{type(error).__name__}: {error}"
        names = {type(error).__name__} | {c.__name__ for c in type(error).__mro__}
        for limitation in KNOWN_LIMITATIONS:
            typed = bool(names & set(limitation.types)) or any(f"{t}: " in text for t in limitation.types)
            if typed and re.search(limitation.pattern, text):
                return f"{UNSUPPORTED_PREFIX}{limitation.operation}"
    return None


def limitation_lines(records) -> list[str]:
    """One line per backend x kernel/impl x limitation (``Record``s in): how many cases
    interpret mode could not run and why."""
    cases: dict[tuple, set] = {}
    for r in records:
        if r.outcome == "error" and r.reason.startswith(UNSUPPORTED_PREFIX):
            key = (r.backend, f"{r.kernel}/{r.impl}", r.reason[len(UNSUPPORTED_PREFIX):])
            cases.setdefault(key, set()).add(r.case_id)
    return [f"{backend}: {kernel}: {len(ids)} case(s) not run, {UNSUPPORTED_PREFIX}{operation}"
            for (backend, kernel, operation), ids in sorted(cases.items())]


_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$", re.MULTILINE)


def callback_error_line(exc: BaseException) -> str | None:
    """For an error raised inside an interpreter callback, which reaches the caller as
    ``JaxRuntimeError: INTERNAL: CpuCallback error calling callback: Traceback ...``, the
    line of the error itself (e.g. ``IndexError: Out-of-bounds read of ...``); else None."""
    text = str(exc)
    if "CpuCallback error" not in text:
        return None
    lines = [m for m in _ERROR_LINE.finditer(text) if m.group(1) != "JaxRuntimeError"]
    if not lines:
        return None
    return f"{lines[-1].group(1)}: {lines[-1].group(2).strip()} (raised in an interpret-mode callback)"
