"""Rates: the strict string parser and ``Rate`` validation. Pure unit tests, no server."""

from __future__ import annotations

import math

import pytest

from ratekeeper import ConfigError, Rate, parse_rates

MAX_INT = 2**53


# -- parse_rates: accepted spellings ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10/second", (Rate(10, 1),)),
        ("10/s", (Rate(10, 1),)),
        ("10/sec", (Rate(10, 1),)),
        ("10/seconds", (Rate(10, 1),)),
        ("7/m", (Rate(7, 60),)),
        ("7/minute", (Rate(7, 60),)),
        ("3/h", (Rate(3, 3600),)),
        ("3/hour", (Rate(3, 3600),)),
        ("1/day", (Rate(1, 86_400),)),
        ("1/d", (Rate(1, 86_400),)),
        ("2/week", (Rate(2, 7 * 86_400),)),
        ("2/w", (Rate(2, 7 * 86_400),)),
        ("2/wk", (Rate(2, 7 * 86_400),)),
        ("2 per 2 wks", (Rate(2, 14 * 86_400),)),
        ("2 per 3 weeks", (Rate(2, 21 * 86_400),)),
        ("9/month", (Rate(9, 30 * 86_400),)),
        ("9/mo", (Rate(9, 30 * 86_400),)),
        ("9 per 2 mos", (Rate(9, 60 * 86_400),)),
        ("9 per 6 months", (Rate(9, 180 * 86_400),)),
        ("4/year", (Rate(4, 365 * 86_400),)),
        ("4/y", (Rate(4, 365 * 86_400),)),
        ("4/yr", (Rate(4, 365 * 86_400),)),
        ("4 per 2 yrs", (Rate(4, 730 * 86_400),)),
        ("4 per 71 years", (Rate(4, 71 * 365 * 86_400),)),
        ("4/YEAR", (Rate(4, 365 * 86_400),)),
        ("7/M", (Rate(7, 60),)),  # m is a minute, in either case; a month is mo
        ("5 per 10 seconds", (Rate(5, 10),)),
        ("100 per 15 minutes", (Rate(100, 900),)),
        ("10 / 5 seconds", (Rate(10, 5),)),
        ("2 per 3 days", (Rate(2, 3 * 86_400),)),
        ("10 per second", (Rate(10, 1),)),
        ("10/SECOND", (Rate(10, 1),)),
        ("10/second;1000/hour", (Rate(10, 1), Rate(1000, 3600))),
        (str(MAX_INT) + "/second", (Rate(MAX_INT, 1),)),
    ],
)
def test_parse_rates_accepts(text: str, expected: tuple[Rate, ...]) -> None:
    assert parse_rates(text) == expected


def test_parse_rates_values_are_exact() -> None:
    (rate,) = parse_rates("100 per 15 minutes")
    assert rate.limit == 100
    assert rate.period == 900.0
    assert rate.period_ms == 900_000
    assert rate.period_us == 900_000_000
    assert type(rate.limit) is int


def test_parse_rates_mixes_every_separator_and_the_long_units() -> None:
    rates = parse_rates("1/year|5/month;10/week,100/day")
    assert [r.period_ms for r in rates] == [
        86_400_000, 604_800_000, 2_592_000_000, 31_536_000_000,
    ]  # fmt: skip
    assert [r.limit for r in rates] == [100, 10, 5, 1]


@pytest.mark.parametrize(
    ("text", "other"),
    [("1/week", "3 per 7 days"), ("1/month", "3 per 30 days"), ("1/year", "3 per 365 days")],
)
def test_long_units_are_whole_days(text: str, other: str) -> None:
    """A week is 7 days, a month 30 and a year 365: the same period as the days spelt out."""
    with pytest.raises(ConfigError, match="share the period"):
        parse_rates(f"{text};{other}")


def test_parse_rates_sorts_by_period() -> None:
    rates = parse_rates("1000/hour;10/second;1/day;100 per 15 minutes;50/minute")
    assert [r.period for r in rates] == [1.0, 60.0, 900.0, 3600.0, 86_400.0]
    assert [r.limit for r in rates] == [10, 50, 100, 1000, 1]


@pytest.mark.parametrize(
    "text",
    [
        "10/second,1000/hour",
        "1000/hour, 10/second",
        "10/second ; 1000/hour",
        "  10/second;1000/hour  ",
        "\t10 /second ;\n1000/ hour",
        "10/second;1000/hour",
        "10/second|1000/hour",
        "10/second | 1000/hour",
        "1000/hour|10/second",
    ],
)
def test_parse_rates_separators_and_whitespace(text: str) -> None:
    assert parse_rates(text) == (Rate(10, 1), Rate(1000, 3600))


def test_parse_rates_accepts_rate_objects() -> None:
    assert parse_rates(Rate(5, 2)) == (Rate(5, 2),)
    assert parse_rates([Rate(1, 60), Rate(5, 1)]) == (Rate(5, 1), Rate(1, 60))


