"""envoyproxy/ratelimit's own configuration files, and what its tests expect of them, as this
project's cases: every file upstream loads loads here with upstream's meaning (``quota_mode``,
``share_threshold``, ``MERGE_DOMAIN_CONFIG``, ``detailed_metric``, ``value_to_metric``,
``metadata``), what it refuses is refused, and what it loads leniently is refused with what
upstream does and the fix, all at once with ``--check --upstream``.

The configurations are restated from upstream's files (named in a comment above each), in our
own layout: the same keys, values and limits, which is what the cases depend on. Decisions go
through a real store (the shared Redis/Valkey) and, for the answers, through the service's gRPC.
"""

from __future__ import annotations

import asyncio
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner
from google.protobuf.json_format import MessageToDict

from ratekeeper import Limiter
from ratekeeper.cli import main
from ratekeeper.service._config import ConfigFileError, ServiceConfig
from ratekeeper.service._loader import UpstreamLenient, check_config, load_config

from ..support.servers import RedisServer
from ..support.service_support import OURS, running

Entries = list[tuple[str, str]]
Call = Callable[[Any], Awaitable[Any]]

# upstream: examples/ratelimit/config/example.yaml (its docker-compose example), restated
EXAMPLE = """
domain: rl
descriptors:
  - key: category
    value: account
    rate_limit: {replaces: [{name: bkthomps}, {name: fake_name}], unit: minute,
                 requests_per_unit: 4}
  - key: source_cluster
    value: proxy
    descriptors:
      - {key: destination_cluster, value: bkthomps,
         rate_limit: {replaces: [{name: bkthomps}], unit: minute, requests_per_unit: 2}}
      - {key: destination_cluster, value: mock, rate_limit: {unit: minute, requests_per_unit: 1}}
      - {key: destination_cluster, value: override,
         rate_limit: {replaces: [{name: banned_limit}], unit: minute, requests_per_unit: 2}}
      - {key: destination_cluster, value: fake,
         rate_limit: {name: fake_name, unit: minute, requests_per_unit: 2}}
  - key: foo
    rate_limit: {unit: minute, requests_per_unit: 2}
    descriptors:
      - {key: bar, rate_limit: {unit: minute, requests_per_unit: 3}}
      - {key: bar, value: bkthomps,
         rate_limit: {name: bkthomps, unit: minute, requests_per_unit: 1}}
      - {key: bar, value: banned,
         rate_limit: {name: banned_limit, unit: minute, requests_per_unit: 0}}
      - {key: baz, rate_limit: {unit: second, requests_per_unit: 1}}
      - {key: baz, value: not-so-shady, rate_limit: {unit: minute, requests_per_unit: 3}}
      - {key: baz, value: shady, rate_limit: {unit: minute, requests_per_unit: 3},
         shadow_mode: true}
      - {key: bay, rate_limit: {unlimited: true}}
  - {key: unspec, detailed_metric: true, rate_limit: {unit: minute, requests_per_unit: 2}}
  - {key: qux, rate_limit: {unlimited: true}}
  - key: service
    value: service_1
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata: {service_with_quota: {name: "service_1"}}
  - key: service
    value: service_2
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
    metadata: {service_with_quota: {name: "service_2"}}
"""

# upstream: test/integration/runtime/current/ratelimit/config/share_threshold.yaml, restated
SHARE_THRESHOLD = """
domain: share-threshold-test
descriptors:
  - {key: files, value: files/*, share_threshold: true,
     rate_limit: {unit: hour, requests_per_unit: 10}}
  - {key: files_no_share, value: files_no_share/*,
     rate_limit: {unit: hour, requests_per_unit: 10}}
"""

