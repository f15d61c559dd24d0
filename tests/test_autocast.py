"""Training under ``torch.autocast`` (fp32 weights, bf16 matmuls): torch's numbers, and no
low-precision copy of the weights kept from the forward to the backward
(``offload/runtime/autocast.py``, its Note).

Autocast's matmuls save their bf16 copy of the weight for the backward. Before offload saved
a reference instead, every unit's copy stayed from the forward to the backward (a 100M
stack of 12 blocks: 184 MiB of bf16 copies), whatever the placement, and autocast's cache held
the trainable ones until the autocast region ended. Offload's forward computes what torch
computes with ``cache_enabled=False`` (a weight used twice in one forward is cast twice).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from engine_models import (
    STACK_DIM,
    STACK_VOCAB,
    LiveCasts,
    LoraLM,
    batches,
    lm_loss,
    make_model,
    placement_config,
)

import offload
from offload.runtime.autocast import _is_cast_of

PLACEMENTS = [("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")]
MODELS = {
    # tied embeddings, a block called twice, a checkpointed block, a frozen bias
    "tiny": (make_model, ["Block", "HugeCheapBlock"]),
    # frozen base layers beside trainable adapters (casts with no autograd history)
    "lora": (lambda: _seeded(LoraLM), ["LoraBlock", "FrozenBlock"]),
    "lora-reentrant": (lambda: _seeded(LoraLM, inner=True), ["LoraBlock", "FrozenBlock"]),
}
# The weights' tolerance after the steps. With TinyLM (a block called twice) under
# ``cache_enabled=False`` the gradients are bitwise torch's, but offload's global norm sums in
# another order than ``clip_grad_norm_``: 7.8254375 against torch's 7.8254371 in the first
# step (fp64: 7.8254379), as before offload saved references; Adam magnifies that one ulp of
# the clipping coefficient on elements whose gradient nearly cancels (1e-4 after three steps,
# the losses still equal).
ATOL = {"tiny": 1e-3, "lora": 1e-6, "lora-reentrant": 1e-6}


def _seeded(cls, **kw):
    torch.manual_seed(0)
    return cls(**kw)


def _autocast(cache: bool = True):
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache)


def _steps(model, opt, data, steps=3, accum=2, clip=1.0, cache=True):
    """Training under autocast as a user writes it (the forward and the loss inside, the
    backward outside); ``opt`` is torch's or offload's."""
    losses = []
    for s in range(steps):
        total = 0.0
        for m in range(accum):
            with _autocast(cache):
                loss = lm_loss(model, data[s * accum + m]) / accum
            loss.backward()
            total += loss.item()
        if clip:
            if isinstance(opt, torch.optim.AdamW):
                torch.nn.utils.clip_grad_norm_(
                    [p for p in model.parameters() if p.requires_grad], clip
                )
            else:
                opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("param_dev,opt_dev", PLACEMENTS)
def test_training_under_autocast_is_torchs_without_the_cast_cache(
    tmp_path, kind, param_dev, opt_dev
):
    build, classes = MODELS[kind]
    plain = build()
    data = batches(6, batch=2, seq=8)
    ref = copy.deepcopy(plain)
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1, foreach=False
    )
    expected = _steps(ref, ref_opt, data, cache=False)
    cfg = placement_config(param_dev, opt_dev, tmp_path, wrap={"module_classes": classes})
    model, opt = offload.wrap(copy.deepcopy(plain), cfg)
    try:
        assert _steps(model, opt, data) == expected  # bitwise: the same casts, the same sums
        sd, rsd = model.state_dict(), ref.state_dict()
        for k in rsd:
            torch.testing.assert_close(sd[k], rsd[k], rtol=0, atol=ATOL[kind], msg=k)
        assert torch.is_autocast_cache_enabled()  # the caller's setting came back
    finally:
        opt.close()


@pytest.mark.parametrize("kind", ["tiny", "lora"])
@pytest.mark.parametrize("param_dev", ["cpu", "nvme"])
def test_no_copy_of_the_weights_lives_from_the_forward_to_the_backward(tmp_path, kind, param_dev):
    """After a forward under autocast, torch holds a bf16 copy of (nearly) every weight for its
    backward; offload none. In a forward with gradients and in an inference, at most two at a
    time."""
    build, classes = MODELS[kind]
    plain = build()
    shapes = {tuple(p.shape) for p in plain.parameters() if p.dim() == 2}
    tokens = batches(1, batch=2, seq=8)[0]

    def forward(model, grad=True):
        casts = LiveCasts(shapes)
        with torch.set_grad_enabled(grad), _autocast(), casts:
            loss = lm_loss(model, tokens)
        return loss, casts

    loss, casts = forward(copy.deepcopy(plain))
    assert casts.live() >= 4  # what the counter sees in torch's forward
    cfg = placement_config(param_dev, "cpu", tmp_path, wrap={"module_classes": classes})
    model, opt = offload.wrap(copy.deepcopy(plain), cfg)
    try:
        loss, casts = forward(model)
        # at most the matmul's copy and, for a frozen weight, the one it is matched with
        assert casts.live() == 0 and casts.peak <= 2, (casts.live(), casts.peak)
        loss.backward()  # (each saved copy cast again, for its backward: the parity test)
        opt.step()
        opt.zero_grad()
        _, casts = forward(model, grad=False)  # the cache held each one to the end before
        assert casts.peak <= 2
    finally:
        opt.close()


@pytest.mark.parametrize("param_dev", ["cpu", "nvme"])
def test_an_autocast_the_models_forward_opens_is_found_at_its_first_unit(tmp_path, param_dev):
    """Accelerate's mixed precision wraps ``model.forward`` in autocast: the region opens after
    offload's root pre-hook ran (the Trainer's ``bf16=True`` on an fp32 model)."""
    plain = make_model()
    data = batches(6, batch=2, seq=8)
    shapes = {tuple(p.shape) for p in plain.parameters() if p.dim() == 2}

    def inside(model):
        model.forward = _autocast(cache=False)(model.forward)  # (torch's, as the reference)
        return model

    ref = inside(copy.deepcopy(plain))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    steps = dict(steps=3, accum=1, clip=0.0)
    expected = _steps(ref, ref_opt, data, cache=False, **steps)
    cfg = placement_config(param_dev, "cpu", tmp_path, gradient_clipping=0.0)
    model, opt = offload.wrap(copy.deepcopy(plain), cfg)
    model = inside(model)
    try:
        casts = LiveCasts(shapes)
        with casts:
            loss = lm_loss(model, data[0])
        # (the root's head, before the forward's end: cast and saved before the first unit
        # would stay; TinyLM's root casts only after its units)
        assert casts.live() == 0, casts.live()
        loss.backward()
        opt.zero_grad()
        model.load_state_dict(plain.state_dict())
        assert _steps(model, opt, data, cache=False, **steps) == expected
        assert torch.is_autocast_cache_enabled()  # as the region left it
    finally:
        opt.close()


def test_the_callers_saved_tensor_hooks_decide_what_is_saved(tmp_path):
    """Under the caller's own ``saved_tensors_hooks`` (``save_on_cpu``, a checkpoint of the
    whole model) offload puts none of its own in between: the caller's see the copies."""
    plain = make_model()
    data = batches(2, batch=2, seq=8)
    cfg = placement_config("cpu", "cpu", tmp_path)
    model, opt = offload.wrap(copy.deepcopy(plain), cfg)
    seen = []

    def pack(t):
        seen.append(t.dtype)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with _autocast():
                loss = lm_loss(model, data[0])
            loss.backward()
        assert torch.bfloat16 in seen
        opt.step()
    finally:
        opt.close()


