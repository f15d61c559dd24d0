"""Weight decay that leaves biases and norm weights alone (``optimizer.no_decay``,
``optimizer.set_no_decay``) against torch's AdamW with two param groups, for every placement
and update schedule, and its bad inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_models import batches, lm_loss, make_model, placement_config

import offload
from offload.config import ConfigError
from offload.runtime.phase import PhaseError

STEPS, ACCUM, CLIP, LR, WD = 6, 2, 0.5, 1e-2, 0.5
NO_DECAY = ["bias", "norm"]


def _undecayed(name: str) -> bool:
    return "bias" in name or "norm" in name


def _reference(model, data, lr_cut_at: int | None, clip: float | None, kind: str):
    """torch.optim.AdamW (or Adam: ``kind``) over two groups, the second with weight_decay=0;
    at step ``lr_cut_at`` the LR is halved between the last backward and the step."""
    model = copy.deepcopy(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = (torch.optim.AdamW if kind == "adamw" else torch.optim.Adam)(
        [
            {"params": [p for n, p in named if not _undecayed(n)]},
            {"params": [p for n, p in named if _undecayed(n)], "weight_decay": 0.0},
        ],
        lr=LR,
        weight_decay=WD,
        foreach=False,
    )
    for s in range(STEPS):
        for m in range(ACCUM):
            (lm_loss(model, data[(s * ACCUM + m) % len(data)]) / ACCUM).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], clip)
        if s == lr_cut_at:
            for group in opt.param_groups:
                group["lr"] *= 0.5
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train(model, opt, data, lr_cut_at: int | None, clip: float | None):
    norms = []
    for s in range(STEPS):
        for m in range(ACCUM):
            (lm_loss(model, data[(s * ACCUM + m) % len(data)]) / ACCUM).backward()
        if clip:  # (asking the norm keeps the gradients for a whole redo)
            norms.append(float(opt.clip_grad_norm_(clip)))
        if s == lr_cut_at:
            opt.param_groups[0]["lr"] *= 0.5
        opt.step()
        opt.zero_grad()
    return norms


@pytest.mark.parametrize(
    "param_dev,opt_dev,over",
    [
        ("none", "cpu", {}),  # gradients in p.grad: the grouped kernel call
        ("cpu", "cpu", {}),
        ("nvme", "nvme", {}),  # the update in the last backward, redone (clipped)
        ("nvme", "nvme", {"clip": None}),  # kept, or only its step size redone (the LR cut)
        ("cpu", "nvme", {"step_in_backward": False}),
        ("none", "cpu", {"keep_grads": False}),  # flat host gradients
        ("cpu", "nvme", {"type": "adam"}),  # L2 decay: in the moments
    ],
)
def test_undecayed_parameters_train_as_torch_with_two_groups(tmp_path, param_dev, opt_dev, over):
    data = batches(8)
    base = make_model()
    lr_cut_at = 3 if opt_dev == "nvme" else None  # a late LR change: the step size is redone
    clip = over.get("clip", CLIP)
    kind = over.get("type", "adamw")
    want = _reference(base, data, lr_cut_at, clip, kind)
    cfg = placement_config(param_dev, opt_dev, tmp_path)
    cfg["optimizer"].update(type=kind, lr=LR, weight_decay=WD, no_decay=NO_DECAY)
    if "step_in_backward" in over:
        cfg["offload_optimizer"]["step_in_backward"] = over["step_in_backward"]
    model, opt = offload.wrap(copy.deepcopy(base), cfg, _keep_grads=over.get("keep_grads"))
    try:
        names = {p: n for n, p in model.named_parameters()}
        assert {names[p] for p in opt.no_decay} == {
            n for n, p in model.named_parameters() if p.requires_grad and _undecayed(n)
        }
        norms = _train(model, opt, data, lr_cut_at, clip)
        got = model.state_dict()
        rollbacks = opt.stats()["total"]["rollbacks"]
    finally:
        opt.close()
    if clip:
        assert max(norms) > clip  # clipping changed the steps (the speculative update redone)
    elif opt_dev == "nvme":
        assert rollbacks == 1  # the LR cut's step: its params made again from the moments
    all_decayed = copy.deepcopy(base).state_dict()
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-7, msg=name)
        if _undecayed(name) and "fc1.bias" not in name:  # (blocks.0.fc1.bias is frozen)
            assert not torch.equal(got[name], all_decayed[name])  # it trained


def test_set_no_decay_between_steps_matches_torch(tmp_path):
    """The set replaced after a first step (all decayed) acts from the next step, as a torch
    group's weight_decay set to 0 then."""
    data = batches(4)
    base = make_model()
    ref = copy.deepcopy(base)
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    topt = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if not _undecayed(n)]},
            {"params": [p for n, p in named if _undecayed(n)]},
        ],
        lr=LR,
        weight_decay=WD,
        foreach=False,
    )
    cfg = placement_config("nvme", "nvme", tmp_path)
    cfg["optimizer"].update(lr=LR, weight_decay=WD)
    model, opt = offload.wrap(copy.deepcopy(base), cfg)
    try:
        for s in range(3):
            lm_loss(ref, data[s]).backward()
            topt.step()
            topt.zero_grad()
            lm_loss(model, data[s]).backward()
            if s == 1:  # mid-step: its update may have run in that backward
                with pytest.raises(PhaseError, match="set_no_decay.*backward"):
                    opt.set_no_decay([])
            opt.step()
            opt.zero_grad()
            if s == 0:
                topt.param_groups[1]["weight_decay"] = 0.0
                opt.set_no_decay(p for n, p in model.named_parameters() if _undecayed(n))
        got = model.state_dict()
    finally:
        opt.close()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-7, msg=name)


