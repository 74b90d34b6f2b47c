// mla_store.cu: the fused MLA cache writer. One warp per token: it reads the bf16 content latent
// (d_c = 512) and RoPE key (d_r = 64), quantizes them by QuantMLA's group-64 affine rule exactly
// as kvq::AffineGroup::encode_reference (float32, correctly rounded division, rint ties to even,
// a scale that is not a positive normal -> FLT_MIN; compiled with --fmad=false), packs the codes
// LSB-first as kvq::pack_bits, writes codes and the 32-byte metadata record into the token's
// page slot, and copies protected positions' bf16 rows into their MlaProtectLayout slots.
#include <cfloat>

#include "kvq/numeric.hpp"
#include "kvq_cuda_mla.hpp"

namespace kvq::cuda {
namespace {

constexpr int kDc = 512, kDr = 64;

__device__ __forceinline__ float clampf_ref(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

template <int CB, int RB>
__global__ void __launch_bounds__(256) mla_store_kernel(MlaStoreParams p) {
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * 8 + (threadIdx.x >> 5);
  if (t >= p.n_tokens) return;
  const std::int64_t slot = p.slot_mapping[t];
  const std::uint16_t* lat = p.latent + static_cast<std::int64_t>(t) * (p.latent_stride ? p.latent_stride : kDc);
  const std::uint16_t* rop = p.rope + static_cast<std::int64_t>(t) * (p.rope_stride ? p.rope_stride : kDr);
  const uint4 c0 = *reinterpret_cast<const uint4*>(lat + 16 * lane);
  const uint4 c1 = *reinterpret_cast<const uint4*>(lat + 16 * lane + 8);
  const std::uint32_t r01 = *reinterpret_cast<const std::uint32_t*>(rop + 2 * lane);

  if (p.protect_rows && p.protect.enabled()) {
    const int pos = p.positions[t], seq = p.seq_ids[t];
    const int s = p.protect.slot(pos);
    bool keep = s >= 0;
    if (keep && pos >= p.protect.sinks && p.protect_seq_lens) keep = pos >= p.protect_seq_lens[seq] - p.protect.window;
    if (keep) {
      std::uint16_t* row = p.protect_rows + p.protect.row(seq, s);
      *reinterpret_cast<uint4*>(row + 16 * lane) = c0;
      *reinterpret_cast<uint4*>(row + 16 * lane + 8) = c1;
      *reinterpret_cast<std::uint32_t*>(row + kDc + 2 * lane) = r01;
    }
  }
  if (slot < 0) return;
  const PageLayout& pg = p.fmt.page;
  std::uint8_t* page = p.pool + static_cast<std::uint64_t>(slot / pg.tokens) * pg.page_bytes;
  const int off = static_cast<int>(slot % pg.tokens);
  std::uint8_t* kc = page + pg.key_code(0, off);
  std::uint8_t* vc = page + pg.value_code(0, off);

  if constexpr (CB == 16) {
    reinterpret_cast<uint4*>(kc)[2 * lane] = c0;
    reinterpret_cast<uint4*>(kc)[2 * lane + 1] = c1;
    reinterpret_cast<std::uint32_t*>(vc)[lane] = r01;
  } else {
    std::uint8_t* meta = page + pg.key_meta(0, off);
    // Content: lane holds dims [16 lane, 16 lane + 16); lanes 4g..4g+3 form group g.
    float x[16];
    const std::uint32_t w[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[2 * i] = bf16_to_float(static_cast<std::uint16_t>(w[i] & 0xffffu));
      x[2 * i + 1] = bf16_to_float(static_cast<std::uint16_t>(w[i] >> 16));
    }
    float lo = x[0], hi = x[0];
#pragma unroll
    for (int i = 1; i < 16; ++i) {
      lo = fminf(lo, x[i]);
      hi = fmaxf(hi, x[i]);
    }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
      hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    constexpr float mf = static_cast<float>((1 << CB) - 1);
    float s = round_bf16(__fdiv_rn(hi - lo, mf));
    if (!(s >= FLT_MIN)) s = FLT_MIN;
    const float z = clampf_ref(rintf(__fdiv_rn(-lo, s)), 0.0f, mf);
    std::uint32_t q[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) q[i] = static_cast<std::uint32_t>(clampf_ref(rintf(__fdiv_rn(x[i], s)) + z, 0.0f, mf));
    if constexpr (CB == 8) {
      uint4 v;
      v.x = q[0] | q[1] << 8 | q[2] << 16 | q[3] << 24;
      v.y = q[4] | q[5] << 8 | q[6] << 16 | q[7] << 24;
      v.z = q[8] | q[9] << 8 | q[10] << 16 | q[11] << 24;
      v.w = q[12] | q[13] << 8 | q[14] << 16 | q[15] << 24;
      reinterpret_cast<uint4*>(kc)[lane] = v;
    } else if constexpr (CB == 4) {
      uint2 v{0, 0};
#pragma unroll
      for (int i = 0; i < 8; ++i) v.x |= q[i] << (4 * i);
#pragma unroll
      for (int i = 0; i < 8; ++i) v.y |= q[8 + i] << (4 * i);
      reinterpret_cast<uint2*>(kc)[lane] = v;
    } else if constexpr (CB == 2) {
      std::uint32_t v = 0;
#pragma unroll
      for (int i = 0; i < 16; ++i) v |= q[i] << (2 * i);
      reinterpret_cast<std::uint32_t*>(kc)[lane] = v;
    } else {  // 3 bits: 16 codes = 6 bytes at byte 6 lane
      std::uint64_t v = 0;
#pragma unroll
      for (int i = 0; i < 16; ++i) v |= static_cast<std::uint64_t>(q[i]) << (3 * i);
      std::uint16_t* d = reinterpret_cast<std::uint16_t*>(kc + 6 * lane);
      d[0] = static_cast<std::uint16_t>(v);
      d[1] = static_cast<std::uint16_t>(v >> 16);
      d[2] = static_cast<std::uint16_t>(v >> 32);
    }
    if ((lane & 3) == 0) {
      const int g = lane >> 2;
      reinterpret_cast<std::uint16_t*>(meta)[g] = float_to_bf16(s);
      meta[16 + g] = static_cast<std::uint8_t>(z);
    }
    // RoPE key: lane holds dims 2 lane, 2 lane + 1; one group of 64, fp32 scale.
    const float y0 = bf16_to_float(static_cast<std::uint16_t>(r01 & 0xffffu));
    const float y1 = bf16_to_float(static_cast<std::uint16_t>(r01 >> 16));
    float rlo = fminf(y0, y1), rhi = fmaxf(y0, y1);
#pragma unroll
    for (int o = 1; o <= 16; o <<= 1) {
      rlo = fminf(rlo, __shfl_xor_sync(0xffffffffu, rlo, o));
      rhi = fmaxf(rhi, __shfl_xor_sync(0xffffffffu, rhi, o));
    }
    constexpr float rm = static_cast<float>((1 << RB) - 1);
    float rs = __fdiv_rn(rhi - rlo, rm);
    if (!(rs >= FLT_MIN)) rs = FLT_MIN;
    const float rz = clampf_ref(rintf(__fdiv_rn(-rlo, rs)), 0.0f, rm);
    const std::uint32_t q0 = static_cast<std::uint32_t>(clampf_ref(rintf(__fdiv_rn(y0, rs)) + rz, 0.0f, rm));
    const std::uint32_t q1 = static_cast<std::uint32_t>(clampf_ref(rintf(__fdiv_rn(y1, rs)) + rz, 0.0f, rm));
    if constexpr (RB == 8) reinterpret_cast<std::uint16_t*>(vc)[lane] = static_cast<std::uint16_t>(q0 | q1 << 8);
    else vc[lane] = static_cast<std::uint8_t>(q0 | q1 << 4);
    if (lane == 0) {
      *reinterpret_cast<float*>(meta + 24) = rs;
      meta[28] = static_cast<std::uint8_t>(rz);
      meta[29] = meta[30] = meta[31] = 0;
    }
  }
}

template <int CB, int RB>
cudaError_t launch_store(const MlaStoreParams& p, cudaStream_t st) {
  mla_store_kernel<CB, RB><<<(p.n_tokens + 7) / 8, 256, 0, st>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t mla_store(const MlaStoreParams& p, cudaStream_t stream) {
  const MlaFormat& f = p.fmt;
  if (!mla_supported(f) || !p.latent || !p.rope || !p.slot_mapping || !p.pool) return cudaErrorInvalidValue;
  if ((p.latent_stride % 8) || (p.rope_stride % 2) || (reinterpret_cast<std::uintptr_t>(p.latent) % 16) ||
      (reinterpret_cast<std::uintptr_t>(p.rope) % 4))
    return cudaErrorInvalidValue;
  if (p.protect.enabled() && p.protect_rows && (!p.positions || !p.seq_ids)) return cudaErrorInvalidValue;
  if (p.n_tokens <= 0) return cudaSuccess;
  const int c = f.content_bits, r = f.rope_bits;
  if (c == 16) return launch_store<16, 16>(p, stream);
  if (c == 8 && r == 8) return launch_store<8, 8>(p, stream);
  if (c == 4 && r == 8) return launch_store<4, 8>(p, stream);
  if (c == 4 && r == 4) return launch_store<4, 4>(p, stream);
  if (c == 3 && r == 4) return launch_store<3, 4>(p, stream);
  if (c == 2 && r == 4) return launch_store<2, 4>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace kvq::cuda
