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
// A duration in words: "40 s", "12 min", "2.5 h"; "?" when not finite.
std::string human_duration(double s);
// "[i/N] elapsed 01:02, ETA 03:04 | WHAT", cut to kProgressColumns with "..." at the end.
std::string progress_line(size_t i, size_t n, double elapsed, double eta, const std::string& what);

// The variants (every one, or those named) with their capabilities and parameters, as a table
// (`list`), or one line each of at most 100 columns (`list --brief`). An unknown name is a
// SpecError.
void print_list(const std::vector<std::string>& names = {}, bool brief = false);
// The registered variants of these names (all when none; a NAME may be a spec), in that order.
std::vector<const VariantInfo*> listed_variants(const std::vector<std::string>& names);

// What a sweep's progress line measures: n, causal and the pass first, then the spec (a layer's
// E) and the rest of describe(), so that the line, cut at its end, loses the detail.
std::string progress_what(const std::string& spec, int64_t embed, const Problem& p,
                          const Workload& w);

// "name:key=value,..." with only the parameters that differ from the variant's defaults (the
// spec as it is when this binary cannot build it).
std::string short_spec(const std::string& spec);

// The table a sweep ends with, on stdout: at its largest n, causal when it measured causal rows
// there, on the problem of its first forward row there, one line per variant (at most
// `max_lines`, in plan order): the forward time, the speed over flash of each pass on the same
// problem, the error against exact attention (on the trained inputs when the sweep measured
// them there) and the peak memory; then the command that draws the figures and report of
// `out_dir`.
void print_sweep_table(const std::vector<Row>& rows, const std::string& out_dir,
                       size_t max_lines = 40);
// The command that plots a results directory: the installed scripts' plot.py
// (PREFIX/share/attnbench/scripts beside this binary's PREFIX/bin), else the source tree's,
// relative to the current directory when inside it.
std::string plot_command(const std::string& out_dir);

// A result row as text, one line per figure.
void print_row(const Row& r);

// Prints the row of `run` or `layer` (as JSON or text); false, with its status on stderr, when
// it is not ok.
bool print_result(const Row& row, bool json);

}  // namespace attnbench::cli
