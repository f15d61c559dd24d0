"""Parameter counts of decoder-only transformers from a Hugging Face ``config.json`` (torch-free).

The layer layouts and the formula are in :class:`ModelShape`; ``offload estimate --hf-config``
uses :func:`params_from_hf_config`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from offload.estimate.errors import EstimateError

# Architecture families whose layout differs from the LLaMA default (see ModelShape.style).
_GPT2_TYPES = {"gpt2", "gpt_bigcode"}
_NEOX_TYPES = {"gpt_neox"}
_QKV_BIAS_TYPES = {"qwen2", "qwen2_moe"}
# attention_bias puts biases on q/k/v only (Seed-OSS: attention_out_bias on o; GLM-4.5: none)
_QKV_ONLY_BIAS_TYPES = {"seed_oss", "glm4_moe"}
# Norms other than two weight-only ones per layer: LayerNorm with a bias (weight + bias a
# norm), none with weights (OLMo's), one per layer (Cohere's parallel block), four (Gemma 2/3)
_BIASED_NORM_TYPES = {"stablelm", "phimoe"}
_WEIGHTLESS_NORM_TYPES = {"olmo"}
_FOUR_NORM_TYPES = {"gemma2", "gemma3_text"}
# Qwen2-MoE / Qwen3-MoE: layers whose MLP is dense, not experts, follow decoder_sparse_step and
# mlp_only_layers.
_SPARSE_STEP_TYPES = {"qwen2_moe", "qwen3_moe"}
# model_types whose transformers config class ties the head to the embeddings by default: their
# config.json, saved by transformers 4.x, leaves tie_word_embeddings out when it is true (the
# base class's default too), so an absent key means tied (Gemma-2B: 2.51 B, not 3.03 B)
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3_text", "cohere", "ernie4_5", "smollm3"}
# An RMSNorm on q and one on k: per head (Qwen3: head_dim weights each, shared by the heads) or
# over all heads at once (OLMoE, OLMo2: heads x head_dim for q, kv heads x head_dim for k).
_HEAD_QK_NORM_TYPES = {"qwen3", "qwen3_moe", "gemma3_text"}
_FULL_QK_NORM_TYPES = {"olmoe", "olmo2", "olmo3"}
# ... or when a config key turns them on: per head (GLM-4.5's use_qk_norm) or over all heads
# (Cohere's use_qk_norm, StableLM's qk_layernorm: one weight-only norm per head)
_SWITCHED_QK_NORM = {
    "glm4_moe": ("use_qk_norm", "head"),
    "cohere": ("use_qk_norm", "full"),
    "stablelm": ("qk_layernorm", "full"),
}
# model_types whose count was checked against transformers' models (exact); any other is counted with the LLaMA layout and says so, since a
# plain MLP (OPT, Falcon, Phi-2, BLOOM, GPT-J: 2 h I) or another attention makes that count far
# off (Falcon-7B: 9.86 B for 6.92 B).
KNOWN_MODEL_TYPES = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma"}
    | {"gemma2", "gemma3_text", "phi3", "granite", "olmo", "olmo2", "olmoe", "cohere"}
    | {"stablelm", "smollm3", "exaone", "glm4", "ernie4_5", "deepseek_v2", "deepseek_v3"}
    | {"phimoe", "gpt_oss", "glm4_moe", "granitemoe", "granitemoeshared", "olmo3", "seed_oss"}
    | _GPT2_TYPES
    | _NEOX_TYPES
)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The few numbers of a decoder-only transformer that its parameter count depends on.

    ``style`` picks the layer layout:
      - ``"llama"`` (default; LLaMA, Mistral, Qwen2, Mixtral, ...): q/k/v/o projections with
        grouped-query k/v, gated MLP (gate, up, down: 3 h I), RMSNorm (h weights, 2 per layer
        plus a final one), rotary positions (no weights), biases only where the config says
        (``attention_bias``, ``mlp_bias``; Qwen2 has q/k/v biases).
      - ``"gpt2"``: fused qkv and output projection with biases, MLP h -> I -> h with biases,
        LayerNorm (weight + bias), learned position embeddings (``n_positions`` x h).
      - ``"gpt_neox"``: like gpt2 but rotary positions (no position weights).

    In the llama layout ``norms_per_layer`` norms of ``norm_weights`` x h parameters each (1:
    a weight; 2: LayerNorm's weight and bias; 0: OLMo's norms have none), the final one alike.
    GPT-OSS adds a learned attention sink per head (``attention_sinks``), biases on its router
    (``router_bias``) and experts (``expert_bias``); PhiMoE may add one to the head
    (``head_bias``).

    An MoE layer (``num_experts`` > 1) repeats the gated MLP per expert at
    ``moe_intermediate_size`` when the config gives one (Qwen-MoE experts are far narrower
    than ``intermediate_size``, the width of its dense layers and shared expert). The experts
    have no biases (transformers fuses them into two weights); a shared expert beside them is
    one gated MLP: Qwen2-MoE's ``shared_expert_intermediate_size`` wide with an h x 1 gate,
    DeepSeek's ``n_shared_experts`` x ``moe_intermediate_size`` wide without one.

    ``kv_lora_rank`` > 0 is DeepSeek's multi-head latent attention, in place of q/k/v/o:
    queries through a ``q_lora_rank`` bottleneck with its RMSNorm (h x r, r x n_q d; or one
    h x n_q d projection when the config's rank is null), keys and values through
    ``kv_lora_rank`` c (h x (c + rope), an RMSNorm of c, c x n_q (d - rope + v)) and an output
    n_q v x h; ``head_dim`` d is a query head's nope + rope dims, ``v_head_dim`` v a value
    head's; ``qkv_bias`` adds biases to its two h x projections, ``o_bias`` to the output.
    """

    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    style: str = "llama"
    num_experts: int = 1  # MoE experts per layer (MLP repeated, plus an h x E router)
    expert_intermediate_size: int = 0  # an expert's MLP width (moe_intermediate_size; 0: I)
    shared_expert_intermediate_size: int = 0  # the MoE layers' shared expert MLP (0: none)
    shared_expert_gate: bool = False  # an h x 1 gate on the shared expert (Qwen2-MoE)
    dense_layers: int = 0  # layers of an MoE model whose MLP is dense (width I), not experts
    qk_norm: int = 0  # RMSNorm weights on q and k per layer (Qwen3: 2 head_dim; OLMoE: all heads)
    q_lora_rank: int = 0  # latent attention's query bottleneck (0: one q projection)
    kv_lora_rank: int = 0  # latent attention's key/value bottleneck (0: not latent attention)
    qk_rope_head_dim: int = 0  # latent attention: the rotary part of head_dim
    v_head_dim: int = 0  # latent attention: a value head's size
    max_positions: int = 0  # learned position embeddings (gpt2 style only)
    qkv_bias: bool = False  # biases on q/k/v (latent attention: on its down-projections)
    o_bias: bool = False  # a bias on the output projection
    mlp_bias: bool = False
    norms_per_layer: int = 2
    norm_weights: int = 1  # parameters per hidden element of one norm (llama layout)
    attention_sinks: bool = False  # one learned logit per query head (GPT-OSS)
    router_bias: bool = False
    expert_bias: bool = False  # biases on the fused experts' projections (GPT-OSS)
    head_bias: bool = False  # a bias on the output head (PhiMoE's lm_head_bias)


