// The sparse-pattern variants (local, strided, sparse_transformer, global, longformer,
// bigbird): their patterns against brute-force definitions written here straight from
// docs/variants.md, their outputs against the dense reference masked by their own pattern, full
// coverage against full attention, causal leakage, BigBird's random blocks and pattern mass.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/random.h"
#include "common/core/registry.h"
#include "common/io/inputs.h"
#include "common/patterns/pattern.h"
#include "common/reference/reference.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::rel_fro_error;

std::unique_ptr<SparsePattern> pattern_of(const std::string& spec, const Problem& p) {
  auto pat = make_variant(spec)->make_pattern(p, {}, {});
  if (!pat) throw std::runtime_error(spec + " has no pattern");
  return pat;
}

bool supports(const std::string& spec, const Problem& p) {
  const VariantInfo& info = make_variant(spec)->info();
  return (!p.causal || info.caps.causal) && (p.causal || !info.caps.causal_only) &&
         (p.keys() == p.n || info.caps.cross);
}

// ----- brute-force definitions, straight from docs/variants.md -----
//
// allowed(p, h, i, j): does query i attend key j in head h, causal mask NOT applied. Queries
// are aligned with keys bottom-right: a(i) = i + (m - n).

using Rule = std::function<bool(const Problem& p, int64_t h, int64_t i, int64_t j)>;

int64_t aligned(const Problem& p, int64_t i) { return i + p.keys() - p.n; }
int64_t math_mod(int64_t x, int64_t s) { return ((x % s) + s) % s; }
int64_t math_floor(int64_t x, int64_t s) { return int64_t(std::floor(double(x) / double(s))); }

Rule local_rule(int64_t w) {
  return [=](const Problem& p, int64_t, int64_t i, int64_t j) {
    return std::llabs(aligned(p, i) - j) <= w;
  };
}
Rule strided_rule(int64_t stride, int64_t span) {
  return [=](const Problem& p, int64_t, int64_t i, int64_t j) {
    const int64_t x = aligned(p, i) - j;
    return math_mod(x, stride) == 0 && (span == 0 || std::llabs(x) <= span);
  };
}
Rule st_strided_rule(int64_t l) {  // local head over |a - j| < l  U  stride head
  return [=](const Problem& p, int64_t, int64_t i, int64_t j) {
    const int64_t x = aligned(p, i) - j;
    return std::llabs(x) < l || math_mod(x, l) == 0;
  };
}
Rule st_fixed_rule(int64_t l, int64_t c) {  // same l-block  U  summary columns
  return [=](const Problem& p, int64_t, int64_t i, int64_t j) {
    return math_floor(j, l) == math_floor(aligned(p, i), l) || j % l >= l - c;
  };
}
// global: positions (or the first g) index keys; query i is global iff a(i) is one of them
Rule global_rule(int64_t g, const std::vector<int64_t>& positions) {
  std::set<int64_t> gs(positions.begin(), positions.end());
  if (positions.empty())
    for (int64_t x = 0; x < g; ++x) gs.insert(x);
  return [gs](const Problem& p, int64_t, int64_t i, int64_t j) {
    return gs.count(aligned(p, i)) > 0 || gs.count(j) > 0;
  };
}
// longformer: window keys a + t D_h, |t| <= w; the first g tokens global both ways
Rule longformer_rule(int64_t w, int64_t dilation, int64_t dilated_heads, int64_t g) {
  return [=](const Problem& p, int64_t h, int64_t i, int64_t j) {
    const int64_t a = aligned(p, i);
    if ((a >= 0 && a < g) || j < g) return true;
    const int64_t d = dilated_heads == 0 || h < dilated_heads ? dilation : 1;
    for (int64_t t = -w; t <= w; ++t)
      if (a + t * d == j) return true;
    return false;
  };
}
// bigbird without its random blocks: global query blocks see everything; the global key
// blocks (first ceil(G/2), last floor(G/2)) and the window qb-floor((W-1)/2)..qb+floor(W/2)
struct BigBirdShape {
  int64_t block, window, random, global;
  bool global_block(int64_t x, int64_t nb) const {
    return x < (global + 1) / 2 || x >= nb - global / 2;
  }
  bool fixed(int64_t n, int64_t qb, int64_t kb) const {
    const int64_t nb = (n + block - 1) / block;
    if (global_block(qb, nb) || global_block(kb, nb)) return true;
    return window > 0 && kb >= qb - (window - 1) / 2 && kb <= qb + window / 2;
  }
};

struct Case {
  std::string spec;
  Rule rule;
  const BigBirdShape* bigbird = nullptr;  // non-null: the rule misses the random blocks
};

