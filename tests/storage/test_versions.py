"""The supported redis-py and hiredis versions: an older one is refused at ``from_url``, in one
line that names the versions (CI runs the suites on the floor itself, in a second environment).
"""

from __future__ import annotations

import re
from pathlib import Path

import hiredis
import pytest
import redis
import redis.utils

from ratekeeper import AsyncLimiter, ConfigError, Limiter
from ratekeeper._storage.redis import _compat


def test_the_installed_versions_are_supported() -> None:
    _compat.check_versions()


@pytest.mark.parametrize(
    ("module", "version"),
    [(redis, "4.6.0"), (redis, "5.0.0"), (hiredis, "2.2.3"), (hiredis, "1.1.0")],
)
@pytest.mark.parametrize("make", [Limiter.from_url, AsyncLimiter.from_url])
def test_an_unsupported_version_is_refused_at_from_url(
    monkeypatch: pytest.MonkeyPatch, module: object, version: str, make: object
) -> None:
    monkeypatch.setattr(module, "__version__", version)
    floor_redis = ".".join(map(str, _compat.MIN_REDIS))
    floor_hiredis = ".".join(map(str, _compat.MIN_HIREDIS))
    with pytest.raises(ConfigError) as excinfo:
        make("redis://127.0.0.1:1/0")  # type: ignore[operator]
    message = str(excinfo.value)
    assert "\n" not in message
    assert f"redis>={floor_redis}" in message
    assert f"hiredis>={floor_hiredis}" in message
    assert version in message


def test_redis_py_ignoring_hiredis_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py 6.2 and later silently ignore a hiredis older than 3.2 (and a future release may
    raise that bar again): refused, in one line, rather than quietly slower."""
    monkeypatch.setattr(redis.utils, "HIREDIS_AVAILABLE", False)
    with pytest.raises(ConfigError) as excinfo:
        Limiter.from_url("redis://127.0.0.1:1/0")
    message = str(excinfo.value)
    assert "\n" not in message
    assert f"redis-py {redis.__version__} does not use hiredis" in message


def _floor(text: str, name: str) -> tuple[int, ...]:
    (found,) = re.findall(rf'"{name}>=([0-9.]+)"', text)
    parts = [int(p) for p in found.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_the_floor_is_what_pyproject_declares() -> None:
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    (extra,) = re.findall(r"(?m)^redis = \[(.*)\]$", text)
    assert _floor(extra, "redis") == _compat.MIN_REDIS
    assert _floor(extra, "hiredis") == _compat.MIN_HIREDIS
