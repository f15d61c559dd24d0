"""The pieces of ZeRO across ranks that need no second process: what the plan decides for a
world size and stage, which ranges each home holds, the learned order of gathers, the ranged
checkpoint verification, the DeepSpeed stage, the collectives' prediction and the estimate."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from engine_models import StackLM, make_model, placement_config

import offload
from offload import estimate as est
from offload.api import checkpoint_files as cf
from offload.api.wrap import engine_of, rank_path
from offload.config import ConfigError, load_config
from offload.dist import CollectiveError, LocalComm, comm_for
from offload.homes.params import Lookahead
from offload.plan import GradOwner, GradReduce, ShardSpec, make_plan, split
from offload.plan.traffic import predict_collectives


def _plan(stage, world=2, rank=0, param="cpu", optim="cpu", model=None, **over):
    cfg = placement_config(param, optim, Path("/tmp/unused"), **over)
    cfg["distributed"] = {"stage": stage}
    return make_plan(model or make_model(), load_config(cfg), shard=ShardSpec(rank, world))


# ------------------------------------------------------------------------------ the plan
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [2, 4])
def test_homes_hold_what_the_stage_says(stage, world):
    for rank in range(world):
        plan = _plan(stage, world, rank)
        for unit in plan.units:
            lay = unit.layout
            held = sum(b - a for a, b in plan.home_regions(unit))
            assert held == (lay.total // world if stage == 3 else lay.total)
            assert plan.home_numel(unit) == held
            # the optimizer and the gradients: this rank's share of the trainable prefix only
            lo, hi = lay.local_trainable
            assert [p for p in plan.trainable_pieces(unit)] == split(
                lo, hi, plan.placement.piece_numel
            )
            # packed home: piece after piece, nothing overlapping, every piece inside
            slices = [plan.home_slice(unit, a, b) for a, b in plan.pieces(unit)]
            assert [s.start for s in slices] == [0] + [s.stop for s in slices[:-1]]
            # a piece never straddles two ranks' shares
            shares = [ShardSpec(r, world) for r in range(world)]
            bounds = {
                x
                for s in shares
                for x in (*s.share(0, lay.trainable), *s.share(lay.trainable, lay.total))
            }
            for a, b in plan.pieces(unit):
                assert not any(a < x < b for x in bounds)


def test_piece_j_of_every_share_has_the_same_length():
    """What the stage-1/2 all-gather of an NVMe home relies on (one broadcast per piece)."""
    plan = _plan(2, 4, 0, param="nvme", optim="nvme")
    for unit in plan.units:
        lengths = [
            [
                b - a
                for a, b in split(
                    *ShardSpec(r, 4).share(0, unit.layout.trainable), plan.placement.piece_numel
                )
            ]
            for r in range(4)
        ]
        assert all(x == lengths[0] for x in lengths)


def test_one_rank_plan_is_unchanged_by_the_stage():
    for stage in (1, 2, 3):
        plan = _plan(stage, world=1)
        pl = plan.placement
        assert (pl.grad_reduce, pl.shard_params, pl.world) == (GradReduce.NONE, False, 1)
        assert pl.params_move and pl.grads is GradOwner.AUTOGRAD  # params on the host, fp32
        assert all(
            plan.home_slice(u, a, b) == slice(a, b) for u in plan.units for a, b in plan.pieces(u)
        )


def test_gradient_reduction_and_owner_across_ranks():
    assert _plan(1).placement.grad_reduce is GradReduce.AT_STEP
    assert _plan(2).placement.grad_reduce is GradReduce.PER_UNIT
    assert _plan(3).placement.grad_reduce is GradReduce.PER_UNIT
    # the step in backward updates each unit as its backward ends: reduced then, at any stage
    in_bwd = {
        "device": "nvme",
        "buffer_count": 8,
        "buffer_size": "64KiB",
        "step_in_backward": True,
        "nvme_path": "/tmp/x",
    }
    assert (
        _plan(1, optim="nvme", offload_optimizer=in_bwd).placement.grad_reduce
        is GradReduce.PER_UNIT
    )
    # p.grad holds a rank's own, unreduced gradients: never their owner across ranks
    cfg = load_config(placement_config("none", "cpu", Path("/tmp")))
    one = make_plan(make_model(), cfg, keep_grads=True)
    two = make_plan(make_model(), cfg, keep_grads=True, shard=ShardSpec(0, 2))
    assert one.placement.grads is GradOwner.AUTOGRAD and two.placement.grads is GradOwner.HOST


def test_auto_stage_shards_params_only_when_they_are_offloaded():
    assert _plan("auto", param="none").placement.stage == 2
    assert _plan("auto", param="cpu").placement.stage == 3
    assert _plan("auto", param="nvme", optim="nvme").placement.shard_params
    # params on the device, stage 3: they are gathered and released like offloaded ones
    assert _plan(3, param="none").placement.params_move


def test_auto_buffers_are_sized_for_a_share():
    cfg = placement_config("nvme", "nvme", Path("/tmp/x"))
    for section in ("offload_param", "offload_optimizer"):
        cfg[section]["buffer_size"] = "auto"
    cfg["aio"] = {"block_size": 4096}
    one = make_plan(make_model(), load_config(cfg))
    four = make_plan(make_model(), load_config(cfg), shard=ShardSpec(0, 4))
    big = max(u.layout.total for u in one.units)
    assert one.placement.buffer_sizes["offload_optimizer"] == -(-big * 4 // 4096) * 4096
    assert (
        four.placement.buffer_sizes["offload_optimizer"]
        <= one.placement.buffer_sizes["offload_optimizer"] // 4 + 4096 * 4
    )


# ------------------------------------------------------------------------------ the order of gathers
def test_lookahead_learns_then_replays_the_order():
    la = Lookahead()
    trace = [0, 1, 2, 1, 3, 3, 2, 1]
    assert [la.record(u) for u in trace] == [None] * len(trace)  # learning
    la.end_iteration()
    assert [la.record(u) for u in trace] == [1, 2, 1, 3, 3, 2, 1, None]
    la.end_iteration()
    assert la.record(2) == 1  # out of order: found further on, the prediction follows it
    assert la.record(9) is None  # never seen: no prediction


# ------------------------------------------------------------------------------ one rank
def test_without_a_group_nothing_is_collective(tmp_path):
    assert isinstance(comm_for(None), LocalComm)
    model, opt = offload.wrap(make_model(), placement_config("cpu", "cpu", tmp_path))
    try:
        assert isinstance(engine_of(model).comm, LocalComm)
        assert rank_path("/x", engine_of(model).comm) == "/x"  # one rank: nvme_path as it is
    finally:
        opt.close()


def test_process_group_needs_torch_distributed():
    with pytest.raises(ValueError, match="init_process_group"):
        offload.wrap(
            make_model(), placement_config("cpu", "cpu", Path("/tmp")), process_group=object()
        )


def test_collective_failure_names_the_operation_the_rank_and_the_timeout():
    comm = LocalComm()
    comm.rank, comm.world, comm.timeout = 1, 4, 7.0
    err = comm.failure("all_gather", "blocks.3 params", None)
    assert isinstance(err, CollectiveError)
    assert "all_gather of blocks.3 params on rank 1 of 4 did not complete within 7 s" in str(err)
    err = comm.failure("reduce_scatter", "x", RuntimeError("Connection closed by peer"))
    assert "failed (Connection closed by peer)" in str(err) and "another rank raised" in str(err)


# ------------------------------------------------------------------------------ config
def test_deepspeed_stage_maps_to_distributed_stage(caplog):
    assert load_config({"zero_optimization": {"stage": 2}}).distributed.stage == 2
    with caplog.at_level(logging.INFO, logger="offload.config"):
        cfg = load_config({"zero_optimization": {"stage": 0}})
    assert cfg.distributed.stage == 1 and "runs as distributed.stage 1" in caplog.text
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        load_config({"zero_optimization": {"stage": 4}})
    with pytest.raises(ConfigError, match="distributed.timeout"):
        load_config({"distributed": {"timeout": 0}})


# ------------------------------------------------------------------------------ collectives
def test_predicted_collectives_are_the_textbook_volumes():
    """Stage 1 and 2: 2 Psi per step; stage 3: 3 Psi (each unit once forward, once backward,
    its gradients once), Psi the padded elements of the compute dtype, without accumulation."""
    torch.manual_seed(0)
    for stage, psi_times in ((1, 2), (2, 2), (3, 3)):
        plan = _plan(stage, model=StackLM(n=4), wrap={"module_classes": ["StackBlock"]})
        psi = sum(u.layout.trainable for u in plan.units) * 4
        total = sum(u.layout.total for u in plan.units) * 4
        got = predict_collectives(plan, micro_steps=1)
        assert got["reduce_scatter"] == psi
        if stage < 3:
            assert got["all_gather"] == psi
        else:  # the root stays gathered from its forward to the end of its backward: once
            root = plan.units[0].layout.total * 4
            assert got["all_gather"] == 2 * total - root
        assert sum(got.values()) <= psi_times * total
    assert predict_collectives(_plan(2, world=1)) == {
        "all_gather": 0,
        "reduce_scatter": 0,
        "broadcast": 0,
        "all_reduce": 0,
    }


@pytest.mark.parametrize(
    "dtype, reduce, want, slots",
    [
        ("bf16", "fp32", torch.float32, 1),  # twice as wide: one unit's buffer, not two
        ("bf16", "bf16", torch.bfloat16, 2),
        ("fp16", "auto", torch.float16, 2),
        ("fp32", "fp32", torch.float32, 2),
    ],
)
def test_the_placement_sums_in_the_reduce_dtype_within_the_same_device_bytes(
    dtype, reduce, want, slots
):
    """The flat buffers of the reduction hold two units in the compute dtype's width: two
    slots of a reduce dtype as wide, one of a reduce dtype twice as wide."""
    cfg = placement_config("cpu", "cpu", Path("/tmp/unused"), dtype=dtype)
    cfg["distributed"] = {"stage": 2, "reduce_dtype": reduce}
    plan = make_plan(make_model(), load_config(cfg), shard=ShardSpec(0, 2))
    pl = plan.placement
    assert pl.reduce_dtype == want and pl.reduce_slots == slots
    assert pl.reduce_slots * want.itemsize <= 2 * pl.dtype.itemsize
    # the gradients cross in the reduce dtype, the params in the compute dtype
    psi = sum(u.layout.trainable for u in plan.units)
    got = predict_collectives(plan, micro_steps=1)
    assert got["reduce_scatter"] == psi * want.itemsize
    assert got["all_gather"] == psi * pl.dtype.itemsize


@pytest.mark.parametrize(
    "dtype, value, want",
    [
        ("bf16", None, torch.float32),  # the default: as one rank and stages 2 and 3 add them
        ("bf16", "bf16", torch.bfloat16),
        ("fp16", "auto", torch.float16),
    ],
)
def test_the_placement_adds_stage_1_micro_steps_in_the_grad_accum_dtype(dtype, value, want):
    cfg = placement_config("cpu", "cpu", Path("/tmp/unused"), dtype=dtype)
    cfg["distributed"] = {"stage": 1} | ({} if value is None else {"grad_accum_dtype": value})
    plan = make_plan(make_model(), load_config(cfg), shard=ShardSpec(0, 2))
    assert plan.placement.grad_reduce is GradReduce.AT_STEP
    assert plan.placement.grad_accum_dtype == want


def test_estimate_comm_and_pools_per_rank():
    e = est.estimate(10**9, est.Machine(gpus_per_node=8), unit_params=10**7)
    rows = {(r.stage, r.placement): r for r in e.rows}
    # bf16 params, gradients in the reduce dtype: fp32 by default, bf16 with "auto"
    assert rows[1, "none"].comm_per_rank == rows[2, "nvme"].comm_per_rank == (4 + 2) * 10**9
    assert rows[3, "cpu_optimizer"].comm_per_rank == (4 + 2 * 2) * 10**9
    auto = est.estimate(10**9, est.Machine(gpus_per_node=8), unit_params=10**7, reduce_dtype="auto")
    rows = {(r.stage, r.placement): r for r in auto.rows}
    assert rows[1, "none"].comm_per_rank == 2 * 2 * 10**9
    assert rows[3, "cpu_optimizer"].comm_per_rank == 3 * 2 * 10**9
    with pytest.raises(est.EstimateError, match="--reduce-dtype 'fp16'.*allowed fp32, auto"):
        est.estimate(10**9, est.Machine(), precision="bf16", reduce_dtype="fp16")
    one = est.estimate(10**9, est.Machine(), unit_params=10**7)
    assert all(r.comm_per_rank == 0 for r in one.rows)
    pools8 = {p.section: p.size for p in e.staging}
    assert pools8["offload_optimizer"] == -(-4 * -(-(10**7) // 8) // 4096) * 4096  # one share


# ------------------------------------------------------------------------------ checkpoint blocks
def _write(tmp_path: Path, block: int, monkeypatch) -> Path:
    monkeypatch.setattr(cf, "BLOCK", block)
    data = torch.arange(10_000, dtype=torch.float32)
    with cf.CheckpointWriter(tmp_path, "ckpt-1") as w:
        w.add_file("a.safetensors", [("x", torch.float32, [10_000], lambda: iter([data]))])
        return w.commit({"note": 1})


def _need(lo: int, hi: int):
    def ranges(name, tensors):
        info = tensors["x"]
        return [(info.begin + 4 * lo, info.begin + 4 * hi)]

    return {"a.safetensors": ranges}


def test_a_reader_of_some_ranges_verifies_only_their_blocks(tmp_path, monkeypatch):
    ckpt = _write(tmp_path, 4096, monkeypatch)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["version"] == 3 and meta["files"]["a.safetensors"]["blocks"]["size"] == 4096
    path = ckpt / "a.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 1  # a byte in the last block: element ~9975
    path.write_bytes(bytes(raw))
    with cf.open_checkpoint(ckpt, need=_need(0, 1000)) as c:  # blocks 0 and 1: fine
        assert torch.equal(c.read("a.safetensors", "x", 0, 1000).clone(), torch.arange(1000.0))
    with pytest.raises(cf.CheckpointError, match=r"a.safetensors'.*SHA-256 of bytes \[36864, "):
        cf.open_checkpoint(ckpt, need=_need(9000, 10_000))
    with pytest.raises(cf.CheckpointError, match="a.safetensors'.*its SHA-256 is"):
        cf.open_checkpoint(ckpt)  # a reader of everything verifies the whole file


def test_version_2_checkpoints_without_blocks_are_still_read(tmp_path, monkeypatch):
    ckpt = _write(tmp_path, 4096, monkeypatch)
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["meta_sha256"]
    meta["version"] = 2
    for rec in meta["files"].values():
        del rec["blocks"]
    (ckpt / "meta.json").write_text(json.dumps(cf.seal_meta(meta)))
    with cf.open_checkpoint(ckpt, need=_need(0, 10)) as c:  # whole-file verification
        assert c.read("a.safetensors", "x", 0, 3).tolist() == [0.0, 1.0, 2.0]


def test_malformed_block_records_are_refused(tmp_path, monkeypatch):
    ckpt = _write(tmp_path, 4096, monkeypatch)
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["meta_sha256"]
    meta["files"]["a.safetensors"]["blocks"]["sha256"].pop()
    (ckpt / "meta.json").write_text(json.dumps(cf.seal_meta(meta)))
    with pytest.raises(cf.CheckpointError, match="blocks is malformed"):
        cf.open_checkpoint(ckpt)


def test_one_rank_loads_a_sharded_checkpoint_layout_check(tmp_path):
    """A checkpoint whose units differ from the model's is refused before anything changes,
    whatever world it was saved at (the resharding path checks names, shapes and offsets)."""
    cfg = placement_config("cpu", "cpu", tmp_path)
    model, opt = offload.wrap(make_model(), cfg)
    try:
        ckpt = offload.save_checkpoint(tmp_path / "c", model, opt)
        meta = json.loads((ckpt / "meta.json").read_text())
        del meta["meta_sha256"]
        meta["world"] = 2  # claims 2 ranks: its files do not follow
        (ckpt / "meta.json").write_text(json.dumps(cf.seal_meta(meta)))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(cf.CheckpointError):
            offload.load_checkpoint(tmp_path / "c", model, opt)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
    finally:
        opt.close()


@pytest.mark.slow
def test_one_rank_group_shards_through_its_collectives(tmp_path):
    """``benchmarks/gpu_smoke.py``'s part 3 (a one-rank NCCL group when a GPU is lent) over
    gloo here: stages 1-3 through real collectives of one rank match the fp32 reference."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_smoke

    rows = gpu_smoke.group_parity("cpu", tmp_path)
    assert all(r["ok"] for r in rows), rows
    assert len([r for r in rows if "stage" in r]) == 9 and rows[0]["check"].startswith("host")


