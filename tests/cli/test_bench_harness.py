"""The benchmark harness's statistics (``benchmarks/_harness.py``): percentiles as numpy computes
them by default (linear interpolation between closest ranks), paired ratios and rotations."""

from __future__ import annotations

import importlib
import random
from pathlib import Path
from types import ModuleType

import numpy
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def harness() -> ModuleType:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        return importlib.import_module("_harness")


def test_the_median_of_one_to_five_is_three(harness: ModuleType) -> None:
    values = [1, 2, 3, 4, 5]
    assert harness.percentile(values, 0.5) == 3.0
    assert harness.percentile(values, 0.0) == 1.0
    assert harness.percentile(values, 1.0) == 5.0
    assert harness.percentile(values, 0.25) == 2.0
    assert harness.percentile([1, 2, 3, 4], 0.5) == 2.5  # between the two middle values
    assert harness.percentile([7], 0.99) == 7.0


@pytest.mark.parametrize("n", [2, 3, 10, 101, 1000])
def test_percentiles_match_numpy(harness: ModuleType, n: int) -> None:
    rng = random.Random(n)
    values = sorted(rng.randrange(1, 10**6) for _ in range(n))
    for q in (0.0, 0.01, 0.1, 0.25, 0.5, 0.9, 0.99, 0.999, 1.0):
        assert harness.percentile(values, q) == pytest.approx(numpy.percentile(values, q * 100))


def test_percentile_input_errors(harness: ModuleType) -> None:
    assert numpy.isnan(harness.percentile([], 0.5))
    with pytest.raises(ValueError, match="within"):
        harness.percentile([1, 2], 50)


def test_paired_ratios_and_rotations(harness: ModuleType) -> None:
    ratio = harness.paired([10.0, 30.0, 8.0], [5.0, 10.0, 8.0])
    assert ratio["per_round"] == [2.0, 3.0, 1.0]
    assert (ratio["median"], ratio["min"], ratio["max"]) == (2.0, 1.0, 3.0)
    orders = [order for _, order in harness.rotations(["a", "b", "c"], 4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


WRK_OUTPUT = """\
Running 1s test @ http://127.0.0.1:18777/
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     4.49ms    4.78ms  47.61ms   89.85%
    Req/Sec     1.09k   315.50     1.43k    70.00%
  Latency Distribution
     50%  812.00us
     75%    5.12ms
     90%    9.32ms
     99%    1.02s
  1092 requests in 1.01s, 554.53KB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 1090
Requests/sec:   1080.95
Transfer/sec:    548.92KB
"""


def test_wrk_output_is_read_in_milliseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    asgi_middleware = importlib.import_module("asgi_middleware")
    requests, seconds, rate, non_2xx, errors, latency = asgi_middleware.parse_wrk(WRK_OUTPUT)
    assert (requests, seconds, rate, non_2xx, errors) == (1092, 1.01, 1080.95, 1090, 3)
    assert latency == pytest.approx({"p50": 0.812, "p75": 5.12, "p90": 9.32, "p99": 1020.0})
