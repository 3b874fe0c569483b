#include "worker/launch/torch_store.h"

#include "absl/strings/str_cat.h"
#include "base/text.h"
#include "client/tcpstore_check.h"
#include "worker/launch/launcher.h"

namespace cohort {
namespace {

// What to change when the check fails, by where the address came from.
std::string Remedy(const TorchStoreLocation& where) {
  if (where.overridden) {
    return "fix --tcpstore (or $COHORT_TCPSTORE), or leave it out: cohortrun "
           "then asks cohortd where its TCPStore listener is";
  }
  return "if cohortd's listener is reached at another address from this "
         "node (a Service, a NAT), start cohortd with "
         "--tcpstore_advertise=HOST:PORT, or give cohortrun --tcpstore";
}

}  // namespace

absl::StatusOr<TorchStoreLocation> LocateTorchStore(
    const std::string& flag, const std::string& env,
    const std::string& coordinator,
    const absl::StatusOr<v1::ServerInfo>& info) {
  if (!info.ok() && !absl::IsUnimplemented(info.status())) {
    return absl::Status(info.status().code(),
                        absl::StrCat("asking cohortd at ", coordinator,
                                     " where its TCPStore listener is: ",
                                     info.status().message()));
  }
  TorchStoreLocation where;
  if (info.ok()) where.listener_prefix = info->tcpstore().prefix();
  if (!flag.empty() || !env.empty()) {
    where.address = !flag.empty() ? flag : env;
    where.source = !flag.empty() ? "--tcpstore" : "$COHORT_TCPSTORE";
    where.overridden = true;
    return where;
  }
  const std::string at = absl::StrCat("cohortd at ", coordinator);
  if (!info.ok()) {
    where.address =
        DefaultTcpStore(coordinator.substr(0, coordinator.find(',')));
    where.source = absl::StrCat("the default, the coordinator's host and port ",
                                kDefaultTcpStorePort, " (", at,
                                " is too old to say where its listener is)");
    return where;
  }
  if (!info->has_tcpstore()) {
    where.source = absl::StrCat(
        at,
        ", which serves no TCPStore listener (started with an empty "
        "--tcpstore_listen, or with --auth_tokens and none given)");
    return where;
  }
  const v1::TcpStoreListener& listener = info->tcpstore();
  where.address = listener.address();
  const std::string bound = base::Escape(listener.bound(), 300);
  switch (listener.source()) {
    case v1::TcpStoreListener::ADVERTISED:
      where.source = absl::StrCat(at,
                                  ", which advertises it (its "
                                  "--tcpstore_advertise; bound to ",
                                  bound, ")");
      break;
    case v1::TcpStoreListener::CALLER_HOST:
      where.source = absl::StrCat(
          at,
          ": its listener's port on the host cohortrun dialed (it is "
          "bound to ",
          bound, ")");
      break;
    case v1::TcpStoreListener::HOSTNAME:
      where.source = absl::StrCat(
          at, ": its listener's port on its hostname (it is bound to ", bound,
          ")");
      break;
    default:
      where.source =
          absl::StrCat(at, ", where its listener is bound (--tcpstore_listen)");
      break;
  }
  return where;
}

absl::StatusOr<std::string> CheckTorchStore(
    Store& grpc_store, const TorchStoreLocation& where,
    const TorchStoreCheckOptions& options) {
  absl::StatusOr<TcpStoreCheckResult> checked = CheckTcpStoreListener(
      grpc_store,
      {.address = where.address,
       .name_space = absl::StrCat("/cohortrun/", options.run_id, "/"),
       .token = options.token,
       .listener_prefix = where.listener_prefix,
       .timeout = options.timeout});
  const std::string named = absl::StrCat("the TCPStore listener at ",
                                         base::Escape(where.address, 300),
                                         " (from ", where.source, ")");
  if (!checked.ok()) {
    return absl::Status(
        checked.status().code(),
        absl::StrCat(named, " failed cohortrun's start-up check: ",
                     checked.status().message(),
                     ". The workers' torch stores (MASTER_ADDR:MASTER_PORT) "
                     "would fail there (torch: \"Connection reset by "
                     "peer\"): ",
                     Remedy(where)));
  }
  if (!checked->same_store) {
    return absl::StrCat("workers' torch stores go to ", named,
                        "; it answers, but ", checked->unverified);
  }
  return absl::StrCat("workers' torch stores go to ", named,
                      "; checked: it serves this cohortd's keys");
}

}  // namespace cohort
