"""Loading ``ratekeeper serve``'s configuration: envoyproxy/ratelimit's YAML files into the
model of ``_config``, refusing any mistake with a :class:`ConfigFileError` that names
``path:line:column`` (the first one found: files are checked in name order, each from the top,
and loading stops there). Pure: it reads files and does no other I/O. What the format is, and
where this loader is stricter than upstream, is in ``_config``'s docstring.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .._errors import ConfigError
from .._policy import Policy
from .._rates import Rate
from ._config import (
    DEFAULT_ALGORITHM,
    MAX_NODES,
    MAX_REQUESTS_PER_UNIT,
    SERVICE_ALGORITHMS,
    UNIT_NAMES,
    UNITS,
    ConfigFileError,
    DomainConfig,
    Level,
    LimitRule,
    ServiceConfig,
    rule_policy_name,
)
from ._yaml_nodes import COMPOSER, NULL, Nodes, kind, read

if TYPE_CHECKING:
    from ..typing import Algorithm

__all__ = ["check_config", "load_config"]

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
_RATE_LIMIT_KEYS = frozenset({"unit", "requests_per_unit", "unlimited", "name", "replaces"})
_RATE_LIMIT_EXTENSIONS = frozenset(
    {"algorithm", "burst", "unit_multiplier", "limits", "charge_over_limit"}
)
_LIMIT_ITEM_KEYS = frozenset({"unit", "requests_per_unit", "unit_multiplier"})
_REPLACES_KEYS = frozenset({"name"})
# Where a key that is valid elsewhere belongs, for the error about a misplaced one.
_PLACE = {
    **dict.fromkeys(_ROOT_KEYS - {"descriptors"}, "the top level of the file"),
    **dict.fromkeys(_DESCRIPTOR_KEYS - {"descriptors"}, "a descriptor"),
    **dict.fromkeys(_RATE_LIMIT_KEYS | _RATE_LIMIT_EXTENSIONS, "rate_limit"),
}


def load_config(path: str | os.PathLike[str], *, portable: bool = False) -> ServiceConfig:
    """Load a YAML file, or every ``*.yaml``/``*.yml`` file of a directory (one domain each).

    In a directory, entries whose names start with a dot are skipped (Kubernetes ConfigMap
    volumes keep their real files in ``..data`` and ``..<timestamp>`` and link the visible names
    to them), as are subdirectories and other files; the files load in name order. A domain may
    appear in one file only. ``portable=True`` refuses every ratekeeper extension.
    """
    root = Path(os.fspath(path))
    if root.is_dir():
        files = sorted(
            entry
            for entry in root.iterdir()
            if not entry.name.startswith(".")
            and entry.suffix in (".yaml", ".yml")
            and entry.is_file()
        )
    elif root.is_file():
        files = [root]
    else:
        raise ConfigError(f"{os.fspath(path)}: no such configuration file or directory")
    domains: dict[str, DomainConfig] = {}
    first_seen: dict[str, str] = {}
    for file in files:
        source = str(file)
        loader = _FileLoader(source, portable)
        config, domain_node = loader.load(read(source))
        if config.name in domains:
            raise loader.error(
                domain_node,
                f"duplicate domain {config.name!r}: already defined at {first_seen[config.name]}",
            )
        domains[config.name] = config
        first_seen[config.name] = loader.where(domain_node)
    return ServiceConfig(MappingProxyType(domains), tuple(str(file) for file in files))


def check_config(path: str | os.PathLike[str], *, portable: bool = False) -> str:
    """What ``ratekeeper serve --check PATH [--portable]`` prints: a summary of a valid
    configuration. A mistake raises ConfigFileError (``path:line:column: what``)."""
    config = load_config(path, portable=portable)
    rules = sum(domain.rules for domain in config.domains.values())
    lines = [
        f"{domain.source}: domain {domain.name!r}, {domain.rules} "
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


class _FileLoader(Nodes):
    """Validates one file's composed YAML nodes and builds its domain."""

    PLACE = _PLACE

    def __init__(self, source: str, portable: bool) -> None:
        super().__init__(source, portable)
        self.order = 0
        self.nodes = 0
        self.rules = 0
        self.names: set[str] = set()
        self.replaced: list[tuple[str, Node]] = []

    def load(self, text: str) -> tuple[DomainConfig, Node]:
        try:
            return self.domain(text)
        except RecursionError:  # a recursive alias (&a [*a]) or absurd nesting
            raise ConfigFileError(
                self.source, 1, 1, "the YAML nests too deeply (or an alias contains itself)"
            ) from None

    def domain(self, text: str) -> tuple[DomainConfig, Node]:
        try:
            document = yaml.compose(text, Loader=COMPOSER)
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
        root = Level("", None)
        if "descriptors" in entries:
            self.level(root, domain, (), entries["descriptors"][1])
        for name, node in self.replaced:
            if name not in self.names:
                raise self.error(
                    node,
                    f"replaces {name!r}, but no rate_limit of domain {domain!r} is named {name!r}",
                )
        config = DomainConfig(domain, self.source, root, self.rules, bool(self.replaced))
        return config, domain_node

    def level(
        self,
        parent: Level,
        domain: str,
        path: tuple[tuple[str, str | None, bool], ...],
        node: Node,
    ) -> None:
        seen: dict[tuple[str, str | None], Node] = {}
        upstream_keys: dict[str, Node] = {}
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
                raise self.error(
                    key_node, "a key cannot hold '*': wildcards go in 'value' (e.g. value: 'foo*')"
                )
            value = self.text(entries["value"][1], "value") if "value" in entries else None
            value = value or None  # upstream reads an empty value as no value: the key alone
            where = key_node if "value" not in entries else entries["value"][1]
            if (key, value) in seen:
                shown = f"key {key!r} value {value!r}" if value is not None else f"key {key!r}"
                raise self.error(
                    where,
                    f"duplicate descriptor {shown} at this level "
                    f"(first at {self.where(seen[key, value])})",
                )
            seen[key, value] = where
            if self.portable:
                joined = f"{key}_{value}" if value is not None else key
                if joined in upstream_keys:
                    raise self.error(
                        where,
                        f"envoyproxy/ratelimit joins key and value as {joined!r}, as it does "
                        f"the descriptor at {self.where(upstream_keys[joined])}, and would "
                        "refuse the file (portable mode)",
                    )
                upstream_keys[joined] = where

            flags = self.flags(entries)
            metadata: Mapping[str, Any] | None = None
            if "metadata" in entries:
                metadata = self.metadata(entries["metadata"][1])

            level = Level(key, value)
            self.order += 1
            level.spec["_order"] = self.order
            for name in ("shadow_mode", "detailed_metric", "value_to_metric"):
                if flags.get(name):
                    level.spec[name] = True
            if metadata is not None:
                level.spec["metadata"] = dict(metadata)
            here = (*path, (key, value, flags.get("value_to_metric", False)))
            if "rate_limit" in entries:
                rate_node = entries["rate_limit"][1]
                if not (isinstance(rate_node, ScalarNode) and rate_node.tag == NULL):
                    level.rule = self.rule(
                        rate_node,
                        domain,
                        here,
                        shadow_mode=flags.get("shadow_mode", False),
                        detailed_metric=flags.get("detailed_metric", False),
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

    def flags(self, entries: dict[str, tuple[Node, Node]]) -> dict[str, bool]:
        """A descriptor's boolean keys; the unsupported ones may only be false."""
        flags: dict[str, bool] = {
            name: self.flag(entries[name][1], name)
            for name in (
                "shadow_mode",
                "detailed_metric",
                "value_to_metric",
                "quota_mode",
                "share_threshold",
            )
            if name in entries
        }
        for name in ("quota_mode", "share_threshold"):
            if flags.get(name):
                raise self.error(
                    entries[name][1],
                    f"{name}: true is not supported by ratekeeper serve (refused rather "
                    "than ignored)",
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
                    raise self.error(
                        key_node,
                        f"duplicate key {key_node.value!r} (first at {self.where(seen[key])})",
                    )
                if key is not None:
                    seen[key] = key_node
                self.no_duplicates(value_node)
        elif isinstance(node, SequenceNode):
            for item in node.value:
                self.no_duplicates(item)

    def rule(
        self,
        node: Node,
        domain: str,
        path: tuple[tuple[str, str | None, bool], ...],
        *,
        shadow_mode: bool,
        detailed_metric: bool,
        metadata: Mapping[str, Any] | None,
    ) -> LimitRule:
        entries = self.mapping(node, "rate_limit", _RATE_LIMIT_KEYS, _RATE_LIMIT_EXTENSIONS)
        given = {
            name: pair
            for name, pair in entries.items()
            if not (isinstance(pair[1], ScalarNode) and pair[1].tag == NULL)
        }
        unlimited = self.flag(given["unlimited"][1], "unlimited") if "unlimited" in given else False
        name = self.text(given["name"][1], "name") if "name" in given else None
        name = name or None
        replaces = self.replaces(given["replaces"][1], name) if "replaces" in given else ()
        if name is not None:
            self.names.add(name)
        self.rules += 1
        stat_key = ".".join([domain, *(f"{k}_{v}" if v is not None else k for k, v, _ in path)])
        common: dict[str, Any] = {
            "name": name,
            "shadow_mode": shadow_mode,
            "detailed_metric": detailed_metric,
            "replaces": replaces,
            "stat_key": stat_key,
            "domain": domain,
            "metric_path": path,
            "metadata": metadata,
        }
        if unlimited:
            for other in ("unit", "requests_per_unit", *sorted(_RATE_LIMIT_EXTENSIONS)):
                if other in given:
                    raise self.error(
                        given[other][0], f"unlimited: true takes no {other} (remove one of them)"
                    )
            return LimitRule(
                unlimited=True, policy=None, unit="UNKNOWN", requests_per_unit=0, **common
            )

        if "limits" in given:
            for other in ("unit", "requests_per_unit", "unit_multiplier"):
                if other in given:
                    raise self.error(
                        given[other][0],
                        f"rate_limit has 'limits': give {other} in each item of the list, "
                        "not beside it",
                    )
            items = self.sequence(given["limits"][1], "limits")
            if not items:
                raise self.error(given["limits"][1], "limits must list at least one limit")
            limits = [self.limit(item, node, in_list=True) for item in items]
        else:
            limits = [self.limit(node, node, in_list=False)]

        algorithm = DEFAULT_ALGORITHM
        if "algorithm" in given:
            algo_node = given["algorithm"][1]
            algorithm = self.text(algo_node, "algorithm") or ""
            if algorithm == "concurrency":
                raise self.error(
                    algo_node,
                    "algorithm 'concurrency' counts requests in flight and needs to hear when "
                    "each ends, which a rate limit service never does: choose one of "
                    + ", ".join(SERVICE_ALGORITHMS),
                )
            if algorithm not in SERVICE_ALGORITHMS:
                raise self.error(
                    algo_node,
                    f"unknown algorithm {algorithm!r}: choose one of "
                    f"{', '.join(SERVICE_ALGORITHMS)}",
                )
        burst = None
        if "burst" in given:
            burst = self.integer(given["burst"][1], "burst", 1, 2**53)

        first_requests, first_unit, _ = limits[0][0]
        if first_requests == 0:
            for other in ("algorithm", "burst", "charge_over_limit"):
                if other in given:
                    raise self.error(
                        given[other][0],
                        f"requests_per_unit: 0 denies every request: {other} does not apply",
                    )
            policy = None
        else:
            policy_name = rule_policy_name("", stat_key, domain, [[k, v] for k, v, _ in path])
            try:
                rates = [
                    Rate(requests, UNITS[unit] * multiplier)
                    for (requests, unit, multiplier), _ in limits
                ]
                policy = Policy(policy_name, rates, cast("Algorithm", algorithm), burst=burst)
            except ConfigError as exc:
                message = str(exc).replace(f"policy {policy_name!r}: ", "")
                where = given["burst"][1] if burst is not None and "burst" in message else node
                if "limits" in given and "share the period" in message:
                    where = given["limits"][1]
                raise self.error(where, message) from None
        return LimitRule(
            unlimited=False,
            policy=policy,
            unit=first_unit,
            requests_per_unit=first_requests,
            limits=tuple(limit for limit, _ in limits),
            charge_over_limit="charge_over_limit" in given
            and self.flag(given["charge_over_limit"][1], "charge_over_limit"),
            **common,
        )

    def replaces(self, node: Node, name: str | None) -> tuple[str, ...]:
        replaces = []
        for item in self.sequence(node, "replaces"):
            if isinstance(item, ScalarNode):
                raise self.error(
                    item, f"a replaces entry is a mapping, as '- name: {item.value}', not a string"
                )
            replaced = self.mapping(item, "a replaces entry", _REPLACES_KEYS)
            target_node = replaced["name"][1] if "name" in replaced else item
            target = self.text(target_node, "name") if "name" in replaced else None
            if not target:
                raise self.error(target_node, "a replaces entry needs a non-empty name")
            if target == name:
                raise self.error(target_node, f"the rule {name!r} replaces itself")
            replaces.append(target)
            self.replaced.append((target, target_node))
        return tuple(replaces)

    def limit(
        self, node: Node, rule_node: Node, *, in_list: bool
    ) -> tuple[tuple[int, str, int], Node]:
        """One limit: (requests_per_unit, UNIT, unit_multiplier) and its node."""
        if in_list:
            entries = self.mapping(node, "an item of limits", _LIMIT_ITEM_KEYS)
        else:
            entries = self.mapping(node, "rate_limit", _RATE_LIMIT_KEYS, _RATE_LIMIT_EXTENSIONS)
        entries = {
            name: pair
            for name, pair in entries.items()
            if not (isinstance(pair[1], ScalarNode) and pair[1].tag == NULL)
        }
        if "unit" not in entries:
            raise self.error(node, f"missing 'unit' ({UNIT_NAMES})")
        unit_node = entries["unit"][1]
        written = self.text(unit_node, "unit") or ""
        unit = written.upper()
        if unit not in UNITS:
            raise self.error(unit_node, f"invalid rate limit unit {written!r}: use {UNIT_NAMES}")
        if "requests_per_unit" not in entries:
            raise self.error(
                node,
                "missing 'requests_per_unit' (envoyproxy/ratelimit would read 0 and deny every "
                "request; write requests_per_unit: 0 if that is meant)",
            )
        low = 1 if in_list else 0
        requests = self.integer(
            entries["requests_per_unit"][1], "requests_per_unit", low, MAX_REQUESTS_PER_UNIT
        )
        multiplier = 1
        if "unit_multiplier" in entries:
            multiplier = self.integer(
                entries["unit_multiplier"][1], "unit_multiplier", 1, 1_000_000
            )
        return (requests, unit, multiplier), node
