#include "server/tcpstore/session.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "proto/c10d/rules.h"
#include "server/auth/quota.h"
#include "store/queue_keys.h"

namespace cohort::server {
namespace {

using tcpstore::CheckReply;
using tcpstore::Dialect;
using tcpstore::Encoder;
using tcpstore::Op;
using tcpstore::ParseResult;
using tcpstore::ParseStatus;
using tcpstore::Request;
using tcpstore::WaitReply;

// How the listener applies a query: the one list of the queries that
// write.
struct OpRule {
  // Committed with the batch as `change`, and answered (if it has a reply)
  // when the batch commits; the other queries are served at once.
  bool batched = false;
  store::Change::Kind change = store::Change::Kind::kSet;
  // Batched with a reply: the batch is committed at the end of the pass.
  bool answered = false;
  // Writes keys the client names, so c10d::CheckClientWrite applies. A
  // queue's items are the store's own keys (store/queue_keys.h), whatever
  // the queue's name.
  bool client_writes = false;
};

OpRule RuleOf(Op op) {
  using Kind = store::Change::Kind;
  switch (op) {
    case Op::kSet:
      return {.batched = true, .change = Kind::kSet, .client_writes = true};
    case Op::kAppend:
      return {.batched = true, .change = Kind::kAppend, .client_writes = true};
    case Op::kAdd:
      return {.batched = true,
              .change = Kind::kAdd,
              .answered = true,
              .client_writes = true};
    case Op::kCompareSet:
      return {.batched = true,
              .change = Kind::kCompareSet,
              .answered = true,
              .client_writes = true};
    case Op::kDeleteKey:
      return {.batched = true,
              .change = Kind::kDelete,
              .answered = true,
              .client_writes = true};
    case Op::kQueuePush:
      return {.batched = true, .change = Kind::kQueuePush};
    case Op::kQueuePop:  // A pop is a write: it removes its item.
      return {.batched = true, .change = Kind::kQueuePop, .answered = true};
    case Op::kMultiSet:
    case Op::kBarrier:  // Adds to its counter key.
      return {.client_writes = true};
    default:
      return {};
  }
}

std::vector<std::string> Strings(const std::vector<absl::string_view>& views) {
  return std::vector<std::string>(views.begin(), views.end());
}

// Whether a client may make the writes `r` asks for: not in cohortd's
// reserved namespace. Keys are the store's keys as they arrive (torch's
// TCPStore client puts a "/" before the user's key, so
// store.set("cohort/runs/x") reaches "/cohort/runs/x").
absl::Status CheckClientWrites(const Request& r) {
  if (!RuleOf(r.op).client_writes) return absl::OkStatus();
  if (r.op != Op::kMultiSet) return c10d::CheckClientWrite(r.key);
  for (absl::string_view key : r.keys) {
    if (absl::Status s = c10d::CheckClientWrite(key); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// `r` with the namespace in front of each of its keys, whose strings are
// kept in `keys`. Empty keys stay empty, and are refused as before.
Request InNamespace(absl::string_view name_space, const Request& r,
                    std::deque<std::string>& keys) {
  auto full = [&](absl::string_view key) -> absl::string_view {
    if (key.empty()) return key;
    return keys.emplace_back(absl::StrCat(name_space, key));
  };
  Request out = r;
  out.key = full(r.key);
  for (absl::string_view& key : out.keys) key = full(key);
  return out;
}

}  // namespace

absl::Status CheckTcpStorePrefix(absl::string_view prefix) {
  if (prefix.empty()) return absl::OkStatus();
  // A prefix that "/cohort/" itself starts with ("/", "/cohort") is as bad
  // as one inside it: its key "/auth/x" would be "/cohort/auth/x".
  if (absl::StartsWith(c10d::kReservedPrefix, prefix)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TCPStore prefix '", prefix,
        "' is the start of cohortd's reserved namespace '",
        c10d::kReservedPrefix,
        "': its clients' keys would reach cohortd's records there; use a "
        "prefix outside it that ends in '/', e.g. 'torch/'"));
  }
  if (absl::Status s = c10d::CheckClientWrite(absl::StrCat(prefix, "x"));
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TCPStore prefix '", prefix,
        "' is inside cohortd's reserved namespace: ", s.message()));
  }
  return absl::OkStatus();
}

