"""What one exchange's Ray round trip costs: a worker's fp32 shards to its SyncActor and rows back.

    python benchmarks/exchange.py                      # the tiny-cpu model (27 MB fp32), ~30 s
    python benchmarks/exchange.py --preset 150m --repeats 3

Two Ray processes on this machine (a worker-like actor and an async actor standing in for the SyncActor),
the model's parameters of the preset in fp32, passed there and back as the exchange passes them: as torch
tensors (pickled by Ray) and as numpy arrays (`ray_diloco.sharding.to_wire`: Ray's object store, no pickling
of the data). The receiving side does what the SyncActor does with them (`from_wire`, one copy: `assemble`)
and returns copies (`rows_for_rank`). Prints the median round trip of each and their ratio.
"""

from __future__ import annotations

import statistics
import time

import ray
import torch

from ray_diloco.cli import OneLineErrors
from ray_diloco.model import build_model
from ray_diloco.presets import PRESETS
from ray_diloco.sharding import from_wire, to_wire

VOCAB = 50_304  # the bundled GPT-2 tokenizer's, padded as the runs pad it


@ray.remote(max_concurrency=4)
class Receiver:
    async def exchange(self, shards: dict) -> dict:
        full = {name: tensor.clone() for name, tensor in from_wire(shards).items()}  # what `assemble` costs
        rows = {name: tensor.clone() for name, tensor in full.items()}  # what `rows_for_rank` costs
        return to_wire(rows) if not isinstance(next(iter(shards.values())), torch.Tensor) else rows


@ray.remote
class Sender:
    def __init__(self, preset: str):
        cfg = PRESETS[preset]()
        model = build_model(cfg.model, VOCAB, cfg.data.seq_len, seed=0)
        self.params = {name: p.detach().float() for name, p in model.named_parameters()}

    def megabytes(self) -> float:
        return sum(t.numel() * 4 for t in self.params.values()) / 1e6

    def round_trips(self, receiver, wire: str, repeats: int) -> list[float]:
        seconds = []
        for _ in range(repeats + 1):  # the first is a warm-up
            started = time.perf_counter()
            shards = to_wire(self.params) if wire == "numpy" else {k: t.clone() for k, t in self.params.items()}
            rows = from_wire(ray.get(receiver.exchange.remote(shards)))
            for name, tensor in self.params.items():  # what `load_rows` does
                tensor.copy_(rows[name])
            seconds.append(time.perf_counter() - started)
        return seconds[1:]


def main() -> None:
    parser = OneLineErrors(prog="exchange.py", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny-cpu", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        sender, receiver = Sender.remote(args.preset), Receiver.remote()
        megabytes = ray.get(sender.megabytes.remote())
        medians = {}
        for wire in ("torch", "numpy"):
            times = ray.get(sender.round_trips.remote(receiver, wire, args.repeats))
            medians[wire] = statistics.median(times)
            print(f"{args.preset} ({megabytes:.1f} MB fp32) as {wire:5s}: median {medians[wire]:.3f} s, "
                  f"min {min(times):.3f} s, max {max(times):.3f} s over {args.repeats}", flush=True)
        print(f"torch ÷ numpy: {medians['torch'] / medians['numpy']:.1f}×")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
