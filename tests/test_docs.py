"""The docs stay true to the code: docs/config.md is what the config classes generate, every relative link in
README.md and docs/ reaches an existing file (and heading), and every guide opens with a command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from megatron_armor.config.reference import COMMAND, reference_markdown

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DOC = ROOT / "docs" / "config.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def doc_files() -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose(text: str) -> str:
    """`text` without fenced code blocks and inline code spans, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text (lowercase, punctuation dropped, spaces to '-';
    repeats numbered -1, -2, ...)."""
    anchors: set[str] = set()
    for line in re.sub(r"^```.*?^```", "", text, flags=re.S | re.M).splitlines():
        match = re.match(r"#{1,6} (.*)", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def broken_links(path: Path) -> list[str]:
    """The relative links of the Markdown file `path` whose file, or heading in it, does not exist."""
    broken = []
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
            broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    return broken


def test_config_reference_is_current():
    assert CONFIG_DOC.read_text() == reference_markdown(), (
        f"docs/config.md is out of date with the config classes; regenerate it: {COMMAND}"
    )


def test_config_reference_imports_no_torch():
    code = "import sys, megatron_armor.config.reference; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0, "the config package imported torch"


def test_relative_links_resolve():
    assert len(doc_files()) > 3
    broken = [line for path in doc_files() for line in broken_links(path)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_guide_opens_with_a_command():
    guides = sorted((ROOT / "docs" / "guides").glob("*.md"))
    assert guides
    for guide in guides:
        lines = [line for line in guide.read_text().splitlines() if line.strip()]
        assert lines[0].startswith("# ") and lines[1] == "```bash", f"{guide.name}: title, then a ```bash block"


def test_the_link_checker_catches_what_it_looks_for(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# A title\n\n## Step 1: `x.py`\n\n[ok](#step-1-xpy) [gone](b.md) "
                                   "[bad](#nope) `[code](c.md)` [web](https://example.com)\n")
    assert heading_anchors("# A title\n## A title\n") == {"a-title", "a-title-1"}
    assert broken_links(tmp_path / "a.md") == ["a.md: b.md (no such file)", "a.md: #nope (no such heading)"]
