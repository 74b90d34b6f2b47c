// decode_fast.cuh: the specialized decode kernel for the hot shapes: head_dim 128, up to 4, 8 or 16 query
// heads per CTA (FCfg::HG; the four-head form is described below, the others at kHG8 / kHG16), TurboQuant or fp8 keys, uniform or TurboQuant values (tq-k8v4, tq-4bit-nc,
// tq-k3v4-nc, tq-3bit-nc, tq-4bit, tq-3bit) and the outlier splits into two segments of 64
// (tq-3.5bit, tq-2.5bit). Other shapes and formats take the generic kernel of decode.cuh; the
// split merge through the workspace (finish_group) is shared. Where the device holds them, the NS
// CTAs of a (sequence, KV head) are launched as one thread-block cluster and merge through
// distributed shared memory instead (finish_cluster): no workspace round trip, fence or counter.
//
// Differences from the generic kernel (docs/kernels.md, "Decode kernel"):
//  - 16 warps in one CTA per SM (fewer where shared memory does not fit), registers capped at 128;
//    a two- or three-stage cp.async ring per warp, the next chunk issued before the current one is used.
//  - QK with the keys as A (16 tokens x 16 dims) and the query as B (columns 2h / 2h + 1: head h
//    rounded to fp16 / its rounding residual): 16 MMAs per 32 tokens, every row and column used;
//    lane (g, t4) gets the scores of head t4 for its tokens g + 8 j, sums the two columns, and
//    keeps the online softmax of head t4 (max over the 8 lanes of the head).
//  - PV with the values as A (16 dims x 16 tokens) and P as B (columns 2h / 2h + 1 again): P times
//    the value scale, split into fp16 + residual, goes from the score layout (token by g) to the B
//    layout (token by t4) through a 512-byte scratch per warp (four 32-bit stores, two 8-byte loads
//    per lane); every accumulator of a lane belongs to head t4, so the rescale needs no shuffle.
//    3- and 4-bit uniform values enter the MMA as fp16 magic numbers (1024 + c 2^p, one LOP3 per register);
//    the merge takes the offset and the scale 2^p out once.
//  - Swizzles against shared-memory bank conflicts: the query rows by 16-byte chunk (qs_chunk), and
//    tq-4bit's 64-byte value rows by 16-byte unit in the stages (kSwzV, only in cp.async builds, KVQ_FAST_BULK=0).
//  - Pair tables laid out [entry][64 words]: key pairs at word `lane`, value pairs at word
//    32 + lane, so a table address is `entry << 8 | lane << 2` (+128): for 4-bit codes one PRMT
//    builds it from a byte of codes; value pairs of two tokens are interleaved nibble-wise with one
//    LOP3 per 4 pairs.
//  - Outlier split (two segments of 64 dims, b+1 and b bits, one norm each): k-tiles 0-3 are
//    segment 0, 4-7 segment 1, each with its own score accumulators and key norm; PV m-tiles 0-3
//    are segment 0 (dims 8 g .. 8 g + 7 of the segment for lane quad g), 4-7 segment 1, with P
//    times the segment's value norm as B (two scratch units per lane). Segment 0's pair table is
//    aligned to its size, segment 1's follows it (aligned to its own, smaller size).
#pragma once

#include <cooperative_groups.h>

#include <type_traits>
#include <utility>

#include "decode.cuh"
#include "key_windows.hpp"

