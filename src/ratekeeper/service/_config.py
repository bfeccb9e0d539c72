"""The configuration of ``ratekeeper serve``: envoyproxy/ratelimit's YAML and its extensions.

Pure: this module reads files and does no other I/O. ``load_config`` turns a file, or a directory
of ``*.yaml``/``*.yml`` files with one domain each, into a :class:`ServiceConfig`, refusing any
mistake with a :class:`ConfigFileError` that names ``path:line:column`` (the first one found:
files are checked in name order, each from the top, and loading stops there).
``ServiceConfig.resolve`` is what the server calls on every request: a few dict lookups per
descriptor entry, no parsing and no regular expressions.

The format is envoyproxy/ratelimit's (``domain``; nested ``descriptors`` with ``key``,
``value``, ``rate_limit`` {``unit``, ``requests_per_unit``, ``unlimited``, ``name``,
``replaces``}, ``shadow_mode``, ``detailed_metric``, ``value_to_metric``, ``metadata``) with its
lookup rules: at each level the exact value first, then the wildcard values (``*`` matches any
run of characters, anywhere in the value) in file order, then the key alone; a limit applies
only where the request's last entry lands. Extensions, refused with ``portable=True`` so that a
file stays loadable by envoyproxy/ratelimit, go in ``rate_limit``: ``algorithm`` (default
``fixed_window``, as upstream), ``burst``, ``unit_multiplier`` (a window of several units) and
``limits`` (several limits on one descriptor, checked all-or-nothing).

Where this loader is stricter than upstream, on purpose (each is a silent mistake there): a key
in the wrong place (upstream accepts any known key anywhere and ignores it), a mapping key
written twice, ``requests_per_unit`` left out (upstream reads 0: deny everything; write 0 to mean
it), ``unlimited`` with ``requests_per_unit``, ``replaces`` naming no rule of the domain, a ``*``
in a key, and ``quota_mode``/``share_threshold`` set to true (not supported: refused rather than
ignored). Matching compares keys and values as they are; upstream joins them as ``key_value``
strings, so that ``("a_b", "c")`` can match a rule for ``a: b_c`` there; ``portable=True``
refuses the files in which two descriptors of a level would collide that way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from hashlib import blake2b
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, cast

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .._algorithms import ALGORITHMS
from .._errors import ConfigError
from .._policy import Policy
from .._rates import Rate

if TYPE_CHECKING:
    from ..typing import Algorithm

__all__ = [
    "MAX_NODES",
    "MAX_REQUESTS_PER_UNIT",
    "UNITS",
    "ConfigFileError",
    "DomainConfig",
    "LimitRule",
    "ServiceConfig",
    "check_config",
    "identity_of",
    "load_config",
    "override_rule",
]

#: The composer: libyaml's when PyYAML was built with it (same nodes and marks, faster).
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

#: envoyproxy/ratelimit's units (the ``RateLimitResponse.RateLimit.Unit`` enum names) and
#: their length in seconds. A month is 30 days, a year 365, as upstream.
UNITS: Final[Mapping[str, int]] = MappingProxyType(
    {
        "SECOND": 1,
        "MINUTE": 60,
        "HOUR": 3600,
        "DAY": 86400,
        "WEEK": 7 * 86400,
        "MONTH": 30 * 86400,
        "YEAR": 365 * 86400,
    }
)
_UNIT_NAMES = "second, minute, hour, day, week, month or year"

#: The most descriptors and metadata values one file may hold, each use of a YAML alias
#: counted: aliases of aliases would otherwise expand a small file into billions of rules.
MAX_NODES: Final = 100_000

#: ``requests_per_unit`` is a uint32 on the wire (``current_limit``), as in upstream's YAML.
MAX_REQUESTS_PER_UNIT: Final = 2**32 - 1

_INT = "tag:yaml.org,2002:int"
_BOOL = "tag:yaml.org,2002:bool"
_NULL = "tag:yaml.org,2002:null"
_TRUE = frozenset({"true", "yes", "on"})  # YAML 1.1, as PyYAML resolves them

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
_RATE_LIMIT_EXTENSIONS = frozenset({"algorithm", "burst", "unit_multiplier", "limits"})
_LIMIT_ITEM_KEYS = frozenset({"unit", "requests_per_unit", "unit_multiplier"})
_REPLACES_KEYS = frozenset({"name"})
# Where a key that is valid elsewhere belongs, for the error about a misplaced one.
_PLACE = {
    **dict.fromkeys(_ROOT_KEYS - {"descriptors"}, "the top level of the file"),
    **dict.fromkeys(_DESCRIPTOR_KEYS - {"descriptors"}, "a descriptor"),
    **dict.fromkeys(_RATE_LIMIT_KEYS | _RATE_LIMIT_EXTENSIONS, "rate_limit"),
}

#: Algorithms a rate limit service can run: ``concurrency`` counts requests in flight and needs
#: to hear that each one ended, which a request/response RPC never says.
_ALGORITHMS = tuple(name for name in sorted(ALGORITHMS) if name != "concurrency")
_DEFAULT_ALGORITHM: Final = "fixed_window"

_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:/-")


class ConfigFileError(ConfigError):
    """A configuration file is wrong at ``path:line:column`` (both 1-based)."""

    def __init__(self, path: str, line: int, column: int, message: str) -> None:
        super().__init__(f"{path}:{line}:{column}: {message}")
        self.path = path
        self.line = line
        self.column = column
        self.reason = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.line, self.column, self.reason))


@dataclass(frozen=True)
class LimitRule:
    """The limit one descriptor gets: a configured ``rate_limit`` or a request's override.

    ``policy`` is the ratekeeper Policy to charge; it is None when ``unlimited`` (answer OK with
    remaining 4294967295, without the store) and when ``requests_per_unit`` is 0 (upstream's
    way to deny every request: see :attr:`denies_all`). Its name is derived from the domain and
    the rule's place in the file (not from its limit), so a reload that changes a limit keeps
    the counters, and two rules never share one.

    ``unit`` and ``requests_per_unit`` are the first limit as written, for ``current_limit``;
    with several ``limits``, :meth:`current_limit` names the one that decided.
    """

    name: str | None
    unlimited: bool
    policy: Policy | None
    unit: str
    requests_per_unit: int
    shadow_mode: bool
    detailed_metric: bool
    replaces: tuple[str, ...]
    stat_key: str
    #: The domain the rule belongs to.
    domain: str = ""
    #: Every limit as written: (requests_per_unit, unit, unit_multiplier), in file order.
    limits: tuple[tuple[int, str, int], ...] = ()
    #: Per level of the rule's path: (key, value as written or None, value_to_metric).
    metric_path: tuple[tuple[str, str | None, bool], ...] = field(default=(), repr=False)
    #: The descriptor's ``metadata`` mapping (upstream's dynamic metadata), if any.
    metadata: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    _values_in_stat_key: bool = field(default=False, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # whether a level's value_to_metric puts request values in the stats key (once, not
        # per decision)
        values = any(level[2] for level in self.metric_path)
        object.__setattr__(self, "_values_in_stat_key", values)

    @property
    def denies_all(self) -> bool:
        """``requests_per_unit: 0``: every request is over the limit (no store needed)."""
        return not self.unlimited and self.requests_per_unit == 0

    @property
    def window(self) -> int:
        """The first limit's window in seconds (0 when unlimited)."""
        if self.unlimited:
            return 0
        multiplier = self.limits[0][2] if self.limits else 1
        return UNITS[self.unit] * multiplier

    def current_limit(self, rate: Rate | None = None) -> tuple[int, str]:
        """``(requests_per_unit, unit)`` for the response: of ``rate`` (the rate of the policy
        that decided) when given, else of the first limit. A window of several units reports
        its unit, since the wire has no multiplier."""
        if rate is not None:
            for requests, unit, multiplier in self.limits:
                if requests == rate.limit and UNITS[unit] * multiplier * 1000 == rate.period_ms:
                    return requests, unit
        return self.requests_per_unit, self.unit

    def stat_key_for(self, entries: Sequence[tuple[str, str]]) -> str:
        """Upstream's stats key for a request's descriptor that landed on this rule: the
        request's values with ``detailed_metric``, where ``value_to_metric`` says so, else
        :attr:`stat_key`."""
        if self.detailed_metric:
            return self.domain + "".join(f".{key}_{value}" for key, value in entries)
        if not self._values_in_stat_key:
            return self.stat_key
        parts = [self.domain]
        for (key, value), (_, written, to_metric) in zip(entries, self.metric_path, strict=False):
            if written is None:
                shown = value if to_metric else ""
            elif "*" in written:
                shown = value if to_metric else written
            else:
                shown = value
            parts.append(f"{key}_{shown}" if shown else key)
        return ".".join(parts)


