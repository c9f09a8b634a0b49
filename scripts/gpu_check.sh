#!/usr/bin/env bash
# The trainer on a CUDA machine in a few minutes: a random model of Qwen3-0.6B's shape trained from generated
# batches at seq 4096 and 16384, bf16 with fp32 master weights, chunked scoring, activation checkpointing off and on;
# pass/fail, tokens/s, MFU and peak GPU memory per item, then a JSON summary (benchmarks/gpu_check.py). Needs torch
# and transformers, not vLLM. Then the weights' delta codec on the GPU, and relayed weights to 2 stand-in replicas
# over NCCL (needs 3 GPUs; skipped otherwise). Where vLLM is installed too, 3 RL steps of the tiny model end to end
# on the GPU follow.
#
#   scripts/gpu_check.sh [--seq 4096 16384] [--peak-tflops N] [--receivers 2]      (summary also in gpu_check.json)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
status=0
timeout 480 "$PY" -m benchmarks.gpu_check --json "${GPU_CHECK_JSON:-gpu_check.json}" "$@" || status=$?
if "$PY" -c "import vllm" 2>/dev/null; then
  run_dir="$(mktemp -d -t primerl-gpu-rl-XXXXXX)"
  if timeout 900 "$PY" -m primerl.train +experiment=reverse_text sft.enabled=false inference.device=cuda \
      trainer.max_steps=3 eval.every=0 orchestrator.batch_size=16 orchestrator.group_size=4 inference.port=0 \
      ledger.enabled=false "hydra.run.dir=$run_dir"; then
    echo "PASS 3 RL steps end to end on the GPU ($run_dir)"
  else
    echo "FAIL 3 RL steps end to end on the GPU (logs: $run_dir/logs)"; status=1
  fi
else
  echo "SKIP the RL steps end to end: vLLM is not installed here"
fi
exit "$status"