namespace kvq::cuda::detail {

#ifndef KVQ_FAST_BULK
#define KVQ_FAST_BULK 1  // chunks by bulk copies (one lane, an mbarrier per stage); 0: cp.async by every lane
#endif
#ifndef KVQ_FAST_MAX_STAGES
#define KVQ_FAST_MAX_STAGES 3  // cp.async stages per warp where 16 warps fit (2 otherwise; -D...=2 for A/B builds)
#endif

// KB1 / VB1 > 0: outlier split, segment 0 (dims 0-63 in segment order) at KB / VB bits, segment 1
// (dims 64-127) at KB1 / VB1 bits; TurboQuant keys and values with the same widths on both sides.
// HG_: query heads per CTA, 4 (G <= 4), 8 (4 < G <= 8; see kHG8 below) or 16 (8 < G <= 16; see kHG16 below).
template <KeyCode KC_, int KB_, ValueCode VC_, int VB_, int KB1_ = 0, int VB1_ = 0, int HG_ = 4>
struct FCfg {
  static constexpr int D = 128;
  static constexpr int HG = HG_;
  static_assert(HG == 4 || HG == 8 || HG == 16, "fast decode: 4, 8 or 16 heads per CTA");
  // Eight heads: the QK B operand takes two n-tiles (heads 0-3 and 4-7, fp16 value and residual columns
  // each) and every lane keeps the softmax of heads t4 and t4 + 4. PV keeps one n-tile: column 2 h is
  // head h, column 2 h + 1 head h + 4, both rounded to fp16 without the residual column the four-head
  // kernel uses (the 4-bit magic offsets then subtract the sum of the rounded B values, which the MMA
  // multiplied). ~30 more registers per thread, so 12 warps.
  static constexpr bool kHG8 = HG == 8;
  // Sixteen heads: the QK B operand's two n-tiles are heads 0-7 and 8-15, each rounded to fp16 without the residual
  // column (~11 bits of the query instead of ~22; docs/kernels.md measures what that costs), so a lane's four
  // accumulator columns are heads 2 t4, 2 t4 + 1, 2 t4 + 8 and 2 t4 + 9, and it keeps their four softmaxes. PV takes
  // two n-tiles (o: heads 0-7, o1: heads 8-15; column n = head n, P rounded to fp16 as with eight heads), so the same
  // four heads are the lane's output columns. The codes of a chunk are unpacked once for all sixteen heads (with
  // at most eight heads per CTA, G = 16 took two CTAs that each unpacked them). ~60 more registers than eight heads:
  // 8 warps. The protected rows keep the state of PMAXH = 16 heads.
  static constexpr bool kHG16 = HG == 16;
  static constexpr bool kQ2 = HG >= 8;  // two QK n-tiles (eight or sixteen heads)
  static constexpr KeyCode KC = KC_;
  static constexpr ValueCode VC = VC_;
  static constexpr int KB = KB_, VB = VB_;
  static constexpr int NSEG = KB1_ > 0 ? 2 : 1;
  static_assert(NSEG == 1 || (KC == KeyCode::kTq && VC == ValueCode::kTq && KB == VB && KB1_ == VB1_ && KB1_ < KB),
                "fast decode: outlier split only for TurboQuant keys and values of equal widths");
  static constexpr bool kBf16 = false;
  static constexpr int sd(int s) { return NSEG == 2 ? D / 2 : (s == 0 ? D : 0); }
  static constexpr int soff(int s) { return s == 0 ? 0 : sd(0); }
  static constexpr int kb(int s) { return s == 0 ? KB : KB1_; }
  static constexpr int vb(int s) { return s == 0 ? VB : VB1_; }
  static constexpr int KCB = NSEG == 2 ? (D / 2) * (KB + KB1_) / 8 : D * KB / 8;
  static constexpr int VCB = NSEG == 2 ? (D / 2) * (VB + VB1_) / 8 : D * VB / 8;
  static constexpr int kcoff(int s) { return s == 0 ? 0 : (D / 2) * KB / 8; }  // segment's bytes in a key record
  static constexpr int vcoff(int s) { return s == 0 ? 0 : (D / 2) * VB / 8; }
  static constexpr int KMB = KC == KeyCode::kTq ? 2 * NSEG : 0;
  static constexpr int VMB = VC == ValueCode::kTq ? 2 * NSEG : 4;
  static constexpr int MB = KMB + VMB;
  static constexpr int KENT = KC == KeyCode::kTq ? 1 << (2 * KB) : 0;
  // 3-bit TurboQuant keys of one segment take their pairs through byte windows (tq_keys_mma, WIN): the pair p
  // of a lane's 96-bit run starts at bit 6 p, i.e. at bit 0, 6, 4 or 2 of a byte. In a copy of the run shifted
  // right by 4, the pairs at bit 4 or 6 of a byte start at bit 0 or 2, so every pair lies in bits 0-5 or 2-7
  // of a byte of the run or of its copy, and one PRMT puts that byte into a table address: row `byte` (256
  // bytes) holds the pair (byte & 63) at word `lane` (column A) and the pair (byte >> 2) at word 32 + lane
  // (column B). Per token 3 funnel shifts, then a PRMT and an LDS per pair, where the 6-bit fields took a
  // shift, a LOP3 and an LDS. The 256 rows take 64 KB and both columns.
  static constexpr bool kKeyWin = KC == KeyCode::kTq && KB == 3 && NSEG == 1;
  static constexpr int KROWS = kKeyWin ? 256 : KENT;  // rows of segment 0's key table
  // 3-bit TurboQuant values with such keys (tq-3bit): a lane's value pairs of two tokens, merged into 6-bit pair
  // fields at bits 6 m of two 48-bit runs (even and odd dims), take the same windows from the key table, whose
  // pairs are the value pairs when the two codebooks are equal (FormatDesc::shared_codebook, which the launcher
  // requires): no table of their own.
  static constexpr bool kValWin = kKeyWin && VC == ValueCode::kTq && VB == 3;
  // 3- and 4-bit uniform values are decoded arithmetically (fp16 magic numbers), no table.
  static constexpr bool kMagicV = VC == ValueCode::kUniform && (VB == 4 || VB == 3);
  static constexpr std::uint32_t kMagic = 0x64006400u;  // fp16 1024 in both halves
  // Magic values: register j of a lane's 16 value dims holds 1024 + c 2^p(j) (p: the field's bit position
  // in its 16-bit window), so the merge scales row j by 2^-p(j) after taking 1024 w_run out. 4 bits:
  // even dims at p = 0, odd dims at p = 4. 3 bits: six byte windows of the lane's 48 bits, p = 3 j mod 8.
  static constexpr int magic_p(int j) { return VB == 4 ? 4 * (j & 1) : (3 * j) % 8; }
  static constexpr int VENT = kMagicV || kValWin ? 0 : 1 << (2 * VB);
  // 64-byte rows of TurboQuant values (4 bits, one segment: tq-4bit) are stored swizzled in the stages:
  // 16-byte unit u of row r at u ^ (2 ((r >> 1) & 1)). A PV load phase (16 lanes: rows t4 = 0..3, 8 bytes at
  // 8 g) then hits 32 different banks; unswizzled, rows t4 and t4 + 2 (128 bytes apart) share theirs (2-way
  // conflicts). tq-4bit's loop waits most on the shared-memory queue (its value pairs are table lookups):
  // 1.02-1.07x with cp.async copies. The 4-bit uniform values (magic numbers, no lookups) measured 0.94-1.00x
  // with it, so they keep the plain rows. Only with KVQ_FAST_BULK=0: a bulk copy cannot permute its source, and
  // tq-4bit by bulk copies into plain rows measured 1.044-1.067x against cp.async into swizzled ones
  // (bench/results/decode-gqa-bulk-2026-12-04.md).
  static constexpr bool kSwzV = KVQ_FAST_BULK == 0 && NSEG == 1 && VCB == 64 && VC == ValueCode::kTq;
  // Segment 0's table (key and value pairs of segment 0, or of the only segment), aligned to its
  // size; the split formats' segment 1 table follows it.
  static constexpr int LUT_ALIGN = (KROWS > VENT ? KROWS : VENT) * 256;  // may be 0; a power of two
  static_assert(!kKeyWin || VENT == 0, "fast decode: the key windows' table has no value column of its own");
  static constexpr int LUT1_BYTES = NSEG == 2 ? (1 << (2 * KB1_)) * 256 : 0;
  static constexpr int LUT_BYTES = LUT_ALIGN + LUT1_BYTES;
  static constexpr int Q_BYTES = HG * D * 4 + 2 * NSEG * 16 * 4;  // query [HG][D], then centroids [2 NSEG][16]
  static constexpr int STAGE_BYTES = align16c(kChunk * (KCB + VCB + MB)) + 16;
  // per-warp scratch of the P transpose: [segment][4 parts][4 heads][8 words]; sixteen heads: [segment][2 k-blocks]
  // [16 heads][8 words] (p16_word)
  static constexpr int SCR_WARP = (kHG16 ? 1024 : 512) * NSEG;
  // Warps per CTA at most. Four heads: 16 (128 registers), except tq-4bit-nc with 12 (up to 168 registers): in a
  // same-call A/B (decode-gqa-ab-2026-12-04.md, section 11) 12 warps measured 1.045x for tq-4bit-nc at 8 x 16K and
  // 1.027x at 8 x 64K, 0.96-0.99x for the other TurboQuant-key formats and 1.000-1.004x for tq-k8v4; 8 warps (up to
  // 255 registers) 0.80-0.99x except tq-k8v4; 10 warps 0.92-0.95x for tq-4bit-nc against 12; 14 warps 0.90-0.94x for
  // tq-4bit and tq-k3v4-nc (section 12); 12 warps with three stages (which fit at 12 warps for tq-k3v4-nc, tq-3bit-nc,
  // tq-4bit and tq-3bit) lost what 12 with two did (section 13). The split count's cost model (decode_splits) divides
  // by the warps.
  static constexpr bool kW12 = HG == 4 && NSEG == 1 && KC == KeyCode::kTq && KB == 4 && VC == ValueCode::kUniform && VB == 4;
  static constexpr int WMAX = kHG16 ? 8 : kHG8 || kW12 ? 12 : 16;
  // cp.async ring depth per warp: 3 stages (two chunks in flight while one is used) where 16 warps' rings fit beside
  // the table, query and scratch, 2 otherwise. The eight-head kernels (12 warps) ask for the same room: with three
  // stages where only their 12 rings fit, tq-3bit-nc and tq-k3v4-nc measured 0.99-1.00x (decode-gqa-ab-2026-12-02.md,
  // section 5). The rings must also fit the layout below, whose pad before the table holds whole rings only, within
  // the most dynamic shared memory a block may have (227 KB, after the 1 KB sm_90 reserves per block): for tq-3bit
  // the first test alone would allow three stages that the pad's remainder leaves no room for.
  static constexpr int AVAIL = kSmemBudget - LUT_BYTES - Q_BYTES - 16 * SCR_WARP;
  static constexpr int kPad1k = LUT_ALIGN > 0 ? (LUT_ALIGN - 1024 % LUT_ALIGN) % LUT_ALIGN : 0;
  static constexpr int rings_need(int nst, int warps) {
    const int in_pad = kPad1k / (nst * STAGE_BYTES) < warps ? kPad1k / (nst * STAGE_BYTES) : warps;
    return kPad1k + LUT_BYTES + Q_BYTES + warps * SCR_WARP + (warps - in_pad) * nst * STAGE_BYTES;
  }
  // Sixteen heads (8 warps, so fewer chunks in flight per SM) also where only their 8 rings fit, except with 3-bit
  // values (tq-3bit-nc, tq-3bit): in a same-call A/B at 128 / 8 heads (decode-gqa-heads16-2026-12-03.md, section 5)
  // three stages measured 1.01-1.04x for tq-k3v4-nc, tq-4bit and tq-3.5bit, 1.00-1.02x for tq-4bit-nc and tq-k8v4,
  // 0.97-1.00x for tq-3bit-nc and tq-3bit.
  static constexpr bool kTry3 = AVAIL / (3 * STAGE_BYTES) >= 16 || (kHG16 && VB != 3);
  static constexpr int NST = KVQ_FAST_MAX_STAGES >= 3 && kTry3 && rings_need(3, WMAX) <= kSmemBudget + 2 * 1024 ? 3 : 2;
  static constexpr int WFIT = AVAIL / (NST * STAGE_BYTES);
  static constexpr int WARPS = WFIT >= WMAX ? WMAX : (WFIT / 2) * 2;
  static constexpr int THREADS = WARPS * 32;
  // The main loop unrolled by two chunks where that measured faster (1.00-1.02x): the outlier splits (tq-3.5bit,
  // tq-2.5bit), four heads (bench/results/decode-gqa-ab-2026-12-01.md). Unrolled, the 4-bit-only and uniform-value
  // kernels spill in the loop or slow down (0.94-0.98x); tq-3bit, unrolled too until its keys took byte windows, is
  // 1.00-1.02x faster without (bench/results/decode-gqa-ab-2026-12-02.md).
  static constexpr int UNROLL = HG == 4 && NSEG == 2 ? 2 : 1;  // NSEG == 2 has TurboQuant values (static_assert above)
  static constexpr int RS = D + 3;
  // Layout (lut_pad: bytes from the start of dynamic shared memory to the first shared-window address
  // aligned to LUT_BYTES, so that a table address is (window bits | entry << 8 | word) and one PRMT or
  // LOP3 builds it, no add): stages of warps [0, nlo) in the pad, the table, the query, the warps'
  // P-transpose scratch, the stages of the other warps.
  static constexpr int nlo(int lut_pad) { return lut_pad / (NST * STAGE_BYTES) < WARPS ? lut_pad / (NST * STAGE_BYTES) : WARPS; }
  static constexpr int PMAXH = HG > kMaxGroup ? HG : kMaxGroup;  // the protected rows' per-head state (protected_split)
  static constexpr int PROT_BYTES = PMAXH * D * 4 + WARPS * PMAXH * RS * 4;  // protected rows (protected_split)
  // Merge of the warps (the kernel's tail, sum_warps): row (warp, head) of RW floats holds dim d at d + (d >> 5).
  // With RW = 4 (one segment) or 6 (split) mod 32, the 32 lanes of each of the writers' stores hit 32 banks (dims
  // 16 g + 2 mt (+ 1), or 64 (mt / 4) + 8 g + 2 (mt % 4) (+ 1), of head t4), and the reader's 32 consecutive dims too.
  static constexpr int RW = NSEG == 2 ? 134 : 132;
  static constexpr int RED_BYTES = WARPS * HG * RW * 4;
  // Each warp's softmax statistics: 2 HG 16-byte slots at the start of its P-transpose scratch (lane g of the merge
  // reads warps g and g + 8), warp 0's HG constant terms after ZC_OFF bytes.
  static constexpr int ZC_OFF = kHG16 ? 512 : 256;
  static_assert(WARPS <= 16 && 2 * HG * 16 <= ZC_OFF && ZC_OFF + HG * 4 <= SCR_WARP, "fast decode: merge statistics");
  // Output rows per warp in the split merges (finish_cluster, finish_group): sixteen heads on 8 warps take two.
  static constexpr int MROWS = HG > WARPS ? 2 : 1;
  static_assert(HG <= MROWS * WARPS, "fast decode: a warp per merged row");
  // The rows start past the warps' P-transpose scratch where the scratch lies below RED_BYTES (the statistics
  // are read there while the rows are written).
  static constexpr int SCR_END = LUT_BYTES + Q_BYTES + WARPS * SCR_WARP;  // past the scratch, without the pad
  static constexpr int red_off(int lut_pad) {
    return lut_pad + LUT_BYTES + Q_BYTES >= RED_BYTES ? 0 : align16c(lut_pad + SCR_END);
  }
  static constexpr int RED_END_MAX =
      LUT_BYTES + Q_BYTES >= RED_BYTES ? RED_BYTES : align16c((LUT_ALIGN > 0 ? LUT_ALIGN - 16 : 0) + SCR_END) + RED_BYTES;
  // Cluster split merge: the CTA's partial ([HG][D] outputs, then HG log2-sum-exps), past what the tail
  // of every CTA kind uses.
  static constexpr int CL_OFF = align16c(PROT_BYTES > RED_END_MAX ? PROT_BYTES : RED_END_MAX);
  static constexpr int CL_BYTES = (HG * D + HG) * 4;
  // Then the merge's receive buffer (finish_cluster): row h of split s at [h][s][D] floats, the log2-sum-exps at
  // [h][s], the transaction barrier (8 bytes). kClMax: the most CTAs per cluster (fast_cluster_applies; 8 is the portable
  // cluster size).
  static constexpr int kClMax = 8;
  static constexpr int RC_OFF = align16c(CL_OFF + CL_BYTES);
  static constexpr int RC_LSE = HG * kClMax * D * 4;
  static constexpr int RC_BAR = RC_LSE + HG * kClMax * 4;
  static constexpr int CL_END = RC_OFF + RC_BAR + 16;
  static_assert(CL_END <= kSmemBudget, "fast decode: the cluster merge's buffers");
  // Early sends (clusters of two CTAs without protection, finish_cluster): the partner's rows go into the rotated
  // query's region, dead once the B fragments are loaded, while this CTA may still be in its loop: row h (h % 2 = this
  // CTA's rank) at [h / 2][D] floats, their log2-sum-exps after them, the transaction barrier (initialized in the
  // prologue) last. Taken only where that region overlaps neither the warps' merge rows nor the partial (ep_ok).
  static constexpr int EP_LSE = (HG / 2) * D * 4;
  static constexpr int EP_BAR = (EP_LSE + (HG / 2) * 4 + 7) / 8 * 8;
  static constexpr int EP_BYTES = EP_BAR + 8;
  static_assert(EP_BYTES <= Q_BYTES, "fast decode: the early sends' buffer");
  // Which kernels take them: all but those where a same-call A/B at 8 x 16K measured them >= 1% slower than the
  // same kernel without (bench/results/decode-gqa-ab-2026-12-04.md, sections 7 and 8):
  // - tq-3bit (four, eight and sixteen heads: 1.1-3.8%) and tq-3bit-nc (1.2-1.7%, 1.9%, 9.6%);
  // - the other uniform-value formats with sixteen heads (tq-k8v4 1.7%, tq-4bit-nc 11%, tq-k3v4-nc 11%);
  // - tq-2.5bit with four heads (2.6%) and tq-4bit with eight (3.5%).
  // Elsewhere they measured between 5% faster (tq-2.5bit, sixteen heads) and 0.8% slower. Each kernel's code depends
  // only on its own kEarly, so every kernel is one of the two measured builds.
  static constexpr bool kEarlyLoss =
      kValWin || (KC == KeyCode::kTq && KB == 3 && VC == ValueCode::kUniform && VB == 3) ||
      (HG == 16 && VC == ValueCode::kUniform) || (NSEG == 2 && KB == 3 && HG == 4) ||
      (NSEG == 1 && KC == KeyCode::kTq && KB == 4 && VC == ValueCode::kTq && VB == 4 && HG == 8);
  static constexpr bool kEarly = !kEarlyLoss;
  static constexpr bool ep_ok(int lut_pad) {
    const int q0 = lut_pad + LUT_BYTES, q1 = q0 + EP_BYTES, r0 = red_off(lut_pad);
    return (q1 <= r0 || r0 + RED_BYTES <= q0) && (q1 <= CL_OFF || CL_OFF + CL_BYTES <= q0);
  }
  // Whether a cluster of two CTAs without protection takes the early sends at this lut_pad: the one rule for the
  // kernel (early_sends) and the launcher (fast_cluster_for).
  static constexpr bool takes_early(int lut_pad) { return kEarly && ep_ok(lut_pad); }
  static constexpr int smem(int lut_pad) {
    const int need = lut_pad + LUT_BYTES + Q_BYTES + WARPS * SCR_WARP + (WARPS - nlo(lut_pad)) * NST * STAGE_BYTES;
    return need > CL_END ? need : CL_END;
  }
  static_assert(WARPS >= 8, "fast decode: too little shared memory");
  static_assert(smem(kPad1k) <= kSmemBudget + 2 * 1024, "fast decode: the layout exceeds 227 KB on sm_90");
};

// Shared-window address of the start of dynamic shared memory.
__device__ __forceinline__ std::uint32_t smem_u32(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
// The query rows in shared memory (qs, [4][D] floats) hold 4-float chunk c of a row at chunk
// qs_chunk(c). The B fragments read chunks 8 t4 + kt (4 t4 + kt + 12 (kt / 4) for the split), which
// all lie in one bank group of an unswizzled row: 16-way conflicts that cost ~4 us of the prologue
// at batch 8 x 16K (8 K shared-memory cycles per SM). Swizzled, the 8 lanes of a 16-byte load
// phase (one head, t4 = 0..3) hit 4 different bank groups: one wavefront per phase.
__host__ __device__ constexpr int qs_chunk(int c) { return c ^ ((c >> 3) & 7); }

// 32-bit load from a shared-window address.
__device__ __forceinline__ std::uint32_t lds_u32(std::uint32_t a) {
  std::uint32_t v;
  asm("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}

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

// The NBY bytes at row + o (row 4-byte aligned, o lane-constant) as the low bits of w[0], w[1];
// bits past them are garbage. NBY = 8 needs o % 8 == 0, NBY = 4 o % 4 == 0, NBY = 2 o even (one
// word); otherwise (3 or 6 bytes) the run must end within the 8 bytes from o & ~3, which are read.
template <int NBY>
__device__ __forceinline__ void load_run(const std::uint8_t* row, int o, std::uint32_t (&w)[2]) {
  if constexpr (NBY == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(row + o);
    w[0] = v.x;
    w[1] = v.y;
  } else if constexpr (NBY == 4) {
    w[0] = *reinterpret_cast<const std::uint32_t*>(row + o);
    w[1] = 0;
  } else {
    const std::uint32_t* q = reinterpret_cast<const std::uint32_t*>(row + (o & ~3));
    const int sh = 8 * (o & 3);
    if constexpr (NBY == 2) {  // o even: never straddles a word
      w[0] = q[0] >> sh;
      w[1] = 0;
    } else {
      const std::uint32_t lo = q[0], hi = q[1];
      w[0] = __funnelshift_r(lo, hi, sh);
      w[1] = hi >> sh;
    }
  }
}

// The byte windows of runs of 3-bit code pairs (key_windows.hpp), shared by the key runs and tq-3bit's value pair
// runs: a run of N words shifted right by 4 bits, and the table address of the pair that window kw names in `word`
// (the run's or the copy's word kw.word; x: the table base with the lane's word bits, column A; x | 128: column B).
template <int N>
__device__ __forceinline__ void shifted_by_4(const std::uint32_t (&w)[N], std::uint32_t (&s)[N]) {
#pragma unroll
  for (int k = 0; k + 1 < N; ++k) s[k] = __funnelshift_r(w[k], w[k + 1], 4);
  s[N - 1] = w[N - 1] >> 4;
}
__device__ __forceinline__ std::uint32_t window_addr(std::uint32_t word, const KeyWindow& kw, std::uint32_t x) {
  return __byte_perm(word, kw.col_b ? (x | 128u) : x, 0x7604u | (static_cast<unsigned>(kw.byte) << 4));
}

// Keys as A from TurboQuant codes: the lane's codes of its 4 tokens (wv[j]: token g + 8 j, FW-bit
// fields of two codes each) become pair-table addresses (x: the table base with the lane's word
// bits; one PRMT for 4-bit codes, a shift and a LOP3 otherwise), one LDS per fp16 pair, and NKT
// k-tiles of mma with the query fragments qb[0 .. NKT - 1] into acc (m-tiles 0, 1); NT = 2: the same A
// fragments also with qb1 into acc1 (eight heads). WIN (FCfg::kKeyWin, 3-bit codes of one segment): the
// pairs through byte windows of the run and of its copy shifted right by 4, one PRMT each (x: column A,
// x | 128: column B of the 256-row table).
template <int FW, int NKT, int NW, int NT = 1, bool WIN = false>
__device__ __forceinline__ void tq_keys_mma(const std::uint32_t (&wv)[4][NW], std::uint32_t x, const std::uint32_t (*qb)[2],
                                            float (&acc)[2][4], const std::uint32_t (*qb1)[2] = nullptr,
                                            float (*acc1)[4] = nullptr) {
  static_assert(!WIN || (FW == 6 && NW == 3), "byte windows: 3-bit codes, 96-bit runs");
  std::uint32_t sh[4][NW];  // WIN: the runs shifted right by 4 bits
  if constexpr (WIN) {
#pragma unroll
    for (int j = 0; j < 4; ++j) shifted_by_4(wv[j], sh[j]);
  }
  auto kaddr = [&](int j, int pair) -> std::uint32_t {
    const int pos = pair * FW;
    if constexpr (WIN) {
      const KeyWindow kw = key_window(pair);
      return window_addr(kw.shifted ? sh[j][kw.word] : wv[j][kw.word], kw, x);
    } else if constexpr (FW == 8) {
      return __byte_perm(wv[j][pos >> 5], x, 0x7604u | (static_cast<unsigned>((pos & 31) >> 3) << 4));
    } else {
      return (field_at(wv[j], pos, FW, 8) & (((1u << FW) - 1u) << 8)) | x;
    }
  };
#pragma unroll
  for (int kt = 0; kt < NKT; ++kt) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const std::uint32_t a[4] = {lds_u32(kaddr(2 * mt, 2 * kt)), lds_u32(kaddr(2 * mt + 1, 2 * kt)),
                                  lds_u32(kaddr(2 * mt, 2 * kt + 1)), lds_u32(kaddr(2 * mt + 1, 2 * kt + 1))};
      mma16816<false>(acc[mt], a, qb[kt][0], qb[kt][1]);
      if constexpr (NT == 2) mma16816<false>(acc1[mt], a, qb1[kt][0], qb1[kt][1]);
    }
  }
}

// The last step of the merge of the warps' online softmaxes: every warp has scaled its rows of each head by
// its weight c_w = 2^(m_w - M) / S (M, S: the CTA's maximum and sum over the warps), so output (h, d) of the
// CTA's partial (po, rows `stride` partials apart: the workspace's [row][NS] layout, or 1 in shared memory for
// the cluster merge) is the constant term sum_w c_w z_w plus the warps' rows in warp order (deterministic).
// Its thread index is read after the loop (tid_after_loop: from threadIdx.x its address arithmetic was
// hoisted above the main loop and cost the loop registers).
template <class C>
__device__ __forceinline__ void sum_warps(const float* red, const float* zc, float* po, int stride, int G) {
  constexpr int D = C::D, HG = C::HG, RW = C::RW;
  const int tid = tid_after_loop();
  for (int idx = tid; idx < G * D; idx += C::THREADS) {
    const int h = idx / D, d = idx % D;
    const float* col = red + h * RW + d + (d >> 5);
    float acc = zc[h];
#pragma unroll
    for (int ww = 0; ww < C::WARPS; ++ww) acc += col[ww * HG * RW];
    po[static_cast<std::size_t>(h) * stride * D + d] = acc;
  }
}

// Shared-window address of p in the CTA of the cluster with rank r.
__device__ __forceinline__ std::uint32_t cluster_addr(std::uint32_t a, int r) {
  std::uint32_t ra;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(r));
  return ra;
}
// 16 bytes (4 bytes) to a cluster shared-window address, counted as complete transaction bytes on the barrier at bar
// (a cluster shared-window address in the same CTA).
__device__ __forceinline__ void st_async16(std::uint32_t dst, float4 v, std::uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(dst),
               "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void st_async4(std::uint32_t dst, float v, std::uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];" ::"r"(dst), "f"(v), "r"(bar) : "memory");
}

