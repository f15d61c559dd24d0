"""offload_optimizer.step_in_backward: each unit updated as its backward completes.

The update is the same math in the same order within a unit as the step after backward, so
the results must be bit for bit those of the default step; gradients must never be written to
disk when the buffers can hold them; what the mode cannot do is refused with a clear error.
"""

from __future__ import annotations

import threading

import pytest
import torch
from engine_models import batches, lm_loss, make_model, placement_config

import offload
from offload.api.wrap import engine_of
from offload.config import ConfigError
from offload.runtime.phase import PhaseError

STEPS = 8


def _config(tmp_path, param_dev, *, step_in_backward, buffer_count=8, **over):
    cfg = placement_config(param_dev, "nvme", tmp_path / str(step_in_backward), **over)
    cfg["offload_optimizer"]["buffer_count"] = buffer_count
    cfg["offload_optimizer"]["step_in_backward"] = step_in_backward
    return cfg


def _train(model, opt, data, steps=STEPS):
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    losses = []
    for s in range(steps):
        loss = lm_loss(model, data[s % len(data)])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _run(tmp_path, param_dev, data, *, step_in_backward, **kw):
    model, opt = offload.wrap(
        make_model(), _config(tmp_path, param_dev, step_in_backward=step_in_backward, **kw)
    )
    try:
        losses = _train(model, opt, data)
        opt.synchronize()
        store = engine_of(model).stores["offload_optimizer"]
        written = store.stats()["tiers"]["host->nvme"]["bytes"]
        grad_bytes = sum(s.io_nbytes for k, s in store._shards.items() if k.startswith("grad."))
        return losses, model.state_dict(), opt.state_dict(), written, grad_bytes
    finally:
        opt.close()


# buffer_count 4: no grad piece can be held (all go through the disk); 8: one is held and
# the big unit's other five spill; 16: every unit's pieces are held (hold 6, read-ahead 1)
@pytest.mark.parametrize("buffer_count", [4, 8, 16])
@pytest.mark.parametrize("param_dev", ["none", "cpu", "nvme"])
def test_bitwise_equal_to_the_step_after_backward(tmp_path, param_dev, buffer_count):
    data = batches(8)
    ref = _run(tmp_path / "ref", param_dev, data, step_in_backward=False)
    got = _run(tmp_path / "sib", param_dev, data, step_in_backward=True, buffer_count=buffer_count)
    assert got[0] == ref[0]  # losses
    assert got[0][-1] < got[0][0]  # it trained
    for name, value in ref[1].items():
        assert torch.equal(got[1][name], value), name
    for i, entry in ref[2]["state"].items():
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[2]["state"][i][kind], entry[kind]), (i, kind)


def test_bf16_bitwise_equal_and_gradients_never_written(tmp_path):
    data = batches(8)
    ref = _run(tmp_path / "ref", "nvme", data, step_in_backward=False, dtype="bf16")
    got = _run(tmp_path / "sib", "nvme", data, step_in_backward=True, buffer_count=16, dtype="bf16")
    assert got[0] == ref[0]
    for name, value in ref[1].items():
        assert torch.equal(got[1][name], value), name
    # the default step writes every grad piece once per step; with the pieces held for the
    # update (16 buffers hold every unit's), step_in_backward writes none of them
    grad_bytes = ref[4]
    assert grad_bytes > 0
    assert ref[3] - got[3] == STEPS * grad_bytes


def test_refused_with_clipping_fp16_or_optimizer_on_cpu(tmp_path):
    cfg = _config(tmp_path, "none", step_in_backward=True)
    cfg["gradient_clipping"] = 1.0
    with pytest.raises(ConfigError, match=r"offload_optimizer.step_in_backward.*gradient_clipping"):
        offload.load_config(cfg)
    cfg = _config(tmp_path, "none", step_in_backward=True, dtype="fp16")
    with pytest.raises(ConfigError, match=r"offload_optimizer.step_in_backward.*fp16"):
        offload.load_config(cfg)
    cfg = placement_config("none", "cpu", tmp_path)
    cfg["offload_optimizer"]["step_in_backward"] = True
    with pytest.raises(ConfigError, match=r"offload_optimizer.step_in_backward.*'cpu'"):
        offload.load_config(cfg)
    cfg["offload_optimizer"]["step_in_backward"] = "yes please"
    with pytest.raises(ConfigError, match="offload_optimizer.step_in_backward"):
        offload.load_config(cfg)


def test_misuse_is_an_error_naming_the_option(tmp_path):
    data = batches(4)
    model, opt = offload.wrap(make_model(), _config(tmp_path, "nvme", step_in_backward=True))
    try:
        lm_loss(model, data[0]).backward()
        with pytest.raises(PhaseError, match="gradient accumulation"):
            lm_loss(model, data[1]).backward()  # a second backward before step()
        with pytest.raises(PhaseError, match="step_in_backward"):
            opt.clip_grad_norm_(1.0)
        with pytest.raises(PhaseError, match="between loss.backward"):
            opt.state_dict()
        opt.param_groups[0]["lr"] = 5e-3  # changed after the backward started
        with pytest.raises(PhaseError, match=r"lr 0.01 -> 0.005"):
            opt.step()
        # the step itself was taken (with the old lr); training goes on with the new one
        lm_loss(model, data[2]).backward()
        opt.step()
        assert opt.state_dict()["offload"]["step_count"] == 2
    finally:
        opt.close()


def test_a_failed_backward_does_not_hang_close(tmp_path):
    data = batches(4)
    model, opt = offload.wrap(
        make_model(), _config(tmp_path, "nvme", step_in_backward=True, buffer_count=16)
    )
    lm_loss(model, data[0]).backward()
    opt.step()
    loss = lm_loss(model, data[1])

    def boom(grad):
        raise RuntimeError("boom in backward")

    model.blocks[0].fc2.weight.register_hook(boom)  # after some units were handed in
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    done = threading.Event()
    closer = threading.Thread(target=lambda: (opt.close(), done.set()), daemon=True)
    closer.start()
    assert done.wait(60), "close() hung after a failed backward"
