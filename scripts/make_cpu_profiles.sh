#!/usr/bin/env bash
# Remakes the committed CPU profiles of SmolLM2-135M (one per weights/KV combination) and their
# calibrations, under planner/profiles/. Run on an otherwise idle machine: about 50 minutes (the prefix points,
# prefills over up to 8K cached tokens, take half of it).
# The engine runs on one thread (a step that waits for two threads on a shared 2-core VM is at the mercy of
# anything else that runs), computes in fp32, and no step reads more than 16K cached tokens (past that a
# CPU step takes seconds and leaves the last-level cache). Left out on CPU: bf16 weights (emulated: 7x
# slower than fp32 and erratic) and fp8 weights (widened to fp32 every step: about 1 s whatever the batch).
# A profile whose fit is refused (above 15% in a regime) gets no calibration file and is not committed;
# `planner calibrate` prints why.
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
    --threads 1 --memory-gib 2 --prefill-tokens 16 32 64 128 256 512 1024 \
    --batches 1 2 4 8 12 16 24 32 64 128 256 --contexts 64 256 1024 4096 \
    --max-kv-tokens 16384 --repeats 3 --out "$name.profile.json" --json
done
for profile in "$OUT"/cpu-smollm2-135m-*.profile.json; do     # a refused fit is reported, not fatal
  calibration="${profile%.profile.json}.calibration.json"
  rm -f "$calibration"
  "$PY" -m planner.cli calibrate "$profile" --out "$calibration" --json || true
done
