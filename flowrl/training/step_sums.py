"""One iteration's update diagnostics, folded on the device and read back at once (:mod:`flowrl.training.updater`).

Each micro-batch's diagnostics (0-d tensors an objective computed) fold into a :class:`DeviceSums` where they are, with
no host read per micro-batch; :func:`host_values` reads every step's sums back with one ``tolist`` per device, and
:func:`fold_steps` folds the steps on the host into the iteration's sums, with their units under :data:`UNITS` and
the auxiliary term's steps under :data:`STEPS`.
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.distributed.process_group import fold

# the counts folded beside the diagnostics (see flowrl.training.updater.Updater._averages)
UNITS, STEPS = "__units", "__steps"


_TORCH_EXTREMES = {min: torch.minimum, max: torch.maximum}  # the objectives' extremes, as tensor functions


class DeviceSums:
    """One optimizer step's diagnostics, accumulated where the objective computed them (no host read per
    micro-batch): size-weighted sums, and the keys of ``extremes`` combined by their min/max. ``values``: key →
    0-d tensor (fp64); :func:`host_values` reads many of them back at once."""

    def __init__(self, extremes: dict[str, Any]):
        self.extremes = extremes
        self.values: dict[str, torch.Tensor] = {}

    def add(self, diag: dict[str, Any], size: int) -> None:
        """Fold one micro-batch's diagnostics (0-d tensors or numbers) of ``size`` units."""
        for key, value in diag.items():
            v = torch.as_tensor(value).detach().reshape(())
            v = v.to(torch.float32 if v.device.type == "mps" else torch.float64)
            if key not in self.extremes:
                v = v * size
            if key not in self.values:
                self.values[key] = v
            elif key in self.extremes:
                combine = _TORCH_EXTREMES.get(self.extremes[key], self.extremes[key])
                self.values[key] = combine(self.values[key], v)
            else:
                self.values[key] = self.values[key] + v


def host_values(parts: list[DeviceSums]) -> list[dict[str, float]]:
    """Every part's values as floats, read back with one ``tolist`` per device (one host synchronisation on an
    accelerator, whatever the number of parts and keys)."""
    flat = [(i, key, v) for i, part in enumerate(parts) for key, v in part.values.items()]
    out: list[dict[str, float]] = [{} for _ in parts]
    for device in {v.device for _, _, v in flat}:
        mine = [(i, key, v) for i, key, v in flat if v.device == device]
        for (i, key, _), number in zip(mine, torch.stack([v for _, _, v in mine]).tolist()):
            out[i][key] = number
    return out


def fold_steps(
    step_diags: list[tuple[DeviceSums, float, DeviceSums | None]], extremes: dict, first_keys: tuple[str, ...]
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """The iteration's diagnostics on the host, read back in one go (:func:`host_values`): (every optimizer
    step's sums folded, with the units under ``UNITS``; the auxiliary term's sums with the steps that had one
    under ``STEPS``; the first step's ``first_keys``, before any weight changed, with its units)."""
    values = host_values([d for sums, _, aux in step_diags for d in (sums, aux) if d is not None])
    diag_sums: dict[str, float] = {}
    aux_sums: dict[str, float] = {}
    first_sums: dict[str, float] = {}
    for k, (_, seen, aux) in enumerate(step_diags):
        step = {**values.pop(0), UNITS: seen}
        if k == 0:  # weights not yet updated (a policy's ratios must be exactly 1)
            first_sums = {key: v for key, v in step.items() if key in first_keys or key == UNITS}
        for key, v in step.items():
            fold(diag_sums, key, v, extremes)
        if aux is not None:
            for key, v in values.pop(0).items():
                aux_sums[key] = aux_sums.get(key, 0.0) + v
            aux_sums[STEPS] = aux_sums.get(STEPS, 0.0) + 1.0
    return diag_sums, aux_sums, first_sums
