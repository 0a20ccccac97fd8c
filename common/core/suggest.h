// "Did you mean": the accepted word nearest a mistyped one (variant names, parameters,
// options, commands).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace attnbench {

/// Edit distance between a and b, case-insensitive: insertions, deletions, substitutions and
/// transpositions of two adjacent letters each count 1 ("flsh" -> "flash" 1, "Flash" -> "flash"
/// 0, "windw" -> "window" 1, "casual" -> "causal" 1).
int edit_distance(std::string_view a, std::string_view b);

/// The candidate nearest `word` when it is near enough to be what was meant: a distance of at
/// most 1 for words of up to 4 letters, 2 up to 8 and 3 beyond, and nearer than any other
/// candidate (a tie names none). Also a candidate that `word` starts with or that starts with
/// `word` when `word` has at least 3 letters and only one candidate does.
std::optional<std::string> closest_match(std::string_view word,
                                         const std::vector<std::string>& candidates);

/// " (did you mean 'X'?)" for the closest_match, or "".
std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates,
                         std::string_view quote = "'");

}  // namespace attnbench
