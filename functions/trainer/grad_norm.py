"""The global gradient norm and the clip rule's epsilon, shared by both optimizer families
(AdamW in `optimizer.py`, Dimuon in `dimuon.py`), so a clipped step is the same in either."""

from __future__ import annotations

import torch

# What torch.nn.utils.clip_grad_norm_ adds to the norm before dividing.
CLIP_EPSILON = 1e-6


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros(())
    # One norm per tensor, as torch.nn.utils.clip_grad_norm_ takes them on CPU (its
    # `_foreach_norm` path rounds differently on large tensors).
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
