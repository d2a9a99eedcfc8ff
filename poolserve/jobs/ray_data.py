"""Ray Data: a Parquet corpus on shared storage embedded by a pool of actors, one engine each.

    from poolserve.jobs.ray_data import embed_dataset

    embed_dataset("/shared/corpus/", "/shared/embedded/", actors=4, model="/shared/model")

`PoolserveEmbedder` is the callable class `Dataset.map_batches` runs: each actor builds one
`PoolingEngine` (the server's settings, start-up and pipeline) and turns a batch of rows into
`poolserve/jobs/arrow.py`'s layout, the rows `poolserve embed` writes for the same options.
Ray is imported only by `embed_dataset`, so this module loads without it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from poolserve.config.flags import add_settings_flags, settings_from_args
from poolserve.config.settings import ServerSettings
from poolserve.http.errors import ERROR_TABLE
from poolserve.jobs.arrow import EMBED_DTYPES, output_schema, output_table
from poolserve.jobs.corpus.errors import JobError
from poolserve.jobs.corpus.run import EmbedOptions
from poolserve.offline import Pooled, PoolingEngine
from poolserve.types.errors import APIError

# Rows per output file at least (the last file of a write may hold fewer): blocks of one batch
# each are gathered so the output is not thousands of small files.
FILE_ROWS = 8192

Batch: TypeAlias = "pa.Table | Mapping[str, np.ndarray]"


class RowsRefusedError(JobError):
    """Rows or options an actor refused: its own one-line message, whatever Ray adds to it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = str(self.args[0])

    def __str__(self) -> str:
        # Ray Data appends its retry notes to an exception's args; the message stays ours
        return self.message

    def __reduce__(self) -> tuple[type[RowsRefusedError], tuple[str]]:
        return type(self), (self.message,)


class PoolserveEmbedder:
    """One engine per actor; a batch of (id, text) rows in, (id, embedding, prompt_tokens) out.

    `settings` (or the `ServerSettings` fields as keyword arguments) choose the model and how it
    runs; the options mean what `poolserve embed`'s flags mean.
    """

    def __init__(
        self,
        settings: ServerSettings | None = None,
        *,
        text_column: str = "text",
        id_column: str = "id",
        options: EmbedOptions | None = None,
        **server_settings: Any,
    ) -> None:
        self.text_column, self.id_column = text_column, id_column
        self.options = _checked_options(options)
        self.engine = PoolingEngine.from_settings(_settings(settings, server_settings))
        self._dim: int | None = None  # learnt on the first empty batch, for its schema

    def __call__(self, batch: Batch) -> pa.Table:
        """The batch's rows embedded, in its order."""
        table = batch if isinstance(batch, pa.Table) else pa.table(dict(batch))
        ids, texts = checked_rows(table, self.text_column, self.id_column)
        if not texts:
            return output_schema(ids.type, self.dim, self.options.embed_dtype).empty_table()
        pooled = self._embed(texts, ids)
        return output_table(ids, pooled, self.options.embed_dtype)

    @property
    def dim(self) -> int:
        """The stored embedding's size with these options (one probe, once)."""
        if self._dim is None:
            self._dim = len(self._embed(["dim"], pa.array(["probe"]))[0].data)
        return self._dim

    def _embed(self, texts: list[str], ids: pa.Array) -> list[Pooled]:
        """The engine's embeddings; a refused batch or option as a JobError naming its ids."""
        try:
            return self.engine.embed(texts, **self.options.api())
        except Exception as exc:
            if not _refused(exc):
                raise  # the engine's own failure, reported as is
            message = exc.message if isinstance(exc, APIError) else str(exc)
            first, last = ids[0].as_py(), ids[-1].as_py()
            raise RowsRefusedError(f"rows id={first!r}..id={last!r} refused: {message}") from None

    def close(self) -> None:
        """Stop the engine and its loop thread."""
        engine = self.__dict__.pop("engine", None)  # absent when the constructor failed
        if engine is not None:
            engine.close()

    def __del__(self) -> None:
        # Ray Data drops the actor's instance before the process exits (`__ray_shutdown__`):
        # the engine drains and stops here instead of dying with the interpreter mid-loop.
        self.close()


