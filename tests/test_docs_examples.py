"""Every documented example runs as written: the shell commands and request bodies of README.md
and docs/*.md, against a real `poolserve serve` process on the embedded MiniLM.

What is extracted:

- ```bash / ```sh / ```console blocks, one example per command (backslash continuations joined,
  comments dropped; in a console block only the `$ ` lines). A `curl` request is sent with
  httpx to the live server (the host:port rewritten) and must answer 2xx with a JSON body (NDJSON
  when streamed), or the status a trailing `# NNN ...` comment documents. `poolserve embed` and
  `poolserve run-batch` run in a temporary folder with the inputs the docs show (INPUT_FILES),
  and must exit 0 and write their output. `poolserve serve` starts on a free port, must become
  ready and answer an embedding, and must exit 0 on SIGTERM.
- ```json blocks that are requests: a batch line (`custom_id`, `method`, `url`, `body`) is the
  run-batch input the docs show, and its body is also sent to its url on the live server. Other
  json blocks are documented answers (response shapes with `...`): counted, not run.
- ```python blocks that call the server (http://127.0.0.1:8000 in them) run as client scripts
  with the URL rewritten; a `print(...)  # value` comment is what the print must show. The other
  python blocks load engines in process (the Python API) and are counted, not run.

What is skipped, always by a visible rule: a `<!-- docs-test: skip (why) -->` comment right
before a block skips the block; SKIP_RULES skips commands by pattern (Docker, Kubernetes, Ray,
benchmarks, installers, multi-host); a poolserve command naming a model other than the
embedded MiniLM is skipped with that model's name. A command no rule runs or skips fails the
test, so a new kind of example is never passed over silently. FILES_WITH_RUNNABLE names the docs
that must keep at least one example that runs; the summary test prints the counts per file.

The processes (the live server, the jobs, the documented servers) start together when the module
starts, so they share the two cores instead of queueing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.deploy.live import poolserve_server, server_env
from tests.deploy.tools import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EMBEDDED_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
SHELL_LANGS = {"bash", "sh", "shell", "console"}
JOB_TIMEOUT_S = 120

# Commands that cannot run offline on a CPU-only test machine, by the pattern that starts them
# (matched against the command without its comments). The first match wins.
SKIP_RULES: list[tuple[str, str]] = [
    (r"^docker\b", "needs a Docker engine (and an NVIDIA GPU for the cuda image and service)"),
    (r"^(kubectl|helm)\b", "needs a Kubernetes cluster"),
    (r"^serve run\b", "needs Ray Serve (the ray extra) and a Ray cluster"),
    (r"^python -m poolserve\.jobs\.ray_data\b", "needs Ray Data and the shared storage it names"),
    (r"\bhaproxy\b", "multi-host: HAProxy in front of replicas on other hosts"),
    (r"^(\S+=\S+ )*(python -m bench\b|bash bench/|bench/)", "a benchmark: minutes of CPU or a GPU"),
    (r"^(pip|\S*/pip) install\b", "installs packages into the environment"),
    (r"^python3? -m venv\b", "creates a virtualenv and installs torch into it"),
    (
        r"^make (test|serve|install)\b",
        "builds .venv; make test is the whole suite, make serve the server these examples use",
    ),
    (
        r"^(\S+=\S+ )*scripts/gpu_check\.sh\b",
        "its own pytest session for a CUDA device (--dry-run: about a minute of CPU here)",
    ),
]
# Input files that commands read and the docs name without showing their creation: a small file
# in the documented format. The run-batch input comes from the docs' own batch line (below).
INPUT_FILES = {
    "corpus.jsonl": '{"id": 1, "text": "first text"}\n{"id": 2, "text": "second text"}\n',
}
# The docs that must keep at least one example that runs here; every other doc with examples
# must be listed in ALL_SKIPPED with the reason none of its examples can run.
FILES_WITH_RUNNABLE = {"README.md", "docs/deploy.md", "docs/jobs.md"}
ALL_SKIPPED = {
    "docs/api.md": "gRPC clients: stubs compiled from the proto, grpcurl (tests/grpc runs them)",
    "docs/gpu.md": "CUDA checks and their virtualenv",
    "docs/scale-out.md": "Kubernetes, Ray, HAProxy and fleet benchmarks",
}

SKIP_MARKER = re.compile(r"<!--\s*docs-test:\s*skip\s*\((.+?)\)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
SERVER_URL = re.compile(r"https?://(localhost|127\.0\.0\.1):8000")
LOCAL_URL = re.compile(r"^(https?://)?(localhost|127\.0\.0\.1|0\.0\.0\.0)(:\d+)?(/|$)")


@dataclass
class Example:
    """One runnable unit of a doc: a command, or a JSON request body."""

    doc: str  # path relative to the repository
    line: int  # the fence's line (1-based)
    kind: str  # curl | job | serve | request | response | unknown
    text: str  # the command as written (continuations joined), or the JSON text
    index: int = 1  # the command's place in its block
    skip: str | None = None
    expect_status: int | None = None
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}#{self.index}:{self.text.split()[0]}"


def _blocks(path: Path) -> Iterator[tuple[int, str, list[str], str | None]]:
    """(fence line, language, body lines, skip reason from a marker right before the fence)."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        before = i - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = SKIP_MARKER.search(lines[before]) if before >= 0 else None
        yield i + 1, m.group(1).lower(), lines[i + 1 : end], marker.group(1) if marker else None
        i = end + 1


