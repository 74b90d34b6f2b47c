// Store kernels: quantize new key/value rows and write them into their paged slots through the
// slot mapping. TurboQuant: gather (outlier split), fp32 norm, x / ||x||, sign diagonal, block
// FWHT, bucketize against the codebook midpoints, norm correction folded into the stored fp16
// norm, pack. Uniform values: vLLM's per-vector min/max rule with fp16 scale and zero. fp8 keys:
// saturating e4m3. The arithmetic follows the scalar references in src/quant operation by
// operation; this file is compiled with --fmad=false so that no product is contracted into an
// FMA, and codes match the CPU bit for bit except where a double-precision sum of squares added
// in another order rounds differently (tests/cuda/test_decode.cpp counts those records).
// Two kernels: the fast one (head_dim 64/128/256, one segment or two equal halves; 16 elements
// per lane, several vectors per warp) and the generic one (one warp per (token, KV head), any
// supported shape).
#include <algorithm>
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

__global__ void __launch_bounds__(kStoreWarps * 32) store_generic_kernel(const StoreParams p) {
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


// ---- fast path ---------------------------------------------------------------------------
// head_dim 64 / 128 / 256, one segment or two equal power-of-two segments. A vector (one side
// of one (token, KV head)) is held by P = head_dim / 16 lanes, 16 consecutive elements each
// (segment-order position 16 l + k), so a warp works on 32 / P vectors at once: the FWHT
// stages h = 1..8 run inside a lane and only h >= 16 cross lanes; the sums of squares, the
// bucketization and the packing (2 * bits bytes per lane) need no shared memory. Buckets come
// from a table of bins over y * s (s = 1.25 / smallest gap of the midpoints, so no bin holds
// two midpoints): bin k stores the number of midpoints in bins below k and the midpoint inside
// k (or +inf), and the bucket is base + (mid < y) — the count of midpoints strictly below y,
// exactly kvq::bucketize, because the bin index is a monotone function of y computed the same
// way for y and for the midpoints. Same operations otherwise as the generic kernel above.
constexpr int kFastThreads = 256;
constexpr int kMaxBins = 512;
constexpr float kFloorMagic = 12582912.0f;  // 1.5 * 2^23: fl_down(t + magic) holds floor(t) in its low bits

struct StoreTables {
  float2 bins[4][kMaxBins];  // [key seg 0, key seg 1, value seg 0, value seg 1]: {midpoint or +inf, base (int bits)}
  double csq[4][kMaxCodebook];  // squared centroids, for the norm correction
  float edges[4][kMaxCodebook];
  float scale[4];
  int half[4];
  int ok[4];
};

__device__ __forceinline__ int bin_of(float y, float s, int half) {
  const float t = fminf(fmaxf(y * s, -static_cast<float>(half)), static_cast<float>(half - 1));
  return __float_as_int(__fadd_rd(t, kFloorMagic)) - 0x4B400000 + half;
}

// Warp-wide: table t from a codebook with `bits` bits.
__device__ void build_store_table(StoreTables& T, int t, const float* __restrict__ edges_g,
                                  const float* __restrict__ cent_g, int bits, int lane) {
  const int ne = (1 << bits) - 1, nc = 1 << bits;
  for (int i = lane; i < ne; i += 32) T.edges[t][i] = edges_g[i];
  for (int i = lane; i < nc; i += 32) {
    const double c = cent_g[i];
    T.csq[t][i] = c * c;
  }
  __syncwarp();
  float gap = INFINITY, emax = 0.0f;
  for (int i = lane; i < ne; i += 32) {
    emax = fmaxf(emax, fabsf(T.edges[t][i]));
    if (i + 1 < ne) gap = fminf(gap, T.edges[t][i + 1] - T.edges[t][i]);
  }
  for (int o = 16; o > 0; o >>= 1) {
    gap = fminf(gap, __shfl_xor_sync(0xffffffffu, gap, o));
    emax = fmaxf(emax, __shfl_xor_sync(0xffffffffu, emax, o));
  }
  if (ne == 1) gap = 1.0f;
  const float s = 1.25f / gap;
  const float hf = ceilf(emax * s) + 2.0f;
  bool ok = gap > 0.0f && emax < INFINITY && hf <= static_cast<float>(kMaxBins / 2);
  const int half = ok ? static_cast<int>(hf) : 1;
  bool bad = false;
  if (ok) {
    for (int k = lane; k < 2 * half; k += 32) {
      int base = 0, inside = 0;
      float e = INFINITY;
      for (int i = 0; i < ne; ++i) {
        const int bi = bin_of(T.edges[t][i], s, half);
        if (bi < k) ++base;
        if (bi == k) {
          ++inside;
          e = T.edges[t][i];
        }
      }
      bad |= inside > 1;
      T.bins[t][k] = make_float2(e, __int_as_float(base));
    }
  }
  ok = ok && !__any_sync(0xffffffffu, bad);
  if (lane == 0) {
    T.scale[t] = s;
    T.half[t] = half;
    T.ok[t] = ok ? 1 : 0;
  }
}

// float_to_fp16 (round to nearest even, overflow to Inf, subnormals) by the conversion
// instruction; NaN through the software path for its payload.
__device__ __forceinline__ std::uint16_t fp16_bits(float v) {
  return v != v ? float_to_fp16(v) : __half_as_ushort(__float2half_rn(v));
}

template <int B>
__device__ __forceinline__ void pack_store16(const int (&c)[16], std::uint8_t* dst) {
  std::uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    constexpr int b = B;
    const int pos = k * b, i = pos >> 5, o = pos & 31;
    w[i] |= static_cast<std::uint32_t>(c[k]) << o;
    if (o + b > 32) w[i + 1] |= static_cast<std::uint32_t>(c[k]) >> (32 - o);
  }
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(dst);
  if constexpr (B == 2) {
    if ((a & 3) == 0) {
      *reinterpret_cast<std::uint32_t*>(dst) = w[0];
      return;
    }
  } else if constexpr (B == 4) {
    if ((a & 7) == 0) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
      return;
    }
  } else if constexpr (B == 8) {
    if ((a & 15) == 0) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < B; ++j)
    reinterpret_cast<std::uint16_t*>(dst)[j] = static_cast<std::uint16_t>(w[j >> 1] >> (16 * (j & 1)));
}

