"""Headless Chromium screenshot of the report rendered from the fixture JSON (skipped when chromium is absent)."""

from pathlib import Path

import pytest

from bench.cli import find_chromium, screenshot
from bench.report import write_report
from bench.report.data import load

FIXTURE = Path(__file__).parent / "fixtures" / "bench_fixture.json"
CHROMIUM = find_chromium()


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (/usr/bin/chromium absent; "
                                             "apt-get install chromium to enable the screenshot check)")
def test_report_screenshot(tmp_path):
    from PIL import Image

    html = write_report(load(FIXTURE), tmp_path / "report.html")
    png = screenshot(html, tmp_path / "report.png", width=1400, height=2000, chromium=CHROMIUM)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    im = Image.open(png).convert("RGB")
    assert im.size == (1400, 2000)
    # not blank: the dark navigation bar, white cards and chart colours all appear
    colours = im.resize((140, 200)).getcolors(maxcolors=100_000)
    assert colours is not None and len(colours) > 50
    nav = im.getpixel((40, 1000))
    assert sum(nav) < 200                      # dark sidebar rendered (CSS applied)
