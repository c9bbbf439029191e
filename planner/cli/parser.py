"""The ``tessera`` command line: one subcommand per user task; errors are one line and exit 2."""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from cost_models.errors import InvalidArgument, TesseraError, TesseraWarning
from cost_models.memory import Optimizer, Precision
from planner.budget import DEFAULT_RESERVE
from planner.cli.run_command import Rendezvous
from planner.plan.kinds import ScheduleKind
from planner.search.problem import Offload

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, like every other tessera error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InvalidArgument(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tessera", description="Plan and run training of models too large for one GPU.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_profile(commands.add_parser(
        "profile", help="trace a model and print its per-layer cost table",
        description="Trace MODEL, cost every layer (FLOPs, time, memory) and print the table. "
                    "On --device cpu times are measured on this machine; on a GPU preset they "
                    "are roofline estimates (the model is built on the meta device)."))
    calibrate = commands.add_parser(
        "calibrate", help="measure this machine's CPU or GPU into a device file that --device accepts",
        description="Time matmuls in every precision, memory copies, per-op overhead and the links on this "
                    "machine's CPU (and between two local gloo processes) or GPU, and write them as a device "
                    "JSON file: plan with --device FILE instead of a preset's datasheet figures.")
    calibrate.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")
    calibrate.add_argument("-o", "--output", type=Path, default=None,
                           help="the device file to write (default calibrated-DEVICE.json)")
    calibrate.set_defaults(handler=_run_calibrate)
    _add_plan(commands.add_parser(
        "plan", help="choose the pipeline x data-parallel split and schedule; print the plan",
        description="Trace MODEL on the meta device, cost it on DEVICE, and solve for the fastest "
                    "plan on GPUS GPUs with MEM memory each. -o saves it for `tessera run`."))
    show = commands.add_parser("show", help="print a saved plan", description="Print a saved plan.")
    show.add_argument("plan_file", metavar="PLAN", type=Path)
    show.set_defaults(handler=lambda args: print(_commands().run_show(args.plan_file)))
    simulate = commands.add_parser(
        "simulate", help="replay a plan's schedule; write a Chrome trace and an SVG timeline",
        description="Replay the plan's per-rank programs on its predicted costs.")
    simulate.add_argument("plan_file", metavar="PLAN", type=Path)
    simulate.add_argument("--trace", type=Path, default=None, help="Chrome trace JSON (default PLAN.trace.json)")
    simulate.add_argument("--svg", type=Path, default=None, help="SVG timeline (default PLAN.svg)")
    simulate.set_defaults(handler=lambda args: print(
        _commands().run_simulate(args.plan_file, args.trace, args.svg)))
    _add_run(commands.add_parser(
        "run", help="train a plan under torchrun on this machine or several (synthetic data)",
        description="Check the plan and its model, then start torchrun's agent: `torchrun "
                    "--standalone --nproc-per-node N -m runtime PLAN --steps K`, or with --nnodes "
                    "one such command per node joined by a rendezvous. Arguments after -- go to the "
                    "runtime (e.g. -- --report run.json --seed 1). Ctrl-C or SIGTERM stops every "
                    "rank; a refused set-up exits 2, a failed rank 1."))
    validate = commands.add_parser(
        "validate", help="print a plan's predictions beside a run report's measurements",
        description="Compare predicted and measured step time, samples/s, the bubble (on CPU), and per "
                    "rank its step time, idle share, peak memory and halo bytes sent, with the error of "
                    "each in percent (of a share, in percentage points) and the worst marked. With "
                    "--tolerance, exit 1 when an error is above it.")
    validate.add_argument("plan_file", metavar="PLAN", type=Path)
    validate.add_argument("report_file", metavar="RUN_REPORT", type=Path)
    validate.add_argument("--tolerance", type=float, default=None, metavar="PERCENT",
                          help="largest error allowed, in percent (e.g. 10; for the bubble and idle "
                               "shares, percentage points): above it, print which check is worst and "
                               "exit 1 (default: only report)")
    validate.set_defaults(handler=lambda args: _run_commands().run_validate(
        args.plan_file, args.report_file, args.tolerance))
    return parser


def _run_commands():
    import planner.cli.run_command as commands

    return commands


def _add_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_file", metavar="PLAN", type=Path)
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes on this node (default: the plan's GPUs / --nnodes)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--nvme-dir", type=Path, default=None,
                        help="directory on a local SSD for the stages whose optimizer state the plan "
                             "puts on NVMe (checked before launch; passed to the runtime)")
    nodes = parser.add_argument_group("several nodes", "run `tessera run` on every node with the "
                                      "same arguments, --node-rank aside (torchrun's rendezvous "
                                      "joins them)")
    nodes.add_argument("--nnodes", type=int, default=1, help="nodes of the job (default 1)")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST:PORT", default=None,
                       help="an address of the first node that every node reaches")
    nodes.add_argument("--rdzv-backend", choices=[kind.value for kind in Rendezvous], default="c10d",
                       type=str.lower,
                       help="c10d (default) numbers the nodes itself; static needs --node-rank")
    nodes.add_argument("--rdzv-id", default=None, help="job id shared by the nodes (c10d)")
    nodes.add_argument("--node-rank", type=int, default=None, help="this node's rank (static only)")
    parser.set_defaults(handler=_run_plan_file, takes_passthrough=True)


