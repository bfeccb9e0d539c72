"""The configuration loader of ``ratekeeper serve`` (``service._loader`` into ``_config``), alone.

Every refused file is checked for its exact ``path:line:column``; lookups (exact value, then
wildcards in file order, then the key alone; depth), ``replaces``, overrides, directory loading,
portable mode, the stable Policy names and the store identities. No server, no store.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ratekeeper import ConfigError, Policy, Rate
from ratekeeper.service._config import (
    MAX_NODES,
    MAX_REQUESTS_PER_UNIT,
    ConfigFileError,
    LimitRule,
    ServiceConfig,
    identity_of,
    override_rule,
)
from ratekeeper.service._loader import check_config, load_config


def write(directory: Path, text: str, name: str = "config.yaml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def load(directory: Path, text: str, *, portable: bool = False) -> ServiceConfig:
    return load_config(write(directory, text), portable=portable)


def refused(directory: Path, text: str, *, portable: bool = False) -> ConfigFileError:
    path = write(directory, text)
    with pytest.raises(ConfigFileError) as excinfo:
        load_config(path, portable=portable)
    error = excinfo.value
    assert error.path == str(path)
    assert str(error) == f"{path}:{error.line}:{error.column}: {error.reason}"
    return error


def at(error: ConfigFileError) -> tuple[int, int]:
    return error.line, error.column


def rule(config: ServiceConfig, domain: str, *entries: tuple[str, str]) -> LimitRule | None:
    (found,) = config.resolve(domain, [list(entries)])
    return found


def limit_of(found: LimitRule | None) -> int | None:
    """The rule's requests_per_unit, or None for no limit (shorter asserts)."""
    return None if found is None else found.requests_per_unit


# --- errors, each with its location -------------------------------------------------------