# upstream: test/integration/runtime/current/ratelimit/config/basic.yaml and another.yaml
BASIC = """
domain: basic
descriptors:
  - {key: key1, rate_limit: {unit: second, requests_per_unit: 50}}
  - {key: key1_local, rate_limit: {unit: second, requests_per_unit: 50}}
  - {key: one_per_minute, rate_limit: {unit: minute, requests_per_unit: 1}}
"""
ANOTHER = """
domain: another
descriptors:
  - {key: key2, rate_limit: {unit: minute, requests_per_unit: 20}}
  - {key: key3, rate_limit: {unit: hour, requests_per_unit: 10}}
  - {key: key2_local, rate_limit: {unit: minute, requests_per_unit: 20}}
  - {key: key3_local, rate_limit: {unit: hour, requests_per_unit: 10}}
  - {key: key4, rate_limit: {unit: day, requests_per_unit: 20}}
  - {key: key4_local, rate_limit: {unit: day, requests_per_unit: 20}}
"""

# upstream: test/config/merge_domain_key1.yaml and merge_domain_key2.yaml
MERGE_1 = """
domain: test-domain
descriptors:
  - {key: key1, value: value1, rate_limit: {unit: minute, requests_per_unit: 10}}
"""
MERGE_2 = """
domain: test-domain
descriptors:
  - {key: key2, value: value2, rate_limit: {unit: minute, requests_per_unit: 20}}
"""

# upstream: test/config/share_threshold.yaml (the cases of TestShareThreshold), restated
SHARE_CASES = """
domain: test-domain
descriptors:
  - {key: files, value: files/*, share_threshold: true,
     rate_limit: {unit: minute, requests_per_unit: 100}}
  - key: nested
    value: parent
    descriptors:
      - {key: files, value: nested/*, share_threshold: true,
         rate_limit: {unit: minute, requests_per_unit: 200}}
  - key: files
    value: top/*
    share_threshold: true
    descriptors:
      - {key: files, value: nested/*, share_threshold: true,
         rate_limit: {unit: minute, requests_per_unit: 300}}
  - key: route
    value: api/*
    share_threshold: true
    value_to_metric: true
    descriptors:
      - {key: method, rate_limit: {unit: minute, requests_per_unit: 60}}
  - key: service
    value: svc/*
    share_threshold: true
    descriptors:
      - {key: endpoint, detailed_metric: true, rate_limit: {unit: minute, requests_per_unit: 80}}
  - key: path
    value: path/*
    share_threshold: true
    descriptors:
      - key: file
        value: file/*
        share_threshold: false
        descriptors:
          - {key: type, rate_limit: {unit: minute, requests_per_unit: 120}}
  - key: user
    value: user/*
    share_threshold: true
    descriptors:
      - key: resource
        value: res/*
        share_threshold: true
        descriptors:
          - {key: action, rate_limit: {unit: minute, requests_per_unit: 150}}
  - {key: file, value: test1, rate_limit: {unit: minute, requests_per_unit: 50}}
  - {key: file, value: test*, share_threshold: true,
     rate_limit: {unit: minute, requests_per_unit: 100}}
  - {key: midpath, value: /api*v1, share_threshold: true,
     rate_limit: {unit: minute, requests_per_unit: 100}}
  - {key: multiroute, value: svc*ep*rpc, share_threshold: true,
     rate_limit: {unit: minute, requests_per_unit: 50}}
  - {key: midroute, value: /api*v2, share_threshold: true, value_to_metric: true,
     rate_limit: {unit: minute, requests_per_unit: 80}}
  - key: tenant
    value: t*prod
    share_threshold: true
    descriptors:
      - {key: resource, value: res*v2, share_threshold: true,
         rate_limit: {unit: minute, requests_per_unit: 60}}
"""


def write(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["serve", *args], env=env)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def redis_url(servers: dict[str, RedisServer]) -> str:
    return next(iter(servers.values())).url


@pytest.fixture
def limiter(redis_url: str) -> Any:
    prefix = f"upstream{time.monotonic_ns()}"
    with Limiter.from_url(redis_url, key_prefix=prefix, timeout=2.0, failure_mode="raise") as made:
        yield made


# --- upstream's files load, as written ---------------------------------------------------


