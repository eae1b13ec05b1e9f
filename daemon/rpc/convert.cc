#include "daemon/rpc/convert.h"

#include <unistd.h>

#include "common/pid_namespace.h"

namespace ckpt {

RegistrationRequest FromProto(const v1::RegisterRequest& req) {
  RegistrationRequest out;
  out.job = req.job();
  out.rank = req.rank();
  out.world_size = req.world_size();
  out.descriptor_table = req.descriptor_table();
  out.sealed = req.sealed();
  out.verify = req.verify();
  out.device.present = req.has_cuda();
  if (req.has_cuda()) {
    out.device.device_uuid = req.cuda().device_uuid();
    out.device.trainer_events.assign(req.cuda().trainer_events().begin(), req.cuda().trainer_events().end());
    out.device.release_words = req.cuda().release_words();
    out.device.release_base = req.cuda().release_base();
  }
  out.layouts.reserve(req.layouts_size());
  for (const auto& l : req.layouts()) {
    GlobalLayout layout;
    layout.global_name = l.global_name();
    layout.global_shape.assign(l.global_shape().begin(), l.global_shape().end());
    layout.offsets.assign(l.offsets().begin(), l.offsets().end());
    layout.replicated = l.replicated();
    out.layouts.emplace_back(l.item(), std::move(layout));
  }
  return out;
}

SnapshotRequestData FromProto(const v1::SnapshotRequest& req) {
  SnapshotRequestData out;
  out.version = req.version();
  out.table_generation = req.table_generation();
  out.trainer_event_slot = req.trainer_event_slot();
  out.blobs.reserve(req.blobs_size());
  for (const auto& b : req.blobs()) {
    out.blobs.push_back(SnapshotBlob{b.name(), std::make_shared<const std::string>(b.data()), std::nullopt});
    if (b.has_for_rank()) out.blobs.back().for_rank = b.for_rank();
  }
  return out;
}

void ToProto(const Registered& r, v1::RegisterReply* reply) {
  reply->set_session(r.session->id);
  reply->set_item_count(r.items);
  reply->set_tensor_bytes(r.tensor_bytes);
  reply->set_latest_committed(r.latest_committed);
  for (const auto& h : r.daemon_events) reply->add_daemon_events(h);
  reply->set_release_words(r.release_words);
  reply->set_sealed(r.sealed);
  reply->set_verify(r.verify);
  reply->set_daemon_pid(::getpid());
  static const std::string pid_namespace = PidNamespaceOf(0).value_or("");
  reply->set_daemon_pid_namespace(pid_namespace);
}

void ToProto(Restored r, v1::RestoreReply* reply) {
  reply->set_version(r.version);
  reply->set_tensor_bytes(r.tensor_bytes);
  reply->set_tier(TierName(r.tier));
  for (auto& blob : r.blobs) {
    auto* b = reply->add_blobs();
    b->set_name(blob.name);
    b->set_data(std::move(blob.data));
    b->set_from_rank(blob.from_rank);
  }
  reply->set_world_size(r.world_size);
  reply->set_resharded(r.resharded);
  reply->set_uncommitted(r.uncommitted);
}

void ToProto(std::uint64_t version, const VersionOnTiers& v, v1::VersionInfo* out) {
  out->set_version(version);
  out->set_committed(v.committed);
  out->set_restorable(v.restorable);
  out->set_aborted(!v.aborted.empty());
  out->set_abort_reason(v.aborted);
  out->set_under_replicated(!v.under_replicated.empty());
  out->set_under_replicated_reason(v.under_replicated);
  for (auto r : v.persistent_ranks) out->add_durable_ranks(r);
  for (auto r : v.local_ranks) out->add_local_ranks(r);
  for (auto r : v.memory_ranks) out->add_memory_ranks(r);
  for (const auto& [rank, origin] : v.replicas_held) {
    auto* h = out->add_replicas_held();
    h->set_rank(rank);
    h->set_origin(origin);
  }
}

void ToProto(const PrefetchResult& r, v1::PrefetchReply* reply) {
  reply->set_version(r.version);
  reply->set_local_shards(r.local_shards);
  reply->set_memory_shards(r.memory_shards);
  reply->set_bytes(r.bytes);
  reply->set_differential_shards(r.differential_shards);
}

}  // namespace ckpt
