// Decode kernels for head_dim 128: the fast kernel (decode_fast.cuh) for up to 16 heads per CTA and the
// TurboQuant / fp8 formats (outlier splits included), the generic kernel (decode.cuh) for
// everything else.
#include "decode_fast.cuh"
#include "decode_launch.cuh"

namespace kvq::cuda::detail {

namespace {
KVQ_DEFINE_DECODE_FN(128, launch_decode_generic_d128, supported_generic_d128)

// The fast kernel's conditions other than the format. The heads per CTA need no check: cta_heads(p) <= 16 (8
// unless fast16_serves) by head_sub's construction, and the dispatch below picks the 4-, 8- or 16-head form.
bool fast_applies(const DecodeParams& p) {
  const FormatDesc& f = p.fmt;
  // The prologue reads the key permutation and signs, the split merge the value permutation and
  // signs as 16-byte vectors (LayerTables' layout is aligned so).
  const auto a16 = [](const void* x, const void* y) {
    return ((reinterpret_cast<std::uintptr_t>(x) | reinterpret_cast<std::uintptr_t>(y)) & 15u) == 0;
  };
  const bool aligned = (f.key != KeyCode::kTq || a16(f.key_perm, f.key_signs)) &&
                       (f.value != ValueCode::kTq || a16(f.value_perm, f.value_signs));
  // The fast kernel forms page offsets by a 32 x 32 -> 64-bit multiply.
  const bool page32 = f.page.page_bytes <= 0xffffffffull;
  return f.head_dim == 128 && f.kv_heads > 0 && p.q_heads % f.kv_heads == 0 && (f.segments == 1 || f.segments == 2) &&
         aligned && page32;
}

#define KVQ_FAST16_FORMAT(KC, KB, VC, VB, KB1, VB1) \
  if (format_is(p.fmt, KC, KB, KB1, VC, VB, VB1)) return !FCfg<KC, KB, VC, VB, KB1, VB1>::kValWin || p.fmt.shared_codebook;
bool fast_format(const DecodeParams& p) {
  KVQ_FAST_FORMATS(KVQ_FAST16_FORMAT)
  return false;
}
#undef KVQ_FAST16_FORMAT
}  // namespace

bool fast16_serves(const DecodeParams& p) {
  const int G = group_size(p);
  return p.sixteen_heads && G > kMaxGroup && G / head_sub(G, kMaxGroup16) > kMaxGroup &&
         fast_applies(p) && fast_format(p);
}

// Four heads per CTA for G <= 4, eight for 4 < G <= 8 (FCfg::kHG8), sixteen for more (FCfg::kHG16, fast16_serves). A
// kernel whose value pairs come from the key table (FCfg::kValWin) needs equal codebooks; without them the generic
// kernel serves the launch.
#define KVQ_FAST_CASE(KC, KB, VC, VB, KB1, VB1)                                     \
  if (format_is(p.fmt, KC, KB, KB1, VC, VB, VB1)) {                                 \
    if (FCfg<KC, KB, VC, VB, KB1, VB1>::kValWin && !p.fmt.shared_codebook)           \
      return cudaErrorNotSupported;                                                 \
    if (heads > 8) {                                                                \
      if (warps) *warps = FCfg<KC, KB, VC, VB, KB1, VB1, 16>::WARPS;                \
      if (!launch) return cudaSuccess;                                              \
      return launch_decode_fast<FCfg<KC, KB, VC, VB, KB1, VB1, 16>>(p, a, st);      \
    }                                                                               \
    if (heads > 4) {                                                                \
      if (warps) *warps = FCfg<KC, KB, VC, VB, KB1, VB1, 8>::WARPS;                 \
      if (!launch) return cudaSuccess;                                              \
      return launch_decode_fast<FCfg<KC, KB, VC, VB, KB1, VB1, 8>>(p, a, st);       \
    }                                                                               \
    if (warps) *warps = FCfg<KC, KB, VC, VB, KB1, VB1>::WARPS;                      \
    if (!launch) return cudaSuccess;                                                \
    return launch_decode_fast<FCfg<KC, KB, VC, VB, KB1, VB1>>(p, a, st);           \
  }

// Launches the fast kernel when it applies (launch = false: only reports whether it would, and
// its warps per CTA); cudaErrorNotSupported when it does not apply.
cudaError_t decode_fast_d128(const DecodeParams& p, bool launch, int* warps, const SplitArgs& a, cudaStream_t st) {
  if (!fast_applies(p)) return cudaErrorNotSupported;
  const int heads = launch ? a.heads : cta_heads(p);  // a launch's CTAs hold a.heads (decode.cu: G / head_sub)
  KVQ_FAST_FORMATS(KVQ_FAST_CASE)
  return cudaErrorNotSupported;
}
#undef KVQ_FAST_CASE

// 0: no cluster merge, 1: a cluster merge, 2: one with early sends (the kernel's early_sends: clusters of two CTAs
// without protection, FCfg::takes_early at the device's lut_pad).
template <class C>
int fast_cluster_for(const DecodeParams& p, int ns) {
  const int smem = fast_smem<C>(p);
  if (!(smem > 0 && smem_limit_once<decode_fast_kernel<C>>(smem) == cudaSuccess &&
        fast_cluster_applies<C>(p, ns, grid_rows(p), smem)))
    return 0;
  return ns == 2 && !p.protect.enabled() && C::takes_early(fast_pad<C>()) ? 2 : 1;
}
#define KVQ_FAST_CLUSTER_CASE(KC, KB, VC, VB, KB1, VB1)                              \
  if (format_is(p.fmt, KC, KB, KB1, VC, VB, VB1)) {                                  \
    if (FCfg<KC, KB, VC, VB, KB1, VB1>::kValWin && !p.fmt.shared_codebook) return 0; \
    if (heads > 8) return fast_cluster_for<FCfg<KC, KB, VC, VB, KB1, VB1, 16>>(p, ns);    \
    if (heads > 4) return fast_cluster_for<FCfg<KC, KB, VC, VB, KB1, VB1, 8>>(p, ns);     \
    return fast_cluster_for<FCfg<KC, KB, VC, VB, KB1, VB1>>(p, ns);                  \
  }

// Whether the fast kernel's launch with ns CTAs per group would merge in clusters (fast_cluster_for's answer).
int decode_fast_cluster_d128(const DecodeParams& p, int ns) {
  if (!fast_applies(p)) return 0;
  const int heads = cta_heads(p);
  KVQ_FAST_FORMATS(KVQ_FAST_CLUSTER_CASE)
  return 0;
}
#undef KVQ_FAST_CLUSTER_CASE

cudaError_t launch_decode_d128(const DecodeParams& p, const SplitArgs& a, cudaStream_t st) {
  const cudaError_t e = decode_fast_d128(p, true, nullptr, a, st);
  if (e != cudaErrorNotSupported) return e;
  return launch_decode_generic_d128(p, a, st);
}
bool supported_d128(const FormatDesc& f) { return supported_generic_d128(f); }

}  // namespace kvq::cuda::detail