// ---- TcpStoreProtocol ----

TcpStoreProtocol::TcpStoreProtocol(store::KvStore* store,
                                   TcpStoreSessionOptions options, Host* host)
    : store_(store),
      options_(std::move(options)),
      limits_{store_->limits().c10d_limits(), options_.max_request_bytes},
      host_(host) {}

TcpStoreProtocol::~TcpStoreProtocol() { Shutdown(); }

void TcpStoreProtocol::Shutdown() {
  for (auto& [key, b] : barriers_) {
    if (b.watch != 0) store_->CancelWatch(b.watch);
  }
  barriers_.clear();
}

TcpStoreProtocol::Stats TcpStoreProtocol::stats() const {
  return {.blocked = blocked_.load(),
          .requests = requests_.load(),
          .refused_unauthenticated = refused_unauthenticated_.load(),
          .refused_quota = refused_quota_.load()};
}

TcpStoreSession* TcpStoreProtocol::Find(uint64_t id) const {
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second;
}

bool TcpStoreProtocol::MustCommit() const {
  return batch_wants_reply_ || batch_.size() >= kMaxBatchChanges ||
         batch_bytes_ >= kMaxBatchBytes ||
         host_->NowNanos() - batch_since_ns_ >= kMaxBatchDelayNs;
}

TcpStoreProtocol::Queued& TcpStoreProtocol::Queue(
    const TcpStoreSession& session, Op op, bool answered, store::Change change,
    int64_t read_ns) {
  auto keep = [this](absl::string_view bytes) -> absl::string_view {
    if (bytes.empty()) return bytes;
    batch_bytes_ += bytes.size();
    return batch_strings_.emplace_back(bytes);
  };
  change.key = keep(change.key);
  change.value = keep(change.value);
  change.expected = keep(change.expected);
  if (batch_.empty()) batch_since_ns_ = host_->NowNanos();
  batch_.push_back(change);
  batch_from_.push_back(
      {.session = session.id(), .op = op, .read_ns = read_ns});
  if (answered) batch_wants_reply_ = true;
  return batch_from_.back();
}

void TcpStoreProtocol::CommitBatch() {
  if (batch_.empty()) return;
  // Pops of sessions ended since they were read are left out.
  std::vector<Queued> from;
  std::vector<store::Change> changes;
  for (size_t i = 0; i < batch_.size(); ++i) {
    if (batch_from_[i].dropped) continue;
    changes.push_back(batch_[i]);
    from.push_back(std::move(batch_from_[i]));
  }
  batch_.clear();
  batch_from_.clear();
  batch_bytes_ = 0;
  batch_push_bytes_ = 0;
  batch_wants_reply_ = false;
  std::vector<store::ChangeResult> results = store_->ApplyBatch(changes);
  for (size_t i = 0; i < results.size(); ++i) Committed(from[i], results[i]);
  batch_strings_.clear();
}

void TcpStoreProtocol::Committed(const Queued& from,
                                 const store::ChangeResult& r) {
  const Op op = from.op;
  Observe(op, from.read_ns,
          r.status.ok() ? TcpStoreOutcome::kOk : TcpStoreOutcome::kFailed);
  if (op == Op::kQueuePush) Charged(from, r);
  if (op == Op::kQueuePop && r.status.ok()) Popped(r);
  TcpStoreSession* s = Find(from.session);
  if (s == nullptr) return;
  if (op == Op::kQueuePop) --s->batched_pops_;
  if (!r.status.ok()) {
    s->Close(absl::StrCat(OpName(op), " failed: ", r.status.message()), false);
    return;
  }
  Encoder reply(&s->output_);
  if (op == Op::kAdd || op == Op::kDeleteKey) reply.I64(r.number);
  if (op == Op::kCompareSet) reply.Bytes(r.value);
  if (op == Op::kQueuePop) {
    reply.I64(r.number);
    if (r.number > 0) reply.Bytes(r.value);
  }
}

