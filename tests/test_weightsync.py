"""Weights without files: the wire format, the trainer's server and an engine's client, for real (TCPStore, gloo
over localhost, shared-memory files), without vLLM. The engine side through vLLM's API is in
tests/test_rollout_vllm.py."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

from tiderl.weightsync import client as client_module
from tiderl.weightsync import shm
from tiderl.weightsync.client import WeightClient
from tiderl.weightsync.server import WeightServer
from tiderl.weightsync.wire import TransferError, pack, unpack, version_digest


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(64, 16, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g),
            "model.layers.0.input_layernorm.weight": torch.randn(16, generator=g),
            "model.norm.weight": torch.randn(16, generator=g),
            "step": torch.tensor(3, dtype=torch.int64)}


def test_packed_buckets_hold_every_tensor_in_the_wire_dtype_and_a_damaged_one_is_refused() -> None:
    st = state(0)
    buckets = pack(st.items(), torch.bfloat16, bucket_bytes=3000)
    assert len(buckets) > 1  # several buckets; a tensor larger than one is a bucket of its own
    assert max(b.layout.nbytes for b in buckets) == 64 * 16 * 2
    got = dict(kv for b in buckets for kv in unpack(b.data, b.layout))
    assert list(got) == list(st)
    for name, t in st.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    damaged = buckets[0].data.clone()
    damaged[5] ^= 1
    with pytest.raises(TransferError, match="does not match its CRC32"):
        unpack(damaged, buckets[0].layout)
    assert version_digest(b.layout for b in buckets) != version_digest(b.layout for b in buckets[1:])


@pytest.mark.parametrize("mapped", [True, False], ids=["shared_memory", "sent"])
def test_an_engine_gets_the_newest_committed_version_and_never_an_uncommitted_one(mapped: bool) -> None:
    server = WeightServer(commit_wait_s=0.3)
    try:
        client = WeightClient(server.address, timeout_s=30, shared_memory=mapped)
        server.stage(1, state(1).items())
        with pytest.raises(TransferError, match="no committed version >= 1"):
            client.receive(1)  # staged, not committed: an engine never samples on weights the store lacks
        server.commit(1)
        r = client.receive(1, expected=list(state(1)))
        assert r.via == ("shared_memory" if mapped else "sent")
        assert r.version == 1 and r.nbytes == sum(t.numel() * t.element_size() for t in state(1).values())
        assert all(torch.equal(t, state(1)[n]) for n, t in r.tensors)
        server.stage(2, state(2).items())
        server.commit(2)
        assert client.receive(1).version == 2  # the newest, never older than asked (as a pruned file version)
        with pytest.raises(TransferError, match="lack 1 of the model's tensors \\(lm_head.weight\\)"):
            client.receive(2, expected=[*state(2), "lm_head.weight"])
        # The server counts a version once its last send returns, which may be after the client has it all.
        deadline = time.monotonic() + 30
        while server.stats.versions_served < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.stats.versions_served == 3 and not server.stats.failed
        assert server.stats.versions_mapped == (3 if mapped else 0)  # the refused one was handed out too
        assert server.stats.bytes_sent == (0 if mapped else 3 * r.nbytes)
        assert client.receive(2).version == 2  # the connection is in step after a refused version
    finally:
        server.close()


def test_shared_memory_files_are_the_owners_only_and_removed_when_replaced_while_a_mapping_lives_on() -> None:
    server = WeightServer()
    try:
        client = WeightClient(server.address, timeout_s=30)
        first = server.stage(1, state(1).items())
        server.commit(1)
        assert first.paths and all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in first.paths)
        r1 = client.receive(1)
        second = server.stage(2, state(2).items())
        assert all(Path(p).exists() for p in first.paths)  # v1 is still the one served
        server.commit(2)
        assert not any(Path(p).exists() for p in first.paths)  # replaced: unlinked...
        assert all(torch.equal(t, state(1)[n]) for n, t in r1.tensors)  # ...while the engine's mapping holds
        assert client.receive(2).version == 2 and all(Path(p).exists() for p in second.paths)
    finally:
        server.close()
    assert not any(Path(p).exists() for p in second.paths)


def test_files_an_engine_cannot_open_are_sent_instead_and_tried_again_only_after_a_while(monkeypatch) -> None:
    opened = []

    def another_host(path: str, nbytes: int) -> torch.Tensor:
        opened.append(path)
        raise FileNotFoundError(errno.ENOENT, "no such file", path)

    monkeypatch.setattr(client_module, "map_bucket", another_host)
    server = WeightServer()
    try:
        server.stage(1, state(1).items())
        server.commit(1)
        client = WeightClient(server.address, timeout_s=30)
        r = client.receive(1)
        assert r.via == "sent" and torch.equal(dict(r.tensors)["model.norm.weight"], state(1)["model.norm.weight"])
        assert len(opened) == 2  # asked twice (a version may be replaced meanwhile)
        assert client.receive(1).via == "sent" and len(opened) == 2  # not tried again for a while...
        monkeypatch.setattr(client_module, "MAP_RETRY_S", 0.0)
        soon = WeightClient(server.address, timeout_s=30)
        soon.receive(1)
        soon.receive(1)
        assert len(opened) == 6  # ...then tried again (the files may have been removed for a time only)
        monkeypatch.undo()
        assert soon.receive(1).via == "shared_memory"
    finally:
        server.close()


def test_a_full_shared_memory_keeps_the_version_in_the_servers_memory(monkeypatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    server = WeightServer()
    try:
        monkeypatch.setattr(shm.os, "posix_fallocate", full)
        staged = server.stage(1, state(1).items())
        monkeypatch.undo()
        server.commit(1)
        assert staged.paths == [] and not list(shm.SHM_DIR.glob(f"{server._arena.tag}-*"))
        r = WeightClient(server.address, timeout_s=30).receive(1)
        assert r.via == "sent" and r.version == 1
    finally:
        server.close()


def test_the_files_of_a_server_that_died_are_removed_by_the_next_one(tmp_path: Path) -> None:
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    ns = os.stat("/proc/self/ns/pid").st_ino
    left = tmp_path / f"{shm.PREFIX}{ns}-{pid}-0123abcd-v3-b0"
    mine = tmp_path / f"{shm.PREFIX}{ns}-{os.getpid()}-0123abcd-v3-b0"
    elsewhere = tmp_path / f"{shm.PREFIX}{ns + 1}-{pid}-0123abcd-v3-b0"  # another container's: its pids are not ours
    other = tmp_path / "tiderl-weights-notes.txt"
    for p in (left, mine, elsewhere, other):
        p.write_bytes(b"x")
    arena = shm.ShmArena(tmp_path)
    assert not left.exists() and mine.exists() and elsewhere.exists() and other.exists()
    data, path = arena.alloc(4, 0, 10)
    assert data.numel() == 10 and Path(path).parent == tmp_path
    arena.release_all()
    assert not Path(path).exists() and mine.exists()


def test_a_request_waits_for_the_commit_of_the_version_it_saw_announced() -> None:
    server = WeightServer(commit_wait_s=30)
    try:
        client = WeightClient(server.address, timeout_s=30)
        server.stage(4, state(4).items())
        threading.Timer(0.3, server.commit, args=(4,)).start()
        t0 = time.monotonic()
        assert client.receive(4).version == 4
        assert time.monotonic() - t0 >= 0.25
    finally:
        server.close()


def test_an_engine_that_stops_mid_transfer_costs_only_its_own_connection() -> None:
    server = WeightServer(timeout_s=30)
    try:
        server.stage(1, state(1).items())
        server.commit(1)
        stalled = WeightClient(server.address, timeout_s=30)
        # It asks and never takes the buckets (a rank killed between the layout and the data).
        stalled._store.set(f"{stalled._prefix}req/1", json.dumps({"min_version": 1}))
        other = WeightClient(server.address, timeout_s=30)
        assert other.receive(1).version == 1
    finally:
        server.close()


def test_a_closed_server_is_a_clear_error_not_a_hang() -> None:
    server = WeightServer()
    address = server.address
    client = WeightClient(address, timeout_s=30)
    server.close()
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="weight server"):
        client.receive(1)
    with pytest.raises(TransferError, match="cannot reach the weight server"):
        WeightClient(address, timeout_s=30, connect_timeout_s=1)
    assert time.monotonic() - t0 < 20
    with pytest.raises(TransferError, match="not host:port"):
        WeightClient("nowhere")


def test_a_server_that_accepts_and_never_answers_costs_only_the_connect_timeout() -> None:
    import socket

    hole = socket.create_server(("127.0.0.1", 0))
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="cannot reach the weight server"):
            WeightClient(f"127.0.0.1:{hole.getsockname()[1]}", timeout_s=300, connect_timeout_s=2)
        assert time.monotonic() - t0 < 30
    finally:
        hole.close()


def test_a_mapped_version_checked_ahead_gives_each_bucket_once_checked_and_stops_at_a_damaged_one() -> None:
    """`receive(check_ahead=True)`: the engine loads bucket by bucket while the later buckets are checked; what
    it gets is the version as a checked receive gives it, and a damaged bucket raises when its turn comes,
    after the buckets before it (the caller's engine then holds a mix: tiderl.rollout.vllm_transfer)."""
    server = WeightServer(bucket_bytes=3000)
    try:
        client = WeightClient(server.address, timeout_s=30)
        staged = server.stage(1, state(1).items())
        server.commit(1)
        assert len(staged.paths) == 2  # fp32: the embedding (4 KiB) alone, the rest in the second
        whole = client.receive(1)
        ahead = client.receive(1, check_ahead=True)
        assert ahead.via == "shared_memory" and not isinstance(ahead.tensors, list)
        got = list(ahead.tensors)
        assert [n for n, _ in got] == [n for n, _ in whole.tensors]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, whole.tensors))
        with open(staged.paths[1], "r+b") as f:  # the second bucket's file, written to after its CRC
            f.seek(3)
            byte = f.read(1)
            f.seek(3)
            f.write(bytes([byte[0] ^ 1]))
        damaged = client.receive(1, check_ahead=True)
        first = len(staged.buckets[0].layout.slots)
        taken = []
        with pytest.raises(TransferError, match="does not match its CRC32"):
            for kv in damaged.tensors:
                taken.append(kv)
        assert len(taken) == first  # the first bucket's tensors, then the damaged one stopped it
        with pytest.raises(TransferError, match="does not match its CRC32"):
            client.receive(1)  # checked before anything is given
    finally:
        server.close()
