// Connection: what every cohort client shares: a channel to cohortd, the
// wait for a (re)connection, bounded retries with backoff for calls that are
// safe to repeat, error messages that name the server, and server streams
// that resume from a revision after cohortd restarts.
#ifndef COHORT_CLIENT_CONNECTION_H_
#define COHORT_CLIENT_CONNECTION_H_

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/rpc/tcp_keepalive.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/sync_stream.h"

namespace cohort {

// Where cohortctl and workers look for cohortd when told nothing else.
inline constexpr char kDefaultAddress[] = "localhost:29500";

// Slack given to a blocking call's gRPC deadline beyond the timeout cohortd
// enforces itself, so that cohortd's explanation (which keys, which ranks
// are missing) arrives before the client gives up on its own.
inline constexpr absl::Duration kServerTimeoutSlack = absl::Seconds(5);

// A duration as the positive millisecond count the protos take (0 would
// mean "the server's default").
inline int64_t ToMillis(absl::Duration d) {
  return std::max<int64_t>(1, absl::ToInt64Milliseconds(d));
}

struct ConnectionOptions {
  // HOST:PORT of cohortd; or, for replicas, several IP:PORT separated by
  // commas (or a DNS name with several records), tried in turn.
  std::string address = kDefaultAddress;
  // How long a call waits for a connection to cohortd.
  absl::Duration connect_timeout = absl::Seconds(30);
  // Deadline of calls that do not block.
  absl::Duration rpc_timeout = absl::Seconds(30);
  // Attempts for a retryable call, the first included.
  int max_attempts = 5;
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);

  // Credentials. Each one left empty is taken from its environment
  // variable when the connection opens (so workers inherit cohortrun's):
  // the token sent with every call ($COHORT_TOKEN, or the first line of
  // the file $COHORT_TOKEN_FILE names).
  std::string token;
  // PEM CA that signed cohortd's certificate; set, the connection uses
  // TLS ($COHORT_TLS_CA).
  std::string tls_ca_file;
  // The client's own certificate and key, for cohortd's --tls_client_ca
  // ($COHORT_TLS_CERT, $COHORT_TLS_KEY).
  std::string tls_cert_file;
  std::string tls_key_file;
  // The name cohortd's certificate must carry, when it is not the host in
  // `address` ($COHORT_TLS_SERVER_NAME).
  std::string tls_server_name;
  // Whether empty credentials are taken from the environment.
  bool credentials_from_env = true;

  // Kernel TCP keepalive on the connection (proto/rpc/tcp_keepalive.h): when
  // cohortd's host goes away or is cut off, the calls waiting on it fail
  // UNAVAILABLE within keepalive.idle + keepalive.timeout instead of at
  // their deadlines. cohortd's kernel answers the probes, so a saturated
  // or stopped cohortd is never taken for dead (gRPC's HTTP/2 pings, which
  // need its threads, are not sent).
  base::TcpKeepalive keepalive;
};

// The token in the first line of `path` (blanks around it dropped);
// INVALID_ARGUMENT naming `what` and the file when there is none.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path,
                                          absl::string_view what);

// `options` with its empty credentials filled from the environment (see
// ConnectionOptions); INVALID_ARGUMENT naming the variable or file when a
// file cannot be read.
absl::StatusOr<ConnectionOptions> WithEnvironmentCredentials(
    ConnectionOptions options);

// How Connection::Call runs one RPC.
struct CallOptions {
  // Whether the call is retried while cohortd is UNAVAILABLE (up to
  // ConnectionOptions::max_attempts): only for calls that are safe to
  // repeat, whose second run cannot change what the first did.
  bool retry_unavailable = false;
  // The call's deadline, from the moment it is sent.
  absl::Duration deadline = absl::Seconds(30);

  static CallOptions Retryable(absl::Duration deadline) {
    return {true, deadline};
  }
  static CallOptions Once(absl::Duration deadline) { return {false, deadline}; }
};

class Connection {
 public:
  // INVALID_ARGUMENT for a malformed address or policy.
  static absl::StatusOr<std::shared_ptr<Connection>> Open(
      const ConnectionOptions& options);

