"""The layouts N devices allow: the search space of :mod:`jaxllm.tune`.

A :class:`Candidate` is one point: the devices along each mesh axis (``config.MESH_AXES``: data,
fsdp, pipeline, tensor, sequence), the micro batch, remat policy and attention impl, the pipeline
schedule and virtual stages, the ``sequence_impl`` and the ``layer_loop``; :func:`candidate_config` applies it
to a config and :func:`candidate_of` reads it back.  :func:`space` lists every ordered factorization
(:func:`factorizations`) of N devices over the chosen axes x micro batches x remat policies x
attention impls x pipeline schedule and virtual stages (only with pipeline > 1: the interleaved
schedules with > 1 virtual stages, the others with 1) x ``sequence_impl`` values (only with
sequence > 1) x layer loops.  :func:`dimensions` reads those lists from comma-separated text (``jaxllm.tune``'s
flags of the same names).

The space is listed before any constraint: which candidates can run is
:func:`jaxllm.resolve.resolve`'s to say (``jaxllm.tune.constraint``), which imports this package,
so nothing here imports it.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Collection, Mapping, Sequence

import jax

from jaxllm import config
from jaxllm.model.attention import available_impls, model_impl

AXES = config.MESH_AXES  # data, fsdp, expert, pipeline, tensor, sequence


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search space."""

    mesh: tuple[int, ...]  # sizes along config.MESH_AXES
    micro_batch: int
    remat: str
    attention: str
    virtual_stages: int = 1
    sequence_impl: str = "allgather"
    schedule: str = "gpipe"
    layer_loop: str = "auto"

    def overrides(self) -> dict[str, object]:
        """``{"SECTION.KEY": value}`` that turn the base config into this candidate."""
        out = {f"mesh.{a}": n for a, n in zip(AXES, self.mesh)}
        out.update({"train.micro_batch_size": self.micro_batch, "model.remat": self.remat,
                    "model.attention_impl": self.attention,
                    "parallel.pipeline_virtual_stages": self.virtual_stages,
                    "parallel.pipeline_schedule": self.schedule,
                    "parallel.sequence_impl": self.sequence_impl, "model.layer_loop": self.layer_loop})
        return out

    def flags(self) -> str:
        """The candidate as ``--config.*`` flags."""
        return " ".join(f"--config.{k}={v}" for k, v in self.overrides().items())

    def mesh_text(self) -> str:
        """``"pipeline2(interleaved_1f1b v2) sequence4(ring)"``: the axes > 1, with the pipeline schedule,
        virtual stages and sequence_impl."""
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        extra = {"pipeline": f"({self.schedule}{v})",
                 "sequence": f"({self.sequence_impl})"}
        return " ".join(f"{a}{n}{extra.get(a, '')}" for a, n in zip(AXES, self.mesh, strict=True)
                        if n > 1) or "1 device"


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every ordered ``k``-tuple of positive integers whose product is ``n``."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, k - 1)]


def candidate_config(base: config.Config, c: Candidate) -> config.Config:
    """``base`` with candidate ``c`` applied."""
    cfg = copy.deepcopy(base)
    for key, value in c.overrides().items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def candidate_of(cfg: config.Config, mesh: Mapping[str, int], backend: str | None = None) -> Candidate:
    """The candidate ``cfg`` is, on the devices ``mesh`` gives each axis (``cfg.mesh`` with its
    -1 axis filled: :func:`jaxllm.resolve.mesh_shape`); the inverse of :func:`candidate_config`.
    ``model.attention_impl="auto"`` is the implementation it picks on ``backend`` (None: this one), as in
    :func:`space`."""
    return Candidate(tuple(mesh[a] for a in AXES), cfg.train.micro_batch_size, cfg.model.remat,
                     model_impl(cfg.model, backend), cfg.parallel.pipeline_virtual_stages,
                     cfg.parallel.sequence_impl, cfg.parallel.pipeline_schedule, cfg.model.layer_loop)


