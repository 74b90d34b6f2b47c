// Store kernel: quantizes new key/value rows and writes them into their paged slots through the
// slot mapping, one warp per (token, KV head). TurboQuant: gather (outlier split), fp32 norm,
// x / ||x||, sign diagonal, block FWHT, bucketize against the codebook midpoints, norm correction
// folded into the stored fp16 norm, pack. Uniform values: vLLM's per-vector min/max rule with fp16
// scale and zero. fp8 keys: saturating e4m3. The arithmetic follows the scalar references in
// src/quant operation by operation; this file is compiled with --fmad=false so that no product
// is contracted into an FMA, and codes match the CPU bit for bit except where a double-precision
// norm summed in another order rounds differently (tests/cuda/test_store.cu counts those).
#include <cfloat>
#include <cstdint>

#include "device.cuh"
#include "kvq/numeric.hpp"
#include "kvq_cuda.hpp"

namespace kvq::cuda {

namespace detail {

constexpr int kStoreWarps = 4;
constexpr int kStoreMaxDim = 256;

__device__ inline void warp_fwht(float* x, int n, int lane) {
  for (int h = 1; h < n; h <<= 1) {
    for (int j = lane; j < n; j += 32) {
      int off;
      const int bs = hadamard_block(n, j, off);
      if (h < bs && ((j - off) & h) == 0) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
    __syncwarp();
  }
  for (int j = lane; j < n; j += 32) {
    int off;
    const int bs = hadamard_block(n, j, off);
    x[j] *= static_cast<float>(1.0 / sqrt(static_cast<double>(bs)));
  }
  __syncwarp();
}

// Power-of-two n = 32 * NI held as v[i] = x[lane + 32 i]: butterflies across lanes by shuffles,
// then within the lane; each output is the same a + b / a - b as the smem version.
template <int NI>
__device__ __forceinline__ void reg_fwht(float (&v)[NI], int lane) {
#pragma unroll
  for (int h = 1; h < 32; h <<= 1) {
    const bool lower = (lane & h) == 0;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const float o = __shfl_xor_sync(0xffffffffu, v[i], h);
      v[i] = lower ? v[i] + o : o - v[i];
    }
  }
#pragma unroll
  for (int hh = 1; hh < NI; hh <<= 1) {
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      if ((i & hh) == 0) {
        const float a = v[i], b = v[i + hh];
        v[i] = a + b;
        v[i + hh] = a - b;
      }
    }
  }
  const float sc = static_cast<float>(1.0 / sqrt(static_cast<double>(32 * NI)));
#pragma unroll
  for (int i = 0; i < NI; ++i) v[i] *= sc;
}

// Number of the 2^bits - 1 sorted edges strictly below y (kvq::bucketize).
__device__ __forceinline__ int bucket(const float* __restrict__ edges, int bits, float y) {
  int lo = 0, n = (1 << bits) - 1;
  while (n > 0) {
    const int half = n >> 1;
    if (__ldg(edges + lo + half) < y) {
      lo += half + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  return lo;
}

__device__ inline double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int BITS>
__device__ inline void warp_pack_t(const std::uint8_t* codes, int n, std::uint8_t* out, int lane) {
  const int nbytes = (n * BITS + 7) / 8;
  for (int j = lane; j < nbytes; j += 32) {
    unsigned v = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int bit = 8 * j + k, i = bit / BITS;
      if (i < n) v |= ((static_cast<unsigned>(codes[i]) >> (bit % BITS)) & 1u) << k;
    }
    out[j] = static_cast<std::uint8_t>(v);
  }
}

// Packs n b-bit codes (LSB first) into (n * b + 7) / 8 bytes.
__device__ inline void warp_pack(const std::uint8_t* codes, int n, int bits, std::uint8_t* out, int lane) {
  switch (bits) {
    case 2: warp_pack_t<2>(codes, n, out, lane); return;
    case 3: warp_pack_t<3>(codes, n, out, lane); return;
    case 4: warp_pack_t<4>(codes, n, out, lane); return;
    case 5: warp_pack_t<5>(codes, n, out, lane); return;
    default: break;
  }
  const int nbytes = (n * bits + 7) / 8;
  for (int j = lane; j < nbytes; j += 32) {
    unsigned v = 0;
    for (int k = 0; k < 8; ++k) {
      const int bit = 8 * j + k, i = bit / bits;
      if (i < n) v |= ((static_cast<unsigned>(codes[i]) >> (bit % bits)) & 1u) << k;
    }
    out[j] = static_cast<std::uint8_t>(v);
  }
}

__device__ inline void put_fp16(std::uint8_t* p, float v) {
  const std::uint16_t h = float_to_fp16(v);
  p[0] = static_cast<std::uint8_t>(h & 0xff);
  p[1] = static_cast<std::uint8_t>(h >> 8);
}

// TurboQuant (one or two segments) of one head's vector.
__device__ void encode_tq(const FormatDesc& f, bool is_key, int head, const std::uint16_t* row, float* x, float* y,
                          std::uint8_t* codes, std::uint8_t* dst_codes, std::uint8_t* dst_meta, int lane) {
  const int D = f.head_dim;
  const std::int32_t* perm = (is_key ? f.key_perm : f.value_perm) + static_cast<std::size_t>(head) * D;
  const float* signs = (is_key ? f.key_signs : f.value_signs) + static_cast<std::size_t>(head) * D;
  for (int i = lane; i < D; i += 32) x[i] = bf16_bits_to_float(row[perm[i]]);
  __syncwarp();
  int off = 0, code_off = 0;
  for (int s = 0; s < f.segments; ++s) {
    const int n = f.seg_dims[s], bits = is_key ? f.key_bits[s] : f.value_bits[s];
    const float* cent = (is_key ? f.key_centroids : f.value_centroids) + s * kMaxCodebook;
    const float* edges = (is_key ? f.key_edges : f.value_edges) + s * kMaxCodebook;
    double ss = 0;
    for (int i = lane; i < n; i += 32) ss += static_cast<double>(x[off + i]) * static_cast<double>(x[off + i]);
    const float norm = static_cast<float>(sqrt(warp_sum(ss)));
    const float inv = norm > 0 ? 1.0f / norm : 0.0f;
    double c2 = 0;
    auto finish = [&](int i, float yi) {
      const int c = bucket(edges, bits, yi);
      codes[i] = static_cast<std::uint8_t>(c);
      const double cv = __ldg(cent + c);
      c2 += cv * cv;
    };
#define KVQ_REG_PATH(NI)                                                     \
  if (n == 32 * NI) {                                                        \
    float v[NI];                                                             \
    _Pragma("unroll") for (int i = 0; i < NI; ++i) {                         \
      const int j = lane + 32 * i;                                           \
      v[i] = (x[off + j] * inv) * signs[off + j];                            \
    }                                                                        \
    reg_fwht<NI>(v, lane);                                                   \
    _Pragma("unroll") for (int i = 0; i < NI; ++i) finish(lane + 32 * i, v[i]); \
  } else
    KVQ_REG_PATH(1) KVQ_REG_PATH(2) KVQ_REG_PATH(4) KVQ_REG_PATH(8) {
      for (int i = lane; i < n; i += 32) y[i] = (x[off + i] * inv) * signs[off + i];
      __syncwarp();
      warp_fwht(y, n, lane);
      for (int i = lane; i < n; i += 32) finish(i, y[i]);
    }
#undef KVQ_REG_PATH
    c2 = warp_sum(c2);
    __syncwarp();
    warp_pack(codes, n, bits, dst_codes + code_off, lane);
    if (lane == 0) put_fp16(dst_meta + 2 * s, norm > 0 ? static_cast<float>(static_cast<double>(norm) / sqrt(c2)) : norm);
    __syncwarp();
    off += n;
    code_off += (n * bits + 7) / 8;
  }
}

__device__ void encode_uniform(int D, int bits, const std::uint16_t* row, float* x, std::uint8_t* codes,
                               std::uint8_t* dst_codes, std::uint8_t* dst_meta, int lane) {
  float lo = INFINITY, hi = -INFINITY;
  for (int i = lane; i < D; i += 32) {
    x[i] = bf16_bits_to_float(row[i]);
    lo = fminf(lo, x[i]);
    hi = fmaxf(hi, x[i]);
  }
  for (int o = 16; o > 0; o >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  const int m = (1 << bits) - 1;
  float s = (hi - lo) / static_cast<float>(m);
  if (!(s > 1e-8f)) s = 1e-8f;
  for (int i = lane; i < D; i += 32) {
    const float q = floorf((x[i] - lo) / s + 0.5f);
    codes[i] = static_cast<std::uint8_t>(fminf(fmaxf(q, 0.0f), static_cast<float>(m)));
  }
  __syncwarp();
  warp_pack(codes, D, bits, dst_codes, lane);
  if (lane == 0) {
    put_fp16(dst_meta, s);
    put_fp16(dst_meta + 2, lo);
  }
  __syncwarp();
}

__global__ void __launch_bounds__(kStoreWarps * 32) store_kernel(const StoreParams p) {
  __shared__ float xs[kStoreWarps][kStoreMaxDim], ys[kStoreWarps][kStoreMaxDim];
  __shared__ std::uint8_t cs[kStoreWarps][kStoreMaxDim];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const FormatDesc& f = p.fmt;
  const long gid = static_cast<long>(blockIdx.x) * kStoreWarps + w;
  const int H = f.kv_heads, D = f.head_dim;
  if (gid >= static_cast<long>(p.n_tokens) * H) return;
  const int tok = static_cast<int>(gid / H), head = static_cast<int>(gid % H);
  const std::int64_t slot = p.slot_mapping[tok];
  const std::int64_t ks = p.key_token_stride ? p.key_token_stride : static_cast<std::int64_t>(H) * D;
  const std::int64_t vs = p.value_token_stride ? p.value_token_stride : static_cast<std::int64_t>(H) * D;
  const std::uint16_t* krow = p.key + tok * ks + static_cast<std::int64_t>(head) * D;
  const std::uint16_t* vrow = p.value + tok * vs + static_cast<std::int64_t>(head) * D;
  if (slot >= 0) {
    const PageLayout& pg = f.page;
    std::uint8_t* base = p.pool + static_cast<std::size_t>(slot / pg.tokens) * pg.page_bytes;
    const int off = static_cast<int>(slot % pg.tokens);
    std::uint8_t* kc = base + pg.key_code(head, off);
    std::uint8_t* vc = base + pg.value_code(head, off);
    std::uint8_t* km = base + pg.key_meta(head, off);
    std::uint8_t* vm = base + pg.value_meta(head, off);
    switch (f.key) {
      case KeyCode::kTq: encode_tq(f, true, head, krow, xs[w], ys[w], cs[w], kc, km, lane); break;
      case KeyCode::kFp8:
        for (int i = 4 * lane; i < D; i += 128) {
          std::uint32_t w = 0;
#pragma unroll
          for (int k = 0; k < 4; ++k) w |= static_cast<std::uint32_t>(float_to_fp8_e4m3(bf16_bits_to_float(krow[i + k]), true)) << (8 * k);
          *reinterpret_cast<std::uint32_t*>(kc + i) = w;
        }
        break;
      case KeyCode::kBf16:
        for (int i = lane; i < D / 2; i += 32)
          reinterpret_cast<std::uint32_t*>(kc)[i] = reinterpret_cast<const std::uint32_t*>(krow)[i];
        break;
    }
    __syncwarp();
    switch (f.value) {
      case ValueCode::kTq: encode_tq(f, false, head, vrow, xs[w], ys[w], cs[w], vc, vm, lane); break;
      case ValueCode::kUniform: encode_uniform(D, f.value_bits[0], vrow, xs[w], cs[w], vc, vm, lane); break;
      case ValueCode::kBf16:
        for (int i = lane; i < D / 2; i += 32)
          reinterpret_cast<std::uint32_t*>(vc)[i] = reinterpret_cast<const std::uint32_t*>(vrow)[i];
        break;
    }
    for (std::uint32_t i = pg.key_meta_bytes + pg.value_meta_bytes + lane; i < pg.meta_bytes; i += 32) km[i] = 0;
  }
  if (p.protect_rows && p.positions && p.seq_ids) {
    const std::int32_t pos = p.positions[tok];
    const std::int32_t sl = p.protect.slot(pos);
    const bool keep = pos < p.protect.sinks || !p.protect_seq_lens ||
                      pos >= p.protect_seq_lens[p.seq_ids[tok]] - p.protect.window;
    if (sl >= 0 && keep) {
      std::uint16_t* dst = p.protect_rows + p.protect.row(p.seq_ids[tok], head, sl);
      for (int i = lane; i < D; i += 32) {
        dst[i] = krow[i];
        dst[D + i] = vrow[i];
      }
    }
  }
}

}  // namespace detail

cudaError_t store(const StoreParams& p, cudaStream_t stream) {
  const FormatDesc& f = p.fmt;
  if (p.n_tokens < 0 || f.head_dim <= 0 || f.head_dim > detail::kStoreMaxDim || f.head_dim % 32 != 0 || f.kv_heads <= 0)
    return cudaErrorInvalidValue;
  if (p.n_tokens == 0) return cudaSuccess;
  if (!p.key || !p.value || !p.slot_mapping || !p.pool) return cudaErrorInvalidValue;
  const long warps = static_cast<long>(p.n_tokens) * f.kv_heads;
  const unsigned blocks = static_cast<unsigned>((warps + detail::kStoreWarps - 1) / detail::kStoreWarps);
  detail::store_kernel<<<blocks, detail::kStoreWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kvq::cuda
