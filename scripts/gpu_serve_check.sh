#!/usr/bin/env bash
# The serving paths that need a GPU, on a CUDA machine with vLLM: 3 RL steps of the tiny model (bf16) each with
# fp8 weights and KV cache (inference=vllm_fp8), prefill/decode through NixlConnector (needs the `nixl` package)
# and through ExampleConnector, on one GPU shared by every server and the trainer. Prints PASS/FAIL/SKIP per item
# with step 0's mismatch KL (the trainer's log-probs against vLLM's on the same policy: ~1e-12 exact, ~1e-3 for
# fp8) and the generation throughput, and exits 1 if any item failed. The CPU runs of the same code are
# tests/test_pd.py and tests/test_inference.py.
#
#   scripts/gpu_serve_check.sh            (about 5 minutes; logs under the printed run directories)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
if ! "$PY" -c "import torch, vllm; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "SKIP everything: this check needs a CUDA GPU and vLLM"; exit 0
fi
status=0
COMMON=(+experiment=reverse_text sft.enabled=false model.dtype=bfloat16 inference.device=cuda inference.port=0
  inference.gpu_memory_utilization=0.25 launcher.share_gpu=true trainer.max_steps=3 eval.every=0
  orchestrator.batch_size=16 orchestrator.group_size=4 ledger.enabled=false)

report() {  # NAME RUN_DIR: step 0's mismatch KL and the median completion tokens/s of the run
  "$PY" - "$1" "$2" <<'PY'
import json, statistics, sys
from primerl.metrics import read_metrics
name, run = sys.argv[1], sys.argv[2]
trainer, orch = read_metrics(run, "trainer"), read_metrics(run, "orchestrator")
rate = statistics.median(r["throughput/completion_tokens_per_s"] for r in orch)
print(f"PASS {name}: mismatch KL at step 0 {trainer[0]['mismatch_kl']:.2e}, {rate:.0f} completion tokens/s ({run})")
PY
}

check() {  # NAME OVERRIDES...: 3 RL steps with the overrides
  local name="$1"; shift
  local run_dir; run_dir="$(mktemp -d -t primerl-gpu-serve-XXXXXX)"
  if timeout 900 "$PY" -m primerl.train "${COMMON[@]}" "$@" "hydra.run.dir=$run_dir" > "$run_dir.log" 2>&1; then
    report "$name" "$run_dir" || { echo "FAIL $name: no metrics ($run_dir)"; status=1; }
  else
    echo "FAIL $name (logs: $run_dir/logs, $run_dir.log)"; status=1
  fi
}

check "fp8 weights and KV cache" inference=vllm_fp8
if "$PY" -c "import nixl" 2>/dev/null; then
  check "prefill/decode, NixlConnector" inference.pd.enabled=true inference.pd.kv_connector=NixlConnector
else
  echo "SKIP prefill/decode with NixlConnector: the nixl package is not installed (pip install nixl)"
fi
check "prefill/decode, ExampleConnector" inference.pd.enabled=true inference.pd.kv_connector=ExampleConnector
exit "$status"