def test_the_example_of_upstreams_docker_compose_checks(tmp_path: Path) -> None:
    examples = tmp_path / "examples"
    write(examples, "example.yaml", EXAMPLE)
    # upstream: examples/ratelimit/config/config.yaml, beside it
    write(
        examples,
        "config.yaml",
        "domain: mongo_cps\ndescriptors:\n"
        "  - {key: database, value: users, rate_limit: {unit: second, requests_per_unit: 500}}\n"
        "  - {key: database, value: default, rate_limit: {unit: second, requests_per_unit: 500}}\n",
    )
    code, out, err = cli("--check", str(examples))
    assert (code, err) == (0, "")
    assert f"{examples / 'example.yaml'}: domain 'rl', 17 rules" in out
    assert out.endswith("OK: 2 files, 2 domains, 19 rules\n")
    # portable: upstream's format only, and nothing upstream would refuse
    code, out, err = cli("--check", str(examples), "--portable", "--upstream")
    assert (code, err) == (0, "")
    config = load_config(examples)
    one, two = config.resolve("rl", [[("service", "service_1")], [("service", "service_2")]])
    assert one is not None
    assert two is not None
    assert (one.quota_mode, one.requests_per_unit, two.requests_per_unit) == (True, 1, 2)
    assert dict(one.metadata or {}) == {"service_with_quota": {"name": "service_1"}}
    shown = {(d["key"], d.get("value")): d for d in config.to_dict()["domains"][1]["descriptors"]}
    assert shown["service", "service_1"]["quota_mode"] is True  # GET /rlconfig shows it
    assert shown["service", "service_1"]["metadata"] == {
        "service_with_quota": {"name": "service_1"}
    }
    (unspec,) = config.resolve("rl", [[("unspec", "anything")]])
    assert unspec is not None
    assert unspec.stat_key_for([("unspec", "anything")]) == "rl.unspec_anything"


def test_upstreams_integration_directory_checks(tmp_path: Path) -> None:
    directory = tmp_path / "config"
    write(directory, "another.yaml", ANOTHER)
    write(directory, "basic.yaml", BASIC)
    write(directory, "share_threshold.yaml", SHARE_THRESHOLD)
    code, out, err = cli("--check", str(directory), "--upstream")
    assert (code, err) == (0, "")
    assert out.endswith("OK: 3 files, 3 domains, 11 rules\n")


# upstream: test/config/*.yaml that upstream refuses (config_test.go), restated; each is
# refused here too, at the place upstream's message points to
REFUSED_BY_BOTH = [
    pytest.param(
        "domain: d\ndescriptors:\n  - {key: k, value: v, rate_limit: {unit: foo, "
        "requests_per_unit: 5}}\n",
        "invalid rate limit unit 'foo'",
        id="bad_limit_unit",
    ),
    pytest.param("'''\n", "found unexpected end of stream", id="bad_yaml"),
    pytest.param(
        "domain: d\ndescriptors:\n  - {key: key1, value: value1}\n  - {key: key1, value: value1}\n",
        "duplicate descriptor",
        id="duplicate_key",
    ),
    pytest.param("descriptors:\n", "missing 'domain'", id="empty_domain"),
    pytest.param("domain: d\ndescriptors:\n  - {value: value1}\n", "needs a 'key'", id="empty_key"),
    pytest.param(
        "domain: d\ndescriptors:\n  - {key: key1, value: value1, ratelimit: {unit: day, "
        "requests_per_unit: 5}}\n",
        "unknown key 'ratelimit'",
        id="misspelled_key",
    ),
    pytest.param(
        "domain: d\ndescriptors:\n  - {key: key1, value: value1, rate_limit: {unit: day, "
        "requestsperunit: 5}}\n",
        "unknown key 'requestsperunit'",
        id="misspelled_key2",
    ),
    pytest.param("domain: d\ndescriptors: [a, b, c]\n", "must be a mapping", id="non_map_list"),
    pytest.param("0.25: d\ndescriptors:\n", "unknown key '0.25'", id="non_string_key"),
    pytest.param(
        "domain: d\ndescriptors:\n  - {key: k, rate_limit: {name: self, replaces: "
        "[{name: }], unit: second, requests_per_unit: 5}}\n",
        "non-empty name",
        id="replaces_empty",
    ),
    pytest.param(
        "domain: d\ndescriptors:\n  - {key: k, rate_limit: {name: self, replaces: "
        "[{name: self}], unit: second, requests_per_unit: 5}}\n",
        "replaces itself",
        id="replaces_self",
    ),
    pytest.param(
        "domain: d\ndescriptors:\n  - {key: foo, rate_limit: {unlimited: true, unit: day,"
        " requests_per_unit: 25}}\n",
        "unlimited: true takes no unit",
        id="unlimited_with_unit",
    ),
    pytest.param(
        "domain: d\ndescriptors:\n  - {key: k, value: v, share_threshold: true, "
        "rate_limit: {unit: day, requests_per_unit: 1}}\n",
        "share_threshold: true needs a wildcard value",
        id="share_threshold_no_wildcard",
    ),
]


