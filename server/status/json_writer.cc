#include "server/status/json_writer.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace cohort::server {
namespace {

// The length of the valid UTF-8 sequence at the start of `s` (1 to 4), or
// 0 if it does not start with one (overlong forms and surrogates are not
// valid).
size_t Utf8Length(absl::string_view s) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const auto continuation = [&](size_t i) {
    return i < s.size() && (byte(i) & 0xC0) == 0x80;
  };
  const unsigned char b = byte(0);
  if (b < 0x80) return 1;
  if (b >= 0xC2 && b <= 0xDF) return continuation(1) ? 2 : 0;
  if (b >= 0xE0 && b <= 0xEF) {
    if (!continuation(1) || !continuation(2)) return 0;
    if (b == 0xE0 && byte(1) < 0xA0) return 0;   // Overlong.
    if (b == 0xED && byte(1) >= 0xA0) return 0;  // Surrogate.
    return 3;
  }
  if (b >= 0xF0 && b <= 0xF4) {
    if (!continuation(1) || !continuation(2) || !continuation(3)) return 0;
    if (b == 0xF0 && byte(1) < 0x90) return 0;   // Overlong.
    if (b == 0xF4 && byte(1) >= 0x90) return 0;  // Past U+10FFFF.
    return 4;
  }
  return 0;
}

void AppendQuoted(std::string& out, absl::string_view text) {
  out.push_back('"');
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    const size_t n = Utf8Length(text.substr(i));
    if (n == 0) {
      out.append("\\ufffd");
      ++i;
      continue;
    }
    if (n > 1) {
      const absl::string_view seq = text.substr(i, n);
      // U+2028 and U+2029 end a line in JavaScript source.
      if (seq == "\xE2\x80\xA8" || seq == "\xE2\x80\xA9") {
        out.append(seq == "\xE2\x80\xA8" ? "\\u2028" : "\\u2029");
      } else {
        out.append(seq.data(), seq.size());
      }
      i += n;
      continue;
    }
    switch (c) {
      case '"':
        out.append("\\\"");
        break;
      case '\\':
        out.append("\\\\");
        break;
      case '\n':
        out.append("\\n");
        break;
      case '\r':
        out.append("\\r");
        break;
      case '\t':
        out.append("\\t");
        break;
      case '<':
      case '>':
      case '&':
        absl::StrAppendFormat(&out, "\\u%04x", static_cast<int>(c));
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<int>(c));
        } else {
          out.push_back(c);
        }
    }
    ++i;
  }
  out.push_back('"');
}

}  // namespace

std::string JsonQuote(absl::string_view text) {
  std::string out;
  AppendQuoted(out, text);
  return out;
}

void JsonWriter::Separate() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (has_items_.empty()) return;
  if (has_items_.back()) out_.push_back(',');
  has_items_.back() = true;
}

JsonWriter& JsonWriter::BeginObject() {
  Separate();
  out_.push_back('{');
  has_items_.push_back(false);
  return *this;
}

JsonWriter& JsonWriter::EndObject() {
  has_items_.pop_back();
  out_.push_back('}');
  return *this;
}

JsonWriter& JsonWriter::BeginArray() {
  Separate();
  out_.push_back('[');
  has_items_.push_back(false);
  return *this;
}

JsonWriter& JsonWriter::EndArray() {
  has_items_.pop_back();
  out_.push_back(']');
  return *this;
}

JsonWriter& JsonWriter::Key(absl::string_view key) {
  Separate();
  AppendQuoted(out_, key);
  out_.push_back(':');
  after_key_ = true;
  return *this;
}

JsonWriter& JsonWriter::String(absl::string_view value) {
  Separate();
  AppendQuoted(out_, value);
  return *this;
}

JsonWriter& JsonWriter::Int(int64_t value) {
  Separate();
  absl::StrAppend(&out_, value);
  return *this;
}

JsonWriter& JsonWriter::Bool(bool value) {
  Separate();
  out_.append(value ? "true" : "false");
  return *this;
}

JsonWriter& JsonWriter::Null() {
  Separate();
  out_.append("null");
  return *this;
}

}  // namespace cohort::server
