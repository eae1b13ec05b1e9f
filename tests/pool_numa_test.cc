// --pool-numa: a real ckptd places its host pool's pages as asked, names the node(s) they
// are on in its log, its status and `ckptctl status`, and refuses a node it may not use.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "daemon/base/numa.h"
#include "support/daemon_process.h"
#include "support/test_dirs.h"

using namespace ckpt;
using namespace ckpt::test;

namespace {

DaemonOptions Options(const TempDir& dir, const std::string& numa) {
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.extra_args = {"--pool-numa", numa};
  return o;
}

std::vector<std::string> Argv(const TempDir& dir, const std::string& numa) {
  return {CKPTD_BINARY,  "--create-root",
          "--root",      dir.path() + "/root",
          "--socket",    dir.path() + "/sock/ckptd.sock",
          "--pool-mib",  "64",
          "--chunk-mib", "4",
          "--pool-numa", numa};
}

}  // namespace

TEST_CASE("the host pool is bound to the NUMA node asked for, and status says where it is") {
  auto allowed = AllowedNumaNodes();
  REQUIRE(allowed.ok());
  REQUIRE(!allowed->empty());
  const std::string node = std::to_string(allowed->front());
  TempDir dir{"numa"};
  DaemonProcess daemon(Options(dir, node));
  CHECK(daemon.Status().pool_numa() == "node " + node + ": node " + node);
  CHECK(daemon.Log().find("(NUMA node " + node + ": node " + node + ")") != std::string::npos);
  ProcessResult ctl = RunProcess({CKPTCTL_BINARY, "--socket", daemon.socket(), "status"});
  INFO(ctl.output);
  CHECK(ctl.exit_code == 0);
  CHECK(ctl.output.find("NUMA node " + node + ": node " + node) != std::string::npos);
}

TEST_CASE("an interleaved pool lies on the nodes the daemon may use, and local is the default") {
  TempDir dir{"numa"};
  {
    DaemonProcess daemon(Options(dir, "interleave"));
    const std::string where = daemon.Status().pool_numa();
    INFO(where);
    CHECK(where.rfind("interleave: node", 0) == 0);
  }
  DaemonOptions o = Options(dir, "local");
  o.extra_args.clear();
  DaemonProcess daemon(o);
  CHECK(daemon.Status().pool_numa().rfind("local: ", 0) == 0);
}

TEST_CASE(
    "a NUMA node the daemon may not use, or a bad --pool-numa, is a configuration error (exit 2) with a "
    "clear "
    "message") {
  auto allowed = AllowedNumaNodes();
  REQUIRE(allowed.ok());
  int missing = 0;
  for (int n : allowed.value()) missing = n == missing ? missing + 1 : missing;
  TempDir dir{"numa"};
  ProcessResult bad_node = RunProcess(Argv(dir, std::to_string(missing)));
  INFO(bad_node.output);
  // A configuration error (before: exit 1, which systemd restarts), and --check-config says so
  // (before: "configuration OK").
  CHECK(bad_node.exit_code == 2);
  CHECK(bad_node.output.find("--pool-numa " + std::to_string(missing) +
                             ": not a NUMA node this daemon may allocate on (allowed: ") !=
        std::string::npos);
  std::vector<std::string> check = Argv(dir, std::to_string(missing));
  check.push_back("--check-config");
  ProcessResult checked = RunProcess(check);
  INFO(checked.output);
  CHECK(checked.exit_code == 2);
  CHECK(checked.output.find("not a NUMA node this daemon may allocate on") != std::string::npos);
  ProcessResult bogus = RunProcess(Argv(dir, "nearest"));
  INFO(bogus.output);
  CHECK(bogus.exit_code == 2);
  CHECK(bogus.output.find("--pool-numa nearest: give local, interleave or a NUMA node number") !=
        std::string::npos);
}
