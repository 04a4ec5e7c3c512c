"""Charts for report.html as inline SVG: axes with ticks and gridlines, log axes with a
separate "exact 0" band (a zero error is a result, not a reason to stretch the axis to
1e-24), heatmaps, the budget trend against the accepted budgets, and error maps (an
embedded PNG of the cells under SVG axes and block boundaries).

Hand-written rather than matplotlib: on a full gate report matplotlib's import alone
takes several times longer than this whole page, drawing with it far longer, and it would
be a large new dependency (docs/DESIGN.md, "Reports", has the figures).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import math
import struct
import zlib
from collections.abc import Iterable, Sequence

import numpy as np

from attncheck.report import errormap
from attncheck.report.errormap import DONT_CARE, ErrorMap

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
          "#7f7f7f", "#bcbd22")
FONT = 'font-family="system-ui, sans-serif"'


def esc(value) -> str:
    return html.escape(str(value))


def linear_ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> list[float]:
    """About ``count`` round values (1, 2, 2.5, 5 x 10^k steps) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, count)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    if integer:
        step = max(1, round(step))
    first = math.ceil(lo / step - 1e-9) * step
    ticks, value = [], first
    while value <= hi + 1e-9 * step:
        ticks.append(round(value, 12))
        value += step
    return ticks


def index_ticks(length: int, count: int = 5) -> list[int]:
    """Ticks of an index axis [0, length]: multiples of a power of two (block sizes are)."""
    step = 1
    while length / step > count:
        step *= 2
    return list(range(0, length + 1, step))


def _fmt_tick(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e5 or abs(value) < 1e-3:
        return f"{value:.0e}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")
    return f"{value:g}"


def _fmt_log(value: float) -> str:
    """Log-axis labels: plain from 0.001 to 1000, else 1e-6, 2e-5."""
    if 1e-3 <= value < 1e4:
        return f"{value:g}"
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _fmt_decade(exponent: int) -> str:
    return _fmt_log(10.0 ** exponent)


class Scale:
    """A linear, log10 or log2 mapping of data values onto [p0, p1] pixels."""

    def __init__(self, kind: str, lo: float, hi: float, p0: float, p1: float):
        self.kind, self.p0, self.p1 = kind, p0, p1
        self.lo, self.hi = self._t(lo), self._t(hi)
        if self.hi <= self.lo:
            self.lo, self.hi = self.lo - 0.5, self.hi + 0.5

    def _t(self, v: float) -> float:
        if self.kind == "log10":
            return math.log10(v)
        if self.kind == "log2":
            return math.log2(v)
        return v

    def __call__(self, v: float) -> float:
        return self.p0 + (self._t(v) - self.lo) / (self.hi - self.lo) * (self.p1 - self.p0)

    def ticks(self) -> list[tuple[float, str]]:
        if self.kind == "log10":
            lo, hi = math.floor(self.lo + 1e-9), math.ceil(self.hi - 1e-9)
            stride = max(1, math.ceil((hi - lo) / 8))
            # Over three decades or fewer, 2x and 5x are labelled too.
            steps = (1, 2, 5) if hi - lo <= 3 else (1,)
            return [(m * 10.0 ** e, _fmt_log(m * 10.0 ** e))
                    for e in range(lo, hi + 1, stride) for m in steps
                    if self.lo - 1e-9 <= math.log10(m * 10.0 ** e) <= self.hi + 1e-9]
        if self.kind == "log2":
            lo, hi = math.ceil(self.lo - 1e-9), math.floor(self.hi + 1e-9)
            return [(2.0 ** e, _fmt_tick(2.0 ** e)) for e in range(lo, hi + 1)]
        return [(v, _fmt_tick(v)) for v in linear_ticks(self.lo, self.hi, 5)]


def _log_range(values: Iterable[float]) -> tuple[float, float]:
    """Whole decades around the positive values."""
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if not positive:
        return 1e-1, 1.0
    lo, hi = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
    if hi == lo:
        hi += 1
    return 10.0 ** lo, 10.0 ** hi


