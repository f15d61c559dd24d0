"""offload estimate: the ZeRO paper's figure, published parameter counts, bad inputs, the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from offload import estimate as est
from offload.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Published configs (the fields that matter) and their published parameter counts.
LLAMA2_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
LLAMA2_70B = LLAMA2_7B | {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
}
MIXTRAL_8X7B = LLAMA2_7B | {
    "model_type": "mixtral",
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
}
QWEN15_MOE_A27B = {  # Qwen1.5-MoE-A2.7B: 60 narrow experts and a shared expert per layer
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts": 60,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
OLMOE_1B_7B = {  # q/k RMSNorms over all heads: h for q, kv heads x head_dim for k
    "model_type": "olmoe",
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "num_experts": 64,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "tie_word_embeddings": False,
    "vocab_size": 50304,
}
OLMO2_7B = {
    "model_type": "olmo2",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "tie_word_embeddings": False,
    "vocab_size": 100352,
}
DEEPSEEK_V2_LITE = {  # latent attention (no q bottleneck), 2 shared experts, 1 dense layer
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "tie_word_embeddings": False,
    "vocab_size": 102400,
}
DEEPSEEK_V3 = DEEPSEEK_V2_LITE | {  # transformers builds no multi-token prediction layer
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "vocab_size": 129280,
    "n_group": 8,
    "topk_group": 4,
}
GEMMA_2B = {  # its config.json has no tie_word_embeddings: GemmaConfig's default (true) holds
    "model_type": "gemma",
    "hidden_size": 2048,
    "intermediate_size": 16384,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "num_hidden_layers": 18,
    "vocab_size": 256000,
}
GPT2_SMALL = {
    "model_type": "gpt2",
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_positions": 1024,
    "vocab_size": 50257,
}
PYTHIA_160M = {
    "model_type": "gpt_neox",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "vocab_size": 50304,
    "tie_word_embeddings": False,
}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "offload", "estimate", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )


# --- the ZeRO paper (Rajbhandari et al. 2020, Figure 1): 7.5B params, 64 ranks, K = 12 ------


@pytest.mark.parametrize(
    "stage, paper_gb, exact_gb",
    [(0, 120, 120.0), (1, 31.4, 31.40625), (2, 16.6, 16.640625), (3, 1.9, 1.875)],
)
def test_zero_paper_figure(stage, paper_gb, exact_gb):
    got = est.zero_model_state_bytes(7_500_000_000, 64, stage)
    assert got == pytest.approx(exact_gb * est.GB, abs=64)
    assert round(got / est.GB, 1) == paper_gb


def test_estimate_rows_carry_the_paper_figure_and_offload_shrinks_the_device():
    e = est.estimate(7_500_000_000, est.Machine(gpus_per_node=8, nodes=8))
    rows = {(r.stage, r.placement): r for r in e.rows}
    assert len(rows) == len(est.STAGES) * len(est.PLACEMENTS)
    for stage, gb in [(0, 120.0), (1, 31.40625), (2, 16.640625), (3, 1.875)]:
        assert rows[stage, "none"].device_states == pytest.approx(gb * est.GB, abs=64)
    psi, n = 7_500_000_000, 64
    for stage in est.STAGES:
        none, opt, both, nvme = (rows[stage, p] for p in est.PLACEMENTS)
        held = 2 * psi if stage == 1 else 0  # stage 1 keeps the whole gradient on the device
        assert none.device_states > opt.device_states > both.device_states == held
        assert nvme.device_states == held
        # offloaded optimizer: fp32 master + m + v + grad = 16 bytes per param of the partition
        part = n if stage >= 1 else 1
        assert opt.host_per_rank == -(-16 * psi // part)
        assert opt.host_per_node == 8 * opt.host_per_rank
        assert both.host_per_rank == opt.host_per_rank + -(-2 * psi // (n if stage == 3 else 1))
        # NVMe: the state moves to disk, the host keeps only wrap's two pinned pools, whose
        # "auto" buffers hold one rank's share of a unit: 7.5e9 / 32 / 64 params
        unit = -(-psi // 32)
        share = -(-unit // n)
        # on disk as on the host, plus the step in backward's second extent of master, m, v
        assert nvme.nvme_per_rank == both.host_per_rank + -(-12 * psi // part)
        assert nvme.host_per_rank == 5 * _round4k(2 * share) + 8 * _round4k(4 * share)
        # params in bf16, gradients summed in fp32 (distributed.reduce_dtype's default); stage
        # 0 is DDP's all-reduce in bf16
        want = 2 * 2 * psi if stage == 0 else (4 + (2 if stage == 3 else 1) * 2) * psi
        assert none.comm_per_rank == want
        assert 0 < opt.device_working <= nvme.device_working


def test_stage_1_keeps_the_micro_steps_sum_in_the_grad_accum_dtype(capsys):
    """With gradient accumulation stage 1 adds a step's micro-steps on the device in
    ``distributed.grad_accum_dtype``: fp32 by default, 4 bytes per parameter where bf16's
    ``p.grad`` takes 2; one micro-step, or the compute dtype, keeps ``p.grad``'s 2."""
    psi, machine = 10**9, est.Machine(gpus_per_node=8)

    def rows(**kw):
        e = est.estimate(psi, machine, unit_params=10**7, **kw)
        return {(r.stage, r.placement): r for r in e.rows}

    one, accum, bf16 = rows(), rows(accumulation=4), rows(accumulation=4, grad_accum_dtype="auto")
    for placement in ("cpu_optimizer_params", "nvme"):
        assert one[1, placement].device_states == bf16[1, placement].device_states == 2 * psi
        assert accum[1, placement].device_states == 4 * psi
    for key, row in accum.items():
        if key[0] != 1 or key[1] == "none":  # (the paper's row: DeepSpeed's stage 1)
            assert row.device_states == one[key].device_states
    # the collectives of 4 micro-steps: stages 2 and 3 reduce each, stage 1 once per step
    assert accum[1, "nvme"].comm_per_rank == one[1, "nvme"].comm_per_rank == (4 + 2) * psi
    assert accum[2, "nvme"].comm_per_rank == (4 * 4 + 2) * psi
    assert accum[3, "nvme"].comm_per_rank == 4 * (4 + 2 * 2) * psi
    assert est.held_grad_bytes("fp32", 4) == 4
    with pytest.raises(est.EstimateError, match="--grad-accum-dtype 'fp16'.*allowed fp32, auto"):
        est.estimate(psi, machine, grad_accum_dtype="fp16")
    with pytest.raises(est.EstimateError, match="--accum: must be an integer >= 1, got 0"):
        est.estimate(psi, machine, accumulation=0)
    assert main(["estimate", "--params", "1e9", "--gpus", "8", "--accum", "4", "--json"]) == 0
    got = {(r["stage"], r["placement"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert got[1, "nvme"]["device_states"] == 4 * psi


def test_fp32_uses_4_4_8_bytes():
    assert est.zero_model_state_bytes(10**9, 1, 0, "fp32") == 16 * 10**9
    assert est.zero_model_state_bytes(10**9, 4, 1, "fp32") == 8 * 10**9 + 2 * 10**9


def test_fits_against_the_machine():
    m = est.Machine(gpu_mem=80 * est.GB, host_mem=256 * est.GB, nvme=2000 * est.GB)
    e = est.estimate(7_000_000_000, m)
    rows = {(r.stage, r.placement): r for r in e.rows}
    assert rows[0, "none"].fits_device is False and not rows[0, "none"].fits
    assert rows[0, "cpu_optimizer"].fits_device is True  # 14 GB of bf16 params on the device
    assert rows[0, "cpu_optimizer"].fits_host is True  # 112 GB of fp32 state on the host
    assert rows[0, "cpu_optimizer_params"].fits
    assert rows[0, "nvme"].fits and rows[0, "nvme"].nvme_per_node == (18 + 12) * 7 * est.GB
    small = est.estimate(7_000_000_000, est.Machine(gpu_mem=80 * est.GB, host_mem=64 * est.GB))
    row = {(r.stage, r.placement): r for r in small.rows}
    assert row[0, "cpu_optimizer"].fits_host is False and not row[0, "cpu_optimizer"].fits
    assert row[0, "nvme"].fits_host is True and row[0, "nvme"].fits_nvme is None


# --- parameter counts of published configs ----------------------------------------------


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (LLAMA2_7B, 6_738_415_616),
        (LLAMA2_70B, 68_976_648_192),
        (MIXTRAL_8X7B, 46_702_792_704),
        (GPT2_SMALL, 124_439_808),
        (PYTHIA_160M, 162_322_944),
        (QWEN15_MOE_A27B, 14_315_784_192),
        (GEMMA_2B, 2_506_172_416),
        (QWEN3_30B_A3B, 30_532_122_624),
        (OLMOE_1B_7B, 6_919_161_856),
        (OLMO2_7B, 7_298_617_344),
        (DEEPSEEK_V2_LITE, 15_706_484_224),
        (DEEPSEEK_V3, 671_026_404_352),
        # dense layers by decoder_sparse_step 2 and mlp_only_layers (counted by transformers)
        (
            QWEN15_MOE_A27B
            | {
                "hidden_size": 64,
                "intermediate_size": 160,
                "num_experts": 4,
                "moe_intermediate_size": 48,
                "shared_expert_intermediate_size": 96,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 1000,
                "decoder_sparse_step": 2,
                "mlp_only_layers": [3],
            },
            326_016,
        ),
    ],
    ids=[
        "llama2-7b",
        "llama2-70b",
        "mixtral-8x7b",
        "gpt2",
        "pythia-160m",
        "qwen1.5-moe-a2.7b",
        "gemma-2b-tied-unsaid",
        "qwen3-30b-a3b",
        "olmoe-1b-7b",
        "olmo2-7b",
        "deepseek-v2-lite",
        "deepseek-v3",
        "qwen2-moe-dense-layers",
    ],
)
def test_hf_config_param_counts(cfg, expected):
    assert est.params_from_hf_config(cfg) == expected


def _small_configs():
    """Small configs of the layouts with something to get wrong (q/k norms over grouped k/v
    heads, dense layers among MoE ones, latent attention with and without a q bottleneck and
    with biases), as transformers' config classes write them."""
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=64, num_attention_heads=4, vocab_size=300, tie_word_embeddings=False)
    return {
        "olmoe-gqa": transformers.OlmoeConfig(
            **small, intermediate_size=32, num_experts=6, num_hidden_layers=2,
            num_key_value_heads=2,
        ),
        "olmo2-gqa": transformers.Olmo2Config(
            **small, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
        ),
        "qwen2_moe-sparse-step": transformers.Qwen2MoeConfig(
            **small, intermediate_size=128, moe_intermediate_size=16, num_experts=6,
            shared_expert_intermediate_size=40, num_hidden_layers=6, num_key_value_heads=2,
            decoder_sparse_step=2, mlp_only_layers=[3],
        ),
        "qwen3_moe-head-dim": transformers.Qwen3MoeConfig(
            **small, intermediate_size=128, moe_intermediate_size=16, num_experts=6,
            num_hidden_layers=3, num_key_value_heads=2, head_dim=24, decoder_sparse_step=3,
        ),
        "deepseek_v2-biases": transformers.DeepseekV2Config(
            **small, intermediate_size=128, moe_intermediate_size=16, n_routed_experts=6,
            n_shared_experts=2, first_k_dense_replace=1, num_hidden_layers=3,
            num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12, attention_bias=True, mlp_bias=True,
            n_group=1, topk_group=1,
        ),
        "deepseek_v3-q-bottleneck": transformers.DeepseekV3Config(
            **small, intermediate_size=128, moe_intermediate_size=16, n_routed_experts=6,
            n_shared_experts=1, first_k_dense_replace=2, num_hidden_layers=3,
            num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=20, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12, attention_bias=True, n_group=1, topk_group=1,
        ),
        "phimoe-biases": transformers.PhimoeConfig(
            **small, intermediate_size=32, num_local_experts=4, num_hidden_layers=2,
            num_key_value_heads=2, attention_bias=True, lm_head_bias=True,
        ),
        "gpt_oss": transformers.GptOssConfig(
            **small, intermediate_size=32, num_local_experts=4, num_hidden_layers=2,
            num_key_value_heads=2, head_dim=16,
        ),
        "glm4_moe-qk-norm": transformers.Glm4MoeConfig(
            **small, intermediate_size=128, moe_intermediate_size=16, n_routed_experts=4,
            n_shared_experts=2, first_k_dense_replace=1, num_hidden_layers=3,
            num_key_value_heads=2, use_qk_norm=True, attention_bias=True,
        ),
        "granitemoeshared": transformers.GraniteMoeSharedConfig(
            **small, intermediate_size=32, num_local_experts=4, num_hidden_layers=2,
            num_key_value_heads=2, shared_intermediate_size=48,
        ),
        "seed_oss-qkv-bias": transformers.SeedOssConfig(
            **small, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
            head_dim=16, attention_bias=True,
        ),
        "seed_oss-out-bias": transformers.SeedOssConfig(
            **small, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
            head_dim=16, attention_bias=True, attention_out_bias=True,
        ),
        "seed_oss-out-bias-only": transformers.SeedOssConfig(
            **small, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
            head_dim=16, attention_bias=False, attention_out_bias=True,
        ),
        "gemma3_text": transformers.Gemma3TextConfig(
            **small, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
            head_dim=16,
        ),
        "cohere-qk-norm": transformers.CohereConfig(
            **small, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
            use_qk_norm=True,
        ),
        "stablelm-parallel": transformers.StableLmConfig(
            **small, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
            qk_layernorm=True, use_qkv_bias=True, use_parallel_residual=True,
        ),
        "olmo": transformers.OlmoConfig(
            **small, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
        ),
        "olmo3": transformers.Olmo3Config(
            **small, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
        ),
    }  # fmt: skip


