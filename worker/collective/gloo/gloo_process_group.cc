#include "worker/collective/gloo/gloo_process_group.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <mutex>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/prefix_store.h"
#include "gloo/allgather.h"
#include "gloo/allgatherv.h"
#include "gloo/alltoall.h"
#include "gloo/alltoallv.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/gather.h"
#include "gloo/reduce.h"
#include "gloo/rendezvous/context.h"
#include "gloo/scatter.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "worker/collective/gloo/gloo_ring.h"
#include "worker/collective/gloo/gloo_store.h"
#include "worker/collective/reduce.h"

namespace cohort {
namespace {

std::chrono::milliseconds ToMillis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// Up to this many bytes sent per rank, all-reduce and all-gather send every
// rank's buffer straight to every other (gloo_ring.h's Direct*): one
// message latency instead of a ring's 2 (size - 1) or size - 1 dependent
// steps, each a notification round trip and a few thread wake-ups (70-90
// us each on the 2-core VM). Past it, the ring's smaller share of bytes on
// the wire wins.
constexpr size_t kDirectMaxWireBytes = 256 << 10;

// Calls f with a value of the unsigned integer type of `bytes` bytes: gloo's
// typed setters need a C++ type of the element's size, and moving or
// reducing by our own kernels never looks at the type's arithmetic.
template <typename F>
void WithElementOfSize(size_t bytes, F&& f) {
  switch (bytes) {
    case 1:
      return f(uint8_t{});
    case 2:
      return f(uint16_t{});
    case 4:
      return f(uint32_t{});
    default:
      return f(uint64_t{});
  }
}

// Names the peers of the given ranks (see GlooProcessGroup::Peers).
using PeerNamer = std::function<std::string(const std::vector<int>&)>;

uint8_t* Bytes(const BufferView& view) {
  return static_cast<uint8_t*>(view.data);
}

// Element counts as gloo's byte-level vectors want them.
template <typename Int>
std::vector<Int> ToBytes(absl::Span<const size_t> counts, Dtype dtype) {
  std::vector<Int> bytes;
  bytes.reserve(counts.size());
  for (size_t count : counts) {
    bytes.push_back(static_cast<Int>(count * DtypeSize(dtype)));
  }
  return bytes;
}

// Runs `fn`, turning what gloo throws into a status (the engine names the
// op). A timeout is DEADLINE_EXCEEDED: where gloo_ring.h's algorithms know
// which peers did not answer (PeersTimedOut), `peers` names them (their
// hosts, when the group knows them); gloo's own collectives only say "Timed
// out", and `peers` (given no ranks) then says where the others are. Any
// other IoException is a broken connection.
absl::Status GlooCall(absl::Duration timeout, const std::function<void()>& fn,
                      const PeerNamer& peers) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const PeersTimedOut& e) {
    return absl::DeadlineExceededError(
        absl::StrCat("no answer within ", absl::FormatDuration(timeout),
                     " from ", peers(e.ranks()), ": ", e.what()));
  } catch (const gloo::IoException& e) {
    if (absl::StrContains(e.what(), "imed out")) {
      const std::string where = peers({});
      return absl::DeadlineExceededError(absl::StrCat(
          "peers did not complete it within ", absl::FormatDuration(timeout),
          where.empty() ? "" : absl::StrCat(" (", where, ")"), ": ", e.what()));
    }
    return absl::UnavailableError(
        absl::StrCat("connection to a peer failed: ", e.what()));
  } catch (const OpMismatch& e) {
    return absl::InvalidArgumentError(e.what());
  } catch (const std::exception& e) {
    return absl::InternalError(e.what());
  }
}

// A posted Send or Recv: gloo's unbound buffer over the caller's memory.
class GlooTransfer final : public OpEngine::Transfer {
 public:
  GlooTransfer(bool is_send,
               std::unique_ptr<gloo::transport::UnboundBuffer> buffer,
               PeerNamer peers)
      : is_send_(is_send),
        buffer_(std::move(buffer)),
        peers_(std::move(peers)) {}

  absl::Status Wait(absl::Duration timeout) override {
    return GlooCall(
        timeout,
        [&] {
          const std::chrono::milliseconds millis = ToMillis(timeout);
          const bool done =
              is_send_ ? buffer_->waitSend(millis) : buffer_->waitRecv(millis);
          if (!done) throw gloo::IoException("aborted");
        },
        peers_);
  }

