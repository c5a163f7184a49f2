"""The README links only to files inside the repository (issue 9 §5), and every file it links exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_links_stay_inside_the_repository_and_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links, "the README links its in-repo documents"
    outside = [t for t in links if not t.startswith(("http://", "https://"))
               and not (ROOT / t).resolve().is_relative_to(ROOT)]
    assert not outside, f"README links outside the repository: {outside}"
    missing = [t for t in links if not t.startswith(("http://", "https://")) and not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"
    assert "../" not in text, "README refers to a path outside the repository"
