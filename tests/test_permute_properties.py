"""Property-based tests (hypothesis) of `topk_permute_indices`: the layout from the router's expert ids against
the oracle (a stable argsort, the counts and generate_permute_indices) over token counts, top-k, expert counts,
alignments, max_len (room for all, exact, short, zero), id dtypes and ids past num_experts.

Small by default (CPU CI: the interpreter runs the kernels); `XKERN_HYPOTHESIS_EXAMPLES=500` for more. Seeded:
every run draws the same examples.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import GPU, same_bits, to_torch

pytest.importorskip("hypothesis", reason="hypothesis is not installed (CPU: scripts/setup.sh; GPU: .whl/)")
from hypothesis import given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import torch_api  # noqa: E402
from xkern import reference as R  # noqa: E402
from xkern.permute import ROUTE_CHUNK  # noqa: E402

EXAMPLES = int(os.environ.get("XKERN_HYPOTHESIS_EXAMPLES", 200 if GPU else 60))


@st.composite
def routes(draw):
    top_k = draw(st.integers(1, 8))
    tokens = draw(st.integers(0, 2 * ROUTE_CHUNK // top_k + 3))  # up to three chunks of copies
    experts = draw(st.sampled_from([1, 2, 3, 7, 16, 40, 129]))
    alignment = draw(st.sampled_from([1, 2, 4, 16]))
    ids = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, experts, (tokens, top_k))
    if draw(st.booleans()) and ids.size:  # some ids past the experts: no slot
        ids.reshape(-1)[:: max(1, ids.size // 5)] = experts + draw(st.integers(0, 3))
    room = tokens * top_k + experts * alignment
    max_len = draw(st.sampled_from([None, room, room // 2, 0, room + 37]))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    return ids.astype(dtype), experts, max_len, alignment


@seed(0)
@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(routes())
def test_topk_permute_indices_matches_oracle(route):
    ids, experts, max_len, alignment = route
    got = torch_api.topk_permute_indices(to_torch(ids), experts, max_len, alignment)
    want = R.topk_permute_indices(ids, experts, ids.size + experts * alignment if max_len is None else max_len,
                                  alignment)
    for name, g, w in zip(("permuted_indices", "m_sizes", "m_offsets"), got, want, strict=True):
        assert g.dtype == torch.int32 and same_bits(g, w), name
