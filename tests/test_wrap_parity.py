"""offload.wrap against plain PyTorch, step by step, for every placement.

Same seed, deep-copied model, the reference loop run separately: 30 steps of gradient
accumulation 4 with clipping and an LR schedule on a model with tied embeddings, a block called
twice, activation checkpointing, a frozen parameter, buffers, root parameters and a huge-and-cheap
block (see engine_models.py).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from engine_models import (
    STACK_DIM,
    StackBlock,
    StackLM,
    batches,
    make_model,
    placement_config,
    reference_fp32,
    reference_mixed,
    train_wrapped,
)
from torch.overrides import TorchFunctionMode

import offload
from offload.runtime.phase import PhaseError

STEPS, ACCUM, CLIP = 30, 4, 1.0
PLACEMENTS = [(p, o) for p in ("none", "cpu", "nvme") for o in ("cpu", "nvme")]


@pytest.fixture(scope="module")
def fp32_reference():
    data = batches(16)
    model, losses = reference_fp32(make_model(), data, STEPS, ACCUM, CLIP)
    return data, model.state_dict(), losses


def _assert_params_close(sd, ref_sd, rtol, atol):
    assert set(sd) == set(ref_sd)
    for name, ref in ref_sd.items():
        got = sd[name]
        assert got.numel() == ref.numel() and got.shape == ref.shape, name
        torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("param_dev,opt_dev", PLACEMENTS)
def test_fp32_parity(tmp_path, fp32_reference, param_dev, opt_dev):
    data, ref_sd, ref_losses = fp32_reference
    model = make_model()
    params_before = list(model.parameters())
    model, opt = offload.wrap(model, placement_config(param_dev, opt_dev, tmp_path))
    try:
        losses, _ = train_wrapped(model, opt, data, STEPS, ACCUM, CLIP)
        assert list(model.parameters()) == params_before  # the same Parameter objects
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0
        )
        _assert_params_close(model.state_dict(), ref_sd, rtol=1e-5, atol=1e-7)
        assert losses[-1] < losses[0] * 0.9  # it trained
    finally:
        opt.close()


@pytest.mark.parametrize("param_dev,opt_dev", [("none", "cpu"), ("nvme", "nvme"), ("cpu", "nvme")])
def test_fp32_parity_through_flat_grads(tmp_path, fp32_reference, param_dev, opt_dev):
    """The path CUDA takes (grads flattened and accumulated into fp32 host/NVMe shards) on CPU."""
    data, ref_sd, ref_losses = fp32_reference
    model, opt = offload.wrap(
        make_model(), placement_config(param_dev, opt_dev, tmp_path), _keep_grads=False
    )
    try:
        losses, _ = train_wrapped(model, opt, data, STEPS, ACCUM, CLIP)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0
        )
        _assert_params_close(model.state_dict(), ref_sd, rtol=1e-5, atol=1e-7)
    finally:
        opt.close()


@pytest.mark.parametrize("param_dev,opt_dev", [("none", "cpu"), ("nvme", "nvme"), ("cpu", "nvme")])
def test_bf16_parity_with_mixed_precision_reference(tmp_path, param_dev, opt_dev):
    data = batches(16)
    steps, accum = 10, 2
    ref, ref_losses = reference_mixed(make_model(), data, steps, accum, CLIP, torch.bfloat16)
    model, opt = offload.wrap(
        make_model(), placement_config(param_dev, opt_dev, tmp_path, dtype="bf16")
    )
    try:
        losses, _ = train_wrapped(model, opt, data, steps, accum, CLIP)
        # both run the same bf16 compute from the same fp32 masters: equal up to bf16 rounding
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=0
        )
        _assert_params_close(model.state_dict(), ref.state_dict(), rtol=1e-2, atol=1e-3)
        for p in model.parameters():
            assert p.dtype == torch.bfloat16
    finally:
        opt.close()


def test_adam_mode_and_no_clipping(tmp_path):
    data = batches(8)
    ref_model = make_model()
    torch_opt = torch.optim.Adam(
        [p for p in ref_model.parameters() if p.requires_grad],
        lr=1e-2,
        weight_decay=0.1,
        foreach=False,
    )
    cfg = placement_config("cpu", "nvme", tmp_path)
    cfg["optimizer"] = {"type": "adam", "lr": 1e-2, "weight_decay": 0.1}
    model, opt = offload.wrap(make_model(), cfg)
    from engine_models import lm_loss

    try:
        for s in range(10):
            for m, o in ((ref_model, torch_opt), (model, opt)):
                lm_loss(m, data[s % 8]).backward()
                o.step()
                o.zero_grad()
        _assert_params_close(model.state_dict(), ref_model.state_dict(), rtol=1e-5, atol=1e-7)
    finally:
        opt.close()


@pytest.mark.parametrize(
    "param_dev,dtype,over",
    [
        ("cpu", "fp32", {}),
        ("nvme", "fp32", {}),
        ("nvme", "bf16", {}),
        ("none", "fp32", {}),
        ("nvme", "fp32", {"reentrant": False}),
        ("cpu", "fp32", {"reentrant": True}),
        ("cpu", "fp32", {"inner": True}),
        ("nvme", "fp32", {"inner": False}),
        ("nvme", "fp32", {"step_in_backward": True}),
        ("cpu", "fp32", {"step_in_backward": True, "persistent": True}),
    ],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None,
)
def test_frozen_layers_inside_units_pass_their_gradient_on(tmp_path, param_dev, dtype, over):
    """LoRA: the backward of a unit's frozen layers (its base layers) comes after the last
    gradient of its trainable ones. The unit was released at that gradient, and the frozen
    layers then computed their input's gradient from released storage (zeros): the embedding's
    gradient lost that path, 1e-2 off torch after one step, without an error. With a reentrant
    checkpoint inside the unit's forward (transformers' layers), that gradient comes in the
    checkpoint's inner backward, which does not hold the unit's input node."""
    from engine_models import LoraLM

    data = batches(6, seq=10)
    steps, accum = 3, 2
    shape = {k: over[k] for k in ("reentrant", "inner") if k in over}
    torch.manual_seed(0)
    ref_model = LoraLM(**shape)
    if dtype == "fp32":
        ref, ref_losses = reference_fp32(ref_model, data, steps, accum, CLIP)
        tol = {"rtol": 1e-5, "atol": 1e-7}
    else:
        ref, ref_losses = reference_mixed(ref_model, data, steps, accum, CLIP, torch.bfloat16)
        tol = {"rtol": 1e-2, "atol": 1e-3}
    torch.manual_seed(0)
    opt_dev = "nvme" if over.get("step_in_backward") else "cpu"  # (where it runs)
    cfg = placement_config(param_dev, opt_dev, tmp_path, dtype=dtype)
    cfg["wrap"] = {"module_classes": ["LoraBlock", "FrozenBlock"]}
    if over.get("step_in_backward"):
        cfg["offload_optimizer"]["step_in_backward"] = True
        cfg["gradient_accumulation_steps"] = accum
    if over.get("persistent"):  # kept from first use to the step: released by the update
        cfg["offload_param"]["persistence_threshold"] = 10**6
    model, opt = offload.wrap(LoraLM(**shape), cfg)
    runtime = opt._engine
    gathered_at_the_embedding = []

    def count_gathered(grad):
        units = runtime.units[1:]
        gathered_at_the_embedding.append(sum(runtime.params.gathered(u) for u in units))

    def hook_the_output(module, args, out):
        out.register_hook(count_gathered)

    model.embed.register_forward_hook(hook_the_output)
    try:
        losses, _ = train_wrapped(model, opt, data, steps, accum, CLIP)
        # the blocks were still released in the backward, each after its frozen layers ran
        assert len(gathered_at_the_embedding) == steps * accum
        if param_dev != "none" and not over.get("persistent"):
            assert max(gathered_at_the_embedding) <= 1, gathered_at_the_embedding
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=tol["rtol"], atol=0
        )
        _assert_params_close(model.state_dict(), ref.state_dict(), **tol)
    finally:
        opt.close()


def _inputs_require_grad(module, args, out):
    """transformers' ``enable_input_require_grads``: a frozen embedding's output needs a
    gradient, or a reentrant checkpoint after it computes none."""
    out.requires_grad_(True)


@pytest.mark.parametrize(
    "param_dev,opt_dev", [("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "nvme")]
)
def test_adapters_only_inside_reentrant_checkpoints_train(tmp_path, param_dev, opt_dev):
    """LoRA on a frozen model (embedding and head frozen) with every block under
    ``checkpoint(use_reentrant=True)``: when the backward begins the graph reaches no trainable
    parameter (the recomputations build it inside the backward), so it was taken for a backward
    of the inputs alone: the gradients offload holds were dropped and ``step()`` raised "no
    backward since the last step" on every placement. It now trains as torch."""
    from engine_models import LoraLM

    data = batches(6, seq=10)
    steps, accum = 3, 2

    def frozen_root_lora():
        torch.manual_seed(0)
        model = LoraLM(reentrant=True)
        model.embed.requires_grad_(False)
        model.head.requires_grad_(False)
        model.embed.register_forward_hook(_inputs_require_grad)
        return model

    ref, ref_losses = reference_fp32(frozen_root_lora(), data, steps, accum, CLIP)
    cfg = placement_config(param_dev, opt_dev, tmp_path)
    cfg["wrap"] = {"module_classes": ["LoraBlock", "FrozenBlock"]}
    if opt_dev == "nvme":  # (the step in backward)
        cfg["gradient_accumulation_steps"] = accum
    model, opt = offload.wrap(frozen_root_lora(), cfg)
    try:
        losses, _ = train_wrapped(model, opt, data, steps, accum, CLIP)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0
        )
        _assert_params_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-7)
    finally:
        opt.close()


