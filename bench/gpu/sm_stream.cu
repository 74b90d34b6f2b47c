// bench_sm_stream: how fast each SM reads HBM while many SMs read, measured per SM. Each CTA of a
// launch reads an equal contiguous share of the input (as the fast GQA decode kernel's CTAs read an
// equal share of a sequence, one CTA per SM) and records its SM and its start and end times
// (%globaltimer); every launch follows a 256 MB read-only L2 flush, as `kvq bench decode` times a
// decode launch. Which share a CTA reads rotates from launch to launch, so a time that stays with an
// SM over the launches belongs to where the SM sits, and one that stays with a share to its bytes.
//
// Kernels: a plain reader (16-byte loads into registers, 4 or 12 in flight per thread) and the fast
// decode kernel's copy structure without its arithmetic (16 warps, each with a ring of chunks in
// shared memory, the next chunk issued before the current one is waited for and read back): by
// cp.async (the kernel's LDGSTS), by one bulk copy per chunk (TMA, on an mbarrier), or through
// registers (loads stored to the slot after the current chunk is read).
//
// Rows: the launch's event time (median); the CTAs' read times (min / median / max over all launches);
// the rate over the slowest CTA (bytes / its time); the correlation of the per-SM and of the per-share
// mean read time between the even and the odd launches. Then one row per TPC (SM pair: a cluster of
// two lands on one) with its SMs' mean read time in each 128-CTA variant.
//
// Usage: bench_sm_stream [--mb M] [--reps n]. M: MB read per launch (default 205.5, the packed bytes
// of tq-k8v4 at batch 8 x 16K x 8 KV heads). Exits 0 with a message without a GPU.
#include <cuda_runtime.h>

#define KVQ_BENCH_NAME "bench_sm_stream"
#include "cuda_check.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

namespace {

__device__ __forceinline__ unsigned long long gtimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// After the CTA's reads: keeps them (one word out), then rec[3 b ..] = (SM, start ns, end ns).
__device__ __forceinline__ void finish_cta(unsigned acc, unsigned long long t0, unsigned long long* rec, unsigned* out) {
  if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    rec[3 * blockIdx.x] = sm;
    rec[3 * blockIdx.x + 1] = t0;
    rec[3 * blockIdx.x + 2] = gtimer();
  }
}

// CTA b reads share s = (b + rot) mod the grid, 16-byte words [s n16, (s + 1) n16), with U loads in
// flight per thread.
template <int U>
__global__ void __launch_bounds__(512) share_kernel(const uint4* __restrict__ p, std::size_t n16, int rot,
                                                     unsigned long long* rec, unsigned* out) {
  __shared__ unsigned long long t0;
  if (threadIdx.x == 0) t0 = gtimer();
  const uint4* q = p + static_cast<std::size_t>((blockIdx.x + rot) % gridDim.x) * n16;
  unsigned acc = 0;
  std::size_t i = threadIdx.x;
  for (; i + (U - 1) * 512 < n16; i += U * 512) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldg(q + i + u * 512);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += 512) {
    const uint4 v = __ldg(q + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  finish_cta(acc, t0, rec, out);
}

// The fast decode kernel's copy structure: 16 warps, each with a ring of NS chunks of CH bytes in shared
// memory (chunk c of the CTA's share, share s as above, goes to warp c % 16), the chunk NS - 1 ahead
// issued before the current one is waited for and read back from shared memory. MODE 0: 16-byte
// cp.async per lane, as the kernel copies (LDGSTS); 1: one cp.async.bulk per chunk by lane 0, completed
// on an mbarrier (TMA); 2: 16-byte loads into registers, stored to the next slot after the current
// chunk is read (one chunk in flight; NS = 2). Every shape uses kRingBytes of shared memory.
constexpr int kRingWarps = 16, kRingBytes = kRingWarps * 2 * 6144;
template <int MODE, int CH, int NS>
__global__ void __launch_bounds__(512, 1) ring_kernel(const std::uint8_t* __restrict__ p, std::size_t cta_bytes, int rot,
                                                       unsigned long long* rec, unsigned* out) {
  extern __shared__ __align__(128) std::uint8_t ring[];
  __shared__ __align__(8) unsigned long long bar[kRingWarps][NS];
  constexpr bool BULK = MODE == 1;
  __shared__ unsigned long long t0;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) t0 = gtimer();
  if (BULK && lane < NS) {
    const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar[w][lane]));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  const std::uint8_t* base = p + static_cast<std::size_t>((blockIdx.x + rot) % gridDim.x) * cta_bytes;
  const int nch = static_cast<int>(cta_bytes / CH);
  const int nloc = (nch - w + kRingWarps - 1) / kRingWarps;
  std::uint8_t* st = ring + static_cast<std::size_t>(w) * NS * CH;
  uint4 held[CH / 512];
  auto issue = [&](int slot, int i) {
    const std::uint8_t* src = base + static_cast<std::size_t>(w + kRingWarps * i) * CH;
    std::uint8_t* dst = st + slot * CH;
    if constexpr (BULK) {
      if (lane == 0) {
        const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar[w][slot]));
        const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(CH) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(d),
                     "l"(src), "r"(CH), "r"(b)
                     : "memory");
      }
    } else if constexpr (MODE == 2) {
#pragma unroll
      for (int j = 0; j < CH / 512; ++j) held[j] = __ldg(reinterpret_cast<const uint4*>(src) + lane + 32 * j);
    } else {
#pragma unroll
      for (int j = 0; j < CH / 512; ++j) {
        const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst + 16 * (lane + 32 * j)));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src + 16 * (lane + 32 * j)) : "memory");
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
  };
  unsigned acc = 0;
  auto put = [&](int slot) {  // MODE 2: the held chunk into its slot
    uint4* d = reinterpret_cast<uint4*>(st + slot * CH);
#pragma unroll
    for (int j = 0; j < CH / 512; ++j) d[lane + 32 * j] = held[j];
  };
  if constexpr (MODE == 2) {
    if (nloc > 0) {
      issue(0, 0);
      put(0);
    }
  } else {
    for (int k = 0; k + 1 < NS; ++k)
      if (k < nloc) issue(k, k);
      else if (MODE == 0) asm volatile("cp.async.commit_group;" ::: "memory");
  }
  for (int i = 0; i < nloc; ++i) {
    const int slot = i % NS;
    if (i + NS - 1 < nloc) issue((i + NS - 1) % NS, i + NS - 1);
    else if (MODE == 0) asm volatile("cp.async.commit_group;" ::: "memory");
    if constexpr (BULK) {
      const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar[w][slot]));
      const unsigned par = (static_cast<unsigned>(i / NS)) & 1u;
      unsigned done = 0;
      while (!done)
        asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
                     : "=r"(done)
                     : "r"(b), "r"(par)
                     : "memory");
    } else if constexpr (MODE == 0) {
      asm volatile("cp.async.wait_group %0;" ::"n"(NS - 1) : "memory");
    }
    __syncwarp();
    const uint4* c = reinterpret_cast<const uint4*>(st + slot * CH);
