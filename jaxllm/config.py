"""The configuration: typed sections, every key and default in one place, resolved once.

A config file (``configs/*.py``) starts from :func:`get_config` and changes what it
needs; ``--config.SECTION.KEY=VALUE`` flags change the rest (ml-collections parses
them by each key's type).  This file is itself a valid config file: it is what
``python -m jaxllm.train`` runs with no ``--config`` (a small byte-level GPT on the
Python standard library's sources).

:class:`Config` has the sections ``model``, ``train``, ``data``, ``mesh``,
``parallel``, ``checkpoint`` and ``log``, each a dataclass whose fields are the keys
users type.  Assigning a key that does not exist is a :class:`ConfigError` naming the
closest key (or the jaxllm key for a Megatron-DeepSpeed name).  A size of 0 means
"derived".  :func:`jaxllm.resolve.resolve` checks every value (the divisibility checks
come from the rules table of :mod:`jaxllm.parallel.sharding` and the model's logical axes)
and returns a :class:`Resolved` config: read-only, derived sizes filled in, and the sizes
of the layout (mesh shape, data-parallel size, microbatches, pipeline stages) as fields,
so that no module computes them again.  This module imports nothing of the library but
its errors: everything else may import it.
"""

import dataclasses
import difflib
import sysconfig
from typing import Any, ClassVar

from jaxllm.errors import MEGATRON_NAMES, ConfigError

# the mesh axes, outermost first (jaxllm.parallel.sharding builds the mesh and maps logical axes to them)
MESH_AXES = ("data", "fsdp", "expert", "pipeline", "tensor", "sequence")

__all__ = ["Config", "ConfigError", "Resolved", "MESH_AXES", "OPTIMIZERS", "OPTIMIZER_ALIASES", "get_config",
           "from_dict", "override"]

# train.optimizer: optax's transformations (jaxllm.runtime.optim says what each is)
OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "lamb", "adafactor", "muon")
# ALCF Megatron-DeepSpeed's --optimizer names (its megatron/optimizer/__init__.py) -> the same optimizer here.
# Its "adam" is torch.optim.Adam (L2 weight decay), jaxllm's adam; Megatron-LM's "--optimizer adam" is AdamW
# unless --no-decoupled-weight-decay: jaxllm's adamw.
OPTIMIZER_ALIASES = {"apex.adam": "adamw", "apex.sgd": "sgd", "ds.fusedlamb": "lamb", "ipex.lamb": "lamb",
                     "ipex.fusedlamb": "lamb"}
# train.lr_decay_style and train.lr_wsd_decay_style: Megatron-LM's names
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


def _key(default, check: str | None = None, choices: tuple = ()):
    """A config key: its default, an optional range check (``">0"``, ``">=0"``) and allowed values."""
    return dataclasses.field(default=default, metadata={"check": check, "choices": choices})


def _derived(default=0):
    """A value :func:`jaxllm.resolve.resolve` computes; users cannot set it."""
    return dataclasses.field(default=default, metadata={"derived": True})


class Section:
    """Base of the config sections: assigning an unknown key is an error, and a resolved config is read-only."""

    name: ClassVar[str] = ""

    def __setattr__(self, key: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"{self.name or 'config'}.{key}: a resolved config is read-only; change the config before "
                "jaxllm.resolve.resolve (or use dataclasses.replace)")
        if key not in self.__dataclass_fields__:
            raise ConfigError(f"{self.name + '.' if self.name else ''}{key}", value, unknown_key_fix(self, key))
        object.__setattr__(self, key, value)

    def update(self, **values) -> "Section":
        """Sets several keys at once (as ``ConfigDict.update``); returns the section."""
        for key, value in values.items():
            setattr(self, key, value)
        return self

    def to_dict(self) -> dict:
        """The keys and values as nested plain dicts (JSON-ready)."""
        return dataclasses.asdict(self)

    def _freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)


