"""The configuration of ``ratekeeper serve``: envoyproxy/ratelimit's YAML and its extensions.

This module is the model: the rules a file describes, and how a request's descriptors find
theirs. ``_loader`` reads the files into it (with ``_yaml_nodes``, typed access to YAML nodes),
refusing any mistake with a :class:`ConfigFileError` that names ``path:line:column``.
``ServiceConfig.resolve`` is what the server calls on every request: a few dict lookups per
descriptor entry, no parsing and no regular expressions.

The format is envoyproxy/ratelimit's (``domain``; nested ``descriptors`` with ``key``,
``value``, ``rate_limit`` {``unit``, ``requests_per_unit``, ``unlimited``, ``name``,
``replaces``}, ``shadow_mode``, ``quota_mode``, ``share_threshold``, ``detailed_metric``,
``value_to_metric``, ``metadata``) with its lookup rules: at each level the exact value first,
then the wildcard values (``*`` matches any run of characters, anywhere in the value) in file
order, then the key alone; a limit applies only where the request's last entry lands. With
``share_threshold`` on a wildcard descriptor, every value it matches shares one counter (the
store identity holds the pattern, :meth:`LimitRule.identity_for`) and one stats key;
``quota_mode`` marks a rule whose being over its limit refuses a request only when every quota
descriptor of the request is over (the Decider applies it). With ``merge_domains``
(upstream's ``MERGE_DOMAIN_CONFIG``) a domain may be spread over several files, whose top-level
descriptors are merged (a descriptor in two of them is refused, as upstream refuses it).
Extensions, refused with ``portable=True`` so that a
file stays loadable by envoyproxy/ratelimit, go in ``rate_limit``: ``algorithm`` (default
``fixed_window``, as upstream), ``burst``, ``unit_multiplier`` (a window of several units),
``limits`` (several limits on one descriptor, checked all-or-nothing) and ``charge_over_limit``
(hits charged whatever the limit: costs reported once the work is done).

Where this loader is stricter than upstream, on purpose (each is a silent mistake there; the
loader's ``UPSTREAM_LENIENT`` lists them, and each message names what upstream does and the
fix): one of upstream's keys in the wrong place (upstream accepts any of its keys anywhere and
ignores it), a mapping key written twice (upstream keeps the last), ``requests_per_unit`` left
out (upstream reads 0: deny everything; write 0 to mean it), ``unlimited`` with
``requests_per_unit`` (upstream ignores the number), ``replaces`` naming no rule of the domain
(upstream replaces nothing), a ``*`` in a key (upstream matches it as a wildcard over the joined
``key_value`` string), a YAML merge key ``<<`` and a second YAML document (upstream reads the
first only). ``load_config(..., upstream=True)`` reports all of them at once. Matching compares
keys and values as they are; upstream joins them as ``key_value`` strings, so that ``("a_b",
"c")`` can match a rule for ``a: b_c`` there; ``portable=True`` refuses the files in which two
descriptors of a level would collide that way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from hashlib import blake2b
from types import MappingProxyType
from typing import Any, Final

from .._algorithms import ALGORITHMS
from .._algorithms.policy import Policy
from .._model.errors import ConfigError
from .._model.rates import Rate

__all__ = [
    "MAX_NODES",
    "MAX_REQUESTS_PER_UNIT",
    "UNITS",
    "ConfigFileError",
    "DomainConfig",
    "LimitRule",
    "ServiceConfig",
    "identity_of",
    "override_rule",
]

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
UNIT_NAMES = "second, minute, hour, day, week, month or year"

#: The most descriptors and metadata values one file may hold, each use of a YAML alias
#: counted: aliases of aliases would otherwise expand a small file into billions of rules.
MAX_NODES: Final = 100_000

#: ``requests_per_unit`` is a uint32 on the wire (``current_limit``), as in upstream's YAML.
MAX_REQUESTS_PER_UNIT: Final = 2**32 - 1

#: Algorithms a rate limit service can run: ``concurrency`` counts requests in flight and needs
#: to hear that each one ended, which a request/response RPC never says.
SERVICE_ALGORITHMS = tuple(name for name in sorted(ALGORITHMS) if name != "concurrency")
DEFAULT_ALGORITHM: Final = "fixed_window"

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
    #: ``charge_over_limit``: a hit is charged whatever the limit (``AsyncLimiter.charge``), for
    #: costs known once the work is done (Envoy's ``apply_on_stream_done``).
    charge_over_limit: bool = False
    #: Per level of the rule's path: (key, value as written or None, value_to_metric,
    #: share_threshold).
    metric_path: tuple[tuple[str, str | None, bool, bool], ...] = field(default=(), repr=False)
    #: The descriptor's ``metadata`` mapping (upstream's dynamic metadata), if any.
    metadata: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    #: ``quota_mode``: over its limit, this descriptor refuses the request only when every
    #: quota descriptor of the request is over too (upstream's per-descriptor quota mode).
    quota_mode: bool = False
    _values_in_stat_key: bool = field(default=False, init=False, compare=False, repr=False)
    _shared: bool = field(default=False, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # once, not per decision: whether a level's value_to_metric puts request values in the
        # stats key (share_threshold keeps the pattern there), and whether a level shares
        values = any(level[2] and not level[3] for level in self.metric_path)
        object.__setattr__(self, "_values_in_stat_key", values)
        object.__setattr__(self, "_shared", any(level[3] for level in self.metric_path))

    @property
    def share_threshold(self) -> bool:
        """Whether a wildcard level of the rule's path has ``share_threshold``."""
        return self._shared

    def identity_for(self, entries: Sequence[tuple[str, str]]) -> str:
        """The store identity of a request's descriptor that landed on this rule: each value
        a ``share_threshold`` wildcard matched is replaced by the pattern, as upstream builds
        its cache key, so every value the wildcard matches counts on one counter."""
        if not self._shared:
            return identity_of(self.domain, entries)
        return identity_of(
            self.domain,
            [
                (key, written if share and written is not None else value)
                for (key, value), (_, written, _, share) in zip(
                    entries, self.metric_path, strict=False
                )
            ],
        )

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
        """Upstream's stats key for a request's descriptor that landed on this rule (the one
        place it is built): the request's values with ``detailed_metric``, where
        ``value_to_metric`` says so, else :attr:`stat_key`; a ``share_threshold`` level always
        shows its pattern (upstream's priority over both flags)."""
        if self.detailed_metric and not self._shared:
            return self.domain + "".join(f".{key}_{value}" for key, value in entries)
        if not (self._values_in_stat_key or self.detailed_metric):
            return self.stat_key
        parts = [self.domain]
        for (key, value), (_, written, to_metric, share) in zip(
            entries, self.metric_path, strict=False
        ):
            if share:  # share_threshold: the pattern, whatever the other flags say
                shown = written
            elif self.detailed_metric:
                shown = value
            elif written is None:
                shown = value if to_metric else ""
            elif "*" in written:
                shown = value if to_metric else written
            else:
                shown = value
            parts.append(f"{key}_{shown}" if shown else key)
        return ".".join(parts)