const BigBirdShape kBB7{7, 3, 3, 2}, kBB16{16, 1, 2, 3}, kBB5{5, 4, 1, 0}, kBB64{64, 3, 3, 2},
    kBB3{3, 0, 5, 1};

std::vector<Case> pattern_cases() {
  return {
      {"local:window=3,block=7", local_rule(3)},
      {"local:window=0,block=1", local_rule(0)},
      {"local:window=20", local_rule(20)},
      {"local:window=50,block=16", local_rule(50)},
      {"strided:stride=5,block=7", strided_rule(5, 0)},
      {"strided:stride=5,span=12,block=7", strided_rule(5, 12)},
      {"strided:stride=1,span=3,block=4", strided_rule(1, 3)},
      {"strided:stride=70,block=16", strided_rule(70, 0)},
      {"strided:stride=3,span=100", strided_rule(3, 100)},
      {"sparse_transformer:mode=strided,stride=5,block=7", st_strided_rule(5)},
      {"sparse_transformer:mode=strided,stride=16,block=16", st_strided_rule(16)},
      {"sparse_transformer:mode=strided,stride=40,block=8", st_strided_rule(40)},
      {"sparse_transformer:mode=fixed,stride=5,summary=2,block=7", st_fixed_rule(5, 2)},
      {"sparse_transformer:mode=fixed,stride=16,summary=4,block=16", st_fixed_rule(16, 4)},
      {"sparse_transformer:mode=fixed,stride=30,summary=0,block=8", st_fixed_rule(30, 0)},
      {"sparse_transformer:mode=fixed,stride=8,summary=3", st_fixed_rule(8, 3)},
      {"global:global=2,block=7", global_rule(2, {})},
      {"global:positions=0+5+50,block=7", global_rule(0, {0, 5, 50})},
      {"global:global=0", global_rule(0, {})},
      {"global:positions=3+4+5+6+7+8+9+10+11+150,block=4",
       global_rule(0, {3, 4, 5, 6, 7, 8, 9, 10, 11, 150})},
      {"global:global=64", global_rule(64, {})},
      {"longformer:window=3,global=2,block=7", longformer_rule(3, 1, 0, 2)},
      {"longformer:window=2,dilation=3,dilated_heads=2,global=5,block=7",
       longformer_rule(2, 3, 2, 5)},
      {"longformer:window=4,dilation=2,global=0,block=5", longformer_rule(4, 2, 0, 0)},
      {"longformer:window=10,global=16", longformer_rule(10, 1, 0, 16)},
      {"longformer:window=0,global=7,block=3", longformer_rule(0, 1, 0, 7)},
      {"bigbird:block=7", nullptr, &kBB7},
      {"bigbird:block=16,window_blocks=1,random_blocks=2,global_blocks=3", nullptr, &kBB16},
      {"bigbird:block=5,window_blocks=4,random_blocks=1,global_blocks=0", nullptr, &kBB5},
      {"bigbird:block=64", nullptr, &kBB64},
      {"bigbird:block=3,window_blocks=0,random_blocks=5,global_blocks=1", nullptr, &kBB3},
  };
}

const int64_t kLens[] = {1, 7, 113, 200};

