// `kvq tokenize`: encodes a text or a file with a tokenizer.json and prints the ids (and, with
// --pieces, each token as the vocabulary spells it), the count, bytes per token, the encoding
// time and whether decoding gives the text back. --json prints all of it as one JSON object.
#include <fmt/core.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "command.hpp"
#include "kvq/common.hpp"
#include "kvq/tokenizer.hpp"

namespace {

struct Options {
  std::string tokenizer;
  std::string text;
  std::string file;
  bool has_text = false;
  bool has_file = false;
  bool json = false;
  bool pieces = false;
};

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) kvq::fail("--file: cannot open '" + path + "'");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void run(const Options& o) {
  kvq::require(o.has_text != o.has_file, "give exactly one of --text and --file");
  // A model directory stands for its tokenizer.json.
  std::string path = kvq::cli::resolve_path(o.tokenizer);
  if (std::filesystem::is_directory(path)) path = (std::filesystem::path(path) / "tokenizer.json").string();
  const auto tk = kvq::Tokenizer::load(path);
  const std::string text = o.has_text ? o.text : read_text_file(kvq::cli::resolve_path(o.file));

  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = tk->encode(text);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const bool round_trip = tk->decode(ids) == text;
  const double bytes_per_token = ids.empty() ? 0.0 : static_cast<double>(text.size()) / ids.size();

  if (o.json) {
    nlohmann::json out = {{"tokenizer", path},
                          {"bytes", text.size()},
                          {"tokens", ids.size()},
                          {"bytes_per_token", bytes_per_token},
                          {"seconds", seconds},
                          {"round_trip", round_trip},
                          {"ids", ids}};
    if (o.pieces) {
      auto& p = out["pieces"] = nlohmann::json::array();
      for (const auto id : ids) p.push_back(tk->token_text(id));
    }
    // Token spellings and invalid UTF-8 input must not make the JSON dump throw.
    fmt::print("{}\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    return;
  }
  fmt::print("{} tokens for {} bytes ({:.2f} bytes/token), encoded in {:.3f} s, round trip {}\n",
             ids.size(), text.size(), bytes_per_token, seconds, round_trip ? "exact" : "normalized");
  if (o.pieces) {
    for (const auto id : ids) {
      const auto t = nlohmann::json(tk->token_text(id)).dump(-1, ' ', false,
                                                             nlohmann::json::error_handler_t::replace);
      fmt::print("{}\t{}{}\n", id, t, tk->is_special(id) ? "\tspecial" : "");
    }
    return;
  }
  std::string line;
  for (const auto id : ids) line += fmt::format("{}{}", line.empty() ? "" : " ", id);
  fmt::print("{}\n", line);
}

void register_cmd(CLI::App& app) {
  auto* cmd = app.add_subcommand("tokenize", "Encode text with a Hugging Face tokenizer.json (byte-level BPE)");
  auto o = std::make_shared<Options>();
  cmd->add_option("--tokenizer", o->tokenizer, "tokenizer.json, or a model directory holding one")->required();
  auto* text = cmd->add_option("--text", o->text, "text to encode");
  auto* file = cmd->add_option("--file", o->file, "file whose bytes to encode");
  text->excludes(file);
  cmd->add_flag("--pieces", o->pieces, "list each token with its vocabulary spelling");
  cmd->add_flag("--json", o->json, "print one JSON object");
  cmd->callback([o, text, file] {
    o->has_text = text->count() > 0;
    o->has_file = file->count() > 0;
    run(*o);
  });
}

}  // namespace

KVQ_REGISTER_COMMAND("tokenize", register_cmd);
