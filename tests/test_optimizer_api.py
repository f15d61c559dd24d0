"""The optimizer ``offload.wrap`` returns, as torch code uses it: clipping called twice, param
groups, torch's clipping functions bound by name, ``state_dict`` to and from
``torch.optim.AdamW``, ``zero_grad(set_to_none=False)`` and ``torch.amp.GradScaler``. Numbers
are compared against plain torch on a deep copy of the same model."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_models import batches, lm_loss, make_model, placement_config

import offload
from offload.api.clipping import ClipError
from offload.api.wrap import engine_of
from offload.runtime.phase import PhaseError

# (param_dev, opt_dev, keep_grads): where the gradients live, each of the three owners
GRAD_OWNERS = {
    "autograd": ("none", "cpu", None),  # p.grad
    "host": ("none", "cpu", False),  # offload's host buffer
    "nvme": ("cpu", "nvme", None),  # NVMe shards
}


def _wrap(tmp_path, owner: str, model=None, **over):
    param_dev, opt_dev, keep = GRAD_OWNERS[owner]
    cfg = placement_config(param_dev, opt_dev, tmp_path, **over)
    kw = {} if keep is None else {"_keep_grads": keep}
    return offload.wrap(make_model() if model is None else model, cfg, **kw)


def _torch_adamw(model, lr=1e-2, wd=0.1):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=wd, foreach=False)


def _assert_close(sd, ref_sd, rtol=1e-5, atol=1e-7):
    assert set(sd) == set(ref_sd)
    for name, ref in ref_sd.items():
        torch.testing.assert_close(sd[name].float(), ref.float(), rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("owner", list(GRAD_OWNERS))
def test_clipping_twice_clips_the_clipped_gradients_as_torch(tmp_path, owner):
    """A second ``clip_grad_norm_`` before ``step()`` sees the gradients the first one clipped,
    as torch's in-place clipping does (it replaced the first coefficient and returned the
    unclipped norm: clip(0.1) then clip(1.0) clipped to 1.0)."""
    data = batches(3)
    ref = make_model()
    ref_opt = _torch_adamw(ref)
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    model, opt = _wrap(tmp_path, owner)
    try:
        for tokens in data:
            lm_loss(ref, tokens).backward()
            want = [torch.nn.utils.clip_grad_norm_(ref_params, m) for m in (0.1, 1.0, 0.05, 0.05)]
            ref_opt.step()
            ref_opt.zero_grad()
            lm_loss(model, tokens).backward()
            got = [opt.clip_grad_norm_(m) for m in (0.1, 1.0, 0.05, 0.05)]
            torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-4, atol=0)
            torch.testing.assert_close(opt.grad_norm(), want[-1], rtol=1e-4, atol=0)
            opt.step()
            opt.zero_grad()
        _assert_close(model.state_dict(), ref.state_dict())
    finally:
        opt.close()


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("owner", list(GRAD_OWNERS))
def test_clipping_non_finite_gradients_gives_torch_s_norm_and_step(tmp_path, owner, bad):
    """Gradients with a NaN: torch's norm is NaN and its clipping scales every gradient by NaN,
    so every weight turns NaN (a diverged run stops there). offload returned inf and scaled by
    0, so the weights whose gradient was finite (the embedding rows the batch missed) trained
    on (found 2026-12-07). With an inf and no NaN, both are inf; NaN and inf masks as torch's."""
    tokens = batches(1)[0]
    ref = make_model()
    ref_opt = _torch_adamw(ref)
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    model, opt = _wrap(tmp_path, owner)

    def poisoned(m):
        loss = lm_loss(m, tokens)
        # a non-finite gradient at the head alone (inf * 0 would make NaN)
        return loss + float(bad) * m.head.weight[0, 0] if bad == "inf" else loss * float(bad)

    try:
        poisoned(ref).backward()
        want = torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
        ref_opt.step()
        poisoned(model).backward()
        got = opt.clip_grad_norm_(1.0)
        opt.step()
        assert str(float(got)) == str(float(want)) == bad
        for name, v in ref.state_dict().items():
            mine = model.state_dict()[name]
            assert torch.equal(mine.isnan(), v.isnan()), name
            assert torch.equal(mine.isinf(), v.isinf()), name
    finally:
        opt.close()


