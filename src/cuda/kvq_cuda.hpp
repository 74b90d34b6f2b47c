// kvq_cuda.hpp: launchers of the CUDA kernels for TurboQuant / uniform / fp8 / bf16 GQA caches.
//
// Every launcher takes raw device pointers and a plain Params struct and returns a cudaError_t
// (cudaErrorInvalidValue for a shape or format it does not support; it never throws). Pages are
// laid out exactly as kvq::PageLayout (include/kvq/page_layout.hpp) declares; each layer has its
// own page pool and a launch works on one layer. The per-layer constants of a format (sign
// diagonals, channel permutation of the outlier split, codebooks) live in device memory owned
// by LayerTables, built from kvq::make_quantizers so that the kernels and the CPU references
// read the same numbers. docs/kernels.md describes the kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvq/cuda_protect.hpp"
#include "kvq/formats.hpp"
#include "kvq/page_layout.hpp"

namespace kvq::cuda {

enum class KeyCode : std::int32_t { kBf16 = 0, kFp8 = 1, kTq = 2 };
enum class ValueCode : std::int32_t { kBf16 = 0, kUniform = 1, kTq = 2 };

inline constexpr int kMaxSegments = 2;
inline constexpr int kMaxCodebook = 256;

// What the kernels need to know about one layer's format. Segments: 1, or 2 for the outlier
// split (segment 0 = the outlier channels with more bits, segment 1 = the rest); segment-order
// position i of a head's vector is channel perm[i].
struct FormatDesc {
  KeyCode key = KeyCode::kBf16;
  ValueCode value = ValueCode::kBf16;
  std::int32_t head_dim = 0;
  std::int32_t kv_heads = 0;
  std::int32_t segments = 1;
  std::int32_t seg_dims[kMaxSegments] = {0, 0};
  std::int32_t key_bits[kMaxSegments] = {16, 0};
  std::int32_t value_bits[kMaxSegments] = {16, 0};
  PageLayout page;
  // Device tables, [kv_heads][head_dim] in segment order (nullptr where the format has none).
  const float* key_signs = nullptr;
  const float* value_signs = nullptr;
  const std::int32_t* key_perm = nullptr;
  const std::int32_t* value_perm = nullptr;
  // [kMaxSegments][kMaxCodebook]: centroids (2^bits) and midpoints (2^bits - 1) per segment.
  const float* key_centroids = nullptr;
  const float* key_edges = nullptr;
  const float* value_centroids = nullptr;
  const float* value_edges = nullptr;
  // [kMaxSegments][kMaxCodebook]: the norm-correction sum's term per centroid of each TurboQuant segment (the
  // centroid's square on its grid, kvq::grid_squares: TurboQuantMse::centroid_squares), zeros elsewhere.
  const float* key_terms = nullptr;
  const float* value_terms = nullptr;
  // True when value_centroids holds exactly key_centroids (every segment): so in every TurboQuant-value
  // preset. The fast decode kernel of 3-bit TurboQuant keys and values (tq-3bit) then reads the value
  // pairs from the key pairs' table; a launch without it takes the generic kernel.
  bool shared_codebook = false;
  // [kMaxSegments][kMaxCodebook]: the midpoints as thresholds on the FWHT output before its final
  // 1 / sqrt(block) (kvq::prescale_threshold; power-of-two segments), for the fast store kernel.
  const float* key_thresholds = nullptr;
  const float* value_thresholds = nullptr;
  // Centering (kvq's calibrated tq-4bit, tq-3bit, tq-3.5bit, tq-2.5bit; docs/formats.md): the
  // per-channel means subtracted before quantization, [kv_heads][head_dim] in channel order, or
  // nullptr for an uncentered format. The store subtracts them; decode scores protected rows
  // against k - key_mean (every score of a query then carries the same shift as the packed rows,
  // which the softmax ignores) and adds value_mean once to the output.
  const float* key_mean = nullptr;
  const float* value_mean = nullptr;
  // The same means in segment order and times the sign diagonal, [kv_heads][head_dim]: the fast
  // store kernel subtracts them from the signed rows (s x - s m = s (x - m), exactly).
  const float* key_mean_seg = nullptr;
  const float* value_mean_seg = nullptr;
  // The fast store kernels' shared-memory setup (their bin tables, sign masks, channel offsets and means), built
  // once from the tables above by build_store_image, so that every store copies it (one round trip) instead of
  // computing it (2.2-3.9 us of a small store on the H200). nullptr, or a size that does not match
  // store_image_bytes: each store builds it. Rebuild it whenever the tables above change. LayerTables makes it
  // (formats with a TurboQuant side; not tq-4bit / tq-3bit at head_dim 64, whose paired kernels build their own).
  const void* store_image = nullptr;
  std::uint32_t store_image_bytes = 0;
};

// The size of f's store setup image (FormatDesc::store_image) in bytes; 0 where no fast store kernel that takes one
// serves f (bf16, tq-k8v4, the generic kernel's formats, tq-4bit / tq-3bit at head_dim 64, missing tables).
std::size_t store_image_bytes(const FormatDesc& f);
// Writes f's store setup image to dst (device memory, 16-byte aligned, `bytes` = store_image_bytes(f)) on stream;
// cudaErrorInvalidValue for a wrong size or a null or misaligned dst.
cudaError_t build_store_image(const FormatDesc& f, void* dst, std::size_t bytes, cudaStream_t stream = nullptr);

// Device copies of one layer's format constants. Built on the host from make_quantizers(f, g,
// layer, head) for every KV head; kvq::Error if the format has no kernel (QJL, MLA formats).
class LayerTables {
 public:
  LayerTables(const FormatSpec& f, const CacheGeometry& g, int layer, const OutlierChannels* outliers = nullptr);
  ~LayerTables();
  LayerTables(const LayerTables&) = delete;
  LayerTables& operator=(const LayerTables&) = delete;
  const FormatDesc& desc() const { return desc_; }

