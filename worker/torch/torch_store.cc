#include "worker/torch/torch_store.h"

#include <chrono>
#include <exception>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "torch/csrc/api/include/torch/version.h"

namespace cohort {
namespace {

std::vector<uint8_t> Bytes(absl::string_view text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

std::string Text(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

std::chrono::milliseconds Millis(absl::Duration timeout) {
  // c10d reads a zero timeout as "none": wait at least a millisecond.
  if (timeout == absl::InfiniteDuration()) return std::chrono::hours(24 * 365);
  return std::max(std::chrono::milliseconds(1),
                  absl::ToChronoMilliseconds(timeout));
}

// What a c10d store threw, as a status naming `call`. c10d's stores throw
// plain errors (TCPStore: "Socket Timeout", "Wait timeout"), so a timeout is
// recognised by its message.
absl::Status Failed(absl::string_view call, const std::exception& e) {
  const std::string message =
      absl::StrCat("torch store: ", call, " failed: ", e.what());
  if (absl::StrContains(e.what(), "imeout") ||
      absl::StrContains(e.what(), "timed out")) {
    return absl::DeadlineExceededError(message);
  }
  return absl::UnavailableError(message);
}

absl::Status Unsupported(absl::string_view call) {
  return absl::UnimplementedError(
      absl::StrCat("torch store: ", call, " is not supported (torch ",
                   TORCH_VERSION, "'s c10d::Store has no such call)"));
}

std::string Quoted(absl::Span<const std::string> keys) {
  return absl::StrCat("\"", absl::StrJoin(keys, "\", \""), "\"");
}

}  // namespace

TorchStore::TorchStore(c10::intrusive_ptr<c10d::Store> store)
    : store_(std::move(store)) {}

absl::Status TorchStore::Set(absl::string_view key, absl::string_view value) {
  try {
    store_->set(std::string(key), Bytes(value));
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return Failed(absl::StrCat("set \"", key, "\""), e);
  }
}

absl::StatusOr<std::string> TorchStore::Get(absl::string_view key,
                                            absl::Duration timeout) {
  const std::string k(key);
  try {
    store_->wait({k}, Millis(timeout));
    return Text(store_->get(k));
  } catch (const std::exception& e) {
    return Failed(absl::StrCat("get \"", key, "\" (timeout ",
                               absl::FormatDuration(timeout), ")"),
                  e);
  }
}

absl::StatusOr<int64_t> TorchStore::Add(absl::string_view key, int64_t delta) {
  try {
    return store_->add(std::string(key), delta);
  } catch (const std::exception& e) {
    return Failed(absl::StrCat("add \"", key, "\""), e);
  }
}

absl::StatusOr<std::string> TorchStore::CompareSet(absl::string_view key,
                                                   absl::string_view expected,
                                                   absl::string_view desired) {
  try {
    return Text(
        store_->compareSet(std::string(key), Bytes(expected), Bytes(desired)));
  } catch (const std::exception& e) {
    return Failed(absl::StrCat("compare_set \"", key, "\""), e);
  }
}

absl::Status TorchStore::Wait(absl::Span<const std::string> keys,
                              absl::Duration timeout) {
  try {
    store_->wait(std::vector<std::string>(keys.begin(), keys.end()),
                 Millis(timeout));
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return Failed(absl::StrCat("wait for ", Quoted(keys), " (timeout ",
                               absl::FormatDuration(timeout), ")"),
                  e);
  }
}

absl::StatusOr<bool> TorchStore::Check(absl::Span<const std::string> keys) {
  try {
    return store_->check(std::vector<std::string>(keys.begin(), keys.end()));
  } catch (const std::exception& e) {
    return Failed(absl::StrCat("check ", Quoted(keys)), e);
  }
}

absl::StatusOr<bool> TorchStore::DeleteKey(absl::string_view key) {
  try {
    return store_->deleteKey(std::string(key));
  } catch (const std::exception& e) {
    return Failed(absl::StrCat("delete_key \"", key, "\""), e);
  }
}

absl::StatusOr<int64_t> TorchStore::NumKeys() {
  try {
    return store_->getNumKeys();
  } catch (const std::exception& e) {
    return Failed("num_keys", e);
  }
}

absl::StatusOr<std::vector<std::string>> TorchStore::MultiGet(
    absl::Span<const std::string> keys, absl::Duration timeout) {
  absl::Status ready = Wait(keys, timeout);
  if (!ready.ok()) return ready;
  std::vector<std::string> values;
  values.reserve(keys.size());
#if TORCH_VERSION_MAJOR >= 2
  try {
    for (const std::vector<uint8_t>& value :
         store_->multiGet(std::vector<std::string>(keys.begin(), keys.end()))) {
      values.push_back(Text(value));
    }
  } catch (const std::exception& e) {
    return Failed(absl::StrCat("multi_get ", Quoted(keys)), e);
  }
#else
  for (const std::string& key : keys) {
    absl::StatusOr<std::string> value = Get(key, timeout);
    if (!value.ok()) return value.status();
    values.push_back(*std::move(value));
  }
#endif
  return values;
}

absl::Status TorchStore::MultiSet(absl::Span<const std::string> keys,
                                  absl::Span<const std::string> values) {
#if TORCH_VERSION_MAJOR >= 2
  std::vector<std::vector<uint8_t>> bytes;
  for (const std::string& value : values) bytes.push_back(Bytes(value));
  try {
    store_->multiSet(std::vector<std::string>(keys.begin(), keys.end()), bytes);
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return Failed(absl::StrCat("multi_set ", Quoted(keys)), e);
  }
#else
  return Unsupported("multi_set");
#endif
}

absl::Status TorchStore::Append(absl::string_view key,
                                absl::string_view value) {
#if TORCH_VERSION_MAJOR >= 2
  try {
    store_->append(std::string(key), Bytes(value));
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return Failed(absl::StrCat("append \"", key, "\""), e);
  }
#else
  return Unsupported("append");
#endif
}

absl::StatusOr<KeyList> TorchStore::ListKeys(absl::string_view prefix) {
  return Unsupported("list_keys");
}

absl::StatusOr<std::unique_ptr<WatchHandle>> TorchStore::Watch(
    absl::string_view prefix, int64_t from_revision, WatchCallback callback) {
  return Unsupported("watch");
}

}  // namespace cohort
