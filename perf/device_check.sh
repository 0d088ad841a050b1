#!/usr/bin/env bash
# Everything a GPU session checks on an H200: the tests that need CUDA (and the engine tests on
# the Triton backend), the kernel benchmark against FlashMLA, the offline engine benchmarks
# against transformers on a random SmolLM2-shaped Llama and on 8 layers of DeepSeek-V2-Lite's
# shape (about 6-8 minutes together), and bench_engine, the engine on the full V2-Lite shape
# phase by phase (143 s in a trial run, checkpoint writing included; at most 8 minutes). The
# device tool allows 10 minutes a command, so run bench_engine as a call of its own. Outputs land in $OUT (default perf/results/device).
#
# Through the device tool, from the repository root, carrying the FlashMLA wheel and the default
# tokenizer (the model's weights are too large to carry; the benchmarks use random weights):
#   carry: .whl (`make flashmla-wheel`), models/smollm2-135m-instruct/{tokenizer.json,tokenizer_config.json,chat_template.jinja}
#   command: bash perf/device_check.sh            (every step)
#            bash perf/device_check.sh pytest     (only the named steps: pytest bench_kernels
#                                                  offline_llama offline_v2lite offline_v2lite_page64
#                                                  bench_engine; tune_p1, gluon16, gluon128,
#                                                  heads128, issue16, ids_ahead, ids_ahead_ab,
#                                                  ids_ahead_engine, fp8_prefill, tile_clock
#                                                  two_programs, loader_warps and
#                                                  h200_candidates only when named)
set -u
STEPS=${*:-all}
OUT=${OUT:-perf/results/device}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/sgl_flash_mla-*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/sgl_flash_mla-*.whl \
        && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi

want() { [[ $STEPS == all || " $STEPS " == *" $1 "* ]]; }

# step NAME SECONDS COMMAND...: run with a time limit, keep the whole log, show its tail.
step() {
    local name=$1 limit=$2
    shift 2
    want "$name" || return 0
    echo "== $name"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "rc=$?"
    tail -n 4 "$OUT/$name.txt"
}

# abba NAME SECONDS COMMAND...: COMMAND as four processes, default, with $ABBA_FLAGS (default
# `--slots-ahead2`), the same, default (each run's "{run}" in COMMAND's words replaced by its
# number); the logs in $OUT/NAME<run>.txt, each one's tail shown.
abba() {
    local name=$1 limit=$2 run extra
    shift 2
    for run in 1 2 3 4; do
        extra=""
        [[ $run == 2 || $run == 3 ]] && extra=${ABBA_FLAGS:---slots-ahead2}
        echo "== $name $run ${extra:-(default)}"
        timeout "$limit" "${@//\{run\}/$run}" $extra > "$OUT/$name$run.txt" 2>&1
        echo "rc=$?"
        tail -n 6 "$OUT/$name$run.txt"
    done
}

# The default model's weights are not on the device: leave out the tests that need them.
step pytest 590 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/test_cuda_graph.py \
    tests/test_triton_backend.py tests/test_models_reference.py tests/test_kv_pool.py \
    tests/test_engine_batching.py tests/test_sampler.py tests/test_overlap.py \
    tests/test_torch_compile.py tests/test_fp8_absorbed.py tests/test_prefill_warmup.py \
    tests/test_gluon_decode_option.py \
    -k "not default_model and not shared_prefix and not stop_strings and not min_tokens and not (solo and llama) and not fp8_cache_follows"
step bench_kernels 150 python3 perf/bench_kernels.py --out "$OUT"
# Issue 16: the decode kernels' tile configs tuned (bench_kernels.py TUNE) at page size 1 (the
# engine's layout) and paged, 16 and 128 heads, FP8 forms included (about
# 3 minutes in runs AH and AI). Only when named (`bash perf/device_check.sh tune_p1`).
if [[ " $STEPS " == *" tune_p1 "* ]]; then
    step tune_p1 420 python3 perf/bench_kernels.py --tune --heads 16 128 \
        --kinds ours_bf16_p1 ours_fp8_p1 ours_bf16 ours_fp8 --out "$OUT/tune_p1"
