"""MkDocs hooks: what the site needs beyond the pages as GitHub shows them.

- The configuration reference (`config.md`) is generated from the config dataclasses at build
  time (`trillora.config.reference`), so a new key shows up without a hand edit (the copy in
  the page, for GitHub, is checked by a test); so are the serving budget tables
  (`product-loop.md`, `tinker.md`), from `ServeConfig`. `python docs/hooks.py` refreshes the copies.
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


BUDGETS_BEGIN, BUDGETS_END = "<!-- generated: serve budgets -->", "<!-- end of the generated budgets -->"


def generated(markdown: str) -> str:
    """A page with its generated blocks (the configuration reference, the serving budgets) made afresh."""
    from trillora.config.reference import BEGIN, filled, flag_table
    from trillora.serve.config import BUDGETS, ServeConfig

    if BEGIN in markdown:
        markdown = filled(markdown)
    if BUDGETS_BEGIN in markdown:
        markdown = filled(markdown, BUDGETS_BEGIN, BUDGETS_END, flag_table(ServeConfig, BUDGETS))
    return markdown


def on_page_markdown(markdown: str, page, config, files) -> str:
    return generated(markdown.replace("](../benchmarks/results/", "](results/"))


if __name__ == "__main__":  # the pages' copies, for GitHub, refreshed
    for page in sorted(Path(__file__).parent.glob("*.md")):
        text = page.read_text()
        if generated(text) != text:
            page.write_text(generated(text))
            print(f"refreshed {page.name}")
