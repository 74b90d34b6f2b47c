#include "command.hpp"

#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "kvq/common.hpp"

namespace kvq::cli {

std::vector<CommandEntry>& command_registry() {
  static std::vector<CommandEntry> r;
  return r;
}

std::string resolve_path(const std::string& path) {
  namespace fs = std::filesystem;
  if (fs::exists(path)) return path;
  if (!fs::path(path).is_absolute()) {
    if (const char* root = std::getenv("KVQ_SOURCE_DIR")) {
      fs::path p = fs::path(root) / path;
      if (fs::exists(p)) return p.string();
    }
#ifdef KVQ_SOURCE_DIR
    fs::path p = fs::path(KVQ_SOURCE_DIR) / path;
    if (fs::exists(p)) return p.string();
#endif
  }
  return path;  // let the caller report the missing file with its own context
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto b = item.find_first_not_of(" \t");
    const auto e = item.find_last_not_of(" \t");
    if (b != std::string::npos) out.push_back(item.substr(b, e - b + 1));
  }
  return out;
}

std::vector<int> parse_int_list(const std::string& s) {
  std::vector<int> out;
  for (const auto& item : split_list(s)) {
    try {
      std::size_t used = 0;
      const int v = std::stoi(item, &used);
      if (used != item.size()) throw std::invalid_argument(item);
      out.push_back(v);
    } catch (const std::exception&) {
      fail("not an integer: '" + item + "' in list '" + s + "'");
    }
  }
  return out;
}

}  // namespace kvq::cli
