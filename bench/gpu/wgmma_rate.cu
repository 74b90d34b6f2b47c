// bench_wgmma_rate: the issue rate of the Hopper tensor-core and shared-memory operations the MLA
// warpgroup decode kernel is built from, measured alone on every SM (sm_90a).
//
// Each CTA is one warpgroup (128 threads); `--ctas-per-sm` of them run on every SM (default 2, as
// the decode kernel). A CTA issues a long stream of one operation and records clock64() around it;
// the table gives SM cycles per operation (CTA cycles / operations per CTA / CTAs per SM), so a row
// is the rate the SM sustains when it does nothing else:
//   ss N     wgmma m64nNk16 f32.f16.f16, A and B from shared memory (no swizzle, K-major), four
//            accumulator chains unless the row names another count, batches of 32 wgmmas per commit / wait
//   rs N     the same with A from registers (only B read from shared memory; the first rs row: 8 chains)
//   stsm     stmatrix m8n8.x4 (512 bytes per warp, 2 KB per warpgroup instruction)
//   ldsm     ldmatrix m8n8.x4 (the same bytes, read)
//   int8     wgmma m64n32k32 s32.s8.s8, fp8: m64n16k32 f32.e4m3.e4m3 (twice the dims per operation)
// Operand bytes per wgmma: A 64 x 16 x 2 = 2 KB (ss only), B N x 16 x 2. The decode kernel's tile
// (64 tokens x 16 heads, d_c 512 + d_r 64) issues 32 ss + 4 rs (QK) and 32 ss (PV) wgmmas of N = 16
// and 32 stmatrix.x4 per warp (4 per 64-dim content group): the last lines turn the
// measured rates into that tile's floor, before any dequantization, softmax or memory traffic.
//
// Usage: bench_wgmma_rate [--ctas-per-sm n] [--iters n]. Needs an sm_90 GPU; exits 0 with a message
// without one.
#include <cuda_runtime.h>

#define KVQ_BENCH_NAME "bench_wgmma_rate"
#include "cuda_check.cuh"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int kSmem = 96 * 1024;  // A region 64 KB, B region 32 KB

__device__ __forceinline__ std::uint64_t desc(std::uint32_t saddr, std::uint32_t lbo, std::uint32_t sbo) {
  return static_cast<std::uint64_t>((saddr & 0x3ffffu) >> 4) | (static_cast<std::uint64_t>(lbo >> 4) << 16) |
         (static_cast<std::uint64_t>(sbo >> 4) << 32);
}
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

template <int N>
struct Acc {
  float r[N / 2];
};

// D (+)= A B with m64nNk16; A from shared memory (ad) or registers (a), B from shared memory (bd).
template <int N>
__device__ __forceinline__ void mma_ss(Acc<N>& d, std::uint64_t ad, std::uint64_t bd);
template <int N>
__device__ __forceinline__ void mma_rs(Acc<N>& d, const std::uint32_t (&a)[4], std::uint64_t bd);

template <>
__device__ __forceinline__ void mma_ss<16>(Acc<16>& d, std::uint64_t ad, std::uint64_t bd) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, 1, 1, 1, 0, 0;\n"
               : "+f"(d.r[0]), "+f"(d.r[1]), "+f"(d.r[2]), "+f"(d.r[3]), "+f"(d.r[4]), "+f"(d.r[5]), "+f"(d.r[6]), "+f"(d.r[7])
               : "l"(ad), "l"(bd));
}
template <>
__device__ __forceinline__ void mma_rs<16>(Acc<16>& d, const std::uint32_t (&a)[4], std::uint64_t bd) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, 1, 1, 1, 0;\n"
               : "+f"(d.r[0]), "+f"(d.r[1]), "+f"(d.r[2]), "+f"(d.r[3]), "+f"(d.r[4]), "+f"(d.r[5]), "+f"(d.r[6]), "+f"(d.r[7])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bd));
}

#define KVQ_ACC32(d)                                                                                                          \
  "+f"(d.r[0]), "+f"(d.r[1]), "+f"(d.r[2]), "+f"(d.r[3]), "+f"(d.r[4]), "+f"(d.r[5]), "+f"(d.r[6]), "+f"(d.r[7]), "+f"(d.r[8]), \
      "+f"(d.r[9]), "+f"(d.r[10]), "+f"(d.r[11]), "+f"(d.r[12]), "+f"(d.r[13]), "+f"(d.r[14]), "+f"(d.r[15]), "+f"(d.r[16]),   \
      "+f"(d.r[17]), "+f"(d.r[18]), "+f"(d.r[19]), "+f"(d.r[20]), "+f"(d.r[21]), "+f"(d.r[22]), "+f"(d.r[23]), "+f"(d.r[24]),   \
      "+f"(d.r[25]), "+f"(d.r[26]), "+f"(d.r[27]), "+f"(d.r[28]), "+f"(d.r[29]), "+f"(d.r[30]), "+f"(d.r[31])
