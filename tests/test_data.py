"""Data: the embedded C4 shards, file listing and the region split (disjoint, complete,
seeded), packing (pure and through real Ray Data on the embedded shards: every token ends up in a
window or in the counted tail), skipped-record counting for broken lines, and the held-out set
with its loss / perplexity on a tiny random Llama."""

import gzip
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from ray_diloco.config import DataConfig
from ray_diloco.data import (
    DataCounters,
    build_region_dataset,
    build_region_datasets,
    embedded_eval_path,
    hf_stream_region_dataset,
    embedded_train_dir,
    evaluate_loss,
    list_data_files,
    load_eval_windows,
    pack_documents,
    parse_c4_lines,
    split_files_across_regions,
)
from ray_diloco.tokenizer import load_tokenizer


def _read_lines(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().split("\n")


def _texts(paths):
    return [json.loads(line)["text"] for p in paths for line in _read_lines(p) if line]


def _direct_tokens(tok, texts):
    """One tokenizer call per document, EOS after each: the reference the pipeline must match."""
    out = []
    for text in texts:
        out += tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return out


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def ray_local():
    started = not ray.is_initialized()
    if started:
        # address="local": a cluster of our own, even while another process's cluster runs here
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    progress, ctx.enable_progress_bars = ctx.enable_progress_bars, False
    yield
    ctx.enable_progress_bars = progress
    if started:
        ray.shutdown()


def _consume(ds, batch_size):
    batches = [b["input_ids"] for b in ds.iter_torch_batches(batch_size=batch_size)]
    return batches


# --- embedded sample and files ------------------------------------------------------------


def test_embedded_shards_layout_and_held_out_is_disjoint():
    train = list_data_files(embedded_train_dir())
    assert [Path(f).name for f in train] == [f"c4-train.{k:05d}-of-00008.json.gz" for k in range(8)]
    per_shard = [len(_texts([f])) for f in train]
    assert per_shard == [90] * 8
    held_out = _texts([embedded_eval_path()])
    assert len(held_out) == 80
    assert not set(held_out) & set(_texts(train))


def test_list_data_files_dir_glob_and_errors(tmp_path):
    for name in ["b.jsonl", "a.json", "c.json.gz", "notes.txt"]:
        (tmp_path / name).write_text("{}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.jsonl").write_text("{}\n")
    assert list_data_files(str(tmp_path)) == [str(tmp_path / n) for n in ["a.json", "b.jsonl", "c.json.gz"]]
    assert list_data_files(str(tmp_path / "[ab].*")) == [str(tmp_path / n) for n in ["a.json", "b.jsonl"]]
    assert list_data_files(str(tmp_path / "sub/*.jsonl")) == [str(tmp_path / "sub" / "d.jsonl")]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_data_files(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"no data files match .*\*\.parquet"):
        list_data_files(str(tmp_path / "*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no data files match"):
        list_data_files(str(tmp_path / "empty"))


@pytest.mark.parametrize("num_files", [3, 8, 17])
def test_regions_get_disjoint_complete_seeded_shares(num_files):
    files = [f"s3://bucket/c4-train.{i:05d}.json.gz" for i in range(num_files)]
    for num_regions in [1, 2, 3]:
        splits_by_seed = {}
        for seed in range(6):
            split = split_files_across_regions(files, num_regions, seed)
            assert len(split) == num_regions
            flat = [f for region in split for f in region]
            assert sorted(flat) == files and len(set(flat)) == len(files)
            assert all(region for region in split)
            assert max(map(len, split)) - min(map(len, split)) <= 1  # balanced
            assert split_files_across_regions(list(reversed(files)), num_regions, seed) == split
            splits_by_seed[seed] = split
        if num_regions > 1:  # the seed actually changes the assignment
            assert len({repr(s) for s in splits_by_seed.values()}) > 1


def test_more_regions_than_files_is_an_error():
    with pytest.raises(ValueError, match="more shards .* or use fewer regions"):
        split_files_across_regions(["a.json.gz", "b.json.gz"], 3, seed=0)


# --- pure parsing and packing -------------------------------------------------------------


def test_parse_c4_lines_skips_and_counts_bad_records():
    lines = [
        json.dumps({"text": "one", "url": "u"}),
        '{"text": "cut off',  # malformed JSON
        "",  # blank line: not a record
        json.dumps({"url": "no text"}),
        json.dumps({"text": 5}),
        json.dumps(["a", "list"]),
        json.dumps({"text": ""}),
        json.dumps({"text": "two\u2028lines"}),
    ]
    texts, skipped = parse_c4_lines(lines)
    assert texts == ["one", "two\u2028lines"]
    assert skipped == 5


def test_parse_c4_lines_skips_a_line_that_makes_the_parser_recurse_too_deep():
    # json.loads raises RecursionError (not ValueError) on deep nesting: one such line in a crawl
    # used to fail the whole Ray Data task.
    lines = [json.dumps({"text": "one"}), "[" * 100_000, "{" * 100_000, json.dumps({"text": "two"})]
    texts, skipped = parse_c4_lines(lines)
    assert texts == ["one", "two"]
    assert skipped == 2


def test_pack_documents_small_case_and_conservation():
    windows, tail = pack_documents([[1, 2, 3], [4, 5]], eos_id=0, seq_len=3)
    assert windows.dtype == np.int32
    assert windows.tolist() == [[1, 2, 3], [0, 4, 5]] and tail == 1
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, 1000, size=rng.integers(0, 50))) for _ in range(40)]
    for seq_len in [1, 7, 64, 10_000]:
        windows, tail = pack_documents(docs, eos_id=0, seq_len=seq_len)
        stream = [t for d in docs for t in d + [0]]
        assert windows.shape[1] == seq_len and 0 <= tail < seq_len
        assert windows.size + tail == len(stream)
        assert windows.reshape(-1).tolist() == stream[: windows.size]


