// decode_fast.cuh: the specialized decode kernel for the hot shapes: head_dim 128, G <= 4 query
// heads per KV head, one segment (no outlier split), TurboQuant or fp8 keys, uniform or
// TurboQuant values (tq-k8v4, tq-4bit-nc, tq-k3v4-nc, tq-3bit-nc, tq-4bit, tq-3bit). Other shapes
// and formats take the generic kernel of decode.cuh; the combine kernel is shared.
//
// Differences from the generic kernel (docs/kernels.md, "Decode kernel"):
//  - 16 warps in one CTA per SM (fewer where shared memory does not fit), registers capped at 128;
//    a two-stage cp.async ring per warp, the next chunk issued before the current one is used.
//  - QK: rows 0-3 of the A operand hold the rounded query of heads 0-3, rows 4-7 the same again,
//    rows 8-15 the rounding residuals, so lanes of row g and g + 4 hold the same scores; the
//    score fragment is directly the B operand of PV (no shuffle).
//  - PV with the values as the A operand (16 dims x 16 tokens) and P as B (columns 0-3: P of
//    heads 0-3 rounded to fp16, columns 4-7: the residuals): half the MMAs and half the
//    accumulators of the generic kernel.
//  - Pair tables laid out [entry][64 words]: key pairs at word `lane`, value pairs at word
//    32 + lane, so a table address is `entry << 8 | lane << 2` (+128): for 4-bit codes one PRMT
//    builds it from a byte of codes; value pairs of two tokens are interleaved nibble-wise with one
//    LOP3 per 4 pairs.
#pragma once

#include "decode.cuh"