void TcpStoreProtocol::DropPops(TcpStoreSession& session) {
  // Its pops are not committed: nobody would get their items. A pop a push
  // woke it for passes the wake-up on.
  std::vector<std::string> queues;
  for (size_t i = 0; i < batch_from_.size(); ++i) {
    Queued& q = batch_from_[i];
    if (q.session != session.id() || q.op != Op::kQueuePop) continue;
    q.dropped = true;
    queues.emplace_back(batch_[i].key);
  }
  session.batched_pops_ = 0;
  store_->PassQueueWakes(queues);
}

void TcpStoreProtocol::Charged(const Queued& q, const store::ChangeResult& r) {
  if (q.owner == nullptr || options_.quotas == nullptr) return;
  if (!r.status.ok()) {
    Uncharge(q.owner, Quota::kQueueBytes, q.charged);
    return;
  }
  item_owners_[r.queue_item] = {q.owner, q.charged};
}

// Items pushed before a restart, or through another replica, were charged
// to nobody here.
void TcpStoreProtocol::Popped(const store::ChangeResult& r) {
  if (r.number == 0) return;
  auto it = item_owners_.find(r.queue_item);
  if (it == item_owners_.end()) return;
  Uncharge(it->second.owner, Quota::kQueueBytes, it->second.bytes);
  item_owners_.erase(it);
}

absl::StatusOr<TcpStoreProtocol::Barrier*> TcpStoreProtocol::WatchBarrier(
    absl::string_view key, int64_t revision) {
  Barrier& b = barriers_[key];
  if (b.watch != 0) return &b;
  std::string k(key);
  auto watch = store_->Watch(
      key, revision + 1,
      [this, k](std::vector<store::Event> events) {
        std::optional<int64_t> latest;
        for (const store::Event& e : events) {
          int64_t v = 0;
          if (e.key == k && e.value != nullptr &&
              absl::SimpleAtoi(*e.value, &v)) {
            latest = v;
          }
        }
        if (latest.has_value()) {
          host_->Post([this, k, v = *latest] { OnBarrierCount(k, v); });
        }
      },
      [this, k](absl::Status status) {
        host_->Post([this, k, status] { OnBarrierClosed(k, status); });
      });
  if (!watch.ok()) {
    barriers_.erase(key);
    return watch.status();
  }
  b.watch = watch->id;
  return &b;
}

void TcpStoreProtocol::LeaveBarrier(const std::string& key, uint64_t session) {
  auto it = barriers_.find(key);
  if (it == barriers_.end()) return;
  it->second.waiting.erase(session);
  if (!it->second.waiting.empty()) return;
  if (it->second.watch != 0) store_->CancelWatch(it->second.watch);
  barriers_.erase(it);
}

void TcpStoreProtocol::OnBarrierCount(const std::string& key, int64_t count) {
  auto it = barriers_.find(key);
  if (it == barriers_.end()) return;
  std::vector<uint64_t> done;
  for (const auto& [id, wait] : it->second.waiting) {
    if (count >= wait.second) done.push_back(id);
  }
  for (uint64_t id : done) {
    it = barriers_.find(key);
    if (it == barriers_.end()) return;
    auto wait = it->second.waiting.find(id);
    TcpStoreSession* s = Find(id);
    if (wait == it->second.waiting.end() || s == nullptr) continue;
    s->Complete(wait->second.first, absl::OkStatus());
  }
}

void TcpStoreProtocol::OnBarrierClosed(const std::string& key,
                                       const absl::Status& status) {
  auto it = barriers_.find(key);
  if (it == barriers_.end()) return;
  std::vector<uint64_t> ids;
  for (const auto& [id, wait] : it->second.waiting) ids.push_back(id);
  it->second.watch = 0;  // Ended by the store; nothing to cancel.
  for (uint64_t id : ids) {
    if (TcpStoreSession* s = Find(id)) {
      s->Close(absl::StrCat("BARRIER ended: ", status.message()), false);
    }
  }
}

