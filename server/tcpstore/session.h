// TCPStore's protocol without I/O: a TcpStoreSession per connection takes
// the bytes its client sent and appends the bytes to send back, applying
// each request to the KvStore; a TcpStoreProtocol holds what the sessions
// of one listener share. The event loop (tcpstore_server.cc) owns the
// sockets and moves bytes in and out; everything the protocol says (each
// dialect, the namespace and token hellos, c10d's write rules, deferred
// WAIT and BARRIER replies, queues, quotas, what closes a connection) is
// here, and is tested from byte strings (session_test.cc).
//
// The store calls are made here, not returned: KvStore has no I/O of its
// own, and the changes of every session go into one batch that is
// committed as one KvStore::ApplyBatch (one write-ahead log record), so a
// session's replies depend on when the batch commits. The loop decides
// when (MustCommit, Overdue, or before it sleeps); a request that reads the
// store or answers at once commits the batch first, so replies always come
// in request order and after the changes before them are in the log.
//
// The sessions and the protocol are used on one thread (the loop's); only
// Host::Post is called from others (the store's callbacks).
#ifndef COHORT_SERVER_TCPSTORE_SESSION_H_
#define COHORT_SERVER_TCPSTORE_SESSION_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/tcpstore/wire.h"
#include "store/kv_store.h"

namespace cohort::server {

class Quotas;      // server/auth/quota.h
enum class Quota;  // server/auth/quota.h

// What became of one TCPStore request (TcpStoreSessionOptions::on_query).
enum class TcpStoreOutcome {
  kOk,      // Answered; for a request without a reply (SET), applied.
  kFailed,  // Refused or failed in the store: its connection was closed.
  // A blocked WAIT or BARRIER given up: CANCEL_WAIT, the client gone, or
  // the server stopping.
  kCancelled,
};

// What a token hello was granted (TcpStoreSessionOptions::authorize).
struct TcpStoreGrant {
  // The quota owner the connection is charged to; "" charges nothing (an
  // admin token).
  std::string owner;
  // Whether the token is still valid (revocation, expiry): checked before
  // each request of the connection, which is closed with the reason when
  // it is not. Null: always valid.
  std::function<absl::Status()> still_valid;
};

// The protocol's part of TcpStoreServerOptions (tcpstore_server.h says
// more of each).
struct TcpStoreSessionOptions {
  // The most bytes one request may take; keys, values and keys per request
  // are bounded by the store's limits.
  size_t max_request_bytes = 64 << 20;
  // Bytes in all queues together past which a QUEUE_PUSH closes its
  // connection.
  size_t max_queue_bytes_total = 1 << 30;
  // Per-owner quotas. Not owned; null: none.
  Quotas* quotas = nullptr;
  // Every key lives under this prefix (CheckTcpStorePrefix).
  std::string prefix;
  // Checks a token hello's token against the namespace it binds (after
  // `prefix`). Null: token hellos are refused.
  std::function<absl::StatusOr<TcpStoreGrant>(absl::string_view token,
                                              absl::string_view name_space)>
      authorize;
  // Serve only connections that open with a token hello.
  bool require_token = false;
  // Called once per request, when it is answered, applied, refused or
  // given up, with the time since it was read. Null: not called.
  std::function<void(tcpstore::Op, TcpStoreOutcome, absl::Duration)> on_query;
};

// OK, or INVALID_ARGUMENT saying why a listener's prefix would reach
// cohortd's reserved namespace ("/cohort/" or a start of it).
absl::Status CheckTcpStorePrefix(absl::string_view prefix);

class TcpStoreSession;

// What the sessions of one listener share: the store, the options, the
// batch of changes read but not committed, the barriers' watches and who
// was charged for each queue item.
class TcpStoreProtocol {
 public:
  // What the protocol needs of the event loop that feeds it.
  class Host {
   public:
    virtual ~Host() = default;
    // Closes `session`'s connection: the host ends the session
    // (TcpStoreSession::End) and serves it no more. `why` is for a log
    // line ("" when the client just left); `bad_input`: the client sent
    // bytes that are not the protocol.
    virtual void Close(TcpStoreSession& session, absl::string_view why,
                       bool bad_input) = 0;
    // `session`'s blocked request ended: its reply is in output(), and the
    // requests it sent since are to be fed again.
    virtual void Ready(TcpStoreSession& session) = 0;
    // Runs `fn` on the loop thread after the current call. Thread-safe: the
    // store calls back on the thread of the write that ends a wait.
    virtual void Post(std::function<void()> fn) = 0;
    // The clock, as absl::GetCurrentTimeNanos.
    virtual int64_t NowNanos() = 0;
  };

