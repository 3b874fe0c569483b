#include "base/connection_budget.h"

#include "gtest/gtest.h"

namespace cohort::base {
namespace {

TEST(ConnectionBudgetTest, TakesUpToTheBoundAndGivesBack) {
  ConnectionBudget budget(2);
  EXPECT_TRUE(budget.TryTake());
  EXPECT_TRUE(budget.TryTake());
  EXPECT_FALSE(budget.TryTake());
  EXPECT_EQ(budget.in_use(), 2u);
  budget.Give();
  EXPECT_EQ(budget.in_use(), 1u);
  EXPECT_TRUE(budget.TryTake());
}

TEST(ConnectionBudgetTest, AFullBudgetAsksTheReclaimerOnce) {
  ConnectionBudget budget(1);
  int asked = 0;
  budget.SetReclaimer([&] {
    ++asked;
    budget.Give();  // One connection turned out to be closed.
  });
  ASSERT_TRUE(budget.TryTake());
  EXPECT_TRUE(budget.TryTake());  // Reclaimed, then taken.
  EXPECT_EQ(asked, 1);
}

TEST(ConnectionBudgetTest, NoReclaimerAfterItIsCleared) {
  ConnectionBudget budget(1);
  int asked = 0;
  budget.SetReclaimer([&] { ++asked; });
  budget.SetReclaimer(nullptr);
  ASSERT_TRUE(budget.TryTake());
  EXPECT_FALSE(budget.TryTake());
  EXPECT_EQ(asked, 0);
}

}  // namespace
}  // namespace cohort::base
