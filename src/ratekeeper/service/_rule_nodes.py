"""The ``rate_limit`` of a descriptor in ``ratekeeper serve``'s YAML: its limit or limits,
``unlimited``, ``name`` and ``replaces``, and ratekeeper's extensions (``algorithm``, ``burst``,
``unit_multiplier``, ``limits``, ``charge_over_limit``), read into a :class:`LimitRule`. The
file loader of ``_loader`` is a :class:`RuleNodes`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from yaml.nodes import Node, ScalarNode

from .._algorithms.policy import Policy
from .._model.errors import ConfigError
from .._model.options import Algorithm
from .._model.rates import Rate
from ._config import (
    DEFAULT_ALGORITHM,
    MAX_REQUESTS_PER_UNIT,
    SERVICE_ALGORITHMS,
    UNIT_NAMES,
    UNITS,
    Level,
    LimitRule,
    rule_policy_name,
)
from ._yaml_nodes import NULL, Nodes

__all__ = ["RATE_LIMIT_EXTENSIONS", "RATE_LIMIT_KEYS", "Domain", "RuleNodes"]

RATE_LIMIT_KEYS = frozenset({"unit", "requests_per_unit", "unlimited", "name", "replaces"})
RATE_LIMIT_EXTENSIONS = frozenset(
    {"algorithm", "burst", "unit_multiplier", "limits", "charge_over_limit"}
)
_LIMIT_ITEM_KEYS = frozenset({"unit", "requests_per_unit", "unit_multiplier"})
_REPLACES_KEYS = frozenset({"name"})


class Domain:
    """A domain being loaded: its tree, where it was first defined, and what its files add."""

    def __init__(self, name: str, source: str, where: str) -> None:
        self.name = name
        self.source = source
        self.where = where
        self.root = Level("", None)
        self.merged: list[str] = []
        self.rules = 0
        self.names: set[str] = set()
        #: (the name a replaces entry gives, its node, the loader of its file)
        self.replaced: list[tuple[str, Node, RuleNodes]] = []


class RuleNodes(Nodes):
    """Reads a descriptor's ``rate_limit`` node into a rule of the domain being loaded."""

    #: The domain the file defines (or adds to), once its ``domain`` is read.
    current: Domain

    def rule(
        self,
        node: Node,
        domain: str,
        path: tuple[tuple[str, str | None, bool, bool], ...],
        *,
        shadow_mode: bool,
        detailed_metric: bool,
        quota_mode: bool,
        metadata: Mapping[str, Any] | None,
    ) -> LimitRule:
        entries = self.mapping(node, "rate_limit", RATE_LIMIT_KEYS, RATE_LIMIT_EXTENSIONS)
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
            self.current.names.add(name)
        self.current.rules += 1
        stat_key = ".".join([domain, *(f"{k}_{v}" if v is not None else k for k, v, *_ in path)])
        common: dict[str, Any] = {
            "name": name,
            "shadow_mode": shadow_mode,
            "detailed_metric": detailed_metric,
            "replaces": replaces,
            "stat_key": stat_key,
            "domain": domain,
            "metric_path": path,
            "metadata": metadata,
            "quota_mode": quota_mode,
        }
        if unlimited:
            self.unlimited_alone(given)
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
            policy_name = rule_policy_name("", stat_key, domain, [[k, v] for k, v, *_ in path])
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

    def unlimited_alone(self, given: dict[str, tuple[Node, Node]]) -> None:
        """Refuse what ``unlimited: true`` takes no part of."""
        for other in ("unit", "requests_per_unit", *sorted(RATE_LIMIT_EXTENSIONS)):
            if other == "requests_per_unit" and other in given:
                self.lenient(
                    given[other][0],
                    "unlimited: true takes no requests_per_unit: envoyproxy/ratelimit ignores "
                    "the number (the descriptor is unlimited); remove one of them",
                )
            elif other in given:
                raise self.error(
                    given[other][0], f"unlimited: true takes no {other} (remove one of them)"
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
            self.current.replaced.append((target, target_node, self))
        return tuple(replaces)

    def limit(
        self, node: Node, rule_node: Node, *, in_list: bool
    ) -> tuple[tuple[int, str, int], Node]:
        """One limit: (requests_per_unit, UNIT, unit_multiplier) and its node."""
        if in_list:
            entries = self.mapping(node, "an item of limits", _LIMIT_ITEM_KEYS)
        else:
            entries = self.mapping(node, "rate_limit", RATE_LIMIT_KEYS, RATE_LIMIT_EXTENSIONS)
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
        low = 1 if in_list else 0
        if "requests_per_unit" not in entries:
            if in_list:
                raise self.error(node, "missing 'requests_per_unit'")
            self.lenient(
                node,
                "missing 'requests_per_unit': envoyproxy/ratelimit reads 0 and denies every "
                "request; write requests_per_unit: 0 if that is meant, else the limit",
            )
            requests = 0
        else:
            requests = self.integer(
                entries["requests_per_unit"][1], "requests_per_unit", low, MAX_REQUESTS_PER_UNIT
            )
        multiplier = 1
        if "unit_multiplier" in entries:
            multiplier = self.integer(
                entries["unit_multiplier"][1], "unit_multiplier", 1, 1_000_000
            )
        return (requests, unit, multiplier), node