class Level:
    """One descriptor of the file: its rule and the lookup tables of the level below it."""

    __slots__ = ("default", "exact", "key", "rule", "spec", "value", "wild")

    def __init__(self, key: str, value: str | None) -> None:
        self.key = key
        self.value = value
        self.rule: LimitRule | None = None
        self.exact: dict[tuple[str, str], Level] = {}
        # key -> the wildcard values of that key, in file order: (parts, fixed length, level)
        self.wild: dict[str, list[tuple[tuple[str, ...], int, Level]]] = {}
        self.default: dict[str, Level] = {}
        self.spec: dict[str, Any] = {}

    def child(self, key: str, value: str) -> Level | None:
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
    """One domain: the file it came from and its descriptor tree (with ``merge_domains``,
    ``merged`` names the other files whose descriptors were merged into it)."""

    name: str
    source: str
    root: Level = field(repr=False)
    rules: int
    has_replaces: bool = field(repr=False)
    merged: tuple[str, ...] = ()

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
                    **({"merged_from": list(config.merged)} if config.merged else {}),
                    "descriptors": [_dump(level) for level in _children(config.root)],
                }
                for config in sorted(self.domains.values(), key=lambda c: c.name)
            ],
        }


def _children(level: Level) -> list[Level]:
    children = [*level.exact.values(), *level.default.values()]
    children += [child for patterns in level.wild.values() for *_, child in patterns]
    return sorted(children, key=lambda child: child.spec["_order"])


def _dump(level: Level) -> dict[str, Any]:
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
                if rule.charge_over_limit:
                    limit["charge_over_limit"] = True
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


def rule_policy_name(kind: str, readable: str, *parts: object) -> str:
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
    shadow mode; a base rule's ``charge_over_limit`` still applies (the same counter, charged
    the same way). Its counter follows upstream's cache key (the domain, the entries and the
    window, so the unit, but not ``requests_per_unit``): with a configured rule ``base`` of
    one limit in the same unit, the override charges that rule's counter; otherwise a counter
    of its own per unit (and per base rule), which any ``requests_per_unit`` shares. It uses
    the base rule's algorithm, else a fixed window. ``unit`` is an upstream unit name (any
    case); a bad unit or a limit the algorithm refuses is a ConfigError.
    """
    unit_name = unit.upper() if isinstance(unit, str) else ""
    if unit_name not in UNITS:
        raise ConfigError(f"limit override unit {unit!r} is invalid: use {UNIT_NAMES}")
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
            name = rule_policy_name("o", base.stat_key, base.policy.name, unit_name)
    else:
        anchor = base.stat_key if base is not None else None
        name = rule_policy_name("o", f"{domain}.override", domain, anchor, unit_name)
        algorithm = DEFAULT_ALGORITHM
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
        charge_over_limit=base is not None and base.charge_over_limit,
    )


@lru_cache(maxsize=1024)
def _override_policy(name: str, algorithm: Any, requests: int, unit: str) -> Policy | None:
    if requests == 0:
        return None
    return Policy(name, Rate(requests, UNITS[unit]), algorithm)