class _Level:
    """One descriptor of the file: its rule and the lookup tables of the level below it."""

    __slots__ = ("default", "exact", "key", "rule", "spec", "value", "wild")

    def __init__(self, key: str, value: str | None) -> None:
        self.key = key
        self.value = value
        self.rule: LimitRule | None = None
        self.exact: dict[tuple[str, str], _Level] = {}
        # key -> the wildcard values of that key, in file order: (parts, fixed length, level)
        self.wild: dict[str, list[tuple[tuple[str, ...], int, _Level]]] = {}
        self.default: dict[str, _Level] = {}
        self.spec: dict[str, Any] = {}

    def child(self, key: str, value: str) -> _Level | None:
        """The level a request entry lands on: exact value, then wildcards, then the key."""
        found = self.exact.get((key, value))
        if found is not None:
            return found
        patterns = self.wild.get(key)
        if patterns is not None:
            for parts, fixed, level in patterns:
                if _wildcard_match(parts, fixed, value):
                    return level
        return self.default.get(key)

    @property
    def leaf(self) -> bool:
        return not (self.exact or self.wild or self.default)


def _wildcard_match(parts: tuple[str, ...], fixed: int, value: str) -> bool:
    """Whether ``value`` matches a pattern split on ``*`` (each ``*`` any run, even empty)."""
    if len(value) < fixed or not value.startswith(parts[0]) or not value.endswith(parts[-1]):
        return False
    if len(parts) == 2:
        return True
    pos, end = len(parts[0]), len(value) - len(parts[-1])
    for part in parts[1:-1]:
        found = value.find(part, pos, end)
        if found < 0:
            return False
        pos = found + len(part)
    return True


