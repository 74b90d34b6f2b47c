// CHECK(x) for the standalone GPU benchmark programs: prints the failing call and the CUDA error
// under the program's name (KVQ_BENCH_NAME, defined before the include) and exits 1.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                                \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s: %s: %s\n", KVQ_BENCH_NAME, #x, cudaGetErrorString(e_));         \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

// The first device's properties for the standalone programs, or false after printing that the program skipped:
// no CUDA device, or (need_sm90) a device that is not sm_90.
inline bool bench_device(cudaDeviceProp& pr, bool need_sm90) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("%s: no CUDA device, skipped\n", KVQ_BENCH_NAME);
    return false;
  }
  CHECK(cudaGetDeviceProperties(&pr, 0));
  if (need_sm90 && pr.major != 9) {
    std::printf("%s: %s is sm_%d%d, needs sm_90; skipped\n", KVQ_BENCH_NAME, pr.name, pr.major, pr.minor);
    return false;
  }
  return true;
}
