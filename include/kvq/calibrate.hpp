// kvq/calibrate.hpp: QuantMLA calibration of MLA caches (paper section 3, appendices C and D) and
// its baselines, fused offline into a Hugging Face checkpoint.
//
// Content path: the cache holds z = u R_C S_C instead of c = u Gamma (u the weightless-RMSNorm
// latent, Gamma the kv_a_layernorm weight): R_C orthogonal (Cayley parameterization), S_C a
// positive diagonal. Producer: kv_a_proj_with_mqa's latent rows W <- R_C^T W, kv_a_layernorm
// weight <- s. Consumers: kv_b_proj W <- W Gamma R_C S_C^-1. Exact in real arithmetic.
// RoPE path: per frequency pair i (the model's native pairing) the key is multiplied by
// sigma_i Rot(theta_i) and the query by sigma_i^-1 Rot(theta_i); both commute with RoPE, so they
// are fused into the pre-RoPE rows of kv_a_proj_with_mqa and q_proj (or q_b_proj). QuaRot-dagger
// instead multiplies the post-RoPE key and query by a normalized Hadamard matrix online.
//
// docs/calibration.md gives the objectives, gradients, optimizer settings and measured results.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvq/mla_attention.hpp"
#include "kvq/quantizers.hpp"

namespace kvq {

// ---- Rotations and scales ---------------------------------------------------------------------

// Cayley map R = (I - A)^-1 (I + A) of a skew-symmetric A [n][n] (row-major). Also returns
// M = (I - A)^-1 when m is not null (the backward needs it).
std::vector<double> cayley(const std::vector<double>& a, int n, std::vector<double>* m = nullptr);
// dL/dA for dL/dR = g, projected onto skew-symmetric matrices (dL/dA_ij for the free parameter
// A_ij = -A_ji, i.e. G - G^T with G = M^T g (R + I)^T).
std::vector<double> cayley_backward(const std::vector<double>& m, const std::vector<double>& r,
                                    const std::vector<double>& g, int n);
// s = exp(clip(l, -2, 2)) and its derivative mask.
double log_scale_value(double l);
double log_scale_grad(double l);  // ds/dl: s inside the clip range, 0 outside

// The RoPE frequency pairs of a model: interleaved (2i, 2i+1) (DeepSeek) or rotate-half (i, i+d/2).
struct RopePairs {
  int dr = 0;
  bool interleaved = true;
  int first(int i) const { return interleaved ? 2 * i : i; }
  int second(int i) const { return interleaved ? 2 * i + 1 : i + dr / 2; }
};

// ---- Quantize-dequantize with a straight-through estimator --------------------------------

// A per-row quantize-dequantize op with its backward. The calibration loop uses AffineSte (the
// runtime's quantizer, bit-identical); tests substitute smooth ops to check gradients.
template <class R>
class RowOp {
 public:
  virtual ~RowOp() = default;
  virtual void forward(const R* x, R* y) const = 0;
  // dx from dy at the point x (y = forward(x)).
  virtual void backward(const R* x, const R* y, const R* dy, R* dx) const = 0;
};

// AffineGroup encode + decode. Backward: rounding is the identity (STE) with its residual
// r_j = (y_j - x_j) / s held fixed, so y_j = x_j + s r_j; the group scale s = (max - min) / m
// passes its gradient to the group's max (+1/m) and min (-1/m) elements; an element clipped to
// the grid's ends (y_j = s k_j) passes none to x_j and k_j to s.
template <class R>
class AffineSte final : public RowOp<R> {
 public:
  explicit AffineSte(const AffineGroup& q) : q_(q) {}
  void forward(const R* x, R* y) const override;
  void backward(const R* x, const R* y, const R* dy, R* dx) const override;