 private:
  const bool is_send_;
  const std::unique_ptr<gloo::transport::UnboundBuffer> buffer_;
  const PeerNamer peers_;
};

// What the engine needs of gloo besides op bodies.
class GlooTransport final : public OpEngine::Transport {
 public:
  GlooTransport(std::shared_ptr<gloo::Context> context, absl::Duration timeout,
                PeerNamer peers)
      : context_(std::move(context)),
        timeout_(timeout),
        peers_(std::move(peers)) {}

  // One exchange with every peer rather than gloo's ring of size - 1
  // steps: verify_ops runs this before every collective, so its latency is
  // every collective's.
  absl::Status AllGatherBytes(const void* mine, size_t bytes, void* all,
                              uint32_t tag) override {
    return GlooCall(
        timeout_,
        [&] {
          DirectAllGather(*context_, mine, bytes, all, tag, ToMillis(timeout_));
        },
        peers_);
  }

  absl::StatusOr<std::unique_ptr<OpEngine::Transfer>> Post(
      const PointToPointOp& op) override {
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
    absl::Status posted = GlooCall(
        timeout_,
        [&] {
          buffer =
              context_->createUnboundBuffer(op.buffer.data, op.buffer.bytes());
          const uint64_t slot = MakeSlot(kPointToPointSlotPrefix, op.tag, 0);
          if (op.is_send) {
            buffer->send(op.peer, slot);
          } else {
            buffer->recv(op.peer, slot);
          }
        },
        peers_);
    // On failure `buffer` goes here, unregistering the caller's memory
    // before the engine completes the op.
    if (!posted.ok()) return posted;
    return std::unique_ptr<OpEngine::Transfer>(
        new GlooTransfer(op.is_send, std::move(buffer), peers_));
  }

 private:
  const std::shared_ptr<gloo::Context> context_;
  const absl::Duration timeout_;
  const PeerNamer peers_;
};

// Gloo's TCP pairs write to peers with writev, which raises SIGPIPE once a
// peer has died, and SIGPIPE's default action kills the process: a rank
// would die with its peer instead of failing the op with UNAVAILABLE.
// Python ignores SIGPIPE in every torch job; a C++ worker gets the same,
// unless it installed a handler of its own.
void IgnoreSigpipeUnlessHandled() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current = {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 &&
        current.sa_handler == SIG_DFL) {
      signal(SIGPIPE, SIG_IGN);
    }
  });
}

// This machine: its host name and the kernel's boot id (so that a
// container's reused host name on another boot is another host), unless
// `configured` or $COHORT_HOST_ID says otherwise.
std::string HostId(const std::string& configured) {
  if (!configured.empty()) return configured;
  if (const char* env = std::getenv("COHORT_HOST_ID"); env && *env) {
    return env;
  }
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return absl::StrCat(name, "/", boot);
}

absl::Status Annotated(absl::string_view where, absl::string_view what,
                       const absl::Status& status) {
  return absl::Status(status.code(),
                      absl::StrCat(where, what, status.message()));
}

// Every rank's host id, by rank: publishes this rank's `host` under
// host/RANK in `store` (the group's prefix) and waits for the others'.
absl::StatusOr<std::vector<std::string>> ExchangeHosts(
    Store& store, int rank, int size, const std::string& host,
    absl::Duration timeout, absl::string_view where) {
  absl::Status published = store.Set(absl::StrCat("host/", rank), host);
  if (!published.ok()) {
    return Annotated(where, "publishing its host: ", published);
  }
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(absl::StrCat("host/", r));
  absl::StatusOr<std::vector<std::string>> hosts =
      store.MultiGet(keys, timeout);
  if (!hosts.ok()) {
    return Annotated(where, "waiting for every rank's host (keys host/RANK): ",
                     hosts.status());
  }
  return hosts;
}

