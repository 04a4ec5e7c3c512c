"""The configurations an implementation supports, declared on the implementation itself.

A Pallas kernel often runs only on sequences of whole tiles (tokamax's ``mosaic`` path
takes blocks of 128). Refusing every other case verifies nothing, so a ``Domain`` also says
how the family's draws are *fitted* to it: ``sequence_multiple`` makes the family round
each drawn sequence length up to a multiple, keeping what the classes read of the shape
(``KernelSpec.fit_sequences``: T < S stays T < S), so the drawn cases still reach every
class the implementation can take. A class that cannot survive the fit (one query token
under tiles of 128) is then a coverage hole, named by ``--attncheck-require-coverage``.
``takes`` names parameters the implementation takes one value of (tpu-inference's
``kernel_hd64.py`` takes head_dim 64 alone): the draws are set to it, as to a sequence
multiple, so they still reach what the implementation can take.
``supports`` is a predicate over a case's params: a case outside it is not run, and its
record says *unsupported by the implementation* (never a pass, listed with its classes),
as for a refusal declared in a table of expectations (``attncheck.expectations``)::

    @attncheck.domain.declare(sequence_multiple=128, supports=lambda p: p.bias == "none",
                              description="no bias")
    def my_attention(query, key, value, ...): ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

ATTRIBUTE = "attncheck_domain"
# What the record of a case outside a domain names as the declaration that left it out.
DECLARED = "the implementation's Domain (attncheck.domain)"


@dataclasses.dataclass(frozen=True)
class Domain:
    """``sequence_multiple``: every sequence length the implementation takes is a multiple
    of it; ``supports(params)``: whether it takes a case (``description`` says which, in
    words, for the record of one it does not)."""

    sequence_multiple: int = 1
    supports: Callable[[Any], bool] | None = None
    description: str = ""
    takes: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # params field -> its one value

    def __post_init__(self):
        if not isinstance(self.takes, Mapping) or not all(isinstance(k, str) for k in self.takes):
            raise TypeError(f"Domain: takes must map parameter names to the one value each takes, got "
                            f"{self.takes!r}")
        if isinstance(self.sequence_multiple, bool) or not isinstance(self.sequence_multiple, int) \
                or self.sequence_multiple < 1:
            raise ValueError(f"Domain: sequence_multiple must be a positive int, got {self.sequence_multiple!r}")
        if self.supports is not None and not callable(self.supports):
            raise TypeError(f"Domain: supports must be a predicate over a case's params, got "
                            f"{type(self.supports).__name__}")
        if self.supports is not None and not self.description.strip():
            raise ValueError("Domain: a supports predicate needs a description (what it admits, in words): "
                             "it is the reason in the record of every case it refuses")

    def refusal(self, params, fit: Callable[[Any, int], Any]) -> str | None:
        """Why a case is outside the domain, or None when the implementation takes it
        (``fit``: the family's ``fit_sequences``)."""
        if self.sequence_multiple > 1 and fit(params, self.sequence_multiple) != params:
            return f"its sequence lengths are multiples of {self.sequence_multiple}; this case's are not"
        for name, value in self.takes.items():
            if getattr(params, name) != value:
                return f"it takes {name}={value!r} alone; this case has {getattr(params, name)!r}"
        if self.supports is not None and not self.supports(params):
            return f"outside its declared domain ({self.description})"
        return None


FULL = Domain()


def check_takes(declared: Domain, params_type: type) -> None:
    """That every parameter ``declared`` takes one value of is a field of the family's
    params (a typo would otherwise fit nothing and refuse every case)."""
    unknown = sorted(set(declared.takes) - {f.name for f in dataclasses.fields(params_type)})
    if unknown:
        raise ValueError(f"Domain: takes names {unknown}, which are not parameters of {params_type.__name__}")


def taken(declared: Domain, params):
    """``params`` with each parameter the domain takes one value of set to that value."""
    return dataclasses.replace(params, **declared.takes) if declared.takes else params


def round_up(length: int, multiple: int) -> int:
    """The least multiple of ``multiple`` at or above ``length``."""
    return -(-length // multiple) * multiple


def of(impl: Callable) -> Domain:
    """The domain an implementation declares (``FULL`` when it declares none)."""
    found = getattr(impl, ATTRIBUTE, FULL)
    if not isinstance(found, Domain):
        raise TypeError(f"{getattr(impl, '__qualname__', impl)!r}.{ATTRIBUTE} must be an attncheck.domain.Domain, "
                        f"got {type(found).__name__}")
    return found


def declare(**fields) -> Callable[[Callable], Callable]:
    """Decorator: the implementation takes the ``Domain(**fields)``."""
    declared = Domain(**fields)

    def mark(impl: Callable) -> Callable:
        setattr(impl, ATTRIBUTE, declared)
        return impl

    return mark
