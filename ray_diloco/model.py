"""The model: a randomly initialised, seeded `transformers` Llama (nothing is downloaded)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ray_diloco.config import ModelConfig


def padded_vocab_size(model_cfg: ModelConfig, tokenizer_vocab: int) -> int:
    """The model's vocabulary: explicit, or the tokenizer's rounded up to 64 (faster matmuls)."""
    if model_cfg.vocab_size is not None:
        if model_cfg.vocab_size < tokenizer_vocab:
            raise ValueError(
                f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} "
                "tokens; raise it or leave it null"
            )
        return model_cfg.vocab_size
    return (tokenizer_vocab + 63) // 64 * 64


def llama_config(model_cfg: ModelConfig, vocab_size: int, max_seq_len: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        num_key_value_heads=model_cfg.num_kv_heads or model_cfg.num_heads,
        max_position_embeddings=max_seq_len,
        rope_theta=model_cfg.rope_theta,
        tie_word_embeddings=model_cfg.tie_embeddings,
        use_cache=False,
    )


def build_model(model_cfg: ModelConfig, vocab_size: int, max_seq_len: int, seed: int) -> LlamaForCausalLM:
    """A fresh model whose weights depend only on (config, seed): every region builds the same one."""
    config = llama_config(model_cfg, vocab_size, max_seq_len)
    # SDPA attention works on CPU and GPU alike; eager would materialise the full attention matrix.
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Unique trainable parameters (a tied embedding is counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def parameter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name as fp32 CPU copies; tied weights appear once (named_parameters dedups)."""
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}
