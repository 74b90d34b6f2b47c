// kvq/model.hpp: the CPU model runtime: Hugging Face config.json + safetensors loading and the
// forward pass of Llama-family (Llama, Mistral, Qwen2, Qwen3) and DeepSeek-V2/V3 (MLA + MoE)
// causal language models.
//
// The forward pass keeps every activation in fp32 (weights are converted to fp32 at load) and
// reaches the KV cache only through kvq::KvCache: per layer it appends the rows it produced and
// asks the cache to attend. MLA models attend in the absorbed form (the cache holds the
// normalized latent and the rope key after RoPE; W_UK is folded into the query and W_UV applied to
// the latent-space output), so a quantized cache sees exactly the rows a bf16 one would.
// docs/runtime.md lists the supported config fields and the numerics.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvq/kv_cache.hpp"

namespace kvq {

enum class Arch { kLlama, kDeepseekV2, kDeepseekV3 };

struct RopeConfig {
  std::string type = "default";  // "default", "yarn", "llama3" or "linear"
  double theta = 10000.0;
  int dim = 0;                    // rotated dims per head
  bool interleaved = false;       // DeepSeek: pairs (2i, 2i+1); Llama: rotate-half pairs (i, i + dim/2)
  // YaRN, llama3 (factor, original_max_position_embeddings, low / high_freq_factor), linear (factor)
  double factor = 1.0;
  int original_max_position_embeddings = 0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 0.0, mscale_all_dim = 0.0;
  bool truncate = true;
  double attention_factor = 1.0;  // multiplies cos and sin (YaRN); 1 for default RoPE
};

enum class MoeScoring { kSoftmax, kSigmoid };
enum class TopkMethod { kGreedy, kGroupLimitedGreedy, kNoauxTc };

struct MoeConfig {
  int n_routed_experts = 0;  // 0: no MoE layers
  int n_shared_experts = 0;
  int top_k = 0;             // num_experts_per_tok
  int moe_intermediate_size = 0;
  int first_k_dense_replace = 0;
  int moe_layer_freq = 1;
  int n_group = 1;
  int topk_group = 1;
  TopkMethod topk_method = TopkMethod::kGreedy;
  MoeScoring scoring = MoeScoring::kSoftmax;
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
  bool correction_bias = false;  // e_score_correction_bias present (noaux_tc)
};

struct ModelConfig {
  std::string architecture;  // architectures[0]
  std::string model_type;
  Arch arch = Arch::kLlama;
  int vocab_size = 0;
  int hidden_size = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;          // GQA head dim (q, k and v)
  int intermediate_size = 0;
  int max_position_embeddings = 0;
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;     // Qwen2 always; Llama/Qwen3 with attention_bias
  bool o_bias = false;       // attention_bias (Llama, Qwen3)
  bool mlp_bias = false;
  bool qk_norm = false;      // Qwen3
  // MLA (DeepSeek-V2/V3)
  bool mla = false;
  int q_lora_rank = 0;       // 0: q_proj directly
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  // QuaRot-dagger calibration (kvq_calibration.json "online_rope_hadamard": true): the RoPE key
  // and query are multiplied by the normalized Hadamard matrix after RoPE, online (it cannot be
  // fused into the pre-RoPE projections). Scores are unchanged; only the cached key differs.
  bool online_rope_hadamard = false;
  MoeConfig moe;
  RopeConfig rope;
  float softmax_scale = 1.0f;  // 1/sqrt(qk head dim), times mscale^2 for DeepSeek YaRN
  int bos_token_id = -1;
  std::vector<int> eos_token_ids;
  // fp8 e4m3 block-scaled weights (quantization_config.quant_method == "fp8")
  bool fp8 = false;
  int fp8_block_rows = 128, fp8_block_cols = 128;

