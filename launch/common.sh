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
#                   a tokenizer.json path; Llama2Tokenizer, HFTokenizer, ...: the tokenizer.json TOKENIZER_MODEL names
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
  cd "$JAXLLM_DIR" || jaxllm_die "cannot cd to $JAXLLM_DIR"
  JAXLLM_EXPORTS=()
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
  for a in "$@" "${extra[@]}"; do
    if [[ "$a" == --config=* ]]; then config_file=("$a"); else rest+=("$a"); fi
  done
  # ALCF's train_llama_alcf.sh trains Llama unless NO_LLAMA is set; jaxllm keeps GPT-3 style the default
  # (MODEL_SIZE_KEY=GPT1_5B ... as documented) and LLAMA=1 selects the Llama recipe.
  case "${LLAMA:-}" in
    "" | 0) ;;
    1) [[ -z "${NO_LLAMA:-}" ]] || jaxllm_die "LLAMA=1 and NO_LLAMA=$NO_LLAMA: give one of them" ;;
    *) jaxllm_die "LLAMA=$LLAMA: 1 (configs/llama.py) or 0 (GPT-3 style, the default)" ;;
  esac
  if [[ "${LLAMA:-}" == 1 ]]; then
    [[ ${#config_file[@]} -eq 0 ]] || jaxllm_die "LLAMA=1 and ${config_file[0]}: give one of them"
    config_file=("--config=configs/llama.py:${MODEL_SIZE_KEY:-ALCF-7B}")
  elif [[ -n "${MODEL_SIZE_KEY:-}" ]]; then
    [[ ${#config_file[@]} -eq 0 ]] || jaxllm_die "MODEL_SIZE_KEY=$MODEL_SIZE_KEY and ${config_file[0]}: give one of them"
    config_file=("--config=configs/gpt3.py:$MODEL_SIZE_KEY")
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
    */* | *.json) echo "$TOKENIZER_TYPE" ;;  # a tokenizer.json, or a directory holding one
    *)
      [[ -n "${TOKENIZER_MODEL:-}" ]] || jaxllm_die "TOKENIZER_TYPE=$TOKENIZER_TYPE: jaxllm reads a Hugging Face" \
        "tokenizer.json; set TOKENIZER_MODEL (or TOKENIZER_TYPE) to its path, or TOKENIZER_TYPE=gpt2"
      [[ "$TOKENIZER_MODEL" != *.model ]] || jaxllm_die "TOKENIZER_MODEL=$TOKENIZER_MODEL: a SentencePiece model;" \
        "jaxllm reads a Hugging Face tokenizer.json (the model's, e.g. from its Hugging Face repository)"
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

# jaxllm_exec CMD...: DRY_RUN=1: print the exports and the command (shell-quoted); else run it.
jaxllm_exec() {
  if [[ "$DRY_RUN" == 1 ]]; then
    local v
    for v in "${JAXLLM_EXPORTS[@]}"; do printf 'export %s=%q\n' "$v" "${!v}"; done
    printf '%q ' "$@"
    printf '\n'
  else
    exec "$@"
  fi
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
