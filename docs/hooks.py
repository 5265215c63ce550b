"""MkDocs hooks: what the site needs beyond the pages as GitHub shows them.

- The configuration reference (`config.md`) is generated from the config dataclasses at build
  time (`trillora.config.reference`), so a new key shows up without a hand edit (the copy in
  the page, for GitHub, is checked by a test).
- Pages show the figures the benchmarks write as `../benchmarks/results/NAME.png`, which GitHub
  resolves; the site serves those files as `results/NAME.png`, so a figure that does not exist
  is a broken link and fails the strict build."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def on_files(files, config):
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = markdown.replace("](../benchmarks/results/", "](results/")
    from trillora.config.reference import BEGIN, filled

    return filled(markdown) if BEGIN in markdown else markdown