def checked_rows(table: pa.Table, text_column: str, id_column: str) -> tuple[pa.Array, list[str]]:
    """The ids and texts of a batch, or a JobError naming the first bad row by its id."""
    missing = [c for c in (id_column, text_column) if c not in table.column_names]
    if missing:
        raise RowsRefusedError(f"no column {missing[0]!r}; the input has {table.column_names}")
    ids = table.column(id_column).combine_chunks()
    texts = table.column(text_column).combine_chunks()
    if ids.null_count:
        raise RowsRefusedError(f"a row's id (column {id_column!r}) is null")
    if pa.types.is_dictionary(texts.type):
        texts = texts.dictionary_decode()
    if str(texts.type) == "string_view":  # pyarrow >= 16; read as the plain string types
        texts = texts.cast(pa.large_string())
    if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
        raise RowsRefusedError(f"the text column {text_column!r} is {texts.type}, not text")
    bad = pc.or_kleene(texts.is_null(), pc.equal(pc.utf8_length(texts), 0))
    row = pc.index(pc.fill_null(bad, True), True).as_py()
    if row >= 0:
        what = "null" if texts[row].as_py() is None else "empty"
        where = f"row id={ids[row].as_py()!r}"
        raise RowsRefusedError(f"{where}: its text (column {text_column!r}) is {what}")
    return ids, texts.to_pylist()


def _refused(exc: Exception) -> bool:
    """Whether the engine refused the request (a 400), as a server would answer it."""
    if isinstance(exc, APIError):
        return exc.status == 400
    shape = next((ERROR_TABLE[c] for c in type(exc).__mro__ if c in ERROR_TABLE), None)
    return shape is not None and shape.status == 400


def _checked_options(options: EmbedOptions | None) -> EmbedOptions:
    """`poolserve embed`'s options; its `truncate=False` (a refusal of cut rows) is not here."""
    options = options or EmbedOptions()
    if not options.truncate:
        raise ValueError(
            "truncate=False is poolserve embed's alone: here over-long rows are cut to the "
            "model's length, as sentence-transformers cuts them (the command's default)"
        )
    return options


def _settings(settings: ServerSettings | None, fields: Mapping[str, Any]) -> ServerSettings:
    """Validated settings: the object given, or the keyword arguments (not both)."""
    if settings is not None and fields:
        raise TypeError("give settings= or ServerSettings fields as keywords, not both")
    return settings if settings is not None else ServerSettings(**fields)


def embed_dataset(
    input: str | Path | Sequence[str],
    output: str | Path,
    *,
    actors: int = 1,
    batch_size: int = 512,
    settings: ServerSettings | None = None,
    text_column: str = "text",
    id_column: str = "id",
    options: EmbedOptions | None = None,
    num_gpus: float | None = None,
    num_cpus: float | None = None,
    overwrite: bool = False,
    **server_settings: Any,
) -> None:
    """Read Parquet at `input`, embed it with `actors` engines, write Parquet files to `output`.

    Ray must be running or startable (`ray.init()` connects to `RAY_ADDRESS` when set). Each
    actor asks for `num_gpus` (default: 1 when the cluster has GPUs, else 0) and `num_cpus`
    (Ray's default 1; it also sets the actor's torch threads). Paths are read by every node:
    shared storage, or a URI pyarrow's filesystems open (s3://, gs://, ...).
    """
    ray: Any = importlib.import_module("ray")  # typed loosely: mypy runs without Ray too
    paths = str(input) if isinstance(input, str | Path) else [str(p) for p in input]
    output = str(output)

    if actors < 1 or batch_size < 1:
        raise ValueError(f"actors and batch_size must be at least 1, got {actors}, {batch_size}")
    checked = _settings(settings, server_settings)  # bad settings fail here, not in every actor
    options = _checked_options(options)
    if not ray.is_initialized():
        ray.init()
    resources = ray.cluster_resources()
    if num_gpus is None:
        num_gpus = 1 if resources.get("GPU", 0) > 0 else 0
    _check_cpus(actors, 1.0 if num_cpus is None else num_cpus, resources.get("CPU", 0.0))
    dataset = ray.data.read_parquet(paths)
    found = dataset.schema().names  # the files' metadata: a wrong column fails before any work
    missing = [c for c in (id_column, text_column) if c not in found]
    if missing:
        raise JobError(f"{paths}: no column {missing[0]!r}; the input has {found}")
    dataset = dataset.select_columns([id_column, text_column])
    # blocks of one batch each: the pool hands out blocks, so small files still reach every actor
    dataset = dataset.repartition(target_num_rows_per_block=batch_size)
    embedded = dataset.map_batches(
        PoolserveEmbedder,
        fn_constructor_kwargs={
            "settings": checked,
            "text_column": text_column,
            "id_column": id_column,
            "options": options,
        },
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_gpus=num_gpus,
        num_cpus=num_cpus,
    )
    # the actors' JobError itself, not Ray's wrapper around it (whose cause is lost in pickling)
    embedded.context.raise_original_map_exception = True
    embedded.write_parquet(output, mode=_write_mode(output, overwrite), min_rows_per_file=FILE_ROWS)