 private:
  FormatDesc desc_;
  void* dev_ = nullptr;
  void* image_ = nullptr;  // desc_.store_image
};

// True when the decode kernel has an instantiation for this format and head_dim.
bool decode_supported(const FormatDesc& f);

// ---- store ---------------------------------------------------------------------------------
// Quantizes n_tokens new (key, value) rows per KV head and writes them into their paged slots;
// with a protection buffer also copies protected positions' bf16 rows there. A (token, KV head)
// record that the CPU encoders refuse (a NaN or an infinity in its key or value row; TurboQuant: a
// stored norm beyond fp16; uniform values: a min or max beyond fp16) is written nowhere (its slot and
// protection row keep their bytes) and counted in `rejected` when given, whether or not its token
// has a slot: the caller treats a non-zero count as the error the CPU cache raises.
struct StoreParams {
  FormatDesc fmt;
  const std::uint16_t* key = nullptr;    // bf16 [n_tokens][kv_heads][head_dim], token stride below
  const std::uint16_t* value = nullptr;  // bf16 [n_tokens][kv_heads][head_dim]
  std::int64_t key_token_stride = 0;     // elements between tokens (0: kv_heads * head_dim)
  std::int64_t value_token_stride = 0;
  const std::int64_t* slot_mapping = nullptr;  // [n_tokens]: page * page.tokens + offset; < 0 skips
  std::int32_t n_tokens = 0;
  std::uint8_t* pool = nullptr;          // the layer's page pool
  // Optional protection rows.
  ProtectLayout protect;
  std::uint16_t* protect_rows = nullptr;
  const std::int32_t* positions = nullptr;  // [n_tokens] position of the token in its sequence
  const std::int32_t* seq_ids = nullptr;    // [n_tokens] batch row
  // [batch] sequence lengths after this call: a window row is written only if it is among the
  // last `window` positions (several positions of one call can share a ring slot). nullptr:
  // the caller guarantees that no two positions of one sequence in this call share a slot.
  const std::int32_t* protect_seq_lens = nullptr;
  std::uint32_t* rejected = nullptr;  // optional device counter of refused records (see above)
};
cudaError_t store(const StoreParams& p, cudaStream_t stream = nullptr);

// ---- decode --------------------------------------------------------------------------------
// One query token per sequence: out[b][h] = softmax(scale * q K^T) V over positions
// [0, seq_lens[b]) of sequence b, query head h reading KV head h / (q_heads / kv_heads). Any q_heads that is a
// multiple of kv_heads: more than 8 query heads per KV head run in CTAs of up to 16 (the fast kernel) or up to 8 (the
// generic kernel; docs/kernels.md).
struct DecodeParams {
  FormatDesc fmt;
  const std::uint8_t* pool = nullptr;
  const std::int32_t* block_tables = nullptr;  // [batch][max_pages] page ids into pool
  std::int32_t max_pages = 0;
  const std::int32_t* seq_lens = nullptr;      // [batch]
  std::int32_t batch = 0;
  std::int32_t q_heads = 0;
  std::int32_t max_seq_len = 0;  // host-side bound of seq_lens, used for the split count
  const float* q = nullptr;      // [batch][q_heads][head_dim]
  float* out = nullptr;          // [batch][q_heads][head_dim]
  float scale = 0;               // softmax scale
  ProtectLayout protect;                          // sinks + window (0 + 0: none)
  const std::uint16_t* protect_rows = nullptr;    // required when protect.enabled()
  // decode_workspace_bytes(p) bytes, 16-byte aligned, any contents; one launch at a time per
  // workspace (it holds the splits' partials and the per-group arrival counters, which each
  // launch tags with its own epoch and leaves at zero).
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  std::int32_t num_splits = 0;   // 0: chosen from batch x heads x length to fill the SMs
  // Protection: the protected rows' share of split 0, in 32-token chunks of its packed range (split 0 reads them after
  // its packed rows, so it takes that many chunks fewer); -1: the launcher's estimate (decode_protect_chunks).
  std::int32_t protect_chunks = -1;
  std::int32_t sm_count = 0;     // 0: read from the current device
  // Fast kernel: merge the splits of a (sequence, KV head) inside a thread-block cluster (their
  // partials through distributed shared memory) where the device holds the launch's clusters in
  // as few waves as its CTAs without clusters; false: always through the workspace.
  bool cluster_merge = true;
  // Fast kernel, 8 < G query heads per KV head: CTAs of up to 16 heads, which unpack each chunk's codes once for all
  // of them; false: CTAs of up to 8 heads (two or more per KV head, each unpacking the codes; for tests and A/Bs).
  bool sixteen_heads = true;
  // Launch the decode as a programmatic dependent launch (Hopper): its CTAs may start while the kernel before it in
  // the stream runs (the store kernels let it from their start), read the sequence lengths, block tables and the
  // format's tables (pointers in fmt), then wait for that kernel to finish before they read the query, the pages, the
  // protected rows or the workspace. So the kernel before must not write the first group, and must have been
  // launched without this attribute itself. KVQ_NO_PDL=1 in the environment turns it off.
  bool programmatic = false;
  // Tests only (0 in use): in a cluster merge of two or more CTAs, the CTAs of odd rank wait this
  // many nanoseconds (at most 1e6) before sending their partials, so that a merge reading its receive
  // buffer before every send has landed gives wrong results instead of winning the race. With early sends
  // they also wait as long after arming their receive buffer, before their main loop, so that the partner's
  // rows land while they have the loop still to run.
  std::int32_t test_send_delay_ns = 0;
};
// Split count the launcher will use, and the workspace it needs.
int decode_splits(const DecodeParams& p);
// With protection, the chunks of split 0's packed range that its protected rows replace (DecodeParams::protect_chunks,
// or the launcher's estimate); 0 without.
int decode_protect_chunks(const DecodeParams& p);
std::size_t decode_workspace_bytes(const DecodeParams& p);
cudaError_t decode(const DecodeParams& p, cudaStream_t stream = nullptr);
// True when decode(p) runs the fast kernel of decode_fast.cuh (head_dim 128, up to 16 query heads per CTA, the
// TurboQuant and fp8 formats including the outlier splits), false when it runs the generic one.
bool decode_uses_fast_kernel(const DecodeParams& p);
// Query heads per CTA of decode(p): G up to 8; for more, G / S with S the smallest divisor of G that leaves at most 16
// (the fast kernel's sixteen-head form: DecodeParams::sixteen_heads, head_dim 128) or at most 8.
int decode_cta_heads(const DecodeParams& p);
// True when decode(p) merges its splits inside thread-block clusters (DecodeParams::cluster_merge).
bool decode_uses_cluster_merge(const DecodeParams& p);
// True when that cluster merge sends early: clusters of two CTAs without protection, where each CTA takes its
// partner's rows in the region of its rotated query, armed in the prologue (docs/kernels.md, cluster merge).
bool decode_uses_early_sends(const DecodeParams& p);

// Bytes the decode kernel must read for one launch (codes, metadata, protected bf16 rows and
// block tables), the figure the benchmark divides by time.
std::size_t decode_bytes_read(const FormatDesc& f, const int* seq_lens_host, int batch, const ProtectLayout& prot);

// ---- benchmark helpers -----------------------------------------------------------------
// Random, finite page contents for a format (codes, fp16 metadata) and random bf16 rows.
cudaError_t fill_random_pages(const FormatDesc& f, std::uint8_t* pool, std::size_t n_pages, std::uint64_t seed,
                              cudaStream_t stream = nullptr);
cudaError_t fill_random_bf16(std::uint16_t* p, std::size_t n, std::uint64_t seed, cudaStream_t stream = nullptr);
// Benchmarks' L2 flush: reads `bytes` (a multiple of 16) of `buf` through the L2 and writes
// nothing (except, never in practice, one word of buf when the XOR of everything read equals a
// sentinel, which keeps the loads alive), so the L2 is left holding clean lines only.
cudaError_t flush_l2_read(std::uint8_t* buf, std::size_t bytes, cudaStream_t stream = nullptr);
// Benchmarks' stand-in for the flush where none is wanted: one CTA whose first thread spins `ns` nanoseconds of the
// global timer (at most kMaxHoldNs, else cudaErrorInvalidValue) and touches no memory. With the device idle when the
// host starts a timed run, the start event would be recorded before the host had enqueued the launch, and the time
// would include the host's launch; held this long, the launch is queued behind the event when the device reaches it.
inline constexpr unsigned kMaxHoldNs = 10'000'000;
cudaError_t hold_stream(unsigned ns, cudaStream_t stream = nullptr);

// ---- test helpers for programmatic launches (DecodeParams::programmatic) -----------------------
struct TestCopies {
  static constexpr int kMax = 4;
  int n = 0;
  void* dst[kMax] = {};
  const void* src[kMax] = {};
  std::size_t bytes[kMax] = {};
};
// One kernel of 8 CTAs that lets a kernel launched programmatically after it start at once, waits delay_ns, then
// copies the regions (16-byte aligned): a slow writer whose output the programmatic launch must wait for.
cudaError_t test_delayed_copy(const TestCopies& c, unsigned delay_ns, cudaStream_t stream = nullptr);
// A programmatic launch that does not wait: *saw_stale = 1 if the first byte of buf was still `stale` when it read
// it. After test_delayed_copy into buf, 1 shows that programmatic launches start early on this device and setup.
cudaError_t test_stale_probe(const std::uint8_t* buf, std::uint8_t stale, int* saw_stale, cudaStream_t stream = nullptr);

}  // namespace kvq::cuda
