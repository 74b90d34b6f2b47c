// kvq/rng.hpp: deterministic random numbers that every platform reproduces bit for bit.
//
// std distributions differ between standard libraries, so rotations, sign diagonals and QJL
// matrices draw from splitmix64 (Steele, Lea, Flood 2014) keyed by (seed, layer, head, stream)
// and turn bits into numbers with our own formulas.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvq/common.hpp"

namespace kvq {

KVQ_HD std::uint64_t splitmix64_next(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A stream key: the seed mixed with layer, head and a stream id (which table it feeds).
KVQ_HD std::uint64_t mix_seed(std::uint64_t seed, std::uint32_t layer, std::uint32_t head,
                              std::uint32_t stream = 0) {
  std::uint64_t s = seed;
  std::uint64_t h = splitmix64_next(s);
  s = h ^ (static_cast<std::uint64_t>(layer) << 32 | head);
  h = splitmix64_next(s);
  s = h ^ stream;
  return splitmix64_next(s);
}

enum : std::uint32_t {
  kStreamSigns = 1,     // sign diagonal of a randomized Hadamard
  kStreamHaar = 2,      // Gaussian matrix of a Haar rotation
  kStreamQjl = 3,       // QJL projection
  kStreamOutlier = 4,   // second instance of an outlier split
};

class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() { return splitmix64_next(state_); }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Standard normal by Box-Muller (one value per call; deterministic).
  double normal() {
    double u1 = uniform();
    const double u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // +1 or -1.
  float sign() { return (next() >> 63) ? -1.0f : 1.0f; }

 private:
  std::uint64_t state_;
};

}  // namespace kvq
