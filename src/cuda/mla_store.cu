// mla_store.cu: the fused MLA cache writers (affine formats and bf16 below; mla-tq4 / mla-tq3 in
// mla_store_tq_kernel). One warp per token: it reads the bf16 content latent
// (d_c = 512) and RoPE key (d_r = 64; other multiples of 64: mla_store_gen_kernel), quantizes them by QuantMLA's group-64 affine rule exactly
// as kvq::AffineGroup::encode_reference (float32, correctly rounded division, rint ties to even,
// a scale that is not a positive normal -> FLT_MIN; compiled with --fmad=false), packs the codes
// LSB-first as kvq::pack_bits, writes codes and the 32-byte metadata record into the token's
// page slot, and copies protected positions' bf16 rows into their MlaProtectLayout slots.
//
// Content codes without a division per element: both x and the scale s are bf16 values (8-bit
// significands), so x / s is either exactly a half-integer or at least 2^-10 away from one; the
// quotient q1 = q0 + (x - s q0) / s with q0 = x * RN(1/s) (one FMA correction) lands on the same
// side of every half-integer as RN(x / s) (and on it exactly when x / s is one), so rint(q1) =
// rint(RN(x / s)) (docs/kernels-mla.md gives the argument). The clamp to [0, m] is applied to the
// quotient (clamp(rint(q) + z, 0, m) = rint(clamp(q, -z, m - z)) + z for integer z), rint is the
// round-to-nearest-even add of 1.5 * 2^23, and codes are packed with one multiply-add each. Groups
// whose scale or range could under/overflow that arithmetic (constant groups: s = FLT_MIN) take
// the per-element division. The RoPE key's fp32 scale has no such gap: it keeps the division.
#include <cuda_bf16.h>

#include <cfloat>

#include "bins.cuh"
#include "device.cuh"
#include "kvq/numeric.hpp"
#include "kvq_cuda_mla.hpp"

