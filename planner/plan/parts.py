"""The parts of a plan: frozen dataclasses, each decoding its own JSON fields explicitly.

Standard library only (plus the standard-library-only cost_models.memory for the precision and
optimizer enums), so reading a plan stays cheap.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from cost_models.comm import hidden_share
from cost_models.memory import Optimizer, Precision
from planner.plan import codec
from planner.plan.kinds import ScheduleKind
from planner.plan.spatial import SpatialSpec


class StateTier(str, Enum):
    """Where optimizer state lives."""

    GPU = "gpu"
    HOST = "host"
    NVME = "nvme"


class ParamTier(str, Enum):
    """Where parameters live between their uses."""

    GPU = "gpu"
    HOST = "host"


@dataclass(frozen=True)
class InputMeta:
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def from_dict(cls, data: Any, path: str) -> InputMeta:
        return codec.fields(cls, data, path, {"shape": codec.tuple_of(codec.integer), "dtype": codec.string})


@dataclass(frozen=True)
class ModelRef:
    """How the runtime rebuilds the model and checks it is the one that was planned.

    ``builder`` names a model file by its absolute path (it resolves from any directory);
    ``builder_relative`` keeps the path as it was given, relative to where `tessera plan` ran, for a
    copy of the project elsewhere. ``builder_specs`` tries them in that order.
    """

    builder: str | None
    builder_kwargs: Mapping[str, Any]
    fingerprint: str
    example_inputs: tuple[InputMeta, ...]
    precision: Precision
    builder_relative: str | None = None  # absent in older files
    leaf_modules: tuple[str, ...] = ()  # the modules traced whole (class or submodule names); absent in older files

    @property
    def builder_specs(self) -> tuple[str, ...]:
        """The builder specs to try, in order (cost_models.graph.model_spec.resolve_builder)."""
        return tuple(spec for spec in (self.builder, self.builder_relative) if spec)

    @classmethod
    def from_dict(cls, data: Any, path: str) -> ModelRef:
        return codec.fields(cls, data, path, {
            "builder": codec.optional(codec.string), "builder_kwargs": codec.json_object,
            "fingerprint": codec.string, "example_inputs": codec.tuple_of(InputMeta.from_dict),
            "precision": codec.enum_of(Precision), "builder_relative": codec.optional(codec.string),
            "leaf_modules": codec.tuple_of(codec.string)},
            optional=frozenset({"builder_relative", "leaf_modules"}))


@dataclass(frozen=True)
class ClusterSpec:
    gpus: int
    gpus_per_node: int
    device: Mapping[str, Any]  # DeviceSpec.to_dict(): name, mem_bytes, links, ...
    mem_bytes: int  # the per-GPU budget the plan was made for
    reserve_bytes: int = 0  # of it kept free (CUDA context, fragmentation); absent in older files
    gpus_available: int | None = None  # GPUs planning was given (``gpus`` is those the plan uses)
    host_mem_bytes: int | None = None  # per node, what host memory the plan may use (None: not planned)
    nvme_bytes: int | None = None  # per node, what NVMe the plan may use

    @property
    def device_name(self) -> str:
        return str(self.device["name"])

    @property
    def backend(self) -> str:
        """What the device's ranks communicate with (DeviceSpec.backend; files made before it: NCCL's model)."""
        return str(self.device.get("backend", "nccl"))

    @property
    def usable_mem_bytes(self) -> int:
        """What the plan's ranks may use: the budget less the reserve."""
        return self.mem_bytes - self.reserve_bytes

    @classmethod
    def from_dict(cls, data: Any, path: str) -> ClusterSpec:
        return codec.fields(cls, data, path, {"gpus": codec.integer, "gpus_per_node": codec.integer,
                                              "device": codec.json_object, "mem_bytes": codec.integer,
                                              "reserve_bytes": codec.integer,
                                              "gpus_available": codec.optional(codec.integer),
                                              "host_mem_bytes": codec.optional(codec.integer),
                                              "nvme_bytes": codec.optional(codec.integer)},
                            optional=frozenset({"reserve_bytes", "gpus_available", "host_mem_bytes",
                                                "nvme_bytes"}))