absl::Status TcpStoreProtocol::Charge(
    const std::shared_ptr<const std::string>& owner, Quota quota,
    uint64_t amount) {
  if (options_.quotas == nullptr || owner == nullptr) return absl::OkStatus();
  return options_.quotas->Take(*owner, quota, amount);
}

void TcpStoreProtocol::Uncharge(const std::shared_ptr<const std::string>& owner,
                                Quota quota, uint64_t amount) {
  if (options_.quotas == nullptr || owner == nullptr || amount == 0) return;
  options_.quotas->Give(*owner, quota, amount);
}

void TcpStoreProtocol::Observe(Op op, int64_t read_ns,
                               TcpStoreOutcome outcome) {
  if (!options_.on_query) return;
  options_.on_query(op, outcome,
                    absl::Nanoseconds(host_->NowNanos() - read_ns));
}

// ---- TcpStoreSession ----

TcpStoreSession::TcpStoreSession(TcpStoreProtocol& protocol, uint64_t id,
                                 std::string peer)
    : protocol_(protocol),
      id_(id),
      peer_(std::move(peer)),
      name_space_(protocol.options_.prefix) {
  protocol_.sessions_.emplace(id_, this);
}

TcpStoreSession::~TcpStoreSession() { End(); }

void TcpStoreSession::End() {
  if (ended_) return;
  ended_ = true;
  CancelBlock();
  PassWakes();
  if (batched_pops_ > 0) protocol_.DropPops(*this);
  if (charged_connection_) {
    protocol_.Uncharge(owner_, Quota::kConnections, 1);
  }
  charged_connection_ = false;
  protocol_.sessions_.erase(id_);
}

void TcpStoreSession::Close(absl::string_view why, bool bad_input) {
  if (ended_) return;
  host().Close(*this, why, bad_input);
}

void TcpStoreSession::Fail(absl::string_view what, const absl::Status& status) {
  Close(absl::StrCat(what, " failed: ", status.message()), false);
}

size_t TcpStoreSession::Feed(absl::string_view bytes) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    const Step step = Next(bytes.substr(pos));
    pos += step.used;
    if (step.progress == Progress::kStopped) break;
  }
  return pos;
}

TcpStoreSession::Step TcpStoreSession::Next(absl::string_view bytes) {
  if (ended_ || bytes.empty()) return {};
  if (!greeted_) return Greet(bytes);
  if (!dialect_.has_value()) {
    dialect_ = tcpstore::DetectDialect(bytes);
    if (!dialect_.has_value()) return {.need = bytes.size() + 1};
  }
  if (block_ == Block::kWait && *dialect_ == Dialect::kTorch113) {
    // A 1.13 client has no CANCEL_WAIT, and it sends nothing while it waits
    // (it is synchronous): a request now means its wait timed out on its
    // side. Forget the wait without a word (a STOP_WAITING later would be
    // read as the start of another reply) and serve the request.
    CancelBlock();
  }
  if (block_ != Block::kNone) return WhileBlocked(bytes);
  return Serve(bytes);
}

TcpStoreSession::Step TcpStoreSession::Greet(absl::string_view bytes) {
  if (!tcpstore::IsNamespaceHello(bytes[0])) {
    if (options().require_token) {
      ++protocol_.refused_unauthenticated_;
      Close(
          "this listener needs a token (cohortd runs with --auth_tokens) and "
          "a torch client cannot send one: run the job under cohortrun, "
          "whose node proxy sends its workers' token",
          /*bad_input=*/false);
      return {};
    }
    greeted_ = true;
    if (!Bind(absl::StrCat("connection ", peer_))) return {};
    return {.progress = Progress::kOpening};
  }
  absl::string_view name_space, token;
  ParseResult hello = tcpstore::ParseNamespaceHello(bytes, &name_space, &token);
  if (hello.status == ParseStatus::kIncomplete) return {.need = hello.size};
  if (hello.status == ParseStatus::kInvalid) {
    Close(absl::StrCat("bad namespace hello: ", hello.error),
          /*bad_input=*/true);
    return {};
  }
  std::string bound = absl::StrCat(options().prefix, name_space);
  std::string owner = absl::StrCat("connection ", peer_);
  if ((!token.empty() || options().require_token) &&
      !Authorize(token, bound, &owner)) {
    return {};
  }
  name_space_ = std::move(bound);
  greeted_ = true;
  if (!Bind(std::move(owner))) return {.used = hello.size};
  return {.used = hello.size, .progress = Progress::kOpening};
}