@dataclasses.dataclass
class Model(Section):
    """The GPT's shape and numerics (see :mod:`jaxllm.model`)."""

    name: ClassVar[str] = "model"
    num_layers: int = _key(4, ">0")
    hidden_size: int = _key(256, ">0")
    num_attention_heads: int = _key(4, ">0")
    num_kv_heads: int = _key(0, ">=0")  # 0: = num_attention_heads (multi-head attention)
    # each attention head's size (Megatron-LM's --kv-channels; HF's head_dim); 0: hidden_size / num_attention_heads
    kv_channels: int = _key(0, ">=0")
    ffn_hidden_size: int = _key(0, ">=0")  # 0: 4 x hidden (gelu) or 8/3 x hidden rounded up to 64 (swiglu)
    vocab_size: int = _key(0, ">=0")  # 0: the tokenizer's vocabulary
    # the padding token's id (transformers' pad_token_id, its nn.Embedding's padding_idx): its row of the embedding
    # starts at zero and gets no gradient from the lookup (the tied output layer's still reaches it); -1: none
    pad_token_id: int = -1
    # the embedding and output tables are padded to a multiple of this x the tensor-parallel size (Megatron-LM's)
    make_vocab_size_divisible_by: int = _key(128, ">0")
    max_position_embeddings: int = _key(0, ">=0")  # positions of the learned table; 0: train.seq_length
    position_embedding: str = _key("learned", choices=("learned", "rotary"))
    rotary_base: float = _key(10000.0, ">0")
    # the windowed layers' own rotary base, without the model's scaling (Gemma 3's 10000); 0: the model's rotary
    local_rotary_base: float = _key(0.0, ">=0")
    # positions divided by this for rotary (Megatron-LM's; HF's rope type linear: Gemma 3's global layers' 8)
    rotary_seq_len_interpolation_factor: float = _key(1.0, ">0")
    # Llama 3.1's rotary frequency scaling (Megatron-LM's --use-rope-scaling, --rope-scaling-factor; HF's rope_type
    # llama3; jaxllm.model.layers.rotary_frequencies)
    use_rope_scaling: bool = False
    rope_scaling_factor: float = _key(8.0, ">0")
    rope_low_freq_factor: float = _key(1.0, ">0")
    rope_high_freq_factor: float = _key(4.0, ">0")
    rope_original_max_position_embeddings: int = _key(8192, ">0")
    # YaRN (Peng et al. 2023; Megatron-LM's --rope-type yarn and yarn_* names; HF's rope type yarn): jaxllm.model.rotary
    rope_type: str = _key("rope", choices=("rope", "yarn"))
    yarn_rotary_scaling_factor: float = _key(40.0, ">0")
    yarn_original_max_position_embeddings: int = _key(4096, ">0")
    yarn_beta_fast: float = _key(32.0, ">0")
    yarn_beta_slow: float = _key(1.0, ">0")
    yarn_mscale: float = _key(1.0, ">=0")
    yarn_mscale_all_dim: float = _key(0.0, ">=0")
    yarn_correction_range_round_to_int: bool = True
    norm: str = _key("layernorm", choices=("layernorm", "rmsnorm"))
    norm_eps: float = _key(1e-5, ">0")
    # gelu (tanh approximation), swiglu, geglu (Gemma's), quick_geglu (Megatron-LM's, gpt-oss's: layers.quick_geglu)
    activation: str = _key("gelu", choices=("gelu", "swiglu", "geglu", "quick_geglu"))
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float = _key(0.0, ">=0")
    apply_layernorm_1p: bool = False  # norms scale by 1 + w, w from 0 (Megatron-LM's --apply-layernorm-1p; Gemma)
    scale_embeddings: bool = False  # the token embeddings times sqrt(hidden_size) (Gemma; the output layer unscaled)
    softmax_scale: float = _key(0.0, ">=0")  # of attention's scores (Megatron-LM's); 0: 1/sqrt(query head width)
    # learnable: a logit per head in the softmax's denominator (attention sinks: gpt-oss; Megatron-LM's); off-by-one: 0
    softmax_type: str = _key("vanilla", choices=("vanilla", "off-by-one", "learnable"))
    use_bias: bool = True
    add_qkv_bias: bool = False  # biases on the query/key/value projections even without use_bias (Qwen2)
    qk_layernorm: bool = False  # model.norm over each head's queries and keys before rotary (Qwen3, OLMo 2)
    qk_layernorm_per_head: bool = True  # False: qk_layernorm over all heads' queries (keys) together (OLMo 2)
    # pre: x + f(norm(x)) (GPT-2, Llama); post: x + norm(f(x)) (OLMo 2); sandwich: x + norm(f(norm(x))) (Gemma 3)
    norm_placement: str = _key("pre", choices=("pre", "post", "sandwich"))
    # a token attends to itself and the sliding_window - 1 positions before it (Mistral; Megatron-LM's
    # --window-size (sliding_window - 1, 0)); 0: to every earlier position
    sliding_window: int = _key(0, ">=0")
    # the layers with the window (Megatron-LM's --window-attn-skip-freq): N, all but every N-th; 1/0 per layer; "": all
    window_attn_skip_freq: str = ""
    # multi-head latent attention (MLA: DeepSeek-V2 section 2.1, DeepSeek-V3; Megatron-LM's names and defaults;
    # jaxllm.model.layers.LatentAttention): queries through a rank-q_lora_rank latent (0: none), keys and values from
    # one of kv_lora_rank per token; qk_head_dim + qk_pos_emb_head_dim (rotary) query/key, v_head_dim value dimensions
    multi_latent_attention: bool = False
    q_lora_rank: int = _key(0, ">=0")
    kv_lora_rank: int = _key(32, ">0")
    qk_head_dim: int = _key(128, ">0")
    qk_pos_emb_head_dim: int = _key(64, ">0")
    v_head_dim: int = _key(128, ">0")
    tie_embeddings: bool = True
    dropout: float = _key(0.0, ">=0")
    init_std: float = _key(0.02, ">0")
    # what each layer keeps for the backward pass (jaxllm.model.remat.POLICIES, MaxText's names): none (all),
    # minimal_with_context, minimal (every layer matmul's output), save_dots, save_dots_except_mlp, save_qkv_proj,
    # full (only the layer's input: the layer is recomputed); *_offloaded: those outputs kept in host memory
    # instead; offload: full with the layer's input in host memory (backends with host memory: GPUs, CPUs)
    remat: str = _key("none", choices=("none", "minimal_with_context", "minimal", "save_dots", "save_dots_except_mlp",
                                       "save_qkv_proj", "full", "minimal_offloaded", "qkv_proj_offloaded", "offload"))
    # the MLP over this many chunks of each sequence, one at a time, each recomputed in the backward pass: its
    # [tokens, ffn_hidden_size] intermediates 1/mlp_chunks as large, for one more forward of the MLP (long
    # sequences, where they bound the length); train.seq_length / mesh.sequence must divide by it
    mlp_chunks: int = _key(1, ">0")
    # the layers as one jax.lax.scan (compile time independent of depth) or written out one after another;
    # auto: unrolled on CPUs and NVIDIA GPUs without remat (XLA zero-fills and copies a scan's stacked activations
    # every step; its schedule of unrolled layers keeps what remat would free), else scan (jaxllm.resolve.layer_loop)
    layer_loop: str = _key("auto", choices=("auto", "scan", "unrolled"))
    # compute dtype (parameters are float32); auto: float32 on CPUs (bfloat16 is emulated there, slower), else bfloat16
    dtype: str = _key("auto", choices=("auto", "float32", "bfloat16", "float16"))
    # auto: cuDNN's flash attention on NVIDIA GPUs, the Pallas kernel on ROCm, xla on CPUs (jaxllm.model.attention)
    attention_impl: str = _key("auto", choices=("auto", "xla", "cudnn", "pallas", "triton"))
    # the layer matmuls in FP8 (e4m3 forward, e5m2 gradients, current scaling; jaxllm.model.fp8): GPUs with FP8
    # matmuls (H100, H200, MI300); parameters, optimizer state, norms and the loss keep their dtypes
    fp8: bool = False
    # mixture of experts (Megatron-LM's names; jaxllm.model.moe): 0 experts is the dense MLP. Each token goes to
    # its moe_router_topk experts (token choice, float32 router), each an MLP of moe_ffn_hidden_size (0:
    # ffn_hidden_size); no token is dropped unless moe_capacity_factor > 0 (each expert then takes at most
    # capacity_factor x tokens x topk / num_experts of a micro batch's tokens, those of highest router probability)
    num_experts: int = _key(0, ">=0")
    moe_router_topk: int = _key(2, ">0")
    moe_ffn_hidden_size: int = _key(0, ">=0")
    moe_aux_loss_coeff: float = _key(0.0, ">=0")  # the Switch/GShard load-balancing loss's weight
    moe_z_loss_coeff: float = _key(0.0, ">=0")  # the router z-loss's weight (ST-MoE)
    moe_capacity_factor: float = _key(0.0, ">=0")
    # how expert parallelism (mesh.expert) brings tokens to their experts (Megatron-LM's dispatchers;
    # jaxllm.parallel.experts): allgather, every token to every device of the expert group; alltoall, each token
    # copy only to its expert's device, in buffers sized for the worst case; ragged, only the copies routed
    # (jax.lax.ragged_all_to_all); auto, the one that sends the fewest rows
    moe_token_dispatcher_type: str = _key("allgather", choices=("allgather", "alltoall", "ragged", "auto"))
    moe_shared_expert_intermediate_size: int = _key(0, ">=0")  # a dense MLP every token also takes; 0: none
    # the router (Megatron-LM's names and topk_routing_with_score_function): softmax or sigmoid scores (DeepSeek-V3;
    # the k chosen ones renormalized); pre_softmax: the softmax over all experts before the top k, not renormalized
    # (DeepSeek-V2); the combine weights times topk_scaling_factor (0: 1; DeepSeek-V3: 2.5); group-limited routing
    # (DeepSeek-V2/V3's device- and node-limited): the experts in num_groups groups, each token's top k taken from
    # its group_topk groups of highest sum of their top topk/group_topk scores (0, 0: no groups)
    moe_router_score_function: str = _key("softmax", choices=("softmax", "sigmoid"))
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float = _key(0.0, ">=0")
    moe_router_num_groups: int = _key(0, ">=0")
    moe_router_group_topk: int = _key(0, ">=0")
    # auxiliary-loss-free load balancing (DeepSeek-V3 section 2.1.2; Megatron-LM's names, sigmoid scores): a bias per
    # expert on the scores for the top-k choice only, moved after each step by bias_update_rate toward the mean load
    moe_router_enable_expert_bias: bool = False
    moe_router_bias: bool = False  # a learned bias on the router's logits (gpt-oss; Megatron-LM's with bias_linear)
    moe_router_bias_update_rate: float = _key(1e-3, ">=0")
    # which layers are mixtures of experts (Megatron-LM's --moe-layer-freq): k, every k-th layer from the first
    # (1: all); or one 0/1 per layer, "[0,0,1,1]" or Megatron's "([0]*3+[1]*58)" (DeepSeek-V3's 3 dense layers)
    moe_layer_freq: str = _key("1")
    # multi-token prediction (DeepSeek-V3 section 2.2; Megatron-LM's names): module k of mtp_num_layers predicts the
    # token k+1 ahead from module k-1's hidden states and the embedding of the token k ahead, through a layer of the
    # last layer's kind; their mean loss x mtp_loss_scaling_factor joins the objective (mtp_loss in the log)
    mtp_num_layers: int = _key(0, ">=0")
    mtp_loss_scaling_factor: float = _key(0.1, ">=0")
    padded_vocab_size: int = _derived()  # rows of the embedding and output tables

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def attention_head_dims(self) -> tuple[int, int]:
        """Each attention head's ``(query/key, value)`` widths: ``(head_dim, head_dim)``, or with
        ``multi_latent_attention`` ``(qk_head_dim + qk_pos_emb_head_dim, v_head_dim)``."""
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim, self.v_head_dim
        return self.head_dim, self.head_dim

    @property
    def window_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends within ``sliding_window`` (all False without one). Raises ConfigError:
        ``window_attn_skip_freq`` is neither "", a positive integer nor a 0/1 list of ``num_layers``."""
        text, n = self.window_attn_skip_freq.strip(), self.num_layers
        if not self.sliding_window or not text:
            return (bool(self.sliding_window),) * n
        pattern = tuple((i + 1) % int(text) != 0 for i in range(n)) if text.isdigit() and int(text) else (
            None if text.isdigit() else moe_layer_pattern(text, n))
        if pattern is None:
            raise ConfigError("model.window_attn_skip_freq", text, f"give N (all layers but every N-th keep the "
                              f"window) or one 1 (window) or 0 (none) per layer for the model.num_layers={n} "
                              "layers, as [1,1,0,1] or ([1]*5+[0]+[1]*2)")
        return pattern

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it is a mixture of experts (all False when ``num_experts`` is 0).

        Raises:
          ConfigError: ``moe_layer_freq`` is neither a positive integer nor a 0/1 list of ``num_layers`` entries.
        """
        if not self.num_experts:
            return (False,) * self.num_layers
        pattern = moe_layer_pattern(self.moe_layer_freq, self.num_layers)
        if pattern is None:
            raise ConfigError("model.moe_layer_freq", self.moe_layer_freq,
                              f"give k (every k-th layer from the first is a mixture of experts) or one 0/1 per "
                              f"layer for the model.num_layers={self.num_layers} layers, as [0,0,1,1] or "
                              f"([0]*1+[1]*{self.num_layers - 1})")
        return pattern