@dataclass(frozen=True)
class TrainingSpec:
    global_batch_size: int
    micro_batch_size: int
    num_microbatches: int
    optimizer: Optimizer

    @classmethod
    def from_dict(cls, data: Any, path: str) -> TrainingSpec:
        return codec.fields(cls, data, path, {
            "global_batch_size": codec.integer, "micro_batch_size": codec.integer,
            "num_microbatches": codec.integer, "optimizer": codec.enum_of(Optimizer)})


@dataclass(frozen=True)
class ScheduleSpec:
    """The schedule family and, per stage, the most micro-batches whose activations it holds at once."""

    kind: ScheduleKind
    in_flight: tuple[int, ...]

    @classmethod
    def from_dict(cls, data: Any, path: str) -> ScheduleSpec:
        return codec.fields(cls, data, path, {"kind": codec.enum_of(ScheduleKind),
                                              "in_flight": codec.tuple_of(codec.integer)})


@dataclass(frozen=True)
class OffloadSpec:
    """One stage's memory decisions (KARMA, ZeRO-Infinity); the default keeps everything on the GPU.

    * ``recompute``: checkpoint regions, each a run of consecutive nodes of the stage (in the
      stage's node order) whose saved activations are dropped after the forward and recomputed,
      region by region, in the backward (only the region's inputs are kept).
    * ``swap``: nodes whose saved activations are copied to host memory during the forward
      (``SWAP_OUT`` in the program waits for those copies) and brought back ahead of the
      backward (``SWAP_IN`` starts the prefetch).
    * ``zero_stage``: model state sharded over the stage's data-parallel replicas: 1 the optimizer
      state and master weights, 2 also the gradients, 3 also the parameters (ZeRO).
    * ``optimizer_state``: where master weights and optimizer state live; on ``host`` or ``nvme``
      the optimizer step runs on the host (gradients copied down, parameters copied back).
    * ``params``: where parameters live between their uses (``host``: fetched ahead of use).
    * ``grads_on_host``: each backward's parameter gradients leave the device as it makes them and add up
      on the host, where the host's step reads them (ZeRO-Offload), instead of adding up on the device
      until the step; it needs the step on the host (``optimizer_state`` host or nvme).
    * ``gathers``: under ZeRO-3, the parameters (canonical names) each all-gather fetches together, in the
      order the stage's layers use them: a group is gathered at its first layer's forward and freed after its
      last, gathered again for its layers' backward and its gradients reduce-scattered once they are all made
      (runtime/layer_gathers.py). Parameters in no group are gathered for the whole pass. Empty: one group per
      layer (module call) that reads sharded parameters.
    * ``prefetch``: under ZeRO-3, each group's gather starts the next one's, which runs while the group computes
      (FSDP's prefetch), in buffers of its own (the planner sets it where the backend overlaps collectives with
      compute: cost_models.comm.GATHERS_AHEAD).
    """

    recompute: tuple[tuple[str, ...], ...] = ()
    swap: tuple[str, ...] = ()
    zero_stage: int = 0
    optimizer_state: StateTier = StateTier.GPU
    params: ParamTier = ParamTier.GPU
    grads_on_host: bool = False
    gathers: tuple[tuple[str, ...], ...] = ()
    prefetch: bool = False

    @property
    def is_default(self) -> bool:
        """Everything kept on the GPU, unsharded."""
        return self == OffloadSpec()

    @property
    def recomputed_nodes(self) -> frozenset[str]:
        return frozenset(node for region in self.recompute for node in region)

    @property
    def host_step(self) -> bool:
        """The optimizer step runs on the host (its state is not on the GPU)."""
        return self.optimizer_state is not StateTier.GPU

    def describe(self, num_nodes: int) -> str:
        """E.g. "recompute 40 of 104 nodes in 12 regions, swap 6 nodes, optimizer on host" ("" if default)."""
        said = []
        recomputed = len(self.recomputed_nodes)
        if recomputed:
            said.append(f"recompute {recomputed} of {num_nodes} nodes in {len(self.recompute)} "
                        f"region{'s' if len(self.recompute) != 1 else ''}")
        if self.swap:
            said.append(f"swap {len(self.swap)} node{'s' if len(self.swap) != 1 else ''}' activations to host")
        if self.zero_stage:
            said.append(f"model state sharded (ZeRO-{self.zero_stage})")
        if self.gathers:
            said.append(f"its weights gathered in {len(self.gathers)} group{'s' if len(self.gathers) != 1 else ''}"
                        + (", each the next's ahead" if self.prefetch else ""))
        if self.optimizer_state is StateTier.HOST:
            said.append("optimizer on host")
        elif self.optimizer_state is StateTier.NVME:
            said.append("optimizer state on NVMe, step on host")
        if self.grads_on_host:
            said.append("gradients to host each backward")
        if self.params is ParamTier.HOST:
            said.append("params on host")
        return ", ".join(said)

    @classmethod
    def from_dict(cls, data: Any, path: str) -> OffloadSpec:
        return codec.fields(cls, data, path, {
            "recompute": codec.tuple_of(codec.tuple_of(codec.string)), "swap": codec.tuple_of(codec.string),
            "zero_stage": codec.integer, "optimizer_state": codec.enum_of(StateTier),
            "params": codec.enum_of(ParamTier), "grads_on_host": codec.boolean,
            "gathers": codec.tuple_of(codec.tuple_of(codec.string)), "prefetch": codec.boolean},
            optional=frozenset({"grads_on_host", "gathers", "prefetch"}))


