"""A custom policy process for the end-to-end tests: proposes the given world sizes to
a running job, one after the other, through :class:`phalanx.policy.PolicyClient`, and
prints each answer as one JSON line.

    python -m tests.workers.propose --job J 5 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from phalanx.policy import PolicyClient


async def propose(job: str, sizes: list[int]) -> None:
    async with await PolicyClient.connect(name="test-policy") as client:
        for size in sizes:
            d = await client.propose(job, size, f"the test asks for {size}", timeout_s=20)
            print(json.dumps({"size": size, "action": d.action.value, "reason": d.reason}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", required=True)
    ap.add_argument("sizes", type=int, nargs="+")
    args = ap.parse_args()
    asyncio.run(propose(args.job, args.sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
