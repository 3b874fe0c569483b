// InfoService: cohort.v1.Info (proto/cohort/v1/info.proto): what this
// cohortd is and where its TCPStore listener is, for any authenticated
// caller. The address rules are free functions, tested without a network.
#ifndef COHORT_SERVER_RPC_INFO_SERVICE_H_
#define COHORT_SERVER_RPC_INFO_SERVICE_H_

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "cohort/v1/info.grpc.pb.h"
#include "server/auth/auth.h"

namespace cohort::server {

// The release cohortd reports (ServerInfo.version); the deploy/ images
// carry the same tag.
inline constexpr char kCohortVersion[] = "0.1.0";

// OK when `address` is a HOST:PORT a client can dial: a name or IPv4
// address, or an IPv6 address in brackets, then a port from 1 to 65535.
// Otherwise INVALID_ARGUMENT naming `flag` and saying what is wrong (no
// port, port 0, a wildcard host, an IPv6 address without brackets, a
// character no host name has).
absl::Status CheckDialAddress(absl::string_view flag,
                              absl::string_view address);

struct TcpStoreDialAddress {
  std::string address;
  v1::TcpStoreListener::Source source = v1::TcpStoreListener::BOUND;
};

// Where a client should dial the TCPStore listener bound to `bound`
// (HOST:PORT with the actual port): `advertise` when it is not empty;
// else `bound`, unless its host is a wildcard: then the host of
// `authority` (the HOST:PORT the caller dialed cohortd's gRPC port with,
// the first one of a comma-separated list) with bound's port, or
// `hostname` with it when the authority names no usable host.
TcpStoreDialAddress DialTcpStoreAt(absl::string_view bound,
                                   absl::string_view advertise,
                                   absl::string_view authority,
                                   absl::string_view hostname);

// 32 random hex digits: a process's ServerInfo.server_id.
std::string NewServerId();

struct InfoServiceOptions {
  // --engine: "rocksdb", "memory" or "etcd"; may be empty.
  std::string engine;
  // Empty: NewServerId().
  std::string server_id;
  // The TCPStore listener's --tcpstore_advertise, --tcpstore_prefix and
  // whether it requires a token hello. Where it is bound comes later
  // (SetTcpStoreBound), once it listens.
  std::string tcpstore_advertise;
  std::string tcpstore_prefix;
  bool tcpstore_token_required = false;
  // Null: auth off, every caller is answered.
  Authenticator* auth = nullptr;
  // Empty: gethostname().
  std::string hostname;
};

class InfoService final : public v1::Info::CallbackService {
 public:
  explicit InfoService(InfoServiceOptions options);

  // Where the TCPStore listener is bound (HOST:PORT, the actual port);
  // until called, the listener is reported off. Thread-safe.
  void SetTcpStoreBound(std::string bound);

  // The answer to a caller that dialed `authority`.
  v1::ServerInfo Describe(absl::string_view authority) const;
  const std::string& server_id() const { return options_.server_id; }

  // UNAUTHENTICATED with auth on and no valid token (any role will do).
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const v1::GetServerInfoRequest* req,
                                          v1::ServerInfo* resp) override;

 private:
  const InfoServiceOptions options_;
  mutable absl::Mutex mu_;
  std::string tcpstore_bound_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_RPC_INFO_SERVICE_H_
