"""The simulator's engine and trainer mechanics against hand-worked timelines."""

from __future__ import annotations

import heapq
from collections import deque
from types import SimpleNamespace

import pytest

from tiderl.policy.ra2p import Ra2pMode
from tiderl.sim.costs import Costs
from tiderl.sim.engine import SimEngine
from tiderl.sim.trainer import Trainer, TrainerKind


def costs(**kw) -> Costs:
    base = dict(
        weights_read_s=0.01, kv_read_s_per_token=0.0, flop_s_per_token=0.0, attn_flop_s_per_token_pos=0.0,
        step_overhead_s=0.0, prefill_chunk_tokens=100, max_num_seqs=8, kv_capacity_tokens=1000,
        train_s_per_token=0.001, train_attn_s_per_token_pos=0.0, swap_s=0.5, weight_sync_s=1.0,
        optimizer_s_multi_node=0.0, optimizer_s_single_node=0.0, phase_switch_s=0.0, train_state_bytes=1.0,
        network_bytes_per_s=1.0, communicator_init_s=0.0, gpus_per_node=8,
    )
    base.update(kw)
    return Costs(**base)


# -- engine ------------------------------------------------------------------------------------
def test_engine_turn_then_prefix_hit():
    e = SimEngine(costs(), 1000)
    e.submit(0.0, "a", ctx=50, gen_tokens=10, kept=False)
    # 50 prompt tokens fit one 100-token chunk: 1 iteration, then 10 decode iterations of 10 ms.
    assert e.next_event_s() == pytest.approx(0.11)
    assert e.pop_finished(0.11) == ["a"]
    assert e.cached_tokens("a") == 60
    # Next turn: 60 cached + 40 observed; only the 40 new tokens are prefilled.
    e.submit(0.11, "a", ctx=100, gen_tokens=5, kept=False)
    assert (e.query_tokens, e.hit_tokens) == (150, 60)
    assert e.next_event_s() == pytest.approx(0.11 + 0.06)


def test_engine_batch_shares_iterations_and_chunked_prefill_queues():
    e = SimEngine(costs(), 10_000)
    e.submit(0.0, "a", ctx=250, gen_tokens=10, kept=False)  # 3 chunks of prefill
    e.submit(0.0, "b", ctx=50, gen_tokens=1, kept=False)  # behind a's 250 tokens: starts at 300/100 = 3
    # b: decoding starts after iteration 3, one token -> done after 4 iterations.
    assert e.next_event_s() == pytest.approx(0.04)
    assert e.pop_finished(0.04) == ["b"]
    # a: generation starts after 2.5 iterations, 10 tokens -> 12.5 iterations.
    assert e.next_event_s() == pytest.approx(0.125)


def test_engine_evicts_lru_ordinary_before_kept_and_partially():
    e = SimEngine(costs(), 1000)
    for task, ctx, kept in (("old", 300, False), ("kept", 300, True), ("new", 300, False)):
        e.submit(0.0, task, ctx=ctx - 1, gen_tokens=1, kept=kept)
        e.pop_finished(e.next_event_s())
    assert e.cached_tokens("old") == 300 and e.used_tokens() == 900
    e.submit(1.0, "big", ctx=400, gen_tokens=1, kept=False)
    # Needs 300 more tokens: 'old' (least recent ordinary) goes entirely, 'kept' untouched.
    assert e.cached_tokens("old") == 0 and e.cached_tokens("kept") == 300 and e.cached_tokens("new") == 300
    e.submit(1.0, "bigger", ctx=150, gen_tokens=1, kept=False)
    # 'big' still pins 400: 150 over, taken from the tail of 'new' (the only ordinary entry).
    assert e.cached_tokens("new") == 150 and e.cached_tokens("kept") == 300


def test_engine_preempts_the_newest_request_and_recomputes_it():
    e = SimEngine(costs(), 100)
    e.submit(0.0, "first", ctx=40, gen_tokens=50, kept=False)
    e.submit(0.0, "second", ctx=40, gen_tokens=50, kept=False)
    # Both prefilled in one iteration; each then grows one token per iteration: 80 + 2 x 20 > 100.
    e.pop_finished(0.215)
    assert e.preemptions == 1
    assert e.abort("second") == (40 + 20, 30)  # back in the queue, its 20 tokens kept, to recompute
    assert e.cached_tokens("second") == 0


def test_engine_flush_interrupts_and_stalls():
    e = SimEngine(costs(), 1000)
    e.submit(0.0, "a", ctx=50, gen_tokens=10, kept=False)
    e.pop_finished(0.11)
    e.submit(0.11, "b", ctx=50, gen_tokens=100, kept=False)
    out = e.flush(0.31, stall_s=1.0)
    assert out == [("b", 50 + 19, 81)]  # 1 prefill + 19 decode iterations done
    assert e.used_tokens() == 0 and e.cached_tokens("a") == 0
    e.submit(0.31, "b", 69, 81, kept=False)
    assert e.next_event_s() == pytest.approx(1.31 + 0.82)  # the stall, then 1 + 81 iterations


# -- trainer -----------------------------------------------------------------------------------
class Loop:
    def __init__(self) -> None:
        self.heap: list = []
        self.n = 0
        self.done_at: list[float] = []

    def schedule(self, t, fn, *args):
        self.n += 1
        heapq.heappush(self.heap, (t, self.n, fn, args))

    def run(self) -> None:
        while self.heap:
            t, _, fn, args = heapq.heappop(self.heap)
            fn(t, *args)


