"""The third-party kernels docs/families.md calls adoptable, each adopted as a new user would, at the
current draws: copied into a package of the user's repository, the gate run bare, then
``attncheck expectations init``, then the gate again with the table it wrote, which must
pass. Under that table a planted bug still fails, and an entry the kernel satisfies is
stale. A new class, pair or value cell that breaks adoption fails here, not a user."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from attncheck import expectations
from attncheck.expectations import BUG_CLASS, Expectation
from attncheck.mutation import catalogue
from attncheck.mutation.mutant import Mutant, mutated_source

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "their_kernels"
# The planted bug and the stale entry are shown on the coverage examples where the numerics
# run; the bare and adopted gates run every backend, as an adopter's first run does.
STRICTNESS = ("--attncheck-backend", "interpret", "-k", "coverage")
RUN_TIMEOUT_S = 1200
FIGURES = ROOT / "reports" / "adoption"
_JAX_TPU = "jax.experimental.pallas.ops.tpu"


@dataclasses.dataclass(frozen=True)
class Adoptee:
    """A kernel as an adopter has it: jax's module ``source`` copied into their package, a
    bug to plant in that copy (``planted``, a mutant of ``source``), and the bug classes of
    the kernel's findings (docs/findings.md), the ones the table must name."""

    family: str
    source: str
    function: str
    planted: Mutant
    declares: frozenset[str]  # the bug classes of its findings, which init must name

    @property
    def copy(self) -> str:
        return f"{PACKAGE}.{self.source.rpartition('.')[2]}"

    @property
    def ref(self) -> str:
        return f"{self.copy}:{self.function}"


def _catalogue(mutant_id: str) -> Mutant:
    return next(m for m in catalogue.CATALOGUE if m.id == mutant_id)


ADOPTEES = (
    Adoptee("flash_attention", f"{_JAX_TPU}.flash_attention", "flash_attention", Mutant(
        "jax-flash-alpha-missing", "flash_attention", None, find="      l_corr = alpha * l_prev\n",
        replace="      l_corr = l_prev\n", description="softmax denominator not rescaled when the running max rises",
        bug_class="missing_alpha_rescale", module=f"{_JAX_TPU}.flash_attention", impl="flash_attention"),
        frozenset({"bias_nonfinite_where_masked", "bias_neg_inf_row_empty", "bias_neg_inf_nonpositive_scale",
                   "causal_absent_rows_skip_blocks", "causal_neg_inf_row_falls_back"})),
    Adoptee("splash_attention", catalogue.SPLASH_KERNEL, "make_splash_mha", _catalogue("splash-l-alpha-missing"),
            frozenset({"forward_nan_rows_reach_backward", "q_seq_shard_without_keys",
                       "q_seq_shards_without_partial_blocks"})),
    Adoptee("paged_attention", catalogue.PAGED_MODULE, "paged_attention", _catalogue("pa-length-mask-off-by-one"),
            frozenset({"zero_length_not_inline"})),
    Adoptee("ragged_paged_attention", f"{_JAX_TPU}.ragged_paged_attention.kernel", "ragged_paged_attention", Mutant(
        "jax-rpa-window-off-by-one", "ragged_paged_attention", None,
        find="row_ids - sliding_window >= col_ids", replace="row_ids - sliding_window > col_ids",
        description="the sliding window keeps one key too many", bug_class="mask_off_by_one",
        module=f"{_JAX_TPU}.ragged_paged_attention.kernel", impl="ragged_paged_attention"),
        frozenset({"empty_seq_before_another", "compact_layout", "one_kv_scale_cache_unlike_queries"})),
)


def _their_repo(tmp_path: pathlib.Path, adoptee: Adoptee) -> pathlib.Path:
    repo = tmp_path / "their_repo"
    (repo / PACKAGE).mkdir(parents=True)
    (repo / PACKAGE / "__init__.py").touch()
    _write_copy(repo, adoptee, pathlib.Path(importlib.util.find_spec(adoptee.source).origin).read_text())
    return repo


def _write_copy(repo: pathlib.Path, adoptee: Adoptee, source: str) -> None:
    (repo / (adoptee.copy.replace(".", "/") + ".py")).write_text(source)