@pytest.mark.parametrize(("text", "message"), REFUSED_BY_BOTH)
def test_what_upstream_refuses_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, "config.yaml", text)
    for upstream in (False, True):  # not a lenient case: refused on its own in both modes
        with pytest.raises(ConfigFileError) as excinfo:
            load_config(path, upstream=upstream)
        assert message in excinfo.value.reason


# --- MERGE_DOMAIN_CONFIG -------------------------------------------------------------------


def test_a_domain_merged_from_two_files(tmp_path: Path) -> None:
    """upstream's TestDomainMerge and TestDuplicateKeyDomainMerge."""
    write(tmp_path, "merge_domain_key1.yaml", MERGE_1)
    write(tmp_path, "merge_domain_key2.yaml", MERGE_2)
    config = load_config(tmp_path, merge_domains=True)
    one, two, none = config.resolve("test-domain", [[("key1", "value1")], [("key2", "value2")], []])
    assert (getattr(one, "requests_per_unit", None), getattr(two, "requests_per_unit", None)) == (
        10,
        20,
    )
    assert none is None
    assert config.resolve("foo_domain", [[("key1", "value1")]]) == [None]
    domain = config.domains["test-domain"]
    assert (domain.source, domain.merged) == (
        str(tmp_path / "merge_domain_key1.yaml"),
        (str(tmp_path / "merge_domain_key2.yaml"),),
    )
    assert config.to_dict()["domains"][0]["merged_from"] == [
        str(tmp_path / "merge_domain_key2.yaml")
    ]
    # without the option: refused, naming it (upstream refuses too, without its variable)
    code, _, err = cli("--check", str(tmp_path))
    assert code == 1
    assert "duplicate domain 'test-domain'" in err
    assert "MERGE_DOMAIN_CONFIG" in err
    assert "--merge-domain-config" in err
    for args, env in (
        (["--merge-domain-config"], None),
        ([], {"MERGE_DOMAIN_CONFIG": "true"}),
        ([], {"RATEKEEPER_SERVE_MERGE_DOMAIN_CONFIG": "1"}),
    ):
        code, out, err = cli("--check", str(tmp_path), *args, env=env)
        assert (code, err) == (0, ""), args
        assert "merge_domain_key1.yaml + " in out
        assert out.endswith("OK: 2 files, 1 domain, 2 rules\n")
    # the same descriptor in two of the files: refused naming both, as upstream
    again = write(tmp_path, "merge_domain_key3.yaml", MERGE_1)
    with pytest.raises(ConfigFileError) as excinfo:
        load_config(tmp_path, merge_domains=True)
    assert excinfo.value.path == str(again)
    assert "duplicate descriptor key 'key1' value 'value1'" in excinfo.value.reason
    assert excinfo.value.reason.endswith(
        "(first at " + str(tmp_path / "merge_domain_key1.yaml:3:24)")
    )


