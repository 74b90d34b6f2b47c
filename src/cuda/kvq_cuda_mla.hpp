// kvq_cuda_mla.hpp: launchers of the CUDA kernels for MLA caches (absorbed form), sm_90a.
//
// Formats: bf16 and the QuantMLA group-64 affine formats c8r8, c4r8, c4r4, c3r4, c2r4 (content
// latent d_c with a bf16 scale per group of 64, RoPE key d_r with an fp32 scale per group of 64);
// decode also reads mla-tq4 / mla-tq3 (TurboQuant-MSE latent: b-bit sphere-codebook indices of
// Pi (c / |c|), Pi = H D over d_c dims, fp16 stored norm with norm correction; bf16 RoPE key).
// Shapes: d_c = 512, d_r = 64 (DeepSeek-V2/V3's) run the tuned kernels; every format also runs any
// d_c = 64 G (G <= 16) and d_r = 64 R (R <= 4) through the generic-shape kernels (mla_decode_gen.cu
// and the generic writer path; the mla-tq writer has one kernel for every width). One layer per
// launch; pages are kvq::page_layout(find_format(name), geometry) with heads = 1 (64 tokens:
// [content codes][rope codes][meta per token: G bf16 scales, G zero points, R fp32 RoPE scales, R
// RoPE zero points, zero padding to the 16-byte record; 32 bytes at 512 / 64; mla-tq 16]). Protected rows follow
// kvq::MlaProtectLayout (include/kvq/cuda_protect.hpp). Launchers take raw device pointers and a
// plain Params struct and return cudaError_t (cudaErrorInvalidValue for an unsupported shape).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvq/cuda_protect.hpp"
#include "kvq/formats.hpp"
#include "kvq/page_layout.hpp"

