// FakeEtcd: an in-process etcd for tests of the etcd engine and leadership.
//
// Each member is a gRPC server on a loopback port speaking etcd's v3 API
// (etcdserverpb), and every member serves one shared in-memory MVCC store,
// as a healthy etcd cluster would: so a client that loses its member and
// goes on with the next one sees the same revisions. Code under test talks
// to it through its real gRPC stubs; nothing in it knows it is a fake.
//
// What it implements, with etcd 3.4's semantics and error codes:
// - KV: Range (single key, range, prefix; limit/more/count, keys_only,
//   count_only, at a past revision), Put (with a lease), DeleteRange, Txn
//   (compares on VERSION, CREATE, MOD, VALUE, LEASE of one key; put,
//   delete and range requests; one revision per transaction; a key put
//   twice in one branch is INVALID_ARGUMENT, as etcd refuses it).
// - Watch: streams of watches created with a key range and start_revision
//   (history replayed from it), events grouped by revision in revision
//   order, `created` and `canceled` answers, cancellation on compacted
//   revisions (compact_revision set), cancel and progress requests.
// - Lease: LeaseGrant, LeaseRevoke (deletes the lease's keys in one
//   revision), LeaseKeepAlive (TTL 0 for a lease that is gone).
//
// Not implemented (UNIMPLEMENTED): Compact over gRPC (use Compact below),
// nested transactions, range compares, the Cluster, Maintenance and Auth
// services.
//
// Leases expire only when the test advances the fake's clock
// (AdvanceClock): a test decides when etcd lets a lease go, and asserts
// what follows, never how long it took.
#ifndef COHORT_SERVER_HA_FAKE_ETCD_H_
#define COHORT_SERVER_HA_FAKE_ETCD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "etcd/etcdserver/etcdserverpb/rpc.pb.h"
#include "etcd/mvcc/mvccpb/kv.pb.h"

namespace cohort::server {

class FakeEtcd {
 public:
  // Starts `members` members (at least 1) on loopback ports chosen by the
  // kernel. The store starts empty at revision 1, as etcd's does.
  static absl::StatusOr<std::unique_ptr<FakeEtcd>> Start(int members = 1);
  // Stops every member.
  ~FakeEtcd();

  FakeEtcd(const FakeEtcd&) = delete;
  FakeEtcd& operator=(const FakeEtcd&) = delete;

  int members() const;
  // "127.0.0.1:PORT" of `member`; the port stays the member's across
  // Stop and Restart.
  std::string endpoint(int member) const;
  std::vector<std::string> endpoints() const;

  // Stops `member` as a killed etcd process would: its streams end, its
  // connections close, and new calls to it fail with UNAVAILABLE. The
  // store is kept (the other members serve it). Returns once the member's
  // handlers have all returned. Idempotent.
  void Stop(int member);
  // Cuts `member` off from the cluster's quorum, as a partition would: its
  // server stays up, but every call to it fails at once with UNAVAILABLE
  // ("etcdserver: no leader", etcd's answer then) and its open streams
  // end. Restart brings it back.
  void Isolate(int member);
  // Serves `member` again (stopped or isolated), on its port.
  absl::Status Restart(int member);

  // The store, straight (as another writer, etcdctl say, would change it).
  // Each write is one revision; returns the store's revision after it.
  // Put with a lease that does not exist fails with NOT_FOUND.
  absl::StatusOr<int64_t> Put(absl::string_view key, absl::string_view value,
                              int64_t lease = 0);
  // Deletes `key` if present (a new revision only then).
  int64_t Delete(absl::string_view key);
  std::optional<mvccpb::KeyValue> Get(absl::string_view key) const;
  int64_t revision() const;
  // Forgets history before `revision` (as etcd's compaction does): ranges
  // at older revisions fail, and watches from them are cancelled.
  void Compact(int64_t revision);

  int64_t GrantLease(int64_t ttl_seconds);
  // Revokes `lease`, deleting its keys; false if it does not exist.
  bool RevokeLease(int64_t lease);
  // Whether `lease` exists (granted, neither revoked nor expired).
  bool HasLease(int64_t lease) const;
  // Moves the fake's clock on by `d`: every lease not kept alive within
  // its TTL by then expires, its keys deleted in one revision each.
  void AdvanceClock(absl::Duration d);

  // Calls `member` has received of `method` ("Range", "Put",
  // "DeleteRange", "Txn", "Watch" (streams opened), "LeaseGrant",
  // "LeaseRevoke", "LeaseKeepAlive" (streams opened)), Restart included.
  int64_t calls(int member, absl::string_view method) const;

  // Called before each Range is served, without the store's lock, with the
  // member serving it and the request: a test can write in the middle of a
  // paged load. Null removes it.
  using RangeHook =
      std::function<void(int member, const etcdserverpb::RangeRequest&)>;
  void SetRangeHook(RangeHook hook);

 private:
  class State;
  class Member;
  FakeEtcd();

  std::unique_ptr<State> state_;
  std::vector<std::unique_ptr<Member>> members_;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_HA_FAKE_ETCD_H_
