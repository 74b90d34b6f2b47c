// kvq/mla_attention.hpp: one MLA attention block in the absorbed form, with its reverse-mode
// (VJP) and forward-mode (JVP) derivatives with respect to the two cached paths.
//
// For one sequence of T tokens at positions 0..T-1 (causal), H heads:
//   S_h[t][s] = scale * (qa[t][h] . C[s] + qr[t][h] . P[s])          (s <= t)
//   A_h = softmax_row(S_h),  O_h = A_h C  (latent space, [T][dc])
//   v[t][h] = W_UV_h O_h[t]  ([vd]),  y[t] = W_O v[t]  ([hidden])
// qa is the absorbed content query (W_UK^T q_nope), qr the RoPE query after RoPE, C the cached
// content latent (kv_a_layernorm output) and P the cached RoPE key after RoPE: exactly what the
// runtime gives the cache, so y equals the runtime's attention output after o_proj.
//
// The calibration objectives (kvq/calibrate.hpp) and the sensitivity analysis use it; both run it
// in float (speed) and double (gradient checks). Everything is plain row-major BLAS.
#pragma once

#include <vector>

namespace kvq {

struct MlaDims {
  int T = 0;       // tokens
  int H = 0;       // query heads
  int dc = 0;      // latent (kv_lora_rank)
  int dr = 0;      // RoPE key dims
  int vd = 0;      // value head dim
  int hidden = 0;  // o_proj output
};

template <class R>
class MlaBlock {
 public:
  // w_uv: [H][vd][dc] (kv_b_proj's value rows per head), w_o: [hidden][H * vd] (o_proj). The
  // pointers must outlive the block.
  MlaBlock(const MlaDims& d, const R* w_uv, const R* w_o, R scale);

  const MlaDims& dims() const { return d_; }

  // y [T][hidden]. Keeps pointers to qa [T][H][dc], qr [T][H][dr], C [T][dc], P [T][dr] and the
  // attention probabilities for backward/jvp, which must follow with the same inputs alive.
  void forward(const R* qa, const R* qr, const R* C, const R* P, R* y);
  // Vector-Jacobian product: dy [T][hidden] -> dC [T][dc], dP [T][dr] (overwritten); dqa, dqr
  // (same shapes as qa, qr) when not null.
  void backward(const R* dy, R* dC, R* dP, R* dqa = nullptr, R* dqr = nullptr);
  // Jacobian-vector product: tangents dC [T][dc], dP [T][dr] (either may be null = zero) -> dy.
  void jvp(const R* dC, const R* dP, R* dy);

 private:
  MlaDims d_;
  const R* w_uv_;
  const R* w_o_;
  R scale_;
  const R *qa_ = nullptr, *qr_ = nullptr, *C_ = nullptr, *P_ = nullptr;
  std::vector<R> prob_;  // [H][T][T], zero above the diagonal
};

// Row-major GEMM over float or double: C = alpha op(A) op(B) + beta C, op = transpose when ta/tb.
// Single-threaded BLAS call (callers parallelize over sequences).
template <class R>
void gemm(bool ta, bool tb, int m, int n, int k, R alpha, const R* a, int lda, const R* b, int ldb, R beta, R* c,
          int ldc);

}  // namespace kvq