@dataclass(frozen=True)
class StagePrediction:
    """What one part costs: per micro-batch times, memory held all step, memory per micro-batch in flight."""

    fwd_ms: float
    bwd_ms: float
    param_bytes: int
    static_bytes: int  # held all step: model state on the device, transient, send buffer, recompute, swap buffers
    activation_bytes: int  # per micro-batch in flight: kept saved activations + received inputs
    allreduce_ms: float = 0.0  # gradient all-reduce over the part's copies (0 without data parallelism)
    optimizer_ms: float = 0.0  # the optimizer step, on the device or the host (after the all-reduce)
    swap_bytes: int = 0  # per micro-batch: saved activations swapped to the host (off the device F..B)
    swap_ms: float = 0.0  # per micro-batch, each way over the host link
    host_bytes: int = 0  # per rank: optimizer state and gradients on the host (swapped activations apart)
    nvme_bytes: int = 0  # per rank: optimizer state on NVMe
    weight_grad_ms: float = 0.0  # what a split backward's W takes: the parameters' gradients
    grad_bytes: int = 0  # of static_bytes: gradients, from the step's first backward to its optimizer step
    step_bytes: int = 0  # during its optimizer step: what the step's buffers add above static_bytes (worst bucket)
    tied_bytes: int = 0  # at each backward's end, once its activations went: what tied weights' partial
    # gradients add above static_bytes (beside a node's working set, in place of the largest transient)
    accumulate_bytes: int = 0  # from a backward that adds into its gradients: the largest node's new gradient
    split_extra_ms: float = 0.0  # a split backward's I and W beyond bwd_ms, measured (I takes bwd - W + this)
    first_backward_bytes: int = 0  # in the step's first backward: what its node-by-node working set and the
    # gradients made so far add above static_bytes, less the gradients (planner/search/working.py)
    split_kept_bytes: int = 0  # per micro-batch, from a split backward's I to its W: what I keeps for W (the
    # output gradients of the nodes computing with weights)
    split_relief_bytes: int = 0  # what static_bytes holds beyond a split backward's W's working set (its largest
    # transient less a node's new weight gradients): gone from an I's end until the rank's next forward or I

    def allreduce_overlap(self, offload: OffloadSpec, after_backward: bool, backend: str) -> float:
        """The share of ``allreduce_ms`` that runs during the stage's last backward (as DDP's: buckets start
        as their gradients are ready, in backward order; cost_models.comm.hidden_share, none on gloo). 0 where
        the runtime reduces after the backward: ZeRO-2/3's reduce-scatter, and ``after_backward`` (stashed
        weight versions, WPipe; a split backward's W, ZB-H1)."""
        if not self.allreduce_ms or offload.zero_stage >= 2 or after_backward:
            return 0.0
        return hidden_share(self.param_bytes, backend)

    @classmethod
    def from_dict(cls, data: Any, path: str) -> StagePrediction:
        return codec.fields(cls, data, path, {
            "fwd_ms": codec.number, "bwd_ms": codec.number, "param_bytes": codec.integer,
            "static_bytes": codec.integer, "activation_bytes": codec.integer, "allreduce_ms": codec.number,
            "optimizer_ms": codec.number, "swap_bytes": codec.integer, "swap_ms": codec.number,
            "host_bytes": codec.integer, "nvme_bytes": codec.integer, "weight_grad_ms": codec.number,
            "grad_bytes": codec.integer, "step_bytes": codec.integer, "tied_bytes": codec.integer,
            "accumulate_bytes": codec.integer, "split_extra_ms": codec.number,
            "first_backward_bytes": codec.integer, "split_kept_bytes": codec.integer,
            "split_relief_bytes": codec.integer},
            optional=frozenset({"optimizer_ms", "swap_bytes", "swap_ms", "host_bytes", "nvme_bytes",
                                "weight_grad_ms", "grad_bytes", "step_bytes", "tied_bytes", "accumulate_bytes",
                                "split_extra_ms", "first_backward_bytes", "split_kept_bytes",
                                "split_relief_bytes"}))