@dataclasses.dataclass
class _BlockOut:
    hidden: torch.Tensor
    unused: torch.Tensor


class _PlainOut:
    """A result class of the user's own: attributes, no pytree, no dataclass."""

    def __init__(self, hidden, unused) -> None:
        self.hidden, self.unused = hidden, unused


class _SlotsOut:
    __slots__ = ("hidden", "unused")

    def __init__(self, hidden, unused) -> None:
        self.hidden, self.unused = hidden, unused


_OUTPUTS = {
    "dataclass": _BlockOut,
    "object": _PlainOut,
    "slots": _SlotsOut,
    "namespace": types.SimpleNamespace,
}


class _ObjectBlock(StackBlock):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return _OUTPUTS[self.kind](hidden=super().forward(x), unused=x)


class _ObjectLM(StackLM):
    """Units and the model return objects the pytree takes as one leaf each."""

    def __init__(self, kind: str) -> None:
        super().__init__(n=3, block=lambda: _ObjectBlock(kind))
        self.kind = kind

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x).hidden
        return _OUTPUTS[self.kind](hidden=self.head(x), unused=None)


@pytest.mark.parametrize("kind", list(_OUTPUTS))
@pytest.mark.parametrize("param_dev", ["cpu", "nvme"])
def test_outputs_in_objects_train_as_torch(tmp_path, param_dev, kind):
    """A forward returning its tensors inside an object the pytree takes as one leaf (a plain
    dataclass; since 2026-12-08 also a class of the user's own, one with ``__slots__``, a
    ``SimpleNamespace``): a unit returning one got no pre-backward gather and a model
    returning one was taken for an inference (its units let go before the backward): the
    backward ran on released parameters, 7e-2 off torch after two steps, only the "read
    between uses" warning."""
    torch.manual_seed(0)
    model = _ObjectLM(kind)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1, foreach=False
    )
    cfg = placement_config(param_dev, "cpu", tmp_path)
    cfg["wrap"] = {"module_classes": ["_ObjectBlock"]}
    model, opt = offload.wrap(model, cfg)
    try:
        for tokens in batches(3, batch=2, seq=8):
            for m, o in ((ref, ref_opt), (model, opt)):
                logits = m(tokens[:, :-1]).hidden
                F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
                ).backward()
                o.step()
                o.zero_grad()
        _assert_params_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-7)
    finally:
        opt.close()


