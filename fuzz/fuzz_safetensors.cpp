// libFuzzer target: arbitrary bytes as a .safetensors image. Parsing must either succeed or
// throw kvq::Error; every tensor of an accepted image must convert to float (or be refused with
// kvq::Error) without reading outside the buffer.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/common.hpp"
#include "kvq/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto file =
        kvq::SafetensorsFile::from_memory(std::vector<std::uint8_t>(data, data + size), "fuzz.safetensors");
    for (const auto& [name, t] : file->tensors()) {
      try {
        if (t.numel() <= (1 << 20)) (void)t.to_float();
      } catch (const kvq::Error&) {
      }
    }
    (void)file->metadata().size();
  } catch (const kvq::Error&) {
  }
  return 0;
}
