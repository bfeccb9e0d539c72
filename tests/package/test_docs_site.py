"""The docs site's structure, checked without building it (CI runs mkdocs build --strict): the
README stays short, every page in docs/ is in mkdocs.yml's nav, and the README's links into
docs/ name files that exist."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

#: Inline Markdown links and images: [text](target) and ![alt](target).
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


class _IgnoreTagsLoader(yaml.SafeLoader):
    """safe_load, except that a tag it does not know (``!!python/name:`` and the like, which
    some mkdocs extensions use) reads as the plain value under it instead of an error."""


def _untagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    return loader.construct_scalar(node)  # type: ignore[arg-type]


_IgnoreTagsLoader.add_multi_constructor("", _untagged)


def _config() -> dict[str, Any]:
    # yaml.load with a SafeLoader subclass: as safe as safe_load.
    config: dict[str, Any] = yaml.load(
        (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_IgnoreTagsLoader
    )
    return config


def _nav_files(node: Any) -> list[str]:
    """Every page path in a nav (pages, titled pages and sections, nested), in order."""
    if isinstance(node, str):
        return [] if "://" in node else [node]
    if isinstance(node, list):
        return [path for item in node for path in _nav_files(item)]
    if isinstance(node, dict):
        return [path for value in node.values() for path in _nav_files(value)]
    return []


def _doc_pages() -> set[str]:
    excluded = {"_griffe"}  # mkdocs.yml's exclude_docs: the API reference's Griffe extension
    return {
        path.relative_to(DOCS).as_posix()
        for path in DOCS.rglob("*.md")
        if not excluded & set(path.relative_to(DOCS).parts)
    }


def test_readme_is_at_most_250_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"


def test_every_docs_page_is_in_the_nav() -> None:
    nav = _nav_files(_config().get("nav"))
    pages = _doc_pages()
    assert pages, "no Markdown pages found under docs/"
    assert "index.md" in nav, "the nav has no home page (docs/index.md)"
    missing = sorted(pages - set(nav))
    assert not missing, f"docs pages missing from mkdocs.yml's nav: {missing}"
    dangling = sorted(set(nav) - pages)
    assert not dangling, f"nav entries with no file under docs/: {dangling}"
    twice = sorted({path for path in nav if nav.count(path) > 1})
    assert not twice, f"pages listed twice in the nav: {twice}"


def test_site_url_is_the_documentation_url() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    documentation = re.search(r'(?m)^Documentation = "([^"]+)"$', pyproject)
    assert documentation is not None, "pyproject.toml's [project.urls] has no Documentation"
    assert _config()["site_url"] == documentation.group(1)


def _readme_docs_links() -> list[str]:
    targets = LINK.findall(README.read_text(encoding="utf-8"))
    return [target for target in targets if target.startswith(("docs/", "./docs/"))]


def test_readme_links_into_the_docs() -> None:
    assert len(_readme_docs_links()) >= 5, "the README should link into the docs site"


@pytest.mark.parametrize("target", sorted(set(_readme_docs_links())))
def test_readme_link_to_docs_exists(target: str) -> None:
    path = target.split("#", 1)[0]
    assert (ROOT / path).is_file(), f"README.md links to {target}, which does not exist"