def _check_cpus(actors: int, per_actor: float, cpus: float) -> None:
    """Refuse a pool that leaves no CPU for the read and write tasks: Ray would wait forever."""
    if actors * per_actor > cpus - 1:
        raise JobError(
            f"{actors} actors x {per_actor:g} CPUs leave none of the cluster's {cpus:g} CPUs for "
            "reading and writing: use fewer actors or fewer CPUs per actor (num_cpus, --num-cpus)"
        )


def _write_mode(output: str, overwrite: bool) -> str:
    """Ray's save mode: an existing output is refused unless `overwrite` (Ray checks URIs)."""
    if overwrite:
        return "overwrite"
    path = Path(output)
    if "://" in output or not path.exists():
        return "error"
    if path.is_dir() and not any(path.iterdir()):
        return "overwrite"  # an empty folder, as a failed run leaves it: nothing to lose
    raise JobError(f"{output} exists: pass overwrite=True (--overwrite) to replace it")


def job_error(exc: BaseException) -> JobError | None:
    """The JobError an actor raised, from the error Ray raises for it on the driver, if any."""
    cause = getattr(exc, "cause", None)  # Ray's RayTaskError carries the actor's exception
    if isinstance(cause, JobError):
        return cause
    return exc if isinstance(exc, JobError) else None


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m poolserve.jobs.ray_data INPUT -o OUTPUT --actors N [serve flags]`."""
    parser = argparse.ArgumentParser(
        prog="python -m poolserve.jobs.ray_data",
        description="Embed Parquet into Parquet (poolserve embed's layout) with Ray Data actors.",
    )
    parser.add_argument("input", metavar="INPUT", help="Parquet file or folder (shared storage).")
    parser.add_argument("-o", "--output", required=True, help="Folder of Parquet files to write.")
    parser.add_argument("--actors", type=int, default=1, help="Engines, one per actor (1).")
    parser.add_argument("--batch-size", type=int, default=512, help="Rows per actor call (512).")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--id-column", default="id")
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--dimensions", type=int)
    parser.add_argument("--prompt-name")
    parser.add_argument("--embed-dtype", default="float32", choices=list(EMBED_DTYPES))
    parser.add_argument("--num-cpus", type=float, help="CPUs per actor (Ray's default 1).")
    parser.add_argument("--overwrite", action="store_true", help="Replace OUTPUT.")
    add_settings_flags(parser, "embed")
    args = parser.parse_args(argv)
    if (args.dimensions is not None and args.dimensions < 1) or args.actors < 1:
        parser.error("--dimensions and --actors must be at least 1")
    options = EmbedOptions(
        normalize=args.normalize,
        dimensions=args.dimensions,
        prompt_name=args.prompt_name,
        embed_dtype=args.embed_dtype,
    )
    try:
        embed_dataset(
            args.input,
            args.output,
            actors=args.actors,
            batch_size=args.batch_size,
            settings=settings_from_args(parser, args),
            text_column=args.text_column,
            id_column=args.id_column,
            options=options,
            num_cpus=args.num_cpus,
            overwrite=args.overwrite,
        )
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        return _fail(parser, "Ray is not installed: pip install 'poolserve[ray-data]'")
    except Exception as exc:
        refusal = job_error(exc)
        if refusal is None:
            raise  # not the input's fault: a failure of Ray or the engine, reported whole
        return _fail(parser, str(refusal))
    return 0


def _fail(parser: argparse.ArgumentParser, message: str) -> int:
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