def moe_layer_pattern(text: str, num_layers: int) -> tuple[bool, ...] | None:
    """Megatron-LM's ``--moe-layer-freq`` (``moe_freq_type`` in its ``arguments.py``) read without ``eval``:
    an integer ``k`` > 0 (layer ``i`` is a mixture of experts when ``i % k == 0``), a list of 0/1 as
    ``[0,1,0,1]``, or a sum of repeated lists as ``([0]*3+[1]*9)``.  None when ``text`` is none of these or
    the list's length is not ``num_layers``."""
    text = text.strip().replace(" ", "")
    if text.isdigit():
        k = int(text)
        return tuple(i % k == 0 for i in range(num_layers)) if k > 0 else None
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    values = []
    for term in text.split("+"):
        body, _, times = term.partition("*")
        if not (body.startswith("[") and body.endswith("]")) or not (times.isdigit() or not times):
            return None
        items = body[1:-1].split(",") if body != "[]" else []
        if any(x not in ("0", "1") for x in items):
            return None
        values += [x == "1" for x in items] * (int(times) if times else 1)
    return tuple(values) if len(values) == num_layers else None


@dataclasses.dataclass
class Train(Section):
    """Batch, optimizer, schedule and evaluation (Megatron-LM's names)."""

    name: ClassVar[str] = "train"
    seq_length: int = _key(128, ">0")
    micro_batch_size: int = _key(16, ">0")
    global_batch_size: int = _key(16, ">0")
    train_iters: int = _key(400, ">0")
    # adamw, adam, sgd, lion, lamb, adafactor, muon (jaxllm/runtime/optim.py); ALCF's names apex.adam,
    # apex.sgd, ds.fusedlamb, ipex.lamb and ipex.fusedlamb are taken for the same optimizer
    optimizer: str = _key("adamw", choices=OPTIMIZERS + tuple(OPTIMIZER_ALIASES))
    lr: float = _key(2e-3, ">0")
    min_lr: float = _key(2e-4, ">=0")
    warmup_iters: int = _key(40, ">=0")
    # the warmup as a fraction of lr_decay_iters instead (Megatron's --lr-warmup-fraction; needs warmup_iters=0)
    lr_warmup_fraction: float = _key(0.0, ">=0")
    lr_decay_iters: int = _key(0, ">=0")  # 0: = train_iters
    # after the warmup (Megatron-LM's OptimizerParamScheduler, step for step): constant, linear, cosine,
    # inverse-square-root, or WSD: lr until lr_wsd_decay_iters before lr_decay_iters, then to min_lr by
    # lr_wsd_decay_style (exponential, linear, cosine, minus_sqrt)
    lr_decay_style: str = _key("cosine", choices=LR_DECAY_STYLES)
    lr_wsd_decay_style: str = _key("exponential", choices=LR_WSD_DECAY_STYLES)
    lr_wsd_decay_iters: int = _key(0, ">=0")
    weight_decay: float = _key(0.1, ">=0")
    beta1: float = _key(0.9, ">=0")
    beta2: float = _key(0.95, ">=0")
    adam_eps: float = _key(1e-8, ">0")
    sgd_momentum: float = _key(0.9, ">=0")  # train.optimizer=sgd; 0: plain SGD
    grad_clip: float = _key(1.0, ">=0")  # global-norm clipping; 0: off
    seed: int = _key(1234, ">=0")
    eval_interval: int = _key(100, ">=0")  # 0: no evaluation
    eval_iters: int = _key(10, ">0")
    log_interval: int = _key(20, ">0")
    # consecutive steps with a non-finite loss or gradient norm (each skipped: no update) after which
    # the run stops with an error; a diverged run rarely recovers
    max_nonfinite_steps: int = _key(10, ">0")
    # seconds a train step, an evaluation or a save may make no progress (a collective some devices
    # never reach) before the run stops with one line and exit status 70; 0: never
    stall_timeout_s: int = _key(600, ">=0")
    # multi-process runs: a process whose own step time (jaxllm/runtime/stragglers.py) is more than this
    # times the processes' median is named in one warning line; 0: never
    straggler_threshold: float = _key(1.3, ">=0")
    # JAX's persistent compilation cache: a restart reads the compiled programs instead of compiling them
    # again. A relative path is under WORKDIR; an absolute one may be shared by every run of a cluster
    # (docs/clusters.md); "": jaxllm sets none (JAX's own JAX_COMPILATION_CACHE_DIR still applies). The
    # default gives way to JAX_COMPILATION_CACHE_DIR when that is set (jaxllm/runtime/compile_cache.py)
    compile_cache_dir: str = "compile_cache"
    # programs that compile faster than this are not written to the cache (JAX's
    # jax_persistent_cache_min_compile_time_secs; 0: every program)
    compile_cache_min_compile_s: float = _key(1.0, ">=0")