__device__ __forceinline__ void pack_store16_bits(int bits, const int (&c)[16], std::uint8_t* dst) {
  switch (bits) {
    case 1: pack_store16<1>(c, dst); break;
    case 2: pack_store16<2>(c, dst); break;
    case 3: pack_store16<3>(c, dst); break;
    case 4: pack_store16<4>(c, dst); break;
    case 5: pack_store16<5>(c, dst); break;
    case 6: pack_store16<6>(c, dst); break;
    case 7: pack_store16<7>(c, dst); break;
    default: pack_store16<8>(c, dst); break;
  }
}

// 16 bf16 elements (32 bytes) as 8 words.
struct Raw16 {
  uint4 a, b;
};
__device__ __forceinline__ Raw16 load_raw16(const std::uint16_t* p) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
  return Raw16{__ldg(q), __ldg(q + 1)};
}
__device__ __forceinline__ void unpack_raw16(const Raw16& r, float (&x)[16]) {
  const std::uint32_t w[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.b.x, r.b.y, r.b.z, r.b.w};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    x[2 * j] = __uint_as_float(w[j] << 16);
    x[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
  }
}

// Outlier split: the lane's 16 segment-order elements x[k] = row[perm[k]], gathered from the
// warp's rows staged in shared memory (row of vector g at [g * D], D = 16 P).
__device__ __forceinline__ void gather16(const Raw16& r, const std::int32_t* __restrict__ perm, std::uint16_t* buf,
                                         int lane, int P, float (&x)[16]) {
  __syncwarp();
  reinterpret_cast<uint4*>(buf)[2 * lane] = r.a;
  reinterpret_cast<uint4*>(buf)[2 * lane + 1] = r.b;
  __syncwarp();
  const std::uint16_t* row = buf + (lane / P) * (16 * P);
  const int4* pp = reinterpret_cast<const int4*>(perm);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int4 q4 = __ldg(pp + j);
    x[4 * j] = bf16_bits_to_float(row[q4.x]);
    x[4 * j + 1] = bf16_bits_to_float(row[q4.y]);
    x[4 * j + 2] = bf16_bits_to_float(row[q4.z]);
    x[4 * j + 3] = bf16_bits_to_float(row[q4.w]);
  }
}