def _get(cfg: Mapping[str, Any], names: tuple[str, ...], source: str) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    raise EstimateError(
        f"{source}: missing key {names[0]!r}"
        + (f" (or {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else "")
        + "; a Hugging Face decoder config needs hidden_size, num_hidden_layers, vocab_size, "
        "num_attention_heads (intermediate_size, num_key_value_heads optional)"
    )


def _positive_int(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EstimateError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def shape_from_hf_config(cfg: Mapping[str, Any], *, source: str = "config") -> ModelShape:
    """Read a Hugging Face ``config.json`` (as a dict) into a :class:`ModelShape`.

    Accepts the GPT-2 spellings (``n_embd``, ``n_layer``, ``n_head``, ``n_inner``) as aliases.
    ``tie_word_embeddings`` defaults as the model type's transformers config class does: True
    for gpt2, Gemma and a few others, False otherwise.
    Raises :class:`EstimateError` naming the key when a required one is missing or invalid.
    """
    if not isinstance(cfg, Mapping):
        raise EstimateError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    model_type = str(cfg.get("model_type", "")).lower()
    style = (
        "gpt2"
        if model_type in _GPT2_TYPES
        else "gpt_neox"
        if model_type in _NEOX_TYPES
        else "llama"
    )
    h = _positive_int(
        _get(cfg, ("hidden_size", "n_embd", "d_model"), source), "hidden_size", source
    )
    layers = _positive_int(
        _get(cfg, ("num_hidden_layers", "n_layer", "num_layers"), source),
        "num_hidden_layers",
        source,
    )
    vocab = _positive_int(_get(cfg, ("vocab_size",), source), "vocab_size", source)
    heads = _positive_int(
        _get(cfg, ("num_attention_heads", "n_head"), source), "num_attention_heads", source
    )
    inter_raw = cfg.get("intermediate_size", cfg.get("n_inner", cfg.get("ffn_dim")))
    inter = 4 * h if inter_raw is None else _positive_int(inter_raw, "intermediate_size", source)
    kv_raw = cfg.get("num_key_value_heads")
    if kv_raw is None:
        kv_heads = 1 if cfg.get("multi_query") else heads
    else:
        kv_heads = _positive_int(kv_raw, "num_key_value_heads", source)
    if heads % kv_heads:
        raise EstimateError(
            f"{source}: num_attention_heads ({heads}) must be a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    latent = _latent_attention(cfg, source) if cfg.get("kv_lora_rank") else {}
    head_dim_raw = cfg.get("head_dim")
    if latent:  # DeepseekV2Config writes its rope dims as head_dim: not a query head's size
        head_dim = latent.pop("head_dim")
    elif head_dim_raw is None:
        if h % heads:
            raise EstimateError(
                f"{source}: hidden_size ({h}) is not a multiple of num_attention_heads "
                f"({heads}) and no head_dim is given"
            )
        head_dim = h // heads
    else:
        head_dim = _positive_int(head_dim_raw, "head_dim", source)
    tied_raw = cfg.get("tie_word_embeddings")
    tied_default = style == "gpt2" or model_type in _TIED_BY_DEFAULT
    tied = tied_default if tied_raw is None else bool(tied_raw)
    expert_keys = ("num_local_experts", "num_experts", "n_routed_experts")  # n_: DeepSeek
    experts_key = next((k for k in expert_keys if cfg.get(k) is not None), None)
    experts = 1 if experts_key is None else _positive_int(cfg[experts_key], experts_key, source)
    moe_raw = cfg.get("moe_intermediate_size")
    moe_inter = 0 if moe_raw is None else _positive_int(moe_raw, "moe_intermediate_size", source)
    shared_key = next(  # Qwen2-MoE's, with an h x 1 gate; Granite-MoE-shared's, without
        (k for k in ("shared_expert_intermediate_size", "shared_intermediate_size") if k in cfg),
        "shared_expert_intermediate_size",
    )
    shared_raw = cfg.get(shared_key) if experts > 1 else None
    shared = 0 if not shared_raw else _positive_int(shared_raw, shared_key, source)
    shared_gate = shared > 0 and shared_key == "shared_expert_intermediate_size"
    if experts > 1 and cfg.get("n_shared_experts"):  # DeepSeek: n experts' width, in one MLP
        n_shared = _positive_int(cfg["n_shared_experts"], "n_shared_experts", source)
        shared = n_shared * (moe_inter or inter)
    dense = 0
    if experts > 1 and model_type in _SPARSE_STEP_TYPES:
        step = _positive_int(cfg.get("decoder_sparse_step", 1), "decoder_sparse_step", source)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list):
            raise EstimateError(f"{source}: mlp_only_layers must be a list, got {only!r}")
        dense = sum(1 for i in range(layers) if i in only or (i + 1) % step)
    elif experts > 1 and cfg.get("first_k_dense_replace") is not None:  # DeepSeek
        first = cfg["first_k_dense_replace"]
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise EstimateError(
                f"{source}: first_k_dense_replace must be an integer >= 0, got {first!r}"
            )
        dense = min(first, layers)
    qk_kind = None
    if model_type in _HEAD_QK_NORM_TYPES:
        qk_kind = "head"
    elif model_type in _FULL_QK_NORM_TYPES:
        qk_kind = "full"
    elif model_type in _SWITCHED_QK_NORM and cfg.get(_SWITCHED_QK_NORM[model_type][0]):
        qk_kind = _SWITCHED_QK_NORM[model_type][1]
    qk_norm = {None: 0, "head": 2 * head_dim, "full": (heads + kv_heads) * head_dim}[qk_kind]
    attention_bias = bool(cfg.get("attention_bias", False))
    qkv_bias = attention_bias or model_type in _QKV_BIAS_TYPES or bool(cfg.get("use_qkv_bias"))
    o_bias = attention_bias  # StableLM's use_qkv_bias above: q/k/v only
    if model_type in _QKV_ONLY_BIAS_TYPES:
        o_bias = bool(cfg.get("attention_out_bias"))
    norms = 2
    if model_type in _FOUR_NORM_TYPES:
        norms = 4
    elif model_type == "cohere" or (
        model_type == "stablelm" and cfg.get("use_parallel_residual")
    ):  # attention and MLP read one norm's output
        norms = 1
    norm_weights = (
        2 if model_type in _BIASED_NORM_TYPES else 0 if model_type in _WEIGHTLESS_NORM_TYPES else 1
    )
    gpt_oss = model_type == "gpt_oss"
    positions = 0
    if style == "gpt2":
        positions = _positive_int(
            _get(cfg, ("n_positions", "max_position_embeddings"), source), "n_positions", source
        )
    return ModelShape(
        hidden_size=h,
        num_layers=layers,
        vocab_size=vocab,
        intermediate_size=inter,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        tied_embeddings=tied,
        style=style,
        num_experts=experts,
        expert_intermediate_size=moe_inter if experts > 1 else 0,
        shared_expert_intermediate_size=shared,
        shared_expert_gate=shared_gate,
        dense_layers=dense,
        qk_norm=qk_norm,
        max_positions=positions,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        norms_per_layer=norms,
        norm_weights=norm_weights,
        attention_sinks=gpt_oss,
        router_bias=gpt_oss,
        expert_bias=gpt_oss,
        head_bias=bool(cfg.get("lm_head_bias")),
        **latent,
    )


def _latent_attention(cfg: Mapping[str, Any], source: str) -> dict[str, int]:
    """The latent attention fields of :class:`ModelShape` from a DeepSeek config, with its
    ``head_dim`` (a query head: nope + rope dims)."""
    dims = {
        key: _positive_int(_get(cfg, (key,), source), key, source)
        for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    }
    q_rank = cfg.get("q_lora_rank")  # null in DeepSeek-V2-Lite's config: one q projection
    return {
        "q_lora_rank": 0 if q_rank is None else _positive_int(q_rank, "q_lora_rank", source),
        "kv_lora_rank": dims["kv_lora_rank"],
        "qk_rope_head_dim": dims["qk_rope_head_dim"],
        "v_head_dim": dims["v_head_dim"],
        "head_dim": dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"],
    }


def unknown_layout(cfg: Mapping[str, Any]) -> str | None:
    """What to say when the config's ``model_type`` is not one whose layout the count knows
    (None when it is, or when the config names none: the LLaMA layout is the default)."""
    model_type = cfg.get("model_type")
    if not model_type or str(model_type).lower() in KNOWN_MODEL_TYPES:
        return None
    return (
        f"model_type {model_type!r} is not a layout the count knows: counted as LLaMA-style "
        "(gated MLP), which may be far off; give --params from the model itself"
    )


def layer_params(shape: ModelShape, *, dense: bool = False) -> int:
    """Parameters of one transformer block (see :class:`ModelShape` for the layouts); of an
    MoE model's dense block when ``dense``."""
    h, inter = shape.hidden_size, shape.intermediate_size
    q_out = shape.num_heads * shape.head_dim
    kv_out = shape.num_kv_heads * shape.head_dim
    if shape.style in ("gpt2", "gpt_neox"):
        attn = h * (q_out + 2 * kv_out) + (q_out + 2 * kv_out) + q_out * h + h
        mlp = 2 * h * inter + inter + h
        norms = 2 * (2 * h)  # two LayerNorms, weight + bias
        return attn + mlp + norms
    if shape.kv_lora_rank:
        attn = _latent_attention_params(shape)
    else:
        attn = h * (q_out + 2 * kv_out) + q_out * h
        attn += (q_out + 2 * kv_out) * shape.qkv_bias + h * shape.o_bias
        attn += shape.qk_norm + (shape.num_heads if shape.attention_sinks else 0)

    def gated(width: int, bias: bool = shape.mlp_bias) -> int:
        return 3 * h * width + (2 * width + h if bias else 0)

    mlp = gated(inter)
    if shape.num_experts > 1 and not dense:
        width = shape.expert_intermediate_size or inter
        experts = shape.num_experts * gated(width, bias=shape.expert_bias)  # fused
        mlp = experts + (h + shape.router_bias) * shape.num_experts  # experts + router
        if shape.shared_expert_intermediate_size:
            mlp += gated(shape.shared_expert_intermediate_size)
            mlp += h if shape.shared_expert_gate else 0
    return attn + mlp + shape.norms_per_layer * shape.norm_weights * h


def _latent_attention_params(shape: ModelShape) -> int:
    """DeepSeek's multi-head latent attention (see :class:`ModelShape`)."""
    h, heads, bias = shape.hidden_size, shape.num_heads, int(shape.qkv_bias)
    q_rank, kv_rank, rope = shape.q_lora_rank, shape.kv_lora_rank, shape.qk_rope_head_dim
    q_out = heads * shape.head_dim
    # down-projection (+ bias) and RMSNorm of the bottleneck, then up to the heads
    q = (h + bias + 1) * q_rank + q_rank * q_out if q_rank else h * q_out
    kv = (h + bias) * (kv_rank + rope) + kv_rank
    kv += kv_rank * heads * (shape.head_dim - rope + shape.v_head_dim)
    out = heads * shape.v_head_dim * h + shape.o_bias * h
    return q + kv + out


def embedding_params(shape: ModelShape) -> int:
    """Token embeddings, the output head unless tied, learned positions, and the final norm."""
    h = shape.hidden_size
    emb = shape.vocab_size * h * (1 if shape.tied_embeddings else 2)
    emb += shape.max_positions * h
    emb += 2 * h if shape.style in ("gpt2", "gpt_neox") else shape.norm_weights * h
    return emb + (shape.vocab_size if shape.head_bias else 0)


def count_params(shape: ModelShape) -> int:
    """Total parameters: layers x block + embeddings/head + final norm."""
    dense = shape.dense_layers * layer_params(shape, dense=True)
    sparse = (shape.num_layers - shape.dense_layers) * layer_params(shape)
    return sparse + dense + embedding_params(shape)


def params_from_hf_config(cfg: Mapping[str, Any], *, source: str = "config") -> int:
    """Parameter count of a LLaMA/GPT-style Hugging Face config (LLaMA-2-7B: 6,738,415,616)."""
    return count_params(shape_from_hf_config(cfg, source=source))


def load_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``config.json``, or the one in a model directory (as ``offload finetune --model``
    and ``offload.from_pretrained`` take it); errors name the path and what is wrong with it."""
    if os.path.isdir(path):
        inside = os.path.join(path, "config.json")
        if not os.path.isfile(inside):
            raise EstimateError(
                f"--hf-config: {os.fspath(path)!r} is a directory without a config.json; "
                "allowed: a Hugging Face config.json or a model directory holding one"
            )
        path = inside
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise EstimateError(f"--hf-config: no such file: {os.fspath(path)!r}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EstimateError(f"--hf-config: cannot read {os.fspath(path)!r}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise EstimateError(
            f"--hf-config: {os.fspath(path)!r} is not valid JSON ({exc}); "
            "expected a Hugging Face config.json"
        ) from None
    if not isinstance(data, dict):
        raise EstimateError(f"--hf-config: {os.fspath(path)!r} must hold a JSON object")
    return data
