"""One place for each concept (project issue 50): where a rule is used in several places, every user
asks the one function that defines it, and nothing computes it on its own again.

- The refs keep up with the actors: `policy.ra2p.refs_needed` / `refs_keep_up`, asked by the paper planner
  (`policy.ers`), the rate planner's moves and candidate splits (`policy.ers.choose`), the trainer
  re-partition (`policy.ers.trainer`) and the simulator's fixed splits (`sim.report`).
- The groups in flight, (staleness + 1) x batch or ERS's admission cap where smaller:
  `policy.admission.inflight_bound`, asked by the feed (`systems.feed_allowance`), the admission cap,
  the rate planner (handed the cap the feed keeps, by the control plane and the simulator alike) and the
  simulator's latency bound (`sim.metrics`).
- A trainer rank's chunk loop: `run.trainer_role._train_chunks`, for the leader, a follower and a ref.
- Run paths: `tiderl/paths.py` alone names the run directory's parts (a source scan of string constants).
"""

from __future__ import annotations

import ast
import re
import types
from dataclasses import replace
from pathlib import Path

import pytest

from tiderl.policy.admission import inflight_bound, inflight_cap
from tiderl.policy.ers import ErsLimits, ErsPolicy, ErsSignals, StepObservation
from tiderl.policy.ers import choose as ers_choose
from tiderl.policy.ers.choose import _one_move, candidates
from tiderl.policy.ers.model import Split, estimate
from tiderl.policy.ers.overrides import plan_paper
from tiderl.policy.ers.signals import ErsSnapshot, build_signals
from tiderl.policy.ra2p import StageTimes, refs_keep_up, refs_needed
from tiderl.roles import Role
from tiderl.systems import feed_allowance

PACKAGE = Path(__file__).resolve().parents[1] / "tiderl"
R, A, F = Role.ROLLOUT, Role.ACTOR, Role.REF


def _times(t_ref: float, t_f: float, t_b: float) -> StageTimes:
    return StageTimes(t_ref_s=t_ref, t_act_f_s=t_f, t_act_b_s=t_b, t_swap_s=0.01)


# (stage times, actor counts): clear cases on both sides, and the roofline's ties (t_ref = t_act_f,
# t_act_b = 2 t_act_f: one ref per three actors keeps up exactly) at step sizes that round differently.
TIMES = [_times(0.5, 1.0, 2.0), _times(0.1, 0.2, 0.4), _times(2.0, 0.5, 0.5), _times(0.3, 0.1, 0.2),
         _times(0.1, 0.1, 0.2), _times(0.7, 0.7, 1.4), _times(1 / 3, 1 / 3, 2 / 3), _times(0.0, 1.0, 1.0), None]
ACTORS = [1, 2, 3, 4, 6, 7, 9, 12]


def test_refs_needed_is_the_smallest_count_that_keeps_up():
    for times in TIMES:
        for m in ACTORS:
            need = refs_needed(m, times)
            if times is None:
                assert need == 0 and refs_keep_up(m, 1, times) and not refs_keep_up(m, 0, times)
                continue
            assert need >= 1 and refs_keep_up(m, need, times) and not refs_keep_up(m, need - 1, times)
            work = times.t_act_f_s + times.t_act_b_s
            # M t_ref / R <= t_act_f + t_act_b, a tie (within float rounding) keeping up.
            assert m * times.t_ref_s / need <= work * (1 + 1e-9)
            if need > 1:
                assert m * times.t_ref_s / (need - 1) > work * (1 + 1e-9)
    # The roofline's ties keep up, however the floats round.
    for x in (0.1, 0.7, 1 / 3, 1e-3, 12.3):
        for r in (1, 2, 3, 4, 5):
            assert refs_needed(3 * r, _times(x, x, 2 * x)) == r


def test_the_paper_planner_adds_a_ref_rank_exactly_while_the_refs_do_not_keep_up():
    # A consumption deficit (HoL 250 s > the mean step of 100 s); fixed actors: the only move is a rollout
    # rank to ref, made exactly when the refs before it do not keep up.
    limits = ErsLimits(groups_min=4, groups_ideal=8, max_moves_per_step=1)
    for times in TIMES:
        signals = ErsSignals(ras_microbatches=6, ready_groups=20, hol_latency_s=250.0, tprm_s=1.0,
                             step_history_s=(100.0, 100.0), stage_times=times)
        for m in ACTORS:
            for refs in range(0, 4):
                roles = (R, R, R) + (F,) * refs + (A,) * m
                added = sum(1 for r in plan_paper(roles, signals, limits).roles if r is F) - refs
                assert added == (0 if refs_keep_up(m, refs, times) else 1), (times, m, refs)