bool TcpStoreSession::Authorize(absl::string_view token,
                                const std::string& name_space,
                                std::string* owner) {
  absl::StatusOr<TcpStoreGrant> allowed =
      token.empty() ? absl::UnauthenticatedError("its hello carries no token")
      : options().authorize
          ? options().authorize(token, name_space)
          : absl::FailedPreconditionError(
                "this listener takes no tokens (cohortd runs without "
                "--auth_tokens)");
  if (!allowed.ok()) {
    ++protocol_.refused_unauthenticated_;
    Close(absl::StrCat("refused: ", allowed.status().message()),
          /*bad_input=*/false);
    return false;
  }
  *owner = std::move(allowed->owner);
  still_valid_ = std::move(allowed->still_valid);
  return true;
}

bool TcpStoreSession::Bind(std::string owner) {
  if (!owner.empty()) {
    owner_ = std::make_shared<const std::string>(std::move(owner));
  }
  if (absl::Status s = protocol_.Charge(owner_, Quota::kConnections, 1);
      !s.ok()) {
    ++protocol_.refused_quota_;
    Close(absl::StrCat("refused: ", s.message()), false);
    return false;
  }
  charged_connection_ = owner_ != nullptr && options().quotas != nullptr;
  return true;
}

TcpStoreSession::Step TcpStoreSession::WhileBlocked(absl::string_view bytes) {
  // Replies go out in order, so only CANCEL_WAIT may pass a request that
  // is still waiting.
  if (*dialect_ != Dialect::kTorch21 ||
      static_cast<uint8_t>(bytes[0]) !=
          *tcpstore::OpCode(Dialect::kTorch21, Op::kCancelWait)) {
    return {};
  }
  CancelBlock();
  Encoder(&output_).U8(static_cast<uint8_t>(WaitReply::kWaitCanceled));
  if (options().on_query) {
    protocol_.Observe(Op::kCancelWait, host().NowNanos(), TcpStoreOutcome::kOk);
  }
  return {.used = 1, .progress = Progress::kOpening};
}

TcpStoreSession::Step TcpStoreSession::Serve(absl::string_view bytes) {
  Request request;
  ParseResult parsed =
      tcpstore::ParseRequest(*dialect_, bytes, protocol_.limits_, &request);
  if (parsed.status == ParseStatus::kIncomplete) return {.need = parsed.size};
  if (parsed.status == ParseStatus::kInvalid) {
    Close(absl::StrCat(parsed.error, " (", DialectName(*dialect_),
                       " protocol; first bytes \"",
                       absl::CHexEscape(bytes.substr(0, 16)), "\")"),
          /*bad_input=*/true);
    return {};
  }
  ++protocol_.requests_;
  read_ns_ = options().on_query ? host().NowNanos() : 0;
  if (still_valid_) {
    // A token revoked (or expired) since the hello ends its connection at
    // its next request.
    if (absl::Status valid = still_valid_(); !valid.ok()) {
      ++protocol_.refused_unauthenticated_;
      Close(absl::StrCat("its token is no longer valid: ", valid.message()),
            false);
      return {.used = parsed.size};
    }
  }
  if (name_space_.empty()) {
    Handle(request);
  } else {
    std::deque<std::string> keys;
    Handle(InNamespace(name_space_, request, keys));
  }
  Handled(request.op);
  if (ended_) return {.used = parsed.size};
  return {.used = parsed.size, .progress = Progress::kRequest};
}

