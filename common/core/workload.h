// The workload of a run: how a problem's inputs are made and how many threads run it.
//
// It belongs to the harness and to the tests: variants, engines and kernels compute with the
// Problem and the q, k, v they are given, and never see it (the thread count reaches them as
// the team run_one sets, common/core/threads.h). Tolerances read it (VariantInfo::tolerance): how
// large the logits are is a property of the inputs, not of the problem.
#pragma once

#include <string>
#include <vector>

#include "common/core/problem.h"

namespace attnbench {

/// The passes a run can measure: fwd, bwd, fwdbwd, decode.
const std::vector<std::string>& pass_names();

struct Workload {
  std::string input = "gaussian";  ///< input distribution (common/io/inputs.h), or "file"
  double scale = 1.0;              ///< logit sharpening: generated q is multiplied by scale
  int threads = 0;                 ///< 0 = every core
  /// What is measured: "fwd" (the forward pass), "bwd" (the backward pass alone, from a saved
  /// forward state) or "fwdbwd" (both), see common/core/backward.h; or "decode" (one generation
  /// step against the state of n tokens, causal self-attention), see common/core/decode.h.
  std::string pass = "fwd";

  /// Checks the scale against the problem's head dimension and the thread count; throws
  /// UsageError naming the bad field and what is accepted.
  void validate(const Problem& p) const;
};

/// The canonical name of a run of `p` under `w`, as the results and benchmark names carry it:
/// "B=1,H=8,n=1024,m=1024,d=64,causal=0,input=gaussian,scale=1,seed=0", with ",pass=bwd",
/// ",pass=fwdbwd" or ",pass=decode" after it for the other passes (forward rows keep their
/// names).
std::string describe(const Problem& p, const Workload& w);

}  // namespace attnbench