// The shared-memory group of the ranks `local` (this host's, in order, with
// `rank` among them), or null when the whole group is on this host and the
// segment could not be set up there: every rank learns that alike, and all
// stay on TCP.
absl::StatusOr<std::unique_ptr<ShmGroup>> ShareMemory(
    Store& store, int rank, const std::vector<int>& local, bool whole_group,
    const GlooOptions& options, const std::string& host,
    absl::string_view where) {
  ShmGroupOptions shm;
  shm.timeout = options.group.timeout;
  shm.slot_bytes = options.shm.slot_bytes;
  shm.group_ranks = local;
  const int local_rank = static_cast<int>(
      std::find(local.begin(), local.end(), rank) - local.begin());
  absl::StatusOr<std::unique_ptr<ShmGroup>> group =
      ShmGroup::Create(store, absl::StrCat("shm/", local[0]), local_rank,
                       static_cast<int>(local.size()), shm);
  if (!group.ok() && whole_group && ShmGroup::IsSetupFailure(group.status())) {
    if (rank == 0) {
      std::fprintf(stderr,
                   "cohort: gloo process group '%s': no shared memory, "
                   "using loopback TCP: %s\n",
                   options.store_prefix.c_str(),
                   std::string(group.status().message()).c_str());
    }
    return std::unique_ptr<ShmGroup>();
  }
  if (!group.ok()) {
    return Annotated(
        where,
        absl::StrCat("shared memory with ranks ", absl::StrJoin(local, ", "),
                     " of host '", host, "': "),
        group.status());
  }
  return group;
}

// Leader `leader` of `leaders` (each host's first rank) connects to the
// others under "leaders" in `store` (the group's prefix).
absl::StatusOr<std::shared_ptr<gloo::Context>> ConnectLeaders(
    const std::shared_ptr<Store>& store, int leader, int leaders,
    const GlooOptions& options, std::shared_ptr<gloo::transport::Device> device,
    absl::string_view where) {
  GlooStore leader_store(std::make_shared<PrefixStore>("leaders", store),
                         options.group.timeout);
  try {
    auto context = std::make_shared<gloo::rendezvous::Context>(leader, leaders);
    context->setTimeout(ToMillis(options.group.timeout));
    context->connectFullMesh(leader_store, device);
    return std::shared_ptr<gloo::Context>(std::move(context));
  } catch (const std::exception& e) {
    absl::Status error = leader_store.TakeError();
    return Annotated(where, "connecting to the other hosts' leaders: ",
                     error.ok() ? absl::UnavailableError(e.what()) : error);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<GlooProcessGroup>> GlooProcessGroup::Create(
    std::shared_ptr<Store> store, int rank, int size,
    const GlooOptions& options) {
  IgnoreSigpipeUnlessHandled();
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gloo process group: rank ", rank, " is not in [0, ", size, ")"));
  }
  if (options.group.timeout <= absl::ZeroDuration() ||
      options.group.threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gloo process group: timeout (",
        absl::FormatDuration(options.group.timeout), ") and threads (",
        options.group.threads, ") must be positive"));
  }
  if (store == nullptr) {
    return absl::InvalidArgumentError("gloo process group: no store");
  }
  auto group_store = std::make_shared<PrefixStore>(options.store_prefix, store);
  GlooStore gloo_store(group_store, options.group.timeout);
  gloo::transport::tcp::attr attr;
  if (!options.interface.empty()) {
    attr.iface = options.interface;
  } else {
    attr.hostname = options.bind_address;
  }
  std::shared_ptr<gloo::rendezvous::Context> context;
  std::shared_ptr<gloo::transport::Device> device;
  try {
    device = gloo::transport::tcp::CreateDevice(attr);
    context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(ToMillis(options.group.timeout));
    context->connectFullMesh(gloo_store, device);
  } catch (const std::exception& e) {
    // Prefer the store's own status: it has the precise code and names the
    // missing keys, where gloo's exception only repeats it as text.
    absl::Status error = gloo_store.TakeError();
    const std::string where = absl::StrCat(
        "gloo process group '", options.store_prefix, "': rank ", rank, " of ",
        size, " could not connect to its peers (whose keys are their ranks): ");
    if (!error.ok()) {
      return absl::Status(error.code(), absl::StrCat(where, error.message()));
    }
    return absl::UnavailableError(absl::StrCat(where, e.what()));
  }
  absl::StatusOr<Locality> locality =
      FindLocality(group_store, rank, size, options, device);
  if (!locality.ok()) return locality.status();
  return std::unique_ptr<GlooProcessGroup>(
      new GlooProcessGroup(std::move(store), rank, size, options,
                           std::move(context), std::move(*locality)));
}