MISTAKES = [
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limt:
              unit: second
        """,
        (4, 5),
        "unknown key 'rate_limt' in a descriptor",
        id="unknown-key",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 1
              shadow_mode: true
        """,
        (7, 7),
        "'shadow_mode' belongs in a descriptor, not in rate_limit: envoyproxy/ratelimit "
        "accepts any of its keys anywhere and ignores one out of place",
        id="misplaced-key",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 1
              requests_per_unit: 2
        """,
        (7, 7),
        "duplicate key 'requests_per_unit' in rate_limit (first at {path}:6:7)",
        id="duplicate-mapping-key",
    ),
    pytest.param(
        """
        domain: a
        domain: b
        """,
        (2, 1),
        "duplicate key 'domain' in the top level (first at {path}:1:1)",
        id="duplicate-domain-key",
    ),
    pytest.param("", (1, 1), "the file is empty", id="empty-file"),
    pytest.param(
        """
        descriptors: []
        """,
        (1, 1),
        "missing 'domain'",
        id="missing-domain",
    ),
    pytest.param(
        """
        domain: ""
        """,
        (1, 9),
        "the domain must not be empty",
        id="empty-domain",
    ),
    pytest.param(
        """
        domain: [a]
        """,
        (1, 9),
        "domain must be a string, got a list",
        id="domain-not-a-string",
    ),
    pytest.param(
        """
        - domain: d
        """,
        (1, 1),
        "the top level must be a mapping, got a list",
        id="top-level-not-a-mapping",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          key: k
        """,
        (3, 3),
        "descriptors must be a list, got a mapping",
        id="descriptors-not-a-list",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - k
        """,
        (3, 5),
        "a descriptor must be a mapping, got 'k'",
        id="descriptor-not-a-mapping",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - value: v
        """,
        (3, 5),
        "a descriptor needs a 'key'",
        id="missing-key",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: ""
        """,
        (3, 10),
        "the descriptor key must not be empty",
        id="empty-key",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: path*
        """,
        (3, 10),
        "a key cannot hold '*'",
        id="wildcard-in-key",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            value: v
          - key: j
          - key: k
            value: v
        """,
        (7, 12),
        "duplicate descriptor key 'k' value 'v' at this level (first at {path}:4:12)",
        id="duplicate-key-value",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
          - key: k
            value: ""
        """,
        (5, 12),
        "duplicate descriptor key 'k' at this level (first at {path}:3:10)",
        id="duplicate-key-only (an empty value is the key alone, as upstream)",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: seconds
              requests_per_unit: 1
        """,
        (5, 13),
        "invalid rate limit unit 'seconds': use second, minute, hour, day, week, month or year",
        id="bad-unit",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              requests_per_unit: 1
        """,
        (5, 7),
        "missing 'unit'",
        id="missing-unit",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
        """,
        (5, 7),
        "missing 'requests_per_unit': envoyproxy/ratelimit reads 0 and denies every request; "
        "write requests_per_unit: 0 if that is meant",
        id="missing-requests-per-unit",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: "10"
        """,
        (6, 26),
        "requests_per_unit must be a whole number, got '10'",
        id="requests-per-unit-a-string",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: -1
        """,
        (6, 26),
        "requests_per_unit must be a whole number, got '-1'",
        id="requests-per-unit-negative",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 4294967296
        """,
        (6, 26),
        f"requests_per_unit must be between 0 and {MAX_REQUESTS_PER_UNIT}, got 4294967296",
        id="requests-per-unit-over-uint32",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            shadow_mode: 1
        """,
        (4, 18),
        "shadow_mode must be true or false, got '1'",
        id="flag-not-a-bool",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unlimited: true
              unit: second
        """,
        (6, 7),
        "unlimited: true takes no unit",
        id="unlimited-with-unit",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              requests_per_unit: 5
              unlimited: true
        """,
        (5, 7),
        "unlimited: true takes no requests_per_unit",
        id="unlimited-with-requests-per-unit",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              name: mine
              unit: second
              requests_per_unit: 1
              replaces:
                - name: mine
        """,
        (9, 17),
        "the rule 'mine' replaces itself",
        id="replaces-itself",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 1
              replaces:
                - name: nobody
        """,
        (8, 17),
        "replaces 'nobody', but no rate_limit of domain 'd' is named 'nobody'",
        id="replaces-unknown-name",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 1
              replaces:
                - name: ""
        """,
        (8, 17),
        "a replaces entry needs a non-empty name",
        id="replaces-empty-name",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 1
              replaces: [other]
        """,
        (7, 18),
        "a replaces entry is a mapping, as '- name: other', not a string",
        id="replaces-a-string",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              algorithm: sliding_log
              unit: second
              requests_per_unit: 20000
        """,
        (5, 7),
        "sliding_log keeps one entry per unit of cost, and a limit of 20000 exceeds",
        id="limit-the-algorithm-refuses",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 10
              burst: 20
        """,
        (7, 14),
        "burst applies to the gcra and token_bucket algorithms, not 'fixed_window'",
        id="burst-without-gcra",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              algorithm: concurrency
              unit: second
              requests_per_unit: 10
        """,
        (5, 18),
        "algorithm 'concurrency' counts requests in flight",
        id="concurrency-refused",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              algorithm: leaky
              unit: second
              requests_per_unit: 10
        """,
        (5, 18),
        "unknown algorithm 'leaky': choose one of fixed_window, gcra, sliding_log, "
        "sliding_window, token_bucket",
        id="unknown-algorithm",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: minute
              limits:
                - unit: minute
                  requests_per_unit: 10
        """,
        (5, 7),
        "rate_limit has 'limits': give unit in each item of the list, not beside it",
        id="limits-beside-unit",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              limits:
                - unit: minute
                  requests_per_unit: 10
                - requests_per_unit: 20
                  unit_multiplier: 1
                  unit: MINUTE
        """,
        (6, 9),
        "two rates share the period 60 s",
        id="limits-sharing-a-period",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              limits:
                - unit: minute
                  requests_per_unit: 0
        """,
        (7, 30),
        "requests_per_unit must be between 1 and",
        id="zero-inside-limits",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: minute
              requests_per_unit: 0
              algorithm: gcra
        """,
        (7, 7),
        "requests_per_unit: 0 denies every request: algorithm does not apply",
        id="deny-all-with-algorithm",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            quota_mode: 1
        """,
        (4, 17),
        "quota_mode must be true or false, got '1'",
        id="quota-mode-not-a-flag",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            value: "a"
            share_threshold: true
        """,
        (5, 22),
        "share_threshold: true needs a wildcard value (containing '*')",
        id="share-threshold-without-a-wildcard",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            share_threshold: true
        """,
        (4, 22),
        "share_threshold: true needs a wildcard value",
        id="share-threshold-without-a-value",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            metadata:
              team: a
              team: b
        """,
        (6, 7),
        "duplicate key 'team' (first at {path}:5:7)",
        id="duplicate-key-in-metadata",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - &base
            key: k
          - <<: *base
            value: v
        """,
        (5, 5),
        "YAML merge keys ('<<') are not supported, in a descriptor: envoyproxy/ratelimit's "
        "YAML reader merges the aliased mapping in; write its keys out here",
        id="merge-key",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
             requests_per_unit: 1
        """,
        (6, 6),
        "while parsing a block mapping, ",  # then libyaml's words or PyYAML's
        id="yaml-syntax",
    ),
    pytest.param(
        """
        domain: a
        ---
        domain: b
        """,
        (2, 1),
        "expected a single document in the stream, but found another document: "
        "envoyproxy/ratelimit reads the first document only",
        id="two-documents",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 1
              unit_multiplier: 0
        """,
        (7, 24),
        "unit_multiplier must be between 1 and 1000000, got 0",
        id="unit-multiplier-zero",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 1
              charge_over_limit: yes please
        """,
        (7, 26),
        "charge_over_limit must be true or false, got 'yes please'",
        id="charge-over-limit-not-a-flag",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: 0
              charge_over_limit: true
        """,
        (7, 7),
        "requests_per_unit: 0 denies every request: charge_over_limit does not apply",
        id="charge-over-limit-deny-all",
    ),
    pytest.param(
        """
        domain: d
        descriptors:
          - key: k
            charge_over_limit: true
            rate_limit: {unit: second, requests_per_unit: 1}
        """,
        (4, 5),
        "'charge_over_limit' belongs in rate_limit",
        id="charge-over-limit-misplaced",
    ),
]


