"""The one interface every engine implements for the run loop.

An engine carries an algorithm's messages to its clients and their replies back (it is
the ``Channel`` the server logic talks to), counts the bytes of what it carried, and knows
what went wrong in the round: replies that never came back, and replies it refused. The
run loop (``fedskew.runs.loop``) uses engines only through :class:`Engine`.

:class:`ServerSideClientStates` is the bookkeeping shared by the engines that keep every
client's state in this process (in-process and worker pool); a Flower node keeps its own
client's state instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from fedskew.core.errors import FedskewError
from fedskew.training.protocol import ClientState, Expected, Message, unmet


@dataclass
class TrafficCounter:
    """Payload bytes carried in the current round, both ways, and how many exchanges."""

    bytes_down: int = 0
    bytes_up: int = 0
    exchanges: int = 0

    def reset(self) -> None:
        self.bytes_down = self.bytes_up = self.exchanges = 0


@dataclass(frozen=True)
class ExchangeFaults:
    """Clients addressed in this round whose reply did not arrive (``missing``: a dead node,
    a timeout, a failed ClientApp, or a refused reply) and, among them, the replies the
    engine refused after checking them (``rejected``)."""

    missing: frozenset[int] = field(default_factory=frozenset)
    rejected: frozenset[int] = field(default_factory=frozenset)


class Engine(Protocol):
    """What the run loop needs of an engine."""

    # True when exchange() may return fewer replies than it was sent messages (a real
    # deployment); the run loop then records the faults and can skip a round.
    may_lose_replies: bool
    # Client worker processes this engine runs (0: none, clients run in this process or
    # elsewhere); recorded in the run folder.
    worker_count: int
    # The devices of those workers when they differ from the run's (one GPU each), else ().
    worker_devices: tuple[str, ...]
    # How the clients of an exchange are trained: "off" (one after another) or "vmap"
    # (together, where the algorithm allows it; see engine.together).
    clients_together: str
    # What the processes that train clients elsewhere (workers, Flower nodes) measured of
    # their denormal handling at start-up: {state: how many}; empty when clients train here.
    client_denormals: dict[str, int]
    traffic: TrafficCounter

    def begin_round(self, rnd: int) -> None:
        """Start round ``rnd`` (0-based): traffic and faults count from zero."""
        ...

    def exchange(
        self, messages: Mapping[int, Message], expect: Expected | None = None
    ) -> dict[int, Message]:
        """Deliver one message per client and return the replies that came back. A reply
        that does not hold what ``expect`` says the server reads is refused: left out and
        reported as rejected where replies may be lost, else the run stops (see
        :func:`refuse_unmet`)."""
        ...

    @property
    def client_states(self) -> Mapping[int, ClientState]:
        """Every client's state this engine holds, for the checkpoint (empty when clients
        keep their state themselves)."""
        ...

    def restore_client_states(self, states: Mapping[int, ClientState]) -> None:
        """Put back the client states of a checkpoint, before the first round of a resume."""
        ...

    def faults(self) -> ExchangeFaults:
        """The faults of the exchanges since :meth:`begin_round`."""
        ...

    def close(self) -> None:
        """Release what the engine started (processes); called once, also on errors."""
        ...


class ServerSideClientStates:
    """The part of an engine that keeps every client's state in this process: the round,
    the traffic, the states created on first use. Such an engine never loses a reply (a
    failing client ends the run), so it reports no faults."""

    may_lose_replies = False
    worker_count = 0
    worker_devices: tuple[str, ...] = ()
    clients_together = "off"

    def __init__(self) -> None:
        self.client_denormals: dict[str, int] = {}
        self._states: dict[int, ClientState] = {}
        self.traffic = TrafficCounter()
        self.round = 0

    @property
    def client_states(self) -> dict[int, ClientState]:
        return self._states

    def restore_client_states(self, states: Mapping[int, ClientState]) -> None:
        self._states = dict(states)

    def begin_round(self, rnd: int) -> None:
        self.round = rnd
        self.traffic.reset()

    def state_of(self, client_id: int) -> ClientState:
        state = self._states.get(client_id)
        if state is None:
            state = self._states[client_id] = ClientState()
        return state

    def faults(self) -> ExchangeFaults:
        return ExchangeFaults()

    def close(self) -> None:
        pass


def refuse_unmet(rnd: int, replies: Mapping[int, Message], expect: Expected | None) -> None:
    """Stop the run at the first reply that lacks what the server reads. For the engines
    whose clients run fedskew's code in this machine's processes: such a reply is a fault of
    the algorithm's client, and the server's aggregation would fail on it less clearly."""
    if expect is None:
        return
    for cid, reply in replies.items():
        why = unmet(reply, expect)
        if why is not None:
            raise FedskewError(
                f"round {rnd + 1}: the reply of client {cid} {why}, which the algorithm's "
                "server reads (a fault in its client logic)"
            )
