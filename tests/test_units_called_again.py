"""A unit reached again within one backward, and a backward inside the model's forward.

A call of a unit under ``checkpoint(use_reentrant=True)`` runs a backward of its own, which
makes the unit's gradients final and releases it; the backward it is nested in may reach
another call of the unit after that. And ``torch.autograd.grad`` inside the model's forward
runs a whole backward there, which ended the forward. Each against plain PyTorch where it
trains, or refused with the documented error where offload takes the gradients out of
``p.grad``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from engine_models import placement_config
from torch.utils.checkpoint import checkpoint

import offload

# the gradients stay in p.grad (fp32, parameters and optimizer on the host): the rounds add up
KEPT = [("cpu", "cpu"), ("none", "cpu")]
# offload takes them (host gradient buffers, NVMe): refused
TAKEN = [("nvme", "cpu"), ("nvme", "nvme"), ("none", "nvme")]


class Blk(nn.Module):
    """A residual two-layer block; ``inner``: its body under a reentrant checkpoint (as a
    layer that checkpoints itself)."""

    def __init__(self, dim: int = 16, inner: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.inner = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim), inner

    def _body(self, x):
        return x + self.b(torch.tanh(self.a(x)))

    def forward(self, x):
        if self.inner:
            return checkpoint(self._body, x, use_reentrant=True)
        return self._body(x)


class Calls(nn.Module):
    """``blk`` called once per letter of ``order``: ``p`` plainly, ``R`` under
    ``checkpoint(use_reentrant=True)``; between two root layers and before another unit."""

    def __init__(self, order: str, inner: bool = False) -> None:
        super().__init__()
        self.order = order
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 1)
        self.blk, self.blk2 = Blk(inner=inner), Blk()

    def forward(self, x):
        x = self.inp(x)
        for call in self.order:
            x = self.blk(x) if call == "p" else checkpoint(self.blk, x, use_reentrant=True)
        return self.out(self.blk2(x))


class GradInForward(nn.Module):
    """A gradient with respect to an activation, taken inside the forward (no create_graph)
    and used as a feature; ``wrt_params``: with respect to ``b2``'s weight too."""

    def __init__(self, wrt_params: bool = False) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 1)
        self.b1, self.b2, self.wrt_params = Blk(), Blk(), wrt_params

    def forward(self, x):
        h = self.b1(self.inp(x))
        hh = h.detach().requires_grad_(True)
        wrt = (hh, self.b2.a.weight) if self.wrt_params else (hh,)
        gh = torch.autograd.grad(self.b2(hh).pow(2).sum(), wrt)[0]
        return self.out(self.b2(h + 0.01 * gh))


def _wrap(model: nn.Module, placement, tmp_path):
    cfg = placement_config(*placement, tmp_path)
    cfg["wrap"] = {"module_classes": ["Blk"]}
    return offload.wrap(model, cfg)


def _data(steps: int = 3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)) for _ in range(steps)]


