"""The forest's scoring helpers (a mixin of :class:`~flowrl.rollout.forest.Forest`).

Leaves are always scored (their latents are clean samples); a plan may ask for intermediate states to be scored too
with :meth:`~ForestScores.add_probe` (node, clean-latent estimate: an ODE completion, an x̂0 projection).
:meth:`~ForestScores.score_requests` lists both; the trainer decodes and scores them and records the results with
:meth:`~ForestScores.record_scores` and :meth:`~ForestScores.combine_scores`. The probes' latents live in
``_probe_blocks`` (on the forest's ``device``, beside the nodes' latents), their nodes in ``probe_node``.
"""

from __future__ import annotations

import torch


class ForestScores:
    """Probes, score requests and the scores' columns (``reward_components``, ``reward``, ``value``) of a forest."""

    def add_probe(self, nodes: torch.Tensor, x0: torch.Tensor) -> None:
        """Ask for intermediate states ``nodes`` [Q] to be scored through the clean-latent estimates
        ``x0`` [Q, C, H, W] (e.g. ODE completions or x̂0 projections); their combined score lands in
        ``value``. Leaves are scored anyway and cannot be probed."""
        nodes = torch.as_tensor(nodes, dtype=torch.long).cpu().reshape(-1)
        if x0.shape[0] != nodes.shape[0]:
            raise ValueError(f"add_probe: {nodes.shape[0]} nodes but {x0.shape[0]} latents")
        self.probe_node = torch.cat([self.probe_node, nodes])
        self._probe_blocks.append(x0.detach().to(self.device, torch.float32))  # beside the nodes' latents

    def probe_latents(self) -> torch.Tensor:
        """Clean-latent estimates of the probed states [Q, C, H, W], in ``probe_node`` order."""
        if not self._probe_blocks:
            return torch.zeros((0,) + tuple(self._latent_blocks[0].shape[1:]), device=self.device)
        if len(self._probe_blocks) > 1:
            self._probe_blocks = [torch.cat(self._probe_blocks)]
        return self._probe_blocks[0]

    def score_requests(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Nodes to score [S] and their clean latents [S, C, H, W]: every leaf, then every probe."""
        leaves = self.leaves()
        if self.probe_node.numel() and bool(torch.isin(self.probe_node, leaves).any()):
            raise ValueError("a probe was added on a leaf: leaves are scored from their own latents")
        nodes = torch.cat([leaves, self.probe_node])
        return nodes, torch.cat([self.latents_of(leaves), self.probe_latents()])

    def record_scores(self, nodes: torch.Tensor, components: dict[str, torch.Tensor]) -> None:
        """Write each reward term's raw scores [S] of ``nodes`` [S] into ``reward_components``. A non-finite
        score (±inf, NaN: a broken reward or server) is stored as NaN: it counts as a failed reward, is left
        out of every statistic and never trained (``reward_failed`` in the metrics)."""
        for name, values in components.items():
            column = self.reward_components.setdefault(name, torch.full((self.num_nodes,), float("nan")))
            values = values.detach().float().cpu()
            column[nodes] = torch.where(torch.isfinite(values), values, torch.full_like(values, float("nan")))

    def combine_scores(self, combine) -> None:
        """``reward`` on the leaves and ``value`` on the probed states from ``reward_components``:
        ``combine(components {name: [S]}, groups [S]) → [S]`` (a MultiReward's :meth:`combine`),
        applied to the leaves and to the probed states separately."""
        if not self.reward_components:
            return
        for nodes, column in ((self.leaves(), self.reward), (self.probe_node, self.value)):
            if nodes.numel():
                column[nodes] = combine(
                    {k: v[nodes] for k, v in self.reward_components.items()}, self.group[nodes]
                ).float()