namespace kvq::cuda {
namespace {

constexpr int kDc = 512, kDr = 64;
constexpr float kRintMagic = 12582912.0f;  // 1.5 * 2^23: RN(q + magic) = magic + rint(q) for |q| < 2^22
constexpr std::uint32_t kRintMagicBits = 0x4B400000u;

__device__ __forceinline__ float clampf_ref(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

using detail::bf16_hi;
using detail::bin_bucket;
using detail::bf16_lo;
using detail::bf16x2_nonfinite;
using detail::bf16x8_nonfinite;
using detail::bmax2;
using detail::bmin2;
using detail::pack_fields;
using detail::reg_fwht;

// Whether the token's row holds a NaN or an infinity (any lane of the warp; every lane must call).
// Such a token is written nowhere; lane 0 counts it in p.rejected.
__device__ __forceinline__ bool reject_token(const MlaStoreParams& p, bool lane_bad, int lane) {
  if (!__any_sync(0xffffffffu, lane_bad)) return false;
  if (lane == 0 && p.rejected) atomicAdd(p.rejected, 1u);
  return true;
}
// This lane's share of the non-finite check of a RoPE row of dr bf16 values.
__device__ __forceinline__ bool rope_nonfinite(const std::uint16_t* rop, int dr, int lane) {
  bool bad = false;
  for (int i = lane; i < dr / 2; i += 32) bad |= bf16x2_nonfinite(reinterpret_cast<const std::uint32_t*>(rop)[i]);
  return bad;
}
// The same for a latent row of dc and a RoPE row of dr bf16 values.
__device__ __forceinline__ bool row_nonfinite(const std::uint16_t* lat, int dc, const std::uint16_t* rop, int dr, int lane) {
  bool bad = false;
  for (int i = lane; i < dc / 8; i += 32) bad |= bf16x8_nonfinite(reinterpret_cast<const uint4*>(lat)[i]);
  return bad || rope_nonfinite(rop, dr, lane);
}

// The token's content codes, RoPE codes and metadata record in the page of `slot` (tok_shift: log2
// of the page's tokens, or -1).
struct TokenSlot {
  std::uint8_t *kc, *vc, *meta;
};
__device__ __forceinline__ TokenSlot token_slot(const MlaStoreParams& p, std::int64_t slot, int tok_shift) {
  const PageLayout& pg = p.fmt.page;
  const std::uint64_t pid = tok_shift >= 0 ? static_cast<std::uint64_t>(slot >> tok_shift) : static_cast<std::uint64_t>(slot / pg.tokens);
  const int off = tok_shift >= 0 ? static_cast<int>(slot & ((1 << tok_shift) - 1)) : static_cast<int>(slot % pg.tokens);
  std::uint8_t* page = p.pool + pid * pg.page_bytes;
  return TokenSlot{page + pg.key_code(0, off), page + pg.value_code(0, off), page + pg.key_meta(0, off)};
}
// The bf16 protection row token t is copied to, or null: a sink, or a window position among the
// last W of its sequence after this call (protect_seq_lens), when protection is on.
__device__ __forceinline__ std::uint16_t* protected_row(const MlaStoreParams& p, int t) {
  if (!p.protect_rows || !p.protect.enabled()) return nullptr;
  const int pos = p.positions[t], seq = p.seq_ids[t];
  const int s = p.protect.slot(pos);
  bool keep = s >= 0;
  if (keep && pos >= p.protect.sinks && p.protect_seq_lens) keep = pos >= p.protect_seq_lens[seq] - p.protect.window;
  return keep ? p.protect_rows + p.protect.row(seq, s) : nullptr;
}
// Copies token t's bf16 latent (dc) and RoPE key (dr) rows into its protection row, if it has one
// (the whole warp).
__device__ __forceinline__ void copy_if_protected(const MlaStoreParams& p, int t, const std::uint16_t* lat, int dc,
                                                  const std::uint16_t* rop, int dr, int lane) {
  if (std::uint16_t* row = protected_row(p, t)) {
    for (int i = lane; i < dc / 8; i += 32) reinterpret_cast<uint4*>(row)[i] = reinterpret_cast<const uint4*>(lat)[i];
    for (int i = lane; i < dr / 2; i += 32)
      reinterpret_cast<std::uint32_t*>(row + dc)[i] = reinterpret_cast<const std::uint32_t*>(rop)[i];
  }
}
// Latent group g of 64 values held 16 per lane (c0, c1) by the lanes 4g..4g+3: AffineGroup's rule in
// float32 (the file comment gives the argument), every lane of the quad taking part in the shuffles.
// Returns this lane's 16 codes packed LSB-first and the group's scale s (bf16-rounded) and zero point.
// range_bad: the group's max - min overflows float32 (AffineGroup refuses such a group).
template <int CB>
__device__ __forceinline__ void quantize_quad(const uint4& c0, const uint4& c1, std::uint32_t (&pk)[(16 * CB + 31) / 32], float& s_out,
                                              std::uint32_t& zi_out, bool& range_bad) {
  const std::uint32_t w[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
  std::uint32_t mn = bmin2(w[0], w[1]), mx = bmax2(w[0], w[1]);
#pragma unroll
  for (int i = 2; i < 8; ++i) {
    mn = bmin2(mn, w[i]);
    mx = bmax2(mx, w[i]);
  }
  // (min, -max) of the lane in one bf16 pair, then over the group's 4 lanes.
  std::uint32_t mm = bmin2(__byte_perm(mn, mx ^ 0x80008000u, 0x5410), __byte_perm(mn, mx ^ 0x80008000u, 0x7632));
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) mm = bmin2(mm, __shfl_xor_sync(0xffffffffu, mm, o));
  const float lo = bf16_lo(mm), hi = -bf16_hi(mm);
  range_bad = !(hi - lo <= FLT_MAX);
  constexpr float mf = static_cast<float>((1 << CB) - 1);
  float s = round_bf16(__fdiv_rn(hi - lo, mf));
  if (!(s >= FLT_MIN)) s = FLT_MIN;
  const float z = clampf_ref(rintf(__fdiv_rn(-lo, s)), 0.0f, mf);
  const std::uint32_t zi = static_cast<std::uint32_t>(z);
  const float y = __frcp_rn(s);
  const bool fast = s >= 0x1p-80f && __fmul_rn(fmaxf(fabsf(lo), fabsf(hi)), y) < 0x1p60f;
  std::uint32_t tq[16];
  std::uint32_t zc;
  if (fast) {
    const float nz = -z, mz = mf - z;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float x = (i & 1) ? bf16_hi(w[i >> 1]) : bf16_lo(w[i >> 1]);
      const float q0 = __fmul_rn(x, y);
      const float q1 = __fmaf_rn(__fmaf_rn(-q0, s, x), y, q0);
      tq[i] = __float_as_uint(__fadd_rn(fminf(fmaxf(q1, nz), mz), kRintMagic));
    }
    zc = zi - kRintMagicBits;
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float x = (i & 1) ? bf16_hi(w[i >> 1]) : bf16_lo(w[i >> 1]);
      tq[i] = static_cast<std::uint32_t>(clampf_ref(rintf(__fdiv_rn(x, s)) + z, 0.0f, mf));
    }
    zc = 0;
  }
  pack_fields<16, CB>(tq, zc, pk);
  s_out = s;
  zi_out = zi;
}
// Stores 16 packed CB-bit codes (2 CB bytes) at dst.
template <int CB>
__device__ __forceinline__ void store_codes16(std::uint8_t* dst, const std::uint32_t (&pk)[(16 * CB + 31) / 32]) {
  if constexpr (CB == 8) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
  } else if constexpr (CB == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pk[0], pk[1]);
  } else if constexpr (CB == 2) {
    *reinterpret_cast<std::uint32_t*>(dst) = pk[0];
  } else {  // 3 bits: 6 bytes
    std::uint16_t* d = reinterpret_cast<std::uint16_t*>(dst);
    d[0] = static_cast<std::uint16_t>(pk[0]);
    d[1] = static_cast<std::uint16_t>(pk[0] >> 16);
    d[2] = static_cast<std::uint16_t>(pk[1]);
  }
}
// A RoPE group of 64 values held two per lane (r01) by the whole warp: fp32 scale rs, zero point rz
// and the lane's two codes packed (q0 | q1 << RB), with the per-element division; range_bad as for
// quantize_quad.
template <int RB>
__device__ __forceinline__ std::uint32_t quantize_rope_pair(std::uint32_t r01, float& rs_out, float& rz_out, bool& range_bad) {
  std::uint32_t rm2 = bmin2(__byte_perm(r01, r01 ^ 0x80008000u, 0x7610), __byte_perm(r01, r01 ^ 0x80008000u, 0x5432));
#pragma unroll
  for (int o = 1; o <= 16; o <<= 1) rm2 = bmin2(rm2, __shfl_xor_sync(0xffffffffu, rm2, o));
  const float rlo = bf16_lo(rm2), rhi = -bf16_hi(rm2);
  range_bad = !(rhi - rlo <= FLT_MAX);
  const float y0 = bf16_lo(r01), y1 = bf16_hi(r01);
  constexpr float rm = static_cast<float>((1 << RB) - 1);
  float rs = __fdiv_rn(rhi - rlo, rm);
  if (!(rs >= FLT_MIN)) rs = FLT_MIN;
  const float rz = clampf_ref(rintf(__fdiv_rn(-rlo, rs)), 0.0f, rm);
  const std::uint32_t q0 = static_cast<std::uint32_t>(clampf_ref(rintf(__fdiv_rn(y0, rs)) + rz, 0.0f, rm));
  const std::uint32_t q1 = static_cast<std::uint32_t>(clampf_ref(rintf(__fdiv_rn(y1, rs)) + rz, 0.0f, rm));
  rs_out = rs;
  rz_out = rz;
  return q0 | q1 << RB;
}

