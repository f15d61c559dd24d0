"""offload_optimizer.step_in_backward: each unit updated as the step's last backward completes it.

The update is the same math in the same order within a unit as the step after backward, and a
speculative one is kept only when it used the step's values (else it is redone from the state
of before), so the results must be bit for bit those of the update after the backward, with
gradient accumulation, clipping that triggers, fp16 overflows and learning rates changed late;
gradients must not be written to disk when nothing can need them again; misuse is a clear error.
"""

from __future__ import annotations

import errno
import threading

import pytest
import torch
from engine_models import batches, lm_loss, make_model, placement_config

import offload
from offload.api.wrap import engine_of
from offload.config import ConfigError
from offload.runtime.phase import PhaseError

STEPS = 8


def _config(tmp_path, param_dev, *, step_in_backward, buffer_count=8, accum=1, **over):
    cfg = placement_config(param_dev, "nvme", tmp_path / str(step_in_backward), **over)
    cfg["offload_optimizer"]["buffer_count"] = buffer_count
    cfg["offload_optimizer"]["step_in_backward"] = step_in_backward
    cfg["gradient_accumulation_steps"] = accum
    return cfg


def _train(model, opt, data, steps=STEPS, accum=1, clip=0.0):
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    losses = []
    for s in range(steps):
        total = 0.0
        for m in range(accum):
            loss = lm_loss(model, data[(s * accum + m) % len(data)]) / accum
            opt.scale_loss(loss).backward()
            total += float(loss.detach())
        if clip:
            opt.clip_grad_norm_(clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _run(tmp_path, param_dev, data, *, step_in_backward, clip=0.0, steps=STEPS, **kw):
    model, opt = offload.wrap(
        make_model(), _config(tmp_path, param_dev, step_in_backward=step_in_backward, **kw)
    )
    try:
        losses = _train(model, opt, data, steps, kw.get("accum", 1), clip)
        opt.synchronize()
        store = engine_of(model).stores["offload_optimizer"]
        written = store.stats()["tiers"]["host->nvme"]["bytes"]
        grad_bytes = sum(s.io_nbytes for k, s in store._shards.items() if k.startswith("grad."))
        total = opt.stats()["total"]
        extra = {k: total[k] for k in ("rollbacks", "updates_in_backward", "clipped_steps")}
        extra["skipped"] = opt.skipped_steps
        return losses, model.state_dict(), opt.state_dict(), written, grad_bytes, extra
    finally:
        opt.close()


def _assert_bitwise(got, ref) -> None:
    assert got[0] == ref[0]  # losses
    for name, value in ref[1].items():
        assert torch.equal(got[1][name], value), name
    for i, entry in ref[2]["state"].items():
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[2]["state"][i][kind], entry[kind]), (i, kind)
    assert got[2]["offload"] == ref[2]["offload"]  # step count, skipped steps, loss scale


# buffer_count 4: no grad piece can be held (all go through the disk); 8: one is held and
# the big unit's other five spill; 16: every unit's pieces are held (hold 6, read-ahead 1)
@pytest.mark.parametrize("buffer_count", [4, 8, 16])
@pytest.mark.parametrize("param_dev", ["none", "cpu", "nvme"])
def test_bitwise_equal_to_the_step_after_backward(tmp_path, param_dev, buffer_count):
    data = batches(8)
    ref = _run(tmp_path / "ref", param_dev, data, step_in_backward=False)
    got = _run(tmp_path / "sib", param_dev, data, step_in_backward=True, buffer_count=buffer_count)
    _assert_bitwise(got, ref)
    assert got[0][-1] < got[0][0]  # it trained
    # telemetry says where each update ran: every one in its backward, none after it
    assert (got[5]["updates_in_backward"], ref[5]["updates_in_backward"]) == (STEPS, 0)
    assert got[5]["clipped_steps"] == ref[5]["clipped_steps"] == 0