def _svg_open(width: float, height: float, title: str, kind: str) -> list[str]:
    return [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot {kind}" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" {FONT}>', f"<title>{esc(title)}</title>",
            f'<text x="8" y="16" font-size="13" font-weight="bold">{esc(title)}</text>']


def no_data(title: str) -> str:
    return f'<p class="nodata">{esc(title)}: no data</p>'


# A log axis shows at most this many decades below its top: one denormal-sized error must
# not squeeze every other point into a strip. Smaller values sit on the bottom edge as
# downward triangles (their value in the tooltip).
MAX_DECADES = 10


def scatter(title: str, series: dict[str, list[tuple[float, float]]], *, xlabel: str, ylabel: str,
            x_kind: str = "linear", join: bool = False, threshold: float | None = None,
            width: int = 640, height: int = 300) -> str:
    """Points (and optionally lines) per series, y on a log10 axis with an "exact 0" band
    below it for zero values; x linear or log2 (sizes and device counts; x = 0 then gets
    its own column at the left)."""
    points = [(x, y) for ps in series.values() for x, y in ps if math.isfinite(y)]
    if not points:
        return no_data(title)
    legend_w = 24 + 6.2 * max(len(name) for name in series)
    left, right, top, bottom = 70, 14, 28, 44
    width = max(width, int(left + right + 300 + legend_w))
    plot_w = width - left - right - legend_w
    zero_band = any(y == 0 for _, y in points)
    band_h = 22 if zero_band else 0
    plot_h = height - top - bottom - band_h
    xs = [x for x, _ in points]
    positive_xs = [x for x in xs if x > 0]
    if x_kind == "log2" and (not positive_xs or max(positive_xs) / min(positive_xs) < 4):
        x_kind = "linear"
    zero_col = 26 if x_kind == "log2" and any(x <= 0 for x in xs) else 0
    if x_kind == "linear":
        x_lo, x_hi = min(xs), max(xs)
        pad = (x_hi - x_lo) * 0.05 or 1.0
        x_lo, x_hi = x_lo - pad, x_hi + pad
    else:
        x_lo, x_hi = min(positive_xs) / 1.25, max(positive_xs) * 1.25
    y_values = [y for _, y in points] + ([threshold] if threshold else [])
    y_lo, y_hi = _log_range(y_values)
    y_lo = max(y_lo, y_hi / 10.0 ** MAX_DECADES)
    sx = Scale(x_kind, x_lo, x_hi, left + zero_col, left + plot_w)
    sy = Scale("log10", y_lo, y_hi, top + plot_h, top)
    out = _svg_open(width, height, title, "scatter")
    x_ticks = sx.ticks()
    if x_kind == "linear":  # integer data (lengths, counts): label the values themselves when few
        distinct = sorted(set(xs))
        if len(distinct) <= 8:
            x_ticks = [(v, _fmt_tick(v)) for v in distinct]
    zero_x = left + zero_col / 2

    def px(x: float) -> float:
        return zero_x if zero_col and x <= 0 else sx(x)

    for value, label in x_ticks + ([(0, "0")] if zero_col else []):
        x = px(value)
        bottom_y = top + plot_h + band_h
        out.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom_y}" stroke="#e3e3e3"/>'
                   f'<text x="{x:.1f}" y="{bottom_y + 14}" font-size="10" text-anchor="middle">{esc(label)}</text>')
    if zero_col:
        out.append(f'<line x1="{left + zero_col}" x2="{left + zero_col}" y1="{top}" y2="{top + plot_h}" stroke="#bbb" '
                   f'stroke-dasharray="3 2"/>')
    for value, label in sy.ticks():
        y = sy(value)
        out.append(f'<line class="grid" x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e3e3e3"/>'
                   f'<text x="{left - 5}" y="{y + 3.5:.1f}" font-size="10" text-anchor="end">{esc(label)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>')
    zero_y = top + plot_h + band_h / 2 + 2
    if zero_band:
        out.append(f'<rect x="{left}" y="{top + plot_h + 6}" width="{plot_w}" height="{band_h - 6}" fill="#f6f6f6" '
                   f'stroke="#bbb" stroke-dasharray="3 2"/>'
                   f'<text x="{left - 5}" y="{zero_y + 3.5:.1f}" font-size="10" text-anchor="end">exact 0</text>')
    if any(0 < y < y_lo for _, y in points):
        out.append(f'<text x="{left + plot_w - 4}" y="{top + plot_h - 4}" font-size="9" text-anchor="end" fill="#555">'
                   f'&#9660; below {_fmt_log(y_lo)}</text>')
    if threshold:
        y = sy(threshold)
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#d62728" '
                   f'stroke-dasharray="5 3"/><text x="{left + plot_w - 4}" y="{y - 4:.1f}" font-size="10" '
                   f'text-anchor="end" fill="#d62728">{threshold:g} = tolerance</text>')
    out.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" font-size="11" text-anchor="middle">'
               f'{esc(xlabel)}</text><text x="14" y="{top + plot_h / 2:.1f}" font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 14 {top + plot_h / 2:.1f})">{esc(ylabel)}</text>')
    for i, (name, ps) in enumerate(sorted(series.items())):
        color = COLORS[i % len(COLORS)]
        finite = sorted((x, y) for x, y in ps if math.isfinite(y))

        def py(y):
            return zero_y if y == 0 else sy(max(y, y_lo))

        if join and len(finite) > 1:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in finite)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-opacity="0.7"/>')
        for x, y in finite:
            tip = f"<title>{esc(name)}: {x:g}, {y:.3g}</title>"
            if 0 < y < y_lo:
                cx, cy = px(x), sy(y_lo)
                out.append(f'<path class="pt" d="M{cx - 4:.1f},{cy - 6:.1f}h8l-4,6z" fill="{color}">{tip}</path>')
            else:
                out.append(f'<circle class="pt" cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}" '
                           f'fill-opacity="0.65">{tip}</circle>')
        ly = top + 4 + 15 * i
        out.append(f'<circle cx="{left + plot_w + 16}" cy="{ly:.0f}" r="4" fill="{color}"/>'
                   f'<text x="{left + plot_w + 24}" y="{ly + 4:.0f}" font-size="11">{esc(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def histogram(title: str, values: Sequence[float], *, xlabel: str, bins: int = 24, clip: float = 1.5,
              width: int = 600, height: int = 260) -> str:
    """Budgets in [0, clip] (larger ones in the last bin, labelled), bars past 1 in red,
    ticks on both axes, exact zeros counted apart."""
    finite = [v for v in values if math.isfinite(v)]
    infinite = len(values) - len(finite)
    if not values:
        return no_data(title)
    left, right, top, bottom = 56, 14, 28, 46
    plot_w, plot_h = width - left - right, height - top - bottom
    counts = [0] * bins
    for v in finite:
        counts[min(int(max(v, 0.0) / clip * bins), bins - 1)] += 1
    counts[-1] += infinite
    peak = max(counts) or 1
    sx = Scale("linear", 0.0, clip, left, left + plot_w)
    sy = Scale("linear", 0.0, peak * 1.08, top + plot_h, top)
    out = _svg_open(width, height, title, "histogram")
    for value, label in sy.ticks():
        if value < 0 or value != int(value):
            continue
        y = sy(value)
        out.append(f'<line class="grid" x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e3e3e3"/>'
                   f'<text x="{left - 5}" y="{y + 3.5:.1f}" font-size="10" text-anchor="end">{label}</text>')
    bar_w = plot_w / bins
    for i, c in enumerate(counts):
        lo = i * clip / bins
        x, y = left + i * bar_w, sy(c)
        color = "#d62728" if lo >= 1.0 else "#1f77b4"
        last = i == bins - 1
        label = f"budget {lo:.3g}-{lo + clip / bins:.3g}" + (" and above" if last else "")
        out.append(f'<rect class="bar" x="{x + 0.5:.1f}" y="{y:.1f}" width="{bar_w - 1:.1f}" '
                   f'height="{top + plot_h - y:.1f}" fill="{color}"><title>{label}: {c}</title></rect>')
    for value in linear_ticks(0.0, clip, 6):
        x = sx(value)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + plot_h}" y2="{top + plot_h + 4}" stroke="#444"/>'
                   f'<text x="{x:.1f}" y="{top + plot_h + 15}" font-size="10" text-anchor="middle">'
                   f'{_fmt_tick(value)}</text>')
    x_one = sx(1.0)
    zeros = sum(1 for v in finite if v == 0)
    out += [f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>',
            f'<line x1="{x_one:.1f}" y1="{top}" x2="{x_one:.1f}" y2="{top + plot_h}" stroke="#d62728" '
            'stroke-dasharray="4"/>',
            f'<text x="{x_one + 4:.1f}" y="{top + 12}" font-size="10" fill="#d62728">1 = tolerance</text>',
            f'<text x="{width - right}" y="16" font-size="10" text-anchor="end">'
            f'{len(values)} comparisons; {zeros} exact 0; last bin: &gt;= {clip - clip / bins:.3g}</text>',
            f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" font-size="11" text-anchor="middle">'
            f'{esc(xlabel)}</text>',
            f'<text x="14" y="{top + plot_h / 2:.1f}" font-size="11" text-anchor="middle" '
            f'transform="rotate(-90 14 {top + plot_h / 2:.1f})">comparisons</text>', "</svg>"]
    return "".join(out)