template <int CB, int RB>
__global__ void __launch_bounds__(256) mla_store_kernel(MlaStoreParams p, int tok_shift) {
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (t >= p.n_tokens) return;
  const std::int64_t slot = p.slot_mapping[t];
  const std::uint16_t* lat = p.latent + static_cast<std::int64_t>(t) * (p.latent_stride ? p.latent_stride : kDc);
  const std::uint16_t* rop = p.rope + static_cast<std::int64_t>(t) * (p.rope_stride ? p.rope_stride : kDr);
  const uint4 c0 = *reinterpret_cast<const uint4*>(lat + 16 * lane);
  const uint4 c1 = *reinterpret_cast<const uint4*>(lat + 16 * lane + 8);
  const std::uint32_t r01 = *reinterpret_cast<const std::uint32_t*>(rop + 2 * lane);
  const bool in_bad = bf16x8_nonfinite(c0) || bf16x8_nonfinite(c1) || bf16x2_nonfinite(r01);
  auto copy_protected = [&]() {
    if (std::uint16_t* row = protected_row(p, t)) {
      *reinterpret_cast<uint4*>(row + 16 * lane) = c0;
      *reinterpret_cast<uint4*>(row + 16 * lane + 8) = c1;
      *reinterpret_cast<std::uint32_t*>(row + kDc + 2 * lane) = r01;
    }
  };
  if constexpr (CB == 16) {
    if (reject_token(p, in_bad, lane)) return;
    copy_protected();
    if (slot < 0) return;
    const TokenSlot ts = token_slot(p, slot, tok_shift);
    reinterpret_cast<uint4*>(ts.kc)[2 * lane] = c0;
    reinterpret_cast<uint4*>(ts.kc)[2 * lane + 1] = c1;
    reinterpret_cast<std::uint32_t*>(ts.vc)[lane] = r01;
  } else {
    // Content: lane holds dims [16 lane, 16 lane + 16); lanes 4g..4g+3 form group g. RoPE key: lane
    // holds dims 2 lane, 2 lane + 1; one group of 64, fp32 scale. Quantized before anything is
    // written: a token is refused whole.
    std::uint32_t pk[(16 * CB + 31) / 32];
    float s, rs, rz;
    std::uint32_t zi;
    bool cbad, rbad;
    quantize_quad<CB>(c0, c1, pk, s, zi, cbad);
    const std::uint32_t rq = quantize_rope_pair<RB>(r01, rs, rz, rbad);
    if (reject_token(p, in_bad || cbad || rbad, lane)) return;
    copy_protected();
    if (slot < 0) return;
    const TokenSlot ts = token_slot(p, slot, tok_shift);
    std::uint8_t *kc = ts.kc, *vc = ts.vc, *meta = ts.meta;
    store_codes16<CB>(kc + 2 * CB * lane, pk);
    if constexpr (RB == 8) reinterpret_cast<std::uint16_t*>(vc)[lane] = static_cast<std::uint16_t>(rq);
    else vc[lane] = static_cast<std::uint8_t>(rq);
    // Metadata record, one 32-bit word from each of 8 lanes (one store instruction):
    // words 0-3 bf16 scales of groups (2i, 2i+1) from lanes 0, 8, 16, 24; words 4, 5 zero points
    // of groups 0-3 / 4-7 from lanes 4, 20; word 6 the RoPE scale (lane 12), word 7 the RoPE zero
    // point and three zero bytes (lane 28).
    const std::uint32_t sb = float_to_bf16(s);
    const std::uint32_t sb_next = __shfl_down_sync(0xffffffffu, sb, 4);
    const int zb = lane & 16;
    const std::uint32_t zw = __shfl_sync(0xffffffffu, zi, zb) | __shfl_sync(0xffffffffu, zi, zb + 4) << 8 |
                             __shfl_sync(0xffffffffu, zi, zb + 8) << 16 | __shfl_sync(0xffffffffu, zi, zb + 12) << 24;
    if ((lane & 3) == 0) {
      const int idx = lane >> 2;
      int word;
      std::uint32_t v;
      if ((idx & 1) == 0) {
        word = idx >> 1;
        v = sb | sb_next << 16;
      } else if (idx == 1 || idx == 5) {
        word = 4 + (idx >> 2);
        v = zw;
      } else if (idx == 3) {
        word = 6;
        v = __float_as_uint(rs);
      } else {
        word = 7;
        v = static_cast<std::uint32_t>(rz);
      }
      reinterpret_cast<std::uint32_t*>(meta)[word] = v;
    }
  }
}

