"""A model wrapped for its forwards and two models trained against each other, across ranks:
``tests/test_frozen_model.py`` and ``tests/test_gan.py`` on 2 ranks (gloo, one process per
rank, ``_dist_worker``'s ``"kind"`` jobs), ZeRO stages 1-3, each rank its own rows.

A model with nothing trainable computes torch's logits and input gradients bitwise on every
rank, and its ``step()`` is refused on every rank alike (before any collective: no rank waits
for the others). A GAN's loops (the generator's step through the discriminator after the
discriminator's step, with no ``zero_grad()`` of it or with it frozen; PyTorch's DCGAN
example, whose generator's graph is held across the discriminator's step; a critic frozen at
wrap) train as plain torch on the ranks' mean gradient; the refusals of ``tests/test_gan.py``
(the norm and the step after a backward that followed a step with no ``zero_grad()``, the
step of a block frozen after wrap, the backward of a parameter unfrozen after wrap) come on
every rank at the same call, and training goes on in step with torch after them. One group
of 2 ranks in the default suite, the rest of the stages and placements in a heavy one, and a
heavy group of 4 ranks (every stage once; each rank a quarter of the rows).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist_worker import GLOBAL_BATCH, gan_steps, refusal_steps, slice_of
from dist_harness import result, run_ranks
from engine_models import VOCAB, batches, make_model
from test_gan import _discriminator, _generator

WORLD = 2


def frozen(stage: int, param: str, optim: str, uneven: bool = False) -> dict:
    name = f"frozen-s{stage}-{param}-{optim}" + ("-uneven" if uneven else "")
    return dict(
        kind="frozen", name=name, param=param, optim=optim, stage=stage, uneven=uneven, timeout=30
    )


def gan(stage: int, param: str, optim: str, loop: str, steps: int = 4, **kw) -> dict:
    """A ``"gan"`` job; ``loop``: ``dcgan`` (``tests/test_gan.py``'s), ``example`` (PyTorch's
    DCGAN example as written: ``gan_steps``' ``held``), ``frozen-d`` or ``critic`` (see
    ``run_gan``)."""
    name = "-".join(
        [f"gan-{loop}-s{stage}-{param}-{optim}", *(f"{k}{v}" for k, v in sorted(kw.items()))]
    )
    return dict(
        kind="gan",
        name=name,
        param=param,
        optim=optim,
        stage=stage,
        steps=steps,
        freeze=loop == "frozen-d",
        critic=loop == "critic",
        held=loop == "example",
        timeout=30,
        **kw,
    )


def refusals(stage: int, param: str, optim: str) -> dict:
    name = f"refusals-s{stage}-{param}-{optim}"
    return dict(kind="refusals", name=name, param=param, optim=optim, stage=stage, timeout=30)


FAST = [
    frozen(3, "nvme", "nvme"),
    frozen(1, "cpu", "cpu", uneven=True),
    gan(2, "none", "nvme", "dcgan"),
    gan(3, "cpu", "cpu", "frozen-d"),
    gan(3, "nvme", "nvme", "example"),
    refusals(3, "cpu", "cpu"),
]
HEAVY = [
    *(frozen(s, p, o) for s in (1, 2, 3) for p, o in (("cpu", "cpu"), ("nvme", "nvme"))),
    *(frozen(s, p, o, uneven=True) for s in (1, 2) for p, o in (("none", "cpu"), ("nvme", "nvme"))),
    frozen(3, "none", "cpu"),
    *(
        gan(s, p, o, loop)
        for s in (1, 2, 3)
        for p, o in (("none", "nvme"), ("cpu", "cpu"), ("nvme", "nvme"))
        for loop in ("dcgan", "example", "frozen-d")
    ),
    *(gan(s, "cpu", "nvme", loop, accum=2, clip=0.05) for s in (2, 3) for loop in ("dcgan",)),
    gan(3, "nvme", "nvme", "frozen-d", accum=2, clip=0.05),
    *(gan(s, "nvme", "nvme", "critic", steps=3) for s in (1, 3)),
    *(
        refusals(s, p, o)
        for s in (1, 2, 3)
        for p, o in (("none", "cpu"), ("none", "nvme"), ("nvme", "nvme"))
    ),
]
HEAVY = [j for j in HEAVY if j["name"] not in {f["name"] for f in FAST}]
# four ranks: each its quarter of the rows (two with the accumulation), every stage once
FOUR = [
    frozen(3, "nvme", "nvme"),
    gan(1, "cpu", "cpu", "dcgan"),
    gan(2, "nvme", "nvme", "example"),
    gan(3, "none", "nvme", "frozen-d"),
    gan(3, "cpu", "nvme", "dcgan", accum=2, clip=0.05),
    gan(3, "nvme", "nvme", "critic", steps=3),
    refusals(2, "nvme", "nvme"),
]
FOUR = [j | {"name": j["name"] + "-w4", "world": 4} for j in FOUR]


def _cases(kind: str) -> list:
    return [
        pytest.param(group, j, id=j["name"], marks=[pytest.mark.heavy] if group != "fast" else [])
        for group, jobs in (("fast", FAST), ("heavy", HEAVY), ("four", FOUR))
        for j in jobs
        if j["kind"] == kind
    ]


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist-gan")
    run_ranks(WORLD, FAST, out)
    return out


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist-gan-heavy")
    run_ranks(WORLD, HEAVY, out)
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist-gan-four")
    run_ranks(4, FOUR, out)
    return out


# ------------------------------------------------------------------------------ frozen
def _frozen_reference(rank: int, world: int = WORLD) -> dict:
    """``run_frozen``'s values in plain torch, on rank ``rank``'s rows."""
    ref = make_model().requires_grad_(False)
    tokens = slice_of(batches(1, batch=GLOBAL_BATCH)[0], rank, world)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].reshape(-1)
    with torch.no_grad():
        logits = ref(inputs)
    x = ref.embed(inputs).detach().requires_grad_(True)
    hook = ref.embed.register_forward_hook(lambda mod, args, output: x)
    F.cross_entropy(ref(inputs).reshape(-1, VOCAB), targets).backward()
    hook.remove()
    return {"logits": logits, "input_grad": x.grad, "state": ref.state_dict()}


@pytest.mark.parametrize("group, job", _cases("frozen"))
def test_a_frozen_model_computes_as_torch_on_every_rank_and_refuses_a_step(request, group, job):
    """Each rank's logits under ``no_grad``, with gradients on and after the refused step, and
    the gradient with respect to its embedding's output, bitwise torch's on its own rows; the
    step refused on every rank, naming why (before any collective: the group goes on); the
    gathered ``state_dict`` and ``close(restore=True)`` give the values back."""
    out, world = request.getfixturevalue(group), job.get("world", WORLD)
    for rank in range(world):
        got = torch.load(out / f"{job['name']}.{rank}.pt")
        want = _frozen_reference(rank, world)
        for key in ("logits", "logits_grad_on", "logits_after"):
            assert torch.equal(got[key], want["logits"]), (rank, key)
        if job["uneven"] and rank == 0:
            assert torch.equal(got["logits_extra"], want["logits"][:1])
        sums = [float(_frozen_reference(r, world)["logits"].sum()) for r in range(world)]
        assert got["gathered"] == sums, rank
        assert torch.equal(got["input_grad"], want["input_grad"]), rank
        message = got["step_error"]
        assert message is not None, f"rank {rank}: optimizer.step() ran"
        assert "no trainable parameters" in message and "set requires_grad before" in message
        for key in ("state", "restored"):
            assert got[key].keys() == want["state"].keys()
            for name, v in want["state"].items():
                assert torch.equal(got[key][name], v), (rank, key, name)


# ------------------------------------------------------------------------------ GANs
def _adamw(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=False)


@pytest.mark.parametrize("group, job", _cases("gan"))
def test_a_gan_loop_across_ranks_trains_as_torch_on_their_mean(request, group, job):
    """Each rank's losses (its rows, its micro-batches) and both models' weights against plain
    torch running every rank's rows with each loss divided by their number (the ranks' mean
    gradient), AdamW(foreach=False). The tolerance is tests/test_gan.py's: Adam's first steps
    are lr * sign(g), so a gradient near eps moves a weight by an ulp's worth of its rounding
    (1e-6 measured here; the summation order of the split batch differs from torch's)."""
    out, world = request.getfixturevalue(group), job.get("world", WORLD)
    accum = job.get("accum", 1)
    torch.manual_seed(0)
    g, d = _generator(), _discriminator()
    if job["critic"]:
        d.requires_grad_(False)
    parts = world * accum
    want = gan_steps(
        g,
        d,
        _adamw(g),
        None if job["critic"] else _adamw(d),
        job["steps"],
        job["freeze"],
        range(parts),
        parts,
        clip=job.get("clip"),
        held=job["held"],
    )
    for rank in range(world):
        mine = slice(rank * accum, (rank + 1) * accum)
        wanted = [[d_losses[mine], g_losses[mine]] for d_losses, g_losses in want]
        got = result(out, job["name"], rank)["losses"]
        assert len(got) == job["steps"]
        for step, (a, b) in enumerate(zip(got, wanted)):
            for losses, ref in zip(a, b):
                torch.testing.assert_close(
                    torch.tensor(losses), torch.tensor(ref), rtol=0, atol=1e-6, msg=(rank, step)
                )
    state = torch.load(out / f"{job['name']}.pt")
    for part, model in (("g", g), ("d", d)):
        wanted = model.state_dict()
        assert state[part].keys() == wanted.keys()
        for name, v in wanted.items():
            torch.testing.assert_close(state[part][name], v, rtol=0, atol=1e-5, msg=part + name)
        if part == "d" and job["critic"]:  # frozen at wrap: untouched
            assert all(torch.equal(state[part][k], v) for k, v in wanted.items())


@pytest.mark.parametrize("group, job", _cases("refusals"))
def test_the_gan_refusals_come_on_every_rank_and_training_goes_on(request, group, job):
    """``refusal_steps`` on each rank's rows: after a backward that followed the step with no
    ``zero_grad()`` (its gradients dropped as they came) the norm, the clipping and the step
    are refused on every rank, and a backward with a parameter unfrozen after wrap; a step
    with a block frozen leaves the block alone on every rank, as torch's does. None of them leaves a rank inside a collective the others never
    join: the norms and the weights after them are torch's on the mean of the ranks'
    gradients. With the params on the device and the optimizer on the CPU too: one process
    keeps the gradients in ``p.grad`` there and sums as torch does, but across ranks offload
    always holds them (``p.grad`` would be a rank's own, unreduced), so the refusals are those
    of a host buffer's."""
    out, world = request.getfixturevalue(group), job.get("world", WORLD)
    torch.manual_seed(0)
    d = _discriminator()
    d[3].bias.requires_grad_(False)
    want = refusal_steps(d, _adamw(d), None, world)
    for rank in range(world):
        got = result(out, job["name"], rank)
        assert got["dropped"], "the dropping backward left gradients in p.grad"
        refused = got["refused"]
        assert len(refused) == 4, refused
        for message in refused[:3]:
            assert "no zero_grad() in between" in message and "after each step" in message
        assert "3.bias was frozen when the model was wrapped" in refused[3], refused[3]
        torch.testing.assert_close(
            torch.tensor(got["norms"]), torch.tensor(want), rtol=1e-6, atol=0
        )
    state = torch.load(out / f"{job['name']}.pt")
    for name, v in d.state_dict().items():
        torch.testing.assert_close(state[name], v, rtol=0, atol=1e-6, msg=name)