@pytest.mark.parametrize("param_dev", ["none", "cpu", "nvme", "persistent"])
@pytest.mark.parametrize("wrt", ["input", "params"])
def test_a_gradient_penalty_trains_as_torch_or_is_refused(tmp_path, param_dev, wrt):
    """A loss holding a gradient (``autograd.grad(create_graph=True)``: WGAN-GP's penalty on
    the input's gradient, a penalty on the parameters' gradient). Its backward goes through
    the graph the first one built, which holds the parameters: released ones read zeros (5e-2
    to 8e-2 off torch after one step, no error). Refused where offload releases them, before
    anything is taken (a plain step follows); as torch where they stay on the device, and
    where every unit is persistent (kept to the step) and the root holds no parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(StackBlock(), StackBlock(), nn.Linear(STACK_DIM, 1))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    persistent = param_dev == "persistent"
    cfg = placement_config("cpu" if persistent else param_dev, "cpu", tmp_path)
    cfg["wrap"] = {"module_classes": ["StackBlock", "Linear"] if persistent else ["StackBlock"]}
    if persistent:
        cfg["offload_param"]["persistence_threshold"] = 10**6
    model, opt = offload.wrap(model, cfg)
    x = torch.randn(4, 3, STACK_DIM, generator=torch.Generator().manual_seed(1))

    def penalized(m):
        h = x.clone().requires_grad_(True)
        out = m(h).pow(2).mean()
        wrt_what = [h] if wrt == "input" else list(m[1].parameters())
        grads = torch.autograd.grad(out, wrt_what, create_graph=True)
        return out + sum(g.pow(2).sum() for g in grads)

    try:
        penalized(ref).backward()
        ref_opt.step()
        if param_dev in ("none", "persistent"):
            penalized(model).backward()
            opt.step()
            _assert_params_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-7)
            return
        with pytest.raises(PhaseError, match="create_graph=True .* released parameters"):
            penalized(model).backward()
        opt.zero_grad()
        model(x).pow(2).mean().backward()  # the engine is between steps: a plain step runs
        opt.step()
    finally:
        opt.close()


@pytest.mark.parametrize(
    "param_dev,opt_dev", [("none", "nvme"), ("nvme", "nvme"), ("cpu", "cpu"), ("cpu", "nvme")]
)
def test_a_backward_to_the_inputs_only_is_not_a_micro_step(tmp_path, param_dev, opt_dev):
    """Adversarial training: each step first takes the input's gradient (``autograd.grad`` with
    respect to the input; ``backward(inputs=[x])``), then trains on the perturbed input.
    That backward was counted as one of the step's: with the update in the last backward
    (NVMe optimizer, "auto" accumulation learned as 1 from a first step without it) it ran the
    update, and the training forward after it was refused. It reaches no parameter now: the
    units are gathered for it and released, the gradients and the count left alone."""
    torch.manual_seed(0)
    model = nn.Sequential(StackBlock(), StackBlock(), nn.Linear(STACK_DIM, 1))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    cfg = placement_config(param_dev, opt_dev, tmp_path)
    cfg["wrap"] = {"module_classes": ["StackBlock"]}
    model, opt = offload.wrap(model, cfg)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 3, STACK_DIM, generator=gen) for _ in range(4)]

    def step(m, o, x, s):
        if s >= 1:  # (the first step has none: "auto" counts one backward)
            xi = x.clone().requires_grad_(True)
            if s % 2:
                (g,) = torch.autograd.grad(m(xi).sum(), xi)
            else:
                m(xi).sum().backward(inputs=[xi])
                g = xi.grad
            x = (x + 0.1 * g).detach()
        (m(x) - 1).pow(2).mean().backward()
        o.step()
        o.zero_grad()

    try:
        for s, x in enumerate(data):
            step(ref, ref_opt, x, s)
            step(model, opt, x, s)
        _assert_params_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-7)
        if param_dev != "none":
            assert not any(opt._engine.params.gathered(u) for u in opt._engine.units[1:])
    finally:
        opt.close()


def test_torch_compile_traces_a_block_once_whatever_the_number_of_units(tmp_path):
    """Dynamo traced offload's hooks into its gathers and IO queue, guarding on offsets,
    sizes, unit indices and the set of gathered units: each unit recompiled the user's block
    forward (12 blocks: it hit torch's recompile limit, and the later blocks ran uncompiled)
    and offload's internals. The hooks are opaque to dynamo now, and a part's check inside its
    unit reads its unit's flag alone: 10 blocks compile as many graphs as 3."""

    def graphs(blocks: int) -> int:
        made = []

        def backend(gm, example_inputs):
            made.append(gm)
            return gm.forward

        torch.manual_seed(0)
        model = nn.Sequential(*(StackBlock() for _ in range(blocks)), nn.Linear(STACK_DIM, 1))
        cfg = placement_config("nvme", "cpu", tmp_path / str(blocks))
        cfg["wrap"] = {"module_classes": ["StackBlock"]}
        model, opt = offload.wrap(model, cfg)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        try:
            for _ in range(2):
                (compiled(torch.randn(2, 3, STACK_DIM)) - 1).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            opt.close()
            torch._dynamo.reset()
        return len(made)

    assert graphs(10) == graphs(3)


@pytest.mark.parametrize("param_dev", ["none", "nvme"])
def test_torch_compile_of_the_wrapped_model_trains_as_torch(tmp_path, param_dev):
    """``torch.compile(model)`` after wrap failed inside dynamo (an AttributeError on
    ``named_parameters.__func__``: offload's overrides on the model were plain functions).
    Dynamo's own backend ("eager") keeps the test fast; the hooks break the graph at each unit
    as they do under FSDP2."""
    torch.manual_seed(0)
    model = nn.Sequential(StackBlock(), StackBlock(), nn.Linear(STACK_DIM, 1))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    cfg = placement_config(param_dev, "cpu", tmp_path)
    cfg["wrap"] = {"module_classes": ["StackBlock"]}
    model, opt = offload.wrap(model, cfg)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    gen = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            x = torch.randn(4, 3, STACK_DIM, generator=gen)
            for m, o in ((ref, ref_opt), (compiled, opt)):
                (m(x) - 1).pow(2).mean().backward()
                o.step()
                o.zero_grad()
        _assert_params_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-6)
    finally:
        opt.close()
        torch._dynamo.reset()


