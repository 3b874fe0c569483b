// FuzzInput: reads a fuzzer's bytes as a sequence of small choices. Past the
// end it returns zeros and empty strings, so every input is a valid (if
// short) program and a fuzzer can grow one byte by byte.
#ifndef COHORT_TESTS_FUZZ_FUZZ_INPUT_H_
#define COHORT_TESTS_FUZZ_FUZZ_INPUT_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

// A property every fuzz target checks: on failure, say which and abort, so
// the fuzzer keeps the input (assert would vanish under NDEBUG).
#define FUZZ_CHECK(cond)                                                    \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, \
                   #cond);                                                  \
      std::abort();                                                         \
    }                                                                       \
  } while (0)

namespace cohort::fuzz {

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  bool empty() const { return pos_ >= size_; }

  uint8_t Byte() { return empty() ? 0 : data_[pos_++]; }

  // A choice among n (> 0) alternatives.
  size_t Pick(size_t n) { return Byte() % n; }

  uint32_t U32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{Byte()} << (8 * i);
    return v;
  }

  int64_t I64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t{Byte()} << (8 * i);
    return static_cast<int64_t>(v);
  }

  // A length byte (at most max_size), then that many bytes (fewer if the
  // input ends first).
  std::string Bytes(size_t max_size) {
    size_t n = std::min<size_t>(Byte() % (max_size + 1), size_ - pos_);
    if (empty()) n = 0;
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  const uint8_t* const data_;
  const size_t size_;
  size_t pos_ = 0;
};

}  // namespace cohort::fuzz

#endif  // COHORT_TESTS_FUZZ_FUZZ_INPUT_H_