  bool is_moe_layer(int layer) const {
    return moe.n_routed_experts > 0 && layer >= moe.first_k_dense_replace && layer % moe.moe_layer_freq == 0;
  }
};

// Parses config.json text; `label` names the file in errors. Anything unsupported is a kvq::Error
// naming the field.
ModelConfig parse_model_config(const std::string& json_text, const std::string& label);
ModelConfig load_model_config(const std::string& path);
// Reads DIR/kvq_calibration.json when it exists (written by `kvq calibrate`) and applies what the
// runtime must do online: "online_rope_hadamard" (MLA, power-of-two qk_rope_head_dim). A malformed
// file, or a flag the model cannot honour, is a kvq::Error.
void apply_calibration_file(const std::string& dir, ModelConfig& cfg);

// The OpenBLAS kernel set the model's matrix products run on (chosen once per process from the CPU; e.g.
// "Haswell", "SkylakeX"). Perplexities differ in their last digits between kernel sets, so reports name it.
const char* blas_kernels();

// Inverse RoPE frequencies [rope.dim / 2] as transformers computes them (default or YaRN).
std::vector<float> rope_inv_freq(const RopeConfig& rope);

// MoE routing of one token: router logits [n_routed_experts] (and the correction bias, or null)
// -> top_k expert indices and their weights (routed_scaling_factor applied). Ties go to the
// lower index. Implements greedy, group_limited_greedy (group score = max) and noaux_tc (group
// score = sum of the two best, bias used for choice only) over softmax or sigmoid scores.
void moe_route(const MoeConfig& moe, const float* router_logits, const float* correction_bias, int* expert_idx,
               float* expert_weight);

enum class LogitsMode { kAll, kLast, kNone };

// How MLA attends. kAuto (default): chunks of at least kMlaExpandedMinChunk tokens use
// KvCache::attend_expanded (the same rows as decode sees, up-projected per head: ~6x fewer
// flops per query-row pair than the absorbed form) where the cache implements it and no
// observer is set (observers receive the absorbed form's queries and latent outputs); every
// other chunk goes through KvCache::attend like decode. kAbsorbed: always KvCache::attend.
// kExpanded computes per-head keys and values from the chunk's own fp32 latent rows (the rows
// are still appended to the cache) and is used only for a chunk that starts the sequence
// (position 0); other chunks fall back to the absorbed form. It exists to check the forms agree.
enum class MlaPrefill { kAuto, kAbsorbed, kExpanded };
inline constexpr int kMlaExpandedMinChunk = 64;

// What one layer of one forward call produced; pointers are valid during the callback only.
struct LayerTrace {
  int layer = 0;
  int seq = 0;
  int pos0 = 0;           // position of the first row
  int n = 0;              // rows (tokens)
  int n_heads = 0;
  float scale = 0.0f;     // softmax scale given to attend
  const float* q = nullptr;    // the queries given to KvCache::attend, [n][q_dim]
  int q_dim = 0;
  const float* k = nullptr;    // rows appended: GQA keys after RoPE / MLA latent, [n][k_dim]
  int k_dim = 0;
  const float* v = nullptr;    // GQA values / MLA rope key after RoPE, [n][v_dim]
  int v_dim = 0;
  const float* attn_out = nullptr;  // what attend returned, [n][out_dim]
  int out_dim = 0;
  const float* attn_proj = nullptr;  // the attention block's output after o_proj, [n][hidden]
};
using LayerObserver = std::function<void(const LayerTrace&)>;

class Model {
 public:
  virtual ~Model() = default;
  // Loads DIR/config.json and DIR/model.safetensors or DIR/model.safetensors.index.json shards;
  // DIR/kvq_calibration.json, when present, may ask for the online RoPE Hadamard (MLA only).
  static std::unique_ptr<Model> load(const std::string& dir);

  virtual const ModelConfig& config() const = 0;
  virtual CacheGeometry cache_geometry() const = 0;
  // Runs tokens [n] at positions cache.length(seq) ... + n - 1, appending their rows to `cache`.
  // logits: [n][vocab] (kAll), [vocab] (kLast) or unused (kNone). Long inputs are processed in
  // chunks of at most max_chunk() tokens. Throws kvq::Error on a bad token id, n <= 0, or a
  // position past max_position_embeddings.
  virtual void forward(const std::int32_t* tokens, int n, KvCache& cache, int seq, float* logits,
                       LogitsMode mode) = 0;
  // Observer called once per layer per chunk; empty to disable (the default, no cost).
  virtual void set_observer(LayerObserver observer) = 0;
  virtual void set_mla_prefill(MlaPrefill mode) = 0;
  virtual void set_max_chunk(int tokens) = 0;  // default 2048
  virtual int max_chunk() const = 0;
  // Bytes of fp32 weights held.
  virtual std::size_t weight_bytes() const = 0;
};

}  // namespace kvq