void TcpStoreSession::Handled(Op op) {
  if (!options().on_query) return;
  if (ended_) {
    return protocol_.Observe(op, read_ns_, TcpStoreOutcome::kFailed);
  }
  if (block_ != Block::kNone) {
    blocked_op_ = op;
    blocked_since_ns_ = read_ns_;
    return;
  }
  if (RuleOf(op).batched) return;
  protocol_.Observe(op, read_ns_, TcpStoreOutcome::kOk);
}

void TcpStoreSession::Handle(const Request& r) {
  // The protocol has no error reply: a refused request closes the
  // connection, which torch's client reports as a failed call.
  if (absl::Status s = CheckClientWrites(r); !s.ok()) {
    Close(absl::StrCat(OpName(r.op), " refused: ", s.message()), false);
    return;
  }
  if (woken_keys_ != nullptr) {
    // After a WAIT, a client pops the queue that ended it; anything else
    // means it will not, and the push's wake-up goes to another waiter.
    if (r.op == Op::kQueuePop &&
        std::find(woken_keys_->begin(), woken_keys_->end(), r.key) !=
            woken_keys_->end()) {
      woken_keys_ = nullptr;
    } else {
      PassWakes();
    }
  }
  const OpRule rule = RuleOf(r.op);
  if (!rule.batched) {
    // It reads the store or answers at once: its reply goes after those of
    // the changes queued before it.
    protocol_.CommitBatch();
    if (!ended_) Answer(r);
    return;
  }
  if (r.op == Op::kQueuePush) return QueuePush(r);
  // A pop is committed with the batch, like a write (it is one); its reply
  // follows those of the changes before it.
  protocol_.Queue(*this, r.op, rule.answered,
                  {.kind = rule.change,
                   .key = r.key,
                   .value = r.value,
                   .expected = r.expected,
                   .delta = r.number},
                  read_ns_);
  if (r.op == Op::kQueuePop) ++batched_pops_;
}

void TcpStoreSession::Answer(const Request& r) {
  Encoder reply(&output_);
  switch (r.op) {
    case Op::kValidate:
      if (r.word != tcpstore::kValidateMagic) {
        Close(absl::StrFormat("VALIDATE with magic 0x%08x, not 0x%08x", r.word,
                              tcpstore::kValidateMagic),
              true);
      }
      return;
    case Op::kPing:
      reply.U32(r.word);
      return;
    case Op::kMultiSet:
      if (auto s = store().MultiSet(Strings(r.keys), Strings(r.values));
          !s.ok()) {
        Fail("MULTI_SET", s.status());
      }
      return;
    case Op::kGet:
      return Get(r);
    case Op::kCheck: {
      // A key whose queue holds items exists too, as on torch's server.
      auto s = store().CheckKeysOrQueues(Strings(r.keys));
      if (!s.ok()) return Fail("CHECK", s.status());
      reply.U8(static_cast<uint8_t>(s->all_exist ? CheckReply::kReady
                                                 : CheckReply::kNotReady));
      return;
    }
    case Op::kWait:
      return StartWait(r.keys);
    case Op::kNumKeys: {
      // (Queue items are not counted: KvStore::NumKeys.)
      auto s = store().NumKeys(name_space_);
      if (!s.ok()) return Fail("GETNUMKEYS", s.status());
      reply.I64(s->num_keys);
      return;
    }
    case Op::kMultiGet: {
      // All at one revision (a write between two keys' reads would show
      // half of a MULTI_SET); a missing key reads as empty, as on torch's
      // server.
      auto s = store().TryGetMany(Strings(r.keys));
      if (!s.ok()) return Fail("MULTI_GET", s.status());
      for (const std::optional<std::string>& value : *s) {
        reply.Bytes(value.has_value() ? absl::string_view(*value) : "");
      }
      return;
    }
    case Op::kCancelWait:
      CancelBlock();
      reply.U8(static_cast<uint8_t>(WaitReply::kWaitCanceled));
      return;
    case Op::kListKeys:
      return ListKeys();
    case Op::kBarrier:
      return ArriveAtBarrier(r);
    case Op::kQueueLen: {
      auto s = store().QueueLen(r.key);
      if (!s.ok()) return Fail("QUEUE_LEN", s.status());
      reply.I64(*s);
      return;
    }
    case Op::kWatchKey:
      Close(
          "WATCH_KEY is not supported (PyTorch removed Store.watch_key in "
          "2.1); watch keys with `cohortctl watch` or the gRPC Watch call",
          false);
      return;
    default:  // The batched queries (RuleOf).
      return;
  }
}

