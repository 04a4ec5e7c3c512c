r"""report.html in a real browser: headless Chromium (Debian's ``chromium`` package; .ci/run
installs it where apt is usable) loads the report of a failing run of a planted block-edge
bug and of a passing run, and must show no console error, every plot with drawn content,
every error map image decoded whole, and the bug's map with its block boundary.

Skipped, with the reason, where no Chromium can be had. With ATTNCHECK_SCREENSHOT_REPORT
set to a report directory, the screenshot of that report's first failure map is written to
ATTNCHECK_SCREENSHOT (default docs/img/error-map.png). The README's comes from a real gate
run against the planted block-edge bug ``fa-dab-map-clamped`` (docs/DESIGN.md, "Reports"):

    # a copy of the project with the mutant applied (attncheck.mutation.mutant.apply), then
    # in it: pytest --pyargs attncheck.gate -x --attncheck-kernel flash_attention \
    #            --attncheck-backend interpret -k coverage --attncheck-report $COPY/reports/latest
    ATTNCHECK_SCREENSHOT_REPORT=$COPY/reports/latest \
        .venv/bin/python -m pytest tests/selftest/test_report_browser.py -k docs -n 0
"""

from __future__ import annotations

import os
import pathlib

import pytest

from attncheck import check
from attncheck.backends import BACKENDS
from attncheck.report import accepted, errormap, merge, model, render
from attncheck.report import records as rec
from attncheck.report.policy import Policy
from tests.selftest import toy_spec
from tests.selftest.chromium import INSTALL_HINT, Chromium, find_executable

RUN_ID = "20260101T0000009876"
APPLICABLE = {"toy_attention": ("causal", "bf16")}
EXECUTABLE = find_executable()
pytestmark = pytest.mark.skipif(EXECUTABLE is None, reason=f"no chromium on PATH (Debian: {INSTALL_HINT})")

# What a page reports about its plots: drawn marks per plot, and for every embedded image
# (the error maps) its decoded size and how many distinct colours it has.
INSPECT = r"""(async () => {
  const plots = Array.from(document.querySelectorAll("svg.plot"));
  async function decode(href) {
    const img = new Image();
    const loaded = new Promise(resolve => { img.onload = () => resolve(true); img.onerror = () => resolve(false); });
    img.src = href;
    if (!(await loaded)) return {width: 0, colours: 0, transparent: -1};
    const canvas = document.createElement("canvas");
    canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
    const ctx = canvas.getContext("2d");
    ctx.drawImage(img, 0, 0);
    const data = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
    const colours = new Set();
    let transparent = 0;  // the maps are opaque RGB: a pixel left transparent was never decoded
    for (let i = 0; i < data.length; i += 4) {
      colours.add((data[i] << 16) | (data[i + 1] << 8) | data[i + 2]);
      transparent += data[i + 3] < 255;
    }
    return {width: img.naturalWidth, colours: colours.size, transparent: transparent};
  }
  const out = [];
  for (const svg of plots) {
    const box = svg.getBoundingClientRect();
    const images = [];
    for (const image of svg.querySelectorAll("image")) images.push(await decode(image.getAttribute("href")));
    out.push({kind: svg.getAttribute("class"), id: svg.id,
              title: (svg.querySelector("title") || {}).textContent || "",
              width: box.width, height: box.height,
              marks: svg.querySelectorAll(".pt, .bar, .cell, image, rect").length,
              bounds: svg.querySelectorAll("line.bound").length, images: images});
  }
  return {plots: out, status: document.querySelector(".status").textContent,
          nodata: Array.from(document.querySelectorAll(".nodata")).map(e => e.textContent),
          failures: document.querySelectorAll("section.failure").length,
          copy: document.querySelectorAll("button.copy").length};
})()"""


def toy_case(seed: int, causal: bool, dtype: str, seq_len: int):
    return toy_spec.SPEC.case(seed, dtype=dtype, batch=toy_spec.BATCH, heads=toy_spec.HEADS, seq_len=seq_len,
                              head_dim=toy_spec.HEAD_DIM, causal=causal, sm_scale=toy_spec.SM_SCALE)


