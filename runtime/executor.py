"""The Executor: interprets this rank's program of a plan, action by action, for one step at a time.

It holds no schedule logic: ``F``/``B`` run the named stage on the named micro-batch (a split
backward's ``I`` backpropagates into the stage's received inputs only, keeping the graph, and its
``W`` into the stage's weights from that graph), runs of
consecutive ``SEND_*``/``RECV_*`` become one batched P2P exchange, ``ALLREDUCE`` sums the
stage's gradients over its replicas (a reduce-scatter under ZeRO-2/3), ``OPTIMIZER_STEP`` steps
the stage's optimizer wherever the plan keeps its state (runtime/stage_optimizer.py, which also
gathers ZeRO-3 parameters around each ``F``/``B`` and starts reading NVMe state at each ``B``; under
fp16/bf16 runtime/precision.py scales the loss and defers the step of the fp32 masters to the rank's
last stage) and ``SWAP_OUT``/``SWAP_IN`` move a micro-batch's swapped activations to the host and back
(runtime/swap.py; recomputation happens inside the stage modules, runtime/recompute.py). A rank
that runs several stages (interleaved, WPipe, GEMS programs) looks each stage up by the
action's stage id, and the values it reads and sends by the parts the stages compute (a GEMS
mirror's two model copies: the dataflow of the stages' parts, within the stage's copy); values
between two stages on the same rank are handed over in memory. A spatial
stage's tiles are joined by a later ordinary stage's receive, and re-tiled onto a later spatial
stage's tiles (runtime/retiling.py). A program that runs forwards ahead for the next step (WPipe,
planner/schedules/periods.py) takes the next step's micro-batches too: the first step runs those
forwards alone first, each step hands what they left to the next, and a step given no next
micro-batches leaves them out (a flush); its first group computes on stashed weight versions
(runtime/stale.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cost_models.comm import RECEIVES_POSTED_AHEAD
from cost_models.graph.capture import LeafSpec
from planner.plan import Plan
from planner.preflight import programs
from planner.schedules import Action, ActionKind
from planner.schedules.periods import Periods
from runtime.checks import segments as grouped
from runtime.comm import P2P, InFlight, Message, ReceivesAhead
from runtime.dataflow import SourceKind
from runtime.grads import GradientSync, OverlappedReduce
from runtime.launch import join_group
from runtime.loss_reduce import STARTS_EARLY, LossReduce, start_after
from runtime.memory import MemoryTracker
from runtime.microbatch import Microbatch, Targets, split_batch
from runtime.precision import ScalerOptions
from runtime.retiling import Retiling
from runtime.seeding import ForwardSeeds
from runtime.setup import set_up
from runtime.split_backward import backward_input, backward_weight, covers_every_weight
from runtime.stages import LocalStage, OptimizerFactory
from runtime.stale import WeightVersions
from runtime.state import MicrobatchState, StepState
from runtime.tiles import halo_bytes_sent

LossFn = Callable[[Any, Any], torch.Tensor]
_BUSY = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.OPTIMIZER_STEP})
"""The actions whose wall time is a rank's busy time (the simulator's compute lane): the rest of a step
is idle, waiting on receives, all-reduces, swaps and the step's end."""

_HANDLERS = {ActionKind.F: "_forward", ActionKind.B: "_backward", ActionKind.I: "_backward_input",
             ActionKind.W: "_backward_weight", ActionKind.ALLREDUCE: "_allreduce",
             ActionKind.OPTIMIZER_STEP: "_optimizer_step", ActionKind.SWAP_OUT: "_swap_out",
             ActionKind.SWAP_IN: "_swap_in"}  # method per non-communication action


