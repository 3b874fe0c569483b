#include "server/ha/etcd_engine.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "grpcpp/create_channel.h"

namespace cohort::server {
namespace {

// etcd's require-leader metadata: a member that has lost its leader (cut
// off in a minority, which it notices within an election timeout) fails
// the call at once with UNAVAILABLE "etcdserver: no leader", and ends a
// watch stream, instead of holding them until their deadline, so the call
// or the watch moves on to the next member.
void RequireLeader(grpc::ClientContext* context) {
  context->AddMetadata("hasleader", "true");
}

using store::KvEngine;
using store::Mutation;

// Keys read per Range page while loading the view.
constexpr int64_t kLoadPage = 1000;

// Every commit also writes this key (in cohortd's reserved namespace, so no
// client writes it, and left out of the view): its modification revision is
// the revision of the last commit, which a quorum read of it returns, and
// its change is an event the watch brings in order. That makes the read
// barrier safe without etcd 3.4's progress reports, which may claim a
// revision the watch has not delivered yet.
constexpr absl::string_view kLastWrite = "/cohort/etcd/last-write";

bool Retryable(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAVAILABLE ||
         s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

class EtcdEngine final : public KvEngine {
 public:
  explicit EtcdEngine(EtcdEngineOptions options)
      : options_(std::move(options)),
        prefix_end_(EtcdPrefixEnd(options_.prefix)) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    for (const std::string& endpoint : options_.endpoints) {
      Member m;
      m.endpoint = endpoint;
      m.channel = grpc::CreateCustomChannel(
          endpoint, grpc::InsecureChannelCredentials(), args);
      m.kv = etcdserverpb::KV::NewStub(m.channel);
      m.watch = etcdserverpb::Watch::NewStub(m.channel);
      members_.push_back(std::move(m));
    }
  }

  ~EtcdEngine() override { StopFeed(); }

  absl::Status Load() {
    const absl::Time give_up = absl::Now() + options_.connect_timeout;
    absl::Status last;
    while (absl::Now() < give_up) {
      last = LoadOnce();
      if (last.ok()) return last;
      absl::SleepFor(absl::Milliseconds(200));
    }
    return absl::UnavailableError(absl::StrCat(
        "no etcd member of ", absl::StrJoin(options_.endpoints, ","),
        " gave the keys under ", options_.prefix, " within ",
        absl::FormatDuration(options_.connect_timeout), ": ", last.message()));
  }

  absl::string_view name() const override { return "etcd"; }

  // The view is store/'s in-memory engine, plus each key's modification
  // revision for the guards.
  absl::StatusOr<std::optional<std::string>> Get(
      absl::string_view key) const override {
    return view_->Get(key);
  }
  bool Contains(absl::string_view key) const override {
    return view_->Contains(key);
  }
  std::unique_ptr<PreparedRead> PrepareRead(
      std::vector<std::string> keys) const override {
    return view_->PrepareRead(std::move(keys));
  }

  // Called by KvStore, under its lock, with the feed's changes: updates
  // the view only (they are committed in etcd already).
  absl::Status Apply(absl::Span<const Mutation> mutations,
                     int64_t revision) override {
    for (const Mutation& m : mutations) {
      if (m.kind == Mutation::Kind::kPut) {
        mod_revisions_.insert_or_assign(m.key, revision);
      } else {
        mod_revisions_.erase(m.key);
      }
    }
    revision_ = std::max(revision_, revision);
    return view_->Apply(mutations, revision_);
  }

  int64_t revision() const override { return revision_; }
  int64_t NumKeys() const override { return view_->NumKeys(); }
  absl::StatusOr<int64_t> CountKeys(absl::string_view prefix) const override {
    return view_->CountKeys(prefix);
  }
  absl::StatusOr<std::vector<std::string>> ListKeys(
      absl::string_view prefix, absl::string_view start_after,
      size_t limit) const override {
    return view_->ListKeys(prefix, start_after, limit);
  }

  absl::Status Flush() override { return absl::OkStatus(); }

  absl::Status CheckWritable() override {
    // A quorum read: etcd can commit only while it has a quorum.
    etcdserverpb::RangeRequest req;
    req.set_key(options_.prefix);
    req.set_range_end(prefix_end_);
    req.set_count_only(true);
    etcdserverpb::RangeResponse resp;
    grpc::Status s = CallWithFailover(
        [&](Member& m, grpc::ClientContext* c) {
          return m.kv->Range(c, req, &resp);
        },
        /*retry=*/true);
    if (!s.ok()) return FromGrpc(s, "etcd has no quorum to read from");
    return absl::OkStatus();
  }

  bool shared() const override { return true; }

  int64_t ModRevision(absl::string_view key) const override {
    auto it = mod_revisions_.find(key);
    return it == mod_revisions_.end() ? 0 : it->second;
  }

  absl::StatusOr<int64_t> ApplyGuarded(
      absl::Span<const Mutation> mutations,
      absl::Span<const Guard> guards) override {
    etcdserverpb::TxnRequest txn;
    // One etcd transaction may name a key once: keep the last mutation of
    // each (what the batch leaves behind).
    absl::flat_hash_map<absl::string_view, size_t> last;
    for (size_t i = 0; i < mutations.size(); ++i) last[mutations[i].key] = i;
    for (size_t i = 0; i < mutations.size(); ++i) {
      const Mutation& m = mutations[i];
      if (last[m.key] != i) continue;
      etcdserverpb::RequestOp* op = txn.add_success();
      if (m.kind == Mutation::Kind::kPut) {
        op->mutable_request_put()->set_key(options_.prefix + m.key);
        op->mutable_request_put()->set_value(m.value);
      } else {
        op->mutable_request_delete_range()->set_key(options_.prefix + m.key);
      }
    }
    if (last.find(kLastWrite) == last.end()) {
      txn.add_success()->mutable_request_put()->set_key(
          absl::StrCat(options_.prefix, kLastWrite));
    }
    absl::flat_hash_map<absl::string_view, int64_t> compared;
    for (const Guard& g : guards) {
      if (!compared.emplace(g.key, g.mod_revision).second) continue;
      etcdserverpb::Compare* c = txn.add_compare();
      c->set_key(options_.prefix + g.key);
      c->set_target(etcdserverpb::Compare::MOD);
      c->set_result(etcdserverpb::Compare::EQUAL);
      c->set_mod_revision(g.mod_revision);
    }
    etcdserverpb::TxnResponse resp;
    // A guarded commit whose answer was lost may have applied: repeating it
    // would fail its guards and make the caller apply it again (an Add
    // twice). KvStore guards every write it commits (a repeated plain put
    // could land after a later write and bring an old value back), so only
    // unguarded commits, which no caller makes today, are repeated.
    grpc::Status s = CallWithFailover(
        [&](Member& m, grpc::ClientContext* c) {
          return m.kv->Txn(c, txn, &resp);
        },
        /*retry=*/guards.empty());
    if (!s.ok()) {
      if (Retryable(s) && !guards.empty()) {
        return absl::UnavailableError(absl::StrCat(
            "etcd did not answer a conditional write (", s.error_message(),
            "); it may or may not have been applied"));
      }
      return FromGrpc(s, "etcd transaction");
    }
    if (!resp.succeeded()) {
      return absl::AbortedError("a key read by this write changed meanwhile");
    }
    return resp.header().revision();
  }

  absl::StatusOr<int64_t> ReadBarrier() override {
#ifdef COHORT_PLANTED_BUG_STALE_READS
    // The planted bug of //server:cohortd_planted_stale_reads (testonly):
    // reads are served from this replica's view as it stands, which may
    // not yet hold a write another replica has acknowledged. The
    // linearizability checker must catch it (tests/robustness).
    return int64_t{0};
#endif
    etcdserverpb::RangeRequest req;
    req.set_key(absl::StrCat(options_.prefix, kLastWrite));
    req.set_keys_only(true);
    etcdserverpb::RangeResponse resp;
    grpc::Status s = CallWithFailover(
        [&](Member& m, grpc::ClientContext* c) {
          return m.kv->Range(c, req, &resp);
        },
        /*retry=*/true);
    if (!s.ok()) return FromGrpc(s, "etcd read barrier");
    return resp.kvs().empty() ? int64_t{0} : resp.kvs(0).mod_revision();
  }

  absl::Status StartFeed(Feed feed) override {
    feed_ = std::move(feed);
    feed_thread_ = std::thread([this] { RunFeed(); });
    return absl::OkStatus();
  }

  void StopFeed() override {
    {
      absl::MutexLock lock(&stream_mu_);
      if (stopping_) return;
      stopping_ = true;
      if (stream_context_ != nullptr) stream_context_->TryCancel();
    }
    if (feed_thread_.joinable()) feed_thread_.join();
  }

 private:
  struct Member {
    std::string endpoint;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Watch::Stub> watch;
  };
  using WatchStream = grpc::ClientReaderWriter<etcdserverpb::WatchRequest,
                                               etcdserverpb::WatchResponse>;

  // Runs `call` on the current member; on UNAVAILABLE or a deadline (and
  // when `retry`), on each of the others in turn.
  template <typename Call>
  grpc::Status CallWithFailover(Call call, bool retry) {
    grpc::Status s;
    const size_t first = current_.load();
    const size_t tries = retry ? members_.size() * 2 : 1;
    for (size_t i = 0; i < tries; ++i) {
      const size_t index = (first + i) % members_.size();
      grpc::ClientContext context;
      context.set_deadline(
          absl::ToChronoTime(absl::Now() + options_.call_timeout));
      RequireLeader(&context);
      s = call(members_[index], &context);
      if (!Retryable(s)) {
        if (index != first) {
          current_ = index;
          Log(absl::StrCat("etcd: now using ", members_[index].endpoint));
        }
        return s;
      }
    }
    return s;
  }

  absl::Status LoadOnce() {
    view_ = store::NewMemoryEngine();
    mod_revisions_.clear();
    last_write_ = 0;
    int64_t at = 0;
    std::string from = options_.prefix;
    for (;;) {
      etcdserverpb::RangeRequest req;
      req.set_key(from);
      req.set_range_end(prefix_end_);
      req.set_limit(kLoadPage);
      req.set_revision(at);
      etcdserverpb::RangeResponse resp;
      grpc::Status s = CallWithFailover(
          [&](Member& m, grpc::ClientContext* c) {
            return m.kv->Range(c, req, &resp);
          },
          /*retry=*/true);
      if (!s.ok()) return FromGrpc(s, "loading the keys");
      if (at == 0) at = resp.header().revision();
      for (const mvccpb::KeyValue& kv : resp.kvs()) {
        Mutation m;
        m.key = kv.key().substr(options_.prefix.size());
        if (m.key == kLastWrite) {
          last_write_ = kv.mod_revision();
          continue;
        }
        m.value = kv.value();
        mod_revisions_.insert_or_assign(m.key, kv.mod_revision());
        if (absl::Status s = view_->Apply({&m, 1}, at); !s.ok()) return s;
      }
      if (!resp.more() || resp.kvs().empty()) break;
      from = resp.kvs(resp.kvs_size() - 1).key() + '\0';
    }
    revision_ = at;
    next_revision_ = std::max<int64_t>(1, at + 1 - options_.history_revisions);
    // The replay is whole once it has brought the last commit made through
    // cohortd before the load (none: nothing to replay).
    replay_until_ = last_write_ >= next_revision_ ? last_write_ : 0;
    loaded_ = at;
    Log(absl::StrCat("etcd: loaded ", view_->NumKeys(), " keys under ",
                     options_.prefix, " at revision ", at));
    return absl::OkStatus();
  }

  // The watch loop: one stream at a time, reopened on the next member
  // from the revision after the last delivered.
  // Long: one stream's life (open, replay, deliver, cancel, back off) reads
  // best in the order it happens; its pieces share the stream and context.
  void RunFeed() {
    absl::Duration backoff = absl::Milliseconds(100);
    for (;;) {
      grpc::ClientContext context;
      const size_t index = current_.load();
      std::unique_ptr<WatchStream> stream;
      bool open = false;
      {
        absl::MutexLock lock(&stream_mu_);
        if (stopping_) return;
        stream_context_ = &context;
        RequireLeader(&context);
        stream = members_[index].watch->Watch(&context);
        etcdserverpb::WatchRequest create;
        auto* c = create.mutable_create_request();
        c->set_key(options_.prefix);
        c->set_range_end(prefix_end_);
        c->set_start_revision(next_revision_);
        open = stream->Write(create);
        if (open) stream_ = stream.get();
      }
      bool delivered = false;
      etcdserverpb::WatchResponse resp;
      while (open && stream->Read(&resp)) {
        if (resp.canceled() && resp.compact_revision() > 0 &&
            next_revision_ <= replay_until_) {
          // Part of the replay is compacted away: replay what etcd holds.
          next_revision_ = resp.compact_revision();
          break;
        }
        if (resp.canceled()) {
          Log(absl::StrCat("etcd: the watch was cancelled",
                           resp.compact_revision() > 0
                               ? absl::StrCat(" (revision ", next_revision_,
                                              " is compacted; etcd keeps from ",
                                              resp.compact_revision(), ")")
                               : "",
                           ": ", resp.cancel_reason()));
          if (resp.compact_revision() > 0) {
            // Changes this view never saw are gone from etcd: the view
            // cannot be repaired in place. A replica keeps no state of its
            // own, so the restart that follows reloads it whole.
            Log("etcd: exiting so that a restart reloads this replica's view");
            _exit(70);
          }
          break;
        }
        if (resp.created()) {
          delivered = true;
          if (replay_until_ == 0 && !replay_reported_) {
            // Nothing to replay: the store's history is whole at once.
            replay_reported_ = true;
            feed_(loaded_, {});
          }
          continue;
        }
        Deliver(resp);
        delivered = true;
        backoff = absl::Milliseconds(100);
      }
      {
        absl::MutexLock lock(&stream_mu_);
        stream_ = nullptr;
        stream_context_ = nullptr;
        if (stopping_) return;
      }
      // etcd keeps a stream open after cancelling a watch on it: without
      // this, Finish would wait for it forever (and StopFeed, which no
      // longer sees the context, with it).
      context.TryCancel();
      stream->Finish().IgnoreError();
      // Go on with the next member.
      current_ = (index + 1) % members_.size();
      Log(absl::StrCat("etcd: the watch on ", members_[index].endpoint,
                       " ended; resuming from revision ", next_revision_,
                       " on ", members_[current_.load()].endpoint));
      if (!delivered) {
        absl::SleepFor(backoff);
        backoff = std::min(backoff * 2, absl::Seconds(1));
      }
    }
  }

  // Hands the events of `resp` to the feed, one revision at a time; a
  // response without events is a progress report.
  void Deliver(const etcdserverpb::WatchResponse& resp) {
    // Responses without events (progress reports) are not trusted: see
    // kLastWrite.
    std::vector<Mutation> batch;
    int64_t batch_revision = 0;
    auto flush = [&] {
      if (batch_revision == 0) return;
      if (batch_revision >= next_revision_) {
        // A revision whose only change is kLastWrite still advances the
        // view (empty mutations).
        feed_(batch_revision, std::move(batch));
        next_revision_ = batch_revision + 1;
        if (!replay_reported_ && replay_until_ > 0 &&
            batch_revision >= replay_until_) {
          replay_reported_ = true;
          feed_(loaded_, {});  // The replay is whole.
        }
      }
      batch.clear();
      batch_revision = 0;
    };
    for (const mvccpb::Event& e : resp.events()) {
      const int64_t revision = e.kv().mod_revision();
      if (revision != batch_revision) {
        flush();
        batch_revision = revision;
      }
      std::string key = e.kv().key().substr(
          std::min(options_.prefix.size(), e.kv().key().size()));
      if (key == kLastWrite) continue;
      Mutation m;
      m.key = std::move(key);
      if (e.type() == mvccpb::Event::PUT) {
        m.kind = Mutation::Kind::kPut;
        m.value = e.kv().value();
      } else {
        m.kind = Mutation::Kind::kDelete;
      }
      batch.push_back(std::move(m));
    }
    flush();
  }

  void Log(absl::string_view line) {
    if (options_.log) options_.log(line);
  }

  const EtcdEngineOptions options_;
  const std::string prefix_end_;
  std::vector<Member> members_;
  std::atomic<size_t> current_{0};

  // The view: read and written under KvStore's lock (Load runs before).
  std::unique_ptr<KvEngine> view_ = store::NewMemoryEngine();
  absl::flat_hash_map<std::string, int64_t> mod_revisions_;
  int64_t revision_ = 0;

  // The feed thread's.
  Feed feed_;
  int64_t next_revision_ = 1;
  // The revision loaded, and kLastWrite's revision then: the watch first
  // replays changes up to it (0: nothing to replay), then says so once.
  int64_t loaded_ = 0;
  int64_t last_write_ = 0;
  int64_t replay_until_ = 0;
  bool replay_reported_ = false;
  std::thread feed_thread_;

  absl::Mutex stream_mu_;
  bool stopping_ ABSL_GUARDED_BY(stream_mu_) = false;
  grpc::ClientContext* stream_context_ ABSL_GUARDED_BY(stream_mu_) = nullptr;
  WatchStream* stream_ = nullptr;  // Written under stream_mu_.
};

}  // namespace

std::string EtcdPrefixEnd(absl::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xFF) {
      end.back() = static_cast<char>(end.back() + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // Everything.
}

absl::StatusOr<std::unique_ptr<store::KvEngine>> OpenEtcdEngine(
    EtcdEngineOptions options) {
  if (options.endpoints.empty()) {
    return absl::InvalidArgumentError(
        "--etcd_endpoints needs at least one HOST:PORT");
  }
  for (const std::string& e : options.endpoints) {
    if (e.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd endpoint '", e, "' is not HOST:PORT"));
    }
  }
  if (options.prefix.empty()) {
    return absl::InvalidArgumentError("the etcd key prefix must not be empty");
  }
  auto engine = std::make_unique<EtcdEngine>(std::move(options));
  if (absl::Status s = engine->Load(); !s.ok()) return s;
  return std::unique_ptr<store::KvEngine>(std::move(engine));
}

}  // namespace cohort::server
