// cohortd's TLS: the certificate files it serves with, checked at start and
// on every reload, and the gRPC credentials that re-read them when they
// change (gRPC's FileWatcherCertificateProvider), so a renewed certificate
// is taken up without dropping a connection.
#ifndef COHORT_SERVER_RPC_TLS_H_
#define COHORT_SERVER_RPC_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/security/server_credentials.h"

namespace cohort::server {

struct TlsOptions {
  // PEM files: the server's certificate chain and its private key. Both
  // empty: no TLS.
  std::string cert_file;
  std::string key_file;
  // PEM CA bundle; set, clients must present a certificate it signed
  // (mTLS), and connections without one are refused in the handshake.
  std::string client_ca_file;
  // How often the files are checked for changes.
  absl::Duration reload_interval = absl::Seconds(1);

  bool enabled() const { return !cert_file.empty() || !key_file.empty(); }
};

// What CheckTlsFiles found, for the log.
struct TlsFilesInfo {
  std::string subject;
  absl::Time not_after;
  int client_cas = 0;
};

// Reads and checks the files: both of cert and key given, readable, PEM;
// the key matches the certificate; the certificate is valid now; the CA
// bundle (if any) holds at least one certificate. FAILED_PRECONDITION or
// INVALID_ARGUMENT naming the file and what is wrong.
absl::StatusOr<TlsFilesInfo> CheckTlsFiles(const TlsOptions& options);

// The gRPC credentials serving `options` (call CheckTlsFiles first).
std::shared_ptr<grpc::ServerCredentials> TlsServerCredentials(
    const TlsOptions& options);

}  // namespace cohort::server

#endif  // COHORT_SERVER_RPC_TLS_H_
