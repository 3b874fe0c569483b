// cohortctl: the command line for a cohortd's key-value store.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "base/signals.h"
#include "client/remote_store.h"

ABSL_FLAG(std::string, addr, "",
          "cohortd HOST:PORT; default $COHORT_ADDR, else localhost:29500");
ABSL_FLAG(double, timeout, 300,
          "seconds that get and wait block for missing keys");
ABSL_FLAG(double, connect_timeout, 5,
          "seconds to wait for a connection to cohortd");

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
  watch [PREFIX]            print changes under PREFIX until interrupted

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
  auto watch = store.Watch(prefix, 0, [](const cohort::WatchEvent& e) {
    PrintLine(absl::StrCat(
        e.revision, " ",
        e.type == cohort::WatchEvent::Type::kPut ? "PUT " : "DELETE ", e.key,
        e.type == cohort::WatchEvent::Type::kPut ? " " : "", e.value));
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

int main(int argc, char** argv) {
  // Blocked before any thread (gRPC's included) starts, so `watch` can take
  // them with sigtimedwait.
  const sigset_t stop_signals = cohort::base::BlockStopSignals();
  absl::SetProgramUsageMessage(kUsage);
  std::vector<std::string> args = ParseArgs(argc, argv);
  if (args.empty()) return Usage("no command given");
  const std::string command = args[0];
  args.erase(args.begin());

  cohort::RemoteStoreOptions options;
  options.address = Address();
  options.connect_timeout = absl::Seconds(absl::GetFlag(FLAGS_connect_timeout));
  auto connected = cohort::RemoteStore::Connect(options);
  if (!connected.ok()) return Fail(connected.status());
  cohort::RemoteStore& store = **connected;
  const double timeout_s = absl::GetFlag(FLAGS_timeout);
  if (!(timeout_s > 0)) return Usage("--timeout must be > 0 seconds");
  const absl::Duration timeout = absl::Seconds(timeout_s);

  if (command != "watch") {
    // Other commands die of SIGINT/SIGTERM as usual: the main thread takes
    // them (gRPC's threads keep them blocked).
    pthread_sigmask(SIG_UNBLOCK, &stop_signals, nullptr);
  }

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
