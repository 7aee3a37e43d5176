"""CReFF (Shang et al., IJCAI 2022): classifier re-training on federated features.

FedAvg runs unchanged on the model. Next to it the server keeps ``num_features`` synthetic
("federated") features per class and a classifier re-trained on them each round; that
re-trained classifier, on the FedAvg body, is the model the evaluation scores.

Each round:
1. The server sends the global model and the current re-trained classifier W.
2. Each client, BEFORE local training, computes for every class c it holds the gradient of
   the mean CE of W on its real features of class c, w.r.t. W's weight (and bias), with the
   global body it just received (eval mode). It then trains as FedAvg does and returns its
   model plus those per-class gradients (only for the classes it holds, with their indices).
3. The server averages the models (FedAvg) and, per class, the clients' gradients (a plain
   mean over the clients holding the class, as in the reference code). For ``match_epochs``
   SGD steps (lr ``lr_feature``) it moves the synthetic features of each such class so that
   the gradient of W on them matches the real one (distance ``dis_metric``; default "ours",
   the sum over W's rows of 1 - cosine, the bias counted as one row).
4. It re-trains a fresh linear classifier on all synthetic features for ``crt_epochs``
   epochs (SGD, lr ``lr_net``, the clients' batch size) and uses it for evaluation and as
   the next round's W.

Choices, all following the FedNH code base's CReFF: gradients are taken with the received
global body and the previous re-trained classifier, so every client's gradient lives in the
same feature space and the server's matching uses the very W the clients used; synthetic
features persist across rounds (standard normal at the start); the re-trained classifier
starts from a fresh initialisation each round. Two choices of ours: each client uses ALL
its samples of a class (the exact mean gradient that the code's ten random 32-sample draws
estimate), and the first round's W is the initial model's head. The model's head must be
linear (``head.weight`` and optionally ``head.bias``). A client whose reply does not arrive
takes no part in the round: the model average and the per-class gradients, hence the synthetic
features the server moves, come from the replies that arrived only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedskew.core.errors import UsageError
from fedskew.core.rng import torch_rng
from fedskew.data.federated import ClientData
from fedskew.training.aggregation import weighted_average
from fedskew.training.interface import (
    Algorithm,
    ClientContext,
    ClientLogic,
    ServerLogic,
    ServerSetup,
    check_one_of,
    keeps_nothing,
)
from fedskew.training.local import (
    PlainTraining,
    TrainResult,
    batch_bounds,
    get_arrays,
    run_plain,
    set_arrays,
    trained_needs,
    trained_reply,
)
from fedskew.training.protocol import ArraySpec, Channel, Message, arrived

DIS_METRICS = ("ours", "mse", "cos")
HEAD_WEIGHT, HEAD_BIAS = "head.weight", "head.bias"
CLF_WEIGHT, CLF_BIAS = "classifier.weight", "classifier.bias"
GRAD_WEIGHT, GRAD_BIAS, GRAD_CLASSES = "real_grad.weight", "real_grad.bias", "real_grad.classes"


@dataclass
class CReFFParams:
    num_features: int = 100  # federated features per class
    match_epochs: int = 100  # gradient-matching steps per round
    crt_epochs: int = 300  # classifier re-training epochs per round
    lr_feature: float = 0.1
    lr_net: float = 0.01
    dis_metric: str = "ours"

    def validate(self) -> None:
        for name in ("num_features", "match_epochs", "crt_epochs"):
            value = getattr(self, name)
            low = 1 if name == "num_features" else 0
            if value < low:
                raise UsageError(f"creff: {name} must be >= {low}, got {value}")
        for name in ("lr_feature", "lr_net"):
            if getattr(self, name) <= 0:
                raise UsageError(f"creff: {name} must be > 0, got {getattr(self, name)}")
        check_one_of("creff", "dis_metric", self.dis_metric, DIS_METRICS)


def class_gradients(
    features: torch.Tensor,
    classes: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of mean CE(W f + b, c) w.r.t. W and b, one per group of features.

    ``features`` is (K, m, d), group k all labelled ``classes[k]``. Closed form
    dL/dW = mean_i (softmax_i - e_c) f_i^T, dL/db = mean_i (softmax_i - e_c), which stays
    differentiable in the features (what matching needs) and costs one batched matmul.
    """
    logits = features @ weight.t()
    if bias is not None:
        logits = logits + bias
    residual = (
        logits.softmax(dim=-1) - F.one_hot(classes, weight.shape[0]).to(logits.dtype)[:, None, :]
    )
    m = features.shape[1]
    grad_w = torch.einsum("kmc,kmd->kcd", residual, features) / m
    grad_b = residual.mean(dim=1) if bias is not None else None
    return grad_w, grad_b