@dataclass(frozen=True)
class DomainConfig:
    """One domain: the file it came from and its descriptor tree."""

    name: str
    source: str
    root: _Level = field(repr=False)
    rules: int
    has_replaces: bool = field(repr=False)

    def rule_for(self, entries: Sequence[tuple[str, str]]) -> LimitRule | None:
        """The rule a descriptor lands on, before ``replaces`` (None: no limit)."""
        level = self.root
        last = len(entries) - 1
        for i, (key, value) in enumerate(entries):
            found = level.child(key, value)
            if found is None:
                return None
            if i == last:
                return found.rule
            if found.leaf:
                return None  # the request goes deeper than the file: no limit
            level = found
        return None


@dataclass(frozen=True)
class ServiceConfig:
    """The loaded domains and the files they came from."""

    domains: Mapping[str, DomainConfig]
    sources: tuple[str, ...]

    def resolve(
        self,
        domain: str,
        descriptors: Sequence[Sequence[tuple[str, str]]],
        *,
        overrides: Sequence[tuple[int, str] | None] | None = None,
    ) -> list[LimitRule | None]:
        """The rule of each request descriptor, in order (None: no limit), as upstream decides:
        each descriptor's rule, then every rule named in a matched rule's ``replaces`` dropped
        (unlimited rules are never dropped). An unknown domain has no limits.

        ``overrides`` optionally gives each descriptor's ``limit`` override as
        ``(requests_per_unit, unit)`` or None. As upstream, an override replaces the configured
        rule of its descriptor (in a known domain), takes no part in ``replaces`` and is never
        replaced. Without it, call :func:`override_rule` for those descriptors yourself.
        """
        config = self.domains.get(domain)
        if config is None:
            return [None] * len(descriptors)
        rule_for = config.rule_for
        rules = [rule_for(entries) for entries in descriptors]
        overridden: set[int] = set()
        if overrides is not None:
            for i, override in enumerate(overrides):
                if override is not None:
                    rules[i] = override_rule(domain, descriptors[i], *override, base=rules[i])
                    overridden.add(i)
        if config.has_replaces:
            replacing = {
                name
                for i, rule in enumerate(rules)
                if rule is not None and i not in overridden
                for name in rule.replaces
            }
            if replacing:
                for i, rule in enumerate(rules):
                    if (
                        rule is not None
                        and not rule.unlimited
                        and rule.name in replacing
                        and i not in overridden
                    ):
                        rules[i] = None
        return rules

    def to_dict(self) -> dict[str, Any]:
        """The loaded configuration as JSON-ready data (what ``GET /rlconfig`` shows)."""
        return {
            "sources": list(self.sources),
            "domains": [
                {
                    "domain": config.name,
                    "source": config.source,
                    "descriptors": [_dump(level) for level in _children(config.root)],
                }
                for config in sorted(self.domains.values(), key=lambda c: c.name)
            ],
        }