namespace kvq::cuda::detail {

template <KeyCode KC_, int KB_, ValueCode VC_, int VB_>
struct FCfg {
  static constexpr int D = 128;
  static constexpr KeyCode KC = KC_;
  static constexpr ValueCode VC = VC_;
  static constexpr int KB = KB_, VB = VB_;
  static constexpr int NSEG = 1;
  static constexpr bool kBf16 = false;
  static constexpr int sd(int s) { return s == 0 ? D : 0; }
  static constexpr int soff(int) { return 0; }
  static constexpr int KCB = D * KB / 8, VCB = D * VB / 8;
  static constexpr int KMB = KC == KeyCode::kTq ? 2 : 0;
  static constexpr int VMB = VC == ValueCode::kTq ? 2 : 4;
  static constexpr int MB = KMB + VMB;
  static constexpr int KENT = KC == KeyCode::kTq ? 1 << (2 * KB) : 0;
  static constexpr int VENT = 1 << (2 * VB);
  static constexpr int LUT_BYTES = (KENT > VENT ? KENT : VENT) * 256;
  static constexpr int Q_BYTES = 4 * D * 4;
  static constexpr int STAGE_BYTES = align16c(kChunk * (KCB + VCB + MB)) + 16;
  static constexpr int WFIT = (kSmemBudget - LUT_BYTES - Q_BYTES) / (2 * STAGE_BYTES);
  static constexpr int WARPS = WFIT >= 16 ? 16 : (WFIT / 2) * 2;
  static constexpr int THREADS = WARPS * 32;
  static constexpr int SMEM = LUT_BYTES + Q_BYTES + WARPS * 2 * STAGE_BYTES;
  static constexpr int RS = D + 3;
  static_assert(WARPS >= 8, "fast decode: too little shared memory");
  static_assert(WARPS * 4 * RS * 4 <= WARPS * 2 * STAGE_BYTES, "reduction buffer must fit in the stages");
  static_assert(kMaxGroup * D * 4 + WARPS * kMaxGroup * RS * 4 <= SMEM, "protected split must fit");
};

// Bits [pos, pos + wd) of the word array w, moved to start at bit dst; other bits are garbage.
template <int NW>
__device__ __forceinline__ std::uint32_t field_at(const std::uint32_t (&w)[NW], int pos, int wd, int dst) {
  const int i = pos >> 5, o = pos & 31;
  if (o + wd > 32) return __funnelshift_r(w[i], w[i + 1], o - dst);  // o > dst always here
  return o >= dst ? (w[i] >> (o - dst)) : (w[i] << (dst - o));
}

__device__ __forceinline__ std::uint32_t lds32(const std::uint8_t* base, std::uint32_t off) {
  return *reinterpret_cast<const std::uint32_t*>(base + off);
}

template <class C>
__global__ void __launch_bounds__(C::THREADS, 1)
    decode_fast_kernel(const DecodeParams p, int nsplit, int cps, float* __restrict__ part_o,
                       float* __restrict__ part_lse) {
  extern __shared__ __align__(16) std::uint8_t smem_raw[];
  constexpr int D = C::D;
  const int split = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
  const int G = p.q_heads / p.fmt.kv_heads;
  const int L = p.seq_lens[b];
  const ProtectLayout prl = p.protect;
  const bool prot = prl.enabled();
  const int NS = nsplit + (prot ? 1 : 0);
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const std::size_t row0 = static_cast<std::size_t>(b) * p.q_heads + static_cast<std::size_t>(kh) * G;
  float* po = part_o + (row0 * NS + split) * D;
  float* plse = part_lse + row0 * NS + split;

  if (split == nsplit) {
    protected_split<C>(p.q, p.q_heads, p.scale, prl, p.protect_rows, p.fmt.value_perm, p.fmt.value_signs, G, L,
                       NS, po, plse, smem_raw);
    return;
  }

  const std::int64_t lo = prot ? prl.packed_begin(L) : 0;
  const std::int64_t hi = prot ? prl.packed_end(L) : L;
  const int c_lo = static_cast<int>(lo / kChunk);
  const int c_hi = hi > lo ? static_cast<int>((hi + kChunk - 1) / kChunk) : c_lo;
  const int cb = max(c_lo, split * cps), ce = min(c_hi, (split + 1) * cps);
  if (cb >= ce) {
    for (int h = tid; h < G; h += C::THREADS) plse[static_cast<std::size_t>(h) * NS] = -INFINITY;
    return;
  }

  std::uint8_t* const lut = smem_raw;
  float* const qs = reinterpret_cast<float*>(smem_raw + C::LUT_BYTES);
  std::uint8_t* const stages = smem_raw + C::LUT_BYTES + C::Q_BYTES;
  const std::uint64_t page_bytes = p.fmt.page.page_bytes, koff = p.fmt.page.key_code_off,
                      voff = p.fmt.page.value_code_off, moff = p.fmt.page.meta_off;
  const std::uint8_t* __restrict__ pool = p.pool;
  const int nloc = (ce - cb - w + C::WARPS - 1) / C::WARPS > 0 ? (ce - cb - w + C::WARPS - 1) / C::WARPS : 0;
  std::uint8_t* my_stages = stages + static_cast<std::size_t>(w) * 2 * C::STAGE_BYTES;
  const std::int32_t* bt = p.block_tables + static_cast<std::size_t>(b) * p.max_pages;

  auto issue = [&](int i) {
    const int c = cb + w + i * C::WARPS;
    const int page = bt[c >> 1];
    const int off = (c & 1) * kChunk;
    const std::uint8_t* base = pool + static_cast<std::size_t>(page) * page_bytes;
    std::uint8_t* dst = my_stages + (i & 1) * C::STAGE_BYTES;
    const std::size_t slot = static_cast<std::size_t>(kh) * 64 + static_cast<std::size_t>(off);
    const std::uint8_t* srck = base + koff + slot * C::KCB;
    const std::uint8_t* srcv = base + voff + slot * C::VCB;
    const std::uint8_t* srcm = base + moff + slot * C::MB;
    constexpr int nk = kChunk * C::KCB / 16, nv = kChunk * C::VCB / 16, nm = kChunk * C::MB / 16;
#pragma unroll
    for (int j = lane; j < nk + nv + nm; j += 32) {
      if (j < nk) cp_async16(dst + 16 * j, srck + 16 * j);
      else if (j < nk + nv) cp_async16(dst + 16 * j, srcv + 16 * (j - nk));
      else cp_async16(dst + 16 * j, srcm + 16 * (j - nk - nv));
    }
  };
  if (nloc > 0) issue(0);
  cp_async_commit();

  // Pair tables: row e (256 bytes) = 32 copies of the key pair e, then 32 of the value pair e.
  {
    const float* kc = p.fmt.key_centroids;
    const float* vc = p.fmt.value_centroids;
    constexpr int NE = C::LUT_BYTES / 256;
    for (int i = tid; i < NE * 64; i += C::THREADS) {
      const int e = i >> 6, half = (i >> 5) & 1;
      std::uint32_t v = 0;
      if (half == 0) {
        if constexpr (C::KENT > 0) {
          if (e < C::KENT) v = pack2<false>(kc[e & ((1 << C::KB) - 1)], kc[e >> C::KB]);
        }
      } else if (e < C::VENT) {
        v = pack2<false>(vc[e & ((1 << C::VB) - 1)], vc[e >> C::VB]);
      }
      reinterpret_cast<std::uint32_t*>(lut)[i] = v;
    }
  }
  // Query: scaled into the log2 domain, gathered and rotated like the keys.
  {
    const float qscale = p.scale * kLog2e;
    const float* qg = p.q + row0 * D;
    if constexpr (C::KC == KeyCode::kTq) {
      const std::int32_t* perm = p.fmt.key_perm + static_cast<std::size_t>(kh) * D;
      const float* sg = p.fmt.key_signs + static_cast<std::size_t>(kh) * D;
      for (int i = tid; i < G * D; i += C::THREADS) {
        const int h = i / D, d = i % D;
        qs[i] = qg[h * D + perm[d]] * qscale * sg[d];
      }
      __syncthreads();
      smem_fwht(qs, D, G, D, tid, C::THREADS);
    } else {
      for (int i = tid; i < G * D; i += C::THREADS) qs[i] = qg[i] * qscale;
    }
    __syncthreads();
  }
  // A fragments of the query: rows g and g + 4 = rounded query of head g & 3, rows g + 8 = residual.
  const int hq = g & 3;
  std::uint32_t qa[8][4];
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    const int pr0 = 16 * t4 + 2 * kt;
    std::uint32_t h0 = 0, l0 = 0, h1 = 0, l1 = 0;
    if (hq < G) {
      const float* qq = qs + hq * D;
      split2<false>(qq[2 * pr0], qq[2 * pr0 + 1], h0, l0);
      split2<false>(qq[2 * pr0 + 2], qq[2 * pr0 + 3], h1, l1);
    }
    qa[kt][0] = h0;
    qa[kt][1] = l0;
    qa[kt][2] = h1;
    qa[kt][3] = l1;
  }
  const std::uint32_t L4 = static_cast<std::uint32_t>(lane) << 2;
  const bool hi_lane = g < 4;