def _run_plan_file(args: argparse.Namespace) -> int:
    from planner.cli.run_command import Nodes, RunRequest, run_plan

    nodes = Nodes(args.nnodes, args.rdzv_endpoint, Rendezvous(args.rdzv_backend), args.rdzv_id,
                  args.node_rank)
    nvme = ("--nvme-dir", str(args.nvme_dir)) if args.nvme_dir is not None else ()
    return run_plan(RunRequest(args.plan_file, args.steps, args.nproc, nodes, (*nvme, *args.passthrough)))


def _commands():
    import planner.cli.plan_command as commands

    return commands


def _add_plan(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser, batch_help="global batch per training step: samples over all "
                                            "data-parallel replicas and micro-batches")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    parser.add_argument("--mem", required=True,
                        help="memory per GPU with a unit: 16GB, 16GiB, 512MB (GB and GiB both mean "
                             "2**30 bytes, as GPUs are sold; a bare number is refused)")
    parser.add_argument("--reserve", default=DEFAULT_RESERVE, metavar="SIZE|PERCENT",
                        help="memory kept free on every GPU for the CUDA context and allocator "
                             "fragmentation; plans fit MEM less this (default %(default)s of MEM; "
                             "e.g. 1GB or 0)")
    parser.add_argument("--device", default="V100-16GB",
                        help="GPU preset or device JSON file (default %(default)s)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs per node (default min(GPUS, 8))")
    _add_training_modes(parser)
    parser.add_argument("--schedule", action="append", default=None, type=str.lower,
                        choices=[kind.value for kind in ScheduleKind],
                        help="schedule families to consider (repeatable; default every synchronous one, "
                             "and wpipe with --allow-stale-weights)")
    parser.add_argument("--allow-stale-weights", action="store_true",
                        help="also consider wpipe, whose first half of the parts trains on weights one "
                             "update old (this changes the training rule; the plan says so)")
    parser.add_argument("--micro-batch-size", action="append", type=int, default=None,
                        help="micro-batch sizes to consider (repeatable; default every divisor of "
                             "the batch per replica)")
    parser.add_argument("--num-stages", action="append", type=int, default=None, metavar="S",
                        help="pipeline stage counts to consider (repeatable; default every divisor of "
                             "the GPUs used)")
    parser.add_argument("--data-parallel", action="append", type=int, default=None, metavar="D",
                        help="data-parallel degrees to consider (repeatable; default every one the "
                             "batch allows); with --num-stages, S x D GPUs may be fewer than GPUS")
    parser.add_argument("--time-limit", type=float, default=60.0, metavar="SECONDS",
                        help="wall-clock limit of the search, > 0 (default %(default)g); a plan it cuts "
                             "short says NOT PROVEN OPTIMAL")
    tiers = parser.add_argument_group("memory tiers", "by default the search decides per unit of nodes "
                                      "whether to keep, recompute or swap saved activations, and per "
                                      "configuration whether to shard model state (ZeRO-1 or ZeRO-3), keep the "
                                      "optimizer on the GPU, the host or NVMe, and with it off the GPU send "
                                      "each backward's gradients to the host")
    decisions = tiers.add_mutually_exclusive_group()
    decisions.add_argument("--no-offload", dest="offload", action="store_false",
                           help="keep every activation and all model state on the GPU")
    decisions.add_argument("--offload", dest="offload_kinds", action="append", type=str.lower, metavar="KIND",
                           choices=[kind.value for kind in Offload],
                           help="allow only these memory decisions (repeatable): recompute, swap, zero (ZeRO-1 or -3), "
                                "host or nvme (the optimizer's tier), grads (gradients to the host, with host "
                                "or nvme), params (ZeRO-3's weight shards on the host, with zero and host or nvme)")
    tiers.add_argument("--host-mem", default=None, metavar="SIZE",
                       help="host memory per node the plan may use (default: the device preset's node)")
    tiers.add_argument("--nvme", default=None, metavar="SIZE",
                       help="NVMe capacity per node the plan may use (default: the device preset's node)")
    parser.add_argument("--no-spatial", dest="spatial", action="store_false",
                        help="never run the first stage of an image model on spatial tiles (by default "
                             "the search tiles it where that is faster or the only fit)")
    measured = parser.add_mutually_exclusive_group()
    measured.add_argument("--profile", dest="profile", action="store_true", default=None,
                          help="cost from node times measured on this machine's GPU (the --device preset or a "
                               "`tessera calibrate` file of it): the whole model, with real weights, at each "
                               "micro-batch size, on that one GPU (cached); on --device cpu this is the default")
    measured.add_argument("--no-profile", dest="profile", action="store_false",
                          help="on --device cpu, cost from the roofline instead of node times measured on this "
                               "machine (which builds the model with real weights; cached)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="write the plan here (JSON)")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--progress", action="store_true",
                       help="print progress on stderr: phase, configurations searched, best so far "
                            "(default: when stderr is a terminal)")
    shown.add_argument("-q", "--quiet", action="store_true", help="print no progress")
    parser.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> None:
    from planner.cli.plan_command import PlanRequest, run_plan
    from planner.cli.progress_line import ProgressLine

    request = PlanRequest(
        model=args.model, model_args=tuple(args.model_arg), inputs=tuple(args.input),
        batch_size=args.batch_size, gpus=args.gpus, mem=args.mem, reserve=args.reserve, device=args.device,
        gpus_per_node=args.gpus_per_node, optimizer=args.optimizer, precision=args.precision,
        schedules=tuple(args.schedule) if args.schedule else None, allow_stale_weights=args.allow_stale_weights,
        micro_batch_sizes=tuple(args.micro_batch_size) if args.micro_batch_size else None,
        num_stages=tuple(args.num_stages) if args.num_stages else None,
        data_parallel=tuple(args.data_parallel) if args.data_parallel else None,
        time_limit_s=args.time_limit, leaf_modules=tuple(args.leaf), output=args.output,
        offload=tuple(args.offload_kinds) if args.offload_kinds else args.offload, host_mem=args.host_mem,
        nvme=args.nvme, spatial=args.spatial,
        profile=args.profile)
    terminal = sys.stderr.isatty()
    progress = ProgressLine(sys.stderr, terminal) if args.progress or (terminal and not args.quiet) else None
    print(run_plan(request, search_root=Path.cwd(), progress=progress))


