from ratekeeper import ManualClock, Policy


def test_limit_is_enforced_on_every_backend_and_api(make_limiter):
    clock = ManualClock()
    limiter = make_limiter(clock=clock)
    policy = Policy("smoke", "3/second")
    assert [limiter.hit(policy, "a").allowed for _ in range(4)] == [True, True, True, False]
    clock.advance(1.0)
    assert limiter.hit(policy, "a").allowed
