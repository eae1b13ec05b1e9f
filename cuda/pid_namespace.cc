#include "cuda/pid_namespace.h"

namespace ckpt::cuda {
namespace {

constexpr const char* kWayOut =
    "legacy CUDA IPC does not work across PID namespaces: run the trainer with the host's PID "
    "namespace (docker --pid=host, Kubernetes hostPID: true) or in ckptd's, or run ckptd inside the "
    "trainer's container (see README, GPU requirements)";

}  // namespace

std::string PidNamespaceNote(pid_t trainer_pid, const Result<std::string>& trainer_ns,
                             const Result<std::string>& daemon_ns) {
  const std::string daemon = daemon_ns.ok() ? daemon_ns.value() : std::string("unknown");
  if (trainer_pid == 0) {
    return "the trainer runs in a PID namespace outside ckptd's (" + daemon +
           "): its socket peer credentials carry no pid ckptd can see; " + kWayOut;
  }
  const std::string trainer = "the trainer (pid " + std::to_string(trainer_pid) + ")";
  if (trainer_ns.ok() && daemon_ns.ok()) {
    if (trainer_ns.value() == daemon_ns.value()) return "";
    return trainer + " runs in PID namespace " + trainer_ns.value() + ", ckptd in " + daemon + ": " + kWayOut;
  }
  const std::string why = trainer_ns.ok() ? daemon_ns.status().message() : trainer_ns.status().message();
  return "if " + trainer + " runs in another PID namespace than ckptd (" + daemon + "; " + why +
         "), that is the cause: " + kWayOut;
}

std::string PidNamespaceNoteFor(pid_t trainer_pid) {
  return PidNamespaceNote(
      trainer_pid, trainer_pid == 0 ? Result<std::string>(Internal("no pid")) : PidNamespaceOf(trainer_pid),
      PidNamespaceOf(0));
}

}  // namespace ckpt::cuda
