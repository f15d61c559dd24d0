"""``wrap(model, config, weights=SOURCE)``: a model's values streamed from safetensors files or
tensors by name into its homes, the model possibly on the meta device (offload.runtime.weights).

The model (engine_models.TinyLM) has tied input/output embeddings, a frozen parameter, a
persistent buffer per block and a large parameter that spans several pieces.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from engine_models import TinyLM, batches, make_model, placement_config, train_wrapped
from safetensors.torch import save_file

import offload
from offload.api import engine_of
from offload.runtime.safetensors import SafetensorsError, SafetensorsFile
from offload.runtime.weights import WeightsError

PLACEMENTS = [("none", "cpu"), ("nvme", "nvme")]


def _file_state(model: nn.Module) -> dict:
    """The model's state dict as Hugging Face saves it: tied weights once (head.weight is
    embed.weight), every tensor its own contiguous copy."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k != "head.weight"}


def _meta_model() -> TinyLM:
    with torch.device("meta"):
        return TinyLM()


def _train(model, opt, steps=4):
    losses, _ = train_wrapped(model, opt, batches(8), steps, 2, 1.0)
    return losses


@pytest.mark.parametrize("param_dev,opt_dev", PLACEMENTS)
def test_meta_model_from_a_file_trains_bitwise_like_the_live_model(tmp_path, param_dev, opt_dev):
    live = make_model()
    save_file(_file_state(live), tmp_path / "w.safetensors")
    ref_model, ref_opt = offload.wrap(live, placement_config(param_dev, opt_dev, tmp_path / "a"))
    try:
        ref = _train(ref_model, ref_opt)
        ref_sd = ref_model.state_dict()
    finally:
        ref_opt.close()
    meta = _meta_model()
    params_before = list(meta.parameters())
    model, opt = offload.wrap(
        meta,
        placement_config(param_dev, opt_dev, tmp_path / "b"),
        weights=tmp_path / "w.safetensors",
    )
    try:
        assert list(model.parameters()) == params_before  # the same Parameter objects
        assert model.head.weight is model.embed.weight  # still tied, filled once
        assert not any(p.is_meta for p in model.parameters())
        assert _train(model, opt) == ref  # bitwise
        for k, v in model.state_dict().items():
            assert torch.equal(v, ref_sd[k]), k
    finally:
        opt.close()


def test_sharded_directory_and_a_mapping_give_the_same_values(tmp_path):
    live = make_model()
    state = _file_state(live)
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[:5],
        "model-00002-of-00002.safetensors": names[5:],
    }
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / fname)
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    expected = {k: v.clone() for k, v in live.state_dict().items()}
    for i, source in enumerate((tmp_path, state)):
        model, opt = offload.wrap(
            _meta_model(), placement_config("nvme", "nvme", tmp_path / f"s{i}"), weights=source
        )
        try:
            got = model.state_dict()
            assert set(got) == set(expected)
            for k, v in expected.items():
                assert torch.equal(got[k], v), k
        finally:
            opt.close()


@pytest.mark.parametrize("dtype, reads_per_element", [("fp32", 1), ("bf16", 2)])
def test_reads_are_bounded_by_a_piece(tmp_path, monkeypatch, dtype, reads_per_element):
    """The file is read in ranges no larger than a piece, never a whole tensor (the huge block's
    table spans several pieces); each element once per copy: in fp32 the params on NVMe are the
    master, in bf16 the fp32 master is a copy of its own."""
    live = make_model()
    save_file(_file_state(live), tmp_path / "w.safetensors")
    reads: list[tuple[str, int]] = []
    real = SafetensorsFile.read

    def spy(self, name, lo, hi):
        reads.append((name, hi - lo))
        return real(self, name, lo, hi)

    monkeypatch.setattr(SafetensorsFile, "read", spy)
    cfg = placement_config("nvme", "nvme", tmp_path, dtype=dtype)
    model, opt = offload.wrap(_meta_model(), cfg, weights=tmp_path / "w.safetensors")
    try:
        piece = engine_of(model).plan.placement.piece_numel
        table = live.huge.table.numel()
        assert table > 2 * piece  # the test means something
        assert max(n for name, n in reads if name == "huge.table") <= piece
        assert sum(n for name, n in reads if name == "huge.table") == reads_per_element * table
    finally:
        opt.close()