# -- parse_rates: refusals name the bad part -------------------------------------------------


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("10/", "10/"),
        ("0/second", "0/second"),
        ("-1/minute", "-1/minute"),
        ("1.5/second", "1.5/second"),
        ("\u0661\u0660/second", "\u0661\u0660/second"),  # Arabic-Indic digits
        ("\uff11\uff10/second", "\uff11\uff10/second"),  # fullwidth digits
        ("10/fortnight", "fortnight"),
        (str(MAX_INT + 1) + "/second", str(MAX_INT + 1)),
        ("second", "second"),
        ("10/0 seconds", "10/0 seconds"),
        ("10/second;5/fortnight", "fortnight"),
        ("10/second;1.5/hour", "1.5/hour"),
        ("ten/second", "ten/second"),
        ("10/ms", "ms"),  # milliseconds or months: ambiguous, so neither
        ("10/mon", "mon"),
        ("10/fortnights", "fortnights"),
        ("10/second|", "10/second|"),
        ("1 per 72 years", "72 years"),
        ("1 per 900 months", "900 months"),
        ("1 per 3800 weeks", "3800 weeks"),
    ],
)
def test_parse_rates_refuses_and_names_the_bad_part(text: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_rates(text)
    assert named in str(info.value)


@pytest.mark.parametrize("text", ["", "   ", "\n"])
def test_parse_rates_refuses_empty(text: str) -> None:
    with pytest.raises(ConfigError, match="empty"):
        parse_rates(text)


@pytest.mark.parametrize(
    "text", ["10/second;", ";10/second", "10/second,,1/hour", "10/s; ;1/h", "10/s||1/h", "|1/w"]
)
def test_parse_rates_refuses_empty_item(text: str) -> None:
    with pytest.raises(ConfigError, match="empty item") as info:
        parse_rates(text)
    assert repr(text) in str(info.value)


def test_an_unknown_unit_lists_every_unit() -> None:
    with pytest.raises(ConfigError) as info:
        parse_rates("10/fortnight")
    assert "second, minute, hour, day, week, month or year" in str(info.value)


def test_parse_rates_refuses_duplicate_period() -> None:
    with pytest.raises(ConfigError) as info:
        parse_rates("10/minute;20/60 seconds")
    message = str(info.value)
    assert "60 s" in message
    assert "10/minute" in message
    assert "20/" in message


def test_parse_rates_refuses_duplicate_period_of_rate_objects() -> None:
    with pytest.raises(ConfigError, match="share the period"):
        parse_rates([Rate(1, 1), Rate(2, 1.0)])


@pytest.mark.parametrize("bad", [None, 10, [], [Rate(1, 1), "1/hour"], object()])
def test_parse_rates_refuses_other_types(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_rates(bad)  # type: ignore[arg-type]


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cannot parse rate '10/'"):
        parse_rates("10/")


# -- Rate validation -------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [True, False, 1.0, 1.5, "10", None])
def test_rate_refuses_non_int_limit(limit: object) -> None:
    with pytest.raises(ConfigError, match="limit"):
        Rate(limit, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("limit", [0, -1, MAX_INT + 1])
def test_rate_refuses_limit_out_of_range(limit: int) -> None:
    with pytest.raises(ConfigError, match="limit"):
        Rate(limit, 1)


def test_rate_accepts_limit_bounds() -> None:
    assert Rate(1, 1).limit == 1
    assert Rate(MAX_INT, 1).limit == MAX_INT


@pytest.mark.parametrize("period", [0, 0.0, -1, -0.5, math.inf, -math.inf, math.nan])
def test_rate_refuses_non_positive_or_non_finite_period(period: float) -> None:
    with pytest.raises(ConfigError, match="period"):
        Rate(1, period)


@pytest.mark.parametrize("period", [True, "1", None])
def test_rate_refuses_non_number_period(period: object) -> None:
    with pytest.raises(ConfigError, match="period"):
        Rate(1, period)  # type: ignore[arg-type]


@pytest.mark.parametrize("period", [0.0005, 0.0001, 1.0005, 1e-9])
def test_rate_refuses_period_not_whole_milliseconds(period: float) -> None:
    with pytest.raises(ConfigError, match="milliseconds"):
        Rate(1, period)


def test_rate_refuses_period_too_long() -> None:
    with pytest.raises(ConfigError, match="too long"):
        Rate(1, 10**13)


@pytest.mark.parametrize(
    ("period", "ms"), [(0.001, 1), (0.3, 300), (1, 1000), (1.5, 1500), (86_400, 86_400_000)]
)
def test_rate_period_in_whole_milliseconds(period: float, ms: int) -> None:
    rate = Rate(1, period)
    assert rate.period_ms == ms
    assert rate.period_us == ms * 1000


def test_rate_is_frozen() -> None:
    rate = Rate(1, 1)
    with pytest.raises(AttributeError):
        rate.limit = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("rate", "text"),
    [
        (Rate(10, 1), "10/second"),
        (Rate(5, 10), "5 per 10 seconds"),
        (Rate(3, 90), "3 per 90 seconds"),
        (Rate(7, 60), "7/minute"),
        (Rate(100, 900), "100 per 15 minutes"),
        (Rate(1000, 3600), "1000/hour"),
        (Rate(2, 7200), "2 per 2 hours"),
        (Rate(1, 86_400), "1/day"),
        (Rate(4, 3 * 86_400), "4 per 3 days"),
        (Rate(2, 7 * 86_400), "2/week"),
        (Rate(2, 14 * 86_400), "2 per 2 weeks"),
        (Rate(9, 30 * 86_400), "9/month"),
        (Rate(9, 90 * 86_400), "9 per 3 months"),
        (Rate(4, 365 * 86_400), "4/year"),
        (Rate(4, 71 * 365 * 86_400), "4 per 71 years"),
        (Rate(1, 360 * 86_400), "1 per 12 months"),
        (Rate(MAX_INT, 1), f"{MAX_INT}/second"),
    ],
)
def test_rate_str_round_trips(rate: Rate, text: str) -> None:
    assert str(rate) == text
    assert parse_rates(str(rate)) == (rate,)


def test_joined_strs_round_trip() -> None:
    rates = parse_rates("10/second;100 per 15 minutes;1/day;5/week;20/month;100/year")
    assert parse_rates(";".join(str(r) for r in rates)) == rates
