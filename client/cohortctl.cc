// cohortctl: the command line for a cohortd's key-value store.
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/notification.h"
#include "base/signals.h"
#include "client/auth_client.h"
#include "client/checkpoint_catalog.h"
#include "client/flight_report.h"
#include "client/info_client.h"
#include "client/membership_client.h"
#include "client/remote_store.h"
#include "client/rendezvous_client.h"
#include "client/trace_command.h"
#include "proto/auth/roles.h"

ABSL_FLAG(std::string, addr, "",
          "cohortd HOST:PORT; default $COHORT_ADDR, else localhost:29500");
ABSL_FLAG(double, timeout, 300,
          "seconds that get and wait block for missing keys");
ABSL_FLAG(double, connect_timeout, 5,
          "seconds to wait for a connection to cohortd");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA that signed cohortd's certificate: connect with TLS; "
          "default $COHORT_TLS_CA");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM client certificate, for a cohortd with --tls_client_ca; "
          "default $COHORT_TLS_CERT");
ABSL_FLAG(std::string, tls_key, "",
          "PEM key of --tls_cert; default $COHORT_TLS_KEY");
ABSL_FLAG(std::string, token_file, "",
          "file whose first line is the token to call with; default "
          "$COHORT_TOKEN, else the file $COHORT_TOKEN_FILE names");
ABSL_FLAG(int64_t, from_revision, 0,
          "watch: deliver the changes from this revision on (those cohortd "
          "still holds) before the new ones; 0: only new ones");
ABSL_FLAG(absl::Duration, ttl, absl::ZeroDuration(),
          "token issue: the token's lifetime (e.g. 24h); 0: cohortd's "
          "--max_token_ttl (30 days by default)");
ABSL_FLAG(double, answer_timeout, 10,
          "dump, diagnose: seconds to wait for every rank's flight dump");
ABSL_FLAG(int64_t, round, -1,
          "diagnose: the round to diagnose; -1: the newest with dumps");
ABSL_FLAG(bool, request_dump, true,
          "diagnose: ask the run's ranks for fresh dumps first (false: "
          "diagnose the dumps already stored, e.g. after the job ended)");
ABSL_FLAG(std::string, description, "",
          "token issue: who the token is for, shown by token list");

namespace {

constexpr char kUsage[] = R"(cohortctl [--addr=HOST:PORT] COMMAND [ARGS...]

Commands:
  set KEY VALUE             write VALUE under KEY
  get KEY [--timeout=S]     print KEY's value, waiting for it to exist
  add KEY DELTA             add DELTA to the counter at KEY; print the sum
  cas KEY EXPECTED DESIRED  compare-and-set; print the value returned
  delete KEY                delete KEY; print true if it existed
  wait KEY... [--timeout=S] block until every KEY exists
  check KEY...              print true if every KEY exists, else false
  list [PREFIX]             print the keys under PREFIX, one a line
  num-keys                  print the number of keys
  watch [PREFIX] [--from_revision=R]
                            print changes under PREFIX until interrupted
  participants RUN [START END]
                            print the nodes of RUN's last completed round
                            (node ranks START to END-1; default all), one a
                            line: NODE_RANK NODE_ID ADDRESS LOCAL_WORLD_SIZE
                            FIRST_GLOBAL_RANK
  checkpoints RUN           print RUN's committed checkpoints, oldest first,
                            one a line: STEP WORLD_SIZE BYTES CREATED PATH,
                            "latest" after the one a resume loads
  dump RUN [--answer_timeout=S]
                            ask every rank of RUN to publish its process
                            groups' recent ops (flight records) to cohortd;
                            print who answered and who did not
  diagnose RUN [--request_dump=false] [--round=R]
                            dump (unless false), then say why RUN's newest
                            round is stuck or slow: the rank a collective
                            waits for, mismatched ops or arguments, failed
                            ops, dead ranks and stragglers
  info                      print what cohortd is, a NAME VALUE a line:
                            version, engine, server_id, and its TCPStore
                            listener: tcpstore HOST:PORT to dial (or
                            "tcpstore off"), tcpstore_source (advertised,
                            bound, caller_host or hostname), tcpstore_bound,
                            tcpstore_prefix (when set) and
                            tcpstore_token_required

Timelines (local files, no cohortd; docs/debugging.md):
  trace merge DIR|FILE... -o OUT
                            merge the per-rank files COHORT_TRACE=DIR makes
                            (DIR/trace-rank*.json, or merged files) into one
                            Chrome-trace / Perfetto JSON file, a process
                            "rank R" per rank
  trace summary DIR|FILE... print per step (the mean over ranks) compute,
                            communication, exposed communication and
                            overlap; per rank; per op algbw and busbw

With auth (cohortd --auth_tokens):
  whoami                    print the token's role, prefix and source
  token issue ROLE PREFIX [--ttl=24h] [--description=TEXT]
                            mint a token (ROLE r, rw or admin) within the
                            caller's own prefix; prints it (shown once) on
                            stdout, its id on stderr
  token revoke ID           revoke an issued token at once
  token list                print issued tokens: ID ROLE PREFIX EXPIRES
                            ISSUED_BY DESCRIPTION

Credentials: --token_file or $COHORT_TOKEN; TLS: --tls_ca (and --tls_cert,
--tls_key for mutual TLS) or $COHORT_TLS_CA, $COHORT_TLS_CERT, $COHORT_TLS_KEY.

Values go to stdout as they are (with a newline when stdout is a terminal).
Errors go to stderr; the exit status is 1 for a failed call, 2 for misuse.)";

