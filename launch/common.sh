# shellcheck shell=bash disable=SC2034  # (it sets variables for the scripts that source it)
# launch/common.sh: what every launch script shares, sourced by them (not run).
#
# Megatron-DeepSpeed-style knobs (environment variables) -> jaxllm.train flags:
#   MODEL_SIZE_KEY  --config=configs/gpt3.py:KEY
#   SEQ_LEN         --config.train.seq_length
#   MICRO_BATCH     --config.train.micro_batch_size
#   GAS             --config.train.global_batch_size = MICRO_BATCH x GAS x DP
#   TP / PP / SP    --config.mesh.tensor / .pipeline / .sequence, and --config.mesh.data = DP
#   EP              --config.mesh.expert (Megatron's --expert-model-parallel-size: it divides DP, and
#                   --config.mesh.data = DP / EP)             NUM_EXPERTS  --config.model.num_experts
#   SP_TYPE         megatron: --config.parallel.megatron_sp=True; ds or ulysses, ring, allgather, usp:
#                   --config.parallel.sequence_impl
#   ZERO_STAGE      --config.parallel.zero_stage
#   WORKDIR         --workdir
#   LLAMA=1         --config=configs/llama.py:KEY (train_llama_alcf.sh's recipe; KEY = MODEL_SIZE_KEY, default
#                   ALCF-7B).  NO_LLAMA (any value, as ALCF's helpers.sh reads it): GPT-3 style, jaxllm's default
#   NUM_KV_HEAD     --config.model.num_kv_heads          FFN_HIDDEN_SIZE  --config.model.ffn_hidden_size
#   OPT             --config.train.optimizer             LR               --config.train.lr
#   LR_DECAY_STYLE  --config.train.lr_decay_style        LR_DECAY_ITERS   --config.train.lr_decay_iters
#   LR_WARMUP_FRAC  --config.train.lr_warmup_fraction (and --config.train.warmup_iters=0)
#   TOKENIZER_TYPE  --config.data.tokenizer: gpt2 for GPT2BPETokenizer (ALCF: any gpt*/GPT*); char, byte;
#                   a tokenizer.json or tokenizer.model path; Llama2Tokenizer, HFTokenizer, ...: the file
#                   TOKENIZER_MODEL names (a Hugging Face tokenizer.json or a SentencePiece tokenizer.model)
#   DATA_FILE_LIST  --config.data.file_list
#   TRAIN_SPLIT, VAL_SPLIT, TEST_SPLIT  --config.data.split (a missing part: ALCF's 990, 10, 0)
#   EVAL_INTERVAL   --config.train.eval_interval         EVAL_ITERS       --config.train.eval_iters
#   SAVE_INTERVAL   --config.checkpoint.interval         TRAIN_ITERS      --config.train.train_iters
#   ADAM_BETA1/2    --config.train.beta1 / .beta2        ADAM_EPS         --config.train.adam_eps
#   WEIGHT_DECAY    --config.train.weight_decay          CLIP_GRAD        --config.train.grad_clip
#   WB_PROJECT, else WANDB_PROJECT  --config.log.wandb=True --config.log.wandb_project (W&B; WANDB_MODE applies)
#   JAXLLM_ARGS     more jaxllm.train flags, space-separated (after the script's own arguments)
# DP = world devices / (TP x PP x SP).  The mesh is pinned (tensor, pipeline, sequence, data)
# only when one of TP, PP, SP, EP, MICRO_BATCH, GAS is set, since the global batch needs DP;
# otherwise the config's own mesh is used.  Other arguments (--config=FILE, --config.*) pass
# through: a --config=FILE goes first (absl needs it before any --config.* override), the
# rest last, so they win over the knobs.  DRY_RUN=1 or --dry-run prints the exports and the
# command instead of running it, and checks the config for the job's devices; the files the config
# names (data, tokenizer) are the cluster's: a dry run does not look for them, and says so.
#
# Paths: jaxllm.train runs where the script was run (submitted, for sbatch and qsub), so a relative
# path (WORKDIR, DATA_FILE_LIST, the prefixes in the list, --config.data.input, ...) means what it
# means there; WORKDIR, --workdir, DATA_FILE_LIST, --config.data.file_list and a --config=FILE are
# made absolute (a --config=FILE found only in the repository, like configs/gpt3.py, is the
# repository's), so that errors name the path read.
#
# In-job restart (jaxllm_run): when jaxllm.train fails (a process died, the others' heartbeat abort,
# a stall: exit 70, a crash, a signal the scheduler did not send) it is started again in the same
# allocation and resumes from the newest complete checkpoint in WORKDIR, each time with one line
# naming the cause and the step.  Not restarted: success, exit 2 (bad input, or WORKDIR in use by
# another run: it would fail again), 74 (a checkpoint was not saved: a full disk or quota, which a
# restart would meet again), 75 (preempted: saved, the scheduler requeues), a SIGTERM/SIGINT/SIGUSR1 to the script itself (the
# scheduler or Ctrl-C), a failure with the same status from the same checkpoint as the previous one
# (it would loop; one line says so).
#   JAXLLM_MAX_RESTARTS     restarts per job (default 3; 0: none)
#   JAXLLM_RESTART_MIN_TIME seconds the allocation must have left for a restart (default 300); the end is
#                           SLURM_JOB_END_TIME on Slurm, PBS's walltime after the job's start on PBS

