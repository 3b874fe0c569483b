#include "server/coordination/participant_list.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace cohort::server {
namespace {

google::protobuf::RepeatedPtrField<v1::Participant> Nodes(int n) {
  google::protobuf::RepeatedPtrField<v1::Participant> nodes;
  for (int i = 0; i < n; ++i) {
    v1::Participant* p = nodes.Add();
    p->set_node_id(absl::StrCat("node-", i));
    // Addresses of different lengths, so entries differ in size.
    p->set_address(std::string(1 + i % 7, 'a'));
    p->set_local_world_size(8);
    p->set_node_rank(i);
    p->set_first_global_rank(8 * i);
  }
  return nodes;
}

// Any range of entries, with the list's other fields, parses as the reply.
TEST(ParticipantListTest, AnyRangeOfEntriesParsesAsThoseParticipants) {
  const auto nodes = Nodes(40);
  ParticipantList list(3, nodes);
  EXPECT_EQ(list.round(), 3);
  EXPECT_EQ(list.num_nodes(), 40);
  for (auto [begin, end] : {std::pair{0, 40}, {0, 1}, {39, 40}, {7, 23}}) {
    v1::ListParticipantsResponse reply;
    ASSERT_TRUE(reply.ParseFromString(std::string(list.Entries(begin, end))));
    ASSERT_EQ(reply.participants_size(), end - begin);
    for (int i = begin; i < end; ++i) {
      EXPECT_EQ(reply.participants(i - begin).SerializeAsString(),
                nodes[i].SerializeAsString());
    }
  }
  EXPECT_TRUE(list.Entries(5, 5).empty());
  EXPECT_EQ(list.Entries(0, 40).size(), list.bytes());
}

TEST(ParticipantListTest, PageEndKeepsToCountAndBytesButTakesOne) {
  ParticipantList list(0, Nodes(40));
  EXPECT_EQ(list.PageEnd(0, 10, 1 << 20), 10);
  EXPECT_EQ(list.PageEnd(35, 10, 1 << 20), 40);
  // A byte budget of exactly entries [4, 9): five participants.
  const size_t five = list.Entries(4, 9).size();
  EXPECT_EQ(list.PageEnd(4, 100, five), 9);
  EXPECT_EQ(list.PageEnd(4, 100, five - 1), 8);
  // Too few bytes for even one: one anyway.
  EXPECT_EQ(list.PageEnd(4, 100, 1), 5);
}

TEST(ParticipantListTest, ReplyIsItsPiecesThenItsTail) {
  auto list = std::make_shared<const ParticipantList>(2, Nodes(10));
  ParticipantsReply reply;
  reply.list = list;
  reply.pieces = {list->Entries(8, 10), list->Entries(0, 1)};
  v1::GetParticipantsResponse tail;
  tail.set_round(2);
  tail.set_num_nodes(10);
  reply.tail = tail.SerializeAsString();
  v1::GetParticipantsResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(reply.Flatten()));
  EXPECT_EQ(reply.size(), reply.Flatten().size());
  EXPECT_EQ(parsed.round(), 2);
  EXPECT_EQ(parsed.num_nodes(), 10);
  ASSERT_EQ(parsed.participants_size(), 3);
  EXPECT_EQ(parsed.participants(0).node_rank(), 8);
  EXPECT_EQ(parsed.participants(1).node_rank(), 9);
  EXPECT_EQ(parsed.participants(2).node_rank(), 0);
}

}  // namespace
}  // namespace cohort::server
