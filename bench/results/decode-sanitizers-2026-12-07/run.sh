#!/usr/bin/env bash
set -u
nvidia-smi --query-gpu=name,uuid,clocks.max.sm,driver_version --format=csv,noheader
t0=$(date +%s)
. scripts/lib/gpu.sh
kvq_gpu_configure . /tmp/bs > $OUT/configure.txt 2>&1 || { tail -20 $OUT/configure.txt; exit 1; }
cmake --build /tmp/bs -j 16 --target test_cuda_decode > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
timeout 200 /tmp/bs/tests/cuda/test_cuda_decode > $OUT/decode.txt 2>&1; echo "test_cuda_decode rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/decode.txt
for tool in memcheck racecheck synccheck; do
  timeout 120 compute-sanitizer --tool $tool --error-exitcode 1 /tmp/bs/tests/cuda/test_cuda_decode --small > $OUT/$tool.txt 2>&1
  echo "$tool rc=$? $(( $(date +%s) - t0 )) s"; tail -2 $OUT/$tool.txt
done
