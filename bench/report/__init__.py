"""HTML report: ``render_html(data)`` / ``write_report(data, path)`` from a pytest-benchmark JSON dict."""

from bench.report.render import SECTIONS, build_context, render_html, write_report  # noqa: F401