@pytest.mark.parametrize("param_dev", ["cpu", "nvme"])
def test_a_model_compiled_before_wrap_runs_through_the_hooks_after_it(tmp_path, param_dev):
    """Dynamo does not guard a compiled frame on its modules' hooks (by default), so code it
    compiled without offload's hooks - the model's own, compiled and run before wrap, or a
    torch baseline's of its class, compiled beside it - ran on the wrapped model without them:
    on the released parameters' zeros, the loss and the update wrong, with no error (0.0 for an
    output of 0.49). wrap turns dynamo's hook guards on and drops the frames compiled
    without them."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(StackBlock(), StackBlock(), nn.Linear(STACK_DIM, 1))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    compiled_ref = torch.compile(ref, backend="eager")
    x0 = torch.randn(4, 3, STACK_DIM)
    with torch.no_grad():
        want = compiled_ref(x0)  # compiled and run before the wrap, as a baseline is
        torch.compile(model, backend="eager")(x0)  # and the model itself, once
    cfg = placement_config(param_dev, "cpu", tmp_path)
    cfg["wrap"] = {"module_classes": ["StackBlock"]}
    model, opt = offload.wrap(model, cfg)
    compiled = torch.compile(model, backend="eager")
    gen = torch.Generator().manual_seed(1)
    try:
        with torch.no_grad():
            torch.testing.assert_close(compiled(x0), want, rtol=0, atol=0)
        for _ in range(3):
            x = torch.randn(4, 3, STACK_DIM, generator=gen)
            losses = []
            for m, o in ((compiled_ref, ref_opt), (compiled, opt)):
                loss = (m(x) - 1).pow(2).mean()
                loss.backward()
                o.step()
                o.zero_grad()
                losses.append(loss.item())
            assert losses[1] == pytest.approx(losses[0], rel=1e-5)
        _assert_params_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-6)
    finally:
        opt.close()
        torch._dynamo.reset()


def _train_beside_torch(ref, ref_opt, model, opt) -> None:
    """Three steps of a wrapped language model and of its torch copy on the same batches, the
    losses equal (1e-6) at each step."""
    for tokens in batches(3, batch=2, seq=8):
        losses = []
        for m, o in ((ref, ref_opt), (model, opt)):
            logits = m(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def _hooked_stack(tmp_path, param_dev: str, opt_dev: str, hook_up):
    """A 3-block StackLM and its torch copy (AdamW), the copy wrapped, ``hook_up`` run on
    both after wrap: (ref, ref_opt, model, opt)."""
    torch.manual_seed(0)
    model = StackLM(n=3, frozen=False)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    cfg = placement_config(param_dev, opt_dev, tmp_path)
    cfg["wrap"] = {"module_classes": ["StackBlock"]}
    model, opt = offload.wrap(model, cfg)
    hook_up(ref)
    hook_up(model)
    return ref, ref_opt, model, opt


@pytest.mark.parametrize("param_dev", ["cpu", "nvme"])
def test_hooks_registered_after_wrap_read_their_unit_gathered(tmp_path, param_dev):
    """Forward hooks the user registers on a unit's module after ``wrap`` (a penalty on the
    block's weights added to its output) ran after offload's release, and a pre-hook with
    ``prepend=True`` before its gather: both read the weights as zeros, 1.6e-2 off torch's loss
    in the first step, no error. Offload's gather and release stay the outermost hooks."""

    def hook_up(m):
        blocks = m.blocks
        blocks[1].register_forward_hook(lambda mod, a, o: o + 0.1 * mod.fc1.weight.sum())
        blocks[2].register_forward_pre_hook(
            lambda mod, a: (a[0] * mod.fc2.weight.mean(),), prepend=True
        )

    ref, ref_opt, model, opt = _hooked_stack(tmp_path, param_dev, "cpu", hook_up)
    try:
        _train_beside_torch(ref, ref_opt, model, opt)
        _assert_params_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-7)
    finally:
        opt.close()