void TcpStoreSession::Get(const Request& r) {
  auto s = store().TryGet(r.key);
  if (!s.ok()) return Fail("GET", s.status());
  if (s->has_value()) {
    Encoder(&output_).Bytes(**s);
  } else if (*dialect_ == Dialect::kTorch21) {
    Encoder(&output_).Bytes("");
  } else {
    // 1.13's server drops such a connection too; its client always waits
    // for the key before getting it.
    Close(absl::StrCat("GET of missing key \"", absl::CHexEscape(r.key), "\""),
          false);
  }
}

void TcpStoreSession::ListKeys() {
  std::vector<std::string> keys;
  std::string token;
  do {
    auto page = store().ListKeys(name_space_, 0, token);
    if (!page.ok()) return Fail("LIST_KEYS", page.status());
    for (std::string& k : page->keys) {
      if (absl::StartsWith(k, store::kQueuePrefix)) continue;
      k.erase(0, name_space_.size());
      keys.push_back(std::move(k));
    }
    token = std::move(page->next_page_token);
  } while (!token.empty());
  Encoder reply(&output_);
  reply.I64(keys.size());
  for (const std::string& k : keys) reply.Bytes(k);
}

void TcpStoreSession::ArriveAtBarrier(const Request& r) {
  auto s = store().Add(r.key, 1);
  if (!s.ok()) return Fail("BARRIER", s.status());
  if (s->value >= r.number) {
    StopWaiting();
  } else {
    StartBarrier(r.key, r.number, s->revision);
  }
}

// Queues the push, once the limits allow it: all queues together hold at
// most max_queue_bytes_total (counted by the store, so items kept over a
// restart count too), each owner at most its quota.
void TcpStoreSession::QueuePush(const Request& r) {
  const uint64_t held =
      store().queue_stats().bytes + protocol_.batch_push_bytes_;
  if (held + r.value.size() > options().max_queue_bytes_total) {
    return OverQuota(
        r.op, absl::ResourceExhaustedError(absl::StrCat(
                  "the queues hold ", held, " bytes, and ", r.value.size(),
                  " more would pass --tcpstore_max_queue_bytes=",
                  options().max_queue_bytes_total,
                  ": pop what the queues hold first")));
  }
  if (absl::Status s =
          protocol_.Charge(owner_, Quota::kQueueBytes, r.value.size());
      !s.ok()) {
    return OverQuota(r.op, s);
  }
  TcpStoreProtocol::Queued& q = protocol_.Queue(
      *this, r.op, /*answered=*/false,
      {.kind = store::Change::Kind::kQueuePush, .key = r.key, .value = r.value},
      read_ns_);
  q.owner = owner_;
  q.charged = r.value.size();
  protocol_.batch_push_bytes_ += r.value.size();
}

void TcpStoreSession::OverQuota(Op op, const absl::Status& why) {
  ++protocol_.refused_quota_;
  Close(absl::StrCat(OpName(op), " refused: ", why.message()), false);
}

void TcpStoreSession::PassWakes() {
  if (woken_keys_ == nullptr) return;
  store().PassQueueWakes(*std::exchange(woken_keys_, nullptr));
}

void TcpStoreSession::StopWaiting() {
  Encoder(&output_).U8(static_cast<uint8_t>(WaitReply::kStopWaiting));
}

