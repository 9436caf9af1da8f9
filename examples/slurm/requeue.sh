#!/usr/bin/env bash
# After the job step: requeue the job when training stopped cleanly to be run again. 75: preempted, the step is
# saved and committed; 69: a GPU fault, saved too (keep the node out of the requeued job: see docs/HEALTH.md).
# Any other code (a crash, 1 from a launcher, 128+N from a signal) is left to you. SCONTROL: for tests.
code=${1:?usage: requeue.sh EXIT_CODE}
case "$code" in
  75) ${SCONTROL:-scontrol} requeue "$SLURM_JOB_ID" ;;
  69) echo "GPU fault: the rank logs name the node and GPU; requeueing" >&2
      ${SCONTROL:-scontrol} requeue "$SLURM_JOB_ID" ;;
esac