fi
# 128 heads: the Gluon kernels' tests and the engine's 128-head logits against the Triton
# kernel (bf16 and FP8), then the kernel table at 128 heads (ctx 1K-16K, both caches) beside
# FlashMLA (runs AM, AN, AT). `heads128` times the engine's decode at 128 heads per kernel and
# cache (perf/bench_mla_heads.py). Only when named (`bash perf/device_check.sh gluon128`).
if [[ " $STEPS " == *" gluon128 "* ]]; then
    step gluon128 540 bash -c "python3 -m pytest -q -p no:cacheprovider \
        tests/kernels/test_mla_decode_gluon.py tests/test_gluon_decode_option.py; \
        python3 perf/bench_kernels.py --no-moe --no-fp8-bmm --heads 128 --out '$OUT/gluon128'"
fi
# 16 heads: the FP8 Gluon kernel's e4m3-PV form (`pv_e4m3`, opt-in since run AN) against its
# tests, then the Gluon tune at 16 heads (its forms beside the fp16-PV ones,
# FlashMLA in the same process), and the kernel table with PDL off and on (the Gluon kernels
# launch with PDL since run AM). Only when named (`bash perf/device_check.sh gluon16`).
if [[ " $STEPS " == *" gluon16 "* ]]; then
    step gluon16 570 bash -c "python3 -m pytest -q -p no:cacheprovider \
        tests/kernels/test_mla_decode_gluon.py -k 'e4m3_pv or paged or matches_reference'; \
        python3 perf/bench_kernels.py --tune --gluon-only --heads 16 --kinds ours_fp8_p1 \
        --batches 1 16 128 --contexts 1024 16384 --out '$OUT/gluon16'; \
        ENGINE_PDL=0 python3 perf/bench_kernels.py --no-moe --no-fp8-bmm --heads 16 \
        --out '$OUT/gluon16_nopdl'; \
        python3 perf/bench_kernels.py --no-moe --no-fp8-bmm --heads 16 --out '$OUT/gluon16_pdl'"
fi
# Issue 16's Done-when in one call (about 7 minutes on an H100, run AV): the kernel grid at 16
# and 128 heads beside FlashMLA, the engine over FP8 against bf16 KV at 64 and 256 requests
# (processes in the order fp8, bf16, bf16, fp8), the 16-head FP8 call (V read into registers
# from 128K tokens of work) against the converter form and the 5-tile register form at the
# grid's points, and the same at ctx 16K with the cache held in L2 (`--l2`: the calls' compute
# limit). Only when named (`bash perf/device_check.sh issue16`).
if [[ " $STEPS " == *" issue16 "* ]]; then
    step issue16 590 bash -c "python3 perf/bench_kernels.py --no-moe --no-fp8-bmm \
        --heads 16 128 --out '$OUT/issue16'; \
        python3 perf/bench_engine.py --kv fp8,bf16 --isolate --abba --ns 64,256 \
        --skip-compile --skip-eager --profile-ns '' --time-budget 280 \
        --json '$OUT/issue16_engine.json'; \
        python3 perf/bench_decode_parts.py --points 1x1024 1x4096 1x16384 16x1024 16x4096 \
        16x16384 64x1024 64x4096 64x16384 128x1024 128x4096 128x16384 --fp8-forms conv regs5; \
        python3 perf/bench_decode_parts.py --l2 --points 16x16384 64x16384 128x16384 \
        --fp8-forms conv regs5"