# jaxllm_die MESSAGE: one line on stderr, exit 2 (as jaxllm.train does for a bad config).
jaxllm_die() {
  echo "launch: $*" >&2
  exit 2
}

# jaxllm_posint NAME VALUE: VALUE must be a positive integer.
jaxllm_posint() {
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || jaxllm_die "$1=$2: must be a positive integer"
}

# jaxllm_setup "$@": sets DRY_RUN, ARGS (the positional arguments other than --dry-run) and
# changes to the repository (JAXLLM_DIR, else this file's parent, else the submit directory).
jaxllm_setup() {
  DRY_RUN=${DRY_RUN:-0}
  ARGS=()
  local a
  for a in "$@"; do
    if [[ "$a" == --dry-run ]]; then DRY_RUN=1; else ARGS+=("$a"); fi
  done
  local here
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  # sbatch/qsub run a copy of the script from a spool directory, so fall back to where it was submitted.
  if [[ -z "${JAXLLM_DIR:-}" ]]; then
    if [[ -f "$here/jaxllm/train.py" ]]; then JAXLLM_DIR=$here
    else JAXLLM_DIR=${SLURM_SUBMIT_DIR:-${PBS_O_WORKDIR:-$PWD}}; fi
  fi
  [[ -f "$JAXLLM_DIR/jaxllm/train.py" ]] || jaxllm_die "JAXLLM_DIR=$JAXLLM_DIR: not the jaxllm repository (set JAXLLM_DIR)"
  JAXLLM_DIR=$(cd "$JAXLLM_DIR" && pwd) || jaxllm_die "cannot cd to $JAXLLM_DIR"
  JAXLLM_STARTED=$(date +%s)
  JAXLLM_EXPORTS=()
  # PBS starts a job in $HOME: the user's directory is where qsub ran
  if [[ -n "${PBS_JOBID:-}" && -n "${PBS_O_WORKDIR:-}" ]]; then
    cd "$PBS_O_WORKDIR" || jaxllm_die "PBS_O_WORKDIR=$PBS_O_WORKDIR: cannot cd to it"
  fi
  if [[ "$(pwd -P)" != "$(cd "$JAXLLM_DIR" && pwd -P)" ]]; then
    JAXLLM_CONFIGS=$JAXLLM_DIR/configs
    jaxllm_export PYTHONPATH="$JAXLLM_DIR${PYTHONPATH:+:$PYTHONPATH}"  # jaxllm from JAXLLM_DIR, run from here
  else
    JAXLLM_CONFIGS=configs
  fi
}

