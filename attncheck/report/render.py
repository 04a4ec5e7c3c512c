"""Render a merged report: report.json, report.md (also the CI step summary) and
report.html (one self-contained file: inline SVG charts and error maps, failures first)."""

from __future__ import annotations

import html
import json
import math
import os
import pathlib
import re
import tempfile
from collections import defaultdict

from attncheck.report import accepted as acc
from attncheck.report import history, parameter_coverage, plots
from attncheck.report.errormap import ErrorMap
from attncheck.report.model import PASS, Report, SummaryRow
from attncheck.report.policy import REGRESSION_FLOOR
from attncheck.report.records import Record

REPORT_FILES = ("report.json", "report.md", "report.html")


def write(directory: pathlib.Path, report: Report, *, accepted: acc.AcceptedBudgets | None = None,
          regression_floor: float = REGRESSION_FLOOR) -> None:
    """Write every report file (each whole, then renamed: a reader never sees half a file),
    record a complete run in the directory's budget history, and append the Markdown to
    $GITHUB_STEP_SUMMARY when set and the run is final. ``accepted``: the accepted budgets
    the run was judged against (the HTML's trend)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(report)
    earlier = history.read(directory)
    texts = {"report.json": dump_json(report), "report.md": markdown,
             "report.html": render_html(report, accepted, regression_floor,
                                        [e for e in earlier if e.run_id != report.run_id])}
    if (entries := history.updated(earlier, report)) is not None:
        texts[history.HISTORY_FILE] = history.dumps(entries)
    umask = os.umask(0)
    os.umask(umask)
    for name, text in texts.items():
        with tempfile.NamedTemporaryFile("w", dir=directory, prefix=f".{name}.", delete=False,
                                         encoding="utf-8") as tmp:
            tmp.write(text)
        os.chmod(tmp.name, 0o666 & ~umask)  # as an ordinary file, not the temporary file's 0600
        os.replace(tmp.name, directory / name)
    summary_path = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary_path and report.complete:
        with open(summary_path, "a", encoding="utf-8") as fh:
            fh.write(markdown)


def dump_json(report: Report) -> str:
    """report.json: the report indented, its records one per line, last. Indenting the
    records sends them through json's pure-Python encoder, several times slower than the
    compact C encoder; one line per record uses the C encoder and still diffs record by
    record."""
    data = report.to_json()
    records = data.pop("records")
    head = json.dumps(data, indent=1, sort_keys=True, allow_nan=False)
    if not records:
        return head[:-2] + ',\n "records": []\n}\n'
    lines = ",\n".join(json.dumps(r, sort_keys=True, allow_nan=False) for r in records)
    return head[:-2] + ',\n "records": [\n' + lines + "\n ]\n}\n"


def _fmt(value) -> str:
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.3g}"
    return str(value)


_MARKDOWN_SPECIAL = re.compile(r"([\\`*\[\]|~])")


def md(text) -> str:
    """Text from a kernel, an exception or a user, safe inside Markdown and its tables: HTML
    escaped, Markdown syntax backslash-escaped, one line."""
    return html.escape(_MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(str(text).split())), quote=True)


def md_code(text) -> str:
    """Untrusted text as inline code: <code> with HTML escaping (a backtick span cannot
    hold every string, and GitHub renders escaped entities literally inside <code>)."""
    return f"<code>{html.escape(' '.join(str(text).split()), quote=True).replace('|', '&#124;')}</code>"


def platform_line(report: Report) -> str:
    """What the numbers of the report belong to."""
    if report.platform is None:
        where = "not known (a run that did not record it, or shards of different platforms)"
    else:
        where = report.platform.describe() + (f" ({report.platform.cpu})" if report.platform.cpu else "")
    return where + (f"; hypothesis profile {report.profile}" if report.profile else "")


def render_markdown(report: Report) -> str:
    totals, failing = report.totals, report.failing
    wall = "wall unknown" if report.wall_s is None else f"wall {report.wall_s:.0f} s"
    out = [f"# attncheck: {report.verdict}", "",
           f"{totals.cases} cases, {totals.records} comparisons, {totals.failures} failing"
           + (f", {totals.deviations} expected deviations" if totals.deviations else "") + "; "
           f"{wall}; run {md_code(report.run_id)}" + ("" if report.complete else " (**incomplete**)"), "",
           f"Platform: {md(platform_line(report))}", ""]
    if report.shard is not None:
        shard = report.shard
        out += [f"Shard {shard.name} of a run: {shard.tests} of its {shard.collection_size} tests. "
                "`attncheck report merge` joins the shards' reports; coverage holes and numerics regressions "
                "are judged there, on the whole run.", ""]
    if report.unverified:
        out += ["## Nothing verified", ""] + [f"- {md(p)}" for p in report.unverified] + [""]
    if report.problems:
        out += ["## Gate problems", ""] + [f"- {md(p)}" for p in report.problems] + [""]
    if report.budget_differences:
        out += ["## Budgets above the accepted ones, not judged", "",
                *[f"- {md(p)}" for p in report.budget_differences], ""]
    if report.limitations:
        out += ["## Not run: unsupported by interpret mode or by the implementation", "",
                *[f"- {md(p)}" for p in report.limitations], ""]
    if failing:
        out += ["## Failures", "", "| kernel | impl | backend | direction | case | reason | reproduce |",
                "|---|---|---|---|---|---|---|"]
        for r in failing[:30]:
            out.append(f"| {md(r.kernel)} | {md(r.impl)} | {md(r.backend)} | {md(r.direction)} | "
                       f"{md_code(r.case_id)} | {md(r.reason[:160])} | {md_code(r.repro)} |")
        if len(failing) > 30:
            out.append(f"| ... {len(failing) - 30} more in report.json | | | | | | |")
        out.append("")
    if report.summary:
        out += ["## Summary", "",
                "| kernel | impl | backend | dtype | direction | cases | failures | worst budget | worst case |",
                "|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {md(row.kernel)} | {md(row.impl)} | {md(row.backend)} | {md(row.dtype)} | {md(row.direction)} | "
                f"{row.cases} | {row.failures} | {_fmt(row.worst_budget)} | {md_code(row.worst_case)} |"
                for row in report.summary]
        out.append("")
    if report.skipped_backends:
        out += ["## Backends not run", ""] + [f"- {md_code(s.backend)}: {md(s.reason)}"
                                             for s in report.skipped_backends] + [""]
    if report.coverage:
        out += ["## Coverage of bug classes (cases / failures)", ""]
        for kernel, classes in report.coverage.items():
            cells = ", ".join(f"{md(c)} {n.cases}/{n.failures}" + (" **(none)**" if n.cases == 0 else "")
                              for c, n in sorted(classes.items()))
            out.append(f"- **{md(kernel)}**: {cells}")
        out.append("")
    if report.deviations:
        out += ["## Declared deviations", "",
                "What an implementation knowingly does not do, each with its reason (`attncheck.expectations`): its "
                "cases run and are reported, and do not fail the gate; an entry whose deviation no longer occurs does.",
                "", "| family | implementation | deviation | reason | declared in | cases (showing it) | status |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {md(d.entry.family)} | {md_code(d.entry.implementation)} | {md(d.entry.kind)} "
                f"{md_code(d.entry.name)} | {md(d.entry.reason)} | {md(d.entry.source)} | {d.cases} ({d.shown}) | "
                f"{'**stale**' if d.status == 'stale' else md(d.status)} |" for d in report.deviations]
        out.append("")
    if report.declared:
        out += ["## Contracts", "",
                "What each family declares of its kernels: properties the gate holds every implementation to on "
                "purpose.", ""]
        for kernel, declared in report.declared.items():
            out.append(f"- **{md(kernel)}**")
            out += [f"  - {md(line)}" for line in declared.contracts]
        out.append("")
    if report.parameters:
        out += render_parameters_markdown(report)
    if report.device_growth:
        out += ["## Worst error against device count", "", "| kernel | direction | dtype | devices | worst max abs |",
                "|---|---|---|---|---|"]
        out += [f"| {md(g.kernel)} | {md(g.direction)} | {md(g.dtype)} | {g.devices} | {_fmt(g.worst_max_abs)} |"
                for g in report.device_growth]
        out.append("")
    if report.mutation:
        out += render_mutation_markdown(report.mutation)
    return "\n".join(out) + "\n"


def _values(values: parameter_coverage.ParameterValues) -> str:
    shown = list(values.cases.items())[:parameter_coverage.MAX_LISTED_VALUES]
    more = len(values.cases) - len(shown)
    return ", ".join(f"{v} ({n})" for v, n in shown) + (f", ... {more} more" if more > 0 else "")


def _cell(name: str, cell: str, n: int, fixed) -> str:
    if n:
        return f"{md(cell)} {n}"
    reason = parameter_coverage.fixed_reason(f"{name}={cell}", fixed)
    return f"{md(cell)} 0 (outside the convention: {md(reason)})" if reason else f"**{md(cell)} 0**"


def render_parameters_markdown(report: Report) -> list[str]:
    """Per family: how many parameters varied, the ones that did not (with the reason when
    the family keeps them fixed on purpose), and the whole table folded away."""
    out = ["## Parameter coverage", "",
           "Every parameter of each kernel's call (keywords, config fields, array axes and dtypes) and the "
           "values it took; one that kept a single value is a blind spot, and so is a cell of a real "
           "parameter (negative, zero, in (0, 1), one, above 1, not a power of two) that no case reached.", ""]
    for kernel, params in report.parameters.items():
        fixed = report.fixed_parameters.get(kernel, {})
        single = [(name, values) for name, values in params.items() if not values.varied]
        varied = len(params) - len(single)
        out.append(f"- **{md(kernel)}**: {varied} of {len(params)} parameters varied")
        for name, values in single:
            reason = parameter_coverage.fixed_reason(name, fixed)
            note = f"fixed: {md(reason)}" if reason else "**never varied**"
            out.append(f"  - {md_code(name)} = {md_code(next(iter(values.cases)))}: {note}")
        for name, values in params.items():
            if parameter_coverage.real_valued(values):
                out.append(f"  - {md_code(name)}, cases per cell: " + ", ".join(
                    _cell(name, cell, n, fixed) for cell, n in parameter_coverage.cells(values).items()))
    out += ["", "<details><summary>Every parameter and its values (cases)</summary>", "",
            "| kernel | parameter | values (cases) |", "|---|---|---|"]
    out += [f"| {md(kernel)} | {md_code(name)} | {md(_values(values))} |"
            for kernel, params in report.parameters.items() for name, values in params.items()]
    return out + ["", "</details>", ""]


def render_mutation_markdown(mutation: dict) -> list[str]:
    out = ["## Mutation testing", "", "| kernel | mutants | killed | survived | equivalent | kill rate |",
           "|---|---|---|---|---|---|"]
    for kernel, row in sorted(mutation.get("per_kernel", {}).items()):
        out.append(f"| {md(kernel)} | {row['total']} | {row['killed']} | {row['survived']} | "
                   f"{row['equivalent']} | {row['kill_rate']:.0%} |")
    survivors = [m for m in mutation.get("results", []) if m["status"] == "survived"]
    if survivors:
        out += ["", "Survivors:"] + [f"- {md_code(m['id'])}: {md(m['description'])}" for m in survivors]
    return out + [""]


# ---------------------------------------------------------------------------- HTML
# Failures shown as cards with their error map; the rest are listed in a table.
MAX_FAILURE_CARDS = 20
# Groups on the budget trend chart (the closest to their regression limit first).
MAX_TREND_ROWS = 40
DIRECTION_ORDER = ("out", "lse", "dq", "dk", "dv", "dab", "dbias", "dx", "dw_in", "db_in", "dw_out", "db_out")


def _slug(*parts) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(str(p) for p in parts))


def row_id(row: SummaryRow) -> str:
    """The HTML id of a summary row (the overview heatmap's cells link to it)."""
    return "s-" + _slug(row.kernel, row.impl, row.backend, row.dtype, row.direction)


def _direction_rank(direction: str) -> tuple:
    return (DIRECTION_ORDER.index(direction), "") if direction in DIRECTION_ORDER else (len(DIRECTION_ORDER), direction)


def _num(value) -> str:
    return "none" if value is None else f"{float(value):.7g}"


def _describe_worst(record: Record) -> str:
    m = record.metrics
    if m is None or m.worst_index is None:
        return ""
    names = record.error_map.axis_names if record.error_map is not None else ()
    where = (", ".join(f"{n}={i}" for n, i in zip(names, m.worst_index)) if len(names) == len(m.worst_index)
             else str(tuple(m.worst_index)))
    return (f"worst element at {where}: kernel {_num(m.worst_kernel)} vs oracle {_num(m.worst_oracle)} "
            f"(|difference| {_num(m.max_abs)}, allowed {_num(m.allowed)}, budget {_num(m.budget)})")


def _param_text(value) -> str:
    # Named pairs (block sizes) as name=value; everything else as JSON.
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) for p in value):
        return ", ".join(f"{name}={json.dumps(v, default=str)}" for name, v in value)
    return json.dumps(value, default=str)


