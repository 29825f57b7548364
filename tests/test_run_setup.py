"""Before Ray starts: which checkpoint each region resumes from (departed regions included), which config
changes a continued run refuses, and the resource check that replaces a hang with one line."""

import dataclasses
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_diloco.checkpoint import CheckpointStore, OuterCheckpoint, join
from ray_diloco.config import ConfigError
from ray_diloco.continuation import config_changes
from ray_diloco.presets import tiny_cpu
from ray_diloco.resources import check_fits, check_local_machine, local_cores, run_needs
from ray_diloco.run_setup import resume_plan, training_groups
from ray_diloco.sync.policy import choose_resume_steps


def test_a_region_that_departed_early_does_not_hold_the_others_back():
    # Each store keeps two checkpoints: r2 left at step 2 while r0 and r1 reached 10 (r1 stopped before 10).
    assert choose_resume_steps({"r0": [9, 10], "r1": [8, 9], "r2": [1, 2]}) == {"r0": 9, "r1": 9, "r2": 2}
    assert choose_resume_steps({"r0": [9, 10], "r1": [9, 10], "r2": [1, 2]}) == {"r0": 10, "r1": 10, "r2": 2}
    # The regions that went on are few: they are not rolled back to the departed majority's step.
    assert choose_resume_steps({"a": [1, 2], "b": [1, 2], "c": [9, 10]}) == {"a": 2, "b": 2, "c": 10}
    # Stopped one round apart with checkpoints every 2 (and one at each stop): both go back to 4.
    assert choose_resume_steps({"a": [4, 6], "b": [4, 5]}, interval=2) == {"a": 4, "b": 4}
    assert choose_resume_steps({"r0": [], "r1": []}) == {"r0": None, "r1": None}
    # Stopped apart with checkpoints every 2, one region holding only a later step: it resumes from it (the other
    # takes its state), not fresh — a fresh start reads its whole stream again.
    assert choose_resume_steps({"a": [1], "b": [2]}, interval=2) == {"a": 1, "b": 2}
    assert choose_resume_steps({"a": [2, 3], "b": [4]}, interval=2) == {"a": 3, "b": 4}
    assert choose_resume_steps({"a": [1], "b": [2, 3]}, interval=2) == {"a": 1, "b": 2}  # the nearest after a's


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]),
                       st.lists(st.integers(0, 12), max_size=3, unique=True), min_size=1),
       st.integers(0, 3))  # run.checkpoint_every: 0 (the default) checkpoints only at a stop and at the end
def test_resume_steps_properties(committed, interval):
    plan = choose_resume_steps(committed, interval)
    assert set(plan) == set(committed)
    for region, step in plan.items():
        # only a checkpoint the region really has; a fresh start only for a region that has none
        assert step in committed[region] if committed[region] else step is None
    newest = {r: max(steps) for r, steps in committed.items() if steps}
    if not newest:
        return
    top = max(newest.values())
    staying = [r for r, n in newest.items() if n >= top - max(1, interval)]  # the regions that went on
    common = set.intersection(*(set(committed[r]) for r in staying))
    if common:  # they resume together, from the newest step all of them hold (none re-trains windows in θ_global)
        assert all(plan[r] == max(common) for r in staying)
    # Else from the oldest newest step among them: where a region holds no step at or before it, from its oldest
    # (the nearest after it); every other region from its newest at or before it.
    target = max(common) if common else min(newest[r] for r in staying)
    for region, steps in committed.items():
        before = [step for step in steps if step <= target]
        if steps:
            assert plan[region] == (max(before) if before else min(steps)), (region, target)
    assert all(plan[r] is None or plan[r] <= top for r in plan)  # never past what was committed


def save_steps(cfg, region, steps):
    store = CheckpointStore(join(cfg.run.checkpoint_root(), region))
    for step in steps:
        store.save(OuterCheckpoint(outer_step=step, theta={"w": torch.zeros(2)}, momentum={},
                                   config_yaml=cfg.to_yaml()))


def small(tmp_path, **run):
    cfg = tiny_cpu()
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name="r", output_dir=str(tmp_path), **run))


