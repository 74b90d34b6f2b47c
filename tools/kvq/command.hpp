// tools/kvq/command.hpp: how a subcommand plugs into the `kvq` binary.
//
// A cmd_*.cpp file defines a registration function and names it with KVQ_REGISTER_COMMAND.
// The function adds a CLI11 subcommand and sets its callback. `--json` is a convention: the
// subcommand prints one JSON object on stdout and nothing else there.
#pragma once

#include <CLI/CLI.hpp>

#include "kvq/common.hpp"
#include <functional>
#include <string>
#include <vector>

namespace kvq::cli {

using Registrar = std::function<void(CLI::App&)>;

struct CommandEntry {
  std::string name;
  Registrar registrar;
};
std::vector<CommandEntry>& command_registry();

struct RegisterCommand {
  RegisterCommand(std::string name, Registrar r) {
    command_registry().push_back({std::move(name), std::move(r)});
  }
};

// Path of a file in the source tree (models/, data/): relative paths are tried as given, then
// against KVQ_SOURCE_DIR, then against the directory holding the executable's source tree.
std::string resolve_path(const std::string& path);

// Option checks with short messages ("must be >= 0, got -3"); CLI11's NonNegativeNumber /
// PositiveNumber print the whole range up to the largest double.
CLI::Validator at_least(double lo);     // value >= lo
CLI::Validator greater_than(double lo); // value > lo

// Makes every integer option of `app` and its subcommands read decimal only. CLI11 (2.1) converts integers with
// strtoll in base 0, so "--reps 050" would mean 40 and "0x10" 16: leading zeros are dropped before the conversion
// and a base prefix (0x, 0b, 0o) is refused. main() calls it once every command has registered.
void decimal_integer_options(CLI::App& app);

// Creates a report directory (and its parents) and checks that a file can be written in it; the commands
// call it before their run, so that a bad --report fails at once instead of after minutes of work.
void make_report_dir(const std::string& dir);

// Parses a comma-separated list ("1,2,3" or "bf16,tq-3bit").
std::vector<std::string> split_list(const std::string& s);
std::vector<int> parse_int_list(const std::string& s);
// A comma-separated list option whose every item is one of `allowed` ("none,paper").
CLI::Validator list_of(std::vector<std::string> allowed);

}  // namespace kvq::cli

#define KVQ_CONCAT_INNER(a, b) a##b
#define KVQ_CONCAT(a, b) KVQ_CONCAT_INNER(a, b)
#define KVQ_REGISTER_COMMAND(name, fn) \
  static ::kvq::cli::RegisterCommand KVQ_CONCAT(kvq_register_, __LINE__)(name, fn)