// Bytes from pad to the first shared-window address aligned to LUT_ALIGN past the dynamic shared memory's start sbase
// (the kernel's layout; every CTA of a launch has the same).
template <class C>
__device__ __forceinline__ int lut_pad_of(std::uint32_t sbase) {
  return C::LUT_ALIGN > 0 ? static_cast<int>((C::LUT_ALIGN - (sbase & (C::LUT_ALIGN - 1))) & (C::LUT_ALIGN - 1)) : 0;
}
// Early sends (FCfg::EP_*): a cluster of two CTAs without protection whose layout leaves the rotated query's region
// alone after the prologue. The same answer in both CTAs (the launch's arguments and layout).
template <class C>
__device__ __forceinline__ bool early_sends(const DecodeParams& p, const SplitArgs& a, std::uint32_t sbase) {
  // Every kernel that takes them (FCfg::kEarly) fits them at sm_90's pad (1 KB reserved per block); a layout change
  // that lost them there fails here instead of only in test_cuda_decode's count of early-send cases on a GPU host.
  static_assert(!C::kEarly || C::ep_ok(C::kPad1k),
                "fast decode: the early sends' buffer overlaps the merge rows or the partial");
  return a.cluster != 0 && a.nsplit == 2 && !p.protect.enabled() && C::takes_early(lut_pad_of<C>(sbase));
}
template <class C>
__device__ __forceinline__ std::uint32_t ep_base(std::uint32_t sbase) {
  return sbase + static_cast<std::uint32_t>(lut_pad_of<C>(sbase) + C::LUT_BYTES);
}
// Arms the early sends once the region is free (packed CTAs: after the B fragments and a CTA barrier; empty ones at
// once): thread 0 initializes the transaction barrier for the partner's rows of this CTA's heads, then every thread
// arrives on the cluster barrier, whose wait in finish_cluster lets the partner send.
template <class C>
__device__ __forceinline__ void ep_arm(std::uint32_t sbase, int rank, int G, int tid) {
  if (tid == 0) {
    int owned = 0;
    for (int h = rank; h < G; h += 2) ++owned;
    const std::uint32_t bar = ep_base<C>(sbase) + C::EP_BAR;
    mbar_init<1>(bar);
    mbar_arrive_expect_tx(bar, static_cast<std::uint32_t>(owned * (C::D + 1) * 4));
    mbar_init_fence();
  }
  __cluster_barrier_arrive_relaxed();
}
// Waits until the transaction barrier at bar (this CTA) has completed its first phase: every byte sent to it by the
// cluster's CTAs has landed (acquire, cluster scope).
__device__ __forceinline__ void wait_cluster_bytes(std::uint32_t bar) {
  std::uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar)
        : "memory");
  } while (!done);
}

// The split merge inside a thread-block cluster (SplitArgs::cluster): the NS CTAs of a (sequence, KV
// head) are one cluster, rank = split, each with its partial ([HG][D] outputs, then HG log2-sum-exps) at CL_OFF of
// its shared memory. Row h is merged by warp h % WARPS of the CTA of rank h % NS (its owner), as finish_group merges from
// the workspace, in split order. Every CTA sends its partial row h to the owner's receive buffer (RC_OFF) with
// asynchronous stores that count their bytes on the owner's transaction barrier, which the owner's warps wait on:
// a cluster barrier with a release before reading other CTAs' shared memory compiles to a GPU-scope memory barrier
// (MEMBAR.ALL.GPU) that waits for all of the CTA's outstanding memory traffic. The receive buffer overlaps the
// stages of the main loop, so a cluster barrier with a relaxed arrival (no data is published by it) first makes
// sure every CTA of the cluster is past its loop and has initialized its transaction barrier. A second one keeps
// every CTA until all sends are issued. No workspace, fence, counter or global round trip.
template <class C>
__device__ __forceinline__ void finish_cluster(const DecodeParams& p, const SplitArgs& a, int NS, int G, std::uint8_t* smem_raw) {
  namespace cg = cooperative_groups;
  constexpr int D = C::D;
  const int rank = static_cast<int>(cg::this_cluster().block_rank());
  const int tid = tid_after_loop(), b = ctaid_z_after_loop();
  const CtaRow cr = cta_row(p, a, ctaid_y_after_loop(), b);
  const int kh = cr.kh;
  const int w = tid >> 5, lane = tid & 31;
  // Row w + WARPS k of the CTA's heads (k < MROWS: two rows per warp only with sixteen heads).
  auto mine_row = [&](int k) {
    const int h = w + C::WARPS * k;
    return h < G && h % NS == rank;
  };
  // With one row per warp the test is written out as before the sixteen-head form (through the lambda, ptxas
  // materialized it as a 16-bit flag in the four- and eight-head kernels); mine_row(0) is the same test.
  const bool mine = C::MROWS > 1 ? mine_row(0) || mine_row(1) : w < G && w % NS == rank;
  const float* mu = p.fmt.value_mean ? p.fmt.value_mean + static_cast<std::size_t>(kh) * D : nullptr;
  int4 vp = make_int4(0, 0, 0, 0);
  float4 vs = make_float4(0, 0, 0, 0);
  if constexpr (C::VC == ValueCode::kTq) {
    if (mine) {
      vp = reinterpret_cast<const int4*>(p.fmt.value_perm + static_cast<std::size_t>(kh) * D)[lane];
      vs = reinterpret_cast<const float4*>(p.fmt.value_signs + static_cast<std::size_t>(kh) * D)[lane];
    }
  }
  const float* const part = reinterpret_cast<const float*>(smem_raw + C::CL_OFF);
  // An opaque copy (asm volatile): from smem_raw directly, ptxas may take the early-send test and the buffer's address
  // from the prologue and keep them across the main loop; without the copy tq-4bit-nc's four-head loop had a spill
  // reload between its MMAs (bench/gpu/sass_loops.py --spills on the cubin).
  std::uint32_t base;
  asm volatile("mov.u32 %0, %1;" : "=r"(base) : "r"(smem_u32(smem_raw)));
  const std::uint32_t rc = base + C::RC_OFF, bar = rc + C::RC_BAR;
  const std::size_t row = cr.row0 + w;
  if (NS == 1) {  // a cluster of one CTA (asynchronous stores need two or more): the merge of its own partial
    __syncthreads();
#pragma unroll
    for (int k = 0; k < C::MROWS; ++k) {
      const int h = w + C::WARPS * k;
      if (C::MROWS == 1 ? mine : mine_row(k))
        merge_row_reg<C::VC == ValueCode::kTq>(
            p, 1, lane, vp, vs, mu, row + C::WARPS * k, [&](int) { return part[C::HG * D + h]; },
            [&](int) { return reinterpret_cast<const float4*>(part + h * D)[lane]; });
    }
    return;
  }
  // Early sends (clusters of two without protection, early_sends): the partner armed its barrier in its prologue, so
  // this CTA sends its rows of the partner's heads without waiting for the partner's loop, and merges its own heads
  // from its own partial and the partner's rows (sent when the partner finished, usually already there). Same
  // partials in the same order, so the same bits as the general path and the workspace merge.
  const bool early = NS == 2 && early_sends<C>(p, a, base);
  const std::uint32_t ep = ep_base<C>(base);
  if (early) {
    __syncthreads();  // the partial is complete (every exit path wrote it with all threads)
  } else {
    if (tid == 0) {
      int owned = 0;  // rows this CTA merges: NS partial rows and log2-sum-exps each
      for (int h = rank; h < G; h += NS) ++owned;
      mbar_init<1>(bar);
      mbar_arrive_expect_tx(bar, owned * NS * (D + 1) * 4);
      mbar_init_fence();
    }
    __syncthreads();  // the partial is complete (every exit path wrote it with all threads), the barrier initialized
    __cluster_barrier_arrive_relaxed();
  }
  __cluster_barrier_wait();  // early: the prologue's arrivals (the partner's buffer and barrier are ready)
  if (p.test_send_delay_ns > 0 && (rank & 1)) sleep_at_least_ns(static_cast<unsigned>(p.test_send_delay_ns));
  const std::uint32_t rbar = early ? ep + C::EP_BAR : bar;  // this CTA's barrier for the rows it merges
  // The two paths' sends are written out separately: one loop with the destination selected per row (the same
  // stores) brought a spill reload back into tq-4bit-nc's four-head main loop (ptxas -v, sass_loops.py --spills).
  if (early) {
    const int o = rank ^ 1;
    for (int i = tid; i < G * (D / 4); i += C::THREADS) {
      const int h = i / (D / 4), q = i % (D / 4);
      if ((h & 1) == o)
        st_async16(cluster_addr(ep + static_cast<std::uint32_t>(((h >> 1) * D + 4 * q) * 4), o),
                   reinterpret_cast<const float4*>(part)[i], cluster_addr(rbar, o));
    }
    if (tid < G && (tid & 1) == o)
      st_async4(cluster_addr(ep + static_cast<std::uint32_t>(C::EP_LSE + (tid >> 1) * 4), o), part[C::HG * D + tid],
                cluster_addr(rbar, o));
  } else {
    for (int i = tid; i < G * (D / 4); i += C::THREADS) {
      const int h = i / (D / 4), q = i % (D / 4), o = h % NS;
      st_async16(cluster_addr(rc + static_cast<std::uint32_t>(((h * C::kClMax + rank) * D + 4 * q) * 4), o),
                 reinterpret_cast<const float4*>(part)[i], cluster_addr(bar, o));
    }
    if (tid < G) {
      const int o = tid % NS;
      st_async4(cluster_addr(rc + static_cast<std::uint32_t>(C::RC_LSE + (tid * C::kClMax + rank) * 4), o), part[C::HG * D + tid],
                cluster_addr(bar, o));
    }
  }
  __cluster_barrier_arrive_relaxed();
  if (mine) {
    wait_cluster_bytes(rbar);
    const float* const recv = reinterpret_cast<const float*>(smem_raw + C::RC_OFF);
    const float* const erecv = reinterpret_cast<const float*>(smem_raw + (ep - base));
#pragma unroll
    for (int k = 0; k < C::MROWS; ++k) {
      const int h = w + C::WARPS * k;
      if (C::MROWS == 1 || mine_row(k))
        merge_row_reg<C::VC == ValueCode::kTq>(
            p, NS, lane, vp, vs, mu, row + C::WARPS * k,
            [&](int s) {
              return !early ? recv[C::RC_LSE / 4 + h * C::kClMax + s]
                            : s == rank ? part[C::HG * D + h] : erecv[C::EP_LSE / 4 + (h >> 1)];
            },
            [&](int s) {
              const float* r = !early ? recv + (h * C::kClMax + s) * D : s == rank ? part + h * D : erecv + (h >> 1) * D;
              return reinterpret_cast<const float4*>(r)[lane];
            });
    }
  }
  __cluster_barrier_wait();
}

