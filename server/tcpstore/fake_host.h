// FakeHost: the event loop's stand-in for tests of TcpStoreSession (and its
// fuzzer). It records closes and readiness, runs what the store posts when
// told to, and keeps a clock its user moves.
#ifndef COHORT_SERVER_TCPSTORE_FAKE_HOST_H_
#define COHORT_SERVER_TCPSTORE_FAKE_HOST_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/tcpstore/session.h"

namespace cohort::server {

class FakeHost : public TcpStoreProtocol::Host {
 public:
  struct Closed {
    std::string why;
    bool bad_input = false;
  };

  // Ends the session, as the loop does, and records why.
  void Close(TcpStoreSession& session, absl::string_view why,
             bool bad_input) override {
    closed[session.id()] = {std::string(why), bad_input};
    session.End();
  }
  void Ready(TcpStoreSession& session) override {
    ready.push_back(session.id());
  }
  void Post(std::function<void()> fn) override {
    absl::MutexLock lock(&mu_);
    posted_.push_back(std::move(fn));
  }
  int64_t NowNanos() override { return now_ns; }

  // Runs what was posted, and what that posts, until nothing is left.
  void RunPosted() {
    for (;;) {
      std::vector<std::function<void()>> batch;
      {
        absl::MutexLock lock(&mu_);
        batch.swap(posted_);
      }
      if (batch.empty()) return;
      for (auto& fn : batch) fn();
    }
  }

  // By session id.
  std::map<uint64_t, Closed> closed;
  // Session ids, in the order Ready named them (the user clears it).
  std::vector<uint64_t> ready;
  int64_t now_ns = 1'000'000'000;

 private:
  absl::Mutex mu_;
  std::vector<std::function<void()>> posted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_TCPSTORE_FAKE_HOST_H_