@dataclass(frozen=True)
class StagePlan:
    """One part of the model: what a stage computes (where it runs is the plan's layout).

    ``spatial`` (None for an ordinary stage) cuts the part's input image into tiles, one per rank
    of the slot that runs it (planner/plan/spatial.py).
    """

    index: int
    nodes: tuple[str, ...]
    predicted: StagePrediction
    spatial: SpatialSpec | None = None
    offload: OffloadSpec = field(default_factory=OffloadSpec)

    @classmethod
    def from_dict(cls, data: Any, path: str) -> StagePlan:
        return codec.fields(cls, data, path, {
            "index": codec.integer, "nodes": codec.tuple_of(codec.string),
            "predicted": StagePrediction.from_dict, "spatial": codec.optional(SpatialSpec.from_dict),
            "offload": OffloadSpec.from_dict}, optional=frozenset({"spatial"}))


@dataclass(frozen=True)
class Transfer:
    """Activations one stage sends another per micro-batch, and the bytes of their gradients coming back
    (the values that carry one: not Python ints or integer tensors)."""

    src_stage: int
    dst_stage: int
    nbytes: int
    ms: float
    grad_nbytes: int
    post_ms: float = 0.0  # what posting one micro-batch's messages costs each end's rank (either way)

    @classmethod
    def from_dict(cls, data: Any, path: str) -> Transfer:
        if isinstance(data, Mapping) and "grad_nbytes" not in data:  # a plan file from before it was recorded
            data = {**data, "grad_nbytes": data.get("nbytes")}
        return codec.fields(cls, data, path, {"src_stage": codec.integer, "dst_stage": codec.integer,
                                              "nbytes": codec.integer, "ms": codec.number,
                                              "grad_nbytes": codec.integer, "post_ms": codec.number},
                            optional=frozenset({"post_ms"}))  # 0 in a plan file from before it was recorded


