"""The per-region training stream on Ray Data: files -> lines -> token windows.

Each region's dataset has ONE column, `input_ids` (int32, shape [seq_len] per row); consumers
call `ds.iter_torch_batches(batch_size=cfg.batch_size)` (cast to long for embedding/labels).
Read and map tasks ask for `cfg.read_num_cpus` CPUs only: with Ray Data's default of 1 CPU per
task, the training workers hold the CPUs and the stream stalls.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from ray_diloco.config import DataConfig
from ray_diloco.data.files import (
    embedded_train_dir,
    filesystem_for,
    list_data_files,
    split_files_across_regions,
)
from ray_diloco.data.packing import pack_documents, parse_c4_lines
from ray_diloco.tokenizer import DocumentEncoder, encode_documents, load_document_encoder

logger = logging.getLogger(__name__)

COLUMN = "input_ids"  # the one column of a region's dataset; WorkerBatches reads it


_COUNTS = ("skipped", "docs", "tokens", "tail_dropped")


@ray.remote(num_cpus=0)
class DataCounters:
    """Totals over the distinct pack batches of a pipeline: each input line counted once per run.

    Every epoch re-reads and re-packs the same batches, and so does a retried task; each batch
    reports a key (a hash of its input lines) and a batch seen again replaces its earlier counts
    rather than adding to them. This relies on the batch boundaries being the same in every pass,
    which holds when Ray Data preserves order (`RegionStream` sets `preserve_order`). Two batches of the
    very same lines would count once. Memory: one small entry per distinct pack batch.

    Map tasks call `add` and wait for it (see `_pack_batch`), so once a dataset has been fully
    consumed, `get()` includes every batch that produced output.
    """

    def __init__(self) -> None:
        self._batches: dict[bytes, tuple[int, ...]] = {}

    def add(self, key: bytes, skipped: int, docs: int, tokens: int, tail_dropped: int) -> None:
        """Counts of one pack batch, `key` = `batch_key` of its input lines."""
        self._batches[key] = (int(skipped), int(docs), int(tokens), int(tail_dropped))

    def get(self) -> dict[str, int]:
        """skipped records, documents kept, tokens incl. one EOS per doc, tail tokens dropped,
        pack batches seen (each drops a tail of < seq_len tokens)."""
        totals = [sum(column) for column in zip(*self._batches.values())] or [0] * len(_COUNTS)
        return {**dict(zip(_COUNTS, totals)), "pack_batches": len(self._batches)}


def batch_key(items: Any) -> bytes:
    """A hash of a pack batch's input lines (or texts): the same batch read again has the same key.

    Each item is length-prefixed, so that ["ab", "c"] and ["a", "bc"] differ; a non-string item
    (a null text from a Hugging Face stream) hashes as its repr.
    """
    digest = hashlib.blake2b(digest_size=16)
    for item in items:
        data = (item if isinstance(item, str) else repr(item)).encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()


# One encoder per worker process: tasks get the tokenizer's *name* and load it once here,
# instead of pickling a ~1.5 MB tokenizer into every task.
_ENCODERS: dict[str | None, DocumentEncoder] = {}


def _encoder(name: str | None) -> DocumentEncoder:
    if name not in _ENCODERS:
        _ENCODERS[name] = load_document_encoder(name)
    return _ENCODERS[name]


def _pack_batch(
    batch: dict[str, np.ndarray],
    *,
    tokenizer_name: str | None,
    seq_len: int,
    json_lines: bool,
    counters: Any = None,
) -> dict[str, np.ndarray]:
    """Parse (JSON lines) or take (already-parsed rows) the texts, tokenize, pack into windows."""
    if json_lines:
        texts, skipped = parse_c4_lines(str(line) for line in batch["text"])
    else:
        raw = list(batch["text"])
        texts = [t for t in raw if isinstance(t, str) and t]
        skipped = len(raw) - len(texts)
    encoder = _encoder(tokenizer_name)
    ids = encode_documents(encoder, texts)
    windows, tail = pack_documents(ids, encoder.eos_token_id, seq_len)
    if skipped:
        logger.warning("skipped %d malformed record(s) without a string 'text'", skipped)
    if counters is not None:
        # Waited for (a few ms per batch of documents): a fire-and-forget call could still be in
        # flight when the consumer has read every window and asks the counters for totals.
        tokens = sum(len(t) for t in ids) + len(ids)
        key = batch_key(batch["text"])
        ray.get(counters.add.remote(key, skipped, len(texts), tokens, tail))
    return {COLUMN: windows}


def _to_windows(ds: ray.data.Dataset, cfg: DataConfig, json_lines: bool, counters: Any):
    return ds.map_batches(
        _pack_batch,
        batch_size=cfg.docs_per_pack_batch,
        batch_format="numpy",
        num_cpus=cfg.read_num_cpus,
        fn_kwargs={
            "tokenizer_name": cfg.tokenizer,
            "seq_len": cfg.seq_len,
            "json_lines": json_lines,
            "counters": counters,
        },
    )


def build_region_dataset(
    cfg: DataConfig, files: list[str], counters: Any = None
) -> ray.data.Dataset:
    """The windows of one region's files (from `list_data_files` / `split_files_across_regions`).

    `counters`: an optional `DataCounters.remote()` handle (or its `ActorByName`); read it with
    `ray.get(counters.get.remote())` after consuming the dataset.
    """
    fs, paths = filesystem_for(files)
    # read_text, not read_json: read_json fails the whole file on one malformed line, whereas
    # here each line is parsed in _pack_batch so a bad record is skipped and counted. read_text
    # decompresses *.gz by extension (pyarrow infers the codec from the path).
    # Note: read_text splits with str.splitlines, which also breaks at U+2028/U+0085; C4 escapes
    # all non-ASCII in its JSON so this never happens there; elsewhere the cut record shows up
    # in the skipped count (as its two broken halves).
    lines = ray.data.read_text(paths, filesystem=fs, num_cpus=cfg.read_num_cpus)
    return _to_windows(lines, cfg, json_lines=True, counters=counters)


def build_hf_region_dataset(
    cfg: DataConfig, region_index: int, num_regions: int, counters: Any = None
) -> ray.data.Dataset:
    """The windows of region `region_index`'s share of the streamed Hugging Face `cfg.hf_dataset`.

    Needs the network (not exercised by the tests; `hf_stream_region_dataset` is).
    """
    from datasets import load_dataset

    stream = load_dataset(cfg.hf_dataset, cfg.hf_config, split="train", streaming=True)
    return hf_stream_region_dataset(cfg, stream, region_index, num_regions, counters)


def hf_stream_region_dataset(
    cfg: DataConfig, stream: Any, region_index: int, num_regions: int, counters: Any = None
) -> ray.data.Dataset:
    """The windows of one region's share of a `datasets.IterableDataset` with a `text` column."""
    from datasets.distributed import split_dataset_by_node
    from ray.data._internal.datasource.huggingface_datasource import HuggingFaceDatasource

    if not 0 <= region_index < num_regions:
        raise ValueError(f"region_index {region_index} not in [0, {num_regions})")
    # Disjoint per region: whole shards when n_shards divides by num_regions, else every
    # num_regions-th example.
    stream = split_dataset_by_node(stream, rank=region_index, world_size=num_regions)
    stream = stream.select_columns(["text"])  # timestamp/url would only be dropped later
    # Not ray.data.from_huggingface: it first looks for the hub's parquet export of the *whole*
    # split (ignoring split_dataset_by_node, so every region would read everything), and it
    # gives no way to set num_cpus on its read task.
    rows = ray.data.read_datasource(
        HuggingFaceDatasource(dataset=stream), num_cpus=cfg.read_num_cpus
    )
    return _to_windows(rows, cfg, json_lines=False, counters=counters)