class _RootUsesABlockWeight(nn.Module):
    """The model uses a block's weight itself (``F.linear``), holding it as its own attribute
    too: a parameter registered in a unit and outside every unit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, STACK_DIM)
        self.blocks = nn.Sequential(StackBlock(), StackBlock(), StackBlock())
        self.proj = self.blocks[2].fc2.weight  # (STACK_DIM, 3 * STACK_DIM)
        self.head = nn.Linear(STACK_DIM, 64)

    def forward(self, tokens):
        x = self.blocks[0](self.embed(tokens))
        x = F.linear(x, self.proj[:, :STACK_DIM])  # before blocks[2] runs
        return self.head(self.blocks[2](self.blocks[1](x)))


@pytest.mark.parametrize("param_dev,opt_dev", [("cpu", "cpu"), ("nvme", "nvme")])
def test_a_block_weight_the_model_also_holds_is_the_roots(tmp_path, param_dev, opt_dev):
    """A parameter registered on a block and on a module outside every unit (the model itself)
    was owned by the block alone and released outside its forward: the model's own use read
    zeros, 6e-2 off torch's loss in the first step, no error. It belongs to the root now, as a
    parameter shared by two units does."""
    from offload.plan import build_units

    torch.manual_seed(0)
    model = _RootUsesABlockWeight()
    units = build_units(model, ["StackBlock"], 0, persistence_threshold=None)
    assert [u.index for u in units if any(p is model.proj for p in u.params)] == [0]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    cfg = placement_config(param_dev, opt_dev, tmp_path)
    cfg["wrap"] = {"module_classes": ["StackBlock"]}
    model, opt = offload.wrap(model, cfg)
    try:
        _train_beside_torch(ref, ref_opt, model, opt)
        _assert_params_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-7)
    finally:
        opt.close()


@pytest.mark.parametrize("hook", ["module", "inner layer", "module pre"])
@pytest.mark.parametrize("param_dev,opt_dev", [("cpu", "cpu"), ("nvme", "nvme"), ("none", "nvme")])
def test_backward_hooks_on_a_unit_read_its_weights_as_torch(tmp_path, param_dev, opt_dev, hook):
    """A full backward hook on a block that reads the block's weights (a gradient rescaled by
    a weight statistic) runs as the block's inputs' gradients are computed, after its
    parameters' last gradient: it read them released (zeros, 5e-6 off torch after a step) or,
    where the update ran in the backward (parameters on the device, the NVMe optimizer),
    already updated (3e-6). The unit now waits for its inputs' gradients, as one holding
    frozen layers does. So does one whose inner layer has such a hook (``inner layer``: it
    read zeros with a warning, 3.2e-2 off torch in three steps, or at ``none`` the update in
    flight, until 2026-12-07). A full backward pre-hook on the block (``module pre``) runs
    before the tensor hook on the block's outputs that gathers it (torch wraps the outputs
    after the forward hooks): it read zeros and the gather raised; offload's gather runs
    first in it now."""

    seen = {}  # model -> the weight statistic its hook read, backward after backward

    def hook_up(m):
        def rescale(mod, grad_in, grad_out):
            stat = mod.weight.abs().mean() if hook == "inner layer" else mod.fc1.weight.abs().mean()
            seen.setdefault(id(m), []).append(float(stat))
            return (grad_in[0] * (1 + stat),)

        def rescale_out(mod, grad_out):
            stat = mod.fc2.weight.abs().mean()
            seen.setdefault(id(m), []).append(float(stat))
            return (grad_out[0] * (1 + stat),)

        if hook == "module":
            m.blocks[1].register_full_backward_hook(rescale)
        elif hook == "inner layer":
            m.blocks[1].fc1.register_full_backward_hook(rescale)
        else:
            m.blocks[1].register_full_backward_pre_hook(rescale_out)

    ref, ref_opt, model, opt = _hooked_stack(tmp_path, param_dev, opt_dev, hook_up)
    try:
        _train_beside_torch(ref, ref_opt, model, opt)
        assert seen[id(model)] == pytest.approx(seen[id(ref)], rel=1e-6)
        _assert_params_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-6)
    finally:
        opt.close()
    users = [*model.blocks[1]._backward_pre_hooks.values()]  # the user's own again
    assert [h.__name__ for h in users] == (["rescale_out"] if hook == "module pre" else [])


class _ReadsOtherBlocksWeights(nn.Module):
    """Code outside a unit reads a unit's weight directly and holds it nowhere: the model's
    forward ``F.linear`` with ``blocks[2].fc2.weight`` before that block runs, and
    ``blocks[1]``'s forward with ``blocks[0].fc1.weight`` after that block released it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, STACK_DIM)
        self.blocks = nn.Sequential(_PeekBlock(), _PeekBlock(), _PeekBlock())
        self.head = nn.Linear(STACK_DIM, 64)

    def forward(self, tokens):
        x = self.blocks[0](self.embed(tokens))
        x = F.linear(x, self.blocks[2].fc2.weight[:, :STACK_DIM])
        x = self.blocks[1](x, peek=self.blocks[0])
        return self.head(self.blocks[2](x))