def heatmap(title: str, row_labels: Sequence[str], col_labels: Sequence[str],
            cells: dict[tuple[int, int], tuple[str, str, str, str]], *, row_groups: Sequence[str] = ()) -> str:
    """A table-like heatmap: cells[(r, c)] = (fill colour, text, tooltip, link target id)."""
    if not row_labels or not col_labels:
        return no_data(title)
    label_w = 8 + 6.0 * max(len(s) for s in row_labels)
    cw, ch, top = max(62, 8 + 7 * max(len(c) for c in col_labels)), 20, 44
    width = label_w + cw * len(col_labels) + 12
    height = top + ch * len(row_labels) + 12
    out = _svg_open(width, height, title, "heatmap")
    for c, label in enumerate(col_labels):
        out.append(f'<text x="{label_w + c * cw + cw / 2:.1f}" y="{top - 6}" font-size="11" text-anchor="middle" '
                   f'font-weight="bold">{esc(label)}</text>')
    previous = None
    for r, label in enumerate(row_labels):
        y = top + r * ch
        group = row_groups[r] if r < len(row_groups) else None
        if group is not None and group != previous and r:
            out.append(f'<line x1="4" x2="{width - 4:.0f}" y1="{y:.1f}" y2="{y:.1f}" stroke="#888"/>')
        previous = group
        out.append(f'<text x="{label_w - 6:.1f}" y="{y + 14:.1f}" font-size="11" text-anchor="end">{esc(label)}</text>')
    for (r, c), (fill, text, tooltip, target) in sorted(cells.items()):
        x, y = label_w + c * cw, top + r * ch
        dark = _is_dark(fill)
        cell = (f'<rect class="cell" x="{x + 1:.1f}" y="{y + 1:.1f}" width="{cw - 2}" height="{ch - 2}" fill="{fill}" '
                f'stroke="#ccc"><title>{esc(tooltip)}</title></rect>'
                f'<text x="{x + cw / 2:.1f}" y="{y + 14:.1f}" font-size="10" text-anchor="middle" '
                f'fill="{"#fff" if dark else "#111"}" pointer-events="none">{esc(text)}</text>')
        out.append(f'<a href="#{esc(target)}">{cell}</a>' if target else cell)
    out.append("</svg>")
    return "".join(out)


