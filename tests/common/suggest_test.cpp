// "Did you mean": the edit distance and the nearest accepted word.
#include "common/core/suggest.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace attnbench {
namespace {

TEST(Suggest, EditDistanceCountsEachEditOnceAndIgnoresCase) {
  EXPECT_EQ(edit_distance("", ""), 0);
  EXPECT_EQ(edit_distance("", "abc"), 3);
  EXPECT_EQ(edit_distance("flash", "flash"), 0);
  EXPECT_EQ(edit_distance("Flash", "flash"), 0);
  EXPECT_EQ(edit_distance("flsh", "flash"), 1);      // deletion
  EXPECT_EQ(edit_distance("flassh", "flash"), 1);    // insertion
  EXPECT_EQ(edit_distance("flach", "flash"), 1);     // substitution
  EXPECT_EQ(edit_distance("casual", "causal"), 1);   // two adjacent letters swapped
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3);  // the textbook pair
  EXPECT_EQ(edit_distance("abc", "cba"), 2);
  // symmetric
  EXPECT_EQ(edit_distance("windw", "window"), edit_distance("window", "windw"));
}

TEST(Suggest, ClosestMatchNamesOneNearWordOrNone) {
  const std::vector<std::string> variants = {"flash",      "full",      "linear",   "local",
                                             "longformer", "performer", "reformer", "nystrom"};
  EXPECT_EQ(closest_match("flsh", variants), "flash");
  EXPECT_EQ(closest_match("FLASH", variants), "flash");
  EXPECT_EQ(closest_match("nystrm", variants), "nystrom");
  EXPECT_EQ(closest_match("perfromer", variants), "performer");
  EXPECT_EQ(closest_match("longform", variants), "longformer");  // a prefix, 2 letters short
  EXPECT_EQ(closest_match("xyz", variants), std::nullopt);       // nothing near
  EXPECT_EQ(closest_match("lineark", variants), "linear");
  // equally near two candidates: no guess
  EXPECT_EQ(closest_match("fll", {"full", "fill"}), std::nullopt);
  EXPECT_EQ(closest_match("", variants), std::nullopt);
  EXPECT_EQ(closest_match("flash", {}), std::nullopt);
  EXPECT_EQ(did_you_mean("windw", {"window", "block"}), " (did you mean 'window'?)");
  EXPECT_EQ(did_you_mean("causl", {"causal"}, ""), " (did you mean causal?)");
  EXPECT_EQ(did_you_mean("zzz", {"window", "block"}), "");
}

}  // namespace
}  // namespace attnbench
