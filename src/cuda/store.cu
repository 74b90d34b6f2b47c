// Store kernels: quantize new key/value rows and write them into their paged slots through the
// slot mapping. TurboQuant: gather (outlier split), float norm, x / ||x||, sign diagonal, block
// FWHT, bucketize against the codebook midpoints, norm correction folded into the stored fp16
// norm, pack. Uniform values: vLLM's per-vector min/max rule with fp16 scale and zero. fp8 keys:
// saturating e4m3. The arithmetic follows the scalar references in src/quant operation by
// operation; this file is compiled with --fmad=false so that no product is contracted into an
// FMA (the FMAs it wants are explicit), and records match the CPU's bit for bit: the sums of
// squares add in kvq::sum_squares's order (bins.cuh), which tests/cuda/test_bins.cu checks.
// Four kernels: a coalesced copy for the bf16 cache; the fast one (head_dim 64/128/256, the core
// grid's formats, instantiated per format; 32 elements per lane, several vectors per warp; the
// exact shortcuts it takes are explained where they are used); its paired form for one-segment
// formats with TurboQuant keys and values (keys in one half-warp, values in the other, 64 elements
// per lane); and the generic one (one warp per (token, KV head), any supported shape).
#include <algorithm>
#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include <cuda.h>

#include "bins.cuh"
#include "code_counts.hpp"
#include "device.cuh"
#include "stage.cuh"
#include "kvq/numeric.hpp"
#include "kvq_cuda.hpp"

