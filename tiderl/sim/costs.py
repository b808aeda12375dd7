"""Hardware costs of the simulator, derived from the cluster file by a roofline
model. Nothing here knows a system or a paper figure.

- Decode iteration: ``overhead + max(weights + KV bytes read / achieved
  bandwidth, tokens x FLOPs / achieved FLOP/s)``; every decoding sequence
  gains one token per iteration. Prefill chunks ride in the same iteration
  (chunked prefill) and add their FLOPs.
- KV capacity per rollout rank: (memory x utilisation - weights - activation
  reserve) / KV bytes per token.
- Training: forward FLOPs of a sequence of n tokens = 2 P n + 2 L d n^2
  (causal attention); backward = 2 x forward; the reference forward = the
  actor forward. Time = FLOPs / (peak x train MFU).
- Transfers: bytes / (nominal bandwidth x link efficiency).

A cluster file with a ``measured`` section (``tools/calibrate_cpu.py``)
replaces the roofline with the machine's own figures: an engine iteration
costs ``decode_step_s + running sequences x decode_s_per_seq + prefill
tokens x prefill_s_per_token``; the actor forward, backward and reference
forward cost their measured time per token; swap, reload and optimizer
times are measured too. With ``host_compute_slots`` the ranks are processes
of one host: while ranks demanding D cores compute at once (a busy rollout
rank ``rollout_busy_cores``, a trainer rank 1), each runs at
min(1, slots / D) of its measured speed (see :meth:`Costs.host_speed`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiderl.policy.host import HostShare, shared_speed
from tiderl.sim.spec import ClusterSpec


@dataclass(frozen=True, slots=True)
class Costs:
    weights_read_s: float
    """Reading the weights once: the memory floor of a decode iteration."""
    kv_read_s_per_token: float
    """Reading one context token's KV in a decode iteration."""
    flop_s_per_token: float
    """Dense forward FLOPs of one token at the rollout MFU (prefill and decode)."""
    attn_flop_s_per_token_pos: float
    """Attention FLOPs of one token per context position at the rollout MFU."""
    step_overhead_s: float
    prefill_chunk_tokens: int
    max_num_seqs: int
    kv_capacity_tokens: int
    train_s_per_token: float
    """Actor forward per token (dense part) at the training MFU."""
    train_attn_s_per_token_pos: float
    """Actor forward attention per token per context position at the training MFU."""
    swap_s: float
    weight_sync_s: float
    optimizer_s_multi_node: float
    optimizer_s_single_node: float
    phase_switch_s: float
    """Synchronous colocated systems: offload/onload of engine and trainer states, one way."""
    train_state_bytes: float
    """The actor's whole training state (weights, grads, optimizer), bytes."""
    network_bytes_per_s: float
    communicator_init_s: float
    gpus_per_node: int
    prefill_s_per_token: float = 0.0
    """Dense prefill cost of one prompt token (the roofline: = flop_s_per_token)."""
    backward_ratio: float = 2.0
    """Actor backward time / actor forward time."""
    ref_ratio: float = 1.0
    """Reference forward time / actor forward time."""
    host_compute_slots: float | None = None
    """Busy ranks the shared host runs at full speed (None: an accelerator per rank)."""
    turn_overhead_s: float = 0.0
    """Latency a turn adds outside engine iterations and the environment (request path, agent loop)."""
    decoupled_step_s: float = 0.0
    """A decoupled step's coordination beyond its pipeline (input to the ref ranks, log-probs back)."""
    engine_start_s: float = 0.0
    """A rank's rollout engine start, alone on its device or host (0: not priced)."""

    rollout_busy_cores: float = 1.0
    """Cores a busy rollout rank occupies on a shared host (its process and its engine's)."""

    def host_speed(self, busy_engines: int, busy_trainer_ranks: int = 0) -> float:
        """Speed of each busy rank while these ranks compute at once on a shared host (processor
        sharing of its slots; a busy rollout rank weighs `rollout_busy_cores`)."""
        # Called at every engine reschedule: no object built here (HostShare.speed is the same formula).
        if self.host_compute_slots is None:
            return 1.0
        return shared_speed(self.host_compute_slots, self.rollout_busy_cores, busy_engines, busy_trainer_ranks)

    @property
    def host(self) -> HostShare | None:
        """The shared host as the ERS planner models it (None: an accelerator per rank)."""
        if self.host_compute_slots is None:
            return None
        return HostShare(self.host_compute_slots, self.rollout_busy_cores)

    def decode_iteration_s(self, num_decoding: int, context_tokens: float, prefill_tokens: float,
                           prefill_position: float = 0.0) -> float:
        memory = self.weights_read_s + context_tokens * self.kv_read_s_per_token
        compute = num_decoding * self.flop_s_per_token + prefill_tokens * self.prefill_s_per_token
        compute += prefill_tokens * prefill_position * self.attn_flop_s_per_token_pos
        return self.step_overhead_s + max(memory, compute)

    def forward_s(self, seq_tokens: int) -> float:
        """Actor (or reference) forward of one sequence on one rank."""
        return seq_tokens * self.train_s_per_token + seq_tokens * seq_tokens / 2 * self.train_attn_s_per_token_pos

    def train_s(self, seq_tokens: int) -> float:
        """Reference forward + actor forward + actor backward of one sequence."""
        return self.forward_s(seq_tokens) * (self.ref_ratio + 1.0 + self.backward_ratio)

    def regroup_s(self, num_actor_ranks: int) -> float:
        """An actor rank joins or leaves: reshard the training state, rebuild the communicators."""
        return self.train_state_bytes / max(num_actor_ranks, 1) / self.network_bytes_per_s + self.communicator_init_s

    def optimizer_s(self, num_actor_ranks: int) -> float:
        return self.optimizer_s_single_node if num_actor_ranks <= self.gpus_per_node else self.optimizer_s_multi_node

    def best_decode_s_per_token(self, mean_context_tokens: float) -> float:
        """Decode cost per token at the largest batch the KV capacity and max_num_seqs allow."""
        batch = max(1, min(self.max_num_seqs, int(self.kv_capacity_tokens / max(mean_context_tokens, 1.0))))
        return self.decode_iteration_s(batch, batch * mean_context_tokens, 0.0) / batch

    def prefill_s(self, tokens: float, start_position: float = 0.0) -> float:
        """Compute-bound prefill of `tokens` new tokens after `start_position` cached ones."""
        mid = start_position + tokens / 2
        return tokens * (self.prefill_s_per_token + mid * self.attn_flop_s_per_token_pos)


