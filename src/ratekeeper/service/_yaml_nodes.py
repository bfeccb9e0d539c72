"""Typed access to composed YAML nodes, for the configuration loader: each reader refuses what
it does not expect with a :class:`ConfigFileError` at the node's ``path:line:column``.

Nodes, not Python values: a node keeps its position for the error, and its tag tells what the
file wrote (``200`` from ``"200"``; YAML 1.1's ``yes`` is a bool, as PyYAML resolves it).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ._config import ConfigFileError

__all__ = ["BOOL", "COMPOSER", "INT", "NULL", "TRUE", "Nodes", "kind", "read", "show"]

#: The composer: libyaml's when PyYAML was built with it (same nodes and marks, faster).
COMPOSER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

INT = "tag:yaml.org,2002:int"
BOOL = "tag:yaml.org,2002:bool"
NULL = "tag:yaml.org,2002:null"
TRUE = frozenset({"true", "yes", "on"})  # YAML 1.1, as PyYAML resolves them


def read(source: str) -> str:
    try:
        data = Path(source).read_bytes()
    except OSError as exc:
        raise ConfigFileError(source, 1, 1, f"cannot read the file: {exc.strerror}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        before = data[: exc.start]
        line = before.count(b"\n") + 1
        # In characters, as YAML's columns are: the line so far is valid UTF-8.
        column = len(before[before.rfind(b"\n") + 1 :].decode("utf-8-sig")) + 1
        raise ConfigFileError(source, line, column, "the file is not valid UTF-8") from None


class Nodes:
    """Readers of one file's nodes: errors name ``source``; ``portable`` refuses the keys a
    mapping lists as extensions; ``PLACE`` says where a key that is misplaced belongs.

    ``findings``: where a file envoyproxy/ratelimit loads leniently is refused
    (:meth:`lenient`), None raises at once; a list collects each refusal and reading goes on
    with upstream's meaning, so that all of them are reported at once."""

    #: A key valid elsewhere -> where it belongs, for the error about a misplaced one.
    PLACE: Mapping[str, str] = {}
    #: The keys envoyproxy/ratelimit knows: it accepts any of them anywhere, ignoring it there.
    UPSTREAM: frozenset[str] = frozenset()

    def __init__(
        self, source: str, portable: bool, findings: list[ConfigFileError] | None = None
    ) -> None:
        self.source = source
        self.portable = portable
        self.findings = findings

    def lenient(self, node: Node | yaml.Mark, message: str) -> None:
        """Refuse what envoyproxy/ratelimit loads leniently (``message`` says what it does
        there and the fix): raised, or collected in :attr:`findings`."""
        error = self.error(node, message)
        if self.findings is None:
            raise error
        if not any(str(seen) == str(error) for seen in self.findings):  # a node read twice
            self.findings.append(error)

    def error(self, node: Node | yaml.Mark, message: str) -> ConfigFileError:
        # libyaml's marks are not yaml.Mark: tell a node by its start_mark
        mark = node.start_mark if isinstance(node, Node) else node
        return ConfigFileError(self.source, mark.line + 1, mark.column + 1, message)

    def where(self, node: Node) -> str:
        return f"{self.source}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"

    # -- typed access to nodes

    def mapping(
        self,
        node: Node,
        what: str,
        keys: frozenset[str],
        extensions: frozenset[str] = frozenset(),
    ) -> dict[str, tuple[Node, Node]]:
        """The entries of a mapping node by key, refusing duplicate and unknown keys."""
        if not isinstance(node, MappingNode):
            raise self.error(node, f"{what} must be a mapping, got {kind(node)}")
        out: dict[str, tuple[Node, Node]] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                raise self.error(key_node, f"keys of {what} must be strings, got {kind(key_node)}")
            name = key_node.value
            if name in out:
                self.lenient(
                    key_node,
                    f"duplicate key {name!r} in {what} (first at {self.where(out[name][0])}): "
                    "envoyproxy/ratelimit silently keeps the last one; remove one of them",
                )
            if name == "<<":
                self.lenient(
                    key_node,
                    f"YAML merge keys ('<<') are not supported, in {what}: envoyproxy/ratelimit's "
                    "YAML reader merges the aliased mapping in; write its keys out here",
                )
                continue
            if name not in keys:
                if name in extensions:
                    if self.portable:
                        raise self.error(
                            key_node,
                            f"{name!r} is a ratekeeper extension, refused in portable mode "
                            "(envoyproxy/ratelimit does not know it)",
                        )
                else:
                    place = self.PLACE.get(name)
                    if place and name in self.UPSTREAM:
                        self.lenient(
                            key_node,
                            f"{name!r} belongs in {place}, not in {what}: envoyproxy/ratelimit "
                            "accepts any of its keys anywhere and ignores one out of place (it "
                            f"does nothing there); move it to {place}, or remove it",
                        )
                        continue
                    hint = f"; {name!r} belongs in {place}" if place else ""
                    known = ", ".join(sorted(keys | (frozenset() if self.portable else extensions)))
                    raise self.error(
                        key_node, f"unknown key {name!r} in {what}{hint} (known: {known})"
                    )
            out[name] = (key_node, value_node)
        return out

    def text(self, node: Node, what: str) -> str | None:
        """A scalar as written (``value: 200`` is ``"200"``, as upstream reads it); None if null."""
        if not isinstance(node, ScalarNode):
            raise self.error(node, f"{what} must be a string, got {kind(node)}")
        if node.tag == NULL:
            return None
        return str(node.value)

    def flag(self, node: Node, what: str) -> bool:
        if isinstance(node, ScalarNode) and node.tag == NULL:
            return False
        if not isinstance(node, ScalarNode) or node.tag != BOOL:
            raise self.error(node, f"{what} must be true or false, got {show(node)}")
        return str(node.value).lower() in TRUE

    def integer(self, node: Node, what: str, low: int, high: int) -> int:
        if not (isinstance(node, ScalarNode) and node.tag == INT and str(node.value).isdecimal()):
            raise self.error(node, f"{what} must be a whole number, got {show(node)}")
        number = int(node.value)
        if not low <= number <= high:
            raise self.error(node, f"{what} must be between {low} and {high}, got {number}")
        return number

    def sequence(self, node: Node, what: str) -> list[Node]:
        if isinstance(node, ScalarNode) and node.tag == NULL:
            return []
        if not isinstance(node, SequenceNode):
            raise self.error(node, f"{what} must be a list, got {kind(node)}")
        return list(node.value)

    # -- the file


def kind(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    return show(node)


def show(node: Node) -> str:
    if isinstance(node, ScalarNode):
        if node.tag == NULL:
            return "nothing (null)"
        return repr(node.value)
    return kind(node)