// Checks one pattern against its brute-force rule on p: the exported rows (causal applied),
// the key block lists (listed iff some pair allowed; marked full iff every pair is) and the
// block masks of every tile and of some unaligned sub-tiles.
void check_pattern(const Case& cs, const Problem& p) {
  SCOPED_TRACE(cs.spec + " " + p.str());
  auto pat = pattern_of(cs.spec, p);
  const int64_t n = p.n, m = p.keys(), bs = pat->block();
  const int64_t nbq = (n + bs - 1) / bs, nbk = (m + bs - 1) / bs;
  std::vector<KeyBlock> blocks;

  // bigbird: its random blocks are the listed blocks outside the fixed structure; there must
  // be min(r, candidates) of them, listed for whole tiles
  std::map<std::pair<int64_t, int64_t>, std::set<int64_t>> random;  // (h, qb) -> blocks
  if (cs.bigbird) {
    const BigBirdShape& bb = *cs.bigbird;
    ASSERT_EQ(bs, bb.block);
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t qb = 0; qb < nbq; ++qb) {
        pat->key_blocks(0, h, qb, blocks);
        std::set<int64_t> listed;
        for (const KeyBlock& kb : blocks) listed.insert(kb.index);
        int64_t fixed = 0;
        for (int64_t kb = 0; kb < nbk; ++kb) {
          if (!bb.fixed(n, qb, kb)) continue;
          ++fixed;
          EXPECT_TRUE(listed.count(kb))
              << "h " << h << " qb " << qb << " misses fixed block " << kb;
        }
        auto& rnd = random[{h, qb}];
        for (int64_t kb : listed)
          if (!bb.fixed(n, qb, kb)) rnd.insert(kb);
        EXPECT_EQ(int64_t(rnd.size()), std::min(bb.random, nbk - fixed))
            << "h " << h << " qb " << qb;
      }
  }
  auto allowed = [&](int64_t h, int64_t i, int64_t j) {
    if (!cs.bigbird) return cs.rule(p, h, i, j);
    return cs.bigbird->fixed(n, i / bs, j / bs) || random[{h, i / bs}].count(j / bs) > 0;
  };

  // rows, causal applied; batch items share the pattern
  std::vector<uint8_t> row(static_cast<size_t>(m));
  int64_t bad_rows = 0;
  std::string first_bad;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i = 0; i < n; ++i) {
        pattern_row(p, *pat, b, h, i, row.data());
        for (int64_t j = 0; j < m; ++j) {
          const bool want = allowed(h, i, j) && j < p.visible(i);
          if (bool(row[size_t(j)]) != want && bad_rows++ == 0) {
            std::ostringstream os;
            os << "b " << b << " h " << h << " i " << i << " j " << j << ": got "
               << int(row[size_t(j)]) << ", want " << want;
            first_bad = os.str();
          }
        }
      }
  EXPECT_EQ(bad_rows, 0) << "first: " << first_bad;
  if (p.causal) return;  // block lists and masks do not depend on the causal mask

  int64_t bad_blocks = 0, bad_masks = 0;
  std::vector<uint8_t> mask;
  for (int64_t h = 0; h < p.heads; ++h)
    for (int64_t qb = 0; qb < nbq; ++qb) {
      pat->key_blocks(1, h, qb, blocks);
      for (size_t x = 1; x < blocks.size(); ++x)
        EXPECT_LT(blocks[x - 1].index, blocks[x].index) << "h " << h << " qb " << qb;
      const int64_t i0 = qb * bs, rows = std::min(bs, n - i0);
      size_t next = 0;
      for (int64_t kb = 0; kb < nbk; ++kb) {
        const int64_t j0 = kb * bs, cols = std::min(bs, m - j0);
        int64_t in = 0;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) in += allowed(h, i0 + r, j0 + c);
        while (next < blocks.size() && blocks[next].index < kb) ++next;
        const bool listed = next < blocks.size() && blocks[next].index == kb;
        if (listed != (in > 0)) {
          ++bad_blocks;
          ADD_FAILURE() << "h " << h << " qb " << qb << " kb " << kb << " listed " << listed
                        << " but " << in << " pairs allowed";
        }
        if (listed && !blocks[next].partial && in != rows * cols) {
          ++bad_blocks;
          ADD_FAILURE() << "h " << h << " qb " << qb << " kb " << kb << " marked full with " << in
                        << " of " << rows * cols << " pairs allowed";
        }
        // allowed but wasteful: the engine then masks a tile it could take whole. Every
        // variant here computes its full tiles exactly.
        if (listed && blocks[next].partial && in == rows * cols) {
          ++bad_blocks;
          ADD_FAILURE() << "h " << h << " qb " << qb << " kb " << kb
                        << " is full but marked partial";
        }
        mask.assign(size_t(rows * cols), 7);
        pat->block_mask(0, h, i0, rows, j0, cols, mask.data());
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c)
            bad_masks += mask[size_t(r * cols + c)] != uint8_t(allowed(h, i0 + r, j0 + c));
      }
    }
  EXPECT_EQ(bad_blocks, 0);
  EXPECT_EQ(bad_masks, 0) << "block_mask differs from the rule";

  // unaligned sub-tiles (block_mask is defined for any rectangle)
  RandomStream rs(99, uint64_t(n * 1000 + m));
  for (int t = 0; t < 20; ++t) {
    const int64_t i0 = int64_t(rs.below(4 * uint64_t(t), uint64_t(n)));
    const int64_t j0 = int64_t(rs.below(4 * uint64_t(t) + 1, uint64_t(m)));
    const int64_t rows = 1 + int64_t(rs.below(4 * uint64_t(t) + 2, uint64_t(n - i0)));
    const int64_t cols = 1 + int64_t(rs.below(4 * uint64_t(t) + 3, uint64_t(m - j0)));
    const int64_t h = t % p.heads;
    mask.assign(size_t(rows * cols), 7);
    pat->block_mask(0, h, i0, rows, j0, cols, mask.data());
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        bad += mask[size_t(r * cols + c)] != uint8_t(allowed(h, i0 + r, j0 + c));
    EXPECT_EQ(bad, 0) << "sub-tile at (" << i0 << ", " << j0 << ") of " << rows << " x " << cols;
  }
}