namespace kvq::cuda {

namespace detail {

constexpr int kStoreWarps = 4;
constexpr int kStoreMaxDim = 256;

// Elements between a side's tokens: the given stride, or (0) the packed [token][head][D] rows.
__host__ __device__ __forceinline__ std::int64_t token_stride(std::int64_t given, int H, int D) {
  return given ? given : static_cast<std::int64_t>(H) * D;
}

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

// Number of the 2^bits - 1 sorted edges strictly below y (kvq::bucketize).
__device__ __forceinline__ int bucket(const float* __restrict__ edges, int bits, float y) {
  return count_below<true>(edges, (1 << bits) - 1, y);
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

// TurboQuant (one or two segments) of one head's vector: the codes into `codes` (segment order) and
// each segment's stored (norm-corrected) norm into stored[s], the same in every lane. Writes nothing
// to global memory (write_tq does, once the record is accepted).
__device__ void encode_tq(const FormatDesc& f, bool is_key, int head, const std::uint16_t* row, float* x, float* y,
                          std::uint8_t* codes, float* stored, int lane) {
  const int D = f.head_dim;
  const std::int32_t* perm = (is_key ? f.key_perm : f.value_perm) + static_cast<std::size_t>(head) * D;
  const float* signs = (is_key ? f.key_signs : f.value_signs) + static_cast<std::size_t>(head) * D;
  // Centered formats subtract the channel mean first (the CPU's x - offset, one float subtraction).
  const float* mean = is_key ? f.key_mean : f.value_mean;
  if (mean) {
    mean += static_cast<std::size_t>(head) * D;
    for (int i = lane; i < D; i += 32) x[i] = bf16_bits_to_float(row[perm[i]]) - mean[perm[i]];
  } else {
    for (int i = lane; i < D; i += 32) x[i] = bf16_bits_to_float(row[perm[i]]);
  }
  __syncwarp();
  int off = 0;
  for (int s = 0; s < f.segments; ++s) {
    const int n = f.seg_dims[s], bits = is_key ? f.key_bits[s] : f.value_bits[s];
    const float* terms = (is_key ? f.key_terms : f.value_terms) + s * kMaxCodebook;  // the norm-correction terms
    const float* edges = (is_key ? f.key_edges : f.value_edges) + s * kMaxCodebook;
    const float norm = __fsqrt_rn(warp_sum_squares(n, lane, [&](int b, int k) { return x[off + 32 * b + k]; }));
    const float inv = norm > 0 ? __frcp_rn(norm) : 0.0f;
    auto finish = [&](int i, float yi) { codes[off + i] = static_cast<std::uint8_t>(bucket(edges, bits, yi)); };
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
    __syncwarp();
    stored[s] = corrected_norm(norm, warp_grid_square_sum(n, lane, [&](int i) { return __ldg(terms + codes[off + i]); }));
    __syncwarp();
    off += n;
  }
}
// Packs the codes of encode_tq and writes its stored norms (fp16).
__device__ void write_tq(const FormatDesc& f, bool is_key, const std::uint8_t* codes, const float* stored, std::uint8_t* dst_codes,
                         std::uint8_t* dst_meta, int lane) {
  int off = 0, code_off = 0;
  for (int s = 0; s < f.segments; ++s) {
    const int n = f.seg_dims[s], bits = is_key ? f.key_bits[s] : f.value_bits[s];
    warp_pack(codes + off, n, bits, dst_codes + code_off, lane);
    if (lane == 0) put_fp16(dst_meta + 2 * s, stored[s]);
    off += n;
    code_off += (n * bits + 7) / 8;
  }
  __syncwarp();
}

// vLLM's uniform values: codes into `codes`; the scale, min and max (lane-uniform) out.
__device__ void encode_uniform(int D, int bits, const std::uint16_t* row, float* x, std::uint8_t* codes, float& s_out, float& lo_out,
                               float& hi_out, int lane) {
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
  s_out = s;
  lo_out = lo;
  hi_out = hi;
}

// The protected bf16 row (key row, then value row) of token t and KV head `head` in the side buffer, or nullptr
// where the token's position is not protected: a sink (pos < S), or in the last W positions of its sequence (where
// the launch gives protect_seq_lens; without them every ring slot is written). The caller has checked that the
// launch protects rows at all (protect_rows, positions and seq_ids given).
__device__ __forceinline__ std::uint16_t* protected_row(const StoreParams& p, int t, int head) {
  const std::int32_t pos = p.positions[t];
  const std::int32_t sl = p.protect.slot(pos);
  const bool keep = pos < p.protect.sinks || !p.protect_seq_lens || pos >= p.protect_seq_lens[p.seq_ids[t]] - p.protect.window;
  return sl >= 0 && keep ? p.protect_rows + p.protect.row(p.seq_ids[t], head, sl) : nullptr;
}

// One warp per (token, KV head); every check before any write (the record is refused whole, as
// by the CPU encoders: non-finite rows, TurboQuant stored norms and uniform min / max beyond fp16).
__global__ void __launch_bounds__(kStoreWarps * 32) store_generic_kernel(const StoreParams p) {
  launch_dependents();  // a decode launched programmatically after the store may start (DecodeParams::programmatic)
  __shared__ float xs[kStoreWarps][kStoreMaxDim], ys[kStoreWarps][kStoreMaxDim];
  __shared__ std::uint8_t cs[kStoreWarps][2][kStoreMaxDim];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const FormatDesc& f = p.fmt;
  const long gid = static_cast<long>(blockIdx.x) * kStoreWarps + w;
  const int H = f.kv_heads, D = f.head_dim;
  if (gid >= static_cast<long>(p.n_tokens) * H) return;
  const int tok = static_cast<int>(gid / H), head = static_cast<int>(gid % H);
  const std::int64_t slot = p.slot_mapping[tok];
  const std::int64_t ks = token_stride(p.key_token_stride, H, D);
  const std::int64_t vs = token_stride(p.value_token_stride, H, D);
  const std::uint16_t* krow = p.key + tok * ks + static_cast<std::int64_t>(head) * D;
  const std::uint16_t* vrow = p.value + tok * vs + static_cast<std::int64_t>(head) * D;
  bool bad = false;
  for (int i = lane; i < D; i += 32) bad |= (krow[i] & 0x7f80u) == 0x7f80u || (vrow[i] & 0x7f80u) == 0x7f80u;
  bad = __any_sync(0xffffffffu, bad);
  float kst[2] = {0, 0}, vst[2] = {0, 0}, us = 0, ulo = 0, uhi = 0;
  if (!bad) {  // warp-uniform; the stored norms and the uniform range are the same in every lane
    if (f.key == KeyCode::kTq) {
      encode_tq(f, true, head, krow, xs[w], ys[w], cs[w][0], kst, lane);
      for (int s = 0; s < f.segments; ++s) bad |= !(fabsf(kst[s]) <= 65504.0f);
    }
    if (f.value == ValueCode::kTq) {
      encode_tq(f, false, head, vrow, xs[w], ys[w], cs[w][1], vst, lane);
      for (int s = 0; s < f.segments; ++s) bad |= !(fabsf(vst[s]) <= 65504.0f);
    } else if (f.value == ValueCode::kUniform) {
      encode_uniform(D, f.value_bits[0], vrow, xs[w], cs[w][1], us, ulo, uhi, lane);
      bad |= !(fabsf(ulo) <= 65504.0f && fabsf(uhi) <= 65504.0f);
    }
  }
  if (bad) {
    if (lane == 0 && p.rejected) atomicAdd(p.rejected, 1u);
    return;
  }
  if (slot >= 0) {
    const PageLayout& pg = f.page;
    std::uint8_t* base = p.pool + static_cast<std::size_t>(slot / pg.tokens) * pg.page_bytes;
    const int off = static_cast<int>(slot % pg.tokens);
    std::uint8_t* kc = base + pg.key_code(head, off);
    std::uint8_t* vc = base + pg.value_code(head, off);
    std::uint8_t* km = base + pg.key_meta(head, off);
    std::uint8_t* vm = base + pg.value_meta(head, off);
    switch (f.key) {
      case KeyCode::kTq: write_tq(f, true, cs[w][0], kst, kc, km, lane); break;
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
    switch (f.value) {
      case ValueCode::kTq: write_tq(f, false, cs[w][1], vst, vc, vm, lane); break;
      case ValueCode::kUniform:
        warp_pack(cs[w][1], D, f.value_bits[0], vc, lane);
        if (lane == 0) {
          put_fp16(vm, us);
          put_fp16(vm + 2, ulo);
        }
        break;
      case ValueCode::kBf16:
        for (int i = lane; i < D / 2; i += 32)
          reinterpret_cast<std::uint32_t*>(vc)[i] = reinterpret_cast<const std::uint32_t*>(vrow)[i];
        break;
    }
    for (std::uint32_t i = pg.key_meta_bytes + pg.value_meta_bytes + lane; i < pg.meta_bytes; i += 32) km[i] = 0;
  }
  if (p.protect_rows && p.positions && p.seq_ids) {
    if (std::uint16_t* dst = protected_row(p, tok, head)) {
      for (int i = lane; i < D; i += 32) {
        dst[i] = krow[i];
        dst[D + i] = vrow[i];
      }
    }
  }
}


// The page of a slot and the token's offset in it (tok_shift: log2 of the page's tokens, or -1).
__device__ __forceinline__ std::uint8_t* slot_page(std::uint8_t* pool, const PageLayout& pg, std::int64_t slot, int tok_shift,
                                                   int& off) {
  const std::size_t page = tok_shift >= 0 ? static_cast<std::size_t>(slot >> tok_shift) : static_cast<std::size_t>(slot / pg.tokens);
  off = tok_shift >= 0 ? static_cast<int>(slot & ((1 << tok_shift) - 1)) : static_cast<int>(slot % pg.tokens);
  return pool + page * pg.page_bytes;
}

// ---- fast path ---------------------------------------------------------------------------
// head_dim 64 / 128 / 256, one segment or two equal power-of-two segments, TurboQuant codes of
// at most 4 bits. A vector (one side of one (token, KV head)) is held by P = head_dim / 32 lanes,
// 32 consecutive segment-order elements each (position 32 l + k), so a warp works on 32 / P
// vectors at once: the FWHT stages h = 1..16 run inside a lane and only h >= 32 cross lanes;
// the sums of squares, the bucketization and the packing (4 * bits bytes per lane) need no shared
// memory. Buckets come from the bin tables of bins.cuh (no search). Both lookups and the
// centroid of the norm correction hit tables of at most 16 words, so random codes never conflict on
// a bank. Uniform values divide without a division per
// element: q = RN((x - lo) / s) by one remainder correction of RN(d RN(1/s)) (Markstein), which is
// the correctly rounded quotient. Buckets of TurboQuant codes are taken on the FWHT output before
// its 1 / sqrt(block), against prescaled thresholds. Same operations otherwise as the generic
// kernel above.
constexpr int kFastThreads = 256;

// float_to_fp16 (round to nearest even, overflow to Inf, subnormals) by the conversion
// instruction; NaN through the software path for its payload.
__device__ __forceinline__ std::uint16_t fp16_bits(float v) {
  return v != v ? float_to_fp16(v) : __half_as_ushort(__float2half_rn(v));
}

// Stores the first NW packed words of w (4 NW bytes, 4-byte aligned destination), as wide as the address
// allows: 16-byte stores where NW is a multiple of 4, else 8-byte ones where it is even, else words.
template <int NW, int N>
__device__ __forceinline__ void store_words(const std::uint32_t (&w)[N], std::uint8_t* dst) {
  static_assert(NW <= N, "words to store");
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(dst);
  if constexpr (NW % 4 == 0) {
    if ((a & 15) == 0) {
#pragma unroll
      for (int i = 0; i < NW; i += 4) reinterpret_cast<uint4*>(dst)[i / 4] = make_uint4(w[i], w[i + 1], w[i + 2], w[i + 3]);
      return;
    }
  } else if constexpr (NW % 2 == 0) {
    if ((a & 7) == 0) {
#pragma unroll
      for (int i = 0; i < NW; i += 2) reinterpret_cast<uint2*>(dst)[i / 2] = make_uint2(w[i], w[i + 1]);
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < NW; ++i) reinterpret_cast<std::uint32_t*>(dst)[i] = w[i];
}

// 32 bf16 elements (64 bytes) as 16 words.
struct Raw32 {
  uint4 q[4];
};
__device__ __forceinline__ std::uint32_t raw_word(const Raw32& r, int j) {
  const uint4& q = r.q[j >> 2];
  return (j & 3) == 0 ? q.x : (j & 3) == 1 ? q.y : (j & 3) == 2 ? q.z : q.w;
}
__device__ __forceinline__ void unpack_raw32(const Raw32& r, float (&x)[kLaneElems]) {
#pragma unroll
  for (int j = 0; j < kLaneElems / 2; ++j) {
    const std::uint32_t w = raw_word(r, j);
    x[2 * j] = bf16_lo(w);
    x[2 * j + 1] = bf16_hi(w);
  }
}
__device__ __forceinline__ void store_raw32(const Raw32& r, std::uint8_t* dst) {
#pragma unroll
  for (int i = 0; i < 4; ++i) reinterpret_cast<uint4*>(dst)[i] = r.q[i];
}

// Sign diagonals as XOR masks in shared memory: word (side, head, pair j) has bit 15 set when
// element 2 j is negated and bit 31 for element 2 j + 1 (one XOR per bf16 pair); 16-byte units
// u = (side H + head) D / 8 + j / 4, stored at u ^ ((u >> 3) & 7) so that the 8 lanes of an
// LDS.128 phase hit 8 different bank groups. Negating x before the product is exact: RN(-x / n) =
// -RN(x / n).
__device__ __forceinline__ int mask_unit(int side, int head, int H, int D8, int unit) {
  const int u = (side * H + head) * D8 + unit;
  return u ^ ((u >> 3) & 7);
}
// Centered formats: x -= the lane's 32 signed, segment-order means (x holds the signed row, so this
// is s x - s m = s (x - m), the CPU's x - offset). From the shared-memory copy when there is one
// (sm: D / 4 16-byte units per head and side, lane l's floats are units 8 l .. 8 l + 7, swizzled so
// that the P lanes of one load hit P bank groups), else from FormatDesc::key_mean_seg / value_mean_seg
// (gm, 16-byte aligned).
template <int D>
__device__ __forceinline__ void center32(const uint4* __restrict__ sm, const float* __restrict__ gm, int side, int head, int H,
                                         int l, float (&x)[kLaneElems]) {
  const float4* g4 = reinterpret_cast<const float4*>(gm + static_cast<std::size_t>(head) * D + kLaneElems * l);
#pragma unroll
  for (int j = 0; j < kLaneElems / 4; ++j) {
    const float4 v = sm ? reinterpret_cast<const float4*>(sm)[mask_unit(side, head, H, D / 4, 8 * l + j)] : __ldg(g4 + j);
    x[4 * j] -= v.x;
    x[4 * j + 1] -= v.y;
    x[4 * j + 2] -= v.z;
    x[4 * j + 3] -= v.w;
  }
}
__device__ __forceinline__ void load_masks(const uint4* __restrict__ sm, int side, int head, int H, int D8, int l,
                                           std::uint32_t (&m)[kLaneElems / 2]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 q = sm[mask_unit(side, head, H, D8, 4 * l + i)];
    m[4 * i] = q.x;
    m[4 * i + 1] = q.y;
    m[4 * i + 2] = q.z;
    m[4 * i + 3] = q.w;
  }
}
// x[k] *= signs[k] for the lane's N elements (the float signs, used without a mask table).
template <int N>
__device__ __forceinline__ void mul_signs(const float* __restrict__ signs, float (&x)[N]) {
  const float4* sp = reinterpret_cast<const float4*>(signs);
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    const float4 s4 = __ldg(sp + j);
    x[4 * j] *= s4.x;
    x[4 * j + 1] *= s4.y;
    x[4 * j + 2] *= s4.z;
    x[4 * j + 3] *= s4.w;
  }
}
// The lane's 32 elements with their signs: from the masks, or (no mask table) by the float signs.
__device__ __forceinline__ void unpack_signed32(const Raw32& r, const uint4* sm, bool use_masks, int side, int head, int H,
                                                int D8, int l, const float* __restrict__ signs, float (&x)[kLaneElems]) {
  if (use_masks) {
    std::uint32_t m[kLaneElems / 2];
    load_masks(sm, side, head, H, D8, l, m);
#pragma unroll
    for (int j = 0; j < kLaneElems / 2; ++j) {
      const std::uint32_t w = raw_word(r, j) ^ m[j];
      x[2 * j] = bf16_lo(w);
      x[2 * j + 1] = bf16_hi(w);
    }
  } else {
    unpack_raw32(r, x);
    mul_signs(signs, x);
  }
}
// The lane's 32 staged elements: chunks at a, a ^ 16, a ^ 32, a ^ 48 (byte offsets into sb).
__device__ __forceinline__ Raw32 lds_raw32(const char* sb, std::uint32_t a) {
  Raw32 r;
#pragma unroll
  for (int i = 0; i < 4; ++i) r.q[i] = *reinterpret_cast<const uint4*>(sb + (a ^ (16u * i)));
  return r;
}

// Outlier split: the lane's 32 segment-order elements x[k] = sign_k row[perm[k]], gathered from
// the staged row (byte offset rb ^ chan_off(perm[k]), rb = the row's base with its XOR term). With
// the masks: the channel offsets come from shared memory (u16 `soff`, [side][head][D] in 16-byte
// units of 8 swizzled like the masks, so that the P lanes of a vector, whose units 4 l + j are the
// same for every vector of the warp, hit P bank groups: in order, lanes l and l + 2 met on one and
// took 2.1M extra wavefronts per tq-3.5bit store of 65,536 x 8 rows), and the sign is added to the
// bf16 bits in the high half: bit 31 of d 2^16 + s flips exactly when s = 2^31 (one integer
// multiply-add per element). Without: channels from global memory, the float signs by mul_signs.
template <int D>
__device__ __forceinline__ void gather32_masked(const char* sb, std::uint32_t rb, const std::uint16_t* soff, int side,
                                                int head, int H, int l, const std::uint32_t (&m)[kLaneElems / 2],
                                                float (&x)[kLaneElems]) {
  const uint4* pp = reinterpret_cast<const uint4*>(soff);
#pragma unroll
  for (int j = 0; j < kLaneElems / 8; ++j) {
    const uint4 q = pp[mask_unit(side, head, H, D / 8, 4 * l + j)];
    const std::uint32_t wv[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const std::uint32_t d0 = *reinterpret_cast<const std::uint16_t*>(sb + (rb ^ (wv[i] & 0xffffu)));
      const std::uint32_t d1 = *reinterpret_cast<const std::uint16_t*>(sb + (rb ^ (wv[i] >> 16)));
      const std::uint32_t mk = m[4 * j + i];
      x[8 * j + 2 * i] = __uint_as_float(d0 * 65536u + (mk << 16));
      x[8 * j + 2 * i + 1] = __uint_as_float(d1 * 65536u + (mk & 0x80000000u));
    }
  }
}
template <int D>
__device__ __forceinline__ void gather32_global(const char* sb, std::uint32_t rb, const std::int32_t* __restrict__ perm,
                                                const float* __restrict__ signs, float (&x)[kLaneElems]) {
  const int4* pp = reinterpret_cast<const int4*>(perm);
#pragma unroll
  for (int j = 0; j < kLaneElems / 4; ++j) {
    const int4 q4 = __ldg(pp + j);
    const int c[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      x[4 * j + i] = bf16_bits_to_float(
          *reinterpret_cast<const std::uint16_t*>(sb + (rb ^ Stage<D>::chan_off(static_cast<std::uint32_t>(c[i])))));
  }
  mul_signs(signs, x);
}

// Format of the fast kernel, fixed at compile time (the launcher dispatches on the FormatDesc):
// key / value kinds, segments and bits per segment. No branch in the kernel depends on the format,
// so every shuffle runs in straight-line code.
template <KeyCode KK_, ValueCode VK_, int NSEG_, int KB0_, int KB1_, int VB0_, int VB1_>
struct FastFmt {
  static constexpr KeyCode KK = KK_;
  static constexpr ValueCode VK = VK_;
  static constexpr int NSEG = NSEG_, KB0 = KB0_, KB1 = KB1_, VB0 = VB0_, VB1 = VB1_;
  static constexpr int KMU = KK == KeyCode::kTq ? NSEG : 0;  // 16-bit metadata units
  static constexpr int VMU = VK == ValueCode::kTq ? NSEG : (VK == ValueCode::kUniform ? 2 : 0);
};

// TurboQuant's steps before the buckets, shared by the fast kernels: the norm of the vector (or segment)
// held by PS lanes with N = 32 or 64 elements each (kvq::sum_squares's order), x / norm (0 for a zero
// vector), the FWHT stages inside the lane, then those across the PS lanes. Returns the norm.
//
// kHalves (PS >= 2; the paired kernel): the first stage across lanes exchanges half a lane, not all of it.
// Lane pair (2 j, 2 j + 1) holds A, B (its two N-element parts after the in-lane stages); the stage's
// outputs are A + B (positions 0 .. N - 1 of the pair) and A - B (N .. 2 N - 1). The odd lane's last
// in-lane stage writes its halves swapped, the upper one negated: (-B_hi, B_lo), as fma(u, -1, w) and
// fma(w, 1, u) where the even lane computes fma(u, 1, w) = u + w and fma(w, -1, u) = u - w. Then each
// lane sends its upper half (A_hi, B_lo) and keeps two outputs per element: the even lane A_lo + B_lo
// and A_lo - B_lo, the odd one A_hi + B_hi = A_hi - (-B_hi) and A_hi - B_hi. Every value is the same
// rounded sum or difference as in the full exchange, up to an exact sign (only the sign of a zero can
// differ, which no bucket tells apart: plus_below), and the lane then holds positions 32 q + i (i < 32)
// of its vector for q = q1 = 4 (ls >> 1) + (ls & 1) in v[0 .. 31] and q1 + 2 in v[32 .. 63] (N = 64; the
// codes go out as two pieces, halves_first_block), with half the shuffles. (The exchange runs from
// the last element down: in the other order ptxas spilled 16 bytes in the head_dim-128 4-bit kernel.)
template <int PS, int N, bool kHalves = false>
__device__ __forceinline__ float tq_rotate(float (&v)[N], int ls) {
  const float norm = __fsqrt_rn(lanes_sum_squares<PS>(v));
  const float inv = norm > 0 ? __frcp_rn(norm) : 0.0f;
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = v[k] * inv;  // signs already applied: RN(s x inv) = s RN(x inv)
  constexpr int H2 = N / 2;
  if constexpr (kHalves) {
    static_assert(PS >= 2, "the half exchange needs a lane pair");
    inlane_fwht<N, H2>(v);  // all in-lane stages but the last
    const float s = (ls & 1) == 0 ? 1.0f : -1.0f;
#pragma unroll
    for (int i = 0; i < H2; ++i) {
      const float u = v[i], w = v[i + H2];
      v[i] = __fmaf_rn(u, s, w);
      v[i + H2] = __fmaf_rn(w, -s, u);
    }
#pragma unroll
    for (int i = H2 - 1; i >= 0; --i) {
      const float o = __shfl_xor_sync(0xffffffffu, v[i + H2], 1);
      const float x = v[i];
      v[i] = __fmaf_rn(x, s, o);
      v[i + H2] = __fmaf_rn(o, -s, x);
    }
  } else {
    inlane_fwht(v);
  }
  // Across lanes: lower lane a + b, upper lane b - a, as fma(+-1, v, o): the product is exact,
  // so this is the same single rounding as the sum or difference.
#pragma unroll
  for (int m = kHalves ? 2 : 1; m < PS; m <<= 1) {
    const float sgn = (ls & m) == 0 ? 1.0f : -1.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float o = __shfl_xor_sync(0xffffffffu, v[k], m);
      v[k] = __fmaf_rn(v[k], sgn, o);
    }
  }
  return norm;
}

// TurboQuant of one side of P-lane vectors (lane ls of its segment of PS lanes, segment size
// 32 PS; bits B0 for segment 0, B1 for segment 1), the sign diagonal already applied to v. Packs this
// lane's codes into pw (the caller stores them once the record is accepted); returns the segment's
// norm and the norm-correction sum of squared centroids (the same in every lane of the segment).
template <int PS, int B0, int B1>
__device__ __forceinline__ void tq_encode32(const StoreTables& T, int t, int sg, float (&v)[kLaneElems], std::uint32_t (&pw)[4],
                                            int ls, float& norm_out, float& c2_out) {
  const float norm = tq_rotate<PS>(v, ls);
  // The bucket of y = fl(v / sqrt(block)) against the midpoints is the bucket of v against the
  // tables' thresholds (FormatDesc::key_thresholds: the largest v with fl(v / sqrt(block)) <=
  // midpoint), so the scale is never applied: y is not needed otherwise.
  std::uint32_t c[kLaneElems];
  if (T.ok[t]) {
    const float ba = T.ba[t], bb = T.bb[t], bn = T.bn[t];
    // (midpoint, base) pairs (build_bin_pairs): one load per code, from the lane's own copy.
    const std::uint32_t pbase = pair_lane_base(T, t, static_cast<int>(threadIdx.x & 31)), pstride = T.pair_stride[t];
#pragma unroll
    for (int k = 0; k < kLaneElems; ++k) c[k] = static_cast<std::uint32_t>(bin_pair_lookup(pbase, pstride, ba, bb, bn, v[k]));
  } else {
    const int ne = (1 << (sg ? B1 : B0)) - 1;
#pragma unroll
    for (int k = 0; k < kLaneElems; ++k) c[k] = static_cast<std::uint32_t>(count_below<false>(T.edges[t], ne, v[k]));
  }
  // The norm-correction sum: the terms on their grid (kvq::grid_square_sum) in four float chains for the latency;
  // every add is exact, so any order gives the CPU's value.
  float c2f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int k = 0; k < kLaneElems; ++k) c2f[k & 3] = __fadd_rn(c2f[k & 3], T.sq[t][c[k]]);
  const float c2 = xor_tree<PS>(__fadd_rn(__fadd_rn(c2f[0], c2f[1]), __fadd_rn(c2f[2], c2f[3])));
  if (B0 == B1 || sg == 0) pack_fields<kLaneElems, B0>(c, 0u, pw);
  else pack_fields<kLaneElems, B1>(c, 0u, pw);
  norm_out = norm;
  c2_out = c2;
}

constexpr int kFastWarps = kFastThreads / 32;

constexpr int kSideBytes = 32 * kLaneElems * 2;                 // one side of a warp's vectors: 2 KB
constexpr int kStageBytes = 2 * kSideBytes;                      // keys and values
constexpr int kStagingBytes = kFastWarps * 2 * kStageBytes;      // two stages per warp: 64 KB

// Work item = (block of V consecutive tokens, KV head): a warp's V vectors are one head's, so the
// sign masks and channel offsets it reads are the same for all of them (broadcast), and the codes
// and metadata of consecutive slots it writes are adjacent in the page ([head][token] layout).
// Copies the rows of item (tb, h) into the stage at shared address kdst: chunk q = lane + 32 j of a side is
// row cg0 + j RJ of the item, elements ce0 .. ce0 + 7, stored at kdst + cdst[j] (the kernel's chunk places). A
// whole item (every row a token: all but the last block) takes one source pointer per side and fixed steps where
// kWhole (the split formats keep the general path: 0.987x with it); the last block zero-fills the rows past n
// (nothing read there). Returns the slot of row g (-1: none).
template <int D, int V, bool kWhole>
__device__ __forceinline__ std::int64_t stage_item(const StoreParams& p, std::uint32_t kdst, const std::uint32_t (&cdst)[4],
                                                   int tb, int h, int cg0, int ce0, int g, std::int64_t ks, std::int64_t vs) {
  constexpr int RJ = 32 / (D / 8);
  const int n = p.n_tokens;
  const std::int64_t hoff = static_cast<std::int64_t>(h) * D + ce0;
  const int t0 = tb * V + cg0;
  if (kWhole && tb * V + V <= n) {  // warp-uniform
    const std::uint16_t* ksrc = p.key + t0 * ks + hoff;
    const std::uint16_t* vsrc = p.value + t0 * vs + hoff;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      cp_async16(kdst + cdst[j], ksrc + j * RJ * ks);
      cp_async16(kdst + kSideBytes + cdst[j], vsrc + j * RJ * vs);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int t = t0 + j * RJ;
      const bool ok = t < n;
      const std::int64_t tt = ok ? t : 0;
      cp_async16_zfill(kdst + cdst[j], p.key + tt * ks + hoff, ok);
      cp_async16_zfill(kdst + kSideBytes + cdst[j], p.value + tt * vs + hoff, ok);
    }
  }
  const int t = tb * V + g;
  return t < n ? p.slot_mapping[t] : -1;
}

// Rows by the tensor memory accelerator (the paired kernel): one tensor map per side over the bf16 rows as
// [token][head][D / 64][64] (dims innermost first: 64 elements = 128 bytes, D / 64 runs, heads, tokens; strides
// 128 B, 2 D B, the token stride), boxes of [V tokens][1 head][D / 64][64] = 2 KB, 128-byte swizzle: in a
// 1024-byte-aligned stage the unit of 16 bytes q lands at q ^ ((q >> 3) & 7), Stage2's place. Tokens past n
// read as zeros (the map's token extent is n). row_maps (host) builds them.
struct RowMaps {
  CUtensorMap key, value;
};
// One side's box of item (t0 .. t0 + V - 1, head) into the stage at shared address dst; completes bytes on
// the mbarrier at shared address bar.
__device__ __forceinline__ void tma_rows(std::uint32_t dst, const CUtensorMap* map, std::uint32_t bar, int head, int t0) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
      ::"r"(dst), "l"(reinterpret_cast<std::uint64_t>(map)), "r"(0), "r"(0), "r"(head), "r"(t0), "r"(bar)
      : "memory");
}