// TurboQuant of one side of P-lane vectors (lane l of its vector, segment size S = 16 PS).
// Returns the fp16 bits of the stored norm of this lane's segment.
template <int PS>
__device__ __forceinline__ std::uint16_t tq_encode16(const StoreTables& T, int t, float (&v)[16],
                                                     const float* __restrict__ signs, int bits, std::uint8_t* dst,
                                                     bool write, int l) {
  double ss = 0;
#pragma unroll
  for (int k = 0; k < 16; ++k) ss += static_cast<double>(v[k]) * static_cast<double>(v[k]);
#pragma unroll
  for (int o = 1; o < PS; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float norm = static_cast<float>(sqrt(ss));
  const float inv = norm > 0 ? 1.0f / norm : 0.0f;
  {
    const float4* sp = reinterpret_cast<const float4*>(signs);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 s4 = __ldg(sp + j);
      v[4 * j] = (v[4 * j] * inv) * s4.x;
      v[4 * j + 1] = (v[4 * j + 1] * inv) * s4.y;
      v[4 * j + 2] = (v[4 * j + 2] * inv) * s4.z;
      v[4 * j + 3] = (v[4 * j + 3] * inv) * s4.w;
    }
  }
#pragma unroll
  for (int h = 1; h < 16; h <<= 1) {
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      if ((k & h) == 0) {
        const float a = v[k], b = v[k + h];
        v[k] = a + b;
        v[k + h] = a - b;
      }
    }
  }
  // Across lanes: lower lane a + b, upper lane b - a, as fma(+-1, v, o): the product is exact,
  // so this is the same single rounding as the sum or difference.
#pragma unroll
  for (int m = 1; m < PS; m <<= 1) {
    const float sgn = (l & m) == 0 ? 1.0f : -1.0f;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const float o = __shfl_xor_sync(0xffffffffu, v[k], m);
      v[k] = __fmaf_rn(v[k], sgn, o);
    }
  }
  const float sc = static_cast<float>(1.0 / sqrt(static_cast<double>(16 * PS)));
  int c[16];
  double c2 = 0;
  if (T.ok[t]) {
    const float s = T.scale[t];
    const int half = T.half[t];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const float y = v[k] * sc;
      const float2 bn = T.bins[t][bin_of(y, s, half)];
      c[k] = __float_as_int(bn.y) + (bn.x < y ? 1 : 0);
      c2 += T.csq[t][c[k]];
    }
  } else {
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const float y = v[k] * sc;
      int lo = 0, n = (1 << bits) - 1;
      while (n > 0) {
        const int hf = n >> 1;
        if (T.edges[t][lo + hf] < y) {
          lo += hf + 1;
          n -= hf + 1;
        } else {
          n = hf;
        }
      }
      c[k] = lo;
    }
#pragma unroll
    for (int k = 0; k < 16; ++k) c2 += T.csq[t][c[k]];
  }
#pragma unroll
  for (int o = 1; o < PS; o <<= 1) c2 += __shfl_xor_sync(0xffffffffu, c2, o);
  if (write) pack_store16_bits(bits, c, dst);
  const float stored = norm > 0 ? static_cast<float>(static_cast<double>(norm) / sqrt(c2)) : norm;
  return fp16_bits(stored);
}