def _commands(lang: str, body: list[str]) -> list[str]:
    """The block's commands: continuations joined, comment-only lines and console output dropped."""
    if lang == "console":
        body = [ln[2:] for ln in body if ln.startswith("$ ")]
    commands: list[str] = []
    pending = ""
    for raw in body:
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        command = (pending + raw).strip()
        pending = ""
        if command and not command.startswith("#"):
            commands.append(command)
    return commands


def _words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def _documented_status(command: str) -> int | None:
    """A trailing comment that starts with a status code documents it (`curl URL  # 200 ...`)."""
    m = re.search(r"\s#\s*([1-5]\d\d)\b", command)
    return int(m.group(1)) if m else None


def _other_model(words: list[str]) -> str | None:
    """The model a poolserve command names when it is not the embedded MiniLM."""
    models: list[str] = []
    for i, word in enumerate(words):
        if word in ("--model", "--models") and i + 1 < len(words):
            models.append(words[i + 1])
        elif word.startswith("--model="):
            models.append(word.split("=", 1)[1])
    if words[:2] == ["poolserve", "serve"]:
        for word in words[2:]:
            if word.startswith("-"):
                break
            models.append(word)
    return next((m for m in models if m != EMBEDDED_MODEL), None)


def _classify(doc: str, line: int, index: int, command: str, block_skip: str | None) -> Example:
    words = _words(command)
    flat = " ".join(words)
    if words and words[0] == "curl":
        kind = "curl"
    elif re.search(r"(^|\| *)poolserve (embed|run-batch)\b", command):
        kind = "job"
    elif words[:2] == ["poolserve", "serve"]:
        kind = "serve"
    else:
        kind = "unknown"
    example = Example(doc, line, kind, command, index, expect_status=_documented_status(command))
    if block_skip:
        example.skip = block_skip
        return example
    for pattern, reason in SKIP_RULES:
        if re.search(pattern, flat):
            example.skip = reason
            return example
    if kind in ("job", "serve"):
        pipeline = [w for w in words if w not in ("|", ">")]
        start = pipeline.index("poolserve") if "poolserve" in pipeline else 0
        model = _other_model(pipeline[start:])
        if model:
            example.skip = f"needs the model {model}; here only the embedded MiniLM, offline"
    return example


def _json_example(doc: str, line: int, text: str, block_skip: str | None) -> Example:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None  # a documented answer with `...` in it
    is_request = isinstance(value, dict) and {"custom_id", "method", "url", "body"} <= set(value)
    example = Example(doc, line, "request" if is_request else "response", text, skip=block_skip)
    if is_request:
        example.extra["batch_line"] = value
    return example


def collect() -> list[Example]:
    examples: list[Example] = []
    for path in DOCS:
        doc = str(path.relative_to(REPO))
        for line, lang, body, block_skip in _blocks(path):
            if lang in SHELL_LANGS:
                for index, command in enumerate(_commands(lang, body), 1):
                    examples.append(_classify(doc, line, index, command, block_skip))
            elif lang == "json":
                examples.append(_json_example(doc, line, "\n".join(body), block_skip))
            elif lang == "python":
                code = "\n".join(body)
                kind = "python" if SERVER_URL.search(code) else "python-in-process"
                examples.append(Example(doc, line, kind, code, skip=block_skip))
    return examples


EXAMPLES = collect()
RUNS = [e for e in EXAMPLES if e.kind not in ("response", "python-in-process")]
BATCH_LINES = [json.dumps(e.extra["batch_line"]) for e in EXAMPLES if e.kind == "request"]


def _param(example: Example) -> object:
    marks = [pytest.mark.skip(reason=f"{example.doc}:{example.line}: {example.skip}")]
    return pytest.param(example, id=example.id, marks=marks if example.skip else [])


# ---------------------------------------------------------------------------------- processes