// The fast kernels' item loop: the grid-stride walk over work items (block tb of V tokens, KV head), warp w of
// CTA b starting at item b kFastWarps + w, (tb, head) carried incrementally; each item's rows are copied into the
// other stage one iteration ahead (the stages at shared addresses stage0 and stage0 + kStageBytes, chunk q of a
// side at S::pos(q)), and body(tb, head, slot, cur) runs on stage cur once its copies have landed; slot is the
// slot of the item's row g. Warp-uniform: every lane takes part. The copies: cp.async by every lane
// (stage_item), or with kTma two tensor copies issued by lane 0 (RowMaps; S must be Stage2), which complete
// on the warp's mbarrier of the stage (shared addresses bar0, bar0 + 8, initialized with count 1). setup() runs in
// every thread after the warp's first copies are issued and before the first body: the kernel's CTA-wide setup
// (fast_setup, which ends with a barrier and writes nothing in the stages), so that its table builds and global
// loads overlap the first rows' round trip.
template <int D, int V, bool kWhole, class S, bool kTma = false, class Setup, class Body>
__device__ __forceinline__ void for_each_item(const StoreParams& p, int H, int w, std::uint32_t stage0, int g, std::int64_t ks,
                                              std::int64_t vs, Setup&& setup, Body&& body, const RowMaps* maps = nullptr,
                                              std::uint32_t bar0 = 0) {
  // The chunks this lane copies: chunk q = lane + 32 j of a side is vector cg0 + j RJ of the item, elements ce0 ..
  // ce0 + 7 (a row's D / 8 chunks divide 32, so the element offset is the same for every j and the source
  // advances by RJ token strides), stored at the kernel's place S::pos(q).
  constexpr int CPR = D / 8, RJ = 32 / CPR;
  static_assert(32 % CPR == 0 && 3 * RJ + 32 / CPR - 1 < V, "a lane's four chunks are rows of one item");
  const int lane = threadIdx.x & 31;
  const int cg0 = lane / CPR, ce0 = 8 * (lane % CPR);
  std::uint32_t cdst[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) cdst[j] = S::pos(static_cast<std::uint32_t>(lane + 32 * j)) << 4;
  const long nblk = (static_cast<long>(p.n_tokens) + V - 1) / V;
  const long nitems = nblk * H;
  const long stride = static_cast<long>(gridDim.x) * kFastWarps;
  const int dtb = static_cast<int>(stride / H), dh = static_cast<int>(stride % H);
  long it = static_cast<long>(blockIdx.x) * kFastWarps + w;
  int tb = static_cast<int>(it / H), head = static_cast<int>(it % H);
  auto issue = [&](int st, int tb_, int h_) -> std::int64_t {
    const std::uint32_t dst = stage0 + static_cast<std::uint32_t>(st) * kStageBytes;
    if constexpr (kTma) {
      if (lane == 0) {
        const std::uint32_t bar = bar0 + 8u * static_cast<std::uint32_t>(st);
        // The warp's generic reads of this stage (ordered by the __syncwarp after them) before the async writes.
        async_proxy_fence();
        mbar_arrive_expect_tx(bar, kStageBytes);
        tma_rows(dst, &maps->key, bar, h_, tb_ * V);
        tma_rows(dst + kSideBytes, &maps->value, bar, h_, tb_ * V);
      }
      const int t = tb_ * V + g;
      return t < p.n_tokens ? p.slot_mapping[t] : -1;
    } else {
      return stage_item<D, V, kWhole>(p, dst, cdst, tb_, h_, cg0, ce0, g, ks, vs);
    }
  };
  std::int64_t slot_next = -1;
  if (it < nitems) slot_next = issue(0, tb, head);
  if constexpr (!kTma) cp_async_commit();
  setup();
  std::uint32_t phase = 0;  // kTma: bit st = the parity of stage st's next completion
  int cur = 0;
  for (; it < nitems; it += stride) {
    int ntb = tb + dtb, nh = head + dh;
    if (nh >= H) {
      nh -= H;
      ++ntb;
    }
    const std::int64_t slot = slot_next;
    if (it + stride < nitems) slot_next = issue(cur ^ 1, ntb, nh);
    if constexpr (kTma) {
      mbar_wait_parity(bar0 + 8u * static_cast<std::uint32_t>(cur), (phase >> cur) & 1u);
      phase ^= 1u << cur;
    } else {
      cp_async_commit();
      cp_async_wait<1>();
    }
    __syncwarp();
    body(tb, head, slot, cur);
    __syncwarp();  // every lane is done with stage cur before the next iteration copies into it
    cur ^= 1;
    tb = ntb;
    head = nh;
  }
  if constexpr (!kTma) cp_async_wait<0>();
}

// The (midpoint, base) pair entries of the fast kernels' BP table: the paired kernel's (VT = 1) 1024; the
// fast kernel's 1024 for one segment, 1536 for the outlier splits (store_fast_kernel says how they are used).
template <class F, int VT>
constexpr int kPairEntriesOf = VT == 1 ? 1024 : (F::NSEG == 2 ? 1536 : 1024);
// Bytes of the fast kernels' shared region after the staging (the masks, then the split formats' channel offsets,
// then the centered formats' means), where use_masks; the launcher and the image builder take the same choice
// (fast_mask_region).
template <int D, int NSEG>
__host__ __device__ constexpr std::size_t mask_region_bytes(int H, bool use_masks, bool use_smean) {
  return use_masks ? (NSEG == 2 ? 8u : 4u) * static_cast<std::size_t>(H) * D + (use_smean ? 8u * static_cast<std::size_t>(H) * D : 0u)
                   : 0u;
}
// The setup image (FormatDesc::store_image) in 16-byte units: StoreTables, the BP table, the mask region. The
// pair bases in StoreTables (shared addresses) are stored relative to the BP table's address.
constexpr int kImageTableUnits = static_cast<int>(sizeof(StoreTables) / 16);
constexpr int kImagePairBaseUnit = static_cast<int>(offsetof(StoreTables, pair_base) / 16);
static_assert(sizeof(StoreTables) % 16 == 0 && offsetof(StoreTables, pair_base) % 16 == 0 &&
                  sizeof(StoreTables::pair_base) == 16,
              "the setup image copies StoreTables in 16-byte units, the pair bases in one");
