#!/usr/bin/env bash
# tritonserver + the engine on the GPU device machine, measured against the engine directly.
#
#   bash perf/gpu_serve.sh               # on the device (run from the repository root)
#   bash perf/gpu_serve.sh --cpu-smoke   # here: the bundle's server, default model, tiny sizes
#
# Needs `.gpubundle/` (perf/make_gpu_bundle.py) and the tokenizer files of
# models/smollm2-135m-instruct. Steps:
#  1. unpack the trimmed server (.gpubundle/tritonserver.tar.xz) and put it on PYTHONPATH, where
#     engine.serving.install.find_tritonserver() finds it through `import pytriton` and prepares
#     the backends folder and LD_LIBRARY_PATH (the bundle's libraries, the interpreter's libpython);
#     install the client wheels with pip --no-index --target /tmp/site (device only);
#  2. the model: a random DeepSeek-V2-Lite checkpoint (perf/write_v2lite_checkpoint.py) on the
#     device, the default SmolLM2 model in the smoke run;
#  3. `python3 -m engine.serve` with LLM_MODEL and LLM_ settings, wait until ready;
#  4. perf/serve_bench.py over gRPC at each concurrency, stop the server, then the same requests
#     through AsyncEngine in-process (engine-direct);
#  5. under $OUT (at most 8 files): server.json, engine.json, summary.json, logs.tar.gz (with
#     cpu_<target>.txt: the busiest threads each second of each benchmark, perf/cpu_sampler.py),
#     and the server's rows as sweep.csv and sweep.png (perf/sweep.py's plot).
# Settings (environment): TARGETS (server,engine; leave engine out to skip 4b; add server_inproc
# for a second server run with the engine inside the stub, LLM_ENGINE_PROCESS=false, written to
# server_inproc.json; add server_b for a run with the settings in SERVER_B_ENV, e.g.
# "LLM_ENGINE_PROCESS=false", written to server_b.json; add engine_process for the requests
# through EngineProcess without Triton, engine_process.json; add engine_process_pinned for the
# same with the bench and the engine's child on GPU 0's local CPUs), CONCURRENCY, PROMPT_TOKENS,
# MAX_TOKENS, REQUESTS_PER_WORKER, MIN_REQUESTS (per level: more per worker at a low
# concurrency, e.g. 32 for a steadier TTFT at 1), V2LITE_LAYERS (cut the checkpoint's depth),
# READY_TIMEOUT, any LLM_<FIELD>.
set -uo pipefail

MODE=gpu
[ "${1:-}" = "--cpu-smoke" ] && MODE=cpu
ROOT=$(pwd)
OUT=${OUT:-/tmp/gpu_serve_out}
WORK=${WORK:-/tmp/gpuserve}
LOGS=$WORK/logs
rm -rf "$WORK" && mkdir -p "$OUT" "$LOGS" "$WORK/triton"
exec > >(tee "$LOGS/gpu_serve.log") 2>&1

if [ "$MODE" = cpu ]; then
  PY=${PY:-$ROOT/.venv/bin/python}
  : "${CONCURRENCY:=1,2}" "${PROMPT_TOKENS:=16}" "${MAX_TOKENS:=8}" "${REQUESTS_PER_WORKER:=1}"
  export LLM_MODEL=${LLM_MODEL:-$ROOT/models/smollm2-135m-instruct}
  export LLM_MAX_TOTAL_TOKENS=${LLM_MAX_TOTAL_TOKENS:-4096} LLM_MAX_CONTEXT_LEN=${LLM_MAX_CONTEXT_LEN:-512}
else
  PY=${PY:-python3}
  : "${CONCURRENCY:=1,16,64}" "${PROMPT_TOKENS:=512}" "${MAX_TOKENS:=256}" "${REQUESTS_PER_WORKER:=2}"
  export LLM_MAX_RUNNING_REQUESTS=${LLM_MAX_RUNNING_REQUESTS:-128}
  export LLM_MAX_CONTEXT_LEN=${LLM_MAX_CONTEXT_LEN:-2048}