TEST(Patterns, MatchBruteForceDefinitions) {
  for (const Case& cs : pattern_cases())
    for (int64_t n : kLens)
      for (int64_t m : kLens)
        for (bool causal : {false, true}) {
          const Problem p = test::problem(2, 3, n, m, 8, causal);
          if (!supports(cs.spec, p)) continue;  // refusal is checked with the outputs
          check_pattern(cs, p);
        }
}

TEST(Patterns, RandomParametersMatchBruteForce) {
  // small random shapes and parameters, so every corner (block > n, stride > m, windows
  // beyond both ends, n > m and n < m) comes up
  RandomStream rs(2024, 1);
  uint64_t x = 0;
  auto pick = [&](int64_t lo, int64_t hi) {
    return lo + int64_t(rs.below(x++, uint64_t(hi - lo + 1)));
  };
  for (int t = 0; t < 300; ++t) {
    const int64_t n = pick(1, 40), m = pick(1, 40), block = pick(1, 24);
    const bool causal = pick(0, 1) == 1;
    const std::string bs = ",block=" + std::to_string(block);
    const int64_t w = pick(0, 12), s = pick(1, 15), span = pick(0, 20), l = pick(1, 12),
                  c = pick(0, 13), g = pick(0, 10), dil = pick(1, 4), dh = pick(0, 3);
    const int64_t p1 = pick(0, 45), p2 = pick(0, 45);
    const std::string ws = std::to_string(w);
    std::vector<Case> cases = {
        {"local:window=" + ws + bs, local_rule(w)},
        {"strided:stride=" + std::to_string(s) + ",span=" + std::to_string(span) + bs,
         strided_rule(s, span)},
        {"sparse_transformer:mode=strided,stride=" + std::to_string(l) + bs, st_strided_rule(l)},
        {"sparse_transformer:mode=fixed,stride=" + std::to_string(l) +
             ",summary=" + std::to_string(c) + bs,
         st_fixed_rule(l, c)},
        {"global:global=" + std::to_string(g) + bs, global_rule(g, {})},
        {"global:positions=" + std::to_string(p1) + "+" + std::to_string(p2) + bs,
         global_rule(0, {std::min(p1, p2), std::max(p1, p2)})},
        {"longformer:window=" + ws + ",dilation=" + std::to_string(dil) +
             ",dilated_heads=" + std::to_string(dh) + ",global=" + std::to_string(g) + bs,
         longformer_rule(w, dil, dh, g)},
    };
    for (const Case& cs : cases) check_pattern(cs, test::problem(1, 3, n, m, 4, causal));
    // bigbird is self-attention only
    const BigBirdShape bb{block, pick(0, 5), pick(0, 4), pick(0, 4)};
    const Case bcase{"bigbird:block=" + std::to_string(bb.block) + ",window_blocks=" +
                         std::to_string(bb.window) + ",random_blocks=" + std::to_string(bb.random) +
                         ",global_blocks=" + std::to_string(bb.global),
                     nullptr, &bb};
    check_pattern(bcase, test::problem(1, 3, n, 0, 4, causal, uint64_t(t)));
  }
}

