// JsonWriter: JSON text written front to back, for the status API. Strings
// are escaped so that any bytes a peer chose (member names, hosts, error
// messages) come out as valid JSON and valid UTF-8: invalid UTF-8 becomes
// U+FFFD, and '<', '>', '&', U+2028 and U+2029 are escaped too, so the text
// is safe inside HTML or a script as well.
#ifndef COHORT_SERVER_STATUS_JSON_WRITER_H_
#define COHORT_SERVER_STATUS_JSON_WRITER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace cohort::server {

class JsonWriter {
 public:
  // Each call writes one value, or the key of the next one inside an
  // object; commas and colons are the writer's. REQUIRES: calls that make
  // one JSON value (Key only inside objects, each Begin matched by its
  // End).
  JsonWriter& BeginObject();
  JsonWriter& EndObject();
  JsonWriter& BeginArray();
  JsonWriter& EndArray();
  JsonWriter& Key(absl::string_view key);
  JsonWriter& String(absl::string_view value);
  JsonWriter& Int(int64_t value);
  JsonWriter& Bool(bool value);
  JsonWriter& Null();

  // Key(key) and its value in one call.
  JsonWriter& Field(absl::string_view key, absl::string_view value) {
    return Key(key).String(value);
  }
  JsonWriter& Field(absl::string_view key, const char* value) {
    return Key(key).String(value);
  }
  JsonWriter& Field(absl::string_view key, int64_t value) {
    return Key(key).Int(value);
  }
  JsonWriter& Field(absl::string_view key, int value) {
    return Key(key).Int(value);
  }
  JsonWriter& Field(absl::string_view key, size_t value) {
    return Key(key).Int(static_cast<int64_t>(value));
  }
  JsonWriter& Field(absl::string_view key, bool value) {
    return Key(key).Bool(value);
  }

  // The text written so far.
  const std::string& text() const { return out_; }

 private:
  // Writes the comma before a value or key, unless it follows its key.
  void Separate();

  std::string out_;
  std::vector<bool> has_items_;  // Per open object or array.
  bool after_key_ = false;
};

// `text` as a JSON string literal, quotes included (see JsonWriter).
std::string JsonQuote(absl::string_view text);

}  // namespace cohort::server

#endif  // COHORT_SERVER_STATUS_JSON_WRITER_H_
