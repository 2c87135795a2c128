"""The forest's edge columns computed on the model's device (a mixin of :class:`~flowrl.rollout.forest.Forest`).

An edge's log-prob and transition std come out of the kernel on the model's device. :meth:`Forest.add_children`
starts their copy to the host without waiting (:func:`flowrl.rollout.transfer.host_copy`) and appends placeholders;
the first read of ``logp_old`` [N], ``std`` [N] or ``stochastic`` [N] settles every copy still in flight (on CUDA one
wait, after the rollout; on the CPU the values are there already). Writing a column settles first, too. The columns
live in ``_logp_old``, ``_std`` and ``_stochastic``; ``_pending`` lists the copies in flight as
(first node, values [2, M] (log-prob, std), ready event or None, whether the kernel is stochastic).
"""

from __future__ import annotations

import torch


class _Settled:
    """A column of :class:`DeviceColumns` (held in ``_<name>``): read or written only after the copies in flight have
    landed (``_settle``)."""

    def __init__(self, doc: str):
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = f"_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        obj._settle()
        return getattr(obj, self.attr)

    def __set__(self, obj, value: torch.Tensor) -> None:
        obj._settle()
        setattr(obj, self.attr, value)


class DeviceColumns:
    """``logp_old``, ``std`` and ``stochastic`` as properties that settle the copies in flight (module docstring)."""

    def _settle(self) -> None:
        """Write the edge values still in flight into ``logp_old``, ``std`` and ``stochastic`` (on CUDA: one wait for
        the copies started by :meth:`add_children`; the rollout itself never waits for them)."""
        pending, self._pending = self._pending, []
        for start, host, ready, trainable_kernel in pending:
            if ready is not None:
                ready.synchronize()
            end = start + host.shape[1]
            self._logp_old[start:end] = host[0]
            self._std[start:end] = host[1]
            self._stochastic[start:end] = (host[1] > 0) & trainable_kernel

    logp_old = _Settled(
        "Log-prob of each node's incoming edge under the rollout's policy [N] (0 on roots and ODE edges)."
    )
    std = _Settled("The transition std of each node's incoming edge [N] (0: deterministic).")
    stochastic = _Settled("Whether each node's incoming edge is an SDE edge with std > 0 [N] bool (trainable).")
