// bench_stream_floor: the time a kernel needs only to read a decode step's cache bytes, measured
// the way `kvq bench decode` measures a decode launch (CUDA events around one launch, a read-only
// L2 flush of 256 MB before it, the median of --reps launches). It is the floor under any decode
// kernel for those bytes at that batch: the launch, the first bytes' latency, the read itself and the
// tail of the last CTAs, with no computation, no split merge and no output.
//
// Rows: an empty kernel (132 CTAs of 512 threads), then for each format of the GQA core grid the
// bytes of batch 8 x 8 KV heads x head_dim 128 at 16K and 64K tokens (the packed page bytes per token
// and head of docs/kernels.md), read by 1, 2 or 4 CTAs of 512 threads per SM, 16-byte loads, the best
// of the three. Usage: bench_stream_floor [--reps n]. Exits 0 with a message without a GPU.
#include <cuda_runtime.h>

#define KVQ_BENCH_NAME "bench_stream_floor"
#include "cuda_check.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

// Reads n16 16-byte words (grid-stride, 4 loads in flight per thread); one word per CTA out keeps the loads.
__global__ void __launch_bounds__(512) read_kernel(const uint4* __restrict__ p, std::size_t n16, unsigned* out) {
  unsigned acc = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride), d = __ldg(p + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n16; i += stride) {
    const uint4 a = __ldg(p + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;
}

__global__ void empty_kernel() {}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
};

}  // namespace

int main(int argc, char** argv) {
  int reps = 50;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_stream_floor [--reps n]\n");
      return 2;
    }
  }
  if (reps < 1) {
    std::fprintf(stderr, "bench_stream_floor: --reps must be >= 1\n");
    return 2;
  }
  cudaDeviceProp pr{};
  if (!bench_device(pr, false)) return 0;
  const int sms = pr.multiProcessorCount;
  struct Fmt {
    const char* name;
    int bytes;  // per token and KV head at head_dim 128
  };
  const Fmt fmts[] = {{"bf16", 512},       {"tq-k8v4", 196}, {"tq-4bit-nc", 134}, {"tq-k3v4-nc", 118},
                      {"tq-3bit-nc", 102}, {"tq-4bit", 132}, {"tq-3.5bit", 120},  {"tq-3bit", 100}};
  const int ctxs[] = {16384, 65536};
  const std::size_t max_bytes = std::size_t{8} * 8 * 65536 * 512;
  const std::size_t flush_bytes = std::size_t{256} << 20;
  // Two copies of the largest input, used in turn (the flush before each launch evicts them from L2 anyway).
  const int copies = 2;
  std::uint8_t* buf = nullptr;
  std::uint8_t* flush = nullptr;
  unsigned* out = nullptr;
  CHECK(cudaMalloc(&buf, copies * max_bytes));
  CHECK(cudaMalloc(&flush, flush_bytes));
  CHECK(cudaMalloc(&out, 4096 * sizeof(unsigned)));
  CHECK(cudaMemset(buf, 1, copies * max_bytes));
  CHECK(cudaMemset(flush, 2, flush_bytes));
  Timer tm;
  auto median = [&](auto launch) {
    std::vector<float> t;
    for (int r = 0; r < reps + 3; ++r) {
      read_kernel<<<4 * sms, 512>>>(reinterpret_cast<const uint4*>(flush), flush_bytes / 16, out);  // L2 flush (read)
      CHECK(cudaEventRecord(tm.a));
      launch(r);
      CHECK(cudaEventRecord(tm.b));
      CHECK(cudaEventSynchronize(tm.b));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, tm.a, tm.b));
      if (r >= 3) t.push_back(ms * 1e3f);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  std::printf("%s, %d SMs; median of %d launches after a 256 MB read flush\n\n", pr.name, sms, reps);
  const float empty = median([&](int) { empty_kernel<<<sms, 512>>>(); });
  std::printf("empty kernel (%d CTAs x 512 threads): %.2f us\n\n", sms, empty);
  std::printf("| format | batch x context | MB | read floor us | GB/s | CTAs per SM |\n|---|---|---:|---:|---:|---:|\n");
  for (const Fmt& f : fmts) {
    for (int ctx : ctxs) {
      const std::size_t bytes = std::size_t{8} * 8 * static_cast<std::size_t>(ctx) * f.bytes;
      float best = 1e30f;
      int best_k = 0;
      for (int k : {1, 2, 4}) {
        const float us = median([&](int r) {
          read_kernel<<<k * sms, 512>>>(reinterpret_cast<const uint4*>(buf + (r % copies) * max_bytes), bytes / 16, out);
        });
        if (us < best) {
          best = us;
          best_k = k;
        }
      }
      CHECK(cudaGetLastError());
      std::printf("| %s | 8 x %dK | %.1f | %.1f | %.0f | %d |\n", f.name, ctx / 1024, bytes / 1e6, best, bytes / (best * 1e3), best_k);
    }
  }
  CHECK(cudaFree(buf));
  CHECK(cudaFree(flush));
  CHECK(cudaFree(out));
  return 0;
}
