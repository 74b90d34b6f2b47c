// The `kvq` binary on bad input: every case exits non-zero with a message that names the problem, never
// by a signal, a sanitizer report or a hang, and writes nothing it was not asked to. The models are
// copies of tiny-gqa / tiny-mla with one defect each (the weights linked, not copied, where the
// defect is elsewhere), and a good copy runs as the control.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace fs = std::filesystem;

namespace {

std::string src(const std::string& rel) { return std::string(KVQ_SOURCE_DIR) + "/" + rel; }

struct Result {
  bool exited = false;  // ended by exit(), not a signal
  int code = -1;
  std::string out;      // stdout and stderr
};

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// kvq ARGS under a time limit (coreutils timeout: 124 when it ran past it).
Result kvq(const std::vector<std::string>& args) {
  std::string cmd = "timeout 300 " + quote(KVQ_BIN);
  for (const auto& a : args) cmd += " " + quote(a);
  cmd += " 2>&1";
  Result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int st = ::pclose(p);
  r.exited = WIFEXITED(st);
  r.code = r.exited ? WEXITSTATUS(st) : -1;
  return r;
}

// The run failed cleanly: exit code `code` (1: kvq's errors; CLI11's parse errors have their own), the
// message holds `needle`, and no crash, sanitizer report or time-out.
void expect_refused(const Result& r, const std::string& needle, int code = 1) {
  EXPECT_TRUE(r.exited) << r.out;
  EXPECT_EQ(r.code, code) << r.out;
  EXPECT_NE(r.out.find(needle), std::string::npos) << "expected '" << needle << "' in:\n" << r.out;
  for (const char* bad : {"terminate called", "Sanitizer", "runtime error", "Segmentation", "Aborted"})
    EXPECT_EQ(r.out.find(bad), std::string::npos) << r.out;
}

std::string read(const fs::path& f) {
  std::ifstream in(f, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write(const fs::path& f, const std::string& s) { std::ofstream(f, std::ios::binary | std::ios::trunc) << s; }

class Cli : public ::testing::Test {
 protected:
  static fs::path base;

  static void SetUpTestSuite() {
    base = fs::temp_directory_path() / ("kvq-test-cli-" + std::to_string(::getpid()));
    fs::remove_all(base);
    fs::create_directories(base);
    // A short text of two documents (the ppl protocol's separator is a blank line).
    const std::string text = read(src("data/validation.txt"));
    write(base / "text.txt", text.substr(0, 6000) + "\n\n" + text.substr(6000, 6000));
    write(base / "empty.txt", "");
  }
  static void TearDownTestSuite() { fs::remove_all(base); }

  // A copy of models/NAME as base/DIR: the small files copied, model.safetensors linked unless `copy_weights`.
  static fs::path model_copy(const std::string& name, const std::string& dir, bool copy_weights = false) {
    const fs::path from = src("models/" + name), to = base / dir;
    fs::create_directories(to);
    for (const auto& e : fs::directory_iterator(from)) {
      const fs::path t = to / e.path().filename();
      if (e.path().filename() == "model.safetensors" && !copy_weights) fs::create_symlink(e.path(), t);
      else if (e.path().filename() != "reference.safetensors") fs::copy_file(e.path(), t);
    }
    return to;
  }
  static void edit_config(const fs::path& dir, const std::string& key, const nlohmann::json& value) {
    auto j = nlohmann::json::parse(read(dir / "config.json"));
    j[key] = value;
    write(dir / "config.json", j.dump(2));
  }
  static std::vector<std::string> ppl(const fs::path& model) {
    return {"ppl", "--model", model.string(), "--text", (base / "text.txt").string(), "--ctx", "256", "--windows", "1"};
  }
};
fs::path Cli::base;

TEST_F(Cli, GoodCopiesRun) {
  // The control: the copies below differ from these only by their defect.
  const Result r = kvq(ppl(model_copy("tiny-gqa", "good-gqa")));
  EXPECT_TRUE(r.exited && r.code == 0) << r.out;
  EXPECT_NE(r.out.find("ppl "), std::string::npos) << r.out;
  const Result m = kvq(ppl(model_copy("tiny-mla", "good-mla")));
  EXPECT_TRUE(m.exited && m.code == 0) << m.out;
}

TEST_F(Cli, RopeScalingsRun) {
  // The same weights under llama3 and linear RoPE scaling: each runs, and each changes the perplexity (the model was
  // trained with default RoPE, so the scaled frequencies do change its predictions).
  auto ppl_of = [](const Result& r) {
    const auto at = r.out.find("ppl ");
    return at == std::string::npos ? -1.0 : std::stod(r.out.substr(at + 4));
  };
  const Result d = kvq(ppl(model_copy("tiny-gqa", "rope-default")));
  ASSERT_TRUE(d.exited && d.code == 0) << d.out;
  const fs::path l3 = model_copy("tiny-gqa", "rope-llama3");
  edit_config(l3, "rope_parameters", {{"rope_type", "llama3"}, {"rope_theta", 10000.0}, {"factor", 8.0},
                                      {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                                      {"original_max_position_embeddings", 64}});
  const Result r3 = kvq(ppl(l3));
  ASSERT_TRUE(r3.exited && r3.code == 0) << r3.out;
  const fs::path lin = model_copy("tiny-gqa", "rope-linear");
  edit_config(lin, "rope_parameters", {{"rope_type", "linear"}, {"rope_theta", 10000.0}, {"factor", 2.0}});
  const Result rl = kvq(ppl(lin));
  ASSERT_TRUE(rl.exited && rl.code == 0) << rl.out;
  const double p0 = ppl_of(d), p3 = ppl_of(r3), pl = ppl_of(rl);
  EXPECT_GT(p0, 1.0);
  EXPECT_GT(p3, 1.0);
  EXPECT_GT(pl, 1.0);
  EXPECT_NE(p3, p0);
  EXPECT_NE(pl, p0);
  const fs::path dyn = model_copy("tiny-gqa", "rope-dynamic");
  edit_config(dyn, "rope_parameters", {{"rope_type", "dynamic"}, {"rope_theta", 10000.0}, {"factor", 2.0}});
  expect_refused(kvq(ppl(dyn)), "supported: default, yarn, llama3, linear");
}

TEST_F(Cli, MalformedModelDirectories) {
  expect_refused(kvq(ppl(base / "absent")), "not a model directory");
  {
    const fs::path d = model_copy("tiny-gqa", "json");
    write(d / "config.json", "{\"model_type\": \"llama\", \"hidden_size\": ");
    expect_refused(kvq(ppl(d)), "malformed JSON");
  }
  // One config field wrong each.
  const struct {
    const char* dir;
    const char* key;
    nlohmann::json value;
    const char* needle;
  } fields[] = {{"arch", "architectures", {"GPT2LMHeadModel"}, "is not supported"},
                {"odd", "head_dim", 33, "must be even"},
                {"groups", "num_key_value_heads", 3, "must divide"},
                {"layers", "num_hidden_layers", 5, "missing tensor"},
                {"vocab", "vocab_size", 4097, "has shape"}};
  for (const auto& f : fields) {
    const fs::path d = model_copy("tiny-gqa", f.dir);
    edit_config(d, f.key, f.value);
    expect_refused(kvq(ppl(d)), f.needle);
  }
  {
    const fs::path d = model_copy("tiny-gqa", "tokenizer");
    write(d / "tokenizer.json", "{\"model\": {\"type\": \"BPE\"");
    expect_refused(kvq(ppl(d)), "malformed JSON");
  }
}

TEST_F(Cli, MalformedWeights) {
  const std::string w = read(src("models/tiny-gqa/model.safetensors"));
  ASSERT_GT(w.size(), 1000u);
  {
    const fs::path d = model_copy("tiny-gqa", "truncated");
    fs::remove(d / "model.safetensors");
    write(d / "model.safetensors", w.substr(0, w.size() / 2));
    expect_refused(kvq(ppl(d)), "truncated");
  }
  {
    const fs::path d = model_copy("tiny-gqa", "header");
    fs::remove(d / "model.safetensors");
    std::string h = w;
    for (int i = 0; i < 8; ++i) h[static_cast<std::size_t>(i)] = i == 7 ? '\x40' : '\0';  // header length 2^62
    write(d / "model.safetensors", h);
    expect_refused(kvq(ppl(d)), "header length");
  }
  {
    // +Inf in the first element of the embedding (bf16 0x7f80).
    const fs::path d = model_copy("tiny-gqa", "inf");
    fs::remove(d / "model.safetensors");
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(w[static_cast<std::size_t>(i)]);
    const auto header = nlohmann::json::parse(w.substr(8, n));
    const auto& e = header.at("model.embed_tokens.weight");
    ASSERT_EQ(e.at("dtype"), "BF16");
    const std::size_t at = 8 + n + e.at("data_offsets")[0].get<std::size_t>();
    std::string bad = w;
    bad[at] = '\x80';
    bad[at + 1] = '\x7f';
    write(d / "model.safetensors", bad);
    expect_refused(kvq(ppl(d)), "NaN or Inf");
  }
}

TEST_F(Cli, BadOptionsAndTexts) {
  const std::string good = model_copy("tiny-gqa", "opts").string(), text = (base / "text.txt").string();
  expect_refused(kvq({"eval", "--model", good, "--text", text, "--cache", "tq-9bit"}), "unknown cache format");
  expect_refused(kvq({"eval", "--model", good, "--text", text, "--windows", "-3"}), "must be >= 0, got -3", 105);
  expect_refused(kvq({"ppl", "--model", good, "--text", text, "--cache", "tq-4bit", "--pool-mib", "inf"}), "finite", 105);
  expect_refused(kvq({"budget", "--budget-gib", "0"}), "must be > 0", 105);
  expect_refused(kvq({"budget", "--context", "4096,-5"}), "each request length must be >= 1, got -5");
  expect_refused(kvq({"budget", "--context", "0"}), "each request length must be >= 1, got 0");
  // eval makes its own caches per window: the pool options are not its.
  expect_refused(kvq({"eval", "--model", good, "--text", text, "--pool-mib", "1"}), "not expected", 109);
  expect_refused(kvq({"ppl", "--model", good, "--text", (base / "absent.txt").string()}), "cannot open");
  expect_refused(kvq({"ppl", "--model", good, "--text", (base / "empty.txt").string()}), "empty text");
  expect_refused(kvq({"generate", "--model", good, "--prompt", "hi", "--max-tokens", "-1"}), "--max-tokens");
  expect_refused(kvq({"codebook", "--bits", "9"}), "1..8");
  expect_refused(kvq({"calibrate", "--model", good, "--out", (base / "cal-gqa").string()}), "needs an MLA");
  EXPECT_FALSE(fs::exists(base / "cal-gqa"));
}

TEST_F(Cli, BenchCommandsRegistered) {
  // cmd_bench*.cpp are an object library of their own (tools/kvq/CMakeLists.txt); their subcommands must still be in
  // the binary. Help and option checks run before any device call, so this holds with or without CUDA and a GPU.
  for (const char* sub : {"decode", "mla"}) {
    const Result h = kvq({"bench", sub, "--help"});
    EXPECT_TRUE(h.exited && h.code == 0) << h.out;
    EXPECT_NE(h.out.find("--reps"), std::string::npos) << h.out;
    expect_refused(kvq({"bench", sub, "--reps", "0"}), "not in range", 105);
  }
}

// Integer options read decimal only (decimal_integer_options in tools/kvq/command.cpp): CLI11 alone takes "0100" as
// octal 64, fails on "0128", and takes "0x80" as 128.
TEST_F(Cli, IntegerOptionsAreDecimal) {
  for (const char* d : {"0100", "+0100", "100"}) {
    const Result r = kvq({"codebook", "--dim", d, "--bits", "2"});
    EXPECT_TRUE(r.exited && r.code == 0) << r.out;
    EXPECT_NE(r.out.find("d = 100\n"), std::string::npos) << d << ":\n" << r.out;
  }
  const Result r = kvq({"codebook", "--dim", "0128", "--bits", "2"});
  EXPECT_TRUE(r.exited && r.code == 0) << r.out;
  EXPECT_NE(r.out.find("d = 128\n"), std::string::npos) << r.out;
  expect_refused(kvq({"codebook", "--dim", "0x80"}), "--dim: must be a decimal integer, got '0x80'", 105);
  // An option with a range check, and the bench commands (their checks run before any device call).
  expect_refused(kvq({"distortion", "--trials", "0b11"}), "must be a decimal integer", 105);
  expect_refused(kvq({"bench", "decode", "--reps", "0X10"}), "must be a decimal integer", 105);
  expect_refused(kvq({"bench", "decode", "--reps", "000"}), "not in range", 105);
  // Protection policies: each item of the list is checked before any device call.
  expect_refused(kvq({"bench", "decode", "--protect", "none,sinks"}), "'sinks' is not one of 'none', 'paper'", 105);
  expect_refused(kvq({"bench", "decode", "--protect", ","}), "needs one of 'none', 'paper'", 105);
  expect_refused(kvq({"bench", "mla", "--protect", "Paper"}), "'Paper' is not one of 'none', 'paper'", 105);
}

TEST_F(Cli, ExhaustedPagePool) {
  const std::string good = model_copy("tiny-gqa", "pool").string(), text = (base / "text.txt").string();
  // 1 MiB holds 15 blocks of 64 tokens of every layer (tq-4bit-nc, a format without calibration); a
  // 256-token window needs 4, 2048 need 32.
  expect_refused(kvq({"ppl", "--model", good, "--text", text, "--cache", "tq-4bit-nc", "--pool-mib", "0.01"}),
                 "smaller than one block");
  expect_refused(kvq({"ppl", "--model", good, "--text", text, "--cache", "tq-4bit-nc", "--pool-mib", "1", "--ctx", "2048"}),
                 "page pool exhausted");
  const Result ok = kvq({"ppl", "--model", good, "--text", text, "--cache", "tq-4bit-nc", "--pool-mib", "1", "--ctx", "256", "--windows", "1"});
  EXPECT_TRUE(ok.exited && ok.code == 0) << ok.out;
}

TEST_F(Cli, OutputsNeverReplaceOtherFiles) {
  const std::string mla = model_copy("tiny-mla", "cal-model").string();
  // calibrate into a directory of other files: refused with and without --overwrite, before any work.
  const fs::path user = base / "mine";
  fs::create_directories(user);
  write(user / "notes.txt", "keep");
  expect_refused(kvq({"calibrate", "--model", mla, "--out", user.string(), "--steps", "0"}), "not empty");
  expect_refused(kvq({"calibrate", "--model", mla, "--out", user.string(), "--steps", "0", "--overwrite"}),
                 "kvq_calibration.json");
  expect_refused(kvq({"calibrate", "--model", mla, "--out", mla, "--steps", "0", "--overwrite"}), "model directory");
  EXPECT_EQ(read(user / "notes.txt"), "keep");
  EXPECT_TRUE(fs::exists(fs::path(mla) / "config.json"));
  // eval and analyze --report on a path that cannot be a directory: refused before the run.
  const std::string bad_report = (user / "notes.txt" / "sub").string();
  expect_refused(kvq({"eval", "--model", src("models/tiny-gqa"), "--text", (base / "text.txt").string(), "--report", bad_report}),
                 "cannot create the report directory");
  expect_refused(kvq({"analyze", "response", "--model", mla, "--report", bad_report}), "cannot create the report directory");
  EXPECT_EQ(read(user / "notes.txt"), "keep");
}

}  // namespace
