# Load tools against a running server (`make serve` in another terminal). Included from the
# Makefile, which defines VENV, PY and `setup`; `perf-deps` (perf_analyzer) is in mk/serve.mk.
#
#   make sweep       perf_analyzer, gRPC streaming, one run per concurrency (perf/sweep.py):
#                    $(RESULTS)/sweep.csv and sweep.png (output tok/s, TTFT, inter-token latency)
#   make sweep CONCURRENCY=1:32:4 REQUESTS=64 MAX_TOKENS=128 URL=localhost:8001
#   make loadtest    locust, headless, HTTP streaming for DURATION (perf/locustfile.py):
#                    $(RESULTS)/loadtest_stats.csv (rows TTFT, ITL, E2E) and loadtest.html
#   make loadtest USERS=16 SPAWN_RATE=4 DURATION=2m URL=http://localhost:8000
#
# Every request asks for exactly MAX_TOKENS tokens, with a prompt of PROMPT_WORDS random words.
#
#   make flashmla-wheel   the FlashMLA wheel (the peer of perf/bench_kernels.py) into .whl/, to
#                         carry to the GPU machine with perf/device_check.sh

CONCURRENCY ?= 1:8:1
REQUESTS ?= 32
MAX_TOKENS ?= 64
PROMPT_WORDS ?= 128
USERS ?= 8
SPAWN_RATE ?= 2
DURATION ?= 60s
RESULTS ?= perf/results
# perf_analyzer speaks gRPC, the locustfile HTTP: each target has its own default URL.
sweep: URL ?= localhost:8001
loadtest: URL ?= http://localhost:8000

FLASHMLA_WHEEL ?= sgl-flash-mla==1.0.0

.PHONY: sweep loadtest flashmla-wheel

flashmla-wheel: setup
	$(VENV)/bin/pip download --quiet --no-deps --only-binary :all: --dest .whl '$(FLASHMLA_WHEEL)'

sweep: perf-deps
	$(PY) perf/sweep.py --url '$(URL)' --concurrency '$(CONCURRENCY)' --requests '$(REQUESTS)' \
		--max-tokens '$(MAX_TOKENS)' --prompt-words '$(PROMPT_WORDS)' --out-dir '$(RESULTS)' \
		--perf-analyzer '$(PA_WRAPPER)'

# URL may leave out http://. --stop-timeout lets the streams in flight at the end finish.
loadtest: setup
	mkdir -p '$(RESULTS)'
	host='$(URL)' && case "$$host" in *://*) ;; *) host="http://$$host" ;; esac && \
	PERF_MAX_TOKENS='$(MAX_TOKENS)' PERF_PROMPT_WORDS='$(PROMPT_WORDS)' $(VENV)/bin/locust \
		-f perf/locustfile.py --host "$$host" --headless --only-summary \
		-u '$(USERS)' -r '$(SPAWN_RATE)' -t '$(DURATION)' --stop-timeout 120 \
		--csv '$(RESULTS)/loadtest' --html '$(RESULTS)/loadtest.html'
