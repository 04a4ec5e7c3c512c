"""The coverage table: how many cases exercised each bug class of each family, how many of
them failed, and the applicable classes no case exercised (coverage holes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from attncheck.expectations import refused
from attncheck.report.records import Record


@dataclasses.dataclass
class ClassCount:
    cases: int = 0
    failures: int = 0


def table(records: list[Record], applicable: Mapping[str, tuple[str, ...]]) -> dict[str, dict[str, ClassCount]]:
    """kernel -> class -> cases that exercised it (one per case and backend) and how many
    of those failed. Kernels with no record are left out; applicable classes with no case
    are listed with 0. A case its implementation refused as unsupported exercised nothing."""
    result: dict[str, dict[str, ClassCount]] = {}
    for kernel, classes in applicable.items():
        if any(r.kernel == kernel for r in records):
            result[kernel] = {c: ClassCount() for c in classes}
    passed: dict[tuple, bool] = {}
    classes_of: dict[tuple, list[str]] = {}
    for r in records:
        if refused(r):
            continue
        key = (r.kernel, r.case_id, r.backend)
        passed[key] = passed.get(key, True) and not r.failing
        classes_of.setdefault(key, r.classes)
    for key, names in classes_of.items():
        for name in names:
            count = result.setdefault(key[0], {}).setdefault(name, ClassCount())
            count.cases += 1
            count.failures += not passed[key]
    return result


def missing(counts: Mapping[str, Mapping[str, ClassCount]],
            applicable: Mapping[str, tuple[str, ...]]) -> dict[str, list[str]]:
    """kernel -> applicable classes no case exercised."""
    holes = {kernel: [c for c, n in classes.items() if n.cases == 0 and c in applicable.get(kernel, ())]
             for kernel, classes in counts.items()}
    return {kernel: names for kernel, names in holes.items() if names}
