// tcpstore_session_fuzz: cohortd's TCPStore protocol (TcpStoreSession) on
// arbitrary bytes from one connection, over an in-memory store, as the
// listener's event loop feeds it but without a socket.
//
// The first byte picks the listener's policy (a prefix, token hellos,
// tokens required) and how the stream is cut into reads; the rest is the
// stream. It is fed twice, to fresh stores: in one read, and in reads of
// the cut's sizes, the batch committed after each read as the loop may.
// Checked:
//  - each step takes no more than it is given; a request takes at least
//    one byte; a step that wants more bytes took none and wants more than
//    it had;
//  - nothing is taken once the session has ended;
//  - both feedings end the session or neither does; if neither, they send
//    the same replies: how the bytes arrive never changes what the
//    protocol says. One that ends sends in one read a prefix of what it
//    sends in smaller ones (the replies to changes not yet committed when
//    it ends are lost, as with a closed connection), for the same reason
//    unless a change failed in the store (known only at the commit).
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "server/tcpstore/fake_host.h"
#include "server/tcpstore/session.h"
#include "store/kv_engine.h"
#include "store/kv_store.h"
#include "tests/fuzz/fuzz_input.h"

namespace cohort::server {
namespace {

struct Outcome {
  std::string replies;
  bool ended = false;
  std::string why;
  bool bad_input = false;
};

TcpStoreSessionOptions Policy(uint8_t control) {
  TcpStoreSessionOptions options;
  options.max_request_bytes = 4096;
  if (control & 1) options.prefix = "/jobs/";
  if (control & 2) {
    options.authorize = [](absl::string_view token,
                           absl::string_view) -> absl::StatusOr<TcpStoreGrant> {
      if (!absl::StartsWith(token, "g")) {
        return absl::UnauthenticatedError("unknown token");
      }
      return TcpStoreGrant{.owner = "token g"};
    };
  }
  if (control & 4) options.require_token = true;
  return options;
}

// Feeds `in` to `session` as the loop does, checking each step.
size_t Feed(TcpStoreSession& session, absl::string_view in) {
  size_t pos = 0;
  while (pos < in.size()) {
    const bool ended = session.ended();
    const absl::string_view rest = in.substr(pos);
    const TcpStoreSession::Step step = session.Next(rest);
    FUZZ_CHECK(step.used <= rest.size());
    if (ended) FUZZ_CHECK(step.used == 0);
    if (step.progress == TcpStoreSession::Progress::kRequest) {
      FUZZ_CHECK(step.used >= 1);
    }
    if (step.need > 0) {
      FUZZ_CHECK(step.progress == TcpStoreSession::Progress::kStopped);
      FUZZ_CHECK(step.used == 0 && step.need > rest.size());
    }
    pos += step.used;
    if (step.progress == TcpStoreSession::Progress::kStopped) break;
  }
  return pos;
}

// Sends `stream` in reads of the sizes `cuts` gives (each 1 to 64 bytes;
// all of it at once when `cuts` is empty), committing after each read.
Outcome Run(uint8_t control, absl::string_view stream, fuzz::FuzzInput* cuts) {
  FakeHost host;
  store::StoreLimits limits;
  limits.max_key_bytes = 64;
  limits.max_value_bytes = 256;
  limits.max_keys_per_call = 8;
  store::KvStore store(store::NewMemoryEngine(), limits);
  TcpStoreProtocol protocol(&store, Policy(control), &host);
  Outcome out;
  {
    TcpStoreSession session(protocol, 1, "10.0.0.1:5000");
    std::string in;
    size_t sent = 0;
    while (sent < stream.size()) {
      const size_t n = cuts == nullptr ? stream.size() : 1 + cuts->Byte() % 64;
      const absl::string_view read = stream.substr(sent, n);
      in.append(read.data(), read.size());
      sent += read.size();
      for (;;) {
        in.erase(0, Feed(session, in));
        protocol.CommitBatch();
        host.RunPosted();
        if (host.ready.empty()) break;
        host.ready.clear();
      }
    }
    out.replies = session.output();
    out.ended = session.ended();
    host.RunPosted();
  }
  host.RunPosted();
  if (auto it = host.closed.find(1); it != host.closed.end()) {
    out.why = it->second.why;
    out.bad_input = it->second.bad_input;
  }
  return out;
}

}  // namespace
}  // namespace cohort::server

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using cohort::server::Outcome;
  if (size < 2) return 0;
  const uint8_t control = data[0];
  const absl::string_view stream(reinterpret_cast<const char*>(data) + 2,
                                 size - 2);
  const Outcome whole = cohort::server::Run(control, stream, nullptr);
  // The reads' sizes are the stream's own bytes, from the offset the second
  // byte picks (1-byte reads past the end).
  const size_t from = data[1] % (size - 1);
  cohort::fuzz::FuzzInput cuts(data + 1 + from, size - 1 - from);
  const Outcome cut = cohort::server::Run(control, stream, &cuts);
  if (cut.replies != whole.replies || cut.why != whole.why) {
    std::fprintf(stderr, "in one read: \"%s\" (%s)\nin cuts:     \"%s\" (%s)\n",
                 absl::CHexEscape(whole.replies).c_str(), whole.why.c_str(),
                 absl::CHexEscape(cut.replies).c_str(), cut.why.c_str());
  }
  FUZZ_CHECK(cut.ended == whole.ended);
  if (!whole.ended) {
    FUZZ_CHECK(cut.replies == whole.replies);
    return 0;
  }
  // A session that ends loses the replies to its changes not yet
  // committed, as a closed connection does: in smaller reads some were.
  FUZZ_CHECK(absl::StartsWith(cut.replies, whole.replies));
  // A change that fails in the store ends the session when its batch
  // commits, which in one read is after later requests were read.
  if (absl::StrContains(whole.why, " failed: ") ||
      absl::StrContains(cut.why, " failed: ")) {
    return 0;
  }
  FUZZ_CHECK(cut.bad_input == whole.bad_input);
  // Bad input is quoted from the bytes that had arrived: compare what
  // comes before the quote.
  auto stem = [](const std::string& why) {
    return why.substr(0, why.find('"'));
  };
  FUZZ_CHECK(stem(cut.why) == stem(whole.why));
  return 0;
}
