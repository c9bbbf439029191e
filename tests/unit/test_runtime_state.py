"""The optimizer-state pieces without processes: ZeRO chunks, the paged file, --nvme-dir and offload checks."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from cost_models.errors import RuntimeSetupError
from planner.nvme_dir import check_nvme_dir, paged_bytes
from planner.plan import OffloadSpec, ParamTier, Plan, StateTier
from planner.reports.run_report import RunReport
from runtime import checks
from runtime.command import parse_args
from runtime.nvme import ALIGN_BYTES, PagedFile
from runtime.sharding import ShardLayout, fill_storage, free_storage, is_freed
from tests.runtime_plans import GPT, make_plan


def _plan(offload: list[OffloadSpec], data_parallel: int = 2) -> Plan:
    return Plan.from_dict(json.loads(make_plan(GPT, ["blocks_1_ln_1"], schedule="gpipe", optimizer="adam",
                                               data_parallel=data_parallel, offload=offload)))


@pytest.fixture(scope="module")
def nvme_plan() -> Plan:
    return _plan([OffloadSpec(optimizer_state=StateTier.NVME), OffloadSpec(zero_stage=1,
                                                                          optimizer_state=StateTier.NVME)])


def test_chunks_of_every_rank_rebuild_the_parameter_and_pad_with_zeros() -> None:
    full = torch.arange(7.0).view(7)
    layouts = [ShardLayout((7,), world=3, rank=rank) for rank in range(3)]
    chunks = [layout.chunk(0, full) for layout in layouts]
    assert [c.tolist() for c in chunks] == [[0, 1, 2], [3, 4, 5], [6, 0, 0]]
    assert torch.equal(layouts[0].unpad(0, torch.stack(chunks), full.shape), full)
    assert layouts[0].row_numel == 3


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_packing_a_table_in_place_equals_concatenating_the_padded_parameters(world: int) -> None:
    """A reduce-scatter's table, each gradient written into its columns (ShardLayout.pack, what the runtime sums),
    equals the padded gradients concatenated: sizes dividing the ranks, not dividing them, and smaller than them;
    the table's stale contents (a kept one's) are overwritten, padding included."""
    fulls = [torch.arange(1.0, 1.0 + numel).view(*shape) for numel, shape in
             ((12, (3, 4)), (7, (7,)), (1, (1,)), (5, (5, 1)))]
    layout = ShardLayout(tuple(full.numel() for full in fulls), world=world, rank=0)
    table = torch.full((world, layout.row_numel), float("nan"))
    start = 0
    for index, full in enumerate(fulls):
        layout.pack(index, full, table[:, start:start + layout.chunk_numel(index)])
        start += layout.chunk_numel(index)
    assert torch.equal(table, torch.cat([layout.padded(index, full) for index, full in enumerate(fulls)], dim=1))


def test_a_freed_parameter_keeps_its_identity_and_autograd_sees_it_refilled() -> None:
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    loss = (weight * weight).sum()  # saves the parameter for backward
    kept = weight.detach().clone()
    free_storage(weight)
    assert is_freed(weight) and weight.untyped_storage().nbytes() == 0
    fill_storage(weight, kept)
    loss.backward()
    assert weight.grad.tolist() == [2.0, 4.0]


def test_the_paged_file_round_trips_at_aligned_offsets(tmp_path: Path) -> None:
    pager = PagedFile(tmp_path / "stage.optim", timeout_s=10)
    tensors = [torch.arange(3, dtype=torch.float64), torch.full((5,), 2.5, dtype=torch.float32)]
    pager.write(tensors)
    pager.prefetch()
    back = pager.read()
    assert [t.tolist() for t in back] == [t.tolist() for t in tensors]
    assert [t.dtype for t in back] == [t.dtype for t in tensors]
    assert pager.slots[1].offset_bytes == ALIGN_BYTES and pager.size_bytes == 2 * ALIGN_BYTES
    pager.close()


def test_a_write_interrupted_before_its_rename_leaves_the_previous_file(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "stage.optim"
    pager = PagedFile(path, timeout_s=10)
    pager.write([torch.ones(4)])
    pager.wait()
    before = path.read_bytes()

    def killed(src: str, dst: str) -> None:
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", killed)
    pager.write([torch.zeros(4)])
    with pytest.raises(OSError, match="killed"):
        pager.wait()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["stage.optim"]  # no temporary file left
    pager.close()


def test_nvme_dir_refusals_are_one_line_naming_the_path_and_the_fix(nvme_plan: Plan, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def refusal(directory: Path | None) -> str:
        with pytest.raises(RuntimeSetupError) as caught:
            check_nvme_dir(nvme_plan, directory, [0, 1])
        assert "\n" not in str(caught.value)
        return str(caught.value)

    assert "no --nvme-dir was given; pass --nvme-dir DIR" in refusal(None)
    assert f"--nvme-dir {tmp_path / 'absent'} does not exist" in refusal(tmp_path / "absent")
    assert "mkdir -p" in refusal(tmp_path / "absent")
    assert "--nvme-dir /proc is not writable" in refusal(Path("/proc"))  # even root cannot create files there
    needed = paged_bytes(nvme_plan, [0, 1])
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    assert f"has 1000 bytes free but stages [0, 1] page {needed} bytes" in refusal(tmp_path)
    check_nvme_dir(nvme_plan, None, [])  # stages without NVMe state need no directory


def test_an_nvme_refusal_rank_0_cannot_meet_is_printed_by_the_rank_that_meets_it() -> None:
    """Rank 0 prints the set-up errors every rank meets; the others wait before printing theirs. A rank whose
    NVMe stages rank 0 does not share must not wait (20 s with nothing said)."""
    one_paged = _plan([OffloadSpec(), OffloadSpec(optimizer_state=StateTier.NVME)])

    def shared(parts: list[int], printer_parts: list[int] | None) -> bool:
        with pytest.raises(RuntimeSetupError) as caught:
            check_nvme_dir(one_paged, None, parts, printer_parts=printer_parts)
        return caught.value.same_on_every_rank

    assert not shared([1], [0])  # rank 1 pages, rank 0 does not: rank 1 says it now
    assert shared([1], [1])  # rank 0 pages the same stage (a replica): it says it
    assert shared([0, 1], None)  # one process checking every stage (tessera run)


def test_paged_bytes_count_masters_and_adam_moments_and_divide_zero_shards(nvme_plan: Plan) -> None:
    params = [stage.predicted.param_bytes // 8 for stage in nvme_plan.stages]  # float64 plan
    assert paged_bytes(nvme_plan, [0]) == params[0] * 3 * 8
    assert paged_bytes(nvme_plan, [1]) == -(-params[1] // 2) * 3 * 8
    assert paged_bytes(_plan([OffloadSpec(), OffloadSpec()]), [0, 1]) == 0


def test_the_runtime_refuses_offload_it_does_not_execute_naming_the_stage() -> None:
    plan = _plan([OffloadSpec(zero_stage=3, optimizer_state=StateTier.NVME), OffloadSpec(zero_stage=2)])
    checks.check_executable(plan)  # ZeRO and optimizer tiers run
    swapped = (plan.stages[0], dataclasses.replace(plan.stages[1], offload=OffloadSpec(swap=("blocks_1_ln_2",))))
    checks.check_executable(dataclasses.replace(plan, stages=swapped))  # and activation swapping
    stages = (plan.stages[0], dataclasses.replace(plan.stages[1], offload=OffloadSpec(params=ParamTier.HOST)))
    with pytest.raises(RuntimeSetupError, match="stage 1 keeps its parameters on the host"):
        checks.check_executable(dataclasses.replace(plan, stages=stages))


def test_nvme_dir_flag_and_optimizer_bytes_in_the_run_report(tmp_path: Path) -> None:
    options, _ = parse_args(["plan.json", "--steps", "2", "--nvme-dir", str(tmp_path)])
    assert options.nvme_dir == tmp_path
    report = RunReport("f" * 64, 2, "cpu", 8, 0, (1.0,), (2.0,), (10, 10), "test", (5, 5),
                       optimizer_host_bytes=(0, 64), optimizer_nvme_bytes=(4096, 0))
    report.save(tmp_path / "run.json")
    assert RunReport.load(tmp_path / "run.json") == report
    older = json.loads((tmp_path / "run.json").read_text())
    del older["optimizer_host_bytes"], older["optimizer_nvme_bytes"]
    assert RunReport.from_dict(older).optimizer_nvme_bytes == ()  # reports without them still load


def test_validate_shows_the_optimizer_state_off_the_device(nvme_plan: Plan) -> None:
    from cost_models.units import format_bytes
    from planner.reports.compare import compare

    ranks = nvme_plan.layout.world_size
    report = RunReport(nvme_plan.model.fingerprint, ranks, "cpu", nvme_plan.training.global_batch_size, 0, (1.0,),
                       (2.0,), (10,) * ranks, "test",
                       optimizer_host_bytes=(64,) * ranks, optimizer_nvme_bytes=(2**20,) * ranks)
    table = compare(nvme_plan, report)
    assert f"rank 3 optimizer state off the device: {format_bytes(64)} in host memory, " \
           f"{format_bytes(2**20)} on NVMe" in table


def test_a_plan_whose_stages_outnumber_its_parts_passes_the_checks_before_launch() -> None:
    """GEMS-MASTER runs each part twice (8 layout stages for 4 parts): `tessera run`'s checks before
    launching, and each rank's NVMe check, look parts up by part (they indexed parts by stage)."""
    from planner.cli.run_command import RunRequest, check_before_launch
    from planner.nvme_dir import check_nvme_dir
    from planner.plan import Plan
    from tests.runtime_plans import GPT, make_plan, scheduled

    gems = Plan.from_dict(json.loads(scheduled(make_plan(GPT, ["blocks_0_mlp_fc", "blocks_1_ln_1", "blocks_1_mlp_fc"],
                                                         schedule="gpipe", microbatches=4, micro_batch_size=1),
                                               "gems-master")))
    assert gems.layout.num_stages == 2 * gems.num_parts == 8
    check_before_launch(gems, RunRequest(Path("plan.json")), gems.layout.world_size)
    for rank in range(gems.layout.world_size):
        check_nvme_dir(gems, None, gems.layout.parts_of_rank(rank))