@pytest.mark.parametrize(
    "arch",
    ["olmoe-1b-7b", "olmo2-7b", "olmoe-gqa", "olmo2-gqa", "qwen2_moe-sparse-step"]
    + ["qwen3_moe-head-dim", "deepseek-v2-lite", "deepseek-v3", "deepseek_v2-biases"]
    + ["deepseek_v3-q-bottleneck", "phimoe-biases", "gpt_oss", "glm4_moe-qk-norm"]
    + ["granitemoeshared", "seed_oss-qkv-bias", "seed_oss-out-bias", "seed_oss-out-bias-only"]
    + ["gemma3_text"]
    + ["cohere-qk-norm"]
    + ["stablelm-parallel", "olmo", "olmo3"],
)
def test_counts_equal_the_models_transformers_builds(arch):
    """The count and the largest block (the estimate's unit) equal those of the model that
    transformers builds from the config (on the meta device: no memory for real sizes). OLMoE's
    and OLMo2's q/k norms were left out: 65,536 and 262,144 parameters short; DeepSeek's latent
    attention, shared experts and dense layers were counted as LLaMA's: DeepSeek-V3 38.6 B for
    671.0 B. LayerNorm biases, OLMo's weightless norms, Cohere's one and Gemma's four norms a
    layer, GPT-OSS's sinks and expert biases, Seed-OSS's and GLM-4.5's q/k/v-only biases and
    the q/k norms a config key turns on were left out or counted wrong (0.04-1.3 %)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    published = {
        "olmoe-1b-7b": OLMOE_1B_7B,
        "olmo2-7b": OLMO2_7B,
        "deepseek-v2-lite": DEEPSEEK_V2_LITE,
        "deepseek-v3": DEEPSEEK_V3,
    }
    if arch in published:
        config = transformers.AutoConfig.for_model(**published[arch])
    else:
        config = _small_configs()[arch]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    block = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    shape = est.shape_from_hf_config(json.loads(config.to_json_string()))
    assert est.count_params(shape) == sum(p.numel() for p in model.parameters())
    assert max(est.layer_params(shape), est.layer_params(shape, dense=True)) == block


def test_llama2_7b_is_6_74b_and_tying_removes_one_table():
    n = est.params_from_hf_config(LLAMA2_7B)
    assert round(n / 1e9, 2) == 6.74
    tied = est.params_from_hf_config(LLAMA2_7B | {"tie_word_embeddings": True})
    assert n - tied == 32000 * 4096


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({k: v for k, v in LLAMA2_7B.items() if k != "hidden_size"}, "missing key 'hidden_size'"),
        ({k: v for k, v in LLAMA2_7B.items() if k != "vocab_size"}, "missing key 'vocab_size'"),
        (LLAMA2_7B | {"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        (LLAMA2_7B | {"hidden_size": "4096"}, "hidden_size must be a positive integer"),
        (LLAMA2_7B | {"num_key_value_heads": 5}, "multiple of num_key_value_heads"),
        (
            LLAMA2_7B | {"num_attention_heads": 33, "num_key_value_heads": 33},
            "not a multiple of num_attention_heads",
        ),
        (
            {k: v for k, v in DEEPSEEK_V2_LITE.items() if k != "v_head_dim"},
            "missing key 'v_head_dim'",
        ),
        (
            DEEPSEEK_V2_LITE | {"first_k_dense_replace": -1},
            "first_k_dense_replace must be an integer >= 0",
        ),
    ],
)
def test_bad_hf_configs_name_the_key(cfg, match):
    with pytest.raises(est.EstimateError, match=match):
        est.params_from_hf_config(cfg)


@pytest.mark.parametrize(
    "text, expected",
    [("7e9", 7 * 10**9), ("7B", 7 * 10**9), ("6.7b", 6_700_000_000), ("350M", 350 * 10**6)],
)
def test_parse_count(text, expected):
    assert est.parse_count(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "7Q", "-5", "0", "1e400", "nan"])
def test_parse_count_rejects(text):
    with pytest.raises(est.EstimateError, match="--params"):
        est.parse_count(text)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GB", 80 * 10**9),
        ("64GiB", 64 * 2**30),
        ("512mb", 512 * 10**6),
        ("3.84TB", 3_840 * 10**9),
        ("80G", 80 * 2**30),  # a bare letter is binary, as in the config's sizes
        ("4k", 4096),
    ],
)
def test_parse_bytes(text, expected):
    assert est.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80XB", "GB", "-1GB", "0"])
def test_parse_bytes_rejects(text):
    with pytest.raises(est.EstimateError, match="size"):
        est.parse_bytes(text, what="size")


def test_bad_machine_and_options():
    with pytest.raises(est.EstimateError, match="gpus_per_node"):
        est.Machine(gpus_per_node=0)
    with pytest.raises(est.EstimateError, match="--dtype"):
        est.estimate(10**9, est.Machine(), precision="int3")
    with pytest.raises(est.EstimateError, match="stage"):
        est.zero_model_state_bytes(10**9, 8, 4)
    # an NVMe optimizer pool wrap refuses was estimated as if it ran
    with pytest.raises(est.EstimateError, match="--buffer-count 3: the NVMe optimizer pool"):
        est.estimate(10**9, est.Machine(buffer_count=3))


def test_activation_estimate():
    shape = est.shape_from_hf_config(LLAMA2_7B)
    a = est.activation_bytes(shape, 4096, 1)
    # 32 layers x s b h (34 + 5 a s / h) + fp32 logits
    assert a.without_checkpointing == 32 * 4096 * 4096 * (34 + 5 * 32) + 4 * 4096 * 32000
    assert a.logits < a.with_checkpointing < a.without_checkpointing
    flash = est.activation_bytes(shape, 4096, 1, flash_attention=True)
    assert flash.without_checkpointing < a.without_checkpointing
    two = est.activation_bytes(shape, 4096, 2)
    assert two.without_checkpointing == 2 * a.without_checkpointing
    with pytest.raises(est.EstimateError, match="--seq-len"):
        est.activation_bytes(shape, 0, 1)
    e = est.estimate(
        shape_params := est.count_params(shape),
        est.Machine(),
        shape=shape,
        seq_len=4096,
        activation_checkpointing=True,
    )
    assert shape_params == 6_738_415_616
    assert all(r.device_activations == a.with_checkpointing for r in e.rows)
    assert all(
        r.device_total == r.device_states + r.device_working + a.with_checkpointing for r in e.rows
    )


# --- the command -------------------------------------------------------------------------


def test_cli_text_shows_paper_numbers():
    res = run_cli("--params", "7.5e9", "--gpus", "8", "--nodes", "8")
    assert res.returncode == 0, res.stderr
    for text in ("120.0 GB", "31.4 GB", "16.6 GB", "1.88 GB", "optimizer+params on NVMe"):
        assert text in res.stdout


def test_cli_json_from_hf_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_7B))
    res = run_cli(
        "--hf-config", str(path), "--gpus", "1", "--gpu-mem", "24GB", "--host-mem", "64GB",
        "--nvme", "1TB", "--seq-len", "2048", "--activation-checkpointing", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["params"] == 6_738_415_616
    assert data["machine"]["gpu_mem"] == 24 * 10**9
    rows = {(r["stage"], r["placement"]): r for r in data["rows"]}
    assert len(rows) == 16
    assert rows[0, "none"]["fits"] is False  # 108 GB of model state on a 24 GB card
    assert rows[0, "nvme"]["fits"] is True  # the ZeRO-Infinity answer for one 24 GB card
    assert rows[0, "cpu_optimizer_params"]["fits_host"] is False  # 121 GB > 64 GB of RAM
    assert data["activations"]["with_checkpointing"] < data["activations"]["without_checkpointing"]


def test_hf_config_takes_a_model_directory(tmp_path):
    """A model directory (what finetune --model and from_pretrained take) was 'Is a directory'."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    assert est.load_hf_config(tmp_path) == LLAMA2_7B
    (tmp_path / "empty").mkdir()
    with pytest.raises(est.EstimateError, match="directory without a config.json"):
        est.load_hf_config(tmp_path / "empty")