_GATHER_ALONE = """
import datetime, os, sys, time
import torch.distributed as dist
from offload.dist import CollectiveError
from offload.dist.comm import TorchComm

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
comm = TorchComm(None, timeout=3.0)
if comm.rank == 0:
    assert comm.all_gather_object({"a": 1}, "a test") == [{"a": 1}, [2, 3]]
    t0 = time.monotonic()
    try:
        comm.all_gather_object("alone", "the checkpoint's name")
    except CollectiveError as exc:
        print(f"{time.monotonic() - t0:.1f} {exc}", flush=True)
        os._exit(0)  # gloo cannot cancel the pending gather: do not wait for it
    os._exit(1)
assert comm.all_gather_object([2, 3]) == [{"a": 1}, [2, 3]]
time.sleep(12)
os._exit(0)
"""


@pytest.mark.heavy  # (11-14 s: it waits out a timeout)
def test_an_object_gather_that_one_rank_never_joins_times_out(tmp_path):
    """Checkpoints and wrap gather small objects; torch's all_gather_object waits with no
    timeout, so a rank that never joined held a save for the group's own 30 minutes. It now
    raises CollectiveError after distributed.timeout, naming what it gathered."""
    from dist_harness import start_ranks, wait_all  # noqa: PLC0415

    (tmp_path / "w.py").write_text(_GATHER_ALONE)
    (rc0, out0, err0), (rc1, _, err1) = wait_all(
        start_ranks([sys.executable, str(tmp_path / "w.py")], 2, tmp_path), 90
    )
    assert rc0 == 0 and rc1 == 0, (err0[-2000:], err1[-2000:])
    took, message = out0.split(" ", 1)
    assert float(took) < 10, out0
    assert "all_gather_object of the checkpoint's name on rank 0 of 2 did not complete" in message