// Which fast kernels take the image: those with a TurboQuant side (the others build no tables: an image only added
// a round trip, 0.86x for tq-k8v4's small store, 0.93x for its large one), but the head_dim-64 paired kernels, in
// which the copy's code made ptxas spill (0.97-0.98x for their large stores).
template <int D, class F, int VT>
constexpr bool kTakesImage = (F::KK == KeyCode::kTq || F::VK == ValueCode::kTq) && !(VT == 1 && D == 64);
template <int D, class F, int VT>
__host__ __device__ constexpr int image_units(int H, bool use_masks, bool use_smean) {
  return kImageTableUnits + kPairEntriesOf<F, VT> / 2 + static_cast<int>(mask_region_bytes<D, F::NSEG>(H, use_masks, use_smean) / 16);
}

// fast_setup's copy of the image, out of line (inlined or not, it made ptxas spill in the head_dim-64 paired kernels,
// which therefore do not take the image: kTakesImage).
template <int D, class F, int VT>
__device__ __noinline__ void copy_image(StoreTables& T, uint2* BP, uint4* dsm, int H, bool use_masks, bool use_smean,
                                        const uint4* image) {
  constexpr int TU = kImageTableUnits, BU = kPairEntriesOf<F, VT> / 2;
  const int units = image_units<D, F, VT>(H, use_masks, use_smean);
  const std::uint32_t ts = static_cast<std::uint32_t>(__cvta_generic_to_shared(&T));
  const std::uint32_t bs = static_cast<std::uint32_t>(__cvta_generic_to_shared(BP));
  const std::uint32_t ms = static_cast<std::uint32_t>(__cvta_generic_to_shared(dsm + kStagingBytes / 16));
  for (int i = threadIdx.x; i < units; i += kFastThreads) {
    if (i == kImagePairBaseUnit) {
      uint4 v = __ldg(image + i);
      v.x += bs;
      v.y += bs;
      v.z += bs;
      v.w += bs;
      *reinterpret_cast<uint4*>(T.pair_base) = v;
    } else {
      const std::uint32_t u = static_cast<std::uint32_t>(i);
      cp_async16(i < TU ? ts + 16u * u : i < TU + BU ? bs + 16u * (u - TU) : ms + 16u * (u - TU - BU), image + i);
    }
  }
  cp_async_commit();
  cp_async_wait<0>();
}

// The fast kernels' shared-memory setup, CTA-wide, ending with a barrier: the bin tables and their
// (midpoint, base) pairs (warps 0-3: keys / values x segment 0 / 1; tables 0, 1 are the keys', VT and
// VT + 1 the values'), the split formats' channel offsets (as S::chan_off byte offsets) and the centered
// formats' means where the launcher gave the space, the sign masks. soff / smean: the offsets and the
// means in shared memory, nullptr where there are none. search: every table's `ok` cleared, so that the kernel
// bucketizes by the binary search (store_search_forced). image (FormatDesc::store_image, made by
// store_image_kernel from this function's result; nullptr: build): all of it copied by cp.async in one round
// trip, the pair bases rebased on this kernel's BP table (a small store's setup took 2.2-3.9 us to build, mostly
// dependent global loads and the tables' searches for a bin count).
template <int D, class F, class S, int VT = 2>
__device__ __forceinline__ void fast_setup(StoreTables& T, uint2* BP, uint4* dsm, const StoreParams& p, bool use_masks,
                                           bool use_smean, bool search, std::uint16_t*& soff, const uint4*& smean,
                                           const uint4* image = nullptr) {
  constexpr int NSEG = F::NSEG;
  constexpr bool KTQ = F::KK == KeyCode::kTq, VTQ = F::VK == ValueCode::kTq;
  const FormatDesc& f = p.fmt;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if constexpr (kTakesImage<D, F, VT>) if (image) {
    copy_image<D, F, VT>(T, BP, dsm, f.kv_heads, use_masks, use_smean, image);
    const int H = f.kv_heads;
    soff = NSEG == 2 && use_masks ? reinterpret_cast<std::uint16_t*>(dsm + kStagingBytes / 16) + 2 * H * D : nullptr;
    smean = use_smean ? dsm + kStagingBytes / 16 + (NSEG == 2 ? 8 : 4) * H * D / 16 : nullptr;
    __syncthreads();
    return;
  }
  if (w < 4) {
    const int side = w >> 1, seg = w & 1;
    const bool tq = side == 0 ? KTQ : VTQ;
    if (tq && seg < NSEG) {
      const int t = side ? VT + seg : seg;
      build_store_table(T, t, (side ? f.value_thresholds : f.key_thresholds) + seg * kMaxCodebook,
                        (side ? f.value_terms : f.key_terms) + seg * kMaxCodebook,
                        side ? (seg ? F::VB1 : F::VB0) : (seg ? F::KB1 : F::KB0), lane);
      if (search && lane == 0) T.ok[t] = 0;  // the binary search instead of the table (KVQ_STORE_SEARCH=1: tests)
      constexpr int c0 = NSEG == 2 ? 448 : 512, c1 = NSEG == 2 ? 320 : 0;  // entries of segment 0 / 1 tables
      build_bin_pairs(T, t, BP + side * (c0 + c1) + seg * c0, seg ? c1 : c0, lane);
    }
  }
  const int H = f.kv_heads;
  constexpr int D8 = D / 8;
  soff = nullptr;
  if constexpr (NSEG == 2) {
    if (use_masks) {
      soff = reinterpret_cast<std::uint16_t*>(dsm + kStagingBytes / 16) + 2 * H * D;
      for (int i = threadIdx.x; i < 2 * H * D; i += kFastThreads) {
        const int side = i / (H * D), rem = i % (H * D), e = rem % D;
        soff[8 * mask_unit(side, rem / D, H, D8, e >> 3) + (e & 7)] =
            static_cast<std::uint16_t>(S::chan_off(static_cast<std::uint32_t>((side ? f.value_perm : f.key_perm)[rem])));
      }
    }
  }
  // Centered formats, when the launcher gave the space: the signed segment-order means after the
  // masks and channel offsets, [side][head][D / 4] 16-byte units swizzled like the masks.
  constexpr int D4 = D / 4;
  smean = use_smean ? dsm + kStagingBytes / 16 + (NSEG == 2 ? 8 : 4) * H * D / 16 : nullptr;
  if (use_smean) {
    uint4* mm = const_cast<uint4*>(smean);
    for (int i = threadIdx.x; i < 2 * H * D4; i += kFastThreads) {
      const int side = i / (H * D4), rem = i % (H * D4);
      mm[mask_unit(side, rem / D4, H, D4, rem % D4)] =
          reinterpret_cast<const uint4*>(side ? f.value_mean_seg : f.key_mean_seg)[rem];
    }
  }
  if (use_masks) {
    std::uint32_t* mw = reinterpret_cast<std::uint32_t*>(dsm + kStagingBytes / 16);
    for (int i = threadIdx.x; i < 2 * H * (D / 2); i += kFastThreads) {
      const int side = i / (H * (D / 2)), rem = i % (H * (D / 2)), head = rem / (D / 2), j = rem % (D / 2);
      if (side == 0 ? !KTQ : !VTQ) continue;
      const float* sg2 = (side ? f.value_signs : f.key_signs) + static_cast<std::size_t>(head) * D + 2 * j;
      mw[4 * mask_unit(side, head, H, D8, j >> 2) + (j & 3)] =
          ((__float_as_uint(sg2[0]) >> 16) & 0x8000u) | (__float_as_uint(sg2[1]) & 0x80000000u);
    }
  }
  __syncthreads();
}

