"""One rank of a multi-rank test (started by ``dist_harness``, or by torchrun): runs a list of
jobs in one process group.

Environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (``env://``, what
torchrun sets). Argument: a JSON file ``{"out": DIR, "timeout": seconds, "jobs": [...]}``;
each job wraps ``engine_models.make_model()`` (or ``StackLM`` with ``"model": "stack"``,
``LoraLM`` with ``"model": "lora"`` (``"lora-reentrant"``: each block checkpointed inside,
reentrant), ``RepeatLM`` with ``"model": "repeat"`` (see
``repeats``), ``StackLM`` of ``NormBlock`` with ``"model": "norm"``, of ``BranchBlock`` with
``"model": "branch"``: see ``skips``) with
``placement_config(param, optim, ...)`` and ``distributed.stage``, trains its slice of every
global batch (``GLOBAL_BATCH`` rows split evenly over the ranks) and writes ``<name>.<rank>.json``
(the mean loss over ranks per step, this rank's stats per step, its NVMe directories) and
``<name>.pt`` (rank 0: ``model.state_dict()``, gathered; the optimizer's state_dict if asked).

Job keys: ``name``, ``param``, ``optim``, ``dtype`` (fp32), ``stage``, ``steps``, ``start``
(0), ``accum`` (2), ``clip`` (1.0), ``config`` (extra top-level config keys), ``load`` /
``save`` (checkpoint directories; the scheduler and the step go in its extra values),
``fail_at`` ({"rank": r, "step": s, "hang": bool, "kill": bool, "abort": bool, "io": bool}:
that rank raises there, or sleeps, or kills itself with SIGKILL, or aborts as gloo aborts a
rank, or (``io``) has every NVMe read fail from that step's ``step()`` on: its update fails;
``"io": "backward"``: from its last backward on, where the step in backward updates; with
``"slow"``: s, the failed update's worker then sleeps s seconds between ending its hand-over
and recording its error),
``step_in_backward`` (the optimizer's setting, when given),
``optimizer_state`` (keep the gathered optimizer state_dict), ``load_model`` (a file of
``{"state": values by name}`` that ``model.load_state_dict(strict=False)`` loads after
wrap), ``export`` and ``save_pretrained`` (paths),
``pairs`` (wrap over a process group of ranks {0,1} / {2,3}; only the first pair reports),
``load_state`` (an optimizer state_dict file to load, the scheduler advanced to ``start``),
``restore`` (close with ``restore=True`` and compare the plain model's values),
``block`` (checkpoint block checksum size), ``peek`` (after each step's backwards, a loss
with gradients on, looked at and let go before the step; ``"refused"``: after the first
step, that forward must be refused, the update in the backward having written the weights),
``slow_update`` ({"rank": r, "unit": label, "seconds": s}: that rank's update writes that
unit's params s seconds late), ``pause`` ({"rank": r, "seconds": s}: that rank waits s
seconds before each step's first forward, the first step's aside), ``log`` (record when collectives
are issued and waited and when units compute, on rank 0), ``count_reads`` (bytes read from
checkpoint files), ``diverge`` ({"rank": r, "step": s, "what": w}: in step s that rank alone
runs an evaluation forward before the step's first (``"eval"``), leaves out its last micro-step
(``"micro"``), or does not call ``clip_grad_norm_`` (``"clip"``) or ``step()`` (``"step"``);
a ``RankDivergenceError`` ends the job, recorded in ``<name>.<rank>.json`` as ``diverged``:
the step, the seconds from that step's start and the message), ``autocast`` (each forward and
its loss under ``torch.autocast("cpu", dtype=torch.bfloat16)``, autocast's cache left on as a
user leaves it, ``peek``'s and ``eval_held``'s forwards too; recorded per micro-step in
``casts``: the bf16 copies of the model's 2-D weights alive after the forward, and at most
during it, ``engine_models.LiveCasts``).

A job with a ``kind`` runs another loop: ``"frozen"`` (a model with nothing trainable),
``"gan"`` (two models trained against each other), ``"refusals"`` (``tests/test_gan.py``'s):
see :func:`run_frozen`, :func:`run_gan`, :func:`run_refusals` (``tests/test_dist_gan.py``).

After the jobs: ``threads.w<world>.<rank>.json``, this process's threads by name before and after
``destroy_process_group``.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_models import (
    STACK_DIM,
    VOCAB,
    BranchBlock,
    LiveCasts,
    LoraLM,
    NormBlock,
    RepeatLM,
    SkipLM,
    StackLM,
    batches,
    lm_loss,
    lr_groups,
    make_model,
    placement_config,
)
from test_gan import DATA, NOISE, _config, _discriminator, _generator

import offload
from offload.api import checkpoint_files
from offload.api.wrap import engine_of
from offload.dist import init_process_group
from offload.io import faults
from offload.runtime.agree import RankDivergenceError
from offload.runtime.grads import UnitOrderError
from offload.runtime.phase import PhaseError

GLOBAL_BATCH = 8
STEPS_DATA = 16
ORIGINAL = (
    checkpoint_files.BLOCK,
    checkpoint_files.VerifiedCheckpoint.read,
    checkpoint_files._sha256_of,
)


def skips(step: int, rank: int) -> bool:
    """``"model": "branch"``: whether the rank skips the middle block's extra layer (rank 1,
    from the second step on: a parameter that one rank leaves unused; every rank in the
    third step: one no rank gives a gradient, which that step leaves alone)."""
    return (rank == 1 and step >= 1) or step == 2


def skips_unit(step: int, micro: int, rank: int) -> int | None:
    """``"model": "unitskip"``: the block rank 1 leaves out (the third, in step 1's second
    micro-step: a whole unit one rank skips, in a forward that gathers nothing; the first
    forward after a step gathers each unit's updated shares as it uses it, which a skip
    would make differ)."""
    return 2 if (rank, step, micro) == (1, 1, 1) else None


def repeats(step: int) -> int | None:
    """``"model": "repeat"``: the block every rank runs twice (the second, in even steps: the
    first forward after each step uses the units in another order than the one before)."""
    return 1 if step % 2 == 0 else None


def _diverges(diverge: dict, rank: int, step: int, what: str) -> bool:
    """Whether this rank alone does ``what`` differently in this step (``diverge`` jobs)."""
    return diverge.get("rank") == rank and diverge.get("step") == step and diverge["what"] == what


def slice_of(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = batch.shape[0] // world
    return batch[rank * per : (rank + 1) * per]


def _model(job: dict):
    if job.get("model") == "stack":
        torch.manual_seed(0)
        return StackLM(n=4), {"module_classes": ["StackBlock"]}
    if job.get("model") == "branch":
        torch.manual_seed(0)
        return StackLM(n=3, block=BranchBlock), {"module_classes": ["BranchBlock"]}
    if job.get("model") == "norm":
        torch.manual_seed(0)
        return StackLM(n=3, block=NormBlock), {"module_classes": ["NormBlock"]}
    if job.get("model") == "unitskip":
        torch.manual_seed(0)
        return SkipLM(n=4), {"module_classes": ["StackBlock"]}
    if job.get("model") == "repeat":
        torch.manual_seed(0)
        return RepeatLM(n=4), {"module_classes": ["StackBlock"]}
    if job.get("model") in ("lora", "lora-reentrant"):  # (checkpointing inside each block)
        torch.manual_seed(0)
        inner = True if job["model"] == "lora-reentrant" else None
        return LoraLM(inner=inner), {"module_classes": ["LoraBlock", "FrozenBlock"]}
    return make_model(), None


class _Logged:
    """A collective's handle whose first wait is recorded."""

    def __init__(self, handle, events: list, event: list) -> None:
        self.handle, self.events, self.event = handle, events, event

    def wait(self) -> None:
        if self.event is not None:
            self.events.append(self.event)
            self.event = None
        self.handle.wait()

    def done(self) -> bool:
        return self.handle.done()


