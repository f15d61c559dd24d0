"""A wrapped model's life beside others in one process (a notebook, a research script): two
models sharing a part, wrapping again after close(), using what a closed engine left, and an
engine let go of without close()."""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest
import torch
import torch.nn as nn
from engine_models import STACK_DIM, StackBlock, placement_config

import offload
from offload.api.wrap import engine_of


def _config(param_dev: str, tmp_path) -> dict:
    cfg = placement_config(param_dev, "cpu", tmp_path)
    cfg["wrap"] = {"module_classes": ["StackBlock"]}
    return cfg


def _model() -> nn.Module:
    return nn.Sequential(StackBlock(), StackBlock(), nn.Linear(STACK_DIM, 1))


def _x() -> torch.Tensor:
    return torch.randn(2, 3, STACK_DIM, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("param_dev", ["none", "cpu"])
def test_a_part_shared_by_two_wrapped_models_is_refused(tmp_path, param_dev):
    """Two models holding one block (or one parameter), each wrapped: accepted, and then the
    second model's engine released storage the first one's forward used (every output 0 with
    the params on the CPU) or each trained its own copy (the params on the device)."""
    shared = StackBlock()
    a = nn.Sequential(shared, nn.Linear(STACK_DIM, 1))
    b = nn.Sequential(shared, nn.Linear(STACK_DIM, 2))
    a, opt = offload.wrap(a, _config(param_dev, tmp_path / "a"))
    try:
        with pytest.raises(ValueError, match=r"parameter '0\.fc1\.weight' belongs to another"):
            offload.wrap(b, _config(param_dev, tmp_path / "b"))
        tied = nn.Sequential(nn.Linear(STACK_DIM, 2))
        tied[0].weight = a[1].weight if param_dev == "none" else nn.Parameter(torch.ones(2, 48))
        if param_dev == "none":  # one parameter tied across the two models
            with pytest.raises(ValueError, match="belongs to another wrapped model"):
                offload.wrap(tied, _config(param_dev, tmp_path / "t"))
        a(_x()).sum().backward()  # the first model is untouched
        opt.step()
    finally:
        opt.close()


@pytest.mark.parametrize("param_dev", ["cpu", "nvme"])
def test_wrapping_again_after_close_without_restore_needs_the_values(tmp_path, param_dev):
    """close() without restore releases the parameters. Wrapping the model again took the
    released storage's zeros as its values, and the closed engine's hooks refused every forward
    of the new one. Now refused, saying the values are gone; with weights= (an export made
    before the close) the model is wrapped again and computes as before."""
    model, opt = offload.wrap(_model(), _config(param_dev, tmp_path / "1"))
    model(_x()).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        want = model(_x())
    offload.export(model, tmp_path / "values.safetensors", dtype=torch.float32)
    opt.close()
    with pytest.raises(ValueError, match="closed without restore .* values are gone"):
        offload.wrap(model, _config(param_dev, tmp_path / "2"))
    model, opt = offload.wrap(
        model, _config(param_dev, tmp_path / "3"), weights=tmp_path / "values.safetensors"
    )
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(_x()), want, rtol=0, atol=0)
        model(_x()).pow(2).mean().backward()
        opt.step()
    finally:
        opt.close()


def test_wrapping_again_after_close_keeps_values_the_engine_did_not_release(tmp_path):
    """Parameters on the device keep their values through close(): wrapping again works (the
    closed engine's hooks, which refused its forwards, go)."""
    model, opt = offload.wrap(_model(), _config("none", tmp_path / "1"))
    with torch.no_grad():
        want = model(_x())
    opt.close()
    with pytest.raises(RuntimeError, match="engine was closed"):
        model(_x())
    model, opt = offload.wrap(model, _config("none", tmp_path / "2"))
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(_x()), want, rtol=0, atol=0)
    finally:
        opt.close()


