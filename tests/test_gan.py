"""Two wrapped models trained against each other: a GAN's loop, as PyTorch's DCGAN example and
CycleGAN write it.

The generator's step backpropagates through the discriminator after the discriminator's own
step, with no ``zero_grad()`` of the discriminator in between (that comes before its next
backward), or with the discriminator frozen for it (``requires_grad_(False)``, CycleGAN's
``set_requires_grad``). Before 2026-12-05 offload refused both at that backward: the first
where it holds the gradients (NVMe), the second on every placement.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from engine_models import STACK_DIM, StackBlock, placement_config

import offload
from offload.runtime.phase import PhaseError

NOISE, DATA = 8, 16


def _generator() -> nn.Module:
    return nn.Sequential(
        nn.Linear(NOISE, STACK_DIM), StackBlock(), StackBlock(), nn.Linear(STACK_DIM, DATA)
    )


def _discriminator() -> nn.Module:
    return nn.Sequential(
        nn.Linear(DATA, STACK_DIM), StackBlock(), StackBlock(), nn.Linear(STACK_DIM, 1)
    )


def _config(param_dev: str, opt_dev: str, path) -> dict:
    cfg = placement_config(param_dev, opt_dev, path)
    cfg["optimizer"] = {"type": "adamw", "lr": 1e-3, "weight_decay": 0.01}
    cfg["wrap"] = {"module_classes": ["StackBlock"]}
    return cfg


def _torch_adamw(model: nn.Module) -> torch.optim.AdamW:
    """The reference's optimizer: offload's hyperparameters (``_config``), one tensor at a time."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)


def _train(g, d, g_opt, d_opt, steps: int, freeze: bool, scaled: bool = False) -> list:
    """The discriminator's step on real and generated samples, then the generator's through
    the discriminator; ``freeze``: the discriminator frozen for the generator's step;
    ``scaled``: each loss scaled by its own model's optimizer (``loss_scale.enabled``)."""
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        real = torch.randn(4, DATA, generator=gen) + 1
        z = torch.randn(4, NOISE, generator=gen)
        d.requires_grad_(True)
        d_opt.zero_grad()
        fake = g(z)
        d_loss = F.softplus(-d(real)).mean() + F.softplus(d(fake.detach())).mean()
        (d_opt.scale_loss(d_loss) if scaled else d_loss).backward()
        d_opt.step()
        d.requires_grad_(not freeze)
        g_opt.zero_grad()
        g_loss = F.softplus(-d(g(z))).mean()
        (g_opt.scale_loss(g_loss) if scaled else g_loss).backward()  # through D, after its step
        g_opt.step()
        losses.append((d_loss.item(), g_loss.item()))
    return losses


@pytest.mark.parametrize(
    "freeze,scaled",
    [(False, False), (True, False), (False, True)],
    ids=["dcgan", "frozen-d", "scaled"],
)
@pytest.mark.parametrize("param_dev,opt_dev", [("none", "nvme"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_a_gan_loop_trains_as_torch(tmp_path, param_dev, opt_dev, freeze, scaled):
    """Losses and both models' weights against plain torch's AdamW(foreach=False) over 4
    steps; the discriminator's ``state_dict()`` is readable right after the generator's
    step (the backward through it ran no update). ``scaled``: a loss scaler on each
    (``loss_scale.enabled``; fp32, so a power-of-two scale changes no value), the generator's
    loss scaled by its own optimizer (the discriminator's engine refused that backward as
    unscaled until 2026-12-06)."""
    torch.manual_seed(0)
    g0, d0 = _generator(), _discriminator()
    ref_g, ref_d = copy.deepcopy(g0), copy.deepcopy(d0)

    ref = _train(ref_g, ref_d, _torch_adamw(ref_g), _torch_adamw(ref_d), 4, freeze)
    scaler = {"loss_scale": {"enabled": scaled}}
    g, g_opt = offload.wrap(g0, _config(param_dev, opt_dev, tmp_path / "g") | scaler)
    d, d_opt = offload.wrap(d0, _config(param_dev, opt_dev, tmp_path / "d") | scaler)
    try:
        got = _train(g, d, g_opt, d_opt, 4, freeze, scaled)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=0, atol=1e-6)
        for model, want in ((d, ref_d), (g, ref_g)):
            values, wanted = model.state_dict(), want.state_dict()
            assert values.keys() == wanted.keys()
            for name, v in wanted.items():
                # (Adam's first steps are lr * sign(g): a gradient near eps moves by an ulp's
                # worth of its rounding, here 2.5e-6 in the generator after one step)
                torch.testing.assert_close(values[name], v, rtol=0, atol=1e-5, msg=name)
    finally:
        g_opt.close()
        d_opt.close()


@pytest.mark.parametrize("param_dev,opt_dev", [("none", "nvme"), ("nvme", "nvme")])
def test_gradients_added_to_a_consumed_step_are_not_stepped(tmp_path, param_dev, opt_dev):
    """Where offload holds the gradients, a backward after the step with no ``zero_grad()``
    is torch's sum minus what the step used: it runs (a GAN needs it), and the norm and the
    step that would read it are refused until ``zero_grad()``, which leaves the run as one
    that zeroed."""
    torch.manual_seed(0)
    d, opt = offload.wrap(_discriminator(), _config(param_dev, opt_dev, tmp_path))
    x = torch.randn(4, DATA, generator=torch.Generator().manual_seed(1))
    try:
        d(x).mean().backward()
        opt.step()
        before = d.state_dict()
        d(x).mean().backward()  # no zero_grad() since the step
        # dropped as they come (kept, p.grad would hold the whole model's gradients)
        assert all(p.grad is None for p in d.parameters())
        for call in (lambda: opt.clip_grad_norm_(1.0), opt.grad_norm, opt.step):
            with pytest.raises(PhaseError, match=r"no zero_grad\(\) in between.*after each step"):
                call()
        after = d.state_dict()
        for name, v in before.items():
            assert torch.equal(after[name], v), name
        opt.zero_grad()
        d(x).mean().backward()
        assert opt.grad_norm() > 0
        opt.step()
    finally:
        opt.close()


@pytest.mark.parametrize("param_dev,opt_dev", [("cpu", "cpu"), ("none", "nvme"), ("nvme", "nvme")])
def test_a_parameter_frozen_after_wrap_is_left_alone_by_its_own_step(tmp_path, param_dev, opt_dev):
    """Frozen for a backward it gets no gradient, and its own step leaves it alone (value,
    moments, step count), as torch's does: the steps after it train as torch's (that step was
    refused until 2026-12-06, when offload's moved it as with a zero gradient: momentum and
    weight decay). One frozen at wrap and unfrozen after is refused at the backward (offload
    holds no optimizer state for it)."""
    torch.manual_seed(0)
    model = _discriminator()
    model[3].bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    d, opt = offload.wrap(model, _config(param_dev, opt_dev, tmp_path))
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01, foreach=False
    )
    x = torch.randn(4, DATA, generator=torch.Generator().manual_seed(1))
    try:
        for frozen in (False, True, True, False, False):
            for m, o in ((d, opt), (ref, ref_opt)):
                m[1].requires_grad_(not frozen)
                m(x).square().mean().backward()
                o.step()
                o.zero_grad()
                m[1].requires_grad_(True)
        got = d.state_dict()
        for name, want in ref.state_dict().items():
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)
        d[3].bias.requires_grad_(True)
        with pytest.raises(PhaseError, match=r"3\.bias was frozen when the model was wrapped"):
            d(x).mean().backward()
    finally:
        opt.close()


