#!/usr/bin/env bash
# Sweep concurrency against the running `llm` model with perf_analyzer over gRPC streaming.
#
#   make perf-deps                     # once: installs .venv/bin/perf_analyzer
#   perf/perf_analyzer_sweep.sh        # server from `make serve` on localhost:8001
#
# Settings (environment): URL (localhost:8001), MODEL (llm), CONCURRENCY (1:8:1, start:end:step),
# MAX_TOKENS (64), PROMPT_WORDS (128), REQUESTS (number counted per concurrency step, 32),
# OUT (perf/results/perf_analyzer.csv). Every request asks for exactly MAX_TOKENS tokens
# (min_tokens + ignore_eos), so runs are comparable.
set -euo pipefail
cd "$(dirname "$0")/.."

URL=${URL:-localhost:8001}
MODEL=${MODEL:-llm}
CONCURRENCY=${CONCURRENCY:-1:8:1}
MAX_TOKENS=${MAX_TOKENS:-64}
PROMPT_WORDS=${PROMPT_WORDS:-128}
REQUESTS=${REQUESTS:-32}
OUT=${OUT:-perf/results/perf_analyzer.csv}

PA=${PERF_ANALYZER:-}
if [[ -z "$PA" ]]; then
  if [[ -x .venv/bin/perf_analyzer ]]; then PA=.venv/bin/perf_analyzer
  elif command -v perf_analyzer >/dev/null; then PA=$(command -v perf_analyzer)
  else echo "perf_analyzer not found: run 'make perf-deps'" >&2; exit 2
  fi
fi

mkdir -p "$(dirname "$OUT")"
INPUT=$(mktemp --suffix=.json)
trap 'rm -f "$INPUT"' EXIT
# One request in perf_analyzer's input-data format (vllm_backend inputs).
python3 - "$INPUT" "$MAX_TOKENS" "$PROMPT_WORDS" <<'EOF'
import json, sys
path, max_tokens, words = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * (words // 9 + 1))
params = {"max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True}
request = {
    "text_input": [" ".join(prompt.split()[:words])],
    "stream": [True],
    "exclude_input_in_output": [True],
    "sampling_parameters": [json.dumps(params)],
}
json.dump({"data": [request]}, open(path, "w"))
EOF

echo "perf_analyzer: $PA -> $URL model=$MODEL concurrency=$CONCURRENCY max_tokens=$MAX_TOKENS"
"$PA" -m "$MODEL" -u "$URL" -i grpc --streaming \
  --input-data "$INPUT" \
  --concurrency-range "$CONCURRENCY" \
  --measurement-mode count_windows --measurement-request-count "$REQUESTS" \
  --stability-percentage 50 --max-trials 3 \
  -f "$OUT"
echo "results: $OUT"
