// Decode launcher: split count, workspace, dispatch by head_dim. One kernel launch: the last CTA
// of each (sequence, KV head) merges the splits' partial outputs (finish_group in decode.cuh), or,
// for the fast kernel where the device holds them, the group's CTAs form a cluster and merge through
// distributed shared memory (finish_cluster in decode_fast.cuh).
#include <algorithm>
#include <atomic>
#include <cmath>

#include "decode_launch.cuh"
#include "kvq_cuda.hpp"

namespace kvq::cuda {

namespace {
// Sub-groups of query heads per KV head (decode.cuh): the smallest divisor S of G with G / S <= M (8, or 16).
static_assert(detail::head_sub(1) == 1 && detail::head_sub(8) == 1 && detail::head_sub(9) == 3 &&
                  detail::head_sub(10) == 2 && detail::head_sub(12) == 2 && detail::head_sub(16) == 2 &&
                  detail::head_sub(18) == 3 && detail::head_sub(11) == 11 && detail::head_sub(64) == 8,
              "head_sub");
static_assert(detail::head_sub(9, 16) == 1 && detail::head_sub(16, 16) == 1 && detail::head_sub(17, 16) == 17 &&
                  detail::head_sub(18, 16) == 2 && detail::head_sub(32, 16) == 2 && detail::head_sub(48, 16) == 3 &&
                  detail::head_sub(64, 16) == 4,
              "head_sub, sixteen heads");
// y / S as umulhi(y, sub_magic(S)) for every grid row y < 2^16 (cta_row in decode.cuh).
constexpr bool sub_magic_exact(int S) {
  const auto q = [S](unsigned y) {
    return static_cast<unsigned>((static_cast<unsigned long long>(y) * detail::sub_magic(S)) >> 32);
  };
  for (unsigned y = 0; y < 65536; y += 97)
    if (q(y) != y / S) return false;
  return q(65535) == 65535u / S;
}
static_assert(sub_magic_exact(2) && sub_magic_exact(3) && sub_magic_exact(7) && sub_magic_exact(11) &&
                  sub_magic_exact(127) && sub_magic_exact(1024),
              "sub_magic");
// 32-token chunks of the longest sequence (at least 1): the packed range the splits divide, before the protected
// rows' share.
int packed_chunks(const DecodeParams& p) {
  return std::max(1, (p.max_seq_len + detail::kChunk - 1) / detail::kChunk);
}
}  // namespace

bool decode_supported(const FormatDesc& f) {
  switch (f.head_dim) {
    case 64: return detail::supported_d64(f);
    case 96: return detail::supported_d96(f);
    case 128: return detail::supported_d128(f);
    case 256: return detail::supported_d256(f);
    default: return false;
  }
}

int decode_protect_chunks(const DecodeParams& p) {
  if (!p.protect.enabled()) return 0;
  if (p.protect_chunks >= 0) return p.protect_chunks;
  // Split 0 reads the protected rows after its packed ones (protected_split): a chain of dependent round trips taken
  // while the other CTAs stream pages, ~13-16 us for the paper's 4 + 128 rows on an H100, where a chunk of packed rows
  // takes a CTA ~0.2 us. A chunk per protected row (132 for the paper's): of the shares 22, 44, 66, 88 and 132 it was
  // the fastest or within 0.3% of it at batch 8 (two splits) x 16K / 64K for every fast format (8 x 16K: 1.07-1.16x
  // faster than 22); with one split (batch 32) the share changes nothing
  // (bench/results/decode-gqa-protect-staged-2026-12-08.md). At most a third of the longest sequence's chunks (42 at
  // 4K, the slots from ~12.7K up): at short context a share of 132 would leave split 0 only the protected rows and
  // hand all packed chunks to the other splits (at 4K with two splits, one CTA per group streaming all 128), which
  // no run has measured.
  return std::max(1, std::min(p.protect.slots(), packed_chunks(p) / 3));
}

int decode_splits(const DecodeParams& p) {
  if (p.num_splits > 0) return p.num_splits;
  const int sms = p.sm_count > 0 ? p.sm_count : detail::device_sms();
  // The virtual range: the packed chunks and the protected rows' share (split 0's).
  const int chunks = packed_chunks(p) + decode_protect_chunks(p);
  const long units = static_cast<long>(p.batch) * std::max(1, detail::grid_rows(p));
  // One CTA per SM (the kernels take ~190-210 KB of shared memory). Cost model: waves x (chunks
  // per CTA over the CTA's warps + a fixed prologue/epilogue of ~1.5 chunks).
  int warps = 8;
  if (p.fmt.head_dim == 128) {
    int fw = 0;
    if (detail::decode_fast_d128(p, false, &fw, detail::SplitArgs{}, nullptr) == cudaSuccess && fw > 0) warps = fw;
  }
  int best = 1;
  double best_t = 1e30;
  for (int ns = 1; ns <= std::min(chunks, 256); ++ns) {
    const int cps = (chunks + ns - 1) / ns;
    const int ns_eff = (chunks + cps - 1) / cps;
    if (ns_eff != ns) continue;
    const double waves = std::ceil(static_cast<double>(units * ns) / sms);
    const double t = waves * (std::ceil(static_cast<double>(cps) / warps) + 1.5);
    if (t < best_t - 1e-9) {
      best_t = t;
      best = ns;
    }
  }
  return best;
}

bool decode_uses_fast_kernel(const DecodeParams& p) {
  return p.fmt.head_dim == 128 &&
         detail::decode_fast_d128(p, false, nullptr, detail::SplitArgs{}, nullptr) == cudaSuccess;
}

int decode_cta_heads(const DecodeParams& p) { return detail::cta_heads(p); }

namespace {
// decode_fast_cluster_d128's answer for the launch decode(p) makes (0 where the fast kernel does not serve it).
int cluster_mode(const DecodeParams& p) {
  return decode_uses_fast_kernel(p) ? detail::decode_fast_cluster_d128(p, decode_splits(p)) : 0;
}
}  // namespace

bool decode_uses_cluster_merge(const DecodeParams& p) { return cluster_mode(p) > 0; }

bool decode_uses_early_sends(const DecodeParams& p) { return cluster_mode(p) == 2; }

namespace {
// Workspace: the groups' arrival counters (8 bytes per sequence x grid row, i.e. KV head x head_sub, 256-byte
// aligned), then the partial outputs [rows][NS][D] and their log2-sum-exps [rows][NS].
std::size_t counter_bytes(const DecodeParams& p) {
  const std::size_t n = static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(std::max(1, detail::grid_rows(p)));
  return (n * sizeof(unsigned long long) + 255) / 256 * 256;
}
// A new tag per launch (never 0, the reset state of a counter).
unsigned next_epoch() {
  static std::atomic<unsigned> epoch{0};
  unsigned e = epoch.fetch_add(1) + 1;
  while (e == 0) e = epoch.fetch_add(1) + 1;
  return e;
}
// The workspace for `splits` splits of the packed range (decode() has the count already).
std::size_t workspace_bytes(const DecodeParams& p, int splits) {
  const std::size_t ns = static_cast<std::size_t>(splits) + (p.protect.enabled() ? 1 : 0);
  const std::size_t rows = static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.q_heads);
  return counter_bytes(p) + rows * ns * (static_cast<std::size_t>(p.fmt.head_dim) + 1) * sizeof(float) + 256;
}
}  // namespace

