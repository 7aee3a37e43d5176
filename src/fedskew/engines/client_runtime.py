"""The client side every engine runs: answer one message for one client.

A :class:`ClientRuntime` is what a process needs to answer messages for any client: the
federated data, one scratch model, the algorithm's client logic, the local-training
settings, the seed and the test set. The in-process engine holds one; a worker process and
a Flower node each build one from the experiment configuration (``fedskew.assembly.prepare``).

The runtime is also the device boundary. Messages and client states are device-free (host
tensors, as the wire, Flower's records and checkpoints need); the data and the scratch model
live on the run's device. So on a GPU the arrays of an incoming message and the client's
state go to the device before the handler runs, and the reply's arrays and the state come
back to host memory after it: between messages a client's state takes no GPU memory, however
many clients there are. On the CPU nothing is moved or copied. The one exception: in a round
whose server computes on the device (``ServerLogic.takes_device_replies``, FedAvg's), the
in-process engine leaves the replies' arrays there (``replies_on_device``), so that ten
trained models are averaged where they are instead of crossing PCIe twice.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Self

import torch

from fedskew.assembly.prepare import Prepared, execution_settings, new_model, prepare
from fedskew.config import build_config, normalise_keys
from fedskew.core.denormals import denormals_applied
from fedskew.core.device import apply_settings, to_cpu, to_device
from fedskew.data.datasets import Dataset
from fedskew.data.federated import FederatedData
from fedskew.engines.together import (
    fused_why_not,
    model_obstacle,
    plain_handler,
    resolve_mode,
    train_together,
)
from fedskew.engines.together_memory import (
    client_bytes,
    clients_that_fit,
    free_bytes,
    plan_stack_bytes,
)
from fedskew.training.graph_step import resolve_graphs
from fedskew.training.interface import ClientContext, ClientLogic, LocalTrainConfig
from fedskew.training.local import PlainTraining, TrainResult, set_arrays
from fedskew.training.local_evaluation import LOCAL_EVALUATION, answer_local_evaluation
from fedskew.training.privacy import summand_reply
from fedskew.training.protocol import ClientState, Message

log = logging.getLogger("fedskew")


def runtime_from_config_json(
    config_json: str,
    who: str,
    local: Mapping[str, Any] | None = None,
    dataset: Dataset | None = None,
) -> ClientRuntime:
    """The client runtime of a run, from its configuration as JSON (``ExperimentConfig.to_dict``,
    as a run folder's config.json and the messages to workers and Flower nodes carry it):
    what a worker process or a Flower node builds once per run. ``local`` overrides what is
    the process's own (a node's data folder); ``who`` names the source in errors;
    ``dataset``, where given, is the run's dataset already loaded (a worker's view of its
    parent's, in shared memory). The run's device and TF32/determinism switches are applied
    for the process's lifetime, before any CUDA work; its denormal handling holds while
    the runtime handles a message (ClientRuntime.handle), so that a process that calls a
    ClientApp in its own thread is left as it was."""
    raw = {**json.loads(config_json), **(local or {})}
    cfg = build_config(normalise_keys(raw, who), {})
    apply_settings(dataclasses.replace(execution_settings(cfg), denormals=None))
    return ClientRuntime.from_prepared(prepare(cfg, dataset))


class ClientRuntime:
    """Builds a client's context for a message and calls the algorithm's client logic."""

    def __init__(
        self,
        client_logic: ClientLogic,
        data: FederatedData,
        model: torch.nn.Module,
        train: LocalTrainConfig,
        seed: int,
        test: tuple[torch.Tensor, torch.Tensor] | None = None,
        clients_together: str = "off",
        denormals: str | None = None,
        clients_together_max: int | str = "auto",
    ) -> None:
        self.client_logic = client_logic
        self.data = data
        self.model = model
        self.train = train
        self.seed = seed
        self.test = test
        self.device = data.x.device
        # "vmap" or "fused": handle_together trains an exchange's clients at once where it can
        # (fused where engines/fused.py can, by vmap elsewhere, the reason logged once).
        self.clients_together = resolve_mode(clients_together, self.device)
        self._said: set[str] = set()  # reasons for training one after another, logged once
        # Clients trained at once: a count, or "auto" (what the GPU's free memory holds).
        self.clients_together_max = clients_together_max
        self._client_bytes: int | None = None  # the estimate, made at the first exchange
        self._after_oom: int | None = None  # a chunk size that ran out of memory, halved
        self._oom_alone = False  # one client at a time ran out: one after another from then
        # The run's denormal policy, held while a handler runs, in whichever thread calls it
        # (Flower calls a ClientApp from threads of its own); None: as the process has it.
        self.denormals = denormals
        # Replies' arrays left on the device (the states still come back): set by the run
        # loop around a round whose server computes with them there (in-process only).
        self.replies_on_device = False

    @classmethod
    def from_prepared(
        cls,
        prep: Prepared,
        client_logic: ClientLogic | None = None,
        model: torch.nn.Module | None = None,
    ) -> Self:
        """The runtime of a prepared experiment; a new client logic and scratch model unless
        the caller already has them."""
        return cls(
            prep.algorithm.Client(prep.params) if client_logic is None else client_logic,
            prep.fed,
            new_model(prep) if model is None else model,
            prep.train,
            prep.cfg.seed,
            test=(prep.x_test, prep.y_test),
            clients_together=prep.cfg.clients_together,
            denormals=prep.cfg.denormals,
            clients_together_max=prep.cfg.clients_together_max,
        )

    @property
    def on_host(self) -> bool:
        """Whether the data and model are in host memory (nothing crosses the boundary)."""
        return self.device.type == "cpu"

    def context(self, cid: int, rnd: int, state: ClientState) -> ClientContext:
        """The context a handler of client ``cid`` gets in round ``rnd``."""
        return ClientContext(
            client_id=cid,
            round=rnd,
            seed=self.seed,
            data=self.data.client(cid),
            model=self.model,
            state=state,
            train=self.train,
            test_x=None if self.test is None else self.test[0],
            test_y=None if self.test is None else self.test[1],
        )

    def inbound(self, msg: Message, state: ClientState) -> Message:
        """The message with its arrays on the device, and the state moved there (in place)."""
        if self.on_host:
            return msg
        state.arrays.update(to_device(state.arrays, self.device))
        return Message(
            msg.kind,
            arrays=to_device(msg.arrays, self.device),
            scalars=msg.scalars,
            strings=msg.strings,
        )

    def outbound(self, reply: Message, state: ClientState) -> Message:
        """The reply with its arrays in host memory (left on the device where
        ``replies_on_device``), and the state moved back (in place)."""
        if self.on_host:
            return reply
        state.arrays.update(to_cpu(state.arrays))
        if self.replies_on_device:
            return reply
        return Message(
            reply.kind, arrays=to_cpu(reply.arrays), scalars=reply.scalars, strings=reply.strings
        )

    def denormals_held(self) -> AbstractContextManager[object]:
        """The run's denormal handling for the block (as the process has it when None)."""
        if self.denormals is None:
            return nullcontext()
        return denormals_applied(self.denormals)

    def handle(self, cid: int, rnd: int, msg: Message, state: ClientState) -> Message:
        with self.denormals_held():
            msg = self.inbound(msg, state)
            ctx = self.context(cid, rnd, state)
            if msg.kind == LOCAL_EVALUATION:  # the engine's own kind, not the algorithm's
                reply = answer_local_evaluation(
                    self.client_logic, msg, ctx, self.data.client_test(cid)
                )
            else:
                reply = self.client_logic.handle(msg, ctx)
                # In a summed exchange (secure aggregation, DP) the client sends its summand.
                reply = summand_reply(self.client_logic, msg, reply, ctx)
            return self.outbound(reply, state)

    def handle_together(
        self, rnd: int, messages: Mapping[int, Message], states: Mapping[int, ClientState]
    ) -> dict[int, Message] | None:
        """The replies of several clients trained together (``engine.together``), or None
        when these messages must be handled one after another (the reason is logged once).
        Each client's handler runs up to its local training and after it as it would alone;
        only the training itself is shared."""
        with self.denormals_held():
            return self._handle_together(rnd, messages, states)

    def _handle_together(
        self, rnd: int, messages: Mapping[int, Message], states: Mapping[int, ClientState]
    ) -> dict[int, Message] | None:
        if any(m.kind == LOCAL_EVALUATION for m in messages.values()):
            return None  # nothing is trained
        reason = self._together_obstacle(messages)
        if reason:
            if reason not in self._said:
                self._said.add(reason)
                log.info("clients trained one after another: %s", reason)
            return None
        cids = list(messages)
        replies: dict[int, Message] = {}
        size = self._chunk_size(cids)
        done = 0
        while done < len(cids):
            chunk = cids[done : done + size]
            if self._train_chunk(rnd, chunk, messages, states, replies):
                done += len(chunk)
                continue
            if len(chunk) == 1:
                self._oom_alone = True
                self._say(
                    "clients trained together ran out of GPU memory with one client at a "
                    "time: one after another from now on",
                    warn=True,
                )
                for cid in cids[done:]:
                    replies[cid] = self.handle(cid, rnd, messages[cid], states[cid])
                break
            self._after_oom = size = len(chunk) // 2
            self._say(
                f"clients trained together ran out of GPU memory with {len(chunk)} at once: "
                f"{size} at a time from now on (--clients-together-max N sets the number)",
                warn=True,
                key="halved",
            )
        return replies

    def _train_chunk(
        self,
        rnd: int,
        chunk: list[int],
        messages: Mapping[int, Message],
        states: Mapping[int, ClientState],
        replies: dict[int, Message],
    ) -> bool:
        """Train the clients of ``chunk`` together and add their replies; False, with nothing
        added, when the GPU ran out of memory (the chunk may then be tried smaller: its
        clients' messages, states and generators are as they were)."""
        # plain_<kind> may take from a client's state before training (FedFM's model kept from
        # its anchor exchange, FedCME's half-trained one): a chunk tried again, smaller or one
        # after another, starts from the states as they were.
        saved = {cid: (dict(states[cid].arrays), dict(states[cid].scalars)) for cid in chunk}
        try:
            plans, trained = self._train_stacked(rnd, chunk, messages, states)
        except torch.cuda.OutOfMemoryError:
            trained = None
        if trained is None:
            for cid, (arrays, scalars) in saved.items():
                states[cid].arrays.clear()
                states[cid].arrays.update(arrays)
                states[cid].scalars.clear()
                states[cid].scalars.update(scalars)
            # Outside the except clause: its traceback no longer holds the chunk's tensors.
            torch.cuda.empty_cache()
            return False
        for cid, (result, final) in zip(chunk, trained, strict=True):
            plan, ctx, msg = plans[cid]
            set_arrays(self.model, final)
            reply = summand_reply(self.client_logic, msg, plan.finish(result), ctx)
            replies[cid] = self.outbound(reply, states[cid])
        return True

    def _train_stacked(
        self,
        rnd: int,
        chunk: list[int],
        messages: Mapping[int, Message],
        states: Mapping[int, ClientState],
    ) -> tuple[
        dict[int, tuple[PlainTraining, ClientContext, Message]],
        list[tuple[TrainResult, dict[str, torch.Tensor]]],
    ]:
        """Each client's handler up to its local training, then the training, stacked."""
        plans: dict[int, tuple[PlainTraining, ClientContext, Message]] = {}
        starts: dict[int, dict[str, torch.Tensor]] = {}
        for cid in chunk:
            msg = self.inbound(messages[cid], states[cid])
            ctx = self.context(cid, rnd, states[cid])
            split, _ = plain_handler(self.client_logic, msg.kind)
            assert split is not None
            plans[cid] = (split(msg, ctx), ctx, msg)
            if ctx.loss_terms:  # train_client would add them; the stacked loop cannot
                raise ValueError(
                    f"{type(self.client_logic).__name__}.plain_{msg.kind} installed loss terms "
                    "on the context, which clients trained together do not see"
                )
            starts[cid] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        first = plans[chunk[0]][0]
        loss, after_step, after_epoch = first.loss, first.after_step, first.after_epoch
        # One function mapped over every client: a per-client closure would silently be
        # the first client's for all (bound methods of one client logic compare equal).
        for what in ("loss", "after_step", "after_epoch"):
            if any(getattr(plans[c][0], what) != getattr(first, what) for c in chunk):
                raise ValueError(
                    f"{type(self.client_logic).__name__}.plain_{messages[chunk[0]].kind} gives "
                    f"each client its own {what} function: per-client values belong in its "
                    "tensors"
                )
        # Tensors stack only where every client has them: clients that bring different ones
        # (MOON's previous model, absent at a client's first participation) train in
        # separate stacks, each client exactly as it would in one.
        stacks: dict[tuple[tuple[str, ...], ...], list[int]] = {}
        for c in chunk:
            plan = plans[c][0]
            names = (
                tuple(plan.tensors),
                tuple(plan.grad_shift),
                tuple(plan.trained),
                tuple(plan.step_tensors),
                tuple(plan.carried),
            )
            stacks.setdefault(names, []).append(c)
        trained: dict[int, tuple[TrainResult, dict[str, torch.Tensor]]] = {}
        extra = max(plan_stack_bytes(plans[c][0]) for c in chunk)
        pieces = [piece for members in stacks.values() for piece in self._pieces(members, extra)]
        fused = self.clients_together == "fused"
        if fused:
            reason = fused_why_not(self.model, loss)
            if reason:
                self._say(f"clients trained together by vmap, not fused: {reason}")
                fused = False
        # Steps of one batch size replay as CUDA graphs where the local step would.
        graphs, _ = resolve_graphs(self.train.cuda_graphs, self.device, self.model)
        for members in pieces:
            results, finals = train_together(
                self.model,
                [plans[c][1].data for c in members],
                self.train,
                [plans[c][1].rng(plans[c][0].purpose) for c in members],
                [starts[c] for c in members],
                [
                    self.train.epochs if plans[c][0].epochs is None else plans[c][0].epochs
                    for c in members
                ],
                loss=loss,
                tensors=[plans[c][0].tensors for c in members],
                grad_shifts=[plans[c][0].grad_shift for c in members],
                trained=[plans[c][0].trained for c in members],
                step_tensors=[plans[c][0].step_tensors for c in members],
                carried=[plans[c][0].carried for c in members],
                after_step=after_step,
                after_epoch=after_epoch,
                fused=fused,
                graphs=graphs,
            )
            trained.update(zip(members, zip(results, finals, strict=True), strict=True))
        return plans, [trained[c] for c in chunk]

    def _chunk_size(self, cids: list[int]) -> int:
        """How many of these clients to train at once: --clients-together-max N, or for
        auto what the device's free memory holds by the estimate (all of them on the CPU);
        never more than a size that ran out of memory before, halved."""
        size = len(cids)
        if self._after_oom is not None:
            size = min(size, self._after_oom)
        if self.clients_together_max != "auto":
            return max(1, min(size, int(self.clients_together_max)))
        free = free_bytes(self.device)
        if free is None:
            return size
        if self._client_bytes is None:
            data = self.data.client(cids[0])
            rows = torch.arange(min(self.train.batch_size, len(data)), device=self.device)
            x, y = data.batch(rows)
            self._client_bytes = client_bytes(self.model, x, y)
        fits = clients_that_fit(free, self._client_bytes)
        if fits < size:
            self._say(
                f"clients trained together: about {self._client_bytes / 2**20:.0f} MiB each, "
                f"{free / 2**30:.1f} GiB free on {self.device}: {fits} at a time "
                "(--clients-together-max N sets the number)",
                key="estimate",
            )
        return min(size, fits)

    def _pieces(self, members: list[int], extra: int) -> list[list[int]]:
        """``members`` in pieces that the free memory holds now that their plans exist, each
        client needing the estimate plus ``extra``, the bytes stacking its per-client tensors
        adds (``plan_stack_bytes``); one piece where --clients-together-max is a number, on the
        CPU, or when they fit."""
        if not extra or self.clients_together_max != "auto" or self._client_bytes is None:
            return [members]
        free = free_bytes(self.device)
        if free is None:
            return [members]
        fits = clients_that_fit(free, self._client_bytes + extra)
        if fits >= len(members):
            return [members]
        self._say(
            f"clients trained together: their own tensors add about {extra / 2**20:.0f} MiB "
            f"each, {free / 2**30:.1f} GiB free on {self.device}: {fits} at a time "
            "(--clients-together-max N sets the number)",
            key="estimate-tensors",
        )
        return [members[i : i + fits] for i in range(0, len(members), fits)]

    def _say(self, line: str, warn: bool = False, key: str | None = None) -> None:
        """Log ``line`` once per runtime (once per ``key`` where given: lines whose numbers
        change from exchange to exchange)."""
        key = line if key is None else key
        if key not in self._said:
            self._said.add(key)
            (log.warning if warn else log.info)("%s", line)

    def _together_obstacle(self, messages: Mapping[int, Message]) -> str:
        """Why these messages cannot be trained together ("" when they can)."""
        if self._oom_alone:
            return "clients trained together ran out of GPU memory with one client at a time"
        for kind in sorted({m.kind for m in messages.values()}):
            split, reason = plain_handler(self.client_logic, kind)
            if split is None:
                return reason
        return model_obstacle(self.model)
