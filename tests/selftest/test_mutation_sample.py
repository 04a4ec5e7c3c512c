"""The gate catches planted kernel bugs: the PR-gate sample of the mutant catalogue, and
cheap checks of the catalogue and of the mutation runner itself.

The sample (mutants marked ``sample=True``, one per kernel family where possible, each
killed in seconds) runs the real gate on a mutated copy of the project; the whole
catalogue runs with ``attncheck mutate`` (nightly / on demand).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import subprocess

import pytest

from attncheck import cache_root, specs
from attncheck.mutation import campaign
from attncheck.mutation.catalogue import CATALOGUE
from attncheck.mutation.mutant import CatalogueError, Mutant, apply, mutated_source
from attncheck.report import model

SAMPLE = [m for m in CATALOGUE if m.sample]
SNAKE_CASE = re.compile(r"^[a-z0-9]+(_[a-z0-9]+)*$")


# ------------------------------------------------------------------ the sample


@pytest.mark.parametrize("mutant", SAMPLE, ids=[m.id for m in SAMPLE])
def test_sample_mutant_is_killed(mutant):
    result = campaign.run_mutant(mutant, timeout_s=300)
    assert result["status"] == "killed", (
        f"{mutant.id} ({mutant.description}): {result['status']} after {result['seconds']} s; "
        f"the gate no longer catches this bug. Last lines: {result['detail']}")
    assert result["killed_by"] and all(f"[{mutant.family}-" in t for t in result["killed_by"]), result


def test_sample_is_small_and_spans_kernels():
    assert 3 <= len(SAMPLE) <= 4, [m.id for m in SAMPLE]
    assert len({m.family for m in SAMPLE}) >= 3, "sample mutants should come from different kernels"
    assert not any(m.equivalent for m in SAMPLE), "an equivalent mutant cannot be killed"


# ------------------------------------------------------------------ the catalogue


@pytest.mark.parametrize("mutant", CATALOGUE, ids=[m.id for m in CATALOGUE])
def test_catalogue_snippet_applies_exactly_once(mutant):
    mutated = mutated_source(mutant)  # raises CatalogueError unless exactly once
    assert mutated != mutant.original_source(), f"{mutant.id}: the replacement changes nothing"
    compile(mutated, mutant.copy_path, "exec")  # a mutant must be a bug, not a syntax error


def test_catalogue_ids_are_unique():
    ids = [m.id for m in CATALOGUE]
    assert len(ids) == len(set(ids)), sorted(i for i in set(ids) if ids.count(i) > 1)


def test_catalogue_families_exist():
    known = specs.all_specs()
    unknown = {m.family for m in CATALOGUE} - set(known)
    assert not unknown, f"catalogue names families without a spec: {sorted(unknown)}; known {sorted(known)}"


def test_catalogue_size_and_spread():
    assert len(CATALOGUE) >= 40
    # Every family of the project's own kernels has mutants (a user family loaded with
    # --attncheck-spec is not part of the catalogue).
    # A family without a kernel of its own (ragged_paged_attention_v3) has none to mutate.
    builtin = {name for name, spec in specs.all_specs().items()
               if spec.default_impls
               and all(ref.startswith("attncheck_kernels.") for ref in spec.default_impls.values())}
    missing = builtin - {m.family for m in CATALOGUE}
    assert not missing, f"kernel families without mutants: {sorted(missing)}"
    for m in CATALOGUE:
        assert m.module is not None or m.file.startswith("kernels/"), m.id  # a project kernel or an installed one
        assert SNAKE_CASE.match(m.bug_class), f"{m.id}: bug_class {m.bug_class!r} is not snake_case"
        assert m.description and "\n" not in m.description, m.id
        assert m.equivalent is None or m.equivalent.strip(), m.id


# ------------------------------------------------------------------ the runner


def test_absent_snippet_raises():
    bad = Mutant("absent", "blockwise_ffn", "kernels/blockwise_ffn.py", find="this text is not in the file\n",
                 replace="", description="absent snippet", bug_class="none")
    with pytest.raises(CatalogueError, match="0 times"):
        mutated_source(bad)


def test_ambiguous_snippet_raises(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "k.py").write_text("x = 1\nx = 1\n")
    twice = Mutant("twice", "blockwise_ffn", "kernels/k.py", find="x = 1\n", replace="x = 2\n",
                   description="ambiguous snippet", bug_class="none")
    with pytest.raises(CatalogueError, match="2 times"):
        apply(twice, tmp_path)
    once = dataclasses.replace(twice, find="x = 1\nx = 1\n", replace="x = 1\nx = 2\n")
    apply(once, tmp_path)
    assert (tmp_path / "kernels" / "k.py").read_text() == "x = 1\nx = 2\n"


def test_a_mutant_of_an_installed_module_is_planted_in_a_copy_the_gate_is_pointed_at(tmp_path):
    """jax's bundled kernels are verified too: their mutants go into a copy of the module
    inside the project copy, never into the installed package."""
    module = "jax.experimental.pallas.ops.tpu.flash_attention"
    original = Mutant("m", "flash_attention", None, find="def flash_attention(", replace="def flash_attention(",
                      description="d", bug_class="b", module=module, impl="flash_attention").original_source()
    mutant = Mutant("m", "flash_attention", None, find="        block_b=1,\n", replace="        block_b=2,\n",
                    description="d", bug_class="b", module=module, impl="flash_attention")
    apply(mutant, tmp_path)
    copy = tmp_path / mutant.copy_path
    assert copy.read_text() == original.replace("        block_b=1,\n", "        block_b=2,\n") != original
    assert (copy.parent / "__init__.py").exists()
    assert mutant.impl_override == (
        "--attncheck-impl=flash_attention=mutated_modules.flash_attention:flash_attention",)
    assert mutant.original_source() == original  # the installed module is untouched
    with pytest.raises(CatalogueError, match="either file, or module and impl"):
        dataclasses.replace(mutant, impl=None)


def test_select_rejects_unknown_ids():
    with pytest.raises(CatalogueError, match="unknown"):
        campaign.select(CATALOGUE, ids=["no-such-mutant"])
    assert campaign.select(CATALOGUE, sample=True) == SAMPLE


def test_summarize_excludes_equivalent_and_invalid():
    rows = [{"family": "f", "status": s} for s in ("killed", "killed", "survived", "equivalent", "invalid")]
    summary = model.mutation_summary(rows)
    assert summary["kill_rate"] == pytest.approx(2 / 3)
    assert summary["per_kernel"]["f"]["kill_rate"] == pytest.approx(2 / 3)



def test_gate_command_runs_one_family_or_the_whole_gate_with_x(tmp_path):
    family = campaign.gate_command("ring_attention", tmp_path)
    whole = campaign.gate_command(None, tmp_path)
    assert "-x" in family and "-x" in whole
    assert family[family.index("--attncheck-kernel") + 1] == "ring_attention"
    assert "--attncheck-kernel" not in whole and whole[whole.index("-n") + 1] == "auto"


def _mutated_run(directory, verdict: str | None, failures: int = 0, failed: tuple[str, ...] = ()):
    """A mutated run's report directory as the gate leaves it (verdict None: no report)."""
    directory.mkdir(exist_ok=True)
    if verdict is not None:
        (directory / "report.json").write_text(json.dumps({"verdict": verdict, "totals": {"failures": failures}}))
    cases = "".join(f'<testcase classname="test_gate.py" name="{name}"><failure message="x"/></testcase>'
                    for name in failed)
    (directory / "junit.xml").write_text(f'<testsuites><testsuite>{cases}'
                                         '<testcase classname="test_gate.py" name="ok"/></testsuite></testsuites>')
    return directory


