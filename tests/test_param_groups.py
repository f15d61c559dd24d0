"""Param groups of their own (``offload.wrap(..., param_groups=[...])``): each group's lr,
betas, eps and weight decay against torch's AdamW over the same groups, for every placement and
update schedule, with a scheduler and with ``optimizer.no_decay``; their state dict and
checkpoint; their bad inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_models import batches, lm_loss, make_model, placement_config

import offload
from offload.api.checkpoint_files import CheckpointError
from offload.runtime.phase import PhaseError

STEPS, ACCUM, CLIP, LR, WD = 6, 2, 0.5, 1e-2, 0.5
# group 0: the middle block, a slower LR and other moments; group 1: the default (the config's
# values); group 2: the second matrices and the huge table, a faster LR and a decay of their own
# (their parameters sit between group 1's in the units' flat pieces: the update cuts runs)
OVERRIDES = (
    {"lr": 0.3 * LR, "betas": (0.8, 0.99), "eps": 1e-6},
    {},
    {"lr": 3 * LR, "weight_decay": 0.02},
)


def _group_of(name: str) -> int:
    if name.startswith("blocks.1."):
        return 0
    if name.endswith("fc2.weight") or name.startswith("huge"):
        return 2
    return 1


def _undecayed(name: str) -> bool:
    return "bias" in name or "norm" in name


def _groups(model, reverse_first: bool = True) -> list[dict]:
    """The groups as a user writes them (group 0's parameters in reverse: a group's own order
    is torch's numbering, not the model's)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        dict(o, params=[p for n, p in named if _group_of(n) == i]) for i, o in enumerate(OVERRIDES)
    ]
    if reverse_first:
        groups[0]["params"].reverse()
    return groups


def _lambdas():
    """A scheduler's factor per group (LambdaLR): each group on its own schedule."""
    return [lambda s: 1.0, lambda s: 0.9**s, lambda s: 1.0 / (1 + s)]


def _reference(model, data, clip, kind, no_decay, cut_at):
    """torch's AdamW (or Adam) over the same groups, each split in two (weight_decay 0 for the
    second) where ``no_decay``; at step ``cut_at`` group 2's LR is halved between the last
    backward and the step."""
    model = copy.deepcopy(model)
    names = {p: n for n, p in model.named_parameters()}
    torch_groups, of = [], []
    for i, g in enumerate(_groups(model)):
        if no_decay:
            keep = [p for p in g["params"] if not _undecayed(names[p])]
            rest = [p for p in g["params"] if _undecayed(names[p])]
            torch_groups += [dict(g, params=keep), dict(g, params=rest, weight_decay=0.0)]
            of += [i, i]
        else:
            torch_groups.append(g)
            of.append(i)
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    opt = cls(torch_groups, lr=LR, weight_decay=WD, foreach=False)
    lambdas = _lambdas()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambdas[i] for i in of])
    for s in range(STEPS):
        for m in range(ACCUM):
            (lm_loss(model, data[(s * ACCUM + m) % len(data)]) / ACCUM).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        if s == cut_at:
            for g, i in zip(opt.param_groups, of, strict=True):
                if i == 2:
                    g["lr"] *= 0.5
        opt.step()
        sched.step()
        opt.zero_grad()
    return model.state_dict()


def _train(model, opt, data, clip, cut_at):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lambdas())
    norms = []
    for s in range(STEPS):
        for m in range(ACCUM):
            (lm_loss(model, data[(s * ACCUM + m) % len(data)]) / ACCUM).backward()
        if clip:
            norms.append(float(opt.clip_grad_norm_(clip)))
        if s == cut_at:
            opt.param_groups[2]["lr"] *= 0.5
        opt.step()
        sched.step()
        opt.zero_grad()
    return norms


