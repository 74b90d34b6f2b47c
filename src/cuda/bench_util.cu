// Device-side fills for benchmarks and tests: random but finite page contents for a format
// (codes, fp16 norms / scales / zeros) and random bf16 rows, so that a benchmark can build
// multi-gigabyte caches without host transfers. Decode cost does not depend on code values.
// Also the benchmarks' read-only L2 flush, and the tests' kernels around programmatic launches.
#include <cstdint>

#include "device.cuh"
#include "kvq/numeric.hpp"
#include "kvq_cuda.hpp"

namespace kvq::cuda {

namespace {

__device__ __forceinline__ std::uint32_t hash32(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<std::uint32_t>(x);
}

__global__ void fill_pages_kernel(std::uint32_t* pool, std::size_t words, std::uint64_t page_words, std::uint64_t vc_word,
                                  std::uint64_t meta_word, int key_kind, int value_kind, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t in_page = i % page_words;
    std::uint32_t r = hash32(seed * 0x9e3779b97f4a7c15ull + i);
    if (in_page >= meta_word) {
      r = 0x38003800u | (r & 0x03ff03ffu);  // two fp16 values in [0.5, 1)
    } else if (in_page >= vc_word) {
      if (value_kind == static_cast<int>(ValueCode::kBf16)) r &= 0xbfffbfffu;
    } else {
      if (key_kind == static_cast<int>(KeyCode::kFp8)) r &= 0xbfbfbfbfu;  // e4m3 exponent <= 7: finite, |x| < 2
      if (key_kind == static_cast<int>(KeyCode::kBf16)) r &= 0xbfffbfffu;
    }
    pool[i] = r;
  }
}

__global__ void fill_bf16_kernel(std::uint16_t* p, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint32_t a = hash32(seed * 0x9e3779b97f4a7c15ull + 2 * i), b = hash32(seed * 0x9e3779b97f4a7c15ull + 2 * i + 1);
    // Irwin-Hall sum of four uniforms: roughly N(0, 1).
    const float s = (static_cast<float>(a & 0xffff) + static_cast<float>(a >> 16) + static_cast<float>(b & 0xffff) +
                     static_cast<float>(b >> 16)) / 65536.0f - 2.0f;
    p[i] = float_to_bf16(s * 1.7320508f);
  }
}

__global__ void flush_read_kernel(uint4* buf, std::size_t n) {
  std::uint32_t acc = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = buf[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) buf[0].x = acc;
}

// Lets the grid launched programmatically after it start at once, spins delay_ns of the global timer in one
// thread per CTA, then copies the regions (16-byte words, then the bytes of each region's tail).
__global__ void delayed_copy_kernel(TestCopies c, unsigned delay_ns) {
  detail::launch_dependents();
  if (threadIdx.x == 0) detail::sleep_at_least_ns(delay_ns);
  __syncthreads();
  const std::size_t tid = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const std::size_t nt = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (int r = 0; r < c.n; ++r) {
    const std::size_t words = c.bytes[r] / 16;
    const uint4* src = static_cast<const uint4*>(c.src[r]);
    uint4* dst = static_cast<uint4*>(c.dst[r]);
    for (std::size_t i = tid; i < words; i += nt) dst[i] = src[i];
    for (std::size_t i = 16 * words + tid; i < c.bytes[r]; i += nt)
      static_cast<std::uint8_t*>(c.dst[r])[i] = static_cast<const std::uint8_t*>(c.src[r])[i];
  }
}

// One thread spins ns of the global timer and touches no memory (hold_stream).
__global__ void hold_kernel(unsigned ns) {
  if (threadIdx.x == 0) detail::sleep_at_least_ns(ns);
}

// Launched programmatically after delayed_copy_kernel and never waiting for it: whether the first byte of buf
// still held `stale` when it read it (a programmatic launch that did start early).
__global__ void stale_probe_kernel(const std::uint8_t* buf, std::uint8_t stale, int* saw_stale) {
  *saw_stale = *reinterpret_cast<const volatile std::uint8_t*>(buf) == stale ? 1 : 0;
}

}  // namespace

cudaError_t test_delayed_copy(const TestCopies& c, unsigned delay_ns, cudaStream_t stream) {
  if (c.n < 0 || c.n > TestCopies::kMax) return cudaErrorInvalidValue;
  for (int r = 0; r < c.n; ++r)
    if ((c.bytes[r] && (!c.dst[r] || !c.src[r])) || reinterpret_cast<std::uintptr_t>(c.dst[r]) % 16 ||
        reinterpret_cast<std::uintptr_t>(c.src[r]) % 16)
      return cudaErrorInvalidValue;
  // Eight CTAs: the rest of the device is free for the programmatic launch's CTAs while this one waits.
  delayed_copy_kernel<<<8, 256, 0, stream>>>(c, delay_ns);
  return cudaGetLastError();
}

cudaError_t test_stale_probe(const std::uint8_t* buf, std::uint8_t stale, int* saw_stale, cudaStream_t stream) {
  if (!buf || !saw_stale) return cudaErrorInvalidValue;
  cudaLaunchAttribute at[2];
  const cudaLaunchConfig_t cfg = detail::launch_config(dim3(1), 32, 0, stream, 0, true, at);
  return cudaLaunchKernelEx(&cfg, stale_probe_kernel, buf, stale, saw_stale);
}

cudaError_t flush_l2_read(std::uint8_t* buf, std::size_t bytes, cudaStream_t stream) {
  if (bytes % 16 || reinterpret_cast<std::uintptr_t>(buf) % 16) return cudaErrorInvalidValue;
  flush_read_kernel<<<132 * 8, 512, 0, stream>>>(reinterpret_cast<uint4*>(buf), bytes / 16);
  return cudaGetLastError();
}

cudaError_t hold_stream(unsigned ns, cudaStream_t stream) {
  if (ns > kMaxHoldNs) return cudaErrorInvalidValue;
  hold_kernel<<<1, 32, 0, stream>>>(ns);
  return cudaGetLastError();
}

cudaError_t fill_random_pages(const FormatDesc& f, std::uint8_t* pool, std::size_t n_pages, std::uint64_t seed,
                              cudaStream_t stream) {
  const PageLayout& pg = f.page;
  if (pg.page_bytes % 4 || pg.value_code_off % 4 || pg.meta_off % 4) return cudaErrorInvalidValue;
  const std::size_t words = n_pages * pg.page_bytes / 4;
  fill_pages_kernel<<<132 * 8, 256, 0, stream>>>(reinterpret_cast<std::uint32_t*>(pool), words, pg.page_bytes / 4,
                                                  pg.value_code_off / 4, pg.meta_off / 4, static_cast<int>(f.key),
                                                  static_cast<int>(f.value), seed);
  return cudaGetLastError();
}

cudaError_t fill_random_bf16(std::uint16_t* p, std::size_t n, std::uint64_t seed, cudaStream_t stream) {
  fill_bf16_kernel<<<132 * 8, 256, 0, stream>>>(p, n, seed);
  return cudaGetLastError();
}

}  // namespace kvq::cuda
