// Fuzzes the .npz reader on archives in memory (read_npz_buffer: the zip container, its
// declared sizes and CRCs, then each .npy) and the loading of q, k and v from what it read.
// Any input must either load or throw InputError.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/core/error.h"
#include "common/io/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    auto arrays = attnbench::read_npz_buffer(bytes, "fuzz.npz");
    attnbench::Problem p;
    attnbench::inputs_from_arrays(std::move(arrays), "fuzz.npz", &p);
  } catch (const attnbench::InputError&) {
  }
  return 0;
}
