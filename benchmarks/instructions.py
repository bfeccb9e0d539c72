"""Client instructions per decision (callgrind), for comparing two trees of the code.

Run: ``.venv/bin/python benchmarks/instructions.py [--hits 2000] [--baseline REV]``

Each case runs in a child process under ``valgrind --tool=callgrind`` twice, with N and 2N
allowed hits after the same warm-up, against one private server; the difference over N is the
instructions one hit costs the client (start-up, imports and the warm-up cancel out). Cases:
one blocking ``Limiter.hit`` at a time, and one ``AsyncLimiter.hit`` awaited at a time with
batching on and off. ``--baseline REV`` runs the same cases on a checkout of REV (a git worktree
in a temporary folder) and prints the ratio: a change that only moves code must cost nothing.
The blocking count is the same to a few instructions from run to run; the asyncio ones move by
a few percent with timing (how often the event loop wakes before a reply is there), so
``--rounds`` runs every case that many times, the trees alternating, and the table gives the
medians and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import Server, find_binary

VALGRIND = ("valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null")
ROOT = Path(__file__).resolve().parent.parent
CASES = ("blocking", "asyncio batched", "asyncio unbatched")

CHILD = """
import asyncio, sys
sys.path.insert(0, {src!r})
import ratekeeper
assert ratekeeper.__file__.startswith({src!r}), ratekeeper.__file__
from ratekeeper import AsyncLimiter, CircuitBreaker, Limiter, Policy

# Only public names, so that any revision runs it: every decision from the store (as
# _harness.store_only, whose import would need this tree's private modules).
never = 2**31
options = dict(
    failure_mode="raise", timeout=10.0, connect_timeout=10.0, deny_cache=0,
    breaker=CircuitBreaker(min_calls=never, consecutive_failures=never),
)
case, url, hits = {case!r}, {url!r}, {hits}
policy = Policy("bench", "1000000000/hour", "sliding_window")
identities = [f"user:{{i}}" for i in range(64)]
if case == "blocking":
    with Limiter.from_url(url, **options) as limiter:
        for i in range(200 + hits):
            assert limiter.hit(policy, identities[i % 64]).allowed
else:
    async def main():
        async with AsyncLimiter.from_url(
            url, batching=case.endswith(" batched"), **options
        ) as limiter:
            for i in range(200 + hits):
                assert (await limiter.hit(policy, identities[i % 64])).allowed
    asyncio.run(main())
"""


def instructions(src: Path, case: str, url: str, hits: int) -> int:
    """The instructions a child running ``hits`` hits (after the warm-up) executes."""
    child = CHILD.format(src=str(src), case=case, url=url, hits=hits)
    done = subprocess.run(
        [*VALGRIND, sys.executable, "-c", child],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONHASHSEED": "0"},  # the same dict layouts in every child
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or found is None:
        raise SystemExit(f"{case} on {src}: the child failed\n{done.stderr[-3000:]}")
    return int(found.group(1))


def per_hit(src: Path, case: str, url: str, hits: int) -> float:
    return (instructions(src, case, url, 2 * hits) - instructions(src, case, url, hits)) / hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hits", type=int, default=2000)
    parser.add_argument("--baseline", help="a git revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = {"this tree": ROOT / "src"}
    with tempfile.TemporaryDirectory() as scratch, Server(find_binary()) as server:
        if args.baseline:
            checkout = Path(scratch) / "baseline"
            subprocess.run(
                [
                    "git",
                    "-C",
                    str(ROOT),
                    "worktree",
                    "add",
                    "--detach",
                    str(checkout),
                    args.baseline,
                ],
                check=True,
                capture_output=True,
            )
            trees = {args.baseline: checkout / "src", **trees}
        try:
            rows: dict[str, dict[str, list[float]]] = {
                case: {name: [] for name in trees} for case in CASES
            }
            for round_ in range(args.rounds):
                order = list(trees.items())[:: 1 if round_ % 2 == 0 else -1]
                for case in CASES:
                    for name, tree in order:
                        rows[case][name].append(per_hit(tree, case, server.url, args.hits))
        finally:
            if args.baseline:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(checkout)],
                    check=True,
                )
    names = list(trees)
    print(
        f"instructions per hit ({args.hits} hits, callgrind, medians of {args.rounds} rounds): "
        + " | ".join(names)
    )
    for case, row in rows.items():
        cells = "  ".join(f"{statistics.median(row[name]):>10,.0f}" for name in names)
        ratio = ""
        if len(names) == 2:
            ratios = [new / old for old, new in zip(row[names[0]], row[names[1]], strict=True)]
            ratio = (
                f"  {statistics.median(ratios):.4f}x (rounds {min(ratios):.4f}-{max(ratios):.4f})"
            )
        print(f"{case:<18} {cells}{ratio}")


if __name__ == "__main__":
    main()
