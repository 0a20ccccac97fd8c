// Replays the fuzz corpora of tests/fuzz/corpus (seeds, and every input a fuzzer crashed on)
// through the same calls as the fuzz targets, so a plain build keeps checking them: each input
// either parses or throws the parser's own error type, never anything else.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "common/core/error.h"
#include "common/core/registry.h"
#include "common/io/npy.h"
#include "harness/merge.h"
#include "harness/results.h"
#include "test_util.h"

namespace attnbench {
namespace {

std::vector<std::filesystem::path> corpus(const char* target) {
  std::vector<std::filesystem::path> files;
  for (const auto& e :
       std::filesystem::directory_iterator(std::filesystem::path(ATTNBENCH_FUZZ_CORPUS) / target))
    if (e.is_regular_file()) files.push_back(e.path());
  EXPECT_FALSE(files.empty()) << target;
  return files;
}

TEST(FuzzCorpus, Spec) {
  for (const auto& file : corpus("spec")) {
    SCOPED_TRACE(file.string());
    const std::string spec = test::read_text(file.string());
    try {
      auto variant = make_variant(spec);
      EXPECT_EQ(make_variant(variant->spec())->spec(), variant->spec());
    } catch (const SpecError& e) {
      EXPECT_NE(std::string(e.what()), "");
    }
  }
}

TEST(FuzzCorpus, Npy) {
  for (const auto& file : corpus("npy")) {
    SCOPED_TRACE(file.string());
    const std::string bytes = test::read_text(file.string());
    try {
      NpyArray a = parse_npy(bytes, file.string());
      NpyArray b = parse_npy(encode_npy(a), "encoded");
      EXPECT_EQ(a.shape, b.shape);
      EXPECT_EQ(a.data, b.data);
      Problem p;
      inputs_from_arrays({{"q", a}, {"k", a}, {"v", a}}, file.string(), &p);
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(file.string()), std::string::npos) << e.what();
    }
  }
}

TEST(FuzzCorpus, Npz) {
  for (const auto& file : corpus("npz")) {
    SCOPED_TRACE(file.string());
    try {
      Problem p;
      load_inputs_npz(file.string(), &p);
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(file.string()), std::string::npos) << e.what();
    }
  }
}

TEST(FuzzCorpus, Mask) {
  for (const auto& file : corpus("mask")) {
    SCOPED_TRACE(file.string());
    const std::string bytes = test::read_text(file.string());
    if (bytes.size() < 4) continue;
    Problem p;  // the sizes as fuzz_mask draws them from the first four bytes
    p.batch = 1 + static_cast<unsigned char>(bytes[0]) % 3;
    p.heads = 1 + static_cast<unsigned char>(bytes[1]) % 4;
    p.n = 1 + static_cast<unsigned char>(bytes[2]) % 17;
    p.m = 1 + static_cast<unsigned char>(bytes[3]) % 17;
    p.dim = 4;
    try {
      const auto mask = attn_mask_from_array(parse_npy(bytes.substr(4), "mask.npy"), "mask.npy", p);
      ASSERT_TRUE(mask);
      EXPECT_EQ(mask->n, p.n);
      EXPECT_EQ(mask->m, p.keys());
      for (float b : mask->bias) EXPECT_FALSE(std::isnan(b) || (b > 0 && std::isinf(b)));
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("mask.npy"), std::string::npos) << e.what();
    }
  }
}

// The results.csv readers of `sweep --resume` and `merge` on each seed, as fuzz_results runs
// them: they keep only whole rows of the current columns, or refuse with a message.
TEST(FuzzCorpus, Results) {
  for (const auto& file : corpus("results")) {
    SCOPED_TRACE(file.string());
    test::TempDir dir;
    const std::string shard = dir.file("shard"), resumed = dir.file("resumed");
    std::filesystem::create_directories(shard);
    std::filesystem::create_directories(resumed);
    const std::string text = test::read_text(file.string());
    test::write_text(shard + "/results.csv", text);
    test::write_text(shard + "/meta.json", R"({"git_commit": "c", "sweep_definition": "d"})");
    test::write_text(resumed + "/results.csv", text);
    try {
      MergeOptions opt;
      opt.dirs = {shard};
      opt.out = dir.file("merged");
      opt.allow_missing = true;
      merge_results(opt);
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()), "");
    }
    try {
      ResultsDir rd(resumed, /*resume=*/true);
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()), "");
      continue;
    }
    const auto lines = test::read_lines(resumed + "/results.csv");
    ASSERT_FALSE(lines.empty());
    EXPECT_EQ(split_csv_line(lines[0]), csv_columns());
    for (size_t i = 1; i < lines.size(); ++i) {
      if (lines[i].empty()) continue;
      EXPECT_EQ(malformed_reason(csv_columns(), split_csv_line(lines[i])), "") << lines[i];
    }
  }
}

}  // namespace
}  // namespace attnbench
