"""Projections that read the same input run as one GEMM.

A decoder layer's query, key and value projections (and its MLP's gate and up projections) each
multiply the same hidden states by their own weight: at decode batch sizes the key and value
products are too small to fill the GPU. :func:`fuse_projections` concatenates such weights into
one and replaces the projections by members of the group; the first member called with an input
computes the whole product, the others return their slices of it, so the model code (transformers')
stays as it is. Each member's output equals its own product up to the GEMM's accumulation order.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

# sibling projections of the module that holds them (transformers' names) -> the fused module's
# name (vLLM's)
GROUPS = {("q_proj", "k_proj", "v_proj"): "qkv_proj", ("gate_proj", "up_proj"): "gate_up_proj"}


class FusedLinear(nn.Module):
    """The concatenated weight and bias of sibling projections, and the product of the input
    they last read until every member has taken its slice."""

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        self.weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]),
                                   requires_grad=False)
        # fuse_projections groups members that all have a bias or none
        self.bias = (nn.Parameter(torch.cat([m.bias.detach() for m in linears]),
                                  requires_grad=False) if linears[0].bias is not None else None)
        ends = list(itertools.accumulate(m.out_features for m in linears))
        self.bounds = list(zip([0] + ends[:-1], ends))
        self._x = self._y = None
        self._left = 0

    def slice(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self._x is not x:  # the first member called with this input
            self._x, self._y, self._left = x, F.linear(x, self.weight, self.bias), len(self.bounds)
        lo, hi = self.bounds[i]
        y = self._y[..., lo:hi]
        self._left -= 1
        if self._left == 0:  # every member took its slice: nothing outlives the step
            self._x = self._y = None
        return y


class FusedMember(nn.Module):
    """One projection of a :class:`FusedLinear` group (it keeps the original's sizes)."""

    def __init__(self, group: FusedLinear, i: int):
        super().__init__()
        object.__setattr__(self, "group", group)  # held by the parent module, not by each member
        self.i = i
        self.in_features = group.weight.shape[1]
        self.out_features = group.bounds[i][1] - group.bounds[i][0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.slice(x, self.i)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part {self.i}"


def fuse_projections(model: nn.Module) -> int:
    """Replace every group of sibling projections (plain ``nn.Linear`` of one input size, dtype
    and device, all with a bias or none) by one :class:`FusedLinear` and its members; returns
    the number of groups fused."""
    n = 0
    for module in list(model.modules()):
        for names, fused in GROUPS.items():
            linears = [getattr(module, name, None) for name in names]
            if hasattr(module, fused) or not all(type(m) is nn.Linear for m in linears):
                continue
            w = linears[0].weight
            if any(m.in_features != linears[0].in_features or m.weight.dtype != w.dtype
                   or m.weight.device != w.device for m in linears):
                continue
            if len({m.bias is None for m in linears}) > 1:
                continue
            group = FusedLinear(linears)
            module.add_module(fused, group)
            for i, name in enumerate(names):
                setattr(module, name, FusedMember(group, i))
            n += 1
    return n
