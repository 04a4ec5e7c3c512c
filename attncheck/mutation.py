"""Mutation testing: plant one known bug in a copy of the project and see the gate fail.

Each mutant is an exact source snippet in a file under ``kernels/`` and its replacement.
The runner copies the project to a temporary directory, applies the mutant (raising if
the snippet does not occur exactly once, so the catalogue cannot rot silently), runs the
gate for that kernel family with ``-x`` and the CI profile, and classifies the mutant:

- killed: the gate failed (time to kill recorded);
- survived: the gate passed: the suite is blind to this bug (or the mutant is equivalent,
  which the catalogue must then say, with the reason);
- timed out: the gate ran past the limit (a hang counts as detected only if the per-test
  timeout turned it into a failure);
- invalid: the mutated project did not even collect (a catalogue error, not a kill).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from attncheck.specs.base import COVERAGE_CACHE_ENV, cache_root_setting

PROJECT_ROOT = pathlib.Path(__file__).resolve().parent.parent
# What a mutated copy needs to run the gate.
COPIED = ("attncheck", "kernels", "tests", "pyproject.toml")
MUTANT_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    family: str  # the KernelSpec name whose gate must kill it
    file: str  # path under the project root
    find: str
    replace: str
    description: str
    bug_class: str
    equivalent: str | None = None  # why no observable difference is possible, if so
    sample: bool = False  # part of the small PR-gate sample (fast to kill)


class CatalogueError(RuntimeError):
    pass


def mutated_source(mutant: Mutant, root: pathlib.Path = PROJECT_ROOT) -> str:
    source = (root / mutant.file).read_text()
    count = source.count(mutant.find)
    if count != 1:
        raise CatalogueError(f"mutant {mutant.id}: snippet occurs {count} times in {mutant.file} "
                             f"(must be exactly once):\n{mutant.find}")
    return source.replace(mutant.find, mutant.replace)


def apply(mutant: Mutant, root: pathlib.Path) -> None:
    (root / mutant.file).write_text(mutated_source(mutant, root))


def gate_command(family: str | None, report_dir: pathlib.Path, extra: tuple[str, ...] = ()) -> list[str]:
    """The family's gate with -x; with family None the whole gate as a developer runs it
    (-x -n auto), which is what the time to kill of a PR means."""
    selection = ("--attncheck-kernel", family) if family else ("-n", "auto")
    return [sys.executable, "-m", "pytest", "tests/gate", "-x", "-q", "-p", "no:cacheprovider",
            "--hypothesis-profile=ci", *selection, "--attncheck-report", str(report_dir), *extra]


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
        apply(mutant, root)
        # The copy must shadow the editable install: cwd and PYTHONPATH come first. Mutants
        # change only kernels/, so the copies reuse this checkout's coverage examples.
        env = dict(os.environ, PYTHONPATH=str(root), CI="true", **{COVERAGE_CACHE_ENV: cache_root_setting()})
        try:
            proc = subprocess.run(gate_command(None if whole_gate else mutant.family, root / "reports"),
                                  cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return _result(mutant, "timed out", start, f"no verdict within {timeout_s:.0f} s")
    output = proc.stdout + proc.stderr
    tail = output.strip().splitlines()[-3:]
    return _result(mutant, verdict(proc.returncode, output, mutant.equivalent), start, " | ".join(tail),
                   killed_by=failed_tests(output))


def failed_tests(output: str) -> list[str]:
    """The tests pytest's summary names as failed: which part of the gate (a family's
    coverage examples or its drawn cases) caught the mutant."""
    return sorted({line.split()[1] for line in output.splitlines() if line.startswith("FAILED ")})


def verdict(returncode: int, output: str, equivalent: str | None) -> str:
    """Classify a gate run on a mutant. xdist reports a run stopped by -x as interrupted
    (exit 2, "stopping after 1 failures"): that is a kill, not a broken catalogue entry."""
    if returncode == 1 or (returncode == 2 and "stopping after 1 failures" in output):
        return "killed"
    if returncode == 0:
        return "equivalent" if equivalent else "survived"
    return "invalid"


def _result(mutant: Mutant, status: str, start: float, detail: str, killed_by: list[str] = ()) -> dict:
    return {"id": mutant.id, "family": mutant.family, "bug_class": mutant.bug_class,
            "description": mutant.description, "status": status, "equivalent": mutant.equivalent,
            "seconds": round(time.perf_counter() - start, 1), "killed_by": list(killed_by) if status == "killed" else [],
            "detail": detail[-600:]}


def summarize(results: list[dict]) -> dict:
    per_kernel: dict[str, dict] = {}
    for r in results:
        row = per_kernel.setdefault(r["family"], {"total": 0, "killed": 0, "survived": 0, "equivalent": 0,
                                                   "timed out": 0, "invalid": 0})
        row["total"] += 1
        row[r["status"]] += 1
    for row in per_kernel.values():
        judged = row["total"] - row["equivalent"] - row["invalid"]
        row["kill_rate"] = row["killed"] / judged if judged else 1.0
    judged = [r for r in results if r["status"] not in ("equivalent", "invalid")]
    return {"per_kernel": per_kernel, "results": results,
            "kill_rate": sum(r["status"] == "killed" for r in judged) / len(judged) if judged else 1.0}


def select(catalogue: list[Mutant], *, kernel=None, ids=None, sample=False) -> list[Mutant]:
    chosen = [m for m in catalogue if (kernel is None or m.family == kernel)
              and (not ids or m.id in ids) and (not sample or m.sample)]
    unknown = set(ids or ()) - {m.id for m in catalogue}
    if unknown:
        raise CatalogueError(f"unknown mutant id(s): {sorted(unknown)}")
    return chosen


def main(args) -> int:
    from attncheck.mutants import CATALOGUE

    chosen = select(CATALOGUE, kernel=args.kernel, ids=args.mutant, sample=args.sample)
    for m in chosen:  # every snippet must apply before anything runs
        mutated_source(m)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = []
        for result in pool.map(functools.partial(run_mutant, whole_gate=args.whole_gate), chosen):
            caught = ", ".join(t.rpartition("[")[2].rstrip("]") for t in result["killed_by"])
            print(f"{result['status']:>10}  {result['id']:<34} {result['seconds']:>6.1f} s  {result['description']}"
                  + (f"  [by {caught}]" if caught else ""), flush=True)
            results.append(result)
    summary = summarize(results)
    report_dir = pathlib.Path(args.report)
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "mutation.json").write_text(json.dumps(summary, indent=1))
    print(f"kill rate {summary['kill_rate']:.0%} of {len(results)} mutants; written to {report_dir / 'mutation.json'}")
    return 0 if all(r["status"] in ("killed", "equivalent") for r in results) else 1

