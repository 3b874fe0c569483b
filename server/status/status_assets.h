// The status page's files (server/status/assets/), built into cohortd by
// the genrule //server/status:status_assets_cc: the page fetches nothing
// from anywhere but cohortd.
#ifndef COHORT_SERVER_STATUS_STATUS_ASSETS_H_
#define COHORT_SERVER_STATUS_STATUS_ASSETS_H_

#include <vector>

#include "absl/strings/string_view.h"

namespace cohort::server {

struct StatusAsset {
  absl::string_view name;  // Its file name under assets/ ("status.js").
  absl::string_view data;
};

// Every file under assets/, in the order the BUILD lists them.
const std::vector<StatusAsset>& StatusAssets();

}  // namespace cohort::server

#endif  // COHORT_SERVER_STATUS_STATUS_ASSETS_H_