def _params_table(record: Record) -> str:
    esc = html.escape
    params = dict(record.case.get("params") or {})
    cells = "".join(f"<tr><th>{esc(str(k))}</th><td>{esc(_param_text(v))}</td></tr>" for k, v in sorted(params.items()))
    settings = esc(json.dumps(dict(record.backend_settings), default=str))
    return (f"<table class='params'><tr><th>seed</th><td>{esc(str(record.case.get('seed', '')))}</td></tr>{cells}"
            f"<tr><th>backend settings</th><td>{settings}</td></tr></table>")


def _copyable(command: str) -> str:
    esc = html.escape
    return (f"<div class='repro'><code>{esc(command)}</code> "
            f"<button type='button' class='copy' data-copy='{esc(command, quote=True)}'>copy</button></div>")


def _map_caption(emap: ErrorMap) -> str:
    over = html.escape(", ".join(emap.reduced_names) or "it")
    return f"each cell: the worst |kernel - oracle| / allowed over {over}; lines: the kernel's block boundaries"


def _failure_card(index: int, record: Record) -> str:
    esc = html.escape
    emap = record.error_map
    title = f"{record.kernel}/{record.impl} {record.direction} on {record.backend} ({record.dtype})"
    figure = ""
    if emap is not None:
        svg = plots.error_map(emap, title=f"{record.direction}: error / allowed", element_id=f"map-f{index}")
        figure = f"<figure>{svg}<figcaption>Where it fails: {_map_caption(emap)}.</figcaption></figure>"
    trace = (f"<details><summary>traceback</summary><pre>{esc(record.traceback)}</pre></details>"
             if record.traceback else "")
    worst = _describe_worst(record)
    return (f"<section class='failure' id='f{index}'><h3>{esc(title)} <span class='fail'>"
            f"{esc(record.outcome.upper())}</span></h3>"
            f"<p class='reason'>{esc(record.reason[:1000])}</p>{_copyable(record.repro)}"
            f"<p>case <code>{esc(record.case_id)}</code></p>"
            + (f"<p class='worst'>{esc(worst)}</p>" if worst else "")
            + f"<div class='cardbody'>{figure}<details open><summary>case parameters</summary>{_params_table(record)}"
            f"</details></div>{trace}</section>")


