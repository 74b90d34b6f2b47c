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

bool decode_supported(const FormatDesc& f) {
  switch (f.head_dim) {
    case 64: return detail::supported_d64(f);
    case 96: return detail::supported_d96(f);
    case 128: return detail::supported_d128(f);
    case 256: return detail::supported_d256(f);
    default: return false;
  }
}

namespace {
// More query heads per KV head than one CTA holds (G > kMaxGroup): the heads of each KV head run in S = ceil(G /
// kMaxGroup) sub-groups of ceil(G / S) heads (the last may have fewer), one launch each with the group's queries
// gathered into the workspace and its outputs scattered back. Each sub-group reads the KV head's pages again.
struct HeadSplit {
  int G = 1, S = 1, Gs = 1;
  int heads(int s) const { return std::min(Gs, G - s * Gs); }
};
HeadSplit head_split(const DecodeParams& p) {
  HeadSplit h;
  h.G = p.fmt.kv_heads > 0 ? std::max(1, p.q_heads / p.fmt.kv_heads) : 1;
  h.S = (h.G + detail::kMaxGroup - 1) / detail::kMaxGroup;
  h.Gs = (h.G + h.S - 1) / h.S;
  return h;
}
// The parameters of sub-group s (q, out and the workspace are set by decode()).
DecodeParams sub_group_params(const DecodeParams& p, const HeadSplit& h, int s) {
  DecodeParams ps = p;
  ps.q_heads = p.fmt.kv_heads * h.heads(s);
  return ps;
}
std::size_t align256(std::size_t n) { return (n + 255) / 256 * 256; }
}  // namespace

int decode_splits(const DecodeParams& p0) {
  if (p0.num_splits > 0) return p0.num_splits;
  const DecodeParams p = sub_group_params(p0, head_split(p0), 0);  // G > kMaxGroup: every sub-group's launch
  const int sms = p.sm_count > 0 ? p.sm_count : detail::device_sms();
  const int chunks = std::max(1, (p.max_seq_len + detail::kChunk - 1) / detail::kChunk);
  const long units = static_cast<long>(p.batch) * std::max(1, p.fmt.kv_heads);
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

bool decode_uses_fast_kernel(const DecodeParams& p0) {
  const DecodeParams p = sub_group_params(p0, head_split(p0), 0);
  return p.fmt.head_dim == 128 &&
         detail::decode_fast_d128(p, false, nullptr, detail::SplitArgs{}, nullptr) == cudaSuccess;
}

bool decode_uses_cluster_merge(const DecodeParams& p0) {
  const DecodeParams p = sub_group_params(p0, head_split(p0), 0);
  return decode_uses_fast_kernel(p) &&
         detail::decode_fast_cluster_d128(p, decode_splits(p) + (p.protect.enabled() ? 1 : 0));
}

namespace {
// Workspace: the groups' arrival counters (8 bytes per sequence x KV head, 256-byte aligned),
// then the partial outputs [rows][NS][D] and their log2-sum-exps [rows][NS].
std::size_t counter_bytes(const DecodeParams& p) {
  const std::size_t n = static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(std::max(1, p.fmt.kv_heads));
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

namespace {
// Bytes of one sub-group's gathered queries (and of its outputs): [batch][kv_heads][Gs][head_dim] floats.
std::size_t sub_group_rows_bytes(const DecodeParams& p, const HeadSplit& h) {
  return align256(static_cast<std::size_t>(std::max(0, p.batch)) * static_cast<std::size_t>(std::max(0, p.fmt.kv_heads)) *
                  static_cast<std::size_t>(h.Gs) * static_cast<std::size_t>(std::max(0, p.fmt.head_dim)) * sizeof(float));
}
cudaError_t decode_group(const DecodeParams& p, cudaStream_t stream);
}  // namespace

std::size_t decode_workspace_bytes(const DecodeParams& p) {
  const HeadSplit h = head_split(p);
  if (h.S == 1) return workspace_bytes(p, decode_splits(p));
  std::size_t need = 0;
  for (int s = 0; s < h.S; ++s) {
    const DecodeParams ps = sub_group_params(p, h, s);
    need = std::max(need, workspace_bytes(ps, decode_splits(ps)));
  }
  return 2 * sub_group_rows_bytes(p, h) + need;
}

cudaError_t decode(const DecodeParams& p, cudaStream_t stream) {
  const FormatDesc& f = p.fmt;
  if (p.batch <= 0 || f.kv_heads <= 0 || p.q_heads <= 0 || p.q_heads % f.kv_heads != 0) return cudaErrorInvalidValue;
  const HeadSplit h = head_split(p);
  if (h.S == 1) return decode_group(p, stream);
  // G > kMaxGroup: one launch per sub-group of heads. The workspace holds the sub-group's gathered queries and
  // outputs first, then what the launch itself needs.
  if (!p.q || !p.out || !p.workspace || p.workspace_bytes < decode_workspace_bytes(p)) return cudaErrorInvalidValue;
  if (reinterpret_cast<std::uintptr_t>(p.workspace) % 16 != 0) return cudaErrorInvalidValue;
  const std::size_t rows_b = sub_group_rows_bytes(p, h);
  float* const qs = static_cast<float*>(p.workspace);
  float* const os = reinterpret_cast<float*>(static_cast<std::uint8_t*>(p.workspace) + rows_b);
  const std::size_t D = static_cast<std::size_t>(f.head_dim), pitch = static_cast<std::size_t>(h.G) * D * sizeof(float);
  const std::size_t groups = static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(f.kv_heads);
  for (int s = 0; s < h.S; ++s) {
    DecodeParams ps = sub_group_params(p, h, s);
    const std::size_t width = static_cast<std::size_t>(h.heads(s)) * D * sizeof(float);
    const std::size_t off = static_cast<std::size_t>(s) * static_cast<std::size_t>(h.Gs) * D;
    // Query rows (b, KV head k, head s Gs + j) lie at (b kv_heads + k) G + s Gs + j: one row block per group.
    cudaError_t e = cudaMemcpy2DAsync(qs, width, p.q + off, pitch, width, groups, cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return e;
    ps.q = qs;
    ps.out = os;
    ps.workspace = static_cast<std::uint8_t*>(p.workspace) + 2 * rows_b;
    ps.workspace_bytes = p.workspace_bytes - 2 * rows_b;
    if ((e = decode_group(ps, stream)) != cudaSuccess) return e;
    e = cudaMemcpy2DAsync(p.out + off, pitch, os, width, width, groups, cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

namespace {
cudaError_t decode_group(const DecodeParams& p, cudaStream_t stream) {
  const FormatDesc& f = p.fmt;
  if (p.batch <= 0 || f.kv_heads <= 0 || p.q_heads % f.kv_heads != 0) return cudaErrorInvalidValue;
  const int G = p.q_heads / f.kv_heads;
  if (G < 1 || G > detail::kMaxGroup || f.page.tokens != 64) return cudaErrorInvalidValue;
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
  detail::SplitArgs a;
  a.nsplit = ns;
  const int chunks = std::max(1, (p.max_seq_len + detail::kChunk - 1) / detail::kChunk);
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
}  // namespace

}  // namespace kvq::cuda
