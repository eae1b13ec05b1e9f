// Building a registration and sending it: register_items turns the trainer's items into
// rows of the descriptor table (host regions, and GPU tensors resolved to their exported
// CUDA allocations), and registers them with the daemon; a reconnection sends the same
// registration again (RequestLocked).
#include <algorithm>
#include <utility>
#include <vector>

#include "client/errors.h"
#include "client/session.h"
#include "client/shared_region.h"
#include "common/mutex.h"
#include "format/dtype.h"

namespace ckpt {

#if !defined(CKPT_HAVE_CUDA)
Result<std::shared_ptr<CudaTensors>> ResolveCudaTensors(const std::vector<CudaTensorSpec>& tensors) {
  return FailedPrecondition("GPU tensor '" + (tensors.empty() ? std::string() : tensors.front().name) +
                            "': this libckpt was built without CUDA; rebuild it where the CUDA toolkit is "
                            "installed, or keep the tensor in a ckpt::SharedRegion");
}
#endif

namespace {

Mutex resolver_mu;
CudaTensorsResolver test_resolver GUARDED_BY(resolver_mu);

Result<std::shared_ptr<CudaTensors>> ResolveGpuTensors(const std::vector<CudaTensorSpec>& tensors) {
  CudaTensorsResolver resolver;
  {
    MutexLock lock(resolver_mu);
    resolver = test_resolver;
  }
  return resolver ? resolver(tensors) : ResolveCudaTensors(tensors);
}

}  // namespace

void SetCudaTensorsResolverForTesting(CudaTensorsResolver resolver) {
  MutexLock lock(resolver_mu);
  test_resolver = std::move(resolver);
}

v1::RegisterRequest Client::Impl::RequestLocked(const std::string& job, std::uint32_t rank,
                                                std::uint32_t world_size) {
  v1::RegisterRequest req;
  req.set_job(job);
  req.set_rank(rank);
  req.set_world_size(world_size);
  req.set_descriptor_table(table->name());
  *req.mutable_layouts() = layouts;
  req.set_sealed(options.sealed);
  req.set_verify(options.verify);
  if (cuda) {
    v1::CudaSession* c = req.mutable_cuda();
    c->set_device_uuid(cuda->device_uuid());
    for (std::string& h : cuda->trainer_event_handles()) c->add_trainer_events(std::move(h));
    AddReleaseWordsLocked(c);
  }
  return req;
}

void Client::Impl::CheckRegionsLocked() {
  for (const auto& r : registered) {
    auto* posix = dynamic_cast<PosixSharedRegion*>(r.region.get());
    const std::optional<std::uint64_t> now = posix != nullptr ? posix->object_size() : std::nullopt;
    bool shrunk = now && *now != r.size;
    if (r.region->generation() != r.generation || r.region->size() != r.size || shrunk) {
      throw Error(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION),
                  "region " + r.region->name() + " of item '" + r.item +
                      "' changed since registration (resized or reallocated); call register_items again");
    }
  }
}

