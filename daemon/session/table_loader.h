// TableLoader: turns a trainer's descriptor table into what snapshots copy from. In: the
// table (read through its imported region) and the regions it names, imported through the
// shm importer or the device backend. Out: the session's items, their regions and one
// TensorSet shared by every snapshot of that table generation. Every item is checked (name,
// duplicates, dtype and shape against length, bounds in its region) before anything of the
// session changes, so a bad table leaves the session as it was. Thread-safe (holds no state
// of its own besides the importers).
#pragma once

#include <string>
#include <vector>

#include "backend/device_copier.h"
#include "backend/region_importer.h"
#include "common/status.h"
#include "daemon/session/session.h"
#include "daemon/session/uid_limits.h"
#include "format/global_layout.h"

namespace ckpt {

// The CUDA part of a Register request.
struct DeviceRegistration {
  bool present = false;
  std::string device_uuid;
  std::vector<std::string> trainer_events;  // cudaIpcEventHandle_t bytes
  std::string release_words;                // shm name, may be empty
  std::uint32_t release_base = 0;
};

class TableLoader {
 public:
  // `backend` may be null; then `no_backend_reason` says why in the error a GPU region gets.
  // Every table loaded is counted against its uid's `items` budget.
  TableLoader(RegionImporter& importer, DeviceBackend* backend, std::string no_backend_reason,
              ItemBudget& items)
      : importer_(importer),
        backend_(backend),
        no_backend_reason_(std::move(no_backend_reason)),
        items_(items) {}

  // Imports the descriptor table `name` of a new registration by `uid`.
  Result<std::shared_ptr<ImportedRegion>> OpenTable(const std::string& name, uid_t uid);
  // (Re-)reads the session's table and imports its regions afresh. A table that would take
  // the session's uid past --max-items-per-uid is refused like a bad one. `layouts` (a
  // registration's) replace the session's once the table loads; null: the session's stay
  // (a snapshot re-reading a changed table). Each layout must name a tensor item of the
  // table, once, and fit it (ResolveLayout): else InvalidArgument naming the item. The
  // items get their resolved layouts, and those of a box (not replicated) block checksums
  // of kBlockBytes.
  Status Load(Session& s, const ItemLayouts* layouts = nullptr) REQUIRES(s.mu);
  // After Load found device regions: opens (or checks) the session's interprocess events
  // and returns the daemon's event handles for the reply.
  Status AttachDevice(Session& s, const DeviceRegistration& device, std::vector<std::string>* daemon_events)
      REQUIRES(s.mu);

 private:
  RegionImporter& importer_;
  DeviceBackend* backend_;
  const std::string no_backend_reason_;
  ItemBudget& items_;
};

}  // namespace ckpt