class _Log:
    """Records collectives issued / waited and units computing (``log`` jobs)."""

    def __init__(self, model, runtime) -> None:
        self.events: list[list] = []
        comm = runtime.comm
        for name in ("all_gather", "reduce_scatter"):
            real = getattr(comm, name)

            def issue(out, inp, what="", real=real, name=name):
                self.events.append(["issue", name, what])
                return _Logged(real(out, inp, what), self.events, ["wait", name, what])

            setattr(comm, name, issue)

        def embed_grad(grad) -> None:  # the backward reached the embedding: it is ending
            self.events.append(["embed-grad"])

        def hook_embed(module, args, out) -> None:
            if out.requires_grad:
                out.register_hook(embed_grad)

        model.embed.register_forward_hook(hook_embed)
        for run in runtime.runs[1:]:
            label = run.unit.label
            run.unit.module.register_forward_pre_hook(
                lambda m, a, label=label: self.events.append(["forward", label])
            )

            # the backward reaching the unit's output, before offload's gather for it (a
            # tensor hook on the output registered before offload's, which runs after every
            # forward hook of the user's; a full backward pre-hook runs after that gather)
            def reached(m, a, out, label=label) -> None:
                if out.requires_grad:
                    out.register_hook(lambda g: self.events.append(["backward", label]))

            run.unit.module.register_forward_hook(reached)


