"""A Griffe extension for the API reference: renders the reST-ish parts of ratekeeper's
docstrings as Markdown, without touching the source.

- ``:class:`~ratekeeper.X```, ``:meth:`from_url``` and the other Python roles become code
  that links to the object when the reference documents it (an optional cross-reference:
  a target the reference does not render stays plain code, with no warning);
- a doctest (lines from ``>>>`` to the next blank line) becomes a ``pycon`` code block;
- a paragraph ending in ``::`` ends in ``:`` and its indented block becomes a code block.

The ``#:`` comments above constants and type aliases become their docstrings through
griffe-sphinx, listed before this extension in mkdocs.yml.

mkdocs.yml loads it (``extensions:`` of the Python handler); ``exclude_docs`` keeps it out
of the site.
"""

from __future__ import annotations

import html
import re
import textwrap
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|data|exc|obj|const):`([^`]+)`")
_EXPLICIT = re.compile(r"^(?P<title>.+?)\s*<(?P<target>[^>]+)>$")


def _identifier(obj: griffe.Object, target: str) -> str:
    """The full path a role's target names, resolved in the scope of ``obj``."""
    if target.startswith("ratekeeper"):
        return target
    head, _, rest = target.partition(".")
    scope = obj if obj.is_class or obj.is_module else obj.parent
    try:
        resolved = scope.resolve(head) if scope is not None else head
    except (griffe.NameResolutionError, AttributeError, KeyError, ValueError):
        return target
    return f"{resolved}.{rest}" if rest else resolved


def _role(obj: griffe.Object, match: re.Match[str]) -> str:
    text = match.group(1).strip()
    explicit = _EXPLICIT.match(text)
    if explicit:
        title, target = explicit["title"], explicit["target"]
    else:
        target = text.lstrip("~").lstrip(".")
        title = target.rsplit(".", 1)[-1] if text.startswith("~") else target
    identifier = _identifier(obj, target.lstrip("~"))
    return (
        f'<autoref identifier="{html.escape(identifier)}" optional>'
        f"<code>{html.escape(title)}</code></autoref>"
    )


def _blocks(text: str) -> str:
    """Doctests and ``::`` literal blocks as fenced code blocks."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        indent = line[: len(line) - len(stripped)]
        if stripped.startswith(">>>"):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
                i += 1
            out += ["", f"{indent}```pycon", *(indent + b for b in block), f"{indent}```", ""]
            continue
        if stripped.endswith("::") and not stripped.startswith(".."):
            head = line[:-2].rstrip()
            out.append(head + (":" if head.strip() and not head.endswith(":") else ""))
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            block_lines = []
            while j < len(lines) and (
                not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > len(indent)
            ):
                block_lines.append(lines[j])
                j += 1
            while block_lines and not block_lines[-1].strip():
                block_lines.pop()
            if block_lines:
                body = textwrap.dedent("\n".join(block_lines)).splitlines()
                out += ["", f"{indent}```python", *(indent + b for b in body), f"{indent}```", ""]
                i = j
                continue
            i += 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class RestDocstrings(griffe.Extension):
    """Rewrites every docstring of a loaded package (see the module's docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._walk(pkg, set())

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            value = _blocks(obj.docstring.value)
            obj.docstring.value = _ROLE.sub(lambda m: _role(obj, m), value)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, seen)  # type: ignore[arg-type]