def space(base: config.Config, num_devices: int, *, axes: Sequence[str], micro_batches: Sequence[int],
          remats: Sequence[str], attentions: Sequence[str], virtual_stages: Sequence[int],
          sequence_impls: Sequence[str], schedules: Sequence[str],
          layer_loops: Sequence[str] | None = None) -> list[Candidate]:
    """The full search space (before constraints), in a fixed order; with pipeline > 1 every
    schedule in ``schedules`` with every count in ``virtual_stages`` it takes (> 1 for the
    interleaved schedules, 1 for the others); ``base``'s ``sequence_impl`` without a sequence axis; ``layer_loops``
    None: ``base``'s."""
    out = []
    idx = [AXES.index(a) for a in axes]
    for sizes in factorizations(num_devices, len(axes)):
        mesh = [1] * len(AXES)
        for i, s in zip(idx, sizes):
            mesh[i] = s
        pipes = ([(s, v) for s in schedules for v in virtual_stages if s.startswith("interleaved") == (v > 1)]
                 if mesh[AXES.index("pipeline")] > 1 else [("gpipe", 1)])
        sis = sequence_impls if mesh[AXES.index("sequence")] > 1 else [base.parallel.sequence_impl]
        for mb, remat, attn, (sched, vs), si, loop in itertools.product(
                micro_batches, remats, attentions, pipes, sis, layer_loops or [base.model.layer_loop]):
            out.append(Candidate(tuple(mesh), mb, remat, attn, vs, si, sched, loop))
    return out


def values(candidates: Collection[Candidate]) -> dict[str, list]:
    """Each field of :class:`Candidate`, in its order -> the values it takes among ``candidates``, sorted."""
    return {f.name: sorted({getattr(c, f.name) for c in candidates}) for f in dataclasses.fields(Candidate)}


# ---------------------------------------------------------------------------------------------
# The dimensions as text
# ---------------------------------------------------------------------------------------------


def parse_ints(name: str, text: str) -> list[int]:
    """``"1,2"`` -> ``[1, 2]``. Raises ValueError naming ``--name`` unless all are integers >= 1."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name}={text!r}: give comma-separated integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{name}={text!r}: give comma-separated integers >= 1")
    return values


def parse_choices(name: str, text: str, options: Sequence[str]) -> list[str]:
    """``"none,full"`` -> ``["none", "full"]``. Raises ValueError naming ``--name`` unless all are ``options``."""
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in options]
    if not values or bad:
        raise ValueError(f"--{name}={text!r}: choose from {', '.join(options)}")
    return values


def default_attentions() -> list[str]:
    """The attention impls that run on this backend, less Pallas's interpreter on CPU."""
    return [i for i in available_impls() if not (jax.devices()[0].platform == "cpu" and i == "pallas")] or ["xla"]


def dimensions(base: config.Config, *, axes: str, micro_batch: str, remat: str, attention: str,
               virtual_stages: str, pipeline_schedules: str, sequence_impls: str,
               layer_loop: str = "auto") -> dict[str, list]:
    """:func:`space`'s keyword arguments from comma-separated lists (``"data,tensor"``);
    ``micro_batch="auto"``: every divisor of ``base.train.global_batch_size``; ``attention="auto"``:
    :func:`default_attentions`; ``layer_loop="auto"``: ``base``'s ``model.layer_loop``.

    Raises:
      ValueError: a list that is empty or holds a value the key does not take (the message names
        ``--NAME``, the ``jaxllm.tune`` flag).
    """
    gbs = base.train.global_batch_size
    return {
        "axes": parse_choices("axes", axes, AXES),
        "micro_batches": (parse_ints("micro_batch", micro_batch) if micro_batch != "auto"
                          else [d for d in range(1, gbs + 1) if gbs % d == 0]),
        "remats": parse_choices("remat", remat, config.choices("model.remat")),
        "attentions": default_attentions() if attention == "auto" else parse_choices(
            "attention", attention, [i for i in config.choices("model.attention_impl") if i != "auto"]),
        "virtual_stages": parse_ints("virtual_stages", virtual_stages),
        "schedules": parse_choices("pipeline_schedules", pipeline_schedules,
                                   config.choices("parallel.pipeline_schedule")),
        "sequence_impls": parse_choices("sequence_impls", sequence_impls, config.choices("parallel.sequence_impl")),
        "layer_loops": [base.model.layer_loop] if layer_loop == "auto" else parse_choices(
            "layer_loop", layer_loop, config.choices("model.layer_loop")),
    }
