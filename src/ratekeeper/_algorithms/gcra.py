"""GCRA, the generic cell rate algorithm; mirrors ``lua/gcra.lua``.

A token bucket without a refill loop: one theoretical arrival time (TAT) per rate. With emission
interval T = period / limit and burst B (the policy's ``burst``, by default the limit), a cost c
fits at time t when ``max(TAT, t) + c*T - t <= B*T``. The TAT is kept exactly as a whole number
of milliseconds plus a remainder in units of 1/limit ms, so the rate is exact and so is
``retry_after`` (to the millisecond the algorithm counts in).

Settling a reservation: a charge adds ``c*T`` to the TAT (past the burst); a refund takes back
only what still counts. The reservation's units were emitted from ``max(TAT then, a)`` on, ``a``
its stamp in whole ms, and what was admitted since is stacked above them; so a refund of ``c``
units at ``t`` moves the TAT back by the part of ``c*T`` from ``a`` on that is still ahead of
``t``, ``min(c*T, max(a + c*T - t, 0))``, and never below ``t`` (in the integers the script
uses, ``d = max(d - min(c*W, max((a - t)*limit + c*W, 0)), 0)``). All of it at the
reservation's own millisecond; nothing once its units have come back by themselves, so the TAT
never drops below what it would be had they never been counted, whatever was admitted since
(at times up to ``t``: a clock ahead of the refund's could still see units it had emitted).

Deliberate differences from the script (also in its header), which change no reply and no
stored field:

* There is no TTL skip here, unlike the other counters: every admission moves the TAT, so the
  script, like this reference, writes both fields and sets the TTL each time, on any clock.
* The script reads only this policy's fields (HMGET); this reference reads the whole hash.
* The script takes the window in ms as ``window / 1000`` in a double, this reference as
  ``window // 1000``: the same, as a window is always whole milliseconds (``Rate.period_us``).
"""

from __future__ import annotations

from .._model.errors import ConfigError
from .._model.rates import MAX_INT, MAX_SPAN_US
from ._base import (
    CHARGE,
    REFUND,
    RESERVE,
    RETRY_NEVER,
    RETRY_NONE,
    SETTLES,
    Algorithm,
    Args,
    Limits,
    Reply,
    check_limits,
)
from .keyspace import Keyspace

#: B * W_ms must stay below this so that every intermediate value is exact in a Lua double.
_MAX_PRODUCT = 2**52
#: reset_after is computed through remainder * 1000 + limit, which must stay below 2**53.
_MAX_LIMIT = 2**53 // 1001


def bursts(policy: Limits) -> tuple[int, ...]:
    """The burst of each rate: the policy's ``burst`` for a single rate, else each limit."""
    if policy.burst is not None:
        return (policy.burst,)
    return tuple(rate.limit for rate in policy.rates)


def validate(policy: Limits) -> None:
    check_limits(policy, _MAX_LIMIT)
    if policy.burst is not None and len(policy.rates) > 1:
        raise ConfigError(
            f"policy {policy.name!r}: burst applies to a single-rate gcra policy; with several "
            "rates each rate's burst is its limit"
        )
    for rate, burst in zip(policy.rates, bursts(policy), strict=True):
        if burst * rate.period_ms > _MAX_PRODUCT:
            raise ConfigError(
                f"policy {policy.name!r}: gcra needs burst x period in ms <= 2**52 for exact "
                f"arithmetic, and {rate} with burst {burst} exceeds it"
            )
        if burst * rate.period_us // rate.limit > MAX_SPAN_US:
            raise ConfigError(
                f"policy {policy.name!r}: a burst of {burst} at {rate} takes over 71 years to "
                "refill; times that long do not fit the scripts' arithmetic"
            )


def _debt(stored: dict[str, int], i: int, tms: int, limit: int) -> int:
    """d = (TAT - t) * limit of rate ``i`` at ``tms``; 0 once the TAT has passed."""
    q = stored.get(f"q{i}")
    return (q - tms) * limit + stored[f"r{i}"] if q is not None and q >= tms else 0