def _late(call, seconds: float):
    """``call`` followed by a sleep of ``seconds``."""

    def late(*args, **kwargs):
        result = call(*args, **kwargs)
        time.sleep(seconds)
        return result

    return late


def run_job(job: dict, out: Path, rank: int, world: int) -> None:
    group, report = None, True
    if job.get("pairs"):
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group, report = pairs[rank // 2], rank < 2
        rank, world = rank % 2, 2
    if job.get("block"):
        checkpoint_files.BLOCK = job["block"]
    read = {"data": 0, "verified": 0}
    if job.get("count_reads"):
        real_read, real_sha = checkpoint_files.VerifiedCheckpoint.read, checkpoint_files._sha256_of

        def counted_read(self, name, tensor, lo, hi):
            got = real_read(self, name, tensor, lo, hi)
            read["data"] += got.numel() * got.element_size()
            return got

        def counted_sha(fd, size, begin=0, stop=None):
            read["verified"] += size - begin
            return real_sha(fd, size, begin, stop)

        checkpoint_files.VerifiedCheckpoint.read = counted_read
        checkpoint_files._sha256_of = counted_sha
    tmp = out / "nvme" / job["name"]
    cfg = placement_config(job["param"], job["optim"], tmp, dtype=job.get("dtype", "fp32"))
    cfg["distributed"] = {"stage": job["stage"], "timeout": job.get("timeout", 60)}
    model, wrap_classes = _model(job)
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}  # (before sharding)
    if wrap_classes:
        cfg["wrap"] = wrap_classes
    cfg.update(job.get("config", {}))
    if "step_in_backward" in job:
        cfg["offload_optimizer"]["step_in_backward"] = job["step_in_backward"]
    groups = lr_groups(model) if job.get("groups") else None
    model, opt = offload.wrap(model, cfg, param_groups=groups, process_group=group)
    runtime = engine_of(model)
    if (slow := job.get("slow_update")) and slow["rank"] == rank:  # this rank's update of
        real_commit = runtime.params.commit  # that unit lands late (a busy core, a slow disk)

        def late_commit(unit, lo, hi):
            if unit.label == slow["unit"]:
                time.sleep(slow["seconds"])
            real_commit(unit, lo, hi)

        runtime.params.commit = late_commit
    log = _Log(model, runtime) if job.get("log") else None
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    start = job.get("start", 0)
    if job.get("load_model"):  # some of the model's values (a partial load, PEFT's)
        model.load_state_dict(torch.load(job["load_model"])["state"], strict=False)
    if job.get("load_state"):  # an optimizer state_dict saved by another job (any world size)
        opt.load_state_dict(torch.load(job["load_state"])["optimizer"])
        for _ in range(start):
            sched.step()
    if job.get("load"):
        extra = offload.load_checkpoint(job["load"], model, opt)
        sched.load_state_dict(extra["scheduler"])
        start = extra["step"]
    data = batches(STEPS_DATA, batch=GLOBAL_BATCH)
    accum, clip = job.get("accum", 2), job.get("clip", 1.0)
    losses, stats, norms, refused, casts = [], [], [], [], []
    fail = job.get("fail_at") or {}
    diverge = job.get("diverge") or {}
    s, began = start, time.monotonic()

    def amp():  # (``autocast`` jobs: every forward under it, the evaluations' too)
        if job.get("autocast"):
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    try:
        for s in range(start, job["steps"]):
            total, began = 0.0, time.monotonic()
            for m in range(accum):
                if _diverges(diverge, rank, s, "micro") and m == accum - 1:
                    continue
                if _diverges(diverge, rank, s, "eval") and m == 0:
                    with torch.no_grad():  # (logging on one rank)
                        lm_loss(model, slice_of(data[0], rank, world))
                if fail.get("rank") == rank and fail.get("step") == s and not fail.get("io"):
                    if fail.get("hang"):
                        time.sleep(600)
                    if fail.get("kill"):
                        os.kill(os.getpid(), signal.SIGKILL)
                    if fail.get("abort"):  # (a collective that differs from the other ranks')
                        os.abort()
                    raise RuntimeError(f"injected failure on rank {rank} at step {s}")
                batch = slice_of(data[(s * accum + m) % len(data)], rank, world)
                if (pause := job.get("pause")) and pause["rank"] == rank and m == 0 and s > start:
                    time.sleep(pause["seconds"])  # (its update in the background done meanwhile)
                if job.get("model") == "branch":  # the middle block's extra layer, on one rank
                    model.blocks[1].skip = skips(s, rank)
                if job.get("model") == "unitskip":
                    model.skip = skips_unit(s, m, rank)
                if job.get("model") == "repeat":
                    model.repeat = repeats(s)
                if job.get("autocast"):
                    live = LiveCasts(shapes)
                    with amp(), live:
                        loss = lm_loss(model, batch) / accum
                    casts.append([live.live(), live.peak])
                else:
                    loss = lm_loss(model, batch) / accum
                if job.get("eval_held"):  # an evaluation (its gathers collective) under that loss
                    with torch.no_grad(), amp():
                        assert lm_loss(model, batch).item() > 0
                if fail.get("io") == "backward" and (fail["rank"], fail["step"]) == (rank, s):
                    if m == accum - 1:  # the last backward's update in it fails (and its undo)
                        faults.inject(errno.EIO, count=fail.get("count", 1 << 30), op="read")
                        if fail.get("slow"):  # its hand-over ends a while before the update's
                            owner = runtime.grads.owner  # error is recorded (a busy core)
                            owner.abandon = _late(owner.abandon, fail["slow"])
                try:
                    loss.backward()
                except UnitOrderError as exc:  # refused on every rank before it took anything:
                    refused.append([s, m, str(exc)])  # the micro-step is left out, the earlier kept
                    continue
                if job.get("probe_one_rank") and rank == 1:  # a unit called by itself, one rank
                    with torch.no_grad():
                        model.blocks[1](torch.zeros(1, 2, STACK_DIM))
                total += float(loss.detach())
            if job.get("peek"):  # a forward (its gathers collective) no backward follows
                batch = slice_of(data[s % len(data)], rank, world)
                if job.get("peek") == "refused" and s > start:  # (the first step counts backwards)
                    try:
                        with amp():
                            lm_loss(model, batch)
                    except PhaseError as e:
                        assert "a forward of the model" in str(e), e
                    else:
                        raise AssertionError("a forward after the update in the backward ran")
                else:
                    with amp():
                        assert lm_loss(model, batch).item() > 0
            if clip and not _diverges(diverge, rank, s, "clip"):
                norms.append(float(opt.clip_grad_norm_(clip)))
            if fail.get("io") is True and fail.get("rank") == rank and fail.get("step") == s:
                faults.inject(errno.EIO, count=1 << 30, op="read")  # for good: the update fails
            if not _diverges(diverge, rank, s, "step"):
                opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(total)
            st = opt.stats()
            keep = ("collectives", "collective_bytes", "collective_wait_seconds", "bytes")
            stats.append({k: st[k] for k in keep} | {"state_bytes": st["state_bytes"]})
    except RankDivergenceError as exc:  # every rank, at the same check: the job ends
        seconds = time.monotonic() - began
        result = {"diverged": [s, seconds, str(exc)], "losses": losses}
        (out / f"{job['name']}.{rank}.json").write_text(json.dumps(result))
        opt.close()
        return
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean, group=group)
    mean /= world
    if job.get("save"):
        offload.save_checkpoint(
            job["save"], model, opt, scheduler=sched.state_dict(), step=job["steps"]
        )
    save_error = None
    if job.get("failed_save"):  # {"dir", "rank"}: that rank's writes fail part way
        from offload.api import checkpoint as ckpt_mod  # noqa: PLC0415

        real_entries = ckpt_mod._unit_entries
        if rank == job["failed_save"]["rank"]:

            def failing(engine, unit):
                if unit.index == 2:
                    raise OSError(28, "No space left on device (injected)")
                return real_entries(engine, unit)

            ckpt_mod._unit_entries = failing
        try:
            offload.save_checkpoint(job["failed_save"]["dir"], model, opt, step=job["steps"])
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            save_error = f"{type(exc).__name__}: {exc}"
        finally:
            ckpt_mod._unit_entries = real_entries
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict() if job.get("optimizer_state") else None
    if job.get("export"):
        offload.export(model, job["export"], dtype=torch.float32)
    if job.get("save_pretrained"):  # a Hugging Face directory, in shards
        offload.save_pretrained(
            model, job["save_pretrained"], dtype=torch.float32, max_shard_size="64KB"
        )
    result = {
        "losses": mean.tolist(),
        "norms": norms,
        "save_error": save_error,
        "refused": refused,
        "casts": casts,
        "stats": stats,
        "rank": rank,
        "world": world,
        "nvme_dirs": sorted(s._nvme.directory for s in runtime.stores.values()),
        "pools": sum(s.stats().get("host_reserved_bytes", 0) for s in runtime.stores.values()),
        "read_bytes": read,
        "log": log.events if log is not None else None,
        # this rank's own buffers (running statistics differ between ranks)
        "buffers": {k: v.flatten().tolist() for k, v in model.named_buffers()},
    }
    if job.get("restore"):  # back to a plain model (collective): the same values
        opt.close(restore=True)
        plain = model.state_dict()
        result["restored_equal"] = all(torch.equal(plain[k], state[k]) for k in state)
    if report:
        if rank == 0:
            torch.save({"state": state, "optimizer": opt_state}, out / f"{job['name']}.pt")
        (out / f"{job['name']}.{rank}.json").write_text(json.dumps(result))
    opt.close()
    checkpoint_files.BLOCK, checkpoint_files.VerifiedCheckpoint.read = ORIGINAL[:2]
    checkpoint_files._sha256_of = ORIGINAL[2]


