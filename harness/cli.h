// The attnbench command line: list, run, sweep, merge, layer, pattern, machine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace attnbench {

/// Parses a LIST option of the sweep: comma-separated items, each a positive integer N, a
/// geometric range A..B:xF (A, A*F, A*F^2, ... while <= B; F an integer >= 2), an arithmetic
/// range A..B:+S (A, A+S, ... while <= B) or A..B, doubling from A, accepted only when it
/// reaches B exactly (256..8192). E.g. "256,512", "100,256..1024", "256..5000:+256". Throws
/// UsageError naming `what`, what is wrong and the accepted forms.
std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what);

/// The sweep's --seq-k: a LIST as parse_int_list reads it, where the item `same` (0 in the
/// result) stands for m = n.
std::vector<int64_t> parse_seq_k_list(const std::string& text);

/// Entry point of the attnbench binary; returns the exit code.
int cli_main(int argc, char** argv);

}  // namespace attnbench