def default_corpus() -> str:
    """The running interpreter's standard library directory (its ``.py`` files are the default corpus)."""
    return sysconfig.get_paths()["stdlib"]


@dataclasses.dataclass
class Data(Section):
    """Where the tokens come from and how batches are drawn (see :mod:`jaxllm.data` and docs/data.md:
    the Megatron-LM option each key stands for)."""

    name: ClassVar[str] = "data"
    # text files/directories (comma-separated; prepared into WORKDIR/data), or Megatron's
    # --data-path: "W1 PREFIX1 W2 PREFIX2 ..." or "PREFIX" (indexed datasets PREFIX.bin/.idx)
    input: str = dataclasses.field(default_factory=default_corpus)
    file_list: str = ""  # an ALCF data-file list ("weight prefix corpus" lines); when set, replaces input
    # char, byte, gpt2, or a Hugging Face tokenizer.json, a SentencePiece tokenizer.model (or a directory holding one)
    tokenizer: str = "byte"
    # tokenizer=gpt2: a directory with GPT-2's encoder.json and vocab.bpe; "": the files shipped with jaxllm
    gpt2_dir: str = ""
    json_key: str = "text"  # text inputs: the text's key in JSON Lines records / column in Parquet files
    document_marker: str = ""  # text inputs: a line starting with this begins a new document ("": one per file)
    split: str = "969,30,1"  # Megatron's --split: train, validation, test weights
    # megatron: GPTDataset/BlendedDataset order; uniform: nanoGPT's random windows
    sampling: str = _key("megatron", choices=("megatron", "uniform"))
    cache_dir: str = ""  # sample indices (Megatron's --data-cache-path); "": index-cache/ beside the data
    reset_position_ids: bool = False  # positions restart after each end-of-document token
    reset_attention_mask: bool = False  # attention stays within documents (segment ids)
    # with reset_attention_mask: the most documents a sample may hold, the static bound cuDNN's packed
    # attention needs on NVIDIA (its softmax statistics are float32 [micro batch x this, heads, seq]); a sample
    # with more stops the run (DataError) before its step. 0: no bound, segment ids go to the Pallas kernel
    max_documents_per_sample: int = _key(0, ">=0")
    eod_mask_loss: bool = False  # no loss where the input is the end-of-document token
    # text inputs: the largest fraction of an input's characters that may fail to decode as UTF-8
    # (or be NUL): a binary file given by mistake stops the run; 1.0 keeps anything
    max_undecodable: float = _key(0.01, ">=0")


