"""The documentation as the tests read it: README.md and every page of docs/. Figures and
commands are looked up across all of them, so a section may move between pages without its
checks going blind."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = "\n\n".join(p.read_text() for p in PAGES)


def after(heading: str) -> str:
    """The text after the heading `heading` (at any level) on the page that has it."""
    pattern = re.compile(r"^#+ " + re.escape(heading) + r"\n", re.M)
    for page in PAGES:
        found = pattern.search(page.read_text())
        if found:
            return page.read_text()[found.end() :]
    raise AssertionError(f"no page of README.md or docs/ has the heading {heading!r}")


def bash_block(heading: str) -> list[str]:
    """The commands of the first ```bash block after `heading`, comments cut."""
    block = after(heading).split("```bash\n", 1)[1].split("\n```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
