"""`poolserve embed INPUT -o OUTPUT`: the flags, and the run that turns them into a job.

Imported by `poolserve --help`: only argparse and the settings' flags load here; pyarrow and the
engine's modules load inside `run`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poolserve.config.flags import add_settings_flags, settings_from_args
from poolserve.config.settings import RUN_ONLY_SETTINGS, ServerSettings
from poolserve.observability.logs import configure_logging
from poolserve.types.errors import command_error

if TYPE_CHECKING:  # argparse's class takes a type argument only for type checkers
    Commands = argparse._SubParsersAction[argparse.ArgumentParser]
    from poolserve.jobs.corpus.run import EmbedJob, Outcome
    from poolserve.offline import AsyncPoolingEngine

logger = logging.getLogger("poolserve.jobs.embed")

# vLLM's embed_dtype names, the keys of poolserve/jobs/arrow.py EMBED_DTYPES (a test keeps
# them equal; arrow.py needs pyarrow, which --help must not load)
EMBED_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
INPUT_FORMATS = ("jsonl", "csv", "parquet")


def add_embed_command(commands: Commands) -> None:
    """`embed INPUT -o OUTPUT`, the embedding's options and every server setting's flag."""
    parser = commands.add_parser(
        "embed",
        help="Embed a corpus (JSONL, CSV or Parquet) into Parquet, resumably.",
        usage="poolserve embed INPUT -o OUTPUT [--model MODEL] [options]",
        description="Embed every row of INPUT into OUTPUT (Parquet: id, embedding, "
        "prompt_tokens, in input order). Work goes to OUTPUT.partial/ in whole parts: rerun "
        "the same command after an interruption and it goes on where it stopped. The model "
        "and its settings are `poolserve serve`'s flags.",
    )
    parser.add_argument(
        "input", metavar="INPUT", help="The corpus: .jsonl/.ndjson, .csv, .parquet."
    )
    parser.add_argument("-o", "--output", required=True, metavar="OUTPUT", help="Parquet to write.")
    parser.add_argument("--input-format", choices=INPUT_FORMATS, help="Override the file ending.")
    parser.add_argument("--text-column", default="text", help="Column of the texts (text).")
    parser.add_argument("--id-column", default="id", help="Column of the row ids (id).")
    parser.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="L2-normalise the embeddings (default: the model's own, as the API decides).",
    )
    parser.add_argument("--dimensions", type=int, help="Matryoshka output size.")
    parser.add_argument("--prompt-name", help="sentence-transformers prompt to prepend.")
    parser.add_argument(
        "--embed-dtype",
        choices=EMBED_DTYPES,
        default="float32",
        help="Stored type of the embedding (bfloat16 and fp8 as raw bits; docs/jobs.md).",
    )
    parser.add_argument(
        "--truncate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Cut over-long rows to the model's length, as sentence-transformers does "
        "(default); --no-truncate refuses them, naming the row.",
    )
    parser.add_argument(
        "--adapter",
        metavar="NAME",
        help="Run the rows through this LoRA adapter (a --lora-modules name) instead of the "
        "model itself.",
    )
    parser.add_argument("--batch-rows", type=int, default=512, help="Rows per engine call (512).")
    parser.add_argument(
        "--part-rows", type=int, default=8192, help="Rows per resumable part (8192)."
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace OUTPUT once the new file is whole; discard OUTPUT.partial/ if it holds "
        "another job (this job's own is resumed).",
    )
    add_settings_flags(parser, "embed")
    parser.set_defaults(run=lambda args: run(parser, args))


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Parse, check the input, run the job; 0 when OUTPUT is complete, 1 on a refusal."""
    for flag in ("dimensions", "batch_rows", "part_rows"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.text_column == args.id_column:
        parser.error("--text-column and --id-column name the same column")
    settings = settings_from_args(parser, args)
    configure_logging(settings.log_level, settings.log_format)
    try:
        import pyarrow  # noqa: F401  (the corpus extra)
    except ImportError:
        return _fail("poolserve embed needs pyarrow: pip install 'poolserve[corpus]'")
    from poolserve.jobs.corpus.errors import JobError

    try:
        job = build_job(args, settings)
        outcome = asyncio.run(_run(job, settings))
    except JobError as exc:
        return _fail(str(exc))
    except OSError as exc:  # a full disk, a folder made read-only: the parts so far are kept
        return _fail(f"{exc}; the whole parts written so far are kept, rerun to go on")
    except KeyboardInterrupt:
        return _fail("interrupted: rerun the same command to go on from the last whole part", 130)
    _report(job, outcome)
    return 0


def build_job(args: argparse.Namespace, settings: ServerSettings) -> EmbedJob:
    """The job the flags describe, after the input's quick checks (before any model loads)."""
    from poolserve.jobs.corpus.files import InputSpec, check_readable, input_format
    from poolserve.jobs.corpus.reader import CorpusReader
    from poolserve.jobs.corpus.run import EmbedJob, EmbedOptions

    path = Path(args.input)
    check_readable(path)  # a folder or a missing file: "cannot read", whatever its name ends in
    spec = InputSpec(path, input_format(path, args.input_format), args.text_column, args.id_column)
    CorpusReader(spec)  # readable, the format's reader opens, both columns are there
    options = EmbedOptions(
        args.normalize,
        args.dimensions,
        args.prompt_name,
        args.embed_dtype,
        args.truncate,
        args.adapter,
    )
    return EmbedJob(
        spec,
        Path(args.output),
        options,
        model_settings(settings),
        batch_rows=args.batch_rows,
        part_rows=args.part_rows,
        overwrite=args.overwrite,
    )


def model_settings(settings: ServerSettings) -> dict[str, Any]:
    """The settings that shape the outputs, as the manifest records them."""
    return settings.model_dump(mode="json", exclude=set(RUN_ONLY_SETTINGS))


async def _run(job: EmbedJob, settings: ServerSettings) -> Outcome:
    """The job with an engine started only if rows are left to embed."""
    from poolserve.jobs.corpus.errors import JobError
    from poolserve.jobs.corpus.run import run_job
    from poolserve.offline import AsyncPoolingEngine
    from poolserve.types.errors import ModelError

    engine: AsyncPoolingEngine | None = None

    async def started() -> AsyncPoolingEngine:
        nonlocal engine
        engine = AsyncPoolingEngine.from_settings(settings)
        try:
            await engine.start()
        except (ModelError, ValueError) as exc:  # a model that cannot load: the start names why
            raise JobError(f"the model could not start: {exc}") from None
        return engine

    try:
        return await run_job(job, started)
    finally:
        if engine is not None:
            await engine.close()


def _report(job: EmbedJob, outcome: Outcome) -> None:
    from poolserve.jobs.corpus.state import Stage

    if outcome.stage is Stage.COMPLETE:
        logger.info(
            "%s was already complete (%d rows): removed its state folder", job.output, outcome.rows
        )
        return
    logger.info("%s: %d rows; %s", job.output, outcome.rows, outcome.totals.summary())


def _fail(message: str, code: int = 1) -> int:
    return command_error("embed", message, code)