def settle(keyspace: Keyspace, key: str, args: Args) -> None:
    """A charge (d grows by the cost, past the burst, up to a debt that stays exact and fits
    ``MAX_SPAN_US``) or a refund (d shrinks by the part of the refunded units' emission still
    ahead of now, counted from the reservation's stamp, not below 0), as the script's settle
    block."""
    now, cost = args.now, args.cost
    tms = now // 1000
    # The refunded reservation's stamp in whole ms: its units were counted from then on.
    at = int(args.token) // 1000 if args.mode == REFUND else 0
    stored: dict[str, int] = keyspace.get(key, now) or {}
    writes: dict[str, int] = {}
    ttl = 0
    changed = False
    for i, ((limit, window), burst) in enumerate(zip(args.rates, args.extra, strict=True), 1):
        wms = window // 1000
        d = _debt(stored, i, tms, limit)
        if cost > 0 and (args.mode == CHARGE or d > 0):
            changed = True
            if args.mode == CHARGE:
                d = min(d + cost * wms, MAX_INT - burst * wms, limit * (MAX_SPAN_US // 1000))
            else:
                # cost * T from the stamp on, less what of it has passed: (at + cost T - t) L
                ahead = min(cost * wms, max((at - tms) * limit + cost * wms, 0))
                d = max(d - ahead, 0)
        whole = d // limit
        rest = d - whole * limit
        writes.update({f"q{i}": tms + whole, f"r{i}": rest})
        if d > 0:
            ttl = max(ttl, tms * 1000 - now + whole * 1000 - (-(rest * 1000) // limit))
    if changed:
        keyspace.set(key, {**stored, **writes}, -(-ttl // 1000) + args.margin_ms, now)


def reference(keyspace: Keyspace, keys: tuple[str, ...], args: Args) -> Reply:
    if args.mode in SETTLES:
        settle(keyspace, keys[0], args)
        args = args.settled()
    now, cost = args.now, args.cost
    tms = now // 1000
    stored: dict[str, int] = keyspace.get(keys[0], now) or {}
    allowed = True
    ds = []
    for i, ((limit, window), burst) in enumerate(zip(args.rates, args.extra, strict=True), 1):
        wms = window // 1000
        d = _debt(stored, i, tms, limit)
        ds.append(d)
        if d + cost * wms > burst * wms:
            allowed = False
    consume = allowed and args.consumes
    reply = [1 if allowed else 0]
    ttl = 0
    writes: dict[str, int] = {}
    for i, ((limit, window), burst, d) in enumerate(
        zip(args.rates, args.extra, ds, strict=True), 1
    ):
        wms = window // 1000
        after = d + cost * wms if consume else d
        remaining = max((burst * wms - after) // wms, 0)
        whole = after // limit
        reset = 0
        if after:
            reset = tms * 1000 - now + whole * 1000 - (-((after - whole * limit) * 1000) // limit)
            reset = max(reset, 0)
        retry = RETRY_NONE
        if cost > burst:
            retry = RETRY_NEVER
        elif d + cost * wms > burst * wms:
            retry = (tms - (-(d + cost * wms - burst * wms) // limit)) * 1000 - now
        reply += (remaining, reset, retry)
        ttl = max(ttl, reset)
        writes.update({f"q{i}": tms + whole, f"r{i}": after - whole * limit})
    if consume:
        keyspace.set(keys[0], {**stored, **writes}, -(-ttl // 1000) + args.margin_ms, now)
    if consume and args.mode == RESERVE:
        reply.append(now)  # the reservation's stamp
    return reply


ALGORITHM = Algorithm(
    name="gcra",
    script="gcra",
    suffixes=("gcra",),
    reference=reference,
    validate=validate,
    extra_args=bursts,
)