absl::StatusOr<GlooProcessGroup::Locality> GlooProcessGroup::FindLocality(
    const std::shared_ptr<Store>& store, int rank, int size,
    const GlooOptions& options,
    std::shared_ptr<gloo::transport::Device> device) {
  Locality locality;
  if (!options.shm.enabled || size == 1) return locality;
  const std::string where =
      absl::StrCat("gloo process group '", options.store_prefix, "': rank ",
                   rank, " of ", size, ": ");
  const std::string host = HostId(options.shm.host_id);
  absl::StatusOr<std::vector<std::string>> hosts =
      ExchangeHosts(*store, rank, size, host, options.group.timeout, where);
  if (!hosts.ok()) return hosts.status();
  std::vector<int> local;    // The ranks on this host, in order.
  std::vector<int> leaders;  // Each host's first rank, in order.
  for (int r = 0; r < size; ++r) {
    if ((*hosts)[r] == host) local.push_back(r);
    if (std::find(hosts->begin(), hosts->begin() + r, (*hosts)[r]) ==
        hosts->begin() + r) {
      leaders.push_back(r);
    }
  }
  locality.hosts = *hosts;
  locality.leader_ranks = leaders;
  locality.whole_group = local.size() == static_cast<size_t>(size);
  locality.hierarchical =
      !locality.whole_group && leaders.size() < static_cast<size_t>(size);
  if (local.size() > 1) {
    absl::StatusOr<std::unique_ptr<ShmGroup>> shm = ShareMemory(
        *store, rank, local, locality.whole_group, options, host, where);
    if (!shm.ok()) return shm.status();
    // Null: no shared memory on this host; every rank stays on TCP.
    if (*shm == nullptr) return locality;
    locality.shm = std::move(*shm);
  }
  const auto leader = std::find(leaders.begin(), leaders.end(), rank);
  if (locality.hierarchical && leader != leaders.end()) {
    absl::StatusOr<std::shared_ptr<gloo::Context>> context = ConnectLeaders(
        store, static_cast<int>(leader - leaders.begin()),
        static_cast<int>(leaders.size()), options, std::move(device), where);
    if (!context.ok()) return context.status();
    locality.leaders = std::move(*context);
  }
  return locality;
}

GlooProcessGroup::GlooProcessGroup(std::shared_ptr<Store> store, int rank,
                                   int size, const GlooOptions& options,
                                   std::shared_ptr<gloo::Context> context,
                                   Locality locality)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      options_(options),
      context_(std::move(context)),
      transport_(new GlooTransport(
          context_, options_.group.timeout,
          [this](const std::vector<int>& ranks) { return Peers(ranks); })),
      locality_(std::move(locality)),
      engine_(rank, size, EngineOptions(options_.group, locality_),
              transport_.get()) {}

absl::StatusOr<std::unique_ptr<GlooProcessGroup>> GlooProcessGroup::CreateChild(
    absl::string_view suffix, int rank, int size) {
  GlooOptions options = options_;
  options.store_prefix = absl::StrCat(options_.store_prefix, "/", suffix);
  return Create(store_, rank, size, options);
}

absl::StatusOr<std::unique_ptr<GlooProcessGroup>> GlooProcessGroup::NewGroup(
    absl::Span<const int> ranks) {
  std::vector<int> sorted(ranks.begin(), ranks.end());
  std::sort(sorted.begin(), sorted.end());
  const bool distinct =
      std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
  if (sorted.empty() || !distinct || sorted.front() < 0 ||
      sorted.back() >= size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("NewGroup: ranks {", absl::StrJoin(ranks, ", "),
                     "} must be distinct ranks of a group of ", size_));
  }
  auto me = std::find(sorted.begin(), sorted.end(), rank_);
  if (me == sorted.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NewGroup: rank ", rank_, " is not one of {",
        absl::StrJoin(sorted, ", "), "}; only members create a group"));
  }
  int incarnation;
  {
    absl::MutexLock lock(&mu_);
    incarnation = new_groups_[sorted]++;
  }
  return CreateChild(
      absl::StrCat("group_", absl::StrJoin(sorted, "_"), "/", incarnation),
      static_cast<int>(me - sorted.begin()), static_cast<int>(sorted.size()));
}