@pytest.mark.parametrize("owner", list(GRAD_OWNERS))
def test_a_backward_after_clipping_and_before_the_step_is_refused(tmp_path, owner):
    """``clip_grad_norm_`` between two backwards of a step: torch clips the gradients so far
    in place and the next backward adds unclipped, while offload's coefficient multiplied the
    whole step's gradients at the step, the later backward's too (the probe: the step's norm
    0.11 against torch's 2.6, no error). Refused before that backward takes anything; the step
    then applies the clipped first backward, as torch's."""
    data = batches(2)
    ref = make_model()
    ref_opt = _torch_adamw(ref)
    model, opt = _wrap(tmp_path, owner)
    try:
        lm_loss(ref, data[0]).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
        lm_loss(model, data[0]).backward()
        torch.testing.assert_close(opt.clip_grad_norm_(0.1), want, rtol=1e-4, atol=0)
        with pytest.raises(PhaseError, match=r"after optimizer\.clip_grad_norm_\(\)"):
            lm_loss(model, data[1]).backward()
        opt.step()
        opt.zero_grad()
        _assert_close(model.state_dict(), ref.state_dict())
        # a clipping that scaled nothing too: the loop is refused at its first step, not at the
        # first batch whose norm is over max_norm (hours in); grad_norm() reads it instead
        lm_loss(model, data[0]).backward()
        opt.clip_grad_norm_(1e9)
        with pytest.raises(PhaseError, match=r"grad_norm\(\) to read the norm"):
            lm_loss(model, data[1]).backward()
        opt.zero_grad()
        lm_loss(model, data[0]).backward()
        opt.grad_norm()
        lm_loss(model, data[1]).backward()
        opt.step()
    finally:
        opt.close()


@pytest.mark.parametrize("owner", list(GRAD_OWNERS))
def test_model_zero_grad_drops_the_clipping_with_the_gradients(tmp_path, owner):
    """A batch clipped, then dropped with ``model.zero_grad()`` (a loop that skips a step on a
    bad norm): its coefficient stayed with the optimizer and scaled the next step's
    gradients (the probe: norm 2.6e0 read 1.6e-4). ``model.zero_grad()`` is
    ``optimizer.zero_grad()``, which drops it."""
    data = batches(2)
    ref = make_model()
    ref_opt = _torch_adamw(ref)
    model, opt = _wrap(tmp_path, owner)
    try:
        lm_loss(model, data[0]).backward()
        opt.clip_grad_norm_(1e-3)
        model.zero_grad()
        lm_loss(model, data[1]).backward()
        lm_loss(ref, data[1]).backward()
        want = torch.nn.utils.get_total_norm(
            [p.grad for p in ref.parameters() if p.grad is not None]
        )
        torch.testing.assert_close(opt.grad_norm(), want, rtol=1e-4, atol=0)
        opt.step()
        ref_opt.step()
        _assert_close(model.state_dict(), ref.state_dict())
    finally:
        opt.close()


