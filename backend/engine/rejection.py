"""The acceptance rule of speculative decoding: modified rejection sampling (Leviathan et al. 2023).

Accept draft x with probability min(1, p(x) / q(x)); at the first rejection draw from
norm(max(0, p - q)); if all k are accepted, draw a bonus token from the target's next p. Whatever
q is, every appended token is distributed exactly as the target would have sampled it. The
executor runs it (sample_step.py) on the target's distributions and the drafts' q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.backend.engine.sampler import draw


@dataclass
class Verdict:
    num_accepted: int
    token_id: int  # the resampled token (a rejection) or the bonus token (all accepted)
    source: str  # resampled | bonus
    accepted: list[bool]  # per drafted token (False after the first rejection: never looked at)


def verify(p: torch.Tensor, q: torch.Tensor, drafts: list[int], uniforms: list[float], greedy: bool) -> Verdict:
    """Modified rejection sampling. p [k+1, V] target, q [k, V] proposer, k = len(drafts).

    uniforms: k + 1 draws (none when greedy): the j-th decides draft j, the last draws the token
    that follows (resampled or bonus). Drawn before the verdict, each is independent of it."""
    k = len(drafts)
    p_x, q_x = p[range(k), drafts].tolist(), q[range(k), drafts].tolist()
    for j, x in enumerate(drafts):
        # Greedy: p and q are one-hot, so the ratio is 0 or 1 and no random number is needed.
        ratio = p_x[j] / q_x[j] if q_x[j] > 0 else 0.0
        accept = ratio >= 1.0 if greedy else uniforms[j] < ratio
        if accept:
            continue
        residual = (p[j] - q[j]).clamp(min=0)
        if residual.sum() <= 0:  # p <= q everywhere means p == q: x could not have been rejected
            residual = p[j]
        token = int(residual.argmax()) if greedy else int(draw(residual[None], uniforms[k:])[0])
        return Verdict(j, token, "resampled", [True] * j + [False] * (k - j))
    token = int(p[k].argmax()) if greedy else int(draw(p[k][None], uniforms[k:])[0])
    return Verdict(k, token, "bonus", [True] * k)
