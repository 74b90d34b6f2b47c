// mla_decode_wg.cuh: the warpgroup (wgmma) decode kernel for absorbed MLA over the affine caches
// c4r4, c2r4 and c4r8 at d_c = 512, d_r = 64 without protected rows; included by mla_decode.cu
// inside its anonymous namespace (it uses Work, widx, dequant16v and the combine kernel there).
//
// One CTA = one warpgroup (4 warps, 128 threads; two CTAs per SM) = one sequence x 16 query heads
// x a contiguous range of 64-token tiles (one page each). Tokens are the M dimension of the score
// product, so one wgmma m64n16k16 covers a whole tile for 16 dims and no partial scores cross warps.
// Warp w, lane (g, t) owns tokens 16 w + g and 16 w + g + 8 of a tile and, in each 64-dim group,
// dims 16 t .. 16 t + 15 (the A-fragment layout of a k-step). Per tile:
//  1. The codes and metadata were loaded into registers a tile earlier: once a group is dequantized,
//     its registers take the same group of the next page (the metadata, read by every group, has two
//     register sets).
//  2. Each content group is dequantized (dequant16v: fp16 s (q - z), the register-fragment kernel's
//     operand; scale 0 outside the sequence) and stored with stmatrix into the V tile (shared memory,
//     8 x 8 core matrices); the RoPE group stays in registers. Before the stmatrix of group G the thread
//     waits until the previous tile's PV m-tile G (the only reader of those columns) has retired.
//  3. S^T = K Q^T: 32 content k-steps with A = the V tile (K-major) into four accumulators in turn,
//     4 RoPE k-steps with A from the register fragments; B = the query tile (fp16, pre-scaled by
//     scale * log2(e), loaded once per CTA).
//  4. Online softmax on the accumulator fragments (thread: 2 tokens x 4 heads). The reference maximum
//     of a head moves only when a score exceeds it by more than kSlack (a CTA vote; the exact tile
//     maximum then goes through shared memory), so P <= 2^kSlack; P goes to shared memory as fp16 in
//     the B-operand layout of PV (MN-major: a thread's two adjacent heads of a token in one store).
//  5. O^T += V^T P^T (8 m-tiles of 64 dims x 4 k-steps of 16 tokens; A = the V tile and B = P, both
//     read MN-major), one commit group per m-tile, issued at the top of the next iteration and retired
//     inside it, so that nothing is in flight across the loop's back edge (see docs/kernels-mla.md for
//     what ptxas needs to keep the wgmma pipeline).
// The dims inside a 16-dim k-step come in the order dequant16v produces (widx, col_dim); the query
// tile uses the same order, and the epilogue maps each output row back to its dim. Operands and
// rounding are the register-fragment kernel's (fp16 s (q - z), fp16 query and P, fp32 accumulation),
// so both kernels meet the same error budget; the partial outputs and the combine kernel are shared.
#pragma once

