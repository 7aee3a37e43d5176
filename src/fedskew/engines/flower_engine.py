"""The server side of the Flower engine: an algorithm's channel over Flower's Grid.

Every exchange of a round becomes one ``grid.send_and_receive`` call: one Flower message
per addressed client, sent to the node that holds the client's partition. Replies that do
not come back (a node died, the reply timeout passed, the ClientApp raised), that fail the
checks of :func:`check_reply` or that lack what the server reads (``expect``) are left out
of the reply dict, so the algorithm's server aggregates over the clients that did reply;
the run loop records which were missing. A node's reply is untrusted input: whatever its
content, it is aggregated only once it passed every check, or rejected and recorded; it
never raises into the server.
Bytes are counted on the algorithm's payload exactly as the in-process engine counts them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import Message as FlowerMessage
from flwr.serverapp import Grid

from fedskew.core.errors import Diverged
from fedskew.engines.base import ExchangeFaults, TrafficCounter
from fedskew.engines.flower_codec import (
    CLIENT_DIVERGED,
    RejectedReply,
    check_reply,
    check_sample_count,
    decode,
    encode,
)
from fedskew.engines.flower_secagg import secure_exchange
from fedskew.training.protocol import (
    ArraySpec,
    ClientState,
    Expected,
    Message,
    ScalarSpec,
    Summed,
    SumRequest,
    unmet,
)

log = logging.getLogger("fedskew")
MESSAGE_TYPE = "train"  # one ClientApp handler routes every fedskew kind


class FlowerEngine:
    """Carries an algorithm's messages to the ClientApps of a Flower federation (an
    :class:`~fedskew.engines.base.Engine`)."""

    may_lose_replies = True
    worker_count = 0  # the clients run on the federation's nodes
    worker_devices: tuple[str, ...] = ()  # each node chooses its own (its --device)
    clients_together = "off"  # a node answers for one client at a time

    def __init__(
        self,
        grid: Grid,
        node_of: Mapping[int, int],
        reference: Mapping[str, torch.Tensor],
        timeout: float | None = None,
        declared: Mapping[str, ArraySpec] | None = None,
        client_sizes: list[int] | None = None,
        scalars: Mapping[str, ScalarSpec] | None = None,
    ) -> None:
        self.grid = grid
        # Each client's training samples, as the server's own copy of the partition says:
        # a reply's ``num_samples`` (its weight in every weighted average) must be exactly
        # that, so one node cannot own the average by claiming 1e30 samples. None: unknown.
        self.client_sizes = client_sizes
        self.node_of = dict(node_of)
        self.reference = dict(reference)
        self.declared = None if declared is None else dict(declared)
        self.scalars = dict(scalars or {})
        self.timeout = timeout
        self.traffic = TrafficCounter()
        self.round = 0
        self.missing: set[int] = set()
        self.rejected: set[int] = set()
        self.client_denormals: dict[str, int] = {}
        # What each node said it computes with (the ServerApp's handshake), for
        # processes.jsonl.
        self.client_nodes: list[dict[str, Any]] = []

    @property
    def client_states(self) -> dict[int, ClientState]:
        # Client state lives in each node's context.state, not on the server: a checkpoint
        # of a Flower run holds none.
        return {}

    def restore_client_states(self, states: Mapping[int, ClientState]) -> None:
        if any(s.arrays or s.scalars for s in states.values()):
            log.warning(
                "resuming on Flower: the checkpoint's client states are not sent to the nodes; "
                "clients start this process with the state their node still holds"
            )

    def faults(self) -> ExchangeFaults:
        return ExchangeFaults(frozenset(self.missing), frozenset(self.rejected))

    def close(self) -> None:
        pass  # the federation outlives the run; nothing was started here

    def begin_round(self, rnd: int) -> None:
        self.round = rnd
        self.traffic.reset()
        self.missing = set()
        self.rejected = set()

    def exchange(
        self, messages: Mapping[int, Message], expect: Expected | None = None
    ) -> dict[int, Message]:
        self.traffic.exchanges += 1
        outgoing: list[FlowerMessage] = []
        addressed: dict[int, int] = {}  # node id -> client id
        for cid, msg in messages.items():
            self.traffic.bytes_down += msg.nbytes()
            node = self.node_of.get(cid)
            if node is None:  # no node holds this partition (it never connected)
                self.missing.add(cid)
                continue
            addressed[node] = cid
            content = encode(msg, {"round": self.round, "client_id": cid})
            outgoing.append(FlowerMessage(content, node, MESSAGE_TYPE, group_id=str(self.round)))
        replies: dict[int, Message] = {}
        diverged: dict[int, str] = {}  # client id -> what it said
        for reply in self.grid.send_and_receive(outgoing, timeout=self.timeout):
            cid = addressed.get(reply.metadata.src_node_id)
            if cid is None:
                continue
            if reply.has_error() and reply.error.code == CLIENT_DIVERGED:
                said = " ".join(str(reply.error.reason or "").split())[:300]
                log.warning("round %d: client %d diverged: %s", self.round + 1, cid, said)
                diverged[cid] = said
                continue
            if reply.has_error():
                log.warning(
                    "round %d: client %d failed: %s", self.round + 1, cid, reply.error.reason
                )
                continue
            size = None if self.client_sizes is None else self.client_sizes[cid]
            try:
                decoded = self._checked(reply, messages[cid], expect, size)
            except RejectedReply as exc:
                log.warning("round %d: reply of client %d rejected: %s", self.round + 1, cid, exc)
                self.rejected.add(cid)
                continue
            self.traffic.bytes_up += decoded.nbytes()
            replies[cid] = decoded
        for cid in messages:
            if cid not in replies:
                self.missing.add(cid)
        if diverged and not replies:
            # Nothing to aggregate because the clients' training diverged: the run stops as
            # it does in process (a client that merely claims it, while others reply, is a
            # lost reply: one node cannot stop the run).
            cid = min(diverged)
            raise Diverged(
                f"round {self.round + 1}: no reply to aggregate; {len(diverged)} of "
                f"{len(messages)} clients diverged (client {cid}: {diverged[cid]})",
                self.round + 1,
            )
        return replies

    def exchange_summed(
        self, messages: Mapping[int, Message], expect: Expected, request: SumRequest
    ) -> Summed:
        """A secure summed exchange: Flower's SecAgg+ through the Grid
        (``fedskew.engines.flower_secagg``); the run loop calls it for secure requests only."""
        return secure_exchange(self, messages, expect, request)

    def _checked(
        self, reply: FlowerMessage, sent: Message, expect: Expected | None, size: int | None
    ) -> Message:
        """The reply as a Message the server can aggregate, or RejectedReply."""
        try:
            decoded, _ = decode(reply.content)
        except Exception as exc:  # noqa: BLE001 - any content a node sends must not stop the server
            why = f"{type(exc).__name__}: {exc}"
            raise RejectedReply(f"it is not a fedskew reply ({why})") from None
        check_reply(decoded, {**self.reference, **sent.arrays}, self.declared, self.scalars, size)
        check_sample_count(decoded, size)
        why = None if expect is None else unmet(decoded, expect)
        if why is not None:  # the server's aggregation would fail on it
            raise RejectedReply(f"it {why}")
        return decoded
