#!/usr/bin/env bash
# The exit code to report after `accelerate launch`: the one the workers recorded (record_exit.sh), the worst
# first (69 GPU fault, then 75 preempted; edit these if you changed HealthConfig's exit codes), else the
# launcher's own.
dir=${1:?usage: worker_code.sh EXIT_DIR LAUNCHER_CODE}
launcher=${2:?usage: worker_code.sh EXIT_DIR LAUNCHER_CODE}
codes=$(cat "$dir"/rank-* 2>/dev/null)
for wanted in 69 75; do
  if grep -qx "$wanted" <<<"$codes"; then
    echo "$wanted"
    exit 0
  fi
done
echo "$launcher"
