"""Mixture-of-experts support: per-expert linear sites, routing record/replay, sparse upcycling.

* :mod:`qpass.moe.experts` — replaces any transformers experts module (fused 3-D ``gate_up_proj`` /
  ``down_proj`` parameters, whatever ``experts_implementation`` is configured) by per-expert
  ``nn.Linear`` s, so every expert projection is one ``aten.linear`` site
  ``model.layers.N.mlp.experts.E.{gate,up,down}_proj`` in the captured graph.
* :mod:`qpass.moe.routing` — the ``qpass::moe_route`` op on every router's top-k indices: records
  the routes, replays recorded routes (the learner reuses the rollout's), and the routing-mismatch
  diagnostic.
* :mod:`qpass.moe.upcycle` — sparse upcycling of a dense Llama-style model into Qwen3-MoE
  (``--model moe-default``).
"""

from qpass.moe.experts import prepare_moe  # noqa: F401
