// Registers clash_new (acceptable on its own) and full (built into attnbench).
#include <memory>

#include "common/core/registry.h"

namespace {

class Zero final : public attnbench::Variant {
 public:
  void forward(const attnbench::Problem&, attnbench::ConstTensorView, attnbench::ConstTensorView,
               attnbench::ConstTensorView, attnbench::TensorView) override {}
  double flops(const attnbench::Problem&) const override { return 0; }
  double memory_estimate(const attnbench::Problem&) const override { return 0; }
};

attnbench::VariantInfo zero_info(const char* name) {
  return {.name = name,
          .summary = "zeros",
          .complexity = "none",
          .params = {},
          .caps = {},
          .make = [](const attnbench::ParamValues&) { return std::make_unique<Zero>(); }};
}

ATTNBENCH_REGISTER_VARIANT(clash_new, zero_info("clash_new"));
ATTNBENCH_REGISTER_VARIANT(full, zero_info("full"));

}  // namespace
