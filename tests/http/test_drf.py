"""ratekeeper.drf.RatekeeperThrottle: exact across processes, beside DRF's own
ScopedRateThrottle on a Redis-backed Django cache under the same load; its keys (the user when
authenticated, else the client address through ``TRUSTED_PROXIES``, never ``NUM_PROXIES``), its
exact ``wait()``, and DRF's scope rules.
"""

from __future__ import annotations

import multiprocessing
import uuid
from typing import Any

import pytest

from tests.support.django_project import configure

configure()

from django.core.exceptions import ImproperlyConfigured  # noqa: E402
from django.test import override_settings  # noqa: E402
from rest_framework.request import Request  # noqa: E402
from rest_framework.response import Response  # noqa: E402
from rest_framework.test import APIRequestFactory, force_authenticate  # noqa: E402
from rest_framework.views import APIView  # noqa: E402

from ratekeeper import ManualClock  # noqa: E402
from ratekeeper.drf import RatekeeperThrottle  # noqa: E402

from ..support import workers  # noqa: E402
from ..support.django_project.drf_workers import hammer  # noqa: E402
from ..support.servers import RedisServer  # noqa: E402

PROCESSES = 4
THREADS = 16
PER_THREAD = 3
LIMIT = 50  # "50/minute" in the test project's DEFAULT_THROTTLE_RATES


def run_processes(url: str) -> dict[str, list[int]]:
    """``PROCESSES`` spawned processes x ``THREADS`` threads calling ratekeeper's throttled
    view, then DRF's, the threads of every process released together for each; every status
    per view."""
    ctx = multiprocessing.get_context("spawn")
    views = ("ratekeeper", "drf")
    reports = workers.run_processes(
        ctx, hammer, PROCESSES, timeout=300, url=url, key_prefix=f"drf-{uuid.uuid4().hex[:8]}",
        view_names=views, threads=THREADS, per_thread=PER_THREAD,
        barrier=ctx.Barrier(PROCESSES * THREADS),  # reused: once per view
    )  # fmt: skip
    return {view: [s for r in reports for s in r["statuses"][view]] for view in views}


def test_4_processes_x_16_threads_admit_exactly_50_where_drf_admits_more(
    private_server: RedisServer, capsys: pytest.CaptureFixture[str]
):
    sent = PROCESSES * THREADS * PER_THREAD
    statuses = run_processes(private_server.url)
    ours, theirs = statuses["ratekeeper"], statuses["drf"]
    assert len(ours) == len(theirs) == sent
    assert set(ours) == {200, 429}
    assert set(theirs) <= {200, 429}
    admitted, drf_admitted = ours.count(200), theirs.count(200)
    with capsys.disabled():
        print(
            f"\nDRF {PROCESSES} processes x {THREADS} threads, {sent} requests at "
            f"{LIMIT}/minute: RatekeeperThrottle admitted {admitted}, "
            f"ScopedRateThrottle on RedisCache admitted {drf_admitted}"
        )
    assert admitted == LIMIT
    # DRF reads the history, then writes it back: concurrent requests all pass the check.
    assert drf_admitted >= LIMIT


# --- in this process, on memory:// ---------------------------------------------------------------


class User:
    is_authenticated = True

    def __init__(self, pk: int) -> None:
        self.pk = pk


class Scoped(APIView):
    throttle_classes = (RatekeeperThrottle,)
    throttle_scope = "unit"

    def get(self, request: Request) -> Response:
        return Response({"decisions": len(getattr(request._request, "ratekeeper", ()))})


class Unscoped(Scoped):
    throttle_scope = None


class Unknown(Scoped):
    throttle_scope = "nowhere"


def configured(rates: dict[str, Any], **ratekeeper: Any) -> Any:
    return override_settings(
        RATEKEEPER={"STORAGE_URL": "memory://", "KEY_PREFIX": "drf-unit", **ratekeeper},
        REST_FRAMEWORK={
            "DEFAULT_AUTHENTICATION_CLASSES": [],
            "DEFAULT_PERMISSION_CLASSES": [],
            "DEFAULT_THROTTLE_RATES": rates,
            "NUM_PROXIES": 1,  # ignored: the trusted proxies decide
        },
    )


def call(view: type[APIView], user: Any = None, **meta: Any) -> Any:
    request = APIRequestFactory().get("/unit", **meta)
    if user is not None:
        force_authenticate(request, user=user)
    return view.as_view()(request)


def codes(view: type[APIView], count: int, user: Any = None, **meta: Any) -> list[int]:
    return [call(view, user, **meta).status_code for _ in range(count)]


def test_keys_on_the_user_when_authenticated_else_on_the_client_address():
    with configured({"unit": "2/minute"}, TRUSTED_PROXIES=["10.0.0.0/8"]):
        proxy = {"REMOTE_ADDR": "10.0.0.5"}
        assert codes(Scoped, 3, User(1), **proxy) == [200, 200, 429]
        assert codes(Scoped, 2, User(2), **proxy) == [200, 200]  # same address, another user
        alice = {**proxy, "HTTP_X_FORWARDED_FOR": "198.51.100.7"}
        bob = {**proxy, "HTTP_X_FORWARDED_FOR": "198.51.100.8"}
        assert codes(Scoped, 3, **alice) == [200, 200, 429]
        assert codes(Scoped, 2, **bob) == [200, 200]
        # A peer that is no trusted proxy is the client, whatever it forwards (NUM_PROXIES=1
        # would have taken the forged address, a fresh identity per request).
        forged = [
            call(Scoped, REMOTE_ADDR="203.0.113.9", HTTP_X_FORWARDED_FOR=f"192.0.2.{i}")
            for i in range(3)
        ]
        assert [r.status_code for r in forged] == [200, 200, 429]


def test_wait_is_the_exact_retry_after():
    clock = ManualClock()
    with configured({"unit": "2/minute"}, LIMITER_OPTIONS={"clock": clock}):
        assert call(Scoped, User(7)).status_code == 200
        clock.advance(10)
        assert call(Scoped, User(7)).status_code == 200
        clock.advance(5)
        throttle = RatekeeperThrottle()
        request = APIRequestFactory().get("/unit")
        force_authenticate(request, user=User(7))
        view = Scoped()
        assert throttle.allow_request(view.initialize_request(request), view) is False
        assert throttle.wait() == 45.0  # the first hit leaves the window in 45 s, not 60
        denied = call(Scoped, User(7))
        assert denied.status_code == 429
        assert denied["Retry-After"] == "45"
        clock.advance(45)
        assert call(Scoped, User(7)).status_code == 200


def test_the_view_sees_the_decision_and_drf_scope_rules_hold():
    with configured({"unit": "1/minute", "off": None}):
        assert call(Scoped).data == {"decisions": 1}
        assert [r.status_code for r in (call(Unscoped), call(Unscoped))] == [200, 200]
        with pytest.raises(
            ImproperlyConfigured, match="No default throttle rate set for 'nowhere'"
        ):
            call(Unknown)

        class Off(Scoped):
            throttle_scope = "off"

        assert codes(Off, 3) == [200, 200, 200]  # a rate of None: not throttled, as in DRF


def test_a_bad_rate_names_the_setting():
    with (
        configured({"unit": "50/fortnight"}),
        pytest.raises(ImproperlyConfigured, match=r"DEFAULT_THROTTLE_RATES'\]\['unit'\]"),
    ):
        call(Scoped)