template <int D>
__global__ void __launch_bounds__(kFastThreads) store_fast_kernel(const StoreParams p, long nwarps) {
  __shared__ StoreTables T;
  __shared__ __align__(16) std::uint16_t rows[kFastThreads / 32][32 * 16];  // split formats: staged rows
  constexpr int P = D / 16, V = 32 / P;
  const FormatDesc& f = p.fmt;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int l = lane & (P - 1), gbase = lane & ~(P - 1);
  const int nseg = f.segments;
  if (w < 4) {
    const int side = w >> 1, seg = w & 1;
    const bool tq = side == 0 ? f.key == KeyCode::kTq : f.value == ValueCode::kTq;
    if (tq && seg < nseg)
      build_store_table(T, w, (side ? f.value_edges : f.key_edges) + seg * kMaxCodebook,
                        (side ? f.value_centroids : f.key_centroids) + seg * kMaxCodebook,
                        side ? f.value_bits[seg] : f.key_bits[seg], lane);
  }
  __syncthreads();
  const int H = f.kv_heads;
  const PageLayout& pg = f.page;
  const long nvec = static_cast<long>(p.n_tokens) * H;
  const std::int64_t ks = p.key_token_stride ? p.key_token_stride : static_cast<std::int64_t>(H) * D;
  const std::int64_t vs = p.value_token_stride ? p.value_token_stride : static_cast<std::int64_t>(H) * D;
  // Segment of this lane (two segments: D / 2 each).
  const int PSv = nseg == 2 ? P / 2 : P;
  const int sg = l / PSv, ls = l % PSv;
  const int kmu = static_cast<int>(pg.key_meta_bytes / 2), vmu = static_cast<int>(pg.value_meta_bytes / 2);
  const int mu = static_cast<int>(pg.meta_bytes / 2);
  const bool protect = p.protect_rows && p.positions && p.seq_ids;

  for (long wg = static_cast<long>(blockIdx.x) * (kFastThreads / 32) + w; wg < nwarps;
       wg += static_cast<long>(gridDim.x) * (kFastThreads / 32)) {
    const long gv = wg * V + lane / P;
    const bool valid = gv < nvec;
    const int tok = valid ? static_cast<int>(gv / H) : 0, head = valid ? static_cast<int>(gv % H) : 0;
    const std::int64_t slot = valid ? p.slot_mapping[tok] : -1;
    const bool write = slot >= 0;
    const std::uint16_t* krow = p.key + tok * ks + static_cast<std::int64_t>(head) * D;
    const std::uint16_t* vrow = p.value + tok * vs + static_cast<std::int64_t>(head) * D;
    std::uint8_t* base = p.pool + (write ? static_cast<std::size_t>(slot / pg.tokens) * pg.page_bytes : 0);
    const int off = write ? static_cast<int>(slot % pg.tokens) : 0;
    std::uint8_t* kc = base + pg.key_code(head, off);
    std::uint8_t* vc = base + pg.value_code(head, off);
    std::uint8_t* meta = base + pg.key_meta(head, off);
    const std::size_t hd = static_cast<std::size_t>(head) * D + 16 * l;

    Raw16 kr{}, vr{};
    if (valid) kr = load_raw16(krow + 16 * l);
    std::uint16_t ku[2] = {0, 0}, vu[2] = {0, 0};
    // ---- keys ----
    if (f.key == KeyCode::kTq) {
      float x[16];
      if (nseg == 1) unpack_raw16(kr, x);
      else gather16(kr, f.key_perm + hd, rows[w], lane, P, x);
      const int bits = f.key_bits[sg];
      std::uint8_t* dst = kc + (sg ? f.seg_dims[0] * f.key_bits[0] / 8 : 0) + 2 * bits * ls;
      const std::uint16_t h = nseg == 2 ? tq_encode16<P / 2>(T, sg, x, f.key_signs + hd, bits, dst, write, l)
                                        : tq_encode16<P>(T, 0, x, f.key_signs + hd, bits, dst, write, l);
      ku[0] = static_cast<std::uint16_t>(__shfl_sync(0xffffffffu, h, gbase));
      ku[1] = static_cast<std::uint16_t>(__shfl_sync(0xffffffffu, h, gbase + PSv));
    } else if (f.key == KeyCode::kFp8) {
      float x[16];
      unpack_raw16(kr, x);
      std::uint32_t o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x[4 * j], x[4 * j + 1]), __NV_SATFINITE, __NV_E4M3);
        const std::uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x[4 * j + 2], x[4 * j + 3]), __NV_SATFINITE, __NV_E4M3);
        o[j] = (lo & 0xffffu) | (hi << 16);
      }
      if (write) *reinterpret_cast<uint4*>(kc + 16 * l) = make_uint4(o[0], o[1], o[2], o[3]);
    } else {
      if (write) {
        reinterpret_cast<uint4*>(kc + 32 * l)[0] = kr.a;
        reinterpret_cast<uint4*>(kc + 32 * l)[1] = kr.b;
      }
    }
    // ---- values ----
    if (valid) vr = load_raw16(vrow + 16 * l);
    if (f.value == ValueCode::kTq) {
      float x[16];
      if (nseg == 1) unpack_raw16(vr, x);
      else gather16(vr, f.value_perm + hd, rows[w], lane, P, x);
      const int bits = f.value_bits[sg];
      std::uint8_t* dst = vc + (sg ? f.seg_dims[0] * f.value_bits[0] / 8 : 0) + 2 * bits * ls;
      const std::uint16_t h = nseg == 2 ? tq_encode16<P / 2>(T, 2 + sg, x, f.value_signs + hd, bits, dst, write, l)
                                        : tq_encode16<P>(T, 2, x, f.value_signs + hd, bits, dst, write, l);
      vu[0] = static_cast<std::uint16_t>(__shfl_sync(0xffffffffu, h, gbase));
      vu[1] = static_cast<std::uint16_t>(__shfl_sync(0xffffffffu, h, gbase + PSv));
    } else if (f.value == ValueCode::kUniform) {
      float x[16];
      unpack_raw16(vr, x);
      float lo = INFINITY, hi = -INFINITY;
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        lo = fminf(lo, x[k]);
        hi = fmaxf(hi, x[k]);
      }