// A key whose queue holds items counts as present, and a push ends one WAIT
// only (KvStore::WaitForKeysOrQueues): torch's blocking queue_pop is a
// WAIT, then a QUEUE_POP.
void TcpStoreSession::StartWait(const std::vector<absl::string_view>& keys) {
  std::vector<std::string> waited = Strings(keys);
  auto s = store().CheckKeysOrQueues(waited);
  if (!s.ok()) return Fail("WAIT", s.status());
  if (s->all_exist) return StopWaiting();
  if (!ChargeWait(Op::kWait, waited.size())) return;
  block_ = Block::kWait;
  ++protocol_.blocked_;
  const uint64_t id = id_;
  const uint64_t seq = ++seq_;
  std::shared_ptr<const std::vector<std::string>> queues;
  if (*dialect_ == Dialect::kTorch21) {
    // (1.13 has no queues.)
    queues = std::make_shared<const std::vector<std::string>>(waited);
    wait_keys_ = queues;
  }
  TcpStoreProtocol* protocol = &protocol_;
  wait_id_ = store().WaitForKeysOrQueues(
      std::move(waited), absl::InfiniteDuration(),
      [protocol, id, seq, queues](absl::StatusOr<store::ReadResult> result) {
        const bool push = result.ok() && result->queue_wake;
        protocol->host_->Post(
            [protocol, id, seq, queues, push, status = result.status()] {
              TcpStoreSession* s = protocol->Find(id);
              if (s != nullptr && s->Complete(seq, status, push)) return;
              // Ended by a push for a client that is gone or no longer waits:
              // another waiter must get the item.
              if (push && queues != nullptr) {
                protocol->store_->PassQueueWakes(*queues);
              }
            });
      });
}

bool TcpStoreSession::ChargeWait(Op op, size_t keys) {
  if (absl::Status s = protocol_.Charge(owner_, Quota::kWaits, 1); !s.ok()) {
    OverQuota(op, s);
    return false;
  }
  if (absl::Status s = protocol_.Charge(owner_, Quota::kWaitedKeys, keys);
      !s.ok()) {
    protocol_.Uncharge(owner_, Quota::kWaits, 1);
    OverQuota(op, s);
    return false;
  }
  charged_wait_keys_ = keys;
  return true;
}

void TcpStoreSession::StartBarrier(absl::string_view key, int64_t target,
                                   int64_t revision) {
  if (!ChargeWait(Op::kBarrier, 1)) return;
  absl::StatusOr<TcpStoreProtocol::Barrier*> b =
      protocol_.WatchBarrier(key, revision);
  if (!b.ok()) {
    protocol_.Uncharge(owner_, Quota::kWaits, 1);
    protocol_.Uncharge(owner_, Quota::kWaitedKeys, 1);
    charged_wait_keys_ = 0;
    return Fail("BARRIER", b.status());
  }
  block_ = Block::kBarrier;
  ++protocol_.blocked_;
  barrier_key_ = std::string(key);
  (*b)->waiting[id_] = {++seq_, target};
}

bool TcpStoreSession::Complete(uint64_t seq, const absl::Status& status,
                               bool push) {
  if (ended_ || block_ == Block::kNone || seq_ != seq) return false;
  if (!status.ok()) {
    ClearBlock(TcpStoreOutcome::kFailed);
    Close(absl::StrCat("wait ended: ", status.message()), false);
    return true;
  }
  if (push) woken_keys_ = wait_keys_;
  ClearBlock(TcpStoreOutcome::kOk);
  StopWaiting();
  host().Ready(*this);
  return true;
}

void TcpStoreSession::ClearBlock(TcpStoreOutcome outcome) {
  if (block_ == Block::kNone) return;
  protocol_.Observe(blocked_op_, blocked_since_ns_, outcome);
  --protocol_.blocked_;
  protocol_.Uncharge(owner_, Quota::kWaits, 1);
  protocol_.Uncharge(owner_, Quota::kWaitedKeys, charged_wait_keys_);
  charged_wait_keys_ = 0;
  if (block_ == Block::kWait) {
    wait_keys_ = nullptr;
    wait_id_ = 0;
  } else {
    protocol_.LeaveBarrier(barrier_key_, id_);
    barrier_key_.clear();
  }
  block_ = Block::kNone;
  ++seq_;
}

void TcpStoreSession::CancelBlock() {
  if (block_ == Block::kWait) store().CancelWait(wait_id_);
  ClearBlock(TcpStoreOutcome::kCancelled);
}

}  // namespace cohort::server