def _env() -> dict[str, str]:
    """A reader's shell in the venv: the installed `poolserve` first on PATH; the live tests'
    server environment (no POOLSERVE_* of this shell, CPU, offline, loopback)."""
    bin_dir = str(Path(sys.executable).parent)
    return {**server_env(), "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}


@dataclass
class Launched:
    process: subprocess.Popen[bytes]
    folder: Path
    log: Path
    port: int | None = None


def _launch_job(example: Example, folder: Path) -> Launched:
    folder.mkdir(parents=True)
    for name, text in INPUT_FILES.items():
        (folder / name).write_text(text)
    (folder / "requests.jsonl").write_text("".join(line + "\n" for line in BATCH_LINES))
    log = folder / "stderr.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            ["bash", "-c", example.text],
            cwd=folder,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=sink,
        )
    return Launched(process, folder, log)


def _launch_serve(example: Example, folder: Path) -> Launched:
    folder.mkdir(parents=True)
    port = free_port()
    log = folder / "stderr.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            ["bash", "-c", f"exec {example.text} --port {port}"],
            cwd=folder,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=sink,
        )
    return Launched(process, folder, log, port)


@pytest.fixture(scope="module")
def launched(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Launched]]:
    """The selected job and server examples, started at once so that they run side by side."""
    specs = [getattr(item, "callspec", None) for item in request.session.items]
    chosen = [spec.params.get("example") for spec in specs if spec is not None]
    selected = {e.id: e for e in chosen if isinstance(e, Example)}
    started: dict[str, Launched] = {}
    root = tmp_path_factory.mktemp("docs-examples")
    for n, example in enumerate(e for e in selected.values() if not e.skip):
        if example.kind == "job":
            started[example.id] = _launch_job(example, root / f"job{n}")
        elif example.kind == "serve":
            started[example.id] = _launch_serve(example, root / f"serve{n}")
    try:
        yield started
    finally:
        for job in started.values():
            if job.process.poll() is None:
                job.process.kill()
                job.process.wait(timeout=30)


@pytest.fixture(scope="module")
def docs_server(
    launched: dict[str, Launched], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[httpx.Client]:
    """`poolserve serve` with no arguments, as `make serve` starts it: the embedded MiniLM under
    its default served name, the name the docs' requests send (the suite's shared live server
    serves other names), with the Batch API the docs show (--batch-dir). Started after the
    jobs, so they share the cores."""
    folder = tmp_path_factory.mktemp("docs-server")
    with (
        poolserve_server(folder, {"POOLSERVE_BATCH_DIR": str(folder / "batches")}) as live,
        httpx.Client(base_url=live.base_url, timeout=60) as client,
    ):
        yield client


# ---------------------------------------------------------------------------------- running


def _curl_request(command: str) -> tuple[str, str, dict[str, str], str | None]:
    """(method, url, headers, body) of a documented curl command; any other option fails."""
    words = _words(command)[1:]
    method, url, headers, data = None, None, {}, None
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("-H", "--header"):
            name, _, value = words[i + 1].partition(":")
            headers[name.strip()] = value.strip()
            i += 2
        elif word in ("-d", "--data", "--data-raw", "--data-binary"):
            data = words[i + 1]
            i += 2
        elif word in ("-X", "--request"):
            method = words[i + 1]
            i += 2
        elif re.fullmatch(r"-[sSN]+", word) or word in ("--silent", "--no-buffer", "--show-error"):
            i += 1
        elif not word.startswith("-") and url is None:
            url = word
            i += 1
        else:
            raise AssertionError(
                f"curl option {word!r} in {command!r}: teach this test or simplify the doc"
            )
    assert url, f"no url in {command!r}"
    return method or ("POST" if data is not None else "GET"), url, headers, data


def _assert_json_answer(response: httpx.Response, expect: int | None, what: str) -> None:
    if expect is None:
        assert response.is_success, f"{what}: {response.status_code} {response.text[:500]}"
    else:
        assert response.status_code == expect, (
            f"{what}: {response.status_code} {response.text[:500]}"
        )
    lines = [ln for ln in response.text.splitlines() if ln.strip()]
    assert lines, f"{what}: empty body"
    if "ndjson" in response.headers.get("content-type", ""):
        for ln in lines:
            json.loads(ln)
    else:
        json.loads(response.text)


def _run_curl(example: Example, server: httpx.Client) -> None:
    method, url, headers, data = _curl_request(example.text)
    m = LOCAL_URL.match(url)
    assert m, f"{example.id}: {url} is not this host: add a skip rule or a marker"
    path = url[m.end() - len(m.group(4)) :] or "/"
    response = server.request(method, path, headers=headers, content=data)
    _assert_json_answer(response, example.expect_status, example.id)


def _run_python(example: Example, server: httpx.Client) -> None:
    """A client snippet against the server, its URL rewritten; a `print(...)  # value` comment
    documents what that print shows."""
    code = SERVER_URL.sub(str(server.base_url).rstrip("/"), example.text)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        env=_env(),
    )
    assert result.returncode == 0, (
        f"{example.id}: exit {result.returncode}\n{result.stderr[-3000:]}"
    )
    shown = re.findall(r"^\s*print\(.*\)\s*#\s*(.+?)\s*$", example.text, flags=re.M)
    assert result.stdout.splitlines()[: len(shown)] == shown, (example.id, result.stdout)