def _is_dark(fill: str) -> bool:
    if not (fill.startswith("#") and len(fill) == 7):
        return False
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return 0.299 * r + 0.587 * g + 0.114 * b < 120


@dataclasses.dataclass(frozen=True)
class TrendRow:
    """One group on the trend chart: this run's worst budget, the accepted one and its
    regression limit (None for a new group), and earlier runs' as (run id, budget)."""

    label: str
    now: float
    accepted: float | None = None
    limit: float | None = None
    earlier: tuple[tuple[str, float], ...] = ()


def trend(title: str, rows: Sequence[TrendRow], *, width: int = 760) -> str:
    """Worst budgets on a log axis with an "exact 0" column, one row per group: earlier
    runs as hollow grey rings (darker the more recent), the accepted budget as a grey dot
    with a line to this run's dot (red past the regression limit or the tolerance), and
    the limit as a red tick."""
    if not rows:
        return no_data(title)
    label_w = 8 + 6.4 * max(len(r.label) for r in rows)
    top, row_h, bottom = 58, 15, 36
    zero_w = 64
    plot_x0 = label_w + zero_w
    plot_w = width - plot_x0 - 20
    height = top + row_h * len(rows) + bottom
    values = [v for r in rows for v in (r.accepted, r.now, r.limit, *(b for _, b in r.earlier)) if v is not None]
    lo, hi = _log_range(values + [1.0])
    sx = Scale("log10", lo, hi, plot_x0, plot_x0 + plot_w)
    out = _svg_open(width, height, title, "trend")
    bottom_y = top + row_h * len(rows)
    for value, label in sx.ticks():
        x = sx(value)
        out.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom_y}" stroke="#e3e3e3"/>'
                   f'<text x="{x:.1f}" y="{bottom_y + 14}" font-size="10" text-anchor="middle">{label}</text>')
    zero_x = label_w + 4 + (zero_w - 24) / 2
    out.append(f'<rect x="{label_w + 4}" y="{top}" width="{zero_w - 24}" height="{bottom_y - top}" fill="#f6f6f6" '
               f'stroke="#bbb" stroke-dasharray="3 2"/><text x="{zero_x:.1f}" y="{bottom_y + 14}" font-size="10" '
               f'text-anchor="middle">exact 0</text>')
    x_one = sx(1.0)
    out.append(f'<line x1="{x_one:.1f}" x2="{x_one:.1f}" y1="{top - 4}" y2="{bottom_y}" stroke="#d62728" '
               f'stroke-dasharray="4"/><text x="{x_one - 3:.1f}" y="{top - 6}" font-size="10" fill="#d62728" '
               f'text-anchor="end">1 = tolerance</text>')
    runs = max(len(r.earlier) for r in rows)
    out.append(f'<text x="{plot_x0}" y="34" font-size="10">'
               + (f'<tspan fill="#777">&#9675; earlier runs ({runs})</tspan>  ' if runs else "")
               + '<tspan fill="#888">&#9679; accepted budget</tspan>  '
               '<tspan fill="#1f77b4">&#9679; this run</tspan>  '
               '<tspan fill="#d62728">| regression limit</tspan></text>')

    def px(v: float) -> float:
        if not math.isfinite(v):
            return sx(hi)
        return zero_x if v <= 0 else sx(v)

    for i, r in enumerate(rows):
        y = top + row_h * i + row_h / 2
        color = "#d62728" if (r.limit is not None and r.now > r.limit) or r.now > 1 else "#1f77b4"
        out.append(f'<text x="{label_w - 4:.1f}" y="{y + 3.5:.1f}" font-size="10" text-anchor="end">'
                   f'{esc(r.label)}</text>')
        for n, (run_id, budget) in enumerate(r.earlier):
            opacity = 0.25 + 0.6 * (n + 1) / len(r.earlier)
            out.append(f'<circle class="past" cx="{px(budget):.1f}" cy="{y:.1f}" r="3" fill="none" stroke="#555" '
                       f'stroke-opacity="{opacity:.2f}"><title>{esc(r.label)}: run {esc(run_id)} {budget:.3g}'
                       "</title></circle>")
        if r.accepted is not None:
            out.append(f'<line x1="{px(r.accepted):.1f}" x2="{px(r.now):.1f}" y1="{y:.1f}" y2="{y:.1f}" '
                       f'stroke="{color}" stroke-opacity="0.5" stroke-width="2"/>'
                       f'<circle cx="{px(r.accepted):.1f}" cy="{y:.1f}" r="3.5" fill="#888">'
                       f"<title>{esc(r.label)}: accepted {r.accepted:.3g}</title></circle>")
        if r.limit is not None and math.isfinite(r.limit):
            out.append(f'<line x1="{px(r.limit):.1f}" x2="{px(r.limit):.1f}" y1="{y - 5:.1f}" y2="{y + 5:.1f}" '
                       'stroke="#d62728"/>')
        out.append(f'<circle class="pt" cx="{px(r.now):.1f}" cy="{y:.1f}" r="4" fill="{color}"><title>{esc(r.label)}: '
                   f"this run {r.now:.3g}" + (f", accepted {r.accepted:.3g}" if r.accepted is not None else ", new")
                   + (f", limit {r.limit:.3g}" if r.limit is not None else "") + "</title></circle>")
    out.append(f'<text x="{plot_x0 + plot_w / 2:.1f}" y="{height - 6}" font-size="11" text-anchor="middle">'
               "worst budget (error / allowed)</text></svg>")
    return "".join(out)


