// ParticipantList: the participants of one completed rendezvous round,
// serialized once and never changed, so that every node reading the list
// (ListParticipants, GetParticipants) is answered with pieces of the same
// bytes instead of a copy each.
#ifndef COHORT_SERVER_COORDINATION_PARTICIPANT_LIST_H_
#define COHORT_SERVER_COORDINATION_PARTICIPANT_LIST_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "cohort/v1/coordination.pb.h"

namespace cohort::server {

class ParticipantList {
 public:
  // Serializes `participants` (in node-rank order) as they appear in
  // ListParticipantsResponse and GetParticipantsResponse: each a field 1
  // entry (tag, length, message).
  ParticipantList(
      int64_t round,
      const google::protobuf::RepeatedPtrField<v1::Participant>& participants);

  ParticipantList(const ParticipantList&) = delete;
  ParticipantList& operator=(const ParticipantList&) = delete;

  int64_t round() const { return round_; }
  int num_nodes() const { return static_cast<int>(offsets_.size()) - 1; }

  // The field 1 entries of node ranks [begin, end), contiguous in the
  // shared serialization. REQUIRES: 0 <= begin <= end <= num_nodes().
  absl::string_view Entries(int begin, int end) const {
    return absl::string_view(bytes_).substr(offsets_[begin],
                                            offsets_[end] - offsets_[begin]);
  }

  // The end of the longest run of ranks from `begin` that has at most
  // `max_count` participants and `max_bytes` bytes of entries, but at
  // least one participant. REQUIRES: 0 <= begin < num_nodes(),
  // max_count >= 1. O(log num_nodes).
  int PageEnd(int begin, int max_count, size_t max_bytes) const;

  // Bytes of the whole serialization, for monitoring.
  size_t bytes() const { return bytes_.size(); }

 private:
  const int64_t round_;
  std::string bytes_;
  // offsets_[r]: where rank r's entry begins; offsets_[num_nodes()] is
  // bytes_.size().
  std::vector<size_t> offsets_;
};

// A reply of ListParticipants or GetParticipants as its serialized bytes:
// `pieces` of a shared ParticipantList (which `list` keeps alive), then
// `tail`, the reply's other fields. Protobuf parses concatenated fields as
// one message, so the bytes in that order are the reply.
struct ParticipantsReply {
  std::shared_ptr<const ParticipantList> list;
  std::vector<absl::string_view> pieces;  // Into *list.
  std::string tail;

  size_t size() const;
  // The bytes as one string: a copy, for tests and in-process callers.
  std::string Flatten() const;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_COORDINATION_PARTICIPANT_LIST_H_