// Any d_c = 64 G, d_r = 64 R (the generic-shape path): the same arithmetic as mla_store_kernel, one
// warp per token, the latent in chunks of 512 dims (lanes 4g..4g+3 hold group g of the chunk, lanes
// past the last group of a short chunk only join the shuffles), the RoPE key in groups of 64 (two
// dims per lane), and the metadata record written field by field: [G bf16 scales][G zero points]
// [R fp32 scales][R zero points][zeros up to meta_bytes] (the scales may be unaligned).
template <int CB, int RB>
__global__ void __launch_bounds__(256) mla_store_gen_kernel(MlaStoreParams p, int tok_shift) {
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (t >= p.n_tokens) return;
  const int dc = p.fmt.d_latent, dr = p.fmt.d_rope, G = dc / 64, R = dr / 64;
  const std::int64_t slot = p.slot_mapping[t];
  const std::uint16_t* lat = p.latent + static_cast<std::int64_t>(t) * (p.latent_stride ? p.latent_stride : dc);
  const std::uint16_t* rop = p.rope + static_cast<std::int64_t>(t) * (p.rope_stride ? p.rope_stride : dr);
  const bool in_bad = row_nonfinite(lat, dc, rop, dr, lane);
  auto copy_protected = [&]() { copy_if_protected(p, t, lat, dc, rop, dr, lane); };
  if constexpr (CB == 16) {
    if (reject_token(p, in_bad, lane)) return;
    copy_protected();
    if (slot < 0) return;
    const TokenSlot ts = token_slot(p, slot, tok_shift);
    for (int i = lane; i < dc / 8; i += 32) reinterpret_cast<uint4*>(ts.kc)[i] = reinterpret_cast<const uint4*>(lat)[i];
    for (int i = lane; i < dr / 2; i += 32)
      reinterpret_cast<std::uint32_t*>(ts.vc)[i] = reinterpret_cast<const std::uint32_t*>(rop)[i];
  } else {
    // Everything is quantized first (at most 2 chunks of 512 latent dims, 4 RoPE groups), so that a
    // refused token writes nothing.
    constexpr int NW = (16 * CB + 31) / 32;
    std::uint32_t pk[2][NW], zi[2], rq[4];
    float s[2], rs[4], rz[4];
    bool bad = in_bad;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if (c >= (G + 7) / 8) break;  // warp-uniform: every lane takes part in the shuffles
      const bool act = lane < 4 * min(8, G - 8 * c);
      uint4 c0 = make_uint4(0, 0, 0, 0), c1 = c0;
      if (act) {
        c0 = *reinterpret_cast<const uint4*>(lat + 512 * c + 16 * lane);
        c1 = *reinterpret_cast<const uint4*>(lat + 512 * c + 16 * lane + 8);
      }
      bool rb;
      quantize_quad<CB>(c0, c1, pk[c], s[c], zi[c], rb);
      bad |= rb;
    }
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) {  // RoPE group ri: lane holds dims 64 ri + 2 lane, + 1
      if (ri >= R) break;
      bool rb;
      rq[ri] = quantize_rope_pair<RB>(reinterpret_cast<const std::uint32_t*>(rop + 64 * ri)[lane], rs[ri], rz[ri], rb);
      bad |= rb;
    }
    if (reject_token(p, bad, lane)) return;
    copy_protected();
    if (slot < 0) return;
    const PageLayout& pg = p.fmt.page;
    const TokenSlot ts = token_slot(p, slot, tok_shift);
    std::uint8_t *kc = ts.kc, *vc = ts.vc, *meta = ts.meta;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if (c >= (G + 7) / 8) break;
      if (lane < 4 * min(8, G - 8 * c)) {
        store_codes16<CB>(kc + (512 * c + 16 * lane) * CB / 8, pk[c]);
        if ((lane & 3) == 0) {
          const int gi = 8 * c + (lane >> 2);
          reinterpret_cast<std::uint16_t*>(meta)[gi] = static_cast<std::uint16_t>(float_to_bf16(s[c]));
          meta[2 * G + gi] = static_cast<std::uint8_t>(zi[c]);
        }
      }
    }
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) {
      if (ri >= R) break;
      if constexpr (RB == 8) reinterpret_cast<std::uint16_t*>(vc + 64 * ri)[lane] = static_cast<std::uint16_t>(rq[ri]);
      else vc[32 * ri + lane] = static_cast<std::uint8_t>(rq[ri]);
      if (lane < 4) meta[3 * G + 4 * ri + lane] = static_cast<std::uint8_t>(__float_as_uint(rs[ri]) >> (8 * lane));
      if (lane == 4) meta[3 * G + 4 * R + ri] = static_cast<std::uint8_t>(rz[ri]);
    }
    for (int i = 3 * G + 5 * R + lane; i < static_cast<int>(pg.meta_bytes); i += 32) meta[i] = 0;
  }
}

