#include "common/core/suggest.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

namespace attnbench {

namespace {

char lower(char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); }

bool starts_with_nocase(std::string_view text, std::string_view prefix) {
  if (prefix.size() > text.size()) return false;
  for (size_t i = 0; i < prefix.size(); ++i)
    if (lower(text[i]) != lower(prefix[i])) return false;
  return true;
}

}  // namespace

int edit_distance(std::string_view a, std::string_view b) {
  // optimal string alignment: Levenshtein plus adjacent transpositions, over three rows
  const size_t n = a.size(), m = b.size();
  std::vector<int> before(m + 1), prev(m + 1), cur(m + 1);
  for (size_t j = 0; j <= m; ++j) prev[j] = static_cast<int>(j);
  for (size_t i = 1; i <= n; ++i) {
    cur[0] = static_cast<int>(i);
    for (size_t j = 1; j <= m; ++j) {
      const bool same = lower(a[i - 1]) == lower(b[j - 1]);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (same ? 0 : 1)});
      if (i > 1 && j > 1 && lower(a[i - 1]) == lower(b[j - 2]) &&
          lower(a[i - 2]) == lower(b[j - 1]))
        cur[j] = std::min(cur[j], before[j - 2] + 1);
    }
    std::swap(before, prev);
    std::swap(prev, cur);
  }
  return prev[m];
}

std::optional<std::string> closest_match(std::string_view word,
                                         const std::vector<std::string>& candidates) {
  if (word.empty() || candidates.empty()) return std::nullopt;
  const int limit = word.size() <= 4 ? 1 : word.size() <= 8 ? 2 : 3;
  int best = limit + 1;
  std::optional<std::string> found;
  bool tie = false;
  for (const std::string& c : candidates) {
    const int d = edit_distance(word, c);
    if (d < best) {
      best = d;
      found = c;
      tie = false;
    } else if (d == best && found && *found != c) {
      tie = true;
    }
  }
  if (found && !tie) return found;
  if (word.size() < 3) return std::nullopt;
  std::optional<std::string> prefixed;
  for (const std::string& c : candidates) {
    if (starts_with_nocase(c, word) || starts_with_nocase(word, c)) {
      if (prefixed && *prefixed != c) return std::nullopt;
      prefixed = c;
    }
  }
  return prefixed;
}

std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates,
                         std::string_view quote) {
  auto match = closest_match(word, candidates);
  return match ? fmt::format(" (did you mean {}{}{}?)", quote, *match, quote) : std::string();
}

}  // namespace attnbench