int Usage(const std::string& problem) {
  std::fprintf(stderr, "cohortctl: %s\n\n%s\n", problem.c_str(), kUsage);
  return 2;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "cohortctl: %s: %s\n",
               std::string(absl::StatusCodeToString(status.code())).c_str(),
               std::string(status.message()).c_str());
  return 1;
}

// Prints a stored value byte for byte.
void PrintValue(const std::string& value) {
  std::fwrite(value.data(), 1, value.size(), stdout);
  if (isatty(STDOUT_FILENO)) std::fputc('\n', stdout);
  std::fflush(stdout);
}

void PrintLine(const std::string& line) {
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

std::string Address() {
  std::string addr = absl::GetFlag(FLAGS_addr);
  if (addr.empty()) {
    const char* env = std::getenv("COHORT_ADDR");
    addr = env != nullptr && *env != '\0' ? env : cohort::kDefaultAddress;
  }
  return addr;
}

// Parses flags, keeping a negative number (`add KEY -5`) as the positional
// argument the user typed instead of reading it as a flag named "5".
std::vector<std::string> ParseArgs(int argc, char** argv) {
  constexpr char kNegative = '\x01';  // Marks a stand-in: no flag starts so.
  std::vector<std::string> negatives;
  std::vector<std::string> stand_ins;
  stand_ins.reserve(argc);  // Pointers into it must stay valid.
  std::vector<char*> args(argv, argv + argc);
  for (char*& arg : args) {
    int64_t number;
    if (arg[0] == '-' && absl::SimpleAtoi(arg, &number) && number < 0) {
      stand_ins.push_back(
          absl::StrCat(std::string(1, kNegative), negatives.size()));
      negatives.push_back(arg);
      arg = stand_ins.back().data();
    }
  }
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  std::vector<std::string> out;
  for (size_t i = 1; i < positional.size(); ++i) {
    size_t index;
    if (positional[i][0] == kNegative &&
        absl::SimpleAtoi(positional[i] + 1, &index) &&
        index < negatives.size()) {
      out.push_back(negatives[index]);
    } else {
      out.push_back(positional[i]);
    }
  }
  return out;
}

int RunWatch(cohort::Store& store, const std::string& prefix,
             const sigset_t& stop_signals) {
  auto watch = store.Watch(
      prefix, absl::GetFlag(FLAGS_from_revision),
      [](const cohort::WatchEvent& e) {
        PrintLine(absl::StrCat(
            e.revision, " ",
            e.type == cohort::WatchEvent::Type::kPut ? "PUT " : "DELETE ",
            e.key, e.type == cohort::WatchEvent::Type::kPut ? " " : "",
            e.value));
      });
  if (!watch.ok()) return Fail(watch.status());
  // Runs until a stop signal, or until the watch fails.
  absl::Notification ended;
  absl::Status status;
  std::thread waiter([&] {
    status = (*watch)->Wait();
    ended.Notify();
  });
  const timespec poll = {0, 100 * 1000 * 1000};
  while (!ended.HasBeenNotified()) {
    if (sigtimedwait(&stop_signals, nullptr, &poll) > 0) break;
  }
  (*watch)->Cancel();
  waiter.join();
  return status.ok() ? 0 : Fail(status);
}

}  // namespace