def group(*tokens: int) -> SimpleNamespace:
    return SimpleNamespace(seq_tokens=list(tokens), gen_tokens=0)


def make(kind: TrainerKind) -> tuple[Trainer, Loop]:
    loop = Loop()
    trainer = Trainer(costs(), kind, micro_batch_tokens=1000, schedule=loop.schedule,
                      on_compute_done=loop.done_at.append)
    return trainer, loop


def test_colocated_burst_and_aggregation():
    # Two actors; a micro-batch of two 1000-token sequences: a 1 s share each.
    # One burst = swap + ref 1 s + swap + actor forward 1 s + backward 2 s = 5 s.
    t, loop = make(TrainerKind.RA2P)
    t.begin_step(0.0, 2, 0, Ra2pMode.COLOCATED, 1)
    t.offer(0.0, deque([group(1000, 1000)]))
    loop.run()
    assert loop.done_at == [pytest.approx(5.0)]
    # Two micro-batches ready together: one burst of both = 1 + 2 x (1 + 3) = 9 s.
    t, loop = make(TrainerKind.RA2P)
    t.begin_step(0.0, 2, 0, Ra2pMode.COLOCATED, 2)
    t.offer(0.0, deque([group(1000, 1000), group(1000, 1000)]))
    loop.run()
    assert loop.done_at == [pytest.approx(9.0)] and t.stats.num_swaps == 2


def test_vanilla_stream_swaps_per_microbatch():
    t, loop = make(TrainerKind.STREAM)
    t.begin_step(0.0, 2, 0, Ra2pMode.COLOCATED, 2)
    t.offer(0.0, deque([group(1000, 1000), group(1000, 1000)]))
    loop.run()
    assert loop.done_at == [pytest.approx(10.0)] and t.stats.num_swaps == 4


def second_group_at_10s(t: Trainer, loop: Loop) -> None:
    """One group ready at the step start, a second one at 10 s; run to the end."""
    buffer = deque([group(1000, 1000)])
    t.offer(0.0, buffer)
    loop.schedule(10.0, lambda now: (buffer.append(group(1000, 1000)), t.offer(now, buffer)))
    loop.run()


def test_batch_waits_for_the_whole_batch_and_counts_the_wait():
    t, loop = make(TrainerKind.BATCH)
    t.begin_step(0.0, 2, 0, Ra2pMode.COLOCATED, 2)
    second_group_at_10s(t, loop)
    assert loop.done_at == [pytest.approx(19.0)]
    assert t.stats.twt_gpu_s == pytest.approx(2 * 10.0)


def test_decoupled_pipeline_timeline():
    # One ref for two actors, one micro-batch at 0, shares of 1 s:
    #   ref:    share 0 [0, 1], share 1 [1, 2]
    #   actor0: forward [0, 1], backward [1, 3]
    #   actor1: forward [0, 1], waits for its ref result until 2, backward [2, 4]
    t, loop = make(TrainerKind.RA2P)
    t.begin_step(0.0, 2, 1, Ra2pMode.DECOUPLED, 1)
    t.offer(0.0, deque([group(1000, 1000)]))
    loop.run()
    assert loop.done_at == [pytest.approx(4.0)]
    # Bubble: actor1's 1 s wait + drain (actor0 1 s, ref 2 s); no swap at all.
    assert t.stats.bubble_gpu_s == pytest.approx(4.0) and t.stats.num_swaps == 0


def test_a_decoupled_step_pays_its_measured_coordination_once_and_colocated_none():
    # The timeline above plus `decoupled_step_s` at the step's end; a colocated step is unchanged.
    loop = Loop()
    t = Trainer(costs(decoupled_step_s=0.25), TrainerKind.RA2P, micro_batch_tokens=1000, schedule=loop.schedule,
                on_compute_done=loop.done_at.append)
    t.begin_step(0.0, 2, 1, Ra2pMode.DECOUPLED, 2)
    t.offer(0.0, deque([group(1000, 1000), group(1000, 1000)]))
    loop.run()
    # Two micro-batches at 0: actor1's second backward ends at 7 s (its ref results at 2 and 4).
    assert loop.done_at == [pytest.approx(7.0 + 0.25)]
    loop = Loop()
    t = Trainer(costs(decoupled_step_s=0.25), TrainerKind.RA2P, micro_batch_tokens=1000, schedule=loop.schedule,
                on_compute_done=loop.done_at.append)
    t.begin_step(0.0, 2, 0, Ra2pMode.COLOCATED, 1)
    t.offer(0.0, deque([group(1000, 1000)]))
    loop.run()
    assert loop.done_at == [pytest.approx(5.0)]


def test_decoupled_waits_count_the_actor_ranks_apart_from_the_ref_ranks():
    # As above, then a second micro-batch at 10 s: the ref (free at 2) waits 8 s, actor0 (free at 3)
    # 7 s and actor1 (free at 4) 6 s. ERS's trainer wait is the actor ranks' (the control plane
    # reads the actor ranks' `twt_s`), so the actors' 13 s are kept apart from the ref's.
    t, loop = make(TrainerKind.RA2P)
    t.begin_step(0.0, 2, 1, Ra2pMode.DECOUPLED, 2)
    second_group_at_10s(t, loop)
    assert loop.done_at == [pytest.approx(14.0)]
    assert t.stats.twt_gpu_s == pytest.approx(8.0 + 7.0 + 6.0)
    assert t.stats.actor_wait_gpu_s == pytest.approx(7.0 + 6.0)