@pytest.mark.parametrize(("text", "where", "message"), MISTAKES)
def test_a_mistake_is_refused_with_its_location(
    tmp_path: Path, text: str, where: tuple[int, int], message: str
) -> None:
    error = refused(tmp_path, text)
    assert at(error) == where, str(error)
    assert message.format(path=tmp_path / "config.yaml") in error.reason


def test_the_error_is_a_config_error_and_pickles(tmp_path: Path) -> None:
    error = refused(tmp_path, "domain: ''\n")
    assert isinstance(error, ConfigError)
    assert isinstance(error, ValueError)
    again = pickle.loads(pickle.dumps(error))
    assert (again.path, again.line, again.column, str(again)) == (
        error.path,
        error.line,
        error.column,
        str(error),
    )


def test_the_first_mistake_in_the_file_is_the_one_reported(tmp_path: Path) -> None:
    error = refused(
        tmp_path,
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: fortnight
              requests_per_unit: x
          - key: ""
        """,
    )
    assert at(error) == (5, 13)


def test_a_file_that_is_not_utf8_is_refused_at_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes("domain: d\ndescriptors:\n  - key: ça\n".encode() + b"  - key: caf\xe9\n")
    with pytest.raises(ConfigFileError) as excinfo:
        load_config(path)
    assert at(excinfo.value) == (4, 13)
    path.write_bytes("domain: d\ndescriptors:\n  - key: é".encode() + b"\xe9\n")
    with pytest.raises(ConfigFileError) as excinfo:
        load_config(path)
    assert at(excinfo.value) == (3, 11)  # columns count characters, not bytes
    assert "not valid UTF-8" in str(excinfo.value)


@pytest.mark.parametrize("where", ["descriptors", "metadata"])
def test_aliases_cannot_expand_a_file_without_bound(tmp_path: Path, where: str) -> None:
    """Lists of ten that each reuse the previous list, nine times over, would be 10**9 rules
    (or metadata values): refused once the uses pass MAX_NODES."""
    lines = ["domain: d", "descriptors:"]
    if where == "descriptors":
        lines += ["  - key: a0", "    descriptors: &l0"]
        lines += [f"      - {{key: k{i}}}" for i in range(10)]
        for level in range(1, 9):
            lines += [f"  - key: a{level}", f"    descriptors: &l{level}"]
            lines += [f"      - {{key: k{i}, descriptors: *l{level - 1}}}" for i in range(10)]
    else:
        lines += ["  - key: a", "    metadata:", "      l0: &l0 [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"]
        lines += [f"      l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 10)}]" for n in range(1, 9)]
    path = write(tmp_path, "\n".join(lines) + "\n")
    with pytest.raises(
        ConfigFileError, match=f"more than {MAX_NODES} descriptors and metadata values"
    ):
        load_config(path)


def test_a_recursive_alias_is_refused(tmp_path: Path) -> None:
    error = refused(tmp_path, "domain: d\ndescriptors: &a\n  - key: k\n    descriptors: *a\n")
    assert at(error) == (1, 1)
    assert "an alias contains itself" in error.reason


def test_a_missing_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such configuration file or directory"):
        load_config(tmp_path / "absent.yaml")


# --- directories --------------------------------------------------------------------------


def test_a_directory_loads_every_yaml_file_in_name_order(tmp_path: Path) -> None:
    write(tmp_path, "domain: b\n", "b.yml")
    write(tmp_path, "domain: a\n", "a.yaml")
    write(tmp_path, "not: yaml: at all: [\n", "notes.txt")
    write(tmp_path, "domain: [broken\n", ".hidden.yaml")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub", "domain: c\n", "c.yaml")
    config = load_config(tmp_path)
    assert config.sources == (str(tmp_path / "a.yaml"), str(tmp_path / "b.yml"))
    assert sorted(config.domains) == ["a", "b"]
    assert config.domains["a"].source == str(tmp_path / "a.yaml")


def test_a_kubernetes_configmap_volume_loads_each_file_once(tmp_path: Path) -> None:
    """A ConfigMap volume: the files live in ``..<timestamp>/``, ``..data`` links to it and the
    visible names link through ``..data``; the dot-entries are skipped, the links followed."""
    real = tmp_path / "..2026_12_03_19_00_00.1"
    real.mkdir()
    write(real, "domain: edge\n", "edge.yaml")
    write(real, "domain: api\n", "api.yaml")
    (tmp_path / "..data").symlink_to(real.name)
    for name in ("edge.yaml", "api.yaml"):
        (tmp_path / name).symlink_to(Path("..data") / name)
    config = load_config(tmp_path)
    assert sorted(config.domains) == ["api", "edge"]
    assert config.sources == (str(tmp_path / "api.yaml"), str(tmp_path / "edge.yaml"))


def test_an_empty_directory_has_no_domains(tmp_path: Path) -> None:
    config = load_config(tmp_path)
    assert config.domains == {}
    assert config.resolve("any", [[("k", "v")]]) == [None]


def test_a_domain_in_two_files_is_refused_naming_both(tmp_path: Path) -> None:
    write(tmp_path, "domain: shared\n", "a.yaml")
    second = write(tmp_path, "# the same domain again\ndomain:   shared\n", "b.yaml")
    with pytest.raises(ConfigFileError) as excinfo:
        load_config(tmp_path)
    error = excinfo.value
    assert (error.path, error.line, error.column) == (str(second), 2, 11)
    assert error.reason.startswith(
        f"duplicate domain 'shared': already defined at {tmp_path}/a.yaml:1:9 (as "
        "envoyproxy/ratelimit, unless its MERGE_DOMAIN_CONFIG is set: give "
        "--merge-domain-config"
    )


def test_a_bad_file_in_a_directory_is_named(tmp_path: Path) -> None:
    write(tmp_path, "domain: a\n", "a.yaml")
    bad = write(tmp_path, "domain: b\ndescriptors:\n  - key: k\n    valeu: v\n", "b.yaml")
    with pytest.raises(ConfigFileError) as excinfo:
        load_config(tmp_path)
    assert (excinfo.value.path, excinfo.value.line, excinfo.value.column) == (str(bad), 4, 5)


def test_check_config_summarises_a_valid_configuration(tmp_path: Path) -> None:
    write(
        tmp_path,
        """
        domain: a
        descriptors:
          - key: k
            rate_limit: {unit: second, requests_per_unit: 1}
          - key: j
            rate_limit: {unlimited: true}
        """,
        "a.yaml",
    )
    write(tmp_path, "domain: b\n", "b.yaml")
    assert check_config(tmp_path) == (
        f"{tmp_path}/a.yaml: domain 'a', 2 rules\n"
        f"{tmp_path}/b.yaml: domain 'b', 0 rules\n"
        "OK: 2 files, 2 domains, 2 rules"
    )
    assert check_config(tmp_path, portable=True).endswith(
        "OK (portable: loadable by envoyproxy/ratelimit): 2 files, 2 domains, 2 rules"
    )


# --- portable mode ------------------------------------------------------------------------

EXTENSIONS = [
    pytest.param("algorithm: sliding_window", (7, 7), "algorithm", id="algorithm"),
    pytest.param("algorithm: gcra\n      burst: 20", (8, 7), "burst", id="burst"),
    pytest.param("unit_multiplier: 15", (7, 7), "unit_multiplier", id="unit_multiplier"),
    pytest.param("charge_over_limit: true", (7, 7), "charge_over_limit", id="charge_over_limit"),
]


@pytest.mark.parametrize(("extra", "where", "key"), EXTENSIONS)
def test_portable_mode_refuses_each_extension(
    tmp_path: Path, extra: str, where: tuple[int, int], key: str
) -> None:
    text = textwrap.dedent(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: minute
              requests_per_unit: 10
              {extra}
        """
    ).format(extra=extra)
    assert load(tmp_path, text).domains["d"].rules == 1  # an extension, loaded by default
    error = refused(tmp_path, text, portable=True)
    if key == "burst":  # the algorithm before it is refused first
        key, where = "algorithm", (7, 7)
    assert at(error) == where
    assert error.reason == (
        f"'{key}' is a ratekeeper extension, refused in portable mode "
        "(envoyproxy/ratelimit does not know it)"
    )


