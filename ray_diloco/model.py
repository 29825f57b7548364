"""The model: a randomly initialised, seeded `transformers` Llama (nothing is downloaded)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ray_diloco import uris
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


def build_model(model_cfg: ModelConfig, vocab_size: int, max_seq_len: int, seed: int,
                init_from: str | None = None) -> LlamaForCausalLM:
    """A fresh model whose weights depend only on (config, seed): every region builds the same one.
    With `init_from`, the weights come from that saved model directory (a warm start)."""
    config = llama_config(model_cfg, vocab_size, max_seq_len)
    if init_from:
        return load_saved_model(init_from, config)
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


def load_parameters(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy `state` (named as `parameter_state` names it) into the model's parameters.

    The names must be exactly the model's `named_parameters` (a tied embedding once, so no
    `lm_head.weight` when tied) and the shapes must match: `load_state_dict(strict=False)` would skip a
    misnamed tensor silently and leave the model's own weights in its place. Nothing is copied on error.
    """
    params = dict(model.named_parameters())
    missing, unexpected = sorted(params.keys() - state.keys()), sorted(state.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"state does not match the model's parameters: missing {_few(missing)}, unexpected "
                         f"{_few(unexpected)}; give parameter_state() of a model built from the same model config "
                         "(tie_embeddings decides whether lm_head.weight is listed)")
    wrong = [f"{name} {tuple(state[name].shape)} (model {tuple(p.shape)})"
             for name, p in params.items() if state[name].shape != p.shape]
    if wrong:
        raise ValueError(f"state has the wrong shape for {_few(wrong)}: it comes from a different model config")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])


def _few(names: list[str], shown: int = 5) -> str:
    """A short list for an error message: the first few names and how many more."""
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def special_token_ids(tokenizer) -> dict[str, int | None]:
    """EOS, BOS and PAD ids as the tokenizer defines them, for the model and generation configs.

    PAD falls back to EOS when the tokenizer has none (GPT-2, Llama), so `generate` has a pad id.
    """
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return {"eos_token_id": eos, "bos_token_id": tokenizer.bos_token_id, "pad_token_id": pad}


def load_saved_model(directory: str, expected: LlamaConfig) -> LlamaForCausalLM:
    """A model saved with `save_pretrained` (a local directory or a URI: downloaded, loaded, the download
    removed); its shape must match the configured one."""
    if not uris.is_file(uris.join(directory, "config.json")):
        raise FileNotFoundError(f"--init-from {directory}: no config.json there; give a run's model/ directory "
                                "or the output of `ray-diloco export`")
    check_saved_shape(directory, expected)
    with uris.local_copy(directory) as local:
        model = LlamaForCausalLM.from_pretrained(local, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return model


def check_saved_shape(directory: str, expected: LlamaConfig) -> None:
    """The saved model's config.json must describe the configured shape (read without loading weights, so the
    driver checks it before Ray starts; for a URI, config.json alone is fetched)."""
    saved_config = LlamaConfig.from_dict(json.loads(uris.read_bytes(uris.join(directory, "config.json"))))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings"):
        saved, wanted = getattr(saved_config, key), getattr(expected, key)
        if saved != wanted:
            raise ValueError(f"--init-from {directory}: saved {key}={saved} but the config asks {wanted}; "
                             "use the same model section as the run that saved it")


def save_model(model: LlamaForCausalLM, state: dict[str, torch.Tensor], directory: Path, tokenizer) -> None:
    """Write θ as a Hugging Face model directory with its tokenizer, so it loads with the Auto* classes.

    The special-token ids come from the tokenizer: LlamaConfig's defaults (BOS 1, EOS 2) are Llama's own
    vocabulary, and with GPT-2's they would make `generate` stop on '#' (id 2).
    """
    load_parameters(model, state)
    for key, value in special_token_ids(tokenizer).items():
        setattr(model.config, key, value)
        setattr(model.generation_config, key, value)
    # One small file: transformers' "Writing model shards" bar would only interleave with the driver's lines.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