absl::StatusOr<std::unique_ptr<GlooProcessGroup>> GlooProcessGroup::Split(
    int color, int key) {
  int split;
  {
    absl::MutexLock lock(&mu_);
    split = splits_++;
  }
  // Every rank learns every (color, key) through this group itself.
  std::vector<int64_t> mine = {color, key};
  std::vector<int64_t> all(2 * static_cast<size_t>(size_));
  absl::Status gathered = AllGather(BufferView::Of(mine.data(), 2),
                                    BufferView::Of(all.data(), all.size()))
                              ->Wait();
  if (!gathered.ok()) return gathered;
  if (color < 0) return std::unique_ptr<GlooProcessGroup>();
  std::vector<std::pair<int64_t, int>> members;  // (key, rank)
  for (int r = 0; r < size_; ++r) {
    const size_t at = 2 * static_cast<size_t>(r);
    if (all[at] == color) members.emplace_back(all[at + 1], r);
  }
  std::sort(members.begin(), members.end());
  const int new_rank =
      static_cast<int>(std::find(members.begin(), members.end(),
                                 std::pair<int64_t, int>(key, rank_)) -
                       members.begin());
  return CreateChild(absl::StrCat("split_", split, "/color_", color), new_rank,
                     static_cast<int>(members.size()));
}

std::string GlooProcessGroup::Peers(const std::vector<int>& ranks,
                                    bool leaders) const {
  const std::vector<std::string>& hosts = locality_.hosts;
  if (ranks.empty()) {
    // Gloo did not say which peers: where this rank and the others are.
    if (hosts.empty() || locality_.whole_group) return "";
    std::vector<std::string> others;
    for (int leader : locality_.leader_ranks) {
      if (hosts[leader] == hosts[rank_]) continue;
      std::vector<int> theirs;
      for (int r = 0; r < size_; ++r) {
        if (hosts[r] == hosts[leader]) theirs.push_back(r);
      }
      others.push_back(absl::StrCat("host '", hosts[leader], "' (ranks ",
                                    absl::StrJoin(theirs, ", "), ")"));
    }
    return absl::StrCat("this rank is on host '", hosts[rank_],
                        "'; the others on ", absl::StrJoin(others, ", "));
  }
  std::vector<int> global;
  for (int r : ranks) global.push_back(leaders ? locality_.leader_ranks[r] : r);
  if (hosts.empty())
    return absl::StrCat("rank(s) ", absl::StrJoin(global, ", "));
  // By host, in the order the hosts first appear.
  std::vector<std::pair<std::string, std::vector<int>>> by_host;
  for (int r : global) {
    auto it = std::find_if(by_host.begin(), by_host.end(),
                           [&](const auto& h) { return h.first == hosts[r]; });
    if (it == by_host.end()) {
      by_host.push_back({hosts[r], {}});
      it = by_host.end() - 1;
    }
    it->second.push_back(r);
  }
  std::vector<std::string> parts;
  for (const auto& [host, rs] : by_host) {
    parts.push_back(absl::StrCat("host '", host, "' (rank",
                                 rs.size() > 1 ? "s " : " ",
                                 absl::StrJoin(rs, ", "), ")"));
  }
  return absl::StrJoin(parts, ", ");
}

absl::Status GlooProcessGroup::Call(const std::function<void()>& fn,
                                    bool leaders) const {
  return GlooCall(options_.group.timeout, fn,
                  [this, leaders](const std::vector<int>& ranks) {
                    return Peers(ranks, leaders);
                  });
}

std::chrono::milliseconds GlooProcessGroup::timeout() const {
  return ToMillis(options_.group.timeout);
}

OpEngineOptions GlooProcessGroup::EngineOptions(
    const ProcessGroupOptions& group, const Locality& locality) {
  OpEngineOptions options;
  options.group = group;
  options.name = "gloo process group";
  // Shared-memory ops run one at a time, in issue order on every rank.
  if (locality.shm != nullptr || locality.hierarchical) {
    options.group.threads = 1;
  }
  // A rank whose op fails outside shared memory (the check exchange with
  // the other hosts, the leaders' part) tells this host's other ranks at
  // once, with its status, which names the hosts that did not answer: they
  // may be waiting for it there. INVALID_ARGUMENT leaves the group usable.
  if (locality.shm != nullptr && locality.hierarchical) {
    ShmGroup* shm = locality.shm.get();
    options.group.on_op_failure =
        [shm, next = std::move(options.group.on_op_failure)](
            const absl::Status& status) {
          if (status.code() != absl::StatusCode::kInvalidArgument) {
            shm->Fail(status);
          }
          if (next) next(status);
        };
  }
  return options;
}

