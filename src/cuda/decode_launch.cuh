// decode_launch.cuh: instantiation of the decode kernel for every supported format at one
// head_dim (included by decode_d64.cu, decode_d96.cu, ...; one file per head_dim keeps builds
// parallel).
#pragma once

#include "decode.cuh"

namespace kvq::cuda::detail {

// (key code, key bits hi, key bits lo, value code, value bits hi, value bits lo); lo = 0: no split.
#define KVQ_DECODE_FORMATS(X, D)                                  \
  X(D, KeyCode::kBf16, 16, 0, ValueCode::kBf16, 16, 0)            \
  X(D, KeyCode::kFp8, 8, 0, ValueCode::kUniform, 4, 0)            \
  X(D, KeyCode::kTq, 4, 0, ValueCode::kUniform, 4, 0)             \
  X(D, KeyCode::kTq, 3, 0, ValueCode::kUniform, 4, 0)             \
  X(D, KeyCode::kTq, 3, 0, ValueCode::kUniform, 3, 0)             \
  X(D, KeyCode::kTq, 4, 0, ValueCode::kTq, 4, 0)                  \
  X(D, KeyCode::kTq, 3, 0, ValueCode::kTq, 3, 0)                  \
  X(D, KeyCode::kTq, 4, 3, ValueCode::kTq, 4, 3)                  \
  X(D, KeyCode::kTq, 3, 2, ValueCode::kTq, 3, 2)

template <class C>
cudaError_t launch_decode(const DecodeParams& p, const SplitArgs& a, cudaStream_t st) {
  const PageLayout& pg = p.fmt.page;
  if (pg.tokens != 64 || pg.key_code_bytes != static_cast<std::uint32_t>(C::KCB) ||
      pg.value_code_bytes != static_cast<std::uint32_t>(C::VCB) || pg.meta_bytes != static_cast<std::uint32_t>(C::MB) ||
      pg.key_meta_bytes != static_cast<std::uint32_t>(C::KMB) || p.fmt.seg_dims[0] != C::sd(0))
    return cudaErrorInvalidValue;
  cudaError_t e = smem_limit_once<decode_kernel<C>>(C::SMEM);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(a.nsplit), static_cast<unsigned>(grid_rows(p, a)),
                  static_cast<unsigned>(p.batch));
  return launch_maybe_pdl(decode_kernel<C>, grid, dim3(C::THREADS), C::SMEM, st, p.programmatic, p, a);
}

inline bool format_is(const FormatDesc& f, KeyCode kc, int kb0, int kb1, ValueCode vc, int vb0, int vb1) {
  const int fk1 = f.segments == 2 ? f.key_bits[1] : 0, fv1 = f.segments == 2 ? f.value_bits[1] : 0;
  return f.key == kc && f.key_bits[0] == kb0 && fk1 == kb1 && f.value == vc && f.value_bits[0] == vb0 && fv1 == vb1;
}

#define KVQ_DECODE_CASE(D, KC, KB0, KB1, VC, VB0, VB1) \
  if (format_is(fmt, KC, KB0, KB1, VC, VB0, VB1))      \
    return launch_decode<Cfg<D, KC, KB0, KB1, VC, VB0, VB1>>(p, a, st);

#define KVQ_DEFINE_DECODE_FN(D, LAUNCH, SUPPORTED)                                                           \
  cudaError_t LAUNCH(const DecodeParams& p, const SplitArgs& a, cudaStream_t st) {                               \
    const FormatDesc& fmt = p.fmt;                                                                               \
    KVQ_DECODE_FORMATS(KVQ_DECODE_CASE, D)                                                                      \
    return cudaErrorInvalidValue;                                                                               \
  }                                                                                                              \
  bool SUPPORTED(const FormatDesc& fmt) {                                                                        \
    KVQ_DECODE_FORMATS(KVQ_SUPPORTED_CASE, D)                                                                   \
    return false;                                                                                                \
  }
#define KVQ_DEFINE_DECODE_D(D) KVQ_DEFINE_DECODE_FN(D, launch_decode_d##D, supported_d##D)
#define KVQ_SUPPORTED_CASE(D, KC, KB0, KB1, VC, VB0, VB1) \
  if (format_is(fmt, KC, KB0, KB1, VC, VB0, VB1)) return true;

cudaError_t launch_decode_d64(const DecodeParams&, const SplitArgs&, cudaStream_t);
cudaError_t launch_decode_d96(const DecodeParams&, const SplitArgs&, cudaStream_t);
cudaError_t launch_decode_d128(const DecodeParams&, const SplitArgs&, cudaStream_t);
cudaError_t launch_decode_d256(const DecodeParams&, const SplitArgs&, cudaStream_t);
// head_dim 128: the fast kernel (decode_fast.cuh) where it applies; cudaErrorNotSupported where
// not. launch = false only reports its warps per CTA (for the split count).
cudaError_t decode_fast_d128(const DecodeParams& p, bool launch, int* warps, const SplitArgs& a, cudaStream_t st);
// 0: the launch with ns CTAs per group merges without clusters, 1: in clusters, 2: in clusters with early sends.
int decode_fast_cluster_d128(const DecodeParams& p, int ns);
bool supported_d64(const FormatDesc&);
bool supported_d96(const FormatDesc&);
bool supported_d128(const FormatDesc&);
bool supported_d256(const FormatDesc&);

}  // namespace kvq::cuda::detail
