#!/usr/bin/env bash
# The concurrency sweep (perf_analyzer over gRPC streaming): the same as `make sweep`, whose
# implementation is perf/sweep.py; this entry point keeps the environment-variable form working.
#
#   make perf-deps                                        # once: installs .venv/bin/perf_analyzer
#   CONCURRENCY=1:32:4 MAX_TOKENS=128 URL=localhost:8001 perf/perf_analyzer_sweep.sh
#
# Settings (environment, or the same flags in lower case): URL (localhost:8001), MODEL (llm),
# CONCURRENCY (1:8:1, start:end:step), REQUESTS (32 per concurrency), MAX_TOKENS (64),
# PROMPT_WORDS (128), OUT_DIR (perf/results: sweep.csv, sweep.png).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[[ -x "$PYTHON" ]] || PYTHON=python3
exec "$PYTHON" perf/sweep.py "$@"