fi
: "${READY_TIMEOUT:=420}" "${TARGETS:=server,engine}"
PYV=$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
step() { echo "=== $(date +%T) $*"; }
# the busiest threads once a second while NAME's benchmark runs (perf/cpu_sampler.py)
sample_cpu() { $PY perf/cpu_sampler.py --out "$LOGS/cpu_$1.txt" & SAMPLER=$!; }
stop_cpu() { kill "$SAMPLER" 2>/dev/null; wait "$SAMPLER" 2>/dev/null; }

finish() {
  step "packing logs"
  { nvidia-smi; nvidia-smi topo -m; } >"$LOGS/nvidia-smi.txt" 2>&1 || true
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs
  ls -la "$OUT"
}
trap finish EXIT

step "1. server bundle (Python $PYV, mode $MODE)"
tar -xJf .gpubundle/tritonserver.tar.xz -C "$WORK/triton" || exit 1
STUBS=$WORK/triton/pytriton/tritonserver/python_backend_stubs
if [ "$MODE" = cpu ] && [ ! -f "$STUBS/$PYV/triton_python_backend_stub" ]; then
  # the bundle carries the device's stub (3.12); this venv needs its own version's
  venv_stub=$($PY -c 'import pathlib, pytriton; print(pathlib.Path(pytriton.__file__).parent)')
  mkdir -p "$STUBS/$PYV"
  cp "$venv_stub/tritonserver/python_backend_stubs/$PYV/triton_python_backend_stub" "$STUBS/$PYV/"