def region_file_shares(cfg: DataConfig, num_regions: int, seed: int) -> list[list[str]] | None:
    """The files each region of the run reads (None for a Hugging Face dataset, split by `split_dataset_by_node`)."""
    if cfg.hf_dataset:
        return None
    return split_files_across_regions(list_data_files(cfg.path or embedded_train_dir()), num_regions, seed)


def region_dataset_recipes(
    cfg: DataConfig, num_regions: int, seed: int, counters: Any = None, indices: list[int] | None = None
) -> list[Callable[[], ray.data.Dataset]]:
    """How to build the datasets of regions `indices` (default: all) of a run of `num_regions`, from
    `cfg.hf_dataset`, `cfg.path`, or the embedded C4 sample: calls with plain arguments (the region's files),
    made where the dataset is read. A built dataset holds object refs (Ray Data's read plan), and an actor given
    one as an argument makes Ray log an error at its start (`actor_by_name`); so would a recipe over ~100 KiB
    (Ray puts such an argument in the object store), thousands of long file URIs per region. The split depends on
    the whole run, not on which regions this driver runs, so drivers in different Ray clusters read disjoint
    shares."""
    indices = list(range(num_regions)) if indices is None else indices
    if cfg.hf_dataset:
        return [functools.partial(build_hf_region_dataset, cfg, r, num_regions, counters) for r in indices]
    shares = region_file_shares(cfg, num_regions, seed)
    for region in indices:
        logger.info("region %d reads %d file(s): %s", region, len(shares[region]), shares[region])
    return [functools.partial(build_region_dataset, cfg, shares[r], counters) for r in indices]


def build_region_datasets(
    cfg: DataConfig, num_regions: int, seed: int, counters: Any = None, indices: list[int] | None = None
) -> list[ray.data.Dataset]:
    """The datasets of `region_dataset_recipes`, built here."""
    return [make() for make in region_dataset_recipes(cfg, num_regions, seed, counters, indices)]
