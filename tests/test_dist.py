"""ZeRO stages 1-3 across ranks: gloo, one process per rank, against one process training on the
concatenated batch.

Every rank trains its slice of the same global batch (``_dist_worker.GLOBAL_BATCH`` rows) with
gradient accumulation 2, clipping and an LR schedule on the model of ``engine_models`` (tied
embeddings, a block called twice, activation checkpointing, a frozen parameter, a huge-and-cheap
block); the reference is plain PyTorch on the whole batch. Starting processes dominates the
cost on two cores, so the ranks run in few groups, each a list of jobs (module fixtures): one
group of 2 ranks, one of 4 (which also runs 2-rank jobs over two process groups of 2), a failure
run and a two-"node" torchrun run. Checkpoints go round 1 -> 2 -> 4 -> 2 and 2 -> 1, 4 -> 1,
each resumed run compared with the uninterrupted reference. The full matrix of stages and
placements at 2 and 4 ranks, torchrun on one node, a hanging rank and ``offload demo --nproc``
are slow-marked.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _dist_worker import GLOBAL_BATCH, STEPS_DATA, slice_of
from children import ROOT, default_sigint
from dist_harness import free_port, result, run_ranks, start_ranks, wait_all
from engine_models import (
    BranchBlock,
    LoraLM,
    RepeatLM,
    SkipLM,
    StackLM,
    batches,
    lm_loss,
    lr_groups,
    make_model,
    placement_config,
    reference_fp32,
    train_wrapped,
)

import offload
from offload.api.wrap import engine_of
from offload.config import load_config
from offload.plan import PAGE_ELEMS, ShardSpec, make_plan
from offload.plan.traffic import predict_collectives

STEPS, ACCUM, CLIP = 10, 2, 1.0
WORKER = Path(__file__).resolve().parent / "_dist_worker.py"


def job(name, param, optim, stage, steps=STEPS, **kw) -> dict:
    return dict(name=name, param=param, optim=optim, stage=stage, steps=steps, **kw)


# fp32 parity: every stage, params and optimizer each on the host and on NVMe at least once
PARITY_2 = [
    job("s1-none-cpu", "none", "cpu", 1),
    job("s1-nvme-nvme", "nvme", "nvme", 1),
    job("s2-cpu-cpu", "cpu", "cpu", 2),
    job("s2-none-nvme", "none", "nvme", 2),
    job("s3-cpu-nvme", "cpu", "nvme", 3),
    job("s3-nvme-cpu", "nvme", "cpu", 3),
    job("s3-none-cpu", "none", "cpu", 3),
]
PARITY_4 = [job("w4-s2-nvme-cpu", "nvme", "cpu", 2), job("w4-s3-cpu-nvme", "cpu", "nvme", 3)]
COLLECTIVES = [job(f"coll-s{s}", "cpu", "cpu", s, steps=3, model="stack") for s in (1, 2, 3)]
# biases and norm weights undecayed: each rank's share cut into runs at their edges
NO_DECAY_OPTIMIZER = {
    "type": "adamw",
    "lr": 1e-2,
    "weight_decay": 0.5,
    "no_decay": ["bias", "norm"],
}
NO_DECAY = [
    job(f"nodecay-s{s}-{p}-{o}", p, o, s, steps=4, config={"optimizer": NO_DECAY_OPTIMIZER})
    for s, p, o in ((2, "nvme", "cpu"), (3, "cpu", "nvme"))
]
# param groups of their own (offload.wrap's param_groups): each rank's share cut into runs too
GROUPS = [
    job(f"groups-s{s}-{p}-{o}", p, o, s, steps=4, groups=True)
    for s, p, o in ((2, "nvme", "cpu"), (3, "cpu", "nvme"))
]
# the step in backward, speculating every step (no clipping, no accumulation)
COLLECTIVES.append(job("coll-s3-sib", "cpu", "nvme", 3, steps=3, model="stack", accum=1, clip=0))


@pytest.fixture(scope="module")
def reference():
    data = batches(STEPS_DATA, batch=GLOBAL_BATCH)
    model, losses = reference_fp32(make_model(), data, STEPS, ACCUM, CLIP)
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def reference_norms():
    """The global gradient norm before clipping at every step of the reference (what the
    ranks' all-reduced norm of the averaged gradients must be)."""
    model = make_model()
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1, foreach=False
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    data, norms = batches(STEPS_DATA, batch=GLOBAL_BATCH), []
    for s in range(STEPS):
        for m in range(ACCUM):
            (lm_loss(model, data[(s * ACCUM + m) % len(data)]) / ACCUM).backward()
        params = [p for p in model.parameters() if p.requires_grad]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        sched.step()
        opt.zero_grad()
    return norms


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


def _one_rank(
    root: Path, name: str, param: str, optim: str, start_from=None, save=None, steps=3, groups=None
):
    """The reference's first ``steps`` steps (or the rest after a load) in this process
    (``groups(model)``: wrap's param groups)."""
    cfg = placement_config(param, optim, root / "w1" / name)
    model = make_model()
    model, opt = offload.wrap(model, cfg, param_groups=None if groups is None else groups(model))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    start = 0
    try:
        if start_from is not None:
            extra = offload.load_checkpoint(start_from, model, opt)
            sched.load_state_dict(extra["scheduler"])
            start = extra["step"]
        data = batches(STEPS_DATA, batch=GLOBAL_BATCH)
        losses, _ = train_wrapped(model, opt, data, steps, ACCUM, CLIP, start=start, sched=sched)
        if save is not None:
            offload.save_checkpoint(save, model, opt, scheduler=sched.state_dict(), step=steps)
        return losses, {k: v.clone() for k, v in model.state_dict().items()}, opt.stats()
    finally:
        opt.close()


@pytest.fixture(scope="module")
def two(root) -> Path:
    """The group of 2 ranks: parity, bitwise resume, 1 -> 2, collectives, the overlap log."""
    _one_rank(root, "ck1", "cpu", "cpu", save=root / "ck1", steps=3)
    jobs = [
        *PARITY_2,
        job("bf16-s3-cpu-cpu", "cpu", "cpu", 3, dtype="bf16"),
        job("whole", "cpu", "nvme", 2, steps=6),
        job("first", "cpu", "nvme", 2, steps=3, save=str(root / "ckA")),
        job("second", "cpu", "nvme", 2, steps=6, load=str(root / "ckA")),
        job("failed-save", "cpu", "cpu", 2, steps=1, save=str(root / "ckF"))
        | {"failed_save": {"dir": str(root / "ckF"), "rank": 1}},
        job("from1", "nvme", "nvme", 3, steps=6, load=str(root / "ck1"), save=str(root / "ck2"))
        | {"block": 4096},  # small checksum blocks: a rank of 4 then needs a few of each file
        job("sd", "cpu", "nvme", 3, steps=3, optimizer_state=True, restore=True)
        | {"export": str(root / "export.safetensors"), "save_pretrained": str(root / "hf")},
        job("sd-load", "nvme", "cpu", 2, steps=6, start=3, load_state=str(root / "sd.pt")),
        *COLLECTIVES,
        job("peek-s3", "cpu", "cpu", 3, steps=3, model="stack", peek=True),
        job("peek-s3-sib", "cpu", "nvme", 3, steps=3, model="stack", accum=1, clip=0)
        | {"peek": "refused"},
        job("eval-s3-sib", "cpu", "nvme", 3, steps=3, model="stack", accum=1, clip=0)
        | {"eval_held": True},
        job("log", "cpu", "cpu", 3, steps=2, model="stack", accum=1, log=True),
        job("lora-s3-cpu-cpu", "cpu", "cpu", 3, steps=4, model="lora"),
        AUTOCAST_TWO,
        job("lora-log-s2", "none", "cpu", 2, steps=2, model="lora", log=True),
        job("branch-s2-cpu-cpu", "cpu", "cpu", 2, steps=4, model="branch"),
        job("branch-s3-nvme-cpu", "nvme", "cpu", 3, steps=4, model="branch"),
        job("branch-s2-cpu-nvme", "cpu", "nvme", 2, steps=4, model="branch", clip=0),
        job("unitskip-s2-cpu-cpu", "cpu", "cpu", 2, steps=3, model="unitskip"),
        job("unitskip-s2-nvme-nvme", "nvme", "nvme", 2, steps=3, model="unitskip"),
        job("probe-s2", "cpu", "cpu", 2, steps=2, model="stack", probe_one_rank=True),
        job("unprobed-s2", "cpu", "cpu", 2, steps=2, model="stack"),
        *NO_DECAY,
        *(dict(j, save=str(root / f"ck-{j['name']}")) for j in GROUPS),
        job("norm-whole", "cpu", "nvme", 3, steps=4, model="norm"),
        job("norm-first", "cpu", "nvme", 3, steps=2, model="norm", save=str(root / "ckN")),
        job("norm-second", "cpu", "nvme", 3, steps=4, model="norm", load=str(root / "ckN")),
    ]
    run_ranks(2, jobs, root)
    return root


@pytest.fixture(scope="module")
def four(two) -> Path:
    """The group of 4 ranks: parity, 2 -> 4 (reading byte ranges), 4 -> 2 over two groups. Its
    tests are heavy (its processes start in ~15 s here): the default suite keeps the group of 2
    (every stage's parity, 1 -> 2 and 2 -> 1, stage 2's shares)."""
    root = two
    jobs = [
        *PARITY_4,
        job("from2", "cpu", "cpu", 2, steps=8, load=str(root / "ck2"), save=str(root / "ck4"))
        | {"block": 4096, "count_reads": True},
        job("pairs-from4", "none", "cpu", 1, load=str(root / "ck4"), pairs=True),
    ]
    run_ranks(4, jobs, root)
    return root


def _close(got: dict, ref: dict, rtol=1e-4, atol=1e-6) -> None:
    assert set(got) == set(ref)
    for name, want in ref.items():
        torch.testing.assert_close(got[name].float(), want.float(), rtol=rtol, atol=atol, msg=name)


def _losses_close(got, want, rtol=1e-5) -> None:
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(want, dtype=torch.float64),
        rtol=rtol,
        atol=0,
    )