def test_the_verdict_of_a_mutant_comes_from_the_mutated_runs_report(tmp_path):
    caught = "test_kernel_matches_oracle[blockwise_ffn-builtin-xla-coverage]"
    # A failing case (a run stopped by -x under xdist is incomplete and still a kill).
    assert campaign.verdict(_mutated_run(tmp_path / "a", "FAIL", 4, (caught,)), None) == (
        "killed", [f"test_gate.py::{caught}"])
    # A test that failed without a record (an invalid input accepted) kills it too.
    assert campaign.verdict(_mutated_run(tmp_path / "b", "FAIL", 0, ("test_invalid[x]",)), None)[0] == "killed"
    assert campaign.verdict(_mutated_run(tmp_path / "c", "PASS"), None) == ("survived", [])
    assert campaign.verdict(_mutated_run(tmp_path / "d", "PASS"), "no observable difference") == ("equivalent", [])
    # A run that failed for another reason, verified nothing, or wrote no report proves nothing.
    assert campaign.verdict(_mutated_run(tmp_path / "e", "FAIL"), None) == ("invalid", [])
    assert campaign.verdict(_mutated_run(tmp_path / "f", "NO CASES"), None) == ("invalid", [])
    assert campaign.verdict(_mutated_run(tmp_path / "g", None), None) == ("invalid", [])


def test_a_mutated_run_compiles_into_a_private_copy_of_the_cache(tmp_path, monkeypatch):
    """A mutant's programs end with its run: kept in the checkout's cache, they would load
    in a later mutated run of the same kernel (the runner's copies share its sources), and
    that run's time to kill would be a warm one, as no new bug's is."""
    root = tmp_path / "root"
    (root / "xla").mkdir(parents=True)
    (root / "xla" / "gate-program-cache").write_bytes(b"compiled")
    monkeypatch.setenv(cache_root.CACHE_ENV, str(root))
    seen = {}

    def gate(command, *, env, **_):
        cache = pathlib.Path(env[cache_root.CACHE_ENV])
        seen["entries"] = sorted(p.name for p in (cache / "xla").iterdir())
        (cache / "xla" / "mutant-program-cache").write_bytes(b"the bug's program")
        return subprocess.CompletedProcess(command, 1, "", "")

    monkeypatch.setattr(campaign.subprocess, "run", gate)
    assert campaign.run_mutant(SAMPLE[0])["status"] == "invalid"  # the fake gate wrote no report
    assert seen["entries"] == ["gate-program-cache"]
    assert sorted(p.name for p in (root / "xla").iterdir()) == ["gate-program-cache"]