def colorbar(*, width: int = 560) -> str:
    """The budget colour scale of heatmaps and error maps, with the special cells."""
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot colorbar" width="{width}" height="58" '
           f'viewBox="0 0 {width} 58" role="img" {FONT}><title>budget colour scale</title>']
    x0, bar_w, lo, hi = 10, 330, -4, 6
    steps = 80
    for i in range(steps):
        e = lo + (hi - lo) * (i + 0.5) / steps
        out.append(f'<rect x="{x0 + i * bar_w / steps:.1f}" y="6" width="{bar_w / steps + 0.6:.1f}" height="16" '
                   f'fill="{budget_css(10.0 ** e)}"/>')
    for e in range(lo, hi + 1):
        x = x0 + (e - lo) / (hi - lo) * bar_w
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="22" y2="26" stroke="#444"/>'
                   f'<text x="{x:.1f}" y="37" font-size="10" text-anchor="middle">{_fmt_decade(e)}</text>')
    out.append(f'<text x="{x0}" y="52" font-size="10">budget = |kernel - oracle| / allowed '
               '(log scale; &gt; 1 fails)</text>')
    specials = (("exact 0", budget_css(0.0)), ("don't care", budget_css(DONT_CARE)),
                ("NaN/Inf mismatch", budget_css(math.inf)))
    x = x0 + bar_w + 20
    for label, fill in specials:
        out.append(f'<rect x="{x}" y="6" width="14" height="14" fill="{fill}" stroke="#999"/>'
                   f'<text x="{x + 18}" y="17" font-size="10">{esc(label)}</text>')
        x += 26 + 6.2 * len(label)
    out.append("</svg>")
    return "".join(out)