def test_param_groups_are_fixed_at_wrap(tmp_path):
    """``add_param_group`` after wrap, and a changed ``param_groups``, are refused (were
    accepted and ignored: a parameter added never moved, a no-decay group decayed, and
    ``state_dict()`` raised a KeyError with a tensor for its message)."""
    data = batches(2)
    model, opt = _wrap(tmp_path, "autograd")
    try:
        extra = torch.nn.Parameter(torch.ones(()))
        with pytest.raises(
            ValueError, match="add_param_group.*param groups wrap built.*before offload"
        ):
            opt.add_param_group({"params": [extra], "lr": 0.1})
        assert len(opt.param_groups) == 1
        lm_loss(model, data[0]).backward()
        opt.step()  # the refused call changed nothing
        opt.zero_grad()

        group = opt.param_groups[0]
        params = list(group["params"])
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        nobias = [p for p in params if all(p is not b for b in biases)]
        for change in (
            lambda: group.__setitem__("params", nobias),
            lambda: group["params"].append(extra),
            lambda: opt.param_groups.append({**group, "params": biases}),
            lambda: opt.param_groups.__setitem__(0, dict(group)),
        ):
            change()
            lm_loss(model, data[1]).backward()
            for call in (opt.step, opt.state_dict):
                with pytest.raises(
                    ValueError, match="param_groups was changed.*param groups wrap built"
                ):
                    call()
            opt.param_groups[:] = [group]
            group["params"] = list(params)
            opt.step()  # put back, it trains
            opt.zero_grad()
        group["lr"] = 1e-3  # a hyperparameter (a scheduler's change) is fine
        opt.state_dict()
    finally:
        opt.close()


TESTS = Path(__file__).resolve().parent

_BOUND_BY_NAME = """
import importlib.util, sys
{first}
assert importlib.util.find_spec("torch")  # a spec asked for, not loaded (transformers does)
from torch.nn.utils import clip_grad_norm_, clip_grad_value_
from torch.nn.utils.clip_grad import clip_grad_norm_ as clip_norm_2
import torch
sys.path.insert(0, {tests!r})
from engine_models import batches, lm_loss, make_model, placement_config
from offload.api.clipping import ClipError

plain = torch.nn.Linear(5, 3)  # no offload model: torch's clipping, unchanged
plain(torch.ones(2, 5)).square().sum().backward()
norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in plain.parameters()]))
got = clip_grad_norm_(plain.parameters(), 0.5)
after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in plain.parameters()]))
assert torch.allclose(got, norm) and torch.allclose(after, torch.tensor(0.5)), (got, norm, after)
cfg = placement_config("none", "cpu", None, dtype="bf16")  # offload holds the gradients
model, opt = offload.wrap(make_model(), cfg)
lm_loss(model, batches(1)[0]).backward()
for clip, arg in ((clip_grad_norm_, 1.0), (clip_norm_2, 1.0), (clip_grad_value_, 0.1)):
    try:
        print(float(clip(model.parameters(), arg)))
    except ClipError:
        print("refused")
opt.close()
"""


@pytest.mark.parametrize(
    "first", ["import offload", pytest.param("import torch, offload", marks=pytest.mark.heavy)]
)
def test_torch_clipping_bound_by_name_after_import_offload_is_guarded(first):
    """``from torch.nn.utils import clip_grad_norm_`` after ``import offload`` and before the
    first wrap binds the guarded function, torch loaded before offload or not (the guard was
    installed at the first wrap: the name kept torch's, which returned 0.0 and clipped
    nothing where offload holds the gradients); other parameters go to torch unchanged. A
    fresh process: here torch and offload are imported already."""
    script = _BOUND_BY_NAME.format(first=first, tests=str(TESTS))
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["refused"] * 3, out.stdout


def _train(model, opt, data):
    for tokens in data:
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("owner", ["autograd", "nvme"])
def test_state_dict_numbers_parameters_as_torch_does(tmp_path, owner):
    """``optimizer.state_dict()`` loads into ``torch.optim.AdamW(trainable parameters)`` and
    training goes on as torch's own run (its parameters were numbered in the units' order, the
    root unit first: AdamW took it silently where shapes matched, each parameter getting
    another's moments, 1.5e-1 rel off after 3 more steps)."""
    data = batches(6)
    ref = make_model()
    ref_opt = _torch_adamw(ref)
    model, opt = _wrap(tmp_path, owner)
    try:
        _train(ref, ref_opt, data[:3])
        _train(model, opt, data[:3])
        names = {p: n for n, p in model.named_parameters()}
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert [names[p] for p in opt.param_groups[0]["params"]] == trainable
        sd = opt.state_dict()
        plain = make_model()
        plain.load_state_dict(model.state_dict())
    finally:
        opt.close()
    plain_opt = _torch_adamw(plain)
    plain_opt.load_state_dict(sd)
    want = ref_opt.state_dict()["state"]
    for i, name in enumerate(trainable):
        for k in ("exp_avg", "exp_avg_sq"):
            got = plain_opt.state_dict()["state"][i][k]
            torch.testing.assert_close(got, want[i][k], rtol=1e-5, atol=1e-8, msg=name)
    _train(plain, plain_opt, data[3:])
    _train(ref, ref_opt, data[3:])
    _assert_close(plain.state_dict(), ref.state_dict())


