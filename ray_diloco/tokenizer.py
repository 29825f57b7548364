"""Tokenizer loading: the bundled GPT-2 BPE by default, any Hugging Face tokenizer by name or dir.

Documents are separated by the tokenizer's EOS token when packed into training windows, so a
tokenizer without one is refused here rather than producing windows with no document boundaries.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

GPT2_EOS = "<|endoftext|>"


def bundled_tokenizer_dir() -> Path:
    """The directory holding the bundled GPT-2 `vocab.json` and `merges.txt` (OpenAI, MIT)."""
    return Path(__file__).resolve().parent / "assets" / "gpt2-tokenizer"


def load_tokenizer(name_or_path: str | None = None) -> PreTrainedTokenizerFast:
    """Load a fast tokenizer.

    None: the bundled GPT-2 byte-level BPE (50,257 tokens; `<|endoftext|>` = 50256 is EOS, BOS and PAD), built
    without any network access. A string: `AutoTokenizer.from_pretrained` (a local directory works
    offline; a hub name needs the network or a warm Hugging Face cache).
    """
    if name_or_path is None:
        tokenizer = _bundled_gpt2()
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, use_fast=True)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"could not load tokenizer {name_or_path!r}: give a Hugging Face tokenizer name "
                "(needs the network or a cached copy), a local directory holding tokenizer.json "
                "(from `save_pretrained`), or leave data.tokenizer unset for the bundled GPT-2 BPE"
            ) from err
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"tokenizer {name_or_path!r} has no eos_token: documents are separated by EOS when "
            "packed into windows. Set eos_token in its tokenizer_config.json or pick another tokenizer"
        )
    return tokenizer


def _bundled_gpt2() -> PreTrainedTokenizerFast:
    from tokenizers import ByteLevelBPETokenizer

    folder = bundled_tokenizer_dir()
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        raise FileNotFoundError(
            f"bundled GPT-2 tokenizer files missing in {folder}: reinstall ray-diloco "
            "(they ship as package data) or set data.tokenizer to a tokenizer name or directory"
        )
    # Built from the `tokenizers` object on purpose: in transformers 5,
    # GPT2TokenizerFast(vocab_file=..., merges_file=...) loads without error but encodes every
    # text to an EMPTY id list. clean_up_tokenization_spaces=False keeps decode(encode(t)) == t.
    # GPT-2 has one special token, <|endoftext|>, for BOS and EOS alike; declared as PAD too so that
    # batched encoding and `generate` of an exported model have one (the model config says the same).
    backend = ByteLevelBPETokenizer(str(vocab), str(merges))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=GPT2_EOS, bos_token=GPT2_EOS, pad_token=GPT2_EOS,
        clean_up_tokenization_spaces=False,
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, in one batch call, without special tokens (EOS is added by packing).

    Raises if a text with visible characters yields no tokens: that means a broken tokenizer
    (e.g. the transformers-5 GPT2TokenizerFast pitfall), which would otherwise train on nothing.
    """
    if not texts:
        return []
    # truncation=False: some tokenizer.json files carry a truncation setting that would silently
    # cut long documents; verbose=False: long documents are expected, not a warning.
    ids = tokenizer(list(texts), add_special_tokens=False, truncation=False, verbose=False)[
        "input_ids"
    ]
    for text, doc_ids in zip(texts, ids):
        if not doc_ids and text.strip():
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} returned no tokens for a non-empty text "
                f"({text[:40]!r}...): it is misconfigured. Use load_tokenizer() (for GPT-2 do not "
                "build GPT2TokenizerFast from vocab_file/merges_file: it encodes to nothing)"
            )
    return [list(doc_ids) for doc_ids in ids]
