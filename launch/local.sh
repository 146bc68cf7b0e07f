#!/bin/bash
# N processes on this machine, each with DEVICES_PER_PROCESS (default 4) CPU devices, joined
# through jax.distributed (gloo collectives): a multi-host run without a cluster.
#
#   launch/local.sh N [--dry-run] [--config=FILE] [--config.KEY=VALUE ...]
#
# Knobs: see launch/common.sh (in-job restart included: JAXLLM_MAX_RESTARTS), plus PORT (the
# coordinator's, default: a free one, a new one for each restart).  Waits for all processes; when one
# fails the others are killed, and the job restarts from the newest checkpoint or exits with its status.
# Ctrl-C or SIGTERM stops the run at a step boundary with a checkpoint (exit 75); rerun to resume.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "$0")/common.sh"
jaxllm_setup "$@"

[[ ${#ARGS[@]} -ge 1 && "${ARGS[0]}" =~ ^[1-9][0-9]*$ ]] || jaxllm_die "usage: launch/local.sh N [--dry-run] [--config.KEY=VALUE ...]"
N=${ARGS[0]}
DEVICES_PER_PROCESS=${DEVICES_PER_PROCESS:-4}
jaxllm_posint DEVICES_PER_PROCESS "$DEVICES_PER_PROCESS"
if [[ -n "${PORT:-}" ]]; then jaxllm_posint PORT "$PORT"; fi
# free_port: PORT, else a port free now.
free_port() {
  if [[ -n "${PORT:-}" ]]; then echo "$PORT"; return; fi
  "${PYTHON:-python}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

jaxllm_export JAX_PLATFORMS=cpu XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$DEVICES_PER_PROCESS" \
  JAXLLM_COORDINATOR_ADDRESS="127.0.0.1:$(free_port)" JAXLLM_NUM_PROCESSES="$N"
jaxllm_train_cmd $((N * DEVICES_PER_PROCESS)) "${ARGS[@]:1}"
jaxllm_summary 1 "$N" $((N * DEVICES_PER_PROCESS))
if [[ "$DRY_RUN" == 1 ]]; then
  jaxllm_print env JAXLLM_PROCESS_ID=0 "${TRAIN_CMD[@]}"
  JAXLLM_EXPORTS=()  # the exports are printed once, before the first command
  for ((i = 1; i < N; i++)); do jaxllm_print env JAXLLM_PROCESS_ID="$i" "${TRAIN_CMD[@]}"; done
  exit 0
fi

PIDS=()
# Ctrl-C or SIGTERM: every process saves a checkpoint at the same step boundary (jaxllm.train's
# preemption) and exits 75; wait for them, and do not restart.  Background processes of a script
# ignore SIGINT, so the signal reaches them only as this SIGTERM.
# shellcheck disable=SC2329  # (invoked by jaxllm_run's trap)
jaxllm_stop() {
  JAXLLM_STOPPING=1
  kill -TERM "${PIDS[@]}" 2>/dev/null || true
}
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT

# run_processes: one start of the job: the N processes, waited for.  Returns 0, or the status of the
# first to fail, the others killed (SIGKILL: a dead peer leaves nothing to save; a restart resumes from
# the newest checkpoint); when stopping, the first non-zero status (75: preempted after saving).
run_processes() {
  local i status=0 left pid s address=$JAXLLM_COORDINATOR_ADDRESS
  if (( ${#PIDS[@]} )); then address="127.0.0.1:$(free_port)"; fi  # a restart: a new coordinator port
  PIDS=()
  for ((i = 0; i < N; i++)); do
    JAXLLM_COORDINATOR_ADDRESS=$address JAXLLM_PROCESS_ID=$i "${TRAIN_CMD[@]}" &
    PIDS+=("$!")
  done
  for ((left = N; left > 0;)); do
    pid="" s=0
    wait -n -p pid 2>/dev/null || s=$?  # (bash's "line N: PID Killed ..." notes: the launch line says it)
    [[ -n "${pid:-}" ]] || continue  # a trapped signal interrupted the wait
    left=$((left - 1))
    if (( s != 0 && status == 0 )); then
      status=$s
      if (( ! JAXLLM_STOPPING )); then kill -KILL "${PIDS[@]}" 2>/dev/null || true; fi
    fi
  done
  return "$status"
}
jaxllm_run run_processes
