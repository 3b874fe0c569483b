// InitProcessGroup: how a worker joins its job's process group, as
// torch.distributed.init_process_group does.
//
//   // Under cohortrun (it sets RANK, WORLD_SIZE, COHORT_ADDR, ...):
//   auto pg = cohort::InitProcessGroup("gloo", "env://");
//   // Anywhere else:
//   auto pg = cohort::InitProcessGroup("gloo", "cohort://cohortd:29500/job42",
//                                      rank, world_size);
//   auto pg = cohort::InitProcessGroup("gloo", "file:///shared/job42", rank,
//                                      world_size);
//   // A PyTorch TCPStore server (e.g. torchrun's, on MASTER_PORT):
//   auto pg = cohort::InitProcessGroup("gloo", "tcpstore://10.0.0.1:29500",
//                                      rank, world_size);
//
// The backend is created by the factory (backend_factory.h), with
// InitOptions: options.group for every backend, options.gloo and
// options.nccl for each backend's own.
#ifndef COHORT_WORKER_COLLECTIVE_INIT_INIT_H_
#define COHORT_WORKER_COLLECTIVE_INIT_INIT_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/collective/init/backend_factory.h"
#include "worker/collective/process_group.h"

namespace cohort {

// Under cohortrun (COHORT_ADDR and COHORT_MEMBER_GROUP, _NAME and
// _INCARNATION in the environment): a reporter that tells cohortd, as this
// node's member, "rank R: <the error>" (ReportMemberError), so that every
// node's agent learns of the failure at once and stops its workers, as it
// does when a worker dies. It reports at most once, and says on stderr
// when it could not. Null (nothing reported) elsewhere.
std::function<void(const absl::Status&)> NodeErrorReporterFromEnv(int rank);

// Creates this rank's process group of `backend` ("gloo", or "nccl": device
// buffers, nccl/nccl_process_group.h; FAILED_PRECONDITION "no CUDA device
// visible: ..." without a GPU) and connects it
// to the other ranks, bootstrapping through the store `init_method` names:
//   env://                  RANK and WORLD_SIZE (unless given), cohortd at
//                           COHORT_ADDR or else MASTER_ADDR:MASTER_PORT, keys
//                           under COHORT_STORE_PREFIX if set (cohortrun sets
//                           all of these, with a prefix unique to the round)
//   cohort://HOST:PORT[/P]  cohortd at HOST:PORT, keys under P (default
//   tcp://HOST:PORT[/P]     "cohort"); rank and world_size are required
//   tcpstore://HOST:PORT[/P][?dialect=D]
//                           a PyTorch TCPStore server (any release), or
//                           cohortd's --tcpstore_listen port, through
//                           TcpStoreClient with key_prefix "/" (so torch
//                           clients see the keys as "P/..."); keys under P
//                           (default "cohort"). D: probe (the default:
//                           1.13 if the server answers a 1.13 query, else
//                           2.1; cohortd answers as 1.13), 1.13 or 2.1
//   file:///PATH            a FileStore at PATH: no coordinator at all; the
//                           file is removed once every rank is done with it
// Ranks of one job call it with the same init_method; a job that creates
// its group again (after a failure) gets fresh keys (the backend's
// store_prefix in `options` is replaced by them). A null
// options.nccl.error_reporter is NodeErrorReporterFromEnv(rank). The group
// is CreateProcessGroup's over that store. Under cohortrun (COHORT_ADDR
// and COHORT_RUN_ID set) the group is registered with the process's
// FlightDumper (flight_dumper.h): its recent ops go to cohortd when an op
// fails, on SIGUSR1, and when `cohortctl dump` asks. Blocks until every rank
// has arrived or options.group.timeout passes (DEADLINE_EXCEEDED naming the
// missing ranks' keys). INVALID_ARGUMENT, naming what is wrong, for an
// unknown backend or scheme, a missing variable, or a bad rank or size.
absl::StatusOr<std::unique_ptr<ProcessGroup>> InitProcessGroup(
    absl::string_view backend, absl::string_view init_method, int rank = -1,
    int world_size = -1, const InitOptions& options = {});

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_INIT_INIT_H_