def _trains_as_torch(model: nn.Module, placement, tmp_path) -> None:
    """Three steps of ``model`` wrapped and of its torch copy (AdamW) on the same batches: the
    gradients after each backward (where they stay in ``p.grad``) and the values after each
    step equal to 1e-6, and no warning of a read of released parameters."""
    torch.manual_seed(0)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    model, opt = _wrap(model, placement, tmp_path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*read between uses")
            for x, y in _data():
                F.mse_loss(ref(x), y).backward()
                F.mse_loss(model(x), y).backward()
                named = zip(model.named_parameters(), ref.parameters(), strict=True)
                for (name, p), q in named if placement in KEPT else ():
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
                for o in (ref_opt, opt):
                    o.step()
                    o.zero_grad()
                values = model.state_dict()
                for name, want in ref.state_dict().items():
                    torch.testing.assert_close(values[name], want, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        opt.close()


@pytest.mark.parametrize("order", ["pR", "pRp", "Rp", "RR", "Rpp"])
@pytest.mark.parametrize("placement", KEPT)
def test_a_unit_called_plainly_and_under_a_reentrant_checkpoint_trains_as_torch(
    tmp_path, placement, order
):
    """``x = blk(x); x = checkpoint(blk, x, use_reentrant=True)``: the checkpoint's backward
    made ``blk``'s gradients final and released it, then the backward it is nested in went
    through the plain call with the parameters released: ``blk.a``'s gradients and everything
    before the unit computed with zeros (half torch's, 2e-2 off after one step), with only a
    "read between uses" warning (until 2026-12-08)."""
    _trains_as_torch(Calls(order), placement, tmp_path)


@pytest.mark.parametrize("placement", KEPT)
def test_a_unit_checkpointing_its_body_called_twice_trains_as_torch(tmp_path, placement):
    """A unit whose forward checkpoints its own body (reentrant), called twice: the second
    call's recomputation raised "blk.a (Linear) was called outside the forward of its unit"
    (the first round's end had released the unit; until 2026-12-08)."""
    _trains_as_torch(Calls("pp", inner=True), placement, tmp_path)


@pytest.mark.parametrize(
    ("order", "inner"), [("pR", False), ("pRp", False), ("Rp", False), ("pp", True)]
)
@pytest.mark.parametrize("placement", TAKEN)
def test_where_offload_takes_the_gradients_a_reentrant_round_is_refused(
    tmp_path, placement, order, inner
):
    """Where offload takes the gradients out of ``p.grad`` a second round would be lost: the
    backward raises the documented error, naming the unit and use_reentrant=False, before it
    reads the released parameters (a unit checkpointing its body, called twice, raised "blk.a
    was called outside the forward of its unit" at nvme/nvme until 2026-12-08)."""
    model, opt = _wrap(Calls(order, inner=inner), placement, tmp_path)
    x, y = _data(1)[0]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*read between uses")
            loss = F.mse_loss(model(x), y)
            with pytest.raises(RuntimeError, match=r"unit blk .*use_reentrant=False"):
                loss.backward()
        opt.zero_grad()
        F.mse_loss(model(x), y)  # the engine is between steps again: a forward runs
    finally:
        opt.close()


@pytest.mark.parametrize("placement", [("cpu", "cpu"), ("nvme", "nvme"), ("none", "nvme")])
@pytest.mark.parametrize("wrt_params", [False, True])
def test_a_gradient_taken_inside_the_forward_trains_as_torch(tmp_path, placement, wrt_params):
    """``torch.autograd.grad`` inside the model's forward ran a whole backward there: its end
    released the root and went back to between steps, so the next root layer raised "out
    (Linear) was called outside the forward of its unit <root>" (until 2026-12-08). The
    forward now goes on with what it had gathered."""
    _trains_as_torch(GradInForward(wrt_params), placement, tmp_path)


class BackwardInForward(nn.Module):
    """A step's backward (one that reaches trainable parameters) inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out, self.b1 = nn.Linear(8, 16), nn.Linear(16, 1), Blk()

    def forward(self, x):
        h = self.b1(self.inp(x))
        h.pow(2).sum().backward(retain_graph=True)
        return self.out(h)


@pytest.mark.parametrize("placement", [("cpu", "cpu"), ("nvme", "nvme")])
def test_a_step_backward_inside_the_forward_is_refused(tmp_path, placement):
    """A backward that reaches trainable parameters inside the forward is refused, saying
    where it ran, before it takes a gradient; the engine is then between steps and trains."""
    model, opt = _wrap(BackwardInForward(), placement, tmp_path)
    x, y = _data(1)[0]
    try:
        with pytest.raises(RuntimeError, match="began inside the model's forward"):
            model(x)
        assert all(p.grad is None for p in model.parameters())
        model.forward = lambda t: model.out(model.b1(model.inp(t)))
        F.mse_loss(model(x), y).backward()
        opt.step()
    finally:
        opt.close()


def _func_transforms():
    """Functions of the model and the input (4 x 8) through ``torch.func``."""
    return {
        "grad": lambda m: torch.func.grad(lambda t: m(t).sum()),
        "jacrev": lambda m: torch.func.jacrev(lambda t: m(t).sum()),
        "vjp": lambda m: lambda t: torch.func.vjp(m, t)[1](torch.ones(4, 1))[0],
        "jvp": lambda m: lambda t: torch.func.jvp(m, (t,), (torch.ones_like(t),))[1],
        "vmap": lambda m: torch.func.vmap(m),
    }


@pytest.mark.parametrize("param_dev", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("transform", sorted(_func_transforms()))
def test_torch_func_of_the_input_computes_as_torch_or_is_refused(tmp_path, param_dev, transform):
    """``torch.func`` transforms of the wrapped model with respect to its input: the gathers'
    copies into the parameters' storage raised torch's "in-place operation (aten::copy_) that
    would mutate a captured Tensor" under ``grad``, ``vjp``, ``jacrev`` and ``jvp``, naming no
    offload, and ``grad`` raised an AttributeError at every placement (until 2026-12-08).
    They compute as torch's where the parameters stay on the device, ``jvp`` and ``vmap``
    everywhere; the backward of ``grad``, ``vjp`` and ``jacrev`` builds its graph
    (create_graph) and is refused where the parameters are released, naming torch.func. The
    model trains as before afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Blk(), Blk(), nn.Linear(16, 1))
    ref = copy.deepcopy(model)
    model, opt = _wrap(model, (param_dev, "cpu"), tmp_path)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    call = _func_transforms()[transform]
    try:
        if param_dev != "none" and transform in ("grad", "vjp", "jacrev"):
            with pytest.raises(RuntimeError, match="create_graph=True.*torch.func.grad"):
                call(model)(x)
        else:
            torch.testing.assert_close(call(model)(x), call(ref)(x), rtol=1e-5, atol=1e-6)
        F.mse_loss(model(x), y).backward()
        F.mse_loss(ref(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            if param_dev != "nvme":  # (the gradients stay in p.grad)
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
        opt.step()
    finally:
        opt.close()
