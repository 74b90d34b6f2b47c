// device.cuh: small device helpers shared by the store and decode kernels: tensor-core mma,
// cp.async, bf16 pair min / max, fp16/bf16 packing, the block-diagonal Walsh-Hadamard transform
// over shared memory; host: per-device launch facts queried once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <utility>

namespace kvq::cuda::detail {

// ---- programmatic dependent launch (sm_90) ---------------------------------------------------
// Waits until the grid this one was programmatically launched after has finished and its writes are
// visible (returns at once when there is none).
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
// Lets the programmatically launched grid after this one be scheduled before this one ends.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
// Spins for at least ns nanoseconds of the global timer, inlined (the fast decode kernel's prologue with early sends
// and DecodeParams::test_send_delay_ns).
__device__ __forceinline__ void spin_at_least_ns(unsigned ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(256);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
// The same as a call (tests and benchmarks only: DecodeParams::test_send_delay_ns before the sends,
// test_delayed_copy, hold_stream).
inline __device__ __noinline__ void sleep_at_least_ns(unsigned ns) { spin_at_least_ns(ns); }
// Whether environment variable `name` is set to 1 (the kernels' test switches; callers read it once).
inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && v[0] == '1';
}
// KVQ_NO_PDL=1 in the environment turns programmatic launches off (read once).
inline bool pdl_enabled() {
  static const bool on = !env_flag("KVQ_NO_PDL");
  return on;
}
// log2 of a page's token count when it is a power of two (the writers' slot -> page shift), else -1.
inline int page_shift(int tokens) {
  for (int s = 0; s < 31; ++s)
    if (tokens == (1 << s)) return s;
  return -1;
}

// ---- host: what a launcher asks the runtime on every launch, asked once per device ----------
struct DeviceFacts {
  int sms = 0;            // multiprocessors
  int reserved_smem = 0;  // shared memory reserved per block (1 KB on sm_90)
};
// The current device's facts (devices 0..63 cached; others queried every time).
inline cudaError_t device_facts(DeviceFacts& out) {
  static DeviceFacts facts[64];
  static std::atomic<int> state[64];  // 0: unknown, 1: being written, 2: ready
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const bool cached = dev >= 0 && dev < 64;
  if (cached && state[dev].load(std::memory_order_acquire) == 2) {
    out = facts[dev];
    return cudaSuccess;
  }
  DeviceFacts f;
  e = cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&f.reserved_smem, cudaDevAttrReservedSharedMemoryPerBlock, dev);
  if (e != cudaSuccess) return e;
  int expect = 0;
  if (cached && state[dev].compare_exchange_strong(expect, 1, std::memory_order_acq_rel)) {
    facts[dev] = f;
    state[dev].store(2, std::memory_order_release);
  }
  out = f;
  return cudaSuccess;
}
// Raises Kernel's dynamic shared-memory limit to `bytes` on the current device, calling the runtime
// only the first time per device (bytes must be the same on every call for one device).
template <auto Kernel>
cudaError_t smem_limit_once(int bytes) {
  static std::atomic<unsigned long long> done{0};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const unsigned long long bit = dev >= 0 && dev < 64 ? 1ull << dev : 0ull;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess && bit != 0) done.fetch_or(bit, std::memory_order_acq_rel);
  return e;
}
// A launch of `grid` x `threads` with `smem` bytes of dynamic shared memory, in clusters of `cluster`
// CTAs along x (0: no clusters), as a programmatic dependent launch where `pdl` (and pdl_enabled()): it may start
// before the previous kernel in the stream ends and must griddepcontrol.wait before reading that kernel's output.
// at: the storage of its attributes, which must outlive the launch call.
inline cudaLaunchConfig_t launch_config(dim3 grid, int threads, int smem, cudaStream_t st, int cluster, bool pdl,
                                        cudaLaunchAttribute (&at)[2]) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned>(threads), 1, 1);
  cfg.dynamicSmemBytes = static_cast<std::size_t>(smem);
  cfg.stream = st;
  cfg.attrs = at;
  cfg.numAttrs = 0;
  if (cluster > 0) {
    at[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
    at[cfg.numAttrs].val.clusterDim.x = static_cast<unsigned>(cluster);
    at[cfg.numAttrs].val.clusterDim.y = 1;
    at[cfg.numAttrs].val.clusterDim.z = 1;
    ++cfg.numAttrs;
  }
  if (pdl && pdl_enabled()) {
    at[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[cfg.numAttrs].val.programmaticStreamSerializationAllowed = 1;
    ++cfg.numAttrs;
  }
  return cfg;
}
// Launches kernel k (launch_config's attributes, without clusters; any block shape); with pdl (and pdl_enabled()) as a
// programmatic dependent launch: it may start before the previous kernel in the stream ends and must
// griddepcontrol.wait before reading that kernel's output.
template <class... Params, class... Args>
cudaError_t launch_maybe_pdl(void (*k)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t st, bool pdl,
                             Args&&... args) {
  cudaLaunchAttribute at[2];
  cudaLaunchConfig_t cfg = launch_config(grid, 1, 0, st, 0, pdl, at);
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  return cudaLaunchKernelEx(&cfg, k, std::forward<Args>(args)...);
}
// Clusters of `cluster` CTAs (1..8, along the grid's x) of Kernel, with `threads` threads and `smem`
// bytes of dynamic shared memory each, that the current device holds at once
// (cudaOccupancyMaxActiveClusters; 0 where the runtime cannot say or none fits), asked once per
// device and cluster size (the smem limit must be set first, and `threads` / `smem` be the same on
// every call for one device).
template <auto Kernel>
int max_active_clusters_once(int cluster, int threads, int smem) {
  static std::atomic<int> cache[64][9];  // 0: unknown, -1: none, n > 0
  if (cluster < 1 || cluster > 8) return 0;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  std::atomic<int>* slot = dev >= 0 && dev < 64 ? &cache[dev][cluster] : nullptr;
  if (slot) {
    const int v = slot->load(std::memory_order_acquire);
    if (v != 0) return v > 0 ? v : 0;
  }
  cudaLaunchAttribute at[2];
  const cudaLaunchConfig_t cfg =
      launch_config(dim3(static_cast<unsigned>(cluster), 1, 1), threads, smem, nullptr, cluster, false, at);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, Kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it, the caller falls back
    n = 0;
  }
  if (slot) slot->store(n > 0 ? n : -1, std::memory_order_release);
  return n > 0 ? n : 0;
}
// The current device's multiprocessors (132, an H200's, when the runtime cannot say).
inline int device_sms() {
  DeviceFacts f;
  return device_facts(f) == cudaSuccess && f.sms > 0 ? f.sms : 132;
}