# jaxllm_abspath PATH: PATH made absolute against the directory the script was run from.
jaxllm_abspath() {
  if [[ "$1" == /* ]]; then echo "$1"; else echo "$PWD/$1"; fi
}

# jaxllm_config_path FILE[:KEY]: the --config value with FILE absolute: the one in the directory the
# script was run from, else the repository's, else (an error for jaxllm.train to report) the first.
jaxllm_config_path() {
  local file=${1%%:*} key=""
  [[ "$1" != *:* ]] || key=:${1#*:}
  if [[ "$file" != /* && ! -e "$file" && -e "$JAXLLM_DIR/$file" ]]; then
    echo "$JAXLLM_DIR/$file$key"
  else
    echo "$(jaxllm_abspath "$file")$key"
  fi
}

# jaxllm_export NAME=VALUE...: exports and remembers them for the dry-run listing.
jaxllm_export() {
  local kv
  for kv in "$@"; do
    export "${kv?}"
    JAXLLM_EXPORTS+=("${kv%%=*}")
  done
}

# jaxllm_train_cmd WORLD_DEVICES [ARG...]: sets TRAIN_CMD (python -m jaxllm.train with the knobs'
# overrides and ARG... passed through), DP and GLOBAL_BATCH.
jaxllm_train_cmd() {
  local world=$1 config_file=() rest=() overrides=() a
  shift
  jaxllm_posint "world devices" "$world"
  local extra=()  # JAXLLM_ARGS: more flags as one variable (qsub passes a script only -v variables)
  if [[ -n "${JAXLLM_ARGS:-}" ]]; then read -ra extra <<< "$JAXLLM_ARGS"; fi
  JAXLLM_WORKDIR=runs/default  # jaxllm.train's default
  if [[ -n "${WORKDIR:-}" ]]; then WORKDIR=$(jaxllm_abspath "$WORKDIR"); JAXLLM_WORKDIR=$WORKDIR; fi
  if [[ -n "${DATA_FILE_LIST:-}" ]]; then DATA_FILE_LIST=$(jaxllm_abspath "$DATA_FILE_LIST"); fi
  for a in "$@" "${extra[@]}"; do
    case "$a" in
      --config=*) config_file=("--config=$(jaxllm_config_path "${a#--config=}")") ;;
      --workdir=*) JAXLLM_WORKDIR=$(jaxllm_abspath "${a#--workdir=}"); rest+=("--workdir=$JAXLLM_WORKDIR") ;;
      --config.data.file_list=?*) rest+=("--config.data.file_list=$(jaxllm_abspath "${a#--config.data.file_list=}")") ;;
      *) rest+=("$a") ;;
    esac
  done
  JAXLLM_WORKDIR=$(jaxllm_abspath "$JAXLLM_WORKDIR")
  # ALCF's train_llama_alcf.sh trains Llama unless NO_LLAMA is set; jaxllm keeps GPT-3 style the default
  # (MODEL_SIZE_KEY=GPT1_5B ... as documented) and LLAMA=1 selects the Llama recipe.
  case "${LLAMA:-}" in
    "" | 0) ;;
    1) [[ -z "${NO_LLAMA:-}" ]] || jaxllm_die "LLAMA=1 and NO_LLAMA=$NO_LLAMA: give one of them" ;;
    *) jaxllm_die "LLAMA=$LLAMA: 1 (configs/llama.py) or 0 (GPT-3 style, the default)" ;;
  esac
  if [[ "${LLAMA:-}" == 1 ]]; then
    [[ ${#config_file[@]} -eq 0 ]] || jaxllm_die "LLAMA=1 and ${config_file[0]}: give one of them"
    config_file=("--config=$JAXLLM_CONFIGS/llama.py:${MODEL_SIZE_KEY:-ALCF-7B}")
  elif [[ -n "${MODEL_SIZE_KEY:-}" ]]; then
    [[ ${#config_file[@]} -eq 0 ]] || jaxllm_die "MODEL_SIZE_KEY=$MODEL_SIZE_KEY and ${config_file[0]}: give one of them"
    config_file=("--config=$JAXLLM_CONFIGS/gpt3.py:$MODEL_SIZE_KEY")
  fi
  local tp=${TP:-1} pp=${PP:-1} sp=${SP:-1} ep=${EP:-1} mb=${MICRO_BATCH:-1} gas=${GAS:-1} name
  for name in TP PP SP EP MICRO_BATCH GAS SEQ_LEN; do
    if [[ -n "${!name:-}" ]]; then jaxllm_posint "$name" "${!name}"; fi
  done
  if (( world % (tp * pp * sp) )); then
    jaxllm_die "TP x PP x SP = $tp x $pp x $sp = $((tp * pp * sp)) does not divide the $world devices"
  fi
  DP=$((world / (tp * pp * sp)))
  if (( DP % ep )); then jaxllm_die "EP=$ep does not divide the data-parallel size DP = $DP (experts split DP)"; fi
  GLOBAL_BATCH=""
  if [[ -n "${TP:-}${PP:-}${SP:-}${EP:-}${MICRO_BATCH:-}${GAS:-}" ]]; then
    overrides+=("--config.mesh.tensor=$tp" "--config.mesh.pipeline=$pp" "--config.mesh.sequence=$sp"
                "--config.mesh.data=$((DP / ep))")
    if [[ -n "${EP:-}" ]]; then overrides+=("--config.mesh.expert=$ep"); fi
  fi
  if [[ -n "${MICRO_BATCH:-}${GAS:-}" ]]; then
    GLOBAL_BATCH=$((mb * gas * DP))
    overrides+=("--config.train.micro_batch_size=$mb" "--config.train.global_batch_size=$GLOBAL_BATCH")
  fi
  if [[ -n "${SEQ_LEN:-}" ]]; then overrides+=("--config.train.seq_length=$SEQ_LEN"); fi
  # SP_TYPE as in ALCF's Megatron-DeepSpeed scripts (megatron: Megatron-LM sequence parallelism
  # within TP; ds: DeepSpeed-Ulysses over SP), or one of jaxllm's sequence_impl values.
  case "${SP_TYPE:-}" in
    "") ;;
    megatron) overrides+=("--config.parallel.megatron_sp=True") ;;
    ds) overrides+=("--config.parallel.sequence_impl=ulysses") ;;
    allgather | ring | ulysses | usp) overrides+=("--config.parallel.sequence_impl=$SP_TYPE") ;;
    *) jaxllm_die "SP_TYPE=$SP_TYPE: choose megatron, ds (= ulysses), allgather, ring, ulysses or usp" ;;
  esac
  if [[ -n "${ZERO_STAGE:-}" ]]; then
    [[ "$ZERO_STAGE" =~ ^[0-3]$ ]] || jaxllm_die "ZERO_STAGE=$ZERO_STAGE: choose 0, 1, 2 or 3"
    overrides+=("--config.parallel.zero_stage=$ZERO_STAGE")
  fi
  jaxllm_recipe_overrides
  if [[ -n "${WORKDIR:-}" ]]; then overrides+=("--workdir=$WORKDIR"); fi
  TRAIN_CMD=("${PYTHON:-python}" -u -m jaxllm.train "${config_file[@]}" "${overrides[@]}" "${rest[@]}")
}

# jaxllm_recipe_overrides: appends to the caller's overrides the flags of ALCF's model and training
# knobs (train_llama_alcf.sh's names; the table above and in docs/clusters.md).
jaxllm_recipe_overrides() {
  local name
  for name in NUM_KV_HEAD FFN_HIDDEN_SIZE NUM_EXPERTS TRAIN_ITERS EVAL_ITERS LR_DECAY_ITERS; do
    if [[ -n "${!name:-}" ]]; then jaxllm_posint "$name" "${!name}"; fi
  done
  for name in EVAL_INTERVAL SAVE_INTERVAL TRAIN_SPLIT VAL_SPLIT TEST_SPLIT; do
    if [[ -n "${!name:-}" && ! "${!name}" =~ ^[0-9]+$ ]]; then jaxllm_die "$name=${!name}: must be an integer >= 0"; fi
  done
  # KNOB=key: the knob's value becomes the key's as given (jaxllm checks it: one line, exit 2)
  local pair knob key
  for pair in NUM_KV_HEAD=model.num_kv_heads FFN_HIDDEN_SIZE=model.ffn_hidden_size NUM_EXPERTS=model.num_experts \
              OPT=train.optimizer \
              LR=train.lr LR_DECAY_STYLE=train.lr_decay_style LR_DECAY_ITERS=train.lr_decay_iters \
              TRAIN_ITERS=train.train_iters EVAL_INTERVAL=train.eval_interval EVAL_ITERS=train.eval_iters \
              SAVE_INTERVAL=checkpoint.interval ADAM_BETA1=train.beta1 ADAM_BETA2=train.beta2 \
              ADAM_EPS=train.adam_eps WEIGHT_DECAY=train.weight_decay CLIP_GRAD=train.grad_clip \
              DATA_FILE_LIST=data.file_list; do
    knob=${pair%%=*} key=${pair#*=}
    if [[ -n "${!knob:-}" ]]; then overrides+=("--config.$key=${!knob}"); fi
  done
  # Megatron's --lr-warmup-fraction replaces the warmup iterations, which must then be 0
  if [[ -n "${LR_WARMUP_FRAC:-}" ]]; then
    overrides+=("--config.train.lr_warmup_fraction=$LR_WARMUP_FRAC" "--config.train.warmup_iters=0")
  fi
  if [[ -n "${TRAIN_SPLIT:-}${VAL_SPLIT:-}${TEST_SPLIT:-}" ]]; then
    overrides+=("--config.data.split=${TRAIN_SPLIT:-990},${VAL_SPLIT:-10},${TEST_SPLIT:-0}")
  fi
  # ALCF's pretrain_gpt_alcf.py logs to W&B project WB_PROJECT, else WANDB_PROJECT (default AuroraGPT); here
  # W&B stays off unless one of them is set
  local project=${WB_PROJECT:-${WANDB_PROJECT:-}}
  if [[ -n "$project" ]]; then overrides+=("--config.log.wandb=True" "--config.log.wandb_project=$project"); fi
  if [[ -n "${TOKENIZER_TYPE:-}" ]]; then
    local tok
    tok=$(jaxllm_tokenizer) || exit 2
    overrides+=("--config.data.tokenizer=$tok")
  fi
}

# jaxllm_tokenizer: data.tokenizer for TOKENIZER_TYPE (and ALCF's TOKENIZER_MODEL, the tokenizer's file).
jaxllm_tokenizer() {
  case "$TOKENIZER_TYPE" in
    gpt* | GPT*) echo gpt2 ;;  # ALCF's helpers.sh: any gpt*/GPT* is GPT2BPETokenizer
    char | byte) echo "$TOKENIZER_TYPE" ;;
    */* | *.json | *.model) echo "$TOKENIZER_TYPE" ;;  # a tokenizer.json or .model, or a directory holding one
    *)
      [[ -n "${TOKENIZER_MODEL:-}" ]] || jaxllm_die "TOKENIZER_TYPE=$TOKENIZER_TYPE: jaxllm reads a Hugging Face" \
        "tokenizer.json or a SentencePiece tokenizer.model; set TOKENIZER_MODEL (or TOKENIZER_TYPE) to its path," \
        "or TOKENIZER_TYPE=gpt2"
      echo "$TOKENIZER_MODEL" ;;
  esac
}

# jaxllm_summary NODES PROCESSES DEVICES: a comment line (also printed on dry runs).  A dry run
# also checks the config the job would run for its DEVICES (jaxllm.train --check_devices: one
# line, exit 2 for a bad config, nothing started).
jaxllm_summary() {
  local dp=config  # the mesh is the config's unless a knob pinned it
  if [[ -n "${TP:-}${PP:-}${SP:-}${EP:-}${MICRO_BATCH:-}${GAS:-}" ]]; then dp=$DP; fi
  echo "# jaxllm launch: nodes=$1 processes=$2 devices=$3 dp=$dp global_batch=${GLOBAL_BATCH:-config}"
  if [[ "$DRY_RUN" == 1 ]]; then
    local checked
    checked=$("${TRAIN_CMD[@]}" --check_devices="$3") || exit $?
    echo "# jaxllm check: $checked"
    echo "# jaxllm note: the data and tokenizer files are the cluster's: a dry run does not check them (the job reads them when it starts)"
  fi
}

# jaxllm_print CMD...: a dry run's listing: the exports and the command (shell-quoted).
jaxllm_print() {
  local v
  for v in "${JAXLLM_EXPORTS[@]}"; do printf 'export %s=%q\n' "$v" "${!v}"; done
  printf '%q ' "$@"
  printf '\n'
}

# jaxllm_stop: the trap of SIGTERM, SIGINT and SIGUSR1 to the script while the job runs: the scheduler
# (its time limit, scancel, qdel) or Ctrl-C ends the job, so it is not restarted.  (local.sh replaces it
# with one that also passes the signal on to its processes.)
# shellcheck disable=SC2329  # (invoked by the trap in jaxllm_run)
jaxllm_stop() {
  JAXLLM_STOPPING=1
}

# jaxllm_run CMD...: DRY_RUN=1: jaxllm_print.  Else runs CMD (the job: srun/mpiexec of TRAIN_CMD) and starts
# it again when it fails, as the header says; exits with its last status.
jaxllm_run() {
  if [[ "$DRY_RUN" == 1 ]]; then jaxllm_print "$@"; return; fi
  local max=${JAXLLM_MAX_RESTARTS:-3} min_time=${JAXLLM_RESTART_MIN_TIME:-300} restarts=0 status cause step
  local previous="" end left from shared local_step
  [[ "$max" =~ ^[0-9]+$ ]] || jaxllm_die "JAXLLM_MAX_RESTARTS=$max: must be an integer >= 0"
  [[ "$min_time" =~ ^[0-9]+$ ]] || jaxllm_die "JAXLLM_RESTART_MIN_TIME=$min_time: must be an integer >= 0 (seconds)"
  end=$(jaxllm_end_time)
  JAXLLM_STOPPING=0
  trap jaxllm_stop TERM INT USR1
  while :; do
    status=0
    "$@" || status=$?
    if (( status == 0 || status == 2 || status == 74 || status == 75 || JAXLLM_STOPPING )); then exit "$status"; fi
    cause="status $status"
    if (( status > 128 )) && kill -l $((status - 128)) >/dev/null 2>&1; then
      cause+=" (SIG$(kill -l $((status - 128))))"
    elif (( status == 70 )); then
      cause+=" (stalled)"
    fi
    cause+=" after step $(jaxllm_logged_step)"
    # The shared tier's newest step, and the node-local tier's of process 0 (this node), which jaxllm.train
    # restores when every process holds it (WORKDIR/checkpoints/local_tier names it; jaxllm says which it took)
    shared=$(jaxllm_newest_step "$JAXLLM_WORKDIR/checkpoints") local_step=""
    if [[ -f "$JAXLLM_WORKDIR/checkpoints/local_tier" ]]; then
      local_step=$(jaxllm_newest_step "$(< "$JAXLLM_WORKDIR/checkpoints/local_tier")")
    fi
    step=$shared
    if [[ -n "$local_step" ]] && (( local_step > ${shared:--1} )); then step=$local_step; fi
    if [[ "$previous" == "$status from $step" ]]; then
      echo "launch: not restarting: jaxllm.train failed with $cause, the same way as before from the same" \
        "checkpoint (${step:-none}); the job ends with status $status" >&2
      exit "$status"
    fi
    if (( restarts >= max )); then
      echo "launch: not restarting: jaxllm.train failed with $cause after $restarts restart(s)" \
        "(JAXLLM_MAX_RESTARTS=$max); the job ends with status $status" >&2
      exit "$status"
    fi
    if [[ -n "$end" ]] && (( (left = end - $(date +%s)) < min_time )); then
      echo "launch: not restarting: jaxllm.train failed with $cause and the allocation has ${left} s left" \
        "(JAXLLM_RESTART_MIN_TIME=$min_time); the job ends with status $status" >&2
      exit "$status"
    fi
    restarts=$((restarts + 1))
    previous="$status from $step"
    from="the checkpoint at step $step"
    [[ "$step" == "$shared" ]] || from+=" (node-local; step ${shared:-0} of $JAXLLM_WORKDIR/checkpoints if a node lacks it)"
    [[ -n "$step" ]] || from="the start (no checkpoint in $JAXLLM_WORKDIR/checkpoints)"
    echo "launch: restart $restarts of $max: jaxllm.train failed with $cause; resuming from $from" >&2
  done
}

# jaxllm_end_time: the allocation's end (seconds since the epoch), or nothing when unknown.
jaxllm_end_time() {
  if [[ -n "${SLURM_JOB_END_TIME:-}" ]]; then
    echo "$SLURM_JOB_END_TIME"
  elif [[ -n "${PBS_JOBID:-}" ]]; then
    local wall h m sec
    wall=$(qstat -f "$PBS_JOBID" 2>/dev/null | sed -n 's/^ *Resource_List.walltime = //p')
    if [[ "$wall" =~ ^([0-9]+):([0-9]+):([0-9]+)$ ]]; then
      h=${BASH_REMATCH[1]} m=${BASH_REMATCH[2]} sec=${BASH_REMATCH[3]}
      echo $((JAXLLM_STARTED + 10#$h * 3600 + 10#$m * 60 + 10#$sec))
    fi
  fi
}

# jaxllm_newest_step DIR: the newest complete checkpoint step in DIR, or nothing.  Orbax writes a step into
# STEP.orbax-checkpoint-tmp-* and renames it STEP when complete (jaxllm/runtime/checkpoint_tiers.py).
jaxllm_newest_step() {
  local d step="" n
  for d in "$1"/*/; do
    n=$(basename "$d")
    if [[ "$n" =~ ^[0-9]+$ ]] && (( ${#step} == 0 || n > step )); then step=$n; fi
  done
  echo "$step"
}

# jaxllm_logged_step: the last step in WORKDIR/metrics.jsonl (lines {"step": N, ...}), or 0.
jaxllm_logged_step() {
  local line
  line=$(tail -n 1 "$JAXLLM_WORKDIR/metrics.jsonl" 2>/dev/null) || true
  if [[ "$line" =~ ^\{\"step\":\ ([0-9]+) ]]; then echo "${BASH_REMATCH[1]}"; else echo 0; fi
}

# jaxllm_slurm_nodes: nodes of the Slurm allocation (a dry run outside Slurm: NNODES or 1).
jaxllm_slurm_nodes() {
  local n=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-${NNODES:-}}}
  if [[ -z "$n" ]]; then
    [[ "$DRY_RUN" == 1 ]] || jaxllm_die "not inside a Slurm allocation (submit with sbatch, or set DRY_RUN=1)"
    n=1
  fi
  jaxllm_posint SLURM_JOB_NUM_NODES "$n"
  echo "$n"
}