@dataclasses.dataclass
class Mesh(Section):
    """Devices along each mesh axis: ``AXIS`` within a node (-1 on one axis: fill with what is
    left), ``dcn_AXIS`` across nodes (the slow network); the axis spans ``AXIS x dcn_AXIS`` devices."""

    name: ClassVar[str] = "mesh"
    data: int = 1
    fsdp: int = 1
    pipeline: int = 1
    tensor: int = 1
    sequence: int = 1
    expert: int = 1  # the experts' weights split over it (Megatron's --expert-model-parallel-size), batch too
    # the experts' hidden dimension split over this many of the tensor devices (Megatron's
    # --expert-tensor-parallel-size): 0, all of them (mesh.tensor x mesh.dcn_tensor); 1, none: the tensor devices
    # then hold other experts and take their share of the tokens, as expert-parallel ones (jaxllm.parallel.experts)
    expert_tensor: int = _key(0, ">=0")
    dcn_data: int = 1
    dcn_fsdp: int = 1
    dcn_expert: int = 1
    dcn_pipeline: int = 1
    dcn_tensor: int = 1
    dcn_sequence: int = 1

    def devices(self) -> dict[str, int]:
        """Devices along each axis, ``AXIS`` and ``dcn_AXIS`` (the keys but ``expert_tensor``)."""
        return {k: v for k, v in self.to_dict().items() if k != "expert_tensor"}