namespace wg {

constexpr int kTI = 64;                     // tokens per tile (one page)
constexpr int kVBytes = kTI * kDc * 2;      // V tile: 64 tokens x 512 dims, fp16
constexpr int kQBytes = kHG * kD * 2;       // query tile: 16 heads x 576 dims, fp16
constexpr int kPBytes = kHG * kTI * 2;      // P: 16 heads x 64 tokens, fp16
constexpr int kRedBytes = 4 * kHG * 4 * 2;  // per-warp head maxima and sums
constexpr int kSmem = kVBytes + kQBytes + kPBytes + kRedBytes;
static_assert(kSmem <= detail::kMlaSmemTwoPerSm, "two CTAs per SM");
static_assert(kHG * kOutRow * 4 <= kVBytes, "the partial output is staged in the V tile");

// Core-matrix layouts (no swizzle): an 8 x 8 block of fp16 values is 8 rows of 16 bytes, 128 bytes.
// V tile: rows = tokens, 16-byte row = 8 consecutive columns; column block c / 8 at kVCB bytes,
// token block at 128. Query: rows = heads, columns = dims (block at 256, head block at 128). P (the
// B operand of PV, read MN-major): rows = tokens, 16-byte row = 8 consecutive heads (token block at 256,
// head block at 128), so a thread's two adjacent heads of one token are one 32-bit store.
constexpr std::uint32_t kVCB = 8 * 128;
__device__ __forceinline__ std::uint32_t v_off(int tok, int col) {
  return static_cast<std::uint32_t>((col >> 3) * kVCB + (tok >> 3) * 128 + (tok & 7) * 16 + (col & 7) * 2);
}
__device__ __forceinline__ std::uint32_t q_off(int h, int col) {
  return static_cast<std::uint32_t>((col >> 3) * 256 + (h >> 3) * 128 + (h & 7) * 16 + (col & 7) * 2);
}
__device__ __forceinline__ std::uint32_t p_off(int h, int tok) {
  return static_cast<std::uint32_t>((tok >> 3) * 256 + (h >> 3) * 128 + (tok & 7) * 16 + (h & 7) * 2);
}

// Shared-memory matrix descriptor: start address, leading-dimension byte offset (between core
// matrices along K), stride-dimension byte offset (along M or N), no swizzle.
__device__ __forceinline__ std::uint64_t desc(std::uint32_t saddr, std::uint32_t lbo, std::uint32_t sbo) {
  return static_cast<std::uint64_t>((saddr & 0x3ffffu) >> 4) | (static_cast<std::uint64_t>(lbo >> 4) << 16) |
         (static_cast<std::uint64_t>(sbo >> 4) << 32);
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// wgmma.wait_group n for n in 0..7 (n known after unrolling).
__device__ __forceinline__ void wait_n(int n) {
  switch (n) {
    case 0: wait<0>(); break;
    case 1: wait<1>(); break;
    case 2: wait<2>(); break;
    case 3: wait<3>(); break;
    case 4: wait<4>(); break;
    case 5: wait<5>(); break;
    case 6: wait<6>(); break;
    default: wait<7>(); break;
  }
}
// Keeps the compiler from moving accesses of accumulator registers across a wait.
__device__ __forceinline__ void pin(float (&d)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (64 x 16, f32) += A (64 x 16, fp16 fragments in registers) B (16 x 16, K-major in shared memory).
__device__ __forceinline__ void mma_rs(float (&d)[8], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2, std::uint32_t a3,
                                       std::uint64_t bd) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, 1, 1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(bd));
}
// D (64 x 16) (+)= A B, both K-major in shared memory (mma_ss0: D = A B, the first product of a chain, its outputs
// defined by the wgmma alone: an initialization by other instructions while wgmmas are in flight serializes them).
__device__ __forceinline__ void mma_ss0(float (&d)[8], std::uint64_t ad, std::uint64_t bd) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, 0, 1, 1, 0, 0;\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7])
      : "l"(ad), "l"(bd));
}
__device__ __forceinline__ void mma_ss(float (&d)[8], std::uint64_t ad, std::uint64_t bd) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(ad), "l"(bd));
}
// D (64 x 16) += A B, both MN-major in shared memory.
__device__ __forceinline__ void mma_ss_tab(float (&d)[8], std::uint64_t ad, std::uint64_t bd) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, 1, 1, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(ad), "l"(bd));
}
__device__ __forceinline__ void stmatrix4(std::uint32_t saddr, std::uint32_t r0, std::uint32_t r1, std::uint32_t r2, std::uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(saddr), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Column x (0..63) of a 64-dim group in the tile's order -> its dim in the group: k-step s = x / 16,
// k position kp = x % 16 = 2 t + 8 h + e holds dim 16 t + widx(2 s + h, e).
template <int CB>
__host__ __device__ constexpr int col_dim(int x) {
  const int s = x >> 4, kp = x & 15;
  return 16 * ((kp & 7) >> 1) + widx<CB>(2 * s + (kp >> 3), kp & 1);
}

__device__ __forceinline__ std::uint32_t word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

template <int CB, int RB>
__global__ void __launch_bounds__(128, 2) mla_decode_wg_kernel(const __grid_constant__ MlaDecodeParams p, Work wk) {
  constexpr float kSlack = 8.0f;
  extern __shared__ __align__(1024) std::uint8_t smem_raw[];
  float* sred = reinterpret_cast<float*>(smem_raw + kVBytes + kQBytes + kPBytes);  // [4][16] maxima, then [4][16] sums
  const std::uint32_t sV = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem_raw));
  const std::uint32_t sQ = sV + kVBytes, sP = sQ + kQBytes;
  const PageLayout L = p.fmt.page;
  const int split = blockIdx.x, hg = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
  const int nh = min(kHG, p.heads - hg * kHG);
  const int Lq = p.seq_lens[b];
  const detail::MlaTiles<kTI> vtiles(p.protect, false, Lq, wk.nsplit, split);
  const int v0 = vtiles.v0, v1 = vtiles.v1;
  const std::int32_t* bt = p.block_tables + static_cast<std::size_t>(b) * p.max_pages;
  constexpr int CBY = 8 * CB * 8, RBY = 8 * RB;  // bytes per token: content codes, RoPE codes

  // A tile's codes and metadata in registers, for this thread's tokens 16 w + g + 8 k: content group
  // G's 16 codes at dims 16 t .. 16 t + 15, the RoPE key's, and the 32-byte metadata records.
  typename Codes16<CB>::T cc[2][8];
  typename Codes16<RB>::T rc[2];
  uint4 mcur[2][2], mnx[2][2];
  auto load_content = [&](const std::uint8_t* pg, int G) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int tok = 16 * w + g + 8 * k;
      if (G < 8)
        cc[k][G] = __ldg(reinterpret_cast<const typename Codes16<CB>::T*>(pg + L.key_code_off + tok * CBY + 8 * CB * G + 2 * CB * t));
      else
        rc[k] = __ldg(reinterpret_cast<const typename Codes16<RB>::T*>(pg + L.value_code_off + tok * RBY + 2 * RB * t));
    }
  };
  auto load_meta = [&](const std::uint8_t* pg, uint4 (&m)[2][2]) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const uint4* me = reinterpret_cast<const uint4*>(pg + L.meta_off + (16 * w + g + 8 * k) * 32);
      m[k][0] = __ldg(me);
      m[k][1] = __ldg(me + 1);
    }
  };
  auto page_of = [&](int id) { return p.pool + static_cast<std::size_t>(static_cast<unsigned>(id)) * L.page_bytes; };
  int id_next = -1;
  if (v0 < v1) {
    const std::uint8_t* pg = page_of(bt[v0]);
    load_meta(pg, mcur);
#pragma unroll
    for (int G = 0; G < 9; ++G) load_content(pg, G);
    if (v0 + 1 < v1) id_next = bt[v0 + 1];
  }

  // Query tile: q[b][hg 16 + h][dim] * scale * log2(e) as fp16, column c holding the dim col_dim gives;
  // one (head, 64-dim group) per item: 16 float4 loads, 8 16-byte stores.
  {
    const float sl2 = p.scale * kLog2e;
    const float* qb = wk.q + (static_cast<std::size_t>(b) * p.heads + hg * kHG) * kD;
    auto put = [&](int h, int G, const float (&x)[64], auto cb) {
      constexpr int B = decltype(cb)::value;
#pragma unroll
      for (int c8 = 0; c8 < 8; ++c8) {
        std::uint32_t u[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) u[i] = detail::pack2<false>(x[col_dim<B>(8 * c8 + 2 * i)] * sl2, x[col_dim<B>(8 * c8 + 2 * i + 1)] * sl2);
        *reinterpret_cast<uint4*>(smem_raw + kVBytes + q_off(h, 64 * G + 8 * c8)) = make_uint4(u[0], u[1], u[2], u[3]);
      }
    };
    for (int it = tid; it < kHG * 9; it += 128) {
      const int h = it / 9, G = it - 9 * h;
      float x[64];
      const float4* src = reinterpret_cast<const float4*>(qb + static_cast<std::size_t>(h) * kD + 64 * G);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float4 v = h < nh ? src[i] : make_float4(0, 0, 0, 0);
        x[4 * i] = v.x;
        x[4 * i + 1] = v.y;
        x[4 * i + 2] = v.z;
        x[4 * i + 3] = v.w;
      }
      if (G < 8) put(h, G, x, std::integral_constant<int, CB>{});
      else put(h, G, x, std::integral_constant<int, RB>{});
    }
  }
  // Accumulators: O^T m-tile mt: rows = tile columns 64 mt + 16 w + g (+ 8), columns = heads 2 t, 2 t + 1 (+ 8).
  float o[8][8];
