// The command line's size grammar: k suffixes in lists and single lengths.
#include "harness/commands/options.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/core/error.h"

namespace attnbench::cli {
namespace {

TEST(Options, SizesTakeKForTimes1024) {
  EXPECT_EQ(expand_k("1k"), "1024");
  EXPECT_EQ(expand_k("4K"), "4096");
  EXPECT_EQ(expand_k("512"), "512");
  EXPECT_EQ(expand_k("k"), "k");
  EXPECT_EQ(expand_k("1.5k"), "1.5k");  // not an integer: left to the validator's message
  EXPECT_EQ(parse_list("1k,2K,512", "--seq", false), (std::vector<int64_t>{1024, 2048, 512}));
  EXPECT_EQ(parse_list("1k..4k", "--seq", false), (std::vector<int64_t>{1024, 2048, 4096}));
  EXPECT_EQ(parse_list("1k..2k:+512", "--seq", false), (std::vector<int64_t>{1024, 1536, 2048}));
  EXPECT_THROW(parse_list("1q", "--seq", false), UsageError);
  EXPECT_THROW(parse_list("2097152k", "--seq", false), UsageError);  // 2^31 > 2^31 - 1
}

TEST(Options, ALengthOfOneProblemTakesKAndPointsListsAtSweep) {
  const CLI::Validator length = length_in(1, 1 << 20, "run");
  std::string text = "2k";
  EXPECT_EQ(length(text), "");
  EXPECT_EQ(text, "2048");  // rewritten for the option's conversion
  text = "256,512";
  EXPECT_NE(length(text).find("`attnbench sweep --seq 256,512`"), std::string::npos);
  text = "2048k";
  EXPECT_NE(length(text).find("out of range"), std::string::npos);
  text = "abc";
  EXPECT_NE(length(text).find("not an integer"), std::string::npos);
}

}  // namespace
}  // namespace attnbench::cli
