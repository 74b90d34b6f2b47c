// tools/kvq/table.hpp: aligned text tables for the CLI (and the same rows as JSON).
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace kvq::cli {

class Table {
 public:
  explicit Table(std::vector<std::string> headers) : headers_(std::move(headers)) {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  // Prints with right-aligned columns except the first `left` ones; markdown pipes if md.
  void print(std::FILE* out = stdout, std::size_t left = 1, bool md = false) const {
    std::vector<std::size_t> w(headers_.size());
    for (std::size_t c = 0; c < headers_.size(); ++c) w[c] = headers_[c].size();
    for (const auto& r : rows_)
      for (std::size_t c = 0; c < r.size() && c < w.size(); ++c) w[c] = std::max(w[c], r[c].size());
    auto line = [&](const std::vector<std::string>& r) {
      std::string s = md ? "|" : "";
      for (std::size_t c = 0; c < w.size(); ++c) {
        const std::string& v = c < r.size() ? r[c] : std::string();
        const std::string pad(w[c] - std::min(w[c], v.size()), ' ');
        s += (md ? " " : (c ? "  " : "")) + (c < left ? v + pad : pad + v) + (md ? " |" : "");
      }
      fmt::print(out, "{}\n", s);
    };
    line(headers_);
    if (md) {
      std::string s = "|";
      for (std::size_t c = 0; c < w.size(); ++c) s += (c < left ? ":" : "-") + std::string(w[c], '-') + (c < left ? "-|" : ":|");
      fmt::print(out, "{}\n", s);
    }
    for (const auto& r : rows_) line(r);
  }

 private:
  std::vector<std::string> headers_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace kvq::cli
