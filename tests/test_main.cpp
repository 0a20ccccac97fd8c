// main() of attnbench_tests. The plugins of ATTNBENCH_PLUGINS (a colon-separated list, as for
// the attnbench binary) are loaded before GoogleTest enumerates its tests, so every test whose
// cases range over the registered variants (tests/test_util.h, variant_names(): AllVariants/*
// and Exact/*) gets cases for the plugins' variants too:
//
//   ATTNBENCH_PLUGINS=/abs/path/myattn.so attnbench_tests --gtest_filter='*/myattn'
//
// A plugin that does not load stops the tests with its error and exit status 2.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/io/plugin.h"

int main(int argc, char** argv) {
  if (const char* env = std::getenv("ATTNBENCH_PLUGINS")) {
    try {
      for (const std::string& path : attnbench::split_plugin_list(env))
        attnbench::load_plugin(path);
    } catch (const attnbench::PluginError& e) {
      std::fprintf(stderr, "attnbench_tests: %s (in ATTNBENCH_PLUGINS)\n", e.what());
      return 2;
    }
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
