"""A mutation campaign: plant each mutant in a temporary copy of the project, run the gate
with ``-x``, and classify the mutant from the mutated run's own report:

- killed: the gate failed a case or a test (time to kill recorded, with the tests that
  caught it);
- survived: the gate passed: the suite is blind to this bug (or the mutant is equivalent,
  which the catalogue must then say, with the reason);
- timed out: the gate ran past the limit (a hang counts as detected only if the per-test
  timeout turned it into a failure);
- invalid: the mutated run verified nothing or failed for another reason (a catalogue or
  harness error, not a kill).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from attncheck import cache_root
from attncheck.report.model import mutation_summary
from attncheck.mutation.mutant import (
    PROJECT_ROOT,
    CatalogueError,
    Mutant,
    apply,
    mutated_source,
)
from attncheck.scheduling import Shard

# What a mutated copy needs to run the gate.
COPIED = ("attncheck", "kernels", "tests", "pyproject.toml")
MUTANT_TIMEOUT_S = 900
KERNELS_PACKAGE = "attncheck_kernels"


def gate_command(family: str | None, report_dir: pathlib.Path, extra: tuple[str, ...] = ()) -> list[str]:
    """The family's gate with -x; with family None the whole gate as a developer runs it
    (-x -n auto), which is what the time to kill of a PR means."""
    selection = ("--attncheck-kernel", family) if family else ("-n", "auto")
    return [sys.executable, "-m", "pytest", "--pyargs", "attncheck.gate", "tests/gate", "-x", "-q",
            "-p", "no:cacheprovider", "--hypothesis-profile=ci", *selection, "--attncheck-report", str(report_dir),
            *extra]


def run_mutant(mutant: Mutant, timeout_s: float = MUTANT_TIMEOUT_S, whole_gate: bool = False) -> dict:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"attncheck-mutant-{mutant.id}-") as tmp:
        root = pathlib.Path(tmp)
        for name in COPIED:
            src = PROJECT_ROOT / name
            if src.is_dir():
                shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, root / name)
        # The kernels import as attncheck_kernels (pyproject's package-dir): the copy's own
        # must be the ones found.
        (root / KERNELS_PACKAGE).symlink_to("kernels", target_is_directory=True)
        apply(mutant, root)
        # The copy must shadow the editable install: cwd and PYTHONPATH come first. Mutants
        # change only kernels and module copies, so the copies reuse this checkout's
        # coverage examples, and its compiled executables wherever the mutant leaves the
        # lowered program unchanged (the compilation cache is keyed by it); what the mutant
        # compiles goes to a private copy of the cache and ends with it, so that each
        # mutant's time to kill is that of a new bug on this checkout's warm cache.
        cache = cache_root.private_copy(root / "cache")
        env = dict(os.environ, PYTHONPATH=str(root), CI="true", **{cache_root.CACHE_ENV: cache})
        report_dir = root / "reports"
        try:
            proc = subprocess.run(gate_command(None if whole_gate else mutant.family, report_dir,
                                               mutant.impl_override),
                                  cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return _result(mutant, "timed out", start, f"no verdict within {timeout_s:.0f} s")
        status, caught = verdict(report_dir, mutant.equivalent)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    return _result(mutant, status, start, " | ".join(tail), killed_by=caught)


def failed_tests(junit: pathlib.Path) -> list[str]:
    """The tests junit.xml says failed or errored: which part of the gate (a family's
    coverage examples or its drawn cases) caught the mutant."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return []
    return sorted({f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
                   if case.find("failure") is not None or case.find("error") is not None})


def verdict(report_dir: pathlib.Path, equivalent: str | None) -> tuple[str, list[str]]:
    """(status, tests that caught it) from the mutated run's report: a FAIL with a failing
    record or a failed test is a kill (a run stopped by -x is incomplete, and still one);
    a PASS is a survivor; anything else (no report, NO CASES, a FAIL of the harness) is
    invalid."""
    try:
        report = json.loads((report_dir / "report.json").read_text())
    except (OSError, ValueError):
        return "invalid", []
    caught = failed_tests(report_dir / "junit.xml")
    if report.get("verdict") == "FAIL" and (caught or report["totals"]["failures"]):
        return "killed", caught
    if report.get("verdict") == "PASS":
        return ("equivalent" if equivalent else "survived"), []
    return "invalid", []


def _result(mutant: Mutant, status: str, start: float, detail: str, killed_by: list[str] = ()) -> dict:
    return {"id": mutant.id, "family": mutant.family, "bug_class": mutant.bug_class,
            "description": mutant.description, "status": status, "equivalent": mutant.equivalent,
            "seconds": round(time.perf_counter() - start, 1),
            "killed_by": list(killed_by) if status == "killed" else [],
            "detail": detail[-600:]}


def select(catalogue: list[Mutant], *, kernel=None, ids=None, sample=False, shard: Shard | None = None) -> list[Mutant]:
    """The mutants asked for; of them, with ``shard`` K/N, every N-th from the K-th (in the
    catalogue's order, so that each shard of a nightly run gets its share of every family)."""
    chosen = [m for m in catalogue if (kernel is None or m.family == kernel)
              and (not ids or m.id in ids) and (not sample or m.sample)]
    unknown = set(ids or ()) - {m.id for m in catalogue}
    if unknown:
        raise CatalogueError(f"unknown mutant id(s): {sorted(unknown)}")
    return chosen if shard is None else chosen[shard.index - 1::shard.count]


def main(args) -> int:
    from attncheck.mutation.catalogue import CATALOGUE

    chosen = select(CATALOGUE, kernel=args.kernel, ids=args.mutant, sample=args.sample, shard=args.shard)
    for m in chosen:  # every snippet must apply before anything runs
        mutated_source(m)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = []
        for result in pool.map(functools.partial(run_mutant, whole_gate=args.whole_gate), chosen):
            caught = ", ".join(t.rpartition("[")[2].rstrip("]") for t in result["killed_by"])
            print(f"{result['status']:>10}  {result['id']:<34} {result['seconds']:>6.1f} s  {result['description']}"
                  + (f"  [by {caught}]" if caught else ""), flush=True)
            results.append(result)
    summary = mutation_summary(results)
    report_dir = pathlib.Path(args.report)
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "mutation.json").write_text(json.dumps(summary, indent=1))
    print(f"kill rate {summary['kill_rate']:.0%} of {len(results)} mutants; written to {report_dir / 'mutation.json'}")
    return 0 if all(r["status"] in ("killed", "equivalent") for r in results) else 1

