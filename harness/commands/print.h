// The text output of the commands: the variant table of `list`, a result row of `run` and
// `layer`, and the sweep's progress line.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "harness/runner.h"

namespace attnbench::cli {

// A byte count in B, KiB, MiB, GiB or TiB; "n/a" when not finite.
std::string human_bytes(double b);
// Seconds as MM:SS or H:MM:SS; "?" when not finite.
std::string human_seconds(double s);
// "[i/N] elapsed 01:02, ETA 03:04 | WHAT", cut to kProgressColumns with "..." at the end.
std::string progress_line(size_t i, size_t n, double elapsed, double eta, const std::string& what);

// The variants (every one, or those named) with their capabilities and parameters, as a table
// (`list`), or one line each of at most 100 columns (`list --brief`). An unknown name is a
// SpecError.
void print_list(const std::vector<std::string>& names = {}, bool brief = false);
// The registered variants of these names (all when none; a NAME may be a spec), in that order.
std::vector<const VariantInfo*> listed_variants(const std::vector<std::string>& names);

// A result row as text, one line per figure.
void print_row(const Row& r);

// Prints the row of `run` or `layer` (as JSON or text); false, with its status on stderr, when
// it is not ok.
bool print_result(const Row& row, bool json);

}  // namespace attnbench::cli
