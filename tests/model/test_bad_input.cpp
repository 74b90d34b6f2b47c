// Bad model directories and inputs must fail with a kvq::Error whose message names the culprit:
// truncated shard, wrong dtype, missing tensor, missing scales of an fp8 tensor, malformed
// config.json, unsupported architecture / RoPE type / activation, an empty input and an input
// longer than max_position_embeddings. Each case copies a good tiny checkpoint and breaks it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "kvq/common.hpp"
#include "test_util.hpp"

namespace kvq::test {
namespace {

namespace fs = std::filesystem;

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kvq_bad_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  void copy_model(const std::string& rel) {
    for (const auto& e : fs::directory_iterator(src_path(rel))) fs::copy_file(e.path(), dir_ / e.path().filename());
  }
  std::string read(const std::string& name) {
    std::ifstream f(dir_ / name, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), {}};
  }
  void write(const std::string& name, const std::string& bytes) {
    std::ofstream f(dir_ / name, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  // Replaces `from` by `to` (same length) inside the safetensors header of `name`.
  void patch_header(const std::string& name, const std::string& from, const std::string& to) {
    ASSERT_EQ(from.size(), to.size());
    std::string b = read(name);
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(b[i]);
    const auto at = b.find(from, 8);
    ASSERT_NE(at, std::string::npos) << from;
    ASSERT_LT(at, 8 + n) << "not in the header";
    b.replace(at, from.size(), to);
    write(name, b);
  }
  // Loads and returns the error message (empty if no error).
  std::string load_error() {
    try {
      Model::load(dir_.string());
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
  fs::path dir_;
};

TEST_F(BadInput, TruncatedShard) {
  KVQ_REQUIRE_DIR("tests/data/tiny-dsv2-yarn");
  copy_model("tests/data/tiny-dsv2-yarn");
  const std::string shard = "model-00002-of-00002.safetensors";
  const std::string b = read(shard);
  write(shard, b.substr(0, b.size() / 2));
  const std::string msg = load_error();
  EXPECT_NE(msg.find(shard), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST_F(BadInput, WrongDtype) {
  copy_model("tests/data/tiny-qwen2");
  patch_header("model.safetensors", "\"F16\"", "\"I16\"");
  const std::string msg = load_error();
  EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("dtype I16"), std::string::npos) << msg;
}

TEST_F(BadInput, MissingTensor) {
  copy_model("tests/data/tiny-qwen2");
  patch_header("model.safetensors", "model.layers.1.self_attn.v_proj.bias", "model.layers.1.self_attn.v_proj.bia_");
  const std::string msg = load_error();
  EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing tensor 'model.layers.1.self_attn.v_proj.bias'"), std::string::npos) << msg;
}

TEST_F(BadInput, MissingTensorInShardIndex) {
  copy_model("models/tiny-mla");
  std::string idx = read("model.safetensors.index.json");
  const std::string key = "\"model.layers.2.mlp.experts.3.down_proj.weight\"";
  const auto at = idx.find(key);
  ASSERT_NE(at, std::string::npos);
  idx.replace(at, key.size(), "\"model.layers.2.mlp.experts.3.down_proj.wei_ht\"");
  write("model.safetensors.index.json", idx);
  const std::string msg = load_error();
  EXPECT_NE(msg.find("model.safetensors.index.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.layers.2.mlp.experts.3.down_proj.weight"), std::string::npos) << msg;
}

TEST_F(BadInput, WrongShape) {
  copy_model("tests/data/tiny-qwen2");
  auto cfg = nlohmann::json::parse(read("config.json"));
  cfg["intermediate_size"] = 96;
  write("config.json", cfg.dump());
  const std::string msg = load_error();
  EXPECT_NE(msg.find("shape"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected [96, 64]"), std::string::npos) << msg;
}

TEST_F(BadInput, Fp8WithoutScales) {
  KVQ_REQUIRE_DIR("tests/data/tiny-dsv3-fp8");
  copy_model("tests/data/tiny-dsv3-fp8");
  patch_header("model.safetensors", "model.layers.0.self_attn.o_proj.weight_scale_inv",
               "model.layers.0.self_attn.o_proj.weight_scale_in_");
  const std::string msg = load_error();
  EXPECT_NE(msg.find("model.layers.0.self_attn.o_proj.weight_scale_inv"), std::string::npos) << msg;
}

TEST_F(BadInput, MalformedConfig) {
  copy_model("tests/data/tiny-qwen2");
  write("config.json", read("config.json").substr(0, 40));
  const std::string msg = load_error();
  EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("malformed JSON"), std::string::npos) << msg;
}

TEST_F(BadInput, UnsupportedArchitecture) {
  copy_model("tests/data/tiny-qwen2");
  auto cfg = nlohmann::json::parse(read("config.json"));
  cfg["architectures"] = {"GPT2LMHeadModel"};
  write("config.json", cfg.dump());
  const std::string msg = load_error();
  EXPECT_NE(msg.find("'architectures' = 'GPT2LMHeadModel' is not supported"), std::string::npos) << msg;
}

TEST_F(BadInput, UnsupportedFieldsAreNamed) {
  copy_model("tests/data/tiny-qwen2");
  const auto good = nlohmann::json::parse(read("config.json"));
  struct Case {
    const char* key;
    nlohmann::json value;
    const char* expect;
  };
  const Case cases[] = {
      {"rope_parameters", {{"rope_type", "dynamic"}, {"rope_theta", 500000.0}, {"factor", 8.0}}, "rope_type' = 'dynamic'"},
      // llama3 is supported; without its frequency factors it is refused by name.
      {"rope_parameters", {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0}}, "'low_freq_factor' is required"},
      {"hidden_act", "gelu", "'hidden_act' = 'gelu'"},
      {"use_sliding_window", true, "'sliding_window'"},
      {"num_key_value_heads", 3, "'num_key_value_heads'"},
      {"quantization_config", {{"quant_method", "awq"}}, "'quant_method' = 'awq'"},
      {"vocab_size", "many", "'vocab_size' must be an integer"},
  };
  for (const auto& c : cases) {
    auto cfg = good;
    cfg[c.key] = c.value;
    if (std::string(c.key) == "use_sliding_window") cfg["sliding_window"] = 16;
    write("config.json", cfg.dump());
    const std::string msg = load_error();
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.key << ": " << msg;
  }
}

TEST_F(BadInput, NoWeights) {
  copy_model("tests/data/tiny-qwen2");
  fs::remove(dir_ / "model.safetensors");
  EXPECT_NE(load_error().find("neither model.safetensors nor"), std::string::npos);
}

TEST(BadForwardInput, EmptyAndTooLongAndOutOfVocabulary) {
  auto m = Model::load(src_path("tests/data/tiny-qwen2"));
  auto cache = make_dense_cache(m->cache_geometry());
  std::vector<float> logits(m->config().vocab_size);
  std::vector<std::int32_t> ids(m->config().max_position_embeddings + 1, 3);
  try {
    m->forward(ids.data(), 0, *cache, 0, logits.data(), LogitsMode::kLast);
    ADD_FAILURE() << "empty input accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("empty"), std::string::npos) << e.what();
  }
  try {
    m->forward(ids.data(), static_cast<int>(ids.size()), *cache, 0, logits.data(), LogitsMode::kLast);
    ADD_FAILURE() << "input past max_position_embeddings accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_position_embeddings (512)"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache->length(0), 0);
  // Fills up to the limit, then one more token is refused.
  m->forward(ids.data(), 512, *cache, 0, nullptr, LogitsMode::kNone);
  EXPECT_THROW(m->forward(ids.data(), 1, *cache, 0, logits.data(), LogitsMode::kLast), Error);
  cache->reset(0);
  ids[0] = 128;
  EXPECT_THROW(m->forward(ids.data(), 1, *cache, 0, logits.data(), LogitsMode::kLast), Error);
}

TEST(DenseCache, RejectsNanAndBadUse) {
  CacheGeometry g;
  g.n_layers = 2;
  g.n_kv_heads = 1;
  g.head_dim = 4;
  g.v_head_dim = 4;
  auto c = make_dense_cache(g, 1, 3);
  std::vector<float> k(4, 1.0f), v(4, 1.0f);
  v[2] = NAN;
  try {
    c->append(0, 0, 1, k.data(), v.data());
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 0, position 0"), std::string::npos) << e.what();
  }
  v[2] = 0.0f;
  EXPECT_THROW(c->append(1, 0, 1, k.data(), v.data()), Error);  // no sequence 1
  c->append(0, 0, 1, k.data(), v.data());
  EXPECT_EQ(c->length(0), 0);  // advances with the last layer
  EXPECT_THROW(c->append(0, 0, 1, k.data(), v.data()), Error);  // layer 0 twice
  c->append(0, 1, 1, k.data(), v.data());
  EXPECT_EQ(c->length(0), 1);
  std::vector<float> kk(12, 1.0f), vv(12, 1.0f);
  EXPECT_THROW(c->append(0, 0, 3, kk.data(), vv.data()), Error);  // over max_tokens
}

}  // namespace
}  // namespace kvq::test