def test_resume_plan_reads_the_stores_and_refuses_a_breaking_change(tmp_path):
    cfg = small(tmp_path)
    assert resume_plan(cfg) == {"region-a": None, "region-b": None}
    with pytest.raises(ConfigError, match="^--resume: no committed checkpoint"):
        resume_plan(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True)))
    save_steps(cfg, "region-a", [1, 2, 9, 10])  # keeps 9 and 10
    save_steps(cfg, "region-b", [1, 2])  # departed at 2
    assert resume_plan(cfg) == {"region-a": 10, "region-b": 2}
    longer = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, outer_steps=20, eval_every=3))
    assert resume_plan(longer) == {"region-a": 10, "region-b": 2}  # allowed changes
    wider = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=64),
                                model=dataclasses.replace(cfg.model, num_layers=3))
    with pytest.raises(ConfigError) as error:
        resume_plan(wider)
    message = str(error.value)
    assert "data.seq_len: 128 -> 64" in message and "model.num_layers: 2 -> 3" in message
    assert "\n" not in message
    # Another run's checkpoints (its directory renamed by hand) are never continued under a new name.
    os.rename(tmp_path / "r", tmp_path / "s")
    with pytest.raises(ConfigError, match=r"^--run-name s: .* belongs to run 'r'"):
        resume_plan(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name="s")))


def test_config_changes_split_breaking_from_allowed():
    base = tiny_cpu()
    changed = dataclasses.replace(
        base, regions=[dataclasses.replace(r, workers=2, cpus_per_worker=2) for r in base.regions],
        run=dataclasses.replace(base.run, outer_steps=9, mode="ddp"),
        inner=dataclasses.replace(base.inner, lr=1e-4))
    breaking, allowed = config_changes(base, changed)
    # Worker counts may change (checkpoints re-shard, the data position is the region's); a region renamed not.
    assert [b.split(":")[0] for b in breaking] == ["run.mode"]
    assert [a.split(":")[0] for a in allowed] == ["inner.lr", "region_workers", "run.outer_steps"]
    renamed = dataclasses.replace(base, regions=[dataclasses.replace(base.regions[0], name="elsewhere"),
                                                 *base.regions[1:]])
    assert [b.split(":")[0] for b in config_changes(base, renamed)[0]] == ["regions"]


def test_resources_that_do_not_fit_are_one_line_naming_the_fix():
    cfg = tiny_cpu()  # 2 regions x 1 worker x 1 CPU + 2 SyncActors x 0.5 + data tasks 0.25
    needs = run_needs(cfg, training_groups(cfg))
    with pytest.raises(ConfigError) as error:
        check_fits(needs, {"CPU": 2.0}, None)
    message = str(error.value)
    assert message.startswith("the run needs 3.25 CPU") and "cluster has 2" in message
    assert "--num-cpus" in message and "outer.sync_actor_cpus" in message and "\n" not in message
    check_fits(needs, {"CPU": 4.0}, None)
    check_fits(needs, {"CPU": 2.0}, {"CPU": 16})  # an autoscaler can add nodes
    gpu = dataclasses.replace(cfg, regions=[dataclasses.replace(r, gpus_per_worker=1) for r in cfg.regions])
    with pytest.raises(ConfigError, match="^the run needs 2 GPU"):
        check_fits(run_needs(gpu, training_groups(gpu)), {"CPU": 64.0}, None)


def test_a_private_local_ray_takes_at_most_8_workers_per_core_counting_a_range_at_its_maximum():
    cfg = tiny_cpu()
    regions = [dataclasses.replace(cfg.regions[0], name="a", workers=8),
               dataclasses.replace(cfg.regions[0], name="b", workers="2..8")]
    check_local_machine(regions, cores=2)  # 16 workers: 8 per core
    with pytest.raises(ConfigError, match=r"^--workers-per-region: the run starts up to 17 training workers \(all "
                                          r"regions of this driver\) on this machine's 2 core\(s\).*more than 8 per "
                                          r"core \(16\)"):
        check_local_machine([*regions, dataclasses.replace(cfg.regions[0], name="c", workers=1)], cores=2)
    check_local_machine([*regions, dataclasses.replace(cfg.regions[0], name="c", workers=1)], cores=3)
    gpus = dataclasses.replace(cfg.regions[0], name="g", workers=64, gpus_per_worker=1)
    check_local_machine([*regions, gpus], cores=2)  # GPU workers are bounded by the GPUs (check_fits), not here


