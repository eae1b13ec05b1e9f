#include "support/run_as.h"

#include <grp.h>
#include <stdlib.h>
#include <unistd.h>

#include "support/test_dirs.h"

namespace ckpt::test {

ProcessResult RunAs(uid_t uid, const std::vector<std::string>& argv, const std::vector<gid_t>& groups) {
  char path[] = "/tmp/ckpt-runas-out-XXXXXX";
  int out = ::mkstemp(path);
  pid_t pid = ::fork();
  if (pid == 0) {
    if (::setgroups(groups.size(), groups.data()) != 0 || ::setgid(uid) != 0 || ::setuid(uid) != 0)
      ::_exit(120);
    ::dup2(out, 1);
    ::dup2(out, 2);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(out);
  ProcessResult r;
  r.exit_code = WaitProcess(pid);
  r.output = ReadFile(path);
  ::unlink(path);
  return r;
}

std::vector<std::string> ToyTrainerArgs(const std::string& socket, const std::string& job, int iters,
                                        bool resume) {
  std::vector<std::string> argv = {TOY_TRAINER_BINARY,
                                   "--socket",
                                   socket,
                                   "--job",
                                   job,
                                   "--state-mib",
                                   "1",
                                   "--tensors",
                                   "2",
                                   "--iters",
                                   std::to_string(iters),
                                   "--every",
                                   "1",
                                   "--compute-ms",
                                   "0",
                                   "--quiet"};
  if (resume) argv.push_back("--resume");
  return argv;
}

}  // namespace ckpt::test
