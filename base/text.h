// How names, keys and values appear in messages: quoted, escaped, cut, and
// long lists shortened to their first few. Every layer's errors and logs use
// these, so a timeout reads the same whichever component produced it.
#ifndef COHORT_BASE_TEXT_H_
#define COHORT_BASE_TEXT_H_

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace cohort::base {

// A key (or value) for a message: quoted, escaped, cut after 64 bytes.
std::string Quote(absl::string_view key);

// Text a peer chose (a name, a host, an error it reported) for a message or
// a log line, inside quotes the caller writes or none: escaped, so that no
// control byte reaches a terminal or a log raw and no line can be forged,
// and cut after `max` bytes ("..." marks the cut).
std::string Escape(absl::string_view text, size_t max = 512);

// The first `shown` items of [begin, end), each passed through `format`,
// joined by ", ", then " and N more" when there were more. Reads only as
// far as it needs plus a count, so a million-entry map costs a count.
template <typename It, typename Format>
std::string FirstFew(It begin, It end, size_t shown, Format format) {
  std::string out;
  size_t n = 0;
  size_t total = 0;
  for (It it = begin; it != end; ++it, ++total) {
    if (n == shown) continue;
    absl::StrAppend(&out, n == 0 ? "" : ", ", format(*it));
    ++n;
  }
  if (total > shown) absl::StrAppend(&out, " and ", total - shown, " more");
  return out;
}

// The first 16 names, as they are, then "and N more".
std::string ListSome(const std::vector<std::string>& names);

// The first 8 keys, quoted, then "and N more".
std::string QuoteList(const std::vector<absl::string_view>& keys);

}  // namespace cohort::base

#endif  // COHORT_BASE_TEXT_H_