template <int D, class F>
__global__ void __launch_bounds__(kFastThreads, 2) store_fast_kernel(const StoreParams p, int tok_shift, bool use_masks,
                                                                      bool use_smean, bool search, const uint4* image) {
  launch_dependents();  // a decode launched programmatically after the store may start (DecodeParams::programmatic)
  __shared__ __align__(16) StoreTables T;
  // The tables' (midpoint, base) pairs, through which every format bucketizes (build_bin_pairs: 16 copies
  // of each bin where they fit, else one; every table has room for one copy of kMaxBins bins). One segment:
  // tables 0 (keys) and 2 (values), 512 entries each (16 copies up to 32 bins: the sphere codebooks' tables
  // at 3 and 4 bits). Outlier splits, whose lanes pick one of two tables: segment 0 (b + 1 bits) 448 entries
  // (28 bins), segment 1 (b bits) 320 (20 bins), per side; the tables start at multiples of 128 bytes, so
  // lanes reading different tables still hit their own bank pairs. (With one copy per bin the splits'
  // pairs measured 1-2% slower than the byte table of bins.cuh, which they used until 2026-12-01.)
  __shared__ __align__(16) uint2 BP[kPairEntriesOf<F, 2>];
  // [warp][stage][side] staged rows (kStagingBytes), then, when the launcher gives the space, the
  // sign masks (4 H D bytes) and for the split formats the channel offsets (4 H D bytes).
  extern __shared__ uint4 dsm[];
  using S = Stage<D>;
  constexpr int P = S::P, V = 32 / P, NSEG = F::NSEG, PS = NSEG == 2 ? P / 2 : P;
  constexpr bool KTQ = F::KK == KeyCode::kTq, VTQ = F::VK == ValueCode::kTq;
  const FormatDesc& f = p.fmt;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int l = lane & (P - 1), gbase = lane & ~(P - 1), g = lane / P;
  char* sb = reinterpret_cast<char*>(dsm);
  const uint4* smask = dsm + kStagingBytes / 16;
  const int H = f.kv_heads;
  constexpr int D8 = D / 8;
  std::uint16_t* soff = nullptr;  // split formats: channel offsets [side][head][D] after the masks (swizzled units)
  const uint4* smean = nullptr;   // centered formats: the signed segment-order means after those
  const PageLayout& pg = f.page;
  const std::int64_t ks = token_stride(p.key_token_stride, H, D);
  const std::int64_t vs = token_stride(p.value_token_stride, H, D);
  const int sg = NSEG == 2 ? l / PS : 0, ls = l % PS;  // segment of this lane (two segments: D / 2 each)
  const int mu = static_cast<int>(pg.meta_bytes / 2);
  const bool protect = p.protect_rows && p.positions && p.seq_ids;
  constexpr std::uint32_t kseg1 = (D / 2) * F::KB0 / 8, vseg1 = (D / 2) * F::VB0 / 8;
  const std::uint32_t kdst_off = (sg ? kseg1 : 0u) + 4u * static_cast<std::uint32_t>(sg ? F::KB1 : F::KB0) * ls;
  const std::uint32_t vdst_off = (sg ? vseg1 : 0u) + 4u * static_cast<std::uint32_t>(sg ? F::VB1 : F::VB0) * ls;

  // Staging (for_each_item): this warp's two stages; the lane's own chunks at own ^ 16 i; the row
  // base of its vector for the gather.
  const std::uint32_t wstage = static_cast<std::uint32_t>(w) * 2u * kStageBytes;
  const std::uint32_t own = S::pos(4u * static_cast<std::uint32_t>(lane)) << 4;
  const std::uint32_t rowb = S::row_base(static_cast<std::uint32_t>(g));
  const std::uint32_t sbase = static_cast<std::uint32_t>(__cvta_generic_to_shared(sb));

  const int n = p.n_tokens;
  auto setup = [&] { fast_setup<D, F, S>(T, BP, dsm, p, use_masks, use_smean, search, soff, smean, image); };
  for_each_item<D, V, NSEG == 1, S>(p, H, w, sbase + wstage, g, ks, vs, setup, [&](int tb, int head, std::int64_t slot, int cur) {
    const int tok = tb * V + g;
    const bool valid = tok < n;
    const bool write = slot >= 0;
    const int vt = valid ? tok : 0, vh = head;
    const std::int64_t sl = write ? slot : 0;
    const std::size_t page = tok_shift >= 0 ? static_cast<std::size_t>(sl >> tok_shift) : static_cast<std::size_t>(sl / pg.tokens);
    const int off = tok_shift >= 0 ? static_cast<int>(sl & ((1 << tok_shift) - 1)) : static_cast<int>(sl % pg.tokens);
    std::uint8_t* base = p.pool + page * pg.page_bytes;
    std::uint8_t* kc = base + pg.key_code(vh, off);
    std::uint8_t* vc = base + pg.value_code(vh, off);
    std::uint8_t* meta = base + pg.key_meta(vh, off);
    const std::size_t hd = static_cast<std::size_t>(vh) * D + kLaneElems * l;
    const std::uint32_t kside = wstage + static_cast<std::uint32_t>(cur) * kStageBytes, vside = kside + kSideBytes;

    float knorm = 0, vnorm = 0, vs_scale = 0, vs_lo = 0;
    float kc2 = 0, vc2 = 0;
    // Everything is computed before anything is written: a record the CPU encoders would refuse
    // (a NaN or an infinity in its rows, a TurboQuant stored norm or a uniform min / max beyond
    // fp16) is written nowhere and counted in p.rejected.
    bool bad = false;
    std::uint32_t kw[4] = {0, 0, 0, 0}, vw[4] = {0, 0, 0, 0};
    // ---- keys ----
    if constexpr (KTQ) {
      float x[kLaneElems];
      if constexpr (NSEG == 1) {
        unpack_signed32(lds_raw32(sb, kside + own), smask, use_masks, 0, vh, H, D8, l, f.key_signs + hd, x);
      } else if (soff) {
        std::uint32_t m[kLaneElems / 2];
        load_masks(smask, 0, vh, H, D8, l, m);
        gather32_masked<D>(sb, kside + rowb, soff, 0, vh, H, l, m, x);
      } else {
        gather32_global<D>(sb, kside + rowb, f.key_perm + hd, f.key_signs + hd, x);
      }
      if (f.key_mean_seg) center32<D>(smean, f.key_mean_seg, 0, vh, H, l, x);
      tq_encode32<PS, F::KB0, F::KB1>(T, sg, sg, x, kw, ls, knorm, kc2);
    } else {  // fp8 e4m3 (converted when stored): the CPU refuses non-finite rows
      const Raw32 kr = lds_raw32(sb, kside + own);
#pragma unroll
      for (int j = 0; j < kLaneElems / 2; ++j) bad |= bf16x2_nonfinite(raw_word(kr, j));
    }
    // ---- values ----
    if constexpr (VTQ) {
      float x[kLaneElems];
      if constexpr (NSEG == 1) {
        unpack_signed32(lds_raw32(sb, vside + own), smask, use_masks, 1, vh, H, D8, l, f.value_signs + hd, x);
      } else if (soff) {
        std::uint32_t m[kLaneElems / 2];
        load_masks(smask, 1, vh, H, D8, l, m);
        gather32_masked<D>(sb, vside + rowb, soff, 1, vh, H, l, m, x);
      } else {
        gather32_global<D>(sb, vside + rowb, f.value_perm + hd, f.value_signs + hd, x);
      }
      if (f.value_mean_seg) center32<D>(smean, f.value_mean_seg, 1, vh, H, l, x);
      tq_encode32<PS, F::VB0, F::VB1>(T, 2 + sg, sg, x, vw, ls, vnorm, vc2);
    } else {  // uniform
      const Raw32 vr = lds_raw32(sb, vside + own);
      constexpr int B = F::VB0, m = (1 << B) - 1;
      // (min, -max) of the lane as one bf16 pair, then over the vector's P lanes; NaN propagates
      // (the record is refused).
      std::uint32_t mn = bmin2<true>(raw_word(vr, 0), raw_word(vr, 1)), mx = bmax2<true>(raw_word(vr, 0), raw_word(vr, 1));
#pragma unroll
      for (int j = 2; j < kLaneElems / 2; ++j) {
        mn = bmin2<true>(mn, raw_word(vr, j));
        mx = bmax2<true>(mx, raw_word(vr, j));
      }
      std::uint32_t mm = bmin2<true>(__byte_perm(mn, mx ^ 0x80008000u, 0x5410), __byte_perm(mn, mx ^ 0x80008000u, 0x7632));
#pragma unroll
      for (int o = 1; o < P; o <<= 1) mm = bmin2<true>(mm, __shfl_xor_sync(0xffffffffu, mm, o));
      const float lo = bf16_lo(mm), hi = -bf16_hi(mm);
      bad |= !(fabsf(lo) <= 65504.0f && fabsf(hi) <= 65504.0f);  // UniformAffine: min and max within fp16
      float s = (hi - lo) / static_cast<float>(m);
      if (!(s > 1e-8f)) s = 1e-8f;
      const float y = __frcp_rn(s);
      std::uint32_t t[kLaneElems];
      // floor(RN(q + 1/2)) with q = RN((x - lo) / s): q0 = RN(d y) is within one ulp and y = RN(1/s)
      // is correctly rounded, so one remainder correction gives the correctly rounded quotient
      // (Markstein's theorem; tests/core/test_numeric.cpp checks it on this kernel's inputs). The
      // floor is the round-down add of 1.5 * 2^23. UniformAffine's clamp to m is never active:
      // d <= RN(hi - lo) and s >= RN(hi - lo) / m (1 + 2^-24) keep q + 1/2 below m + 1.
      // (Tried and dropped, session 9: floor(fma(d, y, 1/2 + 2^-16)) with this route as the
      // fallback for lanes whose fraction came within 3 units of 2^-17 of an integer; 2-4% slower
      // for the uniform-value formats. Exact k + 1/2 quotients are common in bf16 rows: whenever
      // (hi - lo) / m is dyadic, e.g. hi - lo = 15 x 2^-6 at m = 15, and those take the fallback.)
#pragma unroll
      for (int j = 0; j < kLaneElems / 2; ++j) {
        const std::uint32_t wv = raw_word(vr, j);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float xv = __uint_as_float(h ? (wv & 0xffff0000u) : (wv << 16));
          const float d = xv - lo;
          const float q0 = __fmul_rn(d, y);
          const float q = __fmaf_rn(__fmaf_rn(-q0, s, d), y, q0);
          t[2 * j + h] = __float_as_uint(__fadd_rd(q + 0.5f, kFloorMagic));
        }
      }
      pack_fields<kLaneElems, B>(t, 0u - kMagicBits, vw);
      vs_scale = s;
      vs_lo = lo;
    }
    // ---- metadata record: [key units][value units][zero pad], 16-bit units; the lane of a
    // TurboQuant unit takes the norm and correction sum of that unit's segment from its lanes
    // (one fp64 division per unit instead of one per lane and side) ----
    constexpr int NU = F::KMU + F::VMU;
    constexpr int NR = (NU + P - 1) / P;
    std::uint16_t mval[NR];
#pragma unroll
    for (int ri = 0; ri < NR; ++ri) {
      const int u = ri * P + l;
      float fv = 0.0f;
      bool tq_unit = false;
      if constexpr (KTQ && VTQ) {
        const bool isk = u < F::KMU;
        const int src = gbase + ((isk ? u : u - F::KMU) & (NSEG - 1)) * PS;
        const float nk = __shfl_sync(0xffffffffu, knorm, src), nv = __shfl_sync(0xffffffffu, vnorm, src);
        const float ck = __shfl_sync(0xffffffffu, kc2, src), cv = __shfl_sync(0xffffffffu, vc2, src);
        const float n = isk ? nk : nv;
        fv = corrected_norm(n, isk ? ck : cv);
        tq_unit = true;
      } else if constexpr (KTQ) {  // one key segment, uniform values
        fv = u == 0 ? corrected_norm(knorm, kc2) : (u == 1 ? vs_scale : vs_lo);
        tq_unit = u == 0;
      } else {  // fp8 keys, uniform values
        fv = u == 0 ? vs_scale : vs_lo;
      }
      // TurboQuantMse refuses a stored norm beyond fp16 (NaN / inf rows end here too).
      if (u < NU && tq_unit) bad |= !(fabsf(fv) <= 65504.0f);
      mval[ri] = fp16_bits(fv);
    }
#pragma unroll
    for (int o = 1; o < P; o <<= 1) bad |= __shfl_xor_sync(0xffffffffu, bad, o);  // the record's P lanes
    if (bad && valid && l == 0 && p.rejected) atomicAdd(p.rejected, 1u);
    if (write && !bad) {
      if constexpr (KTQ) {
        if (F::KB0 == F::KB1 || sg == 0) store_words<F::KB0>(kw, kc + kdst_off);
        else store_words<F::KB1>(kw, kc + kdst_off);
      } else {
        const Raw32 kr = lds_raw32(sb, kside + own);
        std::uint32_t o[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const std::uint32_t w0 = raw_word(kr, 2 * j), w1 = raw_word(kr, 2 * j + 1);
          const std::uint32_t lo =
              __nv_cvt_float2_to_fp8x2(make_float2(__uint_as_float(w0 << 16), __uint_as_float(w0 & 0xffff0000u)), __NV_SATFINITE, __NV_E4M3);
          const std::uint32_t hi =
              __nv_cvt_float2_to_fp8x2(make_float2(__uint_as_float(w1 << 16), __uint_as_float(w1 & 0xffff0000u)), __NV_SATFINITE, __NV_E4M3);
          o[j] = (lo & 0xffffu) | (hi << 16);
        }
        reinterpret_cast<uint4*>(kc + 32 * l)[0] = make_uint4(o[0], o[1], o[2], o[3]);
        reinterpret_cast<uint4*>(kc + 32 * l)[1] = make_uint4(o[4], o[5], o[6], o[7]);
      }
      if constexpr (VTQ) {
        if (F::VB0 == F::VB1 || sg == 0) store_words<F::VB0>(vw, vc + vdst_off);
        else store_words<F::VB1>(vw, vc + vdst_off);
      } else {
        store_words<F::VB0>(vw, vc + 4 * F::VB0 * l);
      }
#pragma unroll
      for (int ri = 0; ri < NR; ++ri)
        if (ri * P + l < NU) reinterpret_cast<std::uint16_t*>(meta)[ri * P + l] = mval[ri];
      for (int u = NU + l; u < mu; u += P) reinterpret_cast<std::uint16_t*>(meta)[u] = 0;
    }
    // ---- protected bf16 rows ----
    if (protect && valid && !bad) {
      if (std::uint16_t* dst = protected_row(p, vt, vh)) {
        store_raw32(lds_raw32(sb, kside + own), reinterpret_cast<std::uint8_t*>(dst + kLaneElems * l));
        store_raw32(lds_raw32(sb, vside + own), reinterpret_cast<std::uint8_t*>(dst + D + kLaneElems * l));
      }
    }
  });
}

// ---- paired fast path ---------------------------------------------------------------------
// Formats whose keys and values are both TurboQuant with the same bit width and one segment
// (tq-4bit, tq-3bit, centered or not; head_dim 64, 128, 256): lanes 0-15 encode the keys of the
// warp's V vectors and lanes 16-31 their values, in the same instructions (both sides take the same
// operations; their tables, masks and means are found through the side). Lane 16 s + P2 g + l2
// (P2 = D / 64 lanes per vector and side) holds elements 64 l2 .. 64 l2 + 63 of side s of vector g:
// twice store_fast_kernel's 32, so the FWHT has one stage across lanes fewer (h = 64 at head_dim
// 128, none at 64), and the per-vector steps (norm, its square root and reciprocal, the corrected
// norm, the record's checks) serve 64 elements per lane instead of 32. Items (V tokens of one KV
// head) and staging are store_fast_kernel's; the staged chunks' places differ (Stage2), and the rows
// come by tensor copies where the launcher could make the maps (kTma), else by its cp.async.
// The value side's bin table is table 1 (fast_setup's VT), whose centroids lie in the 16 banks
// next to the keys': the two half-warps' centroid loads never meet on a bank (with table 2 every
// key lane whose code equals a value lane's conflicted: 4.45M conflicts per tq-4bit store of
// 65,536 x 8 rows). The arithmetic is the same operation by operation (the sums of squares in
// kvq::sum_squares's order: lanes_sum_squares on 64 elements), so the records are the CPU's bit for bit.
// (Outlier splits keep store_fast_kernel: with both sides gathered in one instruction and four
// centroid tables in 32 banks, the paired layout measured 0.95-0.97x for tq-3.5bit / tq-2.5bit.)
template <int D>
struct Stage2 {
  static constexpr int P2 = D / 64, CPR = D / 8;
  // Chunk q of a side (row q / CPR) is stored at q ^ ((q >> 3) & 7): the XOR moves a chunk inside its
  // run of 8 (128 bytes), and the copy (consecutive lanes, consecutive chunks) writes 8 bank groups per
  // phase, and lane (g, l2) reads its run r = P2 g + l2 as chunks i ^ (r & 7): in an LDS.128 phase, 8
  // lanes of 8 consecutive runs, 8 bank groups.
  __host__ __device__ static constexpr std::uint32_t pos(std::uint32_t q) { return q ^ ((q >> 3) & 7u); }
};

constexpr int kPairElems = 64;