namespace kvq::cuda {

struct MlaFormat {
  std::int32_t content_bits = 16;  // 16: bf16 cache (rope_bits 16 too)
  std::int32_t rope_bits = 16;
  std::int32_t d_latent = 512;
  std::int32_t d_rope = 64;
  PageLayout page;
  // mla-tq4 / mla-tq3 (content_bits 4 / 3, rope_bits 16): the layer's rotation Pi = H D as its
  // sign diagonal D (bit i of the mask set: D_ii = -1; H the block Hadamard of d_c, power-of-two
  // blocks, largest first), the sphere codebook's 2^b centroids and its 2^b - 1 midpoints (float32,
  // the CPU's bucket edges), all read off the quantizer make_quantizers(f, g, layer, 0) builds.
  bool tq = false;
  std::uint32_t tq_signs[32] = {};
  float tq_centroids[16] = {};
  float tq_edges[15] = {};
  float tq_terms[16] = {};  // the norm-correction sum's term per centroid (TurboQuantMse::centroid_squares)
};
// kvq::Error when the format is not an MLA format with a kernel (bf16, c*r* affine, mla-tq*).
// `layer` selects the sign diagonal of mla-tq formats (ignored by the others).
MlaFormat mla_format(const FormatSpec& f, int d_latent = 512, int d_rope = 64, int layer = 0);
bool mla_supported(const MlaFormat& f);

// ---- writer --------------------------------------------------------------------------------
// Quantizes n_tokens new (latent, rope key) rows exactly as the CPU cache does (bit-identical codes
// and metadata: kvq::AffineGroup for the affine formats, kvq::TurboQuantMse with the layer's
// rotation and norm correction for mla-tq4 / mla-tq3, the RoPE key copied as bf16 there) and writes
// them into their paged slots; with protection also copies the bf16 row of every protected position
// into its slot. A token the CPU quantizers refuse (a NaN or an infinity in its latent or RoPE key;
// affine formats: a group whose max - min overflows float32; mla-tq: a stored norm beyond fp16) is
// not written anywhere: its slot and protection row keep their bytes, and `rejected`, when given,
// counts it.
struct MlaStoreParams {
  MlaFormat fmt;
  const std::uint16_t* latent = nullptr;  // bf16 [n_tokens][d_latent], stride below
  const std::uint16_t* rope = nullptr;    // bf16 [n_tokens][d_rope] (after RoPE)
  std::int64_t latent_stride = 0;         // elements between tokens (0: d_latent)
  std::int64_t rope_stride = 0;           // (0: d_rope)
  const std::int64_t* slot_mapping = nullptr;  // [n_tokens]: page * 64 + offset; < 0 skips
  std::int32_t n_tokens = 0;
  std::uint8_t* pool = nullptr;
  MlaProtectLayout protect;
  std::uint16_t* protect_rows = nullptr;
  const std::int32_t* positions = nullptr;        // [n_tokens]
  const std::int32_t* seq_ids = nullptr;          // [n_tokens]
  const std::int32_t* protect_seq_lens = nullptr;  // [batch] lengths after this call (see kvq_cuda.hpp)
  bool generic = false;  // the generic-shape path even for d_c = 512, d_r = 64 (tests, benchmarks)
  std::uint32_t* rejected = nullptr;  // optional device counter, incremented once per refused token (see above)
};
cudaError_t mla_store(const MlaStoreParams& p, cudaStream_t stream = nullptr);

// ---- decode --------------------------------------------------------------------------------
// One query token per sequence, absorbed MLA: for head h of sequence b,
//   s_j = scale * (q[b][h][0:d_c] . c_j + q[b][h][d_c:] . r_j),  out[b][h] = sum_j softmax(s)_j c_j
// over positions [0, seq_lens[b]); c_j, r_j from the packed pages, or from the bf16 rows at
// protected positions. out is in latent space (d_c), fp32. mla-tq formats are decoded in the
// rotated domain: a pre-kernel rotates the query's latent part (Pi q) and the protected latent
// rows (into the workspace), the main kernel scores norm_j (Pi q) . C[idx_j] and accumulates
// P norm_j C[idx_j], and the combine kernel applies Pi^T to the merged output.
// The decode kernels at d_c = 512, d_r = 64: the register-fragment (mma.sync) kernel runs every format;
// the warpgroup (wgmma) kernel runs c4r4, c4r8 and c2r4 without protected rows. kAuto takes the
// warpgroup kernel there when each split has at least kMlaWgMinPages pages (with fewer, its fixed cost
// per CTA loses: 0.89-0.90x at 8 x 4K with 16 heads, ~2 pages per split, bench/results/decode-mla-2026-11-30b.md);
// kFragment and kWarpgroup choose one kernel wherever the warpgroup one applies (tests, A/B).
enum class MlaKernel : int { kAuto = 0, kFragment = 1, kWarpgroup = 2 };
constexpr int kMlaWgMinPages = 12;
struct MlaDecodeParams {
  MlaFormat fmt;
  const std::uint8_t* pool = nullptr;
  const std::int32_t* block_tables = nullptr;  // [batch][max_pages]
  std::int32_t max_pages = 0;
  const std::int32_t* seq_lens = nullptr;      // [batch]
  std::int32_t batch = 0;
  std::int32_t heads = 0;                      // 1..128: groups of 16 share each tile (a partial last group pads its rows)
  std::int32_t max_seq_len = 0;                // host-side bound, for the split count
  const float* q = nullptr;                    // [batch][heads][d_c + d_r]
  float* out = nullptr;                        // [batch][heads][d_c]
  float scale = 0;
  MlaProtectLayout protect;
  const std::uint16_t* protect_rows = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  std::int32_t num_splits = 0;  // 0: chosen to fill the SMs
  std::int32_t sm_count = 0;
  std::int32_t warps = 0;  // 0, 8 or 16: accepted for compatibility; the kernel runs 8-warp CTAs, two per SM
  bool generic = false;    // the generic-shape kernel even for d_c = 512, d_r = 64 (tests, benchmarks)
  MlaKernel kernel = MlaKernel::kAuto;  // which decode kernel runs where the warpgroup one applies (below)
};
// Protected rows must be 16-byte aligned (rows of d_c + d_r bf16 values), and the protection
// layout's d_latent / d_rope must be the format's.
int mla_decode_splits(const MlaDecodeParams& p);
std::size_t mla_decode_workspace_bytes(const MlaDecodeParams& p);
// Whether mla_decode runs the warpgroup (wgmma) kernel (see MlaKernel; never with `generic`).
bool mla_decode_uses_wgmma(const MlaDecodeParams& p);
cudaError_t mla_decode(const MlaDecodeParams& p, cudaStream_t stream = nullptr);
// Bytes one launch must read: whole pages of the packed range, protected rows, block tables.
std::size_t mla_decode_bytes_read(const MlaFormat& f, const int* seq_lens_host, int batch, const MlaProtectLayout& prot);

namespace detail {
// Byte offset of the mla-tq section of the workspace (rotated queries, then rotated protected rows)
// after the splits' partial outputs and (max, sum) pairs of `rows` = batch x heads x splits rows:
// rounded up to 16 bytes for the float4 / uint4 accesses (an odd row count with a head count that is
// not a multiple of 16 would leave it 8 bytes off).
inline std::size_t mla_tq_ws_offset(std::size_t rows, int d_latent) {
  const std::size_t b = rows * (static_cast<std::size_t>(d_latent > 0 ? d_latent : 0) + 2) * sizeof(float);
  return (b + 15) / 16 * 16;
}
// d_c, d_r multiples of 64 within the generic kernels' limits (64..1024, 64..256).
bool mla_generic_shape_ok(int d_latent, int d_rope);
// The generic-shape decode (every format; mla_decode validates the parameters).
cudaError_t mla_decode_generic(const MlaDecodeParams& p, int nsplit, cudaStream_t stream);
}  // namespace detail

}  // namespace kvq::cuda
