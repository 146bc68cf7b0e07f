"""The collectives of a compiled step, per mesh axis: what crosses which links.

:func:`collectives` reads the SPMD-partitioned HLO of a compiled program (``compiled.as_text()``):
every ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``, ``ragged-all-to-all`` and
``collective-permute`` (async ``-start`` halves counted once), times the trip counts of the ``while`` loops around it
(XLA's ``known_trip_count``: the layer scan, the micro batches, the pipeline's steps).  Its device
groups (``replica_groups``, explicit or iota, with ``use_global_device_ids``; a permute's
``source_target_pairs``) are mesh positions: the mesh axes along which a group's members differ are
the axes it spans.  :func:`jaxllm.analysis.step_time.estimate` turns the bytes into seconds.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from jaxllm.platform import hlo

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_BODY = re.compile(r"body=%([^,\s]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"(?:calls|body|true_computation|false_computation)=%([^,\s)]+)|branch_computations=\{([^}]*)\}")


@dataclasses.dataclass
class Traffic:
    """The collectives over one set of mesh axes in one step, per device.

    Attributes:
      ops: collective executions (loop trip counts included).
      wire: bytes each device sends: a ring's ``2 (n - 1) / n`` of an all-reduce's buffer, ``(n - 1) / n``
        of an all-gather's output, a reduce-scatter's input or an all-to-all's buffer, a permute's buffer
        (Thakur et al. 2005, "Optimization of Collective Communication Operations in MPICH"); a ragged all-to-all
        sends what its sizes say at run time, which the program does not hold: ``(n - 1) / n`` of the smaller of
        its input and output buffers (a dispatch's sender holds just its routed rows, the combine's receiver just
        its own: what a balanced router sends, its own rank's rows kept).
      hops: latency terms: ``2 (n - 1)`` per all-reduce, ``n - 1`` per all-gather, reduce-scatter and
        all-to-all, 1 per permute.
      kinds: ``{kind: ops}``.
    """

    ops: int = 0
    wire: float = 0.0
    hops: int = 0
    kinds: dict = dataclasses.field(default_factory=dict)


def groups(line: str, devices: int) -> list[list[int]]:
    """A collective's device groups (logical ids: positions in the mesh's flat device order), from its
    ``source_target_pairs``, or its ``replica_groups`` in one of XLA's three forms: explicit ``{{0,1},...}``,
    iota ``[groups,size]<=[dims]T(perm)``, or ``mesh[...][, device_ids=(...)] {axes}``."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(1) + "}")]
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? "
                     r"\{([^}]*)\}", line)
    if mesh:  # mesh[axis sizes], device_ids=(iota) (absent: the devices in order), {the axes a group spans}
        names = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        dims = [int(d) for d in mesh.group(2).split(",")] if mesh.group(2) else [int(n) for _, n in names]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if mesh.group(3):
            ids = ids.transpose([int(p) for p in mesh.group(3).split(",")])
        ids = ids.reshape([int(n) for _, n in names])
        spanned = [i for i, (name, _) in enumerate(names) if f"'{name}'" in mesh.group(4)]
        rest = [i for i in range(len(names)) if i not in spanned]
        return ids.transpose(rest + spanned).reshape(-1, math.prod(ids.shape[i] for i in spanned)).tolist()
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        groups, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
        return ids.reshape(groups, size).tolist()
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if explicit and explicit.group(1):
        return [[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", explicit.group(1))]
    return [list(range(devices))]  # {}: every device


def axes(group: list[int], mesh_shape: dict) -> tuple[str, ...]:
    coords = np.array(np.unravel_index(np.asarray(group), tuple(mesh_shape.values()))).T
    return tuple(a for i, a in enumerate(mesh_shape) if len(set(coords[:, i])) > 1)


def message(op: hlo.Op, devices: int, mesh_shape: dict) -> tuple | None:
    """One collective instruction's ``(kind, mesh axes, group size n, buffer bytes, bytes each device sends,
    latency terms)`` by the ring algorithms of :class:`Traffic`, or None for anything else and for a group of one
    device.  The buffer: an all-reduce's, all-gather's output, reduce-scatter's input, all-to-all's, a permute's
    (an async ``-start``'s outputs), a ragged all-to-all's smaller buffer (:class:`Traffic`)."""
    kind = op.opcode.removesuffix("-start")
    if kind not in KINDS:
        return None
    shapes = op.type
    if kind == "ragged-all-to-all" and op.opcode.endswith("-start"):  # ((input, output, offsets, sizes), output)
        shapes = min(("{}[{}]".format(*p) for p in _SHAPE.findall(shapes)[:2]), key=hlo.type_bytes)
    elif op.opcode.endswith("-start") and kind != "all-reduce":  # (operands, outputs): the outputs
        parts = _SHAPE.findall(shapes)
        shapes = " ".join(f"{d}[{s}]" for d, s in parts[len(parts) // 2:] if d in hlo.DTYPE_BYTES)
    members = groups(op.rest, devices)
    n = max(len(g) for g in members)
    if n < 2:
        return None
    size = hlo.type_bytes(shapes) * (n if kind == "reduce-scatter" else 1)  # its input: n outputs
    wire, hops = {"all-reduce": (2 * (n - 1) / n * size, 2 * (n - 1)),
                  "all-gather": ((n - 1) / n * size, n - 1),
                  "reduce-scatter": ((n - 1) / n * size, n - 1),
                  "all-to-all": ((n - 1) / n * size, n - 1),
                  "ragged-all-to-all": ((n - 1) / n * size, n - 1),
                  "collective-permute": (size, 1)}[kind]
    return kind, axes(members[0], mesh_shape), n, size, wire, hops


def collectives(hlo_text: str, mesh_shape: dict) -> dict[tuple[str, ...], Traffic]:
    """Per-device collective traffic of one execution of a compiled SPMD program, by the mesh axes it spans.

    Args:
      hlo_text: ``compiled.as_text()`` of a program jitted over a mesh of ``mesh_shape`` (``{axis: size}`` in the
        mesh's axis order; the program's device assignment is the mesh's devices in flat order).
    Returns:
      ``{axes: Traffic}``, axes a tuple of mesh axis names (collectives within one device's group, such as
      over an axis of size 1, are left out).
    """
    entry, bodies = hlo.parse(hlo_text)
    devices = math.prod(mesh_shape.values())
    out: dict[tuple[str, ...], Traffic] = {}

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 64 or name not in bodies:
            return
        for op in bodies[name]:
            one = message(op, devices, mesh_shape)
            if one is not None:
                kind, spanned, _, _, wire, hops = one
                t = out.setdefault(spanned, Traffic())
                t.ops += times
                t.wire += times * wire
                t.hops += times * hops
                t.kinds[kind] = t.kinds.get(kind, 0) + times
                continue
            loop = _BODY.search(op.rest) if op.opcode == "while" else None
            if loop:
                trips = _TRIPS.search(op.rest)
                visit(loop.group(1), times * int(trips.group(1) if trips else 1), depth + 1)
                continue
            for called, branches in _CALLS.findall(op.rest):
                for child in ([called] if called else re.findall(r"%([^,\s]+)", branches)):
                    visit(child, times, depth + 1)

    if entry is not None:
        visit(entry, 1)
    out.pop((), None)
    return out