def test_bf16_bitwise_equal_and_gradients_never_written(tmp_path):
    data = batches(8)
    ref = _run(tmp_path / "ref", "nvme", data, step_in_backward=False, dtype="bf16")
    got = _run(tmp_path / "sib", "nvme", data, step_in_backward=True, buffer_count=16, dtype="bf16")
    _assert_bitwise(got, ref)
    # the default step writes every grad piece once per step; with the pieces held for the
    # update (16 buffers hold every unit's), step_in_backward writes none of them, once the
    # first step has shown that the loop does not clip (until then they are kept for a redo)
    grad_bytes = ref[4]
    assert grad_bytes > 0
    assert ref[3] - got[3] == (STEPS - 1) * grad_bytes
    assert got[5]["rollbacks"] == 0


@pytest.mark.parametrize("param_dev", ["none", "nvme"])
def test_bitwise_with_accumulation_and_clipping_that_triggers(tmp_path, param_dev):
    """Accumulation 2 and clipping at 1.0 (the norms here are 1.6-3, so most steps clip): each
    speculative update is redone from the state of before with the clipped gradients."""
    data = batches(8)
    kw = dict(accum=2, clip=1.0)
    ref = _run(tmp_path / "ref", param_dev, data, step_in_backward=False, **kw)
    got = _run(tmp_path / "sib", param_dev, data, step_in_backward=True, buffer_count=16, **kw)
    _assert_bitwise(got, ref)
    assert 0 < got[5]["rollbacks"] <= STEPS  # clipping triggered, and was redone
    assert got[5]["clipped_steps"] == ref[5]["clipped_steps"] >= got[5]["rollbacks"]


def test_accumulation_is_learned_from_the_first_step(tmp_path):
    """gradient_accumulation_steps "auto" (the default): the first step's update runs after its
    two backwards and counts them; the results are bitwise those of the update after the
    backward whatever the schedule then chooses."""
    data = batches(8)
    ref = _run(tmp_path / "ref", "nvme", data, step_in_backward=False, accum=2, clip=1.0)
    cfg_accum = dict(accum="auto")
    model, opt = offload.wrap(
        make_model(), _config(tmp_path / "auto", "nvme", step_in_backward=True, **cfg_accum)
    )
    try:
        losses = _train(model, opt, data, STEPS, 2, 1.0)
        assert losses == ref[0]
        for name, value in ref[1].items():
            assert torch.equal(model.state_dict()[name], value), name
        assert engine_of(model).schedule.accumulation == 2
        # the loop clips every step here (norms 1.6-3): after the first step shows it, each
        # update runs after the backward instead of being speculated and redone
        total = opt.stats()["total"]
        assert (total["rollbacks"], total["updates_in_backward"]) == (0, 0)
        assert total["clipped_steps"] == STEPS
    finally:
        opt.close()


def test_a_step_of_more_backwards_than_learned_says_the_count_was_learned(tmp_path):
    """gradient_accumulation_steps "auto": a step of more backwards than the first step's is
    refused (the update ran in the last of them), and the refusal named the learned count as
    if the user had set it (a first step whose first backward a ``zero_grad()`` dropped learns
    one fewer); it says the count was learned."""
    data = batches(3)
    cfg = _config(tmp_path, "nvme", step_in_backward=True, accum="auto")
    model, opt = offload.wrap(make_model(), cfg)
    try:
        for _ in range(2):  # the first step counts 2; the second updates in its backward
            lm_loss(model, data[0]).backward()
            lm_loss(model, data[1]).backward()
            opt.step()
            opt.zero_grad()
        lm_loss(model, data[0]).backward()
        lm_loss(model, data[1]).backward()
        learned = r'2 \("auto": the backwards of the first step, counted then\)'
        with pytest.raises(PhaseError, match=learned):
            lm_loss(model, data[2]).backward()
    finally:
        opt.close()


def test_bitwise_with_config_clipping_that_does_not_trigger(tmp_path):
    """gradient_clipping in the config, above every norm: the speculative updates are kept."""
    data = batches(8)
    ref = _run(tmp_path / "ref", "nvme", data, step_in_backward=False, gradient_clipping=100.0)
    got = _run(tmp_path / "sib", "nvme", data, step_in_backward=True, gradient_clipping=100.0)
    _assert_bitwise(got, ref)
    assert got[5]["rollbacks"] == got[5]["clipped_steps"] == 0
    assert got[5]["updates_in_backward"] == STEPS  # all kept


