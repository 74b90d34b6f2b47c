// Decode launcher: split count, workspace, dispatch by head_dim, and the combine kernel that
// merges the splits' partial outputs by their log2-sum-exp and rotates TurboQuant values back
// to the model's basis (inverse block FWHT, sign diagonal, outlier-split scatter) once per row.
#include <algorithm>
#include <cmath>

#include "decode_launch.cuh"
#include "kvq_cuda.hpp"

namespace kvq::cuda {

namespace detail {

__global__ void combine_kernel(const DecodeParams p, int NS, const float* __restrict__ part_o,
                               const float* __restrict__ part_lse) {
  extern __shared__ float y[];
  const int D = p.fmt.head_dim;
  const int row = blockIdx.x;
  const int h = row % p.q_heads, b = row / p.q_heads;
  const int G = p.q_heads / p.fmt.kv_heads, kh = h / G;
  const float* lse = part_lse + static_cast<std::size_t>(row) * NS;
  const float* po = part_o + static_cast<std::size_t>(row) * NS * D;
  float M = -INFINITY;
  for (int s = 0; s < NS; ++s) M = fmaxf(M, lse[s]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float sw = 0, acc = 0;
    if (M != -INFINITY) {
      for (int s = 0; s < NS; ++s) {
        if (lse[s] == -INFINITY) continue;
        const float wgt = exp2f(lse[s] - M);
        sw += wgt;
        acc += wgt * po[static_cast<std::size_t>(s) * D + d];
      }
    }
    y[d] = sw > 0 ? acc / sw : 0.0f;
  }
  __syncthreads();
  float* out = p.out + static_cast<std::size_t>(row) * D;
  (void)b;
  if (p.fmt.value == ValueCode::kTq) {
    int off = 0;
    for (int s = 0; s < p.fmt.segments; ++s) {
      smem_fwht(y + off, p.fmt.seg_dims[s], 1, D, threadIdx.x, blockDim.x);
      off += p.fmt.seg_dims[s];
    }
    __syncthreads();
    const std::int32_t* perm = p.fmt.value_perm + static_cast<std::size_t>(kh) * D;
    const float* sg = p.fmt.value_signs + static_cast<std::size_t>(kh) * D;
    // Centered values: every row entered as v - value_mean and the weights sum to one, so the
    // mean comes back once (not for an empty history, whose output stays zero).
    const float* mu = p.fmt.value_mean && M != -INFINITY ? p.fmt.value_mean + static_cast<std::size_t>(kh) * D : nullptr;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      const int c = perm[d];
      out[c] = mu ? y[d] * sg[d] + mu[c] : y[d] * sg[d];
    }
  } else {
    for (int d = threadIdx.x; d < D; d += blockDim.x) out[d] = y[d];
  }
}

int device_sms() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return 132;
  return n;
}

}  // namespace detail

bool decode_supported(const FormatDesc& f) {
  switch (f.head_dim) {
    case 64: return detail::supported_d64(f);
    case 96: return detail::supported_d96(f);
    case 128: return detail::supported_d128(f);
    case 256: return detail::supported_d256(f);
    default: return false;
  }
}

int decode_splits(const DecodeParams& p) {
  if (p.num_splits > 0) return p.num_splits;
  const int sms = p.sm_count > 0 ? p.sm_count : detail::device_sms();
  const int chunks = std::max(1, (p.max_seq_len + detail::kChunk - 1) / detail::kChunk);
  const long units = static_cast<long>(p.batch) * std::max(1, p.fmt.kv_heads);
  // One CTA per SM (the kernels take ~190-210 KB of shared memory). Cost model: waves x (chunks
  // per CTA over the CTA's warps + a fixed prologue/epilogue of ~1.5 chunks).
  int warps = 8;
  if (p.fmt.head_dim == 128) {
    int fw = 0;
    if (detail::decode_fast_d128(p, false, &fw, 0, 0, nullptr, nullptr, nullptr) == cudaSuccess && fw > 0) warps = fw;
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
         detail::decode_fast_d128(p, false, nullptr, 0, 0, nullptr, nullptr, nullptr) == cudaSuccess;
}

std::size_t decode_workspace_bytes(const DecodeParams& p) {
  const std::size_t ns = static_cast<std::size_t>(decode_splits(p)) + (p.protect.enabled() ? 1 : 0);
  const std::size_t rows = static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.q_heads);
  return rows * ns * (static_cast<std::size_t>(p.fmt.head_dim) + 1) * sizeof(float) + 256;
}

cudaError_t decode(const DecodeParams& p, cudaStream_t stream) {
  const FormatDesc& f = p.fmt;
  if (p.batch <= 0 || f.kv_heads <= 0 || p.q_heads % f.kv_heads != 0) return cudaErrorInvalidValue;
  const int G = p.q_heads / f.kv_heads;
  if (G < 1 || G > detail::kMaxGroup || f.page.tokens != 64) return cudaErrorInvalidValue;
  if (!p.pool || !p.block_tables || !p.seq_lens || !p.q || !p.out) return cudaErrorInvalidValue;
  if (p.protect.enabled() && (!p.protect_rows || p.protect.kv_heads != f.kv_heads || p.protect.head_dim != f.head_dim))
    return cudaErrorInvalidValue;
  if (!decode_supported(f)) return cudaErrorInvalidValue;
  const int ns = decode_splits(p);
  if (!p.workspace || p.workspace_bytes < decode_workspace_bytes(p)) return cudaErrorInvalidValue;
  const int NS = ns + (p.protect.enabled() ? 1 : 0);
  const std::size_t rows = static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.q_heads);
  float* po = static_cast<float*>(p.workspace);
  float* pl = po + rows * static_cast<std::size_t>(NS) * static_cast<std::size_t>(f.head_dim);
  const int chunks = std::max(1, (p.max_seq_len + detail::kChunk - 1) / detail::kChunk);
  const int cps = (chunks + ns - 1) / ns;
  cudaError_t e = cudaErrorInvalidValue;
  switch (f.head_dim) {
    case 64: e = detail::launch_decode_d64(p, ns, cps, po, pl, stream); break;
    case 96: e = detail::launch_decode_d96(p, ns, cps, po, pl, stream); break;
    case 128: e = detail::launch_decode_d128(p, ns, cps, po, pl, stream); break;
    case 256: e = detail::launch_decode_d256(p, ns, cps, po, pl, stream); break;
    default: break;
  }
  if (e != cudaSuccess) return e;
  detail::combine_kernel<<<static_cast<unsigned>(rows), 128, static_cast<std::size_t>(f.head_dim) * sizeof(float), stream>>>(
      p, NS, po, pl);
  return cudaGetLastError();
}

}  // namespace kvq::cuda