std::string FormatMs(int64_t ms) {
  if (ms == 0) return "never";
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixMillis(ms),
                          absl::UTCTimeZone());
}

int AuthCommand(const std::string& command,
                const std::vector<std::string>& args,
                const cohort::ConnectionOptions& options) {
  auto client = cohort::AuthClient::Connect(options);
  if (!client.ok()) return Fail(client.status());
  if (command == "whoami") {
    if (!args.empty()) return Usage("whoami takes no arguments");
    auto me = (*client)->WhoAmI();
    if (!me.ok()) return Fail(me.status());
    PrintLine(absl::StrCat("role ", cohort::auth::RoleName(me->role()),
                           " prefix ", me->prefix(), " source ", me->source(),
                           " expires ", FormatMs(me->expires_unix_ms())));
    return 0;
  }
  const std::string verb = args.empty() ? "" : args[0];
  if (verb == "issue" && args.size() == 3) {
    auto issued = (*client)->Issue(args[1], args[2], absl::GetFlag(FLAGS_ttl),
                                   absl::GetFlag(FLAGS_description));
    if (!issued.ok()) return Fail(issued.status());
    PrintLine(issued->token());
    std::fprintf(stderr, "cohortctl: issued token id %s, expires %s\n",
                 issued->id().c_str(),
                 FormatMs(issued->expires_unix_ms()).c_str());
    return 0;
  }
  if (verb == "revoke" && args.size() == 2) {
    absl::Status revoked = (*client)->Revoke(args[1]);
    return revoked.ok() ? 0 : Fail(revoked);
  }
  if (verb == "list" && args.size() == 1) {
    auto listed = (*client)->List();
    if (!listed.ok()) return Fail(listed.status());
    for (const cohort::v1::TokenInfo& t : listed->tokens()) {
      PrintLine(absl::StrCat(t.id(), " ", cohort::auth::RoleName(t.role()), " ",
                             t.prefix(), " ", FormatMs(t.expires_unix_ms()),
                             " ",
                             absl::StrReplaceAll(t.issued_by(), {{" ", "_"}}),
                             " ", t.description()));
    }
    return 0;
  }
  return Usage("token takes: issue ROLE PREFIX | revoke ID | list");
}

int InfoCommand(const std::vector<std::string>& args,
                const cohort::ConnectionOptions& options) {
  if (!args.empty()) return Usage("info takes no arguments");
  auto client = cohort::InfoClient::Connect(options);
  if (!client.ok()) return Fail(client.status());
  absl::StatusOr<cohort::v1::ServerInfo> info = (*client)->GetServerInfo();
  if (!info.ok()) return Fail(info.status());
  PrintLine(absl::StrCat("version ", info->version()));
  PrintLine(absl::StrCat("engine ", info->engine()));
  PrintLine(absl::StrCat("server_id ", info->server_id()));
  if (!info->has_tcpstore()) {
    PrintLine("tcpstore off");
    return 0;
  }
  const cohort::v1::TcpStoreListener& tcpstore = info->tcpstore();
  PrintLine(absl::StrCat("tcpstore ", tcpstore.address()));
  PrintLine(absl::StrCat(
      "tcpstore_source ",
      absl::AsciiStrToLower(
          cohort::v1::TcpStoreListener::Source_Name(tcpstore.source()))));
  PrintLine(absl::StrCat("tcpstore_bound ", tcpstore.bound()));
  if (!tcpstore.prefix().empty()) {
    PrintLine(absl::StrCat("tcpstore_prefix ", tcpstore.prefix()));
  }
  PrintLine(absl::StrCat("tcpstore_token_required ",
                         tcpstore.token_required() ? "true" : "false"));
  return 0;
}

int ParticipantsCommand(const std::vector<std::string>& args,
                        const cohort::ConnectionOptions& options) {
  int start = 0, end = 0;
  if ((args.size() != 1 && args.size() != 3) ||
      (args.size() == 3 && (!absl::SimpleAtoi(args[1], &start) ||
                            !absl::SimpleAtoi(args[2], &end)))) {
    return Usage("participants takes: RUN [START END] (node ranks)");
  }
  auto client = cohort::RendezvousClient::Connect(options);
  if (!client.ok()) return Fail(client.status());
  absl::StatusOr<cohort::RunStatus> status = (*client)->GetRunStatus(args[0]);
  if (!status.ok()) return Fail(status.status());
  if (args.size() == 1) end = status->num_participants;
  // A page at a time, all of one round: ABORTED if the run moves on. The
  // first call is made whatever the range, so that cohortd judges it: an
  // empty or reversed one is INVALID_ARGUMENT, not an empty listing.
  constexpr int kPage = 10000;
  int first = start;
  do {
    const int last = int64_t{end} - first > kPage ? first + kPage : end;
    auto peers = (*client)->GetPeers(args[0], status->round, {{first, last}});
    if (!peers.ok()) return Fail(peers.status());
    for (const cohort::RendezvousPeer& p : *peers) {
      PrintLine(absl::StrCat(p.node_rank, " ", p.node_id, " ", p.address, " ",
                             p.local_world_size, " ", p.first_global_rank));
    }
    first = last;
  } while (first < end);
  return 0;
}

