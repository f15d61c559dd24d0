"""Models and loops shared by the engine tests (parity, resume, memory).

The model is built to expose races and bookkeeping bugs: tied input/output embeddings (a
parameter used by the root in two places), a block called twice in one forward, a block run
under non-reentrant activation checkpointing, a frozen parameter, a buffer, parameters outside any
unit, and a "huge and cheap" block whose parameters are large and whose compute is trivial, so
transfers dwarf compute and a missing wait shows up as wrong numbers.
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

VOCAB, DIM = 64, 32


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.register_buffer("gain", torch.full((dim,), 0.5))

    def forward(self, x):
        return x + self.gain * self.fc2(F.gelu(self.fc1(self.norm(x))))


class HugeCheapBlock(nn.Module):
    """Many parameters, almost no compute: every element gets a gradient."""

    def __init__(self, dim: int, rows: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, dim) * 0.02)

    def forward(self, x):
        return x + self.table.mean(0)


class TinyLM(nn.Module):
    """``routed``: one more block, which a batch reaches only where its first token is even (an
    MoE expert's routing, made a unit: steps in which it gets no gradient)."""

    def __init__(
        self, n_blocks: int = 3, hidden: int = 96, huge_rows: int = 3000, routed: bool = False
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, hidden) for _ in range(n_blocks))
        self.huge = HugeCheapBlock(DIM, huge_rows)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.blocks[0].fc1.bias.requires_grad_(False)  # a frozen parameter
        self.expert = Block(DIM, hidden) if routed else None

    def forward(self, tokens):
        x = self.embed(tokens)
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        x = self.blocks[1](x)  # the same block twice
        x = checkpoint(self.blocks[2], x, use_reentrant=False)
        if self.expert is not None and int(tokens[0, 0]) % 2 == 0:
            x = self.expert(x)
        x = self.huge(x)
        return self.head(self.norm(x))


STACK_VOCAB, STACK_DIM = 64, 48


class StackBlock(nn.Module):
    def __init__(self, dim: int = STACK_DIM) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.fc2 = nn.Linear(3 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class NormBlock(StackBlock):
    """A block with running statistics (BatchNorm over the features): buffers training
    changes, which differ between ranks."""

    def __init__(self, dim: int = STACK_DIM) -> None:
        super().__init__(dim)
        self.norm = nn.BatchNorm1d(dim)

    def forward(self, x):
        return super().forward(self.norm(x.transpose(1, 2)).transpose(1, 2))


class BranchBlock(StackBlock):
    """A block with a layer its caller may skip (``skip``: a branch taken by the data, which
    may differ between ranks)."""

    def __init__(self, dim: int = STACK_DIM) -> None:
        super().__init__(dim)
        self.extra = nn.Linear(dim, dim)
        self.skip = False

    def forward(self, x):
        h = super().forward(x)
        return h if self.skip else h + self.extra(h)


class StackLM(nn.Module):
    """A plain stack: each unit runs once in the forward and once in the backward (what
    ``offload.plan.traffic`` assumes), one frozen parameter."""

    def __init__(self, n: int = 4, frozen: bool = True, block=StackBlock) -> None:
        super().__init__()
        self.embed = nn.Embedding(STACK_VOCAB, STACK_DIM)
        self.blocks = nn.Sequential(*(block() for _ in range(n)))
        self.head = nn.Linear(STACK_DIM, STACK_VOCAB)
        if frozen:
            self.blocks[1].fc1.bias.requires_grad_(False)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


class SkipLM(StackLM):
    """A stack whose caller may leave out one whole block (``skip``: its index; a
    data-dependent branch around a unit, as MoE experts made units are)."""

    skip: int | None = None

    def forward(self, tokens):
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = block(x)
        return self.head(x)


class RepeatLM(StackLM):
    """A stack whose caller may run one block once more, before the others (``repeat``: its
    index), on every rank alike: the order in which the units are used differs from one step
    to the next."""

    repeat: int | None = None

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.repeat is not None:
            x = self.blocks[self.repeat](x)
        return self.head(self.blocks(x))


class LoraBlock(nn.Module):
    """A frozen base layer with a trainable low-rank adapter beside it (LoRA), a frozen layer
    whose only gradient is the one it passes to its input (``mid``), and a trainable layer:
    the backward of the frozen layers runs after the last gradient of the unit's trainable
    parameters, so a unit released at that gradient would give them released storage."""

    def __init__(self, dim: int = STACK_DIM, rank: int = 4, inner: bool | None = None) -> None:
        super().__init__()
        # checkpointing inside forward (as transformers does), reentrant or not; None: none
        self.inner = inner
        self.base = nn.Linear(dim, dim)
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)
        self.mid = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(2 * dim, dim)
        nn.init.normal_(self.up.weight, std=0.1)  # (LoRA starts at zero; here it must not)
        for p in (*self.base.parameters(), *self.mid.parameters()):
            p.requires_grad_(False)

    def forward(self, x):
        if self.inner is None:
            return self._forward(x)
        return checkpoint(self._forward, x, use_reentrant=self.inner)

    def _forward(self, x):
        h = self.base(x) + self.up(self.down(x))
        return x + self.out(F.gelu(self.mid(h)))