// ---- mla-tq4 / mla-tq3 ------------------------------------------------------------------------
// kvq::TurboQuantMse::encode_reference of the latent (any d_c = 64 G <= 1024), one warp per token,
// operation by operation (this file is compiled with --fmad=false), so records are bit-identical:
//   norm = sqrt(sum x^2) in float, the sum in kvq::sum_squares's order (warp_sum_squares: lane b adds
//   the four FMA chains of block b, the butterfly the pairwise tree of the blocks);
//   u = x * (1 / norm) (0 for a zero row), the sign diagonal (an exact negation), the block FWHT of
//   each power-of-two block (largest first) in registers (reg_fwht: the stage order and the sums of
//   kvq::fwht, 1 / sqrt(block) last), the code = number of codebook midpoints below y (the bin
//   tables of bins.cuh);
//   stored = norm / sqrt(c2), c2 the chosen centroids' terms on their grid (kvq::grid_square_sum: exact
//   in float, so in any order), fp16.
// The RoPE key is copied as bf16. The latent is staged in shared memory as floats (the sums read it
// by block, lane b from 32 b; the FWHT by lane + 32 i), and the codes go through shared memory too
// (the c2 sum reads them by lane + 32 i, the packing by runs of 32).

// The staged latent keeps one word of padding after every 32 floats (element i at xs_pad(i)) and the
// codes four bytes after every 32 (cs_pad), so that the sums, where lane b reads block b, and the
// FWHT and packing, where consecutive lanes read consecutive elements, are all free of bank conflicts.
__device__ __forceinline__ int xs_pad(int i) { return i + (i >> 5); }
__device__ __forceinline__ int cs_pad(int i) { return i + 4 * (i >> 5); }
constexpr int kXsWords = 1024 + 1024 / 32, kCsBytes = 1024 + 4 * (1024 / 32);