TEST(Patterns, RuleCheckHasTeeth) {
  // the checker must notice a pattern that differs from its rule by a single pair
  Case wrong{"local:window=3,block=7", [](const Problem& p, int64_t, int64_t i, int64_t j) {
               return std::llabs(aligned(p, i) - j) <= 3 && !(i == 50 && j == 52);
             }};
  testing::TestPartResultArray failures;
  {
    testing::ScopedFakeTestPartResultReporter reporter(
        testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    check_pattern(wrong, test::problem(1, 1, 113, 113, 8, false));
  }
  EXPECT_GT(failures.size(), 0);
}

// ----- outputs against the dense reference masked by the variant's own pattern -----

const char* const kOutputSpecs[] = {
    "local:window=3,block=7",
    "local:window=20,block=16",
    "strided:stride=5,span=12,block=7",
    "strided:stride=70,block=16",
    "sparse_transformer:mode=strided,stride=5,block=7",
    "sparse_transformer:mode=fixed,stride=16,summary=4,block=16",
    "global:global=2,block=7",
    "global:positions=0+5+50,block=7",
    "longformer:window=3,dilation=2,dilated_heads=2,global=2,block=7",
    "longformer:window=10,global=16,block=16",
    "bigbird:block=7",
    "bigbird:block=16,random_blocks=2",
};

TEST(Patterns, OutputsMatchTheMaskedReference) {
  test::ScopedThreads one(1);
  for (const char* spec : kOutputSpecs) {
    auto variant = make_variant(spec);
    for (int64_t n : kLens)
      for (int64_t m : kLens)
        for (int64_t d : {1, 17, 64})
          for (bool causal : {false, true}) {
            const Problem p = test::problem(2, 3, n, m, d, causal, uint64_t(n + m + d));
            SCOPED_TRACE(std::string(spec) + " " + p.str());
            Inputs in = generate_inputs(p);
            Tensor out(p.q_shape());
            if (!supports(spec, p)) {
              EXPECT_THROW(variant->run(p, in.q.view(), in.k.view(), in.v.view(), out.view()),
                           UnsupportedError);
              continue;
            }
            variant->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
            auto pat = variant->make_pattern(p, in.q.view(), in.k.view());
            ASSERT_NE(pat, nullptr);
            const auto ref =
                reference_attention(p, in.q.view(), in.k.view(), in.v.view(), pat.get());
            EXPECT_LE(rel_fro_error(out.data(), ref), 1e-5);
          }
  }
}

TEST(Patterns, BigBirdRefusesCrossAttention) {
  auto v = make_variant("bigbird");
  EXPECT_FALSE(v->info().caps.cross);
  EXPECT_TRUE(v->info().caps.causal);
  for (bool causal : {false, true}) {
    const Problem p = test::problem(1, 2, 64, 96, 8, causal);
    Inputs in = generate_inputs(p);
    Tensor out(p.q_shape());
    EXPECT_THROW(v->run(p, in.q.view(), in.k.view(), in.v.view(), out.view()), UnsupportedError);
    // the harness asks for estimates before it checks support: they must not throw
    EXPECT_GT(v->flops(p), 0);
    EXPECT_GT(v->memory_estimate(p), 0);
  }
}

TEST(Patterns, OutputsDoNotDependOnTheThreadCount) {
  // every row is computed by one task whatever the thread count: bit-identical outputs, and
  // the patterns are read concurrently by the threads
  for (const char* spec : kOutputSpecs)
    for (bool causal : {false, true}) {
      const Problem p = test::problem(2, 3, 200, 0, 17, causal, 12);
      SCOPED_TRACE(std::string(spec) + " " + p.str());
      auto variant = make_variant(spec);
      Inputs in = generate_inputs(p);
      Tensor one(p.q_shape()), two(p.q_shape());
      {
        test::ScopedThreads t(1);
        variant->run(p, in.q.view(), in.k.view(), in.v.view(), one.view());
      }
      {
        test::ScopedThreads t(2);
        variant->run(p, in.q.view(), in.k.view(), in.v.view(), two.view());
      }
      EXPECT_TRUE(std::equal(one.data(), one.data() + one.numel(), two.data()));
      auto pat = variant->make_pattern(p, {}, {});
      const auto ref = reference_attention(p, in.q.view(), in.k.view(), in.v.view(), pat.get());
      EXPECT_LE(rel_fro_error(two.data(), ref), 1e-5);
    }
}

// ----- patterns that cover everything are full attention -----

TEST(Patterns, CoveringPatternsAreFullAttention) {
  test::ScopedThreads one(1);
  // each covers every pair for n, m <= 200
  const char* const specs[] = {
      "local:window=200,block=16",
      "strided:stride=1,block=7",
      "sparse_transformer:mode=strided,stride=1",
      "sparse_transformer:mode=strided,stride=201,block=32",
      "sparse_transformer:mode=fixed,stride=8,summary=8,block=5",
      "global:global=200,block=7",
      "longformer:window=200,global=0,block=7",
      "longformer:window=0,global=200,block=16",
      "bigbird:block=64,random_blocks=0",  // at most 4 blocks: global 0 and 3 + window
      "bigbird:block=100,window_blocks=0,global_blocks=0,random_blocks=3",  // random: all
  };
  for (const char* spec : specs) {
    auto variant = make_variant(spec);
    for (int64_t n : kLens)
      for (int64_t m : kLens)
        for (bool causal : {false, true}) {
          const Problem p = test::problem(2, 3, n, m, 17, causal, 3);
          if (!supports(spec, p)) continue;
          SCOPED_TRACE(std::string(spec) + " " + p.str());
          Inputs in = generate_inputs(p);
          Tensor out(p.q_shape());
          variant->run(p, in.q.view(), in.k.view(), in.v.view(), out.view());
          const auto ref = reference_attention(p, in.q.view(), in.k.view(), in.v.view());
          EXPECT_LE(rel_fro_error(out.data(), ref), 1e-5);
          // and the pattern itself says so
          auto pat = variant->make_pattern(p, {}, {});
          EXPECT_EQ(pattern_pairs(p, *pat, 1, 2), p.visible_pairs());
        }
  }
}

// ----- causal: nothing leaks from keys after a(i) -----

TEST(Patterns, CausalVariantsLeakNothing) {
  test::ScopedThreads one(1);
  const char* const specs[] = {
      "local:window=40,block=16",
      "strided:stride=3,block=16",
      "sparse_transformer:mode=strided,stride=8,block=16",
      "sparse_transformer:mode=fixed,stride=16,summary=4,block=16",
      "global:positions=0+10+40+90+120,block=16",
      "longformer:window=30,dilation=2,global=4,block=16",
      "bigbird:block=16",
  };
  for (const char* spec : specs) {
    auto variant = make_variant(spec);
    ASSERT_TRUE(variant->info().caps.causal) << spec;
    for (auto [n, m] : {std::pair<int64_t, int64_t>{113, 113}, {100, 130}}) {
      bool changed_without_causal = false;
      for (bool causal : {true, false}) {
        const Problem p = test::problem(1, 2, n, m, 17, causal, 21);
        if (!supports(spec, p)) continue;
        SCOPED_TRACE(std::string(spec) + " " + p.str());
        Inputs in = generate_inputs(p);
        Tensor base(p.q_shape());
        variant->run(p, in.q.view(), in.k.view(), in.v.view(), base.view());
        for (int64_t i : {int64_t(0), int64_t(5), int64_t(17), int64_t(60), n - 1}) {
          // keys and values after a(i) replaced by large random values
          Tensor k2 = Tensor(p.kv_shape()), v2 = Tensor(p.kv_shape());
          std::copy(in.k.data(), in.k.data() + in.k.numel(), k2.data());
          std::copy(in.v.data(), in.v.data() + in.v.numel(), v2.data());
          RandomStream rs(uint64_t(i), 5);
          uint64_t x = 0;
          for (int64_t h = 0; h < p.heads; ++h)
            for (int64_t j = aligned(p, i) + 1; j < m; ++j)
              for (int64_t c = 0; c < p.dim; ++c) {
                k2.view().row(0, h, j)[c] = float(30 * rs.normal(x++));
                v2.view().row(0, h, j)[c] = float(1000 * rs.normal(x++));
              }
          Tensor out(p.q_shape());
          variant->run(p, in.q.view(), k2.view(), v2.view(), out.view());
          double diff = 0;
          for (int64_t h = 0; h < p.heads; ++h)
            for (int64_t c = 0; c < p.dim; ++c)
              diff = std::max(diff, double(std::fabs(out.view().row(0, h, i)[c] -
                                                     base.view().row(0, h, i)[c])));
          if (causal)
            EXPECT_LE(diff, 1e-6) << "row " << i << " sees keys after a(i)";
          else
            changed_without_causal |= diff > 1e-3;
        }
      }
      // the perturbation does reach these rows when nothing masks it
      if (supports(spec, test::problem(1, 2, n, m, 17, false))) {
        EXPECT_TRUE(changed_without_causal) << spec << " n " << n << " m " << m;
      }
    }
  }
}

// ----- BigBird's random blocks -----

// Key blocks of every (head, query block) of head range [0, heads).
std::vector<std::vector<int64_t>> block_lists(const SparsePattern& pat, int64_t b, int64_t heads,
                                              int64_t nbq) {
  std::vector<std::vector<int64_t>> lists;
  std::vector<KeyBlock> blocks;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t qb = 0; qb < nbq; ++qb) {
      pat.key_blocks(b, h, qb, blocks);
      lists.emplace_back();
      for (const KeyBlock& kb : blocks) lists.back().push_back(kb.index);
    }
  return lists;
}