@dataclasses.dataclass
class Parallel(Section):
    """How the mesh axes are used beyond the rules table."""

    name: ClassVar[str] = "parallel"
    zero_stage: int = _key(0, choices=(0, 1, 2, 3))
    megatron_sp: bool = False  # Megatron sequence parallelism: the residual stream split over tensor too
    # with mesh.pipeline > 1 the step's microbatches flow through the stages (jaxllm/parallel/pipeline.py): gpipe;
    # 1f1b and zb_h1 (memory bounded by the stages, not the microbatches); interleaved and
    # interleaved_1f1b with pipeline_virtual_stages chunks of layers per device
    pipeline_schedule: str = _key("gpipe", choices=("gpipe", "interleaved", "1f1b", "interleaved_1f1b", "zb_h1"))
    pipeline_virtual_stages: int = _key(1, ">0")
    # attention with mesh.sequence > 1: allgather (keys/values gathered), ring (context
    # parallelism, load-balanced), ulysses (all-to-all to heads), usp (ulysses inside groups of
    # ulysses_degree devices, ring across the groups)
    sequence_impl: str = _key("allgather", choices=("allgather", "ring", "ulysses", "usp"))
    # usp: consecutive devices of the sequence axis in each all-to-all group; 0: mesh.sequence (a node's),
    # so the ring runs over mesh.dcn_sequence
    ulysses_degree: int = _key(0, ">=0")