#define KVQ_D32 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"

template <>
__device__ __forceinline__ void mma_ss<64>(Acc<64>& d, std::uint64_t ad, std::uint64_t bd) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " KVQ_D32 ", %32, %33, 1, 1, 1, 0, 0;\n"
               : KVQ_ACC32(d)
               : "l"(ad), "l"(bd));
}
template <>
__device__ __forceinline__ void mma_rs<64>(Acc<64>& d, const std::uint32_t (&a)[4], std::uint64_t bd) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " KVQ_D32 ", {%32,%33,%34,%35}, %36, 1, 1, 1, 0;\n"
               : KVQ_ACC32(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bd));
}

// 8-bit operands, k = 32: int8 (s32 accumulators) at N = 32, fp8 e4m3 (f32) at N = 16.
struct AccI32 {
  int r[16];
};
#define KVQ_ACCI16(d)                                                                                                           \
  "+r"(d.r[0]), "+r"(d.r[1]), "+r"(d.r[2]), "+r"(d.r[3]), "+r"(d.r[4]), "+r"(d.r[5]), "+r"(d.r[6]), "+r"(d.r[7]), "+r"(d.r[8]), \
      "+r"(d.r[9]), "+r"(d.r[10]), "+r"(d.r[11]), "+r"(d.r[12]), "+r"(d.r[13]), "+r"(d.r[14]), "+r"(d.r[15])
#define KVQ_D16 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
__device__ __forceinline__ void mma_ss_s8(AccI32& d, std::uint64_t ad, std::uint64_t bd) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 " KVQ_D16 ", %16, %17, 1;\n" : KVQ_ACCI16(d) : "l"(ad), "l"(bd));
}
__device__ __forceinline__ void mma_rs_s8(AccI32& d, const std::uint32_t (&a)[4], std::uint64_t bd) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 " KVQ_D16 ", {%16,%17,%18,%19}, %20, 1;\n"
               : KVQ_ACCI16(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bd));
}
__device__ __forceinline__ void mma_ss_e4m3(Acc<16>& d, std::uint64_t ad, std::uint64_t bd) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, 1, 1, 1;\n"
               : "+f"(d.r[0]), "+f"(d.r[1]), "+f"(d.r[2]), "+f"(d.r[3]), "+f"(d.r[4]), "+f"(d.r[5]), "+f"(d.r[6]), "+f"(d.r[7])
               : "l"(ad), "l"(bd));
}
__device__ __forceinline__ void mma_rs_e4m3(Acc<16>& d, const std::uint32_t (&a)[4], std::uint64_t bd) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, 1, 1, 1;\n"
               : "+f"(d.r[0]), "+f"(d.r[1]), "+f"(d.r[2]), "+f"(d.r[3]), "+f"(d.r[4]), "+f"(d.r[5]), "+f"(d.r[6]), "+f"(d.r[7])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bd));
}

// kind 0: ss, 1: rs, 2: stmatrix, 3: ldmatrix, 4 / 5: int8 m64n32k32 ss / rs, 6 / 7: fp8 e4m3 m64n16k32 ss / rs. ops: operations per CTA (wgmmas, or warpgroup-wide
// matrix instructions). cycles[blockIdx.x]: clock64 cycles of the stream.
template <int N, int KIND, int CH = 4>
__global__ void __launch_bounds__(128) rate_kernel(int iters, long long* cycles, float* sink) {
  extern __shared__ __align__(1024) std::uint8_t smem[];
  const std::uint32_t sA = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem)), sB = sA + 64 * 1024;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  for (int i = tid; i < kSmem / 4; i += 128) reinterpret_cast<std::uint32_t*>(smem)[i] = 0x3c003c00u ^ (i & 0x00ff00ffu) * 0x0101u;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  constexpr int kChains = CH;
  Acc<N> acc[kChains];
  for (int c = 0; c < kChains; ++c)
    for (int i = 0; i < N / 2; ++i) acc[c].r[i] = 0.0f;
  AccI32 iacc[kChains];
  for (int c = 0; c < kChains; ++c)
    for (int i = 0; i < 16; ++i) iacc[c].r[i] = 0;
  std::uint32_t a[4] = {0x3c003c00u + tid, 0x3c003c01u, 0x3c003c02u, 0x3c003c03u};
  std::uint32_t m[4] = {0, 0, 0, 0};
  // A: 32 k-steps of a 64 x 512 fp16 tile in core matrices (LBO 1024, SBO 128), as the decode kernel's V tile.
  const std::uint64_t ad0 = desc(sA, 1024, 128), bd0 = desc(sB, 256, 128);
  const long long t0 = clock64();
