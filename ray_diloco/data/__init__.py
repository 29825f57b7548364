"""Data: C4 files -> per-region Ray Data streams of token windows, plus the held-out set.

The names below are imported on first use (PEP 562), not with the package: `ray_diloco.data.preflight`
(and `.files`, `.packing`) must import without ray, torch or transformers, since the preflight check
runs before Ray starts, and importing a submodule imports this package first.
"""

import importlib

# name -> the submodule that defines it
_WHERE = {
    "DataCounters": "pipeline",
    "build_hf_region_dataset": "pipeline",
    "build_region_dataset": "pipeline",
    "build_region_datasets": "pipeline",
    "check_data": "preflight",
    "embedded_eval_path": "files",
    "embedded_train_dir": "files",
    "evaluate_loss": "eval_set",
    "hf_stream_region_dataset": "pipeline",
    "list_data_files": "files",
    "load_eval_windows": "eval_set",
    "pack_documents": "packing",
    "parse_c4_lines": "packing",
    "region_dataset_recipes": "pipeline",
    "split_files_across_regions": "files",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