template <class C>
__global__ void __launch_bounds__(C::THREADS, 1)
    decode_fast_kernel(const DecodeParams p, const SplitArgs a) {
  extern __shared__ __align__(16) std::uint8_t smem_raw[];
  const int nsplit = a.nsplit, cps = a.cps;
  float* __restrict__ part_o = a.part_o;
  float* __restrict__ part_lse = a.part_lse;
  constexpr int D = C::D;
  const int split = blockIdx.x, b = blockIdx.z;
  const CtaRow cr = cta_row(p, a, blockIdx.y, b);
  const int kh = cr.kh, G = cr.G;
  const int L = p.seq_lens[b];
  const ProtectLayout prl = p.protect;
  const bool prot = prl.enabled();
  const int NS = nsplit + (prot ? 1 : 0);
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const std::size_t row0 = cr.row0;
  // Block-table entries of the warp's first NST chunks, loaded together with the sequence length (the
  // first copies then wait for one round trip instead of two): without protection the CTA's range
  // starts at chunk split * cps whatever the length. Entries are read only inside the sequence's
  // table row; those past the sequence are never used.
  int bt_first[C::NST];
#pragma unroll
  for (int i = 0; i < C::NST; ++i) {
    const int idx = (split * cps + w + i * C::WARPS) >> 1;
    bt_first[i] = !prot && idx < p.max_pages ? p.block_tables[static_cast<std::size_t>(b) * p.max_pages + idx] : 0;
  }
  // The CTA's partial: in the workspace, or (cluster merge) in its own shared memory.
  const bool clus = a.cluster != 0;
  const int pst = clus ? 1 : NS;  // the partial's row stride, in outputs of D and in log2-sum-exps
  float* po = clus ? reinterpret_cast<float*>(smem_raw + C::CL_OFF) : part_o + (row0 * NS + split) * D;
  float* plse = clus ? reinterpret_cast<float*>(smem_raw + C::CL_OFF) + C::HG * D : part_lse + row0 * NS + split;
  auto finish = [&]() {
    if (clus) finish_cluster<C>(p, a, NS, G, smem_raw);
    else finish_group<C::THREADS, C::D, C::VC == ValueCode::kTq, false, C::MROWS>(p, a, NS, G, reinterpret_cast<float*>(smem_raw));
  };

  // Everything above reads what the kernel before a programmatic launch must not write (DecodeParams::programmatic);
  // the query, the pages, the protected rows and the workspace are read after it has finished.
  grid_dependency_wait();

  // Query and centroid loads first: independent of the sequence length, so they are in flight
  // with it and with the block-table loads below (one round trip of the prologue instead of
  // three). Thread i holds the raw query element i; warp h < G holds dims 4 lane .. 4 lane + 3 of
  // the key permutation and signs for head h's rotation.
  constexpr int QPT = (C::HG * D + C::THREADS - 1) / C::THREADS;
  const float* qg = p.q + row0 * D;
  float qraw[QPT];
#pragma unroll
  for (int k = 0; k < QPT; ++k) qraw[k] = tid + k * C::THREADS < G * D ? qg[tid + k * C::THREADS] : 0.0f;
  int4 qperm = make_int4(0, 0, 0, 0);
  float4 qsign = make_float4(0, 0, 0, 0);
  if constexpr (C::KC == KeyCode::kTq) {
    if (w < G) {
      qperm = reinterpret_cast<const int4*>(p.fmt.key_perm + static_cast<std::size_t>(kh) * D)[lane];
      qsign = reinterpret_cast<const float4*>(p.fmt.key_signs + static_cast<std::size_t>(kh) * D)[lane];
    }
  }
  float cent_v = 0;  // centroid table entry tid (layout below)
  if constexpr (C::NSEG == 2) {
    if (tid < 64) {
      const int k = tid & 15, s = tid >> 5;
      const float* cs = ((tid & 16) ? p.fmt.value_centroids : p.fmt.key_centroids) + s * kMaxCodebook;
      cent_v = k < (1 << (s == 0 ? C::kb(0) : C::kb(1))) ? cs[k] : 0.0f;
    }
  } else if (tid < 32) {
    const int k = tid & 15;
    if (tid < 16) {
      if constexpr (C::KENT > 0) cent_v = k < (1 << C::KB) ? p.fmt.key_centroids[k] : 0.0f;
    } else {
      if constexpr (C::VENT > 0) cent_v = k < (1 << C::VB) ? p.fmt.value_centroids[k] : 0.0f;
    }
  }

  const int lo = prot ? static_cast<int>(prl.packed_begin(L)) : 0;
  const int hi = prot ? static_cast<int>(prl.packed_end(L)) : L;
  const int c_lo = lo / kChunk;
  const int c_hi = hi > lo ? (hi + kChunk - 1) / kChunk : c_lo;
  // Split s: virtual chunks [s cps, (s + 1) cps), the first prot_chunks of them the protected rows (split 0's; no
  // cluster merge under protection: fast_cluster_applies).
  const int px = a.prot_chunks;
  const int cb = max(c_lo, split * cps - px), ce = min(c_hi, (split + 1) * cps - px);
  if (cb >= ce) {
    for (int h = tid; h < G; h += C::THREADS) plse[static_cast<std::size_t>(h) * pst] = -INFINITY;
    if (clus && early_sends<C>(p, a, smem_u32(smem_raw))) ep_arm<C>(smem_u32(smem_raw), split, G, tid);
    if (prot && split == 0) protected_rows<C, C::PMAXH>(p, a, NS, smem_raw);
    finish();
    return;
  }
  const std::uint32_t sbase = smem_u32(smem_raw);
  const int lut_pad = lut_pad_of<C>(sbase);
  {
    std::uint32_t dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (static_cast<std::uint32_t>(C::smem(lut_pad)) > dyn) __trap();  // launcher assumed another base
  }
  std::uint8_t* const lut = smem_raw + lut_pad;
  const std::uint32_t lut_s = sbase + static_cast<std::uint32_t>(lut_pad);  // aligned to LUT_BYTES
  float* const qs = reinterpret_cast<float*>(lut + C::LUT_BYTES);
  const int n_lo = C::nlo(lut_pad);
  const std::uint64_t page_bytes = p.fmt.page.page_bytes, koff = p.fmt.page.key_code_off,
                      voff = p.fmt.page.value_code_off, moff = p.fmt.page.meta_off;
  const std::uint8_t* __restrict__ pool = p.pool;
  constexpr int NSEG = C::NSEG;
  const int nloc = (ce - cb - w + C::WARPS - 1) / C::WARPS > 0 ? (ce - cb - w + C::WARPS - 1) / C::WARPS : 0;
  std::uint8_t* my_stages = w < n_lo ? smem_raw + static_cast<std::size_t>(w) * C::NST * C::STAGE_BYTES
                                     : lut + C::LUT_BYTES + C::Q_BYTES + C::WARPS * C::SCR_WARP +
                                           static_cast<std::size_t>(w - n_lo) * C::NST * C::STAGE_BYTES;
  // A warp's chunks are c = cb + w + i WARPS (WARPS even), so chunk i's block-table entry is
  // bt_w[i WARPS / 2] and all its chunks lie in the same half of their pages: the byte offsets of the
  // key codes, value codes and metadata within a page are loop-invariant, and so are the pool
  // pointers below with the lane's 16 bytes folded in. A copy's source is then one 64-bit add of
  // page x page_bytes (one 32 x 32 -> 64-bit multiply; the launcher checks that page_bytes fits 32
  // bits) and an immediate offset of 512 j.
  static_assert(C::WARPS % 2 == 0, "fast decode: a warp's chunks must keep their half page");
  const std::int32_t* const bt_w = p.block_tables + static_cast<std::size_t>(b) * p.max_pages + ((cb + w) >> 1);
  auto page_of = [&](int i) { return i < nloc ? bt_w[i * (C::WARPS / 2)] : 0; };
  auto page_first = [&](int i) { return i < nloc ? (prot ? bt_w[i * (C::WARPS / 2)] : bt_first[i]) : 0; };  // i < NST
  const std::uint32_t page_bytes32 = static_cast<std::uint32_t>(page_bytes);
  const std::size_t slot0 = static_cast<std::size_t>(kh) * 64 + static_cast<std::size_t>(((cb + w) & 1) * kChunk);
  const std::uint8_t* const pool_k = pool + (koff + slot0 * C::KCB);
  const std::uint8_t* const pool_v = pool + (voff + slot0 * C::VCB);
  const std::uint8_t* const pool_m = pool + (moff + slot0 * C::MB);
  // kSwzV: value unit q = lane + 32 j of a stage (row (lane >> 2) + 8 j, unit lane & 3) is copied from the
  // row's unit (lane & 3) ^ 2 ((row >> 1) & 1): the swizzle is an involution, so permuting the sources lays the
  // stage out swizzled with no per-copy cost (a loop-invariant pointer, as before).
  const int vlane = C::kSwzV ? lane ^ ((lane >> 2) & 2) : lane;
  // kSplitGroups (tq-3bit and the outlier splits, whose value pairs are table lookups): a chunk's key codes and
  // metadata are one cp.async group and its value codes the next, so QK waits only for the first and PV for the
  // second (the values' bytes keep arriving while the scores are made): 1.01-1.02x for tq-3bit and tq-2.5bit. The
  // other formats copy a chunk as one group (two groups measured 0.989-1.007x for them; decode-gqa-ab-2026-12-02.md,
  // section 8).
  constexpr int nk = kChunk * C::KCB / 16, nv = kChunk * C::VCB / 16, nm = kChunk * C::MB / 16;
  constexpr bool kSplitGroups = C::kValWin || NSEG == 2;
  // kBulk: lane 0 copies a chunk's three regions with bulk copies (cp.async.bulk) that complete on the stage's
  // mbarriers, kept in the stage's last 16 bytes (past the regions): the first for the key codes and metadata (and
  // the value codes unless kSplitGroups), the second for the value codes (kSplitGroups). The other 31 lanes issue no
  // copy and compute no address. Same-call A/B against cp.async by every lane (bench/results/decode-gqa-bulk-2026-12-03.md):
  // 1.02-1.04x for tq-k8v4, tq-4bit-nc, tq-k3v4-nc, tq-3bit-nc and tq-3.5bit at batch 8, 1.044-1.067x for tq-4bit
  // (whose rows are then not swizzled, kSwzV) at batch 8 and 32 (decode-gqa-bulk-2026-12-04.md). Not for tq-3bit
  // (kValWin: 0.984-0.993x) or tq-2.5bit (ptxas then spills 8 / 12 bytes).
  constexpr bool kBulk = KVQ_FAST_BULK != 0 && !C::kValWin && !(NSEG == 2 && C::kb(1) == 2);
  static_assert(!(kBulk && C::kSwzV), "fast decode: bulk copies cannot swizzle the value rows");
  static_assert(!kBulk || 16 * (nk + nv + nm) + 16 <= C::STAGE_BYTES, "fast decode: the stage's mbarriers");
  const std::uint32_t stages_s = smem_u32(my_stages);
  auto mbar_of = [&](int slot_i) {
    return stages_s + static_cast<std::uint32_t>(slot_i * C::STAGE_BYTES + C::STAGE_BYTES - 16);
  };
  if constexpr (kBulk) {
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < C::NST; ++s) {
        mbar_init<1>(mbar_of(s));
        if constexpr (kSplitGroups) mbar_init<1>(mbar_of(s) + 8);
      }
      mbar_init_fence();
    }
    __syncwarp();
  }
  // kUniIssue: the bulk copies' operands (page, stage address, pool pointers: the same values in every lane) broadcast
  // from lane 0, after which ptxas adds the source offsets in uniform registers: the main loop's issue path has 14-15
  // fewer instructions per chunk (the waterfall loops around the copies remain). Three same-call A/Bs
  // (bench/results/decode-gqa-ab-2026-12-04.md, section 15), ratios of the minima: tq-3bit-nc 1.010-1.035x,
  // tq-k3v4-nc 1.012-1.019x at batch 32 and 0.990-1.013x at 8 x 16K, tq-k3v4-nc and tq-4bit 1.014-1.029x at 128 / 8
  // heads, tq-4bit-nc 0.997-1.009x. Not for tq-k8v4 (0.983x at 128 / 8) or the outlier splits (0.984-1.033x, noisy),
  // which keep the code before (their copies' operands are computed by lane 0 inside its branch, as before: computed
  // outside it and passed in, they changed tq-3.5bit's four-head kernel, which was not measured that way).
  constexpr bool kUniIssue = kBulk && C::KC == KeyCode::kTq && NSEG == 1;
  auto bcast_ptr = [](const std::uint8_t* q) {
    const std::uint64_t v = reinterpret_cast<std::uint64_t>(q);
    const std::uint32_t lo = __shfl_sync(0xffffffffu, static_cast<std::uint32_t>(v), 0);
    const std::uint32_t hi = __shfl_sync(0xffffffffu, static_cast<std::uint32_t>(v >> 32), 0);
    return reinterpret_cast<const std::uint8_t*>((static_cast<std::uint64_t>(hi) << 32) | lo);
  };
  const std::uint8_t* const bk_u = kUniIssue ? bcast_ptr(pool_k) : pool_k;
  const std::uint8_t* const bv_u = kUniIssue ? bcast_ptr(pool_v) : pool_v;
  const std::uint8_t* const bm_u = kUniIssue ? bcast_ptr(pool_m) : pool_m;
  auto issue = [&](int slot_i, int page) {
    const std::uint64_t pgo = static_cast<std::uint64_t>(static_cast<std::uint32_t>(page)) * page_bytes32;
    std::uint8_t* dst = my_stages + slot_i * C::STAGE_BYTES;
    if constexpr (kBulk) {
      std::uint32_t d_u = 0;  // kUniIssue: the stage's shared address and the page's offset, broadcast from lane 0
      std::uint64_t pgo_u = 0;
      if constexpr (kUniIssue) {
        const std::uint32_t pg_u = __shfl_sync(0xffffffffu, static_cast<std::uint32_t>(page), 0);
        d_u = __shfl_sync(0xffffffffu, stages_s + static_cast<std::uint32_t>(slot_i * C::STAGE_BYTES), 0);
        pgo_u = static_cast<std::uint64_t>(pg_u) * page_bytes32;
      }
      if (lane == 0) {
        const std::uint32_t d = kUniIssue ? d_u : stages_s + static_cast<std::uint32_t>(slot_i * C::STAGE_BYTES);
        const std::uint32_t mb = kUniIssue ? d_u + static_cast<std::uint32_t>(C::STAGE_BYTES - 16) : mbar_of(slot_i);
        const std::uint64_t po = kUniIssue ? pgo_u : pgo;
        // The warp's generic reads of this stage (ordered by the __syncwarp before the issue) before the async writes.
        async_proxy_fence();
        mbar_arrive_expect_tx(mb, 16 * (kSplitGroups ? nk + nm : nk + nv + nm));
        bulk_copy(d, bk_u + po, 16 * nk, mb);
        bulk_copy(d + 16 * (nk + nv), bm_u + po, 16 * nm, mb);
        if constexpr (kSplitGroups)
          mbar_arrive_expect_tx(mb + 8, 16 * nv);
        bulk_copy(d + 16 * nk, bv_u + po, 16 * nv, kSplitGroups ? mb + 8 : mb);
      }
    } else if constexpr (nk % 32 == 0 && nv % 32 == 0) {
      static_assert(nm <= 32, "chunk regions");
      const std::uint8_t* srck = pool_k + 16 * lane + pgo;
      const std::uint8_t* srcv = pool_v + 16 * vlane + pgo;
      std::uint8_t* dl = dst + 16 * lane;
#pragma unroll
      for (int j = 0; j < nk / 32; ++j) cp_async16(dl + 512 * j, srck + 512 * j);
      if constexpr (kSplitGroups) {
        if (lane < nm) cp_async16(dl + 16 * (nk + nv), pool_m + 16 * lane + pgo);
        cp_async_commit();
      }
#pragma unroll
      for (int j = 0; j < nv / 32; ++j) cp_async16(dl + 16 * nk + 512 * j, srcv + 512 * j);
      if constexpr (!kSplitGroups) {
        if (lane < nm) cp_async16(dl + 16 * (nk + nv), pool_m + 16 * lane + pgo);
      }
    } else {
      // Regions not in whole warps: only the split formats (112 + 112 + 16 or 80 + 80 + 16 units), which copy in two
      // groups. First group: unit u = lane + 32 j of the key codes and then the metadata (128 or 96 units: whole
      // warps), the metadata's unit u - nk at stage unit nv + u; second group: the value codes.
      static_assert(kSplitGroups && (nk + nm) % 32 == 0, "chunk regions");
      const std::uint8_t* srck = pool_k + pgo;
      const std::uint8_t* srcv = pool_v + pgo;
      const std::uint8_t* srcm = pool_m + pgo;
#pragma unroll
      for (int j = 0; j < (nk + nm) / 32; ++j) {
        const int u = lane + 32 * j;
        if (32 * j + 32 <= nk) cp_async16(dst + 16 * u, srck + 16 * u);
        else if (32 * j >= nk) cp_async16(dst + 16 * (nv + u), srcm + 16 * (u - nk));
        else cp_async16(dst + 16 * (u < nk ? u : nv + u), u < nk ? srck + 16 * u : srcm + 16 * (u - nk));
      }
      cp_async_commit();
#pragma unroll
      for (int j = 0; j < (nv + 31) / 32; ++j) {
        const int u = lane + 32 * j;
        if (32 * j + 32 <= nv || u < nv) cp_async16(dst + 16 * (nk + u), srcv + 16 * u);
      }
    }
  };
  // A chunk is kSplitGroups ? 2 : 1 groups whether or not it is issued (empty groups past the warp's chunks), so
  // the waits below count groups alike in every iteration.
  auto issue_or_skip = [&](bool go, int slot_i, int page) {
    if (go) issue(slot_i, page);
    if constexpr (!kBulk) {
      if (!go && kSplitGroups) cp_async_commit();
      cp_async_commit();
    }
  };
  std::uint32_t phase = 0;  // kBulk: bit s = the parity of stage s's next completion
