"""The messages between front ends and the engine core (poolserve/types/protocol.py).

Every message survives encode -> decode equal and of its own class; each direction refuses the
other's messages and garbled headers with msgspec's DecodeError; token ids travel as one flat
int64 frame (plus one for type ids) that the core cuts back into views of that frame, byte for
byte; pooled outputs travel as raw frames whose dtype and shape ride in the header; and errors
come back as the class the core raised, or as a failed step when the front end cannot rebuild it.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest

from poolserve.types import protocol
from poolserve.types.errors import (
    InvalidTokenIdError,
    OverloadedError,
    OverloadReason,
    PromptTooLongError,
    StepFailedError,
)
from poolserve.types.images import ImageInputs, ImageProcessing, Naflex
from poolserve.types.params import PoolingParams
from poolserve.types.protocol import (
    Adapt,
    Adapted,
    Adapters,
    Beat,
    Cancel,
    Card,
    Hello,
    Load,
    OutputHead,
    Query,
    Results,
    Snapshot,
    Submit,
    WireError,
)
from poolserve.types.tasks import PoolingTask
from poolserve.types.vision import GridProcessing, InlineImages, PromptImages, image_digest
from tests.types.test_wire import Receiver, _wire

IDLE = Load(0, 0, None, None, False, True)
BUSY = Load(17, 4096, 1234.5, "CUDA error: an illegal memory access", True, False)
EVERY_FIELD = PoolingParams(
    PoolingTask.TOKEN_CLASSIFY,
    dimensions=64,
    normalize=False,
    use_activation=True,
    step_tag_id=12,
    returned_token_ids=(3, 9),
    prompt_tokens=2,
    token_spans=(((0, 2), (2, 5)), ((1, 3),)),
)
FAILURE = WireError("poolserve.types.errors", "StepFailedError", "boom", pickle.dumps({}))

TO_CORE = {
    "hello": Hello(),
    "submit": Submit([7], [3], PoolingParams(PoolingTask.EMBED), 0, [False]),
    "submit, every field": Submit([1, 2**40, -1], [5, 3, 1], EVERY_FIELD, -9, [True, False, True]),
    "submit, naflex images": Submit(
        [3, 4, 5],
        [6, 2, 6],
        PoolingParams(PoolingTask.EMBED),
        0,
        [False] * 3,
        [True, False, True],
        [(2, 3), (1, 1)],
    ),
    "cancel": Cancel([4, 5, 6]),
    "cancel nothing": Cancel([]),
    "query": Query(2**62),
    "adapt, load": Adapt(5, "legal", "/adapters/legal", "base"),
    "adapt, unload": Adapt(6, "legal", None),
}
TO_FRONT_END = {
    "card": Card(bytes(range(256)) * 3, IDLE),
    "results": Results(
        [
            OutputHead(1, 12, 0.001, 0.25, "<f4", [384], None),
            OutputHead(2, 7, 0.0, 1e-9, ">f2", [7, 16], b"\x80\x05timeline"),
            OutputHead(3, 1, 2.5, 3.5, "<i8", [0, 4], b""),
        ],
        [(8, FAILURE), (9, FAILURE)],
        [10, 11],
        BUSY,
    ),
    "results, empty": Results([], [], [], IDLE),
    "snapshot": Snapshot(3, b"\x00snapshot\xff", BUSY),
    "beat": Beat(BUSY),
    "adapted": Adapted(5, None, IDLE),
    "adapted, refused": Adapted(6, FAILURE, BUSY),
    "adapters": Adapters([("legal", "/adapters/legal", None), ("medical", "m", "base")], IDLE),
    "adapters, none": Adapters([], IDLE),
}
TO_CORE_TYPES = {type(m) for m in TO_CORE.values()}
TAGS = {
    Hello: "hello",
    Submit: "submit",
    Cancel: "cancel",
    Query: "query",
    Card: "card",
    Results: "results",
    Snapshot: "snapshot",
    Beat: "beat",
    Adapt: "adapt",
    Adapted: "adapted",
    Adapters: "adapters",
}


# ---- headers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("message", TO_CORE.values(), ids=TO_CORE.keys())
def test_every_message_to_the_core_round_trips(message: msgspec.Struct) -> None:
    header = protocol.encode(message)
    for frame in (header, memoryview(bytearray(header))):  # the stream hands over memoryviews
        decoded = protocol.decode_to_core(frame)
        assert type(decoded) is type(message)
        assert decoded == message


@pytest.mark.parametrize("message", TO_FRONT_END.values(), ids=TO_FRONT_END.keys())
def test_every_message_to_a_front_end_round_trips(message: msgspec.Struct) -> None:
    header = protocol.encode(message)
    for frame in (header, memoryview(bytearray(header))):
        decoded = protocol.decode_to_front_end(frame)
        assert type(decoded) is type(message)
        assert decoded == message


def test_the_examples_cover_every_message_of_the_unions() -> None:
    to_core = {type(m) for m in TO_CORE.values()}
    to_front_end = {type(m) for m in TO_FRONT_END.values()}
    assert to_core == set(protocol.ToCore.__args__)  # type: ignore[attr-defined]
    assert to_front_end == set(protocol.ToFrontEnd.__args__)  # type: ignore[attr-defined]
    assert to_core | to_front_end == set(TAGS)


@pytest.mark.parametrize(
    "message", [*TO_CORE.values(), *TO_FRONT_END.values()], ids=[*TO_CORE, *TO_FRONT_END]
)
def test_a_header_is_an_array_led_by_its_tag(message: msgspec.Struct) -> None:
    """The tagged union on the wire: an array, its tag first, then the fields in order."""
    raw = msgspec.msgpack.decode(protocol.encode(message))
    assert isinstance(raw, list)
    assert raw[0] == TAGS[type(message)]
    assert len(raw) == 1 + len(message.__struct_fields__)


@pytest.mark.parametrize("task", list(PoolingTask), ids=lambda task: task.value)
def test_every_task_travels_in_a_submit(task: PoolingTask) -> None:
    message = Submit([1], [4], PoolingParams(task, normalize=True), 3, [False])
    decoded = protocol.decode_to_core(protocol.encode(message))
    assert isinstance(decoded, Submit)
    assert decoded.params.task is task
    assert decoded.params == message.params


def test_parameters_come_back_as_the_frozen_record_with_tuples() -> None:
    decoded = protocol.decode_to_core(protocol.encode(TO_CORE["submit, every field"]))
    assert isinstance(decoded, Submit)
    params = decoded.params
    assert type(params) is PoolingParams
    assert params.returned_token_ids == (3, 9)
    assert params.token_spans == (((0, 2), (2, 5)), ((1, 3),))
    hash(params)  # frozen and made of tuples: still hashable


def test_floats_and_byte_fields_are_exact() -> None:
    load = Load(1, 2, 0.1 + 0.2, None, False, True)
    head = OutputHead(1, 2, 1 / 3, 2**-1074, "<f4", [1], bytes(range(256)))
    decoded = protocol.decode_to_front_end(protocol.encode(Results([head], [], [], load)))
    assert isinstance(decoded, Results)
    assert decoded.load.throughput_tokens_per_s == 0.1 + 0.2
    assert decoded.outputs[0].queue_time_s == 1 / 3
    assert decoded.outputs[0].inference_time_s == 2**-1074
    assert decoded.outputs[0].timeline == bytes(range(256))


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("message", TO_FRONT_END.values(), ids=TO_FRONT_END.keys())
def test_the_core_refuses_what_only_a_front_end_receives(message: msgspec.Struct) -> None:
    with pytest.raises(msgspec.ValidationError):
        protocol.decode_to_core(protocol.encode(message))


@pytest.mark.parametrize("message", TO_CORE.values(), ids=TO_CORE.keys())
def test_a_front_end_refuses_what_only_the_core_receives(message: msgspec.Struct) -> None:
    with pytest.raises(msgspec.ValidationError):
        protocol.decode_to_front_end(protocol.encode(message))


@pytest.mark.parametrize(
    "message", [*TO_CORE.values(), *TO_FRONT_END.values()], ids=[*TO_CORE, *TO_FRONT_END]
)
def test_a_truncated_header_is_refused(message: msgspec.Struct) -> None:
    header = protocol.encode(message)
    to_core = type(message) in TO_CORE_TYPES
    decode = protocol.decode_to_core if to_core else protocol.decode_to_front_end
    for end in range(len(header)):
        with pytest.raises(msgspec.DecodeError):
            decode(header[:end])


@pytest.mark.parametrize(
    "garbled",
    [
        b"\xc1",  # a byte msgpack never uses
        msgspec.msgpack.encode(["submitted", [1], [1]]),  # an unknown tag
        msgspec.msgpack.encode({"type": "cancel", "ids": [1]}),  # a map, not the array form
        msgspec.msgpack.encode(["cancel", "1"]),  # a field of the wrong type
        msgspec.msgpack.encode(["cancel"]),  # a field missing
        msgspec.msgpack.encode(["query", 1.5]),
        msgspec.msgpack.encode(["submit", [1], [1], {"task": "no such task"}, 0, [False]]),
        msgspec.msgpack.encode([]),
        msgspec.msgpack.encode("hello"),
        protocol.encode(Hello()) + b"\x00",  # trailing bytes after a whole header
    ],
    ids=[
        "reserved byte",
        "unknown tag",
        "map",
        "wrong type",
        "missing field",
        "float token",
        "unknown task",
        "empty array",
        "bare string",
        "trailing bytes",
    ],
)
def test_a_garbled_header_is_refused(garbled: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        protocol.decode_to_core(garbled)


def test_random_bytes_never_decode_as_something_else() -> None:
    """Whatever random bytes decode to, it is a whole message of its direction, or refused."""
    rng = random.Random(0)
    for _ in range(2000):
        garbage = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 24)))
        try:
            message = protocol.decode_to_core(garbage)
        except msgspec.DecodeError:
            continue
        assert type(message) in TO_CORE_TYPES


# ---- token frames ------------------------------------------------------------------------------


def _submit(
    prompts: Sequence[np.ndarray], types: Sequence[np.ndarray | None]
) -> tuple[Submit, list[bytes | memoryview]]:
    lengths, typed, frames = protocol.flat_prompts(prompts, types)
    message = Submit(list(range(len(prompts))), lengths, PoolingParams(PoolingTask.EMBED), 0, typed)
    return message, frames


def _over_the_wire(
    message: Submit, frames: Sequence[bytes | memoryview]
) -> tuple[Submit, list[memoryview]]:
    """The header decoded again and each frame as the stream hands it over: a writable copy."""
    decoded = protocol.decode_to_core(protocol.encode(message))
    assert isinstance(decoded, Submit)
    return decoded, [memoryview(bytearray(memoryview(f).tobytes())) for f in frames]


PROMPTS = {
    "one prompt": [np.array([101, 2023, 102])],
    "several": [np.array([1, 2, 3]), np.array([4]), np.array([5, 6, 7, 8, 9])],
    "int32 input": [np.array([7, 8], dtype=np.int32), np.array([2**31 - 1], dtype=np.int32)],
    "one int32 prompt": [np.array([1, 2, 3], dtype=np.int32)],
    "a strided view": [np.arange(20, dtype=np.int64)[::3]],
    "large ids": [np.array([0, 2**62, 2**63 - 1, -(2**63)])],
    "an empty prompt among others": [np.array([1, 2]), np.array([], dtype=np.int64), np.array([3])],
}


@pytest.mark.parametrize("prompts", PROMPTS.values(), ids=PROMPTS.keys())
def test_token_ids_travel_as_one_flat_int64_frame(prompts: list[np.ndarray]) -> None:
    message, frames = _submit(prompts, [None] * len(prompts))
    assert len(frames) == 1
    want = b"".join(np.asarray(p, dtype="<i8").tobytes() for p in prompts)
    assert memoryview(frames[0]).tobytes() == want
    assert message.lengths == [len(p) for p in prompts]
    assert message.typed == [False] * len(prompts)

    decoded, received = _over_the_wire(message, frames)
    got, types = protocol.split_prompts(decoded, received)
    assert types is None
    assert len(got) == len(prompts)
    flat = np.frombuffer(received[0], dtype=np.int64)
    for want_ids, ids in zip(prompts, got, strict=True):
        assert ids.dtype == np.int64
        np.testing.assert_array_equal(ids, want_ids)
        if len(ids):
            assert np.shares_memory(ids, flat)  # views of the frame, no copies
            assert ids.flags.writeable  # the engine may take them as they come


TYPED = {
    "every prompt typed": [np.array([0, 0, 1]), np.array([1, 1])],
    "some typed": [np.array([0, 1, 1]), None],
    "the last typed": [None, np.array([1, 0])],
}


@pytest.mark.parametrize("types", TYPED.values(), ids=TYPED.keys())
def test_type_ids_travel_in_a_second_frame_for_the_typed_prompts_only(
    types: list[np.ndarray | None],
) -> None:
    prompts = [np.array([101, 7, 102]), np.array([101, 102])]
    message, frames = _submit(prompts, types)
    assert message.typed == [t is not None for t in types]
    assert len(frames) == 2
    want = b"".join(np.asarray(t, dtype="<i8").tobytes() for t in types if t is not None)
    assert memoryview(frames[1]).tobytes() == want

    decoded, received = _over_the_wire(message, frames)
    got, got_types = protocol.split_prompts(decoded, received)
    assert got_types is not None
    for want_ids, ids in zip(prompts, got, strict=True):
        np.testing.assert_array_equal(ids, want_ids)
    for want_types, typed in zip(types, got_types, strict=True):
        if want_types is None:
            assert typed is None
        else:
            assert typed is not None
            assert typed.dtype == np.int64
            np.testing.assert_array_equal(typed, want_types)


def test_a_token_frame_that_does_not_match_the_lengths_is_refused() -> None:
    message, frames = _submit([np.array([1, 2, 3]), np.array([4])], [None, None])
    flat = memoryview(frames[0]).tobytes()
    for wrong in (flat[:-8], flat + flat[:8], b""):
        with pytest.raises(ValueError, match="token frame does not match the prompt lengths"):
            protocol.split_prompts(message, [wrong])


def test_a_token_frame_of_partial_int64s_is_refused() -> None:
    message, frames = _submit([np.array([1, 2, 3])], [None])
    flat = memoryview(frames[0]).tobytes()
    with pytest.raises(ValueError):
        protocol.split_prompts(message, [flat[:-1]])


def test_a_type_frame_that_does_not_match_the_typed_lengths_is_refused() -> None:
    message, frames = _submit([np.array([1, 2, 3])], [np.array([0, 1, 1])])
    types = memoryview(frames[1]).tobytes()
    for wrong in (types[:8], types + types[:8]):
        with pytest.raises(ValueError):
            protocol.split_prompts(message, [frames[0], wrong])


# ---- output frames -----------------------------------------------------------------------------

OUTPUTS = {
    "embedding": np.linspace(-1, 1, 384, dtype=np.float32),
    "token embeddings": np.arange(7 * 16, dtype=np.float32).reshape(7, 16) / 3,
    "float16": np.array([[0.5, -2.0], [65504.0, 1e-4]], dtype=np.float16),
    "big-endian": np.arange(6, dtype=">f4").reshape(3, 2),
    "float64 scalar": np.array(0.1, dtype=np.float64),
    "int64 ids": np.array([[1, 2**40], [3, -4]], dtype=np.int64),
    "nothing to pool": np.zeros((0, 4), dtype=np.float32),
}


def test_pooled_outputs_travel_as_raw_frames_with_dtype_and_shape_in_the_header() -> None:
    """As the core sends them (dtype.str, shape, the contiguous data) and a front end reads them
    (np.frombuffer of the frame in the header's dtype, reshaped): byte-exact, dtype and shape
    kept, with the header through encode -> decode."""
    heads = [
        OutputHead(i, 3, 0.0, 0.0, data.dtype.str, list(data.shape), None)
        for i, data in enumerate(OUTPUTS.values())
    ]
    frames = [memoryview(bytearray(np.ascontiguousarray(d).tobytes())) for d in OUTPUTS.values()]
    decoded = protocol.decode_to_front_end(protocol.encode(Results(heads, [], [], IDLE)))
    assert isinstance(decoded, Results)
    for (name, want), head, frame in zip(OUTPUTS.items(), decoded.outputs, frames, strict=True):
        got = np.frombuffer(frame, dtype=np.dtype(head.dtype)).reshape(head.shape)
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name


# ---- errors ------------------------------------------------------------------------------------


def _travelled(exc: BaseException) -> Exception:
    """The exception after a Results message carried it to a front end."""
    message = Results([], [(1, protocol.wire_error(exc))], [], IDLE)
    decoded = protocol.decode_to_front_end(protocol.encode(message))
    assert isinstance(decoded, Results)
    ((request_id, error),) = decoded.failures
    assert request_id == 1
    return protocol.rebuild_error(error)


@pytest.mark.parametrize(
    "exc",
    [
        OverloadedError(OverloadReason.TOKENS_FULL, 2.5, "4096 tokens queued"),
        InvalidTokenIdError(50000, 30522),
        PromptTooLongError(600, 512, request_id=3),
        StepFailedError("the step failed"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_an_engine_error_comes_back_as_its_own_class(exc: Exception) -> None:
    rebuilt = _travelled(exc)
    assert type(rebuilt) is type(exc)
    assert str(rebuilt) == str(exc)
    assert rebuilt.__dict__ == exc.__dict__


def test_an_error_from_outside_the_project_comes_back_as_a_failed_step() -> None:
    rebuilt = _travelled(RuntimeError("CUDA out of memory"))
    assert type(rebuilt) is StepFailedError
    assert str(rebuilt) == "RuntimeError: CUDA out of memory"


def test_an_attribute_that_cannot_travel_leaves_the_class_and_message() -> None:
    exc = StepFailedError("half done")
    exc.callback = lambda: None  # type: ignore[attr-defined]
    rebuilt = _travelled(exc)
    assert type(rebuilt) is StepFailedError
    assert str(rebuilt) == "half done"
    assert not hasattr(rebuilt, "callback")


@pytest.mark.parametrize(
    ("module", "qualname"),
    [
        ("json", "JSONDecodeError"),  # an exception, but not the project's: never imported
        ("poolserve.types.errors", "NoSuchError"),
        ("poolserve.types.no_such_module", "StepFailedError"),
        ("poolserve.types.params", "PoolingParams"),  # the project's, but not an exception
        ("poolserve.types.errors", "OverloadReason"),
    ],
)
def test_a_class_the_front_end_cannot_rebuild_comes_back_as_a_failed_step(
    module: str, qualname: str
) -> None:
    error = WireError(module, qualname, "the core's message", pickle.dumps({"x": 1}))
    rebuilt = protocol.rebuild_error(error)
    assert type(rebuilt) is StepFailedError
    assert str(rebuilt) == "the core's message"


# ---- through the stream ------------------------------------------------------------------------


def test_a_submit_cut_at_every_byte_boundary_decodes_whole() -> None:
    """A Submit with its token and type frames, framed by wire.py and fed in two pieces cut at
    every byte: the core reads back the same message and the same prompts."""
    prompts = [np.array([101, 2023, 102]), np.array([101, 7, 8, 102])]
    types = [None, np.array([0, 0, 1, 1])]
    message, frames = _submit(prompts, types)
    data = _wire([(protocol.encode(message), frames)])
    for cut in range(len(data) + 1):
        receiver = Receiver()
        receiver.feed(data[:cut], data[cut:])
        ((header, received),) = receiver.views
        decoded = protocol.decode_to_core(header)
        assert decoded == message
        assert isinstance(decoded, Submit)
        got, got_types = protocol.split_prompts(decoded, received)
        assert [g.tolist() for g in got] == [p.tolist() for p in prompts]
        assert got_types is not None
        assert got_types[0] is None
        assert got_types[1] is not None
        assert got_types[1].tolist() == [0, 0, 1, 1]


def test_results_and_their_output_frames_decode_whole_from_one_chunk_with_others() -> None:
    outputs = list(OUTPUTS.values())
    heads = [
        OutputHead(i, 3, 0.5, 0.25, a.dtype.str, list(a.shape), None) for i, a in enumerate(outputs)
    ]
    results = Results(heads, [(99, FAILURE)], [100], BUSY)
    data = _wire(
        [
            (protocol.encode(Beat(IDLE)), []),
            (protocol.encode(results), [np.ascontiguousarray(a).data for a in outputs]),
            (protocol.encode(Snapshot(1, b"snap", IDLE)), []),
        ]
    )
    receiver = Receiver()
    receiver.feed(data)
    decoded = [protocol.decode_to_front_end(header) for header, _ in receiver.views]
    assert decoded == [Beat(IDLE), results, Snapshot(1, b"snap", IDLE)]
    _, frames = receiver.views[1]
    for want, head, frame in zip(outputs, heads, frames, strict=True):
        got = np.frombuffer(frame, dtype=np.dtype(head.dtype)).reshape(head.shape)
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes()


# ---- images ------------------------------------------------------------------------------------
# A naflex model (SigLIP 2): 2x2-pixel patches of 3 channels (12 values), at most 6 per image.
NAFLEX = ImageInputs(
    ImageProcessing(None, None, 2, None, None, None, None, True, Naflex(2, 6)), 6, 8
)
FIXED = ImageInputs(ImageProcessing(None, (4, 4), 2, None, None, None, None, True), 5, 8)


def _images(
    pixels: list[np.ndarray | None], inputs: ImageInputs
) -> tuple[Submit, list[bytes | memoryview]]:
    prompts = [inputs.prompt() if p is not None else np.array([1, 2]) for p in pixels]
    lengths, typed, frames = protocol.flat_prompts(prompts, [None] * len(prompts))
    flags, grids, pixel_frames = protocol.pixel_frame(pixels, inputs)
    message = Submit(list(range(len(prompts))), lengths, PoolingParams(PoolingTask.EMBED), 0, typed)
    message.images, message.grids = flags, grids
    decoded = protocol.decode_to_core(protocol.encode(message))
    assert isinstance(decoded, Submit)
    return decoded, [*frames, *pixel_frames]


def test_naflex_images_of_different_grids_travel_with_their_grids() -> None:
    rng = np.random.default_rng(0)
    pixels = [
        rng.standard_normal((2, 3, 12), dtype=np.float32),
        None,
        rng.standard_normal((1, 1, 12), dtype=np.float32),
        rng.standard_normal((6, 1, 12), dtype=np.float32),
    ]
    message, frames = _images(pixels, NAFLEX)
    assert message.grids == [(2, 3), (1, 1), (6, 1)]
    got = protocol.split_pixels(message, frames, NAFLEX)
    assert got is not None and got[1] is None
    for sent, came in zip(pixels, got, strict=True):
        if sent is not None:
            assert came is not None and np.array_equal(sent, came)
    batched, grids = NAFLEX.batch([p for p in got if p is not None])
    assert batched.shape == (3, 6, 12) and grids == ((2, 3), (1, 1), (6, 1))
    assert not batched[1, 1:].any()  # padding is zeros


@pytest.mark.parametrize(
    ("grids", "said"),
    [
        ([(2, 3)], "grids do not match the images"),
        ([(2, 3), (1, 1), (1, 1)], "grids do not match the images"),
        ([(7, 1), (1, 1)], "7x1 patches"),
        ([(0, 6), (1, 1)], "0x6 patches"),
        ([(2, -3), (1, 1)], "2x-3 patches"),
        ([(2, 2), (1, 1)], "frame does not match the image grids"),
        ([(2**40, 2**40), (1, 1)], "patches"),
    ],
)
def test_naflex_grids_are_checked_before_the_frame_is_cut(
    grids: list[tuple[int, int]], said: str
) -> None:
    pixels: list[np.ndarray | None] = [
        np.zeros((2, 3, 12), np.float32),
        np.ones((1, 1, 12), np.float32),
    ]
    message, frames = _images(pixels, NAFLEX)
    message.grids = grids
    with pytest.raises(ValueError, match=said):
        protocol.split_pixels(message, frames, NAFLEX)


def test_grids_to_a_model_of_one_image_size_or_without_images_are_refused() -> None:
    message, frames = _images([np.zeros((3, 4, 4), np.float32)], FIXED)
    assert message.grids == []
    assert protocol.split_pixels(message, frames, FIXED)[0].shape == (3, 4, 4)  # type: ignore[index]
    message.grids = [(1, 1)]
    with pytest.raises(ValueError, match="one size"):
        protocol.split_pixels(message, frames, FIXED)
    text, text_frames = _images([None], FIXED)
    text.grids = [(1, 1)]
    with pytest.raises(ValueError, match="grids without images"):
        protocol.split_pixels(text, text_frames, FIXED)


def test_pixels_the_model_does_not_take_are_refused() -> None:
    with pytest.raises(ValueError, match="patches of 9 values"):
        NAFLEX.check_pixels(np.zeros((1, 1, 9), np.float32))
    with pytest.raises(ValueError, match="3x3 patches"):
        NAFLEX.check_pixels(np.zeros((3, 3, 12), np.float32))
    with pytest.raises(ValueError, match="float32"):
        NAFLEX.check_pixels(np.zeros((1, 1, 12), np.float64))
    with pytest.raises(ValueError, match="the model takes"):
        FIXED.check_pixels(np.zeros((3, 4, 5), np.float32))


# A vision-language model's images: 2x2 merges of 4-value patches, at most 64 pixels of 1-pixel
# patches (8x8 patches; a 200:1 image's narrow grid may go past, up to 200 x 2 x 2 = 800)
INLINE = InlineImages(
    GridProcessing(1, 1, 2, 4, 64, 3, None, None, None, True, channels=4),
    "<|image_pad|>",
    5,
    3,
)


def _inline(
    media: Sequence[PromptImages | None],
) -> tuple[protocol.Submit, list[bytes | memoryview]]:
    """A Submit of one prompt per entry, carrying the entries' images."""
    prompts = [np.zeros(4, np.int64) for _ in media]
    lengths, typed, frames = protocol.flat_prompts(prompts, [None] * len(prompts))
    fields = protocol.media_frame(media)
    message = protocol.Submit(
        list(range(len(media))),
        lengths,
        PoolingParams(task=PoolingTask.EMBED),
        0,
        typed,
        inline=fields.counts,
        thw=fields.grids,
        digests=fields.digests,
    )
    return message, [*frames, *fields.frames]


def test_inline_images_travel_with_their_grids_and_digests() -> None:
    rng = np.random.default_rng(0)

    def images(*grids: tuple[int, int, int]) -> PromptImages:
        patches = tuple(rng.standard_normal((t * h * w, 4), dtype=np.float32) for t, h, w in grids)
        return PromptImages(
            patches, grids, tuple(image_digest(p, g) for p, g in zip(patches, grids, strict=True))
        )

    media = [images((1, 2, 4), (1, 2, 2)), None, images((1, 4, 2))]
    message, frames = _inline(media)
    assert message.inline == [2, 0, 1] and len(message.digests) == 3
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=protocol.Submit)
    got = protocol.split_media(decoded, frames, INLINE)
    assert got is not None and got[1] is None
    for sent, came in zip(media, got, strict=True):
        if sent is None:
            continue
        assert came is not None and came.grids == sent.grids and came.digests == sent.digests
        assert all(np.array_equal(a, b) for a, b in zip(sent.patches, came.patches, strict=True))
    assert protocol.split_media(*_inline([None]), INLINE) is None


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"inline": [1]}, "counts do not match"),
        ({"thw": [(1, 2, 4), (1, 2, 3)]}, "1x2x3 patches"),
        ({"thw": [(1, 2, 4), (2, 2, 2)]}, "2x2x2 patches"),
        ({"thw": [(1, 2, 4), (1, 40, 40)]}, "1x40x40 patches"),
        ({"thw": [(1, 2, 4), (1, 4, 2)]}, "frame does not match"),
        ({"digests": [b"x"]}, "digests do not match"),
    ],
)
def test_inline_grids_are_checked_before_the_frame_is_cut(
    change: dict[str, object], said: str
) -> None:
    patches = (np.zeros((8, 4), np.float32), np.zeros((4, 4), np.float32))
    message, frames = _inline([PromptImages(patches, ((1, 2, 4), (1, 2, 2)))])
    for key, value in change.items():
        setattr(message, key, value)
    with pytest.raises(ValueError, match=said):
        protocol.split_media(message, frames, INLINE)
    with pytest.raises(ValueError, match="takes none inside its prompts"):
        protocol.split_media(*_inline([PromptImages(patches, ((1, 2, 4), (1, 2, 2)))]), None)