def _run_request(example: Example, server: httpx.Client) -> None:
    line = example.extra["batch_line"]
    assert isinstance(line, dict)
    response = server.request(line["method"], line["url"], json=line["body"])
    _assert_json_answer(response, None, example.id)


def _output_of(example: Example) -> str:
    words = _words(example.text)
    for flag in ("-o", "--output-file"):
        if flag in words and words[words.index(flag) + 1] != "-":
            return words[words.index(flag) + 1]
    assert ">" in words, f"{example.id}: no output file"
    return words[words.index(">") + 1]


def _check_job(example: Example, job: Launched) -> None:
    try:
        code = job.process.wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.process.kill()
        raise AssertionError(f"{example.id}: still running after {JOB_TIMEOUT_S} s") from None
    log = job.log.read_text()[-3000:]
    assert code == 0, f"{example.id}: exit {code}\n{log}"
    output = job.folder / _output_of(example)
    assert output.is_file() and output.stat().st_size > 0, f"{example.id}: no {output.name}\n{log}"
    if "run-batch" in example.text:
        answers = [json.loads(ln) for ln in output.read_text().splitlines()]
        assert len(answers) == len(BATCH_LINES)
        assert all(a["response"]["status_code"] == 200 for a in answers), answers
    if output.suffix == ".parquet":
        import pyarrow.parquet as pq

        assert pq.read_metadata(output).num_rows == INPUT_FILES["corpus.jsonl"].count("\n")


def _check_serve(example: Example, job: Launched) -> None:
    base = f"http://127.0.0.1:{job.port}"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while True:
            assert job.process.poll() is None, (
                f"{example.id}: exited\n{job.log.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, (
                f"{example.id}: never ready\n{job.log.read_text()[-3000:]}"
            )
            try:
                if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass  # not listening yet: the server is still starting; poll again
            time.sleep(0.2)
        response = httpx.post(f"{base}/v1/embeddings", json={"input": ["hello world"]}, timeout=30)
        _assert_json_answer(response, None, example.id)
    finally:
        job.process.send_signal(signal.SIGTERM)
        code = job.process.wait(timeout=60)
    assert code == 0, f"{example.id}: exit {code} on SIGTERM\n{job.log.read_text()[-3000:]}"


@pytest.mark.parametrize("example", [_param(e) for e in RUNS])
def test_documented_example(example: Example, request: pytest.FixtureRequest) -> None:
    assert example.kind != "unknown", (
        f"{example.id}: no rule runs or skips {example.text!r}: teach this test to run it, "
        "add a SKIP_RULES pattern, or put <!-- docs-test: skip (why) --> before its block"
    )
    launched = request.getfixturevalue("launched")
    if example.kind in ("curl", "request", "python"):
        server = request.getfixturevalue("docs_server")
        runner = {"curl": _run_curl, "request": _run_request, "python": _run_python}
        runner[example.kind](example, server)
    elif example.kind == "job":
        _check_job(example, launched[example.id])
    else:
        _check_serve(example, launched[example.id])


def test_every_doc_keeps_runnable_examples(request: pytest.FixtureRequest) -> None:
    """Counts per doc (printed), and a doc that had runnable examples still has some."""
    counts: dict[str, dict[str, int]] = {}
    for e in EXAMPLES:
        c = counts.setdefault(
            e.doc, {"found": 0, "run": 0, "skipped": 0, "answers shown": 0, "python not run": 0}
        )
        if e.kind in ("response", "python-in-process"):
            c["answers shown" if e.kind == "response" else "python not run"] += 1
            continue
        c["found"] += 1
        c["skipped" if e.skip else "run"] += 1
    report = "\n".join(
        f"docs examples: {doc}: " + ", ".join(f"{n} {k}" for k, n in c.items())
        for doc, c in counts.items()
    )
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n" + report)
    with_examples = {doc for doc, c in counts.items() if c["found"]}
    assert with_examples <= FILES_WITH_RUNNABLE | set(ALL_SKIPPED), (
        f"docs with examples but in neither FILES_WITH_RUNNABLE nor ALL_SKIPPED: "
        f"{sorted(with_examples - FILES_WITH_RUNNABLE - set(ALL_SKIPPED))}\n{report}"
    )
    empty = sorted(doc for doc in FILES_WITH_RUNNABLE if counts.get(doc, {}).get("run", 0) == 0)
    assert not empty, f"no runnable example left in {empty}\n{report}"