  // Counts since the start, for TcpStoreServerStats.
  struct Stats {
    size_t blocked = 0;  // Sessions waiting in WAIT or BARRIER now.
    uint64_t requests = 0;
    uint64_t refused_unauthenticated = 0;
    uint64_t refused_quota = 0;
  };

  // A change batch is committed once it holds this many changes or bytes,
  // or its first change is this old (MustCommit, Overdue).
  static constexpr size_t kMaxBatchChanges = 4096;
  static constexpr size_t kMaxBatchBytes = 4 << 20;
  static constexpr int64_t kMaxBatchDelayNs = 200'000;

  // `store` and `host` must outlive the protocol and its sessions.
  TcpStoreProtocol(store::KvStore* store, TcpStoreSessionOptions options,
                   Host* host);
  // Shuts down. REQUIRES: every session has ended.
  ~TcpStoreProtocol();
  TcpStoreProtocol(const TcpStoreProtocol&) = delete;
  TcpStoreProtocol& operator=(const TcpStoreProtocol&) = delete;

  // Whether changes are waiting for a commit.
  bool has_batch() const { return !batch_.empty(); }
  // Whether the batch must be committed now, not after more requests:
  // a request in it expects a reply (from any session: every read commits
  // first), it is large, or kMaxBatchDelayNs have passed since its first
  // change. Changes without a reply (SET, APPEND, QUEUE_PUSH) may wait so
  // that a stream of them shares log writes: nobody has been told of them,
  // and as with torch's own server a SET in flight is not yet visible.
  bool MustCommit() const;
  // Whether the batch's first change is kMaxBatchDelayNs old at `now_ns`.
  bool Overdue(int64_t now_ns) const {
    return !batch_.empty() && now_ns - batch_since_ns_ >= kMaxBatchDelayNs;
  }
  // Applies the batch as one KvStore::ApplyBatch and appends each change's
  // reply to its session's output (a session whose change failed is
  // closed). Returns at once when the batch is empty.
  void CommitBatch();

  // Cancels the barriers' watches: the listener is stopping. REQUIRES:
  // the batch is committed and every session has ended.
  void Shutdown();

  Stats stats() const;
  store::KvStore& store() { return *store_; }
  const TcpStoreSessionOptions& options() const { return options_; }

 private:
  friend class TcpStoreSession;

  // A change read but not committed: its session and query.
  struct Queued {
    uint64_t session = 0;
    tcpstore::Op op = tcpstore::Op::kSet;
    int64_t read_ns = 0;  // For on_query.
    // QUEUE_PUSH: the owner charged for it, and how much.
    std::shared_ptr<const std::string> owner;
    uint64_t charged = 0;
    // A QUEUE_POP whose session ended before the commit: left out.
    bool dropped = false;
  };
  // Who was charged for a queue item (Quota::kQueueBytes) until it is
  // popped.
  struct ItemOwner {
    std::shared_ptr<const std::string> owner;
    uint64_t bytes = 0;
  };
  struct Barrier {
    store::KvStore::WatchId watch = 0;
    // session id -> (its seq, the count it waits for)
    absl::flat_hash_map<uint64_t, std::pair<uint64_t, int64_t>> waiting;
  };

  TcpStoreSession* Find(uint64_t id) const;

  // Adds `change` of `session` to the batch, with copies of its strings
  // (the session's input moves on before the commit). `answered`: the
  // query has a reply.
  Queued& Queue(const TcpStoreSession& session, tcpstore::Op op, bool answered,
                store::Change change, int64_t read_ns);
  // Leaves the QUEUE_POPs of `session` out of the batch and passes on the
  // wake-ups they answered.
  void DropPops(TcpStoreSession& session);
  // The result of one change of a commit: its on_query, quota and reply.
  void Committed(const Queued& from, const store::ChangeResult& r);
  // A push committed (its owner's charge now follows the item), or not
  // (the charge is given back).
  void Charged(const Queued& q, const store::ChangeResult& r);
  // An item popped: its pusher's charge is given back.
  void Popped(const store::ChangeResult& r);

