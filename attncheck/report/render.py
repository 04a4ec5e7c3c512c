"""Merge records into report.json, report.md and report.html (self-contained, inline SVG)."""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
import pathlib
from collections import defaultdict

from attncheck.report import records as rec

# A budget may grow this much past the accepted baseline before the gate calls it a
# numerics regression: budgets of passing cases wobble with the drawn inputs.
REGRESSION_FACTOR = 1.5
# Budgets below this are within the run-to-run spread of worst cases (measured: the same
# code gave flash bf16 dk 0.139 under ./dev gate and 0.242 under ./dev test, whose drawn
# flash cases differ in 17 of 37); growth is judged from this level up.
REGRESSION_FLOOR = 1 / 3


@dataclasses.dataclass
class ReportResult:
    report: dict
    problems: list[str]


def _budget(record: dict) -> float:
    value = record.get("budget")
    if value is None:
        return 0.0 if record["outcome"] == "pass" else math.inf
    return float(value)


def summarize(records: list[dict]) -> list[dict]:
    groups = defaultdict(list)
    for r in records:
        groups[(r["kernel"], r["impl"], r["backend"], r.get("dtype", ""), r["direction"])].append(r)
    rows = []
    for (kernel, impl, backend, dtype, direction), rs in sorted(groups.items()):
        worst = max(rs, key=_budget)
        rows.append({"kernel": kernel, "impl": impl, "backend": backend, "dtype": dtype,
                     "direction": direction, "cases": len({r["case_id"] for r in rs}),
                     "comparisons": len(rs),
                     "failures": sum(r["outcome"] != "pass" for r in rs),
                     "worst_budget": _budget(worst), "worst_case": worst["case_id"],
                     "worst_repro": worst["repro"]})
    return rows


def coverage(records: list[dict], applicable: dict[str, tuple[str, ...]]) -> dict[str, dict[str, dict]]:
    """kernel -> class -> {cases, failures}: which bug classes this run exercised."""
    table: dict[str, dict[str, dict]] = {}
    for kernel, classes in applicable.items():
        if any(r["kernel"] == kernel for r in records):
            table[kernel] = {c: {"cases": 0, "failures": 0} for c in classes}
    seen: dict[tuple, bool] = {}
    for r in records:
        key = (r["kernel"], r["case_id"], r["backend"])
        seen[key] = seen.get(key, True) and r["outcome"] == "pass"
        for c in r.get("classes", []):
            table.setdefault(r["kernel"], {}).setdefault(c, {"cases": 0, "failures": 0})
    counted = set()
    for r in records:
        key = (r["kernel"], r["case_id"], r["backend"])
        if key in counted:
            continue
        counted.add(key)
        for c in r.get("classes", []):
            table[r["kernel"]][c]["cases"] += 1
            table[r["kernel"]][c]["failures"] += not seen[key]
    return table


def _accepted_impl(impl: str) -> str:
    # A user's implementation (--attncheck-impl) is held to the built-in one's budgets.
    return "builtin" if impl == "user" else impl


def regressions(rows: list[dict], baseline: dict, floor: float = REGRESSION_FLOOR) -> list[str]:
    """Budgets that grew past the accepted ones. Keyed by implementation too: a family's
    implementations differ legitimately (e.g. blockwise vs one-shot reductions), so each
    is compared with its own accepted budget, never with another's."""
    accepted = {(b["kernel"], b.get("impl", "builtin"), b["backend"], b["dtype"], b["direction"]): b["worst_budget"]
                for b in baseline.get("budgets", [])}
    found = []
    for row in rows:
        key = (row["kernel"], _accepted_impl(row["impl"]), row["backend"], row["dtype"], row["direction"])
        if key in accepted and row["worst_budget"] > REGRESSION_FACTOR * max(accepted[key], floor):
            found.append(f"numerics regression: {'/'.join((row['kernel'], row['impl']) + key[2:])} worst budget "
                         f"{row['worst_budget']:.3g} > {REGRESSION_FACTOR} x baseline {accepted[key]:.3g} "
                         f"(case {row['worst_case']})")
    return found


def baseline_from(report: dict) -> dict:
    """The accepted worst budgets: every passing group of the family's own implementations."""
    return {"schema_version": rec.SCHEMA_VERSION,
            "budgets": [{k: row[k] for k in ("kernel", "impl", "backend", "dtype", "direction", "worst_budget")}
                        for row in report["summary"] if row["impl"] != "user" and row["failures"] == 0]}


