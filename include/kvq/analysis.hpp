// kvq/analysis.hpp: sensitivity analysis of the two MLA cache paths (QuantMLA section 2 and
// appendix B; docs/analysis.md).
//
// For one layer and one sequence, path b is the content latent C [T][dc] or the RoPE key P
// [T][dr] as cached, c_b its vectorized state (D_b = T d_b values), e_b an error on it, y the
// attention output after o_proj [T][hidden] (MlaBlock), J_b = dy/dc_b and H_b = J_b^T J_b:
//   R_b = NMSE_out / NMSE_cache for a finite error (NMSE_cache = ||e||^2 / ||c||^2,
//         NMSE_out = ||y(c + e) - y(c)||^2 / ||y(c)||^2), one path perturbed at a time;
//   G_b(e) = e^T H_b e / ||e||^2 = ||J_b e||^2 / ||e||^2      (one JVP);
//   T_b = tr(H_b) / D_b;  A_b = sum_i H_ii e_i^2 / (T_b ||e||^2);
//   O_b = sum_{i != j} H_ij e_i e_j / sum_i H_ii e_i^2;  so that G_b = T_b A_b (1 + O_b) exactly;
//   locally NMSE_out ~= NMSE_cache ||c_b||^2 / ||y||^2 G_b (i.e. R_b ~= ||c_b||^2 / ||y||^2 G_b).
// tr(H_b) and diag(H_b) are Hutchinson estimates: for Rademacher z, z^T H z = ||J z||^2 (one JVP)
// and z * (J^T (J z)) (the JVP, then one VJP) are unbiased for the trace and the diagonal.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvq/mla_attention.hpp"

