"""Staging plugin ``cpu``: copies the state dict into host memory for ``dcp.async_save``."""

from __future__ import annotations

from typing import Any

from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

import tierstore
from tierstore.kinds import Stager


class CpuStager(Stager):
    """A plain copy into fresh CPU tensors (DTensor and ShardedTensor included)."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged = _create_cpu_state_dict(state_dict)
        _copy_state_dict(state_dict, staged, type_check=False)
        return staged


@tierstore.hookimpl
def tierstore_register_staging(register):
    register("cpu", CpuStager)