def test_the_undecayed_set_goes_with_the_optimizer_state_dict(tmp_path):
    """``optimizer.state_dict()`` left the set out: a wrap that loaded it decayed every
    parameter (torch's own state dict carries its groups). Now it goes with the state dict
    (through ``torch.save``) and comes back on load, one saved without it leaving the set."""
    cfg = placement_config("none", "cpu", tmp_path)
    model, opt = offload.wrap(make_model(), cfg)
    try:
        opt.set_no_decay(p for n, p in model.named_parameters() if _undecayed(n))
        lm_loss(model, batches(1)[0]).backward()
        opt.step()
        opt.zero_grad()
        sd = opt.state_dict()
        want = {n for n, p in model.named_parameters() if p in opt.no_decay}
    finally:
        opt.close()
    torch.save(sd, tmp_path / "opt.pt")
    model, opt = offload.wrap(make_model(), cfg)
    try:
        opt.load_state_dict(torch.load(tmp_path / "opt.pt"))
        assert want and {n for n, p in model.named_parameters() if p in opt.no_decay} == want
        del sd["offload"]["no_decay"]  # one saved before the set went with it
        opt.set_no_decay([])
        opt.load_state_dict(sd)
        assert not opt.no_decay
        two = torch.optim.AdamW(
            [
                {"params": [p for n, p in model.named_parameters() if not _undecayed(n)]},
                {"params": [p for n, p in model.named_parameters() if _undecayed(n)]},
            ]
        )  # torch's two groups: refused, saying why and what to do (it said only the counts)
        with pytest.raises(
            ValueError, match=r"2 group\(s\).*several groups.*param_groups=.*set_no_decay"
        ):
            opt.load_state_dict(two.state_dict())
        sd["offload"]["no_decay"] = [10**6]
        with pytest.raises(ValueError, match=r"'no_decay' holds 1000000.*indices"):
            opt.load_state_dict(sd)
    finally:
        opt.close()


def test_bad_no_decay_is_refused_by_name(tmp_path):
    cfg = placement_config("none", "cpu", tmp_path)
    cfg["optimizer"]["no_decay"] = ["bias", "nrom"]  # misspelt: would decay the norms
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match=r"optimizer\.no_decay: got 'nrom'.*embed\.weight"):
        offload.wrap(model, cfg)
    for n, p in model.named_parameters():  # nothing was taken
        assert torch.equal(p.detach(), before[n]), n
    cfg["optimizer"]["no_decay"] = ["bias", "(norm"]
    with pytest.raises(ConfigError, match=r"optimizer\.no_decay.*'\(norm'.*unterminated"):
        offload.wrap(make_model(), cfg)
    cfg["optimizer"]["no_decay"] = "bias"
    with pytest.raises(ConfigError, match=r"optimizer\.no_decay: got 'bias'; allowed: a list"):
        offload.wrap(make_model(), cfg)
    cfg["optimizer"]["no_decay"] = []
    model, opt = offload.wrap(make_model(), cfg)
    try:
        with pytest.raises(ValueError, match=r"item 1 \(Parameter of shape \(3,\)\) is not a"):
            opt.set_no_decay([model.norm.bias, torch.nn.Parameter(torch.zeros(3))])
        opt.set_no_decay([model.blocks[0].fc1.bias, model.norm.bias])  # the first is frozen
        assert opt.no_decay == frozenset([model.norm.bias])
    finally:
        opt.close()
