// GlooStore: gloo's rendezvous store interface over a cohort::Store, so
// that gloo contexts rendezvous through cohortd (or any cohort::Store).
//
// gloo's interface reports failure only by throwing, so this adapter throws
// gloo::IoException from set/get/wait. It also remembers the first failure
// as an absl::Status (with its code: DEADLINE_EXCEEDED for a timeout,
// UNAVAILABLE when cohortd is away, ...) so that the code that called into
// gloo can catch the exception and report the precise status instead
// (TakeError). No exception leaves cohort's public API.
#ifndef COHORT_WORKER_COLLECTIVE_GLOO_GLOO_STORE_H_
#define COHORT_WORKER_COLLECTIVE_GLOO_GLOO_STORE_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/store.h"
#include "gloo/rendezvous/store.h"

namespace cohort {

class GlooStore final : public gloo::rendezvous::Store {
 public:
  // Keys go to `store` as they are: give it a PrefixStore to keep groups
  // apart. `timeout` bounds get and the wait that has no timeout argument.
  GlooStore(std::shared_ptr<cohort::Store> store, absl::Duration timeout);

  void set(const std::string& key, const std::vector<char>& data) override;
  // Blocks until `key` exists, as gloo expects of get.
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // The first failure since the last call, or OK; clears it.
  absl::Status TakeError();

 private:
  // Records `status` (if it is the first failure) and throws it as a
  // gloo::IoException.
  [[noreturn]] void Fail(const absl::Status& status);

  const std::shared_ptr<cohort::Store> store_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_GLOO_GLOO_STORE_H_
