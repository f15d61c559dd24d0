"""The optimizer's param groups: which trainable parameters take which hyperparameters.

``offload.wrap`` builds them once, from its ``param_groups=`` (tensors, as a torch optimizer
takes them) or from the config's ``optimizer.param_groups`` (name patterns, for models built
inside ``from_pretrained``), and the parameters the config's ``optimizer.no_decay`` leaves
undecayed; every rank must build the same. The update's side of them, each piece cut into runs
at their edges, is ``offload.homes.decay``'s.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

from offload.api.optimizer import HYPER_ALLOWED, hyperparameter
from offload.config import ConfigError
from offload.dist import Comm


def optimizer_groups(
    model: nn.Module, named, listed, trainable: list, defaults: dict, comm: Comm
) -> list[dict]:
    """The groups ``wrap`` gives its optimizer: ``listed`` (``wrap``'s ``param_groups``) or
    ``named`` (the config's ``optimizer.param_groups``), not both; one group of ``trainable``
    with ``defaults`` (the config's values) when neither; checked against the other ranks'."""
    if named:
        if listed is not None:
            raise ValueError(
                "offload.wrap: param_groups= was given and the config's optimizer.param_groups "
                f"lists {len(named)} group(s); allowed: one of the two (the config's names "
                "parameters by patterns, wrap's lists them)"
            )
        listed = _named(model, named, trainable)
    groups = _listed(model, listed, trainable, defaults)
    if comm.world > 1:
        check_ranks_agree(comm, model, groups)
    return groups


GROUP_OVERRIDES = tuple(HYPER_ALLOWED)
"""What a group of ``wrap``'s ``param_groups`` may set for its parameters: the values the
update checks (``lr``, ``betas``, ``eps``, ``weight_decay``)."""


def _listed(model: nn.Module, given, trainable: list, defaults: dict) -> list[dict]:
    """The optimizer's param groups: one with ``trainable`` (``model.parameters()`` order)
    and ``defaults`` (the config's) when ``given`` is None, else ``given``'s, checked as a torch
    optimizer checks them and more: each a dict with ``params`` (the model's parameters; a
    frozen one is accepted and left out, as it would get no gradient) and any of
    ``GROUP_OVERRIDES``; no parameter in two groups; every trainable parameter in one (offload
    trains all of them: one left out would train with no hyperparameters of its own)."""
    if given is None:
        return [dict(defaults, params=trainable)]
    where = "offload.wrap: param_groups"
    if isinstance(given, dict) or not isinstance(given, (list, tuple)) or not given:
        raise ValueError(
            f"{where}: got {type(given).__name__}; allowed: a non-empty list of dicts, each with "
            "'params' (the model's parameters) and any of " + ", ".join(GROUP_OVERRIDES)
        )
    names = {p: n for n, p in model.named_parameters()}
    wanted = set(trainable)
    seen: dict = {}
    groups = []
    for i, g in enumerate(given):
        at = f"{where}[{i}]"
        if not isinstance(g, dict) or "params" not in g:
            got = "dict without params" if isinstance(g, dict) else type(g).__name__
            raise ValueError(
                f"{at}: got {got}; allowed: a dict with 'params' (the model's parameters) and "
                "any of " + ", ".join(GROUP_OVERRIDES)
            )
        extra = sorted(set(g) - {"params", "name", *GROUP_OVERRIDES}, key=str)
        if extra:
            raise ValueError(
                f"{at}: keys {extra} are not supported; allowed: 'params', 'name' (a label, as "
                "Lightning's LR monitor reads) and any of "
                + ", ".join(GROUP_OVERRIDES)
                + " (the optimizer's type and bias_correction are the config's, for all groups)"
            )
        if not isinstance(g.get("name", ""), str):
            raise ValueError(f"{at}['name']: got {g['name']!r}; allowed: a string")
        params = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for j, p in enumerate(params):
            if not isinstance(p, nn.Parameter) or p not in names:
                shape = f" of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else ""
                raise ValueError(
                    f"{at}['params'][{j}]: a {type(p).__name__}{shape} that is not a parameter "
                    "of the wrapped model; allowed: its parameters (model.parameters())"
                )
            if p in seen:
                raise ValueError(
                    f"{at}['params'][{j}]: parameter '{names[p]}' is already in "
                    f"param_groups[{seen[p]}]; allowed: each parameter in one group"
                )
            seen[p] = i
        group = dict(defaults, params=[p for p in params if p in wanted])
        if "name" in g:
            group["name"] = g["name"]
        for key in GROUP_OVERRIDES:
            if key in g:
                group[key] = hyperparameter(g, key, at)
        groups.append(group)
    missing = [names[p] for p in trainable if p not in seen]
    if missing:
        raise ValueError(
            f"{where}: {len(missing)} trainable parameter(s) are in no group "
            f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); allowed: every "
            "trainable parameter in one group (offload trains all of them: freeze one with "
            "requires_grad_(False) before offload.wrap to leave it untrained)"
        )
    return groups


def _named(model: nn.Module, listed: list[dict], trainable: list) -> list[dict]:
    """The config's ``optimizer.param_groups`` as ``wrap``'s ``param_groups``: a first group of
    the trainable parameters no group names (the config's values), then each listed group with
    the trainable parameters a name of which (any of a tied one's) one of its patterns finds
    (``re.search``). A pattern that finds no parameter, or a parameter two groups find, is
    refused, naming the group."""
    named = list(model.named_parameters(remove_duplicate=False))
    first = {p: n for n, p in reversed(named)}  # (a tied parameter by its first name)
    owner: dict = {}
    groups, wanted = [], set(trainable)
    for i, group in enumerate(listed):
        key = f"optimizer.param_groups[{i}].params"
        found: dict = {}
        for pattern in group["params"]:
            hits = [p for name, p in named if re.search(pattern, name)]
            if not hits:
                examples = ", ".join(name for name, _ in named[:4])
                raise ConfigError.bad(
                    key,
                    pattern,
                    "regular expressions that each find a parameter name of the model (re.search; "
                    f"its names look like {examples}, ...)",
                )
            found.update((p, None) for p in hits if p in wanted)  # (ordered, by identity)
        for p in found:
            if p in owner:
                raise ConfigError.bad(
                    key,
                    group["params"],
                    f"patterns that find no parameter an earlier group finds; '{first[p]}' is "
                    f"found by optimizer.param_groups[{owner[p]}] too",
                )
            owner[p] = i
        groups.append(dict({k: v for k, v in group.items() if k != "params"}, params=list(found)))
    rest = [p for p in trainable if p not in owner]
    return [{"params": rest}, *groups]


def check_ranks_agree(comm: Comm, model: nn.Module, groups: list[dict]) -> None:
    """Every rank builds the same param groups (the same parameters, by their index in
    ``model.parameters()``, and hyperparameters); the first difference is told."""
    index = {p: i for i, p in enumerate(model.parameters())}
    mine = [
        {"params": [index[p] for p in g["params"]], **{k: v for k, v in g.items() if k != "params"}}
        for g in groups
    ]
    theirs = comm.all_gather_object(mine, "every rank's param groups")
    for rank, other in enumerate(theirs):
        if len(other) != len(mine):
            what = f"{len(mine)} param group(s) on rank {comm.rank} and {len(other)} on rank {rank}"
        else:
            found = [
                (f"param_groups[{i}]['{k}']", a[k], b.get(k))
                for i, (a, b) in enumerate(zip(mine, other, strict=True))
                for k in a
                if a[k] != b.get(k)
            ]
            if not found:
                continue
            key, a, b = found[0]
            if key.endswith("['params']"):
                what = f"{key[:-10]} holds other parameters (by their index in model.parameters())"
            else:
                what = f"{key} is {a!r} on rank {comm.rank} and {b!r} on rank {rank}"
        raise ValueError(
            f"offload.wrap: rank {comm.rank} and rank {rank} of the process group pass different "
            f"param_groups: {what}; every rank must wrap the same model with the same param groups"
        )


def not_decayed(model: nn.Module, patterns: list[str], trainable: list) -> frozenset:
    """The trainable parameters with a name (any of a tied one's) that one of the config's
    ``optimizer.no_decay`` patterns finds (``re.search``). A pattern that finds no parameter
    at all is refused: a misspelt one would decay what it was meant to leave alone."""
    named = list(model.named_parameters(remove_duplicate=False))
    found: set = set()
    for pattern in patterns:
        hits = [p for name, p in named if re.search(pattern, name)]
        if not hits:
            examples = ", ".join(name for name, _ in named[:4])
            raise ConfigError.bad(
                "optimizer.no_decay",
                pattern,
                "regular expressions that each find a parameter name of the model (re.search; "
                f"its names look like {examples}, ...)",
            )
        found.update(hits)
    return frozenset(p for p in trainable if p in found)