@pytest.mark.parametrize("owner", ["autograd", "nvme"])
def test_a_state_of_another_shape_is_refused_before_anything_loads(tmp_path, owner):
    """A state dict whose parameter has the model's element count in another shape (a weight
    saved [144, 48], the model's now [48, 144]) loaded: its master and moments were read in
    the new shape and trained on, where torch's step raises and ``load_checkpoint`` refuses.
    Refused, naming both shapes, before any unit loads: training goes on as if the load had
    not been asked."""
    data = batches(3)
    model, opt = _wrap(tmp_path, owner)
    try:
        _train(model, opt, data[:1])
        saved = opt.state_dict()
        index = next(
            i for i, p in enumerate(opt._params) if p.dim() == 2 and p.shape[0] != p.shape[1]
        )
        for k in ("master", "exp_avg"):
            broken = copy.deepcopy(saved)
            entry = broken["state"][index]
            entry[k] = entry[k].t().contiguous()
            want = (
                rf"'{k}' of parameter index {index} has shape \[\d+, \d+\]; .*nothing was changed"
            )
            with pytest.raises(ValueError, match=want):
                opt.load_state_dict(broken)
        before = opt.state_dict()
        for k, v in saved["state"][index].items():
            torch.testing.assert_close(before["state"][index][k], v, rtol=0, atol=0)
        _train(model, opt, data[1:])  # (not refused: the load changed nothing)
    finally:
        opt.close()


@pytest.mark.parametrize("owner", ["autograd", "nvme"])
def test_torch_adamw_state_dict_loads(tmp_path, owner):
    """A ``torch.optim.AdamW`` state dict (a run resumed from torch) loads: its moments and
    step, the master being the model's values (was: a bare KeyError 'master'; with 'master'
    added by hand, the moments of other parameters and step 0)."""
    data = batches(6)
    ref = make_model()
    ref_opt = _torch_adamw(ref)
    _train(ref, ref_opt, data[:3])
    model, opt = _wrap(tmp_path, owner, model=copy.deepcopy(ref))
    try:
        opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
        _train(model, opt, data[3:])
        _train(ref, ref_opt, data[3:])
        _assert_close(model.state_dict(), ref.state_dict())
        amsgrad = torch.optim.AdamW(
            [p for p in make_model().parameters() if p.requires_grad], amsgrad=True
        )
        with pytest.raises(ValueError, match="amsgrad.*loads the state of torch.optim.AdamW"):
            opt.load_state_dict(amsgrad.state_dict())
        moments = ref_opt.state_dict()
        moments["offload"] = {"step_count": 3}  # offload's own, without 'master'
        with pytest.raises(ValueError, match=r"no \['master'\].*torch.optim.AdamW"):
            opt.load_state_dict(moments)
    finally:
        opt.close()