// D = A * B + D, m16n8k16, fp16 or bf16 operands, fp32 accumulators (PTX ISA fragment layout:
// a0..a3 rows g / g+8 and k pairs 2t..2t+1 / 2t+8..; b0, b1 k pairs of column g; c0, c1 row g,
// columns 2t, 2t+1; c2, c3 row g + 8; g = lane / 4, t = lane % 4).
template <bool kBf16>
__device__ __forceinline__ void mma16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  if constexpr (kBf16) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// cp.async of 16 bytes; shared address as a 32-bit offset or a generic pointer.
__device__ __forceinline__ void cp_async16(std::uint32_t saddr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  cp_async16(static_cast<std::uint32_t>(__cvta_generic_to_shared(smem)), gmem);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Waits for the completion of the given parity of the mbarrier at shared address bar. The copies that complete
// on it carry a fixed byte count, and a bad address faults the launch instead of leaving the barrier open. (A poll
// counter with a trap made the store kernels spill 8-24 bytes.)
__device__ __forceinline__ void mbar_wait_parity(std::uint32_t bar, std::uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// mbarrier operations on shared addresses: init with an arrival count (kCount), the fence that makes inits visible to the
// async proxy (and the cluster), one arrival announcing `bytes` of transactions, invalidation before the memory is
// reused; and the fence that orders this thread's generic shared-memory accesses before later async-proxy writes.
template <int kCount>
__device__ __forceinline__ void mbar_init(std::uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "n"(kCount) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_inval(std::uint32_t bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void async_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory into this CTA's shared
// memory at shared address dst, completing that many bytes on the mbarrier at shared address bar.
__device__ __forceinline__ void bulk_copy(std::uint32_t dst, const void* src, std::uint32_t bytes, std::uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// cp.async of 16 bytes, zero-filled when !valid (nothing read); shared address as a 32-bit offset or
// a generic pointer.
__device__ __forceinline__ void cp_async16_zfill(std::uint32_t saddr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  cp_async16_zfill(static_cast<std::uint32_t>(__cvta_generic_to_shared(smem)), gmem, valid);
}
// 2^x (ex2.approx.ftz).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats rounded to a packed (lo, hi) pair of fp16 or bf16, and the rounding residuals.
template <bool kBf16>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  if constexpr (kBf16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  }
}
template <bool kBf16>
__device__ __forceinline__ float round_elt(float x) {
  if constexpr (kBf16) return __bfloat162float(__float2bfloat16_rn(x));
  else return __half2float(__float2half_rn(x));
}
// Elementwise min / max of two bf16 pairs (exact: bf16 order is the order of the values; kNaN: a
// NaN operand half gives a NaN half, else the other operand), and the low / high bf16 of a pair as
// float.
template <bool kNaN = false>
__device__ __forceinline__ std::uint32_t bmin2(std::uint32_t a, std::uint32_t b) {
  std::uint32_t r;
  if constexpr (kNaN) asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  else asm("min.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
template <bool kNaN = false>
__device__ __forceinline__ std::uint32_t bmax2(std::uint32_t a, std::uint32_t b) {
  std::uint32_t r;
  if constexpr (kNaN) asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  else asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// Whether either bf16 of the pair is a NaN or an infinity (exponent all ones).
__device__ __forceinline__ bool bf16x2_nonfinite(std::uint32_t w) {
  return (w & 0x7f80u) == 0x7f80u || (w & 0x7f800000u) == 0x7f800000u;
}
// The same for eight bf16 values (16 bytes).
__device__ __forceinline__ bool bf16x8_nonfinite(const uint4& c) {
  return bf16x2_nonfinite(c.x) || bf16x2_nonfinite(c.y) || bf16x2_nonfinite(c.z) || bf16x2_nonfinite(c.w);
}
__device__ __forceinline__ float bf16_lo(std::uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(std::uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
// fp16 pairs held as 32-bit words: (x_lo - z, x_hi - z) of two codes held as fp16 1024 + code
// (exponent trick: exact for codes and zero points <= 255); the pair product; codes 2k, 2k + 1 of a
// little-endian B-bit code word v as the fp16 pair (1024 + code) (one LOP3); a bf16 pair as fp16.
// z2 for zero point z: (1024 + z) x 2 as fp16 bits, the form sub_zero takes.
__device__ __forceinline__ std::uint32_t zero_pair(std::uint32_t z) { return 0x64006400u + z * 0x10001u; }
// zero_pair of byte i (0..3) of w: one PRMT with the fp16 exponent byte 0x64.
__device__ __forceinline__ std::uint32_t zero_pair_byte(std::uint32_t w, unsigned i) {
  return __byte_perm(w, 0x64u, i | 4u << 4 | i << 8 | 4u << 12);
}
__device__ __forceinline__ std::uint32_t sub_zero(std::uint32_t w, std::uint32_t z2) {
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&w), *reinterpret_cast<const __half2*>(&z2));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}
__device__ __forceinline__ std::uint32_t hmul2u(std::uint32_t a, std::uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}
template <int B>
__device__ __forceinline__ std::uint32_t code_pair(std::uint32_t v, int k) {
  constexpr std::uint32_t lo = (1u << B) - 1u, hi = lo << 16;
  const std::uint32_t x = v >> (2 * B * k);
  return (x & lo) | ((x << (16 - B)) & hi) | 0x64006400u;
}
// (x & M) | c in one LOP3. Written in C with a constant c, ptxas folds both constants into
// immediates and splits the operation into two LOP3s (an instruction takes one immediate).
template <std::uint32_t M>
__device__ __forceinline__ std::uint32_t and_or(std::uint32_t x, std::uint32_t c) {
  std::uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(x), "n"(M), "r"(c));
  return d;
}
__device__ __forceinline__ std::uint32_t bf2_to_h2(std::uint32_t x) { return pack2<false>(bf16_lo(x), bf16_hi(x)); }

// x = hi + lo with hi, lo in the 16-bit type: about twice its precision.
template <bool kBf16>
__device__ __forceinline__ void split2(float x0, float x1, std::uint32_t& hi, std::uint32_t& lo) {
  const float h0 = round_elt<kBf16>(x0), h1 = round_elt<kBf16>(x1);
  hi = pack2<kBf16>(h0, h1);
  lo = pack2<kBf16>(x0 - h0, x1 - h1);
}

__device__ __forceinline__ std::uint32_t fp8x2_to_half2(std::uint32_t two_bytes) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes & 0xffffu), __NV_E4M3);
  return static_cast<std::uint32_t>(r.x) | (static_cast<std::uint32_t>(r.y) << 16);
}
// The e4m3 pairs in the low / high 16 bits of w as an fp16 pair (the half is picked by the
// conversion's operand, no shift).
template <int kHalf>
__device__ __forceinline__ std::uint32_t fp8x2_half_to_half2(std::uint32_t w) {
  std::uint32_t r;
  if constexpr (kHalf == 0)
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(r) : "r"(w));
  else
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(r) : "r"(w));
  return r;
}

__device__ __forceinline__ float half_bits_to_float(std::uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float bf16_bits_to_float(std::uint16_t h) { return __uint_as_float(static_cast<std::uint32_t>(h) << 16); }

// Block size and offset of element j under the block-diagonal Hadamard of dimension n
// (power-of-two blocks, largest first, as kvq::hadamard_blocks).
__device__ __forceinline__ int hadamard_block(int n, int j, int& off) {
  off = 0;
  for (int b = 1 << 12; b >= 1; b >>= 1) {
    if (n & b) {
      if (j < off + b) return b;
      off += b;
    }
  }
  return 1;
}

// In-place orthonormal block FWHT of `count` vectors of n floats (stride `stride`) in shared
// memory, by the threads [0, nthreads) of the block; same operation order as kvq::fwht (sums and
// differences per stage, scale 1/sqrt(block) last). Caller synchronizes before and after.
__device__ inline void smem_fwht(float* x, int n, int count, int stride, int tid, int nthreads) {
  for (int h = 1; h < n; h <<= 1) {
    for (int i = tid; i < count * n; i += nthreads) {
      const int v = i / n, j = i % n;
      int off;
      const int bs = hadamard_block(n, j, off);
      if (h < bs && ((j - off) & h) == 0) {
        float* p = x + v * stride;
        const float a = p[j], b = p[j + h];
        p[j] = a + b;
        p[j + h] = a - b;
      }
    }
    __syncthreads();
  }
  for (int i = tid; i < count * n; i += nthreads) {
    const int v = i / n, j = i % n;
    int off;
    const int bs = hadamard_block(n, j, off);
    x[v * stride + j] *= static_cast<float>(1.0 / sqrt(static_cast<double>(bs)));
  }
}

// Unnormalized FWHT of size n (a power of two, 8 <= n <= 128) on a warp's 4 n / 4 / 32 blocks:
// lane l holds elements 4 l .. 4 l + 3 in x; blocks of n are lanes [k n / 4, (k + 1) n / 4). Stages
// 1, 2 in the lane, then 4 .. n / 2 by shuffles, each with the lower index a + b and the upper a - b:
// the stage order and arithmetic of smem_fwht, so the results are the same bits.
__device__ __forceinline__ void warp_fwht4(float (&x)[4], int lane, int n) {
  float t0 = x[0], t1 = x[1];
  x[0] = t0 + t1;
  x[1] = t0 - t1;
  t0 = x[2];
  t1 = x[3];
  x[2] = t0 + t1;
  x[3] = t0 - t1;
  t0 = x[0];
  t1 = x[1];
  x[0] = t0 + x[2];
  x[1] = t1 + x[3];
  x[2] = t0 - x[2];
  x[3] = t1 - x[3];
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    if (4 * m >= n) break;
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float y = __shfl_xor_sync(0xffffffffu, x[j], m);
      x[j] = upper ? y - x[j] : x[j] + y;
    }
  }
}