#pragma unroll
  for (int s = 0; s + 1 < C::NST; ++s) issue_or_skip(s < nloc, s, page_first(s));
  int page_next = page_first(C::NST - 1);
  int slot_rd = 0, slot_wr = C::NST - 1;  // ring slots of chunk i and of chunk i + NST - 1

  // Query (scaled into the log2 domain, gathered and signed like the keys) and the centroids
  // into shared memory; the raw query goes through the P-transpose scratch (unused until the loop)
  // for the gather.
  float* const cent = qs + C::HG * D;  // [0, 16): key centroids, [16, 32): value centroids (split: per segment)
  float* const qraw_s = reinterpret_cast<float*>(lut + C::LUT_BYTES + C::Q_BYTES);
  const float qscale = p.scale * kLog2e;
  if (tid < 32 * NSEG) cent[tid] = cent_v;
#pragma unroll
  for (int k = 0; k < QPT; ++k) {
    const int i = tid + k * C::THREADS;
    if (i < G * D) {
      if constexpr (C::KC == KeyCode::kTq) qraw_s[i] = qraw[k];
      else qs[(i / D) * D + 4 * qs_chunk((i % D) >> 2) + (i & 3)] = qraw[k] * qscale;
    }
  }
  __syncthreads();
  // Pair tables: row e (256 bytes) = 32 copies of the key pair e, then 32 of the value pair e; one
  // thread per (row, half) writes its 128 bytes as 8 16-byte stores, rotated by the thread index so
  // that the 8 threads of a store phase hit 8 different bank groups. Split formats: segment 0's rows,
  // then segment 1's (entry = first code | second code << bits of the segment).
  if constexpr (C::LUT_BYTES > 0) {
    constexpr int NE = C::LUT_BYTES / 256;
#pragma unroll 1
    for (int u = tid; u < 2 * NE; u += C::THREADS) {
      const int r = u >> 1, half = u & 1;
      std::uint32_t v = 0;
      if constexpr (NSEG == 2) {
        constexpr int NE0 = C::LUT_ALIGN / 256;
        const int s = r < NE0 ? 0 : 1, e = r < NE0 ? r : r - NE0, bits = s == 0 ? C::kb(0) : C::kb(1);
        const float* cs = cent + 32 * s + 16 * half;
        v = pack2<false>(cs[e & ((1 << bits) - 1)], cs[e >> bits]);
      } else if constexpr (C::kKeyWin) {
        // The key pairs of byte r at bit 0 (column A) and at bit 2 (column B); kValWin: the value pairs too.
        const int e = key_window_pair(half != 0, r);
        v = pack2<false>(cent[e & 7], cent[e >> 3]);
      } else if (half == 0) {
        if constexpr (C::KENT > 0) {
          if (r < C::KENT) v = pack2<false>(cent[r & ((1 << C::KB) - 1)], cent[r >> C::KB]);
        }
      } else {
        if constexpr (C::VENT > 0) {
          if (r < C::VENT) v = pack2<false>(cent[16 + (r & ((1 << C::VB) - 1))], cent[16 + (r >> C::VB)]);
        }
      }
      const uint4 vv = make_uint4(v, v, v, v);
      uint4* row = reinterpret_cast<uint4*>(lut + r * 256 + half * 128);
#pragma unroll
      for (int k = 0; k < 8; ++k) row[(k + u) & 7] = vv;
    }
  }
  // Rotation of the query in registers: warp h < G gathers dims 4 lane .. 4 lane + 3 of head h
  // (permutation, signs, scale), then the FWHT of size 128 by shuffles (warp_fwht4; split: one per
  // 64-dim segment) and 1 / sqrt(128) (split: 1 / sqrt(64)).
  if constexpr (C::KC == KeyCode::kTq) {
    // Sixteen heads on 8 warps: warp w rotates heads w and w + 8.
#pragma unroll
    for (int k = 0; k < C::MROWS; ++k) {
      const int h = w + C::WARPS * k;
      if (h < G) {
        const float* src = qraw_s + h * D;
        float x[4] = {src[qperm.x] * qscale * qsign.x, src[qperm.y] * qscale * qsign.y, src[qperm.z] * qscale * qsign.z,
                      src[qperm.w] * qscale * qsign.w};
        warp_fwht4(x, lane, C::sd(0));
        const float sc = static_cast<float>(1.0 / sqrt(static_cast<double>(C::sd(0))));
        reinterpret_cast<float4*>(qs + h * D)[qs_chunk(lane)] = make_float4(x[0] * sc, x[1] * sc, x[2] * sc, x[3] * sc);
      }
    }
  }
  __syncthreads();
  // B fragments of the query (QK has the keys as A): column n = g is head g >> 1, rounded to fp16
  // (g even) or its rounding residual (g odd); k pairs 2 t4 (+ 8) of k-tile kt are the dims
  // 32 t4 + 4 kt + {0, 1} ({2, 3}), the run of codes lane t4 reads per token. Split: k-tile kt is
  // segment kt / 4, dims 64 (kt / 4) + 16 t4 + 4 (kt % 4) + {0, 1} ({2, 3}).
  // Sixteen heads: column n = g of n-tile u is head 8 u + g, rounded to fp16 (no residual column).
  const int hq = C::kHG16 ? g : g >> 1;
  const bool lo_col = !C::kHG16 && (g & 1) != 0;
  std::uint32_t qb[8][2];
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) {
    const int d0 = NSEG == 2 ? 64 * (kt >> 2) + 16 * t4 + 4 * (kt & 3) : 32 * t4 + 4 * kt;
    std::uint32_t h0 = 0, l0 = 0, h1 = 0, l1 = 0;
    if (hq < G) {
      const float4 v = reinterpret_cast<const float4*>(qs + hq * D)[qs_chunk(d0 >> 2)];
      split2<false>(v.x, v.y, h0, l0);
      split2<false>(v.z, v.w, h1, l1);
    }
    qb[kt][0] = lo_col ? l0 : h0;
    qb[kt][1] = lo_col ? l1 : h1;
  }
  // Eight heads: the second n-tile, heads 4 + (g >> 1). The loop above is not shared through a lambda: that
  // changed the split formats' main-loop register allocation in the four-head kernels.
  // Sixteen heads: heads 8 + g.
  std::uint32_t qb1[C::kQ2 ? 8 : 1][2];
  if constexpr (C::kQ2) {
    constexpr int kH1 = C::kHG16 ? 8 : 4;
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      const int d0 = NSEG == 2 ? 64 * (kt >> 2) + 16 * t4 + 4 * (kt & 3) : 32 * t4 + 4 * kt;
      std::uint32_t h0 = 0, l0 = 0, h1 = 0, l1 = 0;
      if (kH1 + hq < G) {
        const float4 v = reinterpret_cast<const float4*>(qs + (kH1 + hq) * D)[qs_chunk(d0 >> 2)];
        split2<false>(v.x, v.y, h0, l0);
        split2<false>(v.z, v.w, h1, l1);
      }
      qb1[kt][0] = lo_col ? l0 : h0;
      qb1[kt][1] = lo_col ? l1 : h1;
    }
  }
  // Early sends: the rotated query is dead once every warp has its B fragments, so the partner may send into it.
  // The test hook holds the odd ranks here too, so that the partner's rows land while their loop is still to run.
  if (clus && early_sends<C>(p, a, sbase)) {
    __syncthreads();
    ep_arm<C>(sbase, split, G, tid);
    if (p.test_send_delay_ns > 0 && (split & 1)) spin_at_least_ns(static_cast<unsigned>(p.test_send_delay_ns));
  }
  const std::uint32_t L4 = static_cast<std::uint32_t>(lane) << 2;
  const std::uint32_t lut1_s = lut_s + static_cast<std::uint32_t>(C::LUT_ALIGN);  // split: segment 1's table
  // Table address of entry 0 for this lane (kKeyWin: XK column A, XK | 128 column B of the key table)
  const std::uint32_t XK = lut_s | L4, XV = lut_s | 128u | L4;
  const std::uint32_t XK1 = lut1_s | L4, XV1 = lut1_s | 128u | L4;
  // P transpose scratch of this warp (per segment 128 words): word 32 c + 8 h + 2 (x & 3) + (x >> 2) holds part c
  // (0 / 1: the fp16-rounded P of tokens x, x + 8 / x + 16, x + 24; 2 / 3: their residuals) of head h, written
  // by lane (g = x, t4 = h) with 4 conflict-free 32-bit stores at immediate offsets. A lane's two B registers
  // of one k-block (tokens t4, t4 + 8 from lane t4 and t4 + 4, t4 + 12 from lane t4 + 4) are then adjacent:
  // one 8-byte load gives the register pair the mma reads (no copies into pairs), 2 wavefronts per load.
  std::uint8_t* const scr = lut + C::LUT_BYTES + C::Q_BYTES + static_cast<std::size_t>(w) * C::SCR_WARP;
  std::uint32_t* const scr_st = reinterpret_cast<std::uint32_t*>(scr) + 8 * t4 + 2 * (g & 3) + (g >> 2);
  const uint2* const scr_ld = reinterpret_cast<const uint2*>(scr + 4 * (64 * (g & 1) + 8 * hq + 2 * t4));
  // Sixteen heads (per segment 256 words): p16_word(kk, h, x) = ((16 kk + h) 8 + 2 (x & 3) + (x >> 2)) ^ 8 ((h >> 2) & 1)
  // holds the fp16 P pair of head h, tokens x + 16 kk and x + 16 kk + 8, written by lane (g = x) among whose heads h is.
  // A lane's B registers of n-tile u, k-block kk (head 8 u + g; tokens t4 + 16 kk (+ 8) from lane t4, t4 + 4 + 16 kk
  // (+ 8) from lane t4 + 4) are then adjacent: one 8-byte load, 32 banks per half-warp phase. The XOR term puts the
  // stores of lanes t4 and t4 + 2 (heads 2 t4 + c mod 4 equal) in different bank groups: one wavefront per store.
  std::uint32_t* const scr16_st0 = reinterpret_cast<std::uint32_t*>(scr) + 16 * t4 + 2 * (g & 3) + (g >> 2) + 8 * (t4 >> 1);
  std::uint32_t* const scr16_st1 = reinterpret_cast<std::uint32_t*>(scr) + 16 * t4 + 2 * (g & 3) + (g >> 2) + 8 * (1 - (t4 >> 1));
  const uint2* const scr16_ld = reinterpret_cast<const uint2*>(scr + 4 * ((8 * g + 2 * t4) ^ (8 * ((g >> 2) & 1))));
  // The lane's 8 value bytes in a 64-byte row (kSwzV): rows p0 / p1 of the PV loads have row bit 1 = t4 bit 1.
  const int vofs = C::kSwzV ? (8 * g) ^ ((t4 & 2) << 4) : 8 * g;
  // Metadata of 6-byte tokens: the lane's tokens g + 8 j start 2 bytes into a word where g is odd.
  const unsigned msel0 = (g & 1) ? 0x5432u : 0x3210u, msel1 = (g & 1) ? 0x7676u : 0x5454u;

  // o[mt]: rows g / g + 8 = dims 16 g + 2 mt / + 1 (split: 64 (mt / 4) + 8 g + 2 (mt % 4) / + 1), columns 2 t4 / 2 t4 + 1 = head t4 from the rounded P /
  // its residual: everything a lane accumulates belongs to head t4.
  float o[8][4];
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0;
  float m_run = -INFINITY, l_run = 0, z_run = 0;
  float w_run = 0;  // 4-bit uniform values: sum of P times the value scale (the magic numbers' offsets, below)
  float m_run1 = -INFINITY, l_run1 = 0, z_run1 = 0, w_run1 = 0;  // eight heads: head t4 + 4
  // Sixteen heads: the lane's heads e = 0..3 are hd16(e) = 2 t4 + (e & 1) + 8 (e >> 1): softmax state per e, and
  // o1 the outputs of heads 8-15 (o: heads 0-7; column 2 t4 + c of either is head 2 t4 + c (+ 8)).
  constexpr int NE16 = C::kHG16 ? 4 : 1;
  float m16[NE16], l16[NE16], z16[NE16], w16[NE16];
#pragma unroll
  for (int e = 0; e < NE16; ++e) m16[e] = -INFINITY, l16[e] = 0.0f, z16[e] = 0.0f, w16[e] = 0.0f;
  float o1[C::kHG16 ? 8 : 1][4];
#pragma unroll
  for (int i = 0; i < (C::kHG16 ? 8 : 1); ++i) o1[i][0] = o1[i][1] = o1[i][2] = o1[i][3] = 0;
  auto hd16 = [&](int e) { return 2 * t4 + (e & 1) + 8 * (e >> 1); };

