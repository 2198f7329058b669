"""Chaos soak of `engine serve` (CPU, SmolLM2): thousands of requests from 64 `openai` async clients, hung-up
streams, malformed and over-limit requests, wrong keys, integrity faults and a SIGTERM at the end; prints the
table and writes bench/results/soak.json. Exit status 1 when anything did not hold (engine.harness.soak)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.harness.soak import SoakConfig, run_soak
from engine.harness.soak_verdict import table

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = parser.parse_args()
    report = run_soak(SoakConfig(requests=args.requests, clients=args.clients, faults=args.faults, seed=args.seed))
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    sys.exit(1 if report["failures"] else 0)


if __name__ == "__main__":
    main()
