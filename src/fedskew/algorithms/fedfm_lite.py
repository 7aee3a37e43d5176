"""FedFM-Lite (Ye et al., IEEE TSP 2023, Sec. VI): anchors every round, models every ``a``.

One exchange per round. The server sends each sampled client the global anchors (from the
launching round on) and, only when that client does not hold the current global model yet,
the model. The client trains E epochs from its model with CE + lam * l_FM against the anchors,
then computes its local anchors with its *trained local model* and uploads them (with class
counts under weighted aggregation). In a model round it also uploads its model, which the
server FedAvg-averages; otherwise it keeps the model in its client state for the next round.
The loss, the anchor aggregation and their parameters are FedFM's (``lam``, ``cg_tau``,
``start_round``, ``fm_loss``, ``anchor_agg``; see ``fedskew.algorithms.fedfm``), and so is the
``lam_warmup`` remedy (``fedskew.algorithms.fedfm_remedies``; off by default).

Parameter ``a`` (default 5, the setting of the paper's headline claims; the paper sweeps
{1, 2, 5, 10}): models are uploaded and averaged in rounds ``t`` (0-based) with
``(t + 1) % a == 0``.

Choices the paper leaves open, marked [PROPOSAL]:
- Local anchors are computed after local training with the local model (the paper's "models
  are not communicated" leaves no global model to compute them with); ``a = 1`` is therefore
  FedFM except that the anchors come from the local models of the previous round.
- Round 0 has no anchors yet, so feature matching starts at ``max(start_round, 1)``.
- The last round of the run is always a model round, so that the evaluated global model
  contains the last local training (otherwise up to ``a - 1`` rounds of it would be lost).
- A client that was not sampled in the round the global model last changed gets the current
  global model when it is next sampled and starts from it; its older local model is dropped.
  The server knows this from its own record of which model version it sent to whom; it never
  reads client state. A client deletes its kept model after uploading it in a model round.
- A client whose reply does not arrive is left out of the anchor aggregation and of the model
  average. The server cannot tell whether it still holds a model (a dead node loses it), so it
  forgets what it sent it: the client gets the global model again when it is next sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedskew.algorithms.fedfm import (
    ANCHORS,
    COUNTS,
    AnchorMatchingLoss,
    FeatureMatchingParams,
    aggregate_anchors,
    anchor_fields,
    anchor_metrics,
    anchor_needs,
    anchor_reply_arrays,
    defined_rows,
    local_anchor_arrays,
    matching_inactive,
    received_anchors,
    settings_of,
)
from fedskew.core.errors import UsageError
from fedskew.training.aggregation import weighted_average
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    InactiveMechanism,
    RunShape,
    ServerLogic,
    ServerSetup,
)
from fedskew.training.local import (
    PlainTraining,
    TrainResult,
    cross_entropy_loss,
    get_arrays,
    run_plain,
    set_arrays,
)
from fedskew.training.protocol import ArraySpec, Channel, Message, arrived, needs
from fedskew.training.state_spec import (
    Number,
    PerClient,
    Spec,
    StatePart,
    after_training,
    model_part,
)

_KEPT = "fmlite.model/"  # client state prefix: the local model between model rounds


@dataclass
class FedFMLiteParams(FeatureMatchingParams):
    a: int = 5

    def validate(self) -> None:
        super().validate()
        if self.a < 1:
            raise UsageError(f"fedfm-lite: a must be >= 1, got {self.a}")


class FedFMLiteServer(ServerLogic):
    checkpoint_fields = ("fm_anchors", "model_version", "version_sent")

    def __init__(self, params: FedFMLiteParams, setup: ServerSetup) -> None:
        super().__init__(params, setup)
        self.fm_anchors = None
        self.model_version = 0
        self.version_sent: dict[int, int] = {}  # client -> global model version it was sent

    def is_model_round(self, rnd: int) -> bool:
        return (rnd + 1) % self.params.a == 0 or rnd + 1 == self.setup.rounds

    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        s = settings_of(self.params)
        sync = self.is_model_round(rnd)
        active = (
            rnd >= s.start_round
            and self.fm_anchors is not None
            and bool(defined_rows(self.fm_anchors).any())
        )
        messages: dict[int, Message] = {}
        models_sent = 0
        for c in clients:
            arrays = {}
            if self.version_sent.get(c) != self.model_version:
                arrays.update(self.global_arrays)
                self.version_sent[c] = self.model_version
                models_sent += 1
            if active:
                arrays[ANCHORS] = self.fm_anchors
            messages[c] = Message(
                "lite_train", arrays=arrays, scalars={"upload_model": float(sync)}
            )
        # The anchors every round; the model and its sample count in a model round.
        model, counts = (self.global_arrays, ("num_samples",)) if sync else ((), ())
        uploads = needs((*anchor_needs(s.agg).arrays, *model), ("loss", *counts))
        expect = {"lite_trained": uploads}
        replies = channel.exchange(messages, expect)
        for c in clients:
            if c not in replies:  # it may have lost its model: send it again next time
                self.version_sent.pop(c, None)
        clients = arrived(clients, replies)
        self.fm_anchors = aggregate_anchors([replies[c] for c in clients], self.fm_anchors, s.agg)
        if sync:
            states = [
                {k: v for k, v in replies[c].arrays.items() if k not in (ANCHORS, COUNTS)}
                for c in clients
            ]
            weights = [replies[c].scalars["num_samples"] for c in clients]
            self.global_arrays = weighted_average(states, weights)
            self.model_version += 1
        return {
            "train_loss": self.mean_train_loss(replies, clients),
            **anchor_metrics(active, self.fm_anchors, s.tau),
            "model_round": float(sync),
            "models_sent": float(models_sent),
        }


class FedFMLiteClient(ClientLogic):
    def on_lite_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_lite_train(msg, ctx), ctx)

    def plain_lite_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """Load the model (sent, or kept); train with CE + lam * l_FM against the anchors
        sent; then reply with the local anchors, and the model or keep it."""
        s = settings_of(self.params)
        state = ctx.state
        model = {k: v for k, v in msg.arrays.items() if k != ANCHORS}
        if not model:
            model = {k[len(_KEPT) :]: v for k, v in state.arrays.items() if k.startswith(_KEPT)}
            if not model:
                raise RuntimeError(
                    f"fedfm-lite: client {ctx.client_id} was sent no model and keeps none"
                )
        set_arrays(ctx.model, model)
        for key in [k for k in state.arrays if k.startswith(_KEPT)]:
            del state.arrays[key]

        def finish(result: TrainResult) -> Message:
            arrays = local_anchor_arrays(ctx.model, ctx, s.agg)
            scalars = {"loss": result.mean_loss}
            if msg.scalars["upload_model"]:
                arrays.update(get_arrays(ctx.model))
                scalars["num_samples"] = float(len(ctx.data))
            else:
                for key, value in get_arrays(ctx.model).items():
                    state.arrays[_KEPT + key] = value
            return Message("lite_trained", arrays=arrays, scalars=scalars)

        return PlainTraining(
            finish,
            loss=AnchorMatchingLoss(cross_entropy_loss, s.lam_in(ctx.round), s),
            tensors=received_anchors(msg, self.params, ctx.round),
        )


def holds_current_model(server: FedFMLiteServer, client: int, trained: bool | None) -> bool | None:
    """A client that has the current model version keeps its local model; another may keep
    one too (its reply dropped after it trained), which the next model it is sent replaces."""
    return True if server.version_sent.get(client) == server.model_version else None


class FedFMLite(Algorithm):
    name = "fedfm-lite"
    description = "FedFM-Lite: anchors exchanged every round, models every a rounds"
    Params = FedFMLiteParams
    Server = FedFMLiteServer
    Client = FedFMLiteClient
    feature_matching = True  # --feature-matching leaves it as it is

    @classmethod
    def reply_arrays(
        cls, params: FedFMLiteParams, model: torch.nn.Module, num_classes: int
    ) -> dict[str, ArraySpec]:
        return anchor_reply_arrays(model, num_classes)

    @classmethod
    def checkpoint_specs(
        cls, params: FedFMLiteParams, model: torch.nn.Module, num_classes: int
    ) -> dict[str, Spec]:
        """The anchors, and the model version each client was last sent."""
        sent = PerClient(Number(int), holds=after_training)  # dropped where a reply is lost
        return {**anchor_fields(model, num_classes), "version_sent": sent}

    @classmethod
    def client_state(
        cls, params: FedFMLiteParams, model: torch.nn.Module, num_classes: int
    ) -> tuple[StatePart, ...]:
        """The local model between model rounds: a client that was sent the current model
        version trains from its kept model, as the server sends it none."""
        return (model_part(_KEPT, model, holds=holds_current_model),)

    @classmethod
    def inactive_mechanisms(
        cls, params: FedFMLiteParams, shape: RunShape
    ) -> list[InactiveMechanism]:
        """Feature matching launched after the last round (round 0 has no anchors, so it
        cannot act before round 1); a model period that no round of the run completes."""
        found = matching_inactive(
            params,
            shape,
            "clients train with plain cross-entropy",
            first_round=max(settings_of(params).start_round, 1),
        )
        if params.a > shape.rounds:
            found.append(
                InactiveMechanism(
                    "model averaging every a rounds",
                    {"a": params.a, "rounds": shape.rounds},
                    "no period completes within the run: the models are averaged only in the "
                    "last round, which always is a model round (as with a = rounds)",
                )
            )
        return found
