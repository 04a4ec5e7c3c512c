"""No false green: the verdict of runs that verified nothing, crashed, hung, lost records or
met a misbehaving implementation (tests/selftest/chaos.py).

Each run is the packaged gate on the toy families in a subprocess; the assertions are on
the verdict, the exit code, the record that names the case (with its reproducer), and the
records of the cases that ran before the misbehaviour.
"""

from __future__ import annotations

import json
import pathlib
import re
import signal
import time

import pytest

from attncheck import compiled, selection
from tests.selftest import chaos, harness, toy_spec

CHAOS = "tests.selftest.chaos"
FORWARD = ("--attncheck-spec=tests.selftest.toy_forward_spec", "--attncheck-only-spec")
SHORT_TIMEOUT_S = 5


def impl(name: str, family: str = "toy_attention") -> str:
    return f"--attncheck-impl={family}={CHAOS}:{name}"


def named(record: dict) -> bool:
    """The record names its case and how to rerun it."""
    return (re.fullmatch(r"toy_\w+-[0-9a-f]{12}", record["case_id"]) is not None
            and record["repro"].startswith(f"attncheck repro {record['case_id']} --impl "))


# ------------------------------------------------------------------ nothing verified
@pytest.mark.parametrize("args, why", [
    (("--attncheck-backend=tpu",), "backend tpu requested but unavailable: no TPU"),
    (("-k", "no_such_test_name"), "no gate test was selected"),
    (("--collect-only",), "no gate test was selected"),
])
def test_a_run_that_verified_nothing_is_not_a_pass(gate_dir, pytester, args, why):
    result = harness.run_gate(pytester, "rep", "--attncheck-require-coverage", *args)
    assert result.ret != pytest.ExitCode.OK, result.stdout.str()
    report = harness.load_report(gate_dir / "rep")
    assert report["verdict"] == "NO CASES", report["verdict"]
    assert any(why in line for line in report["unverified"]), report["unverified"]
    markdown = (gate_dir / "rep" / "report.md").read_text()
    assert markdown.startswith("# attncheck: NO CASES") and "## Nothing verified" in markdown
    result.stdout.fnmatch_lines(["*attncheck: NO CASES*"])


def test_a_target_whose_every_case_was_skipped_verified_nothing(gate_dir, pytester):
    """The tpu backend is skipped here: asked for with xla, xla passes and tpu is named."""
    result = harness.run_gate(pytester, "rep", "--attncheck-backend=xla,tpu")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    report = harness.load_report(gate_dir / "rep")
    assert report["verdict"] == "NO CASES" and report["totals"]["failures"] == 0
    assert report["unverified"] == [f"backend tpu requested but unavailable: {report['skipped_backends'][0]['reason']}"]


@pytest.mark.parametrize("content", ['{"a": ', "[1, 2]", '{"x": "slow"}'])
def test_a_bad_durations_file_is_a_warning_and_the_run_goes_on(gate_dir, pytester, content):
    (gate_dir / "durations.json").write_text(content)
    result = harness.run_gate(pytester, "rep", "--attncheck-durations=durations.json")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines(["*attncheck: --attncheck-durations: ignoring*durations.json*"])
    assert harness.load_report(gate_dir / "rep")["verdict"] == "PASS"