class _PeekBlock(StackBlock):
    def forward(self, x, peek=None):
        if peek is not None:
            x = x + F.linear(x, peek.fc1.weight[:STACK_DIM])
        return super().forward(x)


def _register_reads(model: _ReadsOtherBlocksWeights) -> None:
    offload.register_external_parameter(model, model.blocks[2].fc2.weight)
    offload.register_external_parameter(model.blocks[1], model.blocks[0].fc1.weight)


@pytest.mark.parametrize("param_dev,opt_dev", [("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_register_external_parameter_trains_as_torch(tmp_path, param_dev, opt_dev):
    """Unregistered, the two reads saw released weights (zeros on the CPU): 3.3e-2 off
    torch's loss in the first step, 6e-2 off in the weights after three, no error (with the
    parameters on the device, ``none``, nothing is released and it trained as torch's: there
    the planning check below is what the call changes). Registered, both weights are the
    root's (one read by the root, one by two units) and the model trains as torch's, through
    gradient accumulation and clipping; their names stay where the model registers them."""
    from offload.plan import build_units

    torch.manual_seed(0)
    model = _ReadsOtherBlocksWeights()
    ref = copy.deepcopy(model)
    names = [n for n, _ in model.named_parameters()]
    _register_reads(model)
    _register_reads(model)  # idempotent
    read = (model.blocks[2].fc2.weight, model.blocks[0].fc1.weight)
    units = build_units(model, ["_PeekBlock"], 0, persistence_threshold=None)
    assert [[u.index for u in units if any(p is r for p in u.params)] for r in read] == [[0], [0]]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    cfg = placement_config(param_dev, opt_dev, tmp_path)
    cfg["wrap"] = {"module_classes": ["_PeekBlock"]}
    model, opt = offload.wrap(model, cfg)
    try:
        assert [n for n, _ in model.named_parameters()] == names
        for step, tokens in enumerate(batches(3, batch=4, seq=8)):
            losses = []
            for m, o in ((ref, ref_opt), (model, opt)):
                total = 0.0
                for half in tokens.chunk(2):  # accumulation 2
                    logits = m(half[:, :-1])
                    loss = F.cross_entropy(logits.reshape(-1, 64), half[:, 1:].reshape(-1)) / 2
                    loss.backward()
                    total += loss.item()
                if o is opt:
                    opt.clip_grad_norm_(CLIP)
                else:
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
                o.step()
                o.zero_grad()
                losses.append(total)
            assert losses[1] == pytest.approx(losses[0], rel=1e-6), step
        assert list(model.state_dict()) == list(ref.state_dict())
        # blocks.2.fc2.weight: Adam turns the rounding of its two summed uses into 1e-6 (torch
        # against torch with the sum's order swapped: 1e-6); unregistered, 1e-2
        _assert_params_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=3e-6)
    finally:
        opt.close()


def test_register_external_parameter_after_wrap_says_to_call_it_before(tmp_path):
    torch.manual_seed(0)
    model, opt = offload.wrap(
        _ReadsOtherBlocksWeights(),
        placement_config("cpu", "cpu", tmp_path, wrap={"module_classes": ["_PeekBlock"]}),
    )
    try:
        with pytest.raises(ValueError, match=r"'blocks\.2\.fc2\.weight'.*before offload\.wrap"):
            offload.register_external_parameter(model, model.blocks[2].fc2.weight)
    finally:
        opt.close()
    with pytest.raises(TypeError, match="nn.Parameter"):
        offload.register_external_parameter(model, model.blocks[2].fc2.weight.detach())
    from offload.plan import build_units

    other = _ReadsOtherBlocksWeights()
    offload.register_external_parameter(other.blocks[0], nn.Parameter(torch.zeros(2)))
    with pytest.raises(ValueError, match=r"module 'blocks\.0' .* not this model's"):
        build_units(other, ["_PeekBlock"], 0, persistence_threshold=None)


@pytest.mark.parametrize("param_dev", ["cpu", "nvme"])
def test_check_reads_names_a_released_parameter_read_outside_its_unit(tmp_path, param_dev):
    """``wrap.check_reads``: the reads that computed with zeros without an error raise in the
    first forward, naming the parameter, its unit and the module whose forward read it, and
    what to call; declared, the model trains and the check ends after its forwards."""
    cfg = placement_config(param_dev, "cpu", tmp_path)
    cfg["wrap"] = {"module_classes": ["_PeekBlock"], "check_reads": 2}
    tokens = batches(3, batch=2, seq=8)
    for declared, expect in (
        (0, r"blocks\.2\.fc2\.weight is read by the forward of <model> .* unit blocks\.2,"),
        (1, r"blocks\.0\.fc1\.weight is read by the forward of blocks\.1 \(_PeekBlock\)"),
        (2, None),
    ):
        torch.manual_seed(0)
        model = _ReadsOtherBlocksWeights()
        if declared >= 1:
            offload.register_external_parameter(model, model.blocks[2].fc2.weight)
        if declared == 2:
            offload.register_external_parameter(model.blocks[1], model.blocks[0].fc1.weight)
        model, opt = offload.wrap(model, cfg)
        try:
            if expect is not None:
                with pytest.raises(RuntimeError, match=expect + r".*register_external_parameter"):
                    model(tokens[0][:, :-1])
                assert torch._C._len_torch_function_stack() == 0  # the check's mode left
                continue
            hooks = len(model._forward_hooks)
            for t in tokens:
                F.cross_entropy(model(t[:, :-1]).reshape(-1, 64), t[:, 1:].reshape(-1)).backward()
                opt.step()
                opt.zero_grad()
            assert torch._C._len_torch_function_stack() == 0
            assert len(model._forward_hooks) == hooks - 1  # the check's, gone after 2 forwards
        finally:
            opt.close()


class _CallerMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_check_reads_ends_after_a_ctrl_c_in_a_checked_forward(tmp_path):
    """A Ctrl-C in a checked forward runs none of torch's forward hooks (``always_call`` ones
    run for an ``Exception`` only), so the check's mode stays on the thread's stack: the next
    forward finds that forward stopped and takes the mode off, also from below a mode the
    caller pushed since; the forwards after it are checked and counted as without the Ctrl-C,
    and the check ends after them."""
    cfg = placement_config("cpu", "cpu", tmp_path)
    cfg["wrap"] = {"module_classes": ["_PeekBlock"], "check_reads": 2}
    torch.manual_seed(0)
    model = _ReadsOtherBlocksWeights()
    _register_reads(model)
    stops = [KeyboardInterrupt]

    def ctrl_c(module, args):
        if stops:
            raise stops.pop()

    model.blocks[1].register_forward_pre_hook(ctrl_c)
    model, opt = offload.wrap(model, cfg)
    tokens = batches(2, batch=2, seq=8)
    try:
        hooks = len(model._forward_hooks)
        with pytest.raises(KeyboardInterrupt):
            model(tokens[0][:, :-1])
        assert torch._C._len_torch_function_stack() == 1  # the check's, left by the Ctrl-C
        with _CallerMode() as mine:
            for t in tokens:
                loss = F.cross_entropy(model(t[:, :-1]).reshape(-1, 64), t[:, 1:].reshape(-1))
                assert torch._C._len_torch_function_stack() == 1
                assert torch._C._get_function_stack_at(0) is mine  # the check's, taken off
                loss.backward()
                opt.step()
                opt.zero_grad()
        assert torch._C._len_torch_function_stack() == 0
        assert len(model._forward_hooks) == hooks - 1  # the check's, gone after 2 forwards
    finally:
        opt.close()


@pytest.mark.parametrize("param_dev", ["cpu", "nvme"])
def test_a_released_parameter_read_outside_its_unit_is_named_at_its_gather(tmp_path, param_dev):
    """Without ``check_reads`` (off by default: slow, not free of false alarms) the reads of
    ``_ReadsOtherBlocksWeights`` computed with zeros and trained 1e-2 off torch, no error.
    The read leaves the kernel's zero page in the released block, so the unit's next gather
    raises, in the forward that read it (or, for a read after the unit's release in the
    forward, at its backward), before any step: naming the parameter and what to call. The
    model trains once the reads are declared (the parity test above)."""
    torch.manual_seed(0)
    wrap = {"wrap": {"module_classes": ["_PeekBlock"]}}
    model, opt = offload.wrap(
        _ReadsOtherBlocksWeights(), placement_config(param_dev, "cpu", tmp_path, **wrap)
    )
    tokens = batches(1, batch=2, seq=8)[0]
    try:
        for _ in range(2):  # a fault of the model's: each forward says it
            with pytest.raises(
                PhaseError,
                match=r"the forward of unit blocks\.2: code outside the unit read its storage "
                r"while the unit was released, after this forward began.*blocks\.2\.fc2\.weight.*"
                r"computed with zeros.*"
                r"register_external_parameter",
            ):
                model(tokens[:, :-1])
        model.blocks[2].fc2.weight.detach().sum()  # between steps: a warning, then the same
        with pytest.warns(UserWarning, match=r"read between uses.*blocks\.2\.fc2\.weight"):
            with pytest.raises(PhaseError, match=r"the forward of unit blocks\.2"):
                model(tokens[:, :-1])
    finally:
        opt.close()
    # the other read comes after blocks.0's release in the forward: seen at its backward
    torch.manual_seed(0)
    model = _ReadsOtherBlocksWeights()
    offload.register_external_parameter(model, model.blocks[2].fc2.weight)
    model, opt = offload.wrap(model, placement_config(param_dev, "cpu", tmp_path / "b", **wrap))
    try:
        logits = model(tokens[:, :-1])
        with pytest.raises(
            PhaseError,
            match=r"the backward of unit blocks\.0: code outside the "
            r"unit read.*blocks\.0\.fc1\.weight",
        ):
            F.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1)).backward()
    finally:
        opt.close()