class Executor:
    """Runs a plan's program for this rank inside a ``torch.distributed`` job.

    Under torchrun the Executor joins the process group itself if the script has not (NCCL on
    CUDA, gloo on CPU, ``timeout_s`` on the rendezvous and every collective; see
    runtime/launch.py); call ``dist.destroy_process_group()`` when done.

    ``model`` is the planned model: on the meta device (each rank then materialises only its
    own stages, initialised by :func:`runtime.initialize` with ``seed``) or with real weights
    (kept as they are). ``loss_fn(output, targets)`` returns the scalar loss of one micro-batch
    (the loss of a step is their mean); it may be replaced between steps (``exe.loss_fn``).
    ``optimizer_factory(params)`` makes one optimizer per stage, over the parameters or over their
    master copies where the plan's offload section puts them, or over fp32 masters when the plan's
    precision is fp16 or bf16 (runtime/stage_optimizer.py, runtime/precision.py; ``loss_scale`` sets
    fp16's dynamic loss scale, ``exe.mixed.loss_scale`` reads it; a stage paging its optimizer state
    to NVMe needs ``nvme_dir``). Peak memory is in
    ``exe.memory.peak_bytes`` (on CPU, of the steps run with ``run(..., profile_memory=True)``), the
    bytes this rank's halo exchanges sent in the last step in ``exe.halo_bytes_sent``
    (runtime/tiles.py says which).

    Example (a script started with ``torchrun --nproc-per-node N script.py``)::

        plan = Plan.load("plan.json")
        exe = Executor(plan, gpt_tiny(device="meta"), loss_fn,
                       lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
        for inputs, targets in batches:        # the whole global batch on every rank
            loss = exe.step(inputs, targets)   # the global mean loss, on every rank
    """

    def __init__(self, plan: Plan, model: nn.Module, loss_fn: LossFn, optimizer_factory: OptimizerFactory,
                 *, seed: int = 0, device: torch.device | str | None = None, timeout_s: float = 300.0,
                 leaf_modules: Sequence[LeafSpec] = (), loss_scale: ScalerOptions | None = None,
                 nvme_dir: Path | str | None = None) -> None:
        if not dist.is_initialized():  # under torchrun: join the group its environment describes
            joined = join_group("auto" if device is None else torch.device(device).type, timeout_s)
            device = joined if device is None else device
        self.plan, self.model, self.loss_fn, self.seed = plan, model, loss_fn, seed
        self.rank = dist.get_rank()
        self.device = _resolve(device)
        self.timeout_s = timeout_s
        self.seeds = ForwardSeeds(seed, self.device)  # each forward's dropout masks
        ready = set_up(plan, model, optimizer_factory, seed=seed, device=self.device,
                       timeout_s=timeout_s, leaf_modules=leaf_modules, loss_scale=loss_scale,
                       nvme_dir=None if nvme_dir is None else Path(nvme_dir))
        self.segments, self.stage_ids, self.replica = ready.segments, ready.stage_ids, ready.replica
        self.traced, self.flow = ready.traced, ready.flow
        self.stages, self.groups, self.swaps = ready.stages, ready.groups, ready.swaps
        self.mixed, self.tiled = ready.mixed, ready.tiled
        self.p2p = P2P(None, self.device, timeout_s)
        self._receives_ahead = RECEIVES_POSTED_AHEAD.get(str(dist.get_backend()), 0)  # the group's own backend
        self.sync = GradientSync(self.device, timeout_s)
        self.periods = Periods.of(programs(plan))
        stale = plan.schedule.kind.stale_parts(plan.layout.num_parts)
        self.versions = WeightVersions(self.stages, [i for i, stage in self.stages.items() if stage.part in stale])
        self._carried: dict[str, dict[tuple[int, int], Any]] | None = None  # left by the last step's ahead forwards
        program = [a for segment in self.segments for a in (segment if isinstance(segment, tuple) else (segment,))]
        self._ahead_segments = grouped([a for a in program if self.periods.is_ahead(a)])
        self._last_backward = {a.stage: a for a in program if a.kind.ends_backward}  # per stage, in its step
        self._split: dict[int, bool] = {}  # per stage: whether its split backward's I groups cover its weights
        self._overlapped = {a.stage: self._overlapped_reduce(a) for a in program
                            if a.kind is ActionKind.ALLREDUCE and self._overlaps(self.stages[a.stage])}
        flush = grouped([a for a in program if not self.periods.is_ahead(a)])
        loss_stages = {index for index, stage in self.stages.items() if stage.part == self.flow.last_stage}
        early = STARTS_EARLY.get(str(dist.get_backend()), False)
        # each program a step runs, with the segment after which the step's loss all-reduce starts
        self._step_program = self.segments, start_after(self.segments, loss_stages, early)
        self._flush_program = flush, start_after(flush, loss_stages, early)
        self.loss = LossReduce(self.groups.loss, self.device, plan.training.num_microbatches * plan.data_parallel,
                               timeout_s)
        self.memory = MemoryTracker(self.device, self._model_state)
        self.steps_done = 0
        self.halo_bytes_sent = 0  # by this rank's halo exchanges in the last step (runtime/tiles.py)
        self.p2p_bytes_sent = 0  # by this rank's pipeline sends (activations, gradients) in the last step
        self.post_ms: float | None = None  # the last step's messaging wall time per message posted (None: none)
        self._messaging_s = 0.0  # wall time of communication runs, apart from their waits (:meth:`_messaging`)
        self._tied_sum_s = 0.0  # wall time of the tied weights' gradient sums (:meth:`_sync_tied`): not busy
        self.busy_ms = 0.0  # wall time of this rank's compute actions in the last step (CPU: its busy time)
        self.action_ms: dict[tuple[int, ActionKind], list[float]] = {}  # the last step's, per (stage, kind)

    def _model_state(self) -> list[torch.Tensor]:
        """Parameters, buffers, gradients, and the fp32 masters and optimizer state of this rank's stages that
        count as device memory (the host tier's are host memory, on a CPU rank too)."""
        tensors: list[torch.Tensor] = []
        for stage in self.stages.values():
            tensors += [*stage.module.parameters(), *stage.module.buffers(), *stage.attrs.values()]
            tensors += [p.grad for p in stage.params.values() if p.grad is not None]
            if stage.state is not None:
                tensors += stage.state.device_tensors()
        return tensors + self.versions.tensors()

    def _params_in_use(self, stage: LocalStage) -> contextlib.AbstractContextManager[None]:
        """ZeRO-3: the stage's parameters gathered for one forward or backward (else nothing)."""
        return stage.state.in_use() if stage.state is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------- step
    def step(self, inputs: torch.Tensor | Sequence[torch.Tensor] | None, targets: Targets | None, *,
             next_inputs: torch.Tensor | Sequence[torch.Tensor] | None = None) -> float:
        """Train on one global batch (the same on every rank; None where a rank does not need it).

        Inputs are used by the first stage, targets by the last; each replica takes its slice
        and cuts it into the plan's micro-batches. Returns the mean loss over the global batch.
        A plan whose forwards run ahead (WPipe) also takes the next step's inputs (``next_inputs``);
        without them the step flushes (``crosses_steps`` says whether the plan's do).
        """
        training = self.plan.training

        def split(batch: Any, targets: Targets | None) -> list[Microbatch]:
            return split_batch(batch, targets, global_batch_size=training.global_batch_size,
                               data_parallel=self.plan.data_parallel, replica=self.replica,
                               num_microbatches=training.num_microbatches)
        following = None if next_inputs is None or not self.crosses_steps else split(next_inputs, None)
        return self.run(split(inputs, targets), next_microbatches=following)

    @property
    def crosses_steps(self) -> bool:
        """Whether the plan's forwards run ahead into the next step (then pass the next micro-batches)."""
        return self.periods.crosses_steps

    @property
    def needs_inputs(self) -> bool:
        return any(stage.part == self.flow.data_stage for stage in self.stages.values())

    @property
    def needs_targets(self) -> bool:
        return any(stage.part == self.flow.last_stage for stage in self.stages.values())

    def run(self, microbatches: Sequence[Microbatch], *, profile_memory: bool = False,
            next_microbatches: Sequence[Microbatch] | None = None) -> float:
        """One step on this replica's micro-batches (``plan.training.num_microbatches`` of them).

        ``profile_memory`` records this step's CPU allocations for the measured peak (slower;
        see runtime/memory.py); on CUDA the allocator's own peak is always used.
        ``next_microbatches``: the next step's, for a plan whose forwards run ahead (``crosses_steps``);
        None flushes (the last step).
        """
        count = self.plan.training.num_microbatches
        for name, given in (("micro-batches", microbatches), ("next micro-batches", next_microbatches)):
            if given is not None and len(given) != count:
                raise ValueError(f"got {len(given)} {name}, the plan has {count}")
        following = tuple(next_microbatches) if next_microbatches is not None and self.crosses_steps else None
        if not profile_memory:
            return self._run(microbatches, following)
        with self.memory.profiling():
            return self._run(microbatches, following)

    def _run(self, microbatches: Sequence[Microbatch], following: tuple[Microbatch, ...] | None) -> float:
        state = StepState(tuple(microbatches), period=self.steps_done, ahead=following or ())
        self.swaps.new_step()
        halo_before, p2p_before = self._halo_bytes(), self.p2p.bytes_sent
        posted_before, messaging_before_s = self.p2p.posted, self._messaging_s
        self.action_ms = {}
        segments, loss_after = self._step_program
        if self.crosses_steps:
            if self._carried is None:  # the first step, or the one after a flush: its ahead forwards first
                self._prologue(microbatches)
            assert self._carried is not None
            state.adopt(self._carried)
            self._carried = None
            if following is None:
                segments, loss_after = self._flush_program
        busy_s = self._execute(segments, state, loss_after=loss_after)
        self.p2p.finish()
        if following is not None:
            self._carried = state.carry()
        self.halo_bytes_sent = self._halo_bytes() - halo_before
        self.p2p_bytes_sent = self.p2p.bytes_sent - p2p_before
        posted = self.p2p.posted - posted_before
        self.post_ms = (self._messaging_s - messaging_before_s) / posted * 1e3 if posted else None
        self.busy_ms = busy_s * 1e3
        self.steps_done += 1
        return self.loss.mean()

    def _prologue(self, microbatches: Sequence[Microbatch]) -> None:
        """The forwards the previous step would have run ahead for this one (their period is this step's)."""
        state = StepState((), period=self.steps_done - 1, ahead=tuple(microbatches),
                          num_microbatches=self.plan.training.num_microbatches)
        self._execute(self._ahead_segments, state)
        self.p2p.finish()
        self._carried = state.carry()

    def _execute(self, segments: Sequence[Action | tuple[Action, ...]], state: StepState, *,
                 loss_after: int | None = None) -> float:
        """Run ``segments`` on ``state``, the step's loss all-reduce started after segment ``loss_after`` (-1:
        before the first; None: not at all, a prologue's); returns the seconds spent in compute actions."""
        busy_s = 0.0
        with self.seeds.step():  # each forward seeds the generators; the caller's state comes back
            ahead = ReceivesAhead(segments, self._receives_ahead)
            posted: dict[int, tuple[list[list[Message]], list[InFlight]]] = {}
            with self._messaging():
                self._post_receives(ahead.due(-1), segments, state, posted)
            if loss_after == -1:
                self.loss.start(state.losses)
            for index, segment in enumerate(segments):
                if isinstance(segment, tuple):
                    with self._messaging():
                        self._communicate(segment, state, posted.pop(index, None),
                                          lambda index=index: self._post_receives(ahead.due(index), segments, state,
                                                                                  posted))
                else:
                    began, summing_s = time.perf_counter(), self._tied_sum_s
                    getattr(self, _HANDLERS[segment.kind])(segment, state)
                    if segment.kind in _BUSY:  # (less a tied sum it ran: a collective, which waits for the others)
                        took_s = time.perf_counter() - began - (self._tied_sum_s - summing_s)
                        busy_s += took_s
                        self.action_ms.setdefault((segment.stage, segment.kind), []).append(took_s * 1e3)
                if self.memory.active:
                    self.memory.sample([*state.held(), *self.p2p.in_flight()])
                if index == loss_after:
                    self.loss.start(state.losses)
        return busy_s

    @contextlib.contextmanager
    def _messaging(self) -> Iterator[None]:
        """Count the block's wall time, less what it waited for receives, as the rank's messaging: posting,
        packing and delivering messages, what ``post_ms`` divides among them."""
        began, waited_s = time.perf_counter(), self.p2p.waiting_s
        yield
        self._messaging_s += time.perf_counter() - began - (self.p2p.waiting_s - waited_s)

    def _halo_bytes(self) -> int:
        """Bytes this rank's spatial stages have sent through halo exchanges so far."""
        return halo_bytes_sent(stage.module for index, stage in self.stages.items() if index in self.tiled)

    # ------------------------------------------------- stages and the dataflow
    def _parts(self, src: int, dst: int) -> tuple[int, int]:
        """The dataflow edge (between parts) that joins two stages of one model copy."""
        return self.plan.layout.part(src), self.plan.layout.part(dst)

    def _consumers(self, stage: int) -> tuple[int, ...]:
        """The stages of ``stage``'s model copy that read its values."""
        layout = self.plan.layout
        return tuple(layout.stage_of_copy(part, layout.copy(stage)) for part in self.flow.consumers(layout.part(stage)))

    def _producers(self, stage: int) -> tuple[int, ...]:
        """The stages of ``stage``'s model copy whose values it reads."""
        layout = self.plan.layout
        return tuple(layout.stage_of_copy(part, layout.copy(stage)) for part in self.flow.producers(layout.part(stage)))

    # ---------------------------------------------------------------- compute
    def _forward(self, action: Action, state: StepState) -> None:
        assert action.microbatch is not None
        key = (action.stage, action.microbatch)
        stage, micro = self.stages[action.stage], state.micro(*key)
        data, period = state.data(action.microbatch), state.period_of(action.microbatch)
        if stage.part == self.flow.data_stage:
            if data.inputs is None:
                raise ValueError(f"rank {self.rank} runs the first stage and needs the inputs")
            values = [self._to_device(x) for x in data.inputs]
            if stage.index in self.tiled:  # every tile rank takes the micro-batch and keeps its tile
                values = [self.tiled[stage.index].tile_input(x) for x in values]
            micro.env.update(zip(self.flow.data_inputs, values))
        args = [self._input(stage, name, action.microbatch, state) for name in stage.io.inputs]
        micro.env.update(zip(stage.io.inputs, args))
        micro.env.update(state.inbox.pop(key, {}))  # received values the loss reads, not the stage
        index = state.index_in_period(action.microbatch)
        global_microbatch = self.replica * self.plan.training.num_microbatches + index
        self.seeds.apply(period, action.stage, global_microbatch)
        with self.memory.saving((action.stage, period, index)):
            with self.swaps.forward(key), self._params_in_use(stage):
                module = self.versions.module(stage.index, period)
                micro.env.update(zip(stage.io.outputs, module(*args)))
            if stage.part == self.flow.last_stage:
                self._loss(stage, micro, data, state)
        micro.roots = {name: micro.env[name] for dst in self._consumers(stage.index)
                       for name in self.flow.gradients(self._parts(stage.index, dst))}
        self._hand_over(stage.index, action.microbatch, micro, state)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A micro-batch's copy on the device (floats in 16 bits under mixed precision); on the CPU,
        which stands in for one, a copy too (so memory counts only micro-batches in flight, as on a
        GPU, not the caller's batch)."""
        dtype = tensor.dtype if self.mixed is None else self.mixed.input_dtype(tensor)
        return to_device(tensor, self.device, dtype)

    def _input(self, stage: LocalStage, name: str, microbatch: int, state: StepState) -> Any:
        source = stage.io.sources[name]
        if source.kind is SourceKind.PARAM:
            return self.versions.attrs(stage.index, state.period_of(microbatch))[name]
        if source.kind is SourceKind.DATA:
            return state.micro(stage.index, microbatch).env[name]
        spec = self.flow.specs[name]
        if not spec.travels:
            return spec.decode(None, self.device)
        return state.mailbox(stage.index, microbatch).pop(name)

    def _loss(self, stage: LocalStage, micro: MicrobatchState, data: Microbatch, state: StepState) -> None:
        output = torch.fx.node.map_aggregate(self.flow.output, lambda name: micro.env[name])
        if self.mixed is not None:
            output = self.mixed.loss_input(output)  # the loss in fp32
        targets = torch.fx.node.map_aggregate(data.targets, lambda t: to_device(t, self.device)
                                              if isinstance(t, torch.Tensor) else t)
        loss = self.loss_fn(output, targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                             f"{tuple(getattr(loss, 'shape', ()))}")
        state.losses.append(loss.detach())
        scaled = loss if self.mixed is None else self.mixed.scale_loss(loss)
        micro.loss = scaled / (self.plan.training.num_microbatches * self.plan.data_parallel)
        for name in stage.io.outputs:  # the loss is the only backward root of the last stage
            micro.env.pop(name, None)

    def _hand_over(self, stage: int, microbatch: int, micro: MicrobatchState, state: StepState) -> None:
        """Values for consumer stages on this same rank (no communication)."""
        for dst in self._consumers(stage):
            if dst in self.stages:
                box = state.mailbox(dst, microbatch)
                for name in self.flow.travelling(self._parts(stage, dst)):
                    value = micro.env[name]
                    box[name] = (value.detach().requires_grad_(self.flow.specs[name].carries_grad)
                                 if isinstance(value, torch.Tensor) else value)

    def _backward(self, action: Action, state: StepState) -> None:
        """B: the micro-batch's whole backward through the stage, then its input gradients out."""
        micro = self._start_backward(action, state)
        self._start_reduce(action, micro)
        self._run_backward(action, micro, inputs=None)
        self._collect_input_grads(action, micro, state)
        self._end_backward(action, micro, state)

    def _backward_input(self, action: Action, state: StepState) -> None:
        """I: the gradients of the stage's received inputs only, keeping what W needs (runtime/split_backward.py:
        the weights' groups, or the graph where they do not cover every weight), then out."""
        assert action.microbatch is not None
        micro = self._start_backward(action, state)
        stage = self.stages[action.stage]
        inputs = [micro.env[name] for src in self._producers(stage.index)
                  for name in self.flow.gradients(self._parts(src, stage.index))]
        roots, grads = self._roots(micro)
        weights = self.versions.weights(action.stage, state.period_of(action.microbatch))
        if inputs and roots and action.stage not in self._split:
            self._split[action.stage] = covers_every_weight(roots, inputs, weights)
        if inputs and roots and self._split[action.stage]:
            with self._params_in_use(stage):
                micro.weight_groups = backward_input(roots, grads, inputs, weights)
        elif inputs:
            self._run_backward(action, micro, inputs=inputs)
        self._collect_input_grads(action, micro, state)

    def _backward_weight(self, action: Action, state: StepState) -> None:
        """W: the gradients of the stage's weights from what I kept; frees the micro-batch."""
        assert action.microbatch is not None
        micro = state.micro(action.stage, action.microbatch)
        weights = self.versions.weights(action.stage, state.period_of(action.microbatch))
        if micro.weight_groups is not None:
            stage = self.stages[action.stage]
            with self._params_in_use(stage):
                backward_weight(weights, micro.weight_groups,
                                made=stage.state.gradient_made if stage.state is not None else None)
        elif weights:
            self._run_backward(action, micro, inputs=weights)
        self._end_backward(action, micro, state)

    def _start_backward(self, action: Action, state: StepState) -> MicrobatchState:
        """The micro-batch's state on the stage, with the stage's paged optimizer state being read back
        while the backwards run."""
        stage = self.stages[action.stage]
        if stage.state is not None:
            stage.state.prefetch()
        return state.micro(action.stage, action.microbatch)  # type: ignore[arg-type]

    @staticmethod
    def _roots(micro: MicrobatchState) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """What the micro-batch's backward starts from: the loss and the outputs whose gradients came back."""
        roots = [micro.loss] if micro.loss is not None else []
        grads: list[torch.Tensor | None] = [None] * len(roots)
        for name, tensor in micro.roots.items():
            if name in micro.output_grads:
                roots.append(tensor)
                grads.append(micro.output_grads[name])
        return roots, grads

    def _run_backward(self, action: Action, micro: MicrobatchState, *, inputs: list[torch.Tensor] | None) -> None:
        """Backpropagate from the roots into ``inputs`` (all leaves when None), keeping the graph for a W."""
        roots, grads = self._roots(micro)
        if roots:
            with self._params_in_use(self.stages[action.stage]):
                torch.autograd.backward(roots, grads, inputs=inputs, retain_graph=action.kind is ActionKind.I)

    def _collect_input_grads(self, action: Action, micro: MicrobatchState, state: StepState) -> None:
        """The gradients of the received inputs: to a producer stage on this rank, or kept to send."""
        assert action.microbatch is not None
        for src in self._producers(action.stage):
            for name in self.flow.gradients(self._parts(src, action.stage)):
                value = micro.env[name]
                grad = value.grad if value.grad is not None else torch.zeros_like(value)
                if src in self.stages:
                    _accumulate(state.micro(src, action.microbatch).output_grads, name, grad)
                else:
                    micro.input_grads[name] = grad

    def _end_backward(self, action: Action, micro: MicrobatchState, state: StepState) -> None:
        """The micro-batch's backward on the stage is complete: free what it held."""
        assert action.microbatch is not None
        period, index = state.period_of(action.microbatch), state.index_in_period(action.microbatch)
        self.memory.release((action.stage, period, index))
        self.swaps.release((action.stage, action.microbatch))
        self.memory.state_changed()
        micro.env.clear()
        micro.roots.clear()
        micro.output_grads.clear()
        micro.loss = None
        micro.weight_groups = None

    def _swap_out(self, action: Action, state: StepState) -> None:
        assert action.microbatch is not None
        self.swaps.wait_out((action.stage, action.microbatch))

    def _swap_in(self, action: Action, state: StepState) -> None:
        assert action.microbatch is not None
        self.swaps.prefetch((action.stage, action.microbatch))

    # ---------------------------------------------------------- communication
    def _communicate(self, actions: tuple[Action, ...], state: StepState,
                     early: tuple[list[list[Message]], list[InFlight]] | None = None,
                     post_ahead: Callable[[], None] | None = None) -> None:
        """Post the run's messages in one batch and deliver its receives (``early``: the receives, already
        posted, and their transfers); ``post_ahead`` posts later runs' receives while this run's transfers
        are under way (on gloo a post can wait for the pair's incoming data: it then waits with the run)."""
        receives = [action for action in actions if action.kind.is_recv]
        if early is None:
            per_action = [self._messages(action, state) for action in actions]
            transfers = self.p2p.post([message for messages in per_action for message in messages])
            received = [messages for action, messages in zip(actions, per_action) if action.kind.is_recv]
        else:
            received, posted = early
            sends = [message for action in actions if action.kind.is_send for message in self._messages(action, state)]
            transfers = [*posted, *self.p2p.post(sends)]
        if post_ahead is not None:
            post_ahead()
        self.p2p.wait(transfers)
        for action, messages in zip(receives, received):
            self._deliver(action, messages, state)

    def _post_receives(self, runs: list[int], segments: Sequence[Action | tuple[Action, ...]], state: StepState,
                       posted: dict[int, tuple[list[list[Message]], list[InFlight]]]) -> None:
        """Post the receives of ``runs`` (indices of ``segments``) now, ahead of their place in the program."""
        for index in runs:
            run = segments[index]
            assert isinstance(run, tuple)
            per_action = [self._messages(action, state) for action in run if action.kind.is_recv]
            posted[index] = per_action, self.p2p.post([message for messages in per_action for message in messages])

    def _messages(self, action: Action, state: StepState) -> list[Message]:
        """The action's messages: one per peer rank (a spatial peer's tiles: one per tile, in tile order;
        between two spatial stages: one per re-tiled piece, runtime/retiling.py)."""
        assert action.peer is not None and action.microbatch is not None
        peer_ranks = self.plan.layout.ranks_of(action.peer, self.replica)
        joining = self.tiled.get(action.peer)
        if joining is None:
            return [self._message(action, peer_ranks[0], state)]
        if action.stage in self.tiled:
            return self._retiled_messages(action, peer_ranks, state)
        kind = action.kind
        if kind is ActionKind.RECV_F:  # a join: every tile of every value
            names = self.flow.travelling(self._parts(action.peer, action.stage))
            return [Message(action, peer, [joining.tile_buffer(self.flow.specs[n], tile, self.device)
                                           for n in names]) for tile, peer in enumerate(peer_ranks)]
        assert kind is ActionKind.SEND_B, f"{action}: a spatial stage only feeds later stages"
        names = self.flow.gradients(self._parts(action.peer, action.stage))
        grads = [state.micro(action.stage, action.microbatch).input_grads.pop(n) for n in names]
        return [Message(action, peer, [joining.output_grids[n].tile(grad, tile).contiguous()
                                       for n, grad in zip(names, grads)])
                for tile, peer in enumerate(peer_ranks)]

    def _retiled_messages(self, action: Action, peer_ranks: Sequence[int], state: StepState) -> list[Message]:
        assert action.microbatch is not None
        retiling = Retiling.of(action, self.flow, self.tiled, peer_ranks)
        micro = state.micro(action.stage, action.microbatch)
        tiles: dict[str, torch.Tensor] = {}  # what a send cuts its pieces from: this rank's tile of each value
        if action.kind is ActionKind.SEND_F:
            tiles = {name: micro.env[name] for name in retiling.names}
        elif action.kind is ActionKind.SEND_B:
            tiles = {name: micro.input_grads.pop(name) for name in retiling.names}
        return retiling.messages(tiles, self.flow.specs, self.device)

    def _deliver_retiled(self, action: Action, messages: list[Message], state: StepState) -> None:
        """This rank's tile of every value (RECV_F) or of its gradient (RECV_B), put together from its pieces."""
        assert action.peer is not None and action.microbatch is not None
        peer_ranks = self.plan.layout.ranks_of(action.peer, self.replica)
        tiles = Retiling.of(action, self.flow, self.tiled, peer_ranks).assemble(messages)
        if action.kind is ActionKind.RECV_F:
            box = state.mailbox(action.stage, action.microbatch)
            box.update((name, self.flow.specs[name].decode(tile, self.device)) for name, tile in tiles.items())
            return
        grads = state.micro(action.stage, action.microbatch).output_grads
        for name, tile in tiles.items():
            _accumulate(grads, name, tile)

    def _message(self, action: Action, peer_rank: int, state: StepState) -> Message:
        assert action.peer is not None and action.microbatch is not None
        mine = self.tiled.get(action.stage)  # this rank holds one tile of its stage's values
        kind = action.kind
        if kind is ActionKind.SEND_F:
            names = self.flow.travelling(self._parts(action.stage, action.peer))
            micro = state.micro(action.stage, action.microbatch)
            tensors = [micro.env[n].detach().contiguous() if mine else
                       self.flow.specs[n].encode(micro.env[n], self.device) for n in names]
        elif kind is ActionKind.SEND_B:
            names = self.flow.gradients(self._parts(action.peer, action.stage))
            tensors = [state.micro(action.stage, action.microbatch).input_grads.pop(n).contiguous() for n in names]
        elif kind is ActionKind.RECV_F:
            names = self.flow.travelling(self._parts(action.peer, action.stage))
            tensors = [self.flow.specs[n].empty(self.device) for n in names]
        else:
            names = self.flow.gradients(self._parts(action.stage, action.peer))
            tensors = [mine.tile_buffer(self.flow.specs[n], mine.tile, self.device)  # type: ignore[arg-type]
                       if mine else self.flow.specs[n].empty(self.device) for n in names]
        return Message(action, peer_rank, tensors)

    def _deliver(self, action: Action, messages: list[Message], state: StepState) -> None:
        assert action.peer is not None and action.microbatch is not None
        if action.stage in self.tiled and action.peer in self.tiled:
            self._deliver_retiled(action, messages, state)
            return
        if action.kind is ActionKind.RECV_F:
            box = state.mailbox(action.stage, action.microbatch)
            joining = self.tiled.get(action.peer)
            for index, name in enumerate(self.flow.travelling(self._parts(action.peer, action.stage))):
                wire = (messages[0].tensors[index] if joining is None else
                        joining.output_grids[name].join([message.tensors[index] for message in messages]))
                box[name] = self.flow.specs[name].decode(wire, self.device)
            return
        grads = state.micro(action.stage, action.microbatch).output_grads
        for name, wire in zip(self.flow.gradients(self._parts(action.stage, action.peer)), messages[0].tensors):
            _accumulate(grads, name, wire)

    # ------------------------------------------------------------- per stage
    def _overlaps(self, stage: LocalStage) -> bool:
        """Whether the stage's all-reduce runs during its last backward (StagePrediction.allreduce_overlap
        says the same to the simulator): not a ZeRO-2/3 reduce-scatter, not on stashed weight versions."""
        reduce_scatter = stage.state is not None and stage.state.reduces_gradients
        split = self._last_backward[stage.index].kind is ActionKind.W  # W writes the gradients without hooks
        return not reduce_scatter and not split and stage.index not in self.versions.stale_stages

    def _overlapped_reduce(self, action: Action) -> OverlappedReduce:
        """The stage's all-reduce that its last backward of each step starts (hooks on its parameters)."""
        stage = self.stages[action.stage]
        return OverlappedReduce(self.sync, self._reduced(stage), self.groups.data_parallel[stage.part], str(action))

    def _reduced(self, stage: LocalStage) -> list[torch.nn.Parameter]:
        """The parameters the stage's data-parallel all-reduce sums (tied ones are summed with their copies)."""
        return [p for name, p in stage.params.items() if name not in self.groups.tied_names]

    def _start_reduce(self, action: Action, micro: MicrobatchState) -> None:
        """Before the stage's last backward of the step: its all-reduce's buckets start as they fill."""
        if action.stage in self._overlapped and self._last_backward[action.stage] == action:
            self._overlapped[action.stage].arm(self._roots(micro)[0])

    def _allreduce(self, action: Action, state: StepState) -> None:
        if action.stage in self._overlapped:
            self._overlapped[action.stage].wait()
            return
        self.versions.collect_gradients(action.stage, state.period)
        stage = self.stages[action.stage]
        params = self._reduced(stage)
        if stage.state is not None and stage.state.reduces_gradients:  # ZeRO-2/3: reduce-scatter
            stage.state.reduce_gradients(str(action))
            params = [p for name, p in stage.params.items() if name in stage.state.unsharded_names
                      and name not in self.groups.tied_names]
        group = self.groups.data_parallel[stage.part]
        self.sync.all_reduce(params, group, str(action))

    def _optimizer_step(self, action: Action, state: StepState) -> None:
        for stage in self.versions.stale_stages:  # every stale stage's gradients, before the tied sum
            self.versions.collect_gradients(stage, state.period)
        if not state.tied_synced:
            self._sync_tied()
            state.tied_synced = True
        stage_state = self.stages[action.stage].state
        if self.mixed is not None:
            updated = self.mixed.step(action.stage)  # the fp32 masters of every stage, at this rank's last stage
        else:
            if stage_state is not None:
                stage_state.step()
            updated = (action.stage,)
        for stage in updated:  # (a stashed version is loaded from the weights the step wrote)
            self.versions.after_update(stage, state.period)
        self.memory.state_changed()

    def _sync_tied(self) -> None:
        """Sum tied parameters' gradients over every copy (all ranks, one fixed order). Its wall time is not the
        optimizer step's compute (a GPT-2's embedding tied to its head across two stages: the step measured
        4.7-7.4 ms for 1.0-1.9 ms of work, the rest waiting for the other rank's last backward)."""
        began = time.perf_counter()
        mine = {name: p for stage in self.stages.values() for name, p in stage.params.items()}
        for group in self.groups.tied:
            if group.group is not None:
                self.sync.all_reduce([mine[name] for name in group.names], group.group,
                                     f"tied {', '.join(group.names)}", fill_missing=True)
        self._tied_sum_s += time.perf_counter() - began


def _accumulate(grads: dict[str, torch.Tensor], name: str, grad: torch.Tensor) -> None:
    grads[name] = grad if name not in grads else grads[name] + grad


def _resolve(device: torch.device | str | None) -> torch.device:
    """The given device (default: CUDA if available, else the CPU) with its CUDA index filled in."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new copy of ``tensor`` on ``device`` (cast to ``dtype``). From host memory to a GPU it goes through
    pinned memory without blocking and is cast on the GPU: a copy from pageable memory, or one cast on the
    host first, synchronises the stream and leaves the GPU idle until the host has queued work again
    (the targets are copied at the loss, after the forward is queued: a ResNet-50 step in bf16 on an H100
    went from 0.954x to 1.044x of the plain PyTorch loop's samples/s with this)."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True).to(dtype or tensor.dtype)
    return tensor.to(device, dtype, copy=True)
