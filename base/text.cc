#include "base/text.h"

#include "absl/strings/escaping.h"

namespace cohort::base {

std::string Quote(absl::string_view key) {
  constexpr size_t kMax = 64;
  std::string out = absl::CHexEscape(key.substr(0, kMax));
  if (key.size() > kMax) absl::StrAppend(&out, "...");
  return absl::StrCat("\"", out, "\"");
}

std::string Escape(absl::string_view text, size_t max) {
  std::string out = absl::CHexEscape(text.substr(0, max));
  if (text.size() > max) absl::StrAppend(&out, "...");
  return out;
}

std::string ListSome(const std::vector<std::string>& names) {
  return FirstFew(
      names.begin(), names.end(), 16,
      [](const std::string& name) -> const std::string& { return name; });
}

std::string QuoteList(const std::vector<absl::string_view>& keys) {
  return FirstFew(keys.begin(), keys.end(), 8, Quote);
}

}  // namespace cohort::base