def test_replaces_may_name_a_rule_of_another_file_of_the_domain(tmp_path: Path) -> None:
    write(
        tmp_path,
        "a.yaml",
        "domain: d\ndescriptors:\n"
        "  - {key: a, rate_limit: {name: per_a, unit: minute, requests_per_unit: 1}}\n",
    )
    write(
        tmp_path,
        "b.yaml",
        "domain: d\ndescriptors:\n  - {key: b, rate_limit: "
        "{replaces: [{name: per_a}], unit: minute, requests_per_unit: 5}}\n",
    )
    config = load_config(tmp_path, merge_domains=True)
    dropped, kept = config.resolve("d", [[("a", "x")], [("b", "y")]])
    assert dropped is None
    assert kept is not None
    assert kept.requests_per_unit == 5


# --- share_threshold: one counter for the wildcard's values --------------------------------


def share_config(tmp_path: Path) -> ServiceConfig:
    return load_config(write(tmp_path, "share_threshold.yaml", SHARE_CASES), portable=True)


# upstream's TestShareThreshold: (entries, requests_per_unit, stats key); every entry list of
# one row shares the row's counter
SHARED = [
    (
        [[("files", "files/a.pdf")], [("files", "files/b.csv")], [("files", "files/c.txt")]],
        100,
        "test-domain.files_files/*",
    ),
    (
        [[("route", "api/v1"), ("method", "GET")], [("route", "api/v2"), ("method", "GET")]],
        60,
        "test-domain.route_api/*.method",
    ),
    (
        [
            [("service", "svc/user"), ("endpoint", "get")],
            [("service", "svc/x"), ("endpoint", "get")],
        ],
        80,
        "test-domain.service_svc/*.endpoint_get",
    ),
    (
        [
            [("nested", "parent"), ("files", "nested/file1.txt")],
            [("nested", "parent"), ("files", "nested/other")],
        ],
        200,
        "test-domain.nested_parent.files_nested/*",
    ),
    (
        [
            [("files", "top/file1.txt"), ("files", "nested/file1.txt")],
            [("files", "top/2"), ("files", "nested/3")],
        ],
        300,
        "test-domain.files_top/*.files_nested/*",
    ),
    (
        [
            [("user", "user/alice"), ("resource", "res/file1"), ("action", "read")],
            [("user", "user/bob"), ("resource", "res/f2"), ("action", "read")],
        ],
        150,
        "test-domain.user_user/*.resource_res/*.action",
    ),
    (
        [[("file", "test2")], [("file", "test23")], [("file", "test123")]],
        100,
        "test-domain.file_test*",
    ),
    (
        [[("midpath", "/api/v1")], [("midpath", "/api-beta-v1")], [("midpath", "/apiXYZv1")]],
        100,
        "test-domain.midpath_/api*v1",
    ),
    (
        [
            [("multiroute", "svcAepBrpc")],
            [("multiroute", "svcXXXepYYYrpc")],
            [("multiroute", "svceprpc")],
        ],
        50,
        "test-domain.multiroute_svc*ep*rpc",
    ),
    (
        [[("midroute", "/api/v2")], [("midroute", "/api-beta-v2")]],
        80,
        "test-domain.midroute_/api*v2",
    ),
    (
        [
            [("tenant", "t1prod"), ("resource", "resAv2")],
            [("tenant", "t99prod"), ("resource", "resBBBv2")],
        ],
        60,
        "test-domain.tenant_t*prod.resource_res*v2",
    ),
]


@pytest.mark.parametrize(("rows", "limit", "stat_key"), SHARED)
def test_share_threshold_shares_one_counter_and_one_stats_key(
    tmp_path: Path, limiter: Any, rows: list[Entries], limit: int, stat_key: str
) -> None:
    config = share_config(tmp_path)
    rules = config.resolve("test-domain", rows)
    identities = set()
    for entries, rule in zip(rows, rules, strict=True):
        assert rule is not None, entries
        assert (rule.requests_per_unit, rule.share_threshold) == (limit, True)
        assert rule.stat_key_for(entries) == stat_key
        identities.add(rule.identity_for(entries))
    assert len(identities) == 1
    # decided on the store: the first value's hits use up the others' limit
    first = rules[0]
    assert first is not None
    assert first.policy is not None
    assert limiter.hit(first.policy, first.identity_for(rows[0]), limit).allowed
    for entries, rule in zip(rows, rules, strict=True):
        assert rule is not None
        assert rule.policy is not None
        assert not limiter.hit(rule.policy, rule.identity_for(entries)).allowed


