// How keys appear in error messages, shared by every Store implementation so
// that a timeout or a bad value reads the same whichever store produced it.
#ifndef COHORT_STORE_KEY_TEXT_H_
#define COHORT_STORE_KEY_TEXT_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace cohort::store {

// A key (or value) for a message: quoted, escaped, cut after 64 bytes.
std::string Quote(absl::string_view key);

// The first 8 keys, quoted, then "and N more".
std::string QuoteList(const std::vector<absl::string_view>& keys);

}  // namespace cohort::store

#endif  // COHORT_STORE_KEY_TEXT_H_