@pytest.mark.parametrize("owner", ["autograd", "nvme"])
def test_hyperparameters_the_update_cannot_take_are_refused(tmp_path, owner):
    """betas (0.9, 1.5) set by hand or by ``load_state_dict`` failed in the update with a
    bare "adam_step(): incompatible function arguments" (a complex bias correction), and lr
    -1 (gradient ascent) or a NaN eps trained on; ``load_state_dict`` took such a group
    silently. Now the step, and the load before it changes anything, name the key, the value
    and what is allowed."""
    data = batches(2)
    model, opt = _wrap(tmp_path, owner)
    group = opt.param_groups[0]
    good = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
    bad = [
        ("betas", (0.9, 1.5)),
        ("betas", (0.9,)),
        ("lr", -1.0),
        ("lr", "fast"),
        ("eps", float("nan")),
        ("eps", 0.0),
        ("weight_decay", float("inf")),
    ]
    try:
        for key, value in bad:
            group[key] = value
            lm_loss(model, data[0]).backward()
            with pytest.raises(ValueError, match=rf"param_groups\[0\]\['{key}'\]: got .*allowed"):
                opt.step()
            opt.zero_grad()
            group[key] = good[key]
        sd = opt.state_dict()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for key, value in bad:
            broken = copy.deepcopy(sd)
            broken["param_groups"][0][key] = value
            broken["state"][0]["exp_avg"].fill_(7.0)
            with pytest.raises(ValueError, match=rf"load_state_dict: .*'{key}'\]: got .*allowed"):
                opt.load_state_dict(broken)
            assert opt.param_groups[0][key] == good[key]
        assert not torch.equal(
            sd["state"][0]["exp_avg"], torch.full_like(sd["state"][0]["exp_avg"], 7.0)
        )
        assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        group["lr"] = torch.tensor(0.0)  # a tensor, and 0 (a schedule's end), are fine
        lm_loss(model, data[1]).backward()
        opt.step()
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    finally:
        opt.close()


@pytest.mark.parametrize("owner", ["autograd", "nvme"])
def test_torch_switches_set_in_param_groups_are_refused_not_ignored(tmp_path, owner):
    """``param_groups[0]["maximize"] = True`` (or ``amsgrad``, or ``decoupled_weight_decay``
    False on AdamW's group) set after ``wrap``, as on torch's groups, was ignored: the run
    went on minimizing (0.45 where torch's ascended to 1.28). Refused at the step, naming the
    switch; put back, training goes on as torch's AdamW; the implementation options that
    change no value (``foreach``, ``fused``) and the switches at their defaults are fine."""
    data = batches(4)
    ref = make_model()
    ref_opt = _torch_adamw(ref)
    model, opt = _wrap(tmp_path, owner, model=copy.deepcopy(ref))
    group = opt.param_groups[0]
    try:
        for key, value in (("maximize", True), ("amsgrad", True), ("decoupled_weight_decay", 0)):
            group[key] = value
            lm_loss(model, data[0]).backward()
            with pytest.raises(ValueError, match=rf"param_groups\[0\]: {key}={value}: .*ignored"):
                opt.step()
            opt.zero_grad()
            del group[key]
        group.update(maximize=False, amsgrad=False, decoupled_weight_decay=True, foreach=True)
        group["fused"] = None
        _train(model, opt, data)
        _train(ref, ref_opt, data)
        _assert_close(model.state_dict(), ref.state_dict())
    finally:
        opt.close()


def test_state_dict_of_before_the_torch_order_still_loads(tmp_path):
    """A state dict saved before the parameters were numbered in ``model.parameters()`` order
    (no ``param_order`` in its ``offload`` entry: the units' order) loads as it was meant."""
    data = batches(4)
    model, opt = _wrap(tmp_path, "autograd")
    try:
        _train(model, opt, data[:2])
        sd = opt.state_dict()
        units_order = [p for u in engine_of(model).plan.units for p in u.trainable_params]
        index = {p: i for i, p in enumerate(opt.param_groups[0]["params"])}
        assert [id(p) for p in index] != [id(p) for p in units_order]  # this model tells them apart
        old = copy.deepcopy(sd)
        old["state"] = {j: sd["state"][index[p]] for j, p in enumerate(units_order)}
        del old["offload"]["param_order"]
        _train(model, opt, data[2:])
        want = model.state_dict()
    finally:
        opt.close()
    for saved in (sd, old):
        model, opt = _wrap(tmp_path / "again", "autograd")
        try:
            _train(model, opt, data[:1])  # other state, replaced by the load
            opt.load_state_dict(copy.deepcopy(saved))
            assert engine_of(model).step_count == 2
            _train(model, opt, data[2:])
            _assert_close(model.state_dict(), want, rtol=0, atol=0)
        finally:
            opt.close()