@dataclasses.dataclass
class Checkpoint(Section):
    name: ClassVar[str] = "checkpoint"
    interval: int = _key(100, ">=0")  # steps between saves (a crash loses at most this many); 0: only at the end
    keep: int = _key(2, ">0")  # most recent checkpoints kept
    keep_period: int = _key(0, ">=0")  # also keep every checkpoint whose step is a multiple of this; 0: off
    # the node-local tier (docs/checkpoints.md): each process's shards in a directory on its node (NVMe, /tmp)
    # every local_interval steps (the last `keep`); a restart resumes from it when every process has the step
    local_dir: str = ""  # "": no node-local tier
    local_interval: int = _key(0, ">=0")  # steps between node-local saves; 0: none
    # a failed save (full disk or quota) stops the run, exit 74; False: one warning line and training goes on
    # (never past the run's last save: a run whose last checkpoint is not saved never ends with status 0)
    fail_on_save_error: bool = True


@dataclasses.dataclass
class Log(Section):
    name: ClassVar[str] = "log"
    tensorboard: bool = True
    progress_bar: bool = True  # only drawn when stdout is a terminal
    verbose: bool = False  # library chatter (Gloo, XLA warnings, other processes' logs) on the console, not in logs/
    samples: int = _key(1, ">=0")  # text samples printed at the end of training
    sample_tokens: int = _key(256, ">=0")  # tokens of each sample: >= 1 when log.samples > 0 (resolve checks)
    sample_prompt: str = ""  # "": the first tokens of the validation split
    temperature: float = _key(0.8, ">0")
    top_k: int = _key(200, ">=0")
    # Weights & Biases (pip install 'jaxllm[wandb]'): process 0 sends metrics.jsonl's rows and the resolved config;
    # files in WORKDIR/wandb, the run's id in WORKDIR/wandb_run_id (a restart resumes the same W&B run). W&B's
    # variables apply: WANDB_MODE=offline (or disabled), WANDB_API_KEY, ...
    wandb: bool = False
    wandb_project: str = "jaxllm"  # "": W&B's default (WANDB_PROJECT, else "uncategorized")
    wandb_name: str = ""  # the run's display name; "": the WORKDIR's name
    wandb_entity: str = ""  # the W&B user or team; "": your default entity


@dataclasses.dataclass
class Config(Section):
    """A run's configuration, as config files and flags write it (see the module docstring)."""

    model: Model = dataclasses.field(default_factory=Model)
    train: Train = dataclasses.field(default_factory=Train)
    data: Data = dataclasses.field(default_factory=Data)
    mesh: Mesh = dataclasses.field(default_factory=Mesh)
    parallel: Parallel = dataclasses.field(default_factory=Parallel)
    checkpoint: Checkpoint = dataclasses.field(default_factory=Checkpoint)
    log: Log = dataclasses.field(default_factory=Log)

    def sections(self) -> dict[str, Section]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Config)}

    def to_dict(self) -> dict:
        """The seven sections as nested plain dicts (derived layout sizes left out)."""
        return {name: section.to_dict() for name, section in self.sections().items()}


@dataclasses.dataclass
class Resolved(Config):
    """A config after :func:`jaxllm.resolve.resolve`: every value checked, derived sizes filled, read-only.

    Beyond the sections (where ``model.dtype``, ``model.layer_loop``, ``model.num_kv_heads``, ``model.ffn_hidden_size``,
    ``model.max_position_embeddings``, ``model.padded_vocab_size``, ``train.lr_decay_iters`` and any -1 mesh axis are
    filled in, and an alias of ``train.optimizer`` is replaced by its name):"""

    # the kind of machine the run is for (jaxllm.platform.hardware.backend_kind): "cpu", "cuda", "rocm", ...
    backend: str = ""
    num_devices: int = 0  # devices the mesh covers
    mesh_shape: dict = dataclasses.field(default_factory=dict)  # devices along each mesh axis (ICI x DCN)
    data_parallel: int = 0  # replicas the global batch is split over: the data x fsdp x expert axes
    microbatches: int = 0  # micro batches per step and replica: global / (micro batch x data_parallel)
    stages: int = 0  # pipeline stages: devices along the pipeline axis
    # a step's batch as the train step takes it: [microbatches, micro batch x data_parallel, seq_length]
    batch_shape: tuple = ()


