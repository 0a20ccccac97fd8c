// The variant catalogue as data: what `attnbench list --json` prints, what meta.json records
// and what the Python module's attnbench.variants() returns.
#pragma once

#include <nlohmann/json.hpp>

#include "common/core/registry.h"

namespace attnbench {

/// Whether the variant, built with its default parameters, has a backward pass
/// (Variant::backward): read from what it implements, never from a flag.
bool has_backward(const VariantInfo& v);
/// Whether the variant, built with its default parameters, has a decode step
/// (Variant::decoder), read the same way.
bool has_decode(const VariantInfo& v);

/// Every registered variant, sorted by name: name, summary, complexity, capabilities
/// (backward and decode included), plugin file (null for a built-in one) and parameters.
nlohmann::ordered_json variants_json();

}  // namespace attnbench
