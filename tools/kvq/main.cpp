// kvq: the command-line front end. Subcommands live in cmd_*.cpp and register themselves.
// Every kvq::Error (bad input, unknown format, exhausted pool...) becomes a one-line message
// on stderr and exit status 1; usage errors exit with CLI11's codes.
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <exception>

#include "command.hpp"
#include "kvq/common.hpp"

int main(int argc, char** argv) {
  CLI::App app{"kvq: 2-4 bit KV caches (TurboQuant, QuantMLA) for LLM inference"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kvq 0.1.0");
  auto& registry = kvq::cli::command_registry();
  std::sort(registry.begin(), registry.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  for (auto& entry : registry) entry.registrar(app);
  kvq::cli::decimal_integer_options(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const kvq::Error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "kvq: error: {}\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    fmt::print(stderr, "kvq: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "kvq: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