@pytest.mark.parametrize(
    "param_dev,opt_dev,over",
    [
        ("none", "cpu", {}),  # gradients in p.grad: the grouped kernel calls, cut by group
        ("cpu", "cpu", {"no_decay": True}),
        ("nvme", "nvme", {}),  # the update in the last backward, redone (clipped)
        ("nvme", "nvme", {"clip": None, "no_decay": True}),  # its step size redone (the LR cut)
        ("cpu", "nvme", {"step_in_backward": False}),
        ("none", "cpu", {"keep_grads": False, "no_decay": True}),  # flat host gradients
        ("cpu", "nvme", {"type": "adam"}),  # L2 decay: in the moments
    ],
)
def test_param_groups_train_as_torch_with_the_same_groups(tmp_path, param_dev, opt_dev, over):
    data = batches(8)
    base = make_model()
    cut_at = 3 if opt_dev == "nvme" else None  # a late LR change in one group
    clip, kind, no_decay = over.get("clip", CLIP), over.get("type", "adamw"), over.get("no_decay")
    want = _reference(base, data, clip, kind, no_decay, cut_at)
    cfg = placement_config(param_dev, opt_dev, tmp_path)
    cfg["optimizer"].update(type=kind, lr=LR, weight_decay=WD)
    if no_decay:
        cfg["optimizer"]["no_decay"] = ["bias", "norm"]
    if "step_in_backward" in over:
        cfg["offload_optimizer"]["step_in_backward"] = over["step_in_backward"]
    model = copy.deepcopy(base)
    model, opt = offload.wrap(
        model, cfg, param_groups=_groups(model), _keep_grads=over.get("keep_grads")
    )
    try:
        assert [len(g["params"]) for g in opt.param_groups] == [6, 12, 3]
        assert opt.param_groups[1]["lr"] == LR and opt.param_groups[2]["weight_decay"] == 0.02
        norms = _train(model, opt, data, clip, cut_at)
        got = model.state_dict()
        rollbacks = opt.stats()["total"]["rollbacks"]
    finally:
        opt.close()
    if clip:
        assert max(norms) > clip
    elif opt_dev == "nvme":
        assert rollbacks == 1  # the LR cut's step: its params made again from the moments
    one_group = _reference_one_group(base, data, clip, kind)
    for name, ref in want.items():
        # (atol 1e-3 of the LR: where clipping rounds the norm otherwise than torch, a few
        # elements whose gradient is a cancellation, ~1e-3 of the median, move ~2e-6 in one
        # step; a group's value missed moves every element of its group by ~LR)
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-5, msg=name)
    for name, p in base.named_parameters():
        if p.requires_grad:  # each trained with its group's values, not the config's
            assert not torch.equal(got[name], one_group[name]), name