def test_portable_mode_refuses_several_limits(tmp_path: Path) -> None:
    text = """
    domain: d
    descriptors:
      - key: k
        rate_limit:
          limits:
            - {unit: second, requests_per_unit: 10}
            - {unit: hour, requests_per_unit: 1000}
    """
    assert load(tmp_path, text).domains["d"].rules == 1
    error = refused(tmp_path, text, portable=True)
    assert at(error) == (5, 7)
    assert "'limits' is a ratekeeper extension" in error.reason


def test_portable_mode_refuses_what_upstream_would_join_into_one_key(tmp_path: Path) -> None:
    """Upstream keys each level by ``key_value``: ``a: b_c`` and ``a_b: c`` are one entry there."""
    text = """
    domain: d
    descriptors:
      - key: a
        value: b_c
      - key: a_b
        value: c
    """
    config = load(tmp_path, text)
    assert len(config.domains["d"].root.exact) == 2
    error = refused(tmp_path, text, portable=True)
    assert at(error) == (6, 12)
    assert "joins key and value as 'a_b_c'" in error.reason
    assert f"{tmp_path}/config.yaml:4:12" in error.reason


def test_portable_mode_loads_upstream_files(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
        domain: d
        descriptors:
          - key: k
            value: v*
            shadow_mode: true
            detailed_metric: false
            value_to_metric: true
            quota_mode: false
            share_threshold: false
            metadata: {team: edge, tier: [1, 2]}
            rate_limit:
              name: n
              unit: Second
              requests_per_unit: 3
          - key: u
            rate_limit:
              unlimited: true
              replaces: [{name: n}]
        """,
        portable=True,
    )
    found = rule(config, "d", ("k", "vv"))
    assert found is not None
    assert (found.unit, found.requests_per_unit, found.shadow_mode) == ("SECOND", 3, True)
    assert found.metadata == {"team": "edge", "tier": [1, 2]}


# --- values as upstream reads them ----------------------------------------------------------


def test_scalars_are_read_as_written_and_units_in_any_case(tmp_path: Path) -> None:
    """Upstream decodes ``value: 200`` as the string "200" (yaml.v2 into a string field), and
    units by their enum name in any case; YAML 1.1 booleans are booleans."""
    config = load(
        tmp_path,
        """
        domain: 1.50
        descriptors:
          - key: status
            value: 200
            shadow_mode: yes
            rate_limit: {unit: MiNuTe, requests_per_unit: 7}
          - key: flag
            value: true
            rate_limit: {unit: week, requests_per_unit: 8}
          - key: empty
            value:
            rate_limit: {unit: month, requests_per_unit: 9}
          - key: year
            rate_limit: {unit: YEAR, requests_per_unit: 10}
        """,
    )
    found = rule(config, "1.50", ("status", "200"))
    assert found is not None
    assert (found.unit, found.requests_per_unit, found.shadow_mode) == ("MINUTE", 7, True)
    assert found.policy is not None
    assert found.policy.rates == (Rate(7, 60),)
    assert limit_of(rule(config, "1.50", ("flag", "true"))) == 8
    assert limit_of(rule(config, "1.50", ("empty", "anything"))) == 9  # null: the key alone
    periods = {
        r.unit: r.policy.rates[0].period
        for r in (rule(config, "1.50", (k, v)) for k, v in [("flag", "true"), ("empty", "x")])
        if r is not None and r.policy is not None
    }
    assert periods == {"WEEK": 7 * 86400, "MONTH": 30 * 86400}
    year = rule(config, "1.50", ("year", "x"))
    assert year is not None
    assert year.policy is not None
    assert year.policy.rates[0].period == 365 * 86400


def test_null_blocks_are_absent(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
        domain: d
        descriptors:
          - key: k
            rate_limit:
            descriptors:
        """,
    )
    assert rule(config, "d", ("k", "v")) is None