// The lane's 64 signed elements from the staged run at byte offset a (chunk i at a ^ 16 i). Masks: units
// 8 l2 + i of (side, head), whose swizzled places are mask_unit(.., 8 l2) XOR i (8 l2 is a multiple of 8).
__device__ __forceinline__ void unpack_signed64(const char* sb, std::uint32_t a, const uint4* sm, bool use_masks, int side,
                                                int head, int H, int D8, int l2, const float* __restrict__ signs,
                                                float (&x)[kPairElems]) {
  const std::uint32_t mb = 16u * static_cast<std::uint32_t>(mask_unit(side, head, H, D8, 8 * l2));
  const char* smc = reinterpret_cast<const char*>(sm);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint4 r = *reinterpret_cast<const uint4*>(sb + (a ^ (16u * j)));
    const std::uint32_t rw[4] = {r.x, r.y, r.z, r.w};
    std::uint32_t mw[4] = {0, 0, 0, 0};
    if (use_masks) {
      const uint4 m = *reinterpret_cast<const uint4*>(smc + (mb ^ (16u * j)));
      mw[0] = m.x;
      mw[1] = m.y;
      mw[2] = m.z;
      mw[3] = m.w;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::uint32_t w = rw[k] ^ mw[k];
      x[8 * j + 2 * k] = bf16_lo(w);
      x[8 * j + 2 * k + 1] = bf16_hi(w);
    }
  }
  if (!use_masks) mul_signs(signs, x);
}
// Centered formats: x -= the lane's 64 signed, segment-order means: from shared memory (units 16 l2 + j
// of (side, head): two runs of 8, each at mask_unit(.. its first) XOR j), else from global memory.
__device__ __forceinline__ void center64(const uint4* __restrict__ sm, const float* __restrict__ gm, int side, int head,
                                         int H, int D4, int l2, float (&x)[kPairElems]) {
  const char* smc = reinterpret_cast<const char*>(sm);
  const float4* g4 = reinterpret_cast<const float4*>(gm + static_cast<std::size_t>(head) * 4 * D4 + kPairElems * l2);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const std::uint32_t mb = sm ? 16u * static_cast<std::uint32_t>(mask_unit(side, head, H, D4, 16 * l2 + 8 * h)) : 0u;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float4 v = sm ? *reinterpret_cast<const float4*>(smc + (mb ^ (16u * j))) : __ldg(g4 + 8 * h + j);
      float* xx = x + 32 * h + 4 * j;
      xx[0] -= v.x;
      xx[1] -= v.y;
      xx[2] -= v.z;
      xx[3] -= v.w;
    }
  }
}

// The norm-correction sum of 3-bit codes from counts (kvq::grid_square_sum's value): the lane's codes counted by
// magnitude (code_counts.hpp), the counts packed and added over the vector's PS xor-adjacent lanes by one shuffle
// each, then sum_m n_m q(c_{4+m}) in float. Each product and partial sum is a multiple of the grid's step below the
// vector's sum, so exact (kvq::grid_squares), and equals the sum over the codes in any order. Needs T.sym.
template <int PS>
__device__ __forceinline__ float magnitude_c2(const StoreTables& T, int t, const std::uint32_t (&pw)[6]) {
  const MagnitudeCounts mc = magnitude_counts(pw);
  std::uint32_t pk = mc.m0 | mc.m1 << 10 | mc.both << 20;  // <= 64 PS <= 256 each
#pragma unroll
  for (int o = 1; o < PS; o <<= 1) pk += __shfl_xor_sync(0xffffffffu, pk, o);
  const int c0 = static_cast<int>(pk & 1023u), c1 = static_cast<int>((pk >> 10) & 1023u), c01 = static_cast<int>(pk >> 20);
  const int n = kPairElems * PS;
  float acc = __fmul_rn(static_cast<float>(n - c0 - c1 + c01), T.sq[t][4]);
  acc = __fadd_rn(acc, __fmul_rn(static_cast<float>(c0 - c01), T.sq[t][5]));
  acc = __fadd_rn(acc, __fmul_rn(static_cast<float>(c1 - c01), T.sq[t][6]));
  return __fadd_rn(acc, __fmul_rn(static_cast<float>(c01), T.sq[t][7]));
}

// TurboQuant of 64 elements per lane (tq_encode32's steps): vectors of 64 PS elements held by PS lanes
// (lane ls of them), the sign diagonal applied. Packs the lane's B-bit codes into pw and returns the norm
// and the norm-correction sum of its vector (the same in its PS lanes). The bucket, square (where the codes are
// not counted) and packing of each element are one step (64 codes held at once spilled registers).
template <int PS, int B>
__device__ __forceinline__ void tq_encode64(const StoreTables& T, int t, float (&v)[kPairElems], std::uint32_t (&pw)[2 * B],
                                            int ls, float& norm_out, float& c2_out) {
  constexpr bool kHalves = PS >= 2;  // tq_rotate's half exchange: the lane holds blocks q1 and q1 + 2
  const float norm = tq_rotate<PS, kPairElems, kHalves>(v, ls);
#pragma unroll
  for (int i = 0; i < 2 * B; ++i) pw[i] = 0u;
  // The norm-correction sum (kvq::grid_square_sum): 3-bit codes of a codebook whose mirror codes share their
  // terms (T.sym: every preset's) are counted by magnitude from the packed words afterwards (magnitude_c2);
  // otherwise each code adds its term, eight float chains (exact: any order gives the same sum).
  float c2f[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  auto step = [&](int k, std::uint32_t c, auto with_sq) {  // packing (and term) of code c of element k
    if constexpr (decltype(with_sq)::value) c2f[4 * (k >> 5) + (k & 3)] = __fadd_rn(c2f[4 * (k >> 5) + (k & 3)], T.sq[t][c]);
    const int pos = B * k, i = pos >> 5, o = pos & 31;  // pack_fields' order
    pw[i] += c << o;
    if (o + B > 32) pw[i + 1] += c >> (32 - o);
  };
  // Buckets against the prescaled thresholds (tq_encode32): from the pairs, or by the binary search
  // where the table does not work.
  auto codes = [&](auto with_sq) {
    if (T.ok[t]) {
      const float ba = T.ba[t], bb = T.bb[t], bn = T.bn[t];
      const std::uint32_t pbase = pair_lane_base(T, t, static_cast<int>(threadIdx.x & 31)), pstride = T.pair_stride[t];
#pragma unroll
      for (int k = 0; k < kPairElems; ++k)
        step(k, static_cast<std::uint32_t>(bin_pair_lookup(pbase, pstride, ba, bb, bn, v[k])), with_sq);
    } else {
#pragma unroll
      for (int k = 0; k < kPairElems; ++k)
        step(k, static_cast<std::uint32_t>(count_below<false>(T.edges[t], (1 << B) - 1, v[k])), with_sq);
    }
  };
  // One form for both the counts and the lookups, as compiled and checked: the early-return form made ptxas spill
  // 8 bytes in the head_dim-64 3-bit kernel with tensor copies.
  const bool by_counts = B == 3 && T.sym[t];
  if constexpr (B == 3) {
    if (by_counts) codes(std::false_type{});
    else codes(std::true_type{});
  } else {
    codes(std::true_type{});
  }
  float c2 = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) c2 = __fadd_rn(c2, c2f[j]);
  if constexpr (B == 3) {
    if (by_counts) c2_out = magnitude_c2<PS>(T, t, pw);
    else c2_out = xor_tree<PS>(c2);
  } else {
    c2_out = xor_tree<PS>(c2);
  }
  norm_out = norm;
}

// Whether the paired kernel serves format F at head_dim D.
template <int D, class F>
constexpr bool kPairedFast = F::KK == KeyCode::kTq && F::VK == ValueCode::kTq && F::NSEG == 1 && F::KB0 == F::VB0 &&
                             D >= kPairElems && D <= 256;

// kTma: the rows come by tensor copies (RowMaps), the dynamic shared memory has kTmaAlign bytes more, and the
// staging starts at its first 1024-byte boundary (the swizzle's period).
constexpr int kTmaAlign = 1024;
template <int D, class F, bool kTma>
__global__ void __launch_bounds__(kFastThreads, 2) store_pair_kernel(const StoreParams p, int tok_shift, bool use_masks,
                                                                     bool use_smean, bool search, const uint4* image,
                                                                     const __grid_constant__ RowMaps maps) {
  static_assert(kPairedFast<D, F>, "paired store: both sides TurboQuant, one segment, equal widths");
  launch_dependents();  // a decode launched programmatically after the store may start (DecodeParams::programmatic)
  __shared__ __align__(16) StoreTables T;
  __shared__ __align__(16) uint2 BP[kPairEntriesOf<F, 1>];  // store_fast_kernel's pair tables (keys: table 0, values: table 1)
  __shared__ std::uint64_t tbar[kTma ? kFastWarps * 2 : 1];  // kTma: each warp's two stages' mbarriers
  extern __shared__ uint4 dsm_raw[];
  uint4* dsm = dsm_raw;
  if constexpr (kTma) {
    const std::uint32_t a = static_cast<std::uint32_t>(__cvta_generic_to_shared(dsm_raw));
    dsm += ((kTmaAlign - (a & (kTmaAlign - 1))) & (kTmaAlign - 1)) / 16;
    if ((threadIdx.x & 31) == 0) {
      const std::uint32_t b = static_cast<std::uint32_t>(__cvta_generic_to_shared(tbar + 2 * (threadIdx.x >> 5)));
      mbar_init<1>(b);
      mbar_init<1>(b + 8);
      mbar_init_fence();
    }
  }
  using S = Stage2<D>;
  constexpr int P2 = S::P2, V = 16 / P2, B = F::KB0;
  const FormatDesc& f = p.fmt;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int side = lane >> 4, l16 = lane & 15, g = l16 / P2, l2 = l16 % P2;
  char* sb = reinterpret_cast<char*>(dsm);
  const uint4* smask = dsm + kStagingBytes / 16;
  const int H = f.kv_heads;
  constexpr int D8 = D / 8, D4 = D / 4;
  std::uint16_t* soff = nullptr;
  const uint4* smean = nullptr;
  const PageLayout& pg = f.page;
  const std::int64_t ks = token_stride(p.key_token_stride, H, D);
  const std::int64_t vs = token_stride(p.value_token_stride, H, D);
  const int mu = static_cast<int>(pg.meta_bytes / 2);
  const bool protect = p.protect_rows && p.positions && p.seq_ids;
  constexpr int NU = 2;  // metadata units: the key norm, then the value norm

  // Staging as in store_fast_kernel (filled by tensor copies with kTma); the lane's run of 8 chunks (its 64
  // elements) at own ^ 16 i in its side.
  const std::uint32_t wstage = static_cast<std::uint32_t>(w) * 2u * kStageBytes;
  const std::uint32_t run = static_cast<std::uint32_t>(P2 * g + l2);
  const std::uint32_t own = static_cast<std::uint32_t>(side) * kSideBytes + ((128u * run) ^ ((run & 7u) << 4));
  const std::uint32_t sbase = static_cast<std::uint32_t>(__cvta_generic_to_shared(sb));

  const int n = p.n_tokens;
  const std::uint32_t bar0 = static_cast<std::uint32_t>(__cvta_generic_to_shared(tbar + (kTma ? 2 * w : 0)));
  auto setup = [&] { fast_setup<D, F, S, 1>(T, BP, dsm, p, use_masks, use_smean, search, soff, smean, image); };
  for_each_item<D, V, true, S, kTma>(p, H, w, sbase + wstage, g, ks, vs, setup, [&](int tb, int head, std::int64_t slot, int cur) {
    const int tok = tb * V + g;
    const bool valid = tok < n;
    const bool write = slot >= 0;
    const int vt = valid ? tok : 0, vh = head;
    const std::uint32_t stage = wstage + static_cast<std::uint32_t>(cur) * kStageBytes;
    const std::size_t hd = static_cast<std::size_t>(vh) * D + kPairElems * l2;

    float x[kPairElems];
    unpack_signed64(sb, stage + own, smask, use_masks, side, vh, H, D8, l2, (side ? f.value_signs : f.key_signs) + hd, x);
    if (const float* mg = side ? f.value_mean_seg : f.key_mean_seg) center64(smean, mg, side, vh, H, D4, l2, x);
    float norm = 0.0f, c2 = 0.0f;
    std::uint32_t pw[2 * B];  // the lane's packed codes
    tq_encode64<P2, B>(T, side, x, pw, l2, norm, c2);
    // The record: unit `side` from the vector's first lane. TurboQuantMse refuses a stored norm beyond
    // fp16 (NaN / inf rows end here too); a record refused on one side is written on neither.
    const float fv = corrected_norm(norm, c2);
    bool bad = !(fabsf(fv) <= 65504.0f);
#pragma unroll
    for (int o = 1; o < P2; o <<= 1) bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    bad |= __shfl_xor_sync(0xffffffffu, bad, 16);
    if (bad && valid && lane == P2 * g && p.rejected) atomicAdd(p.rejected, 1u);
    if (write && !bad) {
      int off = 0;
      std::uint8_t* base = slot_page(p.pool, pg, slot, tok_shift, off);
      std::uint8_t* codes = base + (side ? pg.value_code(vh, off) : pg.key_code(vh, off));
      if constexpr (P2 >= 2) {  // blocks q1 and q1 + 2 of the vector (tq_rotate's half exchange), 4 B bytes each
        const std::uint32_t q1 = static_cast<std::uint32_t>(halves_first_block(l2));
        std::uint32_t hi[B];
#pragma unroll
        for (int i = 0; i < B; ++i) hi[i] = pw[B + i];
        std::uint8_t* c1 = codes + 4u * B * q1;
        store_words<B>(pw, c1);
        store_words<B>(hi, c1 + 8 * B);
      } else {
        store_words<2 * B>(pw, codes);
      }
      std::uint16_t* meta = reinterpret_cast<std::uint16_t*>(base + pg.key_meta(vh, off));
      if (l2 == 0) meta[side] = fp16_bits(fv);
      for (int u = NU + side * P2 + l2; u < mu; u += 2 * P2) meta[u] = 0;
    }
    // ---- protected bf16 rows: the lane's 64 elements of its side ----
    if (protect && valid && !bad) {
      if (std::uint16_t* row = protected_row(p, vt, vh)) {
        std::uint16_t* dst = row + side * D + kPairElems * l2;
        // The staged run is the row in channel order (outlier splits too): channels 64 l2 .. 64 l2 + 63.
#pragma unroll
        for (int j = 0; j < 8; ++j)
          reinterpret_cast<uint4*>(dst)[j] = *reinterpret_cast<const uint4*>(sb + ((stage + own) ^ (16u * j)));
      }
    }
  }, &maps, bar0);
}

