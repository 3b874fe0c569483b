// MembershipClient: group membership with a background heartbeat, member
// events, barriers and error reports on cohortd. See
// proto/cohort/v1/coordination.proto (service Membership) for the rules.
#ifndef COHORT_CLIENT_MEMBERSHIP_CLIENT_H_
#define COHORT_CLIENT_MEMBERSHIP_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/connection.h"

namespace cohort {

struct MemberOptions {
  std::string group;
  std::string name;
  int rank = -1;     // For error messages ("rank 2 (host-b)").
  std::string host;  // Likewise.
  absl::Duration heartbeat_interval = absl::Seconds(5);
  int missed_heartbeats = 3;  // Declared failed after this many intervals.
};

struct Member {
  std::string name;
  int64_t incarnation = 0;
  int rank = -1;
  std::string host;
  // ListMembers only: how long ago cohortd last heard from the member.
  absl::Duration heartbeat_age = absl::ZeroDuration();
};

struct MemberEvent {
  enum class Type { kJoined, kLeft, kFailed, kErrorReported };
  Type type = Type::kJoined;
  Member member;
  std::string message;  // Why it failed, or the error it reported.
  int64_t revision = 0;
};

using MemberEventCallback = std::function<void(const MemberEvent&)>;

// One live membership: joined on creation, heartbeating on a thread of its
// own, left on destruction.
class GroupMember {
 public:
  virtual ~GroupMember() = default;

  virtual int64_t incarnation() const = 0;

  // OK while the lease holds; after cohortd declared this member failed (or
  // heartbeats could not reach it for a whole timeout) the reason why.
  virtual absl::Status health() const = 0;

  // Blocks until every participant (empty: all live members) reaches
  // `barrier_id`. ABORTED naming who if one fails or reports an error;
  // DEADLINE_EXCEEDED naming who is missing.
  virtual absl::Status Barrier(
      const std::string& barrier_id, absl::Duration timeout,
      const std::vector<std::string>& participants = {}) = 0;

  // Tells every member (and pending barriers) that this one hit `message`.
  virtual absl::Status ReportError(const std::string& message) = 0;

  // Leaves the group now (destruction does it too).
  virtual absl::Status Leave() = 0;
};

// A running member watch; destroying it cancels the watch.
class MemberWatch {
 public:
  virtual ~MemberWatch() = default;
  // Stops delivery; the callback is not called after Cancel returns.
  virtual void Cancel() = 0;
  // Blocks until the watch ends: OK after Cancel, else why it ended (e.g.
  // cohortd unreachable for connect_timeout).
  virtual absl::Status Wait() = 0;
};

class MembershipClient {
 public:
  static absl::StatusOr<std::unique_ptr<MembershipClient>> Connect(
      const ConnectionOptions& connection);
  virtual ~MembershipClient() = default;

  virtual absl::StatusOr<std::unique_ptr<GroupMember>> JoinGroup(
      const MemberOptions& options) = 0;

  virtual absl::StatusOr<std::vector<Member>> ListMembers(
      const std::string& group) = 0;

  // Calls `callback` for each event of `group` from now on, on a thread of
  // the watch's own. Returns once the watch is registered.
  virtual absl::StatusOr<std::unique_ptr<MemberWatch>> Watch(
      const std::string& group, MemberEventCallback callback) = 0;
};

// Reports `message` for the member (group, name, incarnation) that another
// process holds, exactly as that member's GroupMember::ReportError: the
// way a worker tells its node's peers of a failure through the membership
// its cohortrun agent holds (COHORT_MEMBER_* in the worker's environment),
// without waiting for the worker to exit. NOT_FOUND if that incarnation is
// no longer a member.
absl::Status ReportMemberError(const ConnectionOptions& connection,
                               const std::string& group,
                               const std::string& name, int64_t incarnation,
                               const std::string& message);

}  // namespace cohort

#endif  // COHORT_CLIENT_MEMBERSHIP_CLIENT_H_
