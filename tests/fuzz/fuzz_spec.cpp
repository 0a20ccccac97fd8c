// Fuzzes the variant spec parser: parse_spec and Registry::make, through make_variant.
// Any input must either make a variant or throw SpecError; a variant that is made must print
// a canonical spec that makes the same variant again.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/core/error.h"
#include "common/core/registry.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view spec(reinterpret_cast<const char*>(data), size);
  try {
    auto variant = attnbench::make_variant(spec);  // variants registered at libattnbench's load
    const std::string canonical = variant->spec();
    if (attnbench::make_variant(canonical)->spec() != canonical) __builtin_trap();
  } catch (const attnbench::SpecError&) {
  }
  return 0;
}
