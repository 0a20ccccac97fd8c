// The plugin loader in process: a refused plugin leaves the registry exactly as it was.
// (tests/scripts/plugin_test.sh covers loading real plugins through an installed attnbench.)
#include <fstream>

#include "common/core/registry.h"
#include "common/io/plugin.h"
#include "test_util.h"

namespace attnbench {
namespace {

std::vector<std::string> registered_names() {
  std::vector<std::string> names;
  for (const VariantInfo* v : Registry::instance().all())
    names.push_back(v->name + "@" + v->plugin);
  return names;
}

TEST(PluginLoader, ClashAddsNothingAndKeepsTheBuiltIn) {
  const auto before = registered_names();
  // (the plugins of ATTNBENCH_PLUGINS, if the tests are run with some, are loaded already)
  const std::vector<std::string> plugins_before = loaded_plugins();
  const std::string msg =
      test::error_message<PluginError>([] { load_plugin(ATTNBENCH_TEST_CLASH_PLUGIN); });
  EXPECT_CONTAINS(msg, ATTNBENCH_TEST_CLASH_PLUGIN);
  EXPECT_CONTAINS(msg, "'full' is already registered (built in)");
  // clash_new, acceptable on its own, was not added either
  EXPECT_EQ(Registry::instance().find("clash_new"), nullptr);
  EXPECT_EQ(registered_names(), before);
  EXPECT_EQ(loaded_plugins(), plugins_before);
  // the built-in full still works
  Problem p;
  p.batch = 1, p.heads = 1, p.n = 7, p.dim = 5;
  Inputs in = generate_inputs(p);
  Tensor out = test::run("full", p, in);
  EXPECT_NE(out.data()[0], 0.0f);
  // a second attempt fails the same way (the failed load left no state behind)
  EXPECT_CONTAINS(
      test::error_message<PluginError>([] { load_plugin(ATTNBENCH_TEST_CLASH_PLUGIN); }),
      "'full' is already registered");
}

TEST(PluginLoader, MissingAndNonLibraryFilesAreNamed) {
  const auto before = registered_names();
  test::TempDir dir;
  EXPECT_CONTAINS(test::error_message<PluginError>([&] { load_plugin(dir.file("none.so")); }),
                  dir.file("none.so") + ": no such file");
  std::ofstream(dir.file("text.so")) << "text";
  EXPECT_CONTAINS(test::error_message<PluginError>([&] { load_plugin(dir.file("text.so")); }),
                  dir.file("text.so") + ": not a shared library");
  EXPECT_CONTAINS(test::error_message<PluginError>([&] { load_plugin(dir.path().string()); }),
                  "a directory");
  EXPECT_EQ(registered_names(), before);
}

TEST(PluginLoader, AbiIsReadFromTheFile) {
  EXPECT_EQ(read_plugin_abi(ATTNBENCH_TEST_CLASH_PLUGIN), ATTNBENCH_ABI_VERSION);
  // libattnbench itself is a shared library but no plugin
  EXPECT_CONTAINS(test::error_message<PluginError>([] { read_plugin_abi(ATTNBENCH_LIBRARY); }),
                  "not an attnbench plugin");
}

TEST(PluginLoader, SplitsTheEnvironmentList) {
  EXPECT_EQ(split_plugin_list("a.so:/x/b.so"), (std::vector<std::string>{"a.so", "/x/b.so"}));
  EXPECT_EQ(split_plugin_list("::a.so::"), (std::vector<std::string>{"a.so"}));
  EXPECT_TRUE(split_plugin_list("").empty());
}

TEST(Registry, AddAllAddsAllOrNone) {
  auto info = [](const std::string& name) {
    return VariantInfo{
        .name = name, .summary = "", .complexity = "", .params = {}, .caps = {}, .make = nullptr};
  };
  std::vector<VariantInfo> batch;
  batch.push_back(info("test_all_a"));
  batch.push_back(info("test_all_a"));
  EXPECT_THROW(Registry::instance().add_all(std::move(batch)), SpecError);
  EXPECT_EQ(Registry::instance().find("test_all_a"), nullptr);
  batch.clear();
  batch.push_back(info("test_all_b"));
  batch.push_back(info("flash"));
  EXPECT_THROW(Registry::instance().add_all(std::move(batch)), SpecError);
  EXPECT_EQ(Registry::instance().find("test_all_b"), nullptr);
}

}  // namespace
}  // namespace attnbench
