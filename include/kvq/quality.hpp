// kvq/quality.hpp: `kvq eval`'s measurements, as a library.
//
// For one model and a list of cache configurations (a format plus a protection policy):
//  - perplexity by the protocol of models/README.md, with every query attending to history as
//    decode would see it (the paged cache serves prefill too);
//  - KL(P_bf16 || P_format) averaged over every prediction and top-1 agreement, against the
//    same runtime with a bf16 cache, window by window;
//  - needle retrieval (the fixtures' secret-code task), the same seeded samples for every
//    configuration, scored teacher-forced (equal to greedy exact match);
//  - per-layer attention diagnostics on the bf16 run's queries, keys and values with one
//    layer's cache quantized at a time: logit RMSE, total-variation distance, top-8 overlap,
//    output NMSE.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvq/model.hpp"
#include "kvq/paged_cache.hpp"
#include "kvq/tokenizer.hpp"

namespace kvq {

struct CacheConfig {
  std::string label;   // as given on the command line ("c4r4@paper")
  std::string format;  // registry name
  ProtectionPolicy protect;
};
// "FORMAT" (with the default policy) or "FORMAT@paper" / "FORMAT@s4,w128,n1".
CacheConfig parse_cache_config(const std::string& spec, const ProtectionPolicy& default_policy);

struct EvalOptions {
  int ctx = 2048;
  int windows = 8;                 // 0: every full window
  int needle_samples = 0;          // per length; 0 disables
  std::vector<int> needle_lengths = {256, 512, 1024, 2000};
  std::uint64_t seed = 20261129;
  bool diagnostics = true;
  int diag_queries = 64;           // query positions sampled from the first window
  int calib_tokens = 16384;        // outlier calibration, from the calibration text
  std::string calib_text;          // data/validation-tech.txt (never the evaluation text)
  std::string needle_words_text;   // words for the needle (data/validation-tech.txt)
  // When set, the bf16 reference (bf16 ppl, KL, top-1, needle pairing) is this model with a bf16
  // cache instead of the evaluated model: a calibrated (re-parameterized) model is then compared
  // with the original it came from. Same tokenizer, vocabulary and cache geometry required.
  std::string baseline_model;
  std::function<void(const std::string&, double)> progress;  // (stage, fraction done)
};

struct LayerDiagnostics {
  double logit_rmse = 0, tv = 0, top8 = 0, out_nmse = 0;
};

struct ConfigResult {
  CacheConfig config;
  double bits_per_value = 0;      // K+V codes and metadata, protection excluded
  double bytes_per_token = 0;     // all layers, format bytes (protection excluded)
  double compression = 0;         // bf16 bytes / bytes_per_token
  double ppl = 0, mean_nll = 0, delta_ppl_pct = 0;
  double kl = 0, top1 = 0;
  std::map<int, double> needle_acc;       // length -> accuracy
  std::map<int, int> needle_disagree;     // length -> samples whose correctness differs from bf16
  std::vector<LayerDiagnostics> layers;
  double seconds = 0;
};

struct ModelEvalResult {
  std::string model_dir, architecture;
  std::string baseline_model;  // empty: the bf16 reference is model_dir itself
  CacheGeometry geometry;
  int windows = 0;
  std::int64_t predictions = 0;
  int needle_samples = 0;
  double bf16_ppl = 0;
  std::map<int, double> bf16_needle;
  std::string blas_kernels;  // kvq::blas_kernels() of the run
  std::vector<ConfigResult> rows;
};

ModelEvalResult evaluate_model(const std::string& model_dir, const std::vector<CacheConfig>& configs,
                               const std::string& text_path, const EvalOptions& opt);

// The calibration of format `f` (outlier channels, channel means) from `tokens` tokens of
// `text` (bf16 run, rows as cached: keys after RoPE). Null for formats that learn nothing.
std::shared_ptr<FormatCalibration> calibrate_format(Model& model, const Tokenizer& tok, const std::string& text,
                                                    const FormatSpec& f, int tokens, int ctx);
bool format_needs_calibration(const FormatSpec& f);
// A bf16 paged cache that has collected channel statistics over `tokens` tokens of `text`;
// its calibration(f) serves every format.
std::unique_ptr<PagedCache> calibration_stats(Model& model, const Tokenizer& tok, const std::string& text, int tokens,
                                              int ctx);

// The needle samples of models/README.md's protocol.
struct NeedleSample {
  std::vector<std::int32_t> tokens;  // bos + filler/needle + question + answer
  int answer_start = 0;              // index of the first answer token
  int length = 0;
  double depth = 0;
};
std::vector<NeedleSample> make_needle_samples(const Tokenizer& tok, const std::vector<std::int32_t>& filler_stream,
                                              const std::vector<std::string>& words, int length, int count,
                                              std::uint64_t seed, std::int32_t bos);
// Lowercase alphabetic words of 4-9 letters from a text, deduplicated, in order of appearance.
std::vector<std::string> needle_words(const std::string& text);

}  // namespace kvq