#pragma unroll 1
  for (int it = 0; it < iters; ++it) {
    if constexpr (KIND >= 4) {
      fence();
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        const std::uint64_t ad = ad0 + ((k * 2 * 1024) >> 4), bd = bd0 + (((k & 7) * 512) >> 4);
        if constexpr (KIND == 4) mma_ss_s8(iacc[k % kChains], ad, bd);
        if constexpr (KIND == 5) mma_rs_s8(iacc[k % kChains], a, bd);
        if constexpr (KIND == 6) mma_ss_e4m3(acc[k % kChains], ad, bd);
        if constexpr (KIND == 7) mma_rs_e4m3(acc[k % kChains], a, bd);
      }
      commit();
      wait0();
    } else if constexpr (KIND <= 1) {
      fence();
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        const std::uint64_t ad = ad0 + ((k * 2 * 1024) >> 4), bd = bd0 + (((k & 7) * 512) >> 4);
        if constexpr (KIND == 0)
          mma_ss<N>(acc[k % kChains], ad, bd);
        else
          mma_rs<N>(acc[k % kChains], a, bd);
      }
      commit();
      wait0();
    } else {
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        const std::uint32_t addr = sA + static_cast<std::uint32_t>(((k * 4 + w) * 512 + lane * 16) & (64 * 1024 - 1));
        if constexpr (KIND == 2)
          asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(a[0] + k), "r"(a[1]), "r"(a[2]),
                       "r"(a[3])
                       : "memory");
        else {
          std::uint32_t x0, x1, x2, x3;
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                       : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3)
                       : "r"(addr)
                       : "memory");
          m[k & 3] ^= (x0 + x1) ^ (x2 + x3);
        }
      }
    }
  }
  const long long t1 = clock64();
  float s = static_cast<float>(m[0] ^ m[1] ^ m[2] ^ m[3]);
  for (int c = 0; c < kChains; ++c) {
    for (int i = 0; i < N / 2; ++i) s += acc[c].r[i];
    for (int i = 0; i < 16; ++i) s += static_cast<float>(iacc[c].r[i]);
  }
  if (s == 12345.0f) sink[tid] = s;  // keeps the results live
  if (tid == 0) cycles[blockIdx.x] = t1 - t0;
}

struct Row {
  const char* name;
  double cycles;  // SM cycles per operation
  double flops;   // per operation
  double smem;    // shared-memory bytes per operation
};