def build_report(records: list[dict], *, run_id, complete, problems, skipped_backends,
                 applicable, wall_s, mutation=None) -> dict:
    rows = summarize(records)
    return {
        "schema_version": rec.SCHEMA_VERSION, "run_id": run_id, "complete": complete,
        "wall_s": wall_s, "totals": {
            "records": len(records), "cases": len({(r["kernel"], r["case_id"]) for r in records}),
            "failures": sum(r["outcome"] != "pass" for r in records)},
        "skipped_backends": skipped_backends, "summary": rows,
        "coverage": coverage(records, applicable), "device_growth": device_growth(records),
        "problems": problems, "mutation": mutation, "records": records,
    }


def device_growth(records: list[dict]) -> list[dict]:
    """Worst error per kernel x direction x device count: error growth with ring size."""
    worst: dict[tuple, float] = {}
    for r in records:
        if r.get("device_count", 1) > 1 or r["kernel"].startswith("ring"):
            metrics = r.get("metrics") or {}
            key = (r["kernel"], r["direction"], r.get("dtype", ""), r.get("device_count", 1))
            worst[key] = max(worst.get(key, 0.0), float(metrics.get("max_abs", 0.0) or 0.0))
    return [{"kernel": k, "direction": d, "dtype": t, "devices": n, "worst_max_abs": v}
            for (k, d, t, n), v in sorted(worst.items())]


def write_reports(directory, *, run_id, complete, selected_backends=None, baseline_path=None,
                  require_coverage=False, wall_s=0.0, failed_tests=None,
                  regression_floor: float = REGRESSION_FLOOR) -> ReportResult:
    from attncheck import backends, specs

    directory = pathlib.Path(directory)
    records, problems = rec.read_records(directory, run_id)
    problems = list(problems)
    if not complete:
        problems.append("run interrupted: the report holds the records written before the stop")
    failing = [r for r in records if r["outcome"] != "pass"]
    # A test can fail without a failing record (a timeout, a crashed worker, a failing
    # non-gate test): the report must not say PASS then.
    recorded = {r.get("nodeid") for r in failing}
    problems += [f"{nodeid} failed without a failing record: {reason[:300]}"
                 for nodeid, reason in sorted((failed_tests or {}).items()) if nodeid not in recorded]
    skipped = [{"backend": name, "reason": reason} for name, b in backends.BACKENDS.items()
               if (reason := b.unavailable_reason()) is not None]
    if selected_backends:
        chosen = backends.parse_backend_option(selected_backends)
        skipped += [{"backend": n, "reason": "not selected (--attncheck-backend)"}
                    for n in backends.BACKENDS if n not in chosen and b_available(n)]
    applicable = {s.name: s.coverage_classes for s in specs.all_specs().values()}
    report = build_report(records, run_id=run_id, complete=complete, problems=problems,
                          skipped_backends=skipped, applicable=applicable, wall_s=wall_s,
                          mutation=_read_json(directory / "mutation.json"))
    if require_coverage:
        for kernel, classes in report["coverage"].items():
            missing = [c for c, n in classes.items() if n["cases"] == 0 and c in applicable.get(kernel, ())]
            if missing:
                problems.append(f"coverage: {kernel} never exercised {', '.join(missing)}")
    if baseline_path:
        baseline = _read_json(pathlib.Path(baseline_path))
        if baseline is None:
            problems.append(f"--attncheck-baseline: {baseline_path} does not exist or is not JSON")
        else:
            report["regressions"] = regressions(report["summary"], baseline, regression_floor)
            problems.extend(report["regressions"])
    report["problems"] = problems
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(json.dumps(_json_safe(report), indent=1, sort_keys=True, default=str,
                                                      allow_nan=False))
    markdown = render_markdown(report, failing)
    (directory / "report.md").write_text(markdown)
    (directory / "report.html").write_text(render_html(report))
    summary_path = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary_path:
        with open(summary_path, "a", encoding="utf-8") as fh:
            fh.write(markdown)
    return ReportResult(report, problems)