def test_the_local_cores_are_the_affinity_bounded_by_a_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    for content, expected in [("max 100000\n", affinity), ("150000 100000\n", min(affinity, 2)),
                              ("50000 100000\n", 1), (f"{100000 * (affinity + 4)} 100000\n", affinity)]:
        cpu_max.write_text(content)
        assert local_cores(str(cpu_max)) == expected, content
    assert local_cores(str(tmp_path / "absent")) == affinity


def test_the_exported_state_is_the_canonical_one_not_the_first_regions():
    from ray_diloco.outcome import canonical_index

    def stats(region, step, digest, group, phase="training"):
        return {"region": region, "outer_step": step, "digest": digest,
                "record": {"region": region, "outer_step": step, "digest": digest, "group_size": group,
                           "phase": phase, "waited": 0.0}}

    # The highest step wins (the others would re-sync to it), even when it is not the first region...
    assert canonical_index([stats("a", 3, "x", 1), stats("b", 4, "y", 2)]) == 1
    # ... and at equal steps the digest most regions hold, whatever the order.
    assert canonical_index([stats("a", 3, "z", 1), stats("b", 3, "y", 2), stats("c", 3, "y", 2)]) == 1
    # ... unless a region already finished with its state: the others settle to it, and so does the export.
    assert canonical_index([stats("a", 3, "z", 1, "finished"), stats("b", 3, "y", 2), stats("c", 3, "y", 2)]) == 0
    # A single region (no DHT, no record) is its own canonical state.
    assert canonical_index([{"region": "a", "outer_step": 3, "digest": "x", "record": None}]) == 0


def test_unwritable_outputs_and_a_mismatched_init_from_are_refused_before_ray(tmp_path):
    import json
    from pathlib import Path

    from ray_diloco.run_setup import check_writable, prepare_run

    with pytest.raises(ConfigError, match="^--output-dir: cannot write under /proc"):
        check_writable(Path("/proc/nowhere/run"), "--output-dir")  # os.access says yes to root here
    check_writable(tmp_path / "new" / "run", "--output-dir")
    assert not (tmp_path / "new").exists()  # the probe leaves nothing behind
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 50304,
                                                   "num_attention_heads": 4, "num_hidden_layers": 1}))
    cfg = small(tmp_path, init_from=str(saved))
    with pytest.raises(ConfigError, match="^--init-from: .*saved hidden_size=64 but the config asks 128"):
        prepare_run(cfg, training_groups(cfg))
    assert not (tmp_path / "r").exists()


def test_eval_every_by_default_bounds_the_evaluations_share_of_compute(capsys):
    """None -> the smallest K with eval_windows / (3 · H · batch · grad_accum · workers · K) <= 5 %."""
    from ray_diloco.cli import build_parser, resolve_config
    from ray_diloco.run_setup import resolve_eval_every, training_groups

    def resolved(*argv):
        cfg = resolve_config(build_parser().parse_args(["train", *argv]))
        return resolve_eval_every(cfg, training_groups(cfg)).run.eval_every

    assert resolved() == 2  # tiny-cpu, 2 regions x 1 worker: 64 / (0.15 * 15 * 8 * 2) = 1.78
    assert "held-out evaluation every 2 outer step(s)" in capsys.readouterr().out
    assert resolved("--preset", "150m") == 1  # 256 / (0.15 * 500 * 16 * 16) = 0.013
    assert resolved("--inner-steps", "4", "--outer-steps", "3") == 0  # K = 7 > T: the end's only
    assert "at the end only" in capsys.readouterr().out
    assert resolved("--eval-every", "5") == 5 and resolved("--eval-every", "0") == 0  # given: kept