TEST(BigBird, RandomBlocksFollowTheSeedAndTheHead) {
  const std::string spec = "bigbird:block=16";
  const int64_t n = 1024, nbq = 64;
  auto lists = [&](uint64_t seed, int64_t heads, int64_t b = 0) {
    auto pat = pattern_of(spec, test::problem(2, heads, n, 0, 8, false, seed));
    return block_lists(*pat, b, heads, nbq);
  };
  const auto a = lists(1, 4), same = lists(1, 4), other = lists(2, 4);
  EXPECT_EQ(a, same);
  int64_t differ = 0;
  for (size_t x = 0; x < a.size(); ++x) differ += a[x] != other[x];
  // 62 non-global query blocks per head, 3 of ~57 candidates each: nearly all differ
  EXPECT_GT(differ, 4 * 62 / 2) << "of " << a.size();

  // heads differ from each other
  for (int64_t h = 1; h < 4; ++h) {
    int64_t head_differs = 0;
    for (int64_t qb = 0; qb < nbq; ++qb) head_differs += a[size_t(qb)] != a[size_t(h * nbq + qb)];
    EXPECT_GT(head_differs, 31) << "head " << h << " vs head 0";
  }
  // a head keeps its pattern whatever the head count; batch items share it
  const auto one = lists(1, 1), seven = lists(1, 7), batch1 = lists(1, 4, 1);
  for (int64_t qb = 0; qb < nbq; ++qb) EXPECT_EQ(one[size_t(qb)], a[size_t(qb)]);
  for (size_t x = 0; x < a.size(); ++x) EXPECT_EQ(seven[x], a[x]);
  EXPECT_EQ(batch1, a);

  // the draws are spread over the candidates: share in the lower half of each query block's
  // candidate list about 1/2 (744 draws: 0.5 +- 0.018 s.d.)
  const BigBirdShape shape{16, 3, 3, 2};
  int64_t low = 0, total = 0;
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t qb = 1; qb < nbq - 1; ++qb) {
      std::vector<int64_t> cand;
      for (int64_t kb = 0; kb < nbq; ++kb)
        if (!shape.fixed(n, qb, kb)) cand.push_back(kb);
      for (int64_t kb : a[size_t(h * nbq + qb)]) {
        if (shape.fixed(n, qb, kb)) continue;
        const auto pos = std::lower_bound(cand.begin(), cand.end(), kb) - cand.begin();
        low += 2 * pos < int64_t(cand.size());
        ++total;
      }
    }
  ASSERT_EQ(total, 4 * 62 * 3);
  EXPECT_NEAR(double(low) / double(total), 0.5, 0.08);
}

