"""Render a merged report: report.json, report.md (also the CI step summary) and
report.html (self-contained, inline SVG)."""

from __future__ import annotations

import html
import json
import math
import os
import pathlib
import re
import tempfile
from collections import defaultdict

from attncheck.report.model import PASS, Report

REPORT_FILES = ("report.json", "report.md", "report.html")


def write(directory: pathlib.Path, report: Report) -> None:
    """Write every report file (each whole, then renamed: a reader never sees half a file)
    and append the Markdown to $GITHUB_STEP_SUMMARY when set and the run is final."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(report)
    texts = {"report.json": json.dumps(report.to_json(), indent=1, sort_keys=True, allow_nan=False),
             "report.md": markdown, "report.html": render_html(report)}
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


def render_markdown(report: Report) -> str:
    totals, failing = report.totals, report.failing
    wall = "wall unknown" if report.wall_s is None else f"wall {report.wall_s:.0f} s"
    out = [f"# attncheck: {report.verdict}", "",
           f"{totals.cases} cases, {totals.records} comparisons, {totals.failures} failing; "
           f"{wall}; run {md_code(report.run_id)}" + ("" if report.complete else " (**incomplete**)"), ""]
    if report.unverified:
        out += ["## Nothing verified", ""] + [f"- {md(p)}" for p in report.unverified] + [""]
    if report.problems:
        out += ["## Gate problems", ""] + [f"- {md(p)}" for p in report.problems] + [""]
    if report.limitations:
        out += ["## Not runnable in interpret mode", ""] + [f"- {md(p)}" for p in report.limitations] + [""]
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
    if report.device_growth:
        out += ["## Worst error against device count", "", "| kernel | direction | dtype | devices | worst max abs |",
                "|---|---|---|---|---|"]
        out += [f"| {md(g.kernel)} | {md(g.direction)} | {md(g.dtype)} | {g.devices} | {_fmt(g.worst_max_abs)} |"
                for g in report.device_growth]
        out.append("")
    if report.mutation:
        out += render_mutation_markdown(report.mutation)
    return "\n".join(out) + "\n"


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


def render_html(report: Report) -> str:
    numeric = [r for r in report.records if r.metrics is not None]
    # Error vs length: one plot per dtype (errors of f32 and bf16 differ by orders of
    # magnitude), one series per kernel.
    by_len: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in numeric:
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
        f'<figure>{_scatter_svg(f"max abs error vs sequence length ({dtype})", series, "sequence length", "max abs error (log10)")}'
        f"<figcaption>Error against sequence length, {html.escape(dtype)} (one point per comparison)</figcaption></figure>"
        for dtype, series in sorted(by_len.items()))
    esc = html.escape
    totals = report.totals
    ok = report.verdict == PASS
    rows = "".join(
        f"<tr class='{'bad' if row.failures else ''}'>" + "".join(
            f"<td>{esc(_fmt(getattr(row, k)))}</td>" for k in ("kernel", "impl", "backend", "dtype", "direction",
                                                                "cases", "failures", "worst_budget", "worst_case"))
        + "</tr>" for row in report.summary)
    failures = "".join(
        f"<tr><td>{esc(r.kernel)}</td><td>{esc(r.backend)}</td><td>{esc(r.direction)}</td>"
        f"<td><code>{esc(r.case_id)}</code></td><td>{esc(r.reason[:300])}</td>"
        f"<td><code>{esc(r.repro)}</code></td></tr>"
        for r in report.failing)
    problems = "".join(f"<li>{esc(p)}</li>" for p in [*report.unverified, *report.problems])
    skipped = "".join(f"<li><code>{esc(s.backend)}</code>: {esc(s.reason)}</li>" for s in report.skipped_backends)
    limitations = "".join(f"<li>{esc(line)}</li>" for line in report.limitations)
    coverage = "".join(
        f"<tr><td>{esc(k)}</td><td>{esc(c)}</td><td>{n.cases}</td><td>{n.failures}</td></tr>"
        for k, classes in report.coverage.items() for c, n in sorted(classes.items()))
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
<p class="status {'pass' if ok else 'fail'}">{esc(report.verdict)}</p>
<p>{totals.cases} cases, {totals.records} comparisons, {totals.failures} failing; run <code>{esc(report.run_id)}</code>{'' if report.complete else ' (incomplete)'}</p>
{'<h2>Gate problems</h2><ul>' + problems + '</ul>' if problems else ''}
{'<h2>Not runnable in interpret mode</h2><ul>' + limitations + '</ul>' if limitations else ''}
{'<h2>Failures</h2><table><tr><th>kernel</th><th>backend</th><th>direction</th><th>case</th><th>reason</th><th>reproduce</th></tr>' + failures + '</table>' if failures else ''}
<h2>Plots</h2><div class="plots">
{length_plots}
<figure>{_histogram_svg([r.budget for r in numeric])}<figcaption>Budget histogram (1 = at the tolerance)</figcaption></figure>
<figure>{_scatter_svg("worst error vs device count", by_dev, "devices", "worst max abs error (log10)", join=True)}<figcaption>Ring kernels: worst error (over directions) against device count</figcaption></figure>
</div>
<h2>Summary</h2><table><tr><th>kernel</th><th>impl</th><th>backend</th><th>dtype</th><th>direction</th><th>cases</th><th>failures</th><th>worst budget</th><th>worst case</th></tr>{rows}</table>
{'<h2>Backends not run</h2><ul>' + skipped + '</ul>' if skipped else ''}
<h2>Coverage of bug classes</h2><table><tr><th>kernel</th><th>class</th><th>cases</th><th>failures</th></tr>{coverage}</table>
</body></html>
"""
