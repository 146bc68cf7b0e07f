#!/bin/bash
# N processes on this machine, each with DEVICES_PER_PROCESS (default 4) CPU devices, joined
# through jax.distributed (gloo collectives): a multi-host run without a cluster.
#
#   launch/local.sh N [--dry-run] [--config=FILE] [--config.KEY=VALUE ...]
#
# Knobs: see launch/common.sh, plus PORT (the coordinator's, default: a free one).  Waits for
# all processes; when one fails the others are killed and its exit status is returned.
# Ctrl-C or SIGTERM stops the run at a step boundary with a checkpoint (exit 75); rerun to resume.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
jaxllm_setup "$@"

[[ ${#ARGS[@]} -ge 1 && "${ARGS[0]}" =~ ^[1-9][0-9]*$ ]] || jaxllm_die "usage: launch/local.sh N [--dry-run] [--config.KEY=VALUE ...]"
N=${ARGS[0]}
DEVICES_PER_PROCESS=${DEVICES_PER_PROCESS:-4}
jaxllm_posint DEVICES_PER_PROCESS "$DEVICES_PER_PROCESS"
PORT=${PORT:-$("${PYTHON:-python}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

jaxllm_export JAX_PLATFORMS=cpu XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$DEVICES_PER_PROCESS" \
  JAXLLM_COORDINATOR_ADDRESS="127.0.0.1:$PORT" JAXLLM_NUM_PROCESSES="$N"
jaxllm_train_cmd $((N * DEVICES_PER_PROCESS)) "${ARGS[@]:1}"
jaxllm_summary 1 "$N" $((N * DEVICES_PER_PROCESS))
if [[ "$DRY_RUN" == 1 ]]; then
  jaxllm_exec env JAXLLM_PROCESS_ID=0 "${TRAIN_CMD[@]}"
  JAXLLM_EXPORTS=()  # the exports are printed once, before the first command
  for ((i = 1; i < N; i++)); do jaxllm_exec env JAXLLM_PROCESS_ID="$i" "${TRAIN_CMD[@]}"; done
  exit 0
fi

PIDS=()
STOPPING=0
# Ctrl-C or SIGTERM: every process saves a checkpoint at the same step boundary (jaxllm.train's
# preemption) and exits 75; wait for them.  Background processes of a script ignore SIGINT, so
# the signal reaches them only as this SIGTERM.
# shellcheck disable=SC2329  # (invoked by the trap below)
stop() {
  STOPPING=1
  kill -TERM "${PIDS[@]}" 2>/dev/null || true
}
trap stop INT TERM
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
for ((i = 0; i < N; i++)); do
  JAXLLM_PROCESS_ID=$i "${TRAIN_CMD[@]}" &
  PIDS+=("$!")
done
# Unless stopping, the first process to fail decides the exit status and the EXIT trap kills the
# others; when stopping, the first non-zero status (75: preempted after saving) once all are done.
status=0
for ((left = N; left > 0;)); do
  pid="" s=0
  wait -n -p pid || s=$?
  [[ -n "${pid:-}" ]] || continue  # a trapped signal interrupted the wait
  left=$((left - 1))
  if (( s != 0 && status == 0 )); then
    status=$s
    if (( ! STOPPING )); then
      echo "launch: a process exited with status $s; stopping the others" >&2
      exit "$s"
    fi
  fi
done
trap - EXIT
exit "$status"