def test_bitwise_with_fp16_overflows(tmp_path):
    """fp16 with a loss scale that overflows at first: the overflowing steps' speculative updates
    are rolled back and skipped, the others kept, exactly as the update after the backward."""
    data = batches(8)
    over = dict(dtype="fp16", loss_scale={"initial": 2.0**40, "growth_interval": 3})
    ref = _run(tmp_path / "ref", "nvme", data, step_in_backward=False, **over)
    got = _run(tmp_path / "sib", "nvme", data, step_in_backward=True, buffer_count=16, **over)
    _assert_bitwise(got, ref)
    assert got[5]["skipped"] == ref[5]["skipped"] > 0
    assert got[5]["updates_in_backward"] >= got[5]["rollbacks"] >= got[5]["skipped"]


def test_the_default_with_nvme_and_its_config(tmp_path):
    cfg = placement_config("none", "nvme", tmp_path)
    assert offload.load_config(cfg).offload_optimizer.step_in_backward  # the default
    cfg["gradient_clipping"] = 1.0
    cfg["dtype"] = "fp16"
    assert offload.load_config(cfg).offload_optimizer.step_in_backward  # both fine now
    cfg = placement_config("none", "cpu", tmp_path)
    cfg["offload_optimizer"]["step_in_backward"] = True  # no effect with the state on the CPU
    offload.load_config(cfg)
    cfg["offload_optimizer"]["step_in_backward"] = "yes please"
    with pytest.raises(ConfigError, match="offload_optimizer.step_in_backward"):
        offload.load_config(cfg)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        offload.load_config({"gradient_accumulation_steps": 0})


def test_misuse_is_an_error_naming_the_option(tmp_path):
    data = batches(4)
    model, opt = offload.wrap(make_model(), _config(tmp_path, "nvme", step_in_backward=True))
    try:
        lm_loss(model, data[0]).backward()
        # the update in that backward wrote the weights: a forward or a read of them before
        # step() would see the new ones (torch's, the ones of before): the probe's eval read
        # 2.5078 against torch's 2.6513, model.state_dict() 1e-2 off
        with pytest.raises(PhaseError, match="gradient accumulation"):
            lm_loss(model, data[1]).backward()  # a second micro-step, accumulation steps 1
        with torch.no_grad(), pytest.raises(PhaseError, match="a forward of the model"):
            model(data[1][:, :-1])  # an evaluation
        for read in (opt.state_dict, model.state_dict):
            with pytest.raises(PhaseError, match="between loss.backward"):
                read()
        opt.step()
        with torch.no_grad():
            model(data[1][:, :-1])
        assert model.state_dict().keys() == make_model().state_dict().keys()
        opt.zero_grad()
        # after the first step the loop is known not to clip: the gradients are not kept, so
        # values the moments depend on, changed between backward and step, cannot be honoured
        # and are refused (a new step size is redone: the next test)
        lm_loss(model, data[2]).backward()
        opt.param_groups[0]["betas"] = (0.8, 0.999)  # changed after the backward started
        with pytest.raises(PhaseError, match=r"betas \(0.9, 0.999\) -> \(0.8, 0.999\).*taken"):
            opt.step()
        # the step itself was taken (with the old lr); training goes on with the new one
        opt.zero_grad()
        lm_loss(model, data[3]).backward()
        opt.step()
        assert opt.state_dict()["offload"]["step_count"] == 3
    finally:
        opt.close()


def test_a_learning_rate_changed_late_is_honoured_when_the_gradients_are_kept(tmp_path):
    """With clipping configured the gradients are kept until the step commits, so a learning
    rate changed between backward and step() is redone exactly, as the update after backward."""
    data = batches(4)
    results = []
    for sib in (False, True):
        cfg = _config(tmp_path / str(sib), "nvme", step_in_backward=sib, gradient_clipping=50.0)
        model, opt = offload.wrap(make_model(), cfg)
        try:
            for s in range(3):
                lm_loss(model, data[s]).backward()
                opt.param_groups[0]["lr"] = 1e-2 / (s + 1)  # set after the backward
                opt.step()
                opt.zero_grad()
            results.append(model.state_dict())
        finally:
            opt.close()
    for name, value in results[0].items():
        assert torch.equal(results[1][name], value), name