def _children(level: _Level) -> list[_Level]:
    children = [*level.exact.values(), *level.default.values()]
    children += [child for patterns in level.wild.values() for *_, child in patterns]
    return sorted(children, key=lambda child: child.spec["_order"])


def _dump(level: _Level) -> dict[str, Any]:
    out: dict[str, Any] = {"key": level.key}
    if level.value is not None:
        out["value"] = level.value
    out.update((k, v) for k, v in level.spec.items() if not k.startswith("_"))
    rule = level.rule
    if rule is not None:
        limit: dict[str, Any] = {"name": rule.name, "unlimited": rule.unlimited}
        if not rule.unlimited:
            limit["unit"] = rule.unit
            limit["requests_per_unit"] = rule.requests_per_unit
            if rule.policy is not None:
                limit["algorithm"] = rule.policy.algorithm
                limit["limits"] = [
                    {"requests_per_unit": r, "unit": u, "unit_multiplier": m}
                    for r, u, m in rule.limits
                ]
                if rule.policy.burst is not None:
                    limit["burst"] = rule.policy.burst
                limit["policy"] = rule.policy.name
        limit["replaces"] = list(rule.replaces)
        limit["stat_key"] = rule.stat_key
        out["rate_limit"] = limit
    children = _children(level)
    if children:
        out["descriptors"] = [_dump(child) for child in children]
    return out


def identity_of(domain: str, entries: Sequence[tuple[str, str]]) -> str:
    """The store identity of a request descriptor: the domain, keys and values, each prefixed
    with its length, so two different descriptors never share one (no separator a key or value
    could forge) and nothing needs escaping. The limiter hashes it into the key."""
    return f"{len(domain)}:{domain}" + "".join(
        f"{len(key)}:{key}{len(value)}:{value}" for key, value in entries
    )


