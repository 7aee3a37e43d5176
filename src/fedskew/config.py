"""Experiment configuration: defaults < config file (TOML or YAML) < command-line options."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from fedskew.core.errors import UsageError
from fedskew.core.machine import usable_cores
from fedskew.core.option_values import (
    LEGACY_DENORMALS,
    check_denormals,
    check_device_spec,
    check_precision,
)
from fedskew.core.structured_text import parse_structured_text, read_text_file
from fedskew.data.partition import (
    PARTITION_VERSION,
    current_scheme,
    read_partition_file,
    stable_name,
)
from fedskew.metrics.privacy_accounting import ACCOUNTING, noise_for_epsilon


def option(default: Any = dataclasses.MISSING, *, factory: Any = None, **metadata: Any) -> Any:
    """A config field with its option metadata: the one place an option is declared.

    fedskew.apps.options builds the command line from the metadata, fedskew.apps.options_reference
    docs/options.md, and this module the tag lists below the class. Keys:

    - ``help``; ``default_text``: how --help states the default ("" for none);
    - ``short`` ("-a"); ``flag``: the long spelling where it is not --<key>; ``metavar``;
    - ``choices``: shown in --help (``validate`` checks them); ``cli_choices``: the values
      the command line accepts, where fewer;
    - ``action``: "true" / "false" (a flag that sets it), "append" (repeatable), "pairs"
      (a table given as repeatable KEY=VALUE items);
    - ``shortcuts``: a table's keys with a flag of their own, {key: (int or float, help)};
    - ``command``: "experiment" (an option of `fedskew partition` too) or "run" (default);
    - ``exclusive``: a group of options of which one may be given; ``cli``: False, no flag;
    - ``legacy``: the value a run folder written before the option existed ran with
      (LEGACY);
    - tags: ``execution`` (EXECUTION_ONLY), ``resumable`` (RESUME_MAY_CHANGE),
      ``measurement`` (MEASUREMENT_ONLY), ``flower``: False with ``flower_reason``
      (NOT_IN_FLOWER_RUN_CONFIG); ``flower_note``: the comment of its key in the Flower app's
      run config (fedskew.apps.flower.app_config writes flower/pyproject.toml's table)."""
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


MEMORY_FORMATS = ("auto", "channels_last", "contiguous")
CLIENTS_TOGETHER = ("auto", "off", "vmap", "fused")
CUDA_GRAPHS = ("auto", "on", "off")  # fedskew.training.graph_step.GRAPH_MODES
DIVERGENCE_POLICIES = ("stop", "drop")
TRACKERS = ("tensorboard", "mlflow", "wandb")
ENGINES = ("inprocess", "flower-sim", "flower")  # "flower": set by the deployed ServerApp
DP_MODES = ("off", "central", "local")
DP_CLIPPING = ("fixed", "adaptive")
# Flower's SecAgg+ masks and sums modulo 2**32 (its largest modulus_range): the quantised
# values of a round's clients must add up below it.
SECAGG_MODULUS = 2**32
# The clip ranges SecAgg+ sums usefully (ExperimentConfig.check_secagg_range): at least 1
# (a training loss or an update value above R is cut; more precision comes from a larger
# Q, not a smaller R), and a resolution no coarser than SECAGG_MAX_STEP.
SECAGG_MIN_RANGE = 1.0
# A Gaussian draw beyond this many deviations does not happen in a model's worth of draws
# (probability about 1e-15 each): dp-noise x dp-clip times it must stay within float32.
DP_DRAW_MAX = 8.0
SECAGG_MAX_STEP = 1e-4
FLOAT32_EPSILON = 2.0**-23


def cuda_count() -> int:
    """CUDA devices this process sees (:func:`fedskew.core.device.cuda_count`). torch is
    imported only here, when a configuration asks about CUDA: declaring and checking the
    other options (``fedskew --help``, ``fedskew list``) needs none of it."""
    from fedskew.core.device import cuda_count as visible

    return visible()


@dataclass
class ExperimentConfig:
    # fmt: off
    algorithm: str = option(
        "fedavg", short="-a", command="experiment", default_text="",
        help="algorithm name (see `fedskew list`)",
    )
    dataset: str = option(
        "digits", short="-d", command="experiment", default_text="digits, embedded",
        help="dataset name",
    )
    data_dir: str | None = option(
        None, command="experiment", execution=True, resumable=True, flower=False,
        flower_reason="the server reads datasets from $FEDSKEW_DATA or its cache, a node from "
        "its node config",
        help="where datasets are looked for and downloaded to",
    )
    download: bool = option(
        True, flag="--no-download", action="false", command="experiment", execution=True,
        flower_note="the ServerApp may download a dataset it lacks (each node reads its own "
        "copy)",
        help="never download; use local files only",
    )
    model: str = option(
        "auto", short="-m", default_text="",
        help="model name, or auto for the dataset's default",
    )
    model_options: dict[str, Any] = option(
        factory=dict, flag="--model-option", action="pairs",
        help="model option, e.g. stem=imagenet (repeatable)",
    )
    num_clients: int = option(20, short="-n", command="experiment", help="number of clients")
    participation: float | None = option(
        None, exclusive="clients", default_text="0.4",
        help="fraction of clients per round, in (0, 1]",
    )
    clients_per_round: int | None = option(
        None, exclusive="clients", help="number of clients per round (instead of participation)"
    )
    partition: str = option("dirichlet", command="experiment", help="partition scheme")
    # Which meaning of the scheme names the run has (data.partition.PARTITION_VERSION): 2,
    # dirichlet and shards place the classes in a random order per draw, and their index-order
    # forms are dirichlet-niidbench and shards-fedavg; 1, dirichlet and shards were those. A
    # run folder written before the key existed ran with 1 (``legacy``) and reads back with
    # its scheme under today's name (validate), so that it rebuilds and resumes the partition
    # it ran with. Not hashed itself: the scheme's name says what is computed (hashed_values).
    partition_version: int = option(
        2, cli=False, legacy=1, command="experiment",
        help="what the partition names mean: 2 (today), or 1 (before the key existed: "
        "dirichlet and shards meant today's dirichlet-niidbench and shards-fedavg); run "
        "folders without the key ran with 1",
    )
    partition_params: dict[str, Any] = option(
        factory=dict, short="-P", flag="--partition-param", action="pairs", command="experiment",
        shortcuts={
            "beta": (float, "Dirichlet concentration (dirichlet, quantity)"),
            "min_size": (int, "minimum samples per client (dirichlet, quantity)"),
        },
        help="other partition parameter, e.g. classes_per_client=2 (repeatable)",
    )
    # A partition made elsewhere (.npz as fedskew saves it, or JSON index lists); it
    # replaces `partition`, and sets num_clients when that is not given.
    partition_file: str | None = option(
        None, metavar="FILE", command="experiment", execution=True,
        flower_note="relative to the output root; .npz as fedskew saves it or .json lists",
        help="use this partition (.npz as fedskew saves it, or .json index lists per client)",
    )
    partition_overlap: bool = option(
        False, action="true", command="experiment",
        help="allow clients of --partition-file to share samples",
    )
    rounds: int = option(30, short="-r", help="communication rounds")
    local_epochs: int = option(2, short="-e", help="local epochs per round")
    batch_size: int = option(32, short="-b", help="local batch size")
    lr: float = option(0.05, help="local learning rate")
    momentum: float = option(0.9, help="local SGD momentum")
    weight_decay: float = option(1e-5, help="local weight decay")
    augment: bool = option(
        False, action="true", help="random crop and flip on image batches (off by default)"
    )
    grad_clip: float = option(
        0.0, default_text="0: off", help="clip each local step's gradient norm"
    )
    memory_format: str = option(
        "auto", choices=MEMORY_FORMATS, default_text="auto: channels_last for convolutional "
        "models", help="tensor layout",
    )
    precision: str = option(
        "fp32", metavar="fp32|bf16", default_text="",
        help="forward passes in fp32 (default) or under bf16 autocast; weights stay fp32",
    )
    # Part of what a run computes (in the config hash), like the precision. A run folder
    # written before the option existed ran with IEEE denormals: ``legacy`` is that value,
    # which saved_config fills in and config_hash leaves out, so such a folder resumes exactly.
    denormals: str = option(
        "flush", metavar="flush|keep", legacy=LEGACY_DENORMALS,
        default_text="flush: to zero on the CPU",
        help="denormal floats on the CPU: flush to zero (x86 computes on them slowly) or "
        "keep (IEEE behaviour)",
    )
    device: str = option(
        "auto", metavar="auto|cpu|cuda|cuda:N", execution=True, resumable=True,
        default_text="auto: CUDA when available, else the CPU",
        flower_note="the ServerApp's device for evaluation; each SuperNode resolves its own",
        help="where clients train and the model is evaluated",
    )
    tf32: bool = option(
        False, metavar="on|off", execution=True, resumable=True, default_text="off: fp32 is fp32",
        help="CUDA: let fp32 products use TF32 tensor cores",
    )
    deterministic: bool = option(
        False, action="true", execution=True, resumable=True,
        help="PyTorch's deterministic algorithms (and the cuBLAS workspace setting): the same "
        "metrics on every repeat of a CUDA run, somewhat slower",
    )
    # Train a round's clients together: "vmap" stacks their parameters (torch.func) where the
    # algorithm's handler splits around the shared loop (PlainTraining; engines/together.py
    # lists which); "fused" runs the same stacks as one wide model with native BatchNorm
    # (engines/fused.py) where the training is cross-entropy, by vmap elsewhere; "off": one
    # after another; "auto": vmap on CUDA, one after another on the CPU (measured:
    # benchmarks/clients_together.py). fused is not the default: it does not cover the
    # algorithms with a loss of their own.
    clients_together: str = option(
        "auto", metavar="auto|off|vmap|fused", execution=True, resumable=True, flower=False,
        flower_reason="a SuperNode answers for one client at a time",
        default_text="auto: vmap on CUDA, off on the CPU",
        help="train a round's clients together with stacked parameters (vmap) where the "
        "algorithm allows it (FedAvg, FedProx, SCAFFOLD, MOON and others: docs/gpu.md); "
        "fused: as one wide model with native BatchNorm where the training is cross-entropy "
        "(FedAvg, SCAFFOLD, FedNova, CReFF, FedNH), vmap elsewhere; off: one after another",
    )
    # How many clients one stacked step trains at most: "auto" estimates what the GPU's free
    # memory holds before the first step (fedskew.engines.together_memory; all of them on
    # the CPU); a chunk that still runs out of memory is halved and the run goes on.
    clients_together_max: int | str = option(
        "auto", metavar="N|auto", execution=True, resumable=True, flower=False,
        flower_reason="a SuperNode answers for one client at a time",
        default_text="auto: as many as the GPU's free memory holds, by an estimate",
        help="train at most N clients together at once (with --clients-together vmap); "
        "more are trained in chunks of N",
    )
    # The local step (one client after another) replayed as a CUDA graph: the same kernels
    # as eager, launched by one host call (fedskew.training.graph_step). auto and on: on CUDA
    # where the step is graph-safe (no dropout, BatchNorm with a momentum); the CPU runs the
    # same step eagerly whatever this says.
    cuda_graphs: str = option(
        "auto", metavar="auto|on|off", execution=True, resumable=True,
        default_text="auto: on CUDA where the step is graph-safe, off on the CPU",
        help="replay each client's local step as a CUDA graph (clients trained one after "
        "another; docs/gpu.md)",
    )
    params: dict[str, Any] = option(
        factory=dict, short="-p", flag="--param", action="pairs",
        help="algorithm hyper-parameter, e.g. mu=0.01 (repeatable)",
    )
    feature_matching: bool = option(
        False, action="true",
        help="add FedFM's anchor feature matching to the algorithm (plug-in)",
    )
    # Privacy (fedskew.training.privacy; docs/privacy.md). Each changes what a run computes
    # and is in the config hash; ``legacy`` at the default keeps the hashes (and resume) of
    # run folders written before the options existed.
    secure_aggregation: bool = option(
        False, action="true", legacy=False,
        help="SecAgg+ (Flower's secaggplus_mod): the server gets only the weighted sum of the "
        "clients' updates; simulated with the same arithmetic off Flower",
    )
    secagg_clip_range: float = option(
        8.0, metavar="R", legacy=8.0,
        help="secure aggregation: each update value is clipped to [-R, R] before it is "
        "quantised (Flower's clipping_range)",
    )
    secagg_quantization: int = option(
        4194304, metavar="Q", legacy=4194304, default_text="4194304 = 2**22",
        help="secure aggregation: quantisation levels of [-R, R] (Flower's quantization_range); "
        "clients per round x Q must stay below 2**32",
    )
    dp: str = option(
        "off", choices=DP_MODES, legacy="off", default_text="off",
        help="differential privacy of the clients' updates: central (clipped updates, "
        "Gaussian noise on their sum, DP-FedAvg) or local (each client clips and noises its "
        "own update)",
    )
    dp_clip: float = option(
        1.0, metavar="S", legacy=1.0,
        help="DP: L2 norm each client's update is clipped to (the initial norm under "
        "adaptive clipping)",
    )
    dp_noise: float = option(
        1.0, metavar="Z", legacy=1.0,
        help="DP: noise multiplier, the Gaussian noise's standard deviation over the clip "
        "norm (on the sum: central; on each update: local)",
    )
    dp_clipping: str = option(
        "fixed", choices=DP_CLIPPING, legacy="fixed", default_text="fixed",
        help="DP: fixed clip norm, or adaptive (Andrew et al. 2021: the norm follows a "
        "quantile of the update norms, estimated privately; central only)",
    )
    dp_target_quantile: float = option(
        0.5, metavar="G", legacy=0.5,
        help="adaptive clipping: the fraction of updates the clip norm should leave unclipped",
    )
    dp_clip_lr: float = option(
        0.2, metavar="ETA", legacy=0.2, help="adaptive clipping: the clip norm's learning rate"
    )
    dp_count_noise: float = option(
        0.0, metavar="SIGMA", legacy=0.0,
        default_text="0: max(clients per round / 20, dp-noise)",
        help="adaptive clipping: standard deviation of the noise on the count of unclipped "
        "updates",
    )
    # Only what is reported (the accountant's epsilon at this delta): a measurement. With
    # dp_target_epsilon it also decides dp_noise, which is hashed.
    dp_delta: float = option(
        1e-5, metavar="DELTA", measurement=True,
        help="DP: the delta at which the privacy spent (epsilon) is reported",
    )
    # Sets dp_noise (validate solves for it; the noise is hashed, so not the target itself).
    dp_target_epsilon: float | None = option(
        None, metavar="EPS", measurement=True, default_text="none: dp-noise sets the noise",
        help="DP: the epsilon at dp-delta the whole run may spend; the noise multiplier is "
        "solved for with dp-accounting (replaces dp-noise)",
    )
    dp_accounting: str = option(
        "replace-one", choices=ACCOUNTING, measurement=True, default_text="replace-one",
        help="DP: how epsilon is accounted: replace-one (fedskew's mechanism: replace-one "
        "adjacency, sampling without replacement) or poisson-add-remove (what DP-FL papers "
        "state: Poisson sampling of rate m/N, add-or-remove adjacency)",
    )
    eval_every: int = option(1, help="evaluate every N rounds")
    # Changes which samples train (in the config hash); folders from before the option ran
    # without a local split: ``legacy`` 0.0 keeps their hash and resume.
    local_test_fraction: float = option(
        0.0, metavar="F", legacy=0.0, default_text="0: none",
        help="hold out a stratified fraction F of every client's data as its local test "
        "split; evaluation rounds then report each client's accuracy (and personalised "
        "accuracy where the method keeps a personal part)",
    )
    # Changes which samples train and what "accuracy" scores (in the config hash); ``legacy``
    # 0.0 keeps older folders' hash. Tuning sets it so that trials never score on the test set.
    validation_fraction: float = option(
        0.0, metavar="F", legacy=0.0, default_text="0: none (evaluate on the test set)",
        help="hold out a stratified fraction F of every client's training data (after its "
        "local test split) as a validation split and evaluate the global model on the "
        "clients' validation parts together instead of the test set, which the run then "
        "never scores on (fedskew tune's trials; docs/tuning.md)",
    )
    # Metrics besides accuracy (fedskew.metrics.features), every N rounds and the last; 0: off.
    feature_metrics_every: int = option(
        0, metavar="N", measurement=True, default_text="0: off",
        help="every N rounds and the last: NMI of k-means clusters and silhouette of the "
        "global model's test features, as in FedFM Table IV",
    )
    local_risk_every: int = option(
        0, metavar="N", measurement=True, default_text="0: off",
        help="every N rounds and the last: risk of the round's local models over client "
        "distributions, as in FedACD",
    )
    tsne: bool = option(
        False, action="true", measurement=True,
        help="write tsne.png into the run folder: t-SNE of the final global model's test "
        "features, coloured by class",
    )
    seed: int = option(0, command="experiment", help="experiment seed")
    synthetic_alpha: float = option(1.0, command="experiment", help="synthetic dataset alpha")
    synthetic_beta: float = option(1.0, command="experiment", help="synthetic dataset beta")
    checkpoint_every: int = option(1, default_text="1; 0: none", help="rounds between checkpoints")
    engine: str = option(
        "inprocess", choices=ENGINES, cli_choices=("inprocess", "flower-sim"), execution=True,
        flower=False, flower_reason="a deployment is the Flower engine", default_text="",
        help="inprocess (default) or flower-sim: Flower's simulation engine (needs .[flower]); "
        "flower-deployed runs start from `flwr run`",
    )
    reply_timeout: float = option(
        0.0, execution=True, default_text="0: no limit",
        help="seconds a Flower round waits for client replies",
    )
    # Client worker processes, one torch thread each; 0 or 1: in-process; "auto": see
    # execution_choice (BENCHMARKS.md: throughput_repeats, flower_round_time).
    workers: int | str = option(
        "auto", metavar="N|auto", execution=True, resumable=True, flower=False,
        flower_reason="the SuperNodes are the workers",
        default_text="auto: one-thread workers, one per core up to the clients per round "
        "(spare cores become threads where a model's steps can use them), in-process for "
        "small runs; `fedskew run` says what it chose and why; metrics are the same either "
        "way at equal threads per process (OMP_NUM_THREADS, which auto keeps)",
        help="run clients in N worker processes, one torch thread each (at most the "
        "clients per round); 0: in-process",
    )
    # A client reply with NaN or Inf: "stop" ends the run naming round and client (the last
    # good checkpoint is kept); "drop" leaves the reply out of the round, as a lost one.
    on_divergence: str = option(
        "stop", choices=DIVERGENCE_POLICIES, default_text="",
        help="a client reply with NaN or Inf: stop the run (default) or leave the reply out",
    )
    out_dir: str = option(
        "runs", short="-o", execution=True, default_text="./runs", help="where run folders go",
        flower_note='a folder inside the output root ("": the root itself); no absolute path, '
        "no ..",
    )
    name: str | None = option(
        None, execution=True, default_text="algorithm-dataset-partition-seed-time",
        flower_note="the run folder's name: one path component",
        help="run folder name: one path component",
    )
    quiet: bool = option(
        False, short="-q", action="true", execution=True, resumable=True, flower=False,
        flower_reason="the ServerApp logs, it shows no progress bar",
        help="no progress bar or summary",
    )
    track: list[str] = option(
        factory=list, action="append", metavar="tensorboard|mlflow|wandb", execution=True,
        resumable=True,
        flower_note='experiment trackers, comma-separated: "mlflow,tensorboard" (files under '
        "out-dir)",
        help="also log each round's metrics, the config and the summary to this experiment "
        "tracker (repeatable; needs pip install 'fedskew[NAME]')",
    )
    track_dir: str | None = option(
        None, cli=False, execution=True, flower=False,
        flower_reason="trackers keep their files beside the run folder, inside the output root",
        help="where trackers keep their files (mlflow.db, tensorboard/, wandb/); default: the "
        "folder that holds the run folder (fedskew compare sets it to the grid folder)",
    )
    # fmt: on

    def per_round(self) -> int:
        """Clients sampled per round, from the count or the fraction."""
        if self.clients_per_round is not None:
            return self.clients_per_round
        fraction = 0.4 if self.participation is None else self.participation
        return max(1, round(fraction * self.num_clients))

    def validate(self) -> None:
        positive_ints = ("num_clients", "rounds", "local_epochs", "batch_size", "eval_every")
        for key in positive_ints:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(
                    f"{key.replace('_', '-')} must be a positive integer, got {value!r}"
                )
        if self.participation is not None and self.clients_per_round is not None:
            raise UsageError("give either participation or clients-per-round, not both")
        if self.participation is not None and not 0 < self.participation <= 1:
            raise UsageError(f"participation must be in (0, 1], got {self.participation}")
        if (
            self.clients_per_round is not None
            and not 1 <= self.clients_per_round <= self.num_clients
        ):
            raise UsageError(
                f"clients-per-round must be between 1 and num-clients ({self.num_clients}), "
                f"got {self.clients_per_round}"
            )
        for key in FINITE:
            value = getattr(self, key)
            if value is not None and not is_finite_float32(value):
                raise UsageError(f"{key.replace('_', '-')} must be {FINITE_TEXT}, got {value}")
        if self.lr <= 0:
            raise UsageError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise UsageError(f"momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.validation_fraction < 1:
            raise UsageError(
                f"validation-fraction must be in [0, 1) (0: none), got {self.validation_fraction}"
            )
        if not 0 <= self.local_test_fraction < 1:
            raise UsageError(
                f"local-test-fraction must be in [0, 1) (0: none), got {self.local_test_fraction}"
            )
        if self.grad_clip < 0:
            raise UsageError(f"grad-clip must be >= 0 (0: off), got {self.grad_clip}")
        if self.weight_decay < 0:
            raise UsageError(f"weight-decay must be >= 0, got {self.weight_decay}")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise UsageError(f"checkpoint-every must be >= 0, got {self.checkpoint_every!r}")
        for key in ("feature_metrics_every", "local_risk_every"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UsageError(
                    f"{key.replace('_', '-')} must be an integer >= 0 (0: off), got {value!r}"
                )
        if self.memory_format not in MEMORY_FORMATS:
            raise UsageError(
                f"memory-format must be one of {', '.join(MEMORY_FORMATS)}, "
                f"got {self.memory_format!r}"
            )
        check_precision(self.precision)
        check_denormals(self.denormals)
        self.device = check_device_spec(self.device)
        if self.device.startswith("cuda") and cuda_count() == 0:
            raise UsageError(
                f"device {self.device}: no CUDA device is available here; use --device cpu or auto"
            )
        if self.clients_together not in CLIENTS_TOGETHER:
            raise UsageError(
                f"clients-together must be one of {', '.join(CLIENTS_TOGETHER)}, "
                f"got {self.clients_together!r}"
            )
        self.clients_together_max = parse_clients_together_max(self.clients_together_max)
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise UsageError(
                f"cuda-graphs must be one of {', '.join(CUDA_GRAPHS)}, got {self.cuda_graphs!r}"
            )
        if self.name is not None and self.name.endswith(".incomplete"):
            raise UsageError(
                f"name {self.name!r} ends in .incomplete, the mark of an unfinished run folder"
            )
        if self.seed < 0:
            raise UsageError(f"seed must be >= 0, got {self.seed}")
        if self.engine not in ENGINES:
            raise UsageError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.on_divergence not in DIVERGENCE_POLICIES:
            raise UsageError(
                f"on-divergence must be one of {', '.join(DIVERGENCE_POLICIES)}, "
                f"got {self.on_divergence!r}"
            )
        if self.name is not None:
            check_run_name(self.name)
        self.track = parse_trackers(self.track)
        version = self.partition_version
        if isinstance(version, bool) or version not in range(1, PARTITION_VERSION + 1):
            raise UsageError(
                f"partition-version must be an integer from 1 to {PARTITION_VERSION}, "
                f"got {version!r}"
            )
        self.partition = current_scheme(self.partition, version)
        if self.partition_file is not None and self.partition == "natural":
            raise UsageError("give either partition natural or a partition file, not both")
        if self.reply_timeout < 0:
            raise UsageError(f"reply-timeout must be >= 0 (0: no limit), got {self.reply_timeout}")
        self.validate_privacy()
        if self.workers == "auto":
            return
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 0:
            raise UsageError(f"workers must be an integer >= 0 or auto, got {self.workers!r}")
        if self.workers > 1 and self.engine != "inprocess":
            raise UsageError(f"workers runs clients of the inprocess engine, not {self.engine}")

    def validate_privacy(self) -> None:
        """The secure aggregation and DP options: each value, then the combinations that
        would leave no guarantee (which algorithms take them is checked where the algorithm
        is known: fedskew.training.privacy.check_privacy)."""
        if not self.secagg_clip_range > 0:
            raise UsageError(f"secagg-clip-range must be > 0, got {self.secagg_clip_range}")
        q = self.secagg_quantization
        if isinstance(q, bool) or not isinstance(q, int) or q < 2:
            raise UsageError(f"secagg-quantization must be an integer >= 2, got {q!r}")
        if self.dp not in DP_MODES:
            raise UsageError(f"dp must be one of {', '.join(DP_MODES)}, got {self.dp!r}")
        if self.dp_clipping not in DP_CLIPPING:
            raise UsageError(
                f"dp-clipping must be one of {', '.join(DP_CLIPPING)}, got {self.dp_clipping!r}"
            )
        if not self.dp_clip > 0:
            raise UsageError(f"dp-clip must be > 0, got {self.dp_clip}")
        if self.dp_noise < 0:
            raise UsageError(f"dp-noise must be >= 0 (0: clipping only), got {self.dp_noise}")
        if not 0 < self.dp_delta < 1:
            raise UsageError(f"dp-delta must be in (0, 1), got {self.dp_delta}")
        if not 0 <= self.dp_target_quantile <= 1:
            raise UsageError(f"dp-target-quantile must be in [0, 1], got {self.dp_target_quantile}")
        if self.dp_clip_lr < 0:
            raise UsageError(f"dp-clip-lr must be >= 0, got {self.dp_clip_lr}")
        if self.dp_count_noise < 0:
            raise UsageError(f"dp-count-noise must be >= 0, got {self.dp_count_noise}")
        if self.dp_accounting not in ACCOUNTING:
            raise UsageError(
                f"dp-accounting must be one of {', '.join(ACCOUNTING)}, got {self.dp_accounting!r}"
            )
        self.check_secagg_range()
        if self.secure_aggregation:
            if self.per_round() < 2:
                raise UsageError(
                    "secure-aggregation needs at least 2 clients per round (one client's sum "
                    "is its update)"
                )
            if self.per_round() * q >= SECAGG_MODULUS:
                raise UsageError(
                    f"secure aggregation: {self.per_round()} clients per round x "
                    f"secagg-quantization {q} must stay below 2**32 (the sum's modulus)"
                )
        if self.dp == "off":
            if self.dp_target_epsilon is not None:
                raise UsageError("dp-target-epsilon needs dp central or local")
            return
        if self.dp_target_epsilon is not None:
            self.dp_noise = self.noise_for_target()
        if self.validation_fraction > 0:
            raise UsageError(
                "dp: validation-fraction evaluates on samples of the clients' data, outside "
                "the privacy guarantee; use one or the other"
            )
        if self.local_test_fraction > 0:
            raise UsageError(
                "dp: local-test-fraction sends each client's accuracy counts in clear, outside "
                "the privacy guarantee; use one or the other"
            )
        if self.feature_matching:
            raise UsageError(
                "dp: feature matching sends class anchors (feature means per class) in clear, "
                "outside the privacy guarantee"
            )
        if self.dp_clipping == "adaptive":
            if self.dp != "central":
                raise UsageError("dp-clipping adaptive is for dp central (its count is noised "
                                 "on the server)")  # fmt: skip
            sigma = self.count_noise()
            if self.dp_noise > 0 and not 2 * sigma > self.dp_noise:
                raise UsageError(
                    f"adaptive clipping: dp-noise {self.dp_noise} needs dp-count-noise above "
                    f"{self.dp_noise / 2:g} (got {sigma:g}): the count's noise takes part of "
                    "the noise budget (Andrew et al. 2021)"
                )
        noise = self.dp_noise
        if self.dp_clipping == "adaptive" and noise > 0:
            noise = (noise**-2 - (2 * self.count_noise()) ** -2) ** -0.5  # the updates' share
        std = noise * self.dp_clip
        if std * DP_DRAW_MAX > FLOAT32_MAX:
            # The noisy update (local) or model (central) would be Inf in float32: every
            # reply refused and every round skipped, or the model lost to Inf.
            raise UsageError(
                f"dp-noise x dp-clip: noise of deviation {std:.3g} makes float32 updates "
                f"infinite (it must stay below {FLOAT32_MAX / DP_DRAW_MAX:.3g})"
            )

    def check_secagg_range(self) -> None:
        """Refuse, under secure aggregation, a clip range R that leaves SecAgg+ nothing to
        sum: every value (the updates and the summed training loss) is cut to [-R, R], and
        Flower's quantisation adds R to the float32 value and rounds to a step of 2R/Q, so
        the resolution is the larger of 2R/Q and R x 2**-23. R = 1e-30 cut every update to
        nothing and R = 3e38 rounded every one away, each with a train loss of R or 0."""
        if not self.secure_aggregation:
            return
        r, q = self.secagg_clip_range, self.secagg_quantization
        top = min(SECAGG_MAX_STEP * q / 2, SECAGG_MAX_STEP / FLOAT32_EPSILON)
        if top < SECAGG_MIN_RANGE:
            raise UsageError(
                f"secagg-quantization {q} is too coarse: its step 2R/Q is above "
                f"{SECAGG_MAX_STEP:g} for any clip range of at least {SECAGG_MIN_RANGE:g} "
                f"(give at least {math.ceil(2 * SECAGG_MIN_RANGE / SECAGG_MAX_STEP)})"
            )
        if not SECAGG_MIN_RANGE <= r <= top:
            raise UsageError(
                f"secagg-clip-range {r:g} must be from {SECAGG_MIN_RANGE:g} to {top:.6g} "
                f"with secagg-quantization {q}: values beyond R (the summed training loss "
                f"among them) are cut to R, and a resolution (2R/Q, or float32's of R) "
                f"above {SECAGG_MAX_STEP:g} rounds updates away"
            )

    def noise_for_target(self) -> float:
        """The noise multiplier that spends dp_target_epsilon at dp_delta by the last round,
        as the run will report it (fedskew.metrics.privacy_accounting.noise_for_epsilon);
        a dp_noise given besides it must be that value (a run folder's config.json holds
        both)."""
        target = self.dp_target_epsilon
        assert target is not None
        if not target > 0:
            raise UsageError(f"dp-target-epsilon must be > 0, got {target}")
        # Imported here: the sampling needs torch, which the command line's --help does not.
        from fedskew.data.federated import sample_clients

        m, n = self.per_round(), self.num_clients
        counts = [0] * n
        for rnd in range(self.rounds):
            for c in sample_clients(self.seed, rnd, n, m):
                counts[c] += 1
        noise = solved_noise(
            target, self.dp == "local", n, m, self.rounds, max(counts), self.dp_delta,
            self.dp_accounting,
        )  # fmt: skip
        given = self.dp_noise
        if given != LEGACY["dp_noise"] and not math.isclose(given, noise, rel_tol=1e-9):
            raise UsageError(
                f"give dp-noise or dp-target-epsilon, not both (dp-noise {given:g}; the "
                f"target {target:g} gives {noise:.6g})"
            )
        return noise

    def count_noise(self) -> float:
        """The noise on the count of unclipped updates (adaptive clipping): dp_count_noise,
        or by default Andrew et al.'s clients per round / 20, raised to the noise multiplier
        where that is smaller (so that the updates' noise grows by at most 1/sqrt(3/4))."""
        if self.dp_count_noise > 0:
            return self.dp_count_noise
        return max(self.per_round() / 20, self.dp_noise)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FINITE = (
    "lr", "momentum", "weight_decay", "grad_clip", "participation", "reply_timeout",
    "synthetic_alpha", "synthetic_beta", "secagg_clip_range", "dp_clip", "dp_noise",
    "dp_target_quantile", "dp_clip_lr", "dp_count_noise", "dp_delta", "dp_target_epsilon",
)  # fmt: skip


@lru_cache(maxsize=32)
def solved_noise(
    target: float, local: bool, num_clients: int, per_round: int, rounds: int,
    most_participations: int, delta: float, method: str,
) -> float:  # fmt: skip
    """noise_for_epsilon, once per setting: a configuration is validated several times and
    the accountant takes seconds for sampling without replacement."""
    return noise_for_epsilon(
        target, local=local, num_clients=num_clients, per_round=per_round, rounds=rounds,
        most_participations=most_participations, delta=delta, method=method,
    )  # fmt: skip
FIELDS = {f.name: f for f in dataclasses.fields(ExperimentConfig)}
TABLES = tuple(name for name, f in FIELDS.items() if f.metadata.get("action") == "pairs")


def tagged(tag: str) -> tuple[str, ...]:
    """The config keys whose option metadata carries ``tag``, in declaration order."""
    return tuple(name for name, f in FIELDS.items() if f.metadata.get(tag))


# How and where a run executes, not what it computes (tag ``execution``): left out of the
# configuration hash that a checkpoint carries, and changeable when a run is resumed
# (engine: a run started in one process can continue on Flower's simulation with the same
# metrics). partition_file: its path may change (a resume falls back to the folder's
# partition.npz); the partition itself is compared with the saved one on every resume.
# device, tf32, deterministic and clients_together choose the hardware and kernels that
# compute the same experiment (same data, partition, randomness and updates): a change moves
# results by floating-point rounding only (CPU and CUDA agree within the tolerance docs/gpu.md
# states), so they are left out of the hash and a run may be resumed on another device; each
# process's device and settings are recorded in processes.jsonl.
EXECUTION_ONLY = tagged("execution")
# Tag ``resumable``: a resumed run may change them (a run started here can be continued on
# another machine, with its own data folder, cores and GPU).
RESUME_MAY_CHANGE = tagged("resumable")
# Tag ``measurement``: what a run measures besides its training; extra metrics never change
# the model, so a checkpoint made with other values (or before these options existed) fits.
MEASUREMENT_ONLY = tagged("measurement")
# Options added after run folders existed: {key: the value a run folder without the key ran
# with}. saved_config fills them in; config_hash leaves a key out at that value.
LEGACY = {name: f.metadata["legacy"] for name, f in FIELDS.items() if "legacy" in f.metadata}
# Keys a Flower deployment's run config does not take (tag ``flower``: False), with why.
NOT_IN_FLOWER_RUN_CONFIG = {
    name: f.metadata["flower_reason"]
    for name, f in FIELDS.items()
    if f.metadata.get("flower") is False
}


# Values that reach float32 tensors (learning rates, coefficients) must convert to them:
# beyond float32, torch fails with "value cannot be converted to type float without
# overflow" in the middle of a round.
FLOAT32_MAX = 3.4028234663852886e38
FINITE_TEXT = "a finite number of magnitude at most 3.4e38"


def is_finite_float32(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def check_run_name(name: str) -> None:
    """A run name becomes one folder under the output folder: one path component."""
    if (
        not name
        or name in {".", ".."}
        or "/" in name
        or "\\" in name
        or "\0" in name
        or name != name.strip()
    ):
        raise UsageError(
            f"name must be one folder name (no '/', no '..', no leading or trailing space), "
            f"got {name!r}"
        )


def hashed_values(cfg: ExperimentConfig) -> dict[str, Any]:
    """The part of a configuration that says what a run computes: every key but
    EXECUTION_ONLY and MEASUREMENT_ONLY, and but a key that holds its LEGACY value (left out
    so that the hash is the one a run made before the key existed recorded); the partition
    scheme by its data.partition.stable_name, partition_version left out."""
    skip = EXECUTION_ONLY + MEASUREMENT_ONLY + ("partition_version",)
    values = {
        k: v
        for k, v in cfg.to_dict().items()
        if k not in skip and not (k in LEGACY and v == LEGACY[k])
    }
    # The scheme under the name that says what it computes in any partition version (see
    # partition_version): a folder of version 1 keeps the hash its checkpoint recorded.
    values["partition"] = stable_name(current_scheme(cfg.partition, cfg.partition_version))
    return values


def config_hash(cfg: ExperimentConfig) -> str:
    """A short hash of what a run computes (:func:`hashed_values`)."""
    text = json.dumps(hashed_values(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def config_differences(saved: ExperimentConfig, wanted: ExperimentConfig) -> str:
    """What makes two configurations hash differently, for a person: "key: A there, B
    here" for each key of :func:`hashed_values` that differs ("" when none)."""
    a, b = hashed_values(saved), hashed_values(wanted)
    full_a, full_b = saved.to_dict(), wanted.to_dict()
    return "; ".join(
        f"{key}: {full_a[key]!r} there, {full_b[key]!r} here"
        for key in FIELDS
        if a.get(key, LEGACY.get(key)) != b.get(key, LEGACY.get(key))
    )


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or YAML experiment file into a dict of config fields."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file not found: {p}")
    if p.suffix.lower() not in {".toml", ".yaml", ".yml", ".json"}:
        raise UsageError(f"config file must end in .toml, .yaml or .yml: {p}")
    text = read_text_file(p, "config file")
    raw = parse_structured_text(text, p.suffix, str(p))
    if raw is None:  # an empty YAML file
        raw = {}
    if not isinstance(raw, dict):
        raise UsageError(f"{p}: the top level must be a table of options")
    return normalise_keys(raw, str(p))


def normalise_keys(raw: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise UsageError(f"{where}: unknown option '{key}'")
        if name in TABLES and not isinstance(value, dict):
            raise UsageError(f"{where}: '{key}' must be a table of key = value")
        out[name] = value
    return out


def build_config(file_values: dict[str, Any], cli_values: dict[str, Any]) -> ExperimentConfig:
    """Merge file and command-line values (the latter win; tables merge key by key)."""
    for source in (file_values, cli_values):
        if source.get("dp_target_epsilon") is not None and source.get("dp_noise") is not None:
            # One source that names both (a saved config.json holds both: validate checks
            # that its noise is the target's).
            if source is cli_values or "dp_noise" in cli_values:
                raise UsageError("give dp-noise or dp-target-epsilon, not both")
    merged: dict[str, Any] = {}
    for source in (file_values, cli_values):
        for key, value in source.items():
            if value is None:
                continue
            if key in TABLES:
                merged.setdefault(key, {}).update(parse_value(key, value))
            else:
                merged[key] = value
    for key, value in list(merged.items()):
        merged[key] = parse_value(key, value)
    if merged.get("partition_file") is not None and "num_clients" not in merged:
        merged["num_clients"] = len(read_partition_file(merged["partition_file"]))
    cfg = ExperimentConfig(**merged)
    cfg.validate()
    return cfg


# Number options whose default is None (not given), with their type.
OPTIONAL_NUMBERS: dict[str, type] = {
    "participation": float, "clients_per_round": int, "dp_target_epsilon": float,
}  # fmt: skip


def parse_value(key: str, value: Any, where: str | None = None) -> Any:
    """The value of config key ``key`` from any source: a command-line string, a config
    file's TOML/YAML/JSON value, a Flower run config value or a saved config.json. The one
    parser of option values, so that each source accepts the same spellings and refuses
    the others with the same message. Tables take a mapping, a list of KEY=VALUE items (the
    command line's repeatable flag) or a text of them ("lam=10 start_round=0"); ``where``
    names the source in their messages."""
    f = FIELDS[key]
    label = key.replace("_", "-")
    if key in TABLES:
        if isinstance(value, Mapping):
            return dict(value)
        if isinstance(value, str):
            return parse_pairs(value, where or label)
        if isinstance(value, (list, tuple)) and all(isinstance(i, str) for i in value):
            return dict(parse_pair(item, where or label) for item in value)
        raise UsageError(f"{where or label}: expected a table of key = value, got {value!r}")
    default = f.default if f.default is not dataclasses.MISSING else None
    if key == "track":
        return parse_trackers(value)
    if isinstance(value, str) and "\0" in value:  # no path or name holds one
        raise UsageError(f"{label} contains a NUL character: {value!r}")
    if default is None and key not in OPTIONAL_NUMBERS:
        if not isinstance(value, str):  # data_dir, name: text or nothing
            raise UsageError(f"{label} expects text, got {value!r}")
        return value
    if key == "workers":
        return parse_workers(value)
    if key == "clients_together_max":
        return parse_clients_together_max(value)
    kind = OPTIONAL_NUMBERS.get(key, type(default))
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in {"true", "1", "yes", "on"}:
            return True
        if str(value).lower() in {"false", "0", "no", "off"}:
            return False
        raise UsageError(f"{label} expects true or false, got {value!r}")
    if kind in (int, float) and isinstance(value, bool):
        raise UsageError(f"{label} expects a number, got {value!r}")
    if kind is int and isinstance(value, float):  # 1e3 in a file is a float: say so
        raise UsageError(f"{label} must be an integer, got {value!r}")
    if kind is str and not isinstance(value, str):  # a list would become a folder "['a']"
        raise UsageError(f"{label} expects text, got {value!r}")
    return parse_number(label, kind, value)


def parse_number(label: str, kind: type, value: Any) -> Any:
    """``value`` as an int or a float (``kind``), as Python reads it, else a one-line error."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise UsageError(f"{label} expects {kind.__name__}, got {value!r}") from None


def parse_workers(value: Any) -> int | str:
    """``auto`` or a worker count, from a command line, a config file or a saved config."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool):
        raise UsageError(f"workers expects an integer >= 0 or auto, got {value!r}")
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"workers expects an integer >= 0 or auto, got {value!r}") from None
    if isinstance(value, float) and not value.is_integer():
        raise UsageError(f"workers expects an integer >= 0 or auto, got {value!r}")
    return count


def parse_clients_together_max(value: Any) -> int | str:
    """``auto`` or a count >= 1, from any source of a value."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    message = f"clients-together-max expects an integer >= 1 or auto, got {value!r}"
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise UsageError(message)
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise UsageError(message) from None
    if count < 1:
        raise UsageError(message)
    return count


def parse_trackers(value: Any) -> list[str]:
    """Tracker names from a list or a comma-separated text, checked, each once."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise UsageError(f"track expects tracker names ({', '.join(TRACKERS)}), got {value!r}")
    names = [i.strip().lower() for i in items if i.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise UsageError(
            f"track: unknown tracker '{unknown[0]}' (choose from {', '.join(TRACKERS)})"
        )
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------------- execution

# What ``--workers auto`` rests on. Measured on this project's 2-core machines
# (BENCHMARKS.md), FedAvg on Fashion-MNIST, 8 clients per round:
#
# * idle: 2 one-thread worker processes gave 0.97x the round throughput of one process
#   with 2 threads in fp32 and 1.34x in bf16 (fedavg-cnn, batch 64; throughput_repeats);
# * busy (1-minute load 7 to 12 on the 2 cores): 2 one-thread workers took 5.0 s per
#   round, one process with 2 threads 87 s, one process with 1 thread 11 s (simple-cnn;
#   flower_round_time): an OpenMP team whose threads wait for each other at every
#   operation collapses when other processes take its cores, independent one-thread
#   processes do not;
# * side by side in one invocation (auto_choice, fedavg-cnn, fp32, E = 1): idle, 2
#   one-thread workers gave 0.82x one process with 2 threads; beside one busy core, 1.93x.
#   Workers are the default for fp32 too: a fifth less on an idle machine, against twice
#   (and at heavier load, as above, 17x) the throughput on a shared one;
# * starting a worker took about 6 s of one core here (spawn, import torch, build the
#   runtime); one core trained the built-in models at 11 to 43 GFLOP/s (batch 64, fp32,
#   one thread: simple-cnn 11, fedavg-cnn 38, cnn-cifar 43).
#
# The thresholds below are reasoning from those figures, not measurements of other
# machines.

# A client's local training below this (about 0.05 s of one core at ~20 GFLOP/s) is
# as short as shipping its model, state and reply through pipes: kept in one process.
MIN_CLIENT_FLOPS = 1e9
# A run whose clients' training adds up to less than about a minute of one core gains
# less from workers than starting them costs (seconds each).
MIN_RUN_FLOPS = 1.2e12
# Threads for one client's batch steps: a step must bring each thread about this much
# (~5 ms of a core), or the fork and join of every one of a step's dozens of operations
# eats the gain; small models do not split well over threads. fedavg-cnn at batch 64,
# 1.6 GFLOP per step, ran as fast on 2 threads as 2 one-thread workers did, idle.
STEP_FLOPS_PER_THREAD = 100e6


@dataclass(frozen=True)
class TrainingWork:
    """What one client's local training costs, estimated from the model and the partition
    (``fedskew.assembly.prepare.training_work``): FLOPs of a client of mean size (epochs x
    samples x about three forward passes) and of one batch step; the model's parameter
    bytes and one batch's layer outputs (what a worker process holds besides torch)."""

    client_flops: float
    step_flops: float
    model_bytes: int = 0
    activation_bytes: int = 0


@dataclass(frozen=True)
class Execution:
    """How a run's clients execute: in ``workers`` processes (0: in the run's own process)
    with ``threads`` torch threads each (None: the process's thread count, left as it is),
    and why (``reason``). ``auto``: chosen by ``--workers auto``; ``capped``: a given
    count lowered to what can be used."""

    workers: int
    threads: int | None
    reason: str
    auto: bool = True
    capped: bool = False

    def describe(self) -> str:
        """ "2 worker processes x 1 thread", "clients in this process, 2 threads"."""
        threads = "" if self.threads is None else plural(self.threads, "thread")
        if self.workers >= 2:
            return f"{self.workers} worker processes x {threads or '1 thread'}"
        return "clients in this process" + (f", {threads}" if threads else "")

    def note(self) -> str:
        """The line ``fedskew run`` prints about the choice."""
        return f"{self.describe()} ({self.reason})"


def plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def omp_threads() -> int | None:
    """The thread count OMP_NUM_THREADS asks for (the first level of a nested list), or
    None where it is unset or unreadable."""
    text = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    try:
        count = int(text)
    except ValueError:
        return None
    return count if count >= 1 else None


def execution_choice(
    cfg: ExperimentConfig,
    work: TrainingWork | None = None,
    *,
    spawn_ok: bool = True,
    cores: int | None = None,
) -> Execution:
    """How the clients of ``cfg`` execute: ``cfg.workers``, or for ``auto`` this choice.

    A given count is kept (one torch thread per worker), but never above the clients per
    round: more workers than clients would idle. The choice changes speed only: a client's
    work depends on its message, state, id and round, never on the process that runs it
    (tests/test_workers.py). The thread count of the process that trains a client can
    change float sums in the last bits, as torch splits reductions by thread; set
    OMP_NUM_THREADS to fix it (``auto`` then keeps it).

    ``auto`` on the CPU (``cores``: the usable cores, ``fedskew.core.machine.usable_cores``;
    ``work``: the estimate of ``fedskew.assembly.prepare.training_work``, taken as large
    where it is None) decides between worker processes and threads from per-client work:

    * worker processes, one per core up to the clients per round, whenever a round has two
      clients or more to run side by side and their training is worth shipping (a client
      of at least ``MIN_CLIENT_FLOPS``, a run of at least ``MIN_RUN_FLOPS``). Measured here
      (BENCHMARKS.md, 2 cores): one-thread workers were somewhat slower than one process
      with both threads idle in fp32 (0.82x to 0.97x), faster in bf16 (1.34x), 1.9x faster
      beside one busy core and 17x faster at a load of 7 to 12 (5 s against 87 s a round),
      where an OpenMP team stalls whenever another
      process holds one of its cores. Clients are independent: splitting a round by client
      has no per-operation synchronisation, splitting a small model's operations over
      threads has a great deal.
    * threads per worker: with more cores than clients per round, each worker gets
      cores // workers threads, as many as its batch steps can use (one per
      ``STEP_FLOPS_PER_THREAD`` of a step): a big model's step splits well over threads,
      a small one's does not, so its spare cores stay idle rather than slow it down.
      This is reasoning for machines not measured here (more cores than clients).
    * in this process (the engine without workers) when there is nothing to run side by
      side (one core, one client per round), when the work is too small to pay for
      worker processes, or when the script that runs fedskew would start again in each
      worker (no ``if __name__ == "__main__":`` guard, ``spawn_ok`` False); its threads
      are then what one client's steps can use, up to the cores.

    OMP_NUM_THREADS, where set, is the user's thread count per process: workers get that
    many threads each, and as many workers as the cores hold at that count.

    The run then lowers the worker count to what half of the available memory holds
    (``fedskew.engines.workers.affordable_workers``: the dataset once, in shared memory,
    plus each worker's own memory).

    On CUDA (``device`` cuda, or auto with a GPU), ``auto`` runs one worker per visible GPU
    when there are two or more (worker i uses cuda:i mod count), else the in-process engine;
    a device named ``cuda:N`` keeps every client on that one GPU, in process."""
    per_round = cfg.per_round()
    if cfg.workers != "auto":
        given = int(cfg.workers)
        if given >= 2 and given > per_round:
            used = per_round if per_round >= 2 else 0
            return Execution(
                used, 1 if used else None,
                f"--workers {given} capped: {plural(per_round, 'client')} train per round",
                auto=False, capped=True,
            )  # fmt: skip
        return Execution(given, 1 if given >= 2 else None, f"--workers {given}", auto=False)
    if cfg.engine != "inprocess":
        return Execution(0, None, f"auto: the {cfg.engine} engine runs the clients")
    if cfg.device.startswith("cuda") or (cfg.device == "auto" and cuda_count() > 0):
        gpus = cuda_count()
        if cfg.device in ("auto", "cuda"):
            used = min(gpus, per_round)
            why = f"auto: {plural(gpus, 'GPU')}, {plural(per_round, 'client')} per round"
            return Execution(used, 1, why) if used >= 2 else Execution(0, None, why)
        return Execution(0, None, f"auto: every client on {cfg.device}")

    cores = usable_cores() if cores is None else cores
    fixed = omp_threads()
    facts = f"auto: {plural(cores, 'core')}, {plural(per_round, 'client')} per round"
    step_threads = cores if work is None else max(1, int(work.step_flops // STEP_FLOPS_PER_THREAD))
    alone = fixed or min(cores, step_threads)

    def in_process(why: str) -> Execution:
        return Execution(0, alone, f"{facts}; {why}")

    most = min(per_round, cores // (fixed or 1))
    if per_round < 2:
        return in_process("nothing to train side by side")
    if cores < 2:
        return in_process("nothing to run side by side")
    if most < 2:
        return in_process(f"OMP_NUM_THREADS={fixed} leaves room for one process")
    if not spawn_ok:
        return in_process(
            'worker processes need the script\'s code under if __name__ == "__main__":'
        )
    if work is not None:
        if work.client_flops < MIN_CLIENT_FLOPS:
            gflop = work.client_flops / 1e9
            return in_process(
                f"a client's training is about {gflop:.2g} GFLOP, too little to ship to "
                "another process"
            )
        run_flops = cfg.rounds * per_round * work.client_flops
        if run_flops < MIN_RUN_FLOPS:
            return in_process(
                f"the run's training is about {run_flops / 1e12:.2g} TFLOP, too little to "
                "pay for starting worker processes"
            )
    threads = fixed or max(1, min(cores // most, step_threads))
    if fixed:
        why = f"OMP_NUM_THREADS={fixed}"
    elif threads > 1:
        why = f"{plural(threads, 'core')} for each worker's batch steps"
    elif cores // most > 1:
        why = "a batch step is too small to split over threads"
    else:
        why = "one-thread workers hold up on a busy machine"
    return Execution(most, threads, f"{facts}; {why}")


def effective_workers(
    cfg: ExperimentConfig, work: TrainingWork | None = None, *, spawn_ok: bool = True
) -> int:
    """The worker processes a run uses (0: none): see :func:`execution_choice`."""
    return execution_choice(cfg, work, spawn_ok=spawn_ok).workers


# ---------------------------------------------------------------------------- value parsing


def parse_scalar(text: str) -> Any:
    """A command-line value: int, float, true/false, or the text itself."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.lower() in {"true", "false"}:
        return text.lower() == "true"
    return text


def parse_pairs(text: str, where: str) -> dict[str, Any]:
    """``"lam=10 start_round=0"`` (spaces or commas) -> {name: value}."""
    return dict(parse_pair(item, where) for item in text.replace(",", " ").split())


def parse_pair(item: str, where: str) -> tuple[str, Any]:
    """``"lam=10"`` -> ("lam", 10): one item of a table, from the command line's repeatable
    KEY=VALUE flags or a text of pairs (Flower's run config)."""
    name, sep, value = item.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not name:
        raise UsageError(f"{where}: expected key=value, got {item!r}")
    return name, parse_scalar(value.strip())


def params_from_values(
    params_type: type, values: Mapping[str, object], where: str, owner: str
) -> Any:
    """A hyper-parameter dataclass from user values: names checked, strings coerced to the
    fields' types, then the dataclass's own ``validate`` (if any)."""
    fields = {f.name: f for f in dataclasses.fields(params_type)}
    kwargs: dict[str, object] = {}
    for key, raw in values.items():
        name = key.replace("-", "_")
        if name not in fields:
            valid = ", ".join(fields) or "none"
            raise UsageError(f"{where} has no parameter '{key}' (valid: {valid})")
        kwargs[name] = coerce(raw, fields[name], owner)
        value = kwargs[name]
        if isinstance(value, float) and not is_finite_float32(value):
            raise UsageError(f"{owner}: parameter '{name}' must be {FINITE_TEXT}, got {value}")
    params = params_type(**kwargs)
    check = getattr(params, "validate", None)
    if check is not None:
        check()
    return params


def coerce(raw: object, f: dataclasses.Field, owner: str) -> object:
    """Convert a CLI/config value to the type of a dataclass field."""
    default = f.default if f.default is not dataclasses.MISSING else None
    kind = type(default) if default is not None else str
    if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
        return raw
    text = str(raw).strip()
    try:
        if kind is bool:
            if text.lower() in {"1", "true", "yes", "on"}:
                return True
            if text.lower() in {"0", "false", "no", "off"}:
                return False
            raise ValueError(text)
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        raise UsageError(
            f"{owner}: parameter '{f.name}' expects {kind.__name__}, got '{text}'"
        ) from None
    return text
