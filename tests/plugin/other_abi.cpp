// A plugin built against attnbench ABI BUILT_ABI that says it is ABI CLAIMED_ABI.
#include <memory>

#include "common/core/registry.h"

extern "C" __attribute__((visibility("default"))) const int attnbench_plugin_abi_version =
    CLAIMED_ABI;

namespace attnbench {
// The registration entry point of ABI BUILT_ABI.
bool ATTNBENCH_CAT(register_variant_abi, BUILT_ABI)(VariantInfo info);
}  // namespace attnbench

namespace {

class Zero final : public attnbench::Variant {
 public:
  void forward(const attnbench::Problem&, attnbench::ConstTensorView, attnbench::ConstTensorView,
               attnbench::ConstTensorView, attnbench::TensorView) override {}
  double flops(const attnbench::Problem&) const override { return 0; }
  double memory_estimate(const attnbench::Problem&) const override { return 0; }
};

[[maybe_unused]] const bool registered =
    attnbench::ATTNBENCH_CAT(register_variant_abi, BUILT_ABI)(attnbench::VariantInfo{
        .name = "other_abi",
        .summary = "a variant of another ABI",
        .complexity = "none",
        .params = {},
        .caps = {},
        .make = [](const attnbench::ParamValues&) { return std::make_unique<Zero>(); }});

}  // namespace
