"""The weight transfer as a vLLM weight-transfer backend, ``tiderl``, registered by the project's vLLM plugin.

vLLM builds one :class:`TideWeightTransferEngine` per worker when the engine is started with
``weight_transfer_config={"backend": "tiderl"}``; :class:`tiderl.rollout.vllm_engine.VllmEngine` drives it
through vLLM's own calls (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``, by ``collective_rpc``). Unlike vLLM's push backends, the engine pulls: its
``update_weights`` asks the trainer's :class:`~tiderl.weightsync.server.WeightServer` for the newest
committed version (at least the one asked for) and loads it in place (vLLM's layerwise reload, the tied
output layer prepared again as after a file reload), every bucket checked: received over the connection,
the whole version is here and checked before the load; mapped from the server's shared-memory files on its
host (the owner's alone, under names no other server uses), each bucket is loaded once its check has
passed, the later ones checked meanwhile on the worker's other cores. A transfer that fails before the
load leaves the weights untouched and is reported in the result, not raised: the rank then loads the
version's files. A mapped bucket found damaged during the load (``mixed``) leaves a mix: the engine is
then unusable and its rank restarts, as a rank that dies does.

This module runs inside vLLM's worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from tiderl.rollout.vllm_worker import load_in_place
from tiderl.weightsync.client import WeightClient
from tiderl.weightsync.wire import TransferError

BACKEND = "tiderl"


@dataclass
class TideTransferInit(WeightTransferInitInfo):
    address: str  # the weight server's host:port
    timeout_s: float = 300.0


@dataclass
class TideTransferUpdate(WeightTransferUpdateInfo):
    min_version: int
    expected: list[str] = field(default_factory=list)  # checkpoint tensor names a version must hold


class TideWeightTransferEngine(WeightTransferEngine[TideTransferInit, TideTransferUpdate]):
    init_info_cls = TideTransferInit
    update_info_cls = TideTransferUpdate
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.client: WeightClient | None = None
        self.connect_error = ""
        self.result: dict[str, Any] = {}

    def init_transfer_engine(self, init_info: TideTransferInit) -> None:
        self.shutdown()
        try:
            self.client = WeightClient(init_info.address, timeout_s=init_info.timeout_s)
            self.connect_error = ""
        except TransferError as e:
            self.connect_error = str(e)

    def start_weight_update(self) -> None:
        self.result = {}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: TideTransferUpdate) -> None:
        if self.client is None:
            self.result = {"error": self.connect_error or "no weight server connected"}
            return
        try:
            received = self.client.receive(update_info.min_version, update_info.expected, check_ahead=True)
        except TransferError as e:  # nothing loaded: the engine keeps its weights
            self.shutdown()  # a connection that failed is not reused
            self.connect_error = str(e)
            self.result = {"error": str(e)}
            return
        try:
            done = load_in_place(self.model, self.model_config, received.tensors)
        except TransferError as e:  # a mapped bucket found damaged while the ones before it were loading
            self.shutdown()
            self.connect_error = str(e)
            self.result = {"error": f"{e}, found while loading: the weights are a mix", "mixed": True}
            return
        self.result = {"version": received.version, "digest": received.digest, "nbytes": received.nbytes,
                       "receive_s": received.seconds, "via": received.via, **done}

    def finish_weight_update(self) -> None:
        """Nothing left: the whole version was loaded and prepared in :meth:`update_weights`."""

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def register() -> None:
    """Register the ``tiderl`` backend with vLLM's factory (a vLLM general plugin: every vLLM process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "TideWeightTransferEngine")