  float o[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0;
  float m_run = -INFINITY, l_run = 0, z_run = 0;

  for (int i = 0; i < nloc; ++i) {
    cp_async_wait<0>();
    __syncwarp();
    if (i + 1 < nloc) issue(i + 1);
    cp_async_commit();
    const std::uint8_t* st = my_stages + (i & 1) * C::STAGE_BYTES;
    const std::uint8_t* sk = st;
    const std::uint8_t* sv = st + kChunk * C::KCB;
    const std::uint8_t* smeta = sv + kChunk * C::VCB;
    const std::int64_t pos0 = static_cast<std::int64_t>(cb + w + i * C::WARPS) * kChunk;
    const bool full = pos0 >= lo && pos0 + kChunk <= hi;
    auto valid = [&](int t) { return full || (pos0 + t >= lo && pos0 + t < hi); };

    // Metadata of this lane's 8 tokens (nt * 8 + 2 t4 + e): 16-bit units, 2 * MB / 2 per pair.
    constexpr int MW = C::MB / 2;  // 16-bit units per token
    std::uint32_t mraw[4][C::MB / 2];  // per nt: 2 tokens x MB bytes = MB / 2 words
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const std::uint32_t* mp = reinterpret_cast<const std::uint32_t*>(smeta + (nt * 8 + 2 * t4) * C::MB);
      if constexpr (C::MB == 4) {
        const uint2 v = *reinterpret_cast<const uint2*>(mp);
        mraw[nt][0] = v.x;
        mraw[nt][1] = v.y;
      } else {
#pragma unroll
        for (int k = 0; k < C::MB / 2; ++k) mraw[nt][k] = mp[k];
      }
    }
    auto meta = [&](int nt, int e, int k) -> float {  // 16-bit unit k of token e of pair nt
      const int u = e * MW + k;
      const std::uint32_t x = mraw[nt][u >> 1];
      return half_bits_to_float(static_cast<std::uint16_t>((u & 1) ? (x >> 16) : (x & 0xffffu)));
    };

    // ---- scores ----
    float acc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0;
    if constexpr (C::KC == KeyCode::kTq) {
      constexpr int NB = 32 * C::KB, NW = NB / 32, FW = 2 * C::KB;
      std::uint32_t wv[4][NW];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const std::uint8_t* src = sk + (nt * 8 + g) * C::KCB + t4 * (NB / 8);
        if constexpr (NW == 4) {
          const uint4 v = *reinterpret_cast<const uint4*>(src);
          wv[nt][0] = v.x;
          wv[nt][1] = v.y;
          wv[nt][2] = v.z;
          wv[nt][3] = v.w;
        } else {
#pragma unroll
          for (int k = 0; k < NW; ++k) wv[nt][k] = reinterpret_cast<const std::uint32_t*>(src)[k];
        }
      }
      auto kaddr = [&](const std::uint32_t(&ww)[NW], int pair) -> std::uint32_t {
        const int pos = pair * FW;
        if constexpr (FW == 8) {
          return __byte_perm(ww[pos >> 5], L4, 0x5504u | (static_cast<unsigned>((pos & 31) >> 3) << 4));
        } else {
          return (field_at(ww, pos, FW, 8) & (((1u << FW) - 1u) << 8)) | L4;
        }
      };
#pragma unroll
      for (int kt = 0; kt < 8; ++kt) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const std::uint32_t b0 = lds32(lut, kaddr(wv[nt], 2 * kt));
          const std::uint32_t b1 = lds32(lut, kaddr(wv[nt], 2 * kt + 1));
          mma16816<false>(acc[nt], qa[kt], b0, b1);
        }
      }
    } else {  // fp8 keys: 32 bytes per lane and token
      std::uint32_t wv[4][8];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const uint4* src = reinterpret_cast<const uint4*>(sk + (nt * 8 + g) * C::KCB + t4 * 32);
        const uint4 v0 = src[0], v1 = src[1];
        wv[nt][0] = v0.x;
        wv[nt][1] = v0.y;
        wv[nt][2] = v0.z;
        wv[nt][3] = v0.w;
        wv[nt][4] = v1.x;
        wv[nt][5] = v1.y;
        wv[nt][6] = v1.z;
        wv[nt][7] = v1.w;
      }