def _final(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt")["state"]


# ------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("name", ["branch-s2-cpu-cpu", "branch-s3-nvme-cpu", "branch-s2-cpu-nvme"])
def test_a_parameter_one_rank_leaves_unused_is_averaged_as_zero(two, name):
    """Rank 1 skips the middle block's extra layer from the second step on. That unit
    completed only at the end of rank 1's backward, so its reduce-scatter went out after the
    first block's there and before it on rank 0: the two were summed together (2.7e-2 off, no
    error). The reductions now go out in one order on every rank; the result is data
    parallel's, the unused gradient counting as zero. In the third step no rank uses the
    layer: torch's step leaves it alone (its gradient None), and so does offload's on every
    rank (the ranks' records of who got a gradient reduced once per step; where the update
    runs in the backward, at ``branch-s2-cpu-nvme`` (unclipped: from the second step on),
    each unit's beside its gradients, which the update reads as they land). Until 2026-12-06
    that step moved it as with a zero gradient, and its step count went on."""
    from _dist_worker import skips

    torch.manual_seed(0)
    model = StackLM(n=3, block=BranchBlock)

    def branch(s, m, rank) -> bool:
        model.blocks[1].skip = skips(s, rank)
        return True

    losses = _data_parallel(model, 4, branch, clip=0.0 if name.endswith("nvme") else CLIP)
    if name.endswith("nvme"):  # the update in the backward from the second step on
        stats = result(two, name)["stats"]
        assert [st["collectives"]["all_reduce"]["calls"] for st in stats] == [1, 4, 4, 4]
    _losses_close(result(two, name)["losses"], losses)
    _close(_final(two, name), model.state_dict())


def _data_parallel(model, steps: int, runs, clip: float = CLIP) -> list[float]:
    """Plain torch over both ranks' halves of each micro-batch (data parallel's mean), with the
    workers' AdamW, clipping and schedule; ``runs(step, micro, rank)`` prepares the model for
    that rank's half (a branch) and says whether it runs. The losses per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    data, losses = batches(STEPS_DATA, batch=GLOBAL_BATCH), []
    for s in range(steps):
        total = 0.0
        for m in range(ACCUM):
            for rank in range(2):
                if not runs(s, m, rank):
                    continue
                batch = slice_of(data[(s * ACCUM + m) % len(data)], rank, 2)
                loss = lm_loss(model, batch) / ACCUM / 2
                loss.backward()
                total += float(loss.detach())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize("name", ["unitskip-s2-cpu-cpu", "unitskip-s2-nvme-nvme"])
def test_a_unit_one_rank_skips_is_refused_on_every_rank(two, name):
    """Rank 1 leaves out a whole block in one micro-step (a branch around a unit). It was
    reduced last there: the ranks' reductions paired blocks of the same size without a word,
    and the rest ended in gloo aborting rank 1 (``EnforceNotMet``). Now that backward is
    refused on both ranks, naming the units, before it takes anything; the worker leaves that
    micro-step out and training goes on as data parallel without it."""
    from _dist_worker import skips_unit

    for rank in range(2):
        refused = result(two, name, rank)["refused"]
        assert [r[:2] for r in refused] == [[1, 1]], refused
        message = refused[0][2]
        assert "ranks' forwards ran different units" in message, message
        assert "rank 1 ['blocks.3', 'blocks.1', 'blocks.0', '<root>', 'blocks.2']" in message
        assert "rank 0 ['blocks.3', 'blocks.2', 'blocks.1'" in message
        assert "inside one unit (wrap.module_classes" in message
    torch.manual_seed(0)
    model = SkipLM(n=4)
    losses = _data_parallel(  # (the refused micro-step left out on both ranks)
        model, 3, lambda s, m, rank: all(skips_unit(s, m, r) is None for r in range(2))
    )
    _losses_close(result(two, name)["losses"], losses)
    _close(_final(two, name), model.state_dict())


def _diverge(name, param, stage, rank, what, optim="cpu", **kw) -> dict:
    """A job whose ``rank`` alone does ``what`` differently in step 1 (``_dist_worker``)."""
    at = {"rank": rank, "step": 1, "what": what}
    return job(name, param, optim, stage, steps=3, model="stack", diverge=at, timeout=20, **kw)


DIVERGE = [  # (job, the calls each rank is at when they find out)
    (
        _diverge("div-eval-s3", "cpu", 3, 0, "eval"),
        ("a forward of the model under no_grad", "a forward of the model ("),
    ),
    (
        _diverge("div-eval-s1", "none", 1, 0, "eval"),
        ("a forward of the model under no_grad", "a forward of the model ("),
    ),
    (_diverge("div-micro-s2", "cpu", 2, 1, "micro"), ("a backward", "the gradient norm")),
    (  # stage 1, but the step in backward (the NVMe optimizer's default) reduces in it
        _diverge("div-micro-s1-sib", "none", 1, 1, "micro", optim="nvme"),
        ("a backward", "the gradient norm"),
    ),
    (
        _diverge("div-micro-s3", "nvme", 3, 1, "micro"),
        ("a forward of the model (", "the gradient norm"),
    ),
    (_diverge("div-clip-s2", "none", 2, 1, "clip"), ("the gradient norm", "optimizer.step()")),
    (
        _diverge("div-step-s3", "cpu", 3, 1, "step"),
        ("optimizer.step()", "a forward of the model ("),
    ),
]


@pytest.fixture(scope="module")
def diverged(tmp_path_factory) -> Path:
    """A group of 2 ranks whose calls differ in one step (``DIVERGE``), and stage 1 with one
    micro-step fewer on one rank (which it supports)."""
    root = tmp_path_factory.mktemp("diverged")
    jobs = [j for j, _ in DIVERGE] + [_diverge("micro-s1", "none", 1, 1, "micro")]
    run_ranks(2, jobs, root)
    return root


@pytest.mark.heavy
@pytest.mark.parametrize("case", DIVERGE, ids=[j["name"] for j, _ in DIVERGE])
def test_ranks_at_different_calls_stop_at_once_saying_where_each_is(diverged, case):
    """One rank alone runs an evaluation forward, leaves out a micro-step, or skips
    ``clip_grad_norm_`` or ``step()``. Its next collective met another kind on the other ranks:
    each waited for ``distributed.timeout`` (20 s here, 1800 by default) or gloo aborted one,
    and at stage 3 a rank that skipped ``step()`` trained on with its share one update behind
    (2.4e-2 off after 3 steps, no error). Every rank now stops at its next call, within a
    fraction of a second, naming each rank's call (``offload.runtime.agree``)."""
    spec, (at0, at1) = case
    for rank in range(2):
        diverged_at = result(diverged, spec["name"], rank).get("diverged")
        assert diverged_at is not None, f"rank {rank} trained on"
        step, seconds, message = diverged_at
        assert step in (1, 2) and seconds < 10, diverged_at  # (2: step() left out of 1)
        assert "the ranks reached different calls" in message, message
        assert f"rank 0 at {at0}" in message and f"rank 1 at {at1}" in message, message
        assert "Every rank must run the same forwards" in message, message
        if spec["name"] == "div-micro-s1-sib":  # (it said "at stages 2-3" alone)
            assert "stage 1 with offload_optimizer.step_in_backward" in message, message


@pytest.mark.heavy
def test_stage_1_takes_one_micro_step_fewer_on_one_rank_as_data_parallel(diverged):
    """Stage 1 reduces once per step, so a rank may run fewer micro-steps (its loss still
    divided by the accumulation): the result is data parallel's without that micro-batch."""
    torch.manual_seed(0)
    model = StackLM(n=4)
    losses = _data_parallel(model, 3, lambda s, m, rank: (s, m, rank) != (1, 1, 1))
    assert result(diverged, "micro-s1").get("diverged") is None
    _losses_close(result(diverged, "micro-s1")["losses"], losses)
    _close(_final(diverged, "micro-s1"), model.state_dict())


def test_a_unit_one_rank_calls_under_no_grad_does_not_change_the_reductions(two):
    """Rank 1 calls one block by itself under ``no_grad`` after each backward (a probe, no
    collective at stage 2): it took its place in the order of the next backward's reductions
    there, and that backward was refused as if the ranks had run different units."""
    assert result(two, "probe-s2", 1)["refused"] == []
    assert result(two, "probe-s2")["losses"] == result(two, "unprobed-s2")["losses"]
    _close(_final(two, "probe-s2"), _final(two, "unprobed-s2"), rtol=0, atol=0)


def test_frozen_layers_inside_sharded_units_pass_their_gradient_on(two):
    """LoRA at stage 3: each unit's frozen base layers run their backward after its adapters'
    last gradient; the unit is released only after them (its reduction waits too). Released
    before, the frozen layers read zeros: 1e-3 to 4e-2 off. The tolerance is the rounding of
    the split batch, which Adam magnifies where gradients are near zero (3e-5 at stage 1 with
    the params on the device, where nothing is released)."""
    torch.manual_seed(0)
    data = batches(STEPS_DATA, batch=GLOBAL_BATCH)
    model, losses = reference_fp32(LoraLM(), data, 4, ACCUM, CLIP)
    _losses_close(result(two, "lora-s3-cpu-cpu")["losses"], losses)
    _close(_final(two, "lora-s3-cpu-cpu"), model.state_dict(), atol=2e-4)


@pytest.mark.parametrize("name", [j["name"] for j in NO_DECAY])
def test_undecayed_parameters_on_two_ranks_match_torch_with_two_groups(two, name):
    data = batches(STEPS_DATA, batch=GLOBAL_BATCH)
    model, losses = reference_fp32(
        make_model(), data, 4, ACCUM, CLIP, wd=0.5, undecayed=lambda n: "bias" in n or "norm" in n
    )
    _losses_close(result(two, name)["losses"], losses)
    _close(_final(two, name), model.state_dict())
    decayed = reference_fp32(make_model(), data, 4, ACCUM, CLIP, wd=0.5)[0].state_dict()
    assert not torch.allclose(model.state_dict()["norm.weight"], decayed["norm.weight"], atol=1e-4)


@pytest.mark.parametrize("name", [j["name"] for j in GROUPS])
def test_param_groups_on_two_ranks_match_torch_with_the_same_groups(two, name):
    data = batches(STEPS_DATA, batch=GLOBAL_BATCH)
    model, losses = reference_fp32(make_model(), data, 4, ACCUM, CLIP, groups=lr_groups)
    _losses_close(result(two, name)["losses"], losses)
    _close(_final(two, name), model.state_dict(), atol=1e-5)
    one = reference_fp32(make_model(), data, 4, ACCUM, CLIP)[0].state_dict()
    assert not torch.allclose(model.state_dict()["huge.table"], one["huge.table"], atol=1e-4)


@pytest.mark.parametrize("name", [j["name"] for j in GROUPS])
def test_param_groups_saved_by_two_ranks_resume_in_one_process(root, two, name):
    """Each group's values and members go with a checkpoint of two ranks' shares (stages 2 and
    3) and come back in one process at another placement, which trains on as torch does."""
    data = batches(STEPS_DATA, batch=GLOBAL_BATCH)
    model, losses = reference_fp32(make_model(), data, 6, ACCUM, CLIP, groups=lr_groups)
    got_losses, state, _ = _one_rank(
        root, f"from-{name}", "nvme", "cpu", root / f"ck-{name}", steps=6, groups=lr_groups
    )
    _losses_close(got_losses, losses[4:])
    _close(state, model.state_dict(), atol=1e-5)


@pytest.mark.parametrize("name", [j["name"] for j in PARITY_2])
def test_fp32_two_ranks_match_one_process_on_the_whole_batch(two, reference, reference_norms, name):
    ref_losses, ref_state = reference
    _losses_close(result(two, name)["losses"], ref_losses)
    _close(_final(two, name), ref_state)
    for rank in range(2):  # the mean's norm, the same on every rank (clipping is on every step)
        _losses_close(result(two, name, rank)["norms"], reference_norms)


@pytest.mark.heavy
@pytest.mark.parametrize("name", [j["name"] for j in PARITY_4])
def test_fp32_four_ranks_match_one_process_on_the_whole_batch(
    four, reference, reference_norms, name
):
    ref_losses, ref_state = reference
    _losses_close(result(four, name)["losses"], ref_losses)
    _close(_final(four, name), ref_state)
    for rank in range(4):
        _losses_close(result(four, name, rank)["norms"], reference_norms)


def reference_mixed_ranks(model, world, dtype=torch.bfloat16, at_step=False, lr=1e-2, wd=0.1):
    """Data-parallel mixed precision in plain PyTorch: each rank's slice backpropagated in
    ``dtype``, the ranks' gradients summed in fp32 (``distributed.reduce_dtype``'s default),
    accumulated over micro-steps in fp32 (``at_step``: on each rank first, in fp32 as well
    (``distributed.grad_accum_dtype``'s default), and summed over ranks once per step, as stage
    1 does), averaged, clipped; fp32 AdamW masters."""
    data = batches(STEPS_DATA, batch=GLOBAL_BATCH)
    master, compute = copy.deepcopy(model), copy.deepcopy(model).to(dtype)
    mparams = [p for p in master.parameters() if p.requires_grad]
    cparams = [p for p in compute.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(mparams, lr=lr, weight_decay=wd, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    losses = []
    for s in range(STEPS):
        total, held = 0.0, [[None] * len(cparams) for _ in range(world)]
        for m in range(ACCUM):
            batch = data[(s * ACCUM + m) % len(data)]
            summed = [None] * len(cparams)
            for r in range(world):
                loss = lm_loss(compute, slice_of(batch, r, world)) / ACCUM
                loss.backward()
                total += float(loss.detach()) / world
                for i, cp in enumerate(cparams):
                    g, cp.grad = cp.grad, None
                    if at_step:
                        held[r][i] = g.float() if held[r][i] is None else held[r][i] + g
                    else:
                        summed[i] = g.float() if summed[i] is None else summed[i] + g.float()
            if not at_step:
                for mp, g in zip(mparams, summed):
                    mp.grad = g if mp.grad is None else mp.grad + g
        if at_step:
            for i, mp in enumerate(mparams):
                g = held[0][i]
                for r in range(1, world):
                    g = g + held[r][i]
                mp.grad = g
        for mp in mparams:
            mp.grad /= world
        torch.nn.utils.clip_grad_norm_(mparams, CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        with torch.no_grad():
            for mp, cp in zip(mparams, cparams):
                cp.copy_(mp)
        losses.append(total)
    return master, losses


def _bf16_close(got: dict, ref: dict, lr: float = 1e-2) -> None:
    """bf16 tolerance against plain PyTorch. Any difference of rounding (a kernel's, an order
    of additions) moves a bf16 compute copy of the master by an ulp now and then, and where
    that flips the sign of an Adam update (a gradient near zero), the masters part by up to
    one lr-sized step per step. So: elements within 1e-2 relative or 2e-2 absolute but for at
    most 1 in 1000, none further than ``STEPS`` updates of ``lr``, and the parameters within
    1e-3 on average. (One offload process, whose kernels and order of additions are the ranks',
    is matched tightly: ``test_bf16_ranks_sum_what_one_process_sums``.)"""
    assert set(got) == set(ref)
    diff = torch.cat([(got[k].float() - v.float()).abs().reshape(-1) for k, v in ref.items()])
    size = torch.cat([v.float().abs().reshape(-1) for v in ref.values()])
    assert float((diff > 2e-2 + 1e-2 * size).float().mean()) <= 1e-3
    assert float(diff.max()) <= STEPS * lr
    assert float(diff.mean()) < 1e-3


def test_bf16_two_ranks_match_mixed_precision_on_the_whole_batch(two):
    ref, losses = reference_mixed_ranks(make_model(), 2)
    _losses_close(result(two, "bf16-s3-cpu-cpu")["losses"], losses, rtol=1e-2)
    _bf16_close(_final(two, "bf16-s3-cpu-cpu"), ref.state_dict())


def _one_process_on_the_ranks_slices(root: Path, param: str, optim: str, accum: int, world=2):
    """One offload process in bf16 whose micro-steps are the ranks' slices of each global
    micro-batch (each loss divided by the world as well: the ranks' mean), on one thread as
    every rank runs (a bf16 matmul split over two threads adds in another order). The losses
    per step and the final state."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = placement_config(param, optim, root / "w1-slices" / f"{param}-{optim}", dtype="bf16")
    model, opt = offload.wrap(make_model(), cfg)
    try:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        data, losses = batches(STEPS_DATA, batch=GLOBAL_BATCH), []
        for s in range(STEPS):
            total = 0.0
            for m in range(accum):
                batch = data[(s * accum + m) % len(data)]
                for rank in range(world):
                    loss = lm_loss(model, slice_of(batch, rank, world)) / accum / world
                    loss.backward()
                    total += float(loss.detach())
            opt.clip_grad_norm_(CLIP)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(total)
        return losses, {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        opt.close()
        torch.set_num_threads(threads)


def _reduce_dtype(stage: int, reduce_dtype: str) -> dict:
    return {"distributed": {"stage": stage, "timeout": 60, "reduce_dtype": reduce_dtype}}


BF16_ACCUM = {"distributed": {"stage": 1, "timeout": 60, "grad_accum_dtype": "bf16"}}
BF16_SUMS = [
    job("sum-s2-cpu-cpu", "cpu", "cpu", 2, dtype="bf16"),
    job("sum-s3-nvme-nvme", "nvme", "nvme", 3, dtype="bf16"),
    job("sum-s1-none-cpu", "none", "cpu", 1, dtype="bf16"),
    job("sum-s1-none-cpu-accum1", "none", "cpu", 1, dtype="bf16", accum=1),
    job("sum-s2-cpu-cpu-bf16", "cpu", "cpu", 2, dtype="bf16", config=_reduce_dtype(2, "bf16")),
    job("sum-s1-none-cpu-bf16", "none", "cpu", 1, dtype="bf16", config=BF16_ACCUM),
]


@pytest.mark.heavy
def test_bf16_ranks_sum_what_one_process_sums(tmp_path):
    """bf16 on 2 ranks against one process running the ranks' slices as its micro-steps: the
    same bf16 gradients, which one process adds into its fp32 owner. The ranks summed theirs
    in bf16, one more rounding per unit and micro-step: the weights ended 1.2e-2 apart after
    10 steps (losses 1.2e-2), at every stage and placement. Summed in fp32 (the default
    ``distributed.reduce_dtype``) they match to 1.2e-7 (losses equal), in one device buffer of
    the largest unit where two bf16 ones were. ``"bf16"`` still sums in bf16, with half the
    bytes on the wire.

    Stage 1 adds a step's micro-steps on each rank before its one reduction: autograd added
    them in bf16, in ``p.grad``, and with accumulation 2 the weights ended 1.2e-2 apart
    (losses 6.9e-3). Added in fp32 (the default ``distributed.grad_accum_dtype``) they match
    to 1.2e-7 (losses equal); ``"bf16"`` still adds them in ``p.grad``.

    One process on the whole batch is not a reference this tight: its bf16 backward of 8 rows
    rounds other sums than two backwards of 4 rows (2.7e-2 apart, whatever the ranks sum in)."""
    run_ranks(2, BF16_SUMS, tmp_path)
    refs = {}
    for j in BF16_SUMS:
        key = (j["param"], j["optim"], j.get("accum", ACCUM))
        if key not in refs:
            refs[key] = _one_process_on_the_ranks_slices(tmp_path, *key)
        losses, state = refs[key]
        got = _final(tmp_path, j["name"])
        if j["name"].endswith("-bf16"):  # a bf16 sum: within plain bf16 training's tolerance
            _bf16_close(got, state)
            assert max(float((got[k] - v).abs().max()) for k, v in state.items()) > 1e-4
            continue
        _losses_close(result(tmp_path, j["name"])["losses"], losses, rtol=1e-6)
        _close(got, state, rtol=0, atol=1e-6)
    # the gradients cross in the reduce dtype: fp32 twice the bytes of bf16, as the plan says
    for name, reduce_dtype in (("sum-s2-cpu-cpu", "fp32"), ("sum-s2-cpu-cpu-bf16", "bf16")):
        cfg = placement_config("cpu", "cpu", tmp_path, dtype="bf16") | _reduce_dtype(
            2, reduce_dtype
        )
        plan = make_plan(make_model(), load_config(cfg), shard=ShardSpec(0, 2))
        want = predict_collectives(plan, micro_steps=ACCUM)["reduce_scatter"]
        for st in result(tmp_path, name)["stats"][1:]:
            assert st["collectives"]["reduce_scatter"]["bytes"] == want
        assert (
            want
            == (4 if reduce_dtype == "fp32" else 2)
            * sum(u.layout.trainable for u in plan.units)
            * ACCUM
        )


# ------------------------------------------------------------------------------ autocast
AUTOCAST_STEPS = 4
# every stage at each PARITY_2 placement with accumulation 2, and at one with accumulation 1;
# the update in the backward (no accumulation, no clipping) at stage 3
AUTOCAST = [
    job(f"ac-{j['name']}", j["param"], j["optim"], j["stage"], steps=AUTOCAST_STEPS, autocast=True)
    for j in PARITY_2
] + [
    job(f"ac-s{s}-{p}-{o}-accum1", p, o, s, steps=AUTOCAST_STEPS, accum=1, autocast=True)
    for s, p, o in ((1, "nvme", "nvme"), (2, "none", "nvme"), (3, "nvme", "cpu"))
]
AUTOCAST.append(
    job("ac-s3-cpu-nvme-sib", "cpu", "nvme", 3, steps=AUTOCAST_STEPS, accum=1, clip=0)
    | {"autocast": True}
)
# forwards under autocast that change nothing: an evaluation under the loss, a loss let go
AUTOCAST += [
    job("ac-eval-s3-sib", "cpu", "nvme", 3, steps=AUTOCAST_STEPS, accum=1, clip=0)
    | {"autocast": True, "eval_held": True},
    job("ac-peek-s3-nvme-cpu", "nvme", "cpu", 3, steps=AUTOCAST_STEPS, autocast=True, peek=True),
]
# frozen base layers (casts with no autograd history, matched by value), a frozen unit; and
# reentrant checkpointing inside each block (its recomputation casts in the backward)
AUTOCAST += [
    job(f"ac-{m}-s{s}-{p}-{o}", p, o, s, steps=AUTOCAST_STEPS, model=m, autocast=True)
    for m, s, p, o in (
        ("lora", 2, "none", "cpu"),
        ("lora", 3, "cpu", "cpu"),
        ("lora", 3, "nvme", "nvme"),
        ("lora-reentrant", 3, "cpu", "nvme"),
    )
]
AUTOCAST_MODELS = {  # the workers' models (``_dist_worker._model``), as each is built there
    None: make_model,
    "lora": LoraLM,
    "lora-reentrant": lambda: LoraLM(inner=True),
}
AUTOCAST_3 = [j | {"name": f"w3-{j['name']}"} for j in AUTOCAST if j["stage"] == 3]
# in the group of 2 ranks (the default suite's): stage 3, params and optimizer on NVMe
AUTOCAST_TWO = job("ac-two-s3-nvme-nvme", "nvme", "nvme", 3, steps=AUTOCAST_STEPS, autocast=True)


def _autocast_ranks(model, world: int, accum: int, clip: float) -> tuple[list, list, dict]:
    """Data parallel under ``torch.autocast`` (bf16, ``cache_enabled=False``: what offload's
    forward computes) in plain PyTorch: each rank's slice backpropagated by itself (its loss
    divided by the accumulation only, as a rank's is), the ranks' gradients summed in fp32
    every micro-step, accumulated, divided by the world, clipped; the workers' AdamW and
    schedule, on one thread as every rank runs (a bf16 matmul split over two threads adds in
    another order). The losses per step, the gradient norms before clipping and the final
    state."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        norms = []
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        data, losses = batches(STEPS_DATA, batch=GLOBAL_BATCH), []
        for s in range(AUTOCAST_STEPS):
            total, held = 0.0, [None] * len(params)
            for m in range(accum):
                summed = [None] * len(params)
                for rank in range(world):
                    batch = slice_of(data[(s * accum + m) % len(data)], rank, world)
                    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                        loss = lm_loss(model, batch) / accum
                    loss.backward()
                    total += float(loss.detach()) / world
                    for i, p in enumerate(params):
                        g, p.grad = p.grad, None
                        summed[i] = g if summed[i] is None else summed[i] + g
                held = [g if h is None else h + g for h, g in zip(held, summed, strict=True)]
            for p, g in zip(params, held, strict=True):
                p.grad = g / world
            if clip:
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(total)
        return losses, norms, {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def _autocast_matches(out: Path, jobs: list[dict], world: int) -> None:
    refs = {}
    for j in jobs:
        key = (j.get("model"), j.get("accum", ACCUM), j.get("clip", CLIP))
        if key not in refs:
            torch.manual_seed(0)
            refs[key] = _autocast_ranks(AUTOCAST_MODELS[key[0]](), world, *key[1:])
        losses, norms, state = refs[key]
        _losses_close(result(out, j["name"])["losses"], losses, rtol=1e-6)
        # (accumulation 1 and clipping: see the test's docstring)
        _close(_final(out, j["name"]), state, atol=1e-4 if key[1:] == (1, CLIP) else 1e-6)
        for rank in range(world):
            _losses_close(result(out, j["name"], rank)["norms"], norms)
            casts = result(out, j["name"], rank)["casts"]
            assert len(casts) == AUTOCAST_STEPS * key[1]
            # none after each forward; during it, at most the one a matmul computes with and,
            # for a frozen weight, the one it is matched with
            peak = 1 if key[0] is None else 2
            assert all(n == 0 and most <= peak for n, most in casts), (j["name"], rank, casts)


def test_training_under_autocast_at_stage_3_is_data_parallel_without_weight_copies(two):
    """One case of the next test, in the default suite."""
    _autocast_matches(two, [AUTOCAST_TWO], 2)


@pytest.mark.heavy
def test_training_under_autocast_on_two_ranks_is_data_parallel_without_weight_copies(tmp_path):
    """fp32 compute under ``torch.autocast`` (bf16) at every stage, the params and the
    optimizer on the device, the host and NVMe, accumulation 1 and 2, clipping, the update in
    the backward, an evaluation under a loss, a loss let go, LoRA's frozen layers, reentrant
    checkpointing: each rank's forward saves references to its weights, not bf16 copies
    (``offload/runtime/autocast.py``), and the backward casts them again from the params it
    holds then (at stage 3 the unit gathered again by all-gather for its backward). The
    training is data parallel's under autocast with its cache off: the losses equal, the
    weights within 1.2e-7 after 4 steps, but with accumulation 1 and clipping, 1.6e-5 (at
    every stage alike: the fourth step's gradient norm is 8.0466957 on the ranks, 8.0466976 in
    ``clip_grad_norm_``, fp64 8.0466971, the first three equal; Adam magnifies that ulp of the
    clipping coefficient where a gradient nearly cancels its moment, as in
    ``test_autocast.ATOL``). No rank holds a bf16 copy of a weight after a forward, and at
    most one during it (two with LoRA's frozen layers); with autocast's copies saved (the
    pack hook leaving them), each rank held 7 after every forward."""
    run_ranks(2, AUTOCAST, tmp_path)
    _autocast_matches(tmp_path, AUTOCAST, 2)


@pytest.mark.heavy
def test_training_under_autocast_on_three_ranks_at_stage_3(tmp_path):
    """Stage 3 over 3 ranks (shares of odd sizes, padding): as over 2, the weights within
    2.6e-7 (1.0e-6 with accumulation 1 and clipping). A reference that divides each rank's
    loss by the world before its bf16 backward rounds other values than the ranks, which
    divide the fp32 sum (2.3e-2 off in the weights after 4 steps; by 2 the division is
    exact)."""
    run_ranks(3, AUTOCAST_3, tmp_path)
    _autocast_matches(tmp_path, AUTOCAST_3, 3)


# four ranks under autocast: a stage each, and a resume under another stage and placement
AUTOCAST_4 = [
    job("w4-ac-s1-nvme-nvme", "nvme", "nvme", 1, steps=AUTOCAST_STEPS, autocast=True),
    job("w4-ac-s2-cpu-cpu", "cpu", "cpu", 2, steps=AUTOCAST_STEPS, autocast=True),
    job("w4-ac-s3-none-nvme", "none", "nvme", 3, steps=AUTOCAST_STEPS, autocast=True),
]


@pytest.mark.heavy
def test_training_under_autocast_on_four_ranks_and_resumed_under_another_placement(tmp_path):
    """As over 2 and 3 ranks, over 4 (quarters of the batch); and a run under autocast saved
    after 2 steps at stage 3 (params on the host, optimizer on NVMe) and resumed at stage 2
    (params on NVMe, optimizer on the host): the four steps of the uninterrupted reference."""
    half, ck = AUTOCAST_STEPS // 2, str(tmp_path / "ck")
    resume = [
        job("w4-ac-first", "cpu", "nvme", 3, steps=half, autocast=True, save=ck),
        job("w4-ac-second", "nvme", "cpu", 2, steps=AUTOCAST_STEPS, autocast=True, load=ck),
    ]
    run_ranks(4, AUTOCAST_4 + resume, tmp_path)
    _autocast_matches(tmp_path, AUTOCAST_4, 4)
    torch.manual_seed(0)
    losses, _, state = _autocast_ranks(make_model(), 4, ACCUM, CLIP)
    got = result(tmp_path, "w4-ac-first")["losses"] + result(tmp_path, "w4-ac-second")["losses"]
    _losses_close(got, losses, rtol=1e-6)
    _close(_final(tmp_path, "w4-ac-second"), state, atol=1e-6)


@pytest.mark.heavy
def test_fp16_gradients_finite_on_every_rank_do_not_overflow_in_their_sum(tmp_path):
    """Each rank's fp16 gradient is 40000 (finite: fp16's largest is 65504), as is one
    process's on the whole batch, which steps. The ranks summed theirs before dividing by
    the world: 80000 overflowed, and every rank skipped a step one process takes (norm inf,
    at every stage; the loss scale would back off to half). Now they match one process,
    summed in fp16 (divided by the world first) or in fp32 (``distributed.reduce_dtype``)."""
    from _fp16_sum_worker import train_one_step  # noqa: PLC0415

    one = train_one_step(2, world=1)
    assert one["skipped"] == 0 and one["norm"] == pytest.approx(8 * 40000.0)
    worker = Path(__file__).resolve().parent / "_fp16_sum_worker.py"
    runs = [f"{stage}:{red}" for red in ("fp16", "fp32") for stage in (1, 2, 3)]
    procs = start_ranks([sys.executable, str(worker), *runs], 2, tmp_path)
    for rc, out, err in wait_all(procs, 120):
        assert rc == 0, err[-3000:]
        assert len(out.splitlines()) == len(runs), out
        for line in out.splitlines():
            got = json.loads(line)
            where = f"stage {got['stage']} in {got['reduce_dtype']}, rank {got['rank']}"
            assert got["skipped"] == 0, f"{where}: skipped a step one process takes ({got})"
            assert got["norm"] == pytest.approx(one["norm"]), where
            assert got["weight"] == pytest.approx(one["weight"], abs=1e-5), where


# ------------------------------------------------------------------------------ checkpoints
def test_same_world_resume_is_bitwise(two):
    whole, second = result(two, "whole"), result(two, "second")
    assert second["losses"] == whole["losses"][3:]
    a, b = _final(two, "whole"), _final(two, "second")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_same_world_resume_is_bitwise_with_each_rank_s_buffers(two):
    """BatchNorm's running statistics, which differ between ranks, were not in checkpoints:
    a resume at the same world size differed in them (and in everything they fed); each rank's
    own are saved and read back now."""
    for rank in range(2):
        whole, second = result(two, "norm-whole", rank), result(two, "norm-second", rank)
        assert second["losses"] == whole["losses"][2:]
        assert second["buffers"] == whole["buffers"], rank
    assert result(two, "norm-whole", 0)["buffers"] != result(two, "norm-whole", 1)["buffers"]
    a, b = _final(two, "norm-whole"), _final(two, "norm-second")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_no_rank_commits_until_every_rank_s_files_are_written(two):
    """Rank 1 fails half way through a save: every rank raises, ``latest`` still names the
    previous checkpoint, and no partial directory is left."""
    errors = [result(two, "failed-save", r)["save_error"] for r in range(2)]
    assert "No space left on device (injected)" in errors[1]
    assert "save_checkpoint: rank 1 failed" in errors[0] and "nothing was changed" in errors[0]
    root = two / "ckF"
    good = (root / "latest").read_text().strip()
    assert sorted(p.name for p in root.iterdir()) == sorted(["latest", good])
    offload_meta = json.loads((root / good / "meta.json").read_text())
    assert offload_meta["world"] == 2 and len(offload_meta["files"]) == 2 * (5 + 1)  # + buffers


@pytest.mark.heavy
def test_checkpoint_layout_records_the_world_and_every_rank_file(four):
    ckpt = four / "ck4" / (four / "ck4" / "latest").read_text().strip()
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["world"] == 4 and meta["version"] == 3
    units = len(meta["units"])
    assert sorted(meta["files"]) == sorted(
        [f"unit_{u:05d}.rank_{r:05d}.safetensors" for u in range(units) for r in range(4)]
        + [f"buffers.rank_{r:05d}.safetensors" for r in range(4)]
    )


def test_resharded_resumes_match_uninterrupted_training(root, two, reference):
    """1 -> 2 and 2 -> 1 (the group of 4 ranks: the next test)."""
    ref_losses, ref_state = reference
    _losses_close(result(two, "from1")["losses"], ref_losses[3:6])
    losses, state, _ = _one_rank(root, "from-ck2", "nvme", "cpu", root / "ck2", steps=STEPS)
    _losses_close(losses, ref_losses[6:])
    _close(state, ref_state)


@pytest.mark.heavy
def test_resharded_resumes_through_four_ranks_match_uninterrupted_training(root, four, reference):
    """2 -> 4, 4 -> 2 (two process groups of 2 in the 4-rank run), 4 -> 1."""
    ref_losses, ref_state = reference
    _losses_close(result(four, "from2")["losses"], ref_losses[6:8])
    _losses_close(result(four, "pairs-from4")["losses"], ref_losses[8:10])
    _close(_final(four, "pairs-from4"), ref_state)
    losses, state, _ = _one_rank(root, "from-ck4", "nvme", "cpu", root / "ck4", steps=STEPS)
    _losses_close(losses, ref_losses[8:])
    _close(state, ref_state)


@pytest.mark.heavy
def test_each_rank_reads_only_its_byte_ranges(four):
    """Loading a 2-rank checkpoint at 4 ranks: a rank reads its quarter of the data and
    verifies the blocks that hold it (and the headers), not the whole files it touches (half
    the checkpoint)."""
    ckpt = four / "ck2" / (four / "ck2" / "latest").read_text().strip()
    files = list(ckpt.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in files)
    cfg = placement_config("cpu", "cpu", Path("/tmp")) | {"distributed": {"stage": 2}}
    for rank in range(4):
        plan = make_plan(make_model(), load_config(cfg), shard=ShardSpec(rank, 4))
        share = sum(  # this rank's master and moments, and the frozen params its home holds
            12 * (u.layout.local_trainable[1] - u.layout.local_trainable[0])
            + 4 * sum(b - a for a, b in plan.pieces(u) if a >= u.layout.trainable)
            for u in plan.units
        )
        read = result(four, "from2", rank)["read_bytes"]
        assert 0 < read["data"] <= share, (read, share, total)
        touched = len(files) // 2  # each unit's file of one saved rank
        slack = touched * (1 + 2 * 4) * 4096  # its header block, two partial blocks per tensor
        assert read["verified"] <= read["data"] + slack, (read, total)
        assert read["verified"] < total / 2, (read, total)


def test_state_dicts_and_export_are_gathered_on_every_rank(two, root):
    """Stage 3 over 2 ranks, after 3 steps: the optimizer's state_dict holds every parameter's
    whole state (as one rank's does), export and save_pretrained write the whole model from
    rank 0, and close with restore gives every rank the whole values back."""
    from safetensors.torch import load_file

    cfg = placement_config("cpu", "nvme", root / "w1-sd")
    model, opt = offload.wrap(make_model(), cfg)
    try:
        data = batches(STEPS_DATA, batch=GLOBAL_BATCH)
        train_wrapped(model, opt, data, 3, ACCUM, CLIP)
        want = opt.state_dict()
    finally:
        opt.close()
    got = torch.load(two / "sd.pt")["optimizer"]
    assert got["param_groups"] == want["param_groups"] and got["offload"] == want["offload"]
    assert set(got["state"]) == set(want["state"])
    for i, entry in want["state"].items():  # fp32 sums in another order: close, not equal
        for kind, atol in (("master", 1e-6), ("exp_avg", 1e-6), ("exp_avg_sq", 1e-9)):
            torch.testing.assert_close(got["state"][i][kind], entry[kind], rtol=1e-3, atol=atol)
    exported = load_file(str(root / "export.safetensors"))
    state = _final(two, "sd")
    assert set(exported) == set(state)
    assert all(torch.equal(exported[k], state[k].float()) for k in state)
    shards = sorted((root / "hf").glob("model-*.safetensors"))  # save_pretrained: rank 0 writes
    assert len(shards) > 1 and (root / "hf" / "model.safetensors.index.json").is_file()
    saved = {k: v for f in shards for k, v in load_file(str(f)).items()}
    assert saved and set(saved) <= set(state)
    assert all(torch.equal(saved[k], state[k].float()) for k in saved)
    assert all(result(two, "sd", r)["restored_equal"] for r in range(2))


def test_optimizer_state_dict_loads_at_another_stage_and_placement(two, reference):
    """A state_dict gathered at stage 3 and loaded at stage 2 (each rank takes its share)
    continues the same training."""
    _losses_close(result(two, "sd-load")["losses"], reference[0][3:6])
    _close(_final(two, "sd-load"), _final(two, "whole"))


# ------------------------------------------------------------------------------ bytes per rank
def _single_rank_state(root: Path, param: str, optim: str) -> dict:
    cfg = placement_config(param, optim, root / "w1-state" / f"{param}-{optim}")
    model, opt = offload.wrap(make_model(), cfg)
    try:
        return engine_of(model).state_bytes()
    finally:
        opt.close()


PLACE = {"none": "device", "cpu": "host", "nvme": "nvme"}


def _allowance(param: str, optim: str, where: str) -> int:
    """What one rank may hold at ``where`` beyond 1/N of one rank's state: less than one
    padding block (``PAGE_ELEMS``) per region (trainable, frozen) and unit of each kind of
    state kept there (fp32 params; master, moments and gradients, 16 bytes, where the
    optimizer lives)."""
    trainable = (4 if PLACE[param] == where else 0) + (16 if PLACE[optim] == where else 0)
    frozen = 4 if PLACE[param] == where else 0
    cfg = load_config(placement_config("cpu", "cpu", Path("/tmp")))
    return len(make_plan(make_model(), cfg).units) * PAGE_ELEMS * (trainable + frozen)


@pytest.mark.parametrize(
    "group, name, world",
    [
        ("two", "s3-cpu-nvme", 2),
        ("two", "s3-nvme-cpu", 2),
        pytest.param("four", "w4-s3-cpu-nvme", 4, marks=pytest.mark.heavy),
    ],
)
def test_stage3_state_per_rank_is_one_nth(request, root, group, name, world):
    out = request.getfixturevalue(group)
    param, optim = name.split("-")[-2:]
    single = _single_rank_state(root, param, optim)
    for rank in range(world):
        mine = result(out, name, rank)["stats"][-1]["state_bytes"]
        for where in ("device", "host", "nvme"):
            extra = world * mine[where] - single[where]  # padded to N x 2048: never less
            assert 0 <= extra <= world * _allowance(param, optim, where), (where, mine, single)


@pytest.mark.parametrize(
    "group, name, world",
    [
        ("two", "nodecay-s2-nvme-cpu", 2),  # (its decay settings change no byte held)
        pytest.param("four", "w4-s2-nvme-cpu", 4, marks=pytest.mark.heavy),
    ],
)
def test_stage2_shards_optimizer_and_gradients_not_params(request, root, group, name, world):
    out = request.getfixturevalue(group)
    single = _single_rank_state(root, "nvme", "cpu")  # params on NVMe, the rest on the host
    for rank in range(world):
        mine = result(out, name, rank)["stats"][-1]["state_bytes"]
        host, nvme = (_allowance("nvme", "cpu", where) for where in ("host", "nvme"))
        assert 0 <= world * mine["host"] - single["host"] <= world * host
        # the params: the whole unit on every rank (padded to N x 2048 elements, not 2048)
        assert 0 <= mine["nvme"] - single["nvme"] <= world * nvme


@pytest.mark.parametrize(
    "group,world", [("two", 2), pytest.param("four", 4, marks=pytest.mark.heavy)]
)
def test_destroy_process_group_ends_the_group(request, group, world):
    """After every job (engines closed, a subgroup per pair of ranks in ``four``),
    ``destroy_process_group`` leaves no gloo thread: nothing of offload's nor of torch's holds a
    group, so none is destroyed while the interpreter finalizes (``offload.dist.comm``'s Note
    on the end of a process: there, a gloo thread freeing a collective's tensors aborted the
    process, exit status 134)."""
    out = request.getfixturevalue(group)
    for rank in range(world):
        threads = json.loads((out / f"threads.w{world}.{rank}.json").read_text())
        assert "pt_gloo_runloop" in threads["before"], threads  # what this test looks for exists
        assert not [t for t in threads["after"] if "gloo" in t], threads


def test_each_rank_has_its_own_nvme_directory(two, root):
    """... which ``close()`` removes with the files in it (every close across ranks left the
    ``rank-NNNNN`` directories, empty, in each ``nvme_path``)."""
    for name in ("s1-nvme-nvme", "s2-none-nvme"):
        dirs = [result(two, name, r)["nvme_dirs"] for r in range(2)]
        for rank, mine in enumerate(dirs):
            assert mine and all(f"/rank-{rank:05d}/" in d for d in mine), mine
        assert not set(dirs[0]) & set(dirs[1])
        left = [p for d in dirs for p in map(Path, d) if p.parent.exists()]
        assert not left, left


# ------------------------------------------------------------------------------ collectives
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_collective_bytes_match_the_plan(two, stage):
    """Per rank and step (after the first, whose params all-gather of stages 1-2 comes with
    the next forward): exactly the bytes ``predict_collectives`` says, the norm's all-reduce
    (two float64, counted twice) beside them."""
    cfg = placement_config("cpu", "cpu", Path("/tmp"))
    cfg |= {"distributed": {"stage": stage}, "wrap": {"module_classes": ["StackBlock"]}}
    torch.manual_seed(0)
    plan = make_plan(StackLM(n=4), load_config(cfg), shard=ShardSpec(0, 2))
    want = predict_collectives(plan, micro_steps=ACCUM)
    for rank in range(2):
        for st in result(two, f"coll-s{stage}", rank)["stats"][1:]:
            got = {op: st["collectives"][op]["bytes"] for op in want}
            assert got == want | {"all_reduce": want["all_reduce"] + 2 * 16}
            # the norm and the flag; the ranks' records of who got a gradient
            assert st["collectives"]["all_reduce"]["calls"] == 2
            assert st["collective_bytes"] == sum(want.values()) + 2 * 16


def test_an_evaluation_between_forward_and_backward_on_every_rank_changes_nothing(two):
    """Each rank evaluated a batch under ``torch.no_grad()`` (stage 3: its forward gathers
    across ranks) between every forward and its backward, the update speculative in that
    backward: bitwise the same job without the evaluations. (It passed before the engine kept
    such a forward's micro-step too: a guard of the new path across ranks.)"""
    assert result(two, "eval-s3-sib")["losses"] == result(two, "coll-s3-sib")["losses"]
    got, want = _final(two, "eval-s3-sib"), _final(two, "coll-s3-sib")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("peek, plain", [("peek-s3", "coll-s3"), ("peek-s3-sib", "coll-s3-sib")])
def test_a_loss_let_go_on_every_rank_changes_nothing(two, peek, plain):
    """After each step's backwards every rank computed a loss with gradients on (stage 3: its
    forward gathers across ranks) and let it go. The step after it was refused (the engine
    stayed in the forward); now the forward is dropped and the training is bitwise that of
    the same job without it. Where the update ran in the backward, that forward is refused
    (it would compute with the updated weights), and training goes on the same."""
    assert result(two, peek)["losses"] == result(two, plain)["losses"]
    got, want = _final(two, peek), _final(two, plain)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_step_in_backward_gathers_each_unit_once_per_use(two):
    """Stage 3 with the optimizer on NVMe, the update running in the backward: feeding a unit
    to the update leaves the next unit's gather in flight, so the bytes are the plan's (when
    each update dropped it, the next unit was gathered twice: 15% more, bench_dist.py)."""
    cfg = placement_config("cpu", "nvme", Path("/tmp"))
    cfg |= {"distributed": {"stage": 3}, "wrap": {"module_classes": ["StackBlock"]}}
    plan = make_plan(StackLM(n=4), load_config(cfg), shard=ShardSpec(0, 2))
    want = predict_collectives(plan, micro_steps=1)
    for rank in range(2):
        for st in result(two, "coll-s3-sib", rank)["stats"][1:]:
            assert {op: st["collectives"][op]["bytes"] for op in want} == want


def test_next_gather_and_previous_reduction_overlap_compute(two):
    """Stage 3: unit i+1's all-gather is issued before unit i computes and waited after; unit
    i's reduce-scatter is in flight while unit i-1's backward runs."""
    events = [tuple(e) for e in result(two, "log")["log"]]
    root = max(i for i, e in enumerate(events) if e == ("issue", "all_gather", "<root> params"))
    step2 = events[root:]  # the second step replays the order learned in the first
    turn = step2.index(("backward", "blocks.3"))
    forward, backward = step2[:turn], step2[turn:]

    def first(part, event):
        return part.index(event)

    blocks = [f"blocks.{i}" for i in range(4)]
    for a, b in zip(blocks, blocks[1:]):
        issued = first(forward, ("issue", "all_gather", f"{b} params"))
        waited = first(forward, ("wait", "all_gather", f"{b} params"))
        assert issued < first(forward, ("forward", a)) < waited
    for a, b in zip(blocks, blocks[1:]):  # backward runs b, then a
        issued = first(backward, ("issue", "reduce_scatter", f"{b} gradients"))
        waited = first(backward, ("wait", "reduce_scatter", f"{b} gradients"))
        assert issued < first(backward, ("backward", a)) < waited
    for a in blocks[:-1]:  # issued as the unit after it is gathered, in flight while it runs
        issued = first(backward, ("issue", "all_gather", f"{a} params"))
        waited = first(backward, ("wait", "all_gather", f"{a} params"))
        assert issued < first(backward, ("backward", a)) < waited


def test_a_frozen_unit_does_not_hold_back_the_reductions(two):
    """The reductions go out in one order on every rank (a unit that completes early waits
    for its turn). A unit with nothing to reduce (all frozen, ``FrozenBlock``, here completing
    only at the backward's end: params on the device) takes no turn: the first block's
    gradients are reduced while the backward runs, not after it."""
    events = [tuple(e) for e in result(two, "lora-log-s2")["log"]]
    last = len(events) - 1 - events[::-1].index(("backward", "blocks.3"))  # the last backward
    backward = events[last:]
    issued = backward.index(("issue", "reduce_scatter", "blocks.0 gradients"))
    assert issued < backward.index(("embed-grad",)), backward


@pytest.mark.heavy
def test_a_model_load_refreshes_the_same_units_on_every_rank(tmp_path):
    """``model.load_state_dict`` at stages 1 and 2 (the params whole on every rank, each rank
    writing its share): a rank marked a unit for the next forward's all-gather only where its
    own share held a loaded value, so the ranks gathered different units (here
    ``blocks.1.norm.weight`` lies in rank 0's share, ``norm.weight`` in rank 1's) and gloo
    aborted a rank ("Received data size doesn't match expected size"; a full load did so at 3
    or 4 ranks, where a unit smaller than the world's pages leaves some ranks only padding).
    Every rank now marks each unit a value was given for; the training is the plain
    model's from the loaded values."""
    values = {"blocks.1.norm.weight": torch.full((32,), 1.5), "norm.weight": torch.full((32,), 0.5)}
    torch.save({"state": values}, tmp_path / "part.pt")
    placements = ((1, "none"), (2, "cpu"), (2, "nvme"))
    jobs = [
        job(f"part-s{s}-{p}", p, "cpu", s, steps=3, load_model=str(tmp_path / "part.pt"))
        for s, p in placements
    ]
    run_ranks(2, jobs, tmp_path)
    model = make_model()
    model.load_state_dict(values, strict=False)
    data = batches(STEPS_DATA, batch=GLOBAL_BATCH)
    model, losses = reference_fp32(model, data, 3, ACCUM, CLIP)
    for s, p in placements:
        _losses_close(result(tmp_path, f"part-s{s}-{p}")["losses"], losses)
        _close(_final(tmp_path, f"part-s{s}-{p}"), model.state_dict())


@pytest.mark.heavy
def test_units_used_in_another_order_after_a_step_are_gathered_alike_on_every_rank(tmp_path):
    """Stage 2 with the optimizer on NVMe: each unit's update runs in the background after
    ``step()``, and the next forward all-gathers the ranks' updated shares, one unit ahead in
    the order the first step used. Whether that unit was to be gathered was asked before
    waiting for its update, so it depended on whether the update had run yet on that rank;
    where the unit did not come next after all (a block run twice in even steps only), one
    rank gathered it there and another only at its use: gloo aborted a rank on their sizes
    (at 2, 3 and 4 ranks), or, the units of one size, each rank's share went into the other
    unit, silently (losses 2e-3 off; here rank 1's update of that unit is made late). The
    training is data parallel's."""
    from _dist_worker import repeats

    # the race made certain: rank 0's updates are done before its next forward, rank 1's of
    # blocks.1 not yet (clipping every step: the update speculated in the backward is redone
    # after step(), in the background)
    jobs = [job("repeat-s2", "none", "nvme", 2, steps=4, model="repeat", clip=0.05)]
    jobs[0] |= {
        "pause": {"rank": 0, "seconds": 1.0},
        "slow_update": {"rank": 1, "unit": "blocks.1", "seconds": 1.0},
    }
    run_ranks(2, jobs, tmp_path)
    torch.manual_seed(0)
    model = RepeatLM(n=4)

    def repeat(s, m, rank) -> bool:
        model.repeat = repeats(s)
        return True

    losses = _data_parallel(model, 4, repeat, clip=0.05)
    assert min(result(tmp_path, "repeat-s2")["norms"]) > 0.05  # (it clipped every step)
    _losses_close(result(tmp_path, "repeat-s2")["losses"], losses)
    _close(_final(tmp_path, "repeat-s2"), model.state_dict())


# ------------------------------------------------------------------------------ failures
def test_a_rank_that_raises_does_not_hang_the_others(tmp_path):
    """Rank 1 raises in its second step; rank 0, waiting in a collective, fails at once with
    an error that says what it was waiting for and why, naming the rank that raised and its
    exception (it named only itself: "on rank 0 of 2 failed (... Connection closed by peer
    [127.0.0.1]:37776 ...)", so with more ranks which one failed, and why, was in another
    process's log; the rank that raises says so through the group's store as it exits)."""
    spec = tmp_path / "spec.json"
    bad = job("fail", "cpu", "cpu", 3, steps=3, fail_at={"rank": 1, "step": 1})
    spec.write_text(json.dumps({"out": str(tmp_path), "jobs": [bad], "timeout": 120}))
    t0 = time.monotonic()
    results = wait_all(start_ranks([sys.executable, str(WORKER), str(spec)], 2, tmp_path), 120)
    took = time.monotonic() - t0
    (rc0, _, err0), (rc1, _, err1) = results
    assert rc1 == 1 and "injected failure on rank 1 at step 1" in err1
    assert rc0 == 1 and "CollectiveError: offload:" in err0 and "rank 0 of 2" in err0, err0[-2000:]
    assert "another rank raised, stopped or is stuck" in err0
    error = next(line for line in err0.splitlines() if "CollectiveError: offload:" in line)
    assert "rank 1 raised RuntimeError: injected failure on rank 1 at step 1" in error, error
    assert took < 100  # far below the 120 s timeouts: the closed connection ends it


# (where the update runs, how long the reads fail, the stage, what rank 1's error says)
MIX, UNDONE = "mixes updated and old units", "the update was undone: the state is that of before"
FAILED_UPDATES = [
    pytest.param("after", "for good", 2, MIX, id="after-stage2", marks=pytest.mark.heavy),
    pytest.param("after", "for good", 3, MIX, id="after-stage3"),
    pytest.param("in", "once", 3, UNDONE, id="in-once-stage3"),
    pytest.param("in", "for good", 2, MIX, id="in-stage2", marks=pytest.mark.heavy),
    pytest.param("in", "once, slow", 3, UNDONE, id="in-once-slow-stage3"),
]


@pytest.mark.parametrize("where,reads,stage,said", FAILED_UPDATES)
def test_a_rank_whose_update_fails_does_not_hang_the_others(tmp_path, where, reads, stage, said):
    """Rank 1's update fails part way, its NVMe reads failing (once, or from then on): the
    update after the backward (from its second step's ``step()`` on; its next call, the next
    step's forward waiting for that update, raises the update's error naming the mix, before
    any collective), or the step in backward's (from its second step's last backward on; that
    backward raises it between its units' reductions, or ``step()`` where the update had not
    read yet; the update undone where the reads come back, else the undo failing too). Rank 0,
    in its next collective, fails at once naming rank 1 and that error; no rank waits for the
    timeout. (The refusals after a failed update were tested in one process only until
    2026-12-07, and the step in backward's across ranks until that day's next pass.)"""
    spec = tmp_path / "spec.json"
    fail = {"rank": 1, "step": 1, "io": True if where == "after" else "backward"}
    if reads.startswith("once"):
        fail["count"] = 1
    if reads.endswith("slow"):  # its backward goes on after its update failed, unit by unit
        fail["slow"] = 0.3
    # (no clipping in the step in backward's: a loop that clips updates after its backward)
    bad = job(f"io{where}-s{stage}", "cpu", "nvme", stage, steps=3, fail_at=fail,
              step_in_backward=where == "in", clip=1.0 if where == "after" else 0)  # fmt: skip
    spec.write_text(json.dumps({"out": str(tmp_path), "jobs": [bad], "timeout": 120}))
    t0 = time.monotonic()
    results = wait_all(start_ranks([sys.executable, str(WORKER), str(spec)], 2, tmp_path), 120)
    took = time.monotonic() - t0
    (rc0, _, err0), (rc1, _, err1) = results
    assert rc1 == 1 and said in err1, err1[-3000:]
    assert "CollectiveError" not in err1, err1[-3000:]  # its own error, not a wait
    assert "RuntimeError: offload: the background optimizer step failed" in err1, err1[-3000:]
    assert rc0 == 1 and "CollectiveError: offload:" in err0, err0[-3000:]
    error = next(line for line in err0.splitlines() if "CollectiveError: offload:" in line)
    assert "rank 1 raised" in error and said in error, error
    assert took < 100


@pytest.mark.heavy
@pytest.mark.parametrize("how,status", [("kill", -9), ("abort", -6)])
def test_the_healthy_rank_s_error_names_a_rank_that_was_killed(tmp_path, how, status):
    """A rank killed with SIGKILL (the out-of-memory killer) or aborted (SIGABRT: gloo aborts a
    rank whose collective differs from the others', as 1 of 3 ranks calling
    ``optimizer.state_dict()`` alone did) says nothing: the others' errors name it, its pid
    being gone on this host, and both signals, since which one is not known there. It said
    "killed: SIGKILL, the out-of-memory killer?" for the abort too."""
    spec = tmp_path / "spec.json"
    bad = job(how, "cpu", "cpu", 3, steps=3, fail_at={"rank": 1, "step": 1, how: True})
    spec.write_text(json.dumps({"out": str(tmp_path), "jobs": [bad], "timeout": 120}))
    (rc0, _, err0), (rc1, _, _) = wait_all(
        start_ranks([sys.executable, str(WORKER), str(spec)], 2, tmp_path), 120
    )
    error = next((line for line in err0.splitlines() if "CollectiveError: offload:" in line), "")
    assert rc1 == status and rc0 == 1 and error, err0[-2000:]
    assert "rank 1 (pid " in error and "ended without an error" in error, error
    assert "SIGKILL" in error and "SIGABRT, as gloo aborts a rank" in error, error


@pytest.mark.slow
def test_a_rank_that_hangs_times_out_with_a_clear_error(tmp_path):
    spec = tmp_path / "spec.json"
    bad = job("hang", "cpu", "cpu", 3, steps=3, fail_at={"rank": 1, "step": 1, "hang": True})
    bad["timeout"] = 5  # distributed.timeout: the error
    # the process group's own timeout: how long the gather left pending keeps the healthy
    # rank's process from exiting (gloo's work cannot be cancelled)
    spec.write_text(json.dumps({"out": str(tmp_path), "jobs": [bad], "timeout": 20}))
    procs = start_ranks([sys.executable, str(WORKER), str(spec)], 2, tmp_path)
    t0 = time.monotonic()
    rc0, _, err0 = wait_all(procs[:1], 120)[0]
    took = time.monotonic() - t0
    procs[1].kill()
    procs[1].communicate()
    assert rc0 == 1 and "did not complete within 5 s (distributed.timeout)" in err0, err0[-2000:]
    assert took < 100


# ------------------------------------------------------------------------------ launchers
def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _launch(cmds: list[list[str]], cwd: Path, timeout: float = 240) -> list[tuple[int, str, str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            c,
            env=env,
            cwd=str(cwd),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=default_sigint,
        )  # fmt: skip
        for c in cmds
    ]
    return wait_all(procs, timeout)


@pytest.mark.heavy
def test_two_nodes_on_this_host(tmp_path, reference):
    """Two torchrun launches, one per "node", meeting at a localhost rendezvous."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp_path), "jobs": [job("nodes", "nvme", "cpu", 3)]}))
    port = str(free_port())
    cmds = [
        _torchrun(
            "--nnodes=2",
            f"--node-rank={n}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(WORKER),
            str(spec),
        )  # fmt: skip
        for n in (0, 1)
    ]
    for rc, _, err in _launch(cmds, tmp_path):
        assert rc == 0, err[-3000:]
    ref_losses, ref_state = reference
    _losses_close(result(tmp_path, "nodes")["losses"], ref_losses)
    _close(_final(tmp_path, "nodes"), ref_state)


@pytest.mark.slow
def test_torchrun_on_one_node(tmp_path, reference):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp_path), "jobs": [job("tr", "cpu", "nvme", 2)]}))
    cmd = _torchrun("--standalone", "--nproc-per-node=4", str(WORKER), str(spec))
    ((rc, _, err),) = _launch([cmd], tmp_path)
    assert rc == 0, err[-3000:]
    _losses_close(result(tmp_path, "tr")["losses"], reference[0])


@pytest.mark.slow
def test_demo_runs_on_two_ranks(tmp_path):
    cmd = [
        sys.executable, "-m", "offload", "demo", "--size", "tiny", "--steps", "3", "--nproc",
        "2", "--no-progress", "--eval-batches", "0", "--report", str(tmp_path / "report"),
    ]  # fmt: skip
    ((rc, out, err),) = _launch([cmd], tmp_path)
    assert rc == 0, err[-3000:]
    assert "offload demo summary" in out and "ranks" in out
    assert "ZeRO stage 3 over 2 ranks (rank 1, gloo)" in err


# ------------------------------------------------------------------------------ the full matrix
MATRIX = [
    job(f"m-s{s}-{p}-{o}", p, o, s)
    for s in (1, 2, 3)
    for p in ("none", "cpu", "nvme")
    for o in ("cpu", "nvme")
]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_stage_and_placement_matches(tmp_path, reference, world):
    extra = [
        job("m-bf16-s2-nvme-nvme", "nvme", "nvme", 2, dtype="bf16"),
        job("m-bf16-s1-none-cpu", "none", "cpu", 1, dtype="bf16"),
    ]
    run_ranks(world, MATRIX + extra, tmp_path, timeout=1800)
    ref_losses, ref_state = reference
    for j in MATRIX:
        _losses_close(result(tmp_path, j["name"])["losses"], ref_losses)
        _close(_final(tmp_path, j["name"]), ref_state)
    for j in extra:
        ref, losses = reference_mixed_ranks(make_model(), world, at_step=j["stage"] == 1)
        _losses_close(result(tmp_path, j["name"])["losses"], losses, rtol=1e-2)
        _bf16_close(_final(tmp_path, j["name"]), ref.state_dict())


@pytest.mark.slow
def test_step_in_backward_across_ranks(tmp_path):
    """The update in the backward (no accumulation, no clipping) for every stage; with 8 KiB
    buffers (the stack, stages 2 and 3) every unit's share, the root's too, is more grad
    pieces than the pool holds for the update (8 buffers: one), which it takes as they land
    from their reduce-scatter."""
    data = batches(STEPS_DATA, batch=GLOBAL_BATCH)
    model, losses = reference_fp32(make_model(), data, STEPS, 1, 0.0)
    torch.manual_seed(0)
    stack, stack_losses = reference_fp32(StackLM(n=4), data, STEPS, 1, 0.0)
    jobs = []
    for name, s, size, kw in (("s1", 1, "64KiB", {}), ("s2", 2, "64KiB", {}),
                              ("s3", 3, "64KiB", {}), ("stack-s2", 2, "8KiB", {"model": "stack"}),
                              ("stack-s3", 3, "8KiB", {"model": "stack"})):  # fmt: skip
        section = {"device": "nvme", "buffer_count": 8, "buffer_size": size,
                   "step_in_backward": True, "nvme_path": str(tmp_path / f"ib-{name}")}  # fmt: skip
        cfg = {"offload_optimizer": section}
        jobs.append(job(f"ib-{name}", "nvme", "nvme", s, accum=1, clip=0.0, config=cfg, **kw))
    run_ranks(2, jobs, tmp_path, timeout=900)
    for j in jobs:
        want, want_losses = (stack, stack_losses) if "model" in j else (model, losses)
        _losses_close(result(tmp_path, j["name"])["losses"], want_losses)
        _close(_final(tmp_path, j["name"]), want.state_dict())
