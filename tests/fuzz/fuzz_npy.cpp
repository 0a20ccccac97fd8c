// Fuzzes the .npy parser (parse_npy) and the checks load_inputs_npz applies to q, k and v
// (inputs_from_arrays, with the parsed array as all three). Any input must either parse or
// throw InputError; what parses must survive encode_npy and parse_npy unchanged.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/core/error.h"
#include "common/io/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    attnbench::NpyArray a = attnbench::parse_npy(bytes, "fuzz.npy");
    attnbench::NpyArray b = attnbench::parse_npy(attnbench::encode_npy(a), "encoded");
    if (a.dtype != b.dtype || a.shape != b.shape || a.data != b.data) __builtin_trap();
    attnbench::Problem p;
    attnbench::inputs_from_arrays({{"q", a}, {"k", a}, {"v", std::move(a)}}, "fuzz.npz", &p);
  } catch (const attnbench::InputError&) {
  }
  return 0;
}