def worst_passing_maps(records: list[Record]) -> list[tuple[Record, bool]]:
    """Per kernel x impl x direction: the worst passing record that carries a map, and
    whether it is the group's worst passing record (a tie may have kept another's map)."""
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        if r.passed and r.metrics is not None:
            groups[(r.kernel, r.impl, r.direction)].append(r)
    shown = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], _direction_rank(k[2]))):
        with_map = [r for r in groups[key] if r.error_map is not None]
        if with_map:
            best = max(with_map, key=lambda r: r.budget)
            shown.append((best, best.budget >= max(r.budget for r in groups[key])))
    return shown


def _numeric_groups(report: Report) -> set[tuple]:
    """(kernel, impl, backend, direction) that have numbers (not lowerings or crashes only)."""
    return {(r.kernel, r.impl, r.backend, r.direction) for r in report.records if r.metrics is not None}


def _overview_heatmap(report: Report) -> str:
    title = "worst budget per kernel x direction (click a cell for its row)"
    if not report.summary:
        return plots.no_data(title)
    directions = sorted({row.direction for row in report.summary}, key=_direction_rank)
    groups = sorted({(row.kernel, row.impl, row.backend, row.dtype) for row in report.summary})
    numeric = _numeric_groups(report)
    cells = {}
    for row in report.summary:
        key = (row.kernel, row.impl, row.backend, row.dtype)
        if (row.kernel, row.impl, row.backend, row.direction) in numeric:
            fill = plots.budget_css(row.worst_budget)
            text = "NaN/Inf" if math.isinf(row.worst_budget) else f"{row.worst_budget:.2g}"
        else:  # a lowering or a crash: no budget to colour by
            fill, text = ("#d9f0d3", "ok") if not row.failures else ("#f4a6a6", "fail")
        tip = (f"{'/'.join(key)} {row.direction}: worst budget {_fmt(row.worst_budget)}, {row.cases} cases, "
               f"{row.failures} failing; worst case {row.worst_case}")
        cells[(groups.index(key), directions.index(row.direction))] = (fill, text, tip, row_id(row))
    return plots.heatmap(title, [" ".join((f"{k}/{i}", b, d)) for k, i, b, d in groups], directions, cells,
                         row_groups=[g[0] for g in groups])


