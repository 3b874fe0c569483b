#include "server/coordination/participant_list.h"

#include <algorithm>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace cohort::server {
namespace {

// Field 1 (participants), length-delimited.
constexpr uint32_t kEntryTag = (1 << 3) | 2;

}  // namespace

ParticipantList::ParticipantList(
    int64_t round,
    const google::protobuf::RepeatedPtrField<v1::Participant>& participants)
    : round_(round) {
  offsets_.reserve(participants.size() + 1);
  {
    google::protobuf::io::StringOutputStream stream(&bytes_);
    google::protobuf::io::CodedOutputStream out(&stream);
    for (const v1::Participant& p : participants) {
      offsets_.push_back(out.ByteCount());
      out.WriteTag(kEntryTag);
      out.WriteVarint32(static_cast<uint32_t>(p.ByteSizeLong()));
      p.SerializeWithCachedSizes(&out);
    }
    offsets_.push_back(out.ByteCount());
  }  // The stream trims bytes_ to what was written.
}

int ParticipantList::PageEnd(int begin, int max_count, size_t max_bytes) const {
  const int last = std::min(num_nodes(), begin + max_count);
  // The first rank past `begin` whose entry would end beyond max_bytes.
  auto first = offsets_.begin() + begin + 1;
  auto over = std::upper_bound(first, offsets_.begin() + last + 1,
                               offsets_[begin] + max_bytes);
  return std::max(begin + 1, static_cast<int>(over - offsets_.begin()) - 1);
}

size_t ParticipantsReply::size() const {
  size_t n = tail.size();
  for (absl::string_view piece : pieces) n += piece.size();
  return n;
}

std::string ParticipantsReply::Flatten() const {
  std::string bytes;
  bytes.reserve(size());
  for (absl::string_view piece : pieces)
    bytes.append(piece.data(), piece.size());
  bytes.append(tail);
  return bytes;
}

}  // namespace cohort::server