_EXPORT_ALONE = """
import datetime, os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from engine_models import make_model, placement_config
from pathlib import Path
import offload
from offload.dist import CollectiveError

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
cfg = placement_config("cpu", "cpu", Path("."))
cfg["distributed"] = {{"stage": 3, "timeout": 3}}
model, opt = offload.wrap(make_model(), cfg)
if dist.get_rank() == 0:
    t0 = time.monotonic()
    try:
        offload.export(model, "m.safetensors")
    except CollectiveError as exc:
        print(f"{{time.monotonic() - t0:.1f}} {{exc}}", flush=True)
        os._exit(0)
    os._exit(1)
time.sleep(8)  # never joins the export
os._exit(0)
"""


@pytest.mark.heavy  # (11-14 s: it waits out a timeout)
def test_an_export_that_one_rank_never_joins_fails_after_one_timeout(tmp_path):
    """A collective that timed out leaves the group unusable: an export (or save) whose gather
    timed out raised only after its later gathers and the outcome's gather had each waited
    distributed.timeout again (20 s for a timeout of 10); now after the first."""
    from dist_harness import start_ranks, wait_all  # noqa: PLC0415

    (tmp_path / "w.py").write_text(_EXPORT_ALONE.format(tests=str(Path(__file__).parent)))
    (rc0, out0, err0), (rc1, _, err1) = wait_all(
        start_ranks([sys.executable, str(tmp_path / "w.py")], 2, tmp_path), 120
    )
    assert rc0 == 0 and rc1 == 0, (out0, err0[-2000:], err1[-2000:])
    took, message = out0.split(" ", 1)
    assert "did not complete within 3 s" in message, out0
    assert float(took) < 5.5, out0  # one timeout of 3 s, not two or three


