"""Plain torch building blocks of the kernels' references: gather a sequence's K/V through its block
table, and attend with an explicit bottom-right-aligned causal mask, all in fp32.

These are deliberately the slow, obvious way: a Python loop over sequences, the whole context
materialized. They define what each kernel must compute.
"""

from __future__ import annotations

import torch


def gather_reference(cache: torch.Tensor, table: list[int] | torch.Tensor, ctx: int,
                     scale: torch.Tensor | None = None) -> torch.Tensor:
    """The first ctx rows of a sequence, in fp32: cache [num_blocks, block_size, H, D] -> [ctx, H, D].

    scale [num_blocks, block_size, H] dequantizes an int8 cache (one scale per token and head).
    """
    table = torch.as_tensor(table, dtype=torch.long, device=cache.device)
    rows = cache[table].flatten(0, 1)[:ctx].float()
    if scale is not None:
        rows = rows * scale[table].flatten(0, 1)[:ctx, :, None]
    return rows


def attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Tq, Hq, D] at the last Tq positions of k [Tk, Hkv, D], v [Tk, Hkv, Dv] -> fp32 [Tq, Hq, Dv].

    Query i sits at absolute position Tk - Tq + i and sees keys 0..that position.
    """
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1)  # [Tk, Hq, D]: fine for a reference, the kernels never do it
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [Hq, Tq, Tk]
    q_pos = torch.arange(tq, device=q.device) + tk - tq
    visible = torch.arange(tk, device=q.device)[None, :] <= q_pos[:, None]  # [Tq, Tk]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)