# --- lookup -------------------------------------------------------------------------------

LOOKUP = """
domain: d
descriptors:
  - key: path
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: path
    value: /api/*/users/*
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: path
    value: /api/*
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: path
    value: /api/v1/users/me
    rate_limit: {unit: second, requests_per_unit: 4}
  - key: path
    value: "*.png"
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: path
    value: a*a
    rate_limit: {unit: second, requests_per_unit: 6}
  - key: other
    value: "*"
    rate_limit: {unit: second, requests_per_unit: 7}
"""


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (("path", "/api/v1/users/me"), 4),  # the exact value first, before any wildcard
        (("path", "/api/v1/users/42"), 2),  # then wildcards in file order: the first that matches
        (("path", "/api/v1/users/"), 2),  # a * matches an empty run
        (("path", "/api/v1/orders"), 3),
        (("path", "/api/"), 3),
        (("path", "/img/logo.png"), 5),  # a leading *
        (("path", "aa"), 6),
        (("path", "a"), 1),  # "a*a" needs two a's: the key alone
        (("path", "abba"), 6),
        (("path", "/static/app.js"), 1),  # no value matches: the key alone
        (("path", ""), 1),
        (("other", ""), 7),  # "*" matches the empty value
        (("other", "x"), 7),
        (("unknown", "x"), None),
        (("Path", "/api/"), None),  # keys and values are case-sensitive
    ],
)
def test_exact_then_wildcards_in_file_order_then_the_key(
    tmp_path: Path, entry: tuple[str, str], expected: int | None
) -> None:
    assert limit_of(rule(load(tmp_path, LOOKUP), "d", entry)) == expected


DEPTH = """
domain: d
descriptors:
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 1}
    descriptors:
      - key: b
        rate_limit: {unit: minute, requests_per_unit: 2}
        descriptors:
          - key: c
            value: "3"
            rate_limit: {unit: minute, requests_per_unit: 3}
  - key: a
    value: leaf
    rate_limit: {unit: minute, requests_per_unit: 4}
  - key: a
    value: x*
    descriptors:
      - key: b
        rate_limit: {unit: minute, requests_per_unit: 5}
"""


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ([("a", "1")], 1),
        ([("a", "1"), ("b", "2")], 2),
        ([("a", "1"), ("b", "2"), ("c", "3")], 3),
        ([("a", "1"), ("b", "2"), ("c", "4")], None),  # no c=4 and no key-only c
        ([("a", "1"), ("b", "2"), ("c", "3"), ("d", "4")], None),  # deeper than the file
        ([("a", "1"), ("c", "3")], None),  # levels do not skip
        ([("b", "2")], None),  # b is only nested
        ([("a", "leaf")], 4),
        # The exact value wins and has nothing below it: no fallback to the key alone.
        ([("a", "leaf"), ("b", "2")], None),
        ([("a", "xy")], None),  # the wildcard level has no rate_limit of its own
        ([("a", "xy"), ("b", "2")], 5),
        ([], None),
    ],
)
def test_a_limit_applies_only_where_the_last_entry_lands(
    tmp_path: Path, entries: list[tuple[str, str]], expected: int | None
) -> None:
    assert limit_of(rule(load(tmp_path, DEPTH), "d", *entries)) == expected


