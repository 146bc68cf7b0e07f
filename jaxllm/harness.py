"""A trained run as a model of EleutherAI's lm-evaluation-harness (``lm-eval``, the ``eval`` extra).

CLI, lm-eval's own command line (every option of ``lm_eval``) with the model ``jaxllm`` registered::

    python -m jaxllm.harness --model jaxllm --model_args workdir=runs/default[,step=N] --tasks hellaswag \\
        --batch_size 16 [--output_path results/]

lm-eval 0.4 finds models in its own registry only (it loads no plugins), so a bare ``lm_eval --model
jaxllm`` does not know this one.  In Python, ``import jaxllm.harness`` registers it for
``lm_eval.simple_evaluate(model="jaxllm", model_args="workdir=...")``; or pass ``JaxLLM(workdir)`` as
the model.

The requests are computed as lm-eval's Hugging Face backend (``--model hf``) computes them on
``python -m jaxllm.convert --to-hf`` of the run: the same tokens, the same left truncation of long
contexts, the same rolling windows for perplexities, the same greedy text.  One difference: an empty
context (and each rolling window's first token) is conditioned on the run's end-of-document token
(what precedes a document in training) where the export's tokenizer names a ``bos_token`` that
lm-eval would use; byte and char runs, which have no such token, use a newline.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import lm_eval.models  # noqa: F401  (lm-eval's own models: its get_model adds them only to an empty registry)
import numpy as np
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from jaxllm import cli
from jaxllm.api import load
from jaxllm.data.tokenizers import HFTokenizer, SentencePieceTokenizer
from jaxllm.model import gpt

__all__ = ["JaxLLM"]

GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k")


@register_model("jaxllm")
class JaxLLM(TemplateLM):
    """lm-eval's model ``jaxllm``: :func:`jaxllm.load` ``(workdir, step)`` on this host's default JAX device.

    Requests run in batches of ``batch_size`` rows, right-padded to a power-of-two length (at least 16,
    at most :attr:`max_length`), so a task compiles a few shapes, not one per request.

    Args:
      workdir: the run directory (``--workdir`` of ``python -m jaxllm.train``).
      step: the checkpoint's step; None: the latest.
      batch_size: rows per model call (an int, or its string as lm-eval's ``--batch_size`` gives it).
      max_length: the longest input in tokens; None: ``model.max_position_embeddings`` (the export's
        ``n_positions`` / ``max_position_embeddings``, which lm-eval's Hugging Face backend uses).
      max_batch_size, device: lm-eval's arguments for every model, unused: JAX's default backend runs
        the model (``JAX_PLATFORMS=cpu`` chooses the CPU).
    Attributes:
      run: the :class:`jaxllm.TrainedModel` it evaluates.
    Raises:
      ValueError: ``batch_size`` is not a positive integer (``auto`` is not supported), or ``max_length``
        exceeds the learned position table.
      and what :func:`jaxllm.load` raises.
    """

    def __init__(self, workdir: str, step: int | None = None, batch_size: int | str = 16,
                 max_length: int | None = None, max_batch_size: int | None = None, device: str | None = None):
        super().__init__()
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise ValueError(f"batch_size={batch_size!r}: give a positive integer (the jaxllm model has no 'auto')")
        self.run = load(workdir, None if step is None else int(step))
        positions = self.run.config.model.max_position_embeddings
        if max_length is not None and self.run.max_length is not None and int(max_length) > self.run.max_length:
            raise ValueError(f"max_length={max_length}: more than the learned position table's {self.run.max_length}")
        self._max_length = int(max_length or positions)
        self._batch_size = int(batch_size)
        tok = self.run.tokenizer
        self._prefix = tok.eot_id if tok.eot_id is not None else int(tok.encode("\n")[-1])
        graphdef, vocab = self.run.graphdef, self.run.vocab_size

        def score(params, tokens):  # int32 [batch, n + 1] -> ln p(tokens[:, i + 1] | ...), argmax == it: [batch, n]
            logits = gpt.forward(graphdef, params, tokens[:, :-1])[..., :vocab].astype(jnp.float32)
            targets = tokens[:, 1:]
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]
            return logp, jnp.argmax(logits, axis=-1) == targets

        self._score = jax.jit(score)

    @property
    def eot_token_id(self) -> int:
        """The context of an empty context and of rolling windows (see the module docstring)."""
        return self._prefix

    @property
    def max_length(self) -> int:
        """The longest model input, in tokens: longer contexts lose their first tokens."""
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        """Tokens generated when a request does not say (``max_gen_toks``), as lm-eval's Hugging Face backend."""
        return 256

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The run's token ids of ``string``; ``add_special_tokens=False``: without the ones a Hugging Face
        tokenizer's post-processor or a SentencePiece model adds (a beginning-of-text token)."""
        tok = self.run.tokenizer
        if add_special_tokens is False and isinstance(tok, (HFTokenizer, SentencePieceTokenizer)):
            return tok.encode(string, add_special_tokens=False).tolist()
        return tok.encode(string).tolist()

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``[(ln p(continuation | context), whether greedy decoding gives the continuation)]`` (natural
        log, summed over the continuation's tokens) of ``((context, continuation), context_ids,
        continuation_ids)`` requests; a context too long for :attr:`max_length` loses its first tokens."""
        L, rows = self.max_length, []
        for _, context, continuation in requests:
            if len(continuation) > L:
                raise ValueError(f"a continuation of {len(continuation)} tokens: more than max_length={L}")
            rows.append(np.asarray((context + continuation)[-(L + 1):], np.int32))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))  # similar lengths batched together
        out = [None] * len(rows)
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="jaxllm loglikelihood"):
            batch = order[start:start + self.batch_size]
            width = min(L, max(16, 1 << (len(rows[batch[0]]) - 2).bit_length()))  # inputs: row[:-1]
            tokens = np.zeros((self.batch_size, width + 1), np.int32)
            for r, i in enumerate(batch):
                tokens[r, :len(rows[i])] = rows[i]
            logp, greedy = map(np.asarray, self._score(self.run.params, tokens))
            for r, i in enumerate(batch):
                scored = slice(len(rows[i]) - 1 - len(requests[i][2]), len(rows[i]) - 1)
                out[i] = (float(logp[r, scored].sum()), bool(greedy[r, scored].all()))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """ln p(text) of each request's text (``Instance.args == (text,)``), natural log summed over all its
        tokens, in disjoint windows of :attr:`max_length` tokens (lm-eval's ``get_rolling_token_windows``,
        the first window after :attr:`eot_token_id`)."""
        windows, owner = [], []
        for n, req in enumerate(requests):
            for context, continuation in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(req.args[0]), prefix_token=self.eot_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[n] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The text generated after each request's context (``Instance.args == (context, gen_kwargs)``), cut
        before the first stop string of ``until`` (and the end-of-document token's text).

        ``gen_kwargs``: ``until`` (a str or list), ``max_gen_toks`` (default :attr:`max_gen_toks`), greedy
        decoding unless ``do_sample`` is true and ``temperature`` > 0 (then sampling among the ``top_k``,
        default 50 as transformers, most likely tokens; 0: all).  The context keeps its last
        ``max_length - max_gen_toks`` tokens.  Requests of one context length and settings run as a
        batch (:meth:`jaxllm.TrainedModel.sample`, with a KV cache).

        Raises:
          ValueError: another generation setting, or ``max_gen_toks`` >= :attr:`max_length`.
        """
        groups, stops = {}, []
        for n, req in enumerate(requests):
            context, kwargs = req.args
            unknown = set(kwargs) - set(GENERATION_KEYS)
            if unknown:
                raise ValueError(f"generation settings {sorted(unknown)}: the jaxllm model takes {GENERATION_KEYS}")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            if self.run.tokenizer.eot_id is not None:
                until.append(self.run.tokenizer.decode([self.run.tokenizer.eot_id]))
            stops.append(until)
            num = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            if num >= self.max_length:
                raise ValueError(f"max_gen_toks={num}: must be less than max_length={self.max_length}")
            temperature = float(kwargs.get("temperature", 0.0))
            sample = bool(kwargs.get("do_sample")) and temperature > 0
            ids = tuple(self.tok_encode(context)[-(self.max_length - num):] or [self.eot_token_id])
            setting = (len(ids), num, temperature if sample else 1.0, int(kwargs.get("top_k", 50)) if sample else 1)
            groups.setdefault(setting, []).append((n, ids))
        out = [None] * len(requests)
        for (_, num, temperature, top_k), members in tqdm(groups.items(), disable=disable_tqdm,
                                                          desc="jaxllm generate_until"):
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                rows = [ids for _, ids in batch]
                rows += rows[:1] * (self.batch_size - len(rows))  # a full batch: one compiled shape
                new = self.run.sample(np.asarray(rows, np.int32), num, temperature=temperature, top_k=top_k)
                for (n, _), ids in zip(batch, new):
                    text = self.run.tokenizer.decode(ids.tolist())
                    for stop in stops[n]:
                        text = text.split(stop)[0] if stop else text
                    out[n] = text
                    self.cache_hook.add_partial("generate_until", requests[n].args, text)
        return out


def check_output_path(argv: list[str]) -> None:
    """lm-eval's ``--output_path`` / ``-o`` in ``argv`` (a folder, or a ``.json`` file), checked as jaxllm's tools
    check what they write (:func:`jaxllm.cli.check_output`), before a model is loaded.  Raises ConfigError."""
    for i, arg in enumerate(argv):
        path = arg.split("=", 1)[1] if arg.startswith("--output_path=") else (
            argv[i + 1] if arg in ("--output_path", "-o") and i + 1 < len(argv) else None)
        if path:
            cli.check_output("--output_path", path, directory=not path.endswith(".json"))


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    with cli.stoppable("jaxllm.harness", "lm-eval writes its results at the end: none written"):
        with cli.usage_errors():  # lm-eval's results (a folder, or a .json file), checked before any request
            check_output_path(sys.argv[1:])
        cli_evaluate()