@pytest.mark.parametrize("through", ["optimizer", "model"])
def test_zero_grad_set_to_none_false_zeroes_p_grad_in_place(tmp_path, through):
    """``zero_grad(set_to_none=False)`` (the optimizer's or the model's) where the gradients
    stay in ``p.grad`` zeroes them in place, as torch's (it set them to None: code adding to
    ``p.grad`` then failed), and training goes on as torch's with the same calls."""
    data = batches(3)
    ref = make_model()
    ref_opt = _torch_adamw(ref)
    model, opt = _wrap(tmp_path, "autograd")
    try:
        for tokens in data:
            for m, o in ((ref, ref_opt), (model, opt)):
                lm_loss(m, tokens).backward()
                o.step()
                before = {p: p.grad for p in m.parameters() if p.grad is not None}
                (o if through == "optimizer" else m).zero_grad(set_to_none=False)
                for p in m.parameters():
                    if p.requires_grad:
                        assert p.grad is before[p] and not p.grad.any()
                        assert not p.grad.requires_grad
        _assert_close(model.state_dict(), ref.state_dict())
    finally:
        opt.close()


@pytest.mark.parametrize("owner", list(GRAD_OWNERS))
def test_torch_grad_scaler(tmp_path, owner):
    """``torch.amp.GradScaler`` works where the gradients stay in ``p.grad`` (as with torch's
    optimizer) and is refused by name where offload holds them (torch raised a bare
    ``AssertionError: No inf checks were recorded for this optimizer``); bf16 too."""
    data = batches(3)
    ref = make_model()
    ref_opt = _torch_adamw(ref)
    over = {"dtype": "bf16"} if owner == "host" else {}
    model, opt = _wrap(tmp_path, owner, **over)
    try:
        for m, o in ((ref, ref_opt), (model, opt)):
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
            for tokens in data:
                scaler.scale(lm_loss(m, tokens)).backward()
                if owner != "autograd" and o is opt:
                    with pytest.raises(RuntimeError, match="GradScaler.*optimizer.scale_loss"):
                        scaler.step(o)
                    assert not hasattr(o, "found_inf") and not hasattr(o, "grad_scale")
                    o.zero_grad()
                    break
                scaler.unscale_(o)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                scaler.step(o)
                scaler.update()
                o.zero_grad()
        if owner == "autograd":
            _assert_close(model.state_dict(), ref.state_dict())
        lm_loss(model, data[0]).backward()  # without the scaler, it trains
        opt.step()
    finally:
        opt.close()


def _state_dict_hooks(opt, calls: list):
    """torch.optim.Optimizer's four state-dict hooks on ``opt``, each recording its call; the
    post-hook replaces the state dict, the load pre-hook sets its copy's lr to 0.005."""

    def load_pre(o, sd):
        calls.append(("load_pre", "marked" in sd))
        sd["param_groups"] = [dict(g, lr=0.005) for g in sd["param_groups"]]
        del sd["marked"]  # the caller's dict keeps it: the hook has a shallow copy

    opt.register_state_dict_pre_hook(lambda o: calls.append(("pre", o is opt)))
    opt.register_state_dict_post_hook(
        lambda o, sd: (calls.append(("post", "state" in sd)), dict(sd, marked=True))[1]
    )
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load_post", o is opt)))


