"""The HTML report renders from a fixture benchmark JSON, contains every section, and stays self-contained."""

import json
import re
from pathlib import Path

import pytest

from bench.cli import main as cli_main
from bench.report import SECTIONS, render_html
from bench.report.data import load, split

FIXTURE = Path(__file__).parent / "fixtures" / "bench_fixture.json"


@pytest.fixture(scope="module")
def data():
    return load(FIXTURE)


@pytest.fixture(scope="module")
def html(data):
    return render_html(data)


def test_fixture_splits_into_row_kinds(data):
    parts = split(data)
    assert len(parts["model"]) == 11 and len(parts["published"]) == 3
    assert len(parts["kernel"]) == 4 and len(parts["other"]) == 1
    k = parts["kernel"][0]
    assert k["source"] == "modelled (nkisim)" and k["ai"] > 0 and k["achieved_flops"] > 0


def test_every_section_present(html):
    for sid, _name in SECTIONS:
        assert f'<section id="{sid}">' in html, sid
        assert f'href="#{sid}"' in html
    for text in ("Kernel roofline", "Pareto frontier", "Memory per rank over tp × dp", "Collectives per layer",
                 "Best configuration under a memory limit", "Modelled vs published decode latency",
                 "Latency breakdown per configuration"):
        assert text in html


def test_figures_are_inline_svg_and_labelled_modelled(html):
    n_svg = html.count("<svg")
    assert n_svg >= 8
    assert html.count('class="pill modelled"') >= 9
    assert "modelled" in html.lower()
    # self-contained: no external scripts, stylesheets or images
    assert not re.search(r'(src|href)="https?://', html)
    assert "<script" not in html


def test_published_rows_and_numbers(html):
    # GPT-OSS-120B TP16 on trn2: published 7.00 ms TPOT (parallel-and-perf-model.md §2.7)
    assert "7.00" in html and "GPT-OSS-120B" in html
    assert "19.60" in html and "10.52" in html
    assert "tutorial-eagle3-speculative-decoding-gpt-oss.md" in html


def test_seed_three_vs_seven_shown(html):
    assert "3 (attn component-TP all-reduce" in html
    assert "5 collectives + 1 slice" in html


def test_skipped_reason_shown(html):
    assert "tp=64 does not divide num_attention_heads=32" in html


def test_cli_rerenders_from_json(tmp_path):
    out = tmp_path / "r.html"
    assert cli_main(["report", str(FIXTURE), "-o", str(out), "--mem-limit-gib", "4"]) == 0
    text = out.read_text()
    assert '<section id="best">' in text and "4.0 GiB per rank" in text


def test_cli_rejects_non_benchmark_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"x": 1}))
    with pytest.raises(ValueError, match="not a pytest-benchmark JSON"):
        cli_main(["report", str(bad), "-o", str(tmp_path / "o.html")])


@pytest.mark.parametrize("limit", ["0", "-1", "nan"])
def test_cli_rejects_non_positive_mem_limit(tmp_path, limit):
    out = tmp_path / "r.html"
    with pytest.raises(ValueError, match=r"mem_limit_gib=.* must be a positive number"):
        cli_main(["report", str(FIXTURE), "-o", str(out), "--mem-limit-gib", limit])
    assert not out.exists()  # rejected before any work


def test_cli_sweep_rejects_kernels_json_without_kernel_rows(tmp_path):
    out = tmp_path / "sweep.json"
    with pytest.raises(ValueError, match=r"--kernels .*no LNC=1 decode-attention rows"):
        cli_main(["sweep", "-o", str(out), "--kernels", str(_fixture_without_kernel_rows(tmp_path))])
    assert not out.exists()  # rejected before the sweep ran


def _fixture_without_kernel_rows(tmp_path):
    data = json.loads(FIXTURE.read_text())
    data["benchmarks"] = [b for b in data["benchmarks"] if "modelled_latency_s" not in (b.get("extra_info") or {})]
    path = tmp_path / "no_kernels.json"
    path.write_text(json.dumps(data))
    return path