// kvq::sum_squares of a latent of at most 16 blocks with two lanes per block: lane 2 b + h has run
// chains 2 h and 2 h + 1 of block b into sa, sb (zeros past the last block). Lane h = 0 adds
// s0 + s1, lane h = 1 s2 + s3; the xor-1 shuffle gives both (s0 + s1) + (s2 + s3), and the butterfly
// over the remaining lane bits adds the blocks' pairwise tree (bins.cuh's warp_block_tree with the
// chains on two lanes: half the sequential steps per lane).
__device__ __forceinline__ float pair_lanes_tree(float sa, float sb) { return detail::xor_tree<32>(__fadd_rn(sa, sb)); }
// The whole sum over d_c = 32 n values: for n <= 16 two lanes per block, lane 2 b + h reading through
// pair(b, h, m, a, b') the m-th elements (m = 0..7) of chains 2 h and 2 h + 1 of block b; beyond 16
// blocks one lane per block, value(b, k) giving element k of block b (warp_sum_squares).
template <class Pair, class Value>
__device__ __forceinline__ float latent_sum_squares(int dc, int lane, Pair&& pair, Value&& value) {
  if (dc <= 512) {
    const int blk = lane >> 1, half = lane & 1;
    float sa = 0.0f, sb = 0.0f;
    if (32 * blk < dc) {
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        float a, b;
        pair(blk, half, m, a, b);
        sa = __fmaf_rn(a, a, sa);
        sb = __fmaf_rn(b, b, sb);
      }
    }
    return pair_lanes_tree(sa, sb);
  }
  return detail::warp_sum_squares(dc, lane, value);
}