fi
# The loader reading slot ids two tiles ahead (`slots_ahead` 2; on an H200 the FP8 call at page
# size 1 took 1.04-1.09x the paged one at batch 64-128, ctx 4K-16K, run BA) and PV as e4m3
# wgmmas with V^T from registers (`pv_regs` with `pv_e4m3`): their GPU tests (two_tiles,
# pv_regs_e4m3 among pv_regs), then the engine's FP8 call beside these forms (a2: the engine's
# form with ids two tiles ahead; regs4a2, conva2: the register-V and converter forms so;
# regs4q1: q as one e4m3 term, half the QK wgmmas' N; regs84: the e4m3 register form, half the
# PV wgmmas and no V conversion, P in e4m3), also with the cache held in L2 (against the 1.6x
# line where a form is held by its own work), then the kernel table at those points for the
# paged figures in the same run. Only when named (`bash perf/device_check.sh ids_ahead`).
if [[ " $STEPS " == *" ids_ahead "* ]]; then
    step ids_ahead 420 bash -c "python3 -m pytest -q -p no:cacheprovider \
        tests/kernels/test_mla_decode_gluon.py -k 'two_tiles or pv_regs or paged'; \
        python3 perf/bench_decode_parts.py --points 16x4096 64x4096 128x4096 16x16384 \
        64x16384 128x16384 --fp8-forms a2 regs4a2 conv conva2 regs4q1 regs84 regs84a2; \
        python3 perf/bench_decode_parts.py --l2 --points 16x16384 64x16384 128x16384 \
        --fp8-forms a2 regs4q1 regs84; \
        python3 perf/bench_kernels.py --no-moe --no-fp8-bmm --heads 16 --batches 16 64 128 \
        --contexts 4096 16384 --out '$OUT/ids_ahead'"
fi
# The kernel grid's 16-head rows with the loader reading slot ids two tiles ahead
# (`--slots-ahead2`) against the default, alternated (default, ahead, ahead, default), then
# the FP8 forms with ids two ahead held in L2. Only when named (`... ids_ahead_ab`).
if [[ " $STEPS " == *" ids_ahead_ab "* ]]; then
    abba ids_ahead_ab 150 python3 perf/bench_kernels.py --no-moe --no-fp8-bmm --heads 16 \
        --batches 16 64 128 --contexts 4096 16384 --out "$OUT/ids_ahead_ab{run}"
    echo "== ids_ahead_l2"
    timeout 150 python3 perf/bench_decode_parts.py --l2 --points 16x16384 64x16384 128x16384 \
        --fp8-forms a2 regs84a2 regs4a2q1 regs84a2q1 > "$OUT/ids_ahead_l2.txt" 2>&1
    echo "rc=$?"
    grep '^| fp8' "$OUT/ids_ahead_l2.txt"
fi
# The H200 candidates for the 1.6x line (issue 16): the 16-head kernel grid with the loader
# reading slot ids two tiles ahead and q as one e4m3 term (FlashMLA FP8's quantization; its
# error against FlashMLA bf16 is printed beside FlashMLA FP8's) against the default, alternated
# (default, candidate, candidate, default). Only when named (`... h200_candidates`).
if [[ " $STEPS " == *" h200_candidates "* ]]; then
    ABBA_FLAGS="--slots-ahead2 --q-one-term" abba h200_candidates 140 python3 \
        perf/bench_kernels.py --no-moe --no-fp8-bmm --heads 16 --out "$OUT/h200_candidates{run}"
fi
# Two programs an SM: the register-V form with 2 or 3 e4m3 tiles (74-110 KB of shared
# memory) at twice the engine's split count, so that two attention warp groups share each SM's
# tensor cores (batch 16 ctx 16K is held by one group's wgmma issue, run AY), from HBM and in
# L2. Only when named (`bash perf/device_check.sh two_programs`).
if [[ " $STEPS " == *" two_programs "* ]]; then
    step two_programs 300 bash -c "python3 perf/bench_decode_parts.py --points 16x4096 \
        16x16384 64x16384 --fp8-forms regs2 regs2@16 regs3@16 regs2a2@16 regs2@4 regs3@4; \
        python3 perf/bench_decode_parts.py --l2 --points 16x16384 64x16384 --fp8-forms \
        regs2@16 regs3@16 regs2@4 regs3@4"
    grep '^| fp8' "$OUT/two_programs.txt"
