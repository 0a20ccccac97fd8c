// Hostile inputs on the passes (bwd, fwdbwd, decode) and on bf16, through the binary: each is
// refused with one line naming what is wrong and what is accepted, and a non-zero exit (2 for a
// bad value, 1 for something the variant cannot do, with the row printed), never a crash or a
// silent answer.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/io/npy.h"
#include "test_util.h"

namespace attnbench {
namespace {

using test::CliResult;
using test::run_cli;
using test::TempDir;

struct Case {
  std::string args;  ///< after `run --seq 32 --heads 2 --dim 8 --reps 1 --min-time 0`
  int code;          ///< the exit status expected
  std::string says;  ///< a phrase of the message
};

void expect_refused(const std::vector<Case>& cases, const TempDir& dir) {
  for (const auto& c : cases) {
    const std::string args = "run --seq 32 --heads 2 --dim 8 --reps 1 --min-time 0 " + c.args;
    const CliResult r = run_cli(args, dir);
    EXPECT_EQ(r.code, c.code) << args << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("attnbench: ", 0), 0u) << args << ": " << r.err;
    EXPECT_CONTAINS(r.err, c.says);
    EXPECT_EQ(r.err.find("terminate"), std::string::npos) << args << ": " << r.err;
    // a refused problem prints no measurement: either nothing, or its row with the status
    if (!r.out.empty()) {
      EXPECT_CONTAINS(r.out, "status");
    }
    EXPECT_EQ(r.out.find("time "), std::string::npos) << args << ": " << r.out;
  }
}

TEST(HostilePasses, Decode) {
  TempDir dir;
  expect_refused(
      {
          {"--variant flash --pass decode", 1, "it needs --causal and m = n"},
          {"--variant flash --pass decode --causal --seq-k 16", 1, "n = 32, m = 16"},
          {"--variant flash --pass decode --causal --key-padding 3", 1, "--key-padding"},
          {"--variant reformer --pass decode --causal", 1, "has no decode step"},
          {"--variant sinkhorn --pass decode --causal", 1, "has no decode step"},
          {"--variant flash --pass decode --causal --dtype bf16", 1, "float32 only"},
          {"--variant flash --pass decode --causal --score additive", 1, "scaled_dot score only"},
          {"--variant flash --pass Decode --causal", 2, "not in {fwd,bwd,fwdbwd,decode}"},
          {"--variant flash --pass decode --causal --batch 0", 2, "--batch"},
      },
      dir);
}

TEST(HostilePasses, Backward) {
  TempDir dir;
  expect_refused(
      {
          {"--variant flash --pass bwd --score additive", 1,
           "the backward pass does not support the additive score"},
          {"--variant flash --pass bwd --dtype bf16", 1, "float32 only"},
          {"--variant flash --pass fwd --save-grads " + dir.file("g.npz"), 2,
           "--save-grads needs a backward pass"},
          {"--variant flash --pass Bwd", 2, "not in {fwd,bwd,fwdbwd,decode}"},
          {"--variant flash --pass bwd --save-grads /dev/null", 2, "not a regular file"},
      },
      dir);
}

TEST(HostilePasses, Bf16) {
  TempDir dir;
  expect_refused(
      {
          {"--variant performer --dtype bf16", 1, "has no bf16 path"},
          {"--variant flash --dtype fp16", 2, "not in {f32,bf16}"},
          {"--variant flash --dtype BF16", 2, "not in {f32,bf16}"},
      },
      dir);
}

// Inputs files on the passes: a non-finite value, and keys of another length than the queries
// for decoding, are refused before any measurement.
TEST(HostilePasses, InputsFiles) {
  TempDir dir;
  auto array = [](int64_t len, float first) {
    NpyArray a{"<f4", {1, 2, len, 8}, {}};
    std::vector<float> v(size_t(2 * len * 8), 0.25f);
    v[0] = first;
    a.data.assign(reinterpret_cast<const char*>(v.data()),
                  reinterpret_cast<const char*>(v.data() + v.size()));
    return a;
  };
  const std::string nan = dir.file("nan.npz"), ragged = dir.file("ragged.npz");
  write_npz(nan, {{"q", array(32, std::nanf(""))}, {"k", array(32, 1)}, {"v", array(32, 1)}});
  write_npz(ragged, {{"q", array(32, 1)}, {"k", array(20, 1)}, {"v", array(20, 1)}});
  for (const std::string pass : {"--pass bwd", "--dtype bf16", "--pass decode --causal"}) {
    const CliResult r =
        run_cli("run --variant flash --reps 1 --min-time 0 --inputs '" + nan + "' " + pass, dir);
    EXPECT_EQ(r.code, 2) << pass << "\n" << r.err;
    EXPECT_CONTAINS(r.err, "inputs must be finite");
  }
  const CliResult r = run_cli(
      "run --variant flash --reps 1 --min-time 0 --pass decode --causal --inputs '" + ragged + "'",
      dir);
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_CONTAINS(r.err, "n = 32, m = 20");
}

}  // namespace
}  // namespace attnbench