#pragma unroll C::UNROLL
  for (int i = 0; i < nloc; ++i) {
    // chunk i's keys and metadata have landed (kSplitGroups: its values may still be in flight)
    const int slot_i = slot_rd;
    if constexpr (kBulk) mbar_wait_parity(mbar_of(slot_i), (phase >> slot_i) & 1u);
    else cp_async_wait<kSplitGroups ? 2 * C::NST - 3 : C::NST - 2>();
    __syncwarp();
    issue_or_skip(i + C::NST - 1 < nloc, slot_wr, page_next);  // into the slot read last iteration
    page_next = page_of(i + C::NST);  // used next iteration: the load's latency is hidden
    const std::uint8_t* st = my_stages + slot_rd * C::STAGE_BYTES;
    slot_wr = slot_rd;
    slot_rd = slot_rd + 1 == C::NST ? 0 : slot_rd + 1;
    const std::uint8_t* sk = st;
    const std::uint8_t* sv = st + kChunk * C::KCB;
    const std::uint8_t* smeta = sv + kChunk * C::VCB;
    const int pos0 = (cb + w + i * C::WARPS) * kChunk;
    const bool full = pos0 >= lo && pos0 + kChunk <= hi;

    // ---- scores: keys as A (m-tile mt, rows g / g + 8 = tokens 16 mt + g / + 8), query as B ----
    // The lane's tokens are g + 8 j (j = 2 mt + row half); it gets their scores for head t4.
    float sc[4], vsc[NSEG][4], vz[4];
    float sc1[4];  // eight heads: head t4 + 4
    float s16[NE16][4];  // sixteen heads: [lane head e][token g + 8 j]
    if constexpr (NSEG == 2) {
      // Per segment s: the lane's run of codes (dims 16 t4 .. 16 t4 + 15 of the segment: 2 kb(s) bytes at
      // kcoff(s) + 2 kb(s) t4) of each of its 4 tokens, 4 k-tiles, own accumulators.
      float acc[2][2][4], acc1[2][2][4];
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          acc[s][mt][0] = acc[s][mt][1] = acc[s][mt][2] = acc[s][mt][3] = 0;
          acc1[s][mt][0] = acc1[s][mt][1] = acc1[s][mt][2] = acc1[s][mt][3] = 0;
        }
      auto segment = [&](auto seg) {
        constexpr int sg = decltype(seg)::value, KBs = C::kb(sg);
        std::uint32_t wv[4][2];
#pragma unroll
        for (int j = 0; j < 4; ++j) load_run<2 * KBs>(sk + (g + 8 * j) * C::KCB, C::kcoff(sg) + 2 * KBs * t4, wv[j]);
        if constexpr (C::kQ2)
          tq_keys_mma<2 * KBs, 4, 2, 2>(wv, sg == 0 ? XK : XK1, qb + 4 * sg, acc[sg], qb1 + 4 * sg, acc1[sg]);
        else
          tq_keys_mma<2 * KBs, 4>(wv, sg == 0 ? XK : XK1, qb + 4 * sg, acc[sg]);
      };
      segment(std::integral_constant<int, 0>{});
      segment(std::integral_constant<int, 1>{});
      // Metadata [token][4 x fp16]: key norms of segments 0, 1, value norms of segments 0, 1.
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint2 x = *reinterpret_cast<const uint2*>(smeta + (g + 8 * j) * 8);
        const float2 kn = __half22float2(*reinterpret_cast<const __half2*>(&x.x));
        const float2 vn = __half22float2(*reinterpret_cast<const __half2*>(&x.y));
        const int mt = j >> 1, r = 2 * (j & 1);
        sc[j] = (acc[0][mt][r] + acc[0][mt][r + 1]) * kn.x + (acc[1][mt][r] + acc[1][mt][r + 1]) * kn.y;
        if constexpr (C::kHG8)
          sc1[j] = (acc1[0][mt][r] + acc1[0][mt][r + 1]) * kn.x + (acc1[1][mt][r] + acc1[1][mt][r + 1]) * kn.y;
        if constexpr (C::kHG16) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float(&ae)[2][2][4] = e < 2 ? acc : acc1;
            s16[e][j] = ae[0][mt][r + (e & 1)] * kn.x + ae[1][mt][r + (e & 1)] * kn.y;
          }
        }
        vsc[0][j] = vn.x;
        vsc[1][j] = vn.y;
        vz[j] = 0.0f;
      }
    } else {
    float acc[2][4], acc1[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0;
      acc1[mt][0] = acc1[mt][1] = acc1[mt][2] = acc1[mt][3] = 0;
    }
    if constexpr (C::KC == KeyCode::kTq) {
      constexpr int NB = 32 * C::KB, NW = NB / 32, FW = 2 * C::KB;
      std::uint32_t wv[4][NW];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::uint8_t* src = sk + (g + 8 * j) * C::KCB + t4 * (NB / 8);
        if constexpr (NW == 4) {
          const uint4 v = *reinterpret_cast<const uint4*>(src);
          wv[j][0] = v.x;
          wv[j][1] = v.y;
          wv[j][2] = v.z;
          wv[j][3] = v.w;
        } else {
#pragma unroll
          for (int k = 0; k < NW; ++k) wv[j][k] = reinterpret_cast<const std::uint32_t*>(src)[k];
        }
      }
      if constexpr (C::kQ2)
        tq_keys_mma<FW, 8, NW, 2, C::kKeyWin>(wv, XK, qb, acc, qb1, acc1);
      else
        tq_keys_mma<FW, 8, NW, 1, C::kKeyWin>(wv, XK, qb, acc);
    } else {  // fp8 keys: 32 bytes per lane and token
      std::uint32_t wv[4][8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4* src = reinterpret_cast<const uint4*>(sk + (g + 8 * j) * C::KCB + t4 * 32);
        const uint4 v0 = src[0], v1 = src[1];
        wv[j][0] = v0.x;
        wv[j][1] = v0.y;
        wv[j][2] = v0.z;
        wv[j][3] = v0.w;
        wv[j][4] = v1.x;
        wv[j][5] = v1.y;
        wv[j][6] = v1.z;
        wv[j][7] = v1.w;
      }
#pragma unroll
      for (int kt = 0; kt < 8; ++kt) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const std::uint32_t x0 = wv[2 * mt][kt], x1 = wv[2 * mt + 1][kt];
          const std::uint32_t a[4] = {fp8x2_half_to_half2<0>(x0), fp8x2_half_to_half2<0>(x1), fp8x2_half_to_half2<1>(x0),
                                      fp8x2_half_to_half2<1>(x1)};
          mma16816<false>(acc[mt], a, qb[kt][0], qb[kt][1]);
          if constexpr (C::kQ2) mma16816<false>(acc1[mt], a, qb1[kt][0], qb1[kt][1]);
        }
      }
    }

    // Metadata of the lane's tokens g + 8 j: key norm (TurboQuant keys), value scale or norm, value zero
    // (uniform values), as 16-bit units [token][MB / 2].
    float kn[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      kn[j] = 1.0f;
      vz[j] = 0.0f;
      if constexpr (C::MB == 4) {
        const std::uint32_t x = *reinterpret_cast<const std::uint32_t*>(smeta + (g + 8 * j) * 4);
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&x));
        if constexpr (C::KMB == 2) {
          kn[j] = f.x;
          vsc[0][j] = f.y;
        } else {
          vsc[0][j] = f.x;
          vz[j] = f.y;
        }
      } else {
        static_assert(C::MB == 6 && C::KMB == 2, "fast decode: metadata layout");
        const std::uint32_t* wp = reinterpret_cast<const std::uint32_t*>(smeta + (g + 8 * j) * 6 - 2 * (g & 1));
        const std::uint32_t w0 = wp[0], w1 = wp[1];
        const std::uint32_t x = __byte_perm(w0, w1, msel0), y = __byte_perm(w0, w1, msel1);
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&x));
        kn[j] = f.x;
        vsc[0][j] = f.y;
        vz[j] = __half2float(__ushort_as_half(static_cast<unsigned short>(y & 0xffffu)));
      }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      sc[2 * mt] = acc[mt][0] + acc[mt][1];
      sc[2 * mt + 1] = acc[mt][2] + acc[mt][3];
      if constexpr (C::kHG8) {
        sc1[2 * mt] = acc1[mt][0] + acc1[mt][1];
        sc1[2 * mt + 1] = acc1[mt][2] + acc1[mt][3];
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (C::KC == KeyCode::kTq) {
        sc[j] *= kn[j];
        if constexpr (C::kHG8) sc1[j] *= kn[j];
      }
    }
    if constexpr (C::kHG16) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float(&ae)[2][4] = e < 2 ? acc : acc1;
          const float x = ae[j >> 1][2 * (j & 1) + (e & 1)];
          s16[e][j] = C::KC == KeyCode::kTq ? x * kn[j] : x;
        }
    }
    }  // NSEG == 1
    if (!full) {  // warp-uniform: only the first and last chunk of a range can be partial
      // Slots outside the range hold whatever the pool held (NaN patterns too): their score is
      // masked and their value scale and zero set to 0, so that p = 0 multiplies finite numbers.
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int x = pos0 + g + 8 * j;
        if (x < lo || x >= hi) {
          sc[j] = -INFINITY;
          sc1[j] = -INFINITY;
#pragma unroll
          for (int e = 0; e < NE16; ++e) s16[e][j] = -INFINITY;
          vz[j] = 0.0f;
#pragma unroll
          for (int s = 0; s < NSEG; ++s) vsc[s][j] = 0.0f;
        }
      }
    }

    if constexpr (!C::kHG16) {
    // ---- online softmax (log2 domain) of head t4 over the 8 lanes t4, t4 + 4, ... ----
    // The head's maximum moves only when one of its scores exceeds the running one, which gets rarer chunk by chunk
    // (on random rows 1 - (1 - 1/i)^4 in a warp's chunk i for its four heads: 48% of the chunks at 16 per warp, as
    // measured at 8 x 16K; docs/kernels.md, "Open"; a sink token holding the maximum makes it rarer). A vote finds
    // whether any lane has such a score; only then is the maximum reduced over the head's lanes (three shuffles) and
    // the accumulators rescaled. Otherwise the new maximum is the running one exactly and the skipped factors would
    // be ex2(0) = 1: the arithmetic of the reduction in every chunk.
    float mx = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
    float mx1 = C::kHG8 ? fmaxf(fmaxf(sc1[0], sc1[1]), fmaxf(sc1[2], sc1[3])) : -INFINITY;  // eight heads: head t4 + 4
    float alpha = 1.0f, alpha1 = 1.0f;
    const bool moved = __any_sync(0xffffffffu, mx > m_run || mx1 > m_run1);
    if (moved) {
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(m_run, mx);
      // ex2.approx.ftz: the MUFU alone (exp2f adds a rescale for results below 2^-126, weights that
      // do not matter next to the maximum's 1); ex2(-inf) = 0.
      alpha = ex2(m_run - (m_new == -INFINITY ? 0.0f : m_new));
      m_run = m_new;
      // Head t4 + 4, written out: with one inline function for both heads, ptxas rescheduled most of the eight-head
      // kernels' code (not measured), while this form is the one measured and tested.
      if constexpr (C::kHG8) {
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 4));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 8));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 16));
        const float m_new1 = fmaxf(m_run1, mx1);
        alpha1 = ex2(m_run1 - (m_new1 == -INFINITY ? 0.0f : m_new1));
        m_run1 = m_new1;
      }
    }
    const float m_use = m_run == -INFINITY ? 0.0f : m_run;
    float psum = 0, zsum = 0, pv[NSEG][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float pj = ex2(sc[j] - m_use);
      psum += pj;
#pragma unroll
      for (int s = 0; s < NSEG; ++s) pv[s][j] = pj * vsc[s][j];
      if constexpr (C::VC == ValueCode::kUniform) zsum += pj * vz[j];
    }
    z_run = z_run * alpha + zsum;
    l_run = l_run * alpha + psum;
    // Eight heads: PV's B values are fp16-rounded without a residual column, so the offsets' sum is
    // taken over the rounded values.
    if constexpr (C::kHG8) {
#pragma unroll
      for (int s = 0; s < NSEG; ++s)
#pragma unroll
        for (int j = 0; j < 4; ++j) pv[s][j] = round_elt<false>(pv[s][j]);
    }
    if constexpr (C::kMagicV) w_run = w_run * alpha + ((pv[0][0] + pv[0][1]) + (pv[0][2] + pv[0][3]));
    // Eight heads: the same for head t4 + 4 (columns 2 t4 + 1 of PV). Written out rather than shared with
    // the step above through a function: that sharing changed the register allocation of the four-head
    // kernels' loops.
    float pv1[NSEG][4];
    if constexpr (C::kHG8) {
      const float m_use1 = m_run1 == -INFINITY ? 0.0f : m_run1;
      float psum1 = 0, zsum1 = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float pj = ex2(sc1[j] - m_use1);
        psum1 += pj;
#pragma unroll
        for (int s = 0; s < NSEG; ++s) pv1[s][j] = round_elt<false>(pj * vsc[s][j]);
        if constexpr (C::VC == ValueCode::kUniform) zsum1 += pj * vz[j];
      }
      z_run1 = z_run1 * alpha1 + zsum1;
      l_run1 = l_run1 * alpha1 + psum1;
      if constexpr (C::kMagicV) w_run1 = w_run1 * alpha1 + ((pv1[0][0] + pv1[0][1]) + (pv1[0][2] + pv1[0][3]));
    }
    if (moved) {  // the accumulators to the new maxima (here, where the scores are no longer live)
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        o[n][0] *= alpha;
        o[n][1] *= C::kHG8 ? alpha1 : alpha;
        o[n][2] *= alpha;
        o[n][3] *= C::kHG8 ? alpha1 : alpha;
      }
    }
    // ---- P (times the value scale; per segment for the split) to the B layout of PV through the scratch ----