def _measured_costs(cluster: ClusterSpec) -> Costs:
    m = cluster.measured
    assert m is not None
    return Costs(
        weights_read_s=0.0,
        kv_read_s_per_token=0.0,
        flop_s_per_token=m.decode_s_per_seq,
        attn_flop_s_per_token_pos=0.0,
        step_overhead_s=m.decode_step_s,
        prefill_chunk_tokens=cluster.rollout.prefill_chunk_tokens,
        max_num_seqs=cluster.rollout.max_num_seqs,
        kv_capacity_tokens=cluster.rollout.kv_capacity_tokens or m.kv_capacity_tokens,
        train_s_per_token=m.actor_forward_s_per_token,
        train_attn_s_per_token_pos=0.0,
        swap_s=m.swap_s,
        weight_sync_s=m.weight_sync_s,
        optimizer_s_multi_node=m.optimizer_s,
        optimizer_s_single_node=m.optimizer_s,
        # A time-shared rank switching phase: one model swap plus an engine reload.
        phase_switch_s=m.swap_s + m.weight_sync_s,
        train_state_bytes=0.0,
        network_bytes_per_s=1.0,
        communicator_init_s=cluster.training.communicator_init_s,
        gpus_per_node=cluster.num_gpus,
        prefill_s_per_token=m.prefill_s_per_token,
        backward_ratio=m.actor_backward_s_per_token / m.actor_forward_s_per_token,
        ref_ratio=m.ref_forward_s_per_token / m.actor_forward_s_per_token,
        host_compute_slots=m.host_compute_slots,
        rollout_busy_cores=m.rollout_busy_cores,
        turn_overhead_s=m.turn_overhead_s,
        decoupled_step_s=m.decoupled_step_s,
        engine_start_s=cluster.rollout.engine_start_s,
    )