@pytest.mark.parametrize(
    "param_dev,dtype", [("none", "fp32"), ("cpu", "fp32"), ("nvme", "fp32"), ("nvme", "bf16")]
)
def test_a_step_size_changed_late_is_redone_without_the_gradients(tmp_path, param_dev, dtype):
    """No clipping, no fp16: the gradients are not kept. A learning rate, eps or AdamW weight
    decay set between backward and step() (a decay at an epoch's end, say) was refused with
    the step taken at the old values; the moments do not depend on them, so the params are
    made again from the master of before and the update's moments: bitwise the update after
    the backward with the new values, for a master of its own (params on the device, in host
    memory, bf16 on NVMe) and for the fp32 params on NVMe that are the master."""
    data = batches(7)
    results, rollbacks = [], []
    for sib in (False, True):
        cfg = _config(tmp_path / str(sib), param_dev, step_in_backward=sib, dtype=dtype)
        model, opt = offload.wrap(make_model(), cfg)
        try:
            for s in range(7):
                lm_loss(model, data[s]).backward()
                if s == 2:
                    opt.param_groups[0]["lr"] = 3e-3  # set after the backward
                if s == 5:  # (step 3 updates after its backward, step 4 speculates again)
                    opt.param_groups[0].update(eps=1e-6, weight_decay=0.02)
                opt.step()
                rollbacks.append(opt.stats()["rollbacks"])
                opt.zero_grad()
            results.append(model.state_dict())
            state = opt.state_dict()["state"]
            results.append({f"{k}.{n}": t for k, v in state.items() for n, t in v.items()})
        finally:
            opt.close()
    for name, value in results[0].items():
        assert torch.equal(results[2][name], value), name
    for name, value in results[1].items():
        assert torch.equal(results[3][name], value), name
    assert rollbacks[7:] == [0, 0, 1, 0, 0, 1, 0], rollbacks  # the two late steps, redone


def test_a_failed_backward_does_not_hang_close(tmp_path):
    data = batches(4)
    model, opt = offload.wrap(
        make_model(), _config(tmp_path, "nvme", step_in_backward=True, buffer_count=16)
    )
    lm_loss(model, data[0]).backward()
    opt.step()
    opt.zero_grad()
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


def test_an_update_that_fails_in_the_backward_does_not_stop_it(tmp_path, monkeypatch):
    """The update running in the backward fails while the backward still has units to hand
    it, and its thread records the error only a moment after it let go of the held gradient
    pieces: the backward must not wait for the dead update to consume more pieces (it hung
    there once in CI, one run in ~25), it takes the rest of the gradients on NVMe and
    ``optimizer.step()`` raises the update's error, the step undone."""
    from offload.homes.grads import HeldNvmeGrads
    from offload.io import faults

    data = batches(4)
    # 8 buffers: the backward may hold one piece for the update (the parametrized test's Note)
    model, opt = offload.wrap(
        make_model(), _config(tmp_path, "cpu", step_in_backward=True, buffer_count=8)
    )
    real_abandon = HeldNvmeGrads.abandon

    def abandon_slowly(self):  # widens the window between letting go and the error's record
        real_abandon(self)
        if threading.current_thread() is not threading.main_thread():
            threading.Event().wait(0.5)

    monkeypatch.setattr(HeldNvmeGrads, "abandon", abandon_slowly)
    outcome = []

    def step():
        try:
            lm_loss(model, data[1]).backward()
            opt.step()
            outcome.append("no error")
        except Exception as exc:  # noqa: BLE001 - the test checks it
            outcome.append(exc)

    try:
        lm_loss(model, data[0]).backward()
        opt.step()
        opt.zero_grad()
        faults.inject(5, count=1, op="read")  # the update's first read
        try:
            runner = threading.Thread(target=step, daemon=True)
            runner.start()
            runner.join(30)
            assert not runner.is_alive(), "the backward hung on the failed update"
        finally:
            faults.clear()
        assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
        assert "undone" in str(outcome[0])
    finally:
        if outcome:  # else hung: close() would wait on it too
            opt.close()