def _row_cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum over rows of 1 - cos(a_row, b_row); the last axis is the row."""
    dot = (a * b).sum(dim=-1)
    return (1 - dot / (a.norm(dim=-1) * b.norm(dim=-1) + 1e-6)).sum()


def matching_distance(
    syn: list[torch.Tensor], real: list[torch.Tensor], metric: str
) -> torch.Tensor:
    """Distance between synthetic and real gradients, summed over classes (axis 0).

    Each list holds the weight gradients (K, C, d) and, if any, the bias gradients (K, C).
    """
    if metric == "ours":
        total = _row_cosine_distance(syn[0], real[0])
        if len(syn) > 1:
            total = total + _row_cosine_distance(syn[1], real[1])
        return total
    k = syn[0].shape[0]
    syn_flat = torch.cat([g.reshape(k, -1) for g in syn], dim=1)
    real_flat = torch.cat([g.reshape(k, -1) for g in real], dim=1)
    if metric == "mse":
        return ((syn_flat - real_flat) ** 2).sum()
    return _row_cosine_distance(syn_flat, real_flat)


@torch.no_grad()
def real_class_gradients(
    model: torch.nn.Module,
    data: ClientData,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    batch_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(classes held, weight gradients (m, C, d), bias gradients (m, C) or None) of the
    mean CE of the classifier on the body's features of each class, in eval mode."""
    was_training = model.training
    model.eval()
    positions = torch.arange(len(data), device=data.device)
    feats, labels = [], []
    for start in range(0, len(data), batch_size):
        xb, yb = data.batch(positions[start : start + batch_size])
        feats.append(model.body(xb).float())
        labels.append(yb)
    model.train(was_training)
    features, y = torch.cat(feats), torch.cat(labels)
    classes = torch.unique(y)
    grads_w, grads_b = [], []
    for c in classes.tolist():
        label = torch.tensor([c], device=features.device)
        g_w, g_b = class_gradients(features[y == c][None], label, weight, bias)
        grads_w.append(g_w[0])
        if g_b is not None:
            grads_b.append(g_b[0])
    return classes, torch.stack(grads_w), torch.stack(grads_b) if grads_b else None