TEST(BigBird, PatternBytesCountTheRandomTable) {
  auto pat = pattern_of("bigbird:block=16", test::problem(1, 4, 1024, 0, 8, false));
  EXPECT_GE(pat->bytes(), 4.0 * 64 * 3 * sizeof(int32_t));
  auto none = pattern_of("local", test::problem(1, 4, 1024, 0, 8, false));
  EXPECT_EQ(none->bytes(), 0.0);
}

// ----- the engine's work follows the pattern -----

TEST(Patterns, FlopsFollowThePattern) {
  const Problem p = test::problem(1, 2, 4096, 0, 64, false);
  const double full = make_variant("full")->flops(p);
  // local, window 64 one side, block 64: key blocks qb-1..qb+1 of 64 (2 at the ends)
  EXPECT_DOUBLE_EQ(make_variant("local:window=64")->flops(p), full * (62.0 * 3 + 2 * 2) / 4096);
  // bigbird, 64 blocks: query blocks 0 and 63 see all; 1 and 62 see 4 fixed blocks (window
  // and global overlap) + 3 random, the others 2 global + 3 window + 3 random
  EXPECT_DOUBLE_EQ(make_variant("bigbird")->flops(p), full * (2 * 64 + 2 * 7 + 60 * 8.0) / 4096);
}

// ----- pattern mass -----

TEST(Patterns, MassIsOneForCoveringPatterns) {
  for (bool causal : {false, true})
    for (const char* spec : {"global:global=100", "local:window=64,block=8", "bigbird:block=32"}) {
      const Problem p = test::problem(1, 2, 50, 0, 16, causal, 8);
      SCOPED_TRACE(std::string(spec) + " " + p.str());
      Inputs in = generate_inputs(p);
      auto pat = pattern_of(spec, p);
      std::vector<int64_t> rows(50);
      for (int64_t i = 0; i < 50; ++i) rows[size_t(i)] = i;
      for (int64_t h = 0; h < 2; ++h)
        for (double mass : pattern_mass(p, in.q.view(), in.k.view(), *pat, 0, h, rows))
          EXPECT_NEAR(mass, 1.0, 1e-12);
    }
}

TEST(Patterns, MassFromTheLogSumExpMatchesTheFullSoftmax) {
  // the error measurement's mass comes from each row's log-sum-exp; it must equal the mass
  // from the full softmax row, under causal masking, m != n, key padding and a mask
  for (bool causal : {false, true}) {
    Problem p = test::problem(2, 2, 40, 56, 8, causal, 5);
    p.key_lengths = {56, 30};
    auto mask = std::make_shared<AttnMask>();
    mask->batch = 1, mask->heads = 1, mask->n = p.n, mask->m = p.keys();
    for (int64_t t = 0; t < p.n * p.keys(); ++t)
      mask->bias.push_back(t % 7 == 0 ? -INFINITY : float(t % 4) * 0.25f);
    p.attn_mask = mask;
    SCOPED_TRACE(p.str());
    Inputs in = generate_inputs(p);
    auto pat = pattern_of("local:window=5,block=8", p);
    std::vector<int64_t> rows(size_t(p.n));
    for (int64_t i = 0; i < p.n; ++i) rows[size_t(i)] = i;
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 2; ++h) {
        std::vector<double> out(rows.size() * size_t(p.dim)), lse(rows.size());
        reference_rows(p, in.q.view(), in.k.view(), in.v.view(), b, h, rows, out.data(), nullptr,
                       lse.data());
        const auto full = pattern_mass(p, in.q.view(), in.k.view(), *pat, b, h, rows);
        const auto fast = pattern_mass(p, in.q.view(), in.k.view(), *pat, b, h, rows, lse);
        for (size_t r = 0; r < rows.size(); ++r)
          EXPECT_NEAR(fast[r], full[r], 1e-12) << b << h << r;
      }
  }
}