# ------------------------------------------------------------------ budget colours
# Passing budgets on a log scale from 1e-4 (pale) to 1 (dark blue); failing ones from 1
# (orange) to 1e6 and more (dark red): a wrong kernel's budgets are often 1e4-1e7. Exact 0
# is white, don't-care grey with a hatch, a NaN/Inf mismatch magenta: none of them is a
# colour of either ramp.
PASS_RAMP = ((0xf7, 0xfb, 0xff), (0xc6, 0xdb, 0xef), (0x6b, 0xae, 0xd6), (0x21, 0x71, 0xb5), (0x08, 0x30, 0x6b))
FAIL_RAMP = ((0xfd, 0xae, 0x61), (0xf4, 0x6d, 0x43), (0xd7, 0x30, 0x27), (0xa5, 0x00, 0x26), (0x67, 0x00, 0x0d))
PASS_DECADES = (-4.0, 0.0)
FAIL_DECADES = (0.0, 6.0)
ZERO_RGB = (255, 255, 255)
DONT_CARE_RGB = (214, 214, 214)
HATCH_RGB = (150, 150, 150)
MISMATCH_RGB = (230, 0, 230)


def _ramp(t: np.ndarray, ramp) -> np.ndarray:
    stops = np.linspace(0.0, 1.0, len(ramp))
    return np.stack([np.interp(t, stops, [c[i] for c in ramp]) for i in range(3)], axis=-1)