#pragma unroll
    for (int j = 0; j < CH / 512; ++j) {
      const uint4 v = c[lane + 32 * j];
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __syncwarp();
    if constexpr (MODE == 2)
      if (i + 1 < nloc) put((i + 1) % NS);
  }
  finish_cta(acc, t0, rec, out);
}

__global__ void __launch_bounds__(512) flush_kernel(const uint4* __restrict__ p, std::size_t n16, unsigned* out) {
  unsigned acc = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n16; i += stride) {
    const uint4 a = __ldg(p + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;
}

double corr(const std::vector<double>& a, const std::vector<double>& b) {
  const std::size_t n = a.size();
  double ma = 0, mb = 0;
  for (std::size_t i = 0; i < n; ++i) {
    ma += a[i];
    mb += b[i];
  }
  ma /= n;
  mb /= n;
  double sab = 0, saa = 0, sbb = 0;
  for (std::size_t i = 0; i < n; ++i) {
    sab += (a[i] - ma) * (b[i] - mb);
    saa += (a[i] - ma) * (a[i] - ma);
    sbb += (b[i] - mb) * (b[i] - mb);
  }
  return saa > 0 && sbb > 0 ? sab / std::sqrt(saa * sbb) : 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  double mb = 205.520896;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--mb") && i + 1 < argc)
      mb = std::atof(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_sm_stream [--mb M] [--reps n]\n");
      return 2;
    }
  }
  if (reps < 2 || !(mb > 0) || mb > 16384) {
    std::fprintf(stderr, "bench_sm_stream: need --reps >= 2 and 0 < --mb <= 16384\n");
    return 2;
  }
  cudaDeviceProp pr{};
  if (!bench_device(pr, false)) return 0;
  const int sms = pr.multiProcessorCount;
  const std::size_t bytes = static_cast<std::size_t>(mb * 1e6) / 16 * 16;
  const std::size_t flush_bytes = std::size_t{256} << 20;
  std::uint8_t* buf = nullptr;
  std::uint8_t* flush = nullptr;
  unsigned* out = nullptr;
  unsigned long long* rec = nullptr;
  CHECK(cudaMalloc(&buf, bytes + 4096 * 16));
  CHECK(cudaMalloc(&flush, flush_bytes));
  CHECK(cudaMalloc(&out, 4096 * sizeof(unsigned)));
  CHECK(cudaMalloc(&rec, 3 * 4096 * sizeof(unsigned long long)));
  CHECK(cudaMemset(buf, 1, bytes));
  CHECK(cudaMemset(flush, 2, flush_bytes));
  cudaEvent_t ea, eb;
  CHECK(cudaEventCreate(&ea));
  CHECK(cudaEventCreate(&eb));

  using RingFn = void (*)(const std::uint8_t*, std::size_t, int, unsigned long long*, unsigned*);
  struct Variant {
    int ctas, unroll;  // unroll > 0: the plain reader with that many loads in flight per thread; 0: a ring kernel
    RingFn ring;
    int chunk, stages;
    const char* name;
  };
  // 128 CTAs: the fast decode kernel's launch at batch 8 x 8 KV heads (two splits per group); all SMs.
  // Plain reader: 4 loads in flight per thread (32 KB per CTA) or 12 (96 KB, about what tq-k8v4's 16 warps
  // keep in flight). Ring kernels: 16 warps, 192 KB of stages per CTA in every shape.
  const int c128 = std::min(128, sms);
  const Variant vars[] = {{c128, 12, nullptr, 0, 0, "plain, 12 loads / thread"},
                          {c128, 4, nullptr, 0, 0, "plain, 4 loads / thread"},
                          {sms, 12, nullptr, 0, 0, "plain, 12 loads / thread"},
                          {c128, 0, ring_kernel<0, 6144, 2>, 6144, 2, "ring cp.async, 6 KB x 2"},
                          {c128, 0, ring_kernel<1, 6144, 2>, 6144, 2, "ring bulk, 6 KB x 2"},
                          {c128, 0, ring_kernel<2, 6144, 2>, 6144, 2, "ring via registers, 6 KB x 2"},
                          {c128, 0, ring_kernel<0, 4096, 3>, 4096, 3, "ring cp.async, 4 KB x 3"},
                          {c128, 0, ring_kernel<0, 2048, 6>, 2048, 6, "ring cp.async, 2 KB x 6"},
                          {sms / 2, 12, nullptr, 0, 0, "plain, 12 loads / thread"},
                          {sms / 4, 12, nullptr, 0, 0, "plain, 12 loads / thread"},
                          {sms / 2, 0, ring_kernel<0, 6144, 2>, 6144, 2, "ring cp.async, 6 KB x 2"}};
  for (const Variant& v : vars)
    if (v.ring) CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(v.ring), cudaFuncAttributeMaxDynamicSharedMemorySize, kRingBytes));
  std::printf("%s, %d SMs; %.1f MB per launch in equal contiguous shares; %d launches per variant, each after a 256 MB "
              "read flush\n\n",
              pr.name, sms, bytes / 1e6, reps);
  std::printf("| CTAs | kernel | event us (median) | CTA read us min / median / max | GB/s over the slowest CTA | "
              "per-SM time, even vs odd launches (corr) | per-share time (corr) |\n"
              "|---:|---|---:|---|---:|---:|---:|\n");
  std::vector<std::vector<double>> sm_mean;  // per variant: each SM's mean read time (0: unused)
  std::vector<double> sm_share;             // per variant: MB per CTA
  for (const Variant& v : vars) {
    const std::size_t n16 = v.unroll > 0 ? bytes / 16 / static_cast<std::size_t>(v.ctas)
                                         : bytes / static_cast<std::size_t>(v.ctas) / v.chunk * v.chunk / 16;
    std::vector<float> ev;
    std::vector<double> durs;
    std::vector<double> sum[2], cnt[2];
    for (int k = 0; k < 2; ++k) {
      sum[k].assign(sms + 64, 0.0);
      cnt[k].assign(sms + 64, 0.0);
    }
    std::vector<unsigned long long> h(3 * static_cast<std::size_t>(v.ctas));
    std::vector<double> ssum[2], scnt[2];  // the same per share (the bytes a CTA reads)
    for (int k = 0; k < 2; ++k) {
      ssum[k].assign(v.ctas, 0.0);
      scnt[k].assign(v.ctas, 0.0);
    }
    for (int r = 0; r < reps + 2; ++r) {
      const int rot = (37 * r) % v.ctas;  // which share each CTA reads changes with the launch
      flush_kernel<<<4 * sms, 512>>>(reinterpret_cast<const uint4*>(flush), flush_bytes / 16, out);
      CHECK(cudaEventRecord(ea));
      if (v.unroll == 12)
        share_kernel<12><<<v.ctas, 512>>>(reinterpret_cast<const uint4*>(buf), n16, rot, rec, out);
      else if (v.unroll == 4)
        share_kernel<4><<<v.ctas, 512>>>(reinterpret_cast<const uint4*>(buf), n16, rot, rec, out);
      else
        v.ring<<<v.ctas, 512, kRingBytes>>>(buf, n16 * 16, rot, rec, out);
      CHECK(cudaEventRecord(eb));
      CHECK(cudaEventSynchronize(eb));
      CHECK(cudaGetLastError());
      if (r < 2) continue;  // warm-up
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, ea, eb));
      ev.push_back(ms * 1e3f);
      CHECK(cudaMemcpy(h.data(), rec, h.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
      for (int b = 0; b < v.ctas; ++b) {
        const unsigned sm = static_cast<unsigned>(h[3 * b]);
        const double us = static_cast<double>(h[3 * b + 2] - h[3 * b + 1]) / 1e3;
        if (sm >= static_cast<unsigned>(sms + 64) || !(us > 0) || us > 1e6) {
          std::fprintf(stderr, "bench_sm_stream: bad record (SM %u, %.1f us)\n", sm, us);
          return 1;
        }
        durs.push_back(us);
        sum[r & 1][sm] += us;
        cnt[r & 1][sm] += 1;
        ssum[r & 1][(b + rot) % v.ctas] += us;
        scnt[r & 1][(b + rot) % v.ctas] += 1;
      }
    }
    std::sort(ev.begin(), ev.end());
    std::sort(durs.begin(), durs.end());
    // SMs seen in both halves: their mean read times per half and overall.
    std::vector<double> a, b, sa, sb, mean(sms + 64, 0.0);
    for (int k = 0; k < v.ctas; ++k)
      if (scnt[0][k] > 0 && scnt[1][k] > 0) {
        sa.push_back(ssum[0][k] / scnt[0][k]);
        sb.push_back(ssum[1][k] / scnt[1][k]);
      }
    const double share_mb = static_cast<double>(n16) * 16 / 1e6;
    for (int s = 0; s < sms + 64; ++s) {
      const double c = cnt[0][s] + cnt[1][s];
      if (c > 0) mean[s] = (sum[0][s] + sum[1][s]) / c;
      if (cnt[0][s] > 0 && cnt[1][s] > 0) {
        a.push_back(sum[0][s] / cnt[0][s]);
        b.push_back(sum[1][s] / cnt[1][s]);
      }
    }
    std::printf("| %d | %s | %.1f | %.1f / %.1f / %.1f | %.0f | %.2f | %.2f |\n", v.ctas, v.name, ev[ev.size() / 2],
                durs.front(), durs[durs.size() / 2], durs.back(), static_cast<double>(n16) * 16 * v.ctas / (durs.back() * 1e3),
                corr(a, b), corr(sa, sb));
    sm_mean.push_back(mean);
    sm_share.push_back(share_mb);
  }
  // Per TPC, the variants of 128 CTAs (one per SM but 4, as the decode launch at batch 8).
  std::vector<int> vs;
  for (std::size_t k = 0; k < sizeof vars / sizeof vars[0]; ++k)
    if (vars[k].ctas == c128) vs.push_back(static_cast<int>(k));
  std::printf("\nPer TPC (SMs 2k and 2k + 1), %d CTAs: the mean read time of an SM's share, us (GB/s per SM)\n\n| TPC | SMs |",
              c128);
  for (int k : vs) std::printf(" %s |", vars[k].name);
  std::printf("\n|---:|---|");
  for (std::size_t k = 0; k < vs.size(); ++k) std::printf("---:|");
  std::printf("\n");
  for (int t = 0; 2 * t < sms + 64; ++t) {
    const std::vector<double>& m0 = sm_mean[vs[0]];
    const bool u0 = m0[2 * t] > 0, u1 = m0[2 * t + 1] > 0;
    if (!u0 && !u1) continue;
    char ids[32];
    if (u0 && u1)
      std::snprintf(ids, sizeof ids, "%d, %d", 2 * t, 2 * t + 1);
    else
      std::snprintf(ids, sizeof ids, "%d", 2 * t + (u0 ? 0 : 1));
    std::printf("| %d | %s |", t, ids);
    for (int k : vs) {
      const std::vector<double>& m = sm_mean[k];
      double sum = 0;
      int n = 0;
      for (int e = 0; e < 2; ++e)
        if (m[2 * t + e] > 0) {
          sum += m[2 * t + e];
          ++n;
        }
      if (n == 0)
        std::printf(" - |");
      else
        std::printf(" %.1f (%.1f) |", sum / n, sm_share[k] / (sum / n) * 1e3);
    }
    std::printf("\n");
  }
  CHECK(cudaFree(buf));
  CHECK(cudaFree(flush));
  CHECK(cudaFree(out));
  CHECK(cudaFree(rec));
  return 0;
}
