"""Client instructions per decision (callgrind), for comparing two trees of the code.

Run: ``.venv/bin/python benchmarks/instructions.py [--hits 2000] [--baseline REV]``

Each case runs in a child process under ``valgrind --tool=callgrind`` twice, with N and 2N
allowed hits after the same warm-up, against one private server; the difference over N is the
instructions one hit costs the client (start-up, imports and the warm-up cancel out). Cases:
one blocking ``Limiter.hit`` at a time, and one ``AsyncLimiter.hit`` awaited at a time with
batching on and off. ``--baseline REV`` runs the same cases on a checkout of REV (a git worktree
in a temporary folder) and prints the ratio: a change that only moves code must cost nothing.
Instruction counts do not depend on the machine's load, so one run is enough.
"""

from __future__ import annotations

import argparse
import os
import re
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
sys.path.insert(0, {benchmarks!r})
from _harness import store_only
import ratekeeper
assert ratekeeper.__file__.startswith({src!r}), ratekeeper.__file__
from ratekeeper import AsyncLimiter, Limiter, Policy

case, url, hits = {case!r}, {url!r}, {hits}
policy = Policy("bench", "1000000000/hour", "sliding_window")
identities = [f"user:{{i}}" for i in range(64)]
if case == "blocking":
    with Limiter.from_url(url, **store_only()) as limiter:
        for i in range(200 + hits):
            assert limiter.hit(policy, identities[i % 64]).allowed
else:
    async def main():
        async with AsyncLimiter.from_url(
            url, batching=case.endswith(" batched"), **store_only()
        ) as limiter:
            for i in range(200 + hits):
                assert (await limiter.hit(policy, identities[i % 64])).allowed
    asyncio.run(main())
"""


def instructions(src: Path, case: str, url: str, hits: int) -> int:
    """The instructions a child running ``hits`` hits (after the warm-up) executes."""
    child = CHILD.format(
        src=str(src), benchmarks=str(ROOT / "benchmarks"), case=case, url=url, hits=hits
    )
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
            rows = {
                case: {
                    name: per_hit(tree, case, server.url, args.hits) for name, tree in trees.items()
                }
                for case in CASES
            }
        finally:
            if args.baseline:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(checkout)],
                    check=True,
                )
    names = list(trees)
    print(f"instructions per hit ({args.hits} hits, callgrind): " + " | ".join(names))
    for case, row in rows.items():
        cells = "  ".join(f"{row[name]:>10,.0f}" for name in names)
        ratio = f"  {row[names[-1]] / row[names[0]]:.4f}x" if len(names) == 2 else ""
        print(f"{case:<18} {cells}{ratio}")


if __name__ == "__main__":
    main()