  // The barrier on `key`, watching its counter from after `revision`.
  absl::StatusOr<Barrier*> WatchBarrier(absl::string_view key,
                                        int64_t revision);
  // Forgets `session`'s place in the barrier on `key`, and the barrier
  // once nobody waits there.
  void LeaveBarrier(const std::string& key, uint64_t session);
  void OnBarrierCount(const std::string& key, int64_t count);
  void OnBarrierClosed(const std::string& key, const absl::Status& status);

  absl::Status Charge(const std::shared_ptr<const std::string>& owner,
                      Quota quota, uint64_t amount);
  void Uncharge(const std::shared_ptr<const std::string>& owner, Quota quota,
                uint64_t amount);
  void Observe(tcpstore::Op op, int64_t read_ns, TcpStoreOutcome outcome);

  store::KvStore* const store_;
  const TcpStoreSessionOptions options_;
  const tcpstore::Limits limits_;
  Host* const host_;

  // The sessions not yet ended, by id.
  absl::flat_hash_map<uint64_t, TcpStoreSession*> sessions_;
  // The batch: changes, the session and query of each, and the strings
  // they point to.
  std::vector<store::Change> batch_;
  std::vector<Queued> batch_from_;
  std::deque<std::string> batch_strings_;
  size_t batch_bytes_ = 0;
  size_t batch_push_bytes_ = 0;  // Of QUEUE_PUSHes in the batch.
  bool batch_wants_reply_ = false;
  int64_t batch_since_ns_ = 0;
  // The owners charged for queue items not yet popped, by item key.
  absl::flat_hash_map<std::string, ItemOwner> item_owners_;
  absl::flat_hash_map<std::string, Barrier> barriers_;

  std::atomic<size_t> blocked_{0};
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> refused_unauthenticated_{0};
  std::atomic<uint64_t> refused_quota_{0};
};

// One connection's protocol: its hello, dialect, namespace and quota owner,
// its blocked WAIT or BARRIER, and its replies not yet handed to the loop.
class TcpStoreSession {
 public:
  // What Next did.
  enum class Progress {
    // Took one request: applied it, queued it for the batch, or blocked on
    // it. Feed on (after backpressure checks).
    kRequest,
    // Took the hello (or let the connection in without one), or answered a
    // CANCEL_WAIT that passed the blocked request. Feed on.
    kOpening,
    // Stopped: it needs `need` bytes, it is blocked (Host::Ready says when
    // it is not), or it ended.
    kStopped,
  };
  struct Step {
    size_t used = 0;  // Bytes taken from the front of the input.
    Progress progress = Progress::kStopped;
    // kStopped for want of bytes: the fewest the input must hold before
    // Next is worth calling again; else 0.
    size_t need = 0;
  };

  // A session for connection `id` (unique among the protocol's sessions)
  // from `peer` ("host:port", for log lines and its quota owner).
  TcpStoreSession(TcpStoreProtocol& protocol, uint64_t id, std::string peer);
  // Ends the session if it has not ended.
  ~TcpStoreSession();
  TcpStoreSession(const TcpStoreSession&) = delete;
  TcpStoreSession& operator=(const TcpStoreSession&) = delete;

  // Takes the hello or the request at the front of `bytes` (the client's
  // bytes not yet taken) and applies it: its reply, if it has one and it is
  // due now, is appended to output(); a change waits in the protocol's
  // batch and is answered when the batch commits. Strings of `bytes` are
  // not kept. A protocol error, a refusal or a store failure closes the
  // session (Host::Close).
  Step Next(absl::string_view bytes);
  // Next until it stops; returns the bytes taken. For callers without
  // backpressure (tests, the fuzzer).
  size_t Feed(absl::string_view bytes);

  // The replies not yet sent, in request order: the loop sends and erases
  // them, and may swap the buffer out.
  std::string& output() { return output_; }
  const std::string& output() const { return output_; }

  // Ends the session: cancels its blocked request, passes on the queue
  // wake-ups it will not use, leaves its pops out of the batch and gives
  // back its connection's quota. Nothing is fed or answered after this.
  // Idempotent.
  void End();

  uint64_t id() const { return id_; }
  const std::string& peer() const { return peer_; }
  bool ended() const { return ended_; }
  // Waiting in WAIT or BARRIER: later requests are not taken (only a
  // CANCEL_WAIT, or a 1.13 request ending a timed-out WAIT).
  bool blocked() const { return block_ != Block::kNone; }
  // The key prefix of every key this session names: the listener's prefix,
  // then a hello's namespace.
  const std::string& name_space() const { return name_space_; }
  // The dialect its first bytes announced; nullopt until they have come.
  std::optional<tcpstore::Dialect> dialect() const { return dialect_; }