def _add_model_arguments(parser: argparse.ArgumentParser, batch_help: str) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="builder as path/file.py:function or package.module:function")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the builder (repeatable), e.g. num_classes=10; values are "
                             "true/false, none, numbers, 'quoted strings', plain words or [lists]")
    parser.add_argument("--input", action="append", required=True, metavar="SHAPE[:DTYPE]",
                        help="one sample's input shape without the batch dimension, e.g. "
                             "3x224x224 or 1024:int64 (repeat for several inputs)")
    parser.add_argument("--batch-size", type=int, required=True, help=batch_help)
    parser.add_argument("--leaf", action="append", default=[], metavar="NAME",
                        help="keep this submodule (qualified name or class name) as one node")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="on an error, also print its details (e.g. torch.export's output when "
                             "the model cannot be traced)")


def _add_profile(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser, batch_help="samples in the traced batch: the costs shown are for "
                                            "one forward and backward of this many samples")
    parser.add_argument("--device", default="cpu",
                        help="'cpu' (measured here), a GPU preset such as V100-16GB, or a device JSON "
                             "file (default %(default)s)")
    _add_training_modes(parser)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--estimate", action="store_true",
                      help="roofline estimate even on cpu (no real tensors are allocated)")
    mode.add_argument("--measure", action="store_true",
                      help="measure on the local device (default for cpu; a GPU preset needs CUDA)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs per node, median kept (default %(default)s)")
    parser.add_argument("--cache-dir", default=None,
                        help="where measured timings are cached (default ~/.cache/tessera/profiles)")
    parser.add_argument("--top", type=int, default=None, help="show only the N slowest layers (default: all)")
    parser.add_argument("-o", "--output", default=None, help="also write the cost table as JSON")
    parser.set_defaults(handler=_run_profile)