absl::Status GlooProcessGroup::HierarchicalAllReduce(const CollectiveOp& op,
                                                     uint32_t tag) {
  const BufferView& b = op.output;
  if (locality_.shm != nullptr) {
    absl::Status local = locality_.shm->ReduceToLeader(b, op.reduce, "");
    if (!local.ok()) return local;
  }
  absl::Status across;
  if (locality_.leaders != nullptr) {
    gloo::Context& leaders = *locality_.leaders;
    across = Call(
        [&] {
          if (b.bytes() * (leaders.size - 1) <= kDirectMaxWireBytes) {
            DirectAllReduce(leaders, b.data, b.count, b.dtype, op.reduce, tag,
                            timeout());
          } else {
            RingAllReduce(leaders, b.data, b.count, b.dtype, op.reduce, tag,
                          timeout());
          }
        },
        /*leaders=*/true);
  }
  if (locality_.shm == nullptr) return across;
  return locality_.shm->BroadcastFromLeader(b, across);
}

absl::Status GlooProcessGroup::HierarchicalBroadcast(const CollectiveOp& op,
                                                     uint32_t tag) {
  const BufferView& b = op.output;
  const std::vector<std::string>& hosts = locality_.hosts;
  const std::string& root_host = hosts[op.root];
  const bool on_root_host = hosts[rank_] == root_host;
  if (on_root_host && locality_.shm != nullptr) {
    // The root's local rank: its place among this host's ranks.
    const int local_root = static_cast<int>(
        std::count(hosts.begin(), hosts.begin() + op.root, root_host));
    absl::Status local =
        locality_.shm->Run(CollectiveOp::Broadcast(b, local_root), "");
    if (!local.ok()) return local;
  }
  absl::Status across;
  if (locality_.leaders != nullptr) {
    const std::vector<int>& leaders = locality_.leader_ranks;
    const int leader_root = static_cast<int>(
        std::find_if(leaders.begin(), leaders.end(),
                     [&](int r) { return hosts[r] == root_host; }) -
        leaders.begin());
    across = Call(
        [&] {
          gloo::BroadcastOptions opts(locality_.leaders);
          opts.setOutput(Bytes(b), b.bytes());
          opts.setRoot(leader_root);
          SetTagAndTimeout(opts, tag);
          gloo::broadcast(opts);
        },
        /*leaders=*/true);
  }
  if (on_root_host || locality_.shm == nullptr) return across;
  return locality_.shm->BroadcastFromLeader(b, across);
}

std::shared_ptr<Work> GlooProcessGroup::SubmitChecked(CollectiveOp op,
                                                      CheckedBody body) {
  if ((locality_.whole_group && locality_.shm != nullptr) ||
      (locality_.hierarchical && op.kind == OpKind::kAllReduce)) {
    return Submit(std::move(op), Body());  // Shared memory takes it.
  }
  return engine_.Submit(
      std::move(op),
      [this, body = std::move(body)](const CollectiveOp& op,
                                     const OpEngine::OpRun& run) {
        return Call([&] { body(op, run); });
      },
      /*checks_itself=*/true);
}

std::shared_ptr<Work> GlooProcessGroup::Submit(CollectiveOp op, Body body) {
  if (locality_.whole_group && locality_.shm != nullptr) {
    return engine_.Submit(
        std::move(op),
        [this](const CollectiveOp& op, const OpEngine::OpRun& run) {
          return locality_.shm->Run(op, run.check);
        },
        /*checks_itself=*/true);
  }
  if (locality_.hierarchical && op.kind == OpKind::kAllReduce) {
    return engine_.Submit(std::move(op), [this](const CollectiveOp& op,
                                                const OpEngine::OpRun& run) {
      return HierarchicalAllReduce(op, run.tag);
    });
  }
  if (locality_.hierarchical && op.kind == OpKind::kBroadcast) {
    return engine_.Submit(std::move(op), [this](const CollectiveOp& op,
                                                const OpEngine::OpRun& run) {
      return HierarchicalBroadcast(op, run.tag);
    });
  }
  return engine_.Submit(
      std::move(op), [this, body = std::move(body)](
                         const CollectiveOp& op, const OpEngine::OpRun& run) {
        return Call([&] { body(op, run.tag); });
      });
}