def test_unknown_domain_has_no_limits(tmp_path: Path) -> None:
    config = load(tmp_path, DEPTH)
    assert config.resolve("D", [[("a", "1")], [("a", "leaf")]]) == [None, None]


REPLACES = """
domain: d
descriptors:
  - key: a
    rate_limit: {name: general, unit: second, requests_per_unit: 1}
  - key: b
    rate_limit:
      name: special
      unit: second
      requests_per_unit: 2
      replaces: [{name: general}]
  - key: u
    rate_limit:
      name: general
      unlimited: true
  - key: c
    rate_limit:
      unlimited: true
      replaces: [{name: special}]
  - key: e
    rate_limit: {name: general, unit: second, requests_per_unit: 3}
"""


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (["a"], [1]),
        (["b"], [2]),
        (["a", "b"], [None, 2]),  # b replaces every rule named general in the request
        (["b", "a", "e"], [2, None, None]),
        (["a", "u", "b"], [None, "unlimited", 2]),  # an unlimited rule is never replaced
        (["b", "c"], [None, "unlimited"]),  # an unlimited rule replaces like any other
        (["a", "c"], [1, "unlimited"]),
    ],
)
def test_replaces_drops_the_named_rules_of_the_request(
    tmp_path: Path, keys: list[str], expected: list[object]
) -> None:
    config = load(tmp_path, REPLACES)
    got = config.resolve("d", [[(key, "v")] for key in keys])
    assert [
        None if r is None else "unlimited" if r.unlimited else r.requests_per_unit for r in got
    ] == expected


def test_unlimited_and_deny_all_rules(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
        domain: d
        descriptors:
          - key: ip
            rate_limit: {unit: second, requests_per_unit: 10}
          - key: ip
            value: 50.0.0.5
            rate_limit: {unit: second, requests_per_unit: 0}
          - key: internal
            rate_limit: {unlimited: true, name: free}
        """,
    )
    blocked = rule(config, "d", ("ip", "50.0.0.5"))
    assert blocked is not None
    assert (blocked.denies_all, blocked.unlimited, blocked.policy) == (True, False, None)
    assert (blocked.unit, blocked.window) == ("SECOND", 1)
    free = rule(config, "d", ("internal", "x"))
    assert free is not None
    assert (free.unlimited, free.policy, free.denies_all, free.name) == (True, None, False, "free")
    plain = rule(config, "d", ("ip", "50.0.0.1"))
    assert plain is not None
    assert plain.policy is not None
    assert not plain.denies_all


# --- extensions -------------------------------------------------------------------------


def test_extensions_build_the_policy(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
        domain: d
        descriptors:
          - key: user
            rate_limit:
              algorithm: sliding_window
              limits:
                - {unit: second, requests_per_unit: 10}
                - {unit: minute, unit_multiplier: 15, requests_per_unit: 1000}
          - key: burst
            rate_limit:
              algorithm: token_bucket
              unit: second
              requests_per_unit: 5
              burst: 50
          - key: log
            rate_limit:
              algorithm: sliding_log
              unit: hour
              unit_multiplier: 2
              requests_per_unit: 100
          - key: plain
            rate_limit: {unit: second, requests_per_unit: 3}
          - key: streamed
            rate_limit: {unit: minute, requests_per_unit: 100, charge_over_limit: true}
        """,
    )
    user = rule(config, "d", ("user", "ann"))
    assert user is not None
    assert user.policy is not None
    assert user.policy.algorithm == "sliding_window"
    assert user.policy.rates == (Rate(10, 1), Rate(1000, 900))
    assert (user.unit, user.requests_per_unit) == ("SECOND", 10)  # the first limit as written
    assert user.current_limit(Rate(1000, 900)) == (1000, "MINUTE")
    assert user.current_limit(Rate(10, 1)) == (10, "SECOND")
    assert user.current_limit() == (10, "SECOND")
    burst = rule(config, "d", ("burst", "x"))
    assert burst is not None
    assert burst.policy is not None
    assert (burst.policy.algorithm, burst.policy.burst) == ("token_bucket", 50)
    log = rule(config, "d", ("log", "x"))
    assert log is not None
    assert log.policy is not None
    assert (log.policy.algorithm, log.policy.rates, log.window) == (
        "sliding_log",
        (Rate(100, 7200),),
        7200,
    )
    plain = rule(config, "d", ("plain", "x"))
    assert plain is not None
    assert plain.policy is not None
    assert plain.policy.algorithm == "fixed_window"  # upstream's algorithm by default
    assert not plain.charge_over_limit
    streamed = rule(config, "d", ("streamed", "x"))
    assert streamed is not None
    assert streamed.charge_over_limit
    # an override of its limit is charged the same way, on the same counter
    (overridden,) = config.resolve("d", [[("streamed", "x")]], overrides=[(7, "MINUTE")])
    assert overridden is not None
    assert overridden.charge_over_limit
    shown = config.to_dict()["domains"][0]["descriptors"]
    assert [d["rate_limit"].get("charge_over_limit") for d in shown] == [
        None, None, None, None, True
    ]  # fmt: skip


