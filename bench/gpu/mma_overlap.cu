// bench_mma_overlap: whether the warp-level tensor-core product (mma.sync m16n8k16, bf16 in, f32 out; the fast
// decode kernels' QK and PV, and the store's rotation by tensor cores that a probe timed) overlaps with the
// CUDA-core work of the other warps, measured alone on every SM (sm_90a; bench/results/mma-overlap-2026-12-07.md).
//
// One CTA of 16 warps per SM (four per scheduler, as the fast store kernel runs). Each warp runs `--iters`
// iterations of M products (four independent accumulator chains) and F independent operations of one kind
// (FFMA on eight float chains, or LOP3 on eight integer chains), interleaved in the source; clock64() around the
// loop. A row gives SM cycles per iteration (the median CTA) and, for a mixed row, the two times measured alone:
// if the products hide behind the other work the mixed time is about the larger of the two, if they take the
// issue slots (or their operands' register reads) it is about the sum.
//
// The "mma-f16acc" rows use mma.sync with fp16 accumulators. The "wgmma" rows do the same with the warpgroup's
// asynchronous product instead: per iteration each warpgroup issues M wgmma.mma_async m64n8k16 (f32 += f16 x f16, A
// from registers, B a 256-byte tile in shared memory; the multiply-adds of M mma.sync per warp), commits them, runs
// its F operations and then waits for the products.
//
// Usage: bench_mma_overlap [--iters n]. Needs an sm_90 GPU; exits 0 with a message without one.
#include <cuda_runtime.h>

#define KVQ_BENCH_NAME "bench_mma_overlap"
#include "cuda_check.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int kWarps = 16;
constexpr int kPerScheduler = kWarps / 4;  // an SM has four schedulers

__device__ __forceinline__ void mma(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// The same product with fp16 accumulators (two registers: rows g and g + 8, columns 2t, 2t + 1).
__device__ __forceinline__ void mma_h(std::uint32_t (&d)[2], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, {%6,%7}, {%0,%1};\n"
               : "+r"(d[0]), "+r"(d[1])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// wgmma m64n8k16, f32 += f16 x f16, A from registers (the warp's 16 rows, as mma.sync's A), B by descriptor.
__device__ __forceinline__ void wgmma_rs(float (&d)[4], const std::uint32_t (&a)[4], std::uint64_t bd) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, 1, 1, 1, 0;\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bd));
}
__device__ __forceinline__ std::uint32_t lop3(std::uint32_t x, std::uint32_t y, std::uint32_t z) {
  std::uint32_t r;
  asm volatile("lop3.b32 %0, %1, %2, %3, 0x96;\n" : "=r"(r) : "r"(x), "r"(y), "r"(z));  // x ^ y ^ z
  return r;
}