def run_frozen(job: dict, out: Path, rank: int, world: int) -> None:
    """``"kind": "frozen"``: ``make_model()`` with nothing trainable, wrapped for its forwards
    (``tests/test_frozen_model.py``), on this rank's slice of one global batch: the logits
    under ``no_grad`` and with gradients on, the gradient of a loss with respect to the
    embedding's output (a leaf put in its place), ``step()``'s refusal (its message, or None
    where it ran), ``zero_grad()``, the logits again (``uneven``: rank 0 runs one forward
    more), their sums gathered with ``all_gather_object``, the gathered ``state_dict`` and the
    values ``close(restore=True)`` gives back. Writes ``<name>.<rank>.pt``."""
    tmp = out / "nvme" / job["name"]
    cfg = placement_config(job["param"], job["optim"], tmp)
    cfg["distributed"] = {"stage": job["stage"], "timeout": job.get("timeout", 60)}
    model, opt = offload.wrap(make_model().requires_grad_(False), cfg)
    tokens = slice_of(batches(1, batch=GLOBAL_BATCH)[0], rank, world)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].reshape(-1)
    got = {}
    with torch.no_grad():
        got["logits"] = model(inputs)
    got["logits_grad_on"] = model(inputs)
    x = make_model().embed(inputs).detach().requires_grad_(True)  # (the same values)
    hook = model.embed.register_forward_hook(lambda mod, args, output: x)
    F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets).backward()
    hook.remove()
    got["input_grad"] = x.grad
    got["step_error"] = None
    try:
        opt.step()
    except PhaseError as exc:
        got["step_error"] = str(exc)
    opt.zero_grad()
    with torch.no_grad():
        got["logits_after"] = model(inputs)
        if job.get("uneven") and rank == 0:  # a batch more than the others (an uneven split)
            got["logits_extra"] = model(inputs[:1])
    got["gathered"] = [None] * world  # (each rank's predictions, gathered as an evaluation does)
    dist.all_gather_object(got["gathered"], float(got["logits_after"].sum()))
    got["state"] = {k: v.clone() for k, v in model.state_dict().items()}
    opt.close(restore=True)
    got["restored"] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(got, out / f"{job['name']}.{rank}.pt")


