"""Parametrize the generic gate over kernel family x implementation x backend."""

from __future__ import annotations

import pytest

from attncheck import backends, gate, scheduling, specs
from attncheck.specs.base import coverage_examples


def selected_specs(config) -> list:
    wanted = config.getoption("--attncheck-kernel")
    known = specs.all_specs()
    if not wanted:
        return list(known.values())
    names = [n.strip() for n in wanted.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise pytest.UsageError(f"--attncheck-kernel: unknown families {unknown}; known: {sorted(known)}")
    return [known[n] for n in names]


def gate_targets(config) -> list:
    """(spec, implementation name, implementation reference, backend, part, coverage share)
    params; the coverage examples are searched here, once per process (cached)."""
    chosen = backends.parse_backend_option(config.getoption("--attncheck-backend"))
    overrides = specs.parse_impl_overrides(config.getoption("--attncheck-impl"))
    params = []
    for spec in selected_specs(config):
        impls = ({"user": overrides[spec.name]} if spec.name in overrides else dict(spec.default_impls))
        for impl_name, ref in impls.items():
            for name in spec.backends:
                if name not in chosen:
                    continue
                reason = backends.BACKENDS[name].unavailable_reason()
                marks = [pytest.mark.skip(reason=f"backend {name} unavailable: {reason}")] if reason else []
                target = f"{spec.name}-{impl_name}-{name}"
                if name == spec.backends[0] and spec.coverage_classes:
                    shares = gate.coverage_shares(len(coverage_examples(spec)))
                    for index, count in shares:
                        suffix = "" if count == 1 else f"{index + 1}of{count}"
                        params.append(pytest.param(
                            (spec, impl_name, ref, name, gate.COVERAGE, (index, count)),
                            marks=[*marks, getattr(pytest.mark, scheduling.FAIL_FAST_MARKER)(lead=index == 0)],
                            id=f"{target}-{gate.COVERAGE}{suffix}"))
                params.append(pytest.param((spec, impl_name, ref, name, gate.DRAWN, None), marks=marks,
                                           id=f"{target}-{gate.DRAWN}"))
    return params


def pytest_generate_tests(metafunc):
    if "gate_target" in metafunc.fixturenames:
        metafunc.parametrize("gate_target", gate_targets(metafunc.config))
    if "gate_invalid" in metafunc.fixturenames:
        # One test per validation branch of each family; a family that declares none
        # simply contributes no test.
        metafunc.parametrize("gate_invalid", [
            pytest.param(call, id=f"{spec.name}-{call.description}")
            for spec in selected_specs(metafunc.config) for call in spec.invalid_calls()])


def pytest_collection_modifyitems(config, items):
    """--attncheck-kernel also selects the gate's other tests, by their family marker:
    a mutant of one family must be judged by that family's tests alone."""
    if not config.getoption("--attncheck-kernel"):
        return
    wanted = {spec.name for spec in selected_specs(config)}
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("attncheck_family")
        (drop if marker is not None and marker.args[0] not in wanted else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
