"""The permute ops' launch plans: fixed (no autotuning), from shapes and the element size only, so that both
front ends launch the same binaries."""

from __future__ import annotations

from xkern.launch import Launch, cdiv, next_pow2, row_align
from xkern.permute.index_kernels import (
    _expert_sizes_kernel,
    _fill_indices_kernel,
    _generate_one_kernel,
    _inverse_search_kernel,
    _route_count_kernel,
    _route_fill_kernel,
    _route_tables_kernel,
    _scatter_inverse_kernel,
    _verify_inverse_kernel,
)
from xkern.permute.kernels import (
    _combine_bwd_kernel,
    _combine_bwd_token_kernel,
    _combine_rows_kernel,
    _gather_rows_kernel,
    _gather_token_rows_kernel,
    _gather_verified_rows_kernel,
    _scatter_token_rows_kernel,
)

ROW_CHUNK_BYTES = 2048  # columns per inner-loop step: 1024 bf16, 512 fp32 (7168 = 7 x 1024, no tail)
TILE_BYTES = 16384      # bytes per loop step: 8 rows x 1024 bf16; 8 warps move 4 16-byte vectors a thread
MAX_BLOCK_M = 1024      # rows per program for very narrow rows
INDEX_BLOCK = 1024      # slots (or rows) per program of the index kernels
ONE_LAUNCH_SLOTS = 4096 # `one_launch`: at most this many slots, the index ops in one launch
SEARCH_PAIRS = 16       # (row, slot) pairs each thread compares per step of the search kernels' scan
SEARCH_ROWS = 64        # rows per program of the search kernels (each program scans every slot)


def one_launch(n_slots: int) -> bool:
    """The index ops' regime rule: up to ONE_LAUNCH_SLOTS slots (decode steps, small batches: host-bound
    calls) inverse_permutation and unpermute_rows take one launch whose programs each scan every slot, and
    generate_permute_indices one program for its tables and its slots; above it (device-bound) the scatter
    then the verify pass or the verified gather, and the tables then the parallel fill: two launches each."""
    return n_slots <= ONE_LAUNCH_SLOTS


def plan_gather_rows(n_rows: int, n_cols: int, elem_size: int, src_row_stride: int | None = None,
                     through_scatter: bool = False, search: bool = False) -> Launch:
    """`out[i, :] = src[idx[i], :]` for `n_rows` output rows of `n_cols` elements of `elem_size` bytes.

    Arrays `(src, idx, out)`, or with `through_scatter` `(src, slot_of, idx, out)` (unpermute's gather through
    the inverse scatter's slot_of, each entry verified against idx); with `search` `(src, idx, out)` is
    unpermute's whole gather, `out[r] = src[slot naming r]` (`one_launch`); scalars `n_rows, n_cols,
    n_src_rows, src_row_stride`; out is contiguous [n_rows, n_cols], src's last dim contiguous (its row stride
    defaults to n_cols)."""
    align = row_align(n_cols, n_cols if src_row_stride is None else src_row_stride)
    block_m, block_h, num_warps = _row_tile(n_cols, elem_size)
    constexprs = {"ROW_ALIGN": align, "BLOCK_M": block_m, "BLOCK_H": block_h}
    if through_scatter:
        return Launch(_gather_verified_rows_kernel, (max(1, cdiv(n_rows, block_m)),), num_warps, constexprs)
    if search:  # fewer rows per program (each scans every slot), at least 4 warps for the scan
        block_m, num_warps = min(block_m, SEARCH_ROWS), max(num_warps, 4)
    constexprs.update(BLOCK_M=block_m, BLOCK_S=_search_block(block_m, num_warps) if search else 0)
    return Launch(_gather_rows_kernel, (max(1, cdiv(n_rows, block_m)),), num_warps, constexprs)