#pragma unroll
  for (int mt = 0; mt < 8; ++mt)
#pragma unroll
    for (int i = 0; i < 8; ++i) o[mt][i] = 0.0f;
  // Softmax state of this thread's heads 2 t, 2 t + 1, 8 + 2 t, 9 + 2 t (accumulator columns i & 1, i >> 2).
  float mref[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
  float lsum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // stmatrix row address of this lane: matrix lane / 8 = (token half (lane / 8) & 1, column half lane / 16).
  const std::uint32_t st_base = sV + v_off(16 * w + ((lane >> 3) & 1) * 8 + (lane & 7), (lane >> 4) * 8);
  // Descriptors: the query (B of QK), the V tile as A of QK (K-major: column blocks along K) and of
  // PV (MN-major: token blocks along K), P (B of PV); per k-step only the start address moves.
  const std::uint64_t qdesc = desc(sQ, 256, 128), vdesc = desc(sV, kVCB, 128), vtdesc = desc(sV, 128, kVCB),
                      pdesc = desc(sP, 256, 128);
  detail::async_proxy_fence();
  __syncthreads();

  // Scores of tile vt (steps 1-3): S^T in s (accumulator registers, written by the wgmmas only:
  // another definition while wgmmas are in flight serializes them); returns which of the thread's two
  // rows lie in the sequence (bit k: row 16 w + g + 8 k). With the previous tile's 8 PV groups in
  // flight, content group G waits for PV m-tile G only. Once a group is dequantized its registers take
  // the same part of the next tile (page pn, when there is one), so every load is issued about a tile
  // ahead of its use with one set of registers (the metadata, which every group reads, has two).
  auto scores = [&](int vt, float (&s)[8], const std::uint8_t* pn) {
    if (pn) load_meta(pn, mnx);
    int lo, hi;
    vtiles.range(vt, lo, hi);
    std::uint32_t ar[2][8];  // the RoPE k-steps' A fragments
    const bool ok[2] = {16 * w + g >= lo && 16 * w + g < hi, 16 * w + g + 8 >= lo && 16 * w + g + 8 < hi};
    // Scale 0 and zero point 0 outside the sequence (the whole record zeroed once per tile): whatever
    // the page holds there becomes 0.
    uint4 m[2][2];
#pragma unroll
    for (int k = 0; k < 2; ++k)
#pragma unroll
      for (int j = 0; j < 2; ++j) m[k][j] = ok[k] ? mcur[k][j] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int G = 0; G < 9; ++G) {
      std::uint32_t a[2][8];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        std::uint32_t s2, z2;
        if (G < 8) {
          const std::uint32_t sw = word(m[k][0], G >> 1);
          const float sc = __uint_as_float((G & 1) ? (sw & 0xffff0000u) : (sw << 16));
          s2 = detail::pack2<false>(sc, sc);
          const std::uint32_t zw = word(m[k][1], G >> 2);
          z2 = detail::zero_pair_byte(zw, G & 3);
        } else {
          const float rs = __uint_as_float(m[k][1].z);
          s2 = detail::pack2<false>(rs, rs);
          z2 = detail::zero_pair_byte(m[k][1].w, 0);
        }
        if (G < 8) dequant16v<CB>(a[k], cc[k][G], z2, s2);
        else dequant16v<RB>(a[k], rc[k], z2, s2);
      }
      if (pn) load_content(pn, G);
      if (G < 8) {
        wait_n(7 - G);  // PV m-tile G of the previous tile (the only reader of these columns) has completed
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) stmatrix4(st_base + (8 * G + 2 * ks) * kVCB, a[0][2 * ks], a[1][2 * ks], a[0][2 * ks + 1], a[1][2 * ks + 1]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          ar[0][i] = a[0][i];
          ar[1][i] = a[1][i];
        }
      }
    }
    if (pn) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        mcur[k][0] = mnx[k][0];
        mcur[k][1] = mnx[k][1];
      }
    }
    detail::async_proxy_fence();
    __syncthreads();  // the content tile is complete
    // S^T = K Q^T: the content k-steps from the V tile (A K-major in shared memory) into four
    // accumulators in turn (four independent chains), the RoPE k-steps from the fragments.
    float acc[4][8];
    fence();
    // (a rolled loop: unrolled, the compiler materializes all 64 descriptors at once and spills)
    std::uint64_t ad = vdesc, bd = qdesc;  // k-step kk: + 2 kk column blocks, + 2 kk query column blocks