@pytest.mark.parametrize("owner", ["autograd", "nvme"])
def test_state_dict_hooks_run_as_torchs(tmp_path, owner):
    """The hooks of ``register_state_dict_pre_hook`` / ``_post_hook`` and
    ``register_load_state_dict_pre_hook`` / ``_post_hook`` (torch.optim.Optimizer's API, which
    torch.distributed.checkpoint and schedulers' wrappers use) run as torch's: in the same
    order with the same arguments, a returned dict replacing the state dict, the load pre-hook
    on a shallow copy. They were accepted and never called."""
    data = batches(1)
    ref = make_model()
    ref_opt = _torch_adamw(ref)
    model, opt = _wrap(tmp_path, owner)
    try:
        seen = {}
        for m, o in ((ref, ref_opt), (model, opt)):
            calls = seen.setdefault(o is opt, [])
            _state_dict_hooks(o, calls)
            lm_loss(m, data[0]).backward()
            o.step()
            o.zero_grad()
            sd = o.state_dict()
            assert sd["marked"] is True
            o.load_state_dict(sd)
            assert "marked" in sd and o.param_groups[0]["lr"] == 0.005
        want = [("pre", True), ("post", True), ("load_pre", True), ("load_post", True)]
        assert seen[False] == want and seen[True] == want, seen
    finally:
        opt.close()


@pytest.mark.parametrize("owner", list(GRAD_OWNERS))
def test_torch_two_step_clipping_is_guarded(tmp_path, owner):
    """torch >= 2.6's ``clip_grads_with_norm_(params, max_norm, get_total_norm(grads))``: where
    offload holds the gradients it found no ``.grad``, got a norm of 0 and clipped nothing,
    silently (the steps' updates unclipped); it is refused, naming the call to use, as torch's
    ``clip_grad_norm_`` is. Where the gradients are in ``p.grad`` it trains as torch's."""
    data = batches(3)
    ref = make_model()
    ref_opt = _torch_adamw(ref)
    model, opt = _wrap(tmp_path, owner)
    try:
        for tokens in data:
            for m, o in ((ref, ref_opt), (model, opt)):
                lm_loss(m, tokens).backward()
                params = [p for p in m.parameters() if p.requires_grad]
                norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                if o is opt and owner != "autograd":
                    with pytest.raises(ClipError, match=r"optimizer\.clip_grad_norm_"):
                        torch.nn.utils.clip_grads_with_norm_(m.parameters(), 0.5, norm)
                    o.clip_grad_norm_(0.5)
                else:
                    torch.nn.utils.clip_grads_with_norm_(params, 0.5, norm)
                o.step()
                o.zero_grad()
        _assert_close(model.state_dict(), ref.state_dict())
    finally:
        opt.close()


@pytest.mark.parametrize("owner", ["autograd", "nvme"])
def test_a_large_loss_scale_over_finite_gradients_is_no_overflow(tmp_path, owner):
    """A loss scale grown large (2**70 here: the scale grows without an fp16 overflow to stop
    it where the compute is fp32 or bf16) over finite gradients: where they stay in ``p.grad``
    the overflow check took an fp32 norm of the scaled gradients, inf once their squares
    passed 3.4e38, so the step was skipped and the scale halved, where torch's ``GradScaler``
    (per element) and the other owners step. The elements decide; a real inf still skips."""
    data = batches(2)
    ref = make_model()
    ref_opt = _torch_adamw(ref)
    model, opt = _wrap(tmp_path, owner, loss_scale={"enabled": True, "initial": 2.0**70})
    try:
        lm_loss(ref, data[0]).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)  # (the norm alone)
        ref_opt.step()
        opt.scale_loss(lm_loss(model, data[0])).backward()
        torch.testing.assert_close(opt.grad_norm(), want, rtol=1e-5, atol=0)
        opt.step()
        opt.zero_grad()
        assert opt.skipped_steps == 0 and opt.scaler.scale == 2.0**70
        _assert_close(model.state_dict(), ref.state_dict())
        opt.scale_loss(lm_loss(model, data[1]) * float("inf")).backward()
        opt.step()
        assert opt.skipped_steps == 1 and opt.scaler.scale == 2.0**69
    finally:
        opt.close()