def test_a_forward_where_saved_tensor_hooks_are_disabled_runs(tmp_path):
    """``disable_saved_tensors_hooks`` (``torch.func``'s transforms set it) makes pushing any
    raise with its message: offload pushes none there, and the forward runs (LoraLM: no
    checkpoint, which needs hooks itself)."""
    build, classes = MODELS["lora"]
    cfg = placement_config("cpu", "cpu", tmp_path, wrap={"module_classes": classes})
    model, opt = offload.wrap(build(), cfg)
    try:
        with torch.autograd.graph.disable_saved_tensors_hooks("not here"), _autocast():
            loss = lm_loss(model, batches(1, batch=2, seq=8)[0])
        loss.backward()
        opt.step()
    finally:
        opt.close()


def test_a_forward_that_raises_gives_the_cache_setting_and_the_hooks_back(tmp_path):
    model, opt = offload.wrap(make_model(), placement_config("cpu", "cpu", tmp_path))
    try:
        with _autocast(), pytest.raises(IndexError):
            model(torch.full((2, 8), 10_000))  # a token id past the embedding
        assert torch.is_autocast_cache_enabled()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        with _autocast():
            loss = lm_loss(model, batches(1, batch=2, seq=8)[0])  # and training goes on
        loss.backward()
        opt.step()
    finally:
        opt.close()


class SiblingBlock(nn.Module):
    """An attention's frozen q and o (one shape), a low-rank adapter beside them."""

    def __init__(self, dim: int = STACK_DIM) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.down = nn.Linear(dim, 4, bias=False)
        self.up = nn.Linear(4, dim, bias=False)
        for p in (*self.q.parameters(), *self.o.parameters()):
            p.requires_grad_(False)

    def forward(self, x):
        return x + self.o(F.gelu(self.q(x))) + self.up(self.down(x))


