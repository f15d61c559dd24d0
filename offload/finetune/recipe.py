"""``offload finetune``: a Hugging Face model directory + a data file -> a fine-tuned directory.

One run: ``from_pretrained`` (the model streams from its shards into the tiers), the data packed
into sequences (``offload.finetune.data``), AdamW with linear warm-up and cosine decay, gradient
accumulation (the step's loss the mean over every token it covers, as transformers' Trainer
makes it), clipping through ``optimizer.clip_grad_norm_``, checkpoints every ``save_every``
steps, and at the end a Hugging Face export (``save_pretrained`` + the tokenizer) in
``OUT/hf``. ``OUT`` also gets ``metrics.jsonl`` and ``report.png`` (the demo's report).

Note: resuming bitwise
    Everything a step depends on is a function of the step number or is in the checkpoint: the
    batch of micro-step ``k`` comes from a permutation seeded by (seed, epoch)
    (``data.Order``); dropout draws from torch's generator, seeded by ``--seed`` before the
    model loads (``transformers.set_seed``, as the HF Trainer); the LR comes from the scheduler's state, saved as JSON with the
    checkpoint along with the torch RNG state; the optimizer state and step count are the
    checkpoint's. So ``--resume`` from the checkpoint of step ``s`` computes steps ``s+1...``
    exactly as the uninterrupted run did. A resume with another ``--seq-len``, ``--batch``,
    ``--accum``, ``--seed`` or data file is refused (it would not be the same run).
    ``metrics.jsonl`` keeps the records up to the checkpoint's step (not the stopped run's
    summary) and appends the rest.

Note: Ctrl-C
    Ends the loop after the current step; no export, the last checkpoint stays, the swap files
    are removed (``optimizer.close()``), exit status 130.

Note: several ranks
    Under torchrun (``--nproc N`` starts it on this machine) each rank joins the process group
    (``offload.cli.ranks``) and the model's state is sharded over the ranks as ``wrap`` does
    (``distributed.stage``). Micro-batch ``k`` of the run is ``Order``'s batch of
    ``--batch`` x ranks sequences, rank ``r`` computing its ``r``-th slice, so N ranks at
    ``--batch b`` train as one process at ``--batch N x b`` (the step's loss still the mean over
    every token of the step, over all ranks: offload averages the gradients over the ranks, so
    each rank's loss, its tokens' sum over the step's count, is weighed by N). Rank 0 writes
    ``metrics.jsonl``, the report, the tokenizer and shows the progress; checkpoints and the
    export are collective (each rank writes its share; rank 0 the export). A resume at another
    rank count continues the run when ``--batch`` x ranks is the checkpoint's (the same
    sequences per micro-batch: a run that lost a rank goes on at twice the ``--batch``); at
    another global batch it is refused (its batches would differ).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from offload.finetune.data import IGNORE, Order, load_data

DEFAULT_LR = 2e-5
DEFAULT_MAX_GRAD_NORM = 1.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
TIER_SHORT = {"nvme->host": "rd", "host->nvme": "wr", "host->device": "h2d", "device->host": "d2h"}


@dataclasses.dataclass(kw_only=True)
class Options:
    """What ``offload finetune`` was asked (the command's flags)."""

    model: str
    data: str
    out: str
    config: str | None = None
    steps: int | None = None
    epochs: float | None = None
    seq_len: int = 512
    batch: int = 1
    accum: int | None = None  # None: the config's gradient_accumulation_steps, else 1
    lr: float | None = None  # None: the config's optimizer.lr, else DEFAULT_LR
    warmup: int = 0
    max_grad_norm: float | None = None  # None: the config's gradient_clipping, else 1.0
    save_every: int = 0
    resume: bool = False
    seed: int = 0
    gradient_checkpointing: bool = False
    progress: bool = True
    report: bool = True


def cosine_with_warmup(warmup: int, total: int):
    """The LR factor of step ``s`` (0-based): linear warm-up, then cosine decay to 0 (the
    schedule of ``transformers.get_cosine_schedule_with_warmup``)."""

    def factor(s: int) -> float:
        if s < warmup:
            return s / max(1, warmup)
        progress = (s - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return factor


def offload_config(opts: Options, out: Path) -> tuple[dict, Options, bool, bool]:
    """The user's config (or the defaults) with the run's learning rate, accumulation and
    clipping, and ``opts`` with the three resolved: a flag given wins over the config file (said
    on stderr when they differ), a value the file sets is used when the flag is not given, else
    the flag's default. An NVMe section that names no ``nvme_path`` gets ``OUT/swap`` (in
    offload's format and in DeepSpeed's); the third value says so (the run removes it at the
    end, and only then). The fourth says whether the file lists ``optimizer.no_decay`` itself
    (else the run leaves out of weight decay what transformers' Trainer does)."""
    from offload.config import ConfigError, load_config  # noqa: PLC0415
    from offload.config.deepspeed import is_deepspeed_config  # noqa: PLC0415
    from offload.config.loader import nvme_sections_without_path, read_config_file  # noqa: PLC0415

    raw = copy.deepcopy(read_config_file(opts.config)) if opts.config else {}
    swap = False
    deepspeed = isinstance(raw, dict) and is_deepspeed_config(raw)
    for sec in nvme_sections_without_path(raw):
        (out / "swap").mkdir(parents=True, exist_ok=True)
        sec["nvme_path"] = str(out / "swap")
        swap = True
    try:
        cfg = load_config(raw).to_dict()
    except ConfigError as exc:
        if swap:
            _remove_swap(out / "swap")
        raise exc.with_source(opts.config) if opts.config else exc from None
    lr = _flag_or_file(opts.lr, "--lr", _lr_in_file(raw, deepspeed), "optimizer.lr", opts.config)

    def in_file(key: str):  # the loaded value of a top-level key the file sets to a number
        return cfg[key] if isinstance(raw, dict) and _is_number(raw.get(key)) else None

    key = "gradient_accumulation_steps"
    accum = _flag_or_file(opts.accum, "--accum", in_file(key), key, opts.config)
    key = "gradient_clipping"
    clip = _flag_or_file(opts.max_grad_norm, "--max-grad-norm", in_file(key), key, opts.config)
    opts = dataclasses.replace(
        opts,
        lr=DEFAULT_LR if lr is None else lr,
        accum=accum or 1,
        max_grad_norm=DEFAULT_MAX_GRAD_NORM if clip is None else clip,
    )
    cfg["optimizer"]["lr"] = opts.lr
    # the step in backward updates on the last micro-batch of each step: it is --accum's
    cfg["gradient_accumulation_steps"] = opts.accum
    # the loop clips (optimizer.clip_grad_norm_, to opts.max_grad_norm); the optimizer's own
    # clipping in step() clipped to the file's value when the loop did not (--max-grad-norm 0)
    cfg["gradient_clipping"] = 0.0
    section = raw.get("optimizer") if isinstance(raw, dict) and not deepspeed else None
    return cfg, opts, swap, isinstance(section, dict) and "no_decay" in section


def _is_number(value) -> bool:
    """Whether the file sets the key to a number (the loader takes an integral float such as
    4.0 or 1e1 as a count: a file's accumulation of 4.0 was taken as unset, so 1), not to
    DeepSpeed's "auto" or leaves it out."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _lr_in_file(raw, deepspeed: bool) -> float | None:
    """The learning rate the config file itself sets (not a default; DeepSpeed's "auto" is
    none)."""
    section = raw.get("optimizer") if isinstance(raw, dict) else None
    if deepspeed and isinstance(section, dict):
        section = section.get("params")
    lr = section.get("lr") if isinstance(section, dict) else None
    return float(lr) if isinstance(lr, int | float) and not isinstance(lr, bool) else None


def _flag_or_file(flag, flag_name: str, in_file, key: str, config: str | None):
    if flag is None:
        return in_file
    if in_file is not None and in_file != flag:
        print(
            f"offload finetune: {flag_name} {flag} overrides {key}={in_file} of '{config}'",
            file=sys.stderr,
        )
    return flag


def _rng_state() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def _set_rng_state(text: str) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8))


def _postfix(rec: dict[str, Any]) -> str:
    moved = rec["bytes"]
    rates = " ".join(
        f"{short} {moved.get(pair, 0) / rec['wall_seconds'] / 1e9:.2f}"
        for pair, short in TIER_SHORT.items()
        if moved.get(pair)
    )
    return (
        f"loss {rec['loss']:.3f} | {rec['tokens_per_second']:.0f} tok/s | fwd "
        f"{rec['forward_seconds']:.2f} bwd {rec['backward_seconds']:.2f} step "
        f"{rec['step_wall']:.2f} s" + (f" | GB/s {rates}" if rates else "")
    )


def _check_model_dir(model: Path) -> None:
    """A model directory that is not one is named here, before the tokenizer's loader says
    it could not reach the Hub (a missing directory) or asks for sentencepiece (no tokenizer
    files), and before OUT is made."""
    if not model.is_dir():
        raise ValueError(f"--model '{model}': no such directory (a Hugging Face model directory)")
    if not (model / "config.json").is_file():
        raise ValueError(
            f"--model '{model}': no config.json in it (a Hugging Face model directory)"
        )
    if not any((model / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"--model '{model}': no tokenizer in it (one of {', '.join(TOKENIZER_FILES)}); the "
            "recipe takes the tokenizer from the model directory"
        )


def _check_out(out: Path, ckpt_dir: Path, resume: bool) -> None:
    """A new run into an OUT that holds another run's checkpoints would prune them (keep_last)
    and mix two runs' files: refused unless it resumes that run. An OUT that is a file is
    named (its mkdir said only "File exists")."""
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"--out '{out}' is a file, not a directory; allowed: a new or existing directory "
            "(nothing was changed)"
        )
    if resume:
        if not (ckpt_dir / "latest").exists():
            raise ValueError(f"--resume: no checkpoint in '{ckpt_dir}'")
        return
    if ckpt_dir.exists() and not ckpt_dir.is_dir():  # (found at the first save, after
        raise ValueError(  # --save-every steps of training, which were lost)
            f"--out '{out}': its '{ckpt_dir.name}' is a file, where the run's checkpoints go; "
            "give a new --out (nothing there was changed)"
        )
    held = sorted(p.name for p in ckpt_dir.glob("ckpt-*")) if ckpt_dir.is_dir() else []
    if (ckpt_dir / "latest").exists():  # another tool's (DeepSpeed's global_stepN), or ours
        held = held or [f"{ckpt_dir.name}/latest"]
    export = out / "hf"
    if held or (export.is_dir() and any(export.iterdir())):
        raise ValueError(
            f"--out '{out}' already holds a run ({', '.join(held) or 'hf/'}); add --resume to "
            "continue it, or give a new --out (nothing there was changed)"
        )


def _check_positions(model: Path, seq_len: int) -> None:
    """A ``--seq-len`` over the positions the model's config declares is refused before
    anything loads: a model with learned positions (GPT-2's ``n_positions``) failed with an
    ``IndexError`` in its first forward, after the model had streamed in."""
    import json  # noqa: PLC0415

    try:
        config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model '{model}': config.json cannot be read ({exc})") from None
    for key in ("n_positions", "max_position_embeddings"):
        limit = config.get(key) if isinstance(config, dict) else None
        if isinstance(limit, int) and seq_len > limit:
            raise ValueError(
                f"--seq-len {seq_len}: over the model's {key}={limit} (its config.json); "
                f"allowed: at most {limit} (a model whose positions extend, rotary ones with "
                "rope_scaling, declares the longer length in its config.json)"
            )


def _check_writable(export: Path) -> None:
    """The export at the end must not find its directory unwritable after all the training:
    a file is created and removed in it now (the directory too, when this made it)."""
    made = not export.exists()
    try:
        export.mkdir(parents=True, exist_ok=True)
        probe = export / ".offload-write-check"
        probe.touch()
        probe.unlink()
        if made:
            export.rmdir()
    except OSError as exc:
        raise ValueError(
            f"--out: the export directory '{export}' is not writable ({exc.strerror or exc})"
        ) from exc


def finetune(opts: Options, on_step=None) -> int:
    """Runs the recipe (see the module docstring); returns the exit status. ``on_step(record)``
    is called after each step (tests)."""
    from offload.cli.ranks import join_group  # noqa: PLC0415

    out = Path(opts.out)
    ckpt_dir = out / "checkpoints"
    _check_model_dir(Path(opts.model))
    _check_positions(Path(opts.model), opts.seq_len)
    _check_out(out, ckpt_dir, opts.resume)
    lr_flag = opts.lr  # (a resume takes it over the checkpoint's; None: not given)
    made = not out.exists()
    swap = joined = False
    try:
        cfg, opts, swap, no_decay_given = offload_config(opts, out)
        rank, world, joined = join_group(cfg["device"], cfg["distributed"]["timeout"])
        return _run(opts, out, cfg, no_decay_given, lr_flag, rank, world, on_step)
    finally:
        if joined:
            import torch.distributed as dist  # noqa: PLC0415

            dist.destroy_process_group()
        if swap:  # OUT/swap is the run's only when the config named no nvme_path
            _remove_swap(out / "swap")
        if made:  # a run that failed before writing anything leaves no OUT behind
            with contextlib.suppress(OSError):
                out.rmdir()


def _run(opts, out, cfg, no_decay_given, lr_flag, rank, world, on_step) -> int:
    """:func:`finetune` once the config is resolved and this process is rank ``rank`` of
    ``world`` (Note: several ranks)."""
    import transformers  # noqa: PLC0415
    from tqdm.auto import tqdm  # noqa: PLC0415

    import offload  # noqa: PLC0415
    from offload.api import engine_of  # noqa: PLC0415
    from offload.api.pretrained import check_causal_lm  # noqa: PLC0415
    from offload.demo.loop import current_rss, normalize_stats  # noqa: PLC0415
    from offload.demo.report import (  # noqa: PLC0415
        MetricsWriter,
        format_summary,
        plot_report,
        read_metrics,
        summarize,
    )

    lead = rank == 0
    ckpt_dir = out / "checkpoints"
    if not lead:  # rank 0 shows and writes what is the run's (Note: several ranks)
        opts = dataclasses.replace(opts, progress=False, report=False)
    out.mkdir(parents=True, exist_ok=True)
    if lead:  # (the export's writer; the others wait for it in from_pretrained's collectives)
        _check_writable(out / "hf")
    check_causal_lm(opts.model, "--model")  # from_pretrained builds what config.json names
    tokenizer = transformers.AutoTokenizer.from_pretrained(opts.model, local_files_only=True)
    data = load_data(opts.data, tokenizer, opts.seq_len).trained()
    if not len(data):
        raise ValueError(
            f"--data: '{opts.data}' has no sequence of {opts.seq_len} tokens with a token the "
            "loss covers (a completion)"
        )
    per_step = opts.batch * opts.accum * world
    if opts.steps is None:
        epochs = opts.epochs if opts.epochs is not None else 1.0
        total = max(1, math.ceil(epochs * len(data) / per_step))
    else:
        total = opts.steps
    run_id = {
        "seq_len": opts.seq_len,
        "batch": opts.batch,
        "accum": opts.accum,
        "seed": opts.seed,
        "sequences": len(data),
        "data": _tokens_digest(data),
        "ranks": world,
    }
    rss_before = current_rss()
    transformers.set_seed(opts.seed)  # dropout, weights the checkpoint lacks (as the Trainer)
    model, optimizer = offload.from_pretrained(opts.model, cfg)
    writer = None
    try:
        if opts.gradient_checkpointing:  # non-reentrant: offload's hooks run in recomputation
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if cfg["optimizer"]["weight_decay"] and not no_decay_given:
            _decay_as_the_trainer(model, optimizer, say=lead)
        model.train()
        by_tokens = _accepts_loss_kwargs(model)
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(opts.warmup, total))
        start = 0
        records: list[dict] = []
        if opts.resume:
            extra = offload.load_checkpoint(ckpt_dir, model, optimizer)
            saved = extra["run"]
            saved = {"ranks": 1} | saved  # (a run saved before it said: one process)
            if saved.get("data") == str(Path(opts.data).resolve()):  # (older: named by path)
                saved["data"] = run_id["data"]
            changed = [k for k in run_id if saved.get(k) != run_id[k]]
            if _same_global_batch(saved, run_id, changed, say=lead):
                changed = []
            if changed:
                raise ValueError(
                    "--resume: the checkpoint's run had "
                    + ", ".join(f"{k}={saved.get(k)!r}" for k in changed)
                    + "; this one has "
                    + ", ".join(f"{k}={run_id[k]!r}" for k in changed)
                )
            start = int(extra["step"])
            if start > total:  # it exported the checkpoint's model and saved it as step `total`
                raise ValueError(
                    f"--resume: the checkpoint is at step {start}, past this run's {total} "
                    f"steps; give --steps {start} or more"
                )
            sched.load_state_dict(extra["scheduler"])
            listed = cfg["optimizer"]["param_groups"]
            _resume_lr(optimizer, sched, lr_flag, start, [False] + ["lr" in g for g in listed])
            _set_rng_state(extra["rng"])
            if (out / "metrics.jsonl").exists():  # the run's records up to the checkpoint
                records = [
                    r
                    for r in read_metrics(out / "metrics.jsonl", on_bad=_left_out)
                    if r.get("kind") != "summary" and r.get("step", 0) <= start
                ]
        if opts.report:
            writer = MetricsWriter(out / "metrics.jsonl")
            for r in records:
                writer.write(r)
            if not opts.resume:
                run = {"kind": "run", "model": str(opts.model), "config": cfg, "steps": total}
                run["data_path"] = str(Path(opts.data).resolve())
                writer.write(run | run_id | {"rss_before_model_bytes": rss_before})
                records.append(run)
        order = Order(len(data), opts.batch * world, opts.seed)
        mine = slice(rank * opts.batch, (rank + 1) * opts.batch)
        # offload averages the gradients over the ranks: a loss over the step's tokens, on
        # every rank, is weighed by the ranks (a per-rank mean needs no weight)
        weight = world if by_tokens else 1
        budget = _host_budget(engine_of(model), cfg)
        vocab = getattr(model.config, "vocab_size", None) or len(tokenizer)
        elapsed0 = max((r.get("elapsed_seconds", 0.0) for r in records), default=0.0)
        t_start = time.perf_counter()
        if lead:
            print(
                f"offload finetune: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
                f"parameters; {len(data)} sequences of {opts.seq_len} tokens ({data.format}, "
                f"{data.documents} documents); {total} steps of {opts.batch} x {opts.accum}"
                + (f" on each of {world} ranks" if world > 1 else "")
                + (f", resuming after step {start}" if start else ""),
                file=sys.stderr,
            )
        bar = tqdm(
            total=total, initial=start, disable=not opts.progress, unit="step", dynamic_ncols=True
        )
        interrupted = False
        try:
            for step in range(start, total):
                t_step = time.perf_counter()
                fwd = bwd = 0.0
                loss_sum, tokens = 0.0, 0
                micro = [order.indices(step * opts.accum + m) for m in range(opts.accum)]
                loss_kwargs = {}
                if by_tokens:  # the step's mean over the tokens its loss covers (as the Trainer)
                    covered = sum(int((data.labels[i][:, 1:] != IGNORE).sum()) for i in micro)
                    loss_kwargs["num_items_in_batch"] = covered
                for idx in micro:
                    x, y = data.input_ids[idx[mine]], data.labels[idx[mine]]
                    t0 = time.perf_counter()
                    loss = model(input_ids=x, labels=y, **loss_kwargs).loss
                    if not by_tokens:
                        loss = loss / opts.accum
                    t1 = time.perf_counter()
                    weighed = loss * weight if weight != 1 else loss
                    optimizer.scale_loss(weighed).backward()  # fp16: the loss scale; else loss
                    fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
                    loss_sum += loss.item()
                    tokens += x.numel() * world
                if world > 1:  # the step's loss: the ranks' parts (by tokens) or their mean
                    loss_sum = _all_summed(loss_sum, engine_of(model).comm) * weight / world
                t2 = time.perf_counter()
                if not math.isfinite(loss_sum):  # before its step: the weights of before stay
                    raise FloatingPointError(
                        f"the loss became {loss_sum} at step {step + 1}, and the run stopped "
                        "before its update (an update before may have left non-finite weights, "
                        "checkpoints included: try a lower --lr)"
                    )
                if opts.max_grad_norm > 0:
                    norm = float(optimizer.clip_grad_norm_(opts.max_grad_norm))
                else:
                    norm = float(optimizer.grad_norm())
                lr = optimizer.param_groups[0]["lr"]
                optimizer.step()
                sched.step()
                optimizer.zero_grad()
                t3 = time.perf_counter()
                rec = normalize_stats(optimizer.stats())
                wall = t3 - t_step
                rec.update(
                    kind="step",
                    step=step + 1,
                    loss=loss_sum,
                    lr=lr,
                    grad_norm=norm,
                    tokens=tokens,
                    wall_seconds=wall,
                    forward_seconds=rec["forward_seconds"] or fwd,
                    backward_seconds=rec["backward_seconds"] or bwd,
                    forward_wall=fwd,
                    backward_wall=bwd,
                    step_wall=t3 - t2,
                    tokens_per_second=tokens / wall if wall > 0 else 0.0,
                    elapsed_seconds=elapsed0 + time.perf_counter() - t_start,
                    io_bytes=sum(rec["bytes"].values()),
                )
                rec["rss_bytes"] = rec["rss_bytes"] or current_rss()
                records.append(rec)
                if writer is not None:
                    writer.write(rec)
                bar.set_postfix_str(_postfix(rec), refresh=False)
                bar.update(1)
                if opts.save_every and (step + 1) % opts.save_every == 0 and step + 1 < total:
                    save(offload, ckpt_dir, model, optimizer, step + 1, sched, run_id)
                if on_step is not None:
                    on_step(rec)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            bar.close()
        if not interrupted:
            if opts.save_every:
                save(offload, ckpt_dir, model, optimizer, total, sched, run_id)
            export = out / "hf"
            offload.save_pretrained(model, export)
            if lead:
                tokenizer.save_pretrained(export)
        summary = summarize(records)
        if writer is not None:
            writer.write({"kind": "summary", "interrupted": interrupted, **summary})
            writer.close()
            writer = None
            try:
                plot_report(
                    records,
                    out / "report.png",
                    title=f"offload finetune: {Path(opts.model).name}",
                    host_budget=budget,
                    rss_before_bytes=rss_before,
                    loss_title="loss (nats per token)",
                    uniform_loss=math.log(vocab),
                )
            except ImportError:
                print("offload finetune: no report.png (pip install 'offload[plot]')")
        if not lead:
            return 130 if interrupted else 0
        header = [("model", str(opts.model)), ("out", str(out))]
        if world > 1:
            header.append(("ranks", str(world)))
        if not interrupted:
            header.append(("export", str(out / "hf")))
        print("\noffload finetune summary")
        print(format_summary(summary, header, uniform_loss=math.log(vocab)))
        return 130 if interrupted else 0
    finally:
        if writer is not None:
            writer.close()
        optimizer.close()


def _remove_swap(folder: Path) -> None:
    """``OUT/swap``, where the run put its swap files (its stores removed them as they
    closed): its folders that are empty now, bottom up (each rank's ``rank-NNNNN``, then it).
    A file in it stays, and the folder with it: a user's own (it was removed with whatever it
    held) or another rank's still open (the last rank out removes the folder)."""
    for sub in sorted(folder.glob("**/"), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):  # not empty
            sub.rmdir()


def _tokens_digest(data) -> str:
    """What identifies a run's data for ``--resume``: its packed tokens and labels (the file's
    content as this tokenizer and ``--seq-len`` made it). The file's absolute path did: a
    byte-identical copy elsewhere (data staged into a job's scratch directory, a requeued
    Slurm job) was refused, and the file edited in place was resumed without a word."""
    import hashlib  # noqa: PLC0415

    digest = hashlib.sha256()
    for t in (data.input_ids, data.labels):
        digest.update(t.contiguous().numpy().tobytes())
    return "tokens sha256:" + digest.hexdigest()


def _same_global_batch(saved: dict, run_id: dict, changed: list[str], say: bool) -> bool:
    """Whether a resume that changed only ``--batch`` and the rank count keeps the sequences of
    each micro-batch (batch x ranks the same): it is then the same run (Note: several ranks;
    the checkpoint reshards to any rank count), said on stderr."""
    if not changed or not set(changed) <= {"batch", "ranks"}:
        return False
    if saved["batch"] * saved["ranks"] != run_id["batch"] * run_id["ranks"]:
        return False
    if say:

        def on(run: dict) -> str:
            return f"{run['ranks']} rank{'s' if run['ranks'] > 1 else ''} at --batch {run['batch']}"

        print(
            f"offload finetune: --resume: the checkpoint's run had {on(saved)}; this one "
            f"continues it on {on(run_id)} (the same {run_id['batch'] * run_id['ranks']} "
            "sequences per micro-batch)",
            file=sys.stderr,
        )
    return True


def _all_summed(value: float, comm) -> float:
    """``value`` summed over the ranks (float64, so that every rank holds the same sum),
    through the model's collectives: a rank that stopped or is stuck ends the wait at
    ``distributed.timeout`` with offload's error, as every other wait on the ranks does (a
    plain ``all_reduce`` on the default group waited the group's own 30 minutes)."""
    t = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(t, what="the step's loss").wait()
    return float(t)


def _resume_lr(
    optimizer, sched, lr_flag: float | None, start: int, own_lr: list[bool] | None = None
) -> None:
    """The LR of a resumed run's steps: the checkpoint's scheduler state (its peak LR and step)
    under this run's schedule (``--steps`` and ``--warmup`` may have changed it: the optimizer
    state holds the LR the old schedule set for the next step, which the first resumed step
    used). ``--lr`` given replaces the peak from the checkpoint's step on (lowering the LR after
    a loss spike and resuming is the usual remedy), said on stderr; the scheduler state alone
    kept the old one without a word. ``own_lr``: per param group, whether the config's
    ``optimizer.param_groups`` gives it an ``lr`` of its own, which ``--lr`` leaves alone (as
    it does at the run's start: ``--lr`` is the config's ``optimizer.lr``)."""
    if lr_flag is not None and lr_flag != sched.base_lrs[0]:
        print(
            f"offload finetune: --lr {lr_flag} replaces the checkpoint's {sched.base_lrs[0]} "
            f"from step {start + 1} on (the schedule's warm-up and decay stay)",
            file=sys.stderr,
        )
        own = own_lr or [False] * len(sched.base_lrs)
        sched.base_lrs = [b if o else lr_flag for b, o in zip(sched.base_lrs, own, strict=True)]
    for group, base, factor in zip(
        optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True
    ):
        group["initial_lr"] = base
        group["lr"] = base * factor(sched.last_epoch)  # (LambdaLR's own expression)


def _decay_as_the_trainer(model, optimizer, say: bool) -> None:
    """Weight decay leaves alone the parameters transformers' Trainer leaves undecayed (biases,
    norm weights: its second param group), as the recipe this command mirrors does; the rule is
    the installed Trainer's own (``get_decay_parameter_names``; it reads nothing of the Trainer
    instance), so it follows transformers' versions. The config's ``optimizer.no_decay``, when
    the file lists it (``[]``: every parameter decays), replaces it. Said on stderr."""
    from transformers import Trainer  # noqa: PLC0415

    decayed = set(Trainer.get_decay_parameter_names(None, model))
    left = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in decayed]
    optimizer.set_no_decay(p for _, p in left)
    wd = optimizer.param_groups[0]["weight_decay"]
    if not say:
        return
    print(
        f"offload finetune: weight decay {wd} leaves {len(left)} parameter(s) undecayed as "
        "transformers' Trainer does (biases, norm weights); the config's optimizer.no_decay "
        "(name patterns, [] for none) sets others",
        file=sys.stderr,
    )


def _accepts_loss_kwargs(model) -> bool:
    """Whether the model's loss takes ``num_items_in_batch`` (the tokens the whole step's loss
    covers): then the accumulated loss is the step's mean over those tokens, as transformers'
    Trainer makes it (micro-batches of a prompt / completion file cover different counts, and
    a mean per micro-batch divided by ``--accum`` weighs their tokens unequally). The Trainer's
    test: the model says so, or its ``forward`` takes ``**kwargs``."""
    import inspect  # noqa: PLC0415

    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _left_out(what: str) -> None:
    """A metrics line of the run resumed that is not a record (one a killed run, a full disk,
    cut short): left out, said on stderr, where it refused the resume."""
    print(f"offload finetune: {what}; left out", file=sys.stderr)


def _host_budget(engine, cfg: dict):
    """The documented host budget (README "Memory") of a run with NVMe pools, else None."""
    from offload.estimate import host_memory_budget  # noqa: PLC0415

    sizes = engine.plan.placement.buffer_sizes
    buffers = sum(cfg[s]["buffer_count"] * sizes[s] for s in engine.stores)
    return host_memory_budget(buffers, engine.plan.largest_unit) if buffers else None


def save(offload, ckpt_dir: Path, model, optimizer, step: int, sched, run_id: dict) -> None:
    offload.save_checkpoint(
        ckpt_dir,
        model,
        optimizer,
        keep_last=2,
        step=step,
        scheduler=sched.state_dict(),
        rng=_rng_state(),
        run=run_id,
    )