def test_torch_clipping_of_loss_scaled_gradients_in_p_grad_is_refused(tmp_path):
    """Gradients in ``p.grad`` (fp32, all on the CPU) with offload's loss scaler on: ``.grad``
    holds them times the scale until ``step()``, and torch's clipping, let through where the
    gradients are in ``.grad``, took that norm (1024x the true one) and clipped 1024x too
    hard, silently. Refused, naming the scale; ``optimizer.clip_grad_norm_`` trains as
    torch's ``GradScaler`` with ``unscale_`` before the clip."""
    data = batches(3)
    ref = make_model()
    ref_opt = _torch_adamw(ref)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model, opt = _wrap(tmp_path, "autograd", loss_scale={"enabled": True, "initial": 1024.0})
    params = [p for p in model.parameters() if p.requires_grad]
    refused = r"loss scaler on .*\(1024\).*optimizer\.clip_grad_norm_"
    try:
        for tokens in data:
            scaler.scale(lm_loss(ref, tokens)).backward()
            scaler.unscale_(ref_opt)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            scaler.step(ref_opt)
            scaler.update()
            ref_opt.zero_grad()
            opt.scale_loss(lm_loss(model, tokens)).backward()
            for clip in (
                lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5),
                lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 0.1),
                lambda: torch.nn.utils.clip_grads_with_norm_(params, 0.5, torch.tensor(1.0)),
            ):
                with pytest.raises(ClipError, match=refused):
                    clip()
            torch.testing.assert_close(opt.clip_grad_norm_(0.5), want, rtol=1e-5, atol=0)
            opt.step()
            opt.zero_grad()
        _assert_close(model.state_dict(), ref.state_dict())
    finally:
        opt.close()


@pytest.mark.parametrize("owner", ["autograd", "nvme"])
def test_a_step_after_gradients_set_by_hand_says_why_it_updates_nothing(tmp_path, caplog, owner):
    """``gs = torch.autograd.grad(loss, params); p.grad = g`` then ``step()``: offload takes its
    gradients from the backward through the model, so the step has none and updates nothing;
    its warning said only "no backward since the last step", with p.grad plainly set. It now
    says that p.grad set by hand is not read, and what to do. A step that finds only the last
    step's gradients still in p.grad (no zero_grad) says what it said."""
    data = batches(3)
    model, opt = _wrap(tmp_path, owner)
    try:
        lm_loss(model, data[0]).backward()
        opt.step()
        if owner == "autograd":  # the last step's p.grad, not set by hand
            opt.step()
            said = [r.getMessage() for r in caplog.records if "updates nothing" in r.getMessage()]
            assert len(said) == 1 and "set by hand" not in said[0], said
        opt.zero_grad()
        caplog.clear()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        params = [p for p in model.parameters() if p.requires_grad]
        for tokens in data[1:]:
            for p, g in zip(params, torch.autograd.grad(lm_loss(model, tokens), params)):
                p.grad = g
            opt.step()
            opt.zero_grad()
        said = [r.getMessage() for r in caplog.records if "updates nothing" in r.getMessage()]
        assert len(said) == 1, said
        assert f"{len(params)} of the {len(params)} trainable parameters" in said[0]
        assert "not from p.grad set by hand" in said[0] and "loss.backward()" in said[0]
        assert ("works here" in said[0]) == (owner == "autograd")
        _assert_close(model.state_dict(), before, rtol=0, atol=0)
    finally:
        opt.close()


def test_a_first_step_after_gradients_set_by_hand_says_they_are_not_read(tmp_path):
    """The same before any backward: the refusal said to call loss.backward() first, with
    p.grad plainly set; it says now that p.grad set by hand is not read."""
    model, opt = _wrap(tmp_path, "nvme")
    try:
        params = [p for p in model.parameters() if p.requires_grad]
        for p, g in zip(params, torch.autograd.grad(lm_loss(model, batches(1)[0]), params)):
            p.grad = g
        with pytest.raises(PhaseError, match=rf"{len(params)} trainable parameters have a p.grad"):
            opt.step()
    finally:
        opt.close()