#pragma unroll
      for (int o = 1; o < P; o <<= 1) {
        lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
      }
      const int bits = f.value_bits[0];
      const int m = (1 << bits) - 1;
      float s = (hi - lo) / static_cast<float>(m);
      if (!(s > 1e-8f)) s = 1e-8f;
      int c[16];
      // clamp(floor(t), 0, m) = floor(clamp(t, 0, m)) for integer m; the floor through the
      // round-down add of 1.5 * 2^23 (exact for 0 <= t <= 255).
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const float t = fminf(fmaxf((x[k] - lo) / s + 0.5f, 0.0f), static_cast<float>(m));
        c[k] = __float_as_int(__fadd_rd(t, kFloorMagic)) - 0x4B400000;
      }
      if (write) pack_store16_bits(bits, c, vc + 2 * bits * l);
      vu[0] = fp16_bits(s);
      vu[1] = fp16_bits(lo);
    } else {
      if (write) {
        reinterpret_cast<uint4*>(vc + 32 * l)[0] = vr.a;
        reinterpret_cast<uint4*>(vc + 32 * l)[1] = vr.b;
      }
    }
    // ---- metadata record: [key units][value units][zero pad], one 16-bit unit per lane ----
    if (write && l < mu) {
      std::uint16_t u = 0;
      if (l < kmu) u = l == 0 ? ku[0] : ku[1];
      else if (l < kmu + vmu) u = l == kmu ? vu[0] : vu[1];
      reinterpret_cast<std::uint16_t*>(meta)[l] = u;
    }
    // ---- protected bf16 rows ----
    if (protect && valid) {
      const std::int32_t pos = p.positions[tok];
      const std::int32_t sl = p.protect.slot(pos);
      const bool keep = pos < p.protect.sinks || !p.protect_seq_lens ||
                        pos >= p.protect_seq_lens[p.seq_ids[tok]] - p.protect.window;
      if (sl >= 0 && keep) {
        std::uint16_t* dst = p.protect_rows + p.protect.row(p.seq_ids[tok], head, sl);
        for (int i = 16 * l; i < 16 * l + 16; ++i) {
          dst[i] = krow[i];
          dst[D + i] = vrow[i];
        }
      }
    }
  }
}