# --- policy names and identities ---------------------------------------------------------


def test_policy_names_are_stable_per_rule_and_distinct_between_rules(tmp_path: Path) -> None:
    text = """
    domain: d
    descriptors:
      - key: a
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: a
        value: v
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: a
        value: v*
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: b
        descriptors:
          - key: a
            rate_limit: {unit: second, requests_per_unit: 1}
    """
    first_dir, second_dir = tmp_path / "one", tmp_path / "two"
    first_dir.mkdir()
    second_dir.mkdir()
    first, second = load(first_dir, text), load(second_dir, text.replace("1}", "9}"))
    probes = [[("a", "x")], [("a", "v")], [("a", "vv")], [("b", "x"), ("a", "x")]]
    names = [r.policy.name for r in first.resolve("d", probes) if r and r.policy]
    again = [r.policy.name for r in second.resolve("d", probes) if r and r.policy]
    assert len(names) == 4
    assert len(set(names)) == 4  # different rules, different counters
    assert names == again  # a reload with new limits keeps every counter
    other = load(tmp_path, text.replace("domain: d", "domain: e"))
    assert not set(names) & {r.policy.name for r in other.resolve("e", probes) if r and r.policy}


def test_policy_names_fit_policys_rules_for_any_key(tmp_path: Path) -> None:
    key = "k" * 300
    config = load(
        tmp_path,
        f"""
        domain: "dömain with spaces {{}}"
        descriptors:
          - key: "{key}"
            value: "~!@#$%^&()"
            rate_limit: {{unit: second, requests_per_unit: 1}}
          - key: "{key}"
            value: "~!@#$%^&()x"
            rate_limit: {{unit: second, requests_per_unit: 1}}
        """,
    )
    names = [
        r.policy.name
        for r in config.resolve(
            "dömain with spaces {}", [[(key, "~!@#$%^&()")], [(key, "~!@#$%^&()x")]]
        )
        if r and r.policy
    ]
    assert len(set(names)) == 2
    for name in names:
        assert len(name) <= 128
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:/-]*", name)
        Policy(name, "1/second")  # accepted by Policy itself


def test_stat_keys_follow_upstream(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
        domain: d
        descriptors:
          - key: route
            value_to_metric: true
            descriptors:
              - key: action
                value: read*
                descriptors:
                  - key: user
                    rate_limit: {unit: minute, requests_per_unit: 1}
          - key: key1
            detailed_metric: true
            rate_limit: {unit: minute, requests_per_unit: 10}
          - key: key1
            value: value1
            rate_limit: {unit: minute, requests_per_unit: 20}
        """,
    )
    entries = [("route", "api"), ("action", "readfile"), ("user", "ann")]
    nested = rule(config, "d", *entries)
    assert nested is not None
    assert nested.stat_key == "d.route.action_read*.user"
    assert nested.stat_key_for(entries) == "d.route_api.action_read*.user"
    detailed = rule(config, "d", ("key1", "other"))
    assert detailed is not None
    assert detailed.stat_key == "d.key1"
    assert detailed.stat_key_for([("key1", "other")]) == "d.key1_other"
    exact = rule(config, "d", ("key1", "value1"))
    assert exact is not None
    assert exact.stat_key_for([("key1", "value1")]) == exact.stat_key == "d.key1_value1"


def test_identity_of_tells_apart_descriptors_that_join_alike() -> None:
    pairs = [
        ("d", [("a", "b"), ("c", "d")]),
        ("d", [("a", "b.c"), ("d", "")]),
        ("d", [("a_b", "c"), ("d", "")]),
        ("d", [("a", "b_c_d")]),
        ("d", [("a", 'b"],["c'), ("d", "")]),
        ("d.a", [("b", "c"), ("d", "")]),
        ("d", [("a", "b"), ("c", "d"), ("", "")]),
        ("d", [("1:a", "")]),
        ("d", [("1", "a")]),
        ("d", [("a", "1:b")]),
        ("d", [("a", ""), ("b", "")]),
        ("d", []),
        ("", [("d", "")]),
    ]
    identities = [identity_of(domain, entries) for domain, entries in pairs]
    assert len(set(identities)) == len(pairs)


_text = st.text(max_size=6)


@given(
    st.tuples(_text, st.lists(st.tuples(_text, _text), max_size=3)),
    st.tuples(_text, st.lists(st.tuples(_text, _text), max_size=3)),
)
def test_identity_of_is_injective(
    one: tuple[str, list[tuple[str, str]]], two: tuple[str, list[tuple[str, str]]]
) -> None:
    assert (identity_of(*one) == identity_of(*two)) == (one == two)


# --- overrides ------------------------------------------------------------------------------


def test_an_override_replaces_the_configured_limit_on_the_same_counter(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
        domain: d
        descriptors:
          - key: user
            shadow_mode: true
            rate_limit:
              name: general
              algorithm: sliding_window
              unit: second
              requests_per_unit: 10
          - key: admin
            rate_limit:
              unit: second
              requests_per_unit: 99
              replaces: [{name: general}]
        """,
    )
    entries = [("user", "ann")]
    base = rule(config, "d", *entries)
    assert base is not None
    assert base.policy is not None
    over = override_rule("d", entries, 42, "second", base)
    assert over.policy is not None
    # Upstream's counter is the domain, the entries and the window: in the same unit, the
    # override counts on the configured rule's counter, whatever its requests_per_unit.
    assert over.policy.name == base.policy.name
    assert over.policy.algorithm == "sliding_window"
    assert over.policy.rates == (Rate(42, 1),)
    assert (over.name, over.shadow_mode, over.replaces, over.unit) == (None, False, (), "SECOND")
    assert over.stat_key == "d.user_ann"
    per_minute = override_rule("d", entries, 42, "minute", base)
    assert per_minute.policy is not None
    assert per_minute.policy.rates == (Rate(42, 60),)
    assert per_minute.policy.name != base.policy.name  # another window: another counter
    again = override_rule("d", [("user", "bob")], 7, "MINUTE", base)
    assert again.policy is not None
    assert again.policy.name == per_minute.policy.name  # the identity tells users apart
    # Through resolve: the override neither is replaced nor keeps its base's replaces.
    got = config.resolve(
        "d",
        [entries, [("admin", "x")], [("admin", "y")]],
        overrides=[(42, "MINUTE"), None, (5, "SECOND")],
    )
    assert [r.requests_per_unit if r else None for r in got] == [42, 99, 5]
    got = config.resolve("d", [[("admin", "x")], entries], overrides=[(5, "SECOND"), None])
    assert [r.requests_per_unit if r else None for r in got] == [5, 10]
    # An unknown domain stays without limits, override or not (as upstream).
    assert config.resolve("nope", [entries], overrides=[(1, "SECOND")]) == [None]


