"""How DTensor runs liger_lab's operators shard by shard, without gathering anything.

Under tensor or sequence parallelism (``parallelize_module``, ``SequenceParallel``) or 2-D FSDP, a norm's weight and
activations arrive as DTensors, and DTensor refuses an operator it has no sharding strategy for. Each strategy below
lists, for one mesh dimension, the placements under which running the operator on every rank's local tensors gives
the local pieces of the true result (DTensor expands them to every mesh dimension and redistributes inputs that
match none, at the lowest cost):

* **Norms** (``rms_norm``, ``add_rms_norm``, ``layer_norm`` and their backwards) work row by row over the last
  dimension. x may be ``Shard(d)`` on any other dimension, or ``Replicate``; the weight and bias must be
  ``Replicate`` (a weight sharded along the row is gathered first: it is one vector). The saved statistics are
  shaped ``x.shape[:-1]``, so they take x's placement. In the backward, dx takes x's placement and dw, db are
  ``Partial`` sums over each rank's rows when x is sharded (``Replicate`` when it is not).
* **SwiGLU, GeGLU** are elementwise: gate, up, the output and both gradients share any one placement.
* **RoPE** rotates each head vector with its position's cos and sin: q and k may be sharded on batch, heads or
  sequence, cos and sin on batch (when they have a batch), replicated, or sharded on sequence, to match.
  Never on ``head_dim``: a pair's two halves would sit on different ranks.

``Partial`` inputs are never listed: each op is nonlinear in its activations, so DTensor reduces them first. An x
sharded on its last dimension is redistributed too (to a strategy's placement, the cheapest). A weight sharded on
its only dimension is all-gathered (H values) for the op, and its gradient comes back ``Partial`` or ``Replicate``.

The in-place backward operators (``rms_norm_backward_``, ``glu_backward_``) have no strategy: DTensor treats an
operator whose name ends in ``_`` as an in-place op of its first argument and returns that argument, not what the
operator returned, so the ops take their out-of-place backward for DTensors
(:func:`liger_lab.ops.common.in_place_requested`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# The operators must be registered with torch.library before DTensor can be told about them.
from liger_lab.ops import glu, layer_norm, rms_norm, rope  # noqa: F401

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec as Spec
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental import register_sharding
    from torch.distributed.tensor.placement_types import Placement

    # DTensor hands each strategy function the op's arguments with every tensor replaced by its spec (which has
    # the tensor's global ``ndim`` and ``shape``), and takes back (output placements, input placements) pairs,
    # one placement or None per output and per argument, in schema order.
    Strategies = list[tuple[list[Placement | None], list[Placement | None]]]

    def _register(op: torch._ops.OpOverload) -> Callable[[Callable[..., Strategies]], Callable[..., Strategies]]:
        """``register_sharding(op)``, with every argument in the key of DTensor's cache of propagated shardings.

        register_sharding keys that cache on the tensors' specs and the int arguments only. An output's dtype also
        follows ``casting_mode`` (rms_norm, add_rms_norm) and ``qk_dtype`` (rope_backward), so a call differing from
        an earlier one only there would get the earlier output's recorded dtype (the values and the DTensor's own
        dtype stay right, its metadata would not). The table written here is the one register_sharding fills.
        """

        def decorate(strategy: Callable[..., Strategies]) -> Callable[..., Strategies]:
            register_sharding(op)(strategy)
            DTensor._op_dispatcher.sharding_propagator.op_to_schema_info[op] = RuntimeSchemaInfo(
                static_argnum=0, needs_pytree=True
            )
            return strategy

        return decorate

    def _row_placements(ndim: int) -> list[Placement]:
        """Placements of x a per-row op over the last dimension runs under locally."""
        return [Replicate(), *(Shard(dim) for dim in range(ndim - 1))]

    def _column_sum(x_placement: Placement) -> Placement:
        """Placement of a sum over all rows (dw, db) when x has ``x_placement``: each rank sums its own rows."""
        return Partial() if isinstance(x_placement, Shard) else Replicate()

    @_register(torch.ops.liger_lab.rms_norm.default)
    def _rms_norm(
        x: Spec, weight: Spec, eps: float, offset: float, casting_mode: str, in_place_backward: bool
    ) -> Strategies:
        return [([p, p], [p, Replicate(), None, None, None, None]) for p in _row_placements(x.ndim)]

    @_register(torch.ops.liger_lab.rms_norm_backward.default)
    def _rms_norm_backward(dy: Spec, x: Spec, weight: Spec, rstd: Spec, offset: float) -> Strategies:
        return [([p, _column_sum(p)], [p, p, Replicate(), p, None]) for p in _row_placements(x.ndim)]

    @_register(torch.ops.liger_lab.add_rms_norm.default)
    def _add_rms_norm(
        x: Spec, residual: Spec, weight: Spec, eps: float, offset: float, casting_mode: str
    ) -> Strategies:
        return [([p, p, p], [p, p, Replicate(), None, None, None]) for p in _row_placements(x.ndim)]

    @_register(torch.ops.liger_lab.add_rms_norm_backward.default)
    def _add_rms_norm_backward(
        dy: Spec, ds: Spec | None, s: Spec, weight: Spec, rstd: Spec, offset: float
    ) -> Strategies:
        # ds is None when the loss does not use the sum: no placement for it then.
        return [
            ([p, _column_sum(p)], [p, None if ds is None else p, p, Replicate(), p, None])
            for p in _row_placements(s.ndim)
        ]

    @_register(torch.ops.liger_lab.layer_norm.default)
    def _layer_norm(x: Spec, weight: Spec, bias: Spec, eps: float, offset: float) -> Strategies:
        return [([p, p, p], [p, Replicate(), Replicate(), None, None]) for p in _row_placements(x.ndim)]

    @_register(torch.ops.liger_lab.layer_norm_backward.default)
    def _layer_norm_backward(dy: Spec, x: Spec, weight: Spec, mean: Spec, rstd: Spec, offset: float) -> Strategies:
        return [([p, _column_sum(p), _column_sum(p)], [p, p, Replicate(), p, p, None]) for p in _row_placements(x.ndim)]

    def _elementwise_placements(ndim: int) -> list[Placement]:
        """Placements of an elementwise op's inputs (all alike): any dimension may be sharded."""
        return [Replicate(), *(Shard(dim) for dim in range(ndim))]

    @_register(torch.ops.liger_lab.glu.default)
    def _glu(gate: Spec, up: Spec, activation: str, in_place_backward: bool) -> Strategies:
        return [([p], [p, p, None, None]) for p in _elementwise_placements(gate.ndim)]

    @_register(torch.ops.liger_lab.glu_backward.default)
    def _glu_backward(dout: Spec, gate: Spec, up: Spec, activation: str) -> Strategies:
        return [([p, p], [p, p, p, None]) for p in _elementwise_placements(gate.ndim)]

    def _rope_placements(q: Spec, cos: Spec) -> list[tuple[Placement, Placement]]:
        """(placement of q and k, placement of cos and sin) pairs: q, k (B, heads, T, D); cos, sin (B or 1, T, D)."""
        # A (1, T, D) table serves every batch element: each rank needs all of it.
        batch = (Shard(0), Shard(0) if cos.shape[0] > 1 else Replicate())
        return [(Replicate(), Replicate()), batch, (Shard(1), Replicate()), (Shard(2), Shard(1))]

    @_register(torch.ops.liger_lab.rope.default)
    def _rope(q: Spec, k: Spec, cos: Spec, sin: Spec) -> Strategies:
        return [([qk, qk], [qk, qk, cs, cs]) for qk, cs in _rope_placements(q, cos)]

    @_register(torch.ops.liger_lab.rope_backward.default)
    def _rope_backward(dq_out: Spec, dk_out: Spec, cos: Spec, sin: Spec, qk_dtype: torch.dtype) -> Strategies:
        return [([qk, qk], [qk, qk, cs, cs, None]) for qk, cs in _rope_placements(dq_out, cos)]