def test_a_model_type_of_another_layout_is_counted_with_a_note(tmp_path, capsys):
    """Falcon-7B (multi-query attention, a plain 2 h I MLP) was counted as a LLaMA layout, 9.86 B
    parameters for its 6.92 B, with nothing saying the layout was assumed."""
    falcon = {
        "model_type": "falcon", "hidden_size": 4544, "num_hidden_layers": 32,
        "num_attention_heads": 71, "multi_query": True, "vocab_size": 65024,
    }  # fmt: skip
    assert est.unknown_layout(falcon) is not None
    known = (LLAMA2_7B, GPT2_SMALL, QWEN3_30B_A3B, DEEPSEEK_V2_LITE, DEEPSEEK_V3)
    assert all(est.unknown_layout(c) is None for c in known)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(falcon))
    assert main(["estimate", "--hf-config", str(path)]) == 0
    assert "model_type 'falcon' is not a layout the count knows" in capsys.readouterr().out
    assert main(["estimate", "--hf-config", str(path), "--json"]) == 0
    assert "give --params" in json.loads(capsys.readouterr().out)["params_source"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--params", "seven"], "argument --params"),
        (["--params", "7e9", "--gpu-mem", "lots"], "argument --gpu-mem"),
        (["--params", "7e9", "--gpus", "0"], "argument --gpus"),
        (["--hf-config", "/nonexistent/config.json"], "no such file"),
        (["--params", "7e9", "--seq-len", "2048"], "needs the model shape"),
        ([], "one of the arguments --params --hf-config is required"),
    ],
)
def test_cli_bad_inputs(args, message):
    res = run_cli(*args)
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_rejects_non_json_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("hidden_size: 4096\n")
    res = run_cli("--hf-config", str(path))
    assert res.returncode == 2 and "not valid JSON" in res.stderr


