// Fuzzes the attention mask reader (--attn-mask, attn_mask of an .npz): the .npy bytes, then
// their checks against a problem whose sizes come from the input's first bytes. Any input must
// either give a mask of the problem's shape or throw InputError.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "common/core/error.h"
#include "common/io/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  attnbench::Problem p;
  p.batch = 1 + data[0] % 3;
  p.heads = 1 + data[1] % 4;
  p.n = 1 + data[2] % 17;
  p.m = 1 + data[3] % 17;
  p.dim = 4;
  const std::string bytes(reinterpret_cast<const char*>(data) + 4, size - 4);
  try {
    const auto array = attnbench::parse_npy(bytes, "fuzz.npy");
    const auto mask = attnbench::attn_mask_from_array(array, "fuzz.npy", p);
    // a mask that loads is one of the problem's shape, with no NaN or +inf in it
    if (!mask || (mask->batch != 1 && mask->batch != p.batch) ||
        (mask->heads != 1 && mask->heads != p.heads) || mask->n != p.n || mask->m != p.keys() ||
        mask->bias.size() != size_t(mask->batch * mask->heads * mask->n * mask->m))
      __builtin_trap();
    for (float b : mask->bias)
      if (std::isnan(b) || b == std::numeric_limits<float>::infinity()) __builtin_trap();
  } catch (const attnbench::InputError&) {
  }
  return 0;
}