// One Hadamard block of bs = 32 NI dims at offset off: scale, signs, FWHT, codes into cs.
template <int NI>
__device__ __forceinline__ void tq_block(const MlaStoreParams& p, const float* xs, std::uint8_t* cs, const detail::StoreTables& T,
                                         int ne, int off, float inv, int lane) {
  float v[NI];
#pragma unroll
  for (int i = 0; i < NI; ++i) {
    const float u = xs[xs_pad(off + lane + 32 * i)] * inv;
    v[i] = (p.fmt.tq_signs[(off >> 5) + i] >> lane) & 1u ? -u : u;
  }
  reg_fwht<NI>(v, lane);
#pragma unroll
  for (int i = 0; i < NI; ++i) cs[cs_pad(off + lane + 32 * i)] = static_cast<std::uint8_t>(bin_bucket(T, 0, ne, v[i]));
}

template <int B>
__global__ void __launch_bounds__(256) mla_store_tq_kernel(const __grid_constant__ MlaStoreParams p, int tok_shift) {
  __shared__ __align__(16) float xs_all[8][kXsWords];
  __shared__ __align__(16) std::uint8_t cs_all[8][kCsBytes];
  __shared__ detail::StoreTables T;  // table 0: the codebook's bins, midpoints and norm-correction terms
  if (threadIdx.x < 32) detail::build_store_table(T, 0, p.fmt.tq_edges, p.fmt.tq_terms, B, threadIdx.x);
  __syncthreads();
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int t = blockIdx.x * 8 + w;
  if (t >= p.n_tokens) return;
  const int dc = p.fmt.d_latent, dr = p.fmt.d_rope;
  float* xs = xs_all[w];
  std::uint8_t* cs = cs_all[w];
  const std::uint16_t* lat = p.latent + static_cast<std::int64_t>(t) * (p.latent_stride ? p.latent_stride : dc);
  const std::uint16_t* rop = p.rope + static_cast<std::int64_t>(t) * (p.rope_stride ? p.rope_stride : dr);
  bool bad = false;
  for (int i = lane; i < dc / 8; i += 32) {
    const uint4 c = reinterpret_cast<const uint4*>(lat)[i];
    bad |= bf16x8_nonfinite(c);
    float* d = xs + xs_pad(8 * i);  // 8 elements inside one block of 32
    const std::uint32_t wv[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      d[2 * j] = bf16_lo(wv[j]);
      d[2 * j + 1] = bf16_hi(wv[j]);
    }
  }
  bad |= rope_nonfinite(rop, dr, lane);
  __syncwarp();
  // Up to 16 blocks (d_c <= 512): two lanes per block, each two of its chains; beyond, one lane per block.
  const float ss = latent_sum_squares(
      dc, lane,
      [&](int b, int h, int m, float& x0, float& x1) {
        const float* xb = xs + 33 * b + 2 * h + 4 * m;
        x0 = xb[0];
        x1 = xb[1];
      },
      [&](int b, int k) { return xs[33 * b + k]; });
  const float norm = __fsqrt_rn(ss);
  const float inv = norm > 0 ? __frcp_rn(norm) : 0.0f;
  constexpr int ne = (1 << B) - 1;
  for (int off = 0, rem = dc; rem > 0;) {  // blocks of the CPU's hadamard_blocks (multiples of 64), largest first
    const int bs = 1 << (31 - __clz(rem));
    switch (bs) {
      case 64: tq_block<2>(p, xs, cs, T, ne, off, inv, lane); break;
      case 128: tq_block<4>(p, xs, cs, T, ne, off, inv, lane); break;
      case 256: tq_block<8>(p, xs, cs, T, ne, off, inv, lane); break;
      case 512: tq_block<16>(p, xs, cs, T, ne, off, inv, lane); break;
      default: tq_block<32>(p, xs, cs, T, ne, off, inv, lane); break;
    }
    off += bs;
    rem -= bs;
  }
  __syncwarp();
  // The norm-correction sum kvq::grid_square_sum: the codes' terms added exactly in float (lane i takes codes
  // i, i + 32, ...), so the order is free.
  const float c2 = detail::warp_grid_square_sum(dc, lane, [&](int i) { return T.sq[0][cs[cs_pad(i)]]; });
  const float stored = detail::corrected_norm(norm, c2);
  // The CPU refuses a norm beyond fp16 (and non-finite rows): write nothing.
  if (reject_token(p, bad || !(fabsf(stored) <= 65504.0f), lane)) return;
  copy_if_protected(p, t, lat, dc, rop, dr, lane);
  const std::int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;
  const TokenSlot ts = token_slot(p, slot, tok_shift);
  // Codes: lane q packs codes 32 q .. 32 q + 31 LSB-first into B words.
  for (int q = lane; q < dc / 32; q += 32) {
    std::uint32_t c[8], t[32], wv[B];
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i] = reinterpret_cast<const std::uint32_t*>(cs)[9 * q + i];
#pragma unroll
    for (int k = 0; k < 32; ++k) t[k] = (c[k >> 2] >> (8 * (k & 3))) & 0xffu;
    pack_fields<32, B>(t, 0u, wv);
#pragma unroll
    for (int i = 0; i < B; ++i) reinterpret_cast<std::uint32_t*>(ts.kc)[B * q + i] = wv[i];
  }
  for (int i = lane; i < dr / 2; i += 32) reinterpret_cast<std::uint32_t*>(ts.vc)[i] = reinterpret_cast<const std::uint32_t*>(rop)[i];
  // Metadata: the fp16 stored norm, then zeros up to the record's metadata bytes.
  for (int i = lane; i < static_cast<int>(p.fmt.page.meta_bytes) / 4; i += 32)
    reinterpret_cast<std::uint32_t*>(ts.meta)[i] = i == 0 ? static_cast<std::uint32_t>(float_to_fp16(stored)) : 0u;
}

