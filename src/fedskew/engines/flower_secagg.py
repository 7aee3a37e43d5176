"""SecAgg+ on Flower for one summed exchange: Flower's protocol, driven through the Grid.

The clients run Flower's own ``secaggplus_mod`` unchanged (``secure_aggregation_mod`` puts
it in front of the fedskew ClientApp for the messages of a secure exchange only). Flower's
server side, ``SecAggPlusWorkflow``, drives the legacy Strategy API (a ``LegacyContext``,
``configure_fit``/``aggregate_fit`` on ``Parameters``) and trusts the replies, so the four
stages are driven here instead, message for message as the workflow sends them, with the
workflow's arithmetic (Flower's shares, keys, masks and dequantisation), and with every
reply checked: a malformed one leaves its node out as a dropped one, it never raises.

1. setup: the protocol's parameters to each addressed node; each answers two public keys.
2. share keys: each node gets every other node's keys and answers its secret shares,
   encrypted to each other node; the server forwards them.
3. collect masked vectors: each node gets the fedskew message (the round's "train") and
   its shares; the ClientApp trains and forms its summand, the mod quantises, masks and
   sends it. The server adds the masked vectors (modulo 2**32) and reads the numbers each
   reply holds in clear (sample count, FedNova's step count).
4. unmask: each node that sent a vector sends its shares of the others' private mask seeds
   (and of the keys of the nodes that dropped after step 2); the server removes the masks
   and dequantises the weighted mean.

All nodes of the exchange are each other's neighbours (the SecAgg+ graph is complete: a
round has few clients here), and a secret takes a majority of them to rebuild
(``threshold``). A round that cannot finish (fewer nodes than the threshold left, shares
that do not rebuild a secret) is a round without replies: the run loop skips it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Error, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.client.mod import secaggplus_mod
from flwr.common import (
    Code,
    FitRes,
    Status,
    bytes_to_ndarray,
    ndarrays_to_parameters,
)
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from fedskew.core.errors import Diverged
from fedskew.engines.flower_codec import (
    CLIENT_DIVERGED,
    RejectedReply,
    check_reply,
    check_sample_count,
    decode,
    encode,
)
from fedskew.engines.secure_sum import rounding_seed, unmasked_mean
from fedskew.training.privacy import UNIFORM
from fedskew.training.protocol import Expected, Message, NoReplies, Summed, SumRequest, needs, unmet

if TYPE_CHECKING:
    from fedskew.engines.flower_engine import FlowerEngine

log = logging.getLogger("fedskew")
MAX_KEY_BYTES = 4096  # a public key or a share is some hundred bytes


class Abort(Exception):
    """The exchange cannot finish; the message says why."""


def threshold(nodes: int) -> int:
    """Shares that rebuild a secret: a majority of the nodes, at least 2."""
    return max(2, nodes // 2 + 1)


def secure_exchange(
    engine: FlowerEngine, messages: Mapping[int, Message], expect: Expected, request: SumRequest
) -> Summed:
    """The summed exchange of ``messages`` under SecAgg+; NoReplies when it cannot finish
    (the run loop then skips the round)."""
    run = _SecureRound(engine, messages, expect, request)
    try:
        return run.play()
    except Abort as exc:
        for cid in messages:
            engine.missing.add(cid)
        if run.diverged:
            # The sum failed because clients' training diverged: stop as in process.
            cid = min(run.diverged)
            raise Diverged(
                f"round {engine.round + 1}: secure aggregation stopped ({exc}); "
                f"{len(run.diverged)} of {len(messages)} clients diverged (client {cid}: "
                f"{run.diverged[cid]})",
                engine.round + 1,
            ) from None
        raise NoReplies(f"secure aggregation stopped: {exc}") from None


class _SecureRound:
    def __init__(
        self,
        engine: FlowerEngine,
        messages: Mapping[int, Message],
        expect: Expected,
        request: SumRequest,
    ) -> None:
        self.engine = engine
        self.messages = messages
        self.request = request
        # Only the numbers travel in clear: what the server reads of them.
        self.expect = {k: needs((), n.scalars) for k, n in expect.items()}
        self.client_of: dict[int, int] = {}  # node id -> client id
        for cid in messages:
            node = engine.node_of.get(cid)
            if node is None:
                engine.missing.add(cid)
            else:
                self.client_of[node] = cid
        self.threshold = threshold(len(self.client_of))
        self.diverged: dict[int, str] = {}  # client id -> what it said (CLIENT_DIVERGED)
        self.shapes = [(1,), *(tuple(request.shapes[n]) for n in request.names())]

    # ---------------------------------------------------------------------- the stages

    def play(self) -> Summed:
        self.engine.traffic.exchanges += 1
        for msg in self.messages.values():
            self.engine.traffic.bytes_down += msg.nbytes()
        if len(self.client_of) < 2:
            raise Abort(f"{len(self.client_of)} node(s) to sum over, it takes 2")
        keys = self.setup(list(self.client_of))
        forwarded = self.share_keys(keys)
        total, clear = self.collect(forwarded)
        dead = set(forwarded) - set(clear)
        total = self.unmask(total, set(clear), dead, keys)
        vectors, weight = unmasked_mean(total, len(clear), self.request)
        mean = {
            name: torch.from_numpy(np.asarray(v, dtype=np.float64)).reshape(
                self.request.shapes[name]
            )
            for name, v in zip(self.request.names(), vectors, strict=True)
        }
        return Summed(mean, weight, {self.client_of[n]: m for n, m in clear.items()})

    def setup(self, nodes: list[int]) -> dict[int, tuple[bytes, bytes]]:
        r = self.request
        config = {
            Key.STAGE: Stage.SETUP,
            Key.SAMPLE_NUMBER: len(nodes),
            Key.SHARE_NUMBER: len(nodes),
            Key.THRESHOLD: self.threshold,
            Key.CLIPPING_RANGE: float(r.clip_range),
            Key.TARGET_RANGE: int(r.quantization),
            Key.MOD_RANGE: int(r.modulus),
            Key.MAX_WEIGHT: float(r.max_weight),
        }
        keys: dict[int, tuple[bytes, bytes]] = {}
        for node, record in self.send({n: _configs(config) for n in nodes}, "setup").items():
            pk1, pk2 = record.get(Key.PUBLIC_KEY_1), record.get(Key.PUBLIC_KEY_2)
            if _is_key(pk1) and _is_key(pk2):
                keys[node] = (pk1, pk2)
            else:
                self.left_out(node, "setup", "its answer holds no two public keys")
        seen: dict[bytes, int] = {}
        for node, pair in list(keys.items()):
            if any(k in seen for k in pair) or pair[0] == pair[1]:
                self.left_out(node, "setup", "it repeats a public key")
                del keys[node]
            seen.update(dict.fromkeys(pair, node))
        self.enough(keys, "setup")
        return keys

    def share_keys(
        self, keys: dict[int, tuple[bytes, bytes]]
    ) -> dict[int, tuple[list[int], list[bytes]]]:
        """Each node's encrypted shares, forwarded: {destination: (sources, ciphertexts)}."""
        published = {str(n): list(pair) for n, pair in keys.items()}
        contents = {n: _configs({**published, Key.STAGE: Stage.SHARE_KEYS}) for n in keys}
        answers = self.send(contents, "share keys")
        forwarded: dict[int, tuple[list[int], list[bytes]]] = {n: ([], []) for n in answers}
        for node, record in answers.items():
            dsts, texts = record.get(Key.DESTINATION_LIST), record.get(Key.CIPHERTEXT_LIST)
            valid = (
                isinstance(dsts, list) and isinstance(texts, list) and len(dsts) == len(texts)
                and len(set(dsts)) == len(dsts)
                and all(isinstance(d, int) and d in keys and d != node for d in dsts)
                and all(isinstance(t, bytes) and len(t) <= MAX_KEY_BYTES for t in texts)
            )  # fmt: skip
            if not valid:
                self.left_out(node, "share keys", "its answer is not a list of shares")
                forwarded.pop(node)
                continue
            for dst, text in zip(dsts, texts, strict=True):
                if dst in forwarded:
                    forwarded[dst][0].append(node)
                    forwarded[dst][1].append(text)
        for node in list(forwarded):  # shares from nodes that were left out meanwhile
            srcs, texts = forwarded[node]
            kept = [(s, t) for s, t in zip(srcs, texts, strict=True) if s in forwarded]
            forwarded[node] = ([s for s, _ in kept], [t for _, t in kept])
        self.enough(forwarded, "share keys")
        return forwarded

    def collect(
        self, forwarded: dict[int, tuple[list[int], list[bytes]]]
    ) -> tuple[list[np.ndarray], dict[int, Message]]:
        """(the sum of the masked vectors modulo 2**32, what each node that sent one sent in
        clear)."""
        contents = {}
        for node, (srcs, texts) in forwarded.items():
            cid = self.client_of[node]
            content = encode(self.messages[cid], {"round": self.engine.round, "client_id": cid})
            content[RECORD_KEY_CONFIGS] = ConfigRecord(
                {
                    Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                    Key.CIPHERTEXT_LIST: texts,
                    Key.SOURCE_LIST: srcs,
                }  # fmt: skip
            )
            contents[node] = content
        total: list[np.ndarray] | None = None
        clear: dict[int, Message] = {}
        for node, reply in self.send_contents(contents, "collect masked vectors").items():
            cid = self.client_of[node]
            try:
                numbers, vector = self.checked(reply, cid)
            except RejectedReply as exc:
                log.warning("round %d: reply of client %d rejected: %s",
                            self.engine.round + 1, cid, exc)  # fmt: skip
                self.engine.rejected.add(cid)
                self.engine.missing.add(cid)
                continue
            clear[node] = numbers
            self.engine.traffic.bytes_up += self.request.masked_nbytes() + numbers.nbytes()
            total = vector if total is None else [a + b for a, b in zip(total, vector, strict=True)]
        self.enough(clear, "collect masked vectors")
        assert total is not None
        modulus = self.request.modulus
        return [t % modulus for t in total], clear

    def unmask(
        self,
        total: list[np.ndarray],
        active: set[int],
        dead: set[int],
        keys: dict[int, tuple[bytes, bytes]],
    ) -> list[np.ndarray]:
        config = {
            Key.STAGE: Stage.UNMASK,
            Key.ACTIVE_NODE_ID_LIST: sorted(active),
            Key.DEAD_NODE_ID_LIST: sorted(dead),
        }
        shares: dict[int, dict[int, bytes]] = {n: {} for n in active | dead}  # owner -> sender
        # A node silent now has its vector in the sum already: not a lost reply (the others'
        # shares of its mask seed suffice).
        answers = self.send({n: _configs(config) for n in active}, "unmask", lost=False)
        for node, record in answers.items():
            owners, parts = record.get(Key.NODE_ID_LIST), record.get(Key.SHARE_LIST)
            if not (
                isinstance(owners, list) and isinstance(parts, list)
                and len(owners) == len(parts)
                and all(isinstance(o, int) and o in shares for o in owners)
                and all(isinstance(p, bytes) and len(p) <= MAX_KEY_BYTES for p in parts)
            ):  # fmt: skip
                self.left_out(node, "unmask", "its answer is not a list of shares", lost=False)
                continue
            for owner, part in zip(owners, parts, strict=True):
                shares[owner][node] = part
        modulus = self.request.modulus
        try:
            for owner, held in shares.items():
                if len(held) < self.threshold:
                    raise Abort(f"{len(held)} shares of node {owner}'s secret, it takes "
                                f"{self.threshold}")  # fmt: skip
                secret = combine_shares(list(held.values()))
                if owner in active:  # its private mask
                    mask = pseudo_rand_gen(secret, modulus, self.shapes)
                    total = [t - m for t, m in zip(total, mask, strict=True)]
                    continue
                # a node that dropped after sharing its keys: its pairwise masks with the
                # nodes whose vectors are in the sum, as they added (or subtracted) them
                private = bytes_to_private_key(secret)
                for other in active:
                    key = generate_shared_key(private, bytes_to_public_key(keys[other][0]))
                    mask = pseudo_rand_gen(key, modulus, self.shapes)
                    sign = 1 if owner > other else -1
                    total = [t + sign * m for t, m in zip(total, mask, strict=True)]
        except Abort:
            raise
        except Exception as exc:  # noqa: BLE001 - shares a client made must not stop the server
            raise Abort(f"the shares do not rebuild the masks ({type(exc).__name__})") from None
        return [t % modulus for t in total]

    # ---------------------------------------------------------------------- helpers

    def checked(self, reply: RecordDict, cid: int) -> tuple[Message, list[np.ndarray]]:
        """(the numbers of a masked-vector reply, its masked vector), or RejectedReply."""
        try:
            decoded, _ = decode(reply)
            raw = reply.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]
            vector = [bytes_to_ndarray(b) for b in raw]  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - any content a node sends must not stop us
            raise RejectedReply(
                f"it is not a masked fedskew reply ({type(exc).__name__})"
            ) from None
        if decoded.arrays:
            raise RejectedReply("it holds arrays in clear")
        size = None if self.engine.client_sizes is None else self.engine.client_sizes[cid]
        check_reply(decoded, {}, {}, self.engine.scalars, size)
        check_sample_count(decoded, size)
        why = unmet(decoded, self.expect)
        if why is not None:
            raise RejectedReply(f"it {why}")
        if len(vector) != len(self.shapes):
            raise RejectedReply(
                f"its masked vector has {len(vector)} arrays, not {len(self.shapes)}"
            )
        for got, shape in zip(vector, self.shapes, strict=True):
            if got.dtype != np.int64 or got.shape != shape:
                raise RejectedReply(f"a masked array is {got.shape} {got.dtype}, not {shape} int64")
            if got.size and (int(got.min()) < 0 or int(got.max()) >= self.request.modulus):
                raise RejectedReply("a masked value is outside [0, 2**32)")
        return Message(decoded.kind, scalars=decoded.scalars), vector

    def send(
        self, contents: Mapping[int, RecordDict], stage: str, lost: bool = True
    ) -> dict[int, ConfigRecord]:
        """The protocol's config record of each node's answer (``lost``: a node that gives
        none counts as a lost reply)."""
        out: dict[int, ConfigRecord] = {}
        for node, reply in self.send_contents(contents, stage, lost).items():
            record = reply.config_records.get(RECORD_KEY_CONFIGS)
            if record is None:
                self.left_out(node, stage, "its answer has no SecAgg+ record", lost)
            else:
                out[node] = record
        return out

    def send_contents(
        self, contents: Mapping[int, RecordDict], stage: str, lost: bool = True
    ) -> dict[int, RecordDict]:
        """Each node's answer to its content, from the nodes that answered without error."""
        outgoing = [
            FlowerMessage(content, node, "train", group_id=str(self.engine.round))
            for node, content in contents.items()
        ]
        answers: dict[int, RecordDict] = {}
        for reply in self.engine.grid.send_and_receive(outgoing, timeout=self.engine.timeout):
            node = reply.metadata.src_node_id
            if node not in contents or node in answers:
                continue
            if reply.has_error():
                said = " ".join(str(reply.error.reason or "").split())[:300]
                if reply.error.code == CLIENT_DIVERGED:
                    self.diverged[self.client_of[node]] = said
                self.left_out(node, stage, said, lost)
                continue
            answers[node] = reply.content
        for node in contents:
            if node not in answers and lost:
                self.engine.missing.add(self.client_of[node])
        return answers

    def left_out(self, node: int, stage: str, why: str, lost: bool = True) -> None:
        cid = self.client_of[node]
        log.warning("round %d: client %d left out of secure aggregation (%s): %s",
                    self.engine.round + 1, cid, stage, why)  # fmt: skip
        if lost:
            self.engine.missing.add(cid)

    def enough(self, nodes: Mapping[int, Any], stage: str) -> None:
        if len(nodes) < self.threshold:
            raise Abort(f"{len(nodes)} node(s) left after {stage}, it takes {self.threshold}")