def test_the_rate_planner_moves_a_rank_to_ref_exactly_while_the_refs_do_not_keep_up():
    limits = ErsLimits(groups_min=2, groups_ideal=4, policy=ErsPolicy.RATE)
    for times in TIMES:
        for m in ACTORS:
            for refs in range(0, 4):
                now = Split(rollout=4, actors=m, refs=refs)
                roles = (R,) * 4 + (F,) * refs + (A,) * m
                moved = _one_move(roles, now, replace(now, rollout=3, refs=refs + 1), limits, times)
                assert (moved is not None) == (not refs_keep_up(m, refs, times)), (times, m, refs)


def test_the_rate_planner_s_candidates_hold_refs_up_to_the_count_that_keeps_up():
    limits = ErsLimits(groups_min=2, groups_ideal=4, policy=ErsPolicy.RATE)
    for times in TIMES:
        for m in ACTORS:
            splits = candidates(Split(rollout=100, actors=m, refs=0), limits, times)
            assert max(s.refs for s in splits) == refs_needed(m, times), (times, m)


def test_the_trainer_repartition_holds_refs_up_to_the_count_that_keeps_up(monkeypatch):
    # Priced so that every further ref rank looks cheaper: the re-partition then picks the most ref
    # ranks it allows, r <= refs_needed(total - r).
    monkeypatch.setattr(ers_choose, "ready_compute_s",
                        lambda step, actors, refs, times, mb, slower=1.0: 100.0 / (1 + refs))
    window = (StepObservation(version=5, duration_s=10.0, consumed_tokens=4000, rollout_ranks=2, actor_ranks=4,
                              ref_ranks=0),)
    limits = ErsLimits(groups_min=2, groups_ideal=4, policy=ErsPolicy.RATE, elastic_actors=True)
    for times in [t for t in TIMES if t is not None]:
        for total in (2, 4, 6, 8, 12):
            signals = ErsSignals(ras_microbatches=0, ready_groups=0, hol_latency_s=0.0, tprm_s=None,
                                 stage_times=times, window=window, micro_batch_tokens=250)
            allowed = max(r for r in range(0, total) if r <= refs_needed(total - r, times))
            got = ers_choose.repartition(Split(rollout=2, actors=total, refs=0), signals, limits)
            assert (got or 0) == allowed, (times, total)


def test_the_simulator_s_fixed_splits_ask_the_same_rule():
    from sim_helpers import small_specs
    from tiderl.sim.costs import derive_costs
    from tiderl.sim.report import refs_to_keep_up

    _, cluster = small_specs(8)
    costs = derive_costs(cluster)
    times = StageTimes(t_ref_s=costs.ref_ratio, t_act_f_s=1.0, t_act_b_s=costs.backward_ratio, t_swap_s=0.0)
    for m in ACTORS:
        assert refs_to_keep_up(costs, m) == max(1, refs_needed(m, times))


# ---- the groups in flight -------------------------------------------------------------------------------

BOUNDS = [(batch, s, cap) for batch in (1, 4, 32) for s in (0, 1, 3) for cap in (None, 1, 5, 40, 1000)]


def test_the_bound_is_staleness_plus_one_batches_or_the_cap_where_smaller():
    for batch, s, cap in BOUNDS:
        full = (s + 1) * batch
        assert inflight_bound(batch, s, cap) == (full if cap is None else min(full, cap))


def test_the_feed_and_the_admission_cap_ask_the_bound():
    for batch, s, cap in BOUNDS:
        assert feed_allowance(0, batch, s, cap) == inflight_bound(batch, s, cap)
        assert feed_allowance(3, batch, s, cap) == max(0, inflight_bound(batch, s, cap) - 3)
        assert inflight_cap(None, (), batch, s) == inflight_bound(batch, s)  # it starts at the bound
        assert inflight_cap(10 ** 6, (), batch, s) == inflight_bound(batch, s)  # and never exceeds it


def _rate_signals(cap: int | None) -> ErsSignals:
    step = StepObservation(version=10, duration_s=10.0, consumed_tokens=4000, rollout_ranks=2, actor_ranks=2,
                           ref_ranks=0, produced_tokens=4000, groups_completed=4, group_latency_sum_s=80.0,
                           group_env_sum_s=40.0, rollout_busy_rank_s=20.0, trainer_wait_s=1.0)
    return ErsSignals(ras_microbatches=0, ready_groups=4, hol_latency_s=0.0, tprm_s=None, step_history_s=(10.0, 10.0),
                      stage_times=_times(0.1, 0.2, 0.4), microbatches_per_step=8, window=(step, step),
                      micro_batch_tokens=250, group_latency_s=20.0, group_env_s=10.0, tokens_per_group=1000.0,
                      inflight_cap=cap)