@pytest.mark.parametrize(
    "file_dtype,compute",
    [(torch.bfloat16, "fp32"), (torch.float32, "bf16"), (torch.float16, "fp32")],
)
def test_dtype_conversions(tmp_path, file_dtype, compute):
    live = make_model()
    state = {k: v.to(file_dtype) for k, v in _file_state(live).items()}
    save_file(state, tmp_path / "w.safetensors")
    model, opt = offload.wrap(
        _meta_model(),
        placement_config("nvme", "nvme", tmp_path, dtype=compute),
        weights=tmp_path / "w.safetensors",
    )
    try:
        engine = engine_of(model)
        for unit in engine.units:
            for seg in unit.layout.segments:
                name = seg.name if seg.name in state else "embed.weight"
                # the fp32 master of trainable params is the file's value exactly; frozen ones
                # (no master) hold it in the compute dtype
                want = state[name].float() if seg.trainable else state[name].to(engine.dtype)
                assert torch.equal(engine.full_values(unit)[seg.param].to(want.dtype), want), name
        frozen = model.blocks[0].fc1.bias
        assert not frozen.requires_grad
        _train(model, opt, steps=1)
    finally:
        opt.close()


def test_every_problem_is_named_in_one_error(tmp_path):
    state = _file_state(make_model())
    del state["blocks.0.fc1.weight"]  # missing
    del state["embed.weight"]  # missing, and its tied alias too
    state["blocks.9.fc1.weight"] = torch.zeros(3)  # unexpected
    state["blocks.1.fc2.weight"] = torch.zeros(7, 7)  # wrong shape
    state["norm.weight"] = torch.zeros(state["norm.weight"].shape, dtype=torch.int64)  # dtype
    save_file(state, tmp_path / "w.safetensors")
    for source in (tmp_path / "w.safetensors", state):
        with pytest.raises(WeightsError) as err:
            offload.wrap(_meta_model(), placement_config("nvme", "nvme", tmp_path), weights=source)
        msg = str(err.value)
        assert "2 missing keys" in msg and "'blocks.0.fc1.weight'" not in msg
        assert "blocks.0.fc1.weight" in msg and "embed.weight (tied: head.weight)" in msg
        assert "1 unexpected key" in msg and "blocks.9.fc1.weight" in msg
        assert "'blocks.1.fc2.weight': shape [7, 7] in the file, [32, 96]" in msg
        assert "'norm.weight': dtype I64 in the file cannot be converted" in msg
    assert not list((tmp_path / "nvme_p").iterdir())  # nothing was built


def test_persistent_buffers_come_from_the_file(tmp_path):
    state = _file_state(make_model())
    state["blocks.2.gain"] = torch.full_like(state["blocks.2.gain"], 3.25)
    model, opt = offload.wrap(
        _meta_model(), placement_config("none", "cpu", tmp_path), weights=state
    )
    try:
        assert torch.equal(model.blocks[2].gain, torch.full((32,), 3.25))
        assert torch.equal(model.blocks[0].gain, torch.full((32,), 0.5))
    finally:
        opt.close()


class _Computed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_meta_buffer_nothing_computes_is_named_with_the_fix(tmp_path):
    cfg = placement_config("none", "cpu", tmp_path, wrap={"module_classes": []})
    with torch.device("meta"):
        model = _Computed()
    state = {"lin.weight": torch.ones(4, 4), "lin.bias": torch.zeros(4)}
    with pytest.raises(
        WeightsError, match=r"buffer\(s\) scale are on the meta device.*init_empty_weights"
    ):
        offload.wrap(model, cfg, weights=state)
    # a real buffer (what accelerate.init_empty_weights leaves) is kept
    model = _Computed()
    model.lin.to("meta")
    model, opt = offload.wrap(model, cfg, weights=state)
    try:
        assert torch.equal(model(torch.ones(1, 4)), torch.tensor([[0.0, 4.0, 8.0, 12.0]]))
    finally:
        opt.close()


