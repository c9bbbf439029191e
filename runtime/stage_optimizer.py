"""One stage's optimizer: master copies of its parameters where the plan puts them, the optimizer
over them, and the copies between masters and parameters (ZeRO-1/2/3, ZeRO-Offload, ZeRO-Infinity).

The plan's ``offload`` section decides, per stage (planner/plan/parts.py ``OffloadSpec``):

* ``optimizer_state`` gpu, ``zero_stage`` 0: the optimizer steps the parameters themselves (no copy).
* ``optimizer_state`` host: master copies on the CPU (the parameters' dtype: fp32/fp64 plans);
  the step copies gradients down into ``master.grad``, steps the masters with torch's own
  optimizer (``foreach`` on, as on every tier), copies the masters back into the parameters and drops
  the gradients.
  On a CPU-only run the "device" is the CPU: the same path, with separate tensors.
* ``optimizer_state`` nvme: as host, and between steps the masters and the per-element state live
  only in a file of ``--nvme-dir`` (runtime/nvme.py); the read starts at the stage's first backward
  of the step (:meth:`StageOptimizer.prefetch`), the write after the step.
* ``grads_on_host`` (with the step on the host or NVMe; ZeRO-Offload's gradients): a hook on each parameter
  takes the gradient each backward made off the device as soon as it is made (:meth:`_gradient_down`: cast
  on the device to the masters' dtype, copied down, added to the parameter's sum on the host), so the
  device holds no gradient between backwards; the step reads the sums. Tied parameters, summed across
  stages on the device after the backwards, keep theirs there. One copy of the stage only: a data-parallel
  all-reduce sums gradients on the device (runtime/checks.py refuses more copies).
* ``zero_stage`` >= 1 over the stage's data-parallel group (runtime/sharding.py): each rank's masters
  are its chunks of the parameters (on the tier's device), it steps only those, then the updated
  chunks are all-gathered into the parameters, bucket by bucket (1, 2), or kept as the parameter's
  shard (3).
  2 reduce-scatters the gradients at the stage's ``ALLREDUCE`` (after the last micro-batch:
  the gradients of all micro-batches are accumulated whole, then each rank keeps its chunk of
  the sum). 3 also keeps parameters freed between uses: each layer gathers its own around its forward and
  backward and reduce-scatters its gradients after each backward (runtime/layer_gathers.py, through
  :meth:`gather`, :meth:`release` and :meth:`reduce_now`); :meth:`in_use` gathers the rest (parameters read
  through get_attr) around a whole forward or backward, and their gradients are reduce-scattered at
  ``ALLREDUCE`` as 2's are. Tied parameters (summed across stages) and scalars are never sharded.

Mixed precision (fp16/bf16, runtime/precision.py) uses the same masters on every tier: ``sources``
are fp32 copies of the parameters taken before the model was cast to 16 bits; the masters are
made from them (or their chunks), the copy-down casts the 16-bit gradients to fp32 (and undoes
the fp16 loss scale: :class:`runtime.precision.MixedPrecision` checks :meth:`gradients` for overflow
on every rank, then calls :meth:`step` or :meth:`skip`), the copy-back rounds to 16 bits.

Every tier steps in buckets of gradients (:meth:`StageOptimizer.step`), so that what the step itself
allocates (the masters' gradients, the copies, torch's multi-tensor temporaries) is one bucket's. The
plain path with an optimizer that updates in place (:func:`steps_in_place`: SGD, as
cost_models.memory's ``step_temporaries`` counts it) allocates nothing to bound, and steps once: each
bucket's step would walk every parameter again.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from cost_models.memory import step_bucket_bytes, step_buckets
from planner.plan import OffloadSpec, ParamTier, StateTier
from runtime.nvme import PagedFile
from runtime.sharding import PendingGather, ShardGroup, ShardLayout, fill_storage, free_storage
from runtime.stages import OptimizerFactory


class StageOptimizer:
    """The masters, optimizer and copies of one stage (see the module docstring for each tier)."""

    def __init__(self, stage: int, params: Mapping[str, nn.Parameter], factory: OptimizerFactory, *,
                 spec: OffloadSpec, device: torch.device, shards: ShardGroup | None = None,
                 replicated: frozenset[str] = frozenset(), pager: PagedFile | None = None,
                 sources: Sequence[torch.Tensor] | None = None) -> None:
        self.stage, self.spec, self.device, self.pager = stage, spec, device, pager
        self.names, self.params = list(params), list(params.values())
        self._sources = sources  # mixed precision: fp32 weights the masters start from (then dropped)
        zero = spec.zero_stage if shards is not None and shards.world > 1 else 0
        self.sharded = [zero >= 1 and name not in replicated and param.dim() > 0
                        for name, param in params.items()]
        self.zero_stage = zero if any(self.sharded) else 0
        self.shards = shards if self.zero_stage else None
        self.layout = (self.shards.layout([p.numel() for p, s in zip(self.params, self.sharded) if s])
                       if self.shards is not None else None)
        self._slot = {}  # parameter index -> index in the shard layout
        for index, sharded in enumerate(self.sharded):
            if sharded:
                self._slot[index] = len(self._slot)
        self.plain = spec.optimizer_state is StateTier.GPU and not self.zero_stage and sources is None
        self.state_device = device if spec.optimizer_state is StateTier.GPU else torch.device("cpu")
        self.masters = self.params if self.plain else [nn.Parameter(self._new_master(i), requires_grad=True)
                                                       for i in range(len(self.params))]
        self.optimizer = factory(list(self.masters))
        for group in self.optimizer.param_groups:  # torch's multi-tensor kernels (its default on CUDA) on the
            if group.get("foreach", False) is None:  # CPU too: the step's temporaries are a bucket's on every
                group["foreach"] = True  # device, as cost_models.memory.step_transient_bytes counts them
        self.grad_chunks: dict[int, torch.Tensor] = {}
        self.param_shards = self._initial_shards() if self.zero_stage == 3 else {}
        self._holds: dict[int, int] = {}  # ZeRO-3: gathers not yet released, per parameter
        self._ahead: tuple[tuple[int, ...], list[int], PendingGather] | None = None  # ZeRO-3: a gather started early
        self._layered: frozenset[int] = frozenset()  # ZeRO-3: parameters their layers gather (attach_layers)
        self._end_pass: Callable[[], None] | None = None
        # grads_on_host: each sent parameter's gradient summed on the host, in buffers made once (the plan counts
        # them as host memory all along), and which of them hold this step's sum
        self.host_grads = {index: self._new_host_buffer(index) for index, (name, param) in enumerate(params.items())
                           if spec.grads_on_host and name not in replicated and param.requires_grad}
        self._summed: set[int] = set()
        self._sent_ids = {id(self.params[index]): index for index in self.host_grads}
        for index in self.host_grads:
            self.params[index].register_post_accumulate_grad_hook(functools.partial(self._gradient_down, index))
        self._paged: list[tuple[int, str]] = []  # (master index, state key) of the paged state, file order
        self._master_shapes = [m.shape for m in self.masters]
        self._sources = None
        if self.pager is not None:
            self._page_out()

    # ------------------------------------------------------------ set-up
    def _new_master(self, index: int, sources: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        sources = sources if sources is not None else self._sources
        param = (self.params[index] if sources is None else sources[index]).detach()
        if self.sharded[index]:
            assert self.layout is not None
            master = self.layout.chunk(self._slot[index], param).to(self.state_device)
        else:
            master = param.to(self.state_device, copy=True)
        # host masters of a GPU's parameters: pinned, so the copies each step run at the link's speed
        return master.pin_memory() if self.device.type == "cuda" and master.device.type == "cpu" else master

    def _initial_shards(self) -> dict[int, torch.Tensor]:
        """ZeRO-3: each sharded parameter's chunk on the device (the master itself on the GPU tier,
        a copy otherwise, also where the CPU stands in for the device), or with the parameters on the host a
        copy there (pinned beside a GPU; never the master, which NVMe pages out); the parameter's memory freed."""
        shards = {}
        on_device = self.spec.optimizer_state is StateTier.GPU
        home = torch.device("cpu") if self.spec.params is ParamTier.HOST else self.device
        for index, master in enumerate(self.masters):
            if self.sharded[index]:
                dtype = self.params[index].dtype  # 16 bits under mixed precision: a copy, not the master
                shard = (master.detach() if on_device and dtype == master.dtype and home == self.device
                         else master.detach().to(home, dtype, copy=True))
                shards[index] = shard.pin_memory() if self.device.type == "cuda" and home.type == "cpu" else shard
                free_storage(self.params[index])
        return shards

    # ------------------------------------------------------------ hooks the executor calls
    @property
    def unsharded_names(self) -> frozenset[str]:
        """Parameters kept whole on every replica (tied ones, scalars; all of them without ZeRO)."""
        return frozenset(name for name, sharded in zip(self.names, self.sharded) if not sharded)

    @property
    def reduces_gradients(self) -> bool:
        """The stage's ALLREDUCE is a reduce-scatter here (ZeRO-2/3), not the plain all-reduce."""
        return self.zero_stage >= 2

    def reduce_gradients(self, label: str) -> None:
        """Sum the sharded parameters' gradients over the group; keep this rank's chunk, free the rest."""
        assert self.shards is not None and self.layout is not None
        indices = [i for i in self._slot if self.params[i].grad is not None]
        if not indices:
            return
        fulls = [self.params[i].grad if i in indices else torch.zeros_like(self.params[i]) for i in self._slot]
        chunks = self.shards.reduce_scatter(self.layout, fulls, label)  # type: ignore[arg-type]
        for index, chunk in zip(self._slot, chunks):
            if index in indices:
                self.grad_chunks[index] = self.grad_chunks[index] + chunk if index in self.grad_chunks else chunk
                self.params[index].grad = None

    @contextlib.contextmanager
    def in_use(self, *, whole: bool = False) -> Iterator[None]:
        """ZeRO-3: the stage's parameters that no layer gathers itself (runtime/layer_gathers.py; every one if
        ``whole``) all-gathered for the enclosed forward or backward, freed after."""
        if self.zero_stage != 3:
            yield
            return
        indices = [index for index in self.param_shards if whole or index not in self._layered]
        self.gather(indices)
        try:
            yield
        finally:
            self.release(indices)
            if not whole and self._end_pass is not None:
                self._end_pass()

    def attach_layers(self, layered: frozenset[int], end_pass: Callable[[], None]) -> None:
        """ZeRO-3: the parameters ``layered`` are gathered by their layers' hooks, which ``end_pass`` settles
        after each forward or backward (runtime/layer_gathers.py)."""
        self._layered, self._end_pass = layered, end_pass

    def gather(self, indices: Sequence[int]) -> None:
        """ZeRO-3: parameters ``indices`` whole until as many :meth:`release` calls (one all-gather of those
        not held already; every replica asks for the same ones in the same order); the gather
        :meth:`gather_ahead` started, where it was of these parameters (another is waited for and dropped, by the
        first gather that is not of parameters held already)."""
        ahead = None
        if self._ahead is not None and any(not self._holds.get(index) for index in indices):
            ahead, self._ahead = self._ahead, None  # (the next gather that needs a collective takes it)
            rows = ahead[2].finish()
            if ahead[0] != tuple(indices):
                ahead = None  # (every replica started and drops the same one)
        filled: set[int] = set()
        if ahead is not None:
            filled = {index for index in ahead[1] if not self._holds.get(index)}
            self._fill(filled, ahead[1], ahead[2].layout, rows)
        missing = [index for index in indices if not self._holds.get(index) and index not in filled]
        if missing:  # (all of them, unless gathered ahead)
            assert self.shards is not None
            layout = self.shards.layout([self.params[i].numel() for i in missing])
            rows = self.shards.all_gather(layout, [self.param_shards[i] for i in missing],
                                          f"stage {self.stage} parameters", device=self.device)
            self._fill(set(missing), missing, layout, rows)
        for index in indices:
            self._holds[index] = self._holds.get(index, 0) + 1

    def gather_ahead(self, indices: Sequence[int]) -> None:
        """ZeRO-3: start the all-gather of parameters ``indices`` that the next :meth:`gather` will ask for, so that
        it runs while this rank computes (FSDP's prefetch); nothing where one is started already or all are held.
        Every replica starts the same ones in the same order."""
        missing = [index for index in indices if not self._holds.get(index)]
        if self._ahead is not None or not missing:
            return
        assert self.shards is not None
        layout = self.shards.layout([self.params[i].numel() for i in missing])
        pending = self.shards.start_all_gather(layout, [self.param_shards[i] for i in missing],
                                               f"stage {self.stage} parameters (ahead)", device=self.device)
        self._ahead = (tuple(indices), missing, pending)

    def drop_ahead(self) -> None:
        """Wait for a gather started ahead that no :meth:`gather` took (at a pass's end), and forget it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[2].finish()

    def _fill(self, indices: set[int], gathered: Sequence[int], layout: ShardLayout,
              rows: Sequence[torch.Tensor]) -> None:
        """Parameters ``indices`` (of those ``gathered`` into ``rows``, in ``layout``) whole again."""
        for slot, (index, table) in enumerate(zip(gathered, rows)):
            if index in indices:
                fill_storage(self.params[index], layout.unpad(slot, table, self.params[index].shape))

    def release(self, indices: Sequence[int]) -> None:
        """One :meth:`gather` of ``indices`` undone: the parameters no one holds any more are freed."""
        for index in indices:
            self._holds[index] -= 1
            if not self._holds[index]:
                free_storage(self.params[index])

    def reduce_now(self, indices: Sequence[int]) -> None:
        """ZeRO-3, a layer's backward done: its parameters' gradients (``indices``, each present) summed over the
        group now, this rank adding its chunk to its sum of the step's; the whole gradients freed as soon as the
        sum's table holds them."""
        if not indices:
            return
        assert self.shards is not None
        layout = self.shards.layout([self.params[i].numel() for i in indices])
        fulls: list[torch.Tensor] = [self.params[i].grad for i in indices]  # type: ignore[misc]
        for index in indices:
            self.params[index].grad = None
        chunks = self.shards.reduce_scatter(layout, fulls, f"stage {self.stage} layer gradients", in_place=True)
        for index, chunk in zip(indices, chunks):  # (views of the sum's table: added, or copied)
            if index in self.grad_chunks:
                self.grad_chunks[index].add_(chunk)
            else:
                self.grad_chunks[index] = chunk.clone()

    def prefetch(self) -> None:
        """Start reading the paged state back (called at the stage's backwards; idempotent)."""
        if self.pager is not None:
            self.pager.prefetch()

    def gradients(self) -> list[torch.Tensor]:
        """The gradients the next :meth:`step` takes, as they are (16 bits under mixed precision: the loss
        scale's overflow check reads them before any is copied)."""
        grads = (self._grad_chunk(index, keep=True) for index in range(len(self.params)))
        return [grad for grad in grads if grad is not None]

    def step(self, unscale: Callable[[list[torch.Tensor]], object] | None = None) -> None:
        """One optimizer step over the accumulated (and reduced) gradients, ``unscale`` applied to their
        copies in the masters' dtype (fp16: the loss scale undone). It goes bucket by bucket
        (cost_models.memory.step_bucket_bytes): a bucket's gradients are taken from the parameters, copied
        down to its masters (cast to their dtype) and freed, the bucket is stepped, its masters' gradients
        dropped and the masters copied back (ZeRO-1/2: all-gathered). So the step holds one bucket's copies,
        optimizer temporaries and gathered weights at a time, not every parameter's
        (cost_models.memory.step_transient_bytes and zero_gather_bytes count them). The plain path with an
        optimizer stepping in place (:func:`steps_in_place`) has none of these: the optimizer steps the
        parameters on their gradients as they are."""
        if self.plain and unscale is None and steps_in_place(self.optimizer):
            self.optimizer.step()  # on the parameters' own gradients, in place: nothing to take off or bound
            self.optimizer.zero_grad(set_to_none=True)
            return
        self._page_in()
        sizes = [self._grad_bytes(index) for index in range(len(self.masters))]
        # the plain path's optimizer steps the parameters themselves, every one with a gradient: all are taken
        # off first (no copy); with masters of their own, each bucket's are taken when it is stepped
        taken = [self._grad_chunk(index) for index in range(len(self.params))] if self.plain else None
        for param in self.params if self.plain else ():
            param.grad = None
        total = sum(size or 0 for size in sizes)
        in_place = self.plain and steps_in_place(self.optimizer)  # nothing allocated to bound: one bucket
        for bucket in step_buckets(sizes, total if in_place else step_bucket_bytes(total)):
            sources: list[torch.Tensor] = [  # type: ignore[misc]
                self._grad_chunk(index) if taken is None else taken[index] for index in bucket]
            for index in bucket:  # the bucket's gradients are held by ``sources`` alone now
                if taken is None:
                    self.masters[index].grad = self.params[index].grad = None
                else:  # (the plain path's parameters let go of theirs above)
                    taken[index] = None
            targets = [(self.masters[i].shape, self.masters[i].dtype, self.masters[i].device) for i in bucket]
            copies = sources if self.plain else self._down(bucket, sources, targets)
            del sources
            if unscale is not None:
                unscale(copies)
            for index, copy in zip(bucket, copies):
                self.masters[index].grad = copy
            del copies, copy  # the masters alone hold the copies now
            self.optimizer.step()  # it steps the parameters with a gradient: this bucket's
            self.optimizer.zero_grad(set_to_none=True)  # the bucket's copies, freed before the next bucket's
            if not self.plain:
                self._copy_up([i for i in bucket if not self.sharded[i]])
                self._copy_back_shards([i for i in bucket if self.sharded[i]])
        if not self.plain:
            self._page_out()

    def skip(self) -> None:
        """Drop the gradients and leave masters and state as they were (a step the loss scale skips)."""
        self.grad_chunks.clear()
        self._summed.clear()
        for master, param in zip(self.masters, self.params):
            master.grad = param.grad = None

    # ------------------------------------------------------------ the copies
    def _down(self, bucket: Sequence[int], sources: Sequence[torch.Tensor], targets: Sequence[Target]
              ) -> list[torch.Tensor]:
        """A bucket's gradients as its masters' (``targets``): copied down, but the host's sums
        (grads_on_host), which are the masters' already and the step's own."""
        moving = [k for k, index in enumerate(bucket) if index not in self.host_grads]
        copies = list(sources)
        for k, copy in zip(moving, copied_into_new([sources[k] for k in moving], [targets[k] for k in moving])):
            copies[k] = copy
        return copies

    def gradient_made(self, param: torch.Tensor) -> None:
        """A gradient was added to ``param`` outside autograd's accumulation, whose hooks therefore did not run (a
        split backward's W, runtime/split_backward.py): take it off the device as they would (grads_on_host)."""
        index = self._sent_ids.get(id(param))
        if index is not None:
            self._gradient_down(index, param)

    def _gradient_down(self, index: int, param: torch.Tensor) -> None:
        """A backward made ``param``'s gradient: add it to its sum on the host and free it on the device.

        The copy waits for the device (a GPU's backward stalls at each parameter until its gradient is down);
        the plan's grads_on_host costs that link time inside the backward."""
        grad, param.grad = param.grad, None
        if grad is None:
            return
        total = self.host_grads[index]
        if grad.device != total.device or grad.dtype != total.dtype:  # (a CPU rank in the masters' dtype adds it)
            grad = copied_into_new([grad], [(total.shape, total.dtype, total.device)])[0]
        with torch.no_grad():
            if index in self._summed:
                total.add_(grad)
            else:
                total.copy_(grad)
                self._summed.add(index)

    def _new_host_buffer(self, index: int) -> torch.Tensor:
        """Where a parameter's gradients add up on the host: its shape, the masters' dtype (pinned beside a GPU)."""
        buffer = torch.empty(self.params[index].shape, dtype=self.masters[index].dtype, device=self.state_device)
        return buffer.pin_memory() if self.device.type == "cuda" else buffer

    def _grad_chunk(self, index: int, *, keep: bool = False) -> torch.Tensor | None:
        if index in self.host_grads:
            if index not in self._summed:
                return None
            if not keep:
                self._summed.discard(index)
            return self.host_grads[index]
        grad = self.params[index].grad
        if not self.sharded[index]:
            return grad
        if self.zero_stage >= 2:
            return self.grad_chunks.get(index) if keep else self.grad_chunks.pop(index, None)
        assert self.layout is not None  # ZeRO-1: a view of this rank's chunk of the whole gradient
        return None if grad is None else self.layout.padded(self._slot[index], grad)[self.layout.rank]

    def _grad_bytes(self, index: int) -> int | None:
        """Bytes of what :meth:`_grad_chunk` gives for ``index`` (None: no gradient), without making it."""
        if index in self.host_grads:
            grad = self.host_grads[index] if index in self._summed else None
        else:
            grad = self.params[index].grad
        if self.sharded[index] and self.zero_stage >= 2:
            grad = self.grad_chunks.get(index)
        if grad is None:
            return None
        if self.sharded[index] and self.zero_stage == 1:
            assert self.layout is not None
            return self.layout.chunk_numel(self._slot[index]) * grad.element_size()
        return grad.nbytes

    def _copy_up(self, indices: Sequence[int]) -> None:
        """Updated masters of whole (unsharded) parameters into them: one multi-tensor copy (a cast under
        mixed precision). Masters on the host go up in their own dtype and are cast on the device
        (casting on the host first would be a pass over every parameter on the CPU and a copy from
        pageable memory)."""
        if indices:
            with torch.no_grad():
                torch._foreach_copy_([self.params[i] for i in indices], self._masters_up(indices, as_params=True))

    def _copy_back_shards(self, indices: Sequence[int]) -> None:
        """Updated masters of the sharded parameters ``indices`` into them: all-gathered (ZeRO-1/2, every
        replica gathers the same bucket) or kept as shards (3)."""
        with torch.no_grad():
            shards = [index for index in indices if index in self.param_shards]  # ZeRO-3's
            for index, master in zip(shards, self._masters_up(shards)):
                if self.param_shards[index].data_ptr() != master.data_ptr():
                    self.param_shards[index].copy_(master)
            if self.zero_stage not in (1, 2) or not indices:
                return
            assert self.shards is not None
            chunks = [master.to(self.params[i].dtype) for i, master in zip(indices, self._masters_up(indices))]
            layout = self.shards.layout([self.params[i].numel() for i in indices])
            gathered = self.shards.all_gather(layout, chunks, f"stage {self.stage} parameters")
            del chunks
            for slot, (index, rows) in enumerate(zip(indices, gathered)):
                param = self.params[index]
                if rows.numel() == param.numel() and param.is_contiguous():
                    param.view(rows.shape).copy_(rows)  # no padding: straight from the gathered rows
                else:
                    param.copy_(layout.unpad(slot, rows, param.shape))

    def _masters_up(self, indices: Sequence[int], *, as_params: bool = False) -> list[torch.Tensor]:
        """The masters of ``indices`` on the device in their dtype (shaped as their parameters if
        ``as_params``): themselves where they live there, else copies made without blocking."""
        masters = [self.masters[i].detach().view_as(self.params[i]) if as_params else self.masters[i].detach()
                   for i in indices]
        if not masters or all(m.device == self.device for m in masters):
            return masters
        # without waiting: the host changes the masters again only after the next step's copy-down, which
        # the stream orders after these copies; paged masters' memory is reused sooner, so those wait
        return copied_into_new(masters, [(m.shape, m.dtype, self.device) for m in masters],
                               non_blocking=self.pager is None)

    # ------------------------------------------------------------ NVMe paging
    def _page_out(self) -> None:
        """Write the masters and per-element state to the stage's file and drop them from memory."""
        if self.pager is None:
            return
        tensors = [master.data for master in self.masters]
        self.pager.write(tensors + self._release_paged())

    def _page_in(self) -> None:
        if self.pager is None:
            return
        views = self.pager.read()
        for master, shape, view in zip(self.masters, self._master_shapes, views):
            master.data = view.view(shape)
        for (index, key), view in zip(self._paged, views[len(self.masters):]):
            self.optimizer.state[self.masters[index]][key] = view.view(self._master_shapes[index])
        self._paged = []

    @contextlib.contextmanager
    def _resident(self, *, changed: bool) -> Iterator[None]:
        """The paged state in memory for the enclosed block (written back if ``changed``)."""
        if self.pager is None:
            yield
            return
        self._page_in()
        try:
            yield
        finally:
            if changed:
                self._page_out()
            else:
                self._drop_resident()

    def _drop_resident(self) -> None:
        """Forget the in-memory copy of unchanged paged state (the file still holds it)."""
        assert self.pager is not None
        self._release_paged()

    def _release_paged(self) -> list[torch.Tensor]:
        """Take the per-element state out of the optimizer (noting its keys in ``_paged``) and empty the
        masters; returns the state tensors taken, in ``_paged`` order."""
        self._paged = []
        taken = []
        for index, master in enumerate(self.masters):
            state = self.optimizer.state.get(master, {})
            for key in sorted(state):
                if _per_element(state[key], master):
                    self._paged.append((index, key))
                    taken.append(state.pop(key))
        for master in self.masters:
            master.data = master.data.new_empty(0)
        return taken

    # ------------------------------------------------------------ checkpoints and figures
    @contextlib.contextmanager
    def params_gathered(self) -> Iterator[None]:
        """Whole parameters for the enclosed block (collective under ZeRO-3; see :meth:`in_use`)."""
        with self.in_use(whole=True):
            yield

    def gather_full(self, per_master: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Tensors shaped like the masters (e.g. their gradients) as whole parameters (collective;
        every replica passes tensors for the same parameters, as they run the same graph)."""
        full: list[torch.Tensor | None] = list(per_master)
        present = [i for i in self._slot if per_master[i] is not None]
        if present:
            assert self.shards is not None
            layout = self.shards.layout([self.params[i].numel() for i in present])
            rows = self.shards.all_gather(layout, [per_master[i].reshape(-1) for i in present],  # type: ignore[union-attr]
                                          f"stage {self.stage} state")
            for slot, (index, table) in enumerate(zip(present, rows)):
                full[index] = layout.unpad(slot, table, self.params[index].shape)
        return [None if t is None else t.reshape(p.shape) for t, p in zip(full, self.params)]

    def full_optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state dict as if it stepped the whole parameters (what checkpoints hold;
        collective on ZeRO stages: every replica calls it)."""
        if self.plain:
            return self.optimizer.state_dict()
        with self._resident(changed=False):
            saved = self.optimizer.state_dict()
            states = [dict(saved["state"].get(i, {})) for i in range(len(self.masters))]
            keys = sorted({key for state in states for key in state})
            for key in keys:
                per_master = [self._element_state(states[i].get(key), i) for i in range(len(self.masters))]
                for index, tensor in enumerate(self.gather_full(per_master)):
                    if tensor is not None:
                        states[index][key] = tensor
            return {"state": {i: s for i, s in enumerate(states) if s}, "param_groups": saved["param_groups"]}

    def _element_state(self, value: Any, index: int) -> torch.Tensor | None:
        return value if isinstance(value, torch.Tensor) and _per_element(value, self.masters[index]) else None

    def restore(self, optimizer_state: dict[str, Any] | None,
                masters: Sequence[torch.Tensor] | None = None) -> None:
        """Take the (already loaded) parameters, or whole ``masters`` (mixed precision's fp32 ones),
        as the masters, and a full optimizer state dict."""
        if self.plain:
            if optimizer_state is not None:
                self.optimizer.load_state_dict(optimizer_state)
            return
        with self._resident(changed=True), self.params_gathered(), torch.no_grad():
            for index, master in enumerate(self.masters):
                master.copy_(self._new_master(index, masters).view_as(master))
                if index in self.param_shards and self.param_shards[index].data_ptr() != master.data_ptr():
                    self.param_shards[index].copy_(master)
            if optimizer_state is not None:
                self.optimizer.load_state_dict(self._shard_state(optimizer_state))

    def _shard_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        assert saved is not None
        state = {}
        for key, entries in saved["state"].items():
            index = int(key)
            state[index] = {name: (self.layout.chunk(self._slot[index], value)  # type: ignore[union-attr]
                                   if self.sharded[index] and isinstance(value, torch.Tensor)
                                   and value.shape == self.params[index].shape else value)
                            for name, value in entries.items()}
        return {"state": state, "param_groups": saved["param_groups"]}

    def full_masters(self) -> list[torch.Tensor]:
        """Every master as a whole parameter (collective on ZeRO stages; read back from NVMe)."""
        if self.plain:
            return [p.detach() for p in self.params]
        with self._resident(changed=False):
            return [t.clone() for t in self.gather_full([m.detach() for m in self.masters])]  # type: ignore[union-attr]

    def held_tensors(self) -> list[torch.Tensor]:
        """Masters, their state, parameter shards, gradient sums on the host and the table ZeRO-3's layer sums
        keep on gloo (runtime/sharding.py) this stage holds in memory now (not the params)."""
        tensors = [] if self.plain else [m for m in self.masters if m.numel()]
        tensors += [v for state in self.optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor)]
        kept = self.shards.kept_tensors() if self.shards is not None else []
        return tensors + list(self.param_shards.values()) + list(self.host_grads.values()) + kept

    def device_tensors(self) -> list[torch.Tensor]:
        """Of :meth:`held_tensors`, those the plan counts as device memory: all but the host tier's masters and
        state (a CPU rank holds those in the same memory, but they are the plan's host memory: host_bytes)."""
        held = self.held_tensors()
        if self.spec.optimizer_state is StateTier.GPU:
            return held
        shards = self.param_shards.values() if self.spec.params is ParamTier.GPU else ()  # (else the host's)
        on_device = {id(t) for t in (*shards, *(self.shards.kept_tensors() if self.shards is not None else ()))}
        return [t for t in held if id(t) in on_device]

    @property
    def host_bytes(self) -> int:
        """Bytes of masters and optimizer state held in host memory now (0 on the GPU tier)."""
        if self.state_device.type != "cpu" or self.spec.optimizer_state is StateTier.GPU:
            return 0
        on_device = {id(t) for t in self.device_tensors()}
        return sum(t.numel() * t.element_size() for t in self.held_tensors()
                   if t.device.type == "cpu" and id(t) not in on_device)

    @property
    def nvme_bytes(self) -> int:
        """Bytes of masters and optimizer state in the stage's NVMe file."""
        return self.pager.size_bytes if self.pager is not None else 0

    def close(self) -> None:
        if self.pager is not None:
            self.pager.close()