def _digest(*parts: object) -> str:
    data = json.dumps(parts, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    return blake2b(data, digest_size=8, person=b"ratekeeper-rls").hexdigest()


def _policy_name(kind: str, readable: str, *parts: object) -> str:
    """A stable Policy name: readable, within Policy's charset and length, unique by its hash."""
    slug = "".join(c if c in _NAME_CHARS else "_" for c in readable)[:96]
    return f"rls{kind}:{slug}:{_digest(kind, *parts)}"


def _descriptor_key(domain: str, entries: Sequence[tuple[str, str]]) -> str:
    return ".".join([domain, *(f"{k}_{v}" if v else k for k, v in entries)])


def override_rule(
    domain: str,
    entries: Sequence[tuple[str, str]],
    requests_per_unit: int,
    unit: str,
    base: LimitRule | None,
) -> LimitRule:
    """The rule of a descriptor that carries its own ``limit`` (Envoy's override).

    As upstream, the override replaces the configured limit: no name, no ``replaces``, no
    shadow mode. Its counter follows upstream's cache key (the domain, the entries and the
    window, so the unit, but not ``requests_per_unit``): with a configured rule ``base`` of
    one limit in the same unit, the override charges that rule's counter; otherwise a counter
    of its own per unit (and per base rule), which any ``requests_per_unit`` shares. It uses
    the base rule's algorithm, else a fixed window. ``unit`` is an upstream unit name (any
    case); a bad unit or a limit the algorithm refuses is a ConfigError.
    """
    unit_name = unit.upper() if isinstance(unit, str) else ""
    if unit_name not in UNITS:
        raise ConfigError(f"limit override unit {unit!r} is invalid: use {_UNIT_NAMES}")
    if isinstance(requests_per_unit, bool) or not isinstance(requests_per_unit, int):
        raise ConfigError(f"limit override requests_per_unit must be an int: {requests_per_unit!r}")
    if not 0 <= requests_per_unit <= MAX_REQUESTS_PER_UNIT:
        raise ConfigError(
            f"limit override requests_per_unit must be 0 to {MAX_REQUESTS_PER_UNIT}: "
            f"{requests_per_unit}"
        )
    if base is not None and base.policy is not None:
        algorithm = base.policy.algorithm
        if base.limits == ((base.requests_per_unit, unit_name, 1),):
            name = base.policy.name
        else:
            name = _policy_name("o", base.stat_key, base.policy.name, unit_name)
    else:
        anchor = base.stat_key if base is not None else None
        name = _policy_name("o", f"{domain}.override", domain, anchor, unit_name)
        algorithm = _DEFAULT_ALGORITHM
    policy = _override_policy(name, algorithm, requests_per_unit, unit_name)
    return LimitRule(
        name=None,
        unlimited=False,
        policy=policy,
        unit=unit_name,
        requests_per_unit=requests_per_unit,
        shadow_mode=False,
        detailed_metric=False,
        replaces=(),
        stat_key=_descriptor_key(domain, entries),
        domain=domain,
        limits=((requests_per_unit, unit_name, 1),),
    )


@lru_cache(maxsize=1024)
def _override_policy(name: str, algorithm: Any, requests: int, unit: str) -> Policy | None:
    if requests == 0:
        return None
    return Policy(name, Rate(requests, UNITS[unit]), algorithm)


# --- loading -----------------------------------------------------------------------------


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
        config, domain_node = loader.load(_read(source))
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


def _read(source: str) -> str:
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


class _FileLoader:
    """Validates one file's composed YAML nodes and builds its domain."""

    def __init__(self, source: str, portable: bool) -> None:
        self.source = source
        self.portable = portable
        self.order = 0
        self.nodes = 0
        self.rules = 0
        self.names: set[str] = set()
        self.replaced: list[tuple[str, Node]] = []

    # -- errors and locations

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
            raise self.error(node, f"{what} must be a mapping, got {_kind(node)}")
        out: dict[str, tuple[Node, Node]] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                raise self.error(key_node, f"keys of {what} must be strings, got {_kind(key_node)}")
            name = key_node.value
            if name in out:
                raise self.error(
                    key_node,
                    f"duplicate key {name!r} in {what} (first at {self.where(out[name][0])})",
                )
            if name not in keys:
                if name in extensions:
                    if self.portable:
                        raise self.error(
                            key_node,
                            f"{name!r} is a ratekeeper extension, refused in portable mode "
                            "(envoyproxy/ratelimit does not know it)",
                        )
                else:
                    place = _PLACE.get(name)
                    hint = f"; {name!r} belongs in {place}" if place else ""
                    known = ", ".join(sorted(keys | (frozenset() if self.portable else extensions)))
                    if name == "<<":
                        hint = " (YAML merge keys are not supported)"
                    raise self.error(
                        key_node, f"unknown key {name!r} in {what}{hint} (known: {known})"
                    )
            out[name] = (key_node, value_node)
        return out

    def text(self, node: Node, what: str) -> str | None:
        """A scalar as written (``value: 200`` is ``"200"``, as upstream reads it); None if null."""
        if not isinstance(node, ScalarNode):
            raise self.error(node, f"{what} must be a string, got {_kind(node)}")
        if node.tag == _NULL:
            return None
        return str(node.value)

    def flag(self, node: Node, what: str) -> bool:
        if isinstance(node, ScalarNode) and node.tag == _NULL:
            return False
        if not isinstance(node, ScalarNode) or node.tag != _BOOL:
            raise self.error(node, f"{what} must be true or false, got {_show(node)}")
        return str(node.value).lower() in _TRUE

    def integer(self, node: Node, what: str, low: int, high: int) -> int:
        if not (isinstance(node, ScalarNode) and node.tag == _INT and str(node.value).isdecimal()):
            raise self.error(node, f"{what} must be a whole number, got {_show(node)}")
        number = int(node.value)
        if not low <= number <= high:
            raise self.error(node, f"{what} must be between {low} and {high}, got {number}")
        return number

    def sequence(self, node: Node, what: str) -> list[Node]:
        if isinstance(node, ScalarNode) and node.tag == _NULL:
            return []
        if not isinstance(node, SequenceNode):
            raise self.error(node, f"{what} must be a list, got {_kind(node)}")
        return list(node.value)

    # -- the file

    def load(self, text: str) -> tuple[DomainConfig, Node]:
        try:
            return self.domain(text)
        except RecursionError:  # a recursive alias (&a [*a]) or absurd nesting
            raise ConfigFileError(
                self.source, 1, 1, "the YAML nests too deeply (or an alias contains itself)"
            ) from None

    def domain(self, text: str) -> tuple[DomainConfig, Node]:
        try:
            document = yaml.compose(text, Loader=_LOADER)
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
        root = _Level("", None)
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
        parent: _Level,
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

            level = _Level(key, value)
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
                if not (isinstance(rate_node, ScalarNode) and rate_node.tag == _NULL):
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
            raise self.error(node, f"metadata must be a mapping, got {_kind(node)}")
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
            if not (isinstance(pair[1], ScalarNode) and pair[1].tag == _NULL)
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

        algorithm = _DEFAULT_ALGORITHM
        if "algorithm" in given:
            algo_node = given["algorithm"][1]
            algorithm = self.text(algo_node, "algorithm") or ""
            if algorithm == "concurrency":
                raise self.error(
                    algo_node,
                    "algorithm 'concurrency' counts requests in flight and needs to hear when "
                    "each ends, which a rate limit service never does: choose one of "
                    + ", ".join(_ALGORITHMS),
                )
            if algorithm not in _ALGORITHMS:
                raise self.error(
                    algo_node,
                    f"unknown algorithm {algorithm!r}: choose one of {', '.join(_ALGORITHMS)}",
                )
        burst = None
        if "burst" in given:
            burst = self.integer(given["burst"][1], "burst", 1, 2**53)

        first_requests, first_unit, _ = limits[0][0]
        if first_requests == 0:
            for other in ("algorithm", "burst"):
                if other in given:
                    raise self.error(
                        given[other][0],
                        f"requests_per_unit: 0 denies every request: {other} does not apply",
                    )
            policy = None
        else:
            policy_name = _policy_name("", stat_key, domain, [[k, v] for k, v, _ in path])
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
            if not (isinstance(pair[1], ScalarNode) and pair[1].tag == _NULL)
        }
        if "unit" not in entries:
            raise self.error(node, f"missing 'unit' ({_UNIT_NAMES})")
        unit_node = entries["unit"][1]
        written = self.text(unit_node, "unit") or ""
        unit = written.upper()
        if unit not in UNITS:
            raise self.error(unit_node, f"invalid rate limit unit {written!r}: use {_UNIT_NAMES}")
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


def _kind(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    return _show(node)


def _show(node: Node) -> str:
    if isinstance(node, ScalarNode):
        if node.tag == _NULL:
            return "nothing (null)"
        return repr(node.value)
    return _kind(node)
