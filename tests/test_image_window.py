"""The sliding image window (issue 15 item 4; the paper's Appendix C.2: once ten images have accumulated,
keep the five most recent): which images a context keeps and where the trajectory splits, the window across a
hand-over, the run store keeping the split, and the trainer scoring each part with exactly the context the
engine saw."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tiderl.config import load_job
from tiderl.rollout.agent_loop import LoopLimits, TaskRun, progress_of, run_task
from tiderl.rollout.trajectory import (NO_VERSION, Segment, TaskProgress, drop_spans, make_group, segment_view,
                                       window_segments)

ROOT = Path(__file__).resolve().parents[1]


def test_the_window_keeps_the_newest_images_once_the_limit_would_be_reached() -> None:
    paper = LoopLimits(max_turns=50, max_context_tokens=1 << 20, max_new_tokens=8, max_images=10, keep_images=5)
    assert [paper.images_to_drop(kept, 1) for kept in range(1, 10)] == [0] * 8 + [5]
    assert paper.images_to_drop(8, 2) == 5  # two new: 10 would be reached; 5 stay, both new among them
    assert paper.images_to_drop(3, 7) == 3  # the observation's own images are never pruned
    off = LoopLimits(max_turns=50, max_context_tokens=1 << 20, max_new_tokens=8, max_images=10)
    assert off.images_to_drop(9, 1) == 0
    for keep in (0, 10, 11):
        with pytest.raises(ValueError, match="keep_images"):
            LoopLimits(max_turns=5, max_context_tokens=100, max_new_tokens=8, max_images=10, keep_images=keep)


def test_the_job_config_refuses_a_window_that_keeps_as_many_as_it_holds() -> None:
    with pytest.raises(Exception, match="keep_images"):
        load_job(ROOT / "jobs" / "quickstart-vision.yaml", ["rollout.max_images=4", "rollout.keep_images=4"])
    job = load_job(ROOT / "jobs" / "quickstart-vision.yaml", ["rollout.max_images=4", "rollout.keep_images=2"])
    assert (job.rollout.max_images, job.rollout.keep_images) == (4, 2)


def test_segments_views_and_spans() -> None:
    assert window_segments(10, []) == [Segment(0, 10, 0)]
    assert window_segments(10, [(4, 2), (7, 3)]) == [Segment(0, 4, 0), Segment(4, 7, 2), Segment(7, 10, 3)]
    for bad in ([(0, 1)], [(4, 2), (4, 3)], [(4, 2), (6, 2)], [(10, 1)]):
        with pytest.raises(ValueError, match="prunes"):
            window_segments(10, bad)
    assert drop_spans(list(range(10)), [(1, 3), (5, 6)]) == [0, 3, 4, 6, 7, 8, 9]
    # ids: 100 = an image placeholder at 1-2 and 5-6; the part from 4 on dropped the first image
    ids = [7, 100, 101, 8, 9, 100, 101, 10]
    mask = [0, 0, 0, 1, 0, 0, 0, 1]
    v = segment_view(Segment(4, 8, 1), [(1, 3), (5, 7)], ids, mask, [-m * 0.5 for m in mask],
                     [3 if m else NO_VERSION for m in mask])
    assert v.token_ids == [7, 8, 9, 100, 101, 10]
    assert v.loss_mask == [0, 0, 0, 0, 0, 1]  # the earlier part's sampled id is carried, not trained again
    assert v.logprobs == [0.0] * 5 + [-0.5] and v.versions == [NO_VERSION] * 5 + [3]
    assert v.images == range(1, 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiderl.cli import main

    out = tmp_path_factory.mktemp("vl") / "tiny-gridimage"
    assert main(["init-model", "--env", "gridimage", "--out", str(out), "--train-steps", "0"]) == 0
    return out


def _play(model_dir: Path, limits: LoopLimits, seed: int = 3, handover_at: int | None = None):
    """gridimage in-process against a scripted engine that always goes up (the task runs to max_turns). With
    `handover_at`, the task is stopped before that generation and carried on from its progress, as a rank
    hand-over does."""
    from fake_engine import FakeEngine
    from tiderl.rollout.from_config import chat_format
    from tiderl.rollout.local_env import LocalEnvLink

    fmt = chat_format(model_dir)
    engine = FakeEngine(lambda prompt: fmt.encode("up"))
    env = LocalEnvLink()
    spec = make_group("g0", "gridimage", seed=seed, group_size=1).tasks[0]
    contexts: list[int] = []
    carried: list[TaskProgress] = []

    class Gate:
        async def before_generate(self, run: TaskRun, link: object) -> None:
            assert run.trajectory is not None
            contexts.append(run.context_tokens)
            assert run.context_tokens == run.trajectory.engine_tokens
            if handover_at is not None and len(engine.prompts) == handover_at and not carried:
                progress = progress_of(run, None)
                assert progress is not None
                carried.append(TaskProgress.from_json(progress.to_json()))
                run.handoff = True
                raise asyncio.CancelledError

        def after_turn(self, run: TaskRun) -> None:
            pass

    async def go():
        try:
            return await run_task(spec, TaskRun(spec=spec), engine, env, fmt, limits, Gate())
        except asyncio.CancelledError:
            (progress,) = carried
            moved = make_group("g0", "gridimage", seed=seed, group_size=1).tasks[0]
            import dataclasses

            moved = dataclasses.replace(moved, progress=progress)
            return await run_task(moved, TaskRun(spec=moved), engine, env, fmt, limits, Gate())

    return fmt, engine, asyncio.run(go()), carried


def test_the_window_prunes_the_oldest_images_and_splits_the_trajectory(model_dir: Path) -> None:
    limits = LoopLimits(max_turns=12, max_context_tokens=4096, max_new_tokens=4, max_images=4, keep_images=2)
    fmt, engine, t, _ = _play(model_dir, limits)
    assert t.num_turns == 8 and len(t.images) == 8  # gridimage's 8 moves: the first picture, one per observation
    # Images shown per generation: 1, 2, 3, then at the 4th the window keeps 2 ... (never 4 in one context)
    shown = [len(images) for images in engine.images]
    assert shown == [1, 2, 3, 2, 3, 2, 3, 2]
    # ... the newest of the task's pictures: those from the 1st, 1st, 1st, 3rd, 3rd, 5th, 5th, 7th on
    for prompt, images, first in zip(engine.prompts, engine.images, [0, 0, 0, 2, 2, 4, 4, 6]):
        assert list(prompt).count(fmt.image_pad_id) == len(images)
        assert all(a is b for a, b in zip(images, t.images[first:first + len(images)]))  # these very pictures
    # Split where the window pruned: before the observations of turns 3, 5 and 7 (at the end of that action)
    assert [d for _, d in t.prunes] == [2, 4, 6]
    assert all(t.token_ids[at - 1] == fmt.end_of_turn_id for at, _ in t.prunes)
    # The whole task is kept: every picture's placeholder, every sampled id once
    assert t.token_ids.count(fmt.image_pad_id) == len(t.images) == len(t.image_spans)


def test_the_trainer_scores_each_part_with_the_context_the_engine_saw(model_dir: Path) -> None:
    from tiderl.store.types import ReadyTrajectory
    from tiderl.trainer.images import ImageInputs
    from tiderl.trainer.store_io import samples_from_ready

    limits = LoopLimits(max_turns=12, max_context_tokens=4096, max_new_tokens=4, max_images=4, keep_images=2)
    fmt, engine, t, _ = _play(model_dir, limits)
    ready = ReadyTrajectory(id=1, group_id=1, rank=1, token_ids=t.token_ids, loss_mask=t.loss_mask,
                            logprobs=t.logprobs, token_versions=t.versions, reward=1.0, advantage=0.5,
                            num_tokens=len(t.token_ids), num_generated=sum(t.loss_mask), min_version=0,
                            ready_at=0.0, finish=t.finish, images=tuple(i.data for i in t.images),
                            prunes=tuple(t.prunes))
    inputs = ImageInputs(model_dir)
    spans = inputs.placeholder_spans(t.token_ids)
    segments = window_segments(len(t.token_ids), t.prunes)
    assert len(segments) == 4
    views = [segment_view(s, spans, t.token_ids, t.loss_mask, t.logprobs, t.versions) for s in segments]
    # Each generation's prompt is a prefix of its part's ids, with its part's images; the part ends with the
    # part's last generation: the trainer scores exactly the contexts the engine saw.
    calls = iter(zip(engine.prompts, engine.images))
    sampled = 0
    for v in views:
        last = None
        for prompt, images in calls:
            assert list(prompt) == v.token_ids[:len(prompt)]
            assert list(images) == [t.images[i] for i in v.images][:len(images)]
            last = prompt
            if len(images) == len(v.images) and len(v.token_ids) - len(prompt) <= limits.max_new_tokens + 1:
                break
        assert last is not None
        assert v.loss_mask[len(last):] == [1] * (len(v.token_ids) - len(last))  # the part ends with its last action
        sampled += sum(v.loss_mask)
    assert next(calls, None) is None
    assert sampled == sum(t.loss_mask)  # each sampled id is trained once, in its own part
    samples = samples_from_ready(ready, inputs)
    assert len(samples) == 4 and all(s.advantage == 0.5 for s in samples)
    assert sum(sum(s.loss_mask) for s in samples) == sum(t.loss_mask)
    for s, v in zip(samples, views):
        assert s.images is not None and int(s.images.grid_thw.shape[0]) == len(v.images)
        assert s.num_tokens == len(v.token_ids) + 3 * len(v.images)  # each placeholder: its 4 tokens


def test_a_handed_over_task_keeps_its_window(model_dir: Path) -> None:
    limits = LoopLimits(max_turns=12, max_context_tokens=4096, max_new_tokens=4, max_images=4, keep_images=2)
    _, whole_engine, whole, _ = _play(model_dir, limits)
    _, engine, moved, carried = _play(model_dir, limits, handover_at=4)
    (progress,) = carried
    assert progress.prunes == ((whole.prunes[0][0], 2),)  # one prune before the 5th generation
    assert moved.prunes == whole.prunes and moved.token_ids == whole.token_ids and moved.images == whole.images
    # The rank that carried it on gave the engine the same pruned contexts as the one that played it all
    assert engine.prompts[4:] == whole_engine.prompts[4:] and engine.images[4:] == whole_engine.images[4:]


def test_the_store_keeps_where_the_trajectory_split(tmp_path: Path) -> None:
    from tiderl.rundir import create_run
    from tiderl.store.types import FinishedTrajectory, NewGroup, RankReport, Role, RunState, TaskKind

    config = load_job(ROOT / "jobs" / "quickstart.yaml", ["rollout.group_size=2"])
    _, store = create_run(config, tmp_path / "run")
    store.register_initial_version("m", "0")
    store.register_rank(1, Role.ROLLOUT)
    store.set_run_state(RunState.RUNNING)
    store.add_groups([NewGroup(TaskKind.TRAIN, 3, 2)])
    ids, mask = [1, 2, 3, 4, 5, 6], [0, 1, 0, 1, 0, 1]
    finished = [FinishedTrajectory(task_id=c.task_id, token_ids=ids, loss_mask=mask, logprobs=[-0.1 * m for m in mask],
                                   token_versions=[0 if m else -1 for m in mask], num_turns=3, reward=float(i),
                                   success=bool(i), prunes=((2, 1), (4, 3)) if i else ())
                for i, c in enumerate(store.claim_tasks(1, 2))]
    store.report(RankReport(rank=1, finished=finished))
    rows = store.tx.read(lambda c: c.exec_driver_sql("SELECT prunes FROM trajectories ORDER BY id").fetchall())
    assert [r[0] for r in rows] == [None, "[[2, 1], [4, 3]]"]  # readable with SQL
    store.register_rank(0, Role.ACTOR)
    got = store.claim_ready_groups(0, 1)
    assert sorted(t.prunes for t in got) == [(), ((2, 1), (4, 3))]