#pragma unroll
      for (int kt = 0; kt < 8; ++kt) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const std::uint32_t x = wv[nt][kt];
          mma16816<false>(acc[nt], qa[kt], fp8x2_to_half2(x & 0xffffu), fp8x2_to_half2(x >> 16));
        }
      }
    }
    float sc[4][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = acc[nt][e] + acc[nt][2 + e];
        if constexpr (C::KC == KeyCode::kTq) v *= meta(nt, e, 0);
        sc[nt][e] = valid(nt * 8 + 2 * t4 + e) ? v : -INFINITY;
      }
    }

    // ---- online softmax (log2 domain), per head over the quad ----
    float mx = sc[0][0];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) mx = fmaxf(mx, fmaxf(sc[nt][0], sc[nt][1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;
    const float alpha = exp2f(m_run - m_use);
    float psum = 0;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      sc[nt][0] = exp2f(sc[nt][0] - m_use);
      sc[nt][1] = exp2f(sc[nt][1] - m_use);
      psum += sc[nt][0] + sc[nt][1];
    }
    l_run = l_run * alpha + psum;
    m_run = m_new;
    z_run *= alpha;
    // o columns: lanes t4 < 2 hold heads 2 t4, 2 t4 + 1 (rounded P), t4 >= 2 their residual
    // columns: the scale of column c is alpha of head c & 3, held by the lanes of quad c & 3.
    float al[2];
    {
      const int src0 = ((2 * t4) & 3) * 4, src1 = ((2 * t4 + 1) & 3) * 4;
      al[0] = __shfl_sync(0xffffffffu, alpha, src0);
      al[1] = __shfl_sync(0xffffffffu, alpha, src1);
    }
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      o[n][0] *= al[0];
      o[n][1] *= al[1];
      o[n][2] *= al[0];
      o[n][3] *= al[1];
    }

    // ---- P V: values as A (16 dims x 16 tokens), P as B ----
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      float pv[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int nt = 2 * kk + (j >> 1), e = j & 1;
        const float pr = sc[nt][e];
        if constexpr (C::VC == ValueCode::kUniform) {
          pv[j] = pr > 0 ? pr * meta(nt, e, C::KMB / 2) : 0.0f;
          if (pr > 0) z_run += pr * meta(nt, e, C::KMB / 2 + 1);
        } else {
          pv[j] = pr > 0 ? pr * meta(nt, e, C::KMB / 2) : 0.0f;
        }
      }
      std::uint32_t bfr[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        std::uint32_t h, l;
        split2<false>(pv[2 * j], pv[2 * j + 1], h, l);
        bfr[j] = hi_lane ? h : l;
      }
      // Tokens of this lane's A rows: ta, ta + 1 (k 2t4, 2t4+1) and ta + 8, ta + 9.
      const int ta = 16 * kk + 2 * t4;
      std::uint32_t areg[2][16];  // [token pair][dim j of the lane's 16]
#pragma unroll
      for (int tp = 0; tp < 2; ++tp) {
        const int t0 = ta + 8 * tp;
        if constexpr (C::VB == 4) {
          const uint2 va = *reinterpret_cast<const uint2*>(sv + t0 * C::VCB + g * 8);
          const uint2 vb = *reinterpret_cast<const uint2*>(sv + (t0 + 1) * C::VCB + g * 8);
          const std::uint32_t wa[2] = {va.x, va.y}, wb[2] = {vb.x, vb.y};
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const std::uint32_t E = (wa[h] & 0x0f0f0f0fu) | ((wb[h] << 4) & 0xf0f0f0f0u);
            const std::uint32_t O = ((wa[h] >> 4) & 0x0f0f0f0fu) | (wb[h] & 0xf0f0f0f0u);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const unsigned sel = 0x5504u | (static_cast<unsigned>(k) << 4);
              areg[tp][8 * h + 2 * k] = lds32(lut + 128, __byte_perm(E, L4, sel));
              areg[tp][8 * h + 2 * k + 1] = lds32(lut + 128, __byte_perm(O, L4, sel));
            }
          }
        } else {  // 3-bit: 48 bits at byte 6 g
          const int bo = 6 * g, ba = bo & ~3, sh = (bo & 3) * 8;
          const std::uint32_t* pa = reinterpret_cast<const std::uint32_t*>(sv + t0 * C::VCB + ba);
          const std::uint32_t* pb = reinterpret_cast<const std::uint32_t*>(sv + (t0 + 1) * C::VCB + ba);
          const std::uint32_t wa[2] = {__funnelshift_r(pa[0], pa[1], sh), pa[1] >> sh};
          const std::uint32_t wb[2] = {__funnelshift_r(pb[0], pb[1], sh), pb[1] >> sh};
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const std::uint32_t u = (field_at(wb, 3 * j, 3, 11) & 0x3800u) | L4;
            areg[tp][j] = lds32(lut + 128, (field_at(wa, 3 * j, 3, 8) & 0x700u) | u);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < 8; ++mt) {
        const std::uint32_t a[4] = {areg[0][2 * mt], areg[0][2 * mt + 1], areg[1][2 * mt], areg[1][2 * mt + 1]};
        mma16816<false>(o[mt], a, bfr[0], bfr[1]);
      }
    }
  }
  cp_async_wait<0>();

  // ---- merge: hi + lo columns, then the warps through shared memory ----
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  z_run += __shfl_xor_sync(0xffffffffu, z_run, 1);
  z_run += __shfl_xor_sync(0xffffffffu, z_run, 2);
