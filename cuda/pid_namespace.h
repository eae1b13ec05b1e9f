// Why a CUDA IPC open may fail: legacy CUDA IPC (cudaIpcOpenMemHandle,
// cudaIpcOpenEventHandle) does not work between processes in different PID namespaces, as
// with a trainer in a container that has neither the host's PID namespace (docker
// --pid=host, Kubernetes hostPID: true) nor one shared with ckptd (a limit UCX and NCCL
// document too). The daemon names that cause in the error when it can tell.
//
// In: the trainer's pid as the daemon sees it (SO_PEERCRED; 0 when the trainer's PID
// namespace is not below the daemon's, so that its pid has no number there) and the two
// namespaces as /proc/PID/ns/pid names them ("pid:[4026531836]"). Out: a sentence to append
// to the open's error, empty when both processes share a namespace.
//
// Thread-safety: pure functions, and reads of /proc.
#pragma once

#include <sys/types.h>

#include <string>

#include "common/pid_namespace.h"
#include "common/status.h"

namespace ckpt::cuda {

// The note for a failed CUDA IPC open of trainer `trainer_pid`, from the namespaces read
// (or the errors reading them). Empty when both are known and equal.
std::string PidNamespaceNote(pid_t trainer_pid, const Result<std::string>& trainer_ns,
                             const Result<std::string>& daemon_ns);

// PidNamespaceNote with the namespaces read from /proc now.
std::string PidNamespaceNoteFor(pid_t trainer_pid);

}  // namespace ckpt::cuda