def test_the_rate_planner_prices_the_groups_the_feed_keeps_in_flight():
    for s in (0, 1, 3):
        limits = ErsLimits(groups_min=2, groups_ideal=4, policy=ErsPolicy.RATE, max_staleness=s)
        for cap in (None, 4, 5, 6, 100):
            model = estimate(_rate_signals(cap), limits)
            assert model is not None
            inflight = inflight_bound(limits.groups_ideal, s, cap)
            assert model.inflight_groups == inflight
            # Little's law: (F - B/2) groups' tokens, (s + 1/2) B without a cap.
            assert model.little_tokens == pytest.approx((inflight - limits.groups_ideal / 2) * 1000.0)
        uncapped = estimate(_rate_signals(None), limits)
        assert uncapped is not None and uncapped.little_tokens == pytest.approx((s + 0.5) * 4 * 1000.0)


def test_the_signals_hand_the_planner_the_cap_the_feed_keeps():
    snapshot = ErsSnapshot(roles=(R, A), micro_batch_tokens=250, ready_tokens=0, ready_groups=0,
                           oldest_ready_age_s=None, inflight_cap=6)
    assert build_signals(snapshot, 3).inflight_cap == 6
    assert build_signals(replace(snapshot, inflight_cap=None), 3).inflight_cap is None


def _keywords_of_calls(path: Path, func: str) -> list[set[str]]:
    calls = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name == func:
                calls.append({k.arg for k in node.keywords if k.arg})
    return calls


def test_the_control_plane_and_the_simulator_build_the_same_snapshot_fields():
    """The rule for policies: the planner is handed the same inputs by both mechanisms, built by the same
    functions; so both name the same ErsSnapshot fields (the admission cap among them)."""
    (control,) = _keywords_of_calls(PACKAGE / "run" / "control.py", "ErsSnapshot")
    (sim,) = _keywords_of_calls(PACKAGE / "sim" / "ers_boundary.py", "ErsSnapshot")
    assert "inflight_cap" in control and control == sim


def test_the_simulator_s_latency_bound_asks_the_bound():
    from tiderl.sim.metrics import in_flight_limit_groups

    for b_ideal, fetch, fetched, s in [(8, 8, (), 1), (8, 4, (4, 6), 2), (32, 16, (32,), 0)]:
        sim = types.SimpleNamespace(b_ideal=b_ideal, fetch=fetch, staleness=s,
                                    records=[types.SimpleNamespace(fetch_groups=f) for f in fetched])
        assert in_flight_limit_groups(sim) == inflight_bound(max((b_ideal, fetch) + fetched), s)


def _staleness_products(tree: ast.AST) -> list[int]:
    """Lines computing `(… staleness + 1) * …` or `… * (… staleness + 1)`."""
    def staleness_plus_one(node: ast.expr) -> bool:
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)):
            return False
        names = [n for n in (node.left, node.right) if isinstance(n, (ast.Name, ast.Attribute))]
        ones = [n for n in (node.left, node.right) if isinstance(n, ast.Constant) and n.value == 1]
        return bool(names and ones) and any(
            (n.id if isinstance(n, ast.Name) else n.attr).endswith("staleness") for n in names)

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)
            and (staleness_plus_one(node.left) or staleness_plus_one(node.right))]


def test_no_module_but_admission_computes_the_bound():
    assert _staleness_products(ast.parse("limit = (max_staleness + 1) * batch\nx = b * (self.staleness + 1)")) == [1, 2]
    found = {str(path.relative_to(PACKAGE)): lines for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "admission.py" and (lines := _staleness_products(ast.parse(path.read_text())))}
    assert not found, f"(staleness + 1) x batch computed outside policy/admission.py (use inflight_bound): {found}"


# ---- the trainer's chunk loop ---------------------------------------------------------------------------