#pragma unroll
  for (int n = 0; n < 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] += __shfl_xor_sync(0xffffffffu, o[n][e], 2);
  }
  __syncthreads();
  constexpr int RS = C::RS;
  float* red = reinterpret_cast<float*>(stages);
  if (t4 < 2) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int h = 2 * t4 + e;
      if (h < G) {
        float* rr = red + (w * 4 + h) * RS;
#pragma unroll
        for (int mt = 0; mt < 8; ++mt) {
          rr[16 * g + 2 * mt] = o[mt][e];
          rr[16 * g + 2 * mt + 1] = o[mt][2 + e];
        }
      }
    }
  }
  if (hi_lane && t4 == 0 && g < G) {
    float* rr = red + (w * 4 + g) * RS;
    rr[D] = nloc > 0 ? m_run : -INFINITY;
    rr[D + 1] = l_run;
    rr[D + 2] = z_run;
  }
  __syncthreads();
  for (int idx = tid; idx < G * D; idx += C::THREADS) {
    const int h = idx / D, d = idx % D;
    float M = -INFINITY;
    for (int ww = 0; ww < C::WARPS; ++ww) M = fmaxf(M, red[(ww * 4 + h) * RS + D]);
    float sum = 0, a = 0;
    if (M != -INFINITY) {
      for (int ww = 0; ww < C::WARPS; ++ww) {
        const float* rr = red + (ww * 4 + h) * RS;
        if (rr[D] == -INFINITY) continue;
        const float f = exp2f(rr[D] - M);
        sum += f * rr[D + 1];
        a += f * (rr[d] + rr[D + 2]);
      }
    }
    po[static_cast<std::size_t>(h) * NS * D + d] = sum > 0 ? a / sum : 0.0f;
    if (d == 0) plse[static_cast<std::size_t>(h) * NS] = sum > 0 ? M + log2f(sum) : -INFINITY;
  }
}

