// The text output of the commands: the variant table of `list`, a result row of `run` and
// `layer`, and the sweep's progress line.
#pragma once

#include <cstddef>
#include <string>

#include "harness/runner.h"

namespace attnbench::cli {

// A byte count in B, KiB, MiB, GiB or TiB; "n/a" when not finite.
std::string human_bytes(double b);
// Seconds as MM:SS or H:MM:SS; "?" when not finite.
std::string human_seconds(double s);
// "[i/N] elapsed 01:02, ETA 03:04 | WHAT", cut to kProgressColumns with "..." at the end.
std::string progress_line(size_t i, size_t n, double elapsed, double eta, const std::string& what);

// The variants with their capabilities and parameters, as a table (`list`).
void print_list();

// A result row as text, one line per figure.
void print_row(const Row& r);

// Prints the row of `run` or `layer` (as JSON or text); false, with its status on stderr, when
// it is not ok.
bool print_result(const Row& row, bool json);

}  // namespace attnbench::cli
