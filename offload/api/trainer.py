"""``OffloadTrainer``: Hugging Face ``Trainer`` for a model wrapped by offload.

Use it as ``Trainer``, with the pair ``wrap`` (or ``from_pretrained``) returned::

    model, optimizer = offload.from_pretrained(path, config)
    trainer = offload.OffloadTrainer(model=model, args=args, train_dataset=data,
                                     optimizers=(optimizer, scheduler_or_None))

What it changes (``offload.api.clipping``): ``max_grad_norm`` clips through
``optimizer.clip_grad_norm_`` (and it alone: the config's ``gradient_clipping`` is off while the
Trainer trains, said where the two differ) and the logged ``grad_norm`` is the real one whatever the placement
(a plain ``Trainer`` would get no gradient from the parameters and is stopped by the guard);
with fp16 compute the loss is scaled (``optimizer.scale_loss``) before its backward.
The model is never moved to ``args.device``: its homes own the parameters and inputs are moved
by offload's hooks, nor wrapped in ``DistributedDataParallel`` under torchrun (offload shards
and reduces itself). Checkpoints stream the state from the tiers: the optimizer's as an
offload checkpoint (``checkpoint-N/offload_state``), the weights through offload's
``save_pretrained``, where the Trainer's gathered both into host RAM on one process.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings

from offload.api.checkpoint import load_checkpoint, save_checkpoint
from offload.api.clipping import route_clipping
from offload.api.optimizer import OffloadOptimizer
from offload.api.pretrained import save_pretrained

logger = logging.getLogger("offload.api")

STATE_DIR = "offload_state"
"""A Trainer checkpoint's offload checkpoint of the optimizer (not named "optimizer*": the
Trainer takes a folder so named for its own optimizer file)."""


def _warn_unused_arguments(args, optimizer: OffloadOptimizer) -> None:
    """The optimizer was built from the offload config before the Trainer: TrainingArguments'
    optimizer settings do not reach it (as with a plain Trainer handed an optimizer). Where
    they differ from what it runs, one warning says so, naming both values (Trainer users
    expect ``learning_rate`` to be the LR, and HF's default is 5e-5, not the config's). A
    model that trains nothing (an evaluation of a frozen model) has no optimizer settings to
    differ."""
    group = optimizer.param_groups[0]
    if not group["params"]:
        return
    ours = {
        "learning_rate": group.get("initial_lr", group["lr"]),
        "weight_decay": group["weight_decay"],
        "adam_beta1": group["betas"][0],
        "adam_beta2": group["betas"][1],
        "adam_epsilon": group["eps"],
    }
    differ = [
        f"{k}={getattr(args, k)!r} (the config's {v!r})"
        for k, v in ours.items()
        if getattr(args, k, v) != v
    ]
    optim = str(getattr(getattr(args, "optim", ""), "value", getattr(args, "optim", "")))
    if optim and not optim.startswith("adamw_torch") and optim != "adamw_hf":
        differ.append(
            f"optim={optim!r} (offload runs {'AdamW' if group['adamw_mode'] else 'Adam'})"
        )
    if differ:
        logger.warning(
            "OffloadTrainer: the optimizer is the offload config's (its optimizer section), so "
            "these TrainingArguments do not apply: %s. Set them in the config",
            ", ".join(differ),
        )


def _zero_grad_through(holder: torch.nn.Module, wrapped: torch.nn.Module) -> None:
    """The Trainer clears gradients with ``model.zero_grad()``; a model holding the wrapped
    one clears only ``p.grad``, not the gradients offload holds (the next backward is then
    refused), so its ``zero_grad`` also calls the wrapped model's (offload's)."""

    def zero_grad(set_to_none: bool = True) -> None:
        torch.nn.Module.zero_grad(holder, set_to_none)
        wrapped.zero_grad(set_to_none)

    holder.zero_grad = zero_grad


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


class OffloadTrainer(transformers.Trainer):
    def __init__(self, *args, **kwargs) -> None:
        optimizers = kwargs.get("optimizers") or (None, None)
        if not isinstance(optimizers[0], OffloadOptimizer):
            raise TypeError(
                "OffloadTrainer: pass optimizers=(optimizer, scheduler) with the optimizer "
                "offload.wrap / offload.from_pretrained returned (scheduler may be None); got "
                f"{type(optimizers[0]).__name__}"
            )
        model = kwargs.get("model", args[0] if args else None)
        wrapped = optimizers[0]._engine.model
        # the wrapped model, or one holding it (a PeftModel around the transformers model
        # that was wrapped: the Trainer then saves the adapters)
        if model is not None and not any(m is wrapped for m in model.modules()):
            raise TypeError(
                "OffloadTrainer: model= neither is nor holds the model this optimizer trains; "
                "pass the model offload.wrap / offload.from_pretrained returned with it, or a "
                "model holding it (a PeftModel whose get_base_model() was wrapped): a model "
                f"offload did not wrap would train nothing (got {type(model).__name__})"
            )
        if model is not None and model is not wrapped:
            _zero_grad_through(model, wrapped)
        self._offload_optimizer = optimizers[0]
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if targs is not None:  # (a mismatch would fail at the step's extra micro-batch)
            optimizers[0]._engine.schedule.check_accumulation(
                targs.gradient_accumulation_steps,
                f"OffloadTrainer: gradient_accumulation_steps={targs.gradient_accumulation_steps}",
            )
        super().__init__(*args, **kwargs)
        _warn_unused_arguments(self.args, optimizers[0])
        self._warn_decay_of_excluded()

    def _warn_decay_of_excluded(self) -> None:
        """transformers' Trainer, building its optimizer itself, leaves biases and norm weights
        undecayed (two groups); offload's optimizer decays what its config's
        ``optimizer.no_decay`` (or ``set_no_decay``) does not leave out, every parameter by
        default (1.5e-2 off the Trainer's norm weights after 3 steps at decay 0.5). Where the
        two sets differ and the decay is not 0, one warning says so and how to match."""
        optimizer = self._offload_optimizer
        decays = [g["weight_decay"] for g in optimizer.param_groups if g["weight_decay"]]
        if not decays:
            return
        decayed = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        ours = optimizer.no_decay
        more = [n for n, p in named if n not in decayed and p not in ours]
        extra = [n for n, p in named if n in decayed and p in ours]
        if not more and not extra:
            return
        logger.warning(
            "OffloadTrainer: with weight_decay=%s offload's optimizer decays %d parameter(s) "
            "that transformers' Trainer leaves undecayed (%s)%s; the training differs from the "
            "Trainer's. To match it, call optimizer.set_no_decay(p for n, p in "
            "model.named_parameters() if n not in trainer.get_decay_parameter_names(model)) "
            "before train(), or list them in the config's optimizer.no_decay (name patterns, "
            "e.g. ['bias', 'norm'])",
            decays[0],
            len(more),
            _some(more),
            f", and leaves undecayed {len(extra)} that it decays ({_some(extra)})" if extra else "",
        )

    def train(self, *args, **kwargs):
        """``Trainer.train``, its ``max_grad_norm`` deciding the clipping as in a plain
        Trainer (0: none). The optimizer clips in ``step()`` to the config's
        ``gradient_clipping`` where its loop did not clip first: with ``max_grad_norm=0`` it
        clipped anyway, silently (1.4e-2 off the Trainer's weights in 5 steps), and a config's
        value other than ``max_grad_norm`` went unused unsaid. While the Trainer trains it is
        off (said where the two differ), and back after."""
        optimizer = self._offload_optimizer
        kept, wanted = optimizer.gradient_clipping, float(self.args.max_grad_norm or 0.0)
        if kept > 0 and kept != wanted:
            logger.warning(
                "OffloadTrainer: TrainingArguments' max_grad_norm=%r decides the clipping (%s); "
                "the config's gradient_clipping=%r is not applied while the Trainer trains",
                self.args.max_grad_norm,
                "none" if wanted <= 0 else "the Trainer clips each step",
                kept,
            )
        optimizer.gradient_clipping = 0.0
        try:
            return super().train(*args, **kwargs)
        finally:
            optimizer.gradient_clipping = kept

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        route_clipping(self.accelerator)
        # offload's homes own the parameters: Accelerate must not move the model
        self.accelerator.device_placement = False
        ranks, world = self.accelerator.num_processes, self._offload_optimizer._engine.comm.world
        if ranks != world:
            raise RuntimeError(
                f"OffloadTrainer: the Trainer runs {ranks} processes but the model was wrapped "
                f"over {world} rank(s) (offload.wrap / from_pretrained ran before the process "
                "group existed, or in another one): each rank would train a model of its own "
                "on its share of the data. Call offload.dist.init_process_group() (or build the "
                "TrainingArguments, which does) before offload.from_pretrained / offload.wrap"
            )
        # nor wrap it in DistributedDataParallel under torchrun: offload shards the state and
        # reduces the gradients over the ranks itself; DDP's hooks would reduce them again and
        # its zero_grad does not reach offload's (the second step was refused on every rank).
        # Accelerate's evaluation_mode leaves out exactly that wrapping (its autocast stays)
        prepare_model = self.accelerator.prepare_model
        self.accelerator.prepare_model = lambda model, device_placement=None, **_: prepare_model(
            model, device_placement, evaluation_mode=True
        )
        # fp16 (offload's dtype, not Accelerate's): the loss is scaled as the optimizer's step
        # and clipping expect (they divide by the scale); Trainer's plain backward left the
        # gradients 65536x small, the logged grad_norm too, and clipping never applied
        backward, scale = self.accelerator.backward, self._offload_optimizer.scale_loss
        self.accelerator.backward = lambda loss, **kwargs: backward(scale(loss), **kwargs)

    def _move_model_to_device(self, model, device) -> None:
        pass  # see create_accelerator_and_postprocess

    # Note: checkpoints on several ranks
    #   The Trainer saves the model's and the optimizer's state dicts on its main process only;
    #   offload's are collective (each rank holds a share, gathered for them), so the ranks'
    #   collectives differed at the first checkpoint and gloo aborted a process. With several
    #   ranks every rank gathers the model's; the Trainer's own saving, on the main process,
    #   then writes those values (its read answered from what was gathered). The optimizer's
    #   is an offload checkpoint, collective itself (_save_optimizer_and_scheduler).

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Saving reads values, never trains: under ``no_grad`` a part of the model that the
        save calls by itself gathers its unit (PEFT's prompt tuning, the ``PeftModel`` wrapped
        whole, computes the embeddings it saves with its prompt encoder: that call was refused
        with gradients on, and ``save_model`` and every checkpoint of ``save_strategy``
        raised). Several ranks: Note: checkpoints on several ranks."""
        with torch.no_grad():
            if isinstance(self.model, transformers.PreTrainedModel):  # the wrapped model itself
                # streamed from the tiers, one unit at a time, every rank (rank 0 writes): its
                # save_pretrained read model.state_dict(), every weight in host RAM at once
                save_pretrained(self.model, output_dir or self.args.output_dir)
                with _answered(self.model, "save_pretrained", None):  # (the rest: the Trainer's)
                    return super().save_model(output_dir, _internal_call)
            if self.accelerator.num_processes == 1:  # a model holding it (a PeftModel's adapters)
                return super().save_model(output_dir, _internal_call)
            state = self.model.state_dict()  # every rank
            with _answered(self.model, "state_dict", state):
                return super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The optimizer's state goes into ``output_dir/offload_state`` as an offload checkpoint
        (``save_checkpoint``: streamed from the tiers piece by piece, each rank its share)
        where the Trainer wrote ``optimizer.pt`` from ``optimizer.state_dict()``, which gathers
        the fp32 master and moments (12 bytes a parameter: 84 GB for a 7B model) into host
        RAM on one process; the scheduler's state is the Trainer's ``scheduler.pt``."""
        engine = self._offload_optimizer._engine
        save_checkpoint(Path(output_dir) / STATE_DIR, engine.model, self._offload_optimizer)
        if self.args.should_save:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER_NAME)
            reissue_pt_warnings(caught)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """A checkpoint of :meth:`_save_optimizer_and_scheduler`: the offload checkpoint (the
        master, the moments, the step counters: the training resumes bitwise) and the
        scheduler's state; one with ``optimizer.pt`` (an earlier offload's) as the Trainer
        loads it."""
        saved = None if checkpoint is None else Path(checkpoint) / STATE_DIR
        if saved is None or not saved.is_dir():
            return super()._load_optimizer_and_scheduler(checkpoint)
        engine = self._offload_optimizer._engine
        load_checkpoint(saved, engine.model, self._offload_optimizer)
        with warnings.catch_warnings(record=True) as caught:
            state = torch.load(Path(checkpoint) / SCHEDULER_NAME, weights_only=True)
            self.lr_scheduler.load_state_dict(state)
        reissue_pt_warnings(caught)


@contextlib.contextmanager
def _answered(obj, method: str, value):
    """``obj.method()`` returns ``value`` inside the block (an instance attribute over the
    class's method; what the instance held before is put back after)."""
    held = obj.__dict__.get(method)
    obj.__dict__[method] = lambda *args, **kwargs: value
    try:
        yield
    finally:
        if held is None:
            del obj.__dict__[method]
        else:
            obj.__dict__[method] = held