fi
# The loader as 2 or 4 warps (`loader_warps`): their GPU tests (bit-equal to one warp), then
# the register-V forms with fp16 PV (regs4) and with e4m3 PV (regs84: one loader warp's copies
# held its tile, run BB), from HBM and in L2. Only when named
# (`bash perf/device_check.sh loader_warps`).
if [[ " $STEPS " == *" loader_warps "* ]]; then
    step loader_warps 420 bash -c "python3 -m pytest -q -p no:cacheprovider \
        tests/kernels/test_mla_decode_gluon.py -k 'loader_warps or two_tiles'; \
        python3 perf/bench_decode_parts.py --points 16x4096 16x16384 64x16384 128x16384 \
        --fp8-forms regs4l2 regs4l4 regs84 regs84l2 regs84l4 regs84q1l4; \
        python3 perf/bench_decode_parts.py --l2 --points 16x16384 64x16384 128x16384 \
        --fp8-forms regs4l2 regs4l4 regs84 regs84l2 regs84l4 regs84q1l4"
    grep '^| fp8\|passed\|failed' "$OUT/loader_warps.txt"
fi
# The engine with the loader reading slot ids two tiles ahead (`--slots-ahead2`) against the
# default, FP8 KV at 64 and 256 requests, the two alternated twice (processes default, ahead,
# ahead, default). Only when named (`bash perf/device_check.sh ids_ahead_engine`).
if [[ " $STEPS " == *" ids_ahead_engine "* ]]; then
    abba ids_ahead_engine 150 python3 perf/bench_engine.py --kv fp8 --ns 64,256 --skip-compile \
        --skip-eager --profile-ns '' --time-budget 100 --json "$OUT/ids_ahead_engine{run}.json"
fi
# FP8 KV's prefill over a cached prefix (2.7% slower than bf16's at 4K prompts, run BA, before
# `kv_store.gather_dequant` read the pool's rows in one kernel): its test, then the engine over
# FP8 and bf16 KV at 64 requests of 4,096-token prompts (processes fp8, bf16, bf16, fp8; the
# tokenizer files carried). Only when named (`bash perf/device_check.sh fp8_prefill`).
if [[ " $STEPS " == *" fp8_prefill "* ]]; then
    step fp8_prefill 420 bash -c "python3 -m pytest -q -p no:cacheprovider \
        tests/kernels/test_kv_store.py; \
        python3 perf/bench_engine.py --kv fp8,bf16 --isolate --abba --ns 64 --prompt-len 4096 \
        --max-tokens 128 --skip-compile --skip-eager --profile-ns '' --time-budget 190 \
        --json '$OUT/fp8_prefill.json'"
fi
# Where the register-V FP8 kernel's tile cycles go (perf/tile_clock.py, run AY): the clock
# stamps' patch applied for the step and taken back after it. Only when named.
if [[ " $STEPS " == *" tile_clock "* ]]; then
    git apply perf/tile_clock.patch \
        && step tile_clock 120 python3 perf/tile_clock.py \
        && git apply -R perf/tile_clock.patch
fi
if [[ " $STEPS " == *" heads128 "* ]]; then
    step heads128 540 python3 perf/bench_mla_heads.py --requests 16 64 --kv auto fp8_e4m3 \
        --json "$OUT/heads128.json"
fi
if want offline_llama && [[ ! -d /tmp/rand-llama ]]; then
    python3 -m engine.tools.make_random_checkpoint --arch llama --out /tmp/rand-llama > /dev/null
fi
step offline_llama 150 python3 perf/bench_offline.py --model /tmp/rand-llama \
    --json "$OUT/offline_llama.json"
if { want offline_v2lite || want offline_v2lite_page64; } && [[ ! -d /tmp/rand-v2lite ]]; then
    python3 -m engine.tools.make_random_checkpoint --preset v2-lite --layers 8 \
        --out /tmp/rand-v2lite > /dev/null
fi
step offline_v2lite 240 python3 perf/bench_offline.py --model /tmp/rand-v2lite \
    --json "$OUT/offline_v2lite.json"
step offline_v2lite_page64 240 python3 perf/bench_offline.py --model /tmp/rand-v2lite \
    --page-size 64 --json "$OUT/offline_v2lite_page64.json"
# The full V2-Lite shape (31 GB of random bf16 weights, written to /tmp/bench-v2lite once and
# reused); its --time-budget (450 s) skips measurements expected to end later.
step bench_engine 570 python3 perf/bench_engine.py --json "$OUT/bench_engine.json"
