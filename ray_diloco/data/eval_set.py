"""The held-out windows and the loss / perplexity of a model on them.

Small by design (cfg.eval_windows windows), so it is read in-process without Ray: every region
evaluates on exactly the same windows, which makes their losses comparable.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from ray_diloco.config import DataConfig
from ray_diloco.data.files import embedded_eval_path, filesystem_for, list_data_files
from ray_diloco.data.packing import pack_documents, parse_c4_lines
from ray_diloco.tokenizer import DocumentEncoder, encode_documents

if TYPE_CHECKING:  # torch is imported where used: Ray Data workers import this package
    import torch  # (via ray_diloco.data) and should not pay ~2 s for a torch they never use.

logger = logging.getLogger(__name__)

_DOCS_PER_ENCODE = 256


def load_eval_windows(cfg: DataConfig, tokenizer) -> "torch.Tensor":
    """The first `cfg.eval_windows` windows (LongTensor [n, seq_len]) of the held-out files.

    Files are read in sorted order and only until enough tokens are in hand, so pointing
    eval_path at a full C4 validation split costs a few documents, not the whole split.
    """
    encoder = DocumentEncoder.of(tokenizer)
    files = list_data_files(cfg.eval_path) if cfg.eval_path else [embedded_eval_path()]
    fs, paths = filesystem_for(files)
    needed = cfg.eval_windows * cfg.seq_len
    token_lists: list[list[int]] = []
    have, skipped = 0, 0
    for path in paths:
        # open_input_stream decompresses by extension (.gz). Split on "\n" only: JSON lines
        # may legally hold U+2028 inside strings, which str.splitlines would cut.
        with fs.open_input_stream(path) as stream:
            lines = stream.read().decode("utf-8").split("\n")
        for start in range(0, len(lines), _DOCS_PER_ENCODE):
            texts, bad = parse_c4_lines(lines[start : start + _DOCS_PER_ENCODE])
            skipped += bad
            for ids in encode_documents(encoder, texts):
                token_lists.append(ids)
                have += len(ids) + 1  # + EOS
            if have >= needed:
                break
        if have >= needed:
            break
    if skipped:
        logger.warning("held-out set: skipped %d malformed record(s) in %s", skipped, files)
    windows, _ = pack_documents(token_lists, encoder.eos_token_id, cfg.seq_len)
    if len(windows) == 0:
        raise ValueError(
            f"the held-out set {files} gives no full window of {cfg.seq_len} tokens "
            f"({have} tokens in all): lower data.seq_len or point data.eval_path at more documents"
        )
    if len(windows) < cfg.eval_windows:
        logger.warning(
            "held-out set has %d windows, fewer than eval_windows=%d", len(windows), cfg.eval_windows
        )
    import torch

    return torch.from_numpy(windows[: cfg.eval_windows]).long()


def evaluate_loss(
    model: "torch.nn.Module", windows: "torch.Tensor", batch_size: int
) -> tuple[float, float]:
    """(mean next-token loss over every predicted token, perplexity = exp(loss)).

    `model` is a Hugging Face causal LM (shifts labels itself). Batches are weighted by their
    number of predicted tokens, so a short last batch does not count as much as a full one.
    The model's train/eval mode is restored afterwards.
    """
    if len(windows) == 0:
        raise ValueError("no evaluation windows")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    import torch

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum, token_count = 0.0, 0
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                batch = windows[start : start + batch_size].to(device=device, dtype=torch.long)
                out = model(input_ids=batch, labels=batch)
                predicted = batch.shape[0] * (batch.shape[1] - 1)  # the first token has no target
                loss_sum += float(out.loss) * predicted
                token_count += predicted
    finally:
        model.train(was_training)
    loss = loss_sum / token_count
    return loss, math.exp(loss)
