// kvq/common.hpp: shared macros, the error type and small helpers used everywhere.
//
// Headers under include/kvq/ are plain C++20 with no third-party or CUDA includes, so nvcc and
// host compilers read them alike; KVQ_HD marks functions callable from both sides.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define KVQ_HD __host__ __device__ __forceinline__
#else
#define KVQ_HD inline
#endif

namespace kvq {

// Every user-facing failure (bad file, bad format name, NaN input, exhausted pool...) is a
// kvq::Error with a message that names the thing at fault; the CLI prints it and exits 1.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

[[noreturn]] inline void fail(const std::string& what) { throw Error(what); }

inline void require(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

KVQ_HD constexpr bool is_pow2(std::uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }
KVQ_HD constexpr std::size_t align_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

}  // namespace kvq