CLIP = 0.05  # WGAN's weight clipping of the critic


def _clip_through_the_state_dict(critic: nn.Module) -> None:
    """WGAN's clipping where the critic's parameters are offload's: read, clamp, load."""
    critic.load_state_dict({k: v.clamp(-CLIP, CLIP) for k, v in critic.state_dict().items()})


def _clip_in_place(critic: nn.Module) -> None:
    """WGAN's clipping as its reference code writes it."""
    for p in critic.parameters():
        p.data.clamp_(-CLIP, CLIP)


def _train_wgan(g, d, g_opt, d_opt, steps: int, clip) -> list:
    """WGAN's loop: two critic steps, each followed by the weight clipping (``clip``), then
    the generator's step through the critic."""
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        for _ in range(2):
            real = torch.randn(4, DATA, generator=gen) + 1
            z = torch.randn(4, NOISE, generator=gen)
            d_opt.zero_grad()
            d_loss = d(g(z).detach()).mean() - d(real).mean()
            d_loss.backward()
            d_opt.step()
            clip(d)
        g_opt.zero_grad()
        g_loss = -d(g(torch.randn(4, NOISE, generator=gen))).mean()
        g_loss.backward()
        g_opt.step()
        losses.append((d_loss.item(), g_loss.item()))
    return losses


@pytest.mark.parametrize(
    "param_dev,opt_dev", [("none", "cpu"), ("none", "nvme"), ("cpu", "cpu"), ("nvme", "nvme")]
)
def test_wgan_weight_clipping_trains_as_torch(tmp_path, param_dev, opt_dev):
    """WGAN clips the critic's weights after each of its steps with ``p.data.clamp_``: a
    write that bumps no version counter, which the next gather dropped with no error where
    the parameters are released (0.012 off torch's losses in three steps), and the next
    update overwrote where they stay on the device with their master a copy. Through the
    state dict it trains as torch's in-place clipping over 3 iterations (6 critic steps);
    ``p.data.clamp_`` itself is refused at the critic's next forward where it is released
    (``test_engine_api.py``), and lasts where the parameters are the master (none/cpu)."""
    torch.manual_seed(0)
    g0, d0 = _generator(), _discriminator()
    ref_g, ref_d = copy.deepcopy(g0), copy.deepcopy(d0)

    ref = _train_wgan(ref_g, ref_d, _torch_adamw(ref_g), _torch_adamw(ref_d), 3, _clip_in_place)
    g, g_opt = offload.wrap(g0, _config(param_dev, opt_dev, tmp_path / "g"))
    d, d_opt = offload.wrap(d0, _config(param_dev, opt_dev, tmp_path / "d"))
    try:
        got = _train_wgan(g, d, g_opt, d_opt, 3, _clip_through_the_state_dict)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=0, atol=1e-6)
        values = d.state_dict()
        for name, v in ref_d.state_dict().items():
            assert values[name].abs().max() <= CLIP, name
            torch.testing.assert_close(values[name], v, rtol=0, atol=1e-5, msg=name)
    finally:
        g_opt.close()
        d_opt.close()
