"""An optimized HLO module as text (``compiled.as_text()``), read: its computations' instructions and the bytes
of its types.  What reads a compiled program here (:mod:`jaxllm.platform.xla_gpu`'s kernels,
:mod:`jaxllm.analysis.collectives`' traffic, :mod:`jaxllm.analysis.profile`'s kernels) parses it with this.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")


class Op(NamedTuple):
    """One instruction: ``name``, ``type`` (its result's, e.g. ``bf16[4,2048]{1,0}`` or a tuple's), ``opcode``,
    ``rest`` (its operands and attributes, as printed)."""

    name: str
    type: str
    opcode: str
    rest: str

    @property
    def dtype(self) -> str:
        """The result's element type: f32, bf16, f8e4m3fn, ... (``tuple`` for a tuple)."""
        return "tuple" if self.type.startswith("(") else self.type.split("[", 1)[0]

    @property
    def operands(self) -> list[str]:
        """The names of its operands."""
        return re.findall(r"%([\w.-]+)", self.rest.split(")", 1)[0])


def parse(hlo: str) -> tuple[str, dict[str, list[Op]]]:
    """``compiled.as_text()`` -> (the entry computation's name, {computation: its instructions, the ROOT last})."""
    bodies: dict[str, list[Op]] = {}
    entry = current = None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            bodies[current] = []
            entry = current if line.startswith("ENTRY") else entry
            continue
        op = _INSTRUCTION.match(line)
        if op and current is not None:
            bodies[current].append(Op(op.group(1), op.group(2), op.group(3), op.group(4)))
    return entry, bodies


def type_bytes(types: str) -> int:
    """Bytes of every array in ``types`` (``bf16[4,2048]{1,0}``, a tuple's, or several), each element by
    :data:`DTYPE_BYTES` (other element types left out)."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dtype]
               for dtype, dims in _SHAPE.findall(types) if dtype in DTYPE_BYTES)
