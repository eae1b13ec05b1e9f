#include "tools/ckptctl/prefetch_cmd.h"

#include <cinttypes>
#include <cstdio>
#include <iostream>
#include <thread>

#include "tools/ckptctl/common.h"
#include "tools/ckptctl/json.h"

namespace ckptctl {
namespace {

// The newest warm start of `job` in a Status reply, or null.
const ckpt::v1::WarmStartStatus* Newest(const ckpt::v1::StatusReply& r, const std::string& job) {
  const ckpt::v1::WarmStartStatus* found = nullptr;
  for (const auto& w : r.warm_starts()) {
    if (w.job() == job) found = &w;
  }
  return found;
}

}  // namespace

int PrefetchFromPeers(const std::string& socket, const std::string& job, const std::vector<std::uint32_t>& ranks,
                      bool wait, bool json) {
  auto stub = Connect(socket);
  ckpt::v1::WarmStartReply plan;
  {
    grpc::ClientContext ctx;
    SetDeadline(ctx, 120);
    ckpt::v1::WarmStartRequest req;
    req.set_job(job);
    for (auto r : ranks) req.add_ranks(r);
    grpc::Status s = stub->WarmStart(&ctx, req, &plan);
    if (!s.ok()) return Fail("prefetch --from-peers", s, socket);
  }
  if (!json) {
    std::printf("job %s version %" PRIu64 ": %u shard(s), %s queued to pull from peers' memory\n", job.c_str(),
                plan.version(), plan.shards(), Human(plan.total_bytes()).c_str());
  }
  if (!wait) {
    if (json) {
      nlohmann::ordered_json doc = ToJson(plan);
      doc["job"] = job;
      PrintJson(doc);
    }
    return kOk;
  }
  for (;;) {
    grpc::ClientContext ctx;
    SetDeadline(ctx, 10);
    ckpt::v1::StatusReply r;
    grpc::Status s = stub->Status(&ctx, ckpt::v1::StatusRequest(), &r);
    if (!s.ok()) return Fail("prefetch --from-peers: follow the warm start", s, socket);
    const ckpt::v1::WarmStartStatus* w = Newest(r, job);
    if (w == nullptr) {
      std::cerr << "ckptctl: prefetch --from-peers: the daemon at " << socket << " no longer reports job '" << job
                << "'\n";
      return kFailure;
    }
    if (w->state() == "done" || w->state() == "failed") {
      if (json) {
        nlohmann::ordered_json doc = ToJson(*w);
        PrintJson(doc);
      } else {
        std::printf("job %s version %" PRIu64 ": warm start %s, %s of %s%s%s\n", job.c_str(), w->version(),
                    w->state().c_str(), Human(w->bytes_done()).c_str(), Human(w->total_bytes()).c_str(),
                    w->error().empty() ? "" : ": ", w->error().c_str());
      }
      if (w->state() == "failed") {
        if (json) std::cerr << "ckptctl: prefetch --from-peers: " << w->error() << "\n";
        return kFailure;
      }
      return kOk;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void PrintWarmStarts(const ckpt::v1::StatusReply& r) {
  if (r.warm_starts().empty()) return;
  std::printf("\nwarm starts from peers (%d)\n", r.warm_starts_size());
  for (const auto& w : r.warm_starts()) {
    std::printf("  job %-16s v%-8" PRIu64 " %-8s %s / %s%s%s\n", w.job().c_str(), w.version(), w.state().c_str(),
                Human(w.bytes_done()).c_str(), Human(w.total_bytes()).c_str(), w.error().empty() ? "" : "  ",
                w.error().c_str());
    for (const auto& s : w.shards()) {
      if (s.state() == "done" && w.state() == "done") continue;  // a finished job: one line
      std::printf("    rank %-5u %-8s %s / %s%s%s%s%s\n", s.rank(), s.state().c_str(), Human(s.bytes_done()).c_str(),
                  Human(s.total_bytes()).c_str(), s.peer().empty() ? "" : "  from ", s.peer().c_str(),
                  s.error().empty() ? "" : "  ", s.error().c_str());
    }
  }
}

}  // namespace ckptctl