# ------------------------------------------------------------------------------ wrap's agreement
class _OtherRank(LocalComm):
    """Rank 0 of two, whose rank 1 wrapped what ``other`` fingerprints."""

    rank, world = 0, 2

    def __init__(self, other):
        super().__init__()
        self.other = other

    def all_gather_object(self, obj, what=""):
        return [obj, self.other]


@pytest.mark.parametrize(
    "change,named",
    [
        (
            lambda cfg, model: cfg["optimizer"].update(lr=2e-3),
            "optimizer.lr is 0.001 on rank 0 and 0.002",
        ),
        (
            lambda cfg, model: cfg.update(gradient_clipping=0.5),
            "gradient_clipping is 1.0 on rank 0 and 0.5",
        ),
        (
            lambda cfg, model: model.blocks[1].requires_grad_(False),
            "unit 'blocks.1' parameter 'blocks.1.norm.weight'.trainable is True on rank 0 and "
            "False",
        ),
        (  # the parameter, not the root's padded sizes (18432 and 12288 elements) it changes
            lambda cfg, model: model.blocks[1].fc1.bias.requires_grad_(False),
            "unit 'blocks.1' parameter 'blocks.1.fc1.bias'.trainable is True",
        ),
        (
            lambda cfg, model: setattr(
                model.head, "weight", torch.nn.Parameter(model.embed.weight.detach().clone())
            ),
            "unit '<root>' parameter 'head.weight' is absent on rank 0 and {'shape': [64, 32]",
        ),
        (
            lambda cfg, model: torch.nn.init.zeros_(model.norm.weight),
            "values",  # the parameter's name follows
        ),
    ],
    ids=["lr", "clipping", "frozen", "frozen-bias", "untied", "values"],
)
def test_ranks_that_wrap_differently_are_told_the_key_and_both_values(change, named):
    """Every rank must wrap the same model, config and values; where they differ, the error names
    the first key that differs and its value on both ranks, not just "a different config". A
    layout that differs is told by its parameter: it was told by the unit's padded sizes first
    ("unit ''.trainable is 18432 on rank 0 and 12288 on rank 1" for a model tied and a bias
    frozen on one of 3 ranks), which name no parameter, and the root as ''."""
    from offload.api.wrap import _check_ranks, _fingerprint  # noqa: PLC0415

    def wrapped(alter):
        torch.manual_seed(0)
        model = make_model()
        cfg = placement_config("cpu", "cpu", Path("/tmp/unused"), gradient_clipping=1.0)
        cfg["optimizer"]["lr"] = 1e-3
        if alter:
            change(cfg, model)
        config = load_config(cfg)
        return model, config, make_plan(model, config, shard=ShardSpec(0, 2))

    model, cfg, plan = wrapped(False)
    other = _fingerprint(*wrapped(True)[:3], None)
    _check_ranks(_OtherRank(_fingerprint(model, cfg, plan, None)), model, cfg, plan, None)
    with pytest.raises(ValueError) as err:
        _check_ranks(_OtherRank(other), model, cfg, plan, None)
    message = str(err.value)
    assert "rank 0 and rank 1" in message and named in message, message
    if "absent" in named:  # told by the parameter on the other rank too (not the offsets after it)
        with pytest.raises(ValueError) as err:
            _check_ranks(_OtherRank(_fingerprint(model, cfg, plan, None)), *wrapped(True), None)
        assert "parameter 'head.weight' is {'shape': [64, 32]" in str(err.value), str(err.value)
    if named == "values":
        assert "norm.weight is" in message, message


