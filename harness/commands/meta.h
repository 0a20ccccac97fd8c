// What meta.json records of a run: the date, version, source tree, build, machine, command line,
// plugins, variants and bf16 kernels.
#pragma once

#include <nlohmann/json.hpp>

#include "harness/machine.h"

namespace attnbench::cli {

// A finite number as JSON; null for NaN and infinities.
nlohmann::json json_number(double x);

// The meta.json of a sweep: the run's date, version, source tree (commit and changes), build,
// machine figures, host, threads, command line, plugins, variants and bf16 kernels.
nlohmann::json meta_json(int argc, char** argv, const MachineFigures& mf, int threads);

}  // namespace attnbench::cli