@pytest.mark.parametrize("args, message", [
    (("--attncheck-backend=bogus",), "--attncheck-backend 'bogus': unknown backend(s) ['bogus']"),
    (("--attncheck-kernel=bogus",), "--attncheck-kernel 'bogus': unknown families ['bogus']"),
    (("--attncheck-impl=toy_attention=nowhere:fn",), "cannot import 'nowhere'"),
    (("--attncheck-spec=no.such.spec",), "spec module 'no.such.spec' cannot be imported"),
    (("--attncheck-accepted-budgets=budgets.json",), "budgets.json: expected an object with a \"budgets\" list"),
    (("--attncheck-accepted-budgets=entry.json",), "entry.json: budgets[0] lacks dtype"),
    (("--attncheck-accepted-budgets=missing.json",), "missing.json: cannot read the accepted budgets"),
])
def test_bad_options_and_input_files_are_usage_errors_that_name_them(gate_dir, pytester, args, message):
    (gate_dir / "budgets.json").write_text("[]")
    (gate_dir / "entry.json").write_text('{"budgets": [{"kernel": "k", "impl": "i", "backend": "xla", '
                                         '"direction": "out", "worst_budget": 0.5}]}')
    result = harness.run_gate(pytester, "rep", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    assert message in result.stderr.str(), result.stderr.str()
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


# ------------------------------------------------------------------ misbehaving kernels
@pytest.mark.parametrize("name, family_args, expect", [
    ("wrong_shape", (), "shapes differ"),
    ("wrong_shape", FORWARD, "shapes differ"),
    ("wrong_dtype", (), "returned out in float16, expected"),
    ("returns_list", (), "returned list, expected an array"),
    ("returns_list", FORWARD, "shapes differ|TypeError|setting an array element"),
    ("all_nan", (), "NaN positions differ"),
    ("raises_markup", (), "toy kernel failed"),
])
def test_whatever_an_implementation_returns_ends_in_records_that_name_the_case(gate_dir, pytester, name, family_args,
                                                                               expect):
    family = "toy_forward" if family_args else "toy_attention"
    result = harness.run_gate(pytester, "rep", impl(name, family), "-k", "coverage", f"--attncheck-kernel={family}",
                              *family_args)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    report = harness.load_report(gate_dir / "rep")
    assert report["verdict"] == "FAIL"
    records = report["records"]
    # Both coverage examples failed and were recorded: the first did not abort the test.
    failing = [r for r in records if r["outcome"] != "pass"]
    assert len({r["case_id"] for r in failing}) == 2, records
    assert all(named(r) for r in records)
    assert any(re.search(expect, r["reason"]) for r in failing), [r["reason"] for r in failing]
    markdown = (gate_dir / "rep" / "report.md").read_text()
    for tag in ("<h1>", "<img", "</td>", "</table>"):
        assert tag not in markdown
    if name == "raises_markup":
        assert "&lt;h1&gt;PASS&lt;/h1&gt;" in markdown


@pytest.mark.parametrize("name", ["hang_while_tracing", "hang_in_callback"])
def test_a_hang_stops_its_test_once_names_the_case_and_the_run_goes_on(gate_dir, pytester, name):
    start = time.monotonic()
    result = harness.run_gate(pytester, "rep", impl(name), f"--timeout={SHORT_TIMEOUT_S}")
    elapsed = time.monotonic() - start
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    # The coverage and the drawn test each time out once: no second timeout for a replay,
    # no next case after the first hang.
    result.assert_outcomes(failed=2, passed=len(toy_spec.SPEC.invalid_calls(getattr(chaos, name))))
    assert elapsed < 4 * SHORT_TIMEOUT_S + 60, elapsed
    report = harness.load_report(gate_dir / "rep")
    assert report["verdict"] == "FAIL"
    hung = [r for r in report["records"] if r["outcome"] == "error"]
    assert len(hung) == 2 and all(named(r) for r in hung), report["records"]  # one case per test
    assert all(f"Timeout >{SHORT_TIMEOUT_S}.0s" in r["reason"] or f"Timeout (>{SHORT_TIMEOUT_S}.0s)" in r["reason"]
               for r in hung), [r["reason"] for r in hung]


def test_the_limit_bounds_each_case_not_a_test_of_many(gate_dir, pytester):
    """--timeout is a case's limit: a gate test runs as many cases as its profile draws, and
    a correct implementation whose cases each end well inside the limit passes."""
    result = harness.run_gate(pytester, "rep", impl("slow_in_callback"), f"--timeout={SHORT_TIMEOUT_S}")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert harness.load_report(gate_dir / "rep")["verdict"] == "PASS"
    # The premise: a gate test ran past the limit.
    seconds = json.loads((gate_dir / "rep" / "durations.json").read_text())
    longest = max(s for test, s in seconds.items() if "test_kernel_matches_oracle" in test)
    assert longest > SHORT_TIMEOUT_S, seconds


# How each way of running the gate meets a hang no signal reaches: the command, whether the
# run goes on past it (the watchdog ends a worker, xdist starts another) or ends with a verdict.
UNREACHABLE_HANG_RUNS = {
    "attncheck gate -n 0": (("gate", "-n", "0"), True),  # runs as -n 1
    "pytest -n 2": (("-n", "2"), True),
    "pytest -n 0": (("-n", "0"), False),
}


@pytest.mark.parametrize("how", sorted(UNREACHABLE_HANG_RUNS))
def test_a_hang_no_signal_reaches_ends_within_twice_its_limit_and_names_the_case(gate_dir, pytester, monkeypatch,
                                                                               tmp_path, how):
    """A host callback behind real interpret-mode Pallas kernels that never returns: the
    main thread waits in native code, pytest-timeout's SIGALRM never lands, and the watchdog
    ends the process at 1.5 x the limit with the case's error record."""
    args, goes_on = UNREACHABLE_HANG_RUNS[how]
    threads = tmp_path / "callback-threads"
    monkeypatch.setenv(chaos.CALLBACK_THREAD_ENV, str(threads))
    hang = (impl("hang_behind_pallas"), f"--timeout={SHORT_TIMEOUT_S}", "--attncheck-report=rep")
    start = time.monotonic()
    if args[0] == "gate":
        proc = harness.cli(gate_dir, *args, *harness.GATE_ARGS[2:], *hang)
        rc, output = proc.returncode, proc.stdout + proc.stderr
        assert "-n 0 runs as -n 1" in output, output
    else:
        result = pytester.runpytest_subprocess(*harness.GATE_ARGS, *args, *hang, timeout=harness.RUN_TIMEOUT_S)
        rc, output = result.ret, result.stdout.str()
    elapsed = time.monotonic() - start
    # The mechanism under test: the callback ran, and not on the main thread.
    assert threads.read_text().split()[:1] == ["False"], threads.read_text() if threads.exists() else "no callback"
    assert rc != 0, output
    report = harness.load_report(gate_dir / "rep")
    assert report["verdict"] == "FAIL", report["verdict"]
    hung = [r for r in report["records"] if r["outcome"] == "error"]
    assert hung and all(named(r) for r in hung), report["records"]
    # Each hung case names its timeout. jax's wait for a program looks at Python's signals
    # now and then, so a later case may still end by the signal; the first one cannot.
    assert all(re.search(rf"timed out after {SHORT_TIMEOUT_S:g} s|Timeout \(?>{SHORT_TIMEOUT_S:.1f}s", r["reason"])
               for r in hung), [r["reason"] for r in hung]
    ended = [r for r in hung if r["reason"].startswith(f"timed out after {SHORT_TIMEOUT_S:g} s (a case's limit")]
    assert ended, [r["reason"] for r in hung]
    faults = (gate_dir / "rep" / "records").glob("*.faults")
    assert any("_forever_off_the_main_thread" in f.read_text() for f in faults)  # every thread's stack
    if goes_on:
        # Both gate tests hung; the invalid-input tests ran after them.
        invalid = len(toy_spec.SPEC.invalid_calls(chaos.hang_behind_pallas))
        assert len(hung) == 2 and report["problems"] == [], report["problems"]
        assert f"2 failed, {invalid} passed" in output, output
    else:
        # One process ran everything: the watchdog's end of it ends the run, with a verdict.
        assert any(p.startswith("the run ended at ") for p in report["problems"]), report["problems"]
    # Startup, tracing, and each hang ended at 1.5 x the limit at most: inside twice it.
    assert elapsed < len(hung) * 2 * SHORT_TIMEOUT_S + 90, elapsed


@pytest.mark.parametrize("name", ["exit_process", "abort_process"])
def test_a_crashed_worker_names_the_case_and_keeps_the_earlier_records(gate_dir, pytester, name):
    result = harness.run_gate(pytester, "rep", impl(name), "-n", "2", "-k", "drawn")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    report = harness.load_report(gate_dir / "rep")
    assert report["verdict"] == "FAIL"
    passed = [r for r in report["records"] if r["outcome"] == "pass"]
    lost = [r for r in report["records"] if r["outcome"] == "error"]
    assert len(passed) == 4 * (chaos.MISBEHAVE_AT - 1)  # the cases before the crash, every direction
    assert len(lost) == 1 and named(lost[0]) and "crashed" in lost[0]["reason"], lost
    # An abort is a fatal signal: the reason says what killed the worker and where; an
    # exit is no crash of the interpreter and leaves no dump.
    fatal = re.search(r"the process died: Fatal Python error: Aborted at File \S*chaos\.py\", line \d+ in "
                      r"_abort_with_a_native_message", lost[0]["reason"])
    assert bool(fatal) is (name == "abort_process"), lost[0]["reason"]
    # What the process wrote to its file descriptor 2 before it died (XLA's reason) too.
    assert (f"its native stderr ended: {chaos.NATIVE_LAST_WORDS}" in lost[0]["reason"]) is (name == "abort_process")
    result.stdout.fnmatch_lines(
        [f"LOST CASE: {lost[0]['case_id']} (user, {lost[0]['backend']}): case started but never finished: worker*"])


def _sections(report_md: pathlib.Path) -> list[str]:
    return [line for line in report_md.read_text().splitlines() if line.startswith("## ")]


def test_a_run_merged_again_from_its_records_has_the_report_it_wrote(gate_dir, pytester):
    """`attncheck report --run` judges by the policy the run wrote when it started (coverage
    required, contracts, declared deviations): the same sections and verdict as the run's
    own report."""
    result = harness.run_gate(pytester, "rep", "--attncheck-require-coverage")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    own, report = _sections(gate_dir / "rep" / "report.md"), harness.load_report(gate_dir / "rep")
    assert {"## Backends not run", "## Coverage of bug classes (cases / failures)"} <= set(own), own
    proc = harness.cli(gate_dir, "report", "--report", "rep", "--run", report["run_id"], "--complete")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    merged = harness.load_report(gate_dir / "rep")
    assert _sections(gate_dir / "rep" / "report.md") == own
    assert (merged["verdict"], merged["coverage"]) == (report["verdict"], report["coverage"])


def test_a_process_that_dies_leaves_incomplete_not_the_previous_pass_and_can_be_merged(gate_dir, pytester):
    result = harness.run_gate(pytester, "rep")
    assert result.ret == pytest.ExitCode.OK and harness.load_report(gate_dir / "rep")["verdict"] == "PASS"
    result = harness.run_gate(pytester, "rep", impl("exit_process"), "-n", "0", "-k", "drawn")
    assert result.ret == 13, result.stdout.str()
    report = harness.load_report(gate_dir / "rep")
    assert report["verdict"] == "INCOMPLETE" and report["records"] == []
    assert (gate_dir / "rep" / "report.md").read_text().startswith("# attncheck: INCOMPLETE")
    run_id = report["run_id"]
    proc = harness.cli(gate_dir, "report", "--report", "rep", "--run", run_id)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    merged = harness.load_report(gate_dir / "rep")
    assert merged["verdict"] == "FAIL" and merged["run_id"] == run_id and merged["wall_s"] is not None
    lost = [r for r in merged["records"] if r["outcome"] == "error"]
    assert len(lost) == 1 and named(lost[0]) and "never finished" in lost[0]["reason"]
    assert len([r for r in merged["records"] if r["outcome"] == "pass"]) == 4 * (chaos.MISBEHAVE_AT - 1)


# ------------------------------------------------------------------ invalid inputs
def invalid_input_test(impl_name: str, fn) -> selection.InvalidInputTest:
    rank, = [c for c in toy_spec.SPEC.invalid_calls(fn) if c.description == "rank"]
    ref = toy_spec.SPEC.default_impls.get(impl_name, f"{CHAOS}:{fn.__name__}")
    return selection.InvalidInputTest(toy_spec.SPEC, impl_name, ref, rank)


@pytest.mark.parametrize("impl_name, fn, failure", [
    ("user", chaos.accepts_invalid_inputs, r"toy_attention/user \(tests\.selftest\.chaos:accepts_invalid_inputs\) "
                                           r"accepted invalid input silently: rank returned without an error"),
    ("user", chaos.rejects_vaguely, r"rejected rank without naming the argument: 'ValueError: invalid input'"),
    ("user", chaos.rejects_with_its_own_class, None),  # its own class, a message naming q: the contract
    ("builtin", chaos.rejects_with_its_own_class, r"rejected rank with ToyInputError, expected <class 'ValueError'>"),
    ("builtin", toy_spec.toy_attention, None),
])
def test_the_invalid_input_test_holds_every_implementation_to_a_message_naming_the_argument(impl_name, fn, failure):
    import contextlib

    from attncheck.gate import test_gate

    def run():
        test_gate.test_invalid_input_is_rejected_clearly(invalid_input_test(impl_name, fn), contextlib.nullcontext)

    if failure is None:
        run()
    else:
        with pytest.raises((AssertionError, pytest.fail.Exception), match=failure):
            run()


def test_an_implementation_under_test_that_accepts_invalid_input_fails_the_gate(gate_dir, pytester):
    result = harness.run_gate(pytester, "rep", impl("accepts_invalid_inputs"), "-k", "invalid_input")
    # The user's implementation, not the builtin, met each invalid call of the family.
    result.assert_outcomes(failed=len(toy_spec.SPEC.invalid_calls(chaos.accepts_invalid_inputs)))
    result.stdout.fnmatch_lines(["FAILED *test_invalid_input_is_rejected_clearly[[]toy_attention-user-rank[]]*"])
    report = harness.load_report(gate_dir / "rep")
    assert report["verdict"] == "FAIL"
    assert any("[toy_attention-user-kv_head_dim] failed without a failing record: Failed: toy_attention/user "
               f"({CHAOS}:accepts_invalid_inputs) accepted invalid input silently: kv_head_dim" in p
               for p in report["problems"]), report["problems"]


# ------------------------------------------------------------------ one report directory, one run
def test_a_second_live_run_on_the_same_report_directory_stops_at_once(gate_dir):
    env = {toy_spec.CALL_LOG_ENV: ""}
    first = harness.start_gate(gate_dir, "rep", "-n", "0", impl("hang_while_tracing"), "--timeout=60", env=env)
    try:
        deadline = time.monotonic() + 120
        while not (gate_dir / "rep" / "report.md").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        second = harness.start_gate(gate_dir, "rep", "-n", "0", env=env)
        out, _ = second.communicate(timeout=120)
        assert second.returncode == pytest.ExitCode.USAGE_ERROR, out
        assert re.search(r"--attncheck-report .*rep: in use by run \d+T\d+ \(pid \d+", out), out
        assert harness.load_report(gate_dir / "rep")["verdict"] == "INCOMPLETE"  # the first run's, untouched
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)
    assert harness.load_report(gate_dir / "rep")["verdict"] == "FAIL"  # the first run merged its own records


