"""One rank of ``OffloadTrainer`` under torchrun (or one plain process): the tiny Llama of
``hf_models`` trained 5 steps by the Trainer with offload's optimizer, the global batch of 2
split over the ranks. Arguments: the model directory, an output directory, the params' and
the optimizer's devices, and a mode: ``plain``, ``save`` (a Trainer checkpoint every 2 steps)
or ``resume`` (from the ``save`` run's checkpoint of step 2). Rank 0 writes
``result.<mode>.w<world>.json`` (the logged losses and grad norms) and
``state.<mode>.w<world>.pt`` (``model.state_dict()``, gathered)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from hf_models import VOCAB, nvme_config  # noqa: E402

import offload  # noqa: E402
from offload.dist import init_process_group  # noqa: E402


def main(model_dir: str, out: str, param_dev: str, opt_dev: str, mode: str = "plain") -> None:
    from transformers import TrainingArguments  # noqa: PLC0415

    world = int(os.environ.get("WORLD_SIZE", "1"))
    late = os.environ.get("GROUP_AFTER_WRAP") == "1"  # the mistake the Trainer refuses
    if world > 1 and not late:
        init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    out = Path(out)
    cfg = nvme_config(out / f"swap.{mode}.w{world}", param_dev, opt_dev)
    cfg["optimizer"]["lr"] = 1e-2
    model, opt = offload.from_pretrained(model_dir, cfg)
    if world > 1 and late:
        init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(20):
        t = torch.randint(3, VOCAB, (12,), generator=g)
        data.append({"input_ids": t, "labels": t})
    args = TrainingArguments(
        output_dir=str(out / f"trainer.w{world}"), max_steps=5,
        save_strategy="no" if mode == "plain" else "steps", save_steps=2,
        per_device_train_batch_size=2 // world, gradient_accumulation_steps=2,
        learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, logging_steps=1, report_to=[],
        use_cpu=True, lr_scheduler_type="cosine", warmup_steps=2, seed=0,
        disable_tqdm=True,
    )  # fmt: skip
    try:
        trainer = offload.OffloadTrainer(
            model=model, args=args, train_dataset=data, optimizers=(opt, None)
        )
        resume = out / f"trainer.w{world}" / "checkpoint-2" if mode == "resume" else None
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        state = model.state_dict()  # (gathered: every rank calls it)
        if rank == 0:
            result = {"losses": [h["loss"] for h in logs], "norms": [h["grad_norm"] for h in logs]}
            (out / f"result.{mode}.w{world}.json").write_text(json.dumps(result))
            torch.save(state, out / f"state.{mode}.w{world}.pt")
    finally:
        opt.close()
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
