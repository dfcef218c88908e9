"""Does the attention output follow the memory layout of q? Why a norm must keep its input's layout.

    python -m benchmarks.experiments.attention_layout [--json FILE]

Gemma 3 normalises q and k after ``transpose(1, 2)``: the norm gets a (B, T, H, D) tensor viewed as (B, H, T, D).
For each of the two layouts of q, k and v (contiguous (B, H, T, D), and (B, T, H, D) viewed as (B, H, T, D)) and
with and without a mask, this prints the strides of ``F.scaled_dot_product_attention``'s output and whether
``out.transpose(1, 2).reshape(B, T, H * D)``, the view transformers takes before ``o_proj``, has to copy. A copy
there is an extra activation per layer, since ``o_proj`` saves its input for the backward. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from liger_lab import runtime
from liger_lab.workbook import results


def layouts(batch: int = 2, seq: int = 2048, heads: int = 8, head_dim: int = 256) -> list[dict]:
    def contiguous() -> torch.Tensor:
        return torch.randn(batch, heads, seq, head_dim, device=runtime.DEVICE, dtype=torch.bfloat16)

    def transposed() -> torch.Tensor:
        return torch.randn(batch, seq, heads, head_dim, device=runtime.DEVICE, dtype=torch.bfloat16).transpose(1, 2)

    causal = torch.ones(seq, seq, dtype=torch.bool, device=runtime.DEVICE).tril()[None, None]
    rows = []
    for layout, make in (("(B, H, T, D) contiguous", contiguous), ("(B, T, H, D) viewed as (B, H, T, D)", transposed)):
        q, k, v = make(), make(), make()
        for mask in (causal, None):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            flat = out.transpose(1, 2).reshape(batch, seq, heads * head_dim)
            rows.append({"op": "attention_layout", "q_layout": layout, "mask": mask is not None,
                         "out_strides": list(out.stride()), "o_proj_input_copies": flat.data_ptr() != out.data_ptr(),
                         "shape": [batch, heads, seq, head_dim]})  # fmt: skip
            print(f"q {layout:<36} mask={mask is not None!s:<6} output strides {tuple(out.stride())}: "
                  f"the view before o_proj {'copies' if rows[-1]['o_proj_input_copies'] else 'is free'}")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if runtime.INTERPRET:
        raise SystemExit("attention_layout asks the GPU's attention kernels: it needs a CUDA GPU")
    rows = layouts()
    if args.json:
        results.write_rows(rows, args.json)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
