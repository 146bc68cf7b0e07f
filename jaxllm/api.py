"""The public API for other programs: a trained run's model, and the layout for a training loop of your own.

    import jaxllm

    run = jaxllm.load("runs/default")               # the latest checkpoint (step=N: another)
    logits = run.logits(run.tokenizer.encode("def f():")[None])   # float32 [1, len, vocab_size]
    scores = run.score("import os\\n")              # float32 [len - 1]: ln p(token | the tokens before)
    text = run.generate("def f():", num_tokens=64)  # the continuation, a str

    mesh = jaxllm.make_mesh(run.config)             # the run's mesh (its devices must be here)
    params = jax.device_put(run.params, jaxllm.shardings(run.config, mesh))

:func:`load` reads what ``python -m jaxllm.train`` (or ``python -m jaxllm.convert --from-hf``)
wrote into a run directory: the config and parameters of a checkpoint and the tokenizer, and
gives a :class:`TrainedModel`.  :func:`shardings` and :func:`optimizer_shardings` are the
layouts the training loop itself uses, from the one rules table (:data:`RULES`, :func:`rules`;
see :mod:`jaxllm.parallel.sharding`).  Everything runs on the host's default JAX backend.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import MESH_AXES, Config, Resolved
from jaxllm.data import blend
from jaxllm.data.loader import Data
from jaxllm.data.tokenizers import make_tokenizer
from jaxllm.errors import DataError
from jaxllm.model import attention, gpt
from jaxllm.parallel import sharding
from jaxllm.parallel.sharding import RULES, rules
from jaxllm.resolve import resolve
from jaxllm.runtime import checkpoint, checkpoint_tiers, optim
from jaxllm.runtime.sampling import Sampler

__all__ = ["RULES", "TrainedModel", "load", "make_mesh", "optimizer_shardings", "rules", "shardings"]


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class TrainedModel:
    """A checkpoint of a training run, ready to run on this host (:func:`load` makes it).

    Attributes:
      workdir: the run directory; step: the checkpoint's step (training steps completed).
      config: the run's :class:`~jaxllm.config.Resolved` config: its mesh as trained
        (``config.mesh_shape``), its model as it runs here (``config.model``: ``vocab_size`` real
        tokens, tables of ``padded_vocab_size`` rows).
      params: the parameters, a plain nested dict of float32 ``jax.Array`` on the default device,
        shaped as ``jaxllm.model.gpt.describe(config.model).params``.
      tokenizer: the run's tokenizer (``encode(str) -> int32 [n]``, ``decode(ids) -> str``,
        ``vocab_size``; :mod:`jaxllm.data.tokenizers`).
      graphdef: the model's Flax NNX graph definition: ``jaxllm.model.gpt.forward(graphdef, params,
        tokens)`` is the model (its logits span the padded rows, masked to -1e30).
    """

    workdir: str
    step: int
    config: Resolved
    params: dict
    tokenizer: Any
    graphdef: Any

    def __repr__(self) -> str:
        m = self.config.model
        return (f"TrainedModel(workdir={self.workdir!r}, step={self.step}, "
                f"{gpt.num_params(self.params) / 1e6:.2f}M parameters, {m.num_layers} layers, hidden "
                f"{m.hidden_size}, vocab_size {m.vocab_size}, tokenizer {self.tokenizer.name})")

    @property
    def vocab_size(self) -> int:
        """Tokens of the model's vocabulary (the tokenizer's): the last axis of :meth:`logits`."""
        return self.config.model.vocab_size

    @property
    def max_length(self) -> int | None:
        """The longest sequence :meth:`logits` takes: the learned position
        table's ``model.max_position_embeddings``; None with rotary positions (any length runs,
        but positions beyond ``train.seq_length`` were never trained on)."""
        m = self.config.model
        return m.max_position_embeddings if m.position_embedding == "learned" else None

    def _tokens(self, tokens, what: str, limit: bool = True) -> np.ndarray:
        """``tokens`` as int32 ``[batch, len]``, checked (ValueError naming the problem); ``limit``: at
        most :attr:`max_length` tokens."""
        t = np.asarray(tokens)
        if not np.issubdtype(t.dtype, np.integer) or t.ndim != 2 or t.shape[1] == 0:
            raise ValueError(f"{what}: token ids must be integers of shape [batch, len] with len >= 1, got "
                             f"{t.dtype} {t.shape}")
        if t.size and (t.min() < 0 or t.max() >= self.vocab_size):
            raise ValueError(f"{what}: token ids must be in [0, {self.vocab_size}) (the model's vocabulary), got "
                             f"{t.min()}..{t.max()}")
        if limit and self.max_length is not None and t.shape[1] > self.max_length:
            raise ValueError(f"{what}: {t.shape[1]} tokens, more than the learned position table's "
                             f"{self.max_length} (model.max_position_embeddings); pass at most {self.max_length}")
        return t.astype(np.int32)

    @functools.cached_property
    def _forward(self):
        graphdef, vocab = self.graphdef, self.vocab_size
        return jax.jit(lambda params, tokens: gpt.forward(graphdef, params, tokens)[..., :vocab])

    @functools.cached_property
    def _log_likelihoods(self):
        graphdef = self.graphdef

        def log_likelihoods(params, tokens):  # tokens [batch, n] -> [batch, n - 1]
            logp = jax.nn.log_softmax(gpt.forward(graphdef, params, tokens[:, :-1]), axis=-1)
            return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]

        return jax.jit(log_likelihoods)

    @functools.cached_property
    def _sampler(self) -> Sampler:
        return Sampler(self.config.model, self.graphdef, self.params, self.config.train.seq_length)

    def logits(self, tokens) -> np.ndarray:
        """The model's next-token logits after every prefix of each row of ``tokens``.

        Args:
          tokens: int ``[batch, len]`` token ids in ``[0, vocab_size)``; ``len`` at most
            :attr:`max_length` (learned positions).  Row ``b`` is one sequence starting at position 0.
        Returns:
          float32 numpy ``[batch, len, vocab_size]``: entry ``[b, i]`` are the unnormalized log
          probabilities (natural log, up to a constant per position) of the token after
          ``tokens[b, :i + 1]``, over the real vocabulary only (the padded table rows are cut off).
        Raises:
          ValueError: not an integer ``[batch, len]`` array, an id outside the vocabulary, or too long.
        """
        return np.asarray(self._forward(self.params, self._tokens(tokens, "logits")), np.float32)

    def score(self, text: str) -> np.ndarray:
        """Per-token log-likelihoods of ``text`` under the model.

        The text is encoded with the run's tokenizer into ``n`` tokens.  The model has no
        beginning-of-text token, so the first token is context only and is not scored (nothing
        precedes it to predict it from): entry ``i`` is ``ln p(token[i + 1] | token[0], ..., token[i])``,
        and ``-score(text).mean()`` is the loss training reports (nats/token).  A text longer than
        the training context (``n - 1 > train.seq_length = L``) is scored in windows of ``L`` tokens,
        each starting ``L // 2`` after the previous one (the last one ending at the text's end):
        the first ``L`` entries are conditioned on every token before them, the later ones on at
        least the ``L // 2`` before them.

        Returns:
          float32 numpy ``[n - 1]``, natural log (nats), each <= 0.
        Raises:
          ValueError: ``text`` encodes to fewer than 2 tokens.
        """
        ids = np.asarray(self.tokenizer.encode(text), np.int32)
        if ids.size < 2:
            raise ValueError(f"score: {text!r} is {ids.size} token(s); at least 2 are needed (the first is the "
                             "context of the second)")
        self._tokens(ids[None], "score", limit=False)  # ids within the model's vocabulary
        window, targets = self.config.train.seq_length, ids.size - 1
        if targets <= window:
            return np.asarray(self._log_likelihoods(self.params, ids[None])[0], np.float32)
        starts = [*range(0, targets - window, max(1, window // 2)), targets - window]
        scores = np.asarray(self._log_likelihoods(self.params, np.stack([ids[s:s + window + 1] for s in starts])))
        out, done = np.empty(targets, np.float32), 0
        for row, s in zip(scores, starts):  # each target from the first window that scores it with context
            out[done:s + window] = row[done - s:]
            done = s + window
        return out

    def sample(self, tokens, num_tokens: int, *, temperature: float = 0.8, top_k: int = 200,
               seed: int = 0) -> np.ndarray:
        """Continues each row of ``tokens`` (int ``[batch, len]``, len >= 1) by ``num_tokens`` token ids,
        with the KV-cache sampler of ``python -m jaxllm.generate`` (:class:`jaxllm.runtime.sampling.Sampler`;
        the arguments as :meth:`generate`).

        Returns:
          int32 numpy ``[batch, num_tokens]``, the new ids only.
        Raises:
          ValueError: bad ``tokens`` (as :meth:`logits`, any length), ``num_tokens`` < 0,
            ``temperature`` <= 0 or ``top_k`` < 0.
        """
        if temperature <= 0:
            raise ValueError(f"temperature={temperature}: must be > 0 (top_k=1 is greedy decoding)")
        if top_k < 0 or num_tokens < 0:
            raise ValueError(f"top_k={top_k}, num_tokens={num_tokens}: both must be >= 0")
        t = self._tokens(tokens, "sample", limit=False)
        if num_tokens == 0:
            return np.zeros((t.shape[0], 0), np.int32)
        return self._sampler(t, num_tokens, temperature=temperature, top_k=top_k, seed=seed)

    def generate(self, prompt: str, num_tokens: int = 256, *, temperature: float = 0.8, top_k: int = 200,
                 seed: int = 0) -> str:
        """Text the model writes after ``prompt``, as ``python -m jaxllm.generate`` samples it.

        Args:
          prompt: the text to continue ("": a newline, as ``jaxllm.generate``).
          num_tokens: tokens to generate (the text's length in tokens, not characters).
          temperature: the logits are divided by it (> 0; lower: more likely tokens).
          top_k: sample among the ``top_k`` most likely tokens; 1 is greedy decoding; 0 the whole vocabulary.
          seed: the sampling seed (the same arguments give the same text).
        Returns:
          the generated text after the prompt (the prompt not included).  Beyond ``train.seq_length``
          tokens of context the sampler re-encodes the last half and goes on (the model never sees
          positions it was not trained on).
        Raises:
          ValueError: as :meth:`sample`.
        """
        ids = np.asarray(self.tokenizer.encode(prompt or "\n"), np.int32)
        return self.tokenizer.decode(self.sample(ids[None], num_tokens, temperature=temperature, top_k=top_k,
                                                 seed=seed)[0].tolist())


def _steps(workdir: str) -> list[int]:
    """The finalized checkpoint steps of ``workdir``, ascending (``checkpoints/`` must exist: Orbax's
    manager would create it)."""
    manager = checkpoint_tiers.shared_manager(workdir)
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()


def _tokenizer(saved: Config, workdir: str):
    """The run's tokenizer.  Text inputs are prepared with ``data.tokenizer`` itself, so byte, gpt2 and
    Hugging Face tokenizers are built directly (nothing of the data is read: the corpus need not be
    on this machine); a char tokenizer (fitted to the corpus) and indexed datasets (their
    ``.meta.json`` names the tokenizer) are read as training reads them (:class:`jaxllm.data.loader.Data`)."""
    d = saved.data
    if d.tokenizer != "char" and not d.file_list and blend.parse_data_path(d.input) is None:
        return make_tokenizer(d.tokenizer, d.gpt2_dir)
    return Data(saved, workdir, splits=(), quiet=True).tokenizer  # a loaded run says nothing of its data


def load(workdir: str, step: int | None = None) -> TrainedModel:
    """The checkpoint of the run in ``workdir`` at ``step`` (default: the latest), ready to run here.

    The run may have trained on any mesh and backend: the parameters are read whole onto this
    host's default device.  The config is resolved as the run was (``config.mesh_shape`` is its
    layout; nothing of the data is checked), for this backend: an attention implementation the
    backend lacks (``cudnn`` from a GPU run, loaded on a CPU) is replaced by ``auto`` (the same
    function, computed by what runs here).

    Args:
      workdir: the run directory, a str or path (``--workdir`` of ``python -m jaxllm.train``, or the one
        ``python -m jaxllm.convert --from-hf DIR WORKDIR`` wrote).
      step: the checkpoint's step (a directory name under ``WORKDIR/checkpoints/``); None: the latest.
    Returns:
      a :class:`TrainedModel`.
    Raises:
      FileNotFoundError: ``workdir`` does not exist, holds no checkpoint, or none at ``step``
        (the message lists the steps there are).
      jaxllm.errors.DataError: the tokenizer cannot be rebuilt (its files are gone or changed).
      jaxllm.runtime.checkpoint.CheckpointError, or Orbax's errors: the checkpoint cannot be read.
    """
    workdir = os.fspath(workdir)
    checkpoints = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"{workdir}: no such run directory; give the --workdir of a training run "
                                "(python -m jaxllm.train --workdir=DIR)")
    steps = _steps(workdir) if os.path.isdir(checkpoints) else []
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {checkpoints}: train first (python -m jaxllm.train "
                                f"--workdir={workdir}), or import one (python -m jaxllm.convert --from-hf DIR "
                                f"{workdir})")
    if step is None:
        step = steps[-1]
    elif not isinstance(step, int | np.integer) or int(step) not in steps:
        raise FileNotFoundError(f"no checkpoint at step {step!r} in {checkpoints}: it holds steps "
                                f"{', '.join(map(str, steps))}; pass one of them, or step=None for the latest "
                                f"({steps[-1]})")
    step = int(step)
    saved = checkpoint.load_config(workdir, step)
    try:
        tokenizer = _tokenizer(saved, workdir)
    except DataError as e:
        raise DataError(f"{workdir}: the run's tokenizer cannot be rebuilt: {e}") from None
    try:
        attention.resolve_impl(saved.model.attention_impl)
    except ValueError:
        saved.model.attention_impl = "auto"
    cfg = resolve(saved, num_devices=None, vocab_size=tokenizer.vocab_size, data_files=False)
    params = jax.device_put(checkpoint.restore_params(cfg.model, workdir, step), jax.devices()[0])
    return TrainedModel(workdir, step, cfg, params, tokenizer, gpt.describe(cfg.model).graphdef)


def make_mesh(config: Resolved, devices=None) -> jax.sharding.Mesh:
    """The device mesh of ``config`` (axes ``data, fsdp, pipeline, tensor, sequence``, sized as
    ``config.mesh_shape``), as the training loop builds it (:func:`jaxllm.parallel.sharding.make_mesh`).

    Args:
      config: a resolved config.
      devices: ``config.num_devices`` devices; None: the first ``config.num_devices`` of ``jax.devices()``.
    Raises:
      ValueError: not as many devices as the config's mesh covers.
    """
    devices = jax.devices()[:config.num_devices] if devices is None else list(devices)
    if len(devices) != config.num_devices:
        raise ValueError(f"the config's mesh {config.mesh_shape} covers {config.num_devices} devices, and "
                         f"{len(devices)} are given (this host has {jax.device_count()}); resolve a config for "
                         "these devices: jaxllm.resolve.resolve(config, num_devices=...) with other mesh.* sizes")
    return sharding.make_mesh(config, devices)


def _check_layout(config, mesh) -> None:
    if not isinstance(config, Resolved):
        raise TypeError(f"a resolved config is needed, got {type(config).__name__}: "
                        "jaxllm.resolve.resolve(config, num_devices=jax.device_count(), vocab_size=...)")
    if tuple(mesh.axis_names) != MESH_AXES or dict(mesh.shape) != config.mesh_shape:
        raise ValueError(f"the mesh {dict(mesh.shape)} is not the config's {config.mesh_shape}: make it with "
                         "jaxllm.make_mesh(config), or resolve a config with these mesh.* sizes")


def shardings(config: Resolved, mesh: jax.sharding.Mesh) -> dict:
    """Where each parameter lives in a run of ``config`` on ``mesh``: what the training loop uses.

    The rules table (:func:`rules`; ZeRO's from stage 3, :func:`jaxllm.parallel.sharding.zero_tables`) applied
    to the model's logical axes: e.g. with ``mesh.tensor`` > 1 the attention's ``wq`` ``[layers, embed, heads,
    head_dim]`` is ``PartitionSpec("pipeline", "fsdp", "tensor", None)`` (column-parallel) and the
    embedding ``wte`` ``[padded_vocab, embed]`` ``PartitionSpec("tensor", "fsdp")`` (vocabulary-parallel).

    Args:
      config: a resolved config (:attr:`TrainedModel.config`, or ``jaxllm.resolve.resolve``'s).
      mesh: its mesh, :func:`make_mesh` ``(config)`` (axes ``data, fsdp, pipeline, tensor, sequence``).
    Returns:
      ``jax.sharding.NamedSharding`` per parameter, a nested dict shaped as the parameters
      (``jax.device_put(params, shardings(config, mesh))`` lays them out).  Where ``mesh.fsdp`` (with
      ZeRO-3 times the data-parallel axes) does not divide ``model.hidden_size``, the training loop stores
      the parameters padded to a multiple of it (:func:`jaxllm.parallel.sharding.stored`, ``pad``).
    Raises:
      TypeError: ``config`` is not resolved.  ValueError: ``mesh`` is not the config's mesh.
    """
    _check_layout(config, mesh)
    return sharding.param_shardings(config, gpt.describe(config.model).axes, mesh)


def optimizer_shardings(config: Resolved, mesh: jax.sharding.Mesh, optimizer=None):
    """Where the optimizer state lives in a run of ``config`` on ``mesh``: its moments as the parameters,
    split further over ``data`` and ``sequence`` from ZeRO stage 1 (:func:`jaxllm.parallel.sharding.zero_tables`),
    its counters replicated.

    Args:
      config, mesh: as :func:`shardings`.
      optimizer: an ``optax.GradientTransformation``; None: the run's (``train.optimizer`` with clipping,
        :func:`jaxllm.runtime.optim.make_optimizer`).
    Returns:
      a pytree of ``NamedSharding`` shaped as ``optimizer.init(params)`` (for the arrays as stored:
      padded where the devices do not divide ``model.hidden_size``, :func:`jaxllm.parallel.sharding.stored`).
    Raises:
      as :func:`shardings`.
    """
    _check_layout(config, mesh)
    spec = gpt.describe(config.model)
    optimizer = optimizer if optimizer is not None else optim.make_optimizer(config.train, spec.decay, spec.axes)
    abstract = {"params": spec.params, "opt_state": jax.eval_shape(optimizer.init, spec.params)}
    return sharding.state_shardings(config, abstract, spec.axes, mesh)["opt_state"]
