"""The llama.cpp comparison's own logic, without llama.cpp: the Qwen3.5 bench models' shape and size
against the Kimi bench model's, the folder's tokenizer as the GGUF converter reads it, and the helpers
that read llama.cpp's output and the command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bench.gguf_convert import split_arguments
from bench.llamacpp import prompt_token_ids
from bench.models import QWEN3_5_VOCAB_SIZE, add_end_of_text, bench_config, parameter_counts
from bench.vs_llamacpp import Run, parse_args, side_by_side, token_bytes
from metrale.worker.model.families.qwen3_5_config import Qwen35Config, Qwen35MoeConfig
from metrale.worker.model.families.qwen3_5_tiny import write_tokenizer


def test_the_qwen3_5_bench_model_is_the_kimi_bench_models_size_in_the_releases_shape() -> None:
    config = bench_config("qwen3_5-medium")
    assert isinstance(config, Qwen35Config) and not isinstance(config, Qwen35MoeConfig)
    assert (config.hidden_size, config.num_hidden_layers) == (512, 8)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",
    )
    assert config.linear_num_value_heads == 2 * config.linear_num_key_heads
    assert config.num_attention_heads > config.num_key_value_heads  # GQA
    kimi_total, kimi_active = parameter_counts("medium-4-heads")
    total, active = parameter_counts("qwen3_5-medium")
    assert total == active  # dense
    assert active == pytest.approx(kimi_active, rel=0.05)
    moe_total, moe_active = parameter_counts("qwen3_5_moe-medium")
    assert isinstance(bench_config("qwen3_5_moe-medium"), Qwen35MoeConfig)
    assert moe_total == pytest.approx(kimi_total, rel=0.05)
    assert moe_active == pytest.approx(kimi_active, rel=0.1)


def test_every_token_id_the_converter_sees_has_an_embedding_row(tmp_path: Path) -> None:
    # llama.cpp's converter reads the folder through transformers' Qwen3_5Tokenizer, which adds
    # <|endoftext|> when the tokenizer lacks it; every id it then knows must be below vocab_size.
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    assert add_end_of_text(tmp_path) == QWEN3_5_VOCAB_SIZE
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5"}')
    vocab = AutoTokenizer.from_pretrained(tmp_path).get_vocab()
    assert max(vocab.values()) == QWEN3_5_VOCAB_SIZE - 1


def test_token_bytes_are_what_the_tokenizer_decodes_and_special_tokens_print_nothing(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    add_end_of_text(tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    pieces = token_bytes(tokenizer)
    text = "héllo wörld\n\t<think> 12 — ok"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert b"".join(pieces[i] or b"" for i in ids) == text.encode()
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    assert pieces[vocab["<|im_end|>"]] is None
    assert pieces[vocab["<|endoftext|>"]] is None
    assert pieces[vocab["<think>"]] == b"<think>"  # added, not special: printed


def test_prompt_ids_are_read_from_llama_completions_verbose_prompt() -> None:
    log = (
        "0.00.293.756 I llama_completion: prompt: 'The fox'\n"
        "0.00.293.758 I llama_completion: number of tokens in prompt = 4\n"
        "0.00.293.762 I    512 -> '<|bos|>'\n"
        "0.00.293.763 I    324 -> 'The'\n"
        "0.00.293.764 I    198 -> '\n"
        "'\n"
        "0.00.293.764 I     80 -> ' fox'\n"
        "0.00.293.798 I sampler chain: logits -> ?penalties -> top-k\n"
        "0.00.293.799 I      7 -> 'not a prompt token'\n"
    )
    assert prompt_token_ids(log) == [512, 324, 198, 80]


def test_the_converter_wrapper_takes_its_own_option_out_of_the_converters() -> None:
    argv = ["tree", "model", "--unknown-pre-tokenizer", "qwen35", "--no-mtp", "--outtype", "f32"]
    assert split_arguments(argv) == ("tree", "model", "qwen35", ["--no-mtp", "--outtype", "f32"])
    assert split_arguments(["tree", "model", "--outtype", "bf16"]) == ("tree", "model", "gpt-2", ["--outtype", "bf16"])


def test_several_models_run_together_and_a_repeated_one_is_refused() -> None:
    assert parse_args([]).model == ["medium-4-heads"]
    assert parse_args(["--model", "qwen3_5-medium", "medium-4-heads"]).model == ["qwen3_5-medium", "medium-4-heads"]
    with pytest.raises(SystemExit):
        parse_args(["--model", "qwen3_5-medium", "qwen3_5-medium"])
    with pytest.raises(SystemExit):
        parse_args(["--model", "qwen3_6-medium"])


def test_compile_is_refused_for_a_model_met_does_not_compile() -> None:
    assert parse_args(["--compile", "--model", "medium-4-heads"]).compile
    with pytest.raises(SystemExit):
        parse_args(["--compile", "--model", "medium-4-heads", "qwen3_5-medium"])


def test_side_by_side_ratios_are_per_model_against_llama_cpp_and_against_the_first_model() -> None:
    runs = [
        Run("met", "a", "fp32", 100.0, 200.0, 600.0),
        Run("met", "a", "fp32", 120.0, 150.0, 500.0),  # a slower repeat: not the best
        Run("llama.cpp", "a", "fp32", 80.0, 250.0, 500.0),
        Run("met", "b", "fp32", 50.0, 300.0, 900.0),
        Run("llama.cpp", "b", "fp32", 100.0, 300.0, 450.0),
    ]
    rows = {
        workload: (vs_llama, vs_first)
        for workload, _, vs_llama, vs_first in side_by_side(runs, ["a", "b"], ["fp32"], 64, 128, 128)
    }
    batch, decode, ttft = rows.values()
    assert batch == (pytest.approx([1.2, 2.0]), pytest.approx([1.0, 1.5]))
    assert decode == (pytest.approx([0.8, 1.0]), pytest.approx([1.0, 1.5]))
    assert ttft == (pytest.approx([1.25, 0.5]), pytest.approx([1.0, 0.5]))