def test_ranks_whose_param_groups_differ_are_told_the_group_and_key():
    """``offload.wrap(param_groups=)`` must be the same on every rank (each rank updates its
    share of every group): a group's value, its parameters or their count differing is
    refused at wrap, naming it."""
    from offload.api.param_groups import _listed, check_ranks_agree  # noqa: PLC0415

    model = make_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    defaults = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}

    def fingerprint(given):
        groups = _listed(model, given, trainable, dict(defaults))
        out = []
        check_ranks_agree(_Recorder(out), model, groups)
        return out[0], groups

    two = [{"params": trainable[:4], "lr": 1e-3}, {"params": trainable[4:]}]
    mine, groups = fingerprint(two)
    check_ranks_agree(_OtherRank(mine), model, groups)  # the same: accepted
    for other, named in (
        (
            [{"params": trainable[:4], "lr": 2e-3}, {"params": trainable[4:]}],
            "param_groups[0]['lr'] is 0.001 on rank 0 and 0.002 on rank 1",
        ),
        (
            [{"params": trainable[:5]}, {"params": trainable[5:]}],
            "param_groups[0] holds other parameters",
        ),
        (None, "2 param group(s) on rank 0 and 1 on rank 1"),
    ):
        with pytest.raises(ValueError) as err:
            check_ranks_agree(_OtherRank(fingerprint(other)[0]), model, groups)
        assert "rank 0 and rank 1" in str(err.value) and named in str(err.value), str(err.value)


