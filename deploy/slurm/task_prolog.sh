#!/usr/bin/env bash
# Slurm TaskProlog (slurm.conf: TaskProlog=/usr/local/libexec/ckptd/task_prolog.sh): runs
# as the job's user before each task; Slurm applies the "export NAME=VALUE" lines it prints
# to the task's environment. Exports the socket of the job's daemon (job mode) or of the
# node daemon (node mode) as CKPTD_SOCKET, which every client reads first.
ckptd_script=task_prolog
# shellcheck source=common.sh
. "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/common.sh"
if [ "$CKPTD_SLURM_MODE" = node ]; then
  echo "export CKPTD_SOCKET=$CKPTD_NODE_SOCKET"
elif [ -S "$job_socket" ]; then
  echo "export CKPTD_SOCKET=$job_socket"
else
  # Tell the task, without failing it: the prolog has already reported why.
  echo "print ckptd: no daemon socket at $job_socket for job $job_id; checkpoints will fail"
fi
