"""`engine serve` against the engine in-process: the same Poisson requests at three rates, through HTTP (the
`openai` client streaming from a server subprocess) and through `engine.harness.served_run.serve` (no HTTP), side by
side: throughput, TTFT and TPOT percentiles, and the server's cost per token (TPOT p50 served less in-process).

Both engines run SmolLM2-135M (fp32 weights, bf16 KV, one thread: a step that waits for two threads on a
2-core machine is at the mercy of the load generator beside it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

from engine.core.metrics import summarize
from engine.harness.launch import serve_subprocess
from engine.harness.served_run import ServeRequest, serve_requests
from engine.llm import LLM
from planner.endpoint.client import Client, serve_workload, synthetic_prompt
from planner.simulation.workload import LengthDistribution, Workload

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
ENGINE = dict(model="smollm2-135m", weights="fp32", kv_dtype="bf16", device="cpu", kv_cache_gib=0.25, num_threads=1)
SERVE_FLAGS = ["--model", "smollm2-135m", "--weights", "fp32", "--kv-dtype", "bf16", "--device", "cpu",
               "--memory-gib", "0.25", "--threads", "1"]
METRICS = ("output_tokens_per_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")


def served_over_http(url: str, workload: Workload, vocab_size: int) -> dict:
    async def run() -> list:
        client = Client(url, "smollm2-135m")
        try:
            return await serve_workload(client, workload.requests(), vocab_size)
        finally:
            await client.close()
    return summarize(asyncio.run(run()))


def served_in_process(llm: LLM, workload: Workload) -> dict:
    rng = np.random.default_rng(1)
    requests = [ServeRequest(spec.arrival_s, synthetic_prompt(spec.prompt_tokens, llm.model_config.vocab_size, rng),
                             spec.output_tokens) for spec in workload.requests()]
    return summarize(serve_requests(llm, requests, clock="wall").timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    llm = LLM(**ENGINE)
    rows = []
    with serve_subprocess(SERVE_FLAGS) as url:
        for rate in args.rates:
            workload = Workload("poisson", args.requests, rate=rate, prompt=LengthDistribution("fixed", 64),
                                output=LengthDistribution("fixed", 32), seed=0)
            engine = served_in_process(llm, workload)
            http = served_over_http(url, workload, llm.model_config.vocab_size)
            rows.append({"rate": rate, "in_process": {k: engine[k] for k in METRICS},
                         "served": {k: http[k] for k in METRICS},
                         "overhead_ms_per_token": round(1e3 * (http["tpot_p50_s"] - engine["tpot_p50_s"]), 3),
                         "tpot_ratio": round(http["tpot_p50_s"] / engine["tpot_p50_s"], 4),
                         "ttft_ratio": round(http["ttft_p50_s"] / engine["ttft_p50_s"], 4)})
    out = sys.stderr if args.json else sys.stdout
    print(f"{'rate':>5} | {'tok/s in-proc':>13} {'served':>8} | {'TTFT p50 in-proc':>16} {'served':>8} | "
          f"{'TPOT p50 in-proc':>16} {'served':>8} | {'ms/token':>8}", file=out)
    for row in rows:
        engine, http = row["in_process"], row["served"]
        print(f"{row['rate']:5.2f} | {engine['output_tokens_per_s']:13.2f} {http['output_tokens_per_s']:8.2f} | "
              f"{1e3 * engine['ttft_p50_s']:14.1f}ms {1e3 * http['ttft_p50_s']:6.1f}ms | "
              f"{1e3 * engine['tpot_p50_s']:14.1f}ms {1e3 * http['tpot_p50_s']:6.1f}ms | "
              f"{row['overhead_ms_per_token']:8.2f}", file=out)
    result = {"requests_per_rate": args.requests, "prompt_tokens": 64, "output_tokens": 32, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serve.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