// The connection options the flags give (--addr, TLS, --token_file).
absl::StatusOr<cohort::RemoteStoreOptions> OptionsFromFlags() {
  cohort::RemoteStoreOptions options;
  options.address = Address();
  options.connect_timeout = absl::Seconds(absl::GetFlag(FLAGS_connect_timeout));
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  if (const std::string file = absl::GetFlag(FLAGS_token_file); !file.empty()) {
    absl::StatusOr<std::string> token =
        cohort::ReadTokenFile(file, "--token_file");
    if (!token.ok()) return token.status();
    options.token = *std::move(token);
  }
  return options;
}

// `cohortctl checkpoints RUN`: the run's committed checkpoints, oldest
// first, the latest marked.
int PrintCheckpoints(cohort::RemoteStore& store, const std::string& run) {
  cohort::CheckpointCatalog catalog(&store, cohort::CheckpointPrefix(run));
  auto list = catalog.List();
  if (!list.ok()) return Fail(list.status());
  if (list->empty()) {
    std::fprintf(stderr, "cohortctl: run %s has no committed checkpoint\n",
                 run.c_str());
  }
  for (const cohort::v1::CheckpointRecord& r : *list) {
    const bool latest = &r == &list->back();
    PrintLine(
        absl::StrCat(r.step(), " ", r.world_size(), " ", r.bytes(), " ",
                     absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ",
                                      absl::FromUnixMillis(r.created_unix_ms()),
                                      absl::UTCTimeZone()),
                     " ", r.path(), latest ? " latest" : ""));
  }
  return 0;
}

// `cohortctl dump RUN` and `cohortctl diagnose RUN`.
int FlightCommand(const std::string& command, const std::string& run,
                  cohort::RemoteStore& store,
                  const cohort::ConnectionOptions& connection) {
  const double answer_s = absl::GetFlag(FLAGS_answer_timeout);
  if (!(answer_s > 0)) return Usage("--answer_timeout must be > 0 seconds");
  cohort::FlightReportOptions options;
  options.answer_timeout = absl::Seconds(answer_s);
  absl::StatusOr<std::string> report;
  if (command == "dump") {
    report = cohort::DumpReport(store, run, options);
  } else {
    options.request = absl::GetFlag(FLAGS_request_dump);
    options.round = absl::GetFlag(FLAGS_round);
    auto members = cohort::MembershipClient::Connect(connection);
    if (!members.ok()) return Fail(members.status());
    report = cohort::DiagnoseReport(store, members->get(), run, options);
  }
  if (!report.ok()) return Fail(report.status());
  std::fputs(report->c_str(), stdout);
  return 0;
}