def test_what_does_not_share_keeps_its_own_counter(tmp_path: Path) -> None:
    """upstream: an exact value beside a sharing wildcard, and a wildcard without the flag
    under a sharing one (its values apart, the stats key its pattern)."""
    config = share_config(tmp_path)
    exact, wild = config.resolve("test-domain", [[("file", "test1")], [("file", "test2")]])
    assert exact is not None
    assert wild is not None
    assert (exact.requests_per_unit, exact.share_threshold) == (50, False)
    assert exact.stat_key_for([("file", "test1")]) == "test-domain.file_test1"
    assert exact.identity_for([("file", "test1")]) != wild.identity_for([("file", "test2")])
    one = [("path", "path/foo"), ("file", "file/doc1"), ("type", "pdf")]
    two = [("path", "path/bar"), ("file", "file/doc2"), ("type", "pdf")]
    (rule,) = config.resolve("test-domain", [one])
    assert rule is not None
    assert (
        rule.stat_key_for(one)
        == rule.stat_key_for(two)
        == "test-domain.path_path/*.file_file/*.type"
    )
    assert rule.identity_for(one) != rule.identity_for(two)  # file/* does not share
    same_file = [("path", "path/bar"), ("file", "file/doc1"), ("type", "pdf")]
    assert rule.identity_for(one) == rule.identity_for(same_file)  # path/* does
    assert config.resolve("test-domain", [[("midpath", "/api/v2")]]) == [None]
    assert config.resolve("test-domain", [[("multiroute", "svcABCrpc")]]) == [None]


# --- --check --upstream: every lenient place at once ---------------------------------------

LENIENT = """
domain: lenient
descriptors:
  - key: a
    rate_limit:
      unit: minute
      shadow_mode: true
  - key: b
    rate_limit: {unit: minute, requests_per_unit: 1, unit: hour}
  - key: c
    rate_limit: {unlimited: true, requests_per_unit: 5}
  - key: d
    rate_limit: {replaces: [{name: nobody}], unit: second, requests_per_unit: 2}
  - {key: "e*", value: x}
  - &f {key: f, metadata: {team: a, team: b}}
  - {<<: *f, key: g}
  - {key: h, rate_limit: {unit: second, requests_per_unit: 1, descriptors: []}}
---
domain: ignored
"""


def test_check_upstream_reports_every_lenient_place_at_once(tmp_path: Path) -> None:
    directory = tmp_path / "config"
    path = write(directory, "lenient.yaml", LENIENT)
    write(directory, "notes.txt", "not configuration\n")
    (directory / "old").mkdir()
    code, out, err = cli("--check", str(directory), "--upstream")
    assert (code, out) == (1, "")
    lines = err.splitlines()
    expected = [
        (f"{path}:5:7:", "missing 'requests_per_unit': envoyproxy/ratelimit reads 0 and denies"),
        (f"{path}:6:7:", "'shadow_mode' belongs in a descriptor, not in rate_limit"),
        (f"{path}:8:54:", "duplicate key 'unit' in rate_limit (first at"),
        (
            f"{path}:10:35:",
            "unlimited: true takes no requests_per_unit: envoyproxy/ratelimit ignores",
        ),
        (f"{path}:12:36:", "replaces 'nobody', but no rate_limit of domain 'lenient'"),
        (f"{path}:13:11:", "a key cannot hold '*': envoyproxy/ratelimit matches it as a wildcard"),
        (f"{path}:14:37:", "duplicate key 'team'"),
        (f"{path}:15:6:", "YAML merge keys ('<<') are not supported"),
        (f"{path}:16:63:", "'descriptors' belongs in a descriptor or the top level"),
        (f"{path}:17:1:", "expected a single document in the stream, but found another"),
        (
            f"{directory / 'notes.txt'}:1:1:",
            "envoyproxy/ratelimit's runtime loader reads every file",
        ),
        (f"{directory / 'old'}:1:1:", "a subdirectory, skipped by ratekeeper serve"),
    ]
    assert len(lines) == len(expected) + 1, err
    for line, (where, what) in zip(lines, expected, strict=False):
        assert line.startswith(where), (line, where)
        assert what in line, (line, what)
    assert lines[-1].startswith("12 places in 3 files that envoyproxy/ratelimit loads leniently")
    # without --upstream: the first one only (the file is read from its top)
    code, _, err = cli("--check", str(path))
    assert code == 1
    assert err.startswith(f"{path}:17:1: expected a single document")
    with pytest.raises(UpstreamLenient) as excinfo:
        check_config(path, upstream=True)
    assert len(excinfo.value.errors) == 10
    assert {error.path for error in excinfo.value.errors} == {str(path)}
    code, _, err = cli("--config", str(path), "--upstream")
    assert code == 2
    assert "--upstream reports on files: give it with --check PATH" in err


