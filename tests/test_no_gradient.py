"""A trainable parameter that gets no gradient in a step (an MoE expert no token was routed to,
a multi-task head its batch did not use, a branch not taken, a block frozen for one backward)
is left alone by that step, as torch's optimizers leave it: its value, its moments and its own
step count (Adam's bias correction), at every placement and update schedule; the counts go
through the state dict (torch's per-parameter ``step``) and the checkpoint.

Until 2026-12-06 offload moved such a parameter as with a zero gradient where it holds the
gradients (momentum and AdamW's decay), and counted one step for every parameter: 1.6e-3 to
4e-2 off torch after six steps of the loop below, every parameter (the others train on the
moved ones' outputs)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from engine_models import STACK_DIM, BranchBlock, StackLM, batches, lm_loss, placement_config

import offload
from offload.api.checkpoint_files import CheckpointError, seal_meta

STEPS, ACCUM, CLIP, LR, WD = 6, 2, 0.5, 1e-2, 0.1


class RoutedLM(StackLM):
    """A stack of ``BranchBlock``s whose caller leaves out a whole block (``skip``: a unit
    no token reached, as an MoE expert made a unit) and the middle block's extra layer
    (``blocks[1].skip``: a parameter inside a unit that got no gradient)."""

    skip: int | None = None

    def __init__(self) -> None:
        super().__init__(n=3, frozen=False, block=BranchBlock)
        self.aux = torch.nn.Linear(STACK_DIM, STACK_DIM)  # a head only some batches use
        self.aux_on = False

    def forward(self, tokens):
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = block(x)
        if self.aux_on:
            x = x + self.aux(x)
        return self.head(x)


def _route(model, s: int, m: int) -> None:
    """Step ``s``, micro-step ``m``: the third block left out of steps 1 and 4 (both
    micro-steps: no gradient that step); the extra layer of the middle block left out of the
    first micro-step of even steps (a gradient from the second) and of all of step 3; the aux
    head used in step 2 alone (no gradient before it: no state, step count 0)."""
    model.skip = 2 if s % 3 == 1 else None
    model.blocks[1].skip = (s % 2 == 0 and m == 0) or s == 3
    model.aux_on = s == 2


def _loop(model, opt, data, clip, own: bool, sched=None, cut_at=None, start=0, steps=STEPS):
    for s in range(start, steps):
        for m in range(ACCUM):
            _route(model, s, m)
            (lm_loss(model, data[(s * ACCUM + m) % len(data)]) / ACCUM).backward()
        if clip and own:
            opt.clip_grad_norm_(clip)
        elif clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        if s == cut_at:  # an LR changed after the update in the backward: redone
            for g in opt.param_groups:
                g["lr"] *= 0.5
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()


def _base() -> RoutedLM:
    torch.manual_seed(0)
    return RoutedLM()


def _torch_opt(model, kind="adamw"):
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return cls(model.parameters(), lr=LR, weight_decay=WD, foreach=False)


def _config(param_dev, opt_dev, tmp_path, **over):
    cfg = placement_config(param_dev, opt_dev, tmp_path)
    cfg["wrap"] = {"module_classes": ["BranchBlock"]}
    cfg["optimizer"].update(lr=LR, weight_decay=WD)
    for key, value in over.items():
        section, _, name = key.partition(".")
        cfg[section][name] = value
    return cfg


def _aux_trained(base, got: dict) -> None:
    """The aux head got a gradient in one step only (its step count 1): that step's update
    moved it off its initial value, as torch's (a guard on the comparison itself: a loop in
    which it never trained would leave both at their initial values)."""
    assert not torch.equal(got["aux.weight"], base.state_dict()["aux.weight"])


@pytest.mark.parametrize(
    "param_dev,opt_dev,over",
    [
        ("none", "cpu", {}),  # the gradients in p.grad: their grouped kernel calls
        ("none", "cpu", {"keep_grads": False}),  # flat host gradients
        ("cpu", "cpu", {"keep_grads": False, "type": "adam"}),  # L2 decay: in the moments
        ("nvme", "nvme", {}),  # the update in the last backward, redone (clipped)
        ("nvme", "nvme", {"clip": None, "cut_at": 3}),  # its step size redone (an LR cut)
        # 8 KiB buffers, 8 of them: the update takes every unit's grad pieces one by one as
        # the backward hands them over, the root's (with the aux head) at the backward's end
        ("nvme", "nvme", {"clip": None, "small": True}),
        ("cpu", "nvme", {"step_in_backward": False}),  # the update after the backward
        ("nvme", "cpu", {"no_decay": True}),  # the update's runs cut by decay and count
    ],
)
def test_a_parameter_with_no_gradient_is_left_alone_as_torch_leaves_it(
    tmp_path, watchdog, param_dev, opt_dev, over
):
    base, data = _base(), batches(8)
    clip, kind, cut_at = over.get("clip", CLIP), over.get("type", "adamw"), over.get("cut_at")
    ref = copy.deepcopy(base)
    ref_opt = _torch_opt(ref, kind)
    if over.get("no_decay"):
        named = list(ref.named_parameters())
        ref_opt = torch.optim.AdamW(
            [
                {"params": [p for n, p in named if "bias" not in n]},
                {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0},
            ],
            lr=LR,
            weight_decay=WD,
            foreach=False,
        )
    _loop(ref, ref_opt, data, clip, own=False, cut_at=cut_at)
    cfg = _config(param_dev, opt_dev, tmp_path)
    cfg["optimizer"]["type"] = kind
    if over.get("no_decay"):
        cfg["optimizer"]["no_decay"] = ["bias"]
    if "step_in_backward" in over:
        cfg["offload_optimizer"]["step_in_backward"] = over["step_in_backward"]
    if over.get("small"):
        for section in ("offload_param", "offload_optimizer"):
            cfg[section].update(buffer_size="8KiB", buffer_count=8)
    model, opt = offload.wrap(copy.deepcopy(base), cfg, _keep_grads=over.get("keep_grads"))
    try:
        _loop(model, opt, data, clip, own=True, cut_at=cut_at)
        got = model.state_dict()
        steps = {int(e["step"]) for e in opt.state_dict()["state"].values()}
        rollbacks = opt.stats()["total"]["rollbacks"]
    finally:
        opt.close()
    if cut_at is not None:
        assert rollbacks == 1  # the LR cut's step: its params made again from the moments
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)
    # each parameter's own count: all 6 steps; the third block 4; the extra layer 5; aux 1
    assert steps == {6, 4, 5, 1}, steps
    _aux_trained(base, got)


def test_the_counts_go_to_torch_and_back_through_the_state_dict(tmp_path):
    """``optimizer.state_dict()`` holds each parameter's own ``step``, as torch's does: torch's
    AdamW loads it and trains on as offload does; torch's (whose never-stepped parameters have
    no state) loads into offload and trains on as torch does."""
    base, data = _base(), batches(8)
    ref = copy.deepcopy(base)
    ref_opt = _torch_opt(ref)
    _loop(ref, ref_opt, data, CLIP, own=False, steps=2)  # aux: no gradient yet
    torch_sd = copy.deepcopy(ref_opt.state_dict())
    assert len(torch_sd["state"]) < len(list(ref.parameters()))
    _loop(ref, ref_opt, data, CLIP, own=False, start=2, steps=5)
    cfg = _config("cpu", "nvme", tmp_path, **{"offload_optimizer.step_in_backward": False})
    model = copy.deepcopy(base)
    model.load_state_dict(_weights_after(base, data, 2))
    model, opt = offload.wrap(model, cfg)
    try:
        opt.load_state_dict(torch_sd)
        _loop(model, opt, data, CLIP, own=True, start=2, steps=5)
        for name, want in ref.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], want, rtol=1e-5, atol=1e-6)
        mine = opt.state_dict()
    finally:
        opt.close()
    theirs = ref_opt.state_dict()
    names = [n for n, _ in ref.named_parameters()]
    for i, name in enumerate(names):
        assert float(mine["state"][i]["step"]) == float(theirs["state"][i]["step"]), name
    # back into torch: the same steps after it
    back = copy.deepcopy(ref)
    back_opt = _torch_opt(back)
    back_opt.load_state_dict({"state": mine["state"], "param_groups": theirs["param_groups"]})
    _loop(back, back_opt, data, CLIP, own=False, start=5, steps=STEPS)
    _loop(ref, ref_opt, data, CLIP, own=False, start=5, steps=STEPS)
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], want, rtol=1e-5, atol=1e-6)


def _weights_after(base, data, steps: int) -> dict:
    model = copy.deepcopy(base)
    _loop(model, _torch_opt(model), data, CLIP, own=False, steps=steps)
    return model.state_dict()


def test_a_bad_saved_step_is_refused_by_name(tmp_path):
    model, opt = offload.wrap(_base(), _config("cpu", "cpu", tmp_path))
    try:
        _loop(model, opt, batches(8), CLIP, own=True, steps=2)
        sd = opt.state_dict()
        sd["state"][3]["step"] = torch.tensor(7.0)
        with pytest.raises(ValueError, match=r"parameter index 3 has step.*7.*from 0 to.*2"):
            opt.load_state_dict(sd)
    finally:
        opt.close()


@pytest.mark.parametrize("param_dev,opt_dev", [("cpu", "cpu"), ("nvme", "nvme")])
def test_a_checkpoint_keeps_the_counts_and_resumes_bit_for_bit(tmp_path, param_dev, opt_dev):
    """Saved after the third step (the third block has missed one, the aux head has one),
    loaded into a fresh wrap: the last three steps end bit for bit where the run that never
    stopped ends. A checkpoint naming a parameter the model does not train is refused before
    anything changes."""
    base, data = _base(), batches(8)
    whole, opt = offload.wrap(copy.deepcopy(base), _config(param_dev, opt_dev, tmp_path / "a"))
    try:
        _loop(whole, opt, data, CLIP, own=True)
        want = whole.state_dict()
    finally:
        opt.close()
    first, opt = offload.wrap(copy.deepcopy(base), _config(param_dev, opt_dev, tmp_path / "b"))
    try:
        _loop(first, opt, data, CLIP, own=True, steps=3)
        saved = offload.save_checkpoint(tmp_path / "ck", first, opt)
    finally:
        opt.close()
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["param_steps"]["aux.weight"] == 1
    assert meta["param_steps"]["blocks.2.fc1.weight"] == 2
    assert "embed.weight" not in meta["param_steps"]  # every step's: none kept
    resumed, opt = offload.wrap(copy.deepcopy(base), _config(param_dev, opt_dev, tmp_path / "c"))
    try:
        offload.load_checkpoint(saved, resumed, opt)
        _loop(resumed, opt, data, CLIP, own=True, start=3)
        for name, value in resumed.state_dict().items():
            assert torch.equal(value, want[name]), name
        meta["param_steps"]["no.such.weight"] = 1  # (sealed again: a writer's bug)
        (saved / "meta.json").write_text(json.dumps(seal_meta(meta)))
        before = {k: v.clone() for k, v in resumed.state_dict().items()}
        with pytest.raises(CheckpointError, match=r"'param_steps' names 'no.such.weight'"):
            offload.load_checkpoint(saved, resumed, opt)
        for name, value in resumed.state_dict().items():
            assert torch.equal(value, before[name]), name
    finally:
        opt.close()