#pragma unroll
    for (int s = 0; s < NSEG; ++s) {
      if constexpr (C::kHG8) {  // parts 2 / 3: head t4 + 4 instead of the residuals (all values rounded above)
        scr_st[128 * s] = pack2<false>(pv[s][0], pv[s][1]);
        scr_st[128 * s + 32] = pack2<false>(pv[s][2], pv[s][3]);
        scr_st[128 * s + 64] = pack2<false>(pv1[s][0], pv1[s][1]);
        scr_st[128 * s + 96] = pack2<false>(pv1[s][2], pv1[s][3]);
      } else {
        std::uint32_t h01, l01, h23, l23;
        split2<false>(pv[s][0], pv[s][1], h01, l01);
        split2<false>(pv[s][2], pv[s][3], h23, l23);
        scr_st[128 * s] = h01;  // segment s: + 512 s bytes
        scr_st[128 * s + 32] = h23;
        scr_st[128 * s + 64] = l01;
        scr_st[128 * s + 96] = l23;
      }
    }
    } else {
      // ---- sixteen heads: the online softmax of the lane's four heads, as above per head ----
      float alpha16[4] = {1.0f, 1.0f, 1.0f, 1.0f}, mx16[4];
      bool up = false;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        mx16[e] = fmaxf(fmaxf(s16[e][0], s16[e][1]), fmaxf(s16[e][2], s16[e][3]));
        up = up || mx16[e] > m16[e];
      }
      const bool moved = __any_sync(0xffffffffu, up);
      if (moved) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float mx = mx16[e];
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
          const float m_new = fmaxf(m16[e], mx);
          alpha16[e] = ex2(m16[e] - (m_new == -INFINITY ? 0.0f : m_new));
          m16[e] = m_new;
        }
      }
      float pv16[NSEG][4][4];  // [segment][lane head e][token g + 8 j], rounded to fp16
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float m_use = m16[e] == -INFINITY ? 0.0f : m16[e];
        float psum = 0, zsum = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float pj = ex2(s16[e][j] - m_use);
          psum += pj;
#pragma unroll
          for (int s = 0; s < NSEG; ++s) pv16[s][e][j] = round_elt<false>(pj * vsc[s][j]);
          if constexpr (C::VC == ValueCode::kUniform) zsum += pj * vz[j];
        }
        z16[e] = z16[e] * alpha16[e] + zsum;
        l16[e] = l16[e] * alpha16[e] + psum;
        if constexpr (C::kMagicV)
          w16[e] = w16[e] * alpha16[e] + ((pv16[0][e][0] + pv16[0][e][1]) + (pv16[0][e][2] + pv16[0][e][3]));
      }
      if (moved) {
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          o[n][0] *= alpha16[0];
          o[n][1] *= alpha16[1];
          o[n][2] *= alpha16[0];
          o[n][3] *= alpha16[1];
          o1[n][0] *= alpha16[2];
          o1[n][1] *= alpha16[3];
          o1[n][2] *= alpha16[2];
          o1[n][3] *= alpha16[3];
        }
      }
      // P to the B layout of PV (p16_word): per segment, k-block kk and lane head e, the fp16 pair of tokens
      // g + 16 kk, g + 16 kk + 8.
#pragma unroll
      for (int s = 0; s < NSEG; ++s)
#pragma unroll
        for (int kk = 0; kk < 2; ++kk)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            (e & 1 ? scr16_st1 : scr16_st0)[256 * s + 128 * kk + 64 * (e >> 1)] =
                pack2<false>(pv16[s][e][2 * kk], pv16[s][e][2 * kk + 1]);
    }
    if constexpr (kSplitGroups) {  // chunk i's values have landed (the syncwarp below)
      if constexpr (kBulk) mbar_wait_parity(mbar_of(slot_i) + 8, (phase >> slot_i) & 1u);
      else cp_async_wait<2 * C::NST - 2>();
    }
    if constexpr (kBulk) phase ^= 1u << slot_i;
    __syncwarp();
    uint2 bk[NSEG][2];  // [segment][k-block]
    uint2 bk1[NSEG][2];  // sixteen heads: n-tile 1 (heads 8-15); bk is n-tile 0
#pragma unroll
    for (int s = 0; s < NSEG; ++s) {
      if constexpr (C::kHG16) {
        bk[s][0] = scr16_ld[128 * s];
        bk[s][1] = scr16_ld[128 * s + 64];
        bk1[s][0] = scr16_ld[128 * s + 32];
        bk1[s][1] = scr16_ld[128 * s + 96];
      } else {
        bk[s][0] = scr_ld[64 * s];
        bk[s][1] = scr_ld[64 * s + 16];
      }
    }

    // ---- P V: values as A (16 dims x 16 tokens), P as B ----
    // k pairs of k-block kk: 2 t4 / 2 t4 + 1 = tokens 16 kk + t4 / + 8, 2 t4 + 8 / + 9 = 16 kk + t4 + 4 / + 12.
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      std::uint32_t bfr[NSEG][2], bfr1[NSEG][2];
#pragma unroll
      for (int s = 0; s < NSEG; ++s) {
        bfr[s][0] = bk[s][kk].x;
        bfr[s][1] = bk[s][kk].y;
        if constexpr (C::kHG16) {
          bfr1[s][0] = bk1[s][kk].x;
          bfr1[s][1] = bk1[s][kk].y;
        }
      }
      std::uint32_t areg[2][16];  // [token pair][dim j of the lane's 16]
#pragma unroll
      for (int tp = 0; tp < 2; ++tp) {
        const int p0 = 16 * kk + 4 * tp + t4, p1 = p0 + 8;
        if constexpr (NSEG == 2) {
          // Split: j = 8 s + jj is dim 64 s + 8 g + jj (segment s's dims 8 g .. 8 g + 7: vb(s) bytes at
          // vcoff(s) + vb(s) g). Pair fields c_a | c_b << b, even dims from E, odd dims from O.
#pragma unroll
          for (int s = 0; s < 2; ++s) {
            constexpr int VB0 = C::vb(0), VB1 = C::vb(1);
            const int bs = s == 0 ? VB0 : VB1;
            const std::uint32_t xv = s == 0 ? XV : XV1;
            std::uint32_t ra[2], rb[2];
            if (s == 0) {
              load_run<VB0>(sv + p0 * C::VCB, C::vcoff(0) + VB0 * g, ra);
              load_run<VB0>(sv + p1 * C::VCB, C::vcoff(0) + VB0 * g, rb);
            } else {
              load_run<VB1>(sv + p0 * C::VCB, C::vcoff(1) + VB1 * g, ra);
              load_run<VB1>(sv + p1 * C::VCB, C::vcoff(1) + VB1 * g, rb);
            }
            const std::uint32_t A = ra[0], B = rb[0];
            if (bs == 4) {
              const std::uint32_t E = (A & 0x0f0f0f0fu) | ((B << 4) & 0xf0f0f0f0u);
              const std::uint32_t O = ((A >> 4) & 0x0f0f0f0fu) | (B & 0xf0f0f0f0u);
#pragma unroll
              for (int k = 0; k < 4; ++k) {
                const unsigned sel = 0x7604u | (static_cast<unsigned>(k) << 4);
                areg[tp][8 * s + 2 * k] = lds_u32(__byte_perm(E, xv, sel));
                areg[tp][8 * s + 2 * k + 1] = lds_u32(__byte_perm(O, xv, sel));
              }
            } else {
              const std::uint32_t m1 = (1u << bs) - 1u;
              const std::uint32_t Me = m1 | (m1 << (2 * bs)) | (m1 << (4 * bs)) | (m1 << (6 * bs));  // dims 2 m
              const std::uint32_t E = (A & Me) | ((B << bs) & (Me << bs));
              const std::uint32_t O = ((A >> bs) & Me) | (B & (Me << bs));
#pragma unroll
              for (int jj = 0; jj < 8; ++jj) {
                const int f = 2 * bs * (jj >> 1);
                const std::uint32_t X = (jj & 1) ? O : E;
                const std::uint32_t x = f >= 8 ? X >> (f - 8) : X << (8 - f);
                areg[tp][8 * s + jj] = lds_u32((x & (((1u << (2 * bs)) - 1u) << 8)) | xv);
              }
            }
          }
        } else if constexpr (C::kMagicV && C::VB == 3) {
          // 3-bit uniform values as fp16 magic numbers, 1024 + c 2^p (see magic_p; the merge takes the
          // offset and scale out). The lane's 48 bits (dims 16 g .. 16 g + 15) of each token, realigned:
          // r0 = bytes 0-3, r1 = bytes 2-5. A PRMT puts a two-byte window of token a in the low half and
          // the same window of token b in the high half; every field then lies in bits p .. p + 2 <= 9 of its
          // window, one LOP3 (mask | magic) per register.
          const int bo = 6 * g, ba = bo & ~3, sh = (bo & 3) * 8;
          const std::uint32_t* pa = reinterpret_cast<const std::uint32_t*>(sv + p0 * C::VCB + ba);
          const std::uint32_t* pb = reinterpret_cast<const std::uint32_t*>(sv + p1 * C::VCB + ba);
          const std::uint32_t a0 = __funnelshift_rc(pa[0], pa[1], sh), a1 = __funnelshift_rc(pa[0], pa[1], sh + 16);
          const std::uint32_t b0 = __funnelshift_rc(pb[0], pb[1], sh), b1 = __funnelshift_rc(pb[0], pb[1], sh + 16);
          // windows at bytes 0, 1, 2 (from r0) and 3, 4, 5 (bytes 1, 2, 3 of r1; only byte 5 is needed)
          const std::uint32_t win[6] = {__byte_perm(a0, b0, 0x5410u), __byte_perm(a0, b0, 0x6521u), __byte_perm(a0, b0, 0x7632u),
                                        __byte_perm(a1, b1, 0x6521u), __byte_perm(a1, b1, 0x7632u), __byte_perm(a1, b1, 0x7733u)};
          // dim j: the field at bit 3 j of the run, i.e. bit magic_p(j) = 3 j mod 8 of window 3 j / 8
          [&]<int... J>(std::integer_sequence<int, J...>) {
            ((areg[tp][J] = and_or<(0x00070007u << C::magic_p(J))>(win[(3 * J) / 8], C::kMagic)), ...);
          }(std::make_integer_sequence<int, 16>{});
        } else if constexpr (C::kMagicV) {
          // (c_a, c_b) as fp16 with an offset: low nibble | 0x6400 = 1024 + c (even dims, rows g),
          // high nibble | 0x6400 = 1024 + 16 c (odd dims, rows g + 8). The offsets stay in the products; the
          // merge takes them out once (1024 w_run, w_run = sum of the B operand's P) and scales rows g + 8 by
          // 1/16 (exact: the products, sums and offsets of those rows are 16 x those of 64 + c), instead of
          // two half subtractions per pair here. One LOP3 per register (and_or: the magic in a register;
          // written in C, each took two LOP3s, 66 more instructions per chunk). Both nibbles use the
          // same magic, so one register holds it.
          const uint2 va = *reinterpret_cast<const uint2*>(sv + p0 * C::VCB + vofs);
          const uint2 vb = *reinterpret_cast<const uint2*>(sv + p1 * C::VCB + vofs);
          const std::uint32_t wa[2] = {va.x, va.y}, wb[2] = {vb.x, vb.y};
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const unsigned sel = static_cast<unsigned>(k | (k << 4) | ((4 + k) << 8) | ((4 + k) << 12));
              const std::uint32_t t = __byte_perm(wa[h], wb[h], sel);
              areg[tp][8 * h + 2 * k] = and_or<0x000f000fu>(t, C::kMagic);
              areg[tp][8 * h + 2 * k + 1] = and_or<0x00f000f0u>(t, C::kMagic);
            }
          }
        } else if constexpr (C::VB == 4) {
          const uint2 va = *reinterpret_cast<const uint2*>(sv + p0 * C::VCB + vofs);
          const uint2 vb = *reinterpret_cast<const uint2*>(sv + p1 * C::VCB + vofs);
          const std::uint32_t wa[2] = {va.x, va.y}, wb[2] = {vb.x, vb.y};
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const std::uint32_t E = (wa[h] & 0x0f0f0f0fu) | ((wb[h] << 4) & 0xf0f0f0f0u);
            const std::uint32_t O = ((wa[h] >> 4) & 0x0f0f0f0fu) | (wb[h] & 0xf0f0f0f0u);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const unsigned sel = 0x7604u | (static_cast<unsigned>(k) << 4);
              areg[tp][8 * h + 2 * k] = lds_u32(__byte_perm(E, XV, sel));
              areg[tp][8 * h + 2 * k + 1] = lds_u32(__byte_perm(O, XV, sel));
            }
          }
        } else if constexpr (C::kValWin) {
          // 3-bit TurboQuant values through the key table's byte windows (kValWin): the lane's 48 bits (dims
          // 16 g .. 16 g + 15) of tokens a = p0 and b = p1, aligned to bit 0, merged into the even and odd dims'
          // runs of pair fields (value_pair_runs, key_windows.hpp), whose pair m lies where a key run's does: per
          // register a PRMT of the byte key_window(m) names (run or copy shifted right by 4) and an LDS.
          const int bo = 6 * g, ba = bo & ~3, sh = (bo & 3) * 8;
          const std::uint32_t* pa = reinterpret_cast<const std::uint32_t*>(sv + p0 * C::VCB + ba);
          const std::uint32_t* pb = reinterpret_cast<const std::uint32_t*>(sv + p1 * C::VCB + ba);
          const ValuePairRuns r = value_pair_runs(__funnelshift_r(pa[0], pa[1], sh), pa[1] >> sh,
                                                  __funnelshift_r(pb[0], pb[1], sh), pb[1] >> sh);
          std::uint32_t es[2], os[2];
          shifted_by_4(r.e, es);
          shifted_by_4(r.o, os);
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const KeyWindow kw = key_window(j >> 1);
            const std::uint32_t* run = (j & 1) ? (kw.shifted ? os : r.o) : (kw.shifted ? es : r.e);
            areg[tp][j] = lds_u32(window_addr(run[kw.word], kw, XK));
          }
        } else {  // 3-bit: 48 bits at byte 6 g
          const int bo = 6 * g, ba = bo & ~3, sh = (bo & 3) * 8;
          const std::uint32_t* pa = reinterpret_cast<const std::uint32_t*>(sv + p0 * C::VCB + ba);
          const std::uint32_t* pb = reinterpret_cast<const std::uint32_t*>(sv + p1 * C::VCB + ba);
          const std::uint64_t A = (static_cast<std::uint64_t>(pa[1]) << 32 | pa[0]) >> sh;
          const std::uint64_t Bv = (static_cast<std::uint64_t>(pb[1]) << 32 | pb[0]) >> sh;
          // 6-bit pair fields c_a | c_b << 3: even dims j at bit 3 j of E, odd dims at 3 (j - 1) of O.
          constexpr std::uint64_t Me = 0x1c71c71c71c7ull;   // bits 6m .. 6m + 2, m = 0..7
          const std::uint64_t E = (A & Me) | ((Bv << 3) & (Me << 3));
          const std::uint64_t O = ((A >> 3) & Me) | (Bv & (Me << 3));
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const int f = 3 * (j & ~1);
            const std::uint64_t X = (j & 1) ? O : E;
            const std::uint32_t x = f >= 8 ? static_cast<std::uint32_t>(X >> (f - 8)) : static_cast<std::uint32_t>(X << (8 - f));
            areg[tp][j] = lds_u32((x & 0x3f00u) | XV);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < 8; ++mt) {
        const std::uint32_t a[4] = {areg[0][2 * mt], areg[0][2 * mt + 1], areg[1][2 * mt], areg[1][2 * mt + 1]};
        const int s = NSEG == 2 ? mt >> 2 : 0;  // split: m-tiles 0-3 segment 0, 4-7 segment 1
        mma16816<false>(o[mt], a, bfr[s][0], bfr[s][1]);
        if constexpr (C::kHG16) mma16816<false>(o1[mt], a, bfr1[s][0], bfr1[s][1]);
      }
    }
  }
  if constexpr (kBulk) {
    // Every copy issued was waited for in the loop; the stages' mbarriers end before the merge reuses the memory.
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < C::NST; ++s) {
        mbar_inval(mbar_of(s));
        if constexpr (kSplitGroups) mbar_inval(mbar_of(s) + 8);
      }
    }
  } else {
    cp_async_wait<0>();
  }

  // ---- merge: rounded + residual columns, the lanes of a head, then the warps through shared memory ----