# --- NVMe staging pools: wrap's defaults, not the estimator's own ------------------------

MiB = 2**20


def _round4k(n: int) -> int:
    return -(-n // 4096) * 4096


@pytest.mark.parametrize(
    "unit_params, dtype, param_size, opt_size",
    [
        (10**5, "bf16", MiB, MiB),  # below one IO block (1 MiB): one block each
        (10**7, "bf16", _round4k(2 * 10**7), _round4k(4 * 10**7)),  # the unit, rounded up
        (10**7, "fp32", _round4k(4 * 10**7), _round4k(4 * 10**7)),
        (10**9, "bf16", 256 * MiB, 256 * MiB),  # capped at the former fixed default
    ],
)
def test_staging_pools_are_wraps_auto_pools(unit_params, dtype, param_size, opt_size):
    pools = {p.section: p for p in est.staging_pools(est.Machine(), unit_params, dtype)}
    assert (pools["offload_param"].count, pools["offload_param"].size) == (5, param_size)
    assert (pools["offload_optimizer"].count, pools["offload_optimizer"].size) == (8, opt_size)
    assert all(p.auto for p in pools.values())
    e = est.estimate(10 * unit_params, est.Machine(), precision=dtype, unit_params=unit_params)
    nvme = next(r for r in e.rows if r.placement == "nvme")
    assert nvme.host_per_rank == 5 * param_size + 8 * opt_size
    assert e.to_dict()["staging"][0] == {
        "section": "offload_param", "count": 5, "size": param_size, "auto": True,
    }  # fmt: skip


def test_staging_pools_follow_the_config_defaults(monkeypatch):
    """The estimator reads wrap's defaults from the config: change them there and it follows."""
    from offload.config import sections

    monkeypatch.setattr(sections, "DEFAULT_BUFFER_SIZE", 64 * MiB)
    pools = est.staging_pools(est.Machine(), 10**9)
    assert [p.size for p in pools] == [64 * MiB, 64 * MiB]


def test_staging_pool_overrides_apply_to_both_pools():
    m = est.Machine(buffer_count=4, buffer_size=64 * 10**6)
    pools = est.staging_pools(m, 10**5)
    assert [(p.count, p.size, p.auto) for p in pools] == [(4, 64 * 10**6, False)] * 2
    odd = est.staging_pools(est.Machine(buffer_size=16 * 10**6), 10**5)
    assert [p.size for p in odd] == [16_003_072] * 2  # rounded up to 4096 as wrap would
    with pytest.raises(est.EstimateError, match="--buffer-size"):
        est.staging_pools(est.Machine(buffer_size=2 * 2**40), 10**5)


def test_a_rounded_buffer_size_is_said_once_per_pool(caplog):
    """``--buffer-size 100MB`` printed its rounding to 4096 bytes five times for each pool:
    every placement row built the pools again."""
    with caplog.at_level("INFO", logger="offload.config"):
        assert main(["estimate", "--params", "7B", "--buffer-size", "100MB"]) == 0
    said = [r.getMessage() for r in caplog.records]
    for pool in ("offload_param", "offload_optimizer"):
        line = f"{pool}.buffer_size: 100000000, rounded up to 100003840"
        assert sum(line in m for m in said) == 1, said


# --- identical rows are shown once --------------------------------------------------------


def test_one_gpu_collapses_identical_stages():
    e = est.estimate(7_000_000_000, est.Machine(gpu_mem=24 * est.GB))
    collapsed = est.collapse_rows(e.rows)
    labels = [(stages, r.placement) for stages, r in collapsed]
    assert labels == [
        ("0-2", "none"),
        ("0-2", "cpu_optimizer"),
        ("0-3", "cpu_optimizer_params"),
        ("0-3", "nvme"),
        ("3", "none"),  # stage 3 gathers params even without offload: a different working set
        ("3", "cpu_optimizer"),
    ]
    # every row is still there, merged only with rows whose every figure is equal
    assert sorted(r.stage for r in e.rows) == sorted(
        int(s) for stages, _ in collapsed for s in _expand(stages)
    )
    for stages, row in collapsed:
        for s in _expand(stages):
            twin = next(r for r in e.rows if r.stage == int(s) and r.placement == row.placement)
            assert dataclasses.replace(twin, stage=row.stage) == row


def _expand(label: str) -> list[str]:
    if "-" in label:
        lo, hi = label.split("-")
        return [str(s) for s in range(int(lo), int(hi) + 1)]
    return label.split(",")


def test_many_ranks_keep_the_paper_rows_apart():
    e = est.estimate(7_500_000_000, est.Machine(gpus_per_node=8, nodes=8))
    collapsed = est.collapse_rows(e.rows)
    # no offload: four different ZeRO figures, four rows
    assert [s for s, r in collapsed if r.placement == "none"] == ["0", "1", "2", "3"]
    # offloaded: stage 1 keeps the whole gradient on the device between micro-steps (reduced
    # once per step), stage 2 streams it off unit by unit, stage 3 shards the params too
    assert [s for s, r in collapsed if r.placement == "cpu_optimizer"] == ["0", "1", "2", "3"]
    assert len(collapsed) == 16  # every stage differs from the others in every placement


def test_stage_labels():
    assert est._stage_label([0, 1, 2]) == "0-2"
    assert est._stage_label([3]) == "3"
    assert est._stage_label([0, 3]) == "0,3"


def test_cli_one_gpu_prints_six_rows_and_wraps_pools():
    res = run_cli("--params", "7B", "--gpus", "1")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----")) + 1
    body = lines[start : lines.index("", start)]
    assert len(body) == 6, body
    assert body[0].split()[0] == "0-2" and "share a row" in res.stdout
    assert "offload_param 5 x 268 MB + offload_optimizer 8 x 268 MB = 3.49 GB" in res.stdout
    json_rows = json.loads(run_cli("--params", "7B", "--gpus", "1", "--json").stdout)["rows"]
    assert len(json_rows) == 16  # the JSON keeps one row per stage for scripts


def test_host_memory_budget_is_the_readme_sum():
    # README "Memory: what host RAM holds": buffers + 4 x the largest unit in fp32 + 48 MiB
    b = est.host_memory_budget(168 * 2**20, 4_923_520)
    assert (b.buffers, b.units, b.fixed) == (168 * 2**20, 4 * 4 * 4_923_520, 48 * 2**20)
    assert b.total == b.buffers + b.units + b.fixed
    for bad in (-1, 1.5, True):
        with pytest.raises(est.EstimateError, match="largest_unit_params"):
            est.host_memory_budget(0, bad)


def test_fp32_on_one_rank_keeps_one_copy_of_the_weights_on_nvme():
    """The params are the master there: m, v and grad (12), the second extents of m and v (8)
    and of the params (4), and the params (4); bf16 keeps its own fp32 master."""
    psi = 10**9
    one = est.Machine(gpus_per_node=1)
    row = est.placement_row(psi, 0, "nvme", one, precision="fp32", unit_params=psi // 32)
    assert row.nvme_per_rank == 28 * psi
    bf16 = est.placement_row(psi, 0, "nvme", one, precision="bf16", unit_params=psi // 32)
    assert bf16.nvme_per_rank == (16 + 12 + 2) * psi


def test_a_unit_larger_than_the_model_is_refused():
    """``--unit-params 1e12 --params 7B`` was accepted and reported 6 TB of device memory."""
    with pytest.raises(est.EstimateError, match=r"--unit-params 1000000000000: .*allowed: 1 to"):
        est.estimate(7_000_000_000, est.Machine(), unit_params=10**12)
    assert est.estimate(7_000_000_000, est.Machine(), unit_params=7_000_000_000)


@pytest.mark.parametrize("tied", [False, True])
def test_the_largest_unit_is_the_one_wrap_makes_of_the_config(tmp_path, tied):
    """With --hf-config the largest unit is wrap's: every block a unit, and the root holding
    the embeddings, the untied head and the final norm together (the head was left out: a
    model with a large vocabulary got pools half the size of wrap's 'auto' ones)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import offload  # noqa: PLC0415
    from offload.api.wrap import engine_of  # noqa: PLC0415

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=2000, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = est.shape_from_hf_config(json.loads(config.to_json_string()))
    wrapped, opt = offload.wrap(model, {"dtype": "fp32"})
    try:
        units = engine_of(wrapped).plan.units
        largest = max(sum(p.numel() for p in u.params) for u in units)
    finally:
        opt.close()
    got = est.estimate(est.count_params(shape), est.Machine(), shape=shape).unit_params
    assert got == largest


@pytest.mark.parametrize(
    "dense_by",
    [
        {"first_k_dense_replace": 27},  # every layer of DeepSeek-V2-Lite dense
        {"first_k_dense_replace": 0},  # none
        {"first_k_dense_replace": 1},  # both kinds
    ],
    ids=["all-dense", "no-dense", "both"],
)
def test_the_largest_block_is_one_the_model_has(dense_by):
    """An MoE config whose layers are all dense sized its largest unit as an expert block that
    no layer is (larger than the whole model: 58.8M params, a 103.9M unit), and the 'auto'
    pools and device rows with it."""
    shape = est.shape_from_hf_config(DEEPSEEK_V2_LITE | dense_by)
    e = est.estimate(est.count_params(shape), est.Machine(), shape=shape)
    dense, expert = est.layer_params(shape, dense=True), est.layer_params(shape)
    present = {27: [dense], 0: [expert], 1: [dense, expert]}[dense_by["first_k_dense_replace"]]
    assert e.unit_params == max(*present, est.embedding_params(shape))
    assert e.unit_params <= e.params