 private:
  friend class TcpStoreProtocol;
  enum class Block { kNone, kWait, kBarrier };

  TcpStoreProtocol::Host& host() { return *protocol_.host_; }
  store::KvStore& store() { return *protocol_.store_; }
  const TcpStoreSessionOptions& options() const { return protocol_.options_; }

  void Close(absl::string_view why, bool bad_input);
  void Fail(absl::string_view what, const absl::Status& status);
  // The connection's first bytes: a namespace hello, or none.
  Step Greet(absl::string_view bytes);
  // Whether a token hello's grant lets the session in (else it is closed);
  // sets *owner.
  bool Authorize(absl::string_view token, const std::string& name_space,
                 std::string* owner);
  // Binds the session to its quota owner and charges it the connection.
  // False (and the session closed) when that is over the quota.
  bool Bind(std::string owner);
  // Bytes sent while a request is blocked.
  Step WhileBlocked(absl::string_view bytes);
  // Parses and applies one request.
  Step Serve(absl::string_view bytes);
  // Applies `r`, whose keys are in the session's namespace.
  void Handle(const tcpstore::Request& r);
  // The queries served at once, after the batch is committed.
  void Answer(const tcpstore::Request& r);
  void Get(const tcpstore::Request& r);
  void ListKeys();
  // BARRIER: adds one to its counter; answers, or waits for the rest.
  void ArriveAtBarrier(const tcpstore::Request& r);
  void QueuePush(const tcpstore::Request& r);
  // Reports a request Handle dealt with at once; those it queued are
  // reported at the commit, those that block when they end (ClearBlock).
  void Handled(tcpstore::Op op);

  void StartWait(const std::vector<absl::string_view>& keys);
  void StartBarrier(absl::string_view key, int64_t target, int64_t revision);
  // Charges a wait on `keys` keys to the owner; false (and the session
  // closed) when that is over a quota.
  bool ChargeWait(tcpstore::Op op, size_t keys);
  void OverQuota(tcpstore::Op op, const absl::Status& why);
  // Ends the blocked request with STOP_WAITING (or closes the session with
  // the store's error). Whether it was still waiting for `seq`. `push`: a
  // WAIT ended by a push, whose item the client is expected to pop.
  bool Complete(uint64_t seq, const absl::Status& status, bool push = false);
  // Forgets the blocked request, which ended with `outcome`.
  void ClearBlock(TcpStoreOutcome outcome);
  void CancelBlock();
  // Passes on the wake-ups of the last WAIT, which the client will not
  // follow with a QUEUE_POP (see KvStore::PassQueueWakes).
  void PassWakes();
  void StopWaiting();

  TcpStoreProtocol& protocol_;
  const uint64_t id_;
  const std::string peer_;
  std::string output_;
  bool ended_ = false;

  // Whether the first bytes were looked at for a hello, and the namespace
  // bound (the listener's prefix, then the hello's).
  bool greeted_ = false;
  std::string name_space_;
  std::optional<tcpstore::Dialect> dialect_;
  // The quota owner (null: none), and its token's validity check.
  std::shared_ptr<const std::string> owner_;
  std::function<absl::Status()> still_valid_;
  bool charged_connection_ = false;
  size_t charged_wait_keys_ = 0;  // With one wait, while blocked.
  // When the request being handled was read (0 without on_query).
  int64_t read_ns_ = 0;

  Block block_ = Block::kNone;
  // The blocked request's query and when it was read (for on_query).
  tcpstore::Op blocked_op_ = tcpstore::Op::kWait;
  int64_t blocked_since_ns_ = 0;
  uint64_t seq_ = 0;  // Numbers blocking requests; stale completions differ.
  store::KvStore::WaitId wait_id_ = 0;
  // The keys of a 2.x WAIT, whose queues' pushes may end it.
  std::shared_ptr<const std::vector<std::string>> wait_keys_;
  // Those of a WAIT a push ended, until the client pops: if it does
  // something else instead, the wake-up is passed on (PassWakes).
  std::shared_ptr<const std::vector<std::string>> woken_keys_;
  // QUEUE_POPs of this session in the batch not yet committed.
  size_t batched_pops_ = 0;
  std::string barrier_key_;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_TCPSTORE_SESSION_H_