#pragma unroll
  for (int s = 4; s < 32; s <<= 1) {
    l_run += __shfl_xor_sync(0xffffffffu, l_run, s);
    z_run += __shfl_xor_sync(0xffffffffu, z_run, s);
    if constexpr (C::kMagicV) w_run += __shfl_xor_sync(0xffffffffu, w_run, s);
    if constexpr (C::kHG8) {
      l_run1 += __shfl_xor_sync(0xffffffffu, l_run1, s);
      z_run1 += __shfl_xor_sync(0xffffffffu, z_run1, s);
      if constexpr (C::kMagicV) w_run1 += __shfl_xor_sync(0xffffffffu, w_run1, s);
    }
    if constexpr (C::kHG16) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        l16[e] += __shfl_xor_sync(0xffffffffu, l16[e], s);
        z16[e] += __shfl_xor_sync(0xffffffffu, z16[e], s);
        if constexpr (C::kMagicV) w16[e] += __shfl_xor_sync(0xffffffffu, w16[e], s);
      }
    }
  }
  // Magic values: the offset (1024) out of the rows, and row j (1024 + c 2^p(j)) scaled by 2^-p(j). Both exact:
  // the products and sums of row j are 2^p(j) x those of 1024 2^-p(j) + c.
  const float off = C::kMagicV ? 1024.0f * w_run : 0.0f, off1 = C::kMagicV ? 1024.0f * w_run1 : 0.0f;
  auto unmagic = [](int j) { return C::kMagicV ? 1.0f / static_cast<float>(1 << C::magic_p(j)) : 1.0f; };
  // Each warp's softmax statistics of its heads go to its own P-transpose scratch (no other warp uses it
  // after the prologue), so no barrier is needed before they are written: slot h + HG (w & 1) holds
  // (max, sum, zero term) of head h, the slots of warps w and w + 1 in different bank groups.
  const float m_own = nloc > 0 ? m_run : -INFINITY, m_own1 = nloc > 0 ? m_run1 : -INFINITY;
  __syncwarp();  // the warp's last P-transpose loads from the scratch are done
  if (g == 0) {
    float4* const sl = reinterpret_cast<float4*>(scr) + C::HG * (w & 1);
    if constexpr (!C::kHG16) {
      if (t4 < G) sl[t4] = make_float4(m_own, l_run, z_run, 0.0f);
    }
    if constexpr (C::kHG8) {
      if (t4 + 4 < G) sl[t4 + 4] = make_float4(m_own1, l_run1, z_run1, 0.0f);
    }
    if constexpr (C::kHG16) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (hd16(e) < G) sl[hd16(e)] = make_float4(nloc > 0 ? m16[e] : -INFINITY, l16[e], z16[e], 0.0f);
    }
  }
  __syncthreads();  // every warp's statistics are written and its copies have landed (the rows overlap the stages)
  // Every warp computes the CTA's softmax of each of its lanes' heads from the statistics of all warps (lane g
  // reads warps g, g + 8), then its own weight c = 2^(m_own - M) / S, and scales its rows by it.
  float* const red = reinterpret_cast<float*>(smem_raw + C::red_off(lut_pad));
  std::uint8_t* const scr_all = lut + C::LUT_BYTES + C::Q_BYTES;  // warp ww's scratch at ww * SCR_WARP
  float* const zc_s = reinterpret_cast<float*>(scr_all + C::ZC_OFF);  // warp 0's scratch past its slots: [HG] constants
  auto weight = [&](int h, float mown, float& zc, float& lse) {
    float mi[2], li[2], zi[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int ww = g + 8 * k;
      if (ww < C::WARPS && h < G) {
        const float4 v = reinterpret_cast<const float4*>(scr_all + ww * C::SCR_WARP)[h + C::HG * (ww & 1)];
        mi[k] = v.x, li[k] = v.y, zi[k] = v.z;
      } else {
        mi[k] = -INFINITY, li[k] = 0.0f, zi[k] = 0.0f;
      }
    }
    float M = fmaxf(mi[0], mi[1]);
#pragma unroll
    for (int o2 = 4; o2 < 32; o2 <<= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o2));
    float S = 0.0f, Z = 0.0f;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float f = mi[k] == -INFINITY ? 0.0f : exp2f(mi[k] - M);
      S += f * li[k];
      Z += f * zi[k];
    }
#pragma unroll
    for (int o2 = 4; o2 < 32; o2 <<= 1) {
      S += __shfl_xor_sync(0xffffffffu, S, o2);
      Z += __shfl_xor_sync(0xffffffffu, Z, o2);
    }
    zc = S > 0 ? Z / S : 0.0f;
    lse = S > 0 ? M + log2f(S) : -INFINITY;
    return mown == -INFINITY || !(S > 0) ? 0.0f : exp2f(mown - M) / S;
  };
  if constexpr (C::kHG16) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = hd16(e);
      float zc, lse;
      const float c = weight(h, nloc > 0 ? m16[e] : -INFINITY, zc, lse);
      if (w == 0 && g == 0 && h < G) {
        zc_s[h] = zc;
        plse[static_cast<std::size_t>(h) * pst] = lse;
      }
      if (h < G) {
        float* rr = red + (w * C::HG + h) * C::RW;
        const float of = C::kMagicV ? 1024.0f * w16[e] : 0.0f;
        const float(&oe)[8][4] = e < 2 ? o : o1;
#pragma unroll
        for (int mt = 0; mt < 8; ++mt) {
          const int d = NSEG == 2 ? 64 * (mt >> 2) + 8 * g + 2 * (mt & 3) : 16 * g + 2 * mt;
          rr[d + (d >> 5)] = c * ((oe[mt][e & 1] - of) * unmagic(2 * mt));
          rr[d + 1 + (d >> 5)] = c * ((oe[mt][2 + (e & 1)] - of) * unmagic(2 * mt + 1));
        }
      }
    }
  } else {
    float zc, lse;
    const float c = weight(t4, m_own, zc, lse);
    if (w == 0 && g == 0 && t4 < G) {
      zc_s[t4] = zc;
      plse[static_cast<std::size_t>(t4) * pst] = lse;
    }
    float c1 = 0.0f;
    if constexpr (C::kHG8) {
      float zc1, lse1;
      c1 = weight(t4 + 4, m_own1, zc1, lse1);
      if (w == 0 && g == 0 && t4 + 4 < G) {
        zc_s[t4 + 4] = zc1;
        plse[static_cast<std::size_t>(t4 + 4) * pst] = lse1;
      }
    }
#pragma unroll
    for (int hh = 0; hh < (C::kHG8 ? 2 : 1); ++hh) {
      if (t4 + 4 * hh < G) {
        float* rr = red + (w * C::HG + t4 + 4 * hh) * C::RW;
        const float cc = hh ? c1 : c, of = hh ? off1 : off;
#pragma unroll
        for (int mt = 0; mt < 8; ++mt) {
          // dim of row g: 16 g + 2 mt (split: 64 (mt / 4) + 8 g + 2 (mt % 4)); row g + 8: the next one
          const int d = NSEG == 2 ? 64 * (mt >> 2) + 8 * g + 2 * (mt & 3) : 16 * g + 2 * mt;
          // Four heads: columns 2 t4 / 2 t4 + 1 are head t4's rounded P and its residual; eight heads: column
          // 2 t4 + hh is head t4 + 4 hh.
          const float x0 = C::kHG8 ? o[mt][hh] : o[mt][0] + o[mt][1];
          const float x1 = C::kHG8 ? o[mt][2 + hh] : o[mt][2] + o[mt][3];
          rr[d + (d >> 5)] = cc * ((x0 - of) * unmagic(2 * mt));
          rr[d + 1 + (d >> 5)] = cc * ((x1 - of) * unmagic(2 * mt + 1));
        }
      }
    }
  }
  __syncthreads();
  sum_warps<C>(red, zc_s, po, pst, G);
  if (p.protect.enabled() && blockIdx.x == 0) protected_rows<C, C::PMAXH>(p, a, NS, smem_raw);
  finish();
}

// (key code, key bits, value code, value bits, segment 1's key / value bits or 0) of the formats the
// fast kernel serves.
#define KVQ_FAST_FORMATS(X)                         \
  X(KeyCode::kFp8, 8, ValueCode::kUniform, 4, 0, 0) \
  X(KeyCode::kTq, 4, ValueCode::kUniform, 4, 0, 0)  \
  X(KeyCode::kTq, 3, ValueCode::kUniform, 4, 0, 0)  \
  X(KeyCode::kTq, 3, ValueCode::kUniform, 3, 0, 0)  \
  X(KeyCode::kTq, 4, ValueCode::kTq, 4, 0, 0)       \
  X(KeyCode::kTq, 3, ValueCode::kTq, 3, 0, 0)       \
  X(KeyCode::kTq, 4, ValueCode::kTq, 4, 3, 3)       \
  X(KeyCode::kTq, 3, ValueCode::kTq, 3, 2, 2)

// The kernel's lut_pad on this device (lut_pad_of: the dynamic shared memory starts after the per-block reserved
// bytes), or -1 where the device's facts are not available.
template <class C>
int fast_pad() {
  DeviceFacts dv;
  if (device_facts(dv) != cudaSuccess) return -1;
  const int reserved = dv.reserved_smem;
  return C::LUT_ALIGN > 0 ? (C::LUT_ALIGN - reserved % C::LUT_ALIGN) % C::LUT_ALIGN : 0;
}

// The launch's dynamic shared memory (0 where the format's page layout is not this kernel's).
template <class C>
int fast_smem(const DecodeParams& p) {
  const PageLayout& pg = p.fmt.page;
  if (pg.tokens != 64 || pg.key_code_bytes != static_cast<std::uint32_t>(C::KCB) ||
      pg.value_code_bytes != static_cast<std::uint32_t>(C::VCB) || pg.meta_bytes != static_cast<std::uint32_t>(C::MB) ||
      pg.key_meta_bytes != static_cast<std::uint32_t>(C::KMB) || (C::NSEG == 2 && p.fmt.seg_dims[0] != C::sd(0)))
    return 0;
  // Dynamic shared memory starts after the per-block reserved bytes (1 KB on sm_90; the kernel has no
  // static shared memory); the kernel checks the layout against the size it got and traps otherwise.
  const int pad = fast_pad<C>();
  if (pad < 0) return 0;
  const int smem = C::smem(pad);
  return smem > kSmemBudget + 2 * 1024 ? 0 : smem;
}

// Whether a launch with NS CTAs per group and `rows` grid rows merges in clusters: asked for (cluster_merge), NS <= 8
// (the portable cluster size), and the device holds the launch's clusters in no more waves than its CTAs
// without clusters (one CTA per SM); clusters of NS CTAs must fit in one GPC, so a size that leaves
// SMs idle would cost a wave. The caller has raised the kernel's shared-memory limit to smem.
template <class C>
bool fast_cluster_applies(const DecodeParams& p, int NS, int rows, int smem) {
  if (!p.cluster_merge || NS < 1 || NS > C::kClMax || smem <= 0) return false;
  // Not with protection: split 0's CTA writes two partials (its packed rows', then the protected rows'), and the
  // cluster merge takes one per CTA.
  if (p.protect.enabled()) return false;
  const int per = max_active_clusters_once<decode_fast_kernel<C>>(NS, C::THREADS, smem);
  if (per <= 0) return false;
  const long groups = static_cast<long>(p.batch) * rows;
  const int sms = p.sm_count > 0 ? p.sm_count : device_sms();
  const long waves_cluster = (groups + per - 1) / per;
  const long waves_plain = (groups * NS + sms - 1) / sms;
  return waves_cluster <= waves_plain;
}

template <class C>
cudaError_t launch_decode_fast(const DecodeParams& p, const SplitArgs& a, cudaStream_t st) {
  const int smem = fast_smem<C>(p);
  if (smem == 0) return cudaErrorInvalidValue;
  cudaError_t e = smem_limit_once<decode_fast_kernel<C>>(smem);
  if (e != cudaSuccess) return e;
  const int NS = a.nsplit;  // CTAs per group (protection adds a partial, not a CTA)
  const dim3 grid(static_cast<unsigned>(NS), static_cast<unsigned>(grid_rows(p, a)), static_cast<unsigned>(p.batch));
  cudaLaunchAttribute at[2];
  if (fast_cluster_applies<C>(p, NS, static_cast<int>(grid.y), smem)) {
    SplitArgs ac = a;
    ac.cluster = 1;
    const cudaLaunchConfig_t cfg = launch_config(grid, C::THREADS, smem, st, NS, p.programmatic, at);
    if (cudaLaunchKernelEx(&cfg, decode_fast_kernel<C>, p, ac) == cudaSuccess) return cudaSuccess;
    (void)cudaGetLastError();  // a launch-configuration error is not sticky: merge through the workspace instead
  }
  const cudaLaunchConfig_t cfg = launch_config(grid, C::THREADS, smem, st, 0, p.programmatic, at);
  return cudaLaunchKernelEx(&cfg, decode_fast_kernel<C>, p, a);
}

}  // namespace kvq::cuda::detail
