// `kvq calibrate`: QuantMLA calibration (learned content rotation + scales, RoPE pair rotations +
// scales) or its baselines (SmoothQuant-dagger, QuaRot-dagger) for an MLA model and a cXrY cache,
// fused offline into a new Hugging Face model directory (kvq/calibrate.hpp, docs/calibration.md).
#include <fmt/core.h>

#include <nlohmann/json.hpp>

#include "command.hpp"
#include "kvq/calibrate.hpp"

namespace {

struct Args {
  std::string model, text = "data/validation-tech.txt", out, method = "quantmla", cache = "c4r4", dtype = "source",
              paths = "both";
  int steps = 300, train = 128, held = 32, seq_len = 256, rope_seq_len = 0, batch = 4, eval_every = 25, check_seqs = 4;
  std::uint64_t seed = 0;
  double lr_rot = 2e-3, lr_scale = 1e-2, lr_angle = 1e-2;
  bool json = false, quiet = false, overwrite = false;
};

void run(const Args& a) {
  kvq::CalibOptions o;
  o.model_dir = kvq::cli::resolve_path(a.model);
  o.text_file = kvq::cli::resolve_path(a.text);
  o.out_dir = a.out;
  o.overwrite = a.overwrite;
  o.method = kvq::parse_calib_method(a.method);
  o.cache = a.cache;
  if (a.paths != "both" && a.paths != "content" && a.paths != "rope") kvq::fail("--paths must be both, content or rope");
  o.content_path = a.paths != "rope";
  o.rope_path = a.paths != "content";
  o.steps = a.steps;
  o.train_seqs = a.train;
  o.heldout_seqs = a.held;
  o.seq_len = a.seq_len;
  o.rope_seq_len = a.rope_seq_len;
  o.batch = a.batch;
  o.eval_every = a.eval_every;
  o.check_seqs = a.check_seqs;
  o.seed = a.seed;
  o.lr_rotation = a.lr_rot;
  o.lr_scale = a.lr_scale;
  o.lr_angle = a.lr_angle;
  if (a.dtype == "f32") o.dtype = kvq::FuseDtype::kF32;
  else if (a.dtype != "source" && a.dtype != "bf16") kvq::fail("--dtype must be source (bf16 for the fixtures) or f32");
  if (!a.quiet) o.log = [](const std::string& s) { fmt::print(stderr, "[calibrate] {}\n", s); };
  const kvq::CalibResult r = kvq::calibrate(o);
  if (a.json) {
    fmt::print("{}", r.json);
    return;
  }
  fmt::print("{} calibration of {} for {} written to {} ({:.0f} s)\n", a.method, o.model_dir, o.cache, o.out_dir, r.seconds);
  fmt::print("{:>5} | {:>11} {:>11} {:>11} {:>6} | {:>11} {:>11} {:>11} {:>6}\n", "layer", "content RTN", "init", "best",
             "alpha", "RoPE RTN", "init", "best", "alpha");
  for (std::size_t l = 0; l < r.layers.size(); ++l) {
    const auto& L = r.layers[l];
    fmt::print("{:>5} | {:>11.5f} {:>11.5f} {:>11.5f} {:>6.3f} | {:>11.5f} {:>11.5f} {:>11.5f} {:>6.3f}\n", l, L.content.rtn,
               L.content.init, L.content.best, L.content.alpha, L.rope.rtn, L.rope.init, L.rope.best, L.rope.alpha);
  }
  fmt::print("fusion check (fp32, quantization off): max layer output relative error {:.2e}, NLL drift {:+.2e}\n",
             r.fusion_max_rel_err, r.nll_fused_f32 - r.nll_original);
  fmt::print("saved checkpoint NLL drift {:+.2e}; model.safetensors fnv1a64 {}\n", r.nll_saved - r.nll_original, r.checksum);
}

void register_cmd(CLI::App& app) {
  auto* cmd = app.add_subcommand("calibrate", "QuantMLA / SmoothQuant-dagger / QuaRot-dagger calibration of an MLA cache, fused into a new model dir");
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, "MLA (DeepSeek-V2/V3) Hugging Face model directory")->required();
  cmd->add_option("--out", a->out, "output model directory, absent or empty (written beside it, then renamed)")->required();
  cmd->add_flag("--overwrite", a->overwrite, "replace --out when it is an earlier output of kvq calibrate (has kvq_calibration.json)");
  cmd->add_option("--method", a->method, "quantmla | smoothquant | quarot (default quantmla)");
  cmd->add_option("--cache", a->cache, "cXrY cache format calibrated for (default c4r4)");
  cmd->add_option("--text", a->text, "calibration text (default data/validation-tech.txt; never the evaluation text)");
  cmd->add_option("--paths", a->paths, "both (default), or content / rope alone: the other path keeps RTN (ablation)");
  cmd->add_option("--steps", a->steps, "Adam steps per path and layer (quantmla; default 300)");
  cmd->add_option("--train-seqs", a->train, "training sequences (default 128)");
  cmd->add_option("--heldout-seqs", a->held, "held-out sequences for alpha and checkpoint selection (default 32)");
  cmd->add_option("--seq-len", a->seq_len, "tokens per sequence including <|bos|> (default 256)");
  cmd->add_option("--rope-seq-len", a->rope_seq_len,
                  "tokens per sequence of the RoPE path's samples (default: --seq-len); the learned RoPE angles fit the positions they see")
      ->check(kvq::cli::at_least(0));
  cmd->add_option("--batch", a->batch, "sequences per Adam step (default 4)");
  cmd->add_option("--eval-every", a->eval_every, "held-out evaluation cadence in steps (default 25)");
  cmd->add_option("--check-seqs", a->check_seqs, "held-out sequences of the fusion check (default 4)");
  cmd->add_option("--seed", a->seed, "seed of the sequence split and minibatch order (default 0)");
  cmd->add_option("--lr-rotation", a->lr_rot, "Adam learning rate of the Cayley parameters (default 2e-3)");
  cmd->add_option("--lr-scale", a->lr_scale, "Adam learning rate of the log-scales (default 1e-2)");
  cmd->add_option("--lr-angle", a->lr_angle, "Adam learning rate of the RoPE pair angles (default 1e-2)");
  cmd->add_option("--dtype", a->dtype, "saved tensor dtype: source (default) or f32");
  cmd->add_flag("--json", a->json, "print kvq_calibration.json on stdout");
  cmd->add_flag("--quiet", a->quiet, "no progress lines on stderr");
  cmd->callback([a] { run(*a); });
}

}  // namespace

KVQ_REGISTER_COMMAND("calibrate", register_cmd);
