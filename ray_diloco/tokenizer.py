"""Tokenizer loading: the bundled GPT-2 BPE by default, any Hugging Face tokenizer by name or dir.

Documents are separated by the tokenizer's EOS token when packed into training windows, so a
tokenizer without one is refused here rather than producing windows with no document boundaries.

Packing needs only a `DocumentEncoder` (the `tokenizers` backend and the EOS id). Ray Data's packing tasks and
the region's stream actor load that alone: importing transformers (and the torch it imports) costs ~7 s of CPU in
every such process, paid again each time a run starts its workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

GPT2_EOS = "<|endoftext|>"


def bundled_tokenizer_dir() -> Path:
    """The directory holding the bundled GPT-2 `vocab.json` and `merges.txt` (OpenAI, MIT)."""
    return Path(__file__).resolve().parent / "assets" / "gpt2-tokenizer"


@dataclass(frozen=True)
class DocumentEncoder:
    """What packing needs of a tokenizer: its `tokenizers` backend (no truncation, no padding) and EOS id."""

    backend: "Tokenizer"
    eos_token_id: int

    @classmethod
    def of(cls, tokenizer: "PreTrainedTokenizerFast") -> "DocumentEncoder":
        """The encoder of a loaded transformers tokenizer; its backend is copied, never reconfigured."""
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        # Some tokenizer.json files carry a truncation setting that would silently cut long documents.
        backend.no_truncation()
        backend.no_padding()
        return cls(backend, tokenizer.eos_token_id)


def load_document_encoder(name_or_path: str | None = None) -> DocumentEncoder:
    """`load_tokenizer`'s tokenizer as a `DocumentEncoder`; the bundled one without importing transformers."""
    if name_or_path is None:
        backend = _bundled_gpt2_backend()
        return DocumentEncoder(backend, backend.token_to_id(GPT2_EOS))
    return DocumentEncoder.of(load_tokenizer(name_or_path))


def load_tokenizer(name_or_path: str | None = None) -> "PreTrainedTokenizerFast":
    """Load a fast tokenizer.

    None: the bundled GPT-2 byte-level BPE (50,257 tokens; `<|endoftext|>` = 50256 is EOS, BOS and PAD), built
    without any network access. A string: `AutoTokenizer.from_pretrained` (a local directory works
    offline; a hub name needs the network or a warm Hugging Face cache).
    """
    from transformers import AutoTokenizer

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


def _bundled_gpt2_backend() -> "Tokenizer":
    from tokenizers import ByteLevelBPETokenizer

    folder = bundled_tokenizer_dir()
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        raise FileNotFoundError(
            f"bundled GPT-2 tokenizer files missing in {folder}: reinstall ray-diloco "
            "(they ship as package data) or set data.tokenizer to a tokenizer name or directory"
        )
    backend = ByteLevelBPETokenizer(str(vocab), str(merges))
    # The vocabulary holds <|endoftext|> as an ordinary entry; as a special token it is never split or merged.
    backend.add_special_tokens([GPT2_EOS])
    return backend


def _bundled_gpt2() -> "PreTrainedTokenizerFast":
    from transformers import PreTrainedTokenizerFast

    # Built from the `tokenizers` object on purpose: in transformers 5,
    # GPT2TokenizerFast(vocab_file=..., merges_file=...) loads without error but encodes every
    # text to an EMPTY id list. clean_up_tokenization_spaces=False keeps decode(encode(t)) == t.
    # GPT-2 has one special token, <|endoftext|>, for BOS and EOS alike; declared as PAD too so that
    # batched encoding and `generate` of an exported model have one (the model config says the same).
    return PreTrainedTokenizerFast(
        tokenizer_object=_bundled_gpt2_backend(), eos_token=GPT2_EOS, bos_token=GPT2_EOS, pad_token=GPT2_EOS,
        clean_up_tokenization_spaces=False,
    )


def encode_documents(encoder: DocumentEncoder, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, in one batch call, without special tokens (EOS is added by packing).

    Raises if a text with visible characters yields no tokens: that means a broken tokenizer
    (e.g. the transformers-5 GPT2TokenizerFast pitfall), which would otherwise train on nothing.
    """
    if not texts:
        return []
    ids = [encoding.ids for encoding in encoder.backend.encode_batch(list(texts), add_special_tokens=False)]
    for text, doc_ids in zip(texts, ids):
        if not doc_ids and text.strip():
            raise ValueError(
                f"tokenizer {type(encoder.backend).__name__} returned no tokens for a non-empty text "
                f"({text[:40]!r}...): it is misconfigured. Use load_tokenizer() (for GPT-2 do not "
                "build GPT2TokenizerFast from vocab_file/merges_file: it encodes to nothing)"
            )
    return [list(doc_ids) for doc_ids in ids]
