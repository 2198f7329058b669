"""Profiles Kimi K2.6 at full width (hidden 7168, 64 heads, MLA 512 + 64, experts of 2048, the 163840-token
head) cut to 2 layers (the dense first one, one MoE layer) and 16 routed experts, as it ships (INT4 g32
experts, the rest in the compute dtype: fp32 on CPU), BF16 latent pages, random weights; then calibrates.

A CPU step of this model reads 7-8 GB (the head alone is 4.7 GB in fp32) and a prefill of 128 tokens does
~0.6 TFLOP, so the sweep stays small: prompts up to 128 tokens, batches up to 16, contexts up to 512.
Run on an otherwise idle machine (about 15 minutes, 13 GB of memory):

    .venv/bin/python scripts/make_kimi_cpu_profile.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.harness.profiler import Profiler, SweepPlan
from engine.llm import LLM

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "planner" / "data" / "model-configs" / "kimi-k2.6.json"
NAME = REPO / "planner" / "profiles" / "cpu-kimi-k2.6-2layers-16experts-native-kvbf16"
PLAN = SweepPlan(prefill_tokens=(16, 32, 64, 128), multi_prefills=((64, 2), (128, 4)),
                 decode_batches=(1, 2, 4, 8, 16), decode_contexts=(64, 256, 512),
                 mixed=((2, 128, 32), (4, 256, 64), (8, 128, 64, 4), (16, 64, 96)), warmup=1, repeats=3)


def main() -> None:
    os.chdir(REPO)                      # the profile records the config's path: relative to the checkout
    llm = LLM(model=str(CONFIG.relative_to(REPO)), num_layers=2, num_experts=16, weights="native", kv_dtype="bf16", device="cpu",
              num_threads=1, kv_cache_gib=0.05, max_num_seqs=32, max_num_batched_tokens=256)
    profile = Profiler(llm, PLAN).run()
    profile_path = Path(f"{NAME}.profile.json")
    profile_path.write_text(json.dumps(profile, indent=1) + "\n")
    calibration = Path(f"{NAME}.calibration.json")
    made = subprocess.run([sys.executable, "-m", "planner.cli", "calibrate", str(profile_path), "--out",
                           str(calibration), "--json"], cwd=REPO)
    sys.exit(made.returncode)


if __name__ == "__main__":
    main()
