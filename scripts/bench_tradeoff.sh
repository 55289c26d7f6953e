#!/usr/bin/env bash
# Throughput / latency trade-off of jaxserve's batching knobs on the default model:
# one server per (max_num_seqs, max_num_batched_tokens) setting, a concurrency sweep against each,
# all points into one JSON, and the curve as a PNG.
#   bash scripts/bench_tradeoff.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-docs/results}
mkdir -p "$OUT"
rm -f "$OUT/tradeoff.json"
for setting in "4 64" "16 256" "64 512"; do
  read -r seqs tokens <<<"$setting"
  $PY -m jaxserve.serve --http-port 8077 --grpc-port 50077 --max-num-seqs "$seqs" \
      --max-num-batched-tokens "$tokens" --max-model-len 1024 --log-level warning &
  pid=$!
  trap 'kill "$pid" 2>/dev/null || true' EXIT  # never leave a server behind if a run fails
  for _ in $(seq 300); do curl -sf http://127.0.0.1:8077/health >/dev/null && break; sleep 1; done
  $PY scripts/benchmark.py --backend openai --base-url http://127.0.0.1:8077 --workload random \
      --num-prompts 48 --input-len 32-128 --output-len 16-64 --max-concurrency 4,16,48 \
      --label "max_num_seqs=$seqs, max_num_batched_tokens=$tokens" --out "$OUT/tradeoff.json"
  kill -TERM "$pid"; wait "$pid" || true
done
$PY scripts/benchmark.py --plot-only --plot "$OUT/tradeoff.png" --out "$OUT/tradeoff.json"