def derive_costs(cluster: ClusterSpec) -> Costs:
    if cluster.measured is not None:
        return _measured_costs(cluster)
    gpu, model, eff = cluster.gpu, cluster.model, cluster.efficiency
    assert gpu is not None and model is not None and eff is not None
    params = model.params_b * 1e9
    weight_bytes = params * model.bytes_per_param
    kv_bytes_per_token = 2 * model.layers * model.kv_heads * model.head_dim * model.bytes_per_param
    bandwidth = gpu.hbm_tb_s * 1e12 * eff.decode_mbu
    rollout_flops = gpu.bf16_tflops * 1e12 * eff.rollout_mfu
    train_flops = gpu.bf16_tflops * 1e12 * eff.train_mfu
    # Causal attention: QK^T and AV, 2 FLOPs per MAC each -> 4 * L * d per (token, earlier position).
    attn_flops_per_pos = 4 * model.layers * model.hidden
    kv_capacity = cluster.rollout.kv_capacity_tokens
    if kv_capacity is None:
        free = gpu.memory_gb * 1e9 * cluster.rollout.gpu_memory_utilization - weight_bytes
        free -= cluster.rollout.activation_reserve_gb * 1e9
        if free <= 0:
            raise ValueError(f"{cluster.name}: the model does not fit a rollout rank")
        kv_capacity = int(free / kv_bytes_per_token)
    pcie = gpu.pcie_gb_s * 1e9 * eff.link_efficiency
    nvlink = gpu.nvlink_gb_s * 1e9 * eff.link_efficiency
    net = gpu.internode_gb_s * 1e9 * eff.link_efficiency
    t = cluster.training
    # One ref/actor switch moves one model's weights across PCIe (the other leaves in the opposite
    # direction at the same time, PCIe being full duplex).
    swap = t.swap_s if t.swap_s is not None else weight_bytes / pcie + t.switch_overhead_s
    # Weights broadcast from the actors to the rollout ranks (NVLink inside a node, else the network),
    # then reloaded by the engine.
    fabric = nvlink if cluster.num_gpus <= gpu.gpus_per_node else net
    sync = t.weight_sync_s if t.weight_sync_s is not None else weight_bytes / fabric + cluster.rollout.weight_reload_s
    # Distributed optimizer: reduce-scatter FP32 gradients, all-gather BF16 weights (ring: ~1x each).
    grad_bytes = params * 4

    def optimizer(bw: float) -> float:
        return (grad_bytes + weight_bytes) / bw

    opt_multi = t.optimizer_s if t.optimizer_s is not None else optimizer(net)
    opt_single = t.optimizer_s if t.optimizer_s is not None else optimizer(nvlink)
    # Synchronous colocation: the trainer's state (weights, grads, Adam) and the engine's weights
    # cross PCIe at each rollout <-> train switch.
    phase_switch = (params * model.train_state_bytes_per_param / cluster.num_gpus + weight_bytes) / pcie
    phase_switch += cluster.rollout.weight_reload_s
    return Costs(
        weights_read_s=weight_bytes / bandwidth,
        kv_read_s_per_token=kv_bytes_per_token / bandwidth,
        flop_s_per_token=2 * params / rollout_flops,
        attn_flop_s_per_token_pos=attn_flops_per_pos / rollout_flops,
        step_overhead_s=eff.decode_step_overhead_s,
        prefill_chunk_tokens=cluster.rollout.prefill_chunk_tokens,
        max_num_seqs=cluster.rollout.max_num_seqs,
        kv_capacity_tokens=kv_capacity,
        train_s_per_token=2 * params / train_flops,
        train_attn_s_per_token_pos=attn_flops_per_pos / train_flops,
        swap_s=swap,
        weight_sync_s=sync,
        optimizer_s_multi_node=opt_multi,
        optimizer_s_single_node=opt_single,
        phase_switch_s=phase_switch,
        train_state_bytes=params * model.train_state_bytes_per_param,
        network_bytes_per_s=fabric,
        communicator_init_s=t.communicator_init_s,
        gpus_per_node=gpu.gpus_per_node,
        prefill_s_per_token=2 * params / rollout_flops,
        engine_start_s=cluster.rollout.engine_start_s,
    )


def describe(costs: Costs) -> dict[str, float]:
    """The derived figures a reader checks against public numbers (printed by `tiderl sim --json`)."""
    out = {
        "kv_capacity_tokens": costs.kv_capacity_tokens,
        "swap_s": round(costs.swap_s, 3),
        "weight_sync_s": round(costs.weight_sync_s, 3),
        "optimizer_s_single_node": round(costs.optimizer_s_single_node, 3),
        "optimizer_s_multi_node": round(costs.optimizer_s_multi_node, 3),
        "phase_switch_s": round(costs.phase_switch_s, 3),
        "engine_start_s": round(costs.engine_start_s, 3),
        "actor_regroup_s_8": round(costs.regroup_s(8), 3),
        "prefill_tok_s": round(1 / costs.prefill_s(1.0, 2000.0)),
        "train_fwd_bwd_ref_tok_s_4k": round(4096 / costs.train_s(4096)),
    }
    for batch in (1, 32, 256):
        for ctx in (1000, 4000):
            it = costs.decode_iteration_s(batch, batch * ctx, 0.0)
            if batch * ctx <= costs.kv_capacity_tokens:
                out[f"decode_tok_s_b{batch}_ctx{ctx}"] = round(batch / it)
    return out