def _attncheck(repo: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GITHUB_STEP_SUMMARY"))}
    env["PYTHONPATH"] = str(repo)
    # This checkout's cache root: the compiled programs and coverage examples of the runs.
    env["ATTNCHECK_CACHE_DIR"] = str(ROOT / ".attncheck_cache")
    return subprocess.run([sys.executable, "-m", "attncheck", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)


def _gate(repo: pathlib.Path, adoptee: Adoptee, report: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = _attncheck(repo, "gate", "--attncheck-kernel", adoptee.family, "--attncheck-impl",
                      f"{adoptee.family}={adoptee.ref}", "--attncheck-report", report, *args)
    return proc, json.loads((repo / report / "report.json").read_text())


def _satisfied_class(report: dict) -> str:
    """A bug class the run's coverage examples exercised, every one of its cases passing:
    the class of the most such cases (then by name)."""
    cases: dict[str, set] = {}
    failing: set[str] = set()
    for r in report["records"]:
        if "coverage" not in r["nodeid"]:
            continue
        for name in r["classes"]:
            cases.setdefault(name, set()).add(r["case_id"])
            if r["outcome"] != "pass" or "expected" in r:
                failing.add(name)
    return min(set(cases) - failing, key=lambda name: (-len(cases[name]), name))


def _failing(report: dict) -> list[dict]:
    return [r for r in report["records"] if r["outcome"] != "pass" and "expected" not in r]


@pytest.mark.parametrize("adoptee", ADOPTEES, ids=lambda a: a.family)
def test_a_third_party_kernel_adopts_the_gate_with_the_table_init_writes_and_stays_strict(adoptee, tmp_path):
    repo = _their_repo(tmp_path, adoptee)
    tail = lambda proc: (proc.stdout + proc.stderr)[-4000:]  # noqa: E731
    # Red on day one, on what it does not promise.
    proc, bare = _gate(repo, adoptee, "bare")
    assert proc.returncode != 0 and bare["verdict"] == "FAIL", tail(proc)
    init = _attncheck(repo, "expectations", "init", "--report", "bare", "--impl", f"{adoptee.family}={adoptee.ref}",
                      "--output", "declared.toml")
    assert init.returncode == 0, tail(init)
    table = expectations.read(repo / "declared.toml")
    assert all(e.implementation == adoptee.ref for e in table), init.stdout
    assert {e.name for e in table if e.kind == BUG_CLASS} == adoptee.declares, init.stdout
    # Green with that table.
    proc, adopted = _gate(repo, adoptee, "adopted", "--attncheck-expectations", "declared.toml")
    assert proc.returncode == 0 and adopted["verdict"] == "PASS", tail(proc)
    # Each entry of the table occurs; the family's shipped entries for jax's own module are not
    # under test (the copy is another implementation).
    statuses = {(d["entry"]["implementation"] == adoptee.ref, d["status"]) for d in adopted["deviations"]}
    assert statuses <= {(True, expectations.OCCURS), (False, expectations.NOT_UNDER_TEST)}, adopted["deviations"]
    # The figures docs/families.md's adoption table quotes, one file per kernel (pytest -s prints them too).
    figures = {"kernel": adoptee.source, "bare": {"cases": bare["totals"]["cases"], "failing": len(_failing(bare))},
               "declared": {kind: sorted(e.name for e in table if e.kind == kind) for kind in expectations.KINDS},
               "adopted": {"verdict": adopted["verdict"], "cases": adopted["totals"]["cases"],
                           "expected_deviations": adopted["totals"]["deviations"]}}
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / f"{adoptee.family}.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
    # Strict on the rest: a planted bug the table does not declare fails.
    _write_copy(repo, adoptee, mutated_source(adoptee.planted))
    proc, planted = _gate(repo, adoptee, "planted", "--attncheck-expectations", "declared.toml", *STRICTNESS, "-x")
    assert proc.returncode != 0 and planted["verdict"] == "FAIL" and _failing(planted), tail(proc)
    # An entry the kernel satisfies is stale: the run fails and names it.
    _write_copy(repo, adoptee, adoptee.planted.original_source())
    satisfied = _satisfied_class(adopted)
    with open(repo / "declared.toml", "a", encoding="utf-8") as fh:
        fh.write(expectations.toml([Expectation(adoptee.family, adoptee.ref, BUG_CLASS, satisfied, "satisfied")],
                                   pyproject=False))
    proc, stale = _gate(repo, adoptee, "stale", "--attncheck-expectations", "declared.toml", *STRICTNESS)
    assert proc.returncode != 0 and stale["verdict"] == "FAIL", tail(proc)
    assert [p for p in stale["problems"] if p.startswith("stale expectation") and satisfied in p], stale["problems"]
    assert not _failing(stale)