template <int D>
cudaError_t launch_store_fast(const StoreParams& p, cudaStream_t stream) {
  static int max_blocks = 0;
  if (max_blocks == 0) {
    int per_sm = 0, dev = 0, sms = 0;
    cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, store_fast_kernel<D>, kFastThreads, 0);
    if (e == cudaSuccess) e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return e;
    max_blocks = std::max(1, per_sm) * std::max(1, sms);
  }
  constexpr int V = 32 / (D / 16);
  const long nvec = static_cast<long>(p.n_tokens) * p.fmt.kv_heads;
  const long nwarps = (nvec + V - 1) / V;
  const long want = (nwarps + kFastThreads / 32 - 1) / (kFastThreads / 32);
  const unsigned blocks = static_cast<unsigned>(std::min<long>(want, max_blocks));
  store_fast_kernel<D><<<blocks, kFastThreads, 0, stream>>>(p, nwarps);
  return cudaGetLastError();
}

// Whether the fast kernel serves this store.
bool store_fast_applies(const StoreParams& p) {
  const FormatDesc& f = p.fmt;
  const int D = f.head_dim;
  if (D != 64 && D != 128 && D != 256) return false;
  const int nseg = f.segments;
  if (nseg != 1 && !(nseg == 2 && f.seg_dims[0] == D / 2 && f.seg_dims[1] == D / 2)) return false;
  const bool ktq = f.key == KeyCode::kTq, vtq = f.value == ValueCode::kTq;
  for (int s = 0; s < nseg; ++s) {
    if (ktq && (f.key_bits[s] < 1 || f.key_bits[s] > 8)) return false;
    if (vtq && (f.value_bits[s] < 1 || f.value_bits[s] > 8)) return false;
  }
  if (f.value == ValueCode::kUniform && (f.value_bits[0] < 1 || f.value_bits[0] > 8)) return false;
  const PageLayout& pg = f.page;
  const std::uint32_t kmb = ktq ? 2u * nseg : 0u;
  const std::uint32_t vmb = vtq ? 2u * nseg : (f.value == ValueCode::kUniform ? 4u : 0u);
  if (pg.key_meta_bytes != kmb || pg.value_meta_bytes != vmb || pg.meta_bytes % 2 != 0 ||
      pg.meta_bytes / 2 > static_cast<std::uint32_t>(D / 16))
    return false;
  auto a16 = [](const void* q) { return (reinterpret_cast<std::uintptr_t>(q) & 15) == 0; };
  if (!a16(p.key) || !a16(p.value) || !a16(p.pool) || p.key_token_stride % 8 != 0 || p.value_token_stride % 8 != 0 ||
      pg.page_bytes % 16 != 0 || pg.key_code_off % 16 != 0 || pg.value_code_off % 16 != 0)
    return false;
  if (f.key == KeyCode::kTq && (!f.key_signs || !f.key_edges || !f.key_centroids || (nseg == 2 && !f.key_perm))) return false;
  if (f.value == ValueCode::kTq && (!f.value_signs || !f.value_edges || !f.value_centroids || (nseg == 2 && !f.value_perm)))
    return false;
  return true;
}

}  // namespace detail

cudaError_t store(const StoreParams& p, cudaStream_t stream) {
  const FormatDesc& f = p.fmt;
  if (p.n_tokens < 0 || f.head_dim <= 0 || f.head_dim > detail::kStoreMaxDim || f.head_dim % 32 != 0 || f.kv_heads <= 0)
    return cudaErrorInvalidValue;
  if (p.n_tokens == 0) return cudaSuccess;
  if (!p.key || !p.value || !p.slot_mapping || !p.pool) return cudaErrorInvalidValue;
  if (detail::store_fast_applies(p)) {
    switch (f.head_dim) {
      case 64: return detail::launch_store_fast<64>(p, stream);
      case 128: return detail::launch_store_fast<128>(p, stream);
      case 256: return detail::launch_store_fast<256>(p, stream);
      default: break;
    }
  }
  const long warps = static_cast<long>(p.n_tokens) * f.kv_heads;
  const unsigned blocks = static_cast<unsigned>((warps + detail::kStoreWarps - 1) / detail::kStoreWarps);
  detail::store_generic_kernel<<<blocks, detail::kStoreWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kvq::cuda