class _Recorder(LocalComm):
    """Rank 0 of one, keeping what it was asked to gather."""

    def __init__(self, out: list):
        super().__init__()
        self.out = out

    def all_gather_object(self, obj, what=""):
        self.out.append(obj)
        return [obj]


def test_ranks_whose_persistence_threshold_differs_at_stage_3_are_told_it():
    """At stage 3 ``offload_param.persistence_threshold`` decides which units stay gathered,
    so which all-gathers each rank issues: rank 0 at 0 and rank 1 at 100000 passed wrap and
    gloo aborted rank 0 in the first forward ("Received data size doesn't match expected
    size", exit -6). Refused at wrap, naming the key; at stages 1 and 2 (gathers do not depend
    on it) ranks may differ."""
    from offload.api.wrap import _check_ranks, _fingerprint  # noqa: PLC0415

    def wrapped(stage, threshold):
        torch.manual_seed(0)
        model = make_model()
        cfg = placement_config("nvme", "cpu", Path("/tmp/unused"), distributed={"stage": stage})
        cfg["offload_param"]["persistence_threshold"] = threshold
        config = load_config(cfg)
        return model, config, make_plan(model, config, shard=ShardSpec(0, 2))

    for stage in (1, 2):
        model, cfg, plan = wrapped(stage, 0)
        _check_ranks(
            _OtherRank(_fingerprint(*wrapped(stage, 100000)[:3], None)), model, cfg, plan, None
        )
    model, cfg, plan = wrapped(3, 0)
    other = _fingerprint(*wrapped(3, 100000)[:3], None)
    with pytest.raises(ValueError) as err:
        _check_ranks(_OtherRank(other), model, cfg, plan, None)
    message = str(err.value)
    assert "offload_param.persistence_threshold is 0 on rank 0 and 100000 on rank 1" in message, (
        message
    )


