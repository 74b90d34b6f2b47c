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