class SiblingLM(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(STACK_VOCAB, STACK_DIM)
        self.blocks = nn.Sequential(*(SiblingBlock() for _ in range(n)))
        self.head = nn.Linear(STACK_DIM, STACK_VOCAB)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def test_a_frozen_weights_cast_is_matched_to_it_not_to_a_sibling_of_its_shape(tmp_path):
    """An attention's q and o, frozen, have one shape: each cast is matched to its own weight
    (torch's numbers after three steps), and the sibling tried first is told apart by its
    first elements, not cast whole: a forward makes two whole casts a frozen weight (autocast's
    and the match's), where o's match cast q whole too before (5 a block, not 4)."""
    plain = _seeded(SiblingLM)
    data = batches(6, batch=2, seq=8)
    ref = copy.deepcopy(plain)
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1, foreach=False
    )
    expected = _steps(ref, ref_opt, data, cache=False)
    cfg = placement_config("cpu", "cpu", tmp_path, wrap={"module_classes": ["SiblingBlock"]})
    model, opt = offload.wrap(copy.deepcopy(plain), cfg)
    try:
        dim = STACK_DIM
        casts = LiveCasts({(dim, dim), (dim * dim,)})  # a weight's cast, whole or flat
        with casts, _autocast():
            loss = lm_loss(model, data[0])
        assert len(casts.refs) == 4 * len(model.blocks), len(casts.refs)
        loss.backward()
        opt.zero_grad()
        model.load_state_dict(plain.state_dict())
        assert _steps(model, opt, data) == expected
        sd, rsd = model.state_dict(), ref.state_dict()
        for k in rsd:
            torch.testing.assert_close(sd[k], rsd[k], rtol=0, atol=1e-6, msg=k)
    finally:
        opt.close()


def test_a_cast_is_its_weights_by_every_bit():
    """The match compares bits: a tensor equal to the cast in its first elements but one
    later, or in value but for a zero's sign, is not the cast (the backward's cast gives the
    cast's bits back); sizes and offsets that do not fill a wide word are compared too."""
    g = torch.Generator().manual_seed(0)
    p = torch.randn(300, 7, generator=g)
    t = p.to(torch.bfloat16)
    assert _is_cast_of(t, p)
    late = t.clone()
    late.view(-1)[-1] += 1  # (|p| < 128: one more is another bf16 value)
    assert not _is_cast_of(late, p)
    z = torch.zeros(3, 5)
    signed = z.to(torch.bfloat16)
    signed[2, 4] = -0.0
    assert torch.equal(signed, z.to(torch.bfloat16)) and not _is_cast_of(signed, z)
    odd = torch.randn(11, generator=g)[1:]  # 10 elements at offset 1
    assert _is_cast_of(odd.to(torch.float16)[1:], odd[1:])
    assert not _is_cast_of(odd.to(torch.float16)[1:], odd[:-1])


class _MlpBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 32), nn.Linear(32, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class _Mlp(nn.Module):
    """Linear layers alone: under autocast torch's graph saves only their casts, so its
    backward runs on after a step (a LayerNorm saves its fp32 weight, and torch raises)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_MlpBlock() for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize(
    "param_dev,opt_dev,step_in_backward",
    [("none", "cpu", None), ("cpu", "cpu", None), ("nvme", "nvme", True), ("nvme", "nvme", False)],
)
def test_a_backward_through_a_graph_saved_before_the_step_is_refused(
    tmp_path, param_dev, opt_dev, step_in_backward
):
    """A graph kept over a step (``retain_graph=True``, a GAN loop's slip) under autocast: torch
    runs its backward on the copies it saved, the weights of before the step; offload, which
    casts the weights again in the backward (module Note), ran it on the stepped weights,
    unsaid (1.7e-2 off torch's weights after two steps). It raises torch's "modified by an
    inplace operation" error, naming the weight, and after ``zero_grad()`` training goes on as
    torch's, whose backward there went to gradients that ``zero_grad()`` dropped."""
    plain = _Mlp()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)]

    def loss_of(m, x, y):
        with _autocast(cache=False):
            return F.mse_loss(m(x).float(), y)

    ref = copy.deepcopy(plain)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    cfg = placement_config(param_dev, opt_dev, tmp_path, wrap={"module_classes": ["_MlpBlock"]})
    if opt_dev == "nvme":  # (the update in the backward is the NVMe optimizer's)
        cfg["offload_optimizer"]["step_in_backward"] = step_in_backward
    model, opt = offload.wrap(copy.deepcopy(plain), cfg)
    try:
        for m, o in ((ref, ref_opt), (model, opt)):
            loss = loss_of(m, *data[0])
            loss.backward(retain_graph=True)
            o.step()
            if o is opt:
                said = r"modified by an inplace operation: the parameter \S+ is at version"
                with pytest.raises(RuntimeError, match=said):
                    loss.backward()
            else:
                loss.backward()  # (torch's: on the copies of before the step)
            o.zero_grad()
            for x, y in data[1:]:
                loss_of(m, x, y).backward()
                o.step()
                o.zero_grad()
        sd, rsd = model.state_dict(), ref.state_dict()
        for k in rsd:
            torch.testing.assert_close(sd[k], rsd[k], rtol=0, atol=1e-6, msg=k)
    finally:
        opt.close()