# ------------------------------------------------------------------------------ NCCL's device
@pytest.mark.parametrize(
    ("device", "local_rank", "want"),
    [("auto", "1", "cuda:1"), ("cuda", "3", "cuda:3"), ("cuda:2", "0", "cuda:2")],
)
def test_a_nccl_rank_collects_on_its_own_device(monkeypatch, device, local_rank, want):
    """The group's Comm is made before wrap resolves the device, when the current device may
    still be cuda:0 on every rank (torchrun with no set_device of the script's own): wrap
    then makes the rank's device current and the one NCCL's tensors are staged onto. Left at
    cuda:0, each rank's collectives staged onto cuda:0 and NCCL saw every rank on one GPU."""
    from offload.api.wrap import _resolve_cuda  # noqa: PLC0415
    from offload.dist.comm import TorchComm  # noqa: PLC0415

    comm = TorchComm.__new__(TorchComm)  # (no process group: only what _resolve_cuda reads)
    comm.backend, comm.device = "nccl", torch.device("cuda", 0)
    made_current = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    cfg = _resolve_cuda(load_config({"device": device}), comm)
    assert cfg.device == want
    assert comm.device == torch.device(want) and made_current == [torch.device(want)]


class _Rows:
    """A comm of ``len(rows)`` ranks whose check-in returns ``rows`` (the other ranks')."""

    def __init__(self, rank: int, rows) -> None:
        self.rank, self.world, self.rows, self.sent = rank, len(rows), rows, []

    def check_in(self, row, what=""):
        self.sent.append(row.tolist())
        return torch.tensor([v for r in self.rows for v in r], dtype=torch.int64)


