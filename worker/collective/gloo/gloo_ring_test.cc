// gloo_ring's algorithms on their own: the ranks are threads of this
// process, each with its own gloo context over loopback, meeting through
// gloo's in-memory HashStore (no cohortd, no op engine).
#include "worker/collective/gloo/gloo_ring.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/hash_store.h"
#include "gloo/transport/tcp/device.h"
#include "gtest/gtest.h"
#include "worker/collective/reduce.h"

namespace cohort {
namespace {

constexpr std::chrono::milliseconds kTimeout(20000);
constexpr uint32_t kTag = 7;

// Blocks of more than this many i32 elements take more than one of the
// ring's 2 MiB segments (an all-reduce's blocks are count / world).
constexpr size_t kManySegments = (size_t{2} << 20) / sizeof(int32_t) + 3;

using RankMain = std::function<void(gloo::Context& context)>;

// Runs `main` on `world` connected ranks, one thread each. A rank that
// throws fails the test.
void RunRanks(int world, const RankMain& main) {
  gloo::rendezvous::HashStore store;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        gloo::transport::tcp::attr attr;
        attr.hostname = "127.0.0.1";
        std::shared_ptr<gloo::transport::Device> device =
            gloo::transport::tcp::CreateDevice(attr);
        auto context = std::make_shared<gloo::rendezvous::Context>(rank, world);
        context->setTimeout(kTimeout);
        context->connectFullMesh(store, device);
        main(*context);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << rank << " threw: " << e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

// Rank r's element i: small enough that sums and products of four ranks
// stay exact in f32.
int32_t Value(int rank, size_t i) {
  return static_cast<int32_t>((i * 7 + rank * 3) % 11) - 5;
}

std::vector<int32_t> Values(int rank, size_t count) {
  std::vector<int32_t> values(count);
  for (size_t i = 0; i < count; ++i) values[i] = Value(rank, i);
  return values;
}

// Element i of every rank's values combined with `op` in rank order.
int32_t Reference(int world, ReduceOp op, size_t i) {
  int32_t result = Value(0, i);
  for (int r = 1; r < world; ++r) {
    const int32_t theirs = Value(r, i);
    Combine(Dtype::kI32, op, &result, &result, &theirs, 1);
  }
  return result;
}

struct Shape {
  int world;
  size_t count;
};

class RingTest : public ::testing::TestWithParam<Shape> {};

TEST(MakeSlotTest, PrefixTagAndStepHaveBitsOfTheirOwn) {
  EXPECT_EQ(MakeSlot(0xc1, 0, 0), uint64_t{0xc1} << 56);
  EXPECT_EQ(MakeSlot(0xc1, 0xffffffff, 0),
            (uint64_t{0xc1} << 56) | (uint64_t{0xffffffff} << 24));
  EXPECT_EQ(MakeSlot(0, 0, 0x1234567), 0x234567u) << "steps keep 24 bits";
  EXPECT_NE(MakeSlot(kRingAllReduceSlotPrefix, 1, 0),
            MakeSlot(kDirectAllReduceSlotPrefix, 1, 0));
}

// `count` elements per rank; the blocks of a world that does not divide it
// are uneven, and some are empty when it is below the world size.
TEST_P(RingTest, AllReducesMatchTheReferenceOnEveryRank) {
  const Shape shape = GetParam();
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kProd}) {
    RunRanks(shape.world, [&](gloo::Context& context) {
      std::vector<int32_t> ring = Values(context.rank, shape.count);
      std::vector<int32_t> direct = ring;
      RingAllReduce(context, ring.data(), ring.size(), Dtype::kI32, op, kTag,
                    kTimeout);
      DirectAllReduce(context, direct.data(), direct.size(), Dtype::kI32, op,
                      kTag + 2, kTimeout);
      for (size_t i = 0; i < shape.count; ++i) {
        const int32_t want = Reference(shape.world, op, i);
        if (ring[i] != want || direct[i] != want) {
          ADD_FAILURE() << ReduceOpName(op) << " element " << i << " on rank "
                        << context.rank << ": ring " << ring[i] << ", direct "
                        << direct[i] << ", want " << want;
          return;
        }
      }
    });
  }
}

TEST_P(RingTest, ReduceScatterLeavesEachRankItsBlock) {
  const Shape shape = GetParam();
  const size_t block = shape.count;
  RunRanks(shape.world, [&](gloo::Context& context) {
    const std::vector<int32_t> input =
        Values(context.rank, block * shape.world);
    const std::vector<int32_t> before = input;
    std::vector<int32_t> output(block);
    // kAvg combines as kSum: the caller divides.
    RingReduceScatter(context, input.data(), output.data(), block, Dtype::kI32,
                      ReduceOp::kAvg, kTag, kTimeout);
    EXPECT_EQ(input, before) << "the input is only read";
    for (size_t i = 0; i < block; ++i) {
      const int32_t want =
          Reference(shape.world, ReduceOp::kSum, context.rank * block + i);
      if (output[i] != want) {
        ADD_FAILURE() << "element " << i << " on rank " << context.rank << ": "
                      << output[i] << ", want " << want;
        return;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Shapes, RingTest,
                         ::testing::Values(Shape{1, 5}, Shape{2, 1},
                                           Shape{2, 1000}, Shape{3, 2},
                                           Shape{3, 1001}, Shape{4, 3},
                                           Shape{2, 2 * kManySegments + 1},
                                           Shape{3, 3 * kManySegments}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return "World" + std::to_string(info.param.world) +
                                  "Count" + std::to_string(info.param.count);
                         });

TEST(RingTest, FloatAllReducesAreBitIdenticalOnEveryRank) {
  constexpr int kWorld = 3;
  constexpr size_t kCount = 100003;
  std::vector<std::vector<float>> results(kWorld);
  RunRanks(kWorld, [&](gloo::Context& context) {
    std::mt19937 random(context.rank);
    std::uniform_real_distribution<float> uniform(-1, 1);
    std::vector<float> data(kCount);
    for (float& x : data) x = uniform(random);
    RingAllReduce(context, data.data(), kCount, Dtype::kF32, ReduceOp::kSum,
                  kTag, kTimeout);
    results[context.rank] = std::move(data);
  });
  for (int r = 1; r < kWorld; ++r) {
    ASSERT_EQ(results[r].size(), kCount);
    EXPECT_EQ(std::memcmp(results[r].data(), results[0].data(),
                          kCount * sizeof(float)),
              0)
        << "rank " << r << " differs from rank 0";
  }
}

TEST(RingTest, DirectAllGatherMayReadFromItsOwnSlot) {
  constexpr int kWorld = 3;
  RunRanks(kWorld, [&](gloo::Context& context) {
    std::vector<int64_t> all(2 * kWorld, -1);
    all[2 * context.rank] = context.rank;
    all[2 * context.rank + 1] = 10 * context.rank;
    DirectAllGather(context, &all[2 * context.rank], 2 * sizeof(int64_t),
                    all.data(), kTag, kTimeout);
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(all[2 * r], r);
      EXPECT_EQ(all[2 * r + 1], 10 * r);
    }
  });
}

TEST(RingTest, APeerThatNeverTakesPartTimesOut) {
  absl::Notification done;
  RunRanks(2, [&](gloo::Context& context) {
    if (context.rank == 1) {
      done.WaitForNotification();
      return;
    }
    int32_t value = 1;
    EXPECT_THROW(RingAllReduce(context, &value, 1, Dtype::kI32, ReduceOp::kSum,
                               kTag, std::chrono::milliseconds(200)),
                 gloo::IoException);
    done.Notify();
  });
}

}  // namespace
}  // namespace cohort
