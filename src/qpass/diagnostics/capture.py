"""Capture the input activation of every linear site while a graph runs (torch.fx Interpreter).

Works on any qpass graph: ``aten.linear`` nodes and the rollout ops (``qpass::nvfp4_linear``,
``qpass::fp8_linear``) are recognised by their ``qpass_linear_site`` stamp; an ``act_qdq`` in front
of a linear is looked through (the recorded input is the pre-quantization activation, ``X`` in
SPEC §2), so learner and rollout inputs of the same site compare like for like.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, sites: set[str] | None) -> None:
        super().__init__(gm)
        self.sites = sites
        self.acts: dict[str, torch.Tensor] = {}
        qdq = getattr(torch.ops.qpass, "nvfp4_act_qdq", None)
        self._qdq = qdq.default if qdq is not None else None

    def run_node(self, n: torch.fx.Node) -> Any:
        sid = n.meta.get("qpass_linear_site") if n.op == "call_function" else None
        if sid is not None and (self.sites is None or sid in self.sites) and sid not in self.acts:
            x_node = n.args[0]
            if isinstance(x_node, torch.fx.Node) and x_node.target == self._qdq:
                x_node = x_node.args[0]
            x = self.env[x_node] if isinstance(x_node, torch.fx.Node) else x_node
            self.acts[sid] = x.detach().reshape(-1, x.shape[-1]).clone()
        return super().run_node(n)


@torch.no_grad()
def capture_linear_inputs(gm: torch.fx.GraphModule, args: tuple, sites: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Run ``gm(*args)`` and return ``{site: input activation [M, K]}`` (first call of each site).

    Rows are the flattened leading dims of the activation (batch x sequence).
    """
    rec = _Recorder(gm, set(sites) if sites is not None else None)
    rec.run(*args)
    return rec.acts