// KIND 0: FFMA, 1: LOP3. F must be a multiple of 8 (eight chains). W: the products as wgmma (per warpgroup).
// H: mma.sync with fp16 accumulators.
template <int M, int F, int KIND, bool W = false, bool H = false>
__global__ void __launch_bounds__(kWarps * 32, 1) overlap_kernel(int iters, float* out, long long* cycles) {
  static_assert(F % 8 == 0, "eight chains");
  const std::uint32_t t = threadIdx.x;
  __shared__ __align__(128) std::uint32_t btile[kWarps / 4][64];  // one 16 x 8 fp16 B tile per warpgroup
  btile[t >> 7][t & 63] = 0x3c003c00u ^ (t & 0x00ff00ffu);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  // No-swizzle descriptor: address >> 4, leading (k) byte offset 128, stride byte offset 256.
  const std::uint32_t bs = static_cast<std::uint32_t>(__cvta_generic_to_shared(&btile[t >> 7][0]));
  const std::uint64_t bd = static_cast<std::uint64_t>((bs & 0x3ffffu) >> 4) | (std::uint64_t{128 >> 4} << 16) |
                           (std::uint64_t{256 >> 4} << 32);
  std::uint32_t a[4], b[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = 0x3f803f80u ^ ((t + i) & 7u);  // bf16 pairs near 1.0
  b[0] = 0x3f803f80u ^ (t & 3u);
  b[1] = 0x3f803f80u ^ ((t >> 2) & 3u);
  float acc[4][4] = {};
  std::uint32_t hacc[4][2] = {};
  float f[8];
  std::uint32_t u[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    f[k] = 1.0f + 1e-3f * static_cast<float>(k + t);
    u[k] = t * 2654435761u + static_cast<std::uint32_t>(k);
  }
  const float x = 0.999f + 1e-7f * static_cast<float>(t & 15u), y = 1e-6f;
  const std::uint32_t p = 0x9e3779b9u ^ t, q = 0x7f4a7c15u + t;
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    // The products first, then the other work: both independent of each other within the iteration.
    if constexpr (W) {
      if constexpr (M > 0) {
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int m = 0; m < M; ++m) wgmma_rs(acc[m & 3], a, bd);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      }
    } else if constexpr (H) {
#pragma unroll
      for (int m = 0; m < M; ++m) mma_h(hacc[m & 3], a, b);
    } else {
#pragma unroll
      for (int m = 0; m < M; ++m) mma(acc[m & 3], a, b);
    }
#pragma unroll
    for (int j = 0; j < F; ++j) {
      if constexpr (KIND == 0) f[j & 7] = __fmaf_rn(f[j & 7], x, y);
      else u[j & 7] = lop3(u[j & 7], p, q);
    }
    if constexpr (W && M > 0) asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
  __syncthreads();
  const long long t1 = clock64();
  float s = 0.0f;
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int i = 0; i < 4; ++i) s += acc[m][i];
#pragma unroll
  for (int k = 0; k < 8; ++k) s += f[k] + static_cast<float>(u[k] & 1u) + static_cast<float>(hacc[k & 3][k >> 2] & 1u);
  if (s == 12345.678f) out[0] = s;  // keeps every chain live
  if (t == 0) cycles[blockIdx.x] = t1 - t0;
}

struct Row {
  const char* name;
  int m, f, kind;
  bool w;  // the products as wgmma
  bool h;  // mma.sync with fp16 accumulators
  void (*kernel)(int, float*, long long*);
};

}  // namespace