// The FWHT stages 1 .. N / 2 over the N values of one lane (in place, lower index a + b, upper a - b);
// with HEND, the stages h < HEND only.
template <int N, int HEND = N>
__device__ __forceinline__ void inlane_fwht(float (&v)[N]) {
#pragma unroll
  for (int h = 1; h < HEND; h <<= 1) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if ((i & h) == 0) {
        const float a = v[i], b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }
    }
  }
}

// Power-of-two n = 32 * NI held as v[i] = x[lane + 32 i]: butterflies across lanes by shuffles,
// then within the lane; each output is the same a + b / a - b as the smem version.
template <int NI>
__device__ __forceinline__ void reg_fwht(float (&v)[NI], int lane) {
#pragma unroll
  for (int h = 1; h < 32; h <<= 1) {
    // Lower lane a + b, upper lane a - b, both as fma(+-1, own, other): the product is exact, so
    // this is the same single rounding as the sum or difference.
    const float sgn = (lane & h) == 0 ? 1.0f : -1.0f;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const float o = __shfl_xor_sync(0xffffffffu, v[i], h);
      v[i] = __fmaf_rn(v[i], sgn, o);
    }
  }
  inlane_fwht(v);
  const float sc = static_cast<float>(1.0 / sqrt(static_cast<double>(32 * NI)));
