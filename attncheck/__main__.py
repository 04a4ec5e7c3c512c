"""attncheck command line: gate | report [merge DIR...] | repro CASE_ID | budgets accept | durations update |
coverage update | expectations init | findings [export DIR] | mutate.

Every bad or missing input ends in one line naming it and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

from attncheck.report import DEFAULT_DIR as DEFAULT_REPORT


class CommandError(Exception):
    """What the user gave cannot be used; the message says which input and why."""


def _read_report(report_dir: pathlib.Path) -> dict:
    path = report_dir / "report.json"
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CommandError(f"{path} does not exist: run the gate first, or pass --report DIR") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CommandError(f"{path} is not a readable report ({exc}); `attncheck report --report "
                           f"{report_dir}` merges it again from its records") from None
    if not isinstance(report, dict) or not isinstance(report.get("records"), list):
        raise CommandError(f"{path} is not an attncheck report (no records list)")
    from attncheck.report.records import SCHEMA_VERSION

    if report.get("schema_version") != SCHEMA_VERSION:
        raise CommandError(f"{path} has schema_version {report.get('schema_version')!r}; this attncheck reads "
                           f"{SCHEMA_VERSION}: run the gate again with this version")
    return report


# pytest's ways of saying how many xdist workers to run.
_WORKERS = re.compile(r"^(-n|--numprocesses)(=?)(.*)$")


def _at_least_one_worker(extra: list[str]) -> list[str]:
    """The arguments with ``-n auto`` when they name no worker count, and ``-n 1`` where they
    say ``-n 0``: a case that hangs in native code ends only by ending its process, and only
    a worker's end leaves the run (the controller) to go on (``attncheck.watchdog``)."""
    out, i, named = [], 0, False
    while i < len(extra):
        arg = extra[i]
        found = _WORKERS.match(arg)
        if found is None:
            out.append(arg)
            i += 1
            continue
        named = True
        value = found.group(3) if found.group(3) else (extra[i + 1] if i + 1 < len(extra) else "")
        step = 1 if found.group(3) else 2
        if value.strip() == "0":
            print("attncheck gate: -n 0 runs as -n 1: a hung case is ended by ending its worker, and the run goes "
                  "on with a new one (pytest -n 0 runs every test in one process, which a hang would end)",
                  file=sys.stderr)
            value = "1"
        out += [found.group(1), value]
        i += step
    return out if named else ["-n", "auto", *out]


def _gate_help() -> int:
    """pytest's help with attncheck's own options first: the gate takes every option of
    pytest, but these are what a user of the gate looks for."""
    text = subprocess.run([sys.executable, "-m", "pytest", "--help"], capture_output=True, text=True).stdout
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line == "attncheck:"), None)
    if start is None:  # the plugin is not installed in this environment: pytest's help as it is
        print(text)
        return 0
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()), len(lines))
    print("usage: attncheck gate [options] [more test paths]: pytest --pyargs attncheck.gate -n auto "
          "--hypothesis-profile=ci --attncheck [options]\n")
    print("\n".join(lines[start:end]).rstrip() + "\n")
    print("Every other option is pytest's (and its plugins'):\n")
    print("\n".join(lines[:start] + lines[end:]))
    return 0