@pytest.mark.parametrize("param_dev", ["cpu", "nvme"])
def test_what_a_closed_engine_left_raises_that_it_was_closed(tmp_path, param_dev):
    """A loss computed before close() and backwarded after it, and zero_grad() after close():
    a bare KeyError from the page pool the close had torn down."""
    model, opt = offload.wrap(_model(), _config(param_dev, tmp_path))
    loss = model(_x()).sum()
    opt.close()
    for call in (loss.backward, opt.zero_grad, opt.step):
        with pytest.raises(RuntimeError, match=r"engine was closed \(optimizer.close\(\)\)"):
            call()


def test_an_engine_let_go_without_close_is_collected_by_the_next_wrap(tmp_path):
    """A model and its engine hold each other, so a pair let go of without close() (a notebook
    cell run again) held its buffers and swap files until a full garbage collection: 12 runs
    of a cell held 1.1 GB and 40 files. The next wrap collects it."""
    enabled = gc.isenabled()
    gc.disable()  # (only the wrap's own collection may free it)
    try:
        model, opt = offload.wrap(_model(), _config("nvme", tmp_path / "1"))
        engine = weakref.ref(engine_of(model))
        files = list((tmp_path / "1").rglob("*"))
        assert any(f.is_file() for f in files)
        del model, opt
        assert engine() is not None  # the cycle keeps it
        model, opt = offload.wrap(_model(), _config("nvme", tmp_path / "2"))
        try:
            assert engine() is None
            assert not any(f.is_file() for f in (tmp_path / "1").rglob("*"))
        finally:
            opt.close()
    finally:
        if enabled:
            gc.enable()


def _trains_when_wrapped_again(model: nn.Module, cfg: dict, **kwargs) -> None:
    """A model a stopped wrap gave back wraps again and takes a step."""
    from engine_models import batches, lm_loss

    model, opt = offload.wrap(model, cfg, **kwargs)
    try:
        loss = lm_loss(model, batches(1)[0])
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
    finally:
        opt.close()


