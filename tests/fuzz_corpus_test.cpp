// Replays the fuzz corpora of tests/fuzz/corpus (seeds, and every input a fuzzer crashed on)
// through the same calls as the fuzz targets, so a plain build keeps checking them: each input
// either parses or throws the parser's own error type, never anything else.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/npy.h"
#include "common/registry.h"
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

}  // namespace
}  // namespace attnbench
