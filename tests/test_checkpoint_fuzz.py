"""Fuzzing the checkpoint reader: load_checkpoint on a checkpoint whose meta.json or
safetensors headers were mutated at random either loads or raises CheckpointError, and a
CheckpointError leaves the model and optimizer exactly as they were. Nothing else escapes,
nothing crashes, nothing hangs (a watchdog ends the run if one load takes a minute).

Mutations: random edits of meta.json's JSON tree (deleted keys, replaced values of any type,
huge and negative numbers, wrong sizes, nested lists), mostly sealed again so that the checks
behind the seal are reached; raw byte flips, insertions and truncations of meta.json; random
byte flips, truncations, 8-byte lengths and JSON-tree edits of a unit file's header, mostly
with meta.json's size and checksum updated to match, so that the header checks are hit.

The default suite runs 3 x 60 examples; ``-m slow`` runs 4,500 more.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import re
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from engine_models import batches, make_model, placement_config, train_wrapped
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import offload
from offload.api.checkpoint_files import CheckpointError, seal_meta

FAST, SLOW = 60, 1500
RUNS: dict[str, int] = {}
DEEP = {"units", "params", "files", "tensors", "param_group", "loss_scaler"}
OUTCOMES: dict[str, int] = {}  # how the examples ended, by the first words of the error

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 10**30, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["F32", "BF16", "I64", "master", "unit_00000.safetensors", "0" * 64]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


class World(dict):
    """The wrapped model and the saved files (a short repr for Hypothesis' reports)."""

    def __repr__(self) -> str:
        return "<wrapped model and its checkpoint>"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    model, opt = offload.wrap(
        make_model(huge_rows=200), placement_config("none", "cpu", root, dtype="bf16")
    )
    train_wrapped(model, opt, batches(2), 1, 1, 0.0)
    ckpt = offload.save_checkpoint(root / "ck", model, opt, note="fuzz")
    files = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    yield World(model=model, opt=opt, files=files, tmp=root)
    opt.close()
    print("\ncheckpoint fuzz:", ", ".join(f"{name}: {n} examples" for name, n in RUNS.items()))
    for what, n in sorted(OUTCOMES.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {what}")


def _state(model, opt) -> tuple:
    sd = opt.state_dict()
    tensors = [v.clone() for v in model.state_dict().values()]
    tensors += [v for e in sd["state"].values() for v in e.values()]
    return tensors, sd["param_groups"], sd["offload"]


def _same(a: tuple, b: tuple) -> bool:
    return (
        len(a[0]) == len(b[0])
        and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
        and a[1:] == b[1:]
    )


def _load(world, files: dict[str, bytes], kind: str) -> None:
    """Writes ``files`` as a checkpoint directory and loads it: it loads or raises
    CheckpointError, and then nothing changed."""
    RUNS[kind] = RUNS.get(kind, 0) + 1
    d = Path(tempfile.mkdtemp(dir=world["tmp"]))
    faulthandler.dump_traceback_later(60, exit=True)  # a hung load ends the run, loudly
    try:
        for name, raw in files.items():
            (d / name).write_bytes(raw)
        before = _state(world["model"], world["opt"])
        try:
            offload.load_checkpoint(d, world["model"], world["opt"])
            outcome = "loaded"
        except CheckpointError as exc:
            what = str(exc).split("': ", 1)[-1]
            outcome = " ".join(re.sub(r"[0-9]+|'[^']*'", "#", what).split()[:4])
            assert _same(before, _state(world["model"], world["opt"])), (
                "a failed load changed state"
            )
        OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1
    finally:
        faulthandler.cancel_dump_traceback_later()
        shutil.rmtree(d)


def _reseal_file(files: dict[str, bytes], name: str) -> None:
    """meta.json records ``name``'s current size and checksum (and is sealed again)."""
    meta = json.loads(files["meta.json"])
    rec = meta["files"][name]
    rec["size"] = len(files[name])
    rec["sha256"] = hashlib.sha256(files[name]).hexdigest()
    files["meta.json"] = json.dumps(seal_meta(meta)).encode()


# --------------------------------------------------------------------------- meta.json tree
def _mutate_tree(data, node, depth: int = 0):
    """Returns ``node`` with one random edit somewhere below it."""
    containers = isinstance(node, (dict, list)) and len(node) > 0
    if containers and (depth == 0 or (depth < 6 and data.draw(st.integers(0, 3)) > 0)):
        if isinstance(node, dict):
            keys = sorted(node)
            keys += [k for k in keys if k in DEEP] * 4  # where most of the checks are
            key = data.draw(st.sampled_from(keys))
            edit = data.draw(st.sampled_from(["descend"] * 3 + ["delete", "rename"]))
            node = dict(node)
            if edit == "delete":
                del node[key]
            elif edit == "rename":
                node[key + data.draw(st.sampled_from(["_", "X", " "]))] = node.pop(key)
            else:
                node[key] = _mutate_tree(data, node[key], depth + 1)
            return node
        i = data.draw(st.integers(0, len(node) - 1))
        edit = data.draw(st.sampled_from(["descend"] * 3 + ["delete", "duplicate", "append"]))
        node = list(node)
        if edit == "delete":
            del node[i]
        elif edit == "duplicate":
            node.insert(i, node[i])
        elif edit == "append":
            node.append(data.draw(json_values))
        else:
            node[i] = _mutate_tree(data, node[i], depth + 1)
        return node
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        return data.draw(json_values)
    how = data.draw(st.sampled_from(["value", "plus", "minus", "times", "huge", "neg", "str"]))
    return {
        "value": lambda: data.draw(json_values),
        "plus": lambda: node + data.draw(st.integers(1, 9000)),
        "minus": lambda: node - data.draw(st.integers(1, 9000)),
        "times": lambda: node * data.draw(st.sampled_from([0, 2, 4096, 1.5])),
        "huge": lambda: data.draw(st.sampled_from([2**63, 2**64 + 1, 10**40, 1e308])),
        "neg": lambda: -node - 1,
        "str": lambda: str(node),
    }[how]()


@settings(
    max_examples=FAST,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzz_meta_json_edits(pristine, data):
    files = dict(pristine["files"])
    meta = json.loads(files["meta.json"])
    edited = _mutate_tree(data, meta)
    if data.draw(st.integers(0, 3), label="seal again") > 0:
        edited = seal_meta(edited) if isinstance(edited, dict) else edited
    files["meta.json"] = json.dumps(edited).encode()
    _load(pristine, files, "meta.json edits")


@settings(
    max_examples=FAST,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzz_meta_json_bytes(pristine, data):
    files = dict(pristine["files"])
    raw = bytearray(files["meta.json"])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        how = data.draw(st.sampled_from(["flip", "set", "insert", "truncate"]))
        if how == "flip":
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "set":
            raw[at] = data.draw(st.sampled_from(b'{}[]",:0123456789-eE. \x00\xff'))
        elif how == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del raw[at:]
            break
    files["meta.json"] = bytes(raw)
    _load(pristine, files, "meta.json bytes")


@settings(
    max_examples=FAST,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzz_safetensors_headers(pristine, data):
    files = dict(pristine["files"])
    name = data.draw(st.sampled_from(sorted(n for n in files if n.endswith(".safetensors"))))
    raw = bytearray(files[name])
    (n,) = struct.unpack("<Q", raw[:8])
    for _ in range(data.draw(st.integers(1, 3))):
        how = data.draw(st.sampled_from(["flip", "set", "length", "truncate", "json"]))
        if how == "json":  # a well-formed header with one edit in its JSON tree
            try:
                header = json.loads(bytes(raw[8 : 8 + n]))
            except ValueError:  # an earlier mutation broke it
                continue
            new = json.dumps(_mutate_tree(data, header), separators=(",", ":")).encode()
            new += b" " * (-len(new) % 8)
            raw[: 8 + n] = struct.pack("<Q", len(new)) + new
            n = len(new)
        elif how == "length":
            value = data.draw(
                st.one_of(
                    st.integers(0, 2**64 - 1),
                    st.integers(max(0, n - 64), n + 64),
                    st.sampled_from([0, 1, 2, len(raw), len(raw) - 8, 2**63, 2**64 - 1]),
                )
            )
            raw[:8] = struct.pack("<Q", value)
        elif how == "truncate":
            del raw[data.draw(st.integers(0, min(8 + n, len(raw)))) :]
            break
        else:
            at = data.draw(st.integers(0, min(8 + n, len(raw)) - 1))
            if how == "flip":
                raw[at] ^= 1 << data.draw(st.integers(0, 7))
            else:
                raw[at] = data.draw(st.sampled_from(b'{}[]",:0123456789 FBIU_\x00'))
    files[name] = bytes(raw)
    if data.draw(st.integers(0, 3), label="meta.json updated to match") > 0:
        _reseal_file(files, name)
    _load(pristine, files, "safetensors headers")


@pytest.mark.slow
@settings(
    max_examples=3 * SLOW,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), which=st.sampled_from(["edits", "bytes", "headers"]))
def test_fuzz_checkpoint_reader_long(pristine, data, which):
    {
        "edits": test_fuzz_meta_json_edits,
        "bytes": test_fuzz_meta_json_bytes,
        "headers": test_fuzz_safetensors_headers,
    }[which].hypothesis.inner_test(pristine, data)


def test_fuzz_control_an_intact_copy_loads(pristine):
    """The harness itself: the unmutated files load (so the fuzz tests exercise real loads)."""
    d = Path(tempfile.mkdtemp(dir=pristine["tmp"]))
    for name, raw in pristine["files"].items():
        (d / name).write_bytes(raw)
    assert offload.load_checkpoint(d, pristine["model"], pristine["opt"]) == {"note": "fuzz"}