def budget_rgb(values: np.ndarray) -> np.ndarray:
    """[..., 3] uint8 colours of budgets (sentinels included)."""
    values = np.asarray(values, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log10(np.where(values > 0, values, 1.0))
    passing = _ramp(np.clip((logs - PASS_DECADES[0]) / (PASS_DECADES[1] - PASS_DECADES[0]), 0, 1), PASS_RAMP)
    failing = _ramp(np.clip((logs - FAIL_DECADES[0]) / (FAIL_DECADES[1] - FAIL_DECADES[0]), 0, 1), FAIL_RAMP)
    rgb = np.where((values > 1.0)[..., None], failing, passing)
    for mask, colour in ((values == 0, ZERO_RGB), (values == DONT_CARE, DONT_CARE_RGB),
                         (np.isposinf(values), MISMATCH_RGB)):
        rgb = np.where(mask[..., None], np.array(colour, dtype=np.float64), rgb)
    return np.round(rgb).astype(np.uint8)


def budget_css(value: float) -> str:
    r, g, b = budget_rgb(np.array([value]))[0]
    return f"#{r:02x}{g:02x}{b:02x}"


def png(rgb: np.ndarray) -> bytes:
    """A truecolour PNG of a [h, w, 3] uint8 array (standard library only)."""
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1).tobytes()

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def map_image(values: np.ndarray, cell_px: tuple[int, int]) -> bytes:
    """The cells upscaled to cell_px pixels each (crisp in any viewer), don't-care hatched."""
    ph, pw = cell_px
    big = np.repeat(np.repeat(budget_rgb(values), ph, axis=0), pw, axis=1)
    if (values == DONT_CARE).any() and ph * pw >= 9:
        care = np.repeat(np.repeat(values == DONT_CARE, ph, axis=0), pw, axis=1)
        yy, xx = np.indices(care.shape)
        big[care & ((xx + yy) % 4 == 0)] = HATCH_RGB
    return png(big)


# ------------------------------------------------------------------ error maps
# One style per named set of block boundaries (colour, width, dash).
BOUND_STYLES = (("#000000", 1.6, ""), ("#000000", 1.0, "4 3"), ("#e6550d", 1.6, ""), ("#31a354", 1.2, "2 2"))


