#!/usr/bin/env bash
# Remakes the committed CPU profiles of SmolLM2-135M (one per weights/KV combination) and their
# calibrations, under planner/profiles/. Run on an otherwise idle machine: about 20 minutes on 2 cores.
# Left out on CPU: bf16 weights (they compute in bf16, which this CPU emulates: 7x slower than fp32 and
# erratic) and fp8 weights (widened to fp32 every step on CPU: about 1 s a step whatever the batch).
# Every CPU combination computes in fp32. Steps reading more than 16K cached tokens are left out: there a
# CPU step takes seconds (FP8 and BF16 pages convert every element) and leaves the last-level cache; the
# calibrations describe the engine where a CPU serves it. A profile whose fit is refused (above 15% in a
# regime) gets no calibration and is not committed: fp32/fp32 (17.1% prefill: small prefills of 16-128
# tokens cost more than the fitted rates say) and native/fp32 (29.4% prefill: Q4_1 groups of 32 widen at a
# rate that varies with the step) were refused on 2026-12-01. With seeded decodes reading real K/V (same
# day, later) fp32/fp8 was remade; int4/fp8 (24.1% mixed) and native/fp8 (18.9% prefill) refits were refused
# twice, so their committed profiles are still the earlier ones, whose decode points read zero pages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=planner/profiles
COMBOS=${COMBOS:-"fp32:fp32 fp32:bf16 fp32:fp8 int4:fp32 int4:fp8 native:fp32 native:fp8"}
for combo in $COMBOS; do
  weights=${combo%%:*}; kv=${combo##*:}
  name="$OUT/cpu-smollm2-135m-$weights-kv$kv"
  # SmolLM2's widths (576, 1536) take INT4 groups of 64, not the default 128
  "$PY" -m engine.cli profile --model smollm2-135m --device cpu --weights "$weights" --kv-dtype "$kv" --group-size 64 \
    --memory-gib 2 --prefill-tokens 16 32 64 128 256 512 1024 --batches 1 2 4 8 16 32 64 128 256 --contexts 64 256 1024 4096 \
    --max-kv-tokens 16384 --repeats 3 --out "$name.profile.json" --json
done
for profile in "$OUT"/cpu-smollm2-135m-*.profile.json; do     # a refused fit is reported, not fatal
  "$PY" -m planner.cli calibrate "$profile" --out "${profile%.profile.json}.calibration.json" --json || true
done