def _reference_one_group(base, data, clip, kind):
    """What the groups change: the same loop with one group (the config's values)."""
    model = copy.deepcopy(base)
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    opt = cls([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    for s in range(STEPS):
        for m in range(ACCUM):
            (lm_loss(model, data[(s * ACCUM + m) % len(data)]) / ACCUM).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_a_changed_group_lr_after_the_update_in_backward_is_named_by_its_group(tmp_path):
    """With the update in the step's last backward and no clipping (the gradients are not
    kept), a value the update cannot redo without them changed before ``step()`` is refused,
    naming the group and the key."""
    cfg = placement_config("nvme", "nvme", tmp_path)
    model = make_model()
    model, opt = offload.wrap(model, cfg, param_groups=_groups(model))
    try:
        for tokens in batches(2):  # steps with the values kept: the gradients are not kept
            lm_loss(model, tokens).backward()
            opt.step()
            opt.zero_grad()
        lm_loss(model, batches(1)[0]).backward()
        opt.param_groups[0]["betas"] = (0.5, 0.9)
        with pytest.raises(
            Exception, match=r"param_groups\[0\]\.betas \(0\.8, 0\.99\) -> \(0\.5, 0\.9\)"
        ):
            opt.step()
    finally:
        opt.close()


def test_a_first_clip_after_the_update_in_backward_says_it_is_the_clipping(tmp_path):
    """A loop that clips from a later step on (after a warm-up): the first clip comes after an
    update in the backward whose gradients were not kept, so the step is taken unclipped and
    refused. The refusal said param_groups had changed (they had not; its only change was
    the gradient scale); it names the clipping now and what to do."""
    model, opt = offload.wrap(make_model(), placement_config("nvme", "nvme", tmp_path))
    try:
        for tokens in batches(2):  # no norm asked for: the gradients are not kept
            lm_loss(model, tokens).backward()
            opt.step()
            opt.zero_grad()
        lm_loss(model, batches(1)[0]).backward()
        opt.clip_grad_norm_(1e-3)
        with pytest.raises(PhaseError, match="clip_grad_norm_ clipped it after") as err:
            opt.step()
        assert "param_groups" not in str(err.value)
        assert "optimizer.grad_norm() or clip_grad_norm_ from the first step" in str(err.value)
    finally:
        opt.close()


def test_the_state_dict_of_groups_loads_into_torch_and_back(tmp_path):
    """``optimizer.state_dict()`` numbers the parameters group by group as torch does, so
    ``torch.optim.AdamW`` over the same groups loads it and trains on as offload does; torch's
    comes back into offload's; an optimizer of other groups refuses it."""
    data = batches(4)
    base = make_model()
    cfg = placement_config("cpu", "nvme", tmp_path)
    cfg["optimizer"].update(lr=LR, weight_decay=WD)
    model = copy.deepcopy(base)
    model, opt = offload.wrap(model, cfg, param_groups=_groups(model))
    ref = copy.deepcopy(base)
    topt = torch.optim.AdamW(_groups(ref), lr=LR, weight_decay=WD, foreach=False)
    try:
        for s in range(2):
            lm_loss(model, data[s]).backward()
            opt.step()
            opt.zero_grad()
        opt.param_groups[2]["lr"] = 5e-3
        sd = opt.state_dict()
        assert [g["params"] for g in sd["param_groups"]] == [
            list(range(0, 6)),
            list(range(6, 18)),
            list(range(18, 21)),
        ]
        ref.load_state_dict(model.state_dict())
        topt.load_state_dict(sd)  # (torch ignores the extra "master" and "offload" entries)
        assert topt.param_groups[2]["lr"] == 5e-3 and topt.param_groups[0]["betas"] == (0.8, 0.99)
        for s in range(2, 4):
            for m, o in ((model, opt), (ref, topt)):
                lm_loss(m, data[s]).backward()
                o.step()
                o.zero_grad()
        got = model.state_dict()
        for name, want in ref.state_dict().items():
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-7, msg=name)
        torch_sd = topt.state_dict()
    finally:
        opt.close()
    model = copy.deepcopy(ref)
    model, opt = offload.wrap(model, cfg, param_groups=_groups(model))
    try:
        opt.load_state_dict(torch_sd)
        assert opt.param_groups[2]["lr"] == 5e-3
        assert torch.equal(
            opt.state_dict()["state"][20]["exp_avg"], torch_sd["state"][20]["exp_avg"]
        )
    finally:
        opt.close()
    model, opt = offload.wrap(copy.deepcopy(ref), cfg)  # one group
    try:
        with pytest.raises(
            ValueError, match=r"21 parameters in 3 group\(s\) of \[6, 12, 3\].*1 of \[21\]"
        ):
            opt.load_state_dict(torch_sd)
    finally:
        opt.close()


def test_a_checkpoint_keeps_each_groups_values_and_resumes_bitwise(tmp_path):
    """Each group's hyperparameters (changed since wrap) and members go with the checkpoint;
    the run resumed from it equals the run that went on, bit for bit; a wrap with other groups
    (or none) refuses it before anything changes."""
    data = batches(6)
    base = make_model()
    cfg = placement_config("nvme", "nvme", tmp_path / "a")

    def run(model, opt, steps):
        for s in steps:
            lm_loss(model, data[s]).backward()
            opt.step()
            opt.zero_grad()

    model = copy.deepcopy(base)
    model, opt = offload.wrap(model, cfg, param_groups=_groups(model))
    try:
        run(model, opt, range(3))
        opt.param_groups[0]["lr"] = 1e-3
        opt.param_groups[2]["eps"] = 1e-5
        path = offload.save_checkpoint(tmp_path / "ckpt", model, opt)
        run(model, opt, range(3, 6))
        want = model.state_dict()
    finally:
        opt.close()
    cfg = placement_config("nvme", "nvme", tmp_path / "b")
    model = copy.deepcopy(base)
    model, opt = offload.wrap(model, cfg, param_groups=_groups(model))
    try:
        offload.load_checkpoint(path, model, opt)
        assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[2]["eps"] == 1e-5
        assert opt.param_groups[1]["lr"] == 1e-2
        run(model, opt, range(3, 6))
        got = model.state_dict()
    finally:
        opt.close()
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    others = [
        ("one group", lambda m: None, r"1 param group\(s\)|3 param group\(s\), this optimizer 1"),
        ("other members", _moved, r"other parameters"),
        ("the same members in another order", lambda m: _groups(m, reverse_first=False), None),
    ]
    for _, groups, match in others:
        model = copy.deepcopy(base)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model, opt = offload.wrap(model, cfg, param_groups=groups(model))
        try:
            if match is None:  # (a group's order is the state dict's numbering, not its members)
                offload.load_checkpoint(path, model, opt)
                assert opt.param_groups[0]["lr"] == 1e-3
                continue
            with pytest.raises(CheckpointError, match=match):
                offload.load_checkpoint(path, model, opt)
            after = model.state_dict()  # (gathered: the parameters are released)
            for n, p in before.items():  # nothing changed
                assert torch.equal(after[n], p), n
        finally:
            opt.close()


def _moved(model) -> list[dict]:
    """``_groups`` with one parameter of group 2 moved to group 1."""
    groups = _groups(model)
    groups[1]["params"].append(groups[2]["params"].pop())
    return groups


def test_bad_param_groups_are_refused_by_name(tmp_path):
    cfg = placement_config("none", "cpu", tmp_path)
    model = make_model()
    named = dict(model.named_parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    stray = torch.nn.Parameter(torch.zeros(3))
    cases = [
        ({"params": trainable}, r"param_groups: got dict; allowed: a non-empty list of dicts"),
        ([], r"param_groups: got list; allowed: a non-empty list"),
        ([trainable], r"param_groups\[0\]: got list; allowed: a dict with 'params'"),
        ([{"lr": 1.0}], r"param_groups\[0\]: got dict without params"),
        (
            [{"params": trainable, "momentum": 0.9}],
            r"param_groups\[0\]: keys \['momentum'\] are not supported; allowed: 'params', 'name'",
        ),
        (
            [{"params": trainable[:3]}, {"params": [*trainable[3:], stray]}],
            r"param_groups\[1\]\['params'\]\[18\]: a Parameter of shape \(3,\) that is not a",
        ),
        (
            [{"params": trainable}, {"params": [named["norm.bias"]]}],
            r"param_groups\[1\]\['params'\]\[0\]: parameter 'norm.bias' is already in "
            r"param_groups\[0\]",
        ),
        (
            [{"params": trainable[1:]}],
            r"1 trainable parameter\(s\) are in no group \(embed.weight\).*requires_grad_",
        ),
        (
            [{"params": trainable[:2], "lr": -1.0}, {"params": trainable[2:]}],
            r"param_groups\[0\]\['lr'\]: got -1.0; allowed: a finite number >= 0",
        ),
        (
            [{"params": trainable, "name": 3}],
            r"param_groups\[0\]\['name'\]: got 3; allowed: a string",
        ),
        (
            [{"params": trainable, "betas": (0.9, 1.5)}],
            r"param_groups\[0\]\['betas'\]: got \(0.9, 1.5\); allowed: two numbers",
        ),
    ]
    before = {n: p.detach().clone() for n, p in named.items()}
    for groups, match in cases:
        with pytest.raises(ValueError, match=match):
            offload.wrap(model, cfg, param_groups=groups)
        for n, p in model.named_parameters():  # nothing was taken (the wrap below works too)
            assert torch.equal(p.detach(), before[n]), n
    # a frozen parameter in a group is accepted and left out, as it gets no gradient
    frozen = named["blocks.0.fc1.bias"]
    model, opt = offload.wrap(
        model,
        cfg,
        param_groups=[
            {"params": [frozen, *trainable[:5]]},
            {"params": trainable[5:], "name": "rest"},
        ],
    )
    try:
        assert [len(g["params"]) for g in opt.param_groups] == [5, 16]
        assert opt.param_groups[1]["name"] == "rest" and "name" not in opt.param_groups[0]
        with pytest.raises(ValueError, match=r"add_param_group.*param groups wrap built"):
            opt.add_param_group({"params": [stray]})
    finally:
        opt.close()


def test_the_configs_named_groups_train_as_the_same_groups_listed(tmp_path):
    """``optimizer.param_groups`` in the config (name patterns: what ``from_pretrained``,
    ``OffloadTrainer`` and ``offload finetune`` users have, with no model to list tensors
    of) builds the groups wrap's ``param_groups=`` would: a first group of the parameters no
    pattern finds, then each listed one; the two runs are equal bit for bit."""
    data = batches(4)
    base = make_model()
    cfg = placement_config("cpu", "nvme", tmp_path)
    cfg["optimizer"].update(lr=LR, weight_decay=WD)
    named = copy.deepcopy(cfg)
    named["optimizer"]["param_groups"] = [
        {"params": [r"^blocks\.1\."], "name": "middle", **OVERRIDES[0]},
        {"params": [r"blocks\.[02]\.fc2\.weight$", "^huge"], **OVERRIDES[2]},
    ]
    named["optimizer"]["param_groups"][0]["betas"] = list(OVERRIDES[0]["betas"])  # (as YAML)
    got = {}
    for how, config in (("listed", cfg), ("named", named)):
        model = copy.deepcopy(base)
        groups = _groups(model, reverse_first=False)
        listed = [groups[1], groups[0], groups[2]] if how == "listed" else None
        model, opt = offload.wrap(model, config, param_groups=listed)
        try:
            assert [len(g["params"]) for g in opt.param_groups] == [12, 6, 3]
            assert opt.param_groups[1].get("name") == ("middle" if how == "named" else None)
            for s in range(4):
                lm_loss(model, data[s]).backward()
                opt.step()
                opt.zero_grad()
            got[how] = model.state_dict()
        finally:
            opt.close()
    for name, want in got["listed"].items():
        assert torch.equal(got["named"][name], want), name


def test_bad_named_groups_are_refused_by_key(tmp_path):
    from offload.config import ConfigError  # noqa: PLC0415

    cases = [
        ([{"params": ["head"], "lr": -1}], r"optimizer\.param_groups\[0\]\.lr: got -1"),
        ([{"params": ["head"], "momentum": 0.9}], r"param_groups\[0\]\.momentum: got 0\.9"),
        ([{"lr": 1e-3}], r"optimizer\.param_groups\[0\]: got \{'lr': 0\.001\}"),
        ({"params": ["head"]}, r"optimizer\.param_groups: got \{'params'"),
        ([{"params": []}], r"param_groups\[0\]\.params: got \[\]; allowed: at least one"),
        ([{"params": ["(head"]}], r"param_groups\[0\]\.params.*'\(head'"),
        ([{"params": ["haed"]}], r"param_groups\[0\]\.params: got 'haed'.*embed\.weight"),
        (
            [{"params": ["norm"]}, {"params": ["^norm"]}],
            r"param_groups\[1\]\.params: got \['\^norm'\].*'norm\.weight' is found by "
            r"optimizer\.param_groups\[0\] too",
        ),
    ]
    for groups, match in cases:
        cfg = placement_config("none", "cpu", tmp_path)
        cfg["optimizer"]["param_groups"] = groups
        with pytest.raises(ConfigError, match=match):
            offload.wrap(make_model(), cfg)
    cfg["optimizer"]["param_groups"] = [{"params": ["head"], "lr": 1e-4}]
    model = make_model()
    with pytest.raises(ValueError, match=r"param_groups= was given and the config's optimizer"):
        offload.wrap(model, cfg, param_groups=_groups(model))
    # a pattern that finds only frozen parameters is a group with none to train
    cfg["optimizer"]["param_groups"] = [{"params": [r"blocks\.0\.fc1\.bias"], "lr": 1e-4}]
    model, opt = offload.wrap(make_model(), cfg)
    try:
        assert [len(g["params"]) for g in opt.param_groups] == [21, 0]
    finally:
        opt.close()