@pytest.mark.parametrize("param_dev", ["none", "nvme"])
def test_a_failed_speculative_update_is_undone(tmp_path, param_dev):
    """An IO error inside the update that runs in the backward: the error reaches the caller,
    and the state is exactly that of before the step (no checkpoint to load), so training
    goes on. With the params on NVMe they are the master: their store's version is undone."""
    from offload.io import faults

    data = batches(4)
    model, opt = offload.wrap(
        make_model(), _config(tmp_path, param_dev, step_in_backward=True, buffer_count=16)
    )
    try:
        lm_loss(model, data[0]).backward()
        opt.step()
        opt.zero_grad()
        before_model = {k: v.clone() for k, v in model.state_dict().items()}
        before_opt = opt.state_dict()
        store = engine_of(model).stores["offload_optimizer"]
        real_read = store._nvme.read

        reads = []

        def failing_read(*args):  # the update's 5th read of its own store is refused: some
            reads.append(args)  # units are updated by then, and must be undone
            if len(reads) < 5:
                return real_read(*args)
            store._nvme.read = real_read
            raise OSError(errno.EIO, "injected read error")

        if param_dev == "nvme":  # the backward reads params first: target the update's store
            store._nvme.read = failing_read
        else:
            faults.inject(5, count=1, op="read")  # the update's first read (the undo reads)
        try:
            with pytest.raises(RuntimeError, match="undone"):
                lm_loss(model, data[1]).backward()
                opt.step()
        finally:
            faults.clear()
            store._nvme.read = real_read
        opt.zero_grad()
        for k, v in model.state_dict().items():
            assert torch.equal(v, before_model[k]), k
        after_opt = opt.state_dict()
        for i, entry in before_opt["state"].items():
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(after_opt["state"][i][kind], entry[kind]), (i, kind)
        lm_loss(model, data[2]).backward()
        opt.step()  # training goes on
        assert opt.stats()["steps"] >= 1
    finally:
        opt.close()


@pytest.mark.parametrize("cause", ["update", "backward"])
def test_a_speculative_update_whose_undo_fails_waits_for_a_checkpoint(tmp_path, cause):
    """The update in the backward is undone, because it failed (a read error) or because the
    backward did (a user's hook raised), and the undo fails too (its params' derivation from
    the master rolled back, made to fail): the state mixes updated and old units (master and
    moments are back, the compute params half derived). The error says so (the undo of a
    failed backward raised its bare IO error until 2026-12-07), and step(), saves, forwards
    and state_dict() are refused, naming the failure, until a checkpoint is loaded; then the
    values are the checkpoint's and training goes on."""
    from offload.io import faults

    data = batches(3)
    model, opt = offload.wrap(
        make_model(), _config(tmp_path, "none", step_in_backward=True, buffer_count=16)
    )
    optim = engine_of(model).schedule.optim
    try:
        lm_loss(model, data[0]).backward()
        opt.step()
        opt.zero_grad()
        ckpt = offload.save_checkpoint(tmp_path / "ckpt", model, opt)  # (the update is done)
        saved = {k: v.clone() for k, v in model.state_dict().items()}

        def failing_derive(units):
            raise OSError(errno.EIO, "injected read error of the undo")

        def boom(grad):
            raise RuntimeError("boom in a user's hook")

        optim.derive_params = failing_derive
        try:
            if cause == "update":
                faults.inject(5, count=1, op="read")  # the update's first read
                # the mix named by the update's error, a read ahead's included (reported to
                # the backward as a bare OSError in some timings before 2026-12-07, when the
                # store raised it to its next call, not to the shard's next fetch)
                with pytest.raises(RuntimeError, match="mixes updated and old units"):
                    lm_loss(model, data[1]).backward()
                    opt.step()
            else:  # undone by the next call, which finds the backward over
                handle = model.blocks[0].fc2.weight.register_hook(boom)  # after later units'
                with pytest.raises(RuntimeError, match="boom"):
                    lm_loss(model, data[1]).backward()
                handle.remove()
                with pytest.raises(RuntimeError, match="undoing.*mixes updated and old units"):
                    opt.step()
        finally:
            faults.clear()
            del optim.derive_params
        opt.zero_grad()
        for refused in (
            lambda: lm_loss(model, data[2]),
            lambda: model.state_dict(),
            opt.step,
            lambda: offload.save_checkpoint(tmp_path / "bad", model, opt),
        ):
            with pytest.raises(PhaseError, match="earlier optimizer update failed part way"):
                refused()
        offload.load_checkpoint(ckpt.parent, model, opt)
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved[k]), k
        lm_loss(model, data[2]).backward()  # (no read error of the replaced values left)
        opt.step()  # training goes on
    finally:
        opt.close()


