"""FP8 blockwise grouped GEMM for Hopper, written with NVIDIA's CuTe DSL.

``C[l] = A_l B_l^T`` with FP8 operands (E4M3 or E5M2), both K-major, and
fp32 block scales along K every 128 elements (DeepSeek-style scaling):

* A is ``(rows, K)``, one scale per row and 128-block of K (1x128);
* B is ``(N, K, groups)``: under ``grouped_k=False`` one scale per
  128x128 block (a weight), under ``grouped_k=True`` one per row and
  128-block (a transposed activation, as A).

Two ways to group, one kernel:

* ``grouped_k=False`` (fprop, dgrad): A's rows come in groups padded to
  whole 128-row tiles; ``sched[t, 0]`` is the group of row tile ``t`` (its
  B), or -1 for a tile of padding alone (skipped).  Row ``i`` of A gives
  C's row ``rowmap[i]`` (none where it is -1): C has the tokens' rows, the
  padding never leaves the kernel.
* ``grouped_k=True`` (wgrad): group ``g`` reduces over K tiles
  ``sched[g, 0] .. sched[g, 1]`` (its tokens, padded to 128); C is
  ``(M, N, groups)``, a group with no tiles gets zeros.

Each CTA computes a 128x128 tile (rasterized in bands of row tiles for L2
reuse) with two consumer warpgroups (64 rows each) and one producer
warpgroup, whose first warp streams A/B tiles of 128x128x128 through TMA
into a multi-stage shared-memory ring, each stage with its K block's 1x128
scales (the tile's 128 rows of A, under ``grouped_k`` also B's 128
columns; the producer gives its registers to the consumers).  Per K tile
the consumer warpgroups run four WGMMAs (K=32 each) into a temporary
accumulator, read the block's scales from the stage while they run, then
add it, scaled by ``scale_a[row] * scale_b``, into the fp32 accumulator
(the promotion that keeps FP8 products' sums in fp32 across blocks).
Read from global memory by every consumer thread instead, the scales made
wgrad 1.3-1.6x slower (docs/benchmarks.md).  The epilogue stages the tile
in shared memory and writes whole rows in 16-byte vectors.
``persistent=True`` (what ``kernels/blockwise_grouped.py`` runs) launches
at most one CTA per SM instead of one per tile: each loops over tiles,
its producer loading the next tile's operands while the consumers store
this one, the staging in a buffer of its own.  With ``tma_store``
(``grouped_k`` and persistent: wgrad, whose C has no row map) the
epilogue writes the tile in slices of the tile's rows x 128 bytes with
``stmatrix`` into swizzled buffers and sends each out with a TMA store,
which drains while the next tile computes; its tiles may be 128 x 192
(``tile_n``), which read each A tile for half as much C again, or
192 x 128 (``tile_m``) with a third consumer warpgroup, which reads each
B tile for half as much C again and gives each scheduler a third warp to
issue from.  There the promotion reads its scales from the stage after
the WGMMAs (a scale per accumulator element would not fit the registers)
and releases the stage after it; the TMA loads zero-fill and the stores
clip a partial last tile.  ``kernels/blockwise_grouped.py`` says what runs when.

Imported only when the runner is built (``kernels/blockwise_grouped.py``):
nothing here runs on a machine without the DSL or a GPU.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

TILE_M = 128
TILE_N = 128
TILE_K = 128          # one scale block along K per tile
_WG_ROWS = 64         # each consumer warpgroup's rows of the tile
# registers per thread (setmaxnreg) of the producer and of the consumer
# warpgroups, by the number of consumer warpgroups (2: 128-row tiles, 3:
# 192-row ones, whose 64 x 128 accumulators leave room for no more)
_REGS = {2: (40, 232), 3: (24, 160)}
_BAND = 8             # row tiles per rasterization band
EPI_ROW_BYTES = 128   # TMA-store epilogue: slices of the tile's rows x 128 bytes (the swizzle)
EPI_BUFFERS = 2       # slices in flight
_EPI_STORE_WARP = 4   # the first consumer warp issues the TMA stores


def _epi_n(dtype) -> int:
    """C's columns per TMA-store slice (128 bytes)."""
    return EPI_ROW_BYTES * 8 // dtype.width


