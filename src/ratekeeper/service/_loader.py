"""Loading ``ratekeeper serve``'s configuration: envoyproxy/ratelimit's YAML files into the
model of ``_config``, refusing any mistake with a :class:`ConfigFileError` that names
``path:line:column`` (the first one found: files are checked in name order, each from the top,
and loading stops there). Pure: it reads files and does no other I/O. What the format is, and
where this loader is stricter than upstream, is in ``_config``'s docstring.

With ``upstream=True`` (``ratekeeper serve --check PATH --upstream``), what envoyproxy/ratelimit
loads leniently and this loader refuses (``UPSTREAM_LENIENT``) does not stop the loading: every
such place is collected, read with upstream's meaning, and all are raised at the end together
(:class:`UpstreamLenient`), each naming what upstream does there and the fix. Other mistakes,
which upstream refuses too, still stop at the first.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, cast

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .._model.errors import ConfigError
from ._config import (
    MAX_NODES,
    ConfigFileError,
    DomainConfig,
    Level,
    ServiceConfig,
    _children,
)
from ._rule_nodes import RATE_LIMIT_EXTENSIONS, RATE_LIMIT_KEYS, Domain, RuleNodes
from ._yaml_nodes import COMPOSER, NULL, kind, read

__all__ = ["UPSTREAM_LENIENT", "UpstreamLenient", "check_config", "load_config"]

#: What envoyproxy/ratelimit loads and this loader refuses, each a silent mistake there: the
#: message of each refusal names upstream's behaviour and the fix.
UPSTREAM_LENIENT = (
    "one of upstream's keys out of place (e.g. shadow_mode inside rate_limit): ignored there",
    "a mapping key written twice: the last one kept",
    "a YAML merge key '<<': the aliased mapping merged in",
    "a second YAML document in a file: ignored",
    "rate_limit without requests_per_unit: 0, every request denied",
    "unlimited: true with requests_per_unit: the number ignored",
    "replaces naming no rule of the domain: nothing replaced",
    "a '*' in a key: a wildcard over the joined key_value string",
    "(a directory) files that are not *.yaml or *.yml, and subdirectories: read as configuration",
)

# The keys of each mapping: upstream's, then ratekeeper's extensions (refused when portable).
_ROOT_KEYS = frozenset({"domain", "descriptors"})
_DESCRIPTOR_KEYS = frozenset(
    {
        "key",
        "value",
        "rate_limit",
        "descriptors",
        "shadow_mode",
        "detailed_metric",
        "value_to_metric",
        "quota_mode",
        "share_threshold",
        "metadata",
    }
)
#: Every key envoyproxy/ratelimit knows (it accepts each of them anywhere).
_UPSTREAM_KEYS = _ROOT_KEYS | _DESCRIPTOR_KEYS | RATE_LIMIT_KEYS
#: A descriptor's boolean keys.
_FLAGS = ("shadow_mode", "quota_mode", "share_threshold", "detailed_metric", "value_to_metric")
# Where a key that is valid elsewhere belongs, for the error about a misplaced one.
_PLACE = {
    **dict.fromkeys(_ROOT_KEYS - {"descriptors"}, "the top level of the file"),
    **dict.fromkeys(_DESCRIPTOR_KEYS - {"descriptors"}, "a descriptor"),
    **dict.fromkeys(RATE_LIMIT_KEYS | RATE_LIMIT_EXTENSIONS, "rate_limit"),
    "descriptors": "a descriptor or the top level",
}


class UpstreamLenient(ConfigError):
    """Places of a configuration that envoyproxy/ratelimit loads leniently and ratekeeper
    refuses, all of them (``errors``, in file order): what ``--check --upstream`` reports."""

    def __init__(self, errors: list[ConfigFileError]) -> None:
        self.errors = tuple(errors)
        files = len({error.path for error in errors})
        super().__init__(
            "\n".join(str(error) for error in errors)
            + f"\n{len(errors)} place{'s' if len(errors) != 1 else ''} in {files} "
            f"file{'s' if files != 1 else ''} that envoyproxy/ratelimit loads leniently, "
            "refused by ratekeeper serve (each line says what upstream does and the fix)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (list(self.errors),))


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a configuration loads: the nodes and rules it
    builds are millions of objects that live on (or are freed by their counts), and the
    collector's passes over them took two thirds of the time (100,000 rules: 15.8 s, 5.1 s
    without them). It runs again afterwards."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def load_config(
    path: str | os.PathLike[str],
    *,
    portable: bool = False,
    merge_domains: bool = False,
    upstream: bool = False,
) -> ServiceConfig:
    """Load a YAML file, or every ``*.yaml``/``*.yml`` file of a directory (one domain each).

    In a directory, entries whose names start with a dot are skipped (Kubernetes ConfigMap
    volumes keep their real files in ``..data`` and ``..<timestamp>`` and link the visible names
    to them), as are subdirectories and other files; the files load in name order. A domain may
    appear in one file only, unless ``merge_domains`` (upstream's ``MERGE_DOMAIN_CONFIG``):
    then the top-level descriptors of its files are merged, and one in two of them is refused.
    ``portable=True`` refuses every ratekeeper extension. ``upstream=True`` collects what
    upstream loads leniently and raises it all at the end (:class:`UpstreamLenient`); it also
    names the entries of a directory that upstream would read and this loader skips.
    """
    root = Path(os.fspath(path))
    findings: list[ConfigFileError] | None = [] if upstream else None
    if root.is_dir():
        files = []
        for entry in sorted(root.iterdir()):
            if entry.name.startswith("."):
                continue
            if entry.suffix in (".yaml", ".yml") and entry.is_file():
                files.append(entry)
            elif findings is not None:
                if entry.is_dir():
                    what = (
                        "a subdirectory, skipped by ratekeeper serve: envoyproxy/ratelimit's "
                        "runtime loader reads the files under it as configuration too; move "
                        "them up (as *.yaml), or out of the directory"
                    )
                else:
                    what = (
                        "not a *.yaml or *.yml file, skipped by ratekeeper serve: "
                        "envoyproxy/ratelimit's runtime loader reads every file of the "
                        "directory as configuration; rename it to *.yaml, or move it out"
                    )
                findings.append(ConfigFileError(str(entry), 1, 1, what))
    elif root.is_file():
        files = [root]
    else:
        raise ConfigError(f"{os.fspath(path)}: no such configuration file or directory")
    domains = _Domains(merge_domains)
    with _collector_paused():
        for file in files:
            source = str(file)
            loader = _FileLoader(source, portable, findings, domains)
            loader.load(read(source))
        config = domains.finish()
    if findings:
        raise UpstreamLenient(sorted(findings, key=lambda e: (e.path, e.line, e.column)))
    return config


def check_config(
    path: str | os.PathLike[str],
    *,
    portable: bool = False,
    merge_domains: bool = False,
    upstream: bool = False,
) -> str:
    """What ``ratekeeper serve --check PATH [--portable] [--merge-domain-config] [--upstream]``
    prints: a summary of a valid configuration. A mistake raises ConfigFileError
    (``path:line:column: what``); with ``upstream``, what upstream loads leniently raises
    :class:`UpstreamLenient`, every place at once."""
    config = load_config(path, portable=portable, merge_domains=merge_domains, upstream=upstream)
    rules = sum(domain.rules for domain in config.domains.values())
    lines = [
        f"{' + '.join((domain.source, *domain.merged))}: domain {domain.name!r}, {domain.rules} "
        f"rule{'s' if domain.rules != 1 else ''}"
        for domain in sorted(config.domains.values(), key=lambda d: d.source)
    ]
    mode = " (portable: loadable by envoyproxy/ratelimit)" if portable else ""
    lines.append(
        f"OK{mode}: {len(config.sources)} file{'s' if len(config.sources) != 1 else ''}, "
        f"{len(config.domains)} domain{'s' if len(config.domains) != 1 else ''}, "
        f"{rules} rule{'s' if rules != 1 else ''}"
    )
    return "\n".join(lines)


class _Domains:
    """The domains of every file, merged when ``merge`` (else a second definition is refused)."""

    def __init__(self, merge: bool) -> None:
        self.merge = merge
        self.domains: dict[str, Domain] = {}
        self.sources: list[str] = []
        self.order = 0  # file order of the descriptors, across files (GET /rlconfig)

    def open(self, loader: _FileLoader, name: str, node: Node) -> Domain:
        self.sources.append(loader.source)
        domain = self.domains.get(name)
        if domain is None:
            domain = self.domains[name] = Domain(name, loader.source, loader.where(node))
        elif not self.merge:
            raise loader.error(
                node,
                f"duplicate domain {name!r}: already defined at {domain.where} (as "
                "envoyproxy/ratelimit, unless its MERGE_DOMAIN_CONFIG is set: give "
                "--merge-domain-config to merge the files' descriptors into one domain)",
            )
        elif loader.source not in (domain.source, *domain.merged):
            domain.merged.append(loader.source)
        return domain

    def finish(self) -> ServiceConfig:
        configs = {}
        for domain in self.domains.values():
            for target, node, loader in domain.replaced:
                if target not in domain.names:
                    loader.lenient(
                        node,
                        f"replaces {target!r}, but no rate_limit of domain {domain.name!r} is "
                        f"named {target!r}: envoyproxy/ratelimit replaces nothing then; correct "
                        "the name, or remove the entry",
                    )
            configs[domain.name] = DomainConfig(
                domain.name,
                domain.source,
                domain.root,
                domain.rules,
                bool(domain.replaced),
                tuple(domain.merged),
            )
        return ServiceConfig(MappingProxyType(configs), tuple(self.sources))


def _second_document(text: str) -> yaml.Mark:
    """Where a file's second YAML document starts (as the composer says)."""
    try:
        yaml.compose(text, Loader=COMPOSER)
    except yaml.MarkedYAMLError as exc:
        if exc.problem_mark is not None:
            return exc.problem_mark
    return yaml.Mark("", 0, 0, 0, None, 0)


class _FileLoader(RuleNodes):
    """Validates one file's composed YAML nodes and builds its domain."""

    PLACE = _PLACE
    UPSTREAM = _UPSTREAM_KEYS

    def __init__(
        self,
        source: str,
        portable: bool,
        findings: list[ConfigFileError] | None,
        domains: _Domains,
    ) -> None:
        super().__init__(source, portable, findings)
        self.domains = domains
        self.nodes = 0

    def load(self, text: str) -> None:
        try:
            self.domain(text)
        except RecursionError:  # a recursive alias (&a [*a]) or absurd nesting
            raise ConfigFileError(
                self.source, 1, 1, "the YAML nests too deeply (or an alias contains itself)"
            ) from None

    def compose(self, text: str) -> Node | None:
        """The file's document; a second one is refused (upstream reads the first only)."""
        composer = COMPOSER(text)
        try:
            document = composer.get_node() if composer.check_node() else None
            if composer.check_node():
                self.lenient(
                    _second_document(text),
                    "expected a single document in the stream, but found another document: "
                    "envoyproxy/ratelimit reads the first document only and ignores this one; "
                    "put each domain in a file of its own",
                )
            return cast("Node | None", document)
        finally:
            composer.dispose()

    def domain(self, text: str) -> None:
        try:
            document = self.compose(text)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            problem = ", ".join(p for p in (exc.context, exc.problem) if p) or "invalid YAML"
            if mark is None:
                raise ConfigFileError(self.source, 1, 1, problem) from None
            raise self.error(mark, problem) from None
        except yaml.YAMLError as exc:
            raise ConfigFileError(self.source, 1, 1, f"invalid YAML: {exc}") from None
        if document is None:
            raise ConfigFileError(
                self.source, 1, 1, "the file is empty: expected 'domain' and 'descriptors'"
            )
        entries = self.mapping(document, "the top level", _ROOT_KEYS)
        if "domain" not in entries:
            raise self.error(document, "missing 'domain'")
        domain_node = entries["domain"][1]
        domain = self.text(domain_node, "domain")
        if not domain:
            raise self.error(domain_node, "the domain must not be empty")
        self.current = self.domains.open(self, domain, domain_node)
        if "descriptors" in entries:
            self.level(self.current.root, domain, (), entries["descriptors"][1])

    def level(
        self,
        parent: Level,
        domain: str,
        path: tuple[tuple[str, str | None, bool, bool], ...],
        node: Node,
    ) -> None:
        # what the level holds already (a merged domain's other files): where each was defined
        seen: dict[tuple[str, str | None], str] = {
            (child.key, child.value): child.spec["_where"] for child in _children(parent)
        }
        upstream_keys: dict[str, str] = {
            (f"{key}_{value}" if value is not None else key): where
            for (key, value), where in seen.items()
        }
        for item in self.sequence(node, "descriptors"):
            self.count(item)
            entries = self.mapping(item, "a descriptor", _DESCRIPTOR_KEYS)
            if "key" not in entries:
                raise self.error(item, "a descriptor needs a 'key'")
            key_node = entries["key"][1]
            key = self.text(key_node, "key")
            if not key:
                raise self.error(key_node, "the descriptor key must not be empty")
            if "*" in key:
                self.lenient(
                    key_node,
                    "a key cannot hold '*': envoyproxy/ratelimit matches it as a wildcard over "
                    "the joined 'key_value' string (key 'a*' with value 'b' matches key 'ax' "
                    "with value 'b', and key 'a' with value 'x_b'); put wildcards in 'value' "
                    "(e.g. value: 'foo*')",
                )
            value = self.text(entries["value"][1], "value") if "value" in entries else None
            value = value or None  # upstream reads an empty value as no value: the key alone
            where = key_node if "value" not in entries else entries["value"][1]
            self.unique(seen, upstream_keys, key, value, where)

            flags = self.flags(entries, value)
            metadata: Mapping[str, Any] | None = None
            if "metadata" in entries:
                metadata = self.metadata(entries["metadata"][1])

            level = Level(key, value)
            self.domains.order += 1
            level.spec["_order"] = self.domains.order
            level.spec["_where"] = self.where(where)
            for name in _FLAGS:
                if flags.get(name):
                    level.spec[name] = True
            if metadata is not None:
                level.spec["metadata"] = dict(metadata)
            here = (
                *path,
                (
                    key,
                    value,
                    flags.get("value_to_metric", False),
                    flags.get("share_threshold", False),
                ),
            )
            if "rate_limit" in entries:
                rate_node = entries["rate_limit"][1]
                if not (isinstance(rate_node, ScalarNode) and rate_node.tag == NULL):
                    level.rule = self.rule(
                        rate_node,
                        domain,
                        here,
                        shadow_mode=flags.get("shadow_mode", False),
                        detailed_metric=flags.get("detailed_metric", False),
                        quota_mode=flags.get("quota_mode", False),
                        metadata=metadata,
                    )
            if "descriptors" in entries:
                self.level(level, domain, here, entries["descriptors"][1])

            if value is None:
                parent.default[key] = level
            elif "*" in value:
                parts = tuple(value.split("*"))
                fixed = sum(map(len, parts))
                parent.wild.setdefault(key, []).append((parts, fixed, level))
            else:
                parent.exact[key, value] = level

    def unique(
        self,
        seen: dict[tuple[str, str | None], str],
        upstream_keys: dict[str, str],
        key: str,
        value: str | None,
        where: Node,
    ) -> None:
        """Refuse a descriptor that its level holds already (``seen``; with ``portable``, one
        upstream would join into the same ``key_value``), and note this one."""
        if (key, value) in seen:
            shown = f"key {key!r} value {value!r}" if value is not None else f"key {key!r}"
            raise self.error(
                where, f"duplicate descriptor {shown} at this level (first at {seen[key, value]})"
            )
        seen[key, value] = self.where(where)
        if self.portable:
            joined = f"{key}_{value}" if value is not None else key
            if joined in upstream_keys:
                raise self.error(
                    where,
                    f"envoyproxy/ratelimit joins key and value as {joined!r}, as it does "
                    f"the descriptor at {upstream_keys[joined]}, and would "
                    "refuse the file (portable mode)",
                )
            upstream_keys[joined] = self.where(where)

    def flags(self, entries: dict[str, tuple[Node, Node]], value: str | None) -> dict[str, bool]:
        """A descriptor's boolean keys; ``share_threshold`` needs a wildcard value (upstream
        refuses it elsewhere too)."""
        flags = {name: self.flag(entries[name][1], name) for name in _FLAGS if name in entries}
        if flags.get("share_threshold") and (value is None or "*" not in value):
            raise self.error(
                entries["share_threshold"][1],
                "share_threshold: true needs a wildcard value (containing '*'): the values it "
                "matches share one counter (envoyproxy/ratelimit refuses it too)",
            )
        return flags

    def metadata(self, node: Node) -> Mapping[str, Any]:
        if not isinstance(node, MappingNode):
            raise self.error(node, f"metadata must be a mapping, got {kind(node)}")
        self.no_duplicates(node)
        data = yaml.constructor.SafeConstructor().construct_document(node)
        # JSON-ready (GET /rlconfig shows it): dates and such become strings.
        result: Mapping[str, Any] = json.loads(json.dumps(data, default=str))
        return MappingProxyType(dict(result))

    def count(self, node: Node) -> None:
        """Count a descriptor or metadata node: each use of an alias counts again."""
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise self.error(
                node,
                f"more than {MAX_NODES} descriptors and metadata values in one file "
                "(counting each use of an alias)",
            )

    def no_duplicates(self, node: Node) -> None:
        """Refuse a key written twice in any mapping under ``node`` (PyYAML keeps the last)."""
        self.count(node)
        if isinstance(node, MappingNode):
            seen: dict[Any, Node] = {}
            for key_node, value_node in node.value:
                key = (key_node.tag, key_node.value) if isinstance(key_node, ScalarNode) else None
                if key is not None and key in seen:
                    self.lenient(
                        key_node,
                        f"duplicate key {key_node.value!r} (first at {self.where(seen[key])}): "
                        "envoyproxy/ratelimit silently keeps the last one; remove one of them",
                    )
                if key is not None:
                    seen[key] = key_node
                self.no_duplicates(value_node)
        elif isinstance(node, SequenceNode):
            for item in node.value:
                self.no_duplicates(item)