  const ConnectionOptions& options() const { return options_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

  // Waits up to connect_timeout for the channel to be ready; UNAVAILABLE
  // saying why not, from what answers at the address (peer_probe.h):
  // sooner when waiting cannot help (a plaintext client against a TLS
  // port, or the reverse, a certificate that does not verify, something
  // other than cohortd), and otherwise after connect_timeout (plus a probe
  // of at most a quarter of it, 2 s at most): nothing listening, a peer
  // that accepts TCP connections but never answers or closes them at once
  // (cohortd out of file descriptors), or cohortd's GOAWAY turning the
  // connection away (at --max_connections), whose text it quotes.
  absl::Status WaitConnected();

  // Adds the call's credentials (the token) to `context`. Every call made
  // on channel() must go through this.
  void Prepare(grpc::ClientContext* context) const;

  // `status` as an absl::Status prefixed by `what`, naming the server when
  // it could not be reached.
  absl::Status Explain(absl::string_view what, const grpc::Status& status,
                       int attempts) const;

  // Sleeps for about `backoff` (jittered) and returns the next backoff.
  absl::Duration Backoff(absl::Duration backoff) const;

  // Runs one unary RPC after waiting for the connection, under
  // `call.deadline`, retrying as `call` says. Errors are prefixed by `what`.
  template <typename Stub, typename Request, typename Response>
  absl::Status Call(absl::string_view what, const CallOptions& call, Stub* stub,
                    grpc::Status (Stub::*method)(grpc::ClientContext*,
                                                 const Request&, Response*),
                    const Request& request, Response* response) {
    absl::Duration backoff = options_.initial_backoff;
    for (int attempt = 1;; ++attempt) {
      // Waiting for the connection already spent connect_timeout: final.
      if (absl::Status connected = WaitConnected(); !connected.ok()) {
        return absl::Status(connected.code(),
                            absl::StrCat(what, ": ", connected.message()));
      }
      grpc::ClientContext context;
      Prepare(&context);
      context.set_deadline(absl::ToChronoTime(absl::Now() + call.deadline));
      grpc::Status status = (stub->*method)(&context, request, response);
      if (status.ok()) return absl::OkStatus();
      if (status.error_code() != grpc::StatusCode::UNAVAILABLE ||
          !call.retry_unavailable || attempt >= options_.max_attempts) {
        return Explain(what, status, attempt);
      }
      backoff = Backoff(backoff);
    }
  }

 private:
  Connection(const ConnectionOptions& options,
             std::shared_ptr<grpc::ChannelCredentials> credentials);
  const ConnectionOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
};

// A server stream of revisioned events (`Response` has start_revision and
// repeated events with a revision) read on a thread of its own. When cohortd
// becomes unavailable (a restart) it reopens the stream from the revision
// after the last one delivered, and gives up only after connect_timeout
// without a working stream.
template <typename Response>
class ResumingStream {
 public:
  using Event =
      typename std::decay_t<decltype(std::declval<Response>().events(0))>;
  using Open = std::function<std::unique_ptr<grpc::ClientReader<Response>>(
      grpc::ClientContext*, int64_t from_revision)>;

  ResumingStream(std::shared_ptr<Connection> connection, std::string what,
                 int64_t from_revision, Open open,
                 std::function<void(const Event&)> deliver)
      : connection_(std::move(connection)),
        what_(std::move(what)),
        next_revision_(from_revision),
        open_(std::move(open)),
        deliver_(std::move(deliver)),
        thread_([this] { Run(); }) {}

  ~ResumingStream() { Cancel(); }

  // Stops delivery; `deliver` is not called after this returns (unless this
  // is called from it).
  void Cancel() {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      if (context_ != nullptr) context_->TryCancel();
    }
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
      thread_.join();
    }
  }

  // Blocks until the stream ends: OK after Cancel, else why it ended.
  absl::Status Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&ended_));
    return status_;
  }

  // Blocks until cohortd has registered the stream (its first message) or
  // the stream has ended; returns the error it ended with, if any.
  absl::Status WaitStarted() {
    absl::MutexLock lock(&mu_);
    auto started_or_ended = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return started_ || ended_;
    };
    mu_.Await(absl::Condition(&started_or_ended));
    return started_ ? absl::OkStatus() : status_;
  }

 private:
  void Run() {
    const ConnectionOptions& options = connection_->options();
    absl::Duration backoff = options.initial_backoff;
    absl::Time last_ok = absl::Now();
    int attempts = 0;
    absl::Status status;
    for (;;) {
      grpc::ClientContext context;
      connection_->Prepare(&context);
      {
        absl::MutexLock lock(&mu_);
        if (cancelled_) break;
        context_ = &context;
      }
      ++attempts;
      std::unique_ptr<grpc::ClientReader<Response>> reader =
          open_(&context, next_revision_);
      Response resp;
      bool established = false;
      while (reader->Read(&resp)) {
        established = true;
        attempts = 0;
        backoff = options.initial_backoff;
        if (resp.start_revision() > 0) {
          if (next_revision_ == 0) next_revision_ = resp.start_revision();
          absl::MutexLock lock(&mu_);
          started_ = true;
        }
        for (const Event& e : resp.events()) {
          deliver_(e);
          next_revision_ = e.revision() + 1;
        }
      }
      grpc::Status finished = reader->Finish();
      // A stream that worked until now, however quiet, was healthy up to
      // this moment: the outage starts here.
      if (established) last_ok = absl::Now();
      {
        absl::MutexLock lock(&mu_);
        context_ = nullptr;
        if (cancelled_) break;
      }
      if (finished.error_code() != grpc::StatusCode::UNAVAILABLE ||
          absl::Now() - last_ok > options.connect_timeout) {
        status = connection_->Explain(what_, finished, attempts);
        break;
      }
      backoff = connection_->Backoff(backoff);
      connection_->WaitConnected().IgnoreError();
    }
    absl::MutexLock lock(&mu_);
    status_ = status;
    ended_ = true;
  }

  const std::shared_ptr<Connection> connection_;
  const std::string what_;
  int64_t next_revision_;  // Owned by the thread.
  const Open open_;
  const std::function<void(const Event&)> deliver_;
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::thread thread_;  // Last: starts once the rest is built.
};

}  // namespace cohort

#endif  // COHORT_CLIENT_CONNECTION_H_