class FrozenBlock(StackBlock):
    """A block with no trainable parameter between trainable ones."""

    def __init__(self, dim: int = STACK_DIM) -> None:
        super().__init__(dim)
        self.requires_grad_(False)


class LoraLM(nn.Module):
    """Adapters on a frozen stack: every block holds frozen layers the backward passes through
    (one block all frozen); the embedding and the head train."""

    def __init__(self, n: int = 3, reentrant: bool | None = None, inner: bool | None = None):
        super().__init__()
        self.embed = nn.Embedding(STACK_VOCAB, STACK_DIM)
        blocks = [LoraBlock(inner=inner) for _ in range(n)]
        blocks.insert(1, FrozenBlock())
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(STACK_DIM, STACK_VOCAB)
        self.reentrant = reentrant  # checkpointing each block from outside; None: none

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            if self.reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def make_model(seed: int = 0, **kw) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kw)


def batches(n: int, seed: int = 1, batch: int = 4, seq: int = 12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq + 1), generator=g) for _ in range(n)]


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def lr_groups(model) -> list[dict]:
    """Param groups of their own, as ``offload.wrap(param_groups=)`` and torch take them: the
    middle block at a third of the LR with other moments' decay, the second matrices and the
    huge table at twice it with less decay, the rest at the defaults (their parameters
    interleave in the units' flat pieces)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def group_of(name: str) -> int:
        if name.startswith("blocks.1."):
            return 0
        return 2 if name.endswith("fc2.weight") or name.startswith("huge") else 1

    overrides = ({"lr": 3e-3, "betas": (0.8, 0.99)}, {}, {"lr": 2e-2, "weight_decay": 0.02})
    return [
        dict(o, params=[p for n, p in named if group_of(n) == i]) for i, o in enumerate(overrides)
    ]


def torch_adam(model, lr=1e-2, wd=0.1, undecayed=None, adam=False, groups=None, **hyper):
    """torch's AdamW (``adam``: Adam, its decay L2), foreach=False, over the model's trainable
    parameters (``undecayed(name)``: those in a second group, with weight_decay 0; ``hyper``:
    ``betas``, ``eps``; ``groups(model)``: the param groups, instead of either)."""
    kind = torch.optim.Adam if adam else torch.optim.AdamW
    if groups is not None:
        return kind(groups(model), lr=lr, weight_decay=wd, foreach=False, **hyper)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    left = undecayed or (lambda name: False)
    groups = [{"params": [p for n, p in named if not left(n)]}]
    if undecayed is not None:
        groups.append({"params": [p for n, p in named if left(n)], "weight_decay": 0.0})
    return kind([g for g in groups if g["params"]], lr=lr, weight_decay=wd, foreach=False, **hyper)


def reference_fp32(
    model,
    data,
    steps,
    accum,
    clip,
    lr=1e-2,
    wd=0.1,
    undecayed=None,
    adam=False,
    groups=None,
    **hyper,
):
    """Plain PyTorch: AdamW(foreach=False), grad accumulation, clipping, an LR schedule
    (``undecayed(name)``: the parameters in a second group, with weight_decay 0; ``adam``:
    torch's Adam, its weight decay L2; ``hyper``: ``betas``, ``eps``)."""
    model = copy.deepcopy(model)
    opt = torch_adam(model, lr=lr, wd=wd, undecayed=undecayed, adam=adam, groups=groups, **hyper)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    losses = []
    for s in range(steps):
        total = 0.0
        for m in range(accum):
            loss = lm_loss(model, data[(s * accum + m) % len(data)]) / accum
            loss.backward()
            total += float(loss.detach())
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return model, losses


def reference_mixed(model, data, steps, accum, clip, dtype, lr=1e-2, wd=0.1, loss_scale=1.0):
    """Reference mixed precision: fp32 master updated by AdamW, a low-precision copy used for
    compute, gradients accumulated in fp32 (``loss_scale``: each backward's loss multiplied by
    it and its gradients divided by it in fp32, a static loss scale for fp16)."""
    master = copy.deepcopy(model)
    compute = copy.deepcopy(model).to(dtype)
    mparams = [p for p in master.parameters() if p.requires_grad]
    cparams = [p for p in compute.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(mparams, lr=lr, weight_decay=wd, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    losses = []
    for s in range(steps):
        total = 0.0
        for m in range(accum):
            loss = lm_loss(compute, data[(s * accum + m) % len(data)]) / accum
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
            total += float(loss.detach())
            for mp, cp in zip(mparams, cparams):
                if cp.grad is None:  # no gradient (a block this batch does not reach)
                    continue
                g = cp.grad.float() / loss_scale if loss_scale != 1.0 else cp.grad.float()
                mp.grad = g if mp.grad is None else mp.grad + g
                cp.grad = None
        if clip:
            torch.nn.utils.clip_grad_norm_(mparams, clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        with torch.no_grad():
            for mp, cp in zip(mparams, cparams):
                cp.copy_(mp)
        losses.append(total)
    return master, losses


def train_wrapped(
    model, optimizer, data, steps, accum, clip, start=0, sched=None, scale_loss=False
):
    """offload's loop of ``reference_fp32`` (``scale_loss``: each backward through
    ``optimizer.scale_loss``, as fp16 needs)."""
    if sched is None:
        sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    losses = []
    for s in range(start, steps):
        total = 0.0
        for m in range(accum):
            loss = lm_loss(model, data[(s * accum + m) % len(data)]) / accum
            (optimizer.scale_loss(loss) if scale_loss else loss).backward()
            total += float(loss.detach())
        if clip:
            optimizer.clip_grad_norm_(clip)
        optimizer.step()
        sched.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, sched


def placement_config(param_dev: str, opt_dev: str, tmp_path, dtype="fp32", **over) -> dict:
    cfg = {
        "device": "cpu",
        "dtype": dtype,
        "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1},
        "offload_param": {
            "device": param_dev,
            "buffer_count": 4,
            "buffer_size": "64KiB",
            "persistence_threshold": 0,
        },
        "offload_optimizer": {"device": opt_dev, "buffer_count": 8, "buffer_size": "64KiB"},
        "wrap": {"module_classes": ["Block", "HugeCheapBlock"]},
        "prefetch": {"depth": 2},
    }
    if param_dev == "nvme":
        (tmp_path / "nvme_p").mkdir(parents=True, exist_ok=True)
        cfg["offload_param"]["nvme_path"] = str(tmp_path / "nvme_p")
    if opt_dev == "nvme":
        (tmp_path / "nvme_o").mkdir(parents=True, exist_ok=True)
        cfg["offload_optimizer"]["nvme_path"] = str(tmp_path / "nvme_o")
    for k, v in over.items():
        cfg[k] = v
    return cfg


class LiveCasts(TorchDispatchMode):
    """A dispatch mode that sees every bf16 copy made of a tensor of one of ``shapes`` (the
    weights'), held weakly: how many are alive now, and at most while the mode ran."""

    def __init__(self, shapes) -> None:
        super().__init__()
        self.shapes, self.refs, self.peak = shapes, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func is torch.ops.aten._to_copy.default
            and out.dtype == torch.bfloat16
            and tuple(out.shape) in self.shapes
        ):
            self.refs.append(weakref.ref(out))
            self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        return sum(ref() is not None for ref in self.refs)


def nvme_recipe(root, accum: int):
    """The Ctrl-C children's engine (``_notebook_worker.py``, ``_ctrl_c_points.py``): the tiny
    model with params and optimizer state on NVMe under ``root``, the default config (the step
    in backward) with ``gradient_accumulation_steps`` ``accum`` (and clipping when above 1).
    ``(model, opt, one_step)``: ``one_step(s)`` runs step ``s``'s micro-batches, ``step()``
    and ``zero_grad()``."""
    import offload  # noqa: PLC0415

    cfg = placement_config("nvme", "nvme", root)
    cfg["gradient_accumulation_steps"] = accum
    if accum > 1:
        cfg["gradient_clipping"] = 1.0
    model, opt = offload.wrap(make_model(), cfg)
    data = batches(4)

    def one_step(s: int) -> None:
        for m in range(accum):
            (lm_loss(model, data[(s + m) % len(data)]) / accum).backward()
        opt.step()
        opt.zero_grad()

    return model, opt, one_step


def pinned_shards(runtime) -> list[str]:
    """The keys of every store's shards still pinned (none may be between steps)."""
    return sorted(k for st in runtime.stores.values() for k, sh in st._shards.items() if sh.pins)


def lost_buffers(runtime) -> list[str]:
    """What says a pool buffer has no owner: a store whose budget counts more (or fewer)
    buffers taken than its cached copies hold, or a pool whose free buffers and its stores'
    taken ones do not add up to its count."""
    lost, pools = [], {}
    for st in runtime.stores.values():
        if st._room is None:
            continue  # (no NVMe home: no pool)
        budget = st._room.budget
        if budget.in_use != len(st._room.cached):
            lost.append(f"{st.name}: {budget.in_use} taken, {len(st._room.cached)} cached")
        pools.setdefault(id(budget.pool), [budget.pool, 0])[1] += budget.in_use
    for pool, taken in pools.values():
        if pool.free_count + taken != pool.buffer_count:
            lost.append(f"{pool!r}: {taken} taken by its stores")
    return lost
