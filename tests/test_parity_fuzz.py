"""Random engine configurations against plain PyTorch (fp32): the knobs the targeted parity
tests set one or two at a time, drawn together.

Each case is drawn from a fixed seed (its id says what it drew), so a failure reruns as it
failed: the placements of params and optimizer state, gradient accumulation, clipping (through
``optimizer.clip_grad_norm_`` or the config's ``gradient_clipping``, at a threshold that clips
every step or none), ``persistence_threshold``, ``prefetch.depth``, the swap buffers' size and
count, and ``step_in_backward`` with the optimizer on NVMe. The model is ``engine_models``'
TinyLM (tied weights, a frozen parameter, a block called twice, activation checkpointing, a
huge cheap block) with its block width and the huge block's rows drawn too.

- ``test_a_random_config_trains_as_torch``: four steps against torch's AdamW, losses and
  final weights.
- ``test_a_checkpoint_resumes_under_another_random_config``: two steps under one config,
  ``save_checkpoint``, then ``load_checkpoint`` into a model wrapped with another (other
  placements, buffers, modes) and two more steps: the same four steps as torch's.

Heavy (36 cases, ~35 s on the shared 2-core machine): ``.ci/run`` runs them. They can fail:
with a fourth block that the model never calls, the cases where offload holds the gradients (a
host buffer, NVMe) fail on its weights, which offload's step moves as with a zero gradient and
torch's skips (the README's optimizer bullet; DeepSpeed's flat buffers do as offload).
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from engine_models import batches, make_model, placement_config, reference_fp32, train_wrapped

import offload

STEPS = 4
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-4  # fp32 parity elsewhere: summation order differs


def _draw_placement(rng: random.Random) -> dict:
    """One config's drawn knobs (pure: the config is built from them in the test)."""
    knobs = {
        "param": rng.choice(["none", "cpu", "nvme"]),
        "optim": rng.choice(["cpu", "nvme"]),
        "persistence_threshold": rng.choice([0, 0, 500, 10**9]),
        "buffer_size": rng.choice(["16KiB", "64KiB", "1MiB"]),
        "param_buffers": rng.choice([4, 6, 16]),
        "optim_buffers": rng.choice([4, 8, 16]),
        "depth": rng.choice([0, 1, 2, 4]),
    }
    knobs["step_in_backward"] = knobs["optim"] == "nvme" and rng.choice([True, False])
    return knobs


def _name(k: dict) -> str:
    mode = ("-sib" if k["step_in_backward"] else "-after") if k["optim"] == "nvme" else ""
    return (
        f"{k['param']}-{k['optim']}-p{k['persistence_threshold']}-d{k['depth']}"
        f"-{k['buffer_size']}x{k['param_buffers']}{mode}"
    )


def _draw(seed: int, configs: int) -> tuple[dict, str]:
    """The run (accumulation, clipping and how, the model) and ``configs`` placements drawn
    from ``seed``, and the case's name."""
    rng = random.Random(seed)
    clip = rng.choice([0.0, 0.05, 10.0])  # none; every step clips; none clips
    run = {
        "accum": rng.choice([1, 2, 3]),
        "clip": clip,
        "config_clips": bool(clip) and rng.random() < 0.5,  # gradient_clipping in the config
        "model": {"hidden": rng.choice([17, 96]), "huge_rows": rng.choice([7, 3000])},
        "placements": [_draw_placement(rng) for _ in range(configs)],
    }
    name = "-".join(
        [
            f"a{run['accum']}-c{clip}{'cfg' if run['config_clips'] else ''}",
            f"h{run['model']['hidden']}-r{run['model']['huge_rows']}",
            *(_name(k) for k in run["placements"]),
        ]
    )
    return run, name


def _config(run: dict, knobs: dict, tmp_path) -> dict:
    cfg = placement_config(knobs["param"], knobs["optim"], tmp_path)
    cfg["offload_param"].update(
        persistence_threshold=knobs["persistence_threshold"],
        buffer_size=knobs["buffer_size"],
        buffer_count=knobs["param_buffers"],
    )
    cfg["offload_optimizer"].update(
        buffer_size=knobs["buffer_size"], buffer_count=knobs["optim_buffers"]
    )
    if knobs["optim"] == "nvme":
        cfg["offload_optimizer"]["step_in_backward"] = knobs["step_in_backward"]
    cfg["prefetch"]["depth"] = knobs["depth"]
    if run["config_clips"]:  # the step clips; the boundary from the accumulation
        cfg["gradient_clipping"] = run["clip"]
        cfg["gradient_accumulation_steps"] = run["accum"]
    return cfg


def _train(cfg: dict, run: dict, data, start=0, steps=STEPS, checkpoint=None, seed=0):
    """``steps`` steps from ``start`` (after a load of ``checkpoint`` when given): the losses,
    and the model, its optimizer (open: the caller closes it) and the scheduler."""
    model, opt = offload.wrap(make_model(seed, **run["model"]), cfg)
    try:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        if checkpoint is not None:
            extra = offload.load_checkpoint(checkpoint, model, opt)
            sched.load_state_dict(extra["scheduler"])
            assert extra["step"] == start
        clip = 0.0 if run["config_clips"] else run["clip"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # small buffers: "allowed but slow" warnings
            losses, sched = train_wrapped(
                model, opt, data, steps, run["accum"], clip, start=start, sched=sched
            )
        return losses, model, opt, sched
    except BaseException:
        opt.close()
        raise


def _reference(run: dict, data):
    return reference_fp32(make_model(**run["model"]), data, STEPS, run["accum"], run["clip"])


def _check(losses, weights, ref, ref_losses) -> None:
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0
    )
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(weights[k], v, rtol=0, atol=WEIGHT_ATOL, msg=k)


def _cases(seeds, configs: int) -> list:
    return [pytest.param(seed, id=f"{seed}-{_draw(seed, configs)[1]}") for seed in seeds]


@pytest.mark.heavy
@pytest.mark.parametrize("seed", _cases(range(100, 124), 1))
def test_a_random_config_trains_as_torch(tmp_path, seed):
    run, _ = _draw(seed, 1)
    data = batches(6)
    ref, ref_losses = _reference(run, data)
    losses, model, opt, _ = _train(_config(run, run["placements"][0], tmp_path), run, data)
    try:
        weights = model.state_dict()
    finally:
        opt.close()
    _check(losses, weights, ref, ref_losses)


@pytest.mark.heavy
@pytest.mark.parametrize("seed", _cases(range(200, 212), 2))
def test_a_checkpoint_resumes_under_another_random_config(tmp_path, seed):
    run, _ = _draw(seed, 2)
    first, second = (_config(run, k, tmp_path / str(i)) for i, k in enumerate(run["placements"]))
    data = batches(6)
    ref, ref_losses = _reference(run, data)
    half = STEPS // 2
    losses, model, opt, sched = _train(first, run, data, steps=half)
    try:
        offload.save_checkpoint(
            tmp_path / "ck", model, opt, scheduler=sched.state_dict(), step=half
        )
    finally:
        opt.close()
    # another seed: every value the second run trains from comes from the checkpoint
    more, model, opt, _ = _train(second, run, data, start=half, checkpoint=tmp_path / "ck", seed=5)
    try:
        weights = model.state_dict()
    finally:
        opt.close()
    _check(losses + more, weights, ref, ref_losses)