Registration Client::register_items(const std::string& job, std::uint32_t rank, std::uint32_t world_size,
                                    const std::vector<TensorItem>& items, const RegisterOptions& options) {
  MutexLock lock(impl_->mu);
  std::vector<TableItem> rows;
  std::vector<Impl::Registered> registered;
  std::vector<CudaTensorSpec> gpu_tensors;
  std::vector<std::size_t> gpu_rows;  // index in `rows` of each GPU tensor
  google::protobuf::RepeatedPtrField<v1::ItemLayout> layouts;
  for (const auto& it : items) {
    if (it.layout) {
      v1::ItemLayout* l = layouts.Add();
      l->set_item(it.name);
      l->set_global_name(it.layout->global_name);
      for (auto d : it.layout->global_shape) l->add_global_shape(d);
      for (auto o : it.layout->offsets) l->add_offsets(o);
      l->set_replicated(it.layout->replicated);
    }
    if (it.region && it.cuda_ptr) {
      throw Error(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT),
                  "item '" + it.name + "' has both a region and a cuda_ptr: set one of them");
    }
    if (!it.region && !it.cuda_ptr) {
      throw Error(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT),
                  "item '" + it.name + "' has no region");
    }
    std::uint64_t elems = 1;
    for (auto d : it.shape) {
      if (d < 0)
        throw Error(static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT),
                    "item '" + it.name + "' has a negative dimension");
      elems *= static_cast<std::uint64_t>(d);
    }
    TableItem row;
    row.name = it.name;
    row.dtype = it.dtype;
    row.shape = it.shape;
    row.length = elems * DTypeSize(it.dtype);
    if (it.cuda_ptr) {
      // Region, offset and generation come from the tensor's CUDA allocation, below.
      gpu_rows.push_back(rows.size());
      gpu_tensors.push_back(CudaTensorSpec{it.name, it.cuda_ptr, row.length});
      rows.push_back(std::move(row));
      continue;
    }
    row.region = it.region->name();
    row.offset = it.offset;
    row.generation = it.region->generation();
    rows.push_back(std::move(row));
    // One entry per distinct region: the check before each snapshot is per region.
    bool seen = false;
    for (const auto& r : registered) seen = seen || r.region == it.region;
    if (!seen) registered.push_back({it.region, it.region->generation(), it.region->size(), it.name});
  }
  // GPU tensors are checked and exported before anything changes: a refused registration
  // leaves the previous one in place.
  std::shared_ptr<CudaTensors> gpu;
  if (!gpu_tensors.empty()) {
    auto resolved = ResolveGpuTensors(gpu_tensors);
    if (!resolved.ok()) ThrowWithCode(resolved.status());
    gpu = std::move(resolved).value();
    for (std::size_t i = 0; i < gpu_rows.size(); ++i) {
      TableItem& row = rows[gpu_rows[i]];
      row.region = gpu->rows()[i].region;
      row.offset = gpu->rows()[i].offset;
      row.generation = gpu->rows()[i].generation;
    }
  }
  bool new_session = !impl_->table || impl_->table->capacity() < rows.size();
  bool kept_events = false;
  if (gpu) {
    const CudaTensors* previous = new_session || impl_->session.empty() ? nullptr : impl_->cuda.get();
    auto kept = gpu->PrepareEvents(previous);
    if (!kept.ok()) ThrowWithCode(kept.status().With("register"));
    kept_events = kept.value();
    impl_->PrepareReleaseWordsLocked(*gpu);
  }
  // A session keeps the CUDA side it registered with (device, trainer events): the daemon
  // may still be waiting on those events. When that side changes, a new session starts.
  if ((gpu || impl_->cuda) && !kept_events) new_session = true;
  if (!impl_->table || impl_->table->capacity() < rows.size()) {
    auto table =
        DescriptorTable::Create("", static_cast<std::uint32_t>(std::max<std::size_t>(rows.size(), 16)));
    if (!table.ok()) Throw(table.status());
    impl_->table = std::move(table).value();
  }
  if (new_session && !impl_->session.empty()) {
    // A new table object, or another CUDA side, means a new registration.
    impl_->DrainGpuLocked();
    UnregisterQuietly(*impl_->stub, impl_->session);
    impl_->EndSessionLocked();
  }
  if (Status s = impl_->table->Write(rows); !s.ok()) Throw(s);
  impl_->options = options;
  impl_->registered = std::move(registered);
  impl_->layouts = std::move(layouts);
  impl_->cuda = gpu;
  if (gpu && !kept_events) impl_->trainer_slots = TrainerSlotBook(kTrainerEventSlots);
  if (impl_->job != job || impl_->rank != rank) impl_->lost.Clear();  // another registration's versions
  Registration out;
  v1::RegisterReply rep;
  if (!impl_->daemon_lost) {
    // First registration, or (same table, new generation) a re-registration that the daemon
    // validates now rather than at the next snapshot.
    grpc::ClientContext ctx;
    v1::RegisterRequest req = impl_->RequestLocked(job, rank, world_size);
    req.set_session(impl_->session);
    grpc::Status s = impl_->stub->Register(&ctx, req, &rep);
    const bool reregister = !impl_->session.empty();
    if (!s.ok()) {
      // Only a daemon that served this client is waited for; the first registration with
      // no daemon fails at once.
      if (!impl_->served || !Impl::DaemonGone(s, impl_->CallLocked()))
        Throw(s, reregister ? "re-register" : "register");
      impl_->DropSessionLocked();
    } else {
      impl_->served = true;
      if (rep.session() != impl_->session) ++impl_->epoch;
      impl_->session = rep.session();
      impl_->instance = rep.daemon_instance();
      impl_->job = job;
      impl_->rank = rank;
      impl_->world_size = world_size;
      if (gpu) {
        std::vector<std::string> handles(rep.daemon_events().begin(), rep.daemon_events().end());
        if (Status st = gpu->OpenDaemonEvents(handles); !st.ok()) {
          // Without the daemon's events no stream could be ordered after its copies: end the
          // registration rather than leave it half made.
          UnregisterQuietly(*impl_->stub, impl_->session);
          impl_->EndSessionLocked();
          ThrowWithCode(st.With("register"));
        }
        impl_->UseReleaseWordsLocked(rep);
      }
    }
  }
  if (impl_->daemon_lost) {
    impl_->job = job;
    impl_->rank = rank;
    impl_->world_size = world_size;
    rep = impl_->RecoverLocked("register job " + job + " rank " + std::to_string(rank));
  }
  out.item_count = rep.item_count();
  out.tensor_bytes = rep.tensor_bytes();
  out.latest_committed = rep.latest_committed();
  out.sealed = rep.sealed();
  out.verify = rep.verify();
  return out;
}

}  // namespace ckpt