#pragma unroll
  for (int i = 0; i < NI; ++i) v[i] *= sc;
}

// Sum of 2^(pos & 31) over the fields k < n whose bit position b k starts in word i: the multiplier
// that turns one constant into the constant part of every packed field of that word.
__host__ __device__ constexpr std::uint32_t field_word_mult(int n, int b, int i) {
  std::uint32_t m = 0;
  for (int k = 0; k < n; ++k)
    if ((b * k) >> 5 == i) m += 1u << ((b * k) & 31);
  return m;
}
// Packs N codes of B bits, code k = t[k] + zc (mod 2^32), code in [0, 2^B), LSB first into the words
// w[0 .. (N B + 31) / 32) (kvq::pack_bits' order); t[k] may carry a constant that zc cancels (bits
// above a field wrap out of the word or cancel with the constant part).
template <int N, int B, int NW>
__device__ __forceinline__ void pack_fields(const std::uint32_t (&t)[N], std::uint32_t zc, std::uint32_t (&w)[NW]) {
  static_assert(NW * 32 >= N * B, "room for the packed fields");
#pragma unroll
  for (int i = 0; i < (N * B + 31) / 32; ++i) w[i] = zc * field_word_mult(N, B, i);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const int pos = B * k, i = pos >> 5, o = pos & 31;
    w[i] += t[k] << o;
    if (o + B > 32) w[i + 1] += (t[k] + zc) >> (32 - o);
  }
}

// Number of the n sorted edges strictly below y (kvq::bucketize's binary search; the count does
// not depend on the search order). kLdg: edges in global memory, read through the read-only path.
template <bool kLdg>
__device__ __forceinline__ int count_below(const float* __restrict__ edges, int n, float y) {
  int lo = 0;
  while (n > 0) {
    const int half = n >> 1;
    const float e = kLdg ? __ldg(edges + lo + half) : edges[lo + half];
    if (e < y) {
      lo += half + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  return lo;
}

}  // namespace kvq::cuda::detail