template <int N, int KIND, int CH = 4>
Row run(const char* name, int sms, int per_sm, int iters) {
  auto kern = rate_kernel<N, KIND, CH>;
  CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  int occ = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, 128, kSmem));
  if (occ < per_sm) {
    std::fprintf(stderr, "bench_wgmma_rate: %s: only %d CTAs of 96 KB fit per SM (asked %d)\n", name, occ, per_sm);
    std::exit(1);
  }
  const int ctas = sms * per_sm;
  long long* dc = nullptr;
  float* ds = nullptr;
  CHECK(cudaMalloc(&dc, ctas * sizeof(long long)));
  CHECK(cudaMalloc(&ds, 128 * sizeof(float)));
  kern<<<ctas, 128, kSmem>>>(iters / 8, dc, ds);  // warm-up
  CHECK(cudaGetLastError());
  kern<<<ctas, 128, kSmem>>>(iters, dc, ds);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<long long> c(ctas);
  CHECK(cudaMemcpy(c.data(), dc, ctas * sizeof(long long), cudaMemcpyDeviceToHost));
  CHECK(cudaFree(dc));
  CHECK(cudaFree(ds));
  double mean = 0;
  for (long long x : c) mean += static_cast<double>(x);
  mean /= ctas;
  const double ops = 32.0 * iters;  // per CTA
  Row r{name, mean / ops / per_sm, 0, 0};
  if (KIND >= 4) {  // k = 32, one-byte operands: 2 KB of A, N x 32 bytes of B
    r.flops = 2.0 * 64 * N * 32;
    r.smem = (KIND % 2 == 0 ? 64 * 32 : 0) + N * 32;
  } else if (KIND <= 1) {
    r.flops = 2.0 * 64 * N * 16;
    r.smem = (KIND == 0 ? 64 * 16 * 2 : 0) + N * 16 * 2;
  } else {
    r.smem = 4 * 512;
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int per_sm = 2, iters = 4096;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--ctas-per-sm") && i + 1 < argc)
      per_sm = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc)
      iters = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_wgmma_rate [--ctas-per-sm 1|2] [--iters n]\n");
      return 2;
    }
  }
  if (per_sm < 1 || per_sm > 2 || iters < 8) {
    std::fprintf(stderr, "bench_wgmma_rate: --ctas-per-sm must be 1 or 2, --iters >= 8\n");
    return 2;
  }
  cudaDeviceProp pr{};
  if (!bench_device(pr, true)) return 0;
  int khz = 0;
  CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  const int sms = pr.multiProcessorCount;
  std::printf("%s, %d SMs, %d CTAs of one warpgroup per SM, %d x 32 operations per CTA\n\n", pr.name, sms, per_sm, iters);
  std::vector<Row> rows;
  rows.push_back(run<16, 0>("ss m64n16k16", sms, per_sm, iters));
  rows.push_back(run<16, 1, 8>("rs m64n16k16", sms, per_sm, iters));
  rows.push_back(run<64, 0>("ss m64n64k16", sms, per_sm, iters));
  rows.push_back(run<64, 1>("rs m64n64k16", sms, per_sm, iters));
  rows.push_back(run<16, 2>("stmatrix.x4 (warpgroup)", sms, per_sm, iters));
  rows.push_back(run<16, 3>("ldmatrix.x4 (warpgroup)", sms, per_sm, iters));
  rows.push_back(run<16, 0, 8>("ss m64n16k16, 8 chains", sms, per_sm, iters));
  rows.push_back(run<16, 1, 4>("rs m64n16k16, 4 chains", sms, per_sm, iters));
  rows.push_back(run<16, 1, 2>("rs m64n16k16, 2 chains", sms, per_sm, iters));
  rows.push_back(run<32, 4, 8>("int8 ss m64n32k32 (OP/cycle)", sms, per_sm, iters));
  rows.push_back(run<32, 5, 8>("int8 rs m64n32k32 (OP/cycle)", sms, per_sm, iters));
  rows.push_back(run<16, 6, 8>("fp8 e4m3 ss m64n16k32", sms, per_sm, iters));
  rows.push_back(run<16, 7, 8>("fp8 e4m3 rs m64n16k32", sms, per_sm, iters));
  std::printf("| operation | SM cycles / op | FLOP / cycle / SM | shared-memory bytes / cycle / SM |\n|---|---:|---:|---:|\n");
  for (const Row& r : rows) {
    if (r.flops > 0)
      std::printf("| %s | %.2f | %.0f | %.1f |\n", r.name, r.cycles, r.flops / r.cycles, r.smem / r.cycles);
    else
      std::printf("| %s | %.2f | - | %.1f |\n", r.name, r.cycles, r.smem / r.cycles);
  }
  // The decode kernel's 64-token tile at 16 heads: 32 + 32 ss and 4 rs wgmmas of N = 16, and 32 stmatrix.x4
  // per warp (4 per content group), i.e. 32 warpgroup-wide stmatrix operations as timed above.
  const double tile = 64 * rows[0].cycles + 4 * rows[1].cycles + 32 * rows[4].cycles;
  const double tile_rs = 32 * rows[1].cycles + 4 * rows[1].cycles + 32 * rows[0].cycles + 32 * rows[4].cycles;
  std::printf("\nMLA warpgroup tile (64 tokens, 16 heads, c4r4 layout), SM cycles if nothing else ran:\n");
  std::printf("  as built (QK and PV with A from shared memory, stmatrix): %.0f cycles = %.2f per token\n", tile, tile / 64);
  std::printf("  QK with A from registers, PV as built:                     %.0f cycles = %.2f per token\n", tile_rs, tile_rs / 64);
  const double hz = khz * 1e3;
  std::printf("  at the peak SM clock (%.0f MHz) a million tokens take %.1f / %.1f us\n", hz / 1e6, tile / 64 * 1e6 / sms / hz * 1e6,
              tile_rs / 64 * 1e6 / sms / hz * 1e6);
  return 0;
}
