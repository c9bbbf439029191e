"""Make FakeTensors and their meta storages directly, without dispatching an op through FakeTensorMode.

Replaying a memoised node (cost_models.fake_memo) gives its outputs fresh storages, or views of
its inputs' storages, and a node that runs after replayed ones needs those outputs as
FakeTensors. Making them with ``torch.empty``, ``as_strided``, ``detach`` and
``requires_grad_`` under FakeTensorMode costs about 150 us per op (each is hashed into the
mode's dispatch cache and its output synthesised). FakeTensorMode itself synthesises a cached
op's output by allocating a meta tensor with dispatch turned off and wrapping it as
``FakeTensor(mode, meta, device)``; doing the same here gives the same tensor (layout, storage,
device, requires_grad, a leaf) in a few microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch


def fresh_storage(nbytes: int) -> torch.UntypedStorage:
    """A new meta storage of ``nbytes`` bytes (no memory behind it), as a fake tensor's is."""
    with no_dispatch():
        return torch.empty((nbytes,), dtype=torch.uint8, device="meta").untyped_storage()


def fake_view(mode: FakeTensorMode, storage: torch.UntypedStorage, shape: Sequence[int],
              stride: Sequence[int], offset: int, dtype: torch.dtype, device: torch.device,
              requires_grad: bool) -> FakeTensor:
    """A leaf FakeTensor of ``mode`` on ``device`` that views ``storage`` (a meta storage).

    It is what ``base.as_strided(shape, stride, offset).detach().requires_grad_(requires_grad)``
    gives under ``mode`` when the fake ``base`` owns ``storage``: it shares the storage, is not
    a view in autograd's sense, and has no history.
    """
    with no_dispatch():
        meta = torch.empty((0,), dtype=dtype, device="meta")
        meta.set_(storage, offset, shape, stride)
        meta.requires_grad_(requires_grad)
    return FakeTensor(mode, meta, device)