class BlockwiseGroupedGemm:
    """The kernel for one configuration (``grouped_k``, C's dtype)."""

    def __init__(self, grouped_k: bool, stages: int = 0, persistent: bool = False,
                 tma_store: bool = False, tile_n: int = TILE_N, tile_m: int = TILE_M):
        self.grouped_k = grouped_k
        # persistent CTAs (at most one per SM) loop over the tiles: the
        # producer loads the next tile while the consumers store this one
        self.persistent = persistent
        self._stages = stages
        # persistent wgrad CTAs may write C with TMA stores from swizzled
        # slices, which drain while the next tile computes
        self.tma_store = tma_store and grouped_k and persistent
        # wider tiles (192) read each A tile for more of C: wgrad under
        # tma_store only, whose B scales are per column (not 128x128
        # blocks) and whose TMA loads and stores clip a partial last tile
        if tile_n not in (TILE_N, 192) or (tile_n != TILE_N and not self.tma_store):
            raise ValueError(f"tile_n={tile_n}: 128, or 192 for the TMA-store wgrad")
        # taller tiles (192 rows) take a third consumer warpgroup: wgrad
        # under tma_store with 128 columns only (the registers allow no more)
        if tile_m not in (TILE_M, 192) or (tile_m != TILE_M and not (
                self.tma_store and tile_n == TILE_N)):
            raise ValueError(f"tile_m={tile_m}: 128, or 192 for the TMA-store wgrad's "
                             "128-wide tiles")
        self.tile_m, self.tile_n = tile_m, tile_n
        self.tile_mnk = (tile_m, tile_n, TILE_K)
        self.warpgroups = tile_m // _WG_ROWS
        self.mma_threads = 128 * self.warpgroups
        self.threads = 128 + self.mma_threads  # one producer warpgroup first
        self.producer_regs, self.mma_regs = _REGS[self.warpgroups]
        # two warpgroups of 64 x 128 accumulators have the registers for a
        # scale per element, computed while the WGMMAs run; wider or more
        # warpgroups read the scales from the stage after the wait
        self.scales_during_mma = tile_n == TILE_N and self.warpgroups == 2

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, scale_a: cute.Tensor,
                 scale_b: cute.Tensor, sched: cute.Tensor, rowmap: cute.Tensor,
                 max_ctas: cutlass.Int32, stream):
        smem = utils.get_smem_capacity_in_bytes("sm_90")
        # bytes: two FP8 tiles and their K block's fp32 scales (A's rows',
        # and under grouped_k B's columns')
        tile_n = self.tile_n
        tile_m = self.tile_m
        per_stage = (tile_m + tile_n) * TILE_K + 4 * tile_m + (4 * tile_n if self.grouped_k else 0)
        # the epilogue's own staging buffer (persistent): rows padded by 16
        # bytes, or under tma_store EPI_BUFFERS swizzled slices of the
        # tile's rows x 128 bytes, one per store in flight
        c_pad = 128 // c.element_type.width
        c_elems = tile_m * (tile_n + c_pad) if self.persistent else 1
        c_layout = utils.LayoutEnum.from_tensor(c)
        epi_smem = cute.make_layout(1)
        if cutlass.const_expr(self.tma_store):
            epi_n = _epi_n(c.element_type)
            epi_smem = cute.tile_to_shape(
                warpgroup.make_smem_layout_atom(
                    sm90_utils.get_smem_layout_atom(c_layout, c.element_type, epi_n),
                    c.element_type),
                (tile_m, epi_n, EPI_BUFFERS), order=(0, 1, 2))
            c_elems = cute.cosize(epi_smem)
        c_bytes = c_elems * c.element_type.width // 8 if self.persistent else 0
        self.stages = self._stages or min(8, (smem - 2048 - c_bytes) // per_stage)
        a_major = utils.LayoutEnum.from_tensor(a)
        b_major = utils.LayoutEnum.from_tensor(b)
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            a.element_type, b.element_type, a_major.sm90_mma_major_mode(),
            b_major.sm90_mma_major_mode(), cutlass.Float32, (self.warpgroups, 1, 1),
            tiler_mn=(64, tile_n))
        a_smem = sm90_utils.make_smem_layout_a(a_major, self.tile_mnk, a.element_type,
                                               self.stages)
        b_smem = sm90_utils.make_smem_layout_b(b_major, self.tile_mnk, b.element_type,
                                               self.stages)
        tma_a, tma_ta = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), a, cute.slice_(a_smem, (None, None, 0)),
            (tile_m, TILE_K))
        tma_b, tma_tb = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), b, cute.slice_(b_smem, (None, None, 0)),
            (tile_n, TILE_K))
        # the 1x128 scales ride the ring with their tiles: 128 fp32 per stage
        sa_smem = cute.make_layout((tile_m, 1, self.stages))
        sb_smem = cute.make_layout((tile_n, 1, self.stages if self.grouped_k else 1))
        tma_sa, tma_tsa = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), scale_a, cute.slice_(sa_smem, (None, None, 0)),
            (tile_m, 1))
        tma_sb, tma_tsb = tma_sa, tma_tsa  # (unused: a weight's scale is one per block)
        if cutlass.const_expr(self.grouped_k):
            tma_sb, tma_tsb = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), scale_b,
                cute.slice_(sb_smem, (None, None, 0)), (tile_n, 1))

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sa: cute.struct.Align[cute.struct.MemRange[a.element_type, cute.cosize(a_smem)],
                                  1024]
            sb: cute.struct.Align[cute.struct.MemRange[b.element_type, cute.cosize(b_smem)],
                                  1024]
            sc: cute.struct.Align[cute.struct.MemRange[c.element_type, c_elems], 128]
            ssa: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(sa_smem)],
                                   128]
            ssb: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(sb_smem)],
                                   128]

        self.shared_storage = SharedStorage
        self.tx_bytes = (cute.size_in_bytes(a.element_type, cute.slice_(a_smem, (None, None, 0)))
                         + cute.size_in_bytes(b.element_type,
                                              cute.slice_(b_smem, (None, None, 0)))
                         + 4 * tile_m + (4 * tile_n if self.grouped_k else 0))
        tiles = ((cute.size(a, mode=[0]) + tile_m - 1) // tile_m
                 * ((cute.size(c, mode=[1]) + tile_n - 1) // tile_n))
        grid = (tiles, 1, cute.size(c, mode=[2]))
        if cutlass.const_expr(self.persistent):
            grid = (cutlass.min(tiles * cute.size(c, mode=[2]), max_ctas), 1, 1)
        # C's row and batch strides are multiples of 8 elements (N is whole
        # 128-tiles): said, so the epilogue's 16-byte row vectors compile as such
        c = cute.make_tensor(c.iterator, cute.make_layout(
            c.shape, stride=(cute.assume(c.stride[0], divby=8), 1,
                             cute.assume(c.stride[2], divby=8))))
        tma_c, tma_tc = tma_a, c  # (unused but under tma_store)
        if cutlass.const_expr(self.tma_store):
            tma_c, tma_tc = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), c, cute.slice_(epi_smem, (None, None, 0)),
                (tile_m, _epi_n(c.element_type)))
        self.kernel(tma_a, tma_ta, tma_b, tma_tb, c, tma_sa, tma_tsa, tma_sb, tma_tsb, scale_b,
                    sched, rowmap, tiled_mma, a_smem, b_smem, sa_smem, sb_smem, tma_c, tma_tc,
                    epi_smem).launch(grid=grid, block=[self.threads, 1, 1], stream=stream,
                                     # said for 3 consumer warpgroups, so that ptxas
                                     # knows the registers at entry and keeps their
                                     # setmaxnreg (else it ignores it, and spills)
                                     min_blocks_per_mp=1 if self.warpgroups == 3 else 0)

    @cute.jit
    def _epilogue(self, acc, tCcC, mC, c_l, tile_m, tile_n, mRowmap, smem_ptr, mma_tidx):
        """The tile from the accumulators to C through shared memory (the
        drained A ring, or a buffer of its own when persistent): each thread
        writes its elements, then the rows go out in 16-byte vectors, whole
        rows per group of threads.  Grouped along the rows, row ``i`` of
        the tile goes to C's row ``rowmap[i]`` (none where it is -1:
        padding)."""
        dtype = mC.element_type
        # rows padded by 16 bytes: the accumulator layout's 8 rows per warp
        # fall in distinct banks
        pad = 128 // dtype.width
        sC = cute.make_tensor(cute.recast_ptr(smem_ptr, dtype=dtype),
                              cute.make_layout((TILE_M, TILE_N), stride=(TILE_N + pad, 1)))
        vec = 128 // dtype.width  # elements per 16 bytes
        per_row = TILE_N // vec
        out = mC[None, None, c_l]
        reg = cute.make_rmem_tensor((1, vec), dtype)
        vectors = TILE_M * per_row // self.mma_threads
        rows = []
        if cutlass.const_expr(not self.grouped_k):
            # C's rows, all loaded while the tile is staged, before the first
            # store (which could alias them, as far as the compiler knows)
            rows = [mRowmap[tile_m * TILE_M + (mma_tidx + j * self.mma_threads) // per_row]
                    for j in range(vectors)]
        if cutlass.const_expr(not self.persistent):
            # staged in the A ring: the other warpgroup's last WGMMAs may
            # still be reading its A rows from the stage this overwrites
            cute.arch.barrier(barrier_id=1, number_of_threads=self.mma_threads)
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, n = tCcC[i]
            sC[r, n] = acc[i].to(dtype)
        cute.arch.barrier(barrier_id=1, number_of_threads=self.mma_threads)
        for j in cutlass.range_constexpr(vectors):
            idx = mma_tidx + j * self.mma_threads
            r = idx // per_row
            v = idx % per_row
            row = tile_m * TILE_M + r
            if cutlass.const_expr(not self.grouped_k):
                row = rows[j]
            if row >= 0:
                cute.autovec_copy(cute.local_tile(sC, (1, vec), (r, v)), reg)
                cute.autovec_copy(reg, cute.local_tile(out, (1, vec), (row, tile_n * per_row + v)))
        if cutlass.const_expr(self.persistent):  # read out before the next tile writes it
            cute.arch.barrier(barrier_id=1, number_of_threads=self.mma_threads)

    @cute.jit
    def _epilogue_tma(self, r2s, tRS_acc, tRS_sC, tRS_c, tRS_out, tma_c, sC, mC_tma, c_l, tile_m,
                      tile_n, c_stores, warp):
        """The tile from the accumulators to C (``grouped_k``, persistent) in
        slices of the tile's rows x ``EPI_ROW_BYTES``: each converted and written
        to its swizzled shared-memory buffer with ``stmatrix``, then one
        warp's TMA store sends it out; the stores drain while the next tile
        computes, and a buffer is written again only once its last store
        has read it (``c_stores``, the TMA store pipeline)."""
        gC = cute.local_tile(mC_tma, (self.tile_m, self.tile_n), (tile_m, tile_n, c_l))
        epi_n = _epi_n(tRS_out.element_type)
        gC_epi = cute.zipped_divide(gC, (self.tile_m, epi_n))
        bSG_sC, bSG_gC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1),
                                               cute.group_modes(sC, 0, 2), gC_epi)
        n = cute.size(tRS_c)
        buffers = cute.size(tRS_sC, mode=[3])
        for e in cutlass.range_constexpr(self.tile_n // epi_n):
            for v in cutlass.range_constexpr(n):
                tRS_c[v] = tRS_acc[e * n + v]
            tRS_out.store(tRS_c.load().to(tRS_out.element_type))
            cute.copy(r2s, tRS_out, tRS_sC[None, None, None, e % buffers])
            # the generic-proxy smem writes made visible to the TMA unit
            cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared,
                                  space=cute.arch.SharedSpace.shared_cta)
            cute.arch.barrier(barrier_id=1, number_of_threads=self.mma_threads)
            if warp == _EPI_STORE_WARP:
                cute.copy(tma_c, bSG_sC[None, e % buffers], bSG_gC[None, (0, e)])
                c_stores.producer_commit()
                c_stores.producer_acquire()
            cute.arch.barrier(barrier_id=1, number_of_threads=self.mma_threads)

    @cute.jit
    def _raster(self, tile, rows, cols):
        """``(tile_m, tile_n)`` of the CTA's linear index: column-major within
        bands of ``_BAND`` row tiles, so the CTAs that run together share
        their A tiles and few B tiles in L2."""
        m_tiles = (rows + self.tile_m - 1) // self.tile_m
        n_tiles = (cols + self.tile_n - 1) // self.tile_n
        per_band = _BAND * n_tiles
        first = (tile // per_band) * _BAND
        height = cutlass.min(m_tiles - first, _BAND)
        within = tile % per_band
        return first + within % height, within // height

    @cute.jit
    def _work(self, work, tiles, mA, mC, mSched):
        """What the CTA computes for linear work index ``work`` (row tiles x
        N tiles x C's batch): ``(tile_m, tile_n, b_l, c_l, k_begin, k_tiles,
        store)``, B's and C's batch indices and the K tiles it reduces."""
        tile_l = work // tiles
        tile_m, tile_n = self._raster(work % tiles, cute.size(mA, mode=[0]),
                                      cute.size(mC, mode=[1]))
        b_l = cutlass.Int32(0)
        c_l = cutlass.Int32(0)
        k_begin = cutlass.Int32(0)
        k_tiles = cutlass.Int32(0)
        store = cutlass.Boolean(True)
        if cutlass.const_expr(self.grouped_k):
            c_l = tile_l
            k_begin = mSched[tile_l, 0]
            k_tiles = mSched[tile_l, 1] - k_begin
        else:
            group = mSched[tile_m, 0]
            store = group >= 0
            b_l = cutlass.max(group, 0)
            if store:
                k_tiles = (cute.size(mA, mode=[1]) + TILE_K - 1) // TILE_K
        return tile_m, tile_n, b_l, c_l, k_begin, k_tiles, store

    @cute.jit
    def _load(self, ring, loads, tma_a, mA, tma_b, mB, tma_sa, mSA, tma_sb, mSBt, sA, sB, sSA,
              sSB, tile_m, tile_n, b_l, k_begin, k_tiles):
        """The producer warp: one tile's K tiles, and their 1x128 scales,
        through TMA into the ring; returns the advanced ``loads`` state."""
        gA = cute.local_tile(mA, self.tile_mnk, (tile_m, tile_n, None, 0), proj=(1, None, 1))
        gB = cute.local_tile(mB, self.tile_mnk, (tile_m, tile_n, None, b_l), proj=(None, 1, 1))
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                           cute.group_modes(sA, 0, 2),
                                           cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                           cute.group_modes(sB, 0, 2),
                                           cute.group_modes(gB, 0, 2))
        gSA = cute.local_tile(mSA, (self.tile_m, 1), (tile_m, None))
        tSsSA, tSgSA = cpasync.tma_partition(tma_sa, 0, cute.make_layout(1),
                                             cute.group_modes(sSA, 0, 2),
                                             cute.group_modes(gSA, 0, 2))
        tSsSB, tSgSB = tSsSA, tSgSA
        if cutlass.const_expr(self.grouped_k):
            gSB = cute.local_tile(mSBt, (self.tile_n, 1), (tile_n, None, 0))
            tSsSB, tSgSB = cpasync.tma_partition(tma_sb, 0, cute.make_layout(1),
                                                 cute.group_modes(sSB, 0, 2),
                                                 cute.group_modes(gSB, 0, 2))
        for kt in cutlass.range(k_tiles, unroll=1):
            ring.producer_acquire(loads)
            barrier = ring.producer_get_barrier(loads)
            cute.copy(tma_a, tAgA[None, k_begin + kt], tAsA[None, loads.index],
                      tma_bar_ptr=barrier)
            cute.copy(tma_b, tBgB[None, k_begin + kt], tBsB[None, loads.index],
                      tma_bar_ptr=barrier)
            cute.copy(tma_sa, tSgSA[None, k_begin + kt], tSsSA[None, loads.index],
                      tma_bar_ptr=barrier)
            if cutlass.const_expr(self.grouped_k):
                cute.copy(tma_sb, tSgSB[None, k_begin + kt], tSsSB[None, loads.index],
                          tma_bar_ptr=barrier)
            ring.producer_commit(loads)
            loads.advance()
        return loads

    @cute.jit
    def _mma(self, ring, reads, tiled_mma, tCrA, tCrB, tCcC, acc, part, scale, sSA, sSB, mSB,
             tile_n, b_l, k_begin, k_tiles):
        """The consumer warpgroups: one tile's K tiles into ``acc`` (zeroed
        first), each promoted with its block scales; returns the advanced
        ``reads`` state."""
        acc.fill(0.0)
        k_blocks = cute.size(tCrA, mode=[2])
        for kt in cutlass.range(k_tiles, unroll=1):
            kb = k_begin + kt
            ring.consumer_wait(reads)
            warpgroup.fence()
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            for k in cutlass.range_constexpr(k_blocks):
                cute.gemm(tiled_mma, part, tCrA[None, None, k, reads.index],
                          tCrB[None, None, k, reads.index], part)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            if cutlass.const_expr(self.scales_during_mma):
                # this K block's scales (the 1x128 ones from the ring's
                # stage), read while the WGMMAs run
                sb = cutlass.Float32(1.0)
                if cutlass.const_expr(not self.grouped_k):
                    sb = mSB[tile_n, kb, b_l]
                for i in cutlass.range_constexpr(cute.size(scale)):
                    r, n = tCcC[i]
                    if cutlass.const_expr(self.grouped_k):
                        scale[i] = sSA[r, 0, reads.index] * sSB[n, 0, reads.index]
                    else:
                        scale[i] = sSA[r, 0, reads.index] * sb
                warpgroup.wait_group(0)
                ring.consumer_release(reads)
                reads.advance()
                # add this K block's sums, scaled, to the fp32 accumulator
                acc.store(acc.load() + part.load() * scale.load())
            else:
                # a wide tile has no registers left for a scale per
                # element: the promotion reads them from the stage after
                # the WGMMAs, before the stage is released (each thread's
                # elements share 2 rows' and 48 columns' scales)
                warpgroup.wait_group(0)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    r, n = tCcC[i]
                    acc[i] = acc[i] + part[i] * (sSA[r, 0, reads.index] * sSB[n, 0, reads.index])
                ring.consumer_release(reads)
                reads.advance()
        return reads

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
               mB: cute.Tensor, mC: cute.Tensor, tma_sa: cute.CopyAtom, mSA: cute.Tensor,
               tma_sb: cute.CopyAtom, mSBt: cute.Tensor, mSB: cute.Tensor,
               mSched: cute.Tensor, mRowmap: cute.Tensor, tiled_mma: cute.TiledMma,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, sa_smem: cute.Layout,
               sb_smem: cute.Layout, tma_c: cute.CopyAtom, mC_tma: cute.Tensor,
               epi_smem: cute.ComposedLayout):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, bidz = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        tiles = ((cute.size(mA, mode=[0]) + self.tile_m - 1) // self.tile_m
                 * ((cute.size(mC, mode=[1]) + self.tile_n - 1) // self.tile_n))
        # one tile per CTA (grid: tiles x batches), or persistent CTAs
        # striding over every tile of every batch
        first = bidx + bidz * tiles
        end = first + 1
        step = cutlass.Int32(1)
        if cutlass.const_expr(self.persistent):
            first = bidx
            end = tiles * cute.size(mC, mode=[2])
            step = gdim
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_sa)
            if cutlass.const_expr(self.grouped_k):
                cpasync.prefetch_descriptor(tma_sb)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.mma_threads // 32),
            tx_count=self.tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        sA = storage.sa.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sb.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sSA = storage.ssa.get_tensor(sa_smem)
        sSB = storage.ssb.get_tensor(sb_smem)
        # the epilogue's staging: its own buffer when the ring keeps loading
        # the next tile meanwhile, else the drained ring
        c_smem = storage.sa.data_ptr()
        if cutlass.const_expr(self.persistent):
            c_smem = storage.sc.data_ptr()
        sC = sA  # (unused but under tma_store)
        if cutlass.const_expr(self.tma_store):
            sC = storage.sc.get_tensor(epi_smem.outer, swizzle=epi_smem.inner)

        wg = cute.arch.make_warp_uniform(tidx // 128)
        if wg == 0:
            # the producer warpgroup: warp 0 streams the K tiles through TMA
            cute.arch.warpgroup_reg_dealloc(self.producer_regs)
            if warp == 0:
                loads = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                     self.stages)
                for work in cutlass.range(first, end, step, unroll=1):
                    tile_m, tile_n, b_l, c_l, k_begin, k_tiles, store = self._work(
                        work, tiles, mA, mC, mSched)
                    loads = self._load(ring, loads, tma_a, mA, tma_b, mB, tma_sa, mSA, tma_sb,
                                       mSBt, sA, sB, sSA, sSB, tile_m, tile_n, b_l, k_begin,
                                       k_tiles)
                ring.producer_tail(loads)
        else:
            cute.arch.warpgroup_reg_alloc(self.mma_regs)
            mma_tidx = tidx - 128
            # A/B fragments per warpgroup, C per thread
            thr_mma = tiled_mma.get_slice((wg - 1) * 128)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            thr_c = tiled_mma.get_slice(mma_tidx)
            gC = cute.local_tile(mC, self.tile_mnk, (0, 0, None, 0), proj=(1, 1, None))
            tCgC = thr_c.partition_C(gC)
            # each accumulator element's (row, column) in the tile
            tCcC = thr_c.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
            acc = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
            part = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
            scale = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
            reads = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            r2s, tRS_acc, tRS_sC, tRS_c, tRS_out, c_stores = (None,) * 6
            if cutlass.const_expr(self.tma_store):
                dtype = mC.element_type
                c_atom = cute.make_copy_atom(
                    cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), dtype)
                r2s_atom = c_atom
                if cutlass.const_expr(dtype.width != 16):
                    r2s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype)
                r2s = cute.make_tiled_copy_S(r2s_atom,
                                             cute.make_tiled_copy_C_atom(c_atom, tiled_mma))
                thr_r2s = r2s.get_slice(mma_tidx)
                tRS_sC = thr_r2s.partition_D(sC)
                tRS_acc = r2s.retile(acc)
                c_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
                tRS_c = cute.make_rmem_tensor(c_shape, cutlass.Float32)
                tRS_out = cute.make_rmem_tensor(c_shape, dtype)
                c_stores = pipeline.PipelineTmaStore.create(
                    num_stages=cute.size(tRS_sC, mode=[3]),
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                             self.mma_threads))
            for work in cutlass.range(first, end, step, unroll=1):
                tile_m, tile_n, b_l, c_l, k_begin, k_tiles, store = self._work(
                    work, tiles, mA, mC, mSched)
                reads = self._mma(ring, reads, tiled_mma, tCrA, tCrB, tCcC, acc, part, scale,
                                  sSA, sSB, mSB, tile_n, b_l, k_begin, k_tiles)
                if cutlass.const_expr(self.tma_store):
                    self._epilogue_tma(r2s, tRS_acc, tRS_sC, tRS_c, tRS_out, tma_c, sC, mC_tma,
                                       c_l, tile_m, tile_n, c_stores, warp)
                elif store:
                    self._epilogue(acc, tCcC, mC, c_l, tile_m, tile_n, mRowmap, c_smem,
                                   mma_tidx)
            if cutlass.const_expr(self.tma_store):
                if warp == _EPI_STORE_WARP:  # C's last stores land before the CTA's smem goes
                    c_stores.producer_tail()

