"""A model wrapped with no trainable parameter: wrapped for its forwards.

An inference of a model beyond the device's memory (DeepSpeed's ZeRO-Inference), a frozen
teacher beside the student it distills into, a frozen classifier an adversarial example is
computed against. ``wrap`` refused such a model until 2026-12-05 ("no trainable
parameters"), so none of these could use offload; its optimizer's ``step()`` now refuses
instead (PEFT's prompt tuning, whose parameters are outside the base model:
``tests/test_hf.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from engine_models import VOCAB, batches, lm_loss, make_model, placement_config

import offload
from offload.runtime.phase import PhaseError

PLACEMENTS = [("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")]


def _frozen(seed: int = 0, **kw):
    model = make_model(seed, **kw)
    return model.requires_grad_(False)


@pytest.mark.parametrize("param_dev,opt_dev", PLACEMENTS)
def test_a_frozen_model_computes_as_torch_and_refuses_a_step(tmp_path, param_dev, opt_dev):
    """Logits bitwise torch's with and without gradients on; the gradient of a loss with
    respect to the input embedding (an adversarial example) bitwise torch's; ``state_dict``
    and an export hold the values; ``step()`` says nothing trains; ``close(restore=True)``
    gives the model back."""
    ref = _frozen()
    model, opt = offload.wrap(copy.deepcopy(ref), placement_config(param_dev, opt_dev, tmp_path))
    tokens = batches(1)[0][:, :-1]
    try:
        with torch.no_grad():
            assert torch.equal(model(tokens), ref(tokens))
        assert torch.equal(model(tokens), ref(tokens))  # gradients on: nothing to keep
        grads = []
        for m in (ref, model):  # the embedding's output replaced by a leaf that needs a gradient
            x = ref.embed(tokens).detach().requires_grad_(True)
            hook = m.embed.register_forward_hook(lambda mod, args, out, x=x: x)
            F.cross_entropy(m(tokens).reshape(-1, VOCAB), tokens.reshape(-1)).backward()
            hook.remove()
            grads.append(x.grad)
        assert torch.equal(grads[0], grads[1])
        values = model.state_dict()
        for name, want in ref.state_dict().items():
            assert torch.equal(values[name], want), name
        offload.export(model, tmp_path / "w.safetensors", dtype=torch.float32)
        with pytest.raises(PhaseError, match="no trainable parameters.*set requires_grad before"):
            opt.step()
        opt.zero_grad()
    finally:
        opt.close(restore=True)
    for name, want in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], want), name


@pytest.mark.parametrize("param_dev,opt_dev", [("cpu", "cpu"), ("nvme", "nvme")])
def test_a_student_distilled_from_a_wrapped_teacher_trains_as_torch(tmp_path, param_dev, opt_dev):
    """Knowledge distillation with both models wrapped: the teacher frozen (its forward with
    gradients on, as a loop that forgets ``no_grad`` runs it), the student trained on its
    soft targets plus the labels, 3 steps against plain torch."""
    teacher = _frozen(seed=1, hidden=128)
    torch.manual_seed(0)
    student = make_model(0)
    ref_t, ref_s = copy.deepcopy(teacher), copy.deepcopy(student)
    data = batches(3)

    def train(t, s, opt):
        losses = []
        for tokens in data:
            soft = F.log_softmax(t(tokens[:, :-1]) / 2.0, dim=-1)
            logits = s(tokens[:, :-1])
            kd = F.kl_div(
                F.log_softmax(logits / 2.0, dim=-1), soft, reduction="batchmean", log_target=True
            )
            loss = kd * 4.0 + lm_loss(s, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    trainable = [p for p in ref_s.parameters() if p.requires_grad]
    want = train(
        ref_t, ref_s, torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1, foreach=False)
    )
    t, t_opt = offload.wrap(teacher, placement_config(param_dev, opt_dev, tmp_path / "t"))
    s, s_opt = offload.wrap(student, placement_config(param_dev, opt_dev, tmp_path / "s"))
    try:
        got = train(t, s, s_opt)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0)
        values = s.state_dict()
        for name, v in ref_s.state_dict().items():
            torch.testing.assert_close(values[name], v, rtol=0, atol=1e-5, msg=name)
    finally:
        s_opt.close()
        t_opt.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_checkpoint_on_disk_generates_as_transformers_with_nothing_trainable(tmp_path, dtype):
    """ZeRO-Inference's use: a Hugging Face checkpoint streamed from its files into the tiers,
    frozen before wrap, generates transformers' tokens (bf16: those of the checkpoint loaded
    in bf16)."""
    pytest.importorskip("transformers")
    from hf_models import nvme_config, write_model  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    d = write_model(tmp_path / "ckpt")
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16 if dtype == "bf16" else None)
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    want = ref.eval().generate(ids, max_new_tokens=6, do_sample=False)
    model, opt = offload.from_pretrained(
        d,
        nvme_config(tmp_path, "nvme", "nvme", dtype=dtype),
        before_wrap=lambda m: m.requires_grad_(False),
    )
    try:
        assert not any(p.requires_grad for p in model.parameters())
        assert torch.equal(model.eval().generate(ids, max_new_tokens=6, do_sample=False), want)
    finally:
        opt.close()


def test_the_trainer_evaluates_a_frozen_model_as_transformers(tmp_path, caplog):
    """``OffloadTrainer.evaluate`` of a checkpoint frozen in ``before_wrap``: transformers'
    eval loss, and no warning that TrainingArguments' optimizer settings do not apply (there is
    nothing for them to apply to)."""
    pytest.importorskip("transformers")
    from hf_models import nvme_config, write_model  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: PLC0415

    d = write_model(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(2)
    data = [
        {
            "input_ids": torch.randint(3, 64, (12,), generator=g),
            "labels": torch.randint(3, 64, (12,), generator=g),
        }
        for _ in range(6)
    ]
    args = TrainingArguments(
        tmp_path / "o", per_device_eval_batch_size=2, report_to=[], use_cpu=True
    )
    want = Trainer(
        model=AutoModelForCausalLM.from_pretrained(d), args=args, eval_dataset=data
    ).evaluate()
    model, opt = offload.from_pretrained(
        d, nvme_config(tmp_path, "nvme", "nvme"), before_wrap=lambda m: m.requires_grad_(False)
    )
    try:
        with caplog.at_level("WARNING", logger="offload.api"):
            got = offload.OffloadTrainer(
                model=model, args=args, eval_dataset=data, optimizers=(opt, None)
            ).evaluate()
        assert got["eval_loss"] == want["eval_loss"]
        assert "do not apply" not in caplog.text
    finally:
        opt.close()