def error_map(emap: ErrorMap, *, title: str = "", max_px: int = 320, element_id: str = "") -> str:
    """An SVG figure: the cells (an embedded PNG), axes in index units with ticks, the
    block boundaries as lines (one style per named set), and a legend of those sets."""
    nr, nc = emap.values.shape
    cw = min(max_px / nc, 28.0)
    ch = min(max_px / nr, 28.0)
    # Integer pixels per cell in the image; the SVG scales it to the plot box.
    px = (max(1, min(8, int(round(ch)))), max(1, min(8, int(round(cw)))))
    left, top, bottom = 58, 26 if title else 8, 40
    w, h = cw * nc, ch * nr
    legend_h = 16 * sum(len(a.bounds) for a in (emap.rows, emap.cols) if a is not None)
    width = max(left + w + 16, 240)
    height = top + h + bottom + legend_h + 18
    image = base64.b64encode(map_image(emap.values, px)).decode("ascii")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot errormap" width="{width:.0f}" '
           f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img" {FONT}'
           + (f' id="{esc(element_id)}"' if element_id else "") + ">",
           f"<title>{esc(title or emap.direction)}: worst {errormap.fmt_budget(emap.budget)}</title>"]
    if title:
        out.append(f'<text x="4" y="16" font-size="12" font-weight="bold">{esc(title)}</text>')
    out.append(f'<image x="{left}" y="{top}" width="{w:.1f}" height="{h:.1f}" preserveAspectRatio="none" '
               f'style="image-rendering:pixelated" href="data:image/png;base64,{image}"/>')
    out.append(f'<rect x="{left}" y="{top}" width="{w:.1f}" height="{h:.1f}" fill="none" stroke="#444"/>')
    # Axes in index units: a tick at 0, multiples of a power of two, and the length.
    for value in index_ticks(emap.rows.length, 5 if h > 120 else 2):
        y = top + value / emap.rows.length * h
        out.append(f'<line x1="{left - 4}" x2="{left}" y1="{y:.1f}" y2="{y:.1f}" stroke="#444"/>'
                   f'<text x="{left - 6}" y="{y + 3.5:.1f}" font-size="10" text-anchor="end">{value:g}</text>')
    out.append(f'<text x="12" y="{top + h / 2:.1f}" font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 12 {top + h / 2:.1f})">{esc(emap.rows.name)}</text>')
    if emap.cols is not None:
        for value in index_ticks(emap.cols.length, max(1, min(5, int(w // 45)))):
            x = left + value / emap.cols.length * w
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + h}" y2="{top + h + 4}" stroke="#444"/>'
                       f'<text x="{x:.1f}" y="{top + h + 15}" font-size="10" text-anchor="middle">{value:g}</text>')
        out.append(f'<text x="{left + w / 2:.1f}" y="{top + h + 30}" font-size="11" text-anchor="middle">'
                   f'{esc(emap.cols.name)}</text>')
    # Block boundaries over the cells, and their legend.
    y_legend = top + h + bottom
    style_index = 0
    for axis, vertical in ((emap.rows, False), (emap.cols, True)):
        if axis is None:
            continue
        for name, positions in axis.bounds:
            colour, stroke_w, dash = BOUND_STYLES[style_index % len(BOUND_STYLES)]
            style_index += 1
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            for p in positions:
                if vertical:
                    x = left + p / axis.length * w
                    out.append(f'<line class="bound" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + h:.1f}" '
                               f'stroke="{colour}" stroke-width="{stroke_w}"{dash_attr}/>')
                else:
                    y = top + p / axis.length * h
                    out.append(f'<line class="bound" x1="{left}" x2="{left + w:.1f}" y1="{y:.1f}" y2="{y:.1f}" '
                               f'stroke="{colour}" stroke-width="{stroke_w}"{dash_attr}/>')
            out.append(f'<line x1="8" x2="30" y1="{y_legend - 4}" y2="{y_legend - 4}" stroke="{colour}" '
                       f'stroke-width="{stroke_w}"{dash_attr}/><text x="36" y="{y_legend}" font-size="10">'
                       f'{esc(axis.name + ": " + errormap.describe_bounds(name, positions))}</text>')
            y_legend += 16
    cell = f"cell {emap.rows.step}" + (f" x {emap.cols.step}" if emap.cols is not None else "")
    out.append(f'<text x="8" y="{y_legend + 2}" font-size="10" fill="#555">{esc(cell)}'
               + (f"; max over {esc(', '.join(emap.reduced_names))}" if emap.reduced else "") + "</text>")
    out.append("</svg>")
    return "".join(out)