def test_a_ctrl_c_as_a_hook_goes_on_leaves_no_hook_of_the_stopped_wrap(
    tmp_path, monkeypatch, python_ctrl_c
):
    """The runtime's hooks go on one by one, each recorded with its handle for ``close`` to
    take off. A Ctrl-C delivered as a registration returned, before its handle was recorded,
    left that hook on the model for good: a gradient hook of the stopped wrap's closed engine,
    whose next backward (after a second wrap) raised "this model's engine was closed"
    (``tests/_ctrl_c_points.py``, PHASE wrap, at its 9604th point, 2026-12-07). The hooks go on
    as one block for a Ctrl-C now."""
    import os
    import signal

    from engine_models import make_model

    model = make_model()
    cfg = placement_config("cpu", "cpu", tmp_path)
    real = torch.Tensor.register_post_accumulate_grad_hook
    sent = []

    def then_ctrl_c(self, hook):
        handle = real(self, hook)
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler at the next line
        return handle

    monkeypatch.setattr(torch.Tensor, "register_post_accumulate_grad_hook", then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        offload.wrap(model, cfg)
    monkeypatch.undo()
    assert sent
    left = [n for n, p in model.named_parameters() if p._post_accumulate_grad_hooks]
    assert left == [], f"hooks of the stopped wrap left on {left}"
    _trains_when_wrapped_again(model, cfg)


@pytest.mark.parametrize("where", ["second unit", "hooks"])
def test_a_second_ctrl_c_at_a_stopped_wrap_s_cleanup_still_puts_the_model_back(
    tmp_path, monkeypatch, where
):
    """A user pressing Ctrl-C twice: the second lands as the first one's cleanup opens its
    deferred block (where nothing can hold back a pending one). The cleanup was skipped and
    the model's values were lost (``tests/_ctrl_c_points.py`` with AGAIN 1: 54 of 177 trials);
    it is tried again until it has run (offload.api.wrap, Note: a wrap that stops)."""
    from engine_models import make_model

    from offload.runtime import Runtime

    wrap_module = importlib.import_module("offload.api.wrap")
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = placement_config("nvme", "nvme", tmp_path)
    real_trim, real_hooks, real_deferred = (
        wrap_module.trim_host_heap,
        Runtime.install_hooks,
        wrap_module.interrupts_deferred,
    )
    stopped, seconds = [], []

    def trim() -> None:
        if where == "second unit" and not stopped:
            stopped.append(True)
            raise KeyboardInterrupt
        real_trim()

    def hooks(self) -> None:
        real_hooks(self)
        if where == "hooks":
            stopped.append(True)
            raise KeyboardInterrupt

    def deferred():  # the second Ctrl-C, at the first cleanup's entry after the stop
        if stopped and not seconds:
            seconds.append(True)
            raise KeyboardInterrupt
        return real_deferred()

    monkeypatch.setattr(wrap_module, "trim_host_heap", trim)
    monkeypatch.setattr(Runtime, "install_hooks", hooks)
    monkeypatch.setattr(wrap_module, "interrupts_deferred", deferred)
    with pytest.raises(KeyboardInterrupt):
        offload.wrap(model, cfg)
    monkeypatch.undo()
    assert seconds
    now = model.state_dict()
    assert [k for k, v in before.items() if not torch.equal(now[k], v)] == []
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    _trains_when_wrapped_again(model, cfg)


@pytest.mark.parametrize("where", ["second unit", "hooks part way", "hooks"])
@pytest.mark.parametrize("param_dev,opt_dev", [("nvme", "nvme"), ("cpu", "cpu"), ("none", "cpu")])
@pytest.mark.parametrize("meta", [False, True], ids=["live", "meta"])
def test_a_wrap_stopped_part_way_leaves_the_model_as_it_was(
    tmp_path, monkeypatch, where, param_dev, opt_dev, meta
):
    """A Ctrl-C in ``wrap`` (a large model's values streaming to NVMe) closed the homes that
    held the attached units' only copy: the model's values were gone up to where it stopped
    (``tests/_ctrl_c_points.py``, PHASE wrap: 40 of 71 trials). Stopped after
    the first unit is attached (``second unit``), while the runtime's hooks go on (``hooks
    part way``: its close then raised AttributeError for an attribute those hooks had not set
    yet, and left a "closed" hook on the model; PHASE weights, 2026-12-07) or once the runtime
    is built (``hooks``), the model is as it was (values, buffers, no hook, no swap directory;
    a model on the meta device back on it), and wrapping it again trains."""
    from engine_models import TinyLM, make_model
    from safetensors.torch import save_file

    from offload.runtime import Runtime

    wrap_module = importlib.import_module("offload.api.wrap")  # (offload.api.wrap: the function)

    live = make_model()
    before = {k: v.clone() for k, v in live.state_dict().items()}
    kwargs = {}
    if meta:
        save_file({k: v for k, v in before.items() if k != "head.weight"}, tmp_path / "w.st")
        with torch.device("meta"):
            model = TinyLM()
        kwargs["weights"] = tmp_path / "w.st"
    else:
        model = live
    cfg = placement_config(param_dev, opt_dev, tmp_path)
    real_trim, real_hooks, calls = wrap_module.trim_host_heap, Runtime.install_hooks, []
    real_guard = Runtime._guard_parts

    def trim() -> None:
        calls.append(1)
        if where == "second unit" and len(calls) == 2:  # after the first unit's attach
            raise KeyboardInterrupt
        real_trim()

    def hooks(self) -> None:
        real_hooks(self)
        if where == "hooks":
            raise KeyboardInterrupt

    def guard(self) -> None:
        if where == "hooks part way":
            raise KeyboardInterrupt
        real_guard(self)

    monkeypatch.setattr(wrap_module, "trim_host_heap", trim)
    monkeypatch.setattr(Runtime, "install_hooks", hooks)
    monkeypatch.setattr(Runtime, "_guard_parts", guard)
    with pytest.raises(KeyboardInterrupt):
        offload.wrap(model, cfg, **kwargs)
    monkeypatch.undo()
    if meta:
        assert all(p.is_meta for p in model.parameters())
    else:
        now = model.state_dict()
        assert all(torch.equal(now[k], v) for k, v in before.items())
    hooked = [n for n, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks]
    assert hooked == []
    swap = [
        p for d in ("nvme_p", "nvme_o") if (tmp_path / d).is_dir() for p in (tmp_path / d).iterdir()
    ]
    assert swap == []
    _trains_when_wrapped_again(model, cfg, **kwargs)