def gan_steps(g, d, g_opt, d_opt, steps: int, freeze: bool, halves, parts: int, **kw):
    """``tests/test_gan.py``'s loop on global batches of ``4 * parts`` rows, of which this
    process runs the rows of the parts in ``halves``, each loss divided by their number (a
    rank its own, or its micro-batches; the reference every part's: their gradients sum to
    the ranks' mean). The discriminator's step on real and generated samples, then the
    generator's through the discriminator after its step (``freeze``: frozen for it,
    CycleGAN's ``set_requires_grad``; else no ``zero_grad()`` of it before, torch's DCGAN
    example; ``d_opt`` None: the discriminator frozen at wrap, a fixed critic, a perceptual
    loss). ``clip``: each model's gradients clipped to that norm before its step; ``held``:
    PyTorch's DCGAN example as written, the generator's forward once per step, its graph
    held across the discriminator's backwards (real and fake apart) and step and across its
    own ``model.zero_grad()``. The losses per step: ``[[d_loss of each half], [g_loss of
    each half]]``."""
    gen, scale = torch.Generator().manual_seed(5), 1.0 / len(halves)
    clip, held = kw.get("clip"), kw.get("held", False)
    losses = []

    def step(model, opt) -> None:
        if clip is not None and hasattr(opt, "clip_grad_norm_"):  # offload's
            opt.clip_grad_norm_(clip)
        elif clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()

    for _ in range(steps):
        real = torch.randn(4 * parts, DATA, generator=gen) + 1
        z = torch.randn(4 * parts, NOISE, generator=gen)
        rows = [slice(4 * r, 4 * r + 4) for r in halves]
        d_losses, fakes = [], []
        if d_opt is not None:
            d.requires_grad_(True)
            d.zero_grad() if held else d_opt.zero_grad()
            for row in rows:
                if held:
                    real_loss = F.softplus(-d(real[row])).mean()
                    (real_loss * scale).backward()
                    fakes.append(g(z[row]))
                    fake_loss = F.softplus(d(fakes[-1].detach())).mean()
                    (fake_loss * scale).backward()
                    d_losses.append(real_loss.item() + fake_loss.item())
                    continue
                fake = g(z[row])
                d_loss = F.softplus(-d(real[row])).mean() + F.softplus(d(fake.detach())).mean()
                (d_loss * scale).backward()
                d_losses.append(d_loss.item())
            step(d, d_opt)
            d.requires_grad_(not freeze)
        g.zero_grad() if held else g_opt.zero_grad()
        g_losses = []
        for i, row in enumerate(rows):
            g_loss = F.softplus(-d(fakes[i] if held else g(z[row]))).mean()
            (g_loss * scale).backward()  # through the discriminator, after its step
            g_losses.append(g_loss.item())
        step(g, g_opt)
        losses.append([d_losses, g_losses])
    return losses