// (key code, key bits, value code, value bits) of the formats the fast kernel serves.
#define KVQ_FAST_FORMATS(X)                   \
  X(KeyCode::kFp8, 8, ValueCode::kUniform, 4) \
  X(KeyCode::kTq, 4, ValueCode::kUniform, 4)  \
  X(KeyCode::kTq, 3, ValueCode::kUniform, 4)  \
  X(KeyCode::kTq, 3, ValueCode::kUniform, 3)  \
  X(KeyCode::kTq, 4, ValueCode::kTq, 4)       \
  X(KeyCode::kTq, 3, ValueCode::kTq, 3)

template <class C>
cudaError_t launch_decode_fast(const DecodeParams& p, int nsplit, int cps, float* po, float* pl, cudaStream_t st) {
  const PageLayout& pg = p.fmt.page;
  if (pg.tokens != 64 || pg.key_code_bytes != static_cast<std::uint32_t>(C::KCB) ||
      pg.value_code_bytes != static_cast<std::uint32_t>(C::VCB) || pg.meta_bytes != static_cast<std::uint32_t>(C::MB) ||
      pg.key_meta_bytes != static_cast<std::uint32_t>(C::KMB))
    return cudaErrorInvalidValue;
  cudaError_t e = cudaFuncSetAttribute(decode_fast_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(nsplit + (p.protect.enabled() ? 1 : 0)), static_cast<unsigned>(p.fmt.kv_heads),
                  static_cast<unsigned>(p.batch));
  decode_fast_kernel<C><<<grid, C::THREADS, C::SMEM, st>>>(p, nsplit, cps, po, pl);
  return cudaGetLastError();
}

}  // namespace kvq::cuda::detail