#pragma unroll
    for (int j = 0; j < 4; ++j) mma_ss0(acc[j], ad + j * (2 * kVCB >> 4), bd + j * (512 >> 4));
#pragma unroll 1
    for (int kk = 4; kk < 32; kk += 4) {
      ad += 4 * (2 * kVCB >> 4);
      bd += 4 * (512 >> 4);
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_ss(acc[j], ad + j * (2 * kVCB >> 4), bd + j * (512 >> 4));
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) mma_rs(acc[ks], ar[0][2 * ks], ar[1][2 * ks], ar[0][2 * ks + 1], ar[1][2 * ks + 1], qdesc + ((32 + ks) * 512 >> 4));
    commit();
    wait<0>();
#pragma unroll
    for (int j = 0; j < 4; ++j) pin(acc[j]);
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) pin(o[mt]);
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = (acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i]);
    return (ok[0] ? 1 : 0) | (ok[1] ? 2 : 0);
  };
  // Online softmax (step 3): s[i] is token 16 w + g + 8 ((i >> 1) & 1), head (i & 1) + 2 t + 8 (i >> 2).
  auto softmax = [&](const float (&acc)[8], int okm) {
    float s[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = (okm >> ((i >> 1) & 1)) & 1 ? acc[i] : -INFINITY;
    bool move = false;
#pragma unroll
    for (int i = 0; i < 8; ++i) move |= s[i] > mref[(i & 1) + 2 * (i >> 2)] + kSlack;
    if (__syncthreads_or(move)) {  // rare at long context: the exact tile maximum of every head
      float mx[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i0 = (j & 1) + 4 * (j >> 1);
        mx[j] = fmaxf(s[i0], s[i0 + 2]);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], off));
      }
      if (g == 0) {
#pragma unroll
        for (int j = 0; j < 4; ++j) sred[w * kHG + (j & 1) + 2 * t + 8 * (j >> 1)] = mx[j];
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int h = (j & 1) + 2 * t + 8 * (j >> 1);
        const float mn = fmaxf(fmaxf(fmaxf(mref[j], sred[h]), fmaxf(sred[kHG + h], sred[2 * kHG + h])), sred[3 * kHG + h]);
        const float a = mn == mref[j] ? 1.0f : ex2(mref[j] - mn);  // mref = -inf: 0
        mref[j] = mn;
        lsum[j] *= a;
#pragma unroll
        for (int mt = 0; mt < 8; ++mt) {
          const int i0 = (j & 1) + 4 * (j >> 1);
          o[mt][i0] *= a;
          o[mt][i0 + 2] *= a;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 8; i += 2) {  // heads h, h + 1 of one token
      const int j = 2 * (i >> 2);
      const float p0 = s[i] == -INFINITY ? 0.0f : ex2(s[i] - mref[j]);
      const float p1 = s[i + 1] == -INFINITY ? 0.0f : ex2(s[i + 1] - mref[j + 1]);
      lsum[j] += p0;
      lsum[j + 1] += p1;
      const int tok = 16 * w + g + 8 * ((i >> 1) & 1), h = 2 * t + 8 * (i >> 2);
      *reinterpret_cast<std::uint32_t*>(smem_raw + kVBytes + kQBytes + p_off(h, tok)) = detail::pack2<false>(p0, p1);
    }
    detail::async_proxy_fence();
    __syncthreads();  // the V tile and P are complete
  };
  // O^T += V^T P^T (step 4), one commit group per m-tile (the next tile's scores wait on them one by one).
  auto pv = [&]() {
    fence();
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        mma_ss_tab(o[mt], vtdesc + ((mt * 8 * kVCB + ks * 2 * 128) >> 4), pdesc + (ks * 512 >> 4));
      commit();
    }
  };
  // Software pipeline: a tile's PV runs while the next tile is dequantized and scored; nothing is in
  // flight across the loop's back edge (the compiler keeps the wgmma pipeline then).
  if (v0 < v1) {
    float s[8];
    const std::uint8_t* pn = v0 + 1 < v1 ? page_of(id_next) : nullptr;
    id_next = v0 + 2 < v1 ? bt[v0 + 2] : -1;
    softmax(s, scores(v0, s, pn));
#pragma unroll 1
    for (int vt = v0 + 1; vt < v1; ++vt) {
      pn = vt + 1 < v1 ? page_of(id_next) : nullptr;
      id_next = vt + 2 < v1 ? bt[vt + 2] : -1;
      pv();
      softmax(s, scores(vt, s, pn));
    }
    pv();
    wait<0>();  // inside the branch: the accumulators meet the empty split's zeros only when complete
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) pin(o[mt]);
  }
  detail::launch_dependents();  // the combine kernel may be scheduled (it waits for this grid's end)
  __syncthreads();  // every warp's PV is complete before the V tile is reused for the output
  // ---- partial state: unnormalized output through shared memory (whole-line global stores), max, sum
  {
    float* so = reinterpret_cast<float*>(smem_raw);
#pragma unroll
    for (int mt = 0; mt < 8; ++mt)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int d = 64 * mt + col_dim<CB>(16 * w + g + 8 * ((i >> 1) & 1));
        const int h = (i & 1) + 2 * t + 8 * (i >> 2);
        so[h * kOutRow + out_col(d)] = o[mt][i];
      }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) lsum[j] += __shfl_xor_sync(0xffffffffu, lsum[j], off);
    }
    if (g == 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j) sred[4 * kHG + w * kHG + (j & 1) + 2 * t + 8 * (j >> 1)] = lsum[j];
    }
    __syncthreads();
    store_partial<128>(so, wk, b, p.heads, hg, split, nh, tid);
    if (w == 0 && g == 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int h = (j & 1) + 2 * t + 8 * (j >> 1);
        if (h < nh) {
          const float* ls = sred + 4 * kHG + h;
          const std::size_t r = (static_cast<std::size_t>(b) * p.heads + hg * kHG + h) * wk.nsplit + split;
          wk.ml[2 * r] = mref[j] * kLn2;
          wk.ml[2 * r + 1] = ((ls[0] + ls[kHG]) + ls[2 * kHG]) + ls[3 * kHG];
        }
      }
    }
  }
}

}  // namespace wg