def test_report_merges_any_run_of_the_directory(gate_dir, pytester):
    assert harness.run_gate(pytester, "rep", impl("all_nan"), "-k", "coverage").ret == pytest.ExitCode.TESTS_FAILED
    failing_run = harness.load_report(gate_dir / "rep")["run_id"]
    assert harness.run_gate(pytester, "rep", "-k", "coverage").ret == pytest.ExitCode.OK
    passing_run = harness.load_report(gate_dir / "rep")["run_id"]
    proc = harness.cli(gate_dir, "report", "--report", "rep", "--run", failing_run, "--complete")
    assert proc.returncode == 1 and harness.load_report(gate_dir / "rep")["run_id"] == failing_run
    assert harness.load_report(gate_dir / "rep")["verdict"] == "FAIL"
    proc = harness.cli(gate_dir, "report", "--report", "rep", "--run", passing_run, "--complete")
    assert proc.returncode == 0 and harness.load_report(gate_dir / "rep")["verdict"] == "PASS"
    proc = harness.cli(gate_dir, "report", "--report", "rep", "--run", "20990101T0000000")
    assert proc.returncode == 2 and "no such run" in proc.stderr


@pytest.mark.skipif(compiled.mapping_count() is None, reason="the platform does not list a process's mappings")
def test_a_process_near_its_mapping_limit_lets_its_compiled_programs_go():
    """XLA maps each compiled CPU program into the process: a long-running worker (a nightly
    shard's) reaches vm.max_map_count and loses its cases to LLVM's "Cannot allocate memory"."""
    import jax
    import jax.numpy as jnp

    for n in range(10):  # the specs' programs, and a jitted helper of module scope (the yardstick's)
        compiled.compiled(("selftest-mappings", n), lambda n=n: lambda x: jnp.sin(x) * n)(jnp.ones(4))
    helper = jax.jit(lambda x: jnp.cos(x) + 1)
    for n in range(1, 51):
        helper(jnp.ones(n)).block_until_ready()
    held = compiled.mapping_count()
    assert not compiled.release_when_mappings_run_out(budget=held + 10_000)
    assert compiled.release_when_mappings_run_out(budget=held - 1)
    assert compiled.mapping_count() < held - 200  # 60 programs of about 6 mappings each
    assert not [key for key in compiled._COMPILED if key[0] == "selftest-mappings"]
