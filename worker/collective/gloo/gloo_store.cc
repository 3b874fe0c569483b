#include "worker/collective/gloo/gloo_store.h"

#include <utility>

#include "gloo/common/error.h"

namespace cohort {

GlooStore::GlooStore(std::shared_ptr<cohort::Store> store,
                     absl::Duration timeout)
    : store_(std::move(store)), timeout_(timeout) {}

void GlooStore::set(const std::string& key, const std::vector<char>& data) {
  absl::Status status =
      store_->Set(key, absl::string_view(data.data(), data.size()));
  if (!status.ok()) Fail(status);
}

std::vector<char> GlooStore::get(const std::string& key) {
  absl::StatusOr<std::string> value = store_->Get(key, timeout_);
  if (!value.ok()) Fail(value.status());
  return std::vector<char>(value->begin(), value->end());
}

void GlooStore::wait(const std::vector<std::string>& keys) {
  absl::Status status = store_->Wait(keys, timeout_);
  if (!status.ok()) Fail(status);
}

void GlooStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  absl::Status status = store_->Wait(keys, absl::FromChrono(timeout));
  if (!status.ok()) Fail(status);
}

absl::Status GlooStore::TakeError() {
  absl::MutexLock lock(&mu_);
  return std::exchange(error_, absl::OkStatus());
}

void GlooStore::Fail(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (error_.ok()) error_ = status;
  }
  throw gloo::IoException(status.ToString());
}

}  // namespace cohort