def _per_element(value: Any, master: torch.Tensor) -> bool:
    """A state tensor with one element per master element (Adam's moments, momentum), not a scalar."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == master.numel() > 0


Target = tuple[torch.Size, torch.dtype, torch.device]  # what a copy is made as: shape, dtype, device


def copied_into_new(sources: Sequence[torch.Tensor], targets: Sequence[Target], *,
                    non_blocking: bool = False) -> list[torch.Tensor]:
    """Copies of ``sources`` as ``targets`` (one each): views of one new buffer per (device, dtype),
    filled by one multi-tensor copy, so a stage's gradients go down to its masters in a few kernels, not
    a cast and an allocation per parameter. A GPU's tensors for the host are cast on the GPU and then
    copied down at once into pinned memory (torch's caching host allocator reuses it step after step);
    ``non_blocking`` copies from host memory to a GPU without waiting.

    Why cast on the GPU: on an H100, for a GPT's 418 M bf16 parameters and host masters, casting on the
    GPU and copying each parameter through pinned memory took 41 ms down and 33 ms up, against 574 ms
    and 142 ms for a cast on the host (what ``Tensor.copy_`` does between devices) from pageable memory."""
    copies: list[torch.Tensor | None] = [None] * len(targets)
    groups: dict[tuple[torch.device, torch.device, torch.dtype], list[int]] = {}
    for index, (source, (_, dtype, device)) in enumerate(zip(sources, targets)):
        groups.setdefault((source.device, device, dtype), []).append(index)
    for (source_device, device, dtype), indices in groups.items():
        shapes = [targets[i][0] for i in indices]
        numels = [shape.numel() for shape in shapes]
        down = device.type == "cpu" and source_device.type == "cuda"
        buffer = torch.empty(sum(numels), dtype=dtype, device=source_device if down else device)
        torch._foreach_copy_([flat.view(shape) for shape, flat in zip(shapes, buffer.split(numels))],
                             [sources[i].reshape(shape) for i, shape in zip(indices, shapes)],
                             non_blocking=non_blocking)
        if down:
            buffer = torch.empty(sum(numels), dtype=dtype, pin_memory=True).copy_(buffer)
        for index, shape, flat in zip(indices, shapes, buffer.split(numels)):
            copies[index] = flat.view(shape)
    return copies  # type: ignore[return-value]


def steps_in_place(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step allocates nothing per stepped element: torch's SGD, with momentum or not,
    updates its momentum buffers and the parameters in place unless weight decay, Nesterov or ``maximize``
    make it add into copies of the gradients. Any other optimizer is taken to allocate (Adam's denominator).

    >>> param = torch.nn.Parameter(torch.zeros(2))
    >>> steps_in_place(torch.optim.SGD([param], lr=0.1, momentum=0.9)), steps_in_place(torch.optim.Adam([param]))
    (True, False)
    >>> steps_in_place(torch.optim.SGD([param], lr=0.1, momentum=0.9, nesterov=True))
    False
    """
    return type(optimizer) is torch.optim.SGD and not any(
        group.get("weight_decay") or group.get("nesterov") or group.get("maximize") for group in optimizer.param_groups)