def _own_nodes(fn: ast.AST):
    """The nodes of a function's own body, not those of the functions defined in it."""
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def test_the_chunk_loop_is_written_once():
    """One loop feeds a step's chunks to a trainer rank (`_train_chunks`): the leader, a data-parallel
    follower and a ref call it with their own chunk source and start."""
    tree = ast.parse((PACKAGE / "run" / "trainer_role.py").read_text())
    functions = [fn for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def calls(fn: ast.AST, name: str) -> bool:
        return any(isinstance(c, ast.Call) and name in (getattr(c.func, "id", None), getattr(c.func, "attr", None))
                   for c in _own_nodes(fn))

    loops = [fn.name for fn in functions for node in _own_nodes(fn)
             if isinstance(node, (ast.While, ast.For, ast.AsyncFor)) and calls(node, "feed")]
    assert loops == ["_train_chunks"]
    assert {fn.name for fn in functions if calls(fn, "_train_chunks")} == {"_lead", "follow", "serve"}


# ---- run paths ------------------------------------------------------------------------------------------

MOVED = frozenset({"ckpt", "weights", "logs"})
"""Parts of the run directory that only tiderl/paths.py names (RunPaths): the checkpoint, weights and log
directories. (Other modules use "weights" and "logs" as words too: a dict key, a command's name; only a
path joined with them counts.)"""
NUMBERED = re.compile(r"^(step|v)$")
"""The numbered directories' prefixes: `ckpt/step{N}`, `weights/v{N}` (paths.checkpoint_dir, version_dir)."""
PARSED = re.compile(r"step\(|\^v\(")
"""A regular expression that parses those numbers (paths.checkpoint_steps_in, weight_versions_in)."""


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (a module's, a class's, a function's, an attribute's)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str) and (i == 0 or isinstance(body[i - 1], (ast.Assign,
                                                                                                   ast.AnnAssign)))):
                out.add(id(stmt.value))
    return out


def _path_parts(node: ast.AST) -> list[ast.expr]:
    """The operands a path is joined with: `a / b`, `Path(a, b)`, `x.joinpath(b)`."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return [node.left, node.right]
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if name in ("Path", "PurePath", "joinpath"):
            return list(node.args)
    return []


def run_path_fragments(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, what) of each run-path part a module names itself: a joined path part in MOVED, the string
    constant "ckpt" anywhere, an f-string `step{…}` anywhere or `v{…}` joined to a path, a pattern parsing
    `step(N)` or `v(N)`. Docstrings and comments do not count."""
    tree = ast.parse(source, filename)
    docs = _docstrings(tree)
    found = []
    joined = {id(part) for node in ast.walk(tree) for part in _path_parts(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value == "ckpt" or (id(node) in joined and node.value in MOVED):
                found.append((node.lineno, repr(node.value)))
            elif PARSED.search(node.value):
                found.append((node.lineno, f"pattern {node.value!r}"))
        elif isinstance(node, ast.JoinedStr) and len(node.values) >= 2:
            head, nxt = node.values[0], node.values[1]
            if (isinstance(head, ast.Constant) and isinstance(head.value, str) and NUMBERED.match(head.value)
                    and isinstance(nxt, ast.FormattedValue) and (head.value == "step" or id(node) in joined)):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_scan_finds_path_parts_and_not_words():
    source = '''
"""A docstring may say ckpt/step{N} and RUN_DIR / "logs"."""
import re
from pathlib import Path
root = Path("/r")
a = root / "ckpt"  # checkpoints
b = Path(root, "weights")
c = root.joinpath("logs")
d = f"step{3}"
e = root / f"v{2}"
f = re.compile(r"^step(\\d+)$")
g = {"weights": 1, "logs": 2}  # words, not paths
h = f"v{2}"  # a version shown, not a path
def fn():
    """ckpt/step{N} in a docstring."""
    return "the logs"
'''
    assert [line for line, _ in run_path_fragments(source)] == [6, 7, 8, 9, 10, 11]


def test_only_paths_py_names_the_run_directory_s_parts():
    found = {str(path.relative_to(PACKAGE)): hits for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "paths.py" and (hits := run_path_fragments(path.read_text(), str(path)))}
    assert not found, f"run paths built outside tiderl/paths.py (use RunPaths and its functions): {found}"


def test_run_paths_name_the_moved_parts(tmp_path: Path):
    from tiderl.paths import RunPaths
    from tiderl.slurm.submit import rank_step_argv, run_parameters

    paths = RunPaths(tmp_path).create()
    for v in (1, 2, 3):
        paths.weights_version(v).mkdir()
        paths.checkpoint(v).mkdir()
    (paths.weights / ".v4.tmp-x").mkdir()  # half-written: not a version
    assert paths.checkpoint_steps() == [1, 2, 3]
    assert paths.uncommitted(1) == [paths.weights_version(2), paths.weights_version(3), paths.checkpoint(2),
                                    paths.checkpoint(3)]
    assert paths.uncommitted(3) == []
    argv = rank_step_argv(tmp_path, num_ranks=2, num_tasks_per_node=2, cpus_per_task=1)
    assert f"--output={paths.rank_log('%t')}" in argv and str(paths.rank_log("%t")).endswith("logs/rank%t.log")

    from tiderl.config import load_job

    root = Path(__file__).resolve().parents[1]
    params = run_parameters(load_job(root / "jobs" / "quickstart.yaml", []), tmp_path)
    assert params["additional_parameters"]["output"].startswith(str(paths.logs) + "/")