std::shared_ptr<Work> GlooProcessGroup::Broadcast(BufferView buffer, int root) {
  return Submit(CollectiveOp::Broadcast(buffer, root),
                [this](const CollectiveOp& op, uint32_t tag) {
                  gloo::BroadcastOptions opts(context_);
                  opts.setOutput(Bytes(op.output), op.output.bytes());
                  opts.setRoot(op.root);
                  SetTagAndTimeout(opts, tag);
                  gloo::broadcast(opts);
                });
}

std::shared_ptr<Work> GlooProcessGroup::AllReduce(BufferView buffer,
                                                  ReduceOp op) {
  // Small buffers go direct, with the op's check beside the data.
  if (buffer.bytes() * (size_ - 1) <= kDirectMaxWireBytes) {
    return SubmitChecked(
        CollectiveOp::AllReduce(buffer, op),
        [this](const CollectiveOp& op, const OpEngine::OpRun& run) {
          const BufferView& b = op.output;
          DirectAllReduce(*context_, b.data, b.count, b.dtype, op.reduce,
                          run.tag, timeout(), run.check);
        });
  }
  return Submit(CollectiveOp::AllReduce(buffer, op),
                [this](const CollectiveOp& op, uint32_t tag) {
                  const BufferView& b = op.output;
                  RingAllReduce(*context_, b.data, b.count, b.dtype, op.reduce,
                                tag, timeout());
                });
}

std::shared_ptr<Work> GlooProcessGroup::Reduce(BufferView buffer, int root,
                                               ReduceOp op) {
  // gloo's reduce uses the buffer as scratch on every rank: the engine
  // hands it a copy.
  return Submit(
      CollectiveOp::Reduce(buffer, root, op),
      [this](const CollectiveOp& op, uint32_t tag) {
        const Dtype dtype = op.output.dtype;
        const ReduceOp reduce = op.reduce;
        gloo::ReduceOptions opts(context_);
        WithElementOfSize(DtypeSize(dtype), [&](auto element) {
          using T = decltype(element);
          opts.setOutput(static_cast<T*>(op.output.data), op.output.count);
        });
        opts.setRoot(op.root);
        opts.setReduceFunction(
            [dtype, reduce](void* out, const void* a, const void* b, size_t n) {
              Combine(dtype, reduce, out, a, b, n);
            });
        SetTagAndTimeout(opts, tag);
        gloo::reduce(opts);
      });
}

std::shared_ptr<Work> GlooProcessGroup::AllGather(BufferView input,
                                                  BufferView output) {
  if (input.bytes() * (size_ - 1) <= kDirectMaxWireBytes) {
    return SubmitChecked(
        CollectiveOp::AllGather(input, output),
        [this](const CollectiveOp& op, const OpEngine::OpRun& run) {
          DirectAllGather(*context_, op.input.data, op.input.bytes(),
                          op.output.data, run.tag, timeout(), run.check);
        });
  }
  return Submit(CollectiveOp::AllGather(input, output),
                [this](const CollectiveOp& op, uint32_t tag) {
                  const size_t bytes = op.input.bytes();
                  gloo::AllgatherOptions opts(context_);
                  opts.setInput(Bytes(op.input), bytes);
                  opts.setOutput(Bytes(op.output), op.output.bytes());
                  SetTagAndTimeout(opts, tag);
                  gloo::allgather(opts);
                });
}

std::shared_ptr<Work> GlooProcessGroup::AllGatherV(
    BufferView input, BufferView output, absl::Span<const size_t> counts) {
  return Submit(CollectiveOp::AllGatherV(input, output, counts),
                [this](const CollectiveOp& op, uint32_t tag) {
                  gloo::AllgathervOptions opts(context_);
                  opts.setInput(Bytes(op.input), op.input.bytes());
                  opts.setOutput(Bytes(op.output),
                                 ToBytes<size_t>(op.counts, op.input.dtype));
                  SetTagAndTimeout(opts, tag);
                  gloo::allgatherv(opts);
                });
}