def test_the_ranks_check_names_every_rank_s_call_grouped_and_compares_details_apart():
    """``offload.runtime.agree``: equal rows pass; a detail (the backward's order digest)
    that differs is the caller's to report; a call that differs raises on the rank, naming
    the ranks at each call together. Stage 1 compares only whether a rank took a backward."""
    from offload.runtime.agree import Agreement, Call, RankDivergenceError  # noqa: PLC0415

    same = [[2, 0, 4, 1, 1, 7]] * 3
    assert Agreement(_Rows(1, same)).check(Call.BACKWARD, 4, 1, detail=7) is True
    other = [[2, 0, 4, 1, 1, 7], [2, 0, 4, 1, 1, 8], [2, 0, 4, 1, 1, 7]]
    assert Agreement(_Rows(0, other)).check(Call.BACKWARD, 4, 1, detail=7) is False
    split = [[1, 0, 4, 1, 1, 0], [3, 0, 4, 1, 1, 0], [1, 0, 4, 1, 1, 0]]
    agreement = Agreement(_Rows(2, split))
    with pytest.raises(RankDivergenceError) as err:
        agreement.check(Call.FORWARD, 4, 1)
    message = str(err.value)
    assert "(rank 2 of 3)" in message, message
    assert "ranks 0, 2 at a forward of the model (step 5, backwards into it: 1" in message
    assert "rank 1 at the gradient norm (clip_grad_norm_) (step 5" in message
    assert agreement.seq == 1  # (the next check is the second, on every rank alike)
    assert "stage 1 with offload_optimizer.step_in_backward" in message  # (backwards counted)
    with pytest.raises(RankDivergenceError, match="at least one backward per step"):
        Agreement(_Rows(0, split), count_backwards=False).check(Call.FORWARD, 4, 1)
    stage1 = _Rows(0, [[4, 0, 4, 1, 1, 0]] * 2)
    assert Agreement(stage1, count_backwards=False).check(Call.STEP, 4, 3) is True
    assert stage1.sent == [[4, 0, 4, 1, 1, 0]]  # 3 backwards sent as "some"
    assert Agreement(LocalComm()).check(Call.STEP, 0, 0) is True  # one rank: nothing sent
