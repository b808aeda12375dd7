"""Images in the simulator's workloads (issue 15, item 6): every observation carries a screenshot of
`image_tokens`, and the sliding window of the paper (Appendix C.2: once ten images have accumulated, keep
the five most recent) prunes the context and splits the trajectory there."""

from __future__ import annotations

import pytest
from sim_helpers import small_dicts

from tiderl.config import ConfigError
from tiderl.config.schema import build
from tiderl.sim.simulator import Simulation
from tiderl.sim.spec import ClusterSpec, WorkloadSpec
from tiderl.sim.systems import parse_system
from tiderl.sim.workload import TaskSampler

IMG = 500


def _specs(**window) -> tuple[WorkloadSpec, ClusterSpec]:
    w, c = small_dicts()
    w["max_context_tokens"] = 32768
    for t in w["task_types"]:
        t["image_tokens"] = IMG
        t["turns_mean"] = {"start": 7, "end": 7}
        t["turns_min"] = 6
        t["turns_max"] = 12
    w.update(window)
    return build(WorkloadSpec, w, "w"), build(ClusterSpec, c, "c")


def _plans(workload: WorkloadSpec) -> list:
    sampler = TaskSampler(workload, seed=0)
    return [p for g in range(20) for p in sampler.group(g, 0, 4, False)]


def _images_seen(plan, keep: int, limit: int) -> list[int]:
    """Images in the context at each turn, walked from the plan's own prune points."""
    images, out = 1, [1]
    for cut in plan.prune_tokens or [0] * len(plan.obs_tokens):
        images += 1
        if cut:
            assert images == limit and cut == (limit - keep) * IMG
            images = keep
        out.append(images)
    return out


def _cached_before_oldest_image(plan) -> dict[int, int]:
    """Per prune, the context's tokens before the oldest image it drops, walked message by message."""
    messages = [("image", IMG), ("text", plan.prompt_tokens - IMG)]  # the prompt: its picture, then its text
    out = {}
    for i, o in enumerate(plan.obs_tokens):
        messages.append(("text", plan.gen_tokens[i]))
        cut = plan.prune_tokens[i] if i < len(plan.prune_tokens) else 0
        if cut:
            first = next(k for k, (kind, _) in enumerate(messages) if kind == "image")
            out[i] = sum(n for _, n in messages[:first])
            for _ in range(cut // IMG):
                messages.remove(("image", IMG))
        messages += [("image", IMG), ("text", o - IMG)]
    return out


def test_the_window_prunes_to_the_newest_images_and_splits_the_trajectory() -> None:
    text, _ = _specs()
    windowed, _ = _specs(max_images=4, keep_images=2)
    for plain, cut in zip(_plans(text), _plans(windowed)):
        assert plain.prune_tokens == []  # no window: images accumulate
        assert plain.segments == [plain.prompt_tokens + sum(plain.gen_tokens) + sum(plain.obs_tokens)]
        # The same draws; each observation carries its screenshot.
        assert (cut.gen_tokens, cut.obs_tokens) == (plain.gen_tokens, plain.obs_tokens)
        assert all(o > IMG for o in cut.obs_tokens)
        seen = _images_seen(cut, keep=2, limit=4)
        assert max(seen) <= 3 and seen[:3] == [1, 2, 3][: len(seen)]  # pruned as the 4th arrives
        prunes = sum(1 for c in cut.prune_tokens if c)
        assert len(cut.segments) == prunes + 1
        # Each part ends where the next observation would have filled the window; the next starts with
        # the pruned context: the trained tokens exceed the trajectory's by the contexts trained twice.
        assert sum(cut.segments) >= cut.prompt_tokens + sum(cut.gen_tokens) + sum(cut.obs_tokens) - sum(cut.prune_tokens)
        assert cut.turn_prefills()[0] == (cut.prompt_tokens, 0)
        # After a prune everything from the oldest pruned image on is prefilled again. Images come first in
        # their message (the run's chat format): the first prune keeps nothing cached; a later one keeps the
        # text before the oldest image left, the prompt's text, actions and observations up to there.
        walked = _cached_before_oldest_image(cut)
        pruned = [i for i, c in enumerate(cut.prune_tokens) if c]
        for n, i in enumerate(pruned):
            new, cached = cut.turn_prefills()[i + 1]
            assert cached == walked[i] == cut.prune_kept[i] and new > cut.obs_tokens[i]
            assert (cached == 0) == (n == 0)
    assert any(any(p.prune_tokens) for p in _plans(windowed))


def test_a_window_must_keep_fewer_images_than_it_holds() -> None:
    with pytest.raises((ConfigError, ValueError), match="keep_images"):
        _specs(max_images=4, keep_images=4)


def test_a_pruned_context_is_prefilled_again_and_trained_in_parts() -> None:
    runs = {}
    for name, window in (("all", {}), ("window", {"max_images": 4, "keep_images": 2})):
        workload, cluster = _specs(**window)
        runs[name] = Simulation(workload, cluster, parse_system("tiderl-noers@0.5"), steps=3, seed=0).run()
    all_images, window = runs["all"], runs["window"]
    # The same generation; the window keeps contexts shorter but re-prefills them and trains the parts.
    assert window["consumed_tokens"] != all_images["consumed_tokens"]
    assert window["kv_hit_rate"] < all_images["kv_hit_rate"]