class CReFFServer(ServerLogic):
    params: CReFFParams
    checkpoint_fields = ("features", "classifier")  # server state a resumed run needs

    def __init__(self, params: CReFFParams, setup: ServerSetup) -> None:
        super().__init__(params, setup)
        head_keys = {k for k in self.global_arrays if k.startswith("head.")}
        if HEAD_WEIGHT not in head_keys or not head_keys <= {HEAD_WEIGHT, HEAD_BIAS}:
            raise UsageError("creff needs a model whose head is one linear layer")
        self.has_bias = HEAD_BIAS in head_keys
        num_classes, dim = self.global_arrays[HEAD_WEIGHT].shape
        self.num_classes, self.dim = num_classes, dim
        gen = torch_rng(setup.seed, -1, -1, "creff-features")
        self.features = torch.randn(
            num_classes, params.num_features, dim, generator=gen, device=gen.device
        )
        self.classifier = {CLF_WEIGHT: self.global_arrays[HEAD_WEIGHT].clone()}
        if self.has_bias:
            self.classifier[CLF_BIAS] = self.global_arrays[HEAD_BIAS].clone()

    def round(self, rnd: int, clients: list[int], channel: Channel) -> dict[str, float]:
        msg = Message("train", arrays={**self.global_arrays, **self.classifier})
        grads = (GRAD_CLASSES, GRAD_WEIGHT, *((GRAD_BIAS,) if self.has_bias else ()))
        expect = trained_needs((*self.global_arrays, *grads), "num_samples")
        replies = channel.exchange({c: msg for c in clients}, expect)
        clients = arrived(clients, replies)  # features move only by the gradients that arrived
        model_keys = list(self.global_arrays)
        self.global_arrays = weighted_average(
            [{k: replies[c].arrays[k] for k in model_keys} for c in clients],
            [replies[c].scalars["num_samples"] for c in clients],
        )
        classes, real = self.aggregate_gradients([replies[c] for c in clients])
        distance = self.match(classes, real)
        self.classifier = self.retrain(rnd)
        return {
            "train_loss": self.mean_train_loss(replies, clients),
            "match_distance": distance,
        }

    def aggregate_gradients(
        self, replies: list[Message]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Per class, the plain mean of the gradients of the clients holding it."""
        dev = self.features.device
        sum_w = torch.zeros(self.num_classes, self.num_classes, self.dim, device=dev)
        sum_b = torch.zeros(self.num_classes, self.num_classes, device=dev)
        holders = torch.zeros(self.num_classes, device=dev)
        for reply in replies:
            cls = reply.arrays[GRAD_CLASSES]
            sum_w.index_add_(0, cls, reply.arrays[GRAD_WEIGHT])
            if self.has_bias:
                sum_b.index_add_(0, cls, reply.arrays[GRAD_BIAS])
            holders.index_add_(0, cls, torch.ones(len(cls), device=dev))
        classes = torch.nonzero(holders > 0).flatten()
        n = holders[classes]
        real = [sum_w[classes] / n[:, None, None]]
        if self.has_bias:
            real.append(sum_b[classes] / n[:, None])
        return classes, real

    def match(self, classes: torch.Tensor, real: list[torch.Tensor]) -> float:
        """Move the synthetic features of ``classes`` so that W's gradients on them match
        ``real``; return the distance after the last step."""
        weight = self.classifier[CLF_WEIGHT]
        bias = self.classifier.get(CLF_BIAS)
        if len(classes) == 0:
            return 0.0
        feats = self.features[classes].clone().requires_grad_(True)
        opt = torch.optim.SGD([feats], lr=self.params.lr_feature)
        for _ in range(self.params.match_epochs):
            g_w, g_b = class_gradients(feats, classes, weight, bias)
            syn = [g_w] if g_b is None else [g_w, g_b]
            loss = matching_distance(syn, real, self.params.dis_metric)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        with torch.no_grad():
            self.features[classes] = feats.detach()
            g_w, g_b = class_gradients(self.features[classes], classes, weight, bias)
            syn = [g_w] if g_b is None else [g_w, g_b]
            return float(matching_distance(syn, real, self.params.dis_metric))

    @torch.no_grad()
    def retrain(self, rnd: int) -> dict[str, torch.Tensor]:
        """A fresh linear classifier trained by plain SGD on all synthetic features.

        Thousands of tiny steps per round: the CE gradient is written out instead of taken
        by autograd, which is several times faster at this size and the same update.
        """
        gen = torch_rng(self.setup.seed, rnd, -1, "creff-retrain")
        bound = 1 / math.sqrt(self.dim)  # nn.Linear's default initialisation range
        host = gen.device
        weight = torch.rand(self.num_classes, self.dim, generator=gen, device=host)
        weight = (weight * 2 - 1) * bound
        bias = None
        if self.has_bias:
            bias = (torch.rand(self.num_classes, generator=gen, device=host) * 2 - 1) * bound
        x = self.features.reshape(-1, self.dim)
        y = torch.arange(self.num_classes, device=x.device).repeat_interleave(
            self.params.num_features
        )
        onehot = F.one_hot(y, self.num_classes).to(x.dtype)
        lr = self.params.lr_net
        bounds = batch_bounds(len(y), self.setup.train.batch_size)
        for _ in range(self.params.crt_epochs):
            perm = torch.randperm(len(y), generator=gen, device=host)
            for start, stop in bounds:
                idx = perm[start:stop]
                xb = x[idx]
                logits = xb @ weight.t()
                if bias is not None:
                    logits += bias
                residual = logits.softmax(dim=1).sub_(onehot[idx]).div_(stop - start)
                weight.sub_(residual.t() @ xb, alpha=lr)
                if bias is not None:
                    bias.sub_(residual.sum(dim=0), alpha=lr)
        out = {CLF_WEIGHT: weight}
        if bias is not None:
            out[CLF_BIAS] = bias
        return out

    def eval_arrays(self) -> dict[str, torch.Tensor]:
        """The FedAvg body with the re-trained classifier as its head."""
        arrays = dict(self.global_arrays)
        arrays[HEAD_WEIGHT] = self.classifier[CLF_WEIGHT]
        if self.has_bias:
            arrays[HEAD_BIAS] = self.classifier[CLF_BIAS]
        return arrays


class CReFFClient(ClientLogic):
    def on_train(self, msg: Message, ctx: ClientContext) -> Message:
        return run_plain(self.plain_train(msg, ctx), ctx)

    def plain_train(self, msg: Message, ctx: ClientContext) -> PlainTraining:
        """The real gradients under the received model, then FedAvg's plain local training
        (split so that an engine may train a round's clients together)."""
        set_arrays(
            ctx.model, {k: v for k, v in msg.arrays.items() if not k.startswith("classifier.")}
        )
        classes, grad_w, grad_b = real_class_gradients(
            ctx.model, ctx.data, msg.arrays[CLF_WEIGHT], msg.arrays.get(CLF_BIAS)
        )

        def finish(result: TrainResult) -> Message:
            arrays = get_arrays(ctx.model)
            arrays[GRAD_CLASSES] = classes
            arrays[GRAD_WEIGHT] = grad_w
            if grad_b is not None:
                arrays[GRAD_BIAS] = grad_b
            return trained_reply(ctx, result.mean_loss, arrays)

        return PlainTraining(finish)


class CReFF(Algorithm):
    name = "creff"
    description = (
        "CReFF: FedAvg + classifier re-trained on server-side features learnt by "
        "gradient matching (evaluated with the re-trained classifier)"
    )
    Params = CReFFParams
    Server = CReFFServer
    Client = CReFFClient
    client_state = classmethod(keeps_nothing)

    @classmethod
    def reply_arrays(
        cls, params: CReFFParams, model: torch.nn.Module, num_classes: int
    ) -> dict[str, ArraySpec]:
        """The classifier's gradients on each of the n classes a client holds."""
        state = model.state_dict()
        specs = {
            GRAD_CLASSES: ArraySpec(("n",), torch.int64, classes=num_classes),
            GRAD_WEIGHT: ArraySpec(("n", *state[HEAD_WEIGHT].shape)),
        }
        if HEAD_BIAS in state:
            specs[GRAD_BIAS] = ArraySpec(("n", *state[HEAD_BIAS].shape))
        return specs
