r"""The online log-sum-exp: the max and the sum of a row too long for registers, in one read.

``lse(x) = m + log(sum_j exp(x_j - m))`` with ``m = max x`` never overflows, but it needs the max before the
sum: two reads of the row. Walking the row in blocks, keep a running max ``m`` and a running sum ``s`` of
``exp(x - m)``; when a block raises the max to ``m'``, the old sum is moved to it by one factor::

    s' = s * exp(m - m') + sum over the block of exp(x_j - m')

At the end ``lse = m + log s``. With a temperature T the same recurrence runs on x / T, written as
``exp((x - m) / T)`` so that the unscaled difference is taken first (logits of 1e4 keep their digits).

The cross-entropy's and the JSD's kernels both run it; a loss that also needs a weighted sum over the row
(the JSD's E_P[y - z]) rescales that sum by the same factor, which is why the step returns it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_lse_step(m, total, x, inv_temperature):
    """One block of the online log-sum-exp of x / T for a tile of rows. x: (ROWS, BLOCK_N) raw values, -inf in
    masked lanes; m: the running max of x (unscaled); total: the running sum of exp((x - m) / T). Returns the
    new (m, total), the factor that moved the old sum to the new max, and exp((x - new m) / T) for the block."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    # A row that has seen nothing yet still has m = -inf: shift by 0 there, not by -inf - -inf = nan.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    rescale = tl.exp((m - shift) * inv_temperature)
    e = tl.exp((x - shift[:, None]) * inv_temperature)
    return m_new, total * rescale + tl.sum(e, axis=1), rescale, e
