#!/usr/bin/env bash
# The GPU checks in one command, for any CUDA machine; finishes within 8 minutes on an H200.
#   1. the CUDA tests (tests/gpu): every Triton kernel against its torch oracle, the engine on CUDA;
#   2. kernel microbenchmarks (bench/quant.py --kernels): W4A16 and FP8 attention in GB/s;
#   3. engine profiles: SmolLM2-135M's shape and a Llama-3.1-8B-shaped model cut to 4 layers (the
#      calibration's efficiencies scale it to the full model), random weights, BF16 and FP8 KV, INT4;
#      Kimi K2.6 at full width (7168 hidden, 384 experts, INT4 experts as it ships) cut to the 12 layers that
#      fit one H200 (about 9.8 GB a MoE layer, 4.7 GB of embeddings and head); GLM 5.2 at full width (6144
#      hidden, 256 experts, sparse attention with index_topk 2048) cut to the layers that fit one H200 with the
#      float copy of one layer being quantized beside them (INT4: 22 layers, 101 GiB; FP8: 12 layers, 91 GiB), at
#      contexts below and above index_topk.
# PARTS selects what runs (default "tests bench profiles glm"): a tool that caps one command at 10 minutes can
# run "tests bench profiles" and "glm" as two calls.
# Results go under $OUT when it is set (the lent-GPU tool), else bench/results/ and planner/profiles/.
# Usage: scripts/gpu_check.sh            (PY=python3 by default; .whl/ wheels are installed if present)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
RESULTS=${OUT:-bench/results}
PROFILES=${OUT:-planner/profiles}
mkdir -p "$RESULTS" "$PROFILES"
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
status=0
PARTS=${PARTS:-tests bench profiles glm}
wants() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi -L || true

if wants tests; then
  echo "== CUDA tests"
  timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$RESULTS/gpu_tests.log" || status=1
fi

if wants bench; then
  echo "== kernel microbenchmarks"
  timeout 90 "$PY" bench/quant.py --kernels --json --out "$RESULTS/quant_kernels_cuda.json" || status=1
fi

if wants profiles; then
echo "== engine profiles"
LLAMA_CUT=/tmp/llama-3.1-8b-4layers.json
"$PY" - "$LLAMA_CUT" <<'PYEOF'
import json, sys
config = json.load(open("planner/data/model-configs/llama-3.1-8b.json"))
config["num_hidden_layers"] = 4
json.dump(config, open(sys.argv[1], "w"))
PYEOF
profile() {   # name model weights kv
  timeout 75 "$PY" -m engine.cli profile --model "$2" --weights "$3" --kv-dtype "$4" --device cuda \
    --prefill-tokens 16 64 256 1024 4096 --batches 1 4 16 64 256 --contexts 128 1024 8192 32768 \
    --repeats 5 --out "$PROFILES/cuda-$1-$3-kv$4.profile.json" --json || status=1
}
profile smollm2-135m planner/data/model-configs/smollm2-135m.json bf16 bf16
profile smollm2-135m planner/data/model-configs/smollm2-135m.json int4 fp8
profile llama-3.1-8b-4layers "$LLAMA_CUT" bf16 bf16
profile llama-3.1-8b-4layers "$LLAMA_CUT" bf16 fp8
timeout 100 "$PY" -m engine.cli profile --model planner/data/model-configs/kimi-k2.6.json --num-layers 12 \
  --weights native --kv-dtype bf16 --device cuda --prefill-tokens 16 64 256 1024 --batches 1 4 16 64 \
  --contexts 128 1024 8192 --repeats 3 --out "$PROFILES/cuda-kimi-k2.6-12layers-native-kvbf16.profile.json" \
  --json || status=1
fi

if wants glm; then
  echo "== GLM 5.2 profiles (sparse attention)"
  for cut in int4:22 fp8:12; do
    weights=${cut%:*} layers=${cut#*:}
    timeout 200 "$PY" -m engine.cli profile --model planner/data/model-configs/glm-5.2.json --num-layers $layers \
      --weights $weights --kv-dtype bf16 --device cuda --prefill-tokens 16 256 1024 4096 --batches 1 4 16 64 \
      --contexts 256 1024 2048 4096 8192 16384 --repeats 3 \
      --out "$PROFILES/cuda-glm-5.2-${layers}layers-$weights-kvbf16.profile.json" --json || status=1
  done
fi
exit $status