# --- served with upstream's answers, through gRPC ------------------------------------------


def serve_directory(tmp_path: Path) -> Path:
    """Upstream's example, its share_threshold file, and a domain merged from two files."""
    directory = tmp_path / "config"
    write(directory, "example.yaml", EXAMPLE)
    write(directory, "share_threshold.yaml", SHARE_THRESHOLD)
    write(directory, "merge_domain_key1.yaml", MERGE_1)
    write(directory, "merge_domain_key2.yaml", MERGE_2)
    return directory


def with_service(
    directory: Path, redis_url: str, test: Callable[[Call], Awaitable[None]], **options: Any
) -> None:
    async def main_() -> None:
        async with (
            running(directory, redis_url, **options) as service,
            grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel,
        ):
            await test(OURS.caller(channel))

    asyncio.run(main_())


def codes(response: Any) -> tuple[str, list[str]]:
    name = OURS.response_type.Code.Name
    return name(response.overall_code), [name(status.code) for status in response.statuses]


def test_the_directory_checks_and_serves_upstreams_answers(tmp_path: Path, redis_url: str) -> None:
    directory = serve_directory(tmp_path)
    code, out, err = cli("--check", str(directory), "--merge-domain-config", "--upstream")
    assert (code, err) == (0, ""), err
    assert out.endswith("OK: 4 files, 3 domains, 21 rules\n")

    async def test(call: Call) -> None:
        # quota_mode (upstream's integration-test/scripts/quota.sh and the service tests):
        # service_1 1/min, service_2 2/min, both in one request
        quota = OURS.request("rl", [("service", "service_1")], [("service", "service_2")])
        # first: a descriptor not in quota mode over its limit refuses the request, though a
        # quota has room (service_2 peeked: hits_addend 0 consumes nothing)
        mock = [("source_cluster", "proxy"), ("destination_cluster", "mock")]
        peek = {"entries": [("service", "service_2")], "hits_addend": 0}
        assert codes(await call(OURS.request("rl", mock, peek))) == ("OK", ["OK", "OK"])
        mixed = await call(OURS.request("rl", mock, peek))
        assert codes(mixed) == ("OVER_LIMIT", ["OVER_LIMIT", "OK"])
        first = await call(quota)
        assert codes(first) == ("OK", ["OK", "OK"])
        assert [s.limit_remaining for s in first.statuses] == [0, 1]
        metadata = MessageToDict(first.dynamic_metadata)
        assert metadata["domain"] == "rl"
        assert metadata["metadata"] == {"service_with_quota": {"name": "service_1"}}  # first wins
        second = await call(quota)
        assert codes(second) == ("OK", ["OVER_LIMIT", "OK"])  # one quota left: OK overall
        metadata = MessageToDict(second.dynamic_metadata)
        assert metadata["metadata"] == {"service_with_quota": {"name": "service_2"}}
        third = await call(quota)
        assert codes(third) == ("OVER_LIMIT", ["OVER_LIMIT", "OVER_LIMIT"])  # every quota over
        assert "metadata" not in MessageToDict(third.dynamic_metadata)

        # share_threshold (upstream's README, share_threshold example): ten requests for files/*
        # use the one counter, whatever the value
        for n in range(10):
            shared = await call(OURS.request("share-threshold-test", [("files", f"files/{n}.pdf")]))
            assert codes(shared) == ("OK", ["OK"])
            assert shared.statuses[0].limit_remaining == 9 - n
        over = await call(OURS.request("share-threshold-test", [("files", "files/new.csv")]))
        assert codes(over) == ("OVER_LIMIT", ["OVER_LIMIT"])
        for _ in range(10):
            apart = OURS.request("share-threshold-test", [("files_no_share", "files_no_share/a")])
            assert codes(await call(apart)) == ("OK", ["OK"])
        other = OURS.request("share-threshold-test", [("files_no_share", "files_no_share/b")])
        assert (await call(other)).statuses[0].limit_remaining == 9  # a counter per value

        # the merged domain: each file's descriptor with its own limit
        merged = await call(OURS.request("test-domain", [("key1", "value1")], [("key2", "value2")]))
        assert codes(merged) == ("OK", ["OK", "OK"])
        assert [s.current_limit.requests_per_unit for s in merged.statuses] == [10, 20]

    with_service(
        directory, redis_url, test, merge_domain_config=True, response_dynamic_metadata=True
    )


