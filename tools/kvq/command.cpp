#include "command.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unistd.h>

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

namespace {
CLI::Validator bound_check(double lo, bool strict) {
  std::ostringstream os;
  os << lo;  // 0, 0.5, 1e+06
  const std::string rule = std::string(strict ? "> " : ">= ") + os.str();
  return CLI::Validator(
      [lo, strict, rule](std::string& in) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(in.c_str(), &end);
        if (in.empty() || end != in.c_str() + in.size() || !std::isfinite(v)) return "must be a finite number " + rule + ", got '" + in + "'";
        if (strict ? !(v > lo) : !(v >= lo)) return "must be " + rule + ", got " + in;
        return {};
      },
      "number " + rule, strict ? "GREATER_THAN" : "AT_LEAST");
}
}  // namespace

CLI::Validator at_least(double lo) { return bound_check(lo, false); }
CLI::Validator greater_than(double lo) { return bound_check(lo, true); }

void decimal_integer_options(CLI::App& app) {
  const CLI::Validator decimal(
      [](std::string& in) -> std::string {
        std::size_t i = in.size() > 0 && (in[0] == '+' || in[0] == '-') ? 1 : 0;
        if (in.size() >= i + 2 && in[i] == '0' && std::string("xXbBoO").find(in[i + 1]) != std::string::npos)
          return "must be a decimal integer, got '" + in + "'";
        std::size_t z = i;
        while (z + 1 < in.size() && in[z] == '0') ++z;  // keep one digit: "000" -> "0"
        if (z > i && in.find_first_not_of("0123456789", z) == std::string::npos) in.erase(i, z - i);
        return {};
      },
      "");
  for (CLI::Option* o : app.get_options()) {
    const std::string t = o->get_type_name();  // "INT", or "INT:" and its checks' descriptions
    const std::string base = t.substr(0, t.find(':'));
    if (base == "INT" || base == "UINT") o->transform(decimal);
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) decimal_integer_options(*sub);
}

void make_report_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    fail(dir + ": cannot create the report directory" + (ec ? " (" + ec.message() + ")" : std::string()));
  const fs::path probe = fs::path(dir) / (".kvq-write-probe-" + std::to_string(static_cast<long long>(::getpid())));
  {
    std::ofstream f(probe, std::ios::binary);
    if (!(f << 'x')) fail(dir + ": cannot write in the report directory");
  }
  fs::remove(probe, ec);
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

CLI::Validator list_of(std::vector<std::string> allowed) {
  std::string names;
  for (const auto& a : allowed) names += (names.empty() ? "'" : ", '") + a + "'";
  return CLI::Validator(
      [allowed, names](std::string& in) -> std::string {
        const std::vector<std::string> items = split_list(in);
        if (items.empty()) return "needs one of " + names;
        for (const auto& it : items)
          if (std::find(allowed.begin(), allowed.end(), it) == allowed.end())
            return "'" + it + "' is not one of " + names;
        return {};
      },
      "");
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
