"""``torch.autocast(dtype=torch.float16)`` over ``dtype: fp32`` compute: the config's
``loss_scale.enabled: true`` scales the loss as with fp16 compute, and trains as torch does with
``torch.amp.GradScaler`` (``offload/runtime/autocast.py``, Note: fp16 autocast needs a loss
scale).

Before, the loss scaler was built with fp16 compute only: ``optimizer.scale_loss`` returned the
loss unscaled, GradScaler was refused where offload holds the gradients, and nothing said so;
the fp16 gradients below 2**-24 became 0 (every weight gradient of a 3-layer MLP whose loss was
scaled by 1e-6, where a scale of 2**16 lost 1% of them).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from engine_models import batches, lm_loss, make_model, placement_config

import offload
from offload.runtime.phase import PhaseError

PLACEMENTS = [("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")]
SCALE = dict(initial=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=1)
# fp32 parity's tolerance (test_wrap_parity): CPU Adam's update is within an ulp of torch's
# AdamW (15075 of 119264 elements 1 ulp apart after the first step). Under fp16 autocast an ulp
# that moves a weight's fp16 rounding grows: 2.3e-5 apart after 4 updates (1.6e-5 after 3), and
# torch against itself with 13% of the weights nudged by an ulp at the start, 1e-2 after 4. So
# two updates, around the skipped step: 3e-8 apart.
TOL = 1e-5
OVERFLOW_STEP = 1  # its loss is multiplied by 1e10: the fp16 gradients overflow, it is skipped


def _fp16(cache: bool = True):
    return torch.autocast("cpu", dtype=torch.float16, cache_enabled=cache)


def _losses(model, data, step, accum):
    """The step's micro-batch losses, under fp16 autocast (the reference without the cache, as
    offload's forward computes: ``offload/runtime/autocast.py``)."""
    for m in range(accum):
        with _fp16(cache=False):
            loss = lm_loss(model, data[step * accum + m]) / accum
        yield loss * 1e10 if step == OVERFLOW_STEP else loss


def _torch_steps(model, data, steps, accum):
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1, foreach=False
    )
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=SCALE["initial"],
        growth_factor=SCALE["growth_factor"],
        backoff_factor=SCALE["backoff_factor"],
        growth_interval=SCALE["growth_interval"],
    )
    losses, scales = [], []
    for s in range(steps):
        total = 0.0
        for loss in _losses(model, data, s, accum):
            scaler.scale(loss).backward()
            total += loss.item()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(total)
        scales.append(scaler.get_scale())
    return losses, scales


def _offload_steps(model, opt, data, steps, accum):
    losses, scales = [], []
    for s in range(steps):
        total = 0.0
        for loss in _losses(model, data, s, accum):
            opt.scale_loss(loss).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
        scales.append(opt.scaler.scale)
    return losses, scales


@pytest.mark.parametrize("param_dev,opt_dev", PLACEMENTS)
def test_fp16_autocast_with_loss_scaling_trains_as_torch_with_grad_scaler(
    tmp_path, param_dev, opt_dev
):
    """Three steps of two micro-batches: the first grows the scale to 2**17, the second
    overflows and is skipped (it backs off to 2**16), the third grows it again."""
    plain = make_model()
    data = batches(6, batch=2, seq=8)
    steps, accum = 3, 2
    ref = copy.deepcopy(plain)
    expected = _torch_steps(ref, data, steps, accum)
    assert expected[1] == [2.0**17, 2.0**16, 2.0**17]  # (what it exercises)
    cfg = placement_config(param_dev, opt_dev, tmp_path, loss_scale={"enabled": True, **SCALE})
    model, opt = offload.wrap(copy.deepcopy(plain), cfg)
    try:
        losses, scales = _offload_steps(model, opt, data, steps, accum)
        assert scales == expected[1] and opt.skipped_steps == 1
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(expected[0]), rtol=TOL, atol=0
        )
        sd, rsd = model.state_dict(), ref.state_dict()
        for k in rsd:
            torch.testing.assert_close(sd[k], rsd[k], rtol=TOL, atol=1e-7, msg=k)
    finally:
        opt.close()


def test_a_backward_from_an_unscaled_loss_is_refused(tmp_path):
    """The step divides the gradients by the scale: an unscaled loss would train 2**16 times too
    little, as with fp16 compute."""
    cfg = placement_config("cpu", "cpu", tmp_path, loss_scale={"enabled": True})
    model, opt = offload.wrap(make_model(), cfg)
    try:
        with _fp16():
            loss = lm_loss(model, batches(1, batch=2, seq=8)[0])
        with pytest.raises(PhaseError, match=r"optimizer\.scale_loss\(loss\)\.backward\(\)"):
            loss.backward()
    finally:
        opt.close()


@pytest.mark.parametrize(
    "placement,scaled,says",
    [("nvme", False, 1), ("nvme", True, 0), ("cpu", False, 0)],
    ids=["held-unscaled", "held-scaled", "in-p.grad"],
)
def test_fp16_autocast_without_loss_scaling_says_so_once(tmp_path, caplog, placement, scaled, says):
    """With no loss scaler (the default with fp32 compute) and the gradients held by offload
    (NVMe here), the first forward with gradients under fp16 autocast warns, naming
    ``loss_scale.enabled``; bf16 autocast and inference do not, nor a run that scales, nor one
    whose gradients stay in ``p.grad`` (cpu/cpu), where torch's GradScaler scales them."""
    over = {"loss_scale": {"enabled": True}} if scaled else {}
    cfg = placement_config(placement, placement, tmp_path, **over)
    model, opt = offload.wrap(make_model(), cfg)
    tokens = batches(1, batch=2, seq=8)[0]

    def said():
        return [r for r in caplog.records if "loss_scale.enabled" in r.getMessage()]

    try:
        with caplog.at_level(logging.WARNING, logger="offload"):
            with torch.no_grad(), _fp16():
                model(tokens)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = lm_loss(model, tokens)
            opt.scale_loss(loss).backward()
            opt.zero_grad()
            assert said() == []
            for _ in range(2):
                with _fp16():
                    loss = lm_loss(model, tokens)
                opt.scale_loss(loss).backward()
                opt.zero_grad()
        assert len(said()) == says
    finally:
        opt.close()
