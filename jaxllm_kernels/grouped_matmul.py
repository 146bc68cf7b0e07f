"""Grouped matrix multiplication (a mixture of experts' expert matmuls) as Pallas kernels for GPUs.

``y[r] = x[r] @ w[g(r)]`` over rows sorted by group (``jax.lax.ragged_dot``'s product), with its two gradients, in
three kernels of one launch each (MegaBlocks, Gale et al. 2023, "MegaBlocks: Efficient Sparse Training with
Mixture-of-Experts", section 5: the block-sparse tiles; MaxText's ``megablox`` ``gmm`` and ``tgmm`` are the same
decomposition for TPUs):

* :func:`gmm` forward: one program per (row tile, column block).  The row tiles are laid over the groups (each
  group's rows start a tile of their own, ``ceil(rows / tile) + groups`` tiles, a static count); a program reads its
  tile's group, first row and row count (:func:`tile_layout`) and multiplies those rows by its group's weight block,
  float32 accumulation.  The tiles past the groups' rows (another device's experts' copies in a dispatcher's static
  buffer) exit at once: they cost a launch slot, no matmul;
* the input gradient ``dx = dy @ w[g]^T``: the same kernel with the weight read transposed;
* the weight gradient ``dw[g] = x_g^T @ dy_g`` (``tgmm``): one program per (group, input block, output block),
  looping over its group's rows; an empty group's block is zeros.

Triton through Pallas (``jax.experimental.pallas.triton``): NVIDIA and AMD GPUs; on a CPU the same kernels run in
Pallas's interpret mode (the tests check them against ``jax.lax.ragged_dot`` there).  ``jaxllm.model.moe``
picks them per platform.  The tiles (128 x 128, 64 deep, 8 warps, 3 stages: Triton's usual bfloat16 GEMM tiles
for Ampere and Hopper) are not tuned on a GPU.

Reading a tile near the end of ``x``: a tile's first row is moved back so that the whole tile lies inside the
array (``min(start, rows - tile)``) and the rows outside the tile's own are masked, so no load or store leaves
the array (Pallas's interpret mode clamps such slices instead of masking them).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch parameters: ``rows`` per row tile, ``cols`` per output block, ``depth`` per step of
    the contraction (all powers of two, at least 16, Triton's smallest dot); ``num_warps``, ``num_stages``."""

    rows: int = 128
    cols: int = 128
    depth: int = 64
    num_warps: int = 8
    num_stages: int = 3


def _fit(block: int, n: int) -> int:
    """The largest power of two ``<= block`` dividing ``n`` (at least 16; ``n`` is padded to a multiple of 16)."""
    while block > 16 and n % block:
        block //= 2
    return block


def _pad(a, axis: int, multiple: int):
    """``a`` zero-padded along ``axis`` to a multiple of ``multiple``."""
    extra = -a.shape[axis] % multiple
    if not extra:
        return a
    return jnp.pad(a, [(0, extra if i == axis else 0) for i in range(a.ndim)])


