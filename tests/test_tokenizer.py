"""Tokenizer: the bundled GPT-2 BPE encodes real C4 text losslessly, with EOS = BOS = PAD = 50256; tokenizers
loaded from a directory agree with it; the packing encoder (no transformers) gives the transformers tokenizer's
ids; broken tokenizers (no ids, no EOS) are refused loudly."""

import gzip
import json
import subprocess
import sys

import pytest
from transformers import PreTrainedTokenizerFast

from ray_diloco.data.files import embedded_eval_path
from ray_diloco.tokenizer import DocumentEncoder, encode_documents, load_document_encoder, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def encoder():
    return load_document_encoder(None)


@pytest.fixture(scope="module")
def c4_texts():
    with gzip.open(embedded_eval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f][:6]


def test_default_tokenizer_is_gpt2(tok):
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.eos_token == "<|endoftext|>"
    assert tok.eos_token_id == 50256
    # GPT-2's one special token is BOS and (here) PAD too: an exported model's config takes these ids.
    assert tok.bos_token_id == tok.pad_token_id == 50256
    assert len(tok) == 50257
    # Declaring BOS adds nothing when encoding: the byte-level backend has no post-processor.
    assert tok("hello world")["input_ids"] == [31373, 995]
    # Reference GPT-2 ids: proves the merges are applied (byte-level alone would give 11 ids).
    assert encode_documents(DocumentEncoder.of(tok), ["hello world"]) == [[31373, 995]]


def test_c4_text_round_trips(tok, encoder, c4_texts):
    ids = encode_documents(encoder, c4_texts)
    assert len(ids) == len(c4_texts)
    for text, doc_ids in zip(c4_texts, ids):
        assert doc_ids, "no tokens for a C4 document"
        assert tok.eos_token_id not in doc_ids  # no special tokens added
        assert tok.decode(doc_ids) == text
        # BPE compresses English: far fewer tokens than characters.
        assert len(doc_ids) < 0.5 * len(text)


def test_the_packing_encoder_gives_the_transformers_tokenizers_ids(tok, encoder, c4_texts):
    texts = [*c4_texts, "a literal <|endoftext|> in a document", "  leading spaces\n\ttabs"]
    batched = encode_documents(encoder, texts)
    assert batched == [tok.encode(t, add_special_tokens=False) for t in texts]
    assert encoder.eos_token_id == tok.eos_token_id == 50256
    assert batched == encode_documents(DocumentEncoder.of(tok), texts)


def test_the_packing_encoder_loads_without_transformers_or_torch():
    probe = ("import sys; from ray_diloco.data.pipeline import _encoder; _encoder(None); "
             "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_a_tokenizers_truncation_setting_cuts_nothing(tok, c4_texts):
    truncating = load_tokenizer(None)
    truncating.backend_tokenizer.enable_truncation(max_length=8)
    ids = encode_documents(DocumentEncoder.of(truncating), c4_texts)
    assert ids == [tok.encode(t, add_special_tokens=False) for t in c4_texts] and max(map(len, ids)) > 8
    assert truncating.backend_tokenizer.truncation is not None  # the loaded tokenizer is left as it was


def test_local_directory_loads_the_same_tokenizer(tok, encoder, c4_texts, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert (loaded.eos_token_id, loaded.bos_token_id, loaded.pad_token_id) == (50256, 50256, 50256)
    assert encode_documents(load_document_encoder(str(tmp_path)), c4_texts) == encode_documents(encoder, c4_texts)


def test_tokenizer_without_eos_is_refused(tmp_path):
    bundled = load_tokenizer(None)
    no_eos = PreTrainedTokenizerFast(tokenizer_object=bundled.backend_tokenizer)
    assert no_eos.eos_token_id is None
    no_eos.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no eos_token"):
        load_tokenizer(str(tmp_path))


def test_missing_tokenizer_dir_names_it(tmp_path):
    with pytest.raises(ValueError, match="could not load tokenizer"):
        load_tokenizer(str(tmp_path))  # exists, but holds no tokenizer files


def test_empty_ids_for_real_text_raise():
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    # Mimics the transformers-5 GPT2TokenizerFast(vocab_file=...) pitfall: empty ids for every text.
    silent = DocumentEncoder(Tokenizer(BPE(vocab={}, merges=[])), eos_token_id=0)
    assert silent.backend.encode("some real text").ids == []
    with pytest.raises(ValueError, match="returned no tokens"):
        encode_documents(silent, ["some real text"])
    # Whitespace-only or no texts are not an error: there may legitimately be nothing to encode.
    assert encode_documents(silent, ["   "]) == [[]]
    assert encode_documents(silent, []) == []
