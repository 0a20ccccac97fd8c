// The decode pass of the harness (--pass decode, run_one): the checked generation of the last
// positions against exact attention, the timed steps and the decode columns, the refusals, and
// the CLI and sweep around them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common/core/registry.h"
#include "harness/results.h"
#include "harness/runner.h"
#include "test_util.h"

namespace attnbench {
namespace {

Row run_decode(const std::string& spec, const Problem& p, const MachineFigures& mf = {},
               int reps = 2) {
  auto v = make_variant(spec);
  Workload w;
  w.pass = "decode";
  const RunOptions opt{.reps = reps, .min_time = 0};
  return run_one(*v, p, w, nullptr, mf, opt);
}

TEST(DecodeRows, StepCountsAreBoundedByTheContext) {
  EXPECT_EQ(decode_timed_steps(1), 8);
  EXPECT_EQ(decode_timed_steps(1024), 16);
  EXPECT_EQ(decode_timed_steps(65536), 64);
  EXPECT_EQ(decode_checked_steps(3), 3);
  EXPECT_EQ(decode_checked_steps(1000), 8);
}

TEST(DecodeRows, FlashRowHasItsStateStepAndExactError) {
  const int64_t B = 2, H = 3, n = 45, d = 16;
  const Problem p = test::problem(B, H, n, 0, d, true);
  MachineFigures mf;
  mf.bandwidth_gbs = 10;
  const Row r = run_decode("flash", p, mf);
  ASSERT_EQ(r.status, "ok") << r.message;
  // the generated rows (the last 8 of each head) against exact causal attention
  EXPECT_EQ(r.error.rows_used, B * H * 8);
  EXPECT_EQ(r.error.rows_total, B * H * n);
  EXPECT_LT(r.error.rel_fro, 1e-5);
  // a KV cache of n positions per head; one step reads all of it, and its own rows
  EXPECT_EQ(r.state_bytes, double(H * n * 2 * d * 4));
  EXPECT_GE(r.bytes_read_per_step, double(B * H * n * 2 * d * 4));
  EXPECT_GT(r.flops, 0);
  EXPECT_EQ(r.iterations, decode_timed_steps(n));
  EXPECT_EQ(r.reps, 2);
  EXPECT_EQ(r.time_per_token, r.time_median);
  EXPECT_DOUBLE_EQ(r.tokens_per_s, double(B) / r.time_median);
  EXPECT_GT(r.prefill_seconds, 0);
  EXPECT_DOUBLE_EQ(r.bandwidth_fraction, r.bytes_read_per_step / r.time_median / 1e10);
  // no bandwidth measured: no fraction
  const Row r0 = run_decode("flash", p);
  ASSERT_EQ(r0.status, "ok") << r0.message;
  EXPECT_TRUE(std::isnan(r0.bandwidth_fraction));
}

TEST(DecodeRows, AWindowIsMeasuredAgainstExactAttention) {
  // local sees a window of 3 keys: far from exact attention on 40 positions, and its pattern
  // keeps a small share of the softmax mass
  const Problem p = test::problem(1, 2, 40, 0, 8, true);
  const Row r = run_decode("local:window=2", p);
  ASSERT_EQ(r.status, "ok") << r.message;
  EXPECT_GT(r.error.rel_fro, 1e-2);
  EXPECT_LT(r.error.mass_mean, 0.5);
  EXPECT_EQ(r.state_bytes, double(2 * 3 * 2 * 8 * 4));  // the ring of window + 1 rows
}

TEST(DecodeRows, RefusalsAreUnsupportedRowsThatNameTheReason) {
  Row r = run_decode("flash", test::problem(1, 2, 16, 0, 8, false));
  EXPECT_EQ(r.status, "unsupported");
  EXPECT_NE(r.message.find("causal"), std::string::npos) << r.message;
  r = run_decode("flash", test::problem(1, 2, 16, 24, 8, true));
  EXPECT_EQ(r.status, "unsupported");
  EXPECT_NE(r.message.find("m = n"), std::string::npos) << r.message;
  r = run_decode("routing", test::problem(1, 2, 16, 0, 8, true));
  EXPECT_EQ(r.status, "unsupported");
  EXPECT_NE(r.message.find("has no decode step"), std::string::npos) << r.message;
  Problem dot = test::problem(1, 2, 16, 0, 8, true);
  dot.score = Score::dot;
  r = run_decode("flash", dot);
  EXPECT_EQ(r.status, "unsupported");
  EXPECT_NE(r.message.find("scaled_dot"), std::string::npos) << r.message;
}

TEST(DecodeCli, RunPrintsTheDecodeColumnsAndSweepKeepsThem) {
  test::TempDir dir;
  auto r = test::run_cli(
      "run --variant flash --seq 24 --heads 2 --dim 8 --causal --pass decode --reps 1 --json", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* c :
       {"\"prefill_s\"", "\"time_per_token_s\"", "\"tokens_per_s\"", "\"state_bytes\"",
        "\"bytes_read_per_step\"", "\"bandwidth_fraction\"", "\"pass\": \"decode\""})
    EXPECT_NE(r.out.find(c), std::string::npos) << c << " in " << r.out;
  r = test::run_cli(
      "run --variant flash --seq 16 --causal --pass decode --save-grads " + dir.file("g.npz"), dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--save-grads needs a backward pass"), std::string::npos) << r.err;

  const std::string args =
      "sweep --variant flash --variant routing --seq 32 --heads 2 --dim 8 --causal both "
      "--pass fwd,decode --reps 1 --min-time 0 --out " +
      dir.file("s");
  r = test::run_cli(args, dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<std::string> lines = test::read_lines(dir.file("s/results.csv"));
  ASSERT_EQ(lines.size(), 9u);  // 2 variants x causal off/on x 2 passes
  const std::vector<std::string> header = split_csv_line(lines[0]);
  const auto col = [&](const std::string& name) {
    return size_t(std::find(header.begin(), header.end(), name) - header.begin());
  };
  int decoded = 0;
  for (size_t i = 1; i < lines.size(); ++i) {
    const auto f = split_csv_line(lines[i]);
    if (f[col("pass")] != "decode") {
      EXPECT_EQ(f[col("time_per_token_s")], "") << lines[i];
      continue;
    }
    if (f[col("variant")] == "flash" && f[col("causal")] == "1") {
      ASSERT_EQ(f[col("status")], "ok") << lines[i];
      EXPECT_EQ(std::stod(f[col("state_bytes")]), 2.0 * 32 * 2 * 8 * 4) << lines[i];
      EXPECT_GT(std::stod(f[col("time_per_token_s")]), 0) << lines[i];
      ++decoded;
    } else {
      EXPECT_EQ(f[col("status")], "unsupported") << lines[i];
    }
  }
  EXPECT_EQ(decoded, 1);
  r = test::run_cli(args + " --resume", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(test::read_lines(dir.file("s/results.csv")).size(), 9u);
}

}  // namespace
}  // namespace attnbench