class _FailsAfterTouching(_ReadsOtherBlocksWeights):
    """A forward with a bug: it touches ``blocks[1].fc2.weight`` (released then: ``blocks[2]``,
    the last to run, stays gathered for the backward) and raises before ``blocks[1]`` runs;
    ``bug`` off, the forward is the plain stack's."""

    def __init__(self) -> None:
        super().__init__()
        self.bug: str | None = None

    def forward(self, tokens):
        x = self.blocks[0](self.embed(tokens))
        if self.bug == "read":
            x = F.linear(x, self.blocks[1].fc2.weight[:, :STACK_DIM])
        elif self.bug == "write":
            self.blocks[1].fc2.weight.data.clamp_(-0.01, 0.01)
        if self.bug:
            raise ValueError("a bug in the model")
        return self.head(self.blocks[2](self.blocks[1](x)))


@pytest.mark.parametrize("param_dev", ["cpu", "nvme"])
def test_a_forward_that_fails_after_touching_a_released_unit(tmp_path, param_dev):
    """A forward that read a released unit's weight and then raised, before that unit's
    gather, left the read in its pages, and the next forward warned of parameters "read
    between uses", a read the caller never made: the failed forward's reads are let go (a
    forward that reads so again is named at the unit's gather, the test above). A write
    there (through ``p.data``) is still named at the next forward, once."""
    wrap = {"wrap": {"module_classes": ["_PeekBlock"]}}
    torch.manual_seed(0)
    model, opt = offload.wrap(
        _FailsAfterTouching(), placement_config(param_dev, "cpu", tmp_path, **wrap)
    )
    tokens = batches(1, batch=2, seq=8)[0][:, :-1]
    try:
        model(tokens)  # (the first forward: blocks.2 released after it)
        model.bug = "read"
        with pytest.raises(ValueError, match="a bug in the model"):
            model(tokens)
        model.bug = None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning of a read between uses
            model(tokens)
        model.bug = "write"
        with pytest.raises(ValueError, match="a bug in the model"):
            model(tokens)
        model.bug = None
        with pytest.raises(
            PhaseError, match=r"a forward of the model: .*written in place.*blocks\.1\.fc2\.weight"
        ):
            model(tokens)
        model(tokens)  # said once
    finally:
        opt.close()