def _json_safe(value):
    """JSON has no inf/nan (JSON.parse rejects Python's Infinity): write them as "inf"/"nan",
    as records do (e.g. the worst budget of a group holding a crashed case)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def b_available(name: str) -> bool:
    from attncheck import backends

    return backends.BACKENDS[name].unavailable_reason() is None


def _read_json(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fmt(value) -> str:
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.3g}"
    return str(value)


def render_markdown(report: dict, failing: list[dict]) -> str:
    totals = report["totals"]
    status = "PASS" if not totals["failures"] and not report["problems"] else "FAIL"
    out = [f"# attncheck: {status}", "",
           f"{totals['cases']} cases, {totals['records']} comparisons, {totals['failures']} failing; "
           f"wall {report['wall_s']:.0f} s; run `{report['run_id']}`"
           + ("" if report["complete"] else " (**incomplete**)"), ""]
    if report["problems"]:
        out += ["## Gate problems", ""] + [f"- {p}" for p in report["problems"]] + [""]
    if failing:
        out += ["## Failures", "", "| kernel | impl | backend | direction | case | reason | reproduce |",
                "|---|---|---|---|---|---|---|"]
        for r in failing[:30]:
            reason = r["reason"].replace("|", "\\|").replace("\n", " ")[:160]
            out.append(f"| {r['kernel']} | {r['impl']} | {r['backend']} | {r['direction']} | "
                       f"`{r['case_id']}` | {reason} | `{r['repro']}` |")
        if len(failing) > 30:
            out.append(f"| ... {len(failing) - 30} more in report.json | | | | | | |")
        out.append("")
    out += ["## Summary", "", "| kernel | impl | backend | dtype | direction | cases | failures | worst budget | worst case |",
            "|---|---|---|---|---|---|---|---|---|"]
    for row in report["summary"]:
        out.append(f"| {row['kernel']} | {row['impl']} | {row['backend']} | {row['dtype']} | {row['direction']} | "
                   f"{row['cases']} | {row['failures']} | {_fmt(row['worst_budget'])} | `{row['worst_case']}` |")
    out.append("")
    if report["skipped_backends"]:
        out += ["## Backends not run", ""] + [f"- `{s['backend']}`: {s['reason']}" for s in report["skipped_backends"]] + [""]
    if report["coverage"]:
        out += ["## Coverage of bug classes (cases / failures)", ""]
        for kernel, classes in report["coverage"].items():
            cells = ", ".join(f"{c} {n['cases']}/{n['failures']}" + (" **(none)**" if n["cases"] == 0 else "")
                              for c, n in sorted(classes.items()))
            out.append(f"- **{kernel}**: {cells}")
        out.append("")
    if report["device_growth"]:
        out += ["## Worst error against device count", "", "| kernel | direction | dtype | devices | worst max abs |",
                "|---|---|---|---|---|"]
        out += [f"| {g['kernel']} | {g['direction']} | {g['dtype']} | {g['devices']} | {_fmt(g['worst_max_abs'])} |"
                for g in report["device_growth"]]
        out.append("")
    if report.get("mutation"):
        out += render_mutation_markdown(report["mutation"])
    return "\n".join(out) + "\n"


def render_mutation_markdown(mutation: dict) -> list[str]:
    out = ["## Mutation testing", "", "| kernel | mutants | killed | survived | equivalent | kill rate |",
           "|---|---|---|---|---|---|"]
    for kernel, row in sorted(mutation.get("per_kernel", {}).items()):
        out.append(f"| {kernel} | {row['total']} | {row['killed']} | {row['survived']} | "
                   f"{row['equivalent']} | {row['kill_rate']:.0%} |")
    survivors = [m for m in mutation.get("results", []) if m["status"] == "survived"]
    if survivors:
        out += ["", "Survivors:"] + [f"- `{m['id']}`: {m['description']}" for m in survivors]
    return out + [""]


# ---------------------------------------------------------------------------- HTML

# The plot area spans _PLOT_W; the legend column to its right holds the series names.
_PLOT_W, _LEGEND_W, _SVG_H, _PAD = 520, 210, 260, 44
_SVG_W = _PLOT_W + _LEGEND_W
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def _scatter_svg(title: str, series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str,
                 log_y: bool = True, join: bool = False) -> str:
    points = [p for ps in series.values() for p in ps if p[1] > 0 or not log_y]
    if not points:
        return f"<p>{html.escape(title)}: no data</p>"
    ys = [math.log10(y) if log_y else y for _, y in points]
    xs = [x for x, _ in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def sx(x):
        return _PAD + (x - x0) / (x1 - x0) * (_PLOT_W - 2 * _PAD)

    def sy(y):
        return _SVG_H - _PAD - (y - y0) / (y1 - y0) * (_SVG_H - 2 * _PAD)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_SVG_W}" height="{_SVG_H}" role="img">',
             f'<title>{html.escape(title)}</title>',
             f'<line x1="{_PAD}" y1="{_SVG_H - _PAD}" x2="{_PLOT_W - _PAD}" y2="{_SVG_H - _PAD}" stroke="#444"/>',
             f'<line x1="{_PAD}" y1="{_PAD}" x2="{_PAD}" y2="{_SVG_H - _PAD}" stroke="#444"/>',
             f'<text x="{_PLOT_W / 2}" y="{_SVG_H - 8}" text-anchor="middle" font-size="12">{html.escape(xlabel)}</text>',
             f'<text x="12" y="{_SVG_H / 2}" font-size="12" transform="rotate(-90 12 {_SVG_H / 2})" '
             f'text-anchor="middle">{html.escape(ylabel)}</text>',
             f'<text x="{_PAD}" y="{_SVG_H - _PAD + 14}" font-size="10">{x0:g}</text>',
             f'<text x="{_PLOT_W - _PAD}" y="{_SVG_H - _PAD + 14}" font-size="10" text-anchor="end">{x1:g}</text>',
             f'<text x="{_PAD - 4}" y="{_SVG_H - _PAD}" font-size="10" text-anchor="end">'
             f'{("1e%.0f" % y0) if log_y else f"{y0:.3g}"}</text>',
             f'<text x="{_PAD - 4}" y="{_PAD + 4}" font-size="10" text-anchor="end">'
             f'{("1e%.0f" % y1) if log_y else f"{y1:.3g}"}</text>']
    for i, (name, ps) in enumerate(sorted(series.items())):
        color = _COLORS[i % len(_COLORS)]
        if join:
            path = " ".join(f"{sx(x):.1f},{sy(math.log10(y) if log_y else y):.1f}"
                            for x, y in sorted(ps) if y > 0 or not log_y)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-opacity="0.6"/>')
        for x, y in ps:
            if log_y and y <= 0:
                continue
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(math.log10(y) if log_y else y):.1f}" r="3" '
                         f'fill="{color}" fill-opacity="0.7"><title>{html.escape(name)}: {x:g}, {y:.3g}</title></circle>')
        parts.append(f'<text x="{_PLOT_W + 4}" y="{_PAD + 14 * i}" font-size="11" fill="{color}">'
                     f'{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _histogram_svg(values: list[float], bins: int = 20) -> str:
    finite = [min(v, 1.5) for v in values if math.isfinite(v)]
    if not finite:
        return "<p>budget histogram: no data</p>"
    counts = [0] * bins
    for v in finite:
        counts[min(int(v / 1.5 * bins), bins - 1)] += 1
    top = max(counts)
    bar_w = (_SVG_W - 2 * _PAD) / bins
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_SVG_W}" height="{_SVG_H}" role="img">',
             "<title>budget histogram</title>"]
    for i, c in enumerate(counts):
        h = (c / top) * (_SVG_H - 2 * _PAD)
        lo = i * 1.5 / bins
        color = "#d62728" if lo >= 1.0 else "#1f77b4"
        parts.append(f'<rect x="{_PAD + i * bar_w:.1f}" y="{_SVG_H - _PAD - h:.1f}" width="{bar_w - 1:.1f}" '
                     f'height="{h:.1f}" fill="{color}"><title>budget {lo:.2f}-{lo + 1.5 / bins:.2f}: {c}</title></rect>')
    x_one = _PAD + (1.0 / 1.5) * (_SVG_W - 2 * _PAD)
    parts += [f'<line x1="{x_one:.1f}" y1="{_PAD}" x2="{x_one:.1f}" y2="{_SVG_H - _PAD}" stroke="#d62728" stroke-dasharray="4"/>',
              f'<text x="{x_one + 4:.1f}" y="{_PAD}" font-size="10">budget 1 = tolerance</text>',
              f'<text x="{_SVG_W / 2}" y="{_SVG_H - 8}" text-anchor="middle" font-size="12">'
              'budget = error / allowed (values over 1.5 clipped)</text>',
              f'<text x="{_PAD}" y="{_SVG_H - _PAD + 14}" font-size="10">0</text>',
              f'<text x="{_PAD - 4}" y="{_PAD + 4}" font-size="10" text-anchor="end">{top}</text></svg>']
    return "".join(parts)


def render_html(report: dict) -> str:
    numeric = [r for r in report["records"] if r.get("metrics")]
    # Error vs length: one plot per dtype (errors of f32 and bf16 differ by orders of
    # magnitude), one series per kernel.
    by_len: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in numeric:
        by_len[r.get("dtype", "")][r["kernel"]].append((r.get("seq_len", 0), r["metrics"]["max_abs"]))
    # Error vs ring size: worst over the directions, one series per kernel and dtype.
    worst_dev: dict[tuple, float] = defaultdict(float)
    for g in report["device_growth"]:
        key = (f"{g['kernel']} {g['dtype']}", g["devices"])
        worst_dev[key] = max(worst_dev[key], g["worst_max_abs"])
    by_dev: dict[str, list] = defaultdict(list)
    for (name, devices), value in worst_dev.items():
        by_dev[name].append((devices, value))
    length_plots = "".join(
        f'<figure>{_scatter_svg(f"max abs error vs sequence length ({dtype})", series, "sequence length", "max abs error (log10)")}'
        f"<figcaption>Error against sequence length, {html.escape(dtype)} (one point per comparison)</figcaption></figure>"
        for dtype, series in sorted(by_len.items()))
    esc = html.escape
    totals = report["totals"]
    ok = not totals["failures"] and not report["problems"]
    rows = "".join(
        f"<tr class='{'bad' if row['failures'] else ''}'>" + "".join(
            f"<td>{esc(_fmt(row[k]))}</td>" for k in ("kernel", "impl", "backend", "dtype", "direction",
                                                       "cases", "failures", "worst_budget", "worst_case"))
        + "</tr>" for row in report["summary"])
    failures = "".join(
        f"<tr><td>{esc(r['kernel'])}</td><td>{esc(r['backend'])}</td><td>{esc(r['direction'])}</td>"
        f"<td><code>{esc(r['case_id'])}</code></td><td>{esc(r['reason'][:300])}</td>"
        f"<td><code>{esc(r['repro'])}</code></td></tr>"
        for r in report["records"] if r["outcome"] != "pass")
    problems = "".join(f"<li>{esc(p)}</li>" for p in report["problems"])
    skipped = "".join(f"<li><code>{esc(s['backend'])}</code>: {esc(s['reason'])}</li>" for s in report["skipped_backends"])
    coverage = "".join(
        f"<tr><td>{esc(k)}</td><td>{esc(c)}</td><td>{n['cases']}</td><td>{n['failures']}</td></tr>"
        for k, classes in report["coverage"].items() for c, n in sorted(classes.items()))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>attncheck report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; }} th {{ background: #f0f0f0; }}
tr.bad td {{ background: #fde0e0; }} .status {{ font-size: 1.6em; font-weight: bold; }}
.pass {{ color: #1a7f37; }} .fail {{ color: #cf222e; }} .plots {{ display: flex; flex-wrap: wrap; gap: 1em; }}
</style></head><body>
<h1>attncheck report</h1>
<p class="status {'pass' if ok else 'fail'}">{'PASS' if ok else 'FAIL'}</p>
<p>{totals['cases']} cases, {totals['records']} comparisons, {totals['failures']} failing; run <code>{esc(str(report['run_id']))}</code>{'' if report['complete'] else ' (incomplete)'}</p>
{'<h2>Gate problems</h2><ul>' + problems + '</ul>' if problems else ''}
{'<h2>Failures</h2><table><tr><th>kernel</th><th>backend</th><th>direction</th><th>case</th><th>reason</th><th>reproduce</th></tr>' + failures + '</table>' if failures else ''}
<h2>Plots</h2><div class="plots">
{length_plots}
<figure>{_histogram_svg([_budget(r) for r in numeric])}<figcaption>Budget histogram (1 = at the tolerance)</figcaption></figure>
<figure>{_scatter_svg("worst error vs device count", by_dev, "devices", "worst max abs error (log10)", join=True)}<figcaption>Ring kernels: worst error (over directions) against device count</figcaption></figure>
</div>
<h2>Summary</h2><table><tr><th>kernel</th><th>impl</th><th>backend</th><th>dtype</th><th>direction</th><th>cases</th><th>failures</th><th>worst budget</th><th>worst case</th></tr>{rows}</table>
{'<h2>Backends not run</h2><ul>' + skipped + '</ul>' if skipped else ''}
<h2>Coverage of bug classes</h2><table><tr><th>kernel</th><th>class</th><th>cases</th><th>failures</th></tr>{coverage}</table>
</body></html>
"""