# --- the Ray Data pipeline ----------------------------------------------------------------


def test_pipeline_windows_hold_every_token_of_the_embedded_shards(ray_local, tok):
    cfg = DataConfig(seq_len=128, batch_size=8, docs_per_pack_batch=100)
    files = list_data_files(embedded_train_dir())
    counters = DataCounters.remote()
    batches = _consume(build_region_dataset(cfg, files, counters), cfg.batch_size)
    assert all(b.shape == (cfg.batch_size, cfg.seq_len) for b in batches[:-1])
    assert 1 <= batches[-1].shape[0] <= cfg.batch_size and batches[-1].shape[1] == cfg.seq_len

    direct = _direct_tokens(tok, _texts(files))
    got = torch.cat(batches).reshape(-1).tolist()
    counts = ray.get(counters.get.remote())
    assert counts["skipped"] == 0 and counts["docs"] == 720
    assert counts["tokens"] == len(direct)
    assert len(got) + counts["tail_dropped"] == len(direct)
    assert counts["pack_batches"] >= 720 // cfg.docs_per_pack_batch
    assert 0 <= counts["tail_dropped"] < cfg.seq_len * counts["pack_batches"]  # one tail each
    # Block order across tasks is not fixed, so compare as multisets: nothing invented.
    assert not Counter(got) - Counter(direct)


def test_region_datasets_cover_all_documents_once(ray_local):
    cfg = DataConfig(seq_len=64)
    counters = DataCounters.remote()
    datasets = build_region_datasets(cfg, num_regions=3, seed=1, counters=counters)
    assert len(datasets) == 3
    windows = [torch.cat(_consume(ds, 16)) for ds in datasets]
    assert all(w.shape[1] == 64 and len(w) > 0 for w in windows)
    assert ray.get(counters.get.remote())["docs"] == 720


def test_broken_lines_are_skipped_and_counted(ray_local, tok, tmp_path):
    good = [line for line in _read_lines(embedded_eval_path()) if line][:20]
    lines = good[:7] + ['{"text": "this record is cut of'] + good[7:13] + ['{"url": "no text"}'] + good[13:]
    path = tmp_path / "c4-train.00000-of-00001.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")

    cfg = DataConfig(seq_len=16, batch_size=4)
    counters = DataCounters.remote()
    got = torch.cat(_consume(build_region_dataset(cfg, [str(path)], counters), cfg.batch_size))
    counts = ray.get(counters.get.remote())
    assert counts["skipped"] == 2 and counts["docs"] == 20

    direct = _direct_tokens(tok, [json.loads(line)["text"] for line in good])
    assert counts["tokens"] == len(direct)
    assert got.numel() + counts["tail_dropped"] == len(direct)
    # One small file is one pack batch, so the windows are exactly the stream, in order.
    assert got.reshape(-1).tolist() == direct[: got.numel()]


