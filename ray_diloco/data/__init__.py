"""Data: C4 files -> per-region Ray Data streams of token windows, plus the held-out set."""

from ray_diloco.data.eval_set import evaluate_loss, load_eval_windows
from ray_diloco.data.files import (
    embedded_eval_path,
    embedded_train_dir,
    list_data_files,
    split_files_across_regions,
)
from ray_diloco.data.packing import pack_documents, parse_c4_lines
from ray_diloco.data.pipeline import (
    DataCounters,
    build_hf_region_dataset,
    build_region_dataset,
    build_region_datasets,
    hf_stream_region_dataset,
)

__all__ = [
    "DataCounters",
    "build_hf_region_dataset",
    "build_region_dataset",
    "build_region_datasets",
    "embedded_eval_path",
    "embedded_train_dir",
    "evaluate_loss",
    "hf_stream_region_dataset",
    "list_data_files",
    "load_eval_windows",
    "pack_documents",
    "parse_c4_lines",
    "split_files_across_regions",
]
