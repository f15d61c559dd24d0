"""Random engine configurations across ranks against plain PyTorch on the whole batch (fp32):
``test_parity_fuzz``'s knobs, drawn with a ZeRO stage and a model, run by gloo ranks.

Each case is drawn from a fixed seed (its id says what it drew): the placements, buffers,
``persistence_threshold``, ``prefetch.depth``, ``aio`` and ``step_in_backward`` of
``test_parity_fuzz._draw_placement``, its optimizer section (Adam or AdamW, decay, betas, eps,
``no_decay``), ``distributed.stage`` 1-3, accumulation 1-3, clipping
through ``optimizer.clip_grad_norm_`` or the config at a threshold that clips every step or
none, and the model (``engine_models``' TinyLM or the ``StackLM`` of ``_dist_worker``). The
ranks train their slices of every global batch (``_dist_worker``); the reference is torch's
AdamW on the concatenated batch.

- ``test_a_random_config_on_two_ranks_trains_as_torch``: four steps, losses (the mean over
  ranks) and the gathered weights.
- ``test_a_checkpoint_resumes_on_other_ranks_under_another_random_config``: two steps on two
  ranks, ``save_checkpoint``, then ``load_checkpoint`` on four ranks under another config
  (other placements, stage, buffers and modes) and two more steps: torch's four steps.

Heavy (34 cases in two groups of ranks, ~40 s on the shared 2-core machine): starting
processes dominates, so every case of a world size runs in one group, as ``test_dist`` does;
a job that raises fails the cases of its group, each rank's error naming the job. They can
fail: with rank 1's shard scaled by 1.001 in every all-gather (a scratch change in
``offload.dist.comm``), all of them failed.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from _dist_worker import GLOBAL_BATCH, STEPS_DATA
from dist_harness import result, run_ranks
from engine_models import StackLM, batches, make_model, placement_config, reference_fp32
from test_parity_fuzz import (
    _draw_optimizer,
    _draw_placement,
    _name,
    _optimizer_name,
    apply_knobs,
    reference_hyper,
)

STEPS = 4
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-4  # as test_parity_fuzz: summation order differs
# the config keys a job's draw sets (the worker builds the rest: device, dtype, wrap, stage)
DRAWN = ("offload_param", "offload_optimizer", "prefetch", "aio", "optimizer")
DRAWN += ("gradient_clipping", "gradient_accumulation_steps")
PARITY_SEEDS, RESUME_SEEDS = range(300, 324), range(400, 410)


def _draw(seed: int, configs: int) -> tuple[dict, str]:
    """The run (model, accumulation, clipping and how) and ``configs`` placements with their
    stages drawn from ``seed`` (the first trains, or saves; the second resumes), and the case's
    name."""
    rng = random.Random(seed)
    clip = rng.choice([0.0, 0.05, 10.0])  # none; every step clips; none clips
    model = rng.choice(["tiny", "stack"])
    run = {
        "model": model,
        "accum": rng.choice([1, 2, 3]),
        "clip": clip,
        "config_clips": bool(clip) and rng.random() < 0.5,
        "optimizer": _draw_optimizer(rng, ("bias", "norm") if model == "tiny" else ("bias",)),
        "placements": [
            _draw_placement(rng) | {"stage": rng.choice([1, 2, 3])} for _ in range(configs)
        ],
    }
    name = "-".join(
        [
            f"{run['model']}-a{run['accum']}-c{clip}{'cfg' if run['config_clips'] else ''}",
            _optimizer_name(run["optimizer"]),
            *(f"s{k['stage']}-{_name(k)}" for k in run["placements"]),
        ]
    )
    return run, name


def _job(name: str, run: dict, knobs: dict, out: Path, steps: int, **kw) -> dict:
    """A ``_dist_worker`` job of these knobs; its sections replace the worker's whole (its NVMe
    directories are the worker's, ``out/nvme/<name>``)."""
    cfg = apply_knobs(
        placement_config(knobs["param"], knobs["optim"], out / "nvme" / name), run, knobs
    )
    extra = {k: cfg[k] for k in DRAWN if k in cfg}
    job = dict(
        name=name,
        param=knobs["param"],
        optim=knobs["optim"],
        stage=knobs["stage"],
        steps=steps,
        accum=run["accum"],
        clip=0.0 if run["config_clips"] else run["clip"],
        config=extra,
        **kw,
    )
    if run["model"] == "stack":
        job["model"] = "stack"
    return job


def _reference(run: dict):
    if run["model"] == "stack":
        torch.manual_seed(0)  # as _dist_worker builds it
        model = StackLM(n=4)
    else:
        model = make_model()
    data = batches(STEPS_DATA, batch=GLOBAL_BATCH)
    return reference_fp32(
        model, data, STEPS, run["accum"], run["clip"], **reference_hyper(run["optimizer"])
    )


def _check(out: Path, names: list[str], run: dict) -> None:
    """The ranks' losses of the jobs ``names`` (in order) and the last one's gathered weights
    against torch's four steps."""
    ref, ref_losses = _reference(run)
    losses = [x for n in names for x in result(out, n)["losses"]]
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(ref_losses, dtype=torch.float64),
        rtol=LOSS_RTOL,
        atol=0,
    )
    weights = torch.load(out / f"{names[-1]}.pt")["state"]
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(weights[k].float(), v, rtol=0, atol=WEIGHT_ATOL, msg=k)


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> Path:
    """Every case's ranks: one group of 2 (the parity cases, and the resumes' first halves),
    then one of 4 (the resumes' second halves)."""
    out = tmp_path_factory.mktemp("dist_fuzz")
    two, four = [], []
    for seed in PARITY_SEEDS:
        run, _ = _draw(seed, 1)
        two.append(_job(f"p{seed}", run, run["placements"][0], out, STEPS))
    for seed in RESUME_SEEDS:
        run, _ = _draw(seed, 2)
        first, second = run["placements"]
        ck = str(out / f"ck{seed}")
        two.append(_job(f"a{seed}", run, first, out, STEPS // 2, save=ck))
        four.append(_job(f"b{seed}", run, second, out, STEPS, load=ck))
    run_ranks(2, two, out)
    run_ranks(4, four, out)
    return out


def _cases(seeds, configs: int) -> list:
    return [pytest.param(seed, id=f"{seed}-{_draw(seed, configs)[1]}") for seed in seeds]


@pytest.mark.heavy
@pytest.mark.parametrize("seed", _cases(PARITY_SEEDS, 1))
def test_a_random_config_on_two_ranks_trains_as_torch(groups, seed):
    _check(groups, [f"p{seed}"], _draw(seed, 1)[0])


@pytest.mark.heavy
@pytest.mark.parametrize("seed", _cases(RESUME_SEEDS, 2))
def test_a_checkpoint_resumes_on_other_ranks_under_another_random_config(groups, seed):
    _check(groups, [f"a{seed}", f"b{seed}"], _draw(seed, 2)[0])