def _trend(report: Report, accepted: acc.AcceptedBudgets | None, floor: float,
           earlier: list[history.Entry]) -> str:
    if accepted is None and not earlier:
        return ("<p class='nodata'>Budget trend: no accepted budgets given (<code>--attncheck-accepted-budgets</code>, "
                "or <code>attncheck report --accepted-budgets</code>) and no earlier run recorded in this report "
                f"directory (<code>{history.HISTORY_FILE}</code>).</p>")
    numeric = _numeric_groups(report)
    rows = [row for row in report.summary if (row.kernel, row.impl, row.backend, row.direction) in numeric]
    trend_rows = [plots.TrendRow(f"{s.row.kernel}/{s.row.impl} {s.row.backend} {s.row.dtype} {s.row.direction}",
                                 s.row.worst_budget, s.accepted, s.limit,
                                 tuple((e.run_id, e.budgets[key]) for e in earlier
                                       if (key := history.group_key(s.row)) in e.budgets))
                  for s in acc.standings(rows, accepted, floor)]
    # The closest to (or furthest past) their regression limit first.
    trend_rows.sort(key=lambda r: -(r.now / r.limit if r.limit else r.now))
    more = len(trend_rows) - MAX_TREND_ROWS
    against = " and ".join(filter(None, ("the accepted budgets" if accepted is not None else "",
                                         f"the last {len(earlier)} runs" if earlier else "")))
    chart = plots.trend(f"worst budget: this run against {against}", trend_rows[:MAX_TREND_ROWS])
    return chart + (f"<p class='note'>{more} more groups, further from their limits, in the summary table.</p>"
                    if more > 0 else "")