namespace kvq {

enum class CachePath { kContent = 0, kRope = 1 };
const char* cache_path_name(CachePath p);  // "content" | "rope"

// ---- Block-level primitives (after MlaBlock::forward) ----------------------------------------

// Number of cached values of the path: T * dc or T * dr.
int path_size(const MlaDims& d, CachePath p);

// J_b v for a tangent v on one path ([T][hidden]).
template <class R>
void path_jvp(MlaBlock<R>& blk, CachePath p, const R* v, R* jv);
// J_b^T u for u [T][hidden] ([D_b]).
template <class R>
void path_vjp(MlaBlock<R>& blk, CachePath p, const R* u, R* ju);
// G_b(e) = ||J_b e||^2 / ||e||^2 (0 for e = 0).
template <class R>
double jvp_gain(MlaBlock<R>& blk, CachePath p, const R* e);
// The full Jacobian, one JVP per column: [T * hidden][D_b] row-major. Test sizes only.
template <class R>
std::vector<R> path_jacobian(MlaBlock<R>& blk, CachePath p);

struct HutchinsonEstimate {
  int probes = 0;
  double trace = 0, trace_se = 0;         // tr(H) and its standard error
  std::vector<double> diag, diag_se;      // diag(H) [D] and standard errors
};
// `probes` Rademacher probes from SplitMix64(seed): JVP then VJP per probe.
template <class R>
HutchinsonEstimate hutchinson(MlaBlock<R>& blk, CachePath p, int probes, std::uint64_t seed);

// ---- The gain decomposition -----------------------------------------------------------------

struct GainTerms {
  double G = 0, T = 0, A = 0, O = 0;
};
// From the quadratic form q = e^T H e, diag(H) and tr(H) (D = e.size()).
GainTerms decompose_gain(double quad, const std::vector<double>& diag, double trace, const std::vector<double>& e);
// Exact, from a dense symmetric H [D][D].
GainTerms decompose_gain_dense(const std::vector<double>& H, const std::vector<double>& e);

// ---- Statistics -----------------------------------------------------------------------------

double quantile(std::vector<double> v, double q);   // linear interpolation (q in [0, 1])
double spearman(const std::vector<double>& a, const std::vector<double>& b);  // average ranks for ties

// The cross-layer predictor log(G_P / G_C) ~= log(T_P / T_C) + log(A_P / A_C) + gamma and its
// two controls (trace only: log(T_P / T_C) + gamma; cache error only: gamma). gamma is the mean
// residual over the fit half; the scores are over the test half.
struct PredictorPoint {
  double log_g = 0, log_t = 0, log_a = 0;  // log ratios P over C
  bool fit = false;                        // in the fitting half
};
struct PredictorScore {
  std::string name;
  double gamma = 0;
  double rmse = 0;      // test-half root mean square error of log(G_P / G_C)
  double r2 = 0;        // 1 - SSE / SST around the test-half mean
  double pearson = 0;   // correlation of prediction and target on the test half (NaN for a constant)
};
std::vector<PredictorScore> fit_predictors(const std::vector<PredictorPoint>& pts);

// ---- The drivers (`kvq analyze response | jacobian`) --------------------------------------

struct AnalysisOptions {
  std::string model_dir;
  std::vector<std::string> texts;          // one cell per text and seed
  std::vector<std::uint64_t> seeds = {0, 1, 2};
  std::string cache = "c4r4";              // the cXrY format whose QDQ error direction is used
  int seqs = 8;                            // non-overlapping sequences per cell
  int seq_len = 512;                       // tokens per sequence including <|bos|>
  double nmse = 0.01;                      // cache NMSE of the perturbation (response: 0.01)
  // Jacobian only
  int probes = 256;                        // Hutchinson probes per (sequence, layer, path)
  int permutations = 16;                   // whole-token permutations per (sequence, layer, path)
  std::function<void(const std::string&)> log;
};

struct ResponseLayer {
  double r_c = 0, r_p = 0;   // mean over the cell's sequences
  double ratio = 0;          // r_P / r_C
  double block_rel_err = 0;  // max over sequences: ||y_block - y_runtime|| / ||y_runtime|| (capture check)
  // The quantizer's own (unrescaled) error: its cache NMSE and the output NMSE it causes, per path.
  double q_cache_c = 0, q_cache_p = 0, q_out_c = 0, q_out_p = 0;
};
struct ResponseCell {
  std::string text;
  std::uint64_t seed = 0;
  std::vector<ResponseLayer> layers;
  double model_ratio = 0;    // mean_l r_P / mean_l r_C
};
struct ResponseResult {
  std::vector<ResponseCell> cells;
  int n_layers = 0;
  // per layer over cells
  std::vector<double> rc_min, rc_max, rp_min, rp_max, ratio_median, ratio_q1, ratio_q3;
  double ratio_median_all = 0, ratio_q1_all = 0, ratio_q3_all = 0;  // over (layer, cell)
  double model_ratio_mean = 0, model_ratio_min = 0, model_ratio_max = 0;  // over cells
  double seconds = 0;
  std::string json;
};
ResponseResult analyze_response(const AnalysisOptions& o);

struct JacobianPath {
  GainTerms g;               // quantizer error direction, means over the cell's sequences
  double trace_rel_se = 0;   // Hutchinson standard error of tr(H) / tr(H), mean over sequences
  double finite_gain = 0;    // ||y(c + e) - y(c)||^2 / ||e||^2 at the cache NMSE
  double r_local = 0;        // ||c||^2 / ||y||^2 G (the local prediction of R)
  double r_finite = 0;       // NMSE_out / NMSE_cache measured
  // equal-energy interventions: JVP gain over the quantizer-direction gain
  double sign_change = 0, perm_change = 0, iso_change = 0;  // perm: median over permutations
  // finite gains of the interventions (sign, first permutation, isotropic)
  double sign_finite = 0, perm_finite = 0, iso_finite = 0;
  double sign_gain = 0, perm_gain = 0, iso_gain = 0;
};
struct JacobianLayer {
  JacobianPath c, p;
};
struct JacobianCell {
  std::string text;
  std::uint64_t seed = 0;
  std::vector<JacobianLayer> layers;
};
struct JacobianResult {
  std::vector<JacobianCell> cells;
  int n_layers = 0;
  std::vector<PredictorScore> predictors;  // full, trace-only, cache-error-only
  int fit_points = 0, test_points = 0;
  double spearman = 0;       // JVP vs finite gains over all (cell, layer, path, direction)
  int spearman_n = 0;
  double perm_change_median_c = 0, perm_change_median_p = 0;  // over all (cell, layer) permutations
  double sign_change_median_c = 0, sign_change_median_p = 0, iso_change_median_c = 0, iso_change_median_p = 0;
  double seconds = 0;
  std::string json;
};
JacobianResult analyze_jacobian(const AnalysisOptions& o);

}  // namespace kvq