@dataclass(frozen=True)
class TiedSum:
    """A weight several parts hold a copy of (a GPT's embedding tied to its head), whose copies' gradients
    the runtime sums over every rank holding one of ``parts`` at each rank's first optimizer step of the
    step (runtime/executor.py: _sync_tied): the parameters ``names``, ``nbytes`` of gradients, ``ms`` the ring
    all-reduce over those ranks. A rank reaching it waits there for the others (the simulator replays it).
    ``state_bytes``: what one copy of them holds on a device (weights, gradients, optimizer state, as their parts
    keep them); a rank running two of ``parts`` keeps one (runtime/stages.py: local_stages), which the simulator
    counts once (0 in a plan file from before it was recorded: counted on each)."""

    parts: tuple[int, ...]
    names: tuple[str, ...]
    nbytes: int
    ms: float
    state_bytes: int = 0

    @classmethod
    def from_dict(cls, data: Any, path: str) -> TiedSum:
        return codec.fields(cls, data, path, {"parts": codec.tuple_of(codec.integer),
                                              "names": codec.tuple_of(codec.string), "nbytes": codec.integer,
                                              "ms": codec.number, "state_bytes": codec.integer},
                            optional=frozenset({"state_bytes"}))


@dataclass(frozen=True)
class LayerRow:
    """One row of the cost table the solver used (per micro-batch)."""

    name: str
    fwd_ms: float
    bwd_ms: float
    param_bytes: int
    saved_activation_bytes: int
    output_bytes: int

    @classmethod
    def from_dict(cls, data: Any, path: str) -> LayerRow:
        return codec.fields(cls, data, path, {
            "name": codec.string, "fwd_ms": codec.number, "bwd_ms": codec.number,
            "param_bytes": codec.integer, "saved_activation_bytes": codec.integer,
            "output_bytes": codec.integer})


@dataclass(frozen=True)
class Prediction:
    step_ms: float
    samples_per_s: float
    bubble_fraction: float
    peak_mem_bytes: tuple[int, ...]  # per rank

    @classmethod
    def from_dict(cls, data: Any, path: str) -> Prediction:
        return codec.fields(cls, data, path, {
            "step_ms": codec.number, "samples_per_s": codec.number, "bubble_fraction": codec.number,
            "peak_mem_bytes": codec.tuple_of(codec.integer)})


@dataclass(frozen=True)
class RunnerUp:
    """The second-best configuration the search solved (``step_ms``: its simulated step)."""

    num_stages: int
    data_parallel: int
    micro_batch_size: int
    schedule: ScheduleKind
    step_ms: float

    @classmethod
    def from_dict(cls, data: Any, path: str) -> RunnerUp:
        return codec.fields(cls, data, path, {
            "num_stages": codec.integer, "data_parallel": codec.integer, "micro_batch_size": codec.integer,
            "schedule": codec.enum_of(ScheduleKind), "step_ms": codec.number})


@dataclass(frozen=True)
class SolverReport:
    name: str
    status: str
    objective: float
    gap: float | None  # None: unknown (the solve stopped before proving a bound)
    wall_s: float
    configs_tried: int
    why: str
    binding: str = ""
    runner_up: RunnerUp | None = None
    configs_unexamined: int = 0  # could still have won when the time limit ended the search
    decisions_local: bool = False  # the winner's recompute/swap were optimised with its cuts in windows

    @property
    def proven_optimal(self) -> bool:
        """The winner's ILP was solved to optimality over every partition and no configuration that might
        beat it was left."""
        return self.status == "optimal" and not self.configs_unexamined and not self.decisions_local

    @classmethod
    def from_dict(cls, data: Any, path: str) -> SolverReport:
        return codec.fields(cls, data, path, {
            "name": codec.string, "status": codec.string, "objective": codec.number,
            "gap": codec.optional(codec.number), "wall_s": codec.number, "configs_tried": codec.integer,
            "why": codec.string,
            "binding": codec.string, "runner_up": codec.optional(RunnerUp.from_dict),
            "configs_unexamined": codec.integer, "decisions_local": codec.boolean},
            optional=frozenset({"configs_unexamined", "decisions_local"}))