def _add_training_modes(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--optimizer", default="adam", type=str.lower, choices=[o.value for o in Optimizer],
                        help="optimizer whose state is costed (default adam)")
    parser.add_argument("--precision", default=None, type=str.lower, choices=[p.value for p in Precision],
                        help="fp16/bf16 mean mixed precision with fp32 master weights (default: the "
                             "model's own, the dtype of its weights)")


def _run_calibrate(args: argparse.Namespace) -> None:
    from cost_models.calibration import calibrate, describe
    from cost_models.devices import save_device

    measured = calibrate(args.device)
    output = args.output or Path(f"calibrated-{args.device.strip().lower().replace(':', '-')}.json")
    save_device(measured.device, output)
    print(f"{describe(measured)}\nwrote {output}; plan with --device {output}")


def _run_profile(args: argparse.Namespace) -> None:
    from planner.cli.profile_command import ProfileRequest, run_profile

    if args.batch_size < 1:
        raise InvalidArgument(f"--batch-size must be >= 1, got {args.batch_size}")
    cache_dir = args.cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tessera" / "profiles"
    request = ProfileRequest(
        model=args.model, model_args=tuple(args.model_arg), inputs=tuple(args.input),
        batch_size=args.batch_size, device=args.device, optimizer=args.optimizer,
        precision=args.precision, measure=None if not (args.estimate or args.measure) else args.measure,
        repeats=args.repeats, cache_dir=Path(cache_dir), leaf_modules=tuple(args.leaf),
        top=args.top, output=Path(args.output) if args.output else None)
    print(run_profile(request, search_root=Path.cwd()))


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; what follows a ``--`` is kept as ``args.passthrough`` (for `tessera run`)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(_attach_negative_values(argv[:cut]))
    args.passthrough = argv[cut + 1:]
    if args.passthrough and not getattr(args, "takes_passthrough", False):
        raise InvalidArgument(f"arguments after -- ({' '.join(args.passthrough)}) are only for "
                              f"`tessera run`")
    return args


def _attach_negative_values(argv: list[str]) -> list[str]:
    """``--mem -16GB`` → ``--mem=-16GB``: argparse would read "-16GB" as an unknown option and say
    only "expected one argument"; attached, the value reaches its own check, which names it."""
    joined: list[str] = []
    for token in argv:
        if joined and re.match(r"^-\.?\d", token) and joined[-1].startswith("--") and "=" not in joined[-1]:
            joined[-1] = f"{joined[-1]}={token}"
        else:
            joined.append(token)
    return joined


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tessera`` console script; returns the exit code."""
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # so "examples.models.resnet:resnet50" imports
    with warnings.catch_warnings():
        warnings.simplefilter("always", TesseraWarning)
        warnings.showwarning = _one_line_warnings(warnings.showwarning)
        return _run(list(sys.argv[1:] if argv is None else argv))


def _run(argv: list[str]) -> int:
    args = None
    try:
        args = _parse(build_parser(), argv)
        status = args.handler(args)  # `tessera run` returns torchrun's exit status
    except TesseraError as error:
        _print_error(error, verbose=getattr(args, "verbose", None))
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("tessera: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `tessera show plan.json | head`
        sys.stderr.close()
        return 0
    return status if isinstance(status, int) else 0


def _print_error(error: TesseraError, verbose: bool | None) -> None:
    """One line; an error's details (torch's output, ...) before it with --verbose, else a hint."""
    message = " ".join(str(error).split())
    if error.details and verbose:
        print(error.details.rstrip(), file=sys.stderr)
    elif error.details and verbose is False:
        message += " (--verbose prints the details)"
    print(f"tessera: error: {message}", file=sys.stderr)


def _one_line_warnings(show: Callable[..., None]) -> Callable[..., None]:
    """tessera's own warnings as one stderr line each; any other warning as Python shows it."""
    def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, TesseraWarning):
            print(f"tessera: warning: {' '.join(str(message).split())}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)
    return show_warning
