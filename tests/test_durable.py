"""The run's stored records and states (`ray_diloco.sync.durable`), how the policy reads them beside the DHT's
(`policy.with_stored`), and how a run that did not end on one θ_global is reported (`outcome.agreement`, the
CLI's exit status). The real-process case is tests/test_late_regions.py."""

import dataclasses

import pytest
import torch

from ray_diloco import outcome
from ray_diloco.sync import durable, policy
from ray_diloco.sync.outer import state_digest
from ray_diloco.sync.policy import FINISHED, READY, TRAINING, StateRecord

SHAPES = {"w": torch.Size([2, 3]), "b": torch.Size([3])}


def state(seed: int):
    generator = torch.Generator().manual_seed(seed)
    theta = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    return theta, {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def stored_final(tmp_path, region="a", step=4, seed=0) -> durable.StoredRecord:
    theta, momentum = state(seed)
    location = durable.save_final_state(str(tmp_path), region, step, theta, momentum, "run: {}\n")
    stored = durable.StoredRecord(StateRecord(region, step, state_digest(theta), 2, FINISHED), location)
    durable.write_record(str(tmp_path), stored)
    return stored


def test_a_stored_final_state_reads_back_exactly(tmp_path):
    stored = stored_final(tmp_path)
    (tmp_path / "broken.json").write_text("{not json")  # skipped, logged
    assert durable.read_records(str(tmp_path)) == {"a": stored}
    step, theta, momentum = durable.load_state(stored, SHAPES)
    assert step == 4 and state_digest(theta) == stored.record.digest
    expected_theta, expected_momentum = state(0)
    assert all(torch.equal(momentum[n], expected_momentum[n]) and torch.equal(theta[n], expected_theta[n])
               for n in SHAPES)


def test_a_stored_state_that_does_not_match_its_record_or_the_model_is_refused(tmp_path):
    stored = stored_final(tmp_path)
    wrong_digest = durable.StoredRecord(StateRecord("a", 4, "0" * 32, 2, FINISHED), stored.location)
    with pytest.raises(ValueError, match="but the record says"):
        durable.load_state(wrong_digest, SHAPES)
    with pytest.raises(ValueError, match="this model's parameters and shapes"):
        durable.load_state(stored, {**SHAPES, "b": torch.Size([4])})
    _, momentum = state(0)
    named = durable.StoredRecord(dataclasses.replace(stored.record, momentum_digest=state_digest(momentum)),
                                 stored.location)
    assert durable.load_state(named, SHAPES)[0] == 4  # the momentum its record names
    other = durable.StoredRecord(dataclasses.replace(stored.record, momentum_digest="0" * 32), stored.location)
    with pytest.raises(ValueError, match="momentum does not match"):
        durable.load_state(other, SHAPES)
    with pytest.raises(FileNotFoundError):  # not a committed checkpoint
        durable.load_state(durable.StoredRecord(stored.record, str(tmp_path / "nowhere")), SHAPES)


def test_only_a_region_that_finished_this_run_counts_as_finished():
    record = StateRecord("a", 4, "d", 2, FINISHED)
    assert durable.finished(durable.StoredRecord(record, "x"), target=4)
    assert not durable.finished(durable.StoredRecord(record, "x"), target=8)  # the run was continued since
    training = StateRecord("a", 4, "d", 0, TRAINING)
    assert not durable.finished(durable.StoredRecord(training, "x"), target=4)


def test_a_live_record_wins_over_its_regions_stored_one():
    live = [StateRecord("a", 3, "x", 2, READY)]
    stored = [StateRecord("a", 2, "y", 2, FINISHED), StateRecord("b", 4, "z", 1, FINISHED)]
    assert policy.with_stored(live, stored) == [live[0], stored[1]]
    assert policy.with_stored(None, []) is None  # the DHT did not answer and storage has nothing
    assert policy.with_stored(None, stored) == stored


def test_a_region_behind_a_stored_final_state_adopts_it_instead_of_running_alone():
    """The fault of issue 22 item 1 at the policy's level: b, late for the last round, sees no live record of
    a (its driver is gone); a's stored final record makes it adopt rather than go alone."""
    own = StateRecord("b", 1, "mine", 2, READY)
    final = StateRecord("a", 2, "final", 1, FINISHED)
    alone = policy.plan_round(own, [own], target=2, arrived=0.0, now=10.0, max_wait=3.0, fallback_expected=1)
    assert alone == policy.Run(1)
    decision = policy.plan_round(own, policy.with_stored([own], [final]), target=2, arrived=0.0, now=10.0,
                                 max_wait=3.0, fallback_expected=1)
    assert decision == policy.Adopt(final)


def test_a_run_that_did_not_end_on_one_state_is_unsettled_and_names_the_regions():
    stats = [{"region": "b", "digest": "x", "events": []}]
    settled = outcome.agreement(stats, "x", {"a": "x"})
    assert settled["regions_agree"] and not settled["unsettled"] and settled["disagreeing_regions"] == []
    split = outcome.agreement(stats, "x", {"a": "y", "c": "x"})
    assert not split["regions_agree"] and split["unsettled"] and split["disagreeing_regions"] == ["a"]
    gave_up = outcome.agreement([{**stats[0], "events": [{"event": "unsettled_at_end"}]}], "x", {})
    assert gave_up["unsettled"] and gave_up["regions_agree"]
    unread = outcome.agreement(stats, "x", None)  # other drivers' regions, and their storage unreadable
    assert unread["unsettled"] and unread["finished_elsewhere"] == {}


def test_the_cli_exits_non_zero_in_one_line_when_the_run_ended_unsettled(monkeypatch, capsys):
    from ray_diloco import cli, driver

    def unsettled_run(cfg, **_):  # what run_training returns for a region that could not take the final state
        return {"eval_loss": 1.0, "unsettled": True, "disagreeing_regions": ["a"], "exported_digest": "x"}

    monkeypatch.setattr(driver, "run_training", unsettled_run)
    assert cli.main(["train", "--run-name", "split"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ray-diloco: error: run split ended unsettled: region(s) a hold another θ_global than the "
                   "exported x; see summary.json"]


def test_writers_of_the_same_file_at_once_never_fail_or_leave_half_a_file(tmp_path):
    """Drivers of one run's clusters write the run's RUN marker at the same moment: with one shared temporary
    name, one writer's rename took the other's file away (FileNotFoundError) or moved half of it in place."""
    import threading

    from ray_diloco.sync.durable import write_atomically

    errors, payloads = [], [bytes([i]) * 200_000 for i in range(8)]

    def write(payload):
        try:
            for _ in range(20):
                write_atomically(str(tmp_path), "RUN", payload)
        except Exception as error:  # noqa: BLE001 — collected for the assertion
            errors.append(error)

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    assert (tmp_path / "RUN").read_bytes() in payloads
    assert [p.name for p in tmp_path.iterdir()] == ["RUN"]  # no temporary file left
