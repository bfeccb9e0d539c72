"""Limiter options checked where they are given: URL errors hide passwords, and the default
breaker's slow-call bound follows the store timeout the user chose."""

from __future__ import annotations

import pytest

from ratekeeper import AsyncLimiter, CircuitBreaker, ConfigError, Limiter


@pytest.mark.parametrize("make", [Limiter.from_url, AsyncLimiter.from_url])
def test_a_bad_url_error_does_not_show_the_password(make: object) -> None:
    with pytest.raises(ConfigError) as excinfo:
        make("redis://user:s3cret@127.0.0.1:notaport/0")  # type: ignore[operator]
    assert "s3cret" not in str(excinfo.value)
    assert "redis://user:***@127.0.0.1:notaport/0" in str(excinfo.value)


def test_the_default_breaker_counts_a_call_slow_only_past_the_timeout() -> None:
    with Limiter.from_url("redis://127.0.0.1:1", timeout=2.5) as patient:
        assert patient.breaker.slow_call == 2.5
    with Limiter.from_url("redis://127.0.0.1:1") as default:
        assert default.breaker.slow_call == 0.020
    mine = CircuitBreaker(slow_call=0.1)
    with Limiter.from_url("redis://127.0.0.1:1", timeout=2.5, breaker=mine) as chosen:
        assert chosen.breaker is mine
    with pytest.raises(ConfigError, match="timeout must be a positive number"):
        Limiter.from_url("redis://127.0.0.1:1", timeout=-1)
