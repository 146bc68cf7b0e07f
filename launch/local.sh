#!/bin/bash
# N processes on this machine, each with DEVICES_PER_PROCESS (default 4) CPU devices, joined
# through jax.distributed (gloo collectives): a multi-host run without a cluster.
#
#   launch/local.sh N [--dry-run] [--config=FILE] [--config.KEY=VALUE ...]
#
# Knobs: see launch/common.sh, plus PORT (the coordinator's, default: a free one).  Waits for
# all processes; when one fails the others are killed and its exit status is returned.
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
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM
for ((i = 0; i < N; i++)); do
  JAXLLM_PROCESS_ID=$i "${TRAIN_CMD[@]}" &
  PIDS+=("$!")
done
# The first process to fail decides the exit status; the EXIT trap kills the others.
for ((i = 0; i < N; i++)); do
  status=0
  wait -n "${PIDS[@]}" || status=$?
  if (( status != 0 )); then
    echo "launch: a process exited with status $status; stopping the others" >&2
    exit "$status"
  fi
done
trap - EXIT
