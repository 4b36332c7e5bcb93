"""``met generate``: offline, in-process generation through the engine (no Redis, no HTTP)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from metrale.cli.errors import stderr, user_errors
from metrale.cli.options import CompileOption, DtypeOption, SpeculativeConfigOption, speculation_of

if TYPE_CHECKING:
    from rich.progress import Progress

    from metrale.cli.generate_jobs import GenerateJob
    from metrale.worker.engine.factory import LoadedModel
    from metrale.worker.engine.sampling_params import SamplingParams
    from metrale.worker.engine.speculation import SpeculativeConfig

# The engine (and torch) is imported inside the command: ``met --help`` must not load it.


def generate(
    prompts: Annotated[list[str] | None, typer.Argument(help="Prompts to complete (raw text).")] = None,
    model: Annotated[
        Path | None, typer.Option(help="HF model folder; default: MET_MODEL_DIR, else the built-in tiny model.")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.")] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Sample among the k likeliest tokens; 0 = all.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Seed: same seed, same output.")] = None,
    chat: Annotated[bool, typer.Option(help="Wrap each prompt as a user turn in the chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per prompt per line.")] = False,
    input_file: Annotated[
        Path | None,
        typer.Option(
            "--input",
            help='JSONL: one {"prompt": ...} per line with optional overrides, or OpenAI batch requests.',
        ),
    ] = None,
    output_file: Annotated[Path | None, typer.Option("--output", "-o", help="Write JSONL results here.")] = None,
    max_seqs: Annotated[int, typer.Option(help="Sequences run concurrently.")] = 64,
    num_blocks: Annotated[
        int,
        typer.Option(
            help="Attention-cache blocks of 16 tokens, shared by all sequences: a prompt and its output fit "
            "in at most these many tokens (and the model's context). 4096 blocks hold 65,536 tokens."
        ),
    ] = 4096,
    dtype: DtypeOption = "auto",
    compile_decode: CompileOption = False,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Go on past end-of-sequence tokens: exactly --max-tokens each.")
    ] = False,
    speculative_config: SpeculativeConfigOption = None,
) -> None:
    """Complete prompts offline with the engine, all prompts batched together.

    Prompts come from the arguments or from --input (one JSON object per line: "prompt" and optional
    "max_tokens", "temperature", "top_p", "top_k", "seed", "stop" overriding the flags). Results are
    printed, or written to --output in input order. --ignore-eos makes every completion exactly its
    max tokens long (benchmarks, fixed-length batches); stop strings still cut the text.

    --input may instead hold OpenAI batch requests ({"custom_id", "method": "POST", "url", "body"}, url
    /v1/completions or /v1/chat/completions, all lines one url): each body is checked and answered as
    the gateway's endpoint would (the sampling flags do not apply; --seed seeds lines without a seed),
    and the output lines are those of POST /v1/batches. A file holds one format or the other.
    """
    from metrale.cli.generate_jobs import JobFileError, encode_job, line_format, result_record
    from metrale.worker.engine.sampling_params import SamplingParams

    with user_errors(JobFileError, ValueError):
        speculation = speculation_of(speculative_config)
        if input_file is not None and not prompts and line_format(input_file) == "batch":
            _generate_batch(
                input_file, output_file, model, max_seqs, num_blocks, seed, dtype, compile_decode, speculation
            )
            return
        defaults = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, ignore_eos=ignore_eos
        )
        jobs = _collect_jobs(prompts, input_file, defaults)
        loaded, _ = _load(model, max_seqs, num_blocks, seed, dtype, compile_decode, speculation)
        token_ids = [encode_job(loaded.tokenizer, job, chat) for job in jobs]
        with _progress(len(jobs), output_file is not None) as progress:
            task = progress.add_task("generating", total=len(jobs))
            results = loaded.engine.generate(
                token_ids, [job.params for job in jobs], progress=lambda _: progress.advance(task)
            )
        records = [result_record(loaded.tokenizer, job, result) for job, result in zip(jobs, results, strict=True)]
    _emit(records, as_json, output_file)


def _load(
    model: Path | None,
    max_seqs: int,
    num_blocks: int,
    seed: int | None,
    dtype: str,
    compile_decode: bool = False,
    speculation: SpeculativeConfig | None = None,
) -> tuple[LoadedModel, str]:
    """The engine over ``model`` (else MET_MODEL_DIR, else the built-in model), and the name it is served under."""
    from metrale.shared.settings import load_settings
    from metrale.worker.engine.factory import EngineLimits, build_engine
    from metrale.worker.model.builtin import BUILTIN_MODEL_NAME, builtin_model_dir

    settings = load_settings()
    directory = model or settings.model_dir
    name = directory.resolve().name if directory is not None else BUILTIN_MODEL_NAME
    loaded = build_engine(
        directory or builtin_model_dir(),
        EngineLimits(max_seqs=max_seqs, num_blocks=num_blocks),
        dtype=dtype,
        seed=seed,
        kernels=settings.kernels,
        compile_decode=compile_decode,
        speculation=speculation,
    )
    return loaded, name


def _generate_batch(
    input_file: Path,
    output_file: Path | None,
    model: Path | None,
    max_seqs: int,
    num_blocks: int,
    seed: int | None,
    dtype: str,
    compile_decode: bool,
    speculation: SpeculativeConfig | None,
) -> None:
    """Answer a file of OpenAI batch requests offline (``offline_batch.py``); write the output lines."""
    from metrale.cli.offline_batch import read_batch_file, run_batch_file, served_model

    loaded, name = _load(model, max_seqs, num_blocks, seed, dtype, compile_decode, speculation)
    lines = read_batch_file(input_file, served_model(loaded, name))
    with _progress(len(lines), True) as progress:
        task = progress.add_task("generating", total=len(lines))
        answered = list(run_batch_file(loaded, lines, seed=seed, progress=lambda _: progress.advance(task)))
    if output_file is None:
        sys.stdout.writelines(line + "\n" for line in answered)
        return
    with output_file.open("w", encoding="utf-8") as out:
        out.writelines(line + "\n" for line in answered)
    stderr.print(f"wrote {len(answered)} answers to {output_file}")


def _collect_jobs(prompts: list[str] | None, input_file: Path | None, defaults: SamplingParams) -> list[GenerateJob]:
    from metrale.cli.generate_jobs import GenerateJob, JobFileError, jobs_from_file

    if input_file is not None and prompts:
        raise JobFileError("give prompts as arguments or with --input, not both")
    if input_file is not None:
        return jobs_from_file(input_file, defaults)
    if not prompts:
        raise JobFileError("no prompts: pass PROMPT arguments or --input FILE.jsonl (see met generate --help)")
    return [GenerateJob(p, defaults) for p in prompts]


def _progress(total: int, to_file: bool) -> Progress:
    """A progress bar on stderr when it is a terminal (always quiet for a single prompt on screen)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=True,
        disable=not stderr.is_terminal or (total == 1 and not to_file),
    )


def _emit(records: list[dict[str, object]], as_json: bool, output_file: Path | None) -> None:
    if output_file is not None:
        with output_file.open("w", encoding="utf-8") as out:
            out.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        stderr.print(f"wrote {len(records)} results to {output_file}")
        return
    if as_json:
        for record in records:
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
        return
    for record in records:
        sys.stdout.write(f"{record['prompt']}{record['text']}\n")
