// The attnbench command line: list, run, sweep, machine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace attnbench {

/// Parses a LIST such as "256,512,1024", "256..16384" (powers of two from the first to the
/// last) or a mix ("100,256..1024"). Throws UsageError naming `what` on bad text.
std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what);

/// Entry point of the attnbench binary; returns the exit code.
int cli_main(int argc, char** argv);

}  // namespace attnbench