// bf16 cache: a copy. Thread i moves 16-byte chunk i % (D / 8) of key and value row i / (D / 8)
// (consecutive threads, consecutive bytes of a row), and the protected rows. A record's D / 8
// threads are consecutive lanes of one warp (D / 8 divides 32), which vote on its finiteness first.
template <int D>
__global__ void __launch_bounds__(256) store_bf16_kernel(const StoreParams p, int tok_shift) {
  launch_dependents();  // a decode launched programmatically after the store may start (DecodeParams::programmatic)
  constexpr int C = D / 8;  // 16-byte chunks per row
  static_assert(32 % C == 0, "a record's chunks within one warp");
  const FormatDesc& f = p.fmt;
  const int H = f.kv_heads, lane = threadIdx.x & 31;
  const PageLayout& pg = f.page;
  const std::int64_t ks = token_stride(p.key_token_stride, H, D);
  const std::int64_t vs = token_stride(p.value_token_stride, H, D);
  const long n = static_cast<long>(p.n_tokens) * H * C;
  const long step = static_cast<long>(gridDim.x) * blockDim.x;
  for (long i0 = static_cast<long>(blockIdx.x) * blockDim.x + (threadIdx.x & ~31u); i0 < n; i0 += step) {  // warp-uniform
    const long i = i0 + lane;
    const bool act = i < n;
    const long row = act ? i / C : 0;
    const int ch = static_cast<int>(i % C);
    const int tok = static_cast<int>(row / H), head = static_cast<int>(row % H);
    uint4 kq = make_uint4(0, 0, 0, 0), vq = kq;
    if (act) {
      kq = __ldg(reinterpret_cast<const uint4*>(p.key + tok * ks + static_cast<std::int64_t>(head) * D) + ch);
      vq = __ldg(reinterpret_cast<const uint4*>(p.value + tok * vs + static_cast<std::int64_t>(head) * D) + ch);
    }
    bool bad = bf16x2_nonfinite(kq.x) || bf16x2_nonfinite(kq.y) || bf16x2_nonfinite(kq.z) || bf16x2_nonfinite(kq.w) ||
               bf16x2_nonfinite(vq.x) || bf16x2_nonfinite(vq.y) || bf16x2_nonfinite(vq.z) || bf16x2_nonfinite(vq.w);
#pragma unroll
    for (int o = 1; o < C; o <<= 1) bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    if (!act) continue;
    if (bad) {
      if (ch == 0 && p.rejected) atomicAdd(p.rejected, 1u);
      continue;
    }
    const std::int64_t slot = p.slot_mapping[tok];
    if (slot >= 0) {
      int off = 0;
      std::uint8_t* base = slot_page(p.pool, pg, slot, tok_shift, off);
      reinterpret_cast<uint4*>(base + pg.key_code(head, off))[ch] = kq;
      reinterpret_cast<uint4*>(base + pg.value_code(head, off))[ch] = vq;
      if (ch == 0)
        for (std::uint32_t u = 0; u < pg.meta_bytes / 2; ++u) reinterpret_cast<std::uint16_t*>(base + pg.key_meta(head, off))[u] = 0;
    }
    if (p.protect_rows && p.positions && p.seq_ids) {
      if (std::uint16_t* dst = protected_row(p, tok, head)) {
        reinterpret_cast<uint4*>(dst)[ch] = kq;
        reinterpret_cast<uint4*>(dst + D)[ch] = vq;
      }
    }
  }
}


// Resident CTAs of Kernel (threads per CTA, dyn_smem bytes) on the current device: the grid of the
// grid-stride kernels. Found once per device (devices 0..63).
template <auto Kernel>
cudaError_t resident_ctas(int threads, std::size_t dyn_smem, unsigned& blocks) {
  static std::atomic<unsigned> cached[64];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const bool c = dev >= 0 && dev < 64;
  blocks = c ? cached[dev].load(std::memory_order_acquire) : 0u;
  if (blocks != 0) return cudaSuccess;
  int per_sm = 0;
  DeviceFacts dv;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, dyn_smem);
  if (e == cudaSuccess) e = device_facts(dv);
  if (e != cudaSuccess) return e;
  blocks = static_cast<unsigned>(std::max(1, per_sm) * std::max(1, dv.sms));
  if (c) cached[dev].store(blocks, std::memory_order_release);
  return cudaSuccess;
}

// Sign masks (4 H D bytes), split formats: channel order (4 H D), H D <= 4096; centered formats:
// the means (8 H D) where all fit.
constexpr int kMaskBytes = 32 << 10;

// cuTensorMapEncodeTiled from the driver (nullptr where the driver has none).
using TensorMapEncoder = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                      const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                      CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
TensorMapEncoder tensor_map_encoder() {
  static const TensorMapEncoder fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<TensorMapEncoder>(f);
  }();
  return fn;
}
// KVQ_STORE_SEARCH=1 in the environment (read once; the tests' third path): the fast and paired kernels bucketize
// by the binary search, the route of a codebook whose bin table does not work (no preset's), instead of the table.
bool store_search_forced() {
  static const bool on = env_flag("KVQ_STORE_SEARCH");
  return on;
}