fi
SITE=/tmp/site
if [ "$MODE" = gpu ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .gpubundle/whl/*.whl || exit 1
fi
export PYTHONPATH=$WORK/triton:$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
LIBDIR=$($PY -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')
LD_LIBRARY_PATH=$WORK/triton/nvidia_pytriton.libs:$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
  ldd "$STUBS/$PYV/triton_python_backend_stub" "$WORK/triton/pytriton/tritonserver/bin/tritonserver" \
  >"$LOGS/ldd.txt" 2>&1
grep "not found" "$LOGS/ldd.txt" && echo "WARNING: libraries not found (see ldd.txt)"

step "1b. the server's own environment"
# The Python backend stub reads no PYTHONPATH: it embeds the environment of the first python3 on
# PATH (the launcher puts its own interpreter's folder first). Its pybind11 was built for numpy 1
# and misreads numpy 2's dtypes (every BYTES input copied with a zero stride: the stub died on the
# first request), and the device has numpy 2. So the server runs from a venv of its own: numpy 1
# in its site-packages (device only) beside links to every other entry of the device's
# site-packages. Left out with numpy: scipy and scikit-learn, built for numpy 2 (transformers'
# generation utilities import scikit-learn when it is installed, and its scipy fails on numpy 1).
SERVE_VENV=$WORK/serve-venv
$PY -m venv --without-pip "$SERVE_VENV" || exit 1
SERVE_SP=$("$SERVE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
SKIP='^$'
[ "$MODE" = gpu ] && SKIP='^(numpy|scipy|sklearn|scikit_learn)([-.]|$)'
$PY -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' \
  | sort -u | while read -r dir; do
    for entry in "$dir"/*; do
      name=$(basename "$entry")
      [[ $name =~ $SKIP || -e $SERVE_SP/$name ]] || ln -s "$entry" "$SERVE_SP/$name"
    done
  done
if [ "$MODE" = gpu ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$SERVE_SP" .gpubundle/server-whl/*.whl || exit 1
fi
SERVER_PY=$SERVE_VENV/bin/python
$SERVER_PY -c 'import numpy; print("server numpy", numpy.__version__, numpy.__file__)'
$SERVER_PY -m engine.serve --check || exit 1
step "1c. the engine's imports in the server's environment"
# What the stub will import, tried first, so that a failure shows its whole traceback (the stub's
# log shows only the last exception: transformers' lazy "Could not import module").
$SERVER_PY - <<'EOF' || exit 1
import sys, traceback
try:
    import numpy, torch
    from transformers import AutoTokenizer  # noqa: F401
    import engine.async_engine  # noqa: F401
except BaseException:
    traceback.print_exc()
    sys.exit(1)
print("imports ok: numpy", numpy.__version__, "torch", torch.__version__)
EOF

step "2. model"
if [ "$MODE" = gpu ]; then
  export LLM_MODEL=${LLM_MODEL:-/tmp/bench-v2lite}
  $PY perf/write_v2lite_checkpoint.py --out "$LLM_MODEL" ${V2LITE_LAYERS:+--layers $V2LITE_LAYERS} \
    || exit 1
fi
echo "LLM_MODEL=$LLM_MODEL"
env | grep '^LLM_' | sort

BENCH=(--concurrency "$CONCURRENCY" --prompt-tokens "$PROMPT_TOKENS" --max-tokens "$MAX_TOKENS"
  --requests-per-worker "$REQUESTS_PER_WORKER" --min-requests "${MIN_REQUESTS:-0}")
SERVER=""
stop_server() {
  [ -n "$SERVER" ] || return 0
  kill -TERM "$SERVER" 2>/dev/null || return 0
  for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || return 0; sleep 1; done
  kill -KILL "$SERVER" 2>/dev/null
}
trap 'stop_server; finish' EXIT

# serve NAME [sweep]: start `python -m engine.serve` (with the caller's LLM_ settings), wait until
# ready, run serve_bench over gRPC into $OUT/NAME.json (and the sweep plot), stop the server.
serve() {
  local name=$1 http grpc metrics t0 rc
  step "3. tritonserver ($name)"
  read -r http grpc metrics < <($PY -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])')
  $SERVER_PY -m engine.serve --http-port "$http" --grpc-port "$grpc" --metrics-port "$metrics" \
    >"$LOGS/$name.log" 2>&1 &
  SERVER=$!
  t0=$(date +%s)
  until $PY -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$http/v2/health/ready', timeout=2)" 2>/dev/null; do
    if ! kill -0 "$SERVER" 2>/dev/null; then echo "server exited"; tail -50 "$LOGS/$name.log"; return 1; fi
    if [ $(($(date +%s) - t0)) -gt "$READY_TIMEOUT" ]; then echo "not ready"; tail -50 "$LOGS/$name.log"; return 1; fi
    sleep 2
  done
  echo "ready after $(($(date +%s) - t0)) s (http $http, grpc $grpc)" | tee "$LOGS/${name}_ready.txt"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv >>"$LOGS/${name}_ready.txt" 2>&1 || true
  step "4a. serve_bench through tritonserver (gRPC, $name)"
  sample_cpu "$name"
  $PY perf/serve_bench.py --target server --url "127.0.0.1:$grpc" "${BENCH[@]}" \
    --metrics-url "http://127.0.0.1:$metrics/metrics" \
    --out "$OUT/$name.json" ${2:+--sweep-dir "$OUT"} 2>"$LOGS/bench_$name.err" >/dev/null
  rc=$?
  stop_cpu
  tail -5 "$LOGS/bench_$name.err"
  curl -s "http://127.0.0.1:$metrics/metrics" >"$LOGS/${name}_metrics.txt" 2>/dev/null || true
  stop_server
  SERVER=""
  return $rc
}

serve server sweep
RC_SERVER=$?
if [[ ,$TARGETS, == *,server_inproc,* ]]; then  # the engine inside the stub, for comparison
  LLM_ENGINE_PROCESS=false serve server_inproc || RC_SERVER=1
fi
if [[ ,$TARGETS, == *,server_b,* ]]; then  # an A/B: the same server with SERVER_B_ENV's settings
  (export ${SERVER_B_ENV:?server_b needs SERVER_B_ENV}; serve server_b) || RC_SERVER=1
fi
trap finish EXIT

RC_ENGINE=0
if [[ ,$TARGETS, == *,engine,* ]]; then
  step "4b. serve_bench engine-direct (AsyncEngine in this process)"
  sample_cpu engine
  $PY perf/serve_bench.py --target engine "${BENCH[@]}" \
    --out "$OUT/engine.json" 2>"$LOGS/bench_engine.err" >/dev/null
  RC_ENGINE=$?
  stop_cpu
  tail -5 "$LOGS/bench_engine.err"
fi

if [[ ,$TARGETS, == *,engine_process,* ]]; then
  step "4c. serve_bench through EngineProcess (the engine in a child process, no Triton)"
  sample_cpu engine_process
  $PY perf/serve_bench.py --target engine_process "${BENCH[@]}" \
    --out "$OUT/engine_process.json" 2>"$LOGS/bench_engine_process.err" >/dev/null || RC_ENGINE=1
  stop_cpu
  tail -5 "$LOGS/bench_engine_process.err"
fi

if [[ ,$TARGETS, == *,engine_process_pinned,* ]]; then
  # the same, with the bench and the engine's child on GPU 0's local CPUs (sysfs local_cpulist)
  LOCAL=$($PY -c 'from perf.cpu_sampler import gpu_local_cpus; print(gpu_local_cpus() or "")')
  step "4d. serve_bench through EngineProcess on CPUs ${LOCAL:-(unknown: not pinned)}"
  sample_cpu engine_process_pinned
  $PY -c 'import os, sys
from perf.cpu_sampler import parse_cpulist
if sys.argv[1]:
    cpus = parse_cpulist(sys.argv[1]) & os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
print("pinned to", sorted(os.sched_getaffinity(0)), file=sys.stderr)
os.execvp(sys.argv[2], sys.argv[2:])' "$LOCAL" $PY perf/serve_bench.py --target engine_process \
    "${BENCH[@]}" --out "$OUT/engine_process_pinned.json" \
    2>"$LOGS/bench_engine_process_pinned.err" >/dev/null || RC_ENGINE=1
  stop_cpu
  tail -5 "$LOGS/bench_engine_process_pinned.err"
fi

step "5. summary"
$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
res = {}
NAMES = ("server", "server_inproc", "server_b", "engine_process", "engine_process_pinned")
for name in NAMES + ("engine",):
    p = out / f"{name}.json"
    res[name] = json.loads(p.read_text()) if p.is_file() else None
rows = []
for name in NAMES:
    if not (res[name] and res["engine"]):
        continue
    eng = {r["concurrency"]: r for r in res["engine"]["rows"]}
    for s in res[name]["rows"]:
        e = eng.get(s["concurrency"])
        if not e:
            continue
        def div(a, b):
            return round(a / b, 3) if a is not None and b else None
        def sub(a, b):
            return round(a - b, 3) if a is not None and b is not None else None
        rows.append({
            "server": name,
            "concurrency": s["concurrency"],
            "server_tok_per_s": s["output_tok_per_s"], "engine_tok_per_s": e["output_tok_per_s"],
            "throughput_ratio": div(s["output_tok_per_s"], e["output_tok_per_s"]),
            "ttft_p50_overhead_ms": sub(s["ttft_p50_ms"], e["ttft_p50_ms"]),
            # the steadier figure: a p50 of a few dozen TTFTs moves by ms between runs
            "ttft_mean_overhead_ms": sub(s["ttft_mean_ms"], e["ttft_mean_ms"]),
            "itl_p50_server_ms": s["itl_p50_ms"], "itl_p50_engine_ms": e["itl_p50_ms"],
        })
summary = {"rows": rows}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
EOF
echo "rc server=$RC_SERVER engine=$RC_ENGINE"
[ "$RC_SERVER" = 0 ] && [ "$RC_ENGINE" = 0 ]