int main(int argc, char** argv) {
  int iters = 20000;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: bench_mma_overlap [--iters n]\n");
      return 2;
    }
  }
  if (iters < 100 || iters > 10000000) {
    std::fprintf(stderr, "bench_mma_overlap: --iters must be in 100 .. 10000000\n");
    return 2;
  }
  cudaDeviceProp prop{};
  if (!bench_device(prop, true)) return 0;
  const int sms = prop.multiProcessorCount;
  const Row rows[] = {
      {"mma x4", 4, 0, 0, false, false, overlap_kernel<4, 0, 0>},
      {"mma x8", 8, 0, 0, false, false, overlap_kernel<8, 0, 0>},
      {"ffma x32", 0, 32, 0, false, false, overlap_kernel<0, 32, 0>},
      {"ffma x64", 0, 64, 0, false, false, overlap_kernel<0, 64, 0>},
      {"ffma x128", 0, 128, 0, false, false, overlap_kernel<0, 128, 0>},
      {"mma x4 + ffma x32", 4, 32, 0, false, false, overlap_kernel<4, 32, 0>},
      {"mma x4 + ffma x64", 4, 64, 0, false, false, overlap_kernel<4, 64, 0>},
      {"mma x4 + ffma x128", 4, 128, 0, false, false, overlap_kernel<4, 128, 0>},
      {"lop3 x32", 0, 32, 1, false, false, overlap_kernel<0, 32, 1>},
      {"lop3 x64", 0, 64, 1, false, false, overlap_kernel<0, 64, 1>},
      {"lop3 x128", 0, 128, 1, false, false, overlap_kernel<0, 128, 1>},
      {"mma x4 + lop3 x32", 4, 32, 1, false, false, overlap_kernel<4, 32, 1>},
      {"mma x4 + lop3 x64", 4, 64, 1, false, false, overlap_kernel<4, 64, 1>},
      {"mma x4 + lop3 x128", 4, 128, 1, false, false, overlap_kernel<4, 128, 1>},
      {"wgmma x4", 4, 0, 0, true, false, overlap_kernel<4, 0, 0, true>},
      {"wgmma x4 + ffma x32", 4, 32, 0, true, false, overlap_kernel<4, 32, 0, true>},
      {"wgmma x4 + ffma x64", 4, 64, 0, true, false, overlap_kernel<4, 64, 0, true>},
      {"wgmma x4 + ffma x128", 4, 128, 0, true, false, overlap_kernel<4, 128, 0, true>},
      {"wgmma x4 + lop3 x64", 4, 64, 1, true, false, overlap_kernel<4, 64, 1, true>},
      {"mma-f16acc x4", 4, 0, 0, false, true, overlap_kernel<4, 0, 0, false, true>},
      {"mma-f16acc x4 + ffma x64", 4, 64, 0, false, true, overlap_kernel<4, 64, 0, false, true>},
      {"mma-f16acc x4 + ffma x128", 4, 128, 0, false, true, overlap_kernel<4, 128, 0, false, true>},
      {"mma-f16acc x4 + lop3 x64", 4, 64, 1, false, true, overlap_kernel<4, 64, 1, false, true>},
  };
  float* out = nullptr;
  long long* cyc = nullptr;
  CHECK(cudaMalloc(&out, sizeof(float)));
  CHECK(cudaMalloc(&cyc, sizeof(long long) * sms));
  std::printf("# %s, %d SMs, one CTA of %d warps per SM, %d iterations; SM cycles per iteration (median CTA)\n",
              prop.name, sms, kWarps, iters);
  std::printf("# per scheduler and iteration: %d warps x (M products + F operations)\n", kPerScheduler);
  std::printf("%-26s %12s %16s %16s\n", "row", "cycles/iter", "cyc/mma/sched", "cyc/op/sched");
  std::vector<double> med(sizeof(rows) / sizeof(rows[0]));
  for (std::size_t r = 0; r < med.size(); ++r) {
    const Row& w = rows[r];
    std::vector<long long> h(sms);
    for (int rep = 0; rep < 2; ++rep) {  // the first launch warms the code
      w.kernel<<<sms, kWarps * 32>>>(iters, out, cyc);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
    }
    CHECK(cudaMemcpy(h.data(), cyc, sizeof(long long) * sms, cudaMemcpyDeviceToHost));
    std::sort(h.begin(), h.end());
    med[r] = static_cast<double>(h[sms / 2]) / iters;
    char cm[32] = "-", cf[32] = "-";
    if (w.m) std::snprintf(cm, sizeof cm, "%.2f", med[r] / (kPerScheduler * w.m));
    if (w.f) std::snprintf(cf, sizeof cf, "%.2f", med[r] / (kPerScheduler * w.f));
    std::printf("%-26s %12.1f %16s %16s\n", w.name, med[r], cm, cf);
  }
  // Mixed rows against their parts: the products alone (same M, same kind of product) and the operations alone.
  std::printf("\n%-26s %10s %10s %10s %14s\n", "mixed row", "measured", "max(parts)", "sum(parts)", "hidden share");
  for (std::size_t r = 0; r < med.size(); ++r) {
    if (!(rows[r].m && rows[r].f)) continue;
    double part = -1, prod = -1;
    for (std::size_t s = 0; s < med.size(); ++s) {
      if (!rows[s].m && rows[s].f == rows[r].f && rows[s].kind == rows[r].kind) part = med[s];
      if (!rows[s].f && rows[s].m == rows[r].m && rows[s].w == rows[r].w && rows[s].h == rows[r].h) prod = med[s];
    }
    const double mx = std::max(prod, part), sm = prod + part;
    // 1: the mixed time is the larger part (the smaller one fully hidden); 0: the sum (nothing hidden).
    const double hidden = (sm - med[r]) / (sm - mx);
    std::printf("%-26s %10.1f %10.1f %10.1f %14.2f\n", rows[r].name, med[r], mx, sm, hidden);
  }
  CHECK(cudaFree(out));
  CHECK(cudaFree(cyc));
  return 0;
}