@pytest.mark.parametrize("param_dev,opt_dev", [("cpu", "cpu"), ("nvme", "nvme")])
def test_check_reads_passes_the_parity_model(tmp_path, fp32_reference, param_dev, opt_dev):
    """No false alarm on the parity model (tied embeddings, a block called twice, activation
    checkpointing, a frozen parameter, root parameters), every forward checked, and the same
    numbers as torch's."""
    data, _, ref_losses = fp32_reference
    cfg = placement_config(param_dev, opt_dev, tmp_path)
    cfg["wrap"] = dict(cfg["wrap"], check_reads=10**6)
    model, opt = offload.wrap(make_model(), cfg)
    try:
        losses, _ = train_wrapped(model, opt, data, 3, ACCUM, CLIP)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses[:3]), rtol=1e-5, atol=0
        )
    finally:
        opt.close()


class _SacBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class _SacModel(nn.Module):
    """Selective activation checkpointing around two units."""

    def __init__(self, policy) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 1)
        self.blocks = nn.Sequential(_SacBlock(), _SacBlock())
        self.policy = policy

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        context = functools.partial(create_selective_checkpoint_contexts, self.policy)
        return self.out(
            checkpoint(self.blocks, self.inp(x), use_reentrant=False, context_fn=context)
        )


@pytest.mark.parametrize("policy", ["recompute", "save"])
@pytest.mark.parametrize("param_dev,opt_dev", [("cpu", "cpu"), ("nvme", "nvme"), ("none", "nvme")])
def test_selective_checkpointing_around_units_trains_as_torch(tmp_path, param_dev, opt_dev, policy):
    """Selective activation checkpointing (a ``TorchDispatchMode``) around several units saw
    offload's gathers and releases as the model's operations: the recomputation met others
    than the forward ("aten.view.default encountered during backward but not found in
    storage", params on NVMe) or a tensor it cached mutated by the next gather (a MUST_SAVE
    policy). offload's own operations run outside the caller's dispatch modes now."""
    from torch.utils.checkpoint import CheckpointPolicy

    kind = (
        CheckpointPolicy.PREFER_RECOMPUTE if policy == "recompute" else CheckpointPolicy.MUST_SAVE
    )
    plain = _SacModel(lambda ctx, op, *args, **kwargs: kind)
    ref = copy.deepcopy(plain)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    cfg = placement_config(param_dev, opt_dev, tmp_path, wrap={"module_classes": ["_SacBlock"]})
    model, opt = offload.wrap(copy.deepcopy(plain), cfg)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)
            for m, o in ((ref, ref_opt), (model, opt)):
                F.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
        _assert_params_close(model.state_dict(), ref.state_dict(), rtol=1e-5, atol=1e-7)
    finally:
        opt.close()