def test_an_override_without_a_configured_rule(tmp_path: Path) -> None:
    config = load(tmp_path, "domain: d\n")
    (got,) = config.resolve("d", [[("k", "v")]], overrides=[(3, "HOUR")])
    assert got is not None
    assert got.policy is not None
    assert (got.policy.algorithm, got.policy.rates) == ("fixed_window", (Rate(3, 3600),))
    names = {
        (domain, requests, unit): override_rule(domain, [("k", "w")], requests, unit, None).policy
        for domain, requests, unit in [("d", 7, "HOUR"), ("d", 7, "DAY"), ("e", 3, "HOUR")]
    }
    assert got.policy.name == names["d", 7, "HOUR"].name  # type: ignore[union-attr]
    assert got.policy.name != names["d", 7, "DAY"].name  # type: ignore[union-attr]
    assert got.policy.name != names["e", 3, "HOUR"].name  # type: ignore[union-attr]
    zero = override_rule("d", [("k", "v")], 0, "second", None)
    assert (zero.denies_all, zero.policy) == (True, None)


@pytest.mark.parametrize(
    ("requests", "unit", "message"),
    [
        (1, "UNKNOWN", "unit 'UNKNOWN' is invalid"),
        (1, "fortnight", "unit 'fortnight' is invalid"),
        (-1, "SECOND", "must be 0 to 4294967295"),
        (2**32, "SECOND", "must be 0 to 4294967295"),
    ],
)
def test_a_bad_override_is_a_config_error(requests: int, unit: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        override_rule("d", [("k", "v")], requests, unit, None)


def test_an_override_the_algorithm_refuses_is_a_config_error(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """
        domain: d
        descriptors:
          - key: k
            rate_limit: {algorithm: sliding_log, unit: second, requests_per_unit: 10}
        """,
    )
    with pytest.raises(ConfigError, match="sliding_log keeps one entry per unit"):
        config.resolve("d", [[("k", "v")]], overrides=[(50_000, "SECOND")])


# --- what GET /rlconfig shows ---------------------------------------------------------------


def test_to_dict_is_json_and_shows_every_rule(tmp_path: Path) -> None:
    config = load(tmp_path, REPLACES)
    shown = json.loads(json.dumps(config.to_dict()))
    assert shown["sources"] == [str(tmp_path / "config.yaml")]
    (domain,) = shown["domains"]
    assert domain["domain"] == "d"
    assert [d["key"] for d in domain["descriptors"]] == ["a", "b", "u", "c", "e"]  # file order
    b = domain["descriptors"][1]["rate_limit"]
    assert b["name"] == "special"
    assert b["replaces"] == ["general"]
    assert b["unit"] == "SECOND"
    assert b["requests_per_unit"] == 2
    assert b["algorithm"] == "fixed_window"
    assert b["policy"].startswith("rls:d.b:")
    assert domain["descriptors"][2]["rate_limit"]["unlimited"] is True


def test_the_loader_reads_nothing_but_the_files(tmp_path: Path) -> None:
    """Loading is pure apart from reading: the same files give equal rules."""
    path = write(tmp_path, DEPTH)
    first, second = load_config(path), load_config(os.fspath(path))
    probe = [[("a", "1"), ("b", "2")]]
    assert first.resolve("d", probe) == second.resolve("d", probe)
