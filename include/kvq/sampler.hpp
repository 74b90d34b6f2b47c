// kvq/sampler.hpp: next-token selection for generation: greedy (temperature 0, the default) or
// temperature + nucleus (top-p) sampling from a splitmix64 stream, so a seed reproduces the same
// tokens on every platform.
#pragma once

#include <cstdint>

#include "kvq/rng.hpp"

namespace kvq {

struct SamplerOptions {
  float temperature = 0.0f;  // 0: greedy (argmax, lowest id on ties)
  float top_p = 1.0f;        // keep the smallest set of most likely tokens whose mass reaches top_p
  std::uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplerOptions& opt);
  std::int32_t sample(const float* logits, int vocab);

 private:
  SamplerOptions opt_;
  SplitMix64 rng_;
};

}  // namespace kvq