def _configs(values: Mapping[str, Any]) -> RecordDict:
    return RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(dict(values))})


def _is_key(value: object) -> bool:
    return isinstance(value, bytes) and 0 < len(value) <= MAX_KEY_BYTES


# ---------------------------------------------------------------------------- client side


def is_secure_stage(message: FlowerMessage) -> bool:
    """Whether a message is one of a secure exchange's (it carries SecAgg+'s record)."""
    return RECORD_KEY_CONFIGS in message.content.config_records


def secure_aggregation_mod(
    message: FlowerMessage,
    context: Context,
    call_next: Callable[[FlowerMessage, Context], FlowerMessage],
) -> FlowerMessage:
    """Flower's ``secaggplus_mod`` for the messages of a secure exchange; every other
    message goes straight to the ClientApp's handler. NumPy's global generator, which the
    mod's random rounding draws from (seeded by the handler: ``secure_reply``), is put back
    after it."""
    if not is_secure_stage(message):
        return call_next(message, context)
    state = np.random.get_state()
    try:
        return secaggplus_mod(message, context, call_next)
    except Diverged as exc:
        # Its summand is NaN or Inf: out of the sum, saying why in one line (the server
        # stops the run when the sum fails for it) rather than as Flower's traceback.
        error = Error(code=CLIENT_DIVERGED, reason=str(exc).splitlines()[0][:300])
        return FlowerMessage(error, reply_to=message)
    finally:
        np.random.set_state(state)


def secure_reply(reply: Message, sent: Message, seed: int, rnd: int, cid: int) -> RecordDict:
    """The content a ClientApp answers a collect-masked-vectors message with: the numbers in
    fedskew's records, the summands (in the order the server sums them) and the weight as
    the legacy FitRes that ``secaggplus_mod`` masks. Seeds NumPy's global generator for the
    mod's random rounding, which comes next."""
    names = sorted(reply.arrays)
    arrays = [reply.arrays[n].detach().cpu().contiguous().numpy() for n in names]
    weight = 1 if sent.scalars.get(UNIFORM) else int(reply.scalars["num_samples"])
    fit = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), weight, {})
    content = encode(Message(reply.kind, scalars=reply.scalars, strings=reply.strings), {})
    for name, record in compat.fitres_to_recorddict(fit, keep_input=False).items():
        content[name] = record
    np.random.seed(rounding_seed(seed, rnd, cid))
    return content
