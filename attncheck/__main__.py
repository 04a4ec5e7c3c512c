"""attncheck command line: report | repro CASE_ID | baseline update | durations update | mutate."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from attncheck import xla_env

xla_env.configure_before_jax_import()

DEFAULT_REPORT = "reports/latest"


def _find_record(report_dir: pathlib.Path, case_id: str, impl: str | None, backend: str | None) -> dict:
    from attncheck.report import records as rec

    candidates = []
    report = report_dir / "report.json"
    if report.exists():
        candidates = json.loads(report.read_text())["records"]
    if not candidates:
        candidates, _ = rec.read_records(report_dir)
    matches = [r for r in candidates if r["case_id"] == case_id
               and (impl is None or r["impl"] == impl) and (backend is None or r["backend"] == backend)]
    if not matches:
        raise SystemExit(f"attncheck repro: no record of case {case_id!r} in {report_dir} "
                         f"(impl={impl}, backend={backend}); run the gate first or pass --report")
    return matches[0]


def _describe_index(spec, direction: str, index) -> str:
    names = spec.index_names(direction)
    if not names or len(names) != len(index):
        return str(tuple(index))
    return ", ".join(f"{n}={i}" for n, i in zip(names, index))


def cmd_repro(args) -> int:
    from attncheck import backends, gate, specs

    record = _find_record(pathlib.Path(args.report), args.case_id, args.impl, args.backend)
    case = specs.Case.from_json(record["case"])
    specs.add_spec_modules(args.spec)
    if case.family not in specs.all_specs():
        raise SystemExit(f"attncheck repro: unknown kernel family {case.family!r} (known: "
                         f"{', '.join(sorted(specs.all_specs()))}); pass --spec MODULE for a user spec")
    spec = specs.all_specs()[case.family]
    backend_name = args.backend or record["backend"]
    impl = specs.resolve_impl(record["impl_ref"])
    print(f"case {case.id}: {spec.name} / {record['impl']} ({record['impl_ref']}) on {backend_name}")
    print("  parameters: " + ", ".join(f"{k}={v}" for k, v in sorted(case.params.items())) + f", seed={case.seed}")
    outcome = gate.check_case(spec, record["impl"], impl, case, backends.BACKENDS[backend_name])
    for r in outcome.records:
        line = f"  {r['direction']:>10}: {r['outcome'].upper():5} {r['reason']}"
        metrics = r.get("metrics")
        if metrics and metrics.get("worst_index") is not None:
            line += (f"\n{'':14}worst at {_describe_index(spec, r['direction'], metrics['worst_index'])}: "
                     f"kernel {metrics['worst_kernel']:.7g} vs oracle {metrics['worst_oracle']:.7g} "
                     f"(baseline error {metrics['baseline_err']:.3g}, allowed {metrics['allowed']:.3g}, "
                     f"budget {float(metrics['budget']):.3g}, ulp p99 {metrics['ulp_p99']:.3g})")
        if r.get("traceback") and args.verbose:
            line += "\n" + r["traceback"]
        print(line)
    return 1 if outcome.failures else 0


def cmd_report(args) -> int:
    from attncheck.report import records as rec
    from attncheck.report import render

    directory = pathlib.Path(args.report)
    records, _ = rec.read_records(directory)
    if not records:
        print(f"attncheck report: no records under {directory / rec.RECORDS_DIR}", file=sys.stderr)
        return 2
    # A merge done here (not by the pytest controller) is of a run that did not finish.
    result = render.write_reports(directory, run_id=records[0]["run_id"], complete=args.complete,
                                  baseline_path=args.baseline)
    print((directory / "report.md").read_text())
    return 1 if result.problems or result.report["totals"]["failures"] else 0


def cmd_baseline_update(args) -> int:
    from attncheck.report import render

    report = json.loads((pathlib.Path(args.report) / "report.json").read_text())
    baseline = render.baseline_from(report)
    pathlib.Path(args.output).write_text(json.dumps(baseline, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(baseline['budgets'])} accepted budgets to {args.output}")
    return 0


def cmd_durations_update(args) -> int:
    from attncheck import scheduling

    measured = pathlib.Path(args.report) / scheduling.REPORT_FILE
    if not measured.is_file():
        raise SystemExit(f"attncheck durations update: {measured} does not exist; run the tests first")
    count = scheduling.merge_into(pathlib.Path(args.output), measured)
    print(f"wrote {count} test durations to {args.output}")
    return 0


def cmd_mutate(args) -> int:
    from attncheck import mutation

    return mutation.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attncheck", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("repro", help="rerun one recorded case and show where it differs")
    p.add_argument("case_id")
    p.add_argument("--report", default=DEFAULT_REPORT)
    p.add_argument("--impl", default=None)
    p.add_argument("--backend", default=None)
    p.add_argument("--spec", action="append", default=[], metavar="MODULE",
                   help="a spec module the case's family comes from (as given to --attncheck-spec)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_repro)
    p = sub.add_parser("report", help="(re)merge the records of a run into its reports")
    p.add_argument("--report", default=DEFAULT_REPORT)
    p.add_argument("--baseline", default=None)
    p.add_argument("--complete", action="store_true", help="the run finished (default: mark incomplete)")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("baseline", help="manage reports/baseline.json")
    bsub = p.add_subparsers(dest="action", required=True)
    u = bsub.add_parser("update", help="accept the worst budgets of a passing run")
    u.add_argument("--report", default=DEFAULT_REPORT)
    u.add_argument("--output", default="reports/baseline.json")
    u.set_defaults(func=cmd_baseline_update)
    p = sub.add_parser("durations", help="manage the test durations that order the run")
    dsub = p.add_subparsers(dest="action", required=True)
    u = dsub.add_parser("update", help="merge the durations of a run into the committed file")
    u.add_argument("--report", default="reports/test")
    u.add_argument("--output", default="tests/durations.json")
    u.set_defaults(func=cmd_durations_update)
    p = sub.add_parser("mutate", help="run the mutant catalogue against the gate")
    p.add_argument("--kernel", default=None)
    p.add_argument("--mutant", action="append", default=None)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--sample", action="store_true", help="only the PR-gate sample of fast mutants")
    p.add_argument("--whole-gate", action="store_true",
                   help="run the whole gate (-x -n auto) against each mutant, not only its family's")
    p.add_argument("--report", default=DEFAULT_REPORT)
    p.set_defaults(func=cmd_mutate)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