// The store's commands: set, get, add, cas, delete, wait, check, list,
// num-keys and watch.
int StoreCommand(const std::string& command,
                 const std::vector<std::string>& args,
                 cohort::RemoteStore& store, absl::Duration timeout,
                 const sigset_t& stop_signals) {
  auto need = [&](size_t min, size_t max) {
    return args.size() >= min && args.size() <= max;
  };

  if (command == "set") {
    if (!need(2, 2)) return Usage("set takes KEY VALUE");
    absl::Status s = store.Set(args[0], args[1]);
    return s.ok() ? 0 : Fail(s);
  }
  if (command == "get") {
    if (!need(1, 1)) return Usage("get takes KEY");
    absl::StatusOr<std::string> v = store.Get(args[0], timeout);
    if (!v.ok()) return Fail(v.status());
    PrintValue(*v);
    return 0;
  }
  if (command == "add") {
    int64_t delta = 0;
    if (!need(2, 2) || !absl::SimpleAtoi(args[1], &delta)) {
      return Usage("add takes KEY DELTA, DELTA an integer");
    }
    absl::StatusOr<int64_t> v = store.Add(args[0], delta);
    if (!v.ok()) return Fail(v.status());
    PrintLine(absl::StrCat(*v));
    return 0;
  }
  if (command == "cas") {
    if (!need(3, 3)) return Usage("cas takes KEY EXPECTED DESIRED");
    absl::StatusOr<std::string> v = store.CompareSet(args[0], args[1], args[2]);
    if (!v.ok()) return Fail(v.status());
    PrintValue(*v);
    return 0;
  }
  if (command == "delete") {
    if (!need(1, 1)) return Usage("delete takes KEY");
    absl::StatusOr<bool> v = store.DeleteKey(args[0]);
    if (!v.ok()) return Fail(v.status());
    PrintLine(*v ? "true" : "false");
    return 0;
  }
  if (command == "wait") {
    if (args.empty()) return Usage("wait takes KEY...");
    absl::Status s = store.Wait(args, timeout);
    return s.ok() ? 0 : Fail(s);
  }
  if (command == "check") {
    if (args.empty()) return Usage("check takes KEY...");
    absl::StatusOr<bool> v = store.Check(args);
    if (!v.ok()) return Fail(v.status());
    PrintLine(*v ? "true" : "false");
    return 0;
  }
  if (command == "list") {
    if (!need(0, 1)) return Usage("list takes at most a PREFIX");
    absl::StatusOr<cohort::KeyList> v =
        store.ListKeys(args.empty() ? "" : args[0]);
    if (!v.ok()) return Fail(v.status());
    for (const std::string& k : v->keys) PrintLine(k);
    return 0;
  }
  if (command == "num-keys") {
    if (!need(0, 0)) return Usage("num-keys takes no arguments");
    absl::StatusOr<int64_t> v = store.NumKeys();
    if (!v.ok()) return Fail(v.status());
    PrintLine(absl::StrCat(*v));
    return 0;
  }
  if (command == "watch") {
    if (!need(0, 1)) return Usage("watch takes at most a PREFIX");
    return RunWatch(store, args.empty() ? "" : args[0], stop_signals);
  }
  return Usage(absl::StrCat("unknown command '", command, "'"));
}

int main(int argc, char** argv) {
  // Blocked before any thread (gRPC's included) starts, so `watch` can take
  // them with sigtimedwait.
  const sigset_t stop_signals = cohort::base::BlockStopSignals();
  absl::SetProgramUsageMessage(kUsage);
  std::vector<std::string> args = ParseArgs(argc, argv);
  if (args.empty()) return Usage("no command given");
  const std::string command = args[0];
  args.erase(args.begin());
  if (command == "trace") {
    pthread_sigmask(SIG_UNBLOCK, &stop_signals, nullptr);
    return cohort::TraceCommand(args);
  }

  absl::StatusOr<cohort::RemoteStoreOptions> options = OptionsFromFlags();
  if (!options.ok()) return Fail(options.status());
  if (command == "whoami" || command == "token") {
    pthread_sigmask(SIG_UNBLOCK, &stop_signals, nullptr);
    return AuthCommand(command, args, *options);
  }
  if (command == "info") {
    pthread_sigmask(SIG_UNBLOCK, &stop_signals, nullptr);
    return InfoCommand(args, *options);
  }
  if (command == "participants") {
    pthread_sigmask(SIG_UNBLOCK, &stop_signals, nullptr);
    return ParticipantsCommand(args, *options);
  }
  auto connected = cohort::RemoteStore::Connect(*options);
  if (!connected.ok()) return Fail(connected.status());
  const double timeout_s = absl::GetFlag(FLAGS_timeout);
  if (!(timeout_s > 0)) return Usage("--timeout must be > 0 seconds");
  if (command != "watch") {
    // Other commands die of SIGINT/SIGTERM as usual: the main thread takes
    // them (gRPC's threads keep them blocked).
    pthread_sigmask(SIG_UNBLOCK, &stop_signals, nullptr);
  }
  if (command == "checkpoints") {
    if (args.size() != 1) return Usage("checkpoints takes RUN");
    return PrintCheckpoints(**connected, args[0]);
  }
  if (command == "dump" || command == "diagnose") {
    if (args.size() != 1) return Usage(absl::StrCat(command, " takes RUN"));
    return FlightCommand(command, args[0], **connected, *options);
  }
  return StoreCommand(command, args, **connected, absl::Seconds(timeout_s),
                      stop_signals);
}
