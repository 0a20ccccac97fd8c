// Key padding in the approximations that drop padded keys from their sums, projections,
// landmarks, pooled groups and matchings (efficient, rfa plain and gated, sinkhorn, linformer,
// nystrom, compressed): garbage in the padded keys and values never reaches the output, a batch
// element without keys gives 0, and without a causal mask (whose diagonal is the full m's) a
// batch element computes what the variant computes on its valid keys alone. Clustered and
// routing have the same check in their own test files; every variant that claims key padding
// also meets its masked oracle in variants_test.cpp.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "test_util.h"
#include "tests/padded_keys.h"

namespace attnbench {
namespace {

struct Case {
  std::string spec;
  bool causal;
  bool self;   // self-attention only (m = n)
  double tol;  // against the valid keys alone
};

const Case kCases[] = {
    {"efficient", false, false, 1e-6},
    {"rfa", false, false, 1e-6},
    {"rfa:features=16,sigma=0.5", false, false, 1e-6},
    {"rfa", true, false, 0},
    {"rfa:features=32,sigma=2", true, false, 0},
    {"rfa:gate=true", true, false, 0},
    {"sinkhorn:block=16", false, true, 0},  // its blocks tile the queries too: not alone
    {"sinkhorn:block=16", true, true, 0},
    {"sinkhorn:block=7,iterations=9", true, true, 0},
    {"linformer:proj=32", false, false, 1e-5},
    {"linformer:proj=16,share_kv=true", false, false, 1e-5},
    {"nystrom:landmarks=8", false, false, 1e-4},
    {"nystrom:landmarks=16,pinv_iterations=3", false, false, 1e-4},
    {"compressed:ratio=3", false, false, 1e-5},
    {"compressed:ratio=4,pool=conv", false, false, 1e-5},
    {"compressed:ratio=3", true, false, 0},
    {"compressed:ratio=4,pool=conv", true, false, 0},
};

TEST(KeyPadding, PaddedKeysAreAbsent) {
  for (const Case& c : kCases)
    for (auto [n, m] : {std::pair<int64_t, int64_t>{70, 130}, {300, 600}, {100, 40}}) {
      if (c.self && n != m) m = n;
      Problem p = test::problem(4, 2, n, m, 16, c.causal, 5);
      p.key_lengths = {m / 2 + 3, 0, m, 1};
      const bool alone = !c.causal && c.tol > 0;
      test::expect_padded_keys_absent(c.spec, p, alone, c.tol);
    }
}

}  // namespace
}  // namespace attnbench