TEST(Patterns, MassMatchesADirectComputation) {
  for (bool causal : {false, true}) {
    const Problem p = test::problem(1, 2, 50, 0, 16, causal, 9);
    SCOPED_TRACE(p.str());
    Inputs in = generate_inputs(p);
    auto pat = pattern_of("local:window=3,block=8", p);
    std::vector<int64_t> rows(50);
    for (int64_t i = 0; i < 50; ++i) rows[size_t(i)] = i;
    double smallest = 1;
    for (int64_t h = 0; h < 2; ++h) {
      const auto mass = pattern_mass(p, in.q.view(), in.k.view(), *pat, 0, h, rows);
      for (int64_t i = 0; i < 50; ++i) {
        // softmax of the whole visible row in double, summed over |i - j| <= 3
        const int64_t vis = causal ? i + 1 : 50;
        std::vector<double> s(static_cast<size_t>(vis));
        double mx = -INFINITY;
        for (int64_t j = 0; j < vis; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < 16; ++c)
            dot += double(in.q.view().row(0, h, i)[c]) * double(in.k.view().row(0, h, j)[c]);
          s[size_t(j)] = dot / 4.0;
          mx = std::max(mx, s[size_t(j)]);
        }
        double sum = 0, in_window = 0;
        for (int64_t j = 0; j < vis; ++j) {
          const double e = std::exp(s[size_t(j)] - mx);
          sum += e;
          if (std::llabs(i - j) <= 3) in_window += e;
        }
        EXPECT_NEAR(mass[size_t(i)], in_window / sum, 1e-12) << "h " << h << " i " << i;
        smallest = std::min(smallest, mass[size_t(i)]);
      }
    }
    EXPECT_LT(smallest, 0.99);  // the window really loses mass on these inputs
  }
}

// ----- registration -----

TEST(Patterns, RegisteredWithTheDocumentedParameters) {
  struct Want {
    const char* name;
    bool cross;
    std::vector<std::string> params;
  };
  const Want wants[] = {
      {"local", true, {"window", "sinks", "block"}},
      {"strided", true, {"stride", "span", "block"}},
      {"sparse_transformer", true, {"mode", "stride", "summary", "block"}},
      {"global", true, {"global", "positions", "block"}},
      {"longformer", true, {"window", "dilation", "dilated_heads", "global", "block"}},
      {"bigbird", false, {"block", "window_blocks", "random_blocks", "global_blocks"}},
  };
  for (const Want& w : wants) {
    const VariantInfo* info = Registry::instance().find(w.name);
    ASSERT_NE(info, nullptr) << w.name;
    EXPECT_TRUE(info->caps.causal) << w.name;
    EXPECT_EQ(info->caps.cross, w.cross) << w.name;
    std::vector<std::string> names;
    for (const ParamSpec& ps : info->params) {
      names.push_back(ps.name);
      EXPECT_FALSE(ps.help.empty()) << w.name << "." << ps.name;
      if (ps.name == "block") {
        EXPECT_EQ(ps.default_value, "64");
        EXPECT_EQ(ps.min, 1);
        EXPECT_EQ(ps.max, 4096);
      }
    }
    EXPECT_EQ(names, w.params) << w.name;
    EXPECT_FALSE(info->complexity.empty());
    auto v = make_variant(w.name);
    EXPECT_NE(v->make_pattern(test::problem(1, 1, 10, 0, 4, false), {}, {}), nullptr) << w.name;
  }
  EXPECT_EQ(make_variant("local")->spec(), "local:window=256,block=64");
  EXPECT_EQ(make_variant("global:positions=50+0+5")->spec(),
            "global:global=64,positions=0+5+50,block=64");
  EXPECT_THROW(make_variant("sparse_transformer:mode=dense"), SpecError);
  EXPECT_THROW(make_variant("local:block=0"), SpecError);
}

}  // namespace
}  // namespace attnbench