def write_toy_report(directory: pathlib.Path, impls: dict) -> model.Report:
    """A real run of the toy family's implementations: checked, written, merged and
    rendered as the gate does, with an error map on every record (the toy's budgets are
    below the gate's threshold for a passing map) and accepted budgets (half the
    reference's on its first case) for the trend."""
    writer = rec.RecordWriter(directory, RUN_ID, "main")
    maps = errormap.EveryMap()
    for impl_name, impl in impls.items():
        for seed, causal, dtype, seq_len in ((1, True, "float32", 16), (2, False, "bfloat16", 8)):
            target = check.Target(toy_spec.SPEC, impl_name, impl, BACKENDS["xla"])
            for record in check.check_case(target, toy_case(seed, causal, dtype, seq_len), maps=maps,
                                           nodeid=f"test_report_browser.py::{impl_name}").records:
                writer.write(record)
    report = merge.merge(directory, RUN_ID, merge.RunOutcome(complete=True), Policy(applicable=APPLICABLE))
    budgets = accepted.AcceptedBudgets(tuple(
        accepted.AcceptedBudget(r.kernel, r.impl, r.backend, r.dtype, r.direction, 0.5 * r.budget)
        for r in report.records if r.impl == "builtin" and r.case["seed"] == 1))
    render.write(directory, report, accepted=budgets)
    return report


def inspect_page(path: pathlib.Path, screenshot: tuple[str, pathlib.Path] | None = None) -> tuple[dict, list[str]]:
    with Chromium(EXECUTABLE) as browser:
        session = browser.open(path.resolve().as_uri())
        found = browser.evaluate(session, INSPECT)
        if screenshot:
            browser.screenshot(session, *screenshot)
        return found, browser.console_errors(session)


def assert_every_plot_drawn(found: dict) -> None:
    assert found["plots"], "no plot in the page"
    for plot in found["plots"]:
        assert plot["width"] > 0 and plot["height"] > 0, plot
        assert plot["marks"] > 0, f"plot without drawn content: {plot}"
        for image in plot["images"]:
            assert image["width"] > 0 and image["transparent"] == 0, (plot["title"], image)  # decoded, whole


def test_report_of_a_planted_block_edge_bug_renders_in_chromium(tmp_path):
    report = write_toy_report(tmp_path, {"builtin": toy_spec.toy_attention, "user": toy_spec.toy_attention_chunk_edge})
    failing = sorted(report.failing, key=lambda r: -r.budget)
    assert failing and all(r.error_map is not None for r in failing)
    found, errors = inspect_page(tmp_path / "report.html", ("#map-f0", tmp_path / "map.png"))
    assert errors == []
    assert found["status"] == "FAIL"
    assert_every_plot_drawn(found)
    assert found["nodata"] == [], found["nodata"]
    kinds = {p["kind"] for p in found["plots"]}
    assert {"plot scatter", "plot histogram", "plot heatmap", "plot trend", "plot colorbar",
            "plot errormap"} <= kinds, kinds
    # Every failure has its card and copy button; the maps of dk and dv draw the key chunk
    # boundary (the planted bug's block edge), those of out and dq none (no key axis).
    assert found["failures"] == len(failing) and found["copy"] >= len(failing)
    maps = {p["id"]: p for p in found["plots"] if p["kind"] == "plot errormap"}
    for i, r in enumerate(failing):
        assert maps[f"map-f{i}"]["bounds"] == (1 if r.direction in ("dk", "dv") else 0), (i, r.direction)
    # The causal output's first row is exact (one visible key, whatever the bug) and the
    # rest fails: a map of more than one colour family.
    out = next(i for i, r in enumerate(failing) if r.direction == "out" and r.case["params"]["causal"])
    assert maps[f"map-f{out}"]["images"][0]["colours"] >= 2
    assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_a_passing_run_renders_in_chromium(tmp_path):
    report = write_toy_report(tmp_path, {"builtin": toy_spec.toy_attention})
    assert report.verdict == "PASS"
    found, errors = inspect_page(tmp_path / "report.html")
    assert errors == []
    assert found["status"] == "PASS" and found["failures"] == 0
    assert_every_plot_drawn(found)
    # The worst passing map of each direction, and no failure card.
    assert sum(p["kind"] == "plot errormap" for p in found["plots"]) == len(toy_spec.SPEC.directions)


@pytest.mark.skipif(not os.environ.get("ATTNCHECK_SCREENSHOT_REPORT"),
                    reason="set ATTNCHECK_SCREENSHOT_REPORT=<report dir> to write the docs screenshot")
def test_docs_screenshot_of_a_failure_map():
    directory = pathlib.Path(os.environ["ATTNCHECK_SCREENSHOT_REPORT"])
    target = pathlib.Path(os.environ.get("ATTNCHECK_SCREENSHOT", "docs/img/error-map.png"))
    target.parent.mkdir(parents=True, exist_ok=True)
    selector = os.environ.get("ATTNCHECK_SCREENSHOT_SELECTOR", "#map-f0")
    found, errors = inspect_page(directory / "report.html", (selector, target))
    assert errors == []
    assert_every_plot_drawn(found)