def run_gan(job: dict, out: Path, rank: int, world: int) -> None:
    """``"kind": "gan"``: ``tests/test_gan.py``'s generator and discriminator, each wrapped
    (``param``, ``optim``, ``stage``, ``config``), trained by :func:`gan_steps` on this rank's
    rows for ``steps`` steps (``freeze``; ``accum`` micro-batches per step, 1; ``clip``;
    ``held``; ``critic``: the discriminator frozen at wrap, only the generator trains). Writes
    ``<name>.<rank>.json`` (this rank's losses) and ``<name>.pt`` (rank 0: both models'
    gathered ``state_dict``)."""
    tmp = out / "nvme" / job["name"]
    torch.manual_seed(0)
    models = []
    for part, make in (("g", _generator), ("d", _discriminator)):
        cfg = _config(job["param"], job["optim"], tmp / part)
        cfg["distributed"] = {"stage": job["stage"], "timeout": job.get("timeout", 60)}
        cfg.update(job.get("config", {}))
        model = make().requires_grad_(part == "g" or not job.get("critic"))
        models.append(offload.wrap(model, cfg))
    (g, g_opt), (d, d_opt) = models
    if job.get("critic"):  # its optimizer refuses to step: left out of the loop
        d_opt, critic_opt = None, d_opt
    accum = job.get("accum", 1)
    halves = [rank * accum + m for m in range(accum)]  # this rank's micro-batches
    losses = gan_steps(
        g,
        d,
        g_opt,
        d_opt,
        job["steps"],
        job["freeze"],
        halves,
        world * accum,
        clip=job.get("clip"),
        held=job.get("held", False),
    )
    state = {p: {k: v.clone() for k, v in m.state_dict().items()} for p, m in (("g", g), ("d", d))}
    if rank == 0:
        torch.save(state, out / f"{job['name']}.pt")
    (out / f"{job['name']}.{rank}.json").write_text(json.dumps({"losses": losses}))
    g_opt.close()
    (critic_opt if job.get("critic") else d_opt).close()


