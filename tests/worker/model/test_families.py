"""Families: chosen from config.json, refused when unknown; their state kinds in one pool; a state of one
family refused by another."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from metrale.worker.model.config import ModelConfigError
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.families.qwen3_5_config import Qwen35Config
from metrale.worker.model.families.registry import family_for
from metrale.worker.model.interface import ForwardChunk
from metrale.worker.model.loader import load_model
from metrale.worker.model.state import StateMismatchError, StatePool, state_sizes
from tests.worker.model.qwen_reference import make_hf_qwen_checkpoint

QWEN35_08B_TEXT: dict[str, Any] = {  # the release's text_config, the fields that size it
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "full_attention_interval": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "dtype": "bfloat16",
    "eos_token_id": 248044,
}
QWEN35_08B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": QWEN35_08B_TEXT,
    "tie_word_embeddings": True,
}


def test_the_family_is_chosen_by_architectures_then_model_type() -> None:
    assert family_for(QWEN35_08B).name == "qwen3_5"
    assert family_for({"model_type": "qwen3_5_text"}).name == "qwen3_5"
    assert family_for({"architectures": ["Qwen3_5MoeForConditionalGeneration"]}).name == "qwen3_5_moe"
    assert family_for({"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text"}}).name == (
        "qwen3_5_moe"
    )
    assert family_for({"architectures": ["KimiLinearForCausalLM"], "model_type": "x"}).name == "kimi_linear"
    assert family_for({"model_type": "kimi_linear"}).name == "kimi_linear"


def test_an_unknown_family_is_refused_in_one_line_listing_those_served() -> None:
    with pytest.raises(ModelConfigError) as caught:
        family_for({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    message = str(caught.value)
    assert "\n" not in message
    assert "model_type 'llama' is not supported" in message
    assert "kimi_linear (KimiLinearForCausalLM)" in message
    assert "qwen3_5 (Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM)" in message


def test_qwen3_5_config_reads_the_nested_text_config() -> None:
    config = Qwen35Config.from_hf_dict(QWEN35_08B)
    assert config.attention_layers == (3, 7, 11, 15, 19, 23)
    assert len(config.linear_layers) == 18
    assert config.rotary_dim == 64 and config.rope_theta == 1e7
    assert config.tie_word_embeddings and config.dtype == "bfloat16" and config.eos_token_ids == (248044,)


@pytest.mark.parametrize(
    ("field", "value"),
    [("attention_bias", True), ("hidden_act", "gelu"), ("attn_output_gate", False), ("mamba_ssm_dtype", "bfloat16")],
)
def test_qwen3_5_config_refuses_what_is_not_implemented_naming_the_field(field: str, value: object) -> None:
    data = {**QWEN35_08B, "text_config": {**QWEN35_08B_TEXT, field: value}}
    with pytest.raises(ModelConfigError, match=rf"text_config\.{field}="):
        Qwen35Config.from_hf_dict(data)


def test_state_sizes_of_the_qwen3_5_08b_release() -> None:
    sizes = state_sizes(Qwen35Config.from_hf_dict(QWEN35_08B), torch.bfloat16)
    conv_channels = 2 * 16 * 128 + 16 * 128
    assert sizes.slot_bytes == 18 * (16 * 128 * 128 + conv_channels * 3) * 4  # fp32 recurrent + conv
    assert sizes.token_bytes == 6 * 2 * 2 * 256 * 2  # keys and values of 2 kv heads, bf16


def test_a_gqa_pool_holds_keys_and_values_per_block() -> None:
    config = Qwen35Config.from_hf_dict(QWEN35_08B)
    with torch.device("meta"):
        pool = StatePool(config, num_slots=2, num_blocks=3, block_size=16, latent_dtype=torch.bfloat16)
    assert set(pool.kv) == set(config.attention_layers)
    assert pool.kv[3].shape == (3, 16, 2, 2, 256) and pool.kv[3].dtype is torch.bfloat16
    assert pool.recurrent[0].shape == (2, 16, 128, 128) and pool.recurrent[0].dtype is torch.float32
    assert pool.conv[0].shape == (2, 2 * 16 * 128 + 16 * 128, 3)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen")
    make_hf_qwen_checkpoint("gdn16k32v-gqa4q2kv-untied", directory, seed=1)
    return directory


def test_an_exported_qwen_state_continues_exactly_in_other_slots_and_blocks(qwen_dir: Path) -> None:
    executor = ModelExecutor(load_model(qwen_dir, dtype=torch.float32), num_slots=2, num_blocks=8, block_size=16)
    prompt, follow = list(range(3, 40)), [5, 6]
    executor.forward([ForwardChunk(0, [0, 1, 2], 0, prompt)])
    state = executor.export_state(0, [0, 1, 2], len(prompt))
    assert state["gqa.0.kv"].shape == (len(prompt), 2, 2, 16)
    expected = executor.forward([ForwardChunk(0, [0, 1, 2], len(prompt), follow)])
    executor.import_state(state, 1, [5, 3, 7])
    got = executor.forward([ForwardChunk(1, [5, 3, 7], len(prompt), follow)])
    assert torch.equal(got, expected)


def test_a_state_of_another_family_is_refused(qwen_dir: Path, tiny_model_dir: Path) -> None:
    kimi = ModelExecutor(load_model(tiny_model_dir, dtype=torch.float32), num_slots=1, num_blocks=4, block_size=16)
    qwen = ModelExecutor(load_model(qwen_dir, dtype=torch.float32), num_slots=1, num_blocks=4, block_size=16)
    kimi.forward([ForwardChunk(0, [0], 0, [1, 2, 3])])
    with pytest.raises(StateMismatchError, match=r"kda/mla layers, written by another model family.*qwen3_5"):
        qwen.import_state(kimi.export_state(0, [0], 3), 0, [0])


def test_compiled_decode_is_refused_for_a_family_without_it(qwen_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"--compile.*kimi_linear models only, not qwen3_5"):
        ModelExecutor(load_model(qwen_dir, dtype=torch.float32), num_slots=1, num_blocks=4, decode_buckets=(1,))