def test_global_quota_mode(tmp_path: Path, redis_url: str) -> None:
    """upstream's QUOTA_MODE (its TestServiceGlobalQuotaMode and TestMetadataReturnedFor...):
    every descriptor a quota; unlimited ones take no part, and send no metadata."""
    directory = tmp_path / "config"
    write(
        directory,
        "quota.yaml",
        """
        domain: quota-domain
        descriptors:
          - {key: foo, rate_limit: {unit: minute, requests_per_unit: 1}, metadata: {name: foo}}
          - {key: hello, rate_limit: {unit: minute, requests_per_unit: 2}}
          - {key: free, rate_limit: {unlimited: true}, metadata: {free: true}}
        """,
    )

    async def test(call: Call) -> None:
        both = OURS.request("quota-domain", [("foo", "bar")], [("hello", "world")], [("free", "x")])
        first = await call(both)
        assert codes(first) == ("OK", ["OK", "OK", "OK"])
        assert MessageToDict(first.dynamic_metadata)["metadata"] == {"name": "foo"}
        assert codes(await call(both)) == ("OK", ["OVER_LIMIT", "OK", "OK"])
        third = await call(both)
        assert codes(third) == ("OVER_LIMIT", ["OVER_LIMIT", "OVER_LIMIT", "OK"])
        assert "metadata" not in MessageToDict(third.dynamic_metadata)

    with_service(directory, redis_url, test, quota_mode=True, response_dynamic_metadata=True)


def test_a_merged_domain_reloads_merged(tmp_path: Path) -> None:
    """The watcher loads with MERGE_DOMAIN_CONFIG too: a change to one of the files is applied
    to the merged domain; a descriptor moved into both files keeps the one in force."""
    from ratekeeper.service._reload import ConfigWatcher

    directory = tmp_path / "config"
    write(directory, "merge_domain_key1.yaml", MERGE_1)
    second = write(directory, "merge_domain_key2.yaml", MERGE_2)
    applied: list[ServiceConfig] = []

    async def main_() -> None:
        watcher = ConfigWatcher(directory, applied.append, merge_domains=True)
        watcher.load_now()
        write(directory, "merge_domain_key2.yaml", MERGE_2.replace("20", "25"))
        assert await watcher.reload("a test")
        second.write_text(MERGE_1, encoding="utf-8")  # key1 in both files: refused
        assert not await watcher.reload("a test")
        assert watcher.last_error is not None
        assert "duplicate descriptor key 'key1'" in watcher.last_error

    asyncio.run(main_())
    assert len(applied) == 2
    limits = [
        [
            getattr(rule, "requests_per_unit", None)
            for rule in config.resolve("test-domain", [[("key1", "value1")], [("key2", "value2")]])
        ]
        for config in applied
    ]
    assert limits == [[10, 20], [10, 25]]