// The paired kernel's RowMaps of p (see there); false where the driver cannot make them, or with
// KVQ_NO_TMA=1 in the environment (read once; the tests' second path): the kernel then copies by cp.async.
template <int D>
bool row_maps(const StoreParams& p, std::int64_t ks, std::int64_t vs, RowMaps& m) {
  static const bool off = env_flag("KVQ_NO_TMA");
  const TensorMapEncoder enc = off ? nullptr : tensor_map_encoder();
  if (!enc) return false;
  constexpr int V = 16 / (D / 64);
  auto one = [&](CUtensorMap& out, const std::uint16_t* rows, std::int64_t ts) {
    const cuuint64_t dims[4] = {64, D / 64, static_cast<cuuint64_t>(p.fmt.kv_heads), static_cast<cuuint64_t>(p.n_tokens)};
    const cuuint64_t strides[3] = {128, 2 * D, static_cast<cuuint64_t>(2 * ts)};
    const cuuint32_t box[4] = {64, D / 64, 1, V};
    const cuuint32_t unit[4] = {1, 1, 1, 1};
    return enc(&out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<std::uint16_t*>(rows), dims, strides, box, unit,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  return one(m.key, p.key, ks) && one(m.value, p.value, vs);
}

// The fast kernels' choice of shared memory after the staging: the sign masks (and the split formats' channel
// offsets) where H D <= 4096, the centered formats' means too where they fit; returns its bytes (0: none).
template <int D, class F>
std::size_t fast_mask_region(const FormatDesc& f, bool& use_masks, bool& use_smean) {
  use_masks = f.kv_heads * D <= 4096;
  use_smean = use_masks && f.key_mean_seg && f.value_mean_seg &&
              mask_region_bytes<D, F::NSEG>(f.kv_heads, true, true) <= static_cast<std::size_t>(kMaskBytes);
  return mask_region_bytes<D, F::NSEG>(f.kv_heads, use_masks, use_smean);
}

// Builds format F's setup image (FormatDesc::store_image): one CTA runs the fast kernel's fast_setup (the paired
// kernel's where it serves F), then writes StoreTables (pair bases relative to its BP table), the BP table and
// the mask region to out.
template <int D, class F>
__global__ void __launch_bounds__(kFastThreads) store_image_kernel(const StoreParams p, bool use_masks, bool use_smean,
                                                                   uint4* out) {
  constexpr int VT = kPairedFast<D, F> ? 1 : 2;
  __shared__ __align__(16) StoreTables T;
  __shared__ __align__(16) uint2 BP[kPairEntriesOf<F, VT>];
  extern __shared__ uint4 dsm[];
  std::uint16_t* soff = nullptr;
  const uint4* smean = nullptr;
  constexpr int TU = kImageTableUnits, BU = kPairEntriesOf<F, VT> / 2;
  const int units = image_units<D, F, VT>(p.fmt.kv_heads, use_masks, use_smean);
  // Zeros first: the parts the setup leaves unwritten (tables a format does not use, rows past a table's bins)
  // are zeros in the image, so that an image is a function of the format alone.
  for (int i = threadIdx.x; i < units; i += kFastThreads)
    (i < TU ? reinterpret_cast<uint4*>(&T)[i] : i < TU + BU ? reinterpret_cast<uint4*>(BP)[i - TU] : dsm[kStagingBytes / 16 + (i - TU - BU)]) =
        make_uint4(0, 0, 0, 0);
  __syncthreads();
  if constexpr (kPairedFast<D, F>) fast_setup<D, F, Stage2<D>, 1>(T, BP, dsm, p, use_masks, use_smean, false, soff, smean);
  else fast_setup<D, F, Stage<D>, 2>(T, BP, dsm, p, use_masks, use_smean, false, soff, smean);
  const std::uint32_t bs = static_cast<std::uint32_t>(__cvta_generic_to_shared(BP));
  for (int i = threadIdx.x; i < units; i += kFastThreads) {
    uint4 v = i < TU ? reinterpret_cast<const uint4*>(&T)[i]
                     : i < TU + BU ? reinterpret_cast<const uint4*>(BP)[i - TU] : dsm[kStagingBytes / 16 + (i - TU - BU)];
    if (i == kImagePairBaseUnit) {
      v.x -= bs;
      v.y -= bs;
      v.z -= bs;
      v.w -= bs;
    }
    out[i] = v;
  }
}
template <int D, class F>
cudaError_t launch_store_image(const FormatDesc& f, void* dst, std::size_t bytes, cudaStream_t stream) {
  constexpr int VT = kPairedFast<D, F> ? 1 : 2;
  bool use_masks = false, use_smean = false;
  const std::size_t mb = fast_mask_region<D, F>(f, use_masks, use_smean);
  if (bytes != 16u * static_cast<std::size_t>(image_units<D, F, VT>(f.kv_heads, use_masks, use_smean)) ||
      (reinterpret_cast<std::uintptr_t>(dst) & 15) != 0)
    return cudaErrorInvalidValue;
  const std::size_t smem = kStagingBytes + mb;
  if (const cudaError_t e = smem_limit_once<store_image_kernel<D, F>>(kStagingBytes + kMaskBytes); e != cudaSuccess) return e;
  StoreParams p;
  p.fmt = f;
  store_image_kernel<D, F><<<1, kFastThreads, smem, stream>>>(p, use_masks, use_smean, static_cast<uint4*>(dst));
  return cudaGetLastError();
}

template <int D, class F, bool kTma>
cudaError_t launch_fast_kernel(const StoreParams& p, const RowMaps& maps, cudaStream_t stream) {
  const bool search = store_search_forced();
  constexpr auto kernel = [] {
    if constexpr (kPairedFast<D, F>) return store_pair_kernel<D, F, kTma>;
    else return store_fast_kernel<D, F>;
  }();
  constexpr std::size_t extra = kTma ? kTmaAlign : 0;
  unsigned max_blocks = 0;
  cudaError_t e = smem_limit_once<kernel>(kStagingBytes + kMaskBytes + extra);
  if (e == cudaSuccess) e = resident_ctas<kernel>(kFastThreads, kStagingBytes + kMaskBytes + extra, max_blocks);
  if (e != cudaSuccess) return e;
  bool use_masks = false, use_smean = false;
  const std::size_t mask_bytes = fast_mask_region<D, F>(p.fmt, use_masks, use_smean);
  // The setup image where the format has one of this kernel's shape (not with the forced search, whose tables differ).
  constexpr int VT = kPairedFast<D, F> ? 1 : 2;
  const bool use_image = !search && p.fmt.store_image && (reinterpret_cast<std::uintptr_t>(p.fmt.store_image) & 15) == 0 &&
                         p.fmt.store_image_bytes == 16u * static_cast<std::uint32_t>(image_units<D, F, VT>(p.fmt.kv_heads, use_masks, use_smean));
  const uint4* image = use_image ? static_cast<const uint4*>(p.fmt.store_image) : nullptr;
  constexpr int V = 32 / (D / kLaneElems);
  const long nitems = (static_cast<long>(p.n_tokens) + V - 1) / V * p.fmt.kv_heads;  // (V-token block, head) per warp
  const long want = (nitems + kFastWarps - 1) / kFastWarps;
  const unsigned blocks = static_cast<unsigned>(std::min<long>(want, max_blocks));
  const std::size_t smem = kStagingBytes + mask_bytes + extra;
  if constexpr (kPairedFast<D, F>) {
    kernel<<<blocks, kFastThreads, smem, stream>>>(p, page_shift(p.fmt.page.tokens), use_masks, use_smean, search, image, maps);
  } else {
    kernel<<<blocks, kFastThreads, smem, stream>>>(p, page_shift(p.fmt.page.tokens), use_masks, use_smean, search, image);
  }
  return cudaGetLastError();
}
template <int D, class F>
cudaError_t launch_store_fast(const StoreParams& p, cudaStream_t stream) {
  // Both sides TurboQuant of equal widths: the paired kernel (keys and values in the two half-warps), its
  // rows by tensor copies where the driver makes the maps.
  RowMaps maps{};
  if constexpr (kPairedFast<D, F>) {
    const std::int64_t ks = token_stride(p.key_token_stride, p.fmt.kv_heads, D);
    const std::int64_t vs = token_stride(p.value_token_stride, p.fmt.kv_heads, D);
    if (row_maps<D>(p, ks, vs, maps)) return launch_fast_kernel<D, F, true>(p, maps, stream);
  }
  return launch_fast_kernel<D, F, false>(p, maps, stream);
}

template <int D>
cudaError_t launch_store_bf16(const StoreParams& p, cudaStream_t stream) {
  unsigned max_blocks = 0;
  if (const cudaError_t e = resident_ctas<store_bf16_kernel<D>>(256, 0, max_blocks); e != cudaSuccess) return e;
  const long n = static_cast<long>(p.n_tokens) * p.fmt.kv_heads * (D / 8);
  const unsigned blocks = static_cast<unsigned>(std::min<long>((n + 255) / 256, max_blocks));
  store_bf16_kernel<D><<<blocks, 256, 0, stream>>>(p, page_shift(p.fmt.page.tokens));
  return cudaGetLastError();
}

// Common checks of the fast kernels: alignment, metadata sizes.
bool fast_layout_ok(const StoreParams& p, std::uint32_t kmb, std::uint32_t vmb) {
  const FormatDesc& f = p.fmt;
  const PageLayout& pg = f.page;
  auto a16 = [](const void* q) { return (reinterpret_cast<std::uintptr_t>(q) & 15) == 0; };
  if (pg.key_meta_bytes != kmb || pg.value_meta_bytes != vmb || pg.meta_bytes % 2 != 0 || pg.meta_off % 2 != 0) return false;
  if (!a16(p.key) || !a16(p.value) || !a16(p.pool) || p.key_token_stride % 8 != 0 || p.value_token_stride % 8 != 0 ||
      pg.page_bytes % 16 != 0 || pg.key_code_off % 16 != 0 || pg.value_code_off % 16 != 0 || pg.key_code_bytes % 4 != 0 ||
      pg.value_code_bytes % 4 != 0)
    return false;
  if (p.protect_rows && !a16(p.protect_rows)) return false;
  return true;
}

// Whether format F's device tables are there for the fast kernels (and its centering is of TurboQuant sides, from
// 16-byte aligned signed segment-order means).
template <class Fm>
bool fast_tables_ok(const FormatDesc& f) {
  using KC = KeyCode;
  using VC = ValueCode;
  auto a16 = [](const float* q) { return (reinterpret_cast<std::uintptr_t>(q) & 15) == 0; };
  if ((f.key_mean && (Fm::KK != KC::kTq || !f.key_mean_seg || !a16(f.key_mean_seg))) ||
      (f.value_mean && (Fm::VK != VC::kTq || !f.value_mean_seg || !a16(f.value_mean_seg))))
    return false;
  return !((Fm::KK == KC::kTq && (!f.key_signs || !f.key_thresholds || !f.key_terms || (Fm::NSEG == 2 && !f.key_perm))) ||
           (Fm::VK == VC::kTq && (!f.value_signs || !f.value_thresholds || !f.value_terms || (Fm::NSEG == 2 && !f.value_perm))));
}

// Calls go(FastFmt tag, key metadata bytes, value metadata bytes) for the fast kernel that serves format f at head_dim
// D (bf16 excepted: its own kernel); returns cudaSuccess without calling it where none does.
template <int D, class Go>
cudaError_t visit_fast_format(const FormatDesc& f, Go&& go) {
  const int ns = f.segments;
  if (ns == 2 && !(f.seg_dims[0] == D / 2 && f.seg_dims[1] == D / 2)) return cudaSuccess;
  if (ns != 1 && ns != 2) return cudaSuccess;
  const int kb0 = f.key_bits[0], kb1 = ns == 2 ? f.key_bits[1] : 0, vb0 = f.value_bits[0], vb1 = ns == 2 ? f.value_bits[1] : 0;
  using KC = KeyCode;
  using VC = ValueCode;
  if (f.key == KC::kFp8 && f.value == VC::kUniform && ns == 1 && vb0 == 4) return go(FastFmt<KC::kFp8, VC::kUniform, 1, 0, 0, 4, 4>{}, 0, 4);
  if (f.key == KC::kTq && f.value == VC::kUniform && ns == 1) {
    if (kb0 == 4 && vb0 == 4) return go(FastFmt<KC::kTq, VC::kUniform, 1, 4, 4, 4, 4>{}, 2, 4);
    if (kb0 == 3 && vb0 == 4) return go(FastFmt<KC::kTq, VC::kUniform, 1, 3, 3, 4, 4>{}, 2, 4);
    if (kb0 == 3 && vb0 == 3) return go(FastFmt<KC::kTq, VC::kUniform, 1, 3, 3, 3, 3>{}, 2, 4);
  }
  if (f.key == KC::kTq && f.value == VC::kTq) {
    if (ns == 1 && kb0 == 4 && vb0 == 4) return go(FastFmt<KC::kTq, VC::kTq, 1, 4, 4, 4, 4>{}, 2, 2);
    if (ns == 1 && kb0 == 3 && vb0 == 3) return go(FastFmt<KC::kTq, VC::kTq, 1, 3, 3, 3, 3>{}, 2, 2);
    if (ns == 2 && kb0 == 4 && kb1 == 3 && vb0 == 4 && vb1 == 3) return go(FastFmt<KC::kTq, VC::kTq, 2, 4, 3, 4, 3>{}, 4, 4);
    if (ns == 2 && kb0 == 3 && kb1 == 2 && vb0 == 3 && vb1 == 2) return go(FastFmt<KC::kTq, VC::kTq, 2, 3, 2, 3, 2>{}, 4, 4);
  }
  return cudaSuccess;
}

template <int D>
cudaError_t dispatch_fast(const StoreParams& p, cudaStream_t stream, bool& done) {
  const FormatDesc& f = p.fmt;
  done = false;
  if (f.key == KeyCode::kBf16 && f.value == ValueCode::kBf16 && f.segments == 1) {
    if (!fast_layout_ok(p, 0, 0)) return cudaSuccess;
    done = true;
    return launch_store_bf16<D>(p, stream);
  }
  return visit_fast_format<D>(f, [&](auto fmt_tag, std::uint32_t kmb, std::uint32_t vmb) -> cudaError_t {
    using Fm = decltype(fmt_tag);
    if (!fast_layout_ok(p, kmb, vmb) || !fast_tables_ok<Fm>(f)) return cudaSuccess;
    done = true;
    return launch_store_fast<D, Fm>(p, stream);
  });
}

// The setup image of f at head_dim D: its bytes where a fast kernel with a setup serves f (writing it to dst when
// dst is not null), else 0.
template <int D>
cudaError_t image_of(const FormatDesc& f, void* dst, std::size_t& bytes, cudaStream_t stream) {
  const std::size_t want = bytes;
  bytes = 0;
  return visit_fast_format<D>(f, [&](auto fmt_tag, std::uint32_t, std::uint32_t) -> cudaError_t {
    using Fm = decltype(fmt_tag);
    constexpr int VT = kPairedFast<D, Fm> ? 1 : 2;
    if constexpr (!kTakesImage<D, Fm, VT>) {
      return cudaSuccess;
    } else {
      if (!fast_tables_ok<Fm>(f)) return cudaSuccess;
      bool use_masks = false, use_smean = false;
      fast_mask_region<D, Fm>(f, use_masks, use_smean);
      bytes = 16u * static_cast<std::size_t>(image_units<D, Fm, VT>(f.kv_heads, use_masks, use_smean));
      if (!dst) return cudaSuccess;
      return want == bytes ? launch_store_image<D, Fm>(f, dst, bytes, stream) : cudaErrorInvalidValue;
    }
  });
}
template <class Fn>
cudaError_t by_head_dim(int d, Fn&& fn) {
  switch (d) {
    case 64: return fn(std::integral_constant<int, 64>{});
    case 128: return fn(std::integral_constant<int, 128>{});
    case 256: return fn(std::integral_constant<int, 256>{});
    default: return cudaSuccess;
  }
}

}  // namespace detail

cudaError_t store(const StoreParams& p, cudaStream_t stream) {
  const FormatDesc& f = p.fmt;
  if (p.n_tokens < 0 || f.head_dim <= 0 || f.head_dim > detail::kStoreMaxDim || f.head_dim % 32 != 0 || f.kv_heads <= 0)
    return cudaErrorInvalidValue;
  if (p.n_tokens == 0) return cudaSuccess;
  if (!p.key || !p.value || !p.slot_mapping || !p.pool) return cudaErrorInvalidValue;
  // TurboQuant sides need their tables, the norm-correction terms included (LayerTables fills them).
  if ((f.key == KeyCode::kTq && (!f.key_signs || !f.key_edges || !f.key_terms)) ||
      (f.value == ValueCode::kTq && (!f.value_signs || !f.value_edges || !f.value_terms)))
    return cudaErrorInvalidValue;
  bool done = false;
  const cudaError_t e = detail::by_head_dim(f.head_dim, [&](auto d) { return detail::dispatch_fast<decltype(d)::value>(p, stream, done); });
  if (done || e != cudaSuccess) return e;
  const long warps = static_cast<long>(p.n_tokens) * f.kv_heads;
  const unsigned blocks = static_cast<unsigned>((warps + detail::kStoreWarps - 1) / detail::kStoreWarps);
  detail::store_generic_kernel<<<blocks, detail::kStoreWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

std::size_t store_image_bytes(const FormatDesc& f) {
  std::size_t bytes = 0;
  if (f.kv_heads <= 0) return 0;
  const cudaError_t e = detail::by_head_dim(f.head_dim, [&](auto d) { return detail::image_of<decltype(d)::value>(f, nullptr, bytes, nullptr); });
  return e == cudaSuccess ? bytes : 0;
}

cudaError_t build_store_image(const FormatDesc& f, void* dst, std::size_t bytes, cudaStream_t stream) {
  if (!dst || bytes == 0 || bytes != store_image_bytes(f)) return cudaErrorInvalidValue;
  std::size_t b = bytes;
  return detail::by_head_dim(f.head_dim, [&](auto d) { return detail::image_of<decltype(d)::value>(f, dst, b, stream); });
}

}  // namespace kvq::cuda