def test_each_bad_line_is_counted_once_over_two_epochs(ray_local, tmp_path, monkeypatch):
    """A second pass re-runs every pack batch (as would a retried task): the counters must not grow."""
    options = ray.data.DataContext.get_current().execution_options
    monkeypatch.setattr(options, "preserve_order", True)  # as the driver sets it
    good = [line for line in _read_lines(embedded_eval_path()) if line][:40]
    for shard in range(2):  # two files, several pack batches each, bad lines in different batches
        lines = list(good[shard * 20 : shard * 20 + 20])
        for at in (3, 11, 17):
            lines.insert(at, f'{{"text": "cut off in shard {shard} at {at}')
        with gzip.open(tmp_path / f"c4-train.{shard:05d}-of-00002.json.gz", "wt", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")

    cfg = DataConfig(seq_len=16, batch_size=4, docs_per_pack_batch=8)
    counters = DataCounters.remote()
    ds = build_region_dataset(cfg, list_data_files(str(tmp_path)), counters)
    first = torch.cat(_consume(ds, cfg.batch_size))
    after_one = ray.get(counters.get.remote())
    second = torch.cat(_consume(ds, cfg.batch_size))
    after_two = ray.get(counters.get.remote())
    assert after_one["skipped"] == 6 and after_one["docs"] == 40
    assert after_one["pack_batches"] >= 2 * 23 // cfg.docs_per_pack_batch
    # Same batch boundaries in both epochs (preserve_order): no new batch key, no count twice.
    assert after_two == after_one
    assert torch.equal(first, second)


def test_file_with_only_bad_lines_gives_no_windows(ray_local, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": \n{"no": "text"}\nnot json\n')
    counters = DataCounters.remote()
    ds = build_region_dataset(DataConfig(seq_len=16), [str(path)], counters)
    assert _consume(ds, 4) == []
    assert ray.get(counters.get.remote()) == {
        "skipped": 3, "docs": 0, "tokens": 0, "tail_dropped": 0, "pack_batches": 1
    }


def test_hf_stream_regions_split_a_local_iterable_dataset(ray_local, tok):
    """The Hugging Face path minus load_dataset (no network here): a local IterableDataset."""
    import datasets

    texts = _texts([embedded_eval_path()])[:40] + [None]  # a null text is skipped and counted
    table = datasets.Dataset.from_dict({"text": texts, "url": ["u"] * len(texts)})
    stream = table.to_iterable_dataset(num_shards=4)
    cfg = DataConfig(seq_len=32, docs_per_pack_batch=64)
    counters = [DataCounters.remote(), DataCounters.remote()]
    windows = [
        torch.cat(_consume(hf_stream_region_dataset(cfg, stream, r, 2, counters[r]), 8))
        for r in range(2)
    ]
    counts = [ray.get(c.get.remote()) for c in counters]
    assert sum(c["docs"] for c in counts) == 40 and sum(c["skipped"] for c in counts) == 1
    assert all(c["docs"] > 0 for c in counts)  # both regions got a share
    assert sum(c["tokens"] for c in counts) == len(_direct_tokens(tok, texts[:40]))
    for w, c in zip(windows, counts):
        assert w.shape[1] == 32 and w.numel() + c["tail_dropped"] == c["tokens"]


# --- held-out set and evaluation ----------------------------------------------------------


def test_eval_windows_are_the_start_of_the_held_out_stream(tok):
    cfg = DataConfig(seq_len=128, eval_windows=64)
    windows = load_eval_windows(cfg, tok)
    assert windows.dtype == torch.long and windows.shape == (64, 128)
    direct = _direct_tokens(tok, _texts([embedded_eval_path()]))
    assert windows.reshape(-1).tolist() == direct[: 64 * 128]


def test_eval_set_smaller_than_asked_and_too_short(tok, tmp_path):
    direct = _direct_tokens(tok, _texts([embedded_eval_path()]))
    windows = load_eval_windows(DataConfig(seq_len=512, eval_windows=100_000), tok)
    assert len(windows) == len(direct) // 512
    with pytest.raises(ValueError, match="lower data.seq_len"):
        load_eval_windows(DataConfig(seq_len=len(direct) + 1), tok)
    small = tmp_path / "held.jsonl"
    small.write_text(json.dumps({"text": "just a few words"}) + "\n")
    with pytest.raises(ValueError, match="no full window"):
        load_eval_windows(DataConfig(seq_len=64, eval_path=str(small)), tok)


def test_evaluate_loss_on_a_tiny_random_llama(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = len(tok)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        )
    )
    model.train()
    windows = load_eval_windows(DataConfig(seq_len=64, eval_windows=5), tok)
    loss, ppl = evaluate_loss(model, windows, batch_size=2)
    assert model.training  # mode restored
    assert math.isfinite(loss) and abs(loss - math.log(vocab)) < 0.5
    assert ppl == pytest.approx(math.exp(loss), rel=1e-9)
    # Weighted by tokens: a 2+2+1 split gives the same mean as one batch of 5.
    whole, _ = evaluate_loss(model, windows, batch_size=5)
    assert loss == pytest.approx(whole, rel=1e-5)
    # And it matches the mean token loss computed by hand.
    with torch.no_grad():
        model.eval()
        logits = model(input_ids=windows).logits[:, :-1]
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), windows[:, 1:].reshape(-1))
    assert loss == pytest.approx(float(ref), rel=1e-5)