def tile_layout(group_sizes, rows: int, tile: int):
    """Each row tile's group, first row and row count, for ``rows`` rows sorted by group.

    Args:
      group_sizes: int32 ``[groups]``, summing to at most ``rows``.
      rows, tile: static ints.
    Returns:
      int32 ``[3, tiles]``, ``tiles = ceil(rows / tile) + groups``: group, first row, rows (0 for the tiles past
      the groups' rows, which come last).  Group ``g``'s ``s`` rows fill ``ceil(s / tile)`` consecutive tiles.
    """
    groups = group_sizes.shape[0]
    tiles = -(-rows // tile) + groups
    count = -(-group_sizes // tile)
    tile_end = jnp.cumsum(count)
    row_end = jnp.cumsum(group_sizes)
    i = jnp.arange(tiles, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(tile_end, i, side="right"), groups - 1).astype(jnp.int32)
    first = row_end[g] - group_sizes[g] + (i - (tile_end[g] - count[g])) * tile
    n = jnp.where(i < tile_end[-1], jnp.minimum(tile, row_end[g] - first), 0)
    return jnp.stack([g, first, n]).astype(jnp.int32)


def _gmm_kernel(layout_ref, x_ref, w_ref, y_ref, *, tiles: Tiles, transpose: bool):
    """One (row tile, column block): ``y[tile rows, block] = x[tile rows] @ w[g][:, block]`` (``w[g]^T``)."""
    t, bm, bn, bk = pl.program_id(0), tiles.rows, tiles.cols, tiles.depth
    first, n = layout_ref[1, t], layout_ref[2, t]
    cols = pl.ds(pl.program_id(1) * bn, bn)  # (program ids only outside the condition: interpret mode)

    @pl.when(n > 0)
    def _():
        g = layout_ref[0, t]
        start = jnp.minimum(first, x_ref.shape[0] - bm)  # the whole tile inside x; its own rows masked
        row = start + jnp.arange(bm, dtype=jnp.int32)
        mine = (row >= first) & (row < first + n)

        def step(kb, acc):
            depth = pl.ds(pl.multiple_of(kb * bk, bk), bk)
            x = plgpu.load(x_ref.at[pl.ds(start, bm), depth], mask=mine[:, None], other=0)
            w = w_ref[g, cols, depth] if transpose else w_ref[g, depth, cols]
            return acc + _dot(x, w, trans_b=transpose)

        acc = lax.fori_loop(0, x_ref.shape[1] // bk, step, jnp.zeros((bm, bn), jnp.float32))
        plgpu.store(y_ref.at[pl.ds(start, bm), cols], acc.astype(y_ref.dtype), mask=mine[:, None])


def _tgmm_kernel(groups_ref, x_ref, dy_ref, dw_ref, *, tiles: Tiles):
    """One (group, input block, output block): ``dw[g][block, block] = x_g[:, block]^T @ dy_g[:, block]``, the
    group's rows (``groups_ref``: first row and rows of each) ``tiles.depth`` at a time."""
    g, br, bi, bo = pl.program_id(0), tiles.depth, tiles.rows, tiles.cols
    first, n = groups_ref[0, g], groups_ref[1, g]
    ins, outs = pl.ds(pl.program_id(1) * bi, bi), pl.ds(pl.program_id(2) * bo, bo)

    def step(j, acc):
        lo = first + j * br
        start = jnp.minimum(lo, x_ref.shape[0] - br)
        row = start + jnp.arange(br, dtype=jnp.int32)
        mine = ((row >= lo) & (row < first + n))[:, None]
        x = plgpu.load(x_ref.at[pl.ds(start, br), ins], mask=mine, other=0)
        dy = plgpu.load(dy_ref.at[pl.ds(start, br), outs], mask=mine, other=0)
        return acc + _dot(x, dy, trans_a=True)

    acc = lax.fori_loop(0, lax.div(n + (br - 1), np.int32(br)), step, jnp.zeros((bi, bo), jnp.float32))
    dw_ref[...] = acc.astype(dw_ref.dtype)


def _dot(a, b, **trans):
    """``a @ b`` (optionally transposed), float32; IEEE float32 for float32 operands (no TF32)."""
    return plgpu.dot(a, b, **trans, precision=lax.Precision.HIGHEST if a.dtype == jnp.float32 else None)


def _launch(tiles: Tiles, interpret: bool) -> dict:
    return dict(interpret=interpret,
                compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages))


def _below(block: int, rows: int) -> int:
    """The largest power of two ``<= block`` and ``<= rows`` (``rows`` >= 16)."""
    return min(block, 1 << (rows.bit_length() - 1))


def _gmm(x, w, group_sizes, *, transpose: bool, tiles: Tiles, interpret: bool):
    """``x`` ``[rows, k]`` times ``w[g]`` (``[groups, k, n]``; ``transpose``: ``w[g]^T`` of ``[groups, n, k]``) ->
    ``[rows, n]`` in ``x``'s dtype, zero past the groups' rows."""
    rows, n = x.shape[0], w.shape[1 if transpose else 2]
    x = _pad(_pad(x, 1, 16), 0, 16)
    w = _pad(_pad(w, 1, 16), 2, 16)
    k, n_pad = x.shape[1], w.shape[1 if transpose else 2]
    tiles = dataclasses.replace(tiles, rows=_below(tiles.rows, x.shape[0]), depth=_fit(tiles.depth, k),
                                cols=_fit(tiles.cols, n_pad))
    layout = tile_layout(group_sizes, x.shape[0], tiles.rows)
    y = pl.pallas_call(
        functools.partial(_gmm_kernel, tiles=tiles, transpose=transpose),
        grid=(layout.shape[1], n_pad // tiles.cols),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n_pad), x.dtype),
        name="jaxllm_grouped_matmul_dx" if transpose else "jaxllm_grouped_matmul",
        **_launch(tiles, interpret),
    )(layout, x, w)[:rows, :n]
    return jnp.where((jnp.arange(rows) < group_sizes.sum())[:, None], y, 0)  # the rows no tile wrote


def _tgmm(x, dy, group_sizes, dtype, *, tiles: Tiles, interpret: bool):
    """``dw[g] = x_g^T dy_g``: ``x`` ``[rows, k]``, ``dy`` ``[rows, n]`` -> ``[groups, k, n]`` in ``dtype``."""
    k, n = x.shape[1], dy.shape[1]
    x, dy = _pad(_pad(x, 1, 16), 0, 16), _pad(_pad(dy, 1, 16), 0, 16)
    tiles = dataclasses.replace(tiles, rows=_fit(tiles.rows, x.shape[1]), cols=_fit(tiles.cols, dy.shape[1]),
                                depth=_below(tiles.depth, x.shape[0]))
    groups = group_sizes.shape[0]
    first = jnp.cumsum(group_sizes) - group_sizes
    dw = pl.pallas_call(
        functools.partial(_tgmm_kernel, tiles=tiles),
        grid=(groups, x.shape[1] // tiles.rows, dy.shape[1] // tiles.cols),
        out_specs=pl.BlockSpec((None, tiles.rows, tiles.cols), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((groups, x.shape[1], dy.shape[1]), dtype),
        name="jaxllm_grouped_matmul_dw",
        **_launch(tiles, interpret),
    )(jnp.stack([first, group_sizes]).astype(jnp.int32), x, dy)
    return dw[:, :k, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def gmm(x, w, group_sizes, tiles: Tiles = Tiles(), interpret: bool = False):
    """Row block ``g`` of ``x`` times ``w[g]``: ``jax.lax.ragged_dot(x, w, group_sizes)`` as Pallas kernels.

    Args:
      x: ``[rows, k]``, its rows sorted by group; w: ``[groups, k, n]`` of ``x``'s dtype (bfloat16, float16 or
        float32); group_sizes: int32 ``[groups]``, summing to at most ``rows``.
      tiles: :class:`Tiles`; interpret: run in Pallas's interpret mode (CPUs).
    Returns:
      ``[rows, n]`` in ``x``'s dtype (float32 accumulation), zero for the rows past ``sum(group_sizes)``.  The
      gradients are the same kernels (``dx``: the weight transposed; ``dw``: the per-group ``x^T dy``).
    """
    return _gmm(x, w, group_sizes, transpose=False, tiles=tiles, interpret=interpret)


def _gmm_fwd(x, w, group_sizes, tiles, interpret):
    return gmm(x, w, group_sizes, tiles, interpret), (x, w, group_sizes)


def _gmm_bwd(tiles, interpret, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)
    dx = _gmm(dy, w, group_sizes, transpose=True, tiles=tiles, interpret=interpret)
    dw = _tgmm(x, dy, group_sizes, w.dtype, tiles=tiles, interpret=interpret)
    return dx, dw, None


gmm.defvjp(_gmm_fwd, _gmm_bwd)
