"""Build a ready engine from a model folder: weights, state pools, scheduler limits, tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from metrale.shared.settings import KernelBackend
from metrale.text.tokenizer import Tokenizer
from metrale.worker.engine.constraints import GrammarCompiler
from metrale.worker.engine.draft_length import CPU_STEP_COST, DraftLengths
from metrale.worker.engine.draft_model import load_drafter, relative_step_cost
from metrale.worker.engine.engine import Engine
from metrale.worker.engine.speculation import Drafter, SpeculativeConfig
from metrale.worker.kernels.ops import set_kernel_backend
from metrale.worker.model.decode_graph import DEFAULT_BUCKETS
from metrale.worker.model.executor import ModelExecutor
from metrale.worker.model.families.family import FamilyConfig
from metrale.worker.model.loader import load_model
from metrale.worker.model.precision import DtypeChoice
from metrale.worker.scheduler.config import SchedulerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """How much a worker takes on at once. ``max_model_len`` 0 means the model's own context length."""

    max_seqs: int = 64
    max_batch_tokens: int = 2048
    num_blocks: int = 4096
    block_size: int = 16
    swap_space_mb: int = 256
    max_model_len: int = 0
    checkpoint_grid: int | None = 256
    """Prefill chunks end on multiples of this, where the state is checkpointed; None: no grid."""
    decode_checkpoint_interval: int | None = None
    """Checkpoint running requests every this many generated tokens (for failover); None: never."""

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_batch_tokens", "num_blocks", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.swap_space_mb < 0 or self.max_model_len < 0:
            raise ValueError("swap_space_mb and max_model_len must be >= 0")

    def scheduler_config(self, model_config: FamilyConfig) -> SchedulerConfig:
        context = self.max_model_len or model_config.max_position_embeddings
        context = min(context, self.num_blocks * self.block_size)
        return SchedulerConfig(
            max_batch_tokens=max(self.max_batch_tokens, self.max_seqs),
            max_seqs=self.max_seqs,
            num_slots=self.max_seqs,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            swap_space_bytes=self.swap_space_mb << 20,
            max_model_len=context,
            checkpoint_grid=self.checkpoint_grid,
            model_context=model_config.max_position_embeddings,
        )


@dataclass(frozen=True)
class LoadedModel:
    """An engine over a loaded model, with what the text edge needs to talk to it."""

    engine: Engine
    executor: ModelExecutor
    tokenizer: Tokenizer
    config: FamilyConfig
    directory: Path


def build_engine(
    directory: Path,
    limits: EngineLimits | None = None,
    *,
    device: str = "cpu",
    dtype: DtypeChoice = None,
    seed: int | None = None,
    kernels: KernelBackend | None = None,
    compile_decode: bool = False,
    speculation: SpeculativeConfig | None = None,
) -> LoadedModel:
    """Load the model in ``directory`` and wrap it in an :class:`Engine` sized by ``limits``.

    ``dtype`` is the weight dtype: a name (``auto``, ``float32``, ``bfloat16``, ``float16``), a torch dtype,
    or None for the config's. ``kernels`` sets the process-wide kernel backend (``MET_KERNELS``); None
    leaves it as it is. ``compile_decode`` runs decode steps of up to ``decode_graph.DEFAULT_BUCKETS[-1]``
    sequences through compiled graphs (CPU only), compiled here, before the engine is returned.
    ``speculation`` (None: off) turns on speculative decoding with its method's drafts (a draft model is
    loaded here, on ``device`` in ``dtype``, its pools sized as the target's).
    """
    if compile_decode and speculation is not None:
        raise ValueError(
            "--compile and --speculative-config cannot be combined: the compiled decode step's logits differ in "
            "their last bits from the eager verify step's, so speculating would change answers"
        )
    if compile_decode and torch.device(device).type != "cpu":
        raise ValueError("--compile runs on the CPU only for now (a GPU would capture the same buckets as CUDA graphs)")
    limits = limits or EngineLimits()
    if kernels is not None:
        set_kernel_backend(kernels)
    tokenizer = Tokenizer.from_dir(directory)
    model = load_model(directory, dtype=dtype, device=device)
    scheduler_config = limits.scheduler_config(model.config)
    executor = ModelExecutor(
        model,
        num_slots=scheduler_config.num_slots,
        num_blocks=scheduler_config.num_blocks,
        block_size=scheduler_config.block_size,
        decode_buckets=DEFAULT_BUCKETS if compile_decode else None,
    )
    if compile_decode:
        seconds = executor.warm_up()
        log.info("compiled the decode step for batch sizes %s in %.1f s", list(seconds), sum(seconds.values()))
    drafter, lengths = _drafts(speculation, limits, scheduler_config, tokenizer, executor, device, dtype)
    eos = set(model.config.eos_token_ids) | set(tokenizer.eos_token_ids)
    engine = Engine(
        executor,
        scheduler_config,
        eos_token_ids=eos,
        seed=seed,
        decode_checkpoint_interval=limits.decode_checkpoint_interval,
        grammars=GrammarCompiler(tokenizer, model.config.vocab_size),
        drafter=drafter,
        draft_lengths=lengths,
    )
    return LoadedModel(engine, executor, tokenizer, model.config, directory)


def _drafts(
    speculation: SpeculativeConfig | None,
    limits: EngineLimits,
    scheduler_config: SchedulerConfig,
    tokenizer: Tokenizer,
    target: ModelExecutor,
    device: str,
    dtype: DtypeChoice,
) -> tuple[Drafter | None, DraftLengths | None]:
    """The drafter ``speculation`` names and, for a draft model, the adaptive lengths that weigh its cost
    (None: the engine's default, for prompt lookup's free drafts). A draft model's drafts are not free: each
    draft token costs one of its decode steps, timed against the target's (``relative_step_cost``) and added
    to what a verify row costs, so the lengths draft only where that pays (a draft model not much cheaper
    than the target never drafts)."""
    if speculation is None:
        return None, None
    if speculation.model is None:
        return speculation.drafter(), None
    drafter = load_drafter(
        speculation.model,
        num_speculative_tokens=speculation.num_speculative_tokens,
        target_tokenizer=tokenizer,
        target_vocab_size=target.vocab_size,
        max_seqs=limits.max_seqs,
        num_blocks=scheduler_config.num_blocks,
        block_size=scheduler_config.block_size,
        max_model_len=scheduler_config.max_model_len,
        device=device,
        dtype=dtype,
    )
    draft_cost = relative_step_cost(drafter.executor, target)
    log.info(
        "drafting with %s, %d tokens a step at most; a draft token costs %.2f of the target's decode step",
        speculation.model,
        speculation.num_speculative_tokens,
        draft_cost,
    )
    return drafter, DraftLengths(replace(CPU_STEP_COST, verify_row=CPU_STEP_COST.verify_row + draft_cost))
