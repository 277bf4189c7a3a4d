#!/usr/bin/env bash
# The H200 runs behind BENCHMARKS.md, one stage per device call:
#   bash bench/h200_session.sh tests|kernel|speedup|rest|tiers|...
# Results go to $OUT (the device tool brings them back) and bench/results/.
set -uo pipefail
export CXX=/usr/bin/g++ PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/streamrec-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
for stage in "$@"; do
  start=$(date +%s)
  case "$stage" in
    tests)
      python3 -m pytest -q -s -m gpu tests/models tests/cache tests/pipeline -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    kernel)
      base=""; [ -f .carry/old_paged_attention.py ] && base="--baseline-kernels .carry/old_paged_attention.py"
      python3 -m bench.h200_bench --sections kernel $base --out "$OUT" 2>&1 | tail -80
      cp "$OUT/h200.json" "$OUT/h200_kernel.json" ;;
    ncu)  # Nsight Compute counters of one launch of each fused kernel (batch 64)
      for op in rank extend; do
        ncu --set full -k regex:"_candidate_kernel|_decode" -c 1 \
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
    worker|worker-eager)  # (e): the whole worker with the dev broker on this machine
      flags=""; [ "$stage" = worker-eager ] && flags="--no-cuda-graphs"
      python3 -m bench.worker_bench --config hstu-8l --device cuda --users 2000 \
        --events 60000 --rates 2000 5000 10000 20000 --seconds 10 --drain-s 40 \
        --max-batch-users 256 --warm-wave 32 --partitions 4 $flags 2>&1 | tail -12
      cp bench/results/worker_bench_hstu-8l_cuda.json "$OUT/$stage.json" 2>/dev/null ;;
    tiers)  # issue 20: embedding cache, retrievable set, disk KV tier (~2.5 min)
      python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/cache/test_embedding_cache.py \
        tests/cache/test_disk_tier.py tests/pipeline/test_item_catalog.py \
        tests/worker/test_serving_stack.py 2>&1 \
        | tee "$OUT/tiers_gpu_tests.log" | tail -12
      python3 -m bench.tiers_bench --out "$OUT" --disk-dir "${TIERS_DISK_DIR:-$PWD}" 2>&1 | tail -40 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "stage $stage: $(( $(date +%s) - start )) s"
done