std::size_t decode_workspace_bytes(const DecodeParams& p) { return workspace_bytes(p, decode_splits(p)); }

cudaError_t decode(const DecodeParams& p, cudaStream_t stream) {
  const FormatDesc& f = p.fmt;
  if (p.batch <= 0 || f.kv_heads <= 0 || p.q_heads % f.kv_heads != 0) return cudaErrorInvalidValue;
  // More query heads per KV head than a CTA holds (8, or 16: cta_limit): head_sub grid rows per KV head
  // (decode.cuh).
  const int G = p.q_heads / f.kv_heads;
  if (G < 1 || f.page.tokens != 64) return cudaErrorInvalidValue;
  detail::SplitArgs a;
  a.head_sub = detail::head_sub(G, detail::cta_limit(p));
  a.group = G;
  a.heads = G / a.head_sub;
  a.sub_magic = a.head_sub > 1 ? detail::sub_magic(a.head_sub) : 0u;
  if (detail::grid_rows(p, a) > 65535) return cudaErrorInvalidValue;  // the grid's y extent
  if (!p.pool || !p.block_tables || !p.seq_lens || !p.q || !p.out) return cudaErrorInvalidValue;
  if (p.protect.enabled() && (!p.protect_rows || p.protect.kv_heads != f.kv_heads || p.protect.head_dim != f.head_dim))
    return cudaErrorInvalidValue;
  if (!decode_supported(f)) return cudaErrorInvalidValue;
  if (p.test_send_delay_ns < 0 || p.test_send_delay_ns > 1000000) return cudaErrorInvalidValue;
  const int ns = decode_splits(p);
  if (!p.workspace || p.workspace_bytes < workspace_bytes(p, ns)) return cudaErrorInvalidValue;
  if (reinterpret_cast<std::uintptr_t>(p.workspace) % 16 != 0) return cudaErrorInvalidValue;
  const int NS = ns + (p.protect.enabled() ? 1 : 0);
  const std::size_t rows = static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.q_heads);
  a.nsplit = ns;
  a.prot_chunks = decode_protect_chunks(p);
  const int chunks = packed_chunks(p) + a.prot_chunks;
  a.cps = (chunks + ns - 1) / ns;
  a.counters = static_cast<unsigned long long*>(p.workspace);
  a.part_o = reinterpret_cast<float*>(static_cast<std::uint8_t*>(p.workspace) + counter_bytes(p));
  a.part_lse = a.part_o + rows * static_cast<std::size_t>(NS) * static_cast<std::size_t>(f.head_dim);
  a.epoch = next_epoch();
  cudaError_t e = cudaErrorInvalidValue;
  switch (f.head_dim) {
    case 64: e = detail::launch_decode_d64(p, a, stream); break;
    case 96: e = detail::launch_decode_d96(p, a, stream); break;
    case 128: e = detail::launch_decode_d128(p, a, stream); break;
    case 256: e = detail::launch_decode_d256(p, a, stream); break;
    default: break;
  }
  return e;
}

}  // namespace kvq::cuda