def get_config() -> Config:
    """Every default of jaxllm."""
    return Config()


# ----- unknown keys -------------------------------------------------------------------------


def unknown_key_fix(holder, key: str) -> str:
    """The fix for an unknown ``key`` of ``holder`` (a :class:`Config` or one of its sections)."""
    if isinstance(holder, Config):
        known = [f.name for f in dataclasses.fields(Config)]
        what = f"no such section; the sections are {', '.join(known)}"
    else:
        known = [f.name for f in dataclasses.fields(holder) if not f.metadata.get("derived")]
        derived = key in holder.__dataclass_fields__
        what = ("is derived (computed from the other keys), not set" if derived
                else f"no such key in section {holder.name}")
    hint = MEGATRON_NAMES.get(key.replace("-", "_"))
    if hint:
        return f"{what}; Megatron-DeepSpeed's {key} is {hint} in jaxllm"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    prefix = f"{holder.name}." if isinstance(holder, Section) and holder.name else ""
    return f"{what}; did you mean {prefix}{close[0]}?" if close else f"{what}; see jaxllm/config.py for the keys"


def check_key(path: str, value=None) -> None:
    """Raises :class:`ConfigError` unless ``SECTION.KEY`` (or ``SECTION``) names a key users can set
    (``value``: what they gave it, for the message)."""
    parts = path.split(".")
    if parts[0] not in Config.__dataclass_fields__:
        raise ConfigError(path, value, unknown_key_fix(Config(), parts[0]))
    if len(parts) == 1:
        return
    holder = Config.__dataclass_fields__[parts[0]].default_factory()
    field = holder.__dataclass_fields__.get(parts[1])
    if len(parts) > 2 or field is None or field.metadata.get("derived"):
        raise ConfigError(path, value, unknown_key_fix(holder, parts[1]))


TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def key_type(path: str) -> type:
    """The type of ``SECTION.KEY`` (``int``, ``float``, ``str`` or ``bool``)."""
    check_key(path)
    section, name = path.split(".")
    return Config.__dataclass_fields__[section].default_factory.__dataclass_fields__[name].type


def type_name(path: str) -> str:
    """``"an integer"``, ``"a number"``, ``"a string"`` or ``"true or false"``: what ``SECTION.KEY`` takes."""
    return TYPE_NAMES[key_type(path)]


def choices(path: str) -> tuple:
    """The values ``SECTION.KEY`` accepts (empty: any of its type)."""
    check_key(path)
    section, name = path.split(".")
    return Config.__dataclass_fields__[section].default_factory.__dataclass_fields__[name].metadata.get("choices", ())


def override(cfg: Config, key: str, text: str) -> None:
    """Sets ``SECTION.KEY`` of ``cfg`` from a string, parsed as the key's type (as a flag would be).

    Raises:
      ConfigError: an unknown key, or a value that does not parse as its type.
    """
    kind = key_type(key)
    section, name = key.split(".")
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            value = text.lower() in ("true", "1", "yes")
        else:
            value = kind(text)
    except ValueError:
        raise ConfigError(key, text, f"must be {TYPE_NAMES[kind]}") from None
    setattr(getattr(cfg, section), name, value)


def from_dict(values: dict) -> Config:
    """A :class:`Config` from nested dicts (as :meth:`Config.to_dict` writes them, e.g. a checkpoint's).

    Missing keys keep their defaults; derived keys are ignored (:func:`jaxllm.resolve.resolve` computes them).
    Raises:
      ConfigError: an unknown section or key.
    """
    cfg = Config()
    for section, keys in values.items():
        if section not in Config.__dataclass_fields__:
            if section in Resolved.__dataclass_fields__:
                continue  # a derived layout size
            raise ConfigError(section, None, unknown_key_fix(cfg, section))
        holder = getattr(cfg, section)
        for key, value in keys.items():
            field = holder.__dataclass_fields__.get(key)
            if field is not None and field.metadata.get("derived"):
                continue
            setattr(holder, key, value)
    return cfg
