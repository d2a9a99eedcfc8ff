"""The CPU peers of `python -m bench cpu-peers`: sentence-transformers on torch, ONNX Runtime
(float32 and dynamic int8) and OpenVINO, each embedding texts as sentence-transformers does.

sentence-transformers' ONNX and OpenVINO backends run a model exported once to ONNX, fed in padded
batches of 32 texts sorted by length, pooled and normalized outside the runtime; this module does
the same with the runtimes' own Python APIs (bench/precision/cpu_peers.py says why not through the
backends). A runtime that is not installed or cannot take the model is left out with a log line,
never faked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from poolserve.models.cpu_class import cpu_class

logger = logging.getLogger(__name__)

BATCH = 32  # sentence-transformers' encode() default
MAX_LENGTH = 512
Forward = Callable[[np.ndarray, np.ndarray], np.ndarray]  # ids, mask [b, s] -> hidden [b, s, h]


@dataclass(frozen=True)
class Runtime:
    """One row of the run: its label, how it started, and texts -> normalized embeddings."""

    label: str
    start: str
    embed: Callable[[list[str]], np.ndarray]


def peer_runtimes(
    model_dir: Path, pooling: str, tmp: Path, keep: Callable[[str], bool] = lambda label: True
) -> list[Runtime]:
    """sentence-transformers (torch), then the ONNX runtimes that are installed and take it;
    only those whose label `keep` keeps are built (the reference always)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir), device="cpu")
    rows = [
        Runtime(
            "sentence-transformers (torch) float32",
            "",
            lambda texts: np.asarray(
                st.encode(
                    texts, batch_size=BATCH, normalize_embeddings=True, show_progress_bar=False
                )
            ),
        )
    ]
    try:
        onnx_path = export_onnx(model_dir, tmp / f"{model_dir.name}.onnx")
    except Exception as exc:  # an exporter gap is a result to report, not a crash
        logger.warning("no ONNX export of %s: %s", model_dir, exc)
        return rows
    for label, start, forward in _onnx_forwards(onnx_path, tmp, keep):
        rows.append(Runtime(label, start, padded(model_dir, forward, pooling)))
    return rows


def export_onnx(model_dir: Path, path: Path) -> Path:
    """The backbone's last hidden state as ONNX (TorchScript exporter, opset 17, dynamic axes)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state

    ids = torch.ones(2, 8, dtype=torch.long)
    axes = {0: "batch", 1: "sequence"}
    torch.onnx.export(
        Hidden(),
        (ids, torch.ones_like(ids)),
        str(path),
        input_names=["ids", "mask"],
        output_names=["hidden"],
        dynamic_axes={"ids": axes, "mask": axes, "hidden": axes},
        opset_version=17,
        dynamo=False,
    )
    return path


def _onnx_forwards(
    onnx_path: Path, tmp: Path, keep: Callable[[str], bool]
) -> list[tuple[str, str, Forward]]:
    """ONNX Runtime float32 and int8, OpenVINO default and float32: those installed and kept."""
    forwards: list[tuple[str, str, Forward]] = []
    try:
        import onnxruntime as ort
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError:
        logger.warning("onnxruntime is not installed: pip install -e '.[cpu-peers]'")
    else:
        # optimum's AVX-512 VNNI configuration keeps the full range; its AVX2 one reduces it
        reduce_range = "VNNI" not in cpu_class().units
        int8_path = tmp / f"{onnx_path.stem}-int8.onnx"
        for label, path in (("float32", onnx_path), ("dynamic int8", int8_path)):
            name = f"ONNX Runtime {ort.__version__} {label}"
            if not keep(name):
                continue
            if path == int8_path:
                quantize_dynamic(
                    onnx_path,
                    int8_path,
                    weight_type=QuantType.QInt8,
                    per_channel=True,
                    reduce_range=reduce_range,
                )
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            forwards.append((name, "", _ort(session)))
    try:
        import openvino as ov
    except ImportError:
        logger.warning("openvino is not installed: pip install -e '.[cpu-peers]'")
        return forwards
    core = ov.Core()
    version = ov.__version__.split("-")[0]
    # its default precision (bfloat16 where the CPU has the units), then float32 where it differs
    for label, hint in (("default", {}), ("float32", {"INFERENCE_PRECISION_HINT": "f32"})):
        if label == "float32" and any(f[1] == "runs f32" for f in forwards):
            break  # the default already runs float32
        if not keep(f"OpenVINO {version} {label}"):
            continue
        try:
            compiled = core.compile_model(core.read_model(str(onnx_path)), "CPU", hint)
        except RuntimeError as exc:  # e.g. bfloat16 under ONEDNN_MAX_CPU_ISA=AVX2
            logger.warning("OpenVINO %s cannot compile the model here: %s", label, exc)
            continue
        precision = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        forwards.append((f"OpenVINO {version} {label}", f"runs {precision}", _ov(compiled)))
    return forwards


def _ort(session: object) -> Forward:
    """An ONNX Runtime session as a forward."""

    def forward(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return session.run(None, {"ids": ids, "mask": mask})[0]  # type: ignore[attr-defined, no-any-return]

    return forward


def _ov(compiled: object) -> Forward:
    """An OpenVINO compiled model as a forward."""

    def forward(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return np.asarray(compiled({"ids": ids, "mask": mask})[0])  # type: ignore[operator]

    return forward


def padded(model_dir: Path, forward: Forward, pooling: str) -> Callable[[list[str]], np.ndarray]:
    """texts -> normalized embeddings: sorted by length, padded batches, pooled in numpy."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def embed(texts: list[str]) -> np.ndarray:
        order = np.argsort([-len(text) for text in texts], kind="stable")
        out = np.zeros((len(texts), 0), dtype=np.float32)
        rows: dict[int, np.ndarray] = {}
        for start in range(0, len(texts), BATCH):
            index = order[start : start + BATCH]
            batch = tokenizer(
                [texts[i] for i in index],
                padding=True,
                truncation=True,
                max_length=MAX_LENGTH,
                return_tensors="np",
            )
            ids = batch["input_ids"].astype(np.int64)
            mask = batch["attention_mask"].astype(np.int64)
            pooled = POOLS[pooling](forward(ids, mask), mask)  # [b, h]
            pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
            rows.update(zip(index.tolist(), pooled, strict=True))
        if rows:
            out = np.stack([rows[i] for i in range(len(texts))])
        return out

    return embed


def _mean(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    weights = mask[:, :, None].astype(np.float32)  # [b, s, 1]
    return (hidden * weights).sum(1) / weights.sum(1)


def _cls(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return hidden[:, 0].copy()


def _last(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    last = mask.sum(1) - 1  # right padding: each row's last real token
    return hidden[np.arange(hidden.shape[0]), last].copy()


POOLS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "mean": _mean,
    "cls": _cls,
    "last": _last,
}