def _row_tile(n_cols: int, elem_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_H, num_warps) of the row kernels: TILE_BYTES per loop step, ROW_CHUNK_BYTES per row."""
    block_h = min(next_pow2(n_cols), ROW_CHUNK_BYTES // elem_size)
    block_m = min(MAX_BLOCK_M, TILE_BYTES // (block_h * elem_size))
    return block_m, block_h, max(1, min(8, block_m * block_h * elem_size // 2048))


# The token-major kernels (the weighted combine and the copy-sum, permute_rows(top_k) and the combine's backward
# above ONE_LAUNCH_SLOTS) and the slot-major combine backward: TOKEN_ROWS rows of TOKEN_STEP_BYTES per step, 4
# warps (one 16-byte access a thread), the copies' loop unrolled up to MAX_UNROLL_K copies. At the Qwen3-MoE
# size (16384 tokens, top 8, hidden 2048 bf16; H100, 2026-12-06, L2 flushed): the combine
# 211.8 us against 229.2 at the row tile (8 x 1024, 8 warps, a loop over the copies), the combine backward
# token-major 415.7 against 647.5 at the row tile, permute_rows(top_k) token-major 233.2 against 243.2 (0.86,
# 0.91 and 0.86 of the copy ceiling). The backward's dprobs sum its FP32 terms in BLOCK_H chunks: one tile for
# both of its forms keeps them bitwise equal.
TOKEN_ROWS = 4
TOKEN_STEP_BYTES = 512
MAX_UNROLL_K = 8


def _token_tile(n_cols: int, elem_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_H, num_warps) of the token-major kernels, the combines and the combine backward."""
    return TOKEN_ROWS, min(next_pow2(n_cols), TOKEN_STEP_BYTES // elem_size), 4


def plan_gather_token_rows(n_rows: int, n_cols: int, elem_size: int, src_row_stride: int) -> Launch:
    """permute_rows(top_k > 1): arrays `(src, idx, out)`, scalars `n_rows, n_cols, n_src_rows, src_row_stride,
    top_k`; the tile of `plan_gather_rows`."""
    block_m, block_h, num_warps = _row_tile(n_cols, elem_size)
    return Launch(_gather_token_rows_kernel, (max(1, cdiv(n_rows, block_m)),), num_warps,
                  {"ROW_ALIGN": row_align(n_cols, src_row_stride), "BLOCK_M": block_m, "BLOCK_H": block_h})


def plan_combine(n_tokens: int, n_cols: int, elem_size: int, src_row_stride: int, has_probs: bool,
                 top_k: int) -> Launch:
    """The weighted combine: arrays `(src, slot_of, idx, probs, out)` (probs: idx again without probs), scalars
    `n_tokens, n_cols, n_src_rows, src_row_stride, top_k`; BLOCK_M tokens per program, each summing its
    top_k slot rows chunk by chunk into an FP32 tile (`_token_tile`), the copies unrolled (TOP_K) up to
    MAX_UNROLL_K of them."""
    block_m, block_h, num_warps = _token_tile(n_cols, elem_size)
    return Launch(_combine_rows_kernel, (max(1, cdiv(n_tokens, block_m)),), num_warps,
                  {"ROW_ALIGN": row_align(n_cols, src_row_stride), "BLOCK_M": block_m, "BLOCK_H": block_h,
                   "HAS_PROBS": has_probs, "TOP_K": top_k if top_k <= MAX_UNROLL_K else 0})


def plan_combine_bwd(n_slots: int, n_cols: int, elem_size: int, dout_row_stride: int, y_row_stride: int) -> Launch:
    """The weighted combine's backward: arrays `(dout, y, idx, probs, dy, dprobs)`, scalars `n_slots, n_cols,
    num_rows, dout_row_stride, y_row_stride, top_k`; BLOCK_M slots per program, the token-major form's tile."""
    block_m, block_h, num_warps = _token_tile(n_cols, elem_size)
    return Launch(_combine_bwd_kernel, (max(1, cdiv(n_slots, block_m)),), num_warps,
                  {"ROW_ALIGN": row_align(n_cols, dout_row_stride, y_row_stride), "BLOCK_M": block_m,
                   "BLOCK_H": block_h})



def plan_scatter_token_rows(n_tokens: int, n_slots: int, n_cols: int, elem_size: int, src_row_stride: int,
                            top_k: int) -> tuple[Launch, int]:
    """permute_rows(top_k) token-major: arrays `(src, slot_of, idx, out)`, scalars `n_tokens, n_cols, n_slots,
    src_row_stride, token_programs`; the launch and its `token_programs` (the programs that read token rows;
    those after them zero the padding slots)."""
    block_m, block_h, num_warps = _token_tile(n_cols, elem_size)
    token_programs = cdiv(n_tokens, block_m)
    return Launch(_scatter_token_rows_kernel, (max(1, token_programs + cdiv(n_slots, block_m)),), num_warps,
                  {"ROW_ALIGN": row_align(n_cols, src_row_stride), "BLOCK_M": block_m, "BLOCK_H": block_h,
                   "TOP_K": top_k}), token_programs


def plan_combine_bwd_token(n_tokens: int, n_slots: int, n_cols: int, elem_size: int, dout_row_stride: int,
                           y_row_stride: int, top_k: int) -> tuple[Launch, int]:
    """The weighted combine's backward token-major: arrays `(dout, y, slot_of, idx, probs, dy, dprobs)`, scalars
    `n_tokens, n_cols, n_slots, dout_row_stride, y_row_stride, token_programs`; the launch and its
    `token_programs`, as `plan_scatter_token_rows`."""
    block_m, block_h, num_warps = _token_tile(n_cols, elem_size)
    token_programs = cdiv(n_tokens, block_m)
    return Launch(_combine_bwd_token_kernel, (max(1, token_programs + cdiv(n_slots, block_m)),), num_warps,
                  {"ROW_ALIGN": row_align(n_cols, dout_row_stride, y_row_stride), "BLOCK_M": block_m,
                   "BLOCK_H": block_h, "TOP_K": top_k, "K_PAD": next_pow2(top_k)}), token_programs

def _search_block(rows: int, num_warps: int) -> int:
    """Slots per step of a search kernel's scan: SEARCH_PAIRS (row, slot) compares per thread."""
    return min(1024, max(1, SEARCH_PAIRS * 32 * num_warps // rows))


def plan_inverse(n_slots: int, n_rows: int) -> tuple[Launch, ...]:
    """Scatter `slot_of[idx[i]] = i` over `n_slots` slots, then verify `inv` over `n_rows` rows; or, when
    `one_launch(n_slots)`, the one search launch.

    Arrays and scalars: scatter `(idx, slot_of)`, verify `(idx, slot_of, inv)`, search `(idx, inv)`, all with
    `n_slots, n_rows`."""
    if one_launch(n_slots):
        return (Launch(_inverse_search_kernel, (max(1, cdiv(n_rows, SEARCH_ROWS)),), 4,
                       {"BLOCK": SEARCH_ROWS, "BLOCK_S": _search_block(SEARCH_ROWS, 4)}),)
    return plan_scatter_inverse(n_slots), \
        Launch(_verify_inverse_kernel, (max(1, cdiv(n_rows, INDEX_BLOCK)),), 4, {"BLOCK": INDEX_BLOCK})


def plan_scatter_inverse(n_slots: int) -> Launch:
    return Launch(_scatter_inverse_kernel, (max(1, cdiv(n_slots, INDEX_BLOCK)),), 4, {"BLOCK": INDEX_BLOCK})


def plan_generate_indices(experts_per_rank: int, num_ranks: int, max_len: int) -> tuple[Launch, ...]:
    """The one-program size/offset pass and the per-slot fill; or, when `one_launch(max_len)`, both in one
    program over every slot.

    Arrays: sizes `(counts, m_sizes, m_offsets, row_start, rank_begin)` with `n_experts, n_ranks,
    alignment`; fill `(counts, m_sizes, m_offsets, row_start, rank_begin, out)` with `max_len, n_experts,
    n_ranks`; the one launch `(counts, m_sizes, m_offsets, row_start, rank_begin, out)` with all four.
    row_start and rank_begin are int32 scratch of num_ranks * experts_per_rank elements."""
    block_e = next_pow2(experts_per_rank)
    steps = {"STEPS_E": experts_per_rank.bit_length(), "STEPS_R": num_ranks.bit_length()}
    if 0 < max_len and one_launch(max_len):
        block_s = next_pow2(max_len)
        return (Launch(_generate_one_kernel, (1,), max(4, min(16, block_s // 256)),
                       {"BLOCK_E": block_e, "BLOCK_S": block_s, **steps}),)
    sizes = Launch(_expert_sizes_kernel, (1,), max(1, min(8, block_e // 256)), {"BLOCK_E": block_e})
    fill = Launch(_fill_indices_kernel, (max(1, cdiv(max_len, INDEX_BLOCK)),), 4, {"BLOCK_S": INDEX_BLOCK, **steps})
    return sizes, fill


ROUTE_CHUNK = 1024    # copies per program of the routing kernels (tables of n_copies / ROUTE_CHUNK x E)
ROUTE_TILE = 16384    # elements of the routing kernels' one-hot and table tiles
MAX_ROUTE_EXPERTS = 16384  # a row of every expert's counts is one tile of the routing kernels


def plan_route_indices(n_copies: int, n_experts: int, max_len: int) -> tuple[Launch, Launch, Launch]:
    """topk_permute_indices: the per-chunk counts and ranks, the one-program tables, the fill.

    Arrays: count `(ids, counts, rank)` with `n_copies, n_experts`; tables `(counts, m_sizes, m_offsets,
    totals, base)` with `n_chunks, n_experts, alignment`; fill `(ids, rank, base, m_sizes, m_offsets, totals,
    out)` with `n_copies, n_chunks, n_experts, max_len`. counts and base are int32 [n_chunks, n_experts],
    rank int32 [n_copies], totals int32 [n_experts]; n_chunks = the count launch's grid."""
    block_e = next_pow2(n_experts)
    n_chunks = max(1, cdiv(n_copies, ROUTE_CHUNK))
    sub = max(1, min(64, ROUTE_TILE // block_e))
    count = Launch(_route_count_kernel, (n_chunks,), 8, {"CHUNK": ROUTE_CHUNK, "SUB": sub, "BLOCK_E": block_e})
    tables = Launch(_route_tables_kernel, (1,), 8, {"ROWS": max(1, ROUTE_TILE // 2 // block_e), "BLOCK_E": block_e})
    fill = Launch(_route_fill_kernel, (n_chunks + n_experts,), 4, {"CHUNK": ROUTE_CHUNK, "BLOCK_S": 256})
    return count, tables, fill