def _values_joined(extra: list[str]) -> list[str]:
    """attncheck's options with their values joined by '=': pytest picks its root directory
    from the command line's paths before it knows a plugin's options, so a value given apart
    (``--attncheck-report DIR``) counts as a path there, and the run (its xdist workers
    too) takes DIR for the project: the project's pyproject.toml, with its table of
    declared deviations, goes unread."""
    from attncheck.pytest_plugin import FLAG_OPTIONS

    out, i = [], 0
    while i < len(extra):
        arg = extra[i]
        if arg.startswith("--attncheck-") and "=" not in arg and arg not in FLAG_OPTIONS and i + 1 < len(extra):
            out.append(f"{arg}={extra[i + 1]}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def cmd_gate(args, extra: list[str]) -> int:
    """The gate, as ``pytest --pyargs attncheck.gate`` with the CI defaults; extra
    arguments go to pytest (more test paths, -k, --attncheck-impl, ...)."""
    if any(a in ("-h", "--help") for a in extra):
        return _gate_help()
    from attncheck import env

    profile = [] if any(a.startswith("--hypothesis-profile") for a in extra) else ["--hypothesis-profile=ci"]
    command = [sys.executable, "-m", "pytest", "--pyargs", "attncheck.gate", "--attncheck", *profile,
               *_at_least_one_worker(_values_joined(extra))]
    # Set here, inherited by pytest: another pytest plugin (jaxtyping's) imports NumPy before
    # attncheck's plugin could set its environment, and NumPy's kernels are chosen at import.
    # This process computes nothing: what it had imported already does not matter.
    env.configure()
    rc = subprocess.call(command)
    if rc == 5:  # pytest's "no tests collected": the report says NO CASES; the exit says failure
        print("attncheck gate: no tests were collected", file=sys.stderr)
        return 1
    return rc


def _describe_index(spec, direction: str, index) -> str:
    names = spec.index_names(direction)  # of the trailing axes; leading ones are numbered
    if not names or len(names) > len(index):
        return str(tuple(index))
    names = tuple(f"axis{i}" for i in range(len(index) - len(names))) + tuple(names)
    return ", ".join(f"{n}={i}" for n, i in zip(names, index))


def cmd_repro(args) -> int:
    from attncheck import env

    # Before jax and NumPy start: ring cases run on several simulated devices, and the code
    # is generated as the gate generates it.
    try:
        warnings = env.configure()
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    for warning in warnings:
        print(f"attncheck repro: {warning}", file=sys.stderr)
    from attncheck import check, specs
    from attncheck.backends import BACKENDS
    from attncheck.report import errormap
    from attncheck.report.records import Record

    from attncheck.expectations import Expectation

    report_dir = pathlib.Path(args.report)
    report = _read_report(report_dir)
    matches = [r for r in report["records"] if r.get("case_id") == args.case_id
               and (args.impl is None or r.get("impl") == args.impl)
               and (args.backend is None or r.get("backend") == args.backend)]
    if not matches:
        raise CommandError(f"no record of case {args.case_id!r} in {report_dir / 'report.json'} "
                           f"(impl={args.impl}, backend={args.backend}); run the gate first or pass --report")
    record = Record.from_json(matches[0])
    try:
        specs.use_spec_modules(args.spec)
        known = specs.all_specs()
    except ValueError as exc:
        raise CommandError(f"--spec: {exc}") from None
    family = record.case["family"]
    if family not in known:
        raise CommandError(f"unknown kernel family {family!r} (known: {', '.join(sorted(known))}); "
                           "pass --spec MODULE for a user spec")
    spec = known[family]
    backend_name = args.backend or record.backend
    if backend_name not in BACKENDS:
        raise CommandError(f"--backend {backend_name!r}: unknown; known: {', '.join(BACKENDS)}")
    # Judged as the run judged it: with the deviations it declared for this implementation;
    # every direction's map: a terminal shows the text grid of each one asked for.
    declared = tuple(Expectation.from_json(d["entry"]) for d in report.get("deviations", []))
    try:
        target = check.Target.named(spec, record.impl, record.impl_ref, backend_name, declared)
        case = spec.case_from_json(record.case)
    except (ValueError, TypeError, KeyError) as exc:
        raise CommandError(f"case {args.case_id}: {exc}") from None
    if (reason := target.backend.unavailable_reason()) is not None:
        raise CommandError(f"backend {backend_name} is unavailable here: {reason}")
    print(f"case {case.id}: {spec.name} / {record.impl} ({record.impl_ref}) on {backend_name}")
    print(f"  platform: {env.current_platform().describe()} (the record's: "
          f"{record.backend_settings.get('platform', 'not recorded')})")
    print("  parameters: " + ", ".join(f"{k}={v}" for k, v in sorted(case.params.to_json().items()))
          + f", seed={case.seed}")
    for entry in target.expected:
        print(f"  declared deviation: {entry.kind} {entry.name}: {entry.reason}")
    outcome = check.check_case(target, case,
                               report_dir=args.report,
                               maps=None if args.maps == "none" else errormap.EveryMap())
    for r in outcome.records:
        line = f"  {r.direction:>10}: {r.outcome.upper():5} {r.reason}" + (
            f" (an expected deviation: {r.expected})" if r.expected else "")
        m = r.metrics
        if m is not None and m.worst_index is not None:
            line += (f"\n{'':14}worst at {_describe_index(spec, r.direction, m.worst_index)}: "
                     f"kernel {m.worst_kernel:.7g} vs oracle {m.worst_oracle:.7g} "
                     f"(yardstick error {m.yardstick_err:.3g}, allowed {m.allowed:.3g}, "
                     f"budget {m.budget:.3g}, ulp p99 {m.ulp_p99:.3g})")
        if r.traceback and args.verbose:
            line += "\n" + r.traceback
        if r.error_map is not None and (args.maps == "all" or (args.maps == "failing" and not r.passed)):
            line += "".join(f"\n{'':4}{row}" for row in r.error_map.to_text().splitlines())
        print(line)
    return 1 if outcome.failures else 0


def cmd_report(args) -> int:
    import dataclasses

    from attncheck.report import accepted
    from attncheck.report import merge, render
    from attncheck.report import records as rec

    directory = pathlib.Path(args.report)
    runs = rec.run_ids(directory)
    if not runs:
        raise CommandError(f"no run recorded under {directory / rec.RECORDS_DIR}")
    run_id = args.run or runs[-1]
    if run_id not in runs:
        raise CommandError(f"--run {run_id}: no such run under {directory / rec.RECORDS_DIR} "
                           f"(recorded: {', '.join(runs)})")
    info = rec.RunInfo.read(directory, run_id)
    if info is None or info.policy is None:
        raise CommandError(f"run {run_id}: {directory / rec.RECORDS_DIR} holds no readable description of it "
                           f"({run_id}{rec.RUN_SUFFIX}), so how it is judged is not known")
    last = rec.last_activity(directory, run_id)
    wall = None if last is None else last - info.started
    # A merge done here (not by the pytest session) is of a run that did not finish; it
    # judges the run as the run itself would have.
    policy = info.policy
    if args.accepted_budgets:
        policy = dataclasses.replace(policy, accepted_budgets=args.accepted_budgets)
    outcome = merge.RunOutcome(complete=args.complete, wall_s=wall)
    try:
        report = merge.merge(directory, run_id, outcome, policy)
        budgets = accepted.read(pathlib.Path(policy.accepted_budgets)) if policy.accepted_budgets else None
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    render.write(directory, report, accepted=budgets, regression_floor=policy.regression_floor)
    print((directory / "report.md").read_text(encoding="utf-8"))
    return 0 if report.verdict == "PASS" else 1


def cmd_report_merge(args) -> int:
    """The report of a whole run from its shards' report directories (``--attncheck-shard
    K/N``), with their durations joined; exits 0 only on PASS."""
    from attncheck import scheduling
    from attncheck.report import merge, render

    output = pathlib.Path(args.report)
    if any(pathlib.Path(d).resolve() == output.resolve() for d in args.shards):
        raise CommandError(f"--report {output}: also given as a shard; write the merged report elsewhere")
    report = merge.merge_shards([pathlib.Path(d) for d in args.shards])
    render.write(output, report)
    durations: dict[str, float] = {}
    for directory in args.shards:
        path = pathlib.Path(directory) / scheduling.REPORT_FILE
        try:
            durations.update(scheduling.load(path))
        except (OSError, ValueError) as exc:  # they only order later runs: never a verdict
            print(f"attncheck report merge: durations of {directory} left out: {exc}", file=sys.stderr)
    scheduling.write(output / scheduling.REPORT_FILE, durations)
    print((output / "report.md").read_text(encoding="utf-8"))
    return 0 if report.verdict == "PASS" else 1


def cmd_budgets_accept(args) -> int:
    from attncheck.report import accepted
    from attncheck.report.model import SummaryRow

    report = _read_report(pathlib.Path(args.report))
    if report.get("verdict") not in ("PASS", None):
        raise CommandError(f"{args.report}: the run's verdict is {report.get('verdict')}; accept the budgets "
                           "of a passing run")
    try:
        rows = [SummaryRow(**row) for row in report.get("summary", [])]
    except TypeError as exc:
        raise CommandError(f"{args.report}/report.json: unreadable summary ({exc})") from None
    from attncheck.env import Platform

    platform = report.get("platform")
    budgets = accepted.from_summary(rows, None if platform is None else Platform.from_json(platform),
                                    report.get("profile"))
    accepted.write(pathlib.Path(args.output), budgets)
    where = "an unknown platform" if budgets.platform is None else budgets.platform.describe()
    print(f"wrote {len(budgets.budgets)} accepted budgets to {args.output} (platform: {where}; "
          f"profile: {budgets.profile}): a run is judged against them only on that platform and profile")
    return 0


def cmd_durations_update(args) -> int:
    from attncheck import scheduling, specs

    measured = pathlib.Path(args.report) / scheduling.REPORT_FILE
    if not measured.is_file():
        raise CommandError(f"{measured} does not exist; run the tests first")
    try:
        count = scheduling.merge_into(pathlib.Path(args.output), measured,
                                      pathlib.Path(args.packaged) if args.packaged else None)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    print(f"wrote {count} test durations to {args.output}")
    sources = scheduling.sources_path(pathlib.Path(args.output))
    count = scheduling.write_sources(sources, (ref for spec in specs.all_specs().values()
                                               for ref in spec.default_impls.values()))
    print(f"wrote the source digests of {count} implementations to {sources} (their families run first once "
          "they change)")
    return 0


def cmd_coverage_update(args) -> int:
    """The built-in families' coverage examples, searched afresh under the CI profile's shapes
    and written into the package (``coverage.SHIPPED``), so that a clone searches none."""
    from hypothesis import settings

    from attncheck import coverage, profiles, specs  # noqa: F401 (profiles registers "ci")

    settings.load_profile("ci")  # the CI profile's shapes
    for path in coverage.update_shipped(specs.all_specs().values()):
        print(f"wrote {path}")
    return 0


def cmd_expectations_init(args) -> int:
    """The table of declared deviations a failing run calls for: one entry per bug class,
    invalid call or contract its implementations failed (with a reason to fill in),
    appended to ``--output`` (a pyproject.toml gets ``[[tool.attncheck.expect]]``)."""
    from attncheck import expectations, specs
    from attncheck.expectations import BUG_CLASS, CONTRACT, INVALID_CALL, Expectation
    from attncheck.report.records import Record, case_evidence

    report = _read_report(pathlib.Path(args.report))
    only = {}
    for value in args.impl:
        family, sep, ref = value.partition("=")
        if not sep or not family or not ref:
            raise CommandError(f"--impl {value!r}: expected FAMILY=package.module:function")
        only[family] = ref
    output = pathlib.Path(args.output)
    try:
        existing = {(e.family, e.implementation, e.kind, e.name) for e in expectations.read(output, required=False)}
    except expectations.ExpectationError as exc:
        raise CommandError(str(exc)) from None
    reason = args.reason
    wanted = lambda family, ref: family not in only or only[family] == ref  # noqa: E731
    records = [Record.from_json(r) for r in report["records"] if wanted(r["kernel"], r["impl_ref"])]
    failed_calls = [(c["family"], c["impl_ref"], c["call"]) for c in report.get("invalid_calls", [])
                    if c["outcome"] == "failed" and wanted(c["family"], c["impl_ref"])]
    explanation = expectations.explaining(case_evidence(records), failed_calls, cells=specs.cell_classes())
    entries = [Expectation(f, ref, kind, name, reason.format(family=f, implementation=ref, kind=kind, name=name),
                           str(output)) for f, ref, kind, name in explanation.entries
               if (f, ref, kind, name) not in existing]
    undeclarable = [f"{c.family} / {c.implementation}: case {c.case_id} fails, and each of its bug classes also "
                    f"passes elsewhere ({', '.join(sorted(c.classes)) or 'it has none'}): a bug no entry describes "
                    f"(reproduce: {c.repro})" for c in explanation.unexplained]
    for line in undeclarable:
        print(f"attncheck expectations init: not declarable: {line}", file=sys.stderr)
    if not entries:
        print(f"attncheck expectations init: nothing to declare: {args.report}'s run has no failure a bug class, "
              f"invalid call or contract explains that {output} does not declare already")
        return 1 if undeclarable else 0
    pyproject = output.name == expectations.DEFAULT_TABLE
    with open(output, "a", encoding="utf-8") as fh:
        fh.write(expectations.toml(entries, pyproject=pyproject))
    print(f"wrote {len(entries)} declared deviations to {output}" + ("" if pyproject else
          f" (run the gate with --attncheck-expectations {output})") + "; fill in each reason:")
    for e in entries:
        print(f"  {e.describe()}")
    kinds = {BUG_CLASS: "bug classes", INVALID_CALL: "invalid calls", CONTRACT: "contracts"}
    print("  (" + ", ".join(f"{sum(e.kind == k for e in entries)} {v}" for k, v in kinds.items()) + ")")
    return 1 if undeclarable else 0


def cmd_findings(args) -> int:
    """Every finding the gate holds: the kernels' own (with reproducer and issue draft), and
    the deviations a run declared (``--report``)."""
    from attncheck import findings

    print(f"{'id':36} {'family':24} {'since':14} held by the gate as")
    for f in findings.FINDINGS:
        print(f"{f.id:36} {f.family:24} {f.since:14} {f.held_as}" + (" (by design)" if f.by_design else ""))
        print(f"{'':36} {f.title}")
        files = f"; reproducer {f.reproducer.name}, draft {f.issue.name}" if f.reproducer and f.issue else ""
        print(f"{'':36} in {f.package or 'jax'}: {f.source}{files}")
    if args.report:
        report = _read_report(pathlib.Path(args.report))
        declared = [d for d in report.get("deviations", []) if d["entry"]["source"] != "shipped with the family"]
        print(f"\ndeclared in the run of {args.report} ({len(declared)}):")
        for d in declared:
            e = d["entry"]
            print(f"  {e['family']} / {e['implementation']}: {e['kind']} {e['name']}: {d['status']} "
                  f"({d['shown']} of {d['cases']}): {e['reason']} [{e['source']}]")
    return 0


def cmd_findings_export(args) -> int:
    from attncheck import findings

    written = findings.export(pathlib.Path(args.directory))
    print(f"wrote {len(written)} files to {args.directory}: " + ", ".join(p.name for p in written))
    return 0


def cmd_mutate(args) -> int:
    from attncheck.mutation import campaign
    from attncheck.mutation.mutant import CatalogueError

    try:
        return campaign.main(args)
    except CatalogueError as exc:
        raise CommandError(str(exc)) from None


def _shard(text: str):
    from attncheck.scheduling import Shard

    try:
        return Shard.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--attncheck-shard {text!r}: ")) from None


def _add_report(parser, default=DEFAULT_REPORT) -> None:
    parser.add_argument("--report", default=default, help="report directory (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    from attncheck.report import accepted

    parser = argparse.ArgumentParser(prog="attncheck", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("gate", help="run the gate (pytest --pyargs attncheck.gate); other arguments go to pytest")
    p.set_defaults(func=cmd_gate, passthrough=True)
    p = sub.add_parser("repro", help="rerun one recorded case and show where it differs")
    p.add_argument("case_id")
    _add_report(p)
    p.add_argument("--impl", default=None)
    p.add_argument("--backend", default=None)
    p.add_argument("--spec", action="append", default=[], metavar="MODULE",
                   help="a spec module the case's family comes from (as given to --attncheck-spec)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--maps", choices=("all", "failing", "none"), default="all",
                   help="print the error map of these directions as a text grid (default: %(default)s)")
    p.set_defaults(func=cmd_repro)
    p = sub.add_parser("report", help="(re)merge the records of a run into its reports")
    _add_report(p)
    p.add_argument("--run", default=None, metavar="RUN_ID", help="the run to merge (default: the newest)")
    p.add_argument("--accepted-budgets", default=None, metavar="PATH")
    p.add_argument("--complete", action="store_true", help="the run finished (default: mark incomplete)")
    p.set_defaults(func=cmd_report)
    rsub = p.add_subparsers(dest="action")
    m = rsub.add_parser("merge", help="merge the reports of a run's shards (--attncheck-shard K/N) into one")
    m.add_argument("shards", nargs="+", metavar="DIR", help="the report directory of each shard")
    _add_report(m)
    m.set_defaults(func=cmd_report_merge)
    for name, help_text in (("budgets", "manage the accepted budgets"),
                            ("baseline", "deprecated name of `budgets`")):
        p = sub.add_parser(name, help=help_text)
        bsub = p.add_subparsers(dest="action", required=True)
        u = bsub.add_parser("accept" if name == "budgets" else "update",
                            help="accept the worst budgets of a passing run")
        _add_report(u)
        u.add_argument("--output", default=str(accepted.DEFAULT_FILE))
        u.set_defaults(func=cmd_budgets_accept, deprecated=name == "baseline")
    p = sub.add_parser("durations", help="manage the test durations that order the run")
    dsub = p.add_subparsers(dest="action", required=True)
    u = dsub.add_parser("update", help="merge the durations of a run into the committed file")
    _add_report(u, "reports/test")
    u.add_argument("--output", default="tests/durations.json")
    u.add_argument("--packaged", default=None, metavar="PATH",
                   help="write the packaged gate's durations here instead (this project: "
                        "attncheck/gate/durations.json, which the package ships)")
    u.set_defaults(func=cmd_durations_update)
    p = sub.add_parser("coverage", help="the coverage examples the package ships")
    csub = p.add_subparsers(dest="action", required=True)
    u = csub.add_parser("update", help="search the built-in families' coverage examples afresh (CI profile) and "
                                       "write them into the package")
    u.set_defaults(func=cmd_coverage_update)
    p = sub.add_parser("expectations", help="declared deviations of your implementations")
    esub = p.add_subparsers(dest="action", required=True)
    i = esub.add_parser("init", help="write the entries a failing run calls for, one per failing bug class, "
                                     "invalid call or contract")
    _add_report(i)
    i.add_argument("--impl", action="append", default=[], metavar="FAMILY=MOD:FN",
                   help="only this implementation of the family (default: every implementation that failed)")
    i.add_argument("--output", default="pyproject.toml",
                   help="append the entries here (default: %(default)s, as [[tool.attncheck.expect]]; any other "
                        "file gets [[expect]] tables, for --attncheck-expectations)")
    i.add_argument("--reason", default="TODO: why {implementation} does not do this (a sentence or a link)",
                   help="the reason written in each entry ({family}, {implementation}, {kind} and {name} are filled "
                        "in; default: %(default)r)")
    i.set_defaults(func=cmd_expectations_init)
    p = sub.add_parser("findings", help="the kernel findings the gate holds, with reproducers and issue drafts")
    p.add_argument("--report", default=None, help="also list the deviations declared in this run's report")
    p.set_defaults(func=cmd_findings)
    fsub = p.add_subparsers(dest="action")
    x = fsub.add_parser("export", help="write each finding's standalone reproducer and issue draft into DIR")
    x.add_argument("directory", metavar="DIR")
    x.set_defaults(func=cmd_findings_export)
    p = sub.add_parser("mutate", help="run the mutant catalogue against the gate")
    p.add_argument("--kernel", default=None)
    p.add_argument("--mutant", action="append", default=None)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--sample", action="store_true", help="only the PR-gate sample of fast mutants")
    p.add_argument("--whole-gate", action="store_true",
                   help="run the whole gate (-x -n auto) against each mutant, not only its family's")
    p.add_argument("--shard", type=_shard, default=None, metavar="K/N",
                   help="run only every N-th mutant from the K-th (one shard of a nightly run)")
    _add_report(p)
    p.set_defaults(func=cmd_mutate)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["gate"]:  # everything after `gate` is pytest's
        return cmd_gate(None, argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "deprecated", False):
        print("attncheck: `baseline update` is deprecated, use `budgets accept`", file=sys.stderr)
    try:
        return args.func(args)
    except CommandError as exc:
        print(f"attncheck {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