template <int CB, int RB>
cudaError_t launch_store(const MlaStoreParams& p, cudaStream_t st) {
  const int shift = detail::page_shift(p.fmt.page.tokens);
  if (p.generic || p.fmt.d_latent != kDc || p.fmt.d_rope != kDr) mla_store_gen_kernel<CB, RB><<<(p.n_tokens + 7) / 8, 256, 0, st>>>(p, shift);
  else mla_store_kernel<CB, RB><<<(p.n_tokens + 7) / 8, 256, 0, st>>>(p, shift);
  return cudaGetLastError();
}

}  // namespace

cudaError_t mla_store(const MlaStoreParams& p, cudaStream_t stream) {
  const MlaFormat& f = p.fmt;
  if (!mla_supported(f) || !p.latent || !p.rope || !p.slot_mapping || !p.pool) return cudaErrorInvalidValue;
  if (p.protect.enabled() && p.protect_rows &&
      (p.protect.d_latent != f.d_latent || p.protect.d_rope != f.d_rope || reinterpret_cast<std::uintptr_t>(p.protect_rows) % 16))
    return cudaErrorInvalidValue;
  if ((p.latent_stride % 8) || (p.rope_stride % 2) || (reinterpret_cast<std::uintptr_t>(p.latent) % 16) ||
      (reinterpret_cast<std::uintptr_t>(p.rope) % 4))
    return cudaErrorInvalidValue;
  if (p.protect.enabled() && p.protect_rows && (!p.positions || !p.seq_ids)) return cudaErrorInvalidValue;
  if (p.n_tokens <= 0) return cudaSuccess;
  const int c = f.content_bits, r = f.rope_bits;
  if (f.tq) {
    const int blocks = (p.n_tokens + 7) / 8;
    if (c == 4) mla_store_tq_kernel<4><<<blocks, 256, 0, stream>>>(p, detail::page_shift(f.page.tokens));
    else mla_store_tq_kernel<3><<<blocks, 256, 0, stream>>>(p, detail::page_shift(f.page.tokens));
    return cudaGetLastError();
  }
  if (c == 16) return launch_store<16, 16>(p, stream);
  if (c == 8 && r == 8) return launch_store<8, 8>(p, stream);
  if (c == 4 && r == 8) return launch_store<4, 8>(p, stream);
  if (c == 4 && r == 4) return launch_store<4, 4>(p, stream);
  if (c == 3 && r == 4) return launch_store<3, 4>(p, stream);
  if (c == 2 && r == 4) return launch_store<2, 4>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace kvq::cuda