def _held_state(model) -> list[str]:
    """The optimizer store's shards someone holds (fetched and not released)."""
    store = engine_of(model).stores["offload_optimizer"]
    return sorted(k for k, s in store._shards.items() if s.pins)


@pytest.mark.parametrize("param_dev", ["none", "nvme"])
def test_an_update_after_the_backward_reads_its_first_pieces_in_it(tmp_path, param_dev):
    """A loop that clips every step updates after the backward (no speculative update to
    redo). The step's last backward reads the update's first pieces (the head start), held
    for it, not the earlier backward; the update takes them; a state_dict between backward
    and step lets them go unused (a skipped step: the next test); the results are bitwise
    those of the update after the backward all the same."""
    data = batches(8)
    kw = dict(accum=2, clip=1.0, steps=6)
    ref = _run(tmp_path / "ref", param_dev, data, step_in_backward=False, **kw)
    model, opt = offload.wrap(
        make_model(),
        _config(tmp_path / "sib", param_dev, step_in_backward=True, buffer_count=16, accum=2),
    )
    engine = engine_of(model)
    optim, placement = engine.optim, engine.plan.placement
    first = optim.pieces(engine.plan.units[0])[0][0]
    kinds = optim.master.kinds
    head = [f"{k}.u0.{first}" for k in kinds]  # the root's first piece is the update's first
    try:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        losses = []
        for s in range(6):
            total = 0.0
            for m in range(2):
                loss = lm_loss(model, data[(s * 2 + m) % len(data)]) / 2
                opt.scale_loss(loss).backward()
                total += float(loss.detach())
                held = [k for k in _held_state(model) if not k.startswith("grad.")]
                if s == 0:  # the first step speculates: its update runs in the backward
                    continue
                if m == 0:  # not the step's last backward
                    assert held == [], (s, held)
                else:
                    assert set(head) <= set(held), (s, held)
                    assert len(held) == placement.head_start // len(kinds) * len(kinds)
            if s == 3:
                opt.state_dict()  # reads the state: nothing may stay held for the update
                assert _held_state(model) == []
            opt.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(total)
        opt.synchronize()
        assert _held_state(model) == []  # the updates took them
        got = (losses, model.state_dict(), opt.state_dict())
        _assert_bitwise(got, ref)
        total = opt.stats()["total"]
        assert (total["rollbacks"], total["updates_in_backward"]) == (1, 1)  # then after
    finally:
        opt.close()


def test_a_skipped_fp16_step_lets_the_head_start_go(tmp_path):
    """fp16 with clipping and a loss scale that overflows again after it grows: steps skipped
    after clipped ones (whose updates run after the backward) had their head start read in
    the last backward; it is let go, and the results are bitwise the update after backward's."""
    data = batches(8)
    over = dict(
        dtype="fp16", loss_scale={"initial": 2.0**18, "growth_interval": 2}, accum=2, clip=1.0
    )
    ref = _run(tmp_path / "ref", "nvme", data, step_in_backward=False, steps=10, **over)
    got = _run(
        tmp_path / "sib", "nvme", data, step_in_backward=True, buffer_count=16, steps=10, **over
    )
    _assert_bitwise(got, ref)
    assert got[5]["skipped"] == ref[5]["skipped"] > 0
    assert got[5]["clipped_steps"] > 0
