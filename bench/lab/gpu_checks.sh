#!/bin/bash
# The GPU checks that are still open, as device-machine steps (each fits one 10-minute command).
# Run from the repository root on the device, results under $OUT:
#
#   bash bench/lab/gpu_checks.sh STEP
#
# FA3 (tokenspeed-fa3) travels unpacked and xz-compressed as .carry/fa3.tar.xz (27 MiB; made here
# with `pip download --no-deps tokenspeed-fa3==3.0.0.post20260810`, unzip, `tar cJf`): name it in
# the call's carry. Steps:
#   pending  head256_no_l2_prefetch.patch (issue 27): head-256 GPU tests and split sweeps on a copy
#            of the tree with the patch, then bench/decode.py on main and on the patch
#   l2a      the L2 prefetch distance at head sizes 64 and 128 (issues 27, 24), main only
#   engine   tqattn bench throughput: chat, cache-bound, decode-heavy (issue 24)
#   h200     issue 27's ratio table (heads 64, 256, padded 80/96) and issue 29's centering cost
set -u
STEP=${1:?step: pending, l2a, engine or h200}
T0=$(date +%s)
R=$PWD
left() { echo $(( ${BUDGET:-580} - ($(date +%s) - T0) )); }
if [ -f .carry/fa3.tar.xz ]; then
  mkdir -p /tmp/fa3 && tar xJf .carry/fa3.tar.xz -C /tmp/fa3
fi
export PYTHONPATH=$R:/tmp/fa3
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/device.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/device.txt

case $STEP in
pending)
  P=/tmp/patched && rm -rf $P && mkdir -p $P
  cp -r tqattn tests bench pyproject.toml $P/ && (cd $P && { patch -p1 -s < bench/lab/pending/head256_no_l2_prefetch.patch || git apply bench/lab/pending/head256_no_l2_prefetch.patch; }) || exit 1
  (cd $P && PYTHONPATH=$P timeout 150 python3 -m pytest -m gpu -q -k head256 tests/kernels/test_kernels_gpu.py) \
    > $OUT/gpu_tests_head256_nopf.log 2>&1; tail -2 $OUT/gpu_tests_head256_nopf.log
  for h in 4/1/256 8/4/256; do
    t=$(echo $h | tr / _)
    (cd $P && PYTHONPATH=$P timeout 110 python3 bench/lab/split_sweep.py --presets turboquant_k3v4_nc,tq_k4v3 \
      --heads $h --shapes 32x16384-16384 --splits 4,8,16,24,33 --maxnreg 255,200 --out $OUT/split_nopf_$t.json) > $OUT/split_nopf_$t.log 2>&1
  done
  for tree in $R $P; do
    tag=$([ $tree = $R ] && echo main || echo nopf)
    [ $(left) -lt 100 ] && break
    (cd $tree && PYTHONPATH=$tree:/tmp/fa3 timeout 110 python3 bench/decode.py --shapes 8/4/256,4/1/256 --batches 32 \
      --contexts 16384 --presets turboquant_k3v4_nc,tq_k4v3 --no-extra --out $OUT --tag d256_$tag) > $OUT/d256_$tag.log 2>&1
  done ;;
l2a)
  for a in 2 0 1 2; do
    for h in 32/8/128 9/3/64 14/2/64; do
      [ $(left) -lt 40 ] && break
      t=$(echo $h | tr / _)
      timeout 60 python3 bench/lab/split_sweep.py --l2-ahead $a --presets turboquant_k3v4_nc,tq_k4v3 --heads $h \
        --shapes 32x16384-16384,256x1024-1280 --splits 1 --out $OUT/l2a_${a}_${t}_$(date +%s).json > /dev/null 2>&1
    done
  done ;;
engine)
  for w in chat cache-bound decode-heavy; do
    [ $(left) -lt 170 ] && break
    timeout $(left) python3 -m tqattn.cli bench throughput --workload $w \
      --kv-cache-dtypes auto,turboquant_k3v4_nc,tq_k4v3 --out-dir $OUT/$w > $OUT/$w.log 2>&1
  done ;;
h200)
  timeout 240 python3 bench/decode.py --shapes 9/3/64,14/2/64,8/4/256,4/1/256 --batches 32 --contexts 16384 \
    --presets turboquant_k3v4_nc,tq_k4v3 --no-extra --out $OUT --tag decode_ratios > $OUT/decode_ratios.log 2>&1
  timeout 120 python3 bench/decode.py --shapes 32/8/80,32/8/96 --batches 32 --contexts 16384 \
    --presets turboquant_k3v4_nc,tq_k4v3 --no-extra --pad-head-size --out $OUT --tag decode8096 > $OUT/decode8096.log 2>&1
  for i in 1 2; do
    [ $(left) -lt 60 ] && break
    timeout 90 python3 bench/centering_overhead.py --out $OUT/centering_overhead_$i.json > $OUT/centering_$i.log 2>&1
  done ;;
*) echo "unknown step $STEP"; exit 2 ;;
esac
cd $OUT && tar cJf $STEP.tar.xz --exclude=$STEP.tar.xz --exclude=device.txt * && find . -mindepth 1 \
  ! -name $STEP.tar.xz ! -name device.txt -delete; ls -la $OUT
