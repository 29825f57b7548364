"""An outsider beside a real run: real Hivemind, our own averaging and state-sharing code, the run's name and
config, but not its secret. Run as a process of its own (tests stop it by PID):

    python tests/intruder.py CONFIG_YAML REPORT_JSON

It finds the regions through the peer files in the run's storage and, until it is killed, tries every attack of
issue #24 each cycle, writing what it tried and what it got to REPORT_JSON:
- forged records: "region-b finished at the last step" and a region that does not exist, with expirations an
  hour ahead (what stopped an unprotected run cold);
- a state download from every region it has seen a record of (their peer IDs are in the records it reads);
- joining the matchmaking of the round the regions are in, with a Δ of 1000 and a weight of 10^6.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import yaml
from hivemind import DHT
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from ray_diloco.config import ExperimentConfig
from ray_diloco.model import build_model, parameter_state
from ray_diloco.run_setup import resolve_vocab
from ray_diloco.sync import peers
from ray_diloco.sync.auth import MAC_MARKER, SUFFIX_BYTES
from ray_diloco.sync.averaging import RegionAverager
from ray_diloco.sync.policy import FINISHED, StateRecord
from ray_diloco.sync.state_sharing import StateSharer, state_key
from ray_diloco.tokenizer import load_tokenizer


class Forger(RecordValidatorBase):
    """The strongest outsider's DHT: it reads every record (drops our MACs unchecked) and writes records in our
    format with a MAC it made up."""

    def validate(self, record):
        return True

    def sign_value(self, record):
        return record.value + MAC_MARKER + b"\x07" * (SUFFIX_BYTES - len(MAC_MARKER))

    def strip_value(self, record):
        has_mac = record.value[-SUFFIX_BYTES:].startswith(MAC_MARKER)
        return record.value[:-SUFFIX_BYTES] if has_mac else record.value


def wait_for_regions(cfg: ExperimentConfig) -> list[str]:
    while True:
        found = peers.read_peer_files(cfg.run.peers_dir(), exclude="")
        if len(found) == len(cfg.regions):
            return [maddr for maddrs in found.values() for maddr in maddrs]
        time.sleep(0.5)


def records(dht: DHT, key: str) -> dict[str, dict]:
    found = dht.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {region: item.value for region, item in found.value.items() if isinstance(item.value, dict)}


def forge(dht: DHT, key: str, cfg: ExperimentConfig, report: dict) -> None:
    later = get_dht_time() + 3600
    victim = cfg.regions[-1].name
    fake = dict(outer_step=cfg.run.outer_steps, digest="0" * 32, group_size=2, phase=FINISHED, waited=0.0)
    for region in (victim, "region-that-does-not-exist"):
        dht.store(key, subkey=region, value={**fake, "peer_id": dht.peer_id.to_base58()}, expiration_time=later)
        report["forged_stores"] += 1


def download(sharer: StateSharer, seen: dict[str, dict], report: dict) -> None:
    for region, value in seen.items():
        want = StateRecord(region, int(value["outer_step"]), str(value["digest"]), int(value["group_size"]))
        report["download_attempts"] += 1
        try:
            sharer._run(sharer._download(PeerID.from_base58(value["peer_id"]), region, want), timeout=20)
            report["downloads_served"] += 1
        except Exception:  # noqa: BLE001 — refused: what the run must do
            pass


def join_round(averager: RegionAverager, seen: dict[str, dict], shapes: dict, report: dict) -> None:
    round_index = max(int(v["outer_step"]) for v in seen.values())  # a region at step s runs round s next
    delta = {name: torch.full(shape, 1000.0) for name, shape in shapes.items()}
    report["average_attempts"] += 1
    try:
        result = averager.average(delta, weight=1e6, round_index=round_index)
        report["largest_group"] = max(report["largest_group"], result.group_size)
    except Exception as error:  # noqa: BLE001
        report["average_errors"].append(repr(error)[:200])


def main(config_path: str, report_path: str) -> None:
    cfg = ExperimentConfig.from_dict(yaml.safe_load(open(config_path)))
    cfg = resolve_vocab(cfg, load_tokenizer(cfg.data.tokenizer))  # as the driver does: the model's true shapes
    model = build_model(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, cfg.run.seed)
    shapes = {name: tuple(t.shape) for name, t in parameter_state(model).items()}
    del model
    dht = DHT(initial_peers=wait_for_regions(cfg), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
              record_validators=[Forger()])
    key = state_key(cfg.run.name)
    sharer = StateSharer(dht, cfg.run.name, "intruder", lambda: None, ttl=60, chunk_timeout=10,
                         schema={name: (shape, "float32") for name, shape in shapes.items()})
    averager = RegionAverager(run_id=cfg.run.name, region="intruder", expected_regions=len(cfg.regions) + 1,
                              dht=dht, matchmaking_seconds=cfg.outer.matchmaking_seconds,
                              averaging_timeout=cfg.outer.averaging_timeout, compression=cfg.outer.compression)
    report = dict(cycles=0, forged_stores=0, download_attempts=0, downloads_served=0, average_attempts=0,
                  largest_group=0, average_errors=[], regions_seen=[], peer_id=dht.peer_id.to_base58())
    while True:
        forge(dht, key, cfg, report)
        seen = {r: v for r, v in records(dht, key).items() if v.get("peer_id") != dht.peer_id.to_base58()}
        report["regions_seen"] = sorted(set(report["regions_seen"]) | set(seen))
        if seen:
            download(sharer, seen, report)
            write(report, report_path)
            join_round(averager, seen, shapes, report)
        report["cycles"] += 1
        write(report, report_path)
        time.sleep(0.5)


def write(report: dict, path: str) -> None:
    with open(path + ".tmp", "w") as out:
        json.dump(report, out)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