 private:
  const AffineGroup& q_;
};

// ---- Objectives -------------------------------------------------------------------------------

// One layer's frozen weights, in the layout MlaBlock takes.
template <class R>
struct MlaLayerWeights {
  MlaDims dims;                 // T is set per sample
  R scale = 0;                  // softmax scale
  std::vector<R> gamma;         // kv_a_layernorm weight [dc]
  std::vector<R> w_uv;          // [H][vd][dc]
  std::vector<R> w_o;           // [hidden][H * vd]
};

// One captured sequence of one layer (the teacher: exact fp32 cache).
template <class R>
struct MlaSample {
  int T = 0;
  std::vector<R> u;   // weightless-normalized latent [T][dc]
  std::vector<R> qa;  // absorbed content query [T][H][dc]
  std::vector<R> qr;  // RoPE query after RoPE [T][H][dr]
  std::vector<R> p;   // RoPE key after RoPE [T][dr]
  std::vector<R> y;   // attention output after o_proj [T][hidden]
};

// Content transform (R [dc][dc] orthogonal or any invertible matrix, s [dc] nonzero).
// Loss = mean((y_hat - y)^2) / max(mean(y^2), 1e-8) with the cache z = u R diag(s) passed
// through `op` (null: exact) and consumed as C = op(z) diag(1/s) R^T Gamma; RoPE path exact.
// With dr / ds not null, adds the gradients (dL/dR, dL/ds) to them.
template <class R>
double content_objective(const MlaLayerWeights<R>& w, const MlaSample<R>& x, const R* rot, const R* s,
                         const RowOp<R>* op, R* drot = nullptr, R* ds = nullptr);

// RoPE transform (per pair angle and scale). Loss = sum over heads and causal pairs (s <= t) of
// (q~_t . op(k~_s) - q_t . k_s)^2 / max(sum (q_t . k_s)^2, 1e-8) with k~ = sigma Rot(theta) k,
// q~ = sigma^-1 Rot(theta) q. With `hadamard`, angle and scale are ignored and k~ = k H,
// q~ = q H (normalized Hadamard; QuaRot-dagger). Gradients are added when not null.
template <class R>
double rope_objective(const MlaSample<R>& x, int H, const RopePairs& pairs, const R* angle, const R* scale,
                      bool hadamard, const RowOp<R>* op, R* dangle = nullptr, R* dscale = nullptr);

// Attention-output objective (as content_objective) with the content path exact and the RoPE
// path transformed and quantized (SmoothQuant-dagger selects its RoPE alpha with it).
template <class R>
double rope_output_objective(const MlaLayerWeights<R>& w, const MlaSample<R>& x, const RopePairs& pairs,
                             const R* angle, const R* scale, bool hadamard, const RowOp<R>* op);

// The frozen attention weights of every layer of an MLA checkpoint in MlaBlock's layout
// (kv_a_layernorm gamma, kv_b_proj's W_UV rows per head, o_proj), dims.T left 0. kvq::Error when
// gamma has a zero channel (the weightless latent u = c / gamma is then undefined).
std::vector<MlaLayerWeights<float>> load_mla_layer_weights(const std::string& model_dir);

// Runs `model` (an MLA model) on each token sequence (positions from 0) with an exact fp32 cache
// and returns, per layer, one sample per sequence: u, qa, qr, p from the runtime's own rows and
// the teacher y recomputed by MlaBlock from the exact cache. kvq::Error naming the layer and
// sequence on a non-finite activation.
class Model;
std::vector<std::vector<MlaSample<float>>> capture_mla_samples(Model& model, const std::vector<MlaLayerWeights<float>>& w,
                                                               const std::vector<std::vector<std::int32_t>>& seqs);

// ---- Fusion -----------------------------------------------------------------------------------

// Producer rows: w [dc][in] <- R^T w.
void fuse_content_producer(float* w, int dc, int in, const double* rot);
// Consumer: w [rows][dc] <- w diag(gamma) R diag(1/s).
void fuse_content_consumer(float* w, int rows, int dc, const float* gamma, const double* rot, const double* s);
// RoPE rows [dr][in] (pre-RoPE projection rows of one head or the shared key): per pair
// rows <- f * Rot(theta) rows with f = scale (key) or 1/scale (query, `inverse_scale`).
void fuse_rope_rows(float* w, int dr, int in, const RopePairs& pairs, const double* angle, const double* scale,
                    bool inverse_scale);

// Per-layer learned (or fixed) transforms.
struct LayerTransform {
  std::vector<double> rotation;  // [dc][dc]; empty = identity
  std::vector<double> scale;     // [dc]; empty = 1 (with a rotation, gamma still moves into kv_b_proj)
  std::vector<double> angle;     // [dr / 2]; empty = 0
  std::vector<double> rope_scale;  // [dr / 2]; empty = 1
};

// Reads the checkpoint in `model_dir`, fuses the transforms (one per layer) and writes a complete
// model into the existing, empty directory `dir`: config.json, the tokenizer files, one
// model.safetensors in `dtype` (kSource keeps each tensor's dtype, bf16 / f16 / f32), and
// `calibration_json` as kvq_calibration.json when not empty. Returns the FNV-1a 64 checksum of
// model.safetensors as hex. The caller owns the directory (`calibrate` writes into OUT.tmp and
// renames it when everything has been checked).
enum class FuseDtype { kSource, kF32 };
std::string fuse_into(const std::string& model_dir, const std::vector<LayerTransform>& transforms, const std::string& dir,
                      FuseDtype dtype, const std::string& calibration_json);

// FNV-1a 64-bit of a file's bytes, as 16 hex digits.
std::string file_checksum(const std::string& path);

// ---- The calibration driver (`kvq calibrate`) ------------------------------------------------

enum class CalibMethod { kQuantMla, kSmoothQuant, kQuaRot };
CalibMethod parse_calib_method(const std::string& name);
std::string calib_method_name(CalibMethod m);

struct CalibOptions {
  std::string model_dir, text_file, out_dir;
  std::string cache = "c4r4";
  CalibMethod method = CalibMethod::kQuantMla;
  // Which paths get their transform (ablations): the other path keeps the identity (RTN).
  bool content_path = true, rope_path = true;
  int steps = 300;
  int train_seqs = 128;
  int heldout_seqs = 32;
  int seq_len = 256;
  int rope_seq_len = 0;  // sequence length of the RoPE path's samples (0: seq_len)
  int batch = 4;         // sequences per Adam step
  int eval_every = 25;   // held-out objective cadence for best-checkpoint selection
  std::uint64_t seed = 0;
  double lr_rotation = 2e-3, lr_scale = 1e-2, lr_angle = 1e-2;
  FuseDtype dtype = FuseDtype::kSource;
  int check_seqs = 4;    // held-out sequences of the quantization-disabled fusion check
  // out_dir must be absent or an empty directory; with overwrite it may also be an earlier output of
  // kvq calibrate (a directory with kvq_calibration.json), which the finished model replaces. Never the
  // model directory, a directory that holds it, or the working directory (check_calib_output).
  bool overwrite = false;
  std::function<void(const std::string&)> log;  // progress lines (may be empty)
};

// Refuses (kvq::Error, nothing written or removed) an output directory that calibrate must not
// replace; see CalibOptions::overwrite. Returns its absolute, normalized path.
std::string check_calib_output(const std::string& out_dir, const std::string& model_dir, bool overwrite);

struct PathResult {
  double rtn = 0;      // held-out objective of the plain cache (RTN)
  double init = 0;     // after the alpha search (QuantMLA, SmoothQuant-dagger) / fixed transform
  double best = 0;     // selected checkpoint (== init without training)
  double alpha = -1;   // selected alpha (-1: none)
  int best_step = 0;
};
struct LayerResult {
  PathResult content, rope;
  double rope_output_rtn = 0, rope_output_best = 0;  // RoPE path scored by attention-output NMSE
};
struct CalibResult {
  std::vector<LayerResult> layers;
  double fusion_max_rel_err = 0;   // quantization off, fused fp32 vs original, max over layers
  double nll_original = 0, nll_fused_f32 = 0, nll_saved = 0;
  std::string checksum;
  double seconds = 0;
  std::string json;                // the kvq_calibration.json written
};

CalibResult calibrate(const CalibOptions& o);

}  // namespace kvq