def _header(*names: str) -> str:
    return "<tr>" + "".join(f"<th>{name}</th>" for name in names) + "</tr>"


def render_html(report: Report, accepted: acc.AcceptedBudgets | None = None,
                floor: float = REGRESSION_FLOOR, earlier: list[history.Entry] = ()) -> str:
    """report.html: one self-contained file (inline SVG and CSS, a few lines of script for
    the copy buttons; nothing loaded from the network or the disk). ``earlier``: the budget
    history of earlier runs, for the trend."""
    esc = html.escape
    numeric = [r for r in report.records if r.metrics is not None]
    # Error vs length: one plot per dtype (errors of f32 and bf16 differ by orders of
    # magnitude), one series per kernel.
    by_len: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in numeric:
        if math.isfinite(r.metrics.max_abs):
            by_len[r.dtype][r.kernel].append((r.seq_len, r.metrics.max_abs))
    # Error vs ring size: worst over the directions, one series per kernel and dtype.
    worst_dev: dict[tuple, float] = defaultdict(float)
    for g in report.device_growth:
        key = (f"{g.kernel} {g.dtype}", g.devices)
        worst_dev[key] = max(worst_dev[key], g.worst_max_abs)
    by_dev: dict[str, list] = defaultdict(list)
    for (name, devices), value in worst_dev.items():
        by_dev[name].append((devices, value))
    length_plots = "".join(
        "<figure>" + plots.scatter(f"max abs error vs sequence length ({dtype})", series, xlabel="sequence length",
                                   ylabel="max |kernel - oracle|", x_kind="log2")
        + f"<figcaption>Error against sequence length, {esc(dtype)} (one point per comparison)</figcaption></figure>"
        for dtype, series in sorted(by_len.items()))
    device_plot = ("<figure>" + plots.scatter("worst error vs device count", by_dev, xlabel="devices",
                                              ylabel="worst max |kernel - oracle|", x_kind="log2", join=True)
                   + "<figcaption>Ring kernels: worst error (over directions) against device count"
                   "</figcaption></figure>"
                   if by_dev else "")
    histogram = ("<figure>" + plots.histogram("budget of every comparison", [r.budget for r in numeric],
                                              xlabel="budget = error / allowed (1 = at the tolerance)")
                 + "<figcaption>Budget histogram</figcaption></figure>")
    failing = sorted(report.failing, key=lambda r: -r.budget)
    cards = "".join(_failure_card(i, r) for i, r in enumerate(failing[:MAX_FAILURE_CARDS]))
    rest = "".join(
        f"<tr><td>{esc(r.kernel)}/{esc(r.impl)}</td><td>{esc(r.backend)}</td><td>{esc(r.direction)}</td>"
        f"<td><code>{esc(r.case_id)}</code></td><td>{esc(r.reason[:300])}</td><td>{_copyable(r.repro)}</td></tr>"
        for r in failing[MAX_FAILURE_CARDS:])
    failures = ""
    if failing:
        failures = (f"<h2 id='failures'>Failures ({len(failing)})</h2>{cards}"
                    + (f"<h3>{len(failing) - MAX_FAILURE_CARDS} more</h3><table><tr><th>kernel</th><th>backend</th>"
                       f"<th>direction</th><th>case</th><th>reason</th><th>reproduce</th></tr>{rest}</table>"
                       if rest else ""))
    gallery = "".join(
        "<figure class='map'>" + plots.error_map(r.error_map, title=f"{r.kernel}/{r.impl} {r.direction}", max_px=220,
                                                 element_id=_slug("map", r.kernel, r.impl, r.direction))
        + f"<figcaption>worst passing: budget {_fmt(r.budget)} on {esc(r.backend)} {esc(r.dtype)}"
        + ("" if exact else " (a tie: the worst case with a map)")
        + f"<br>{_copyable(r.repro)}</figcaption></figure>"
        for r, exact in worst_passing_maps(report.records))
    rows = "".join(
        f"<tr id='{row_id(row)}' class='{'bad' if row.failures else ''}'>" + "".join(
            f"<td>{esc(_fmt(getattr(row, k)))}</td>" for k in ("kernel", "impl", "backend", "dtype", "direction",
                                                                "cases", "failures", "worst_budget", "worst_case"))
        + "</tr>" for row in report.summary)
    problems = "".join(f"<li>{esc(p)}</li>" for p in [*report.unverified, *report.problems])
    differences = "".join(f"<li>{esc(p)}</li>" for p in report.budget_differences)
    skipped = "".join(f"<li><code>{esc(s.backend)}</code>: {esc(s.reason)}</li>" for s in report.skipped_backends)
    limitations = "".join(f"<li>{esc(line)}</li>" for line in report.limitations)
    coverage = "".join(
        f"<tr><td>{esc(k)}</td><td>{esc(c)}</td><td>{n.cases}</td><td>{n.failures}</td></tr>"
        for k, classes in report.coverage.items() for c, n in sorted(classes.items()))
    declared_rows = "".join(
        f"<tr><td>{esc(k)}</td><td>{esc(line)}</td></tr>" for k, d in report.declared.items() for line in d.contracts)
    deviation_rows = "".join(
        f"<tr class='{'bad' if d.status == 'stale' else ''}'><td>{esc(d.entry.family)}</td>"
        f"<td><code>{esc(d.entry.implementation)}</code></td>"
        f"<td>{esc(d.entry.kind)} <code>{esc(d.entry.name)}</code></td>"
        f"<td>{esc(d.entry.reason)}</td><td>{esc(d.entry.source)}</td><td>{d.cases} ({d.shown})</td>"
        f"<td>{esc(d.status)}</td></tr>" for d in report.deviations)
    parameter_rows = "".join(
        f"<tr class='{'' if values.varied or fixed else 'bad'}'>"
        f"<td>{esc(k)}</td><td><code>{esc(name)}</code></td><td>{esc(_values(values))}</td>"
        f"<td>{esc(fixed or '')}</td></tr>"
        for k, params in report.parameters.items() for name, values in params.items()
        for fixed in [parameter_coverage.fixed_reason(name, report.fixed_parameters.get(k, {}))])
    sections = ((("failures", "failures"),) if failing else ()) + (
        ("overview", "overview"), ("maps", "error maps"), ("summary", "summary"), ("coverage", "coverage"),
        ("parameters", "parameters"))
    nav = " · ".join(f"<a href='#{target}'>{label}</a>" for target, label in sections)
    totals, ok = report.totals, report.verdict == PASS
    expected = f", {totals.deviations} expected deviations" if totals.deviations else ""
    deviations = ('<h2 id="deviations">Declared deviations</h2><table>' + _header(
        "family", "implementation", "deviation", "reason", "declared in", "cases (showing it)", "status")
        + deviation_rows + "</table>" if deviation_rows else "")
    contracts = ('<h2 id="declared">Contracts</h2><table>' + _header("kernel", "contract") + declared_rows
                 + "</table>" if declared_rows else "")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>attncheck report: {esc(report.verdict)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: left; }} th {{ background: #f0f0f0; }}
tr.bad td {{ background: #fde0e0; }} tr:target td {{ background: #fff3b0; }}
.status {{ font-size: 1.6em; font-weight: bold; }} .pass {{ color: #1a7f37; }} .fail {{ color: #cf222e; }}
.plots, .gallery {{ display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }}
figure {{ margin: 0.5em 0; }} figcaption {{ font-size: 12px; color: #444; max-width: 600px; }}
.gallery figcaption {{ max-width: 330px; overflow-wrap: anywhere; }}
section.failure {{ border: 1px solid #e3b4b4; border-left: 6px solid #cf222e; padding: 0.5em 1em; margin: 1em 0; }}
.cardbody {{ display: flex; flex-wrap: wrap; gap: 1.5em; align-items: flex-start; }}
.repro code {{ background: #f4f4f4; padding: 2px 6px; }} button.copy {{ font-size: 11px; cursor: pointer; }}
table.params {{ font-size: 12px; margin: 0.3em 0; }} .note, .nodata {{ color: #555; font-size: 13px; }}
</style></head><body>
<h1>attncheck report</h1>
<p class="status {'pass' if ok else 'fail'}">{esc(report.verdict)}</p>
<p>{totals.cases} cases, {totals.records} comparisons, {totals.failures} failing{expected}; run \
<code>{esc(report.run_id)}</code>{'' if report.complete else ' (incomplete)'}</p>
<p class="note">Platform: {esc(platform_line(report))}</p>
<p class="nav">{nav}</p>
{'<h2>Gate problems</h2><ul>' + problems + '</ul>' if problems else ''}
{'<h2>Budgets above the accepted ones, not judged</h2><ul>' + differences + '</ul>' if differences else ''}
{failures}
{'<h2>Not run: unsupported by interpret mode or by the implementation</h2><ul>' + limitations + '</ul>'
  if limitations else ''}
<h2 id="overview">Overview</h2>
{plots.colorbar()}
<div class="plots"><figure>{_overview_heatmap(report)}</figure></div>
{_trend(report, accepted, floor, list(earlier))}
<div class="plots">
{length_plots}
{histogram}
{device_plot}
</div>
<h2 id="maps">Error maps: the worst passing comparison of each kernel x direction</h2>
<p class="note">|kernel - oracle| / allowed over the direction's natural axes, worst over the others; lines are \
the kernel's block boundaries. <code>attncheck repro</code> prints the same map as text.</p>
<div class="gallery">{gallery or "<p class='nodata'>no error maps in these records</p>"}</div>
<h2 id="summary">Summary</h2><table>{_header("kernel", "impl", "backend", "dtype", "direction", "cases", "failures",
                                               "worst budget", "worst case")}{rows}</table>
{'<h2>Backends not run</h2><ul>' + skipped + '</ul>' if skipped else ''}
<h2 id="coverage">Coverage of bug classes</h2><table>{_header("kernel", "class", "cases", "failures")}{coverage}</table>
{deviations}
{contracts}
<h2 id="parameters">Parameter coverage</h2><table>{_header("kernel", "parameter", "values (cases)", "fixed because")}\
{parameter_rows}</table>
<script>{COPY_SCRIPT}</script>
</body></html>
"""


# The copy buttons: the clipboard API where the page is a secure context (file:// is),
# else a selected textarea.
COPY_SCRIPT = """
document.querySelectorAll("button.copy").forEach(function (button) {
  button.addEventListener("click", function () {
    var text = button.getAttribute("data-copy");
    function done() { button.textContent = "copied"; setTimeout(function () { button.textContent = "copy"; }, 1500); }
    function fallback() {
      var area = document.createElement("textarea");
      area.value = text; document.body.appendChild(area); area.select();
      try { document.execCommand("copy"); done(); } catch (e) { button.textContent = "select and copy"; }
      area.remove();
    }
    if (navigator.clipboard && window.isSecureContext) { navigator.clipboard.writeText(text).then(done, fallback); }
    else { fallback(); }
  });
});
"""