std::shared_ptr<Work> GlooProcessGroup::Gather(BufferView input,
                                               BufferView output, int root) {
  return Submit(CollectiveOp::Gather(input, output, root),
                [this](const CollectiveOp& op, uint32_t tag) {
                  gloo::GatherOptions opts(context_);
                  opts.setInput(Bytes(op.input), op.input.bytes());
                  if (rank_ == op.root) {
                    opts.setOutput(Bytes(op.output), op.output.bytes());
                  }
                  opts.setRoot(op.root);
                  SetTagAndTimeout(opts, tag);
                  gloo::gather(opts);
                });
}

std::shared_ptr<Work> GlooProcessGroup::Scatter(BufferView input,
                                                BufferView output, int root) {
  return Submit(CollectiveOp::Scatter(input, output, root),
                [this](const CollectiveOp& op, uint32_t tag) {
                  const size_t block = op.output.bytes();
                  gloo::ScatterOptions opts(context_);
                  if (rank_ == op.root) {
                    std::vector<uint8_t*> blocks(size_);
                    for (int r = 0; r < size_; ++r) {
                      blocks[r] = Bytes(op.input) + r * block;
                    }
                    opts.setInputs(blocks, block);
                  }
                  opts.setOutput(Bytes(op.output), block);
                  opts.setRoot(op.root);
                  SetTagAndTimeout(opts, tag);
                  gloo::scatter(opts);
                });
}

std::shared_ptr<Work> GlooProcessGroup::AllToAll(BufferView input,
                                                 BufferView output) {
  return Submit(CollectiveOp::AllToAll(input, output),
                [this](const CollectiveOp& op, uint32_t tag) {
                  gloo::AlltoallOptions opts(context_);
                  opts.setInput(Bytes(op.input), op.input.bytes());
                  opts.setOutput(Bytes(op.output), op.output.bytes());
                  SetTagAndTimeout(opts, tag);
                  gloo::alltoall(opts);
                });
}

std::shared_ptr<Work> GlooProcessGroup::AllToAllV(
    BufferView input, absl::Span<const size_t> send_counts, BufferView output,
    absl::Span<const size_t> recv_counts) {
  return Submit(
      CollectiveOp::AllToAllV(input, send_counts, output, recv_counts),
      [this](const CollectiveOp& op, uint32_t tag) {
        gloo::AlltoallvOptions opts(context_);
        opts.setInput(Bytes(op.input),
                      ToBytes<int64_t>(op.counts, op.input.dtype));
        opts.setOutput(Bytes(op.output),
                       ToBytes<int64_t>(op.recv_counts, op.output.dtype));
        SetTagAndTimeout(opts, tag);
        gloo::alltoallv(opts);
      });
}

std::shared_ptr<Work> GlooProcessGroup::ReduceScatter(BufferView input,
                                                      BufferView output,
                                                      ReduceOp op) {
  // The ring only reads the input, so it runs on the caller's.
  return Submit(CollectiveOp::ReduceScatter(input, output, op),
                [this](const CollectiveOp& op, uint32_t tag) {
                  RingReduceScatter(*context_, op.input.data, op.output.data,
                                    op.output.count, op.output.dtype, op.reduce,
                                    tag, timeout());
                });
}

std::shared_ptr<Work> GlooProcessGroup::Barrier() {
  return Submit(CollectiveOp::Barrier(),
                [this](const CollectiveOp&, uint32_t tag) {
                  gloo::BarrierOptions opts(context_);
                  SetTagAndTimeout(opts, tag);
                  gloo::barrier(opts);
                });
}

std::shared_ptr<Work> GlooProcessGroup::Send(BufferView buffer, int dst_rank,
                                             uint32_t tag) {
  return engine_.Post(PointToPointOp{/*is_send=*/true, buffer, dst_rank, tag});
}

std::shared_ptr<Work> GlooProcessGroup::Recv(BufferView buffer, int src_rank,
                                             uint32_t tag) {
  return engine_.Post(PointToPointOp{/*is_send=*/false, buffer, src_rank, tag});
}

}  // namespace cohort