def refusal_steps(d, opt, rank: int | None, world: int, seen: dict | None = None) -> list[float]:
    """``tests/test_gan.py``'s refusals on this rank's rows of a batch of ``4 * world`` (the
    reference: ``rank`` None, every rank's rows, with no refusal). A backward after the step
    with no ``zero_grad()``: the norm and the step are refused, then ``zero_grad()``, a
    backward and the step; a block frozen for the next backward and its step (which leaves it
    alone, as torch's does; refused until 2026-12-06); the last layer's bias (frozen at wrap) unfrozen: that backward is
    refused; frozen again, a last backward and step. In ``seen``: each refusal's message
    (``"refused"``), whether the dropping backward left every ``p.grad`` None (``"dropped"``).
    The norms before the steps."""
    x = torch.randn(4 * world, DATA, generator=torch.Generator().manual_seed(1))
    x = x if rank is None else x[4 * rank : 4 * rank + 4]
    plain = seen is None

    def backward() -> None:
        d(x).mean().backward()

    def refuse(call) -> None:
        try:
            call()
        except PhaseError as exc:
            seen["refused"].append(str(exc))
        else:
            raise AssertionError("not refused")

    def norm() -> float:
        if plain:
            grads = [p.grad for p in d.parameters() if p.grad is not None]
            return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        return float(opt.grad_norm())

    norms = []
    backward()
    norms.append(norm())
    opt.step()
    if not plain:
        backward()  # no zero_grad() since the step: its gradients are dropped as they come
        seen["dropped"] = all(p.grad is None for p in d.parameters())
        for call in (lambda: opt.clip_grad_norm_(1.0), opt.grad_norm, opt.step):
            refuse(call)
    opt.zero_grad()
    backward()
    norms.append(norm())
    opt.step()
    opt.zero_grad()
    d[1].requires_grad_(False)
    backward()
    opt.step()  # the frozen block got no gradient on any rank: each step leaves it alone
    d[1].requires_grad_(True)
    opt.zero_grad()
    if not plain:
        d[3].bias.requires_grad_(True)
        refuse(backward)
        d[3].bias.requires_grad_(False)
    backward()
    norms.append(norm())
    opt.step()
    return norms


def run_refusals(job: dict, out: Path, rank: int, world: int) -> None:
    """``"kind": "refusals"``: ``tests/test_gan.py``'s discriminator (its last bias frozen at
    wrap) wrapped (``param``, ``optim``, ``stage``) through :func:`refusal_steps`. Writes
    ``<name>.<rank>.json`` (what it saw, the norms) and ``<name>.pt`` (rank 0: the gathered
    ``state_dict``)."""
    torch.manual_seed(0)
    model = _discriminator()
    model[3].bias.requires_grad_(False)
    cfg = _config(job["param"], job["optim"], out / "nvme" / job["name"])
    cfg["distributed"] = {"stage": job["stage"], "timeout": job.get("timeout", 60)}
    d, opt = offload.wrap(model, cfg)
    seen = {"refused": []}
    norms = refusal_steps(d, opt, rank, world, seen)
    state = {k: v.clone() for k, v in d.state_dict().items()}
    if rank == 0:
        torch.save(state, out / f"{job['name']}.pt")
    (out / f"{job['name']}.{rank}.json").write_text(json.dumps(seen | {"norms": norms}))
    opt.close()


JOBS = {"frozen": run_frozen, "gan": run_gan, "refusals": run_refusals}


def _thread_names() -> list[str]:
    """This process's threads, native ones included, by name (Linux)."""
    return sorted((t / "comm").read_text().strip() for t in Path("/proc/self/task").iterdir())


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("timeout", 60)))
    try:
        for job in spec["jobs"]:
            JOBS.get(job.get("kind"), run_job)(job, Path(spec["out"]), rank, world)
        before = _thread_names()
    finally:
        dist.destroy_process_group()
    after = _thread_names()
    for _ in range(100):  # a thread just joined may still be listed for a moment
        if not any("gloo" in name for name in after):
            break
        time.sleep(0.02)
        after = _thread_names()
    threads = {"before": before, "after": after}
    (Path(spec["out"]) / f"threads.w{world}.{rank}.json").write_text(json.dumps(threads))


if __name__ == "__main__":
    main()