def test_weights_replace_a_materialized_model_s_values(tmp_path):
    state = {k: torch.full_like(v, 0.125) for k, v in _file_state(make_model()).items()}
    model, opt = offload.wrap(
        make_model(seed=5), placement_config("nvme", "nvme", tmp_path), weights=state
    )
    try:
        for k, v in model.state_dict().items():
            assert torch.equal(v, torch.full_like(v, 0.125)), k
    finally:
        opt.close()


def test_meta_model_without_weights_is_an_error(tmp_path):
    with pytest.raises(
        ValueError, match=r"parameter 'embed.weight' is on the meta device.*weights="
    ):
        offload.wrap(_meta_model(), placement_config("none", "cpu", tmp_path))


def test_bad_files_are_named(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(SafetensorsError, match=r"bad\.safetensors: not a valid safetensors file"):
        offload.wrap(_meta_model(), placement_config("none", "cpu", tmp_path), weights=bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor"):
        offload.wrap(
            _meta_model(), placement_config("none", "cpu", tmp_path), weights=tmp_path / "empty"
        )
    index = tmp_path / "idx"
    index.mkdir()
    (index / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"embed.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="names shard 'model-00001-of-00002.safetensors'"):
        offload.wrap(_meta_model(), placement_config("none", "cpu", tmp_path), weights=index)
    short = tmp_path / "short.safetensors"
    save_file({"x": torch.zeros(1000)}, short)
    short.write_bytes(short.read_bytes()[:-100])
    with pytest.raises(SafetensorsError, match=r"short\.safetensors.*'x' lies outside the file"):
        SafetensorsFile(short)


class _ScaledEmbedding(nn.Embedding):
    """An embedding with a computed buffer beside its weight (Gemma's scaled embedding)."""

    def __init__(self) -> None:
        super().__init__(8, 4)
        self.register_buffer("scale", torch.tensor(1.0), persistent=False)


class _ScaledModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = _ScaledEmbedding()

    def _init_weights(self, module):  # what Hugging Face's does: parameters and buffers
        if isinstance(module, _ScaledEmbedding):
            module.weight.fill_(7.0)
            module.scale.fill_(2.0)


@pytest.mark.parametrize("params_on", ["meta", "cpu"])
def test_a_computed_buffer_beside_parameters_is_filled_and_they_are_not_touched(params_on):
    from offload.runtime.weights import fill_computed_buffers  # noqa: PLC0415

    model = _ScaledModel()
    weight = model.embed.weight
    before = weight.detach().clone()
    with torch.device("meta"):
        model.embed.scale = torch.empty(())
    model.embed._non_persistent_buffers_set.add("scale")
    if params_on == "meta":
        model.embed.weight = weight = nn.Parameter(weight.to("meta"))
    fill_computed_buffers(model)
    assert model.embed.scale.item() == 2.0 and model.embed.scale.device.type == "cpu"
    assert model.embed.weight is weight
    if params_on == "cpu":
        assert torch.equal(weight, before)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_lazy_cat_and_narrow_read_any_range_like_torch(dim):
    from offload.runtime.conversion import Cat, Narrow, _Unsqueezed  # noqa: PLC0415

    g = torch.Generator().manual_seed(dim)
    shapes = [[3, 5, 7], [3, 5, 7]]
    for s, n in zip(shapes, (1, 4)):
        s[dim] = n
    parts = [torch.randn(s, generator=g) for s in shapes]
    whole = torch.cat(parts, dim)
    same = [torch.randn(3, 5, 7, generator=g) for _ in range(3)]
    stacked = Cat([_Unsqueezed(t, dim) for t in same], dim)  # MergeModulelist
    cases = [
        (Cat(parts, dim), whole),
        (Narrow(Cat(parts, dim), dim, 1, 3), whole.narrow(dim, 1, 3)),
        (stacked, torch.stack(same, dim)),
    ]
    for got, want in cases:
        assert got.shape == want.shape and got.dtype == want.dtype
        flat = want.reshape(-1)
        for lo, hi in [
            (0, flat.numel()),
            (0, 1),
            (6, 23),
            (flat.numel() - 1, flat.numel()),
            (9, 9),
        ]:
            assert torch.equal(got[lo:hi], flat[lo:hi]), (lo, hi)
    with pytest.raises(ValueError, match="shapes"):
        Cat([torch.ones(2, 3), torch.ones(2, 4)], 0)
