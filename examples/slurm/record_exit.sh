#!/usr/bin/env bash
# A worker command for `accelerate launch --no_python record_exit.sh python train.py`: runs the command, passes
# it the signals the launcher sends, and records its exit code in $RESILIENCE_EXIT_DIR/rank-$RANK, because the
# elastic agent behind `accelerate launch` exits 1 whatever the workers' codes were. worker_code.sh reads them.
set -u
dir=${RESILIENCE_EXIT_DIR:?set RESILIENCE_EXIT_DIR to a directory every node can write}
"$@" &
child=$!
for signal in TERM INT HUP USR1; do
  trap "kill -$signal $child 2>/dev/null" "$signal"
done
while kill -0 "$child" 2>/dev/null; do
  wait "$child"  # returns early when a trapped signal arrives; the loop waits again
done
wait "$child"  # the child's own status, kept by the shell
code=$?
mkdir -p "$dir" && echo "$code" > "$dir/rank-${RANK:-0}"
exit "$code"
