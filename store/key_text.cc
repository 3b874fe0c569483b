#include "store/key_text.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace cohort::store {

std::string Quote(absl::string_view key) {
  constexpr size_t kMax = 64;
  std::string out = absl::CHexEscape(key.substr(0, kMax));
  if (key.size() > kMax) absl::StrAppend(&out, "...");
  return absl::StrCat("\"", out, "\"");
}

std::string QuoteList(const std::vector<absl::string_view>& keys) {
  constexpr size_t kMax = 8;
  std::vector<std::string> shown;
  for (size_t i = 0; i < keys.size() && i < kMax; ++i) {
    shown.push_back(Quote(keys[i]));
  }
  std::string out = absl::StrJoin(shown, ", ");
  if (keys.size() > kMax) {
    absl::StrAppend(&out, " and ", keys.size() - kMax, " more");
  }
  return out;
}

}  // namespace cohort::store