def _views(grouped_k: bool, a, b, out, scale_a, scale_b, sched, rowmap) -> list:
    """The kernel's arguments from ``kernels/blockwise_grouped.py``'s torch
    tensors: A ``(rows, K, 1)``, B ``(N, K, groups)``, C ``(rows, N, l)``,
    the scales with their blocks along K second, ``sched`` 2-D."""
    from .tensors import to_cute
    if grouped_k:
        views = [(a.unsqueeze(-1), 1, 16), (b.unsqueeze(-1), 1, 16),
                 (out.permute(1, 2, 0), 1, 16), (scale_a, 0, 16),
                 (scale_b.unsqueeze(-1), 0, 16), (sched, 1, 4), (rowmap, 0, 4)]
    else:
        views = [(a.unsqueeze(-1), 1, 16), (b.permute(1, 2, 0), 1, 16),
                 (out.as_strided((*out.shape, 1), (out.shape[1], 1, out.numel())), 1, 16),
                 (scale_a, 0, 16),
                 (scale_b.permute(1, 2, 0), 1, 4), (sched.view(-1, 1), 0, 4), (rowmap, 0, 4)]
    return [to_cute(t, lead, align) for t, lead, align in views]


def _example(grouped_k: bool, a_dtype, b_dtype, out_dtype, device="cuda") -> list:
    """Small CUDA tensors of the runtime layouts, to compile against."""
    import torch
    dev, g, t = device, 2, 2 * TILE_K
    zeros = lambda *s, dtype=torch.float32: torch.zeros(*s, device=dev).to(dtype)  # noqa: E731
    if grouped_k:
        return [zeros(TILE_M, t, dtype=a_dtype), zeros(TILE_N, t, dtype=b_dtype),
                zeros(g, TILE_M, TILE_N, dtype=out_dtype), zeros(t // TILE_K, TILE_M).t(),
                zeros(t // TILE_K, TILE_N).t(), zeros(g, 2, dtype=torch.int32),
                zeros(2, dtype=torch.int32)]
    return [zeros(2 * TILE_M, t, dtype=a_dtype), zeros(g, 2 * TILE_N, t, dtype=b_dtype),
            zeros(2 * TILE_M, 2 * TILE_N, dtype=out_dtype), zeros(t // TILE_K, 2 * TILE_M).t(),
            zeros(g, 2, 4), zeros(2, dtype=torch.int32), zeros(2 * TILE_M, dtype=torch.int32)]


def build(config, out_shape):
    """The runner of one configuration (``kernels/blockwise_grouped.py``):
    compiled here, once, for any shapes of its layouts."""
    import torch
    from .tensors import current_stream
    values = config.as_dict()
    dtype = lambda name: getattr(torch, name.replace("torch.", ""))  # noqa: E731
    grouped_k = values["grouped_k"]
    out_dtype = dtype(values["out_dtype"])
    example = _example(grouped_k, dtype(values["a_dtype"]), dtype(values["b_dtype"]), out_dtype)
    kernel = BlockwiseGroupedGemm(grouped_k, persistent=values.get("persistent", False),
                                  tma_store=values.get("tma_store", False),
                                  tile_n=values.get("tile_n", TILE_N),
                                  tile_m=values.get("tile_m", TILE_M))
    compiled = cute.compile(kernel, *_views(grouped_k, *example), cutlass.Int32(1),
                            current_stream())
    max_ctas = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    # the runner keeps no CUDA tensor: one built in a CUDA-graph warm-up
    # would hold memory of the graphs' pool
    def run(inputs):
        a, b, scale_a, scale_b, sched = inputs[:5]
        rowmap = sched.reshape(-1) if grouped_k else inputs[5]  # (wgrad reads no row map)
        out = torch.empty(out_shape(config, inputs), dtype=out_dtype, device=a.device)
        compiled(*_views(grouped_k, a, b, out, scale_a, scale_b, sched, rowmap), max_ctas,
                 current_stream())
        return [out]

    return run
