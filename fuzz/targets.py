"""Fuzz targets: every decoder of untrusted input, with the typed errors it documents.

Each target takes the fuzzer's bytes, feeds them to one decoder the way the
network (or a file on disk) would, and lets only that decoder's documented
errors through: anything else escaping is a bug (`run.py` reports it with the
input, and the input goes into `corpus/<target>/` as a regression case).

Decoders that read from a stream are driven through `BytesStream`, which has
the end-of-stream behaviour of `shoal.transport.connection.Stream` (a short
read raises ProtocolViolation) and never blocks, so a coroutine over it runs
to its end in one `send` (`run_now`) without an event loop.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import BytesStream, Target, run_now
from harness import message as _message
from harness import split as _split
from targets_app import APP_TARGETS
from targets_net import NET_TARGETS

from shoal.averaging import commit, state_file
from shoal.averaging.compression import CodecError, Int4BlockCodec, Int8BlockCodec
from shoal.averaging.matchmaking_rules import Declaration, parse_view
from shoal.averaging.sparse_codec import SparseCodec
from shoal.dht import protocol as dht_protocol
from shoal.dht.records import Record, RecordError, RecordValidator
from shoal.dht.storage import LocalStorage
from shoal.peer.experiment import Manifest, ManifestError, parse_experiment_ref
from shoal.peer.status.cli import format_status
from shoal.peer.status.server import parse_status_addr
from shoal.peer.trainer import check_hyperparameters
from shoal.peer.training.checkpoint import CheckpointError, CheckpointStore
from shoal.pipeline import stage_checkpoint
from shoal.transport import tensors
from shoal.transport.errors import HandshakeError, ProtocolViolation
from shoal.transport.identity import Identity, PeerID
from shoal.transport.multiaddr import Multiaddr, MultiaddrError
from shoal.transport.mux import Multiplexer
from shoal.transport.nat import wire
from shoal.transport.noise import NoiseHandshakeXX
from shoal.transport.rpc import MessageStream, RpcLimits
from shoal.verification.commitment import Commitment, CommitmentError
from shoal.verification.evidence import Evidence, EvidenceError, Verdict

__all__ = ["TARGETS", "BytesStream", "Target", "run_now"]


# ---------------------------------------------------------------- transport

_RESPONDER_KEY = bytes(range(32))
_INITIATOR_KEY = bytes(range(1, 33))


def noise_responder(data: bytes) -> None:
    """Messages 1 and 3 of a Noise XX handshake, as a listener receives them."""
    first, third = _split(data, 2)
    hs = NoiseHandshakeXX(False, _RESPONDER_KEY, ephemeral_private=bytes(range(2, 34)))
    hs.read_message(first)
    hs.write_message(b"payload")
    hs.read_message(third)
    if hs.complete:
        hs.split()


def noise_initiator(data: bytes) -> None:
    """Message 2 of a Noise XX handshake, as a dialer receives it."""
    hs = NoiseHandshakeXX(True, _INITIATOR_KEY, ephemeral_private=bytes(range(3, 35)))
    hs.write_message()
    hs.read_message(data)
    hs.write_message(b"payload")


def mux_frames(data: bytes) -> None:
    """Decrypted messages of a connection, through the multiplexer state machine."""
    for initiator in (False, True):
        mux = Multiplexer(initiator)
        now = 0.0
        for message in _split(data, 4):
            mux.receive_message(message, now)
            now += 0.01
            while mux.next_output() is not None:
                pass


_RPC_LIMITS = RpcLimits(max_message=1 << 16, max_tensor=1 << 16)


def rpc_frames(data: bytes) -> None:
    """RPC frames on a stream: messages and tensors, in whatever order they come."""
    stream = MessageStream(BytesStream(data), _RPC_LIMITS)  # type: ignore[arg-type]

    async def read_all() -> None:
        while not stream.stream.at_eof():
            kind = data[0] % 2 if data else 0
            if kind:
                await stream.recv_tensor()
            else:
                await stream.recv()

    run_now(read_all())


def tensor_header(data: bytes) -> None:
    """A tensor frame's header (dtype, shape, sizes) and the buffer it asks for, under
    the transport's limit of bytes and a call's of elements."""
    header = tensors.validate(_message(data), 1 << 16, max_elements=1 << 12)
    t, _ = tensors.allocate(header)
    assert math.prod(t.shape) <= 1 << 12


_NAT_FIELDS: tuple[Callable[[dict[str, Any]], object], ...] = (
    lambda m: wire.get_str(m, "type"),
    lambda m: wire.get_bytes(m, "nonce"),
    lambda m: wire.get_number(m, "ttl"),
    lambda m: wire.get_peer(m, "peer"),
    lambda m: wire.get_addrs(m, "addrs"),
    lambda m: wire.get_str_list(m, "protocols", 16),
)


def nat_messages(data: bytes) -> None:
    """A NAT protocol message (identify, AutoNAT, relay, hole punch): the field readers."""
    ms = wire.messages(BytesStream(data))  # type: ignore[arg-type]

    async def read_all() -> None:
        while not ms.stream.at_eof():
            msg = await wire.recv_map(ms, "fuzz")
            for read in _NAT_FIELDS:
                try:
                    read(msg)
                except ProtocolViolation:
                    pass

    run_now(read_all())


def multiaddr(data: bytes) -> None:
    """Multiaddrs in binary (from peers) and text (from users and records) form."""
    try:
        addr = Multiaddr.from_bytes(data)
    except MultiaddrError:
        pass
    else:
        assert Multiaddr.from_bytes(addr.to_bytes()) == addr
        assert Multiaddr(str(addr)) == addr
    text = data.decode("utf-8", "replace")
    try:
        parsed = Multiaddr(text)
    except MultiaddrError:
        return
    assert Multiaddr(str(parsed)) == parsed


def peer_id(data: bytes) -> None:
    """Peer IDs in binary and base58 form."""
    try:
        pid = PeerID(data)
    except ValueError:
        pass
    else:
        assert PeerID.from_base58(str(pid)) == pid
    PeerID.from_base58(data.decode("utf-8", "replace"))


# ---------------------------------------------------------------- DHT

_LOCAL = Identity.from_seed(b"\x01" * 32).peer_id
_REMOTE = Identity.from_seed(b"\x02" * 32).peer_id
_VALIDATOR = RecordValidator()


def dht_messages(data: bytes) -> None:
    """The fields of DHT requests and responses, as node.py reads them."""
    obj = _message(data)
    msg = obj if isinstance(obj, dict) else {"x": obj}
    for parse in (
        lambda: dht_protocol.parse_ids(msg.get("ids")),
        lambda: dht_protocol.parse_keys(msg.get("keys")),
        lambda: dht_protocol.parse_records(msg.get("records")),
        lambda: dht_protocol.parse_addrs(_REMOTE, msg.get("addrs")),
        lambda: dht_protocol.parse_nearest(msg, 2, 20, local=_LOCAL, responder=_REMOTE),
        lambda: dht_protocol.parse_values(msg, ["a", "b"]),
        lambda: dht_protocol.parse_counts(msg, 2),
        lambda: dht_protocol.parse_stored(msg, 2),
        lambda: dht_protocol.parse_cursors(msg.get("since"), 2, "since"),
        lambda: dht_protocol.parse_tags(msg.get("known"), 2, "known"),
    ):
        try:
            parse()
        except dht_protocol.DHTProtocolError:
            pass


def dht_records(data: bytes) -> None:
    """A record on the wire, then the checks before it is stored, then its storage (and
    merge by subkey) in a node's local storage, read back."""
    record = Record.from_wire(_message(data))
    now = time.time()
    _VALIDATOR.validate(record, now)
    storage = LocalStorage(max_entries=4, max_bytes=1 << 16, validator=_VALIDATOR)
    storage.store(record, now)
    stored = storage.get(record.key, now)
    assert stored is None or all(r.key == record.key for r in stored.records())


# ---------------------------------------------------------------- averaging

_INT8 = Int8BlockCodec()


def allreduce_control(data: bytes) -> None:
    """The commit protocol's control messages (status, ballots) of an all-reduce round."""
    commit.parse_message(_message(data), 8)


def matchmaking_declarations(data: bytes) -> None:
    """Declarations of peers looking for a group, read from a DHT dictionary."""
    obj = _message(data)
    if isinstance(obj, list) and len(obj) == 3:
        try:
            Declaration.from_record(*obj)
        except ValueError:
            pass
    if isinstance(obj, dict):
        parse_view(obj, time.time())


def codec_int8(data: bytes) -> None:
    """int8 block-codec payloads (scales and codes) of a chunk, checked then decoded."""
    import torch

    n = (data[0] if data else 0) * 3
    out = torch.empty(n, dtype=torch.float32)
    _INT8.check(data[1:], n)
    _INT8.decode_checked(data[1:], out)
    assert torch.isfinite(out).all()


_INT4 = (Int4BlockCodec(), Int4BlockCodec(16))


def codec_int4(data: bytes) -> None:
    """int4 block-codec payloads (scales, then codes two to a byte) of a chunk, checked
    then decoded: byte 0's low bit picks the block size, the rest the element count."""
    import torch

    head = data[0] if data else 0
    codec, n = _INT4[head & 1], (head >> 1) * 3
    out = torch.empty(n, dtype=torch.float32)
    codec.check(data[1:], n)
    codec.decode_checked(data[1:], out)
    assert torch.isfinite(out).all()


# One codec per layout branch: packed offsets (top-k and DCT), per-chunk bitmaps, and
# 4096-chunk offsets of 12 bits with 3-bit codes.
SPARSE_CODECS = (
    SparseCodec("topk", 64, 4, 2),
    SparseCodec("dct", 64, 4, 2),
    SparseCodec("topk", 16, 8, 2),
    SparseCodec("topk", 4096, 64, 3),
    SparseCodec("topk", 256, 8, 2),  # Elias-Fano offsets, full chunks and a tail
    SparseCodec("dct", 128, 8, 2),
)


def codec_sparse(data: bytes) -> None:
    """Sparse pseudo-gradient messages (top-k or DCT; offsets as fields, Elias-Fano or
    bitmaps), checked then
    decoded: byte 0 picks the codec, byte 1 the element count."""
    import torch

    if len(data) < 2:
        return
    codec = SPARSE_CODECS[data[0] % len(SPARSE_CODECS)]
    n = data[1] * 5
    message = codec.check(data[2:], n)
    out = torch.zeros(n, dtype=torch.float32)
    codec.add_decoded(message, out, 1.0)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------- peer


def manifest(data: bytes) -> None:
    """A signed experiment manifest (from the DHT), its hyperparameters (the inner
    optimizer included) and an experiment reference."""
    try:
        m = Manifest.from_bytes(data)
    except ManifestError:
        pass
    else:
        assert Manifest.from_bytes(m.to_bytes()) == m
        with contextlib.suppress(ValueError):
            check_hyperparameters(m.hyperparameters)
    parse_experiment_ref(data.decode("utf-8", "replace"))


def checkpoint(data: bytes) -> None:
    """A checkpoint file on disk (damaged, truncated or forged)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = CheckpointStore(Path(tmp))
        store.latest.write_bytes(data)
        state = store.load()
    if state is not None:  # (as a pipeline stage checkpoint: peer/pipelined/checkpoints.py)
        why = stage_checkpoint.problem(state, experiment="exp", stages=2, like=[torch.zeros(3)])
        assert why is None or isinstance(why, str)
        assert all(v < 8 for v in stage_checkpoint.step_sizes(state, 8))
        assert all(r.version < 8 for r in stage_checkpoint.step_log(state, 8))


def work_log_state(data: bytes) -> None:
    """A state file of the work log on disk (damaged, truncated or rewritten), read back
    as a reveal reads it: a tree of tensors, each within the file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state"
        path.write_bytes(data)
        tree = state_file.read_tree(path)
    stack = [tree]
    while stack:  # (every tensor readable: its bytes are the file's)
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            node.sum()
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)


def status_inputs(data: bytes) -> None:
    """What the status tools read: --status-addr, and another peer's /status and /peers."""
    try:
        parse_status_addr(data.decode("utf-8", "replace"))
    except ValueError:
        pass
    obj = _message(data)
    status = obj if isinstance(obj, dict) else {"peer_id": obj}
    peers = obj if isinstance(obj, list) else [status]
    format_status(status, [p if isinstance(p, dict) else {"x": p} for p in peers], "http://x")


def verification_evidence(data: bytes) -> None:
    """A conviction from the DHT (then its offline check), a commitment, a verdict."""
    try:
        Evidence.decode(data).check()
    except EvidenceError:
        pass
    try:
        c = Commitment.decode(data)
    except CommitmentError:
        pass
    else:
        assert Commitment.decode(c.encode()) == c
        again = Commitment.decode_known(c.encode_known(), c.experiment, c.prover, c.round)
        assert again.digest() == c.digest()
    try:  # (a lane header's compact form, protocol 2.11)
        Commitment.decode_known(data, "exp", _REMOTE, 3)  # (the seeds' prover)
    except CommitmentError:
        pass
    Verdict.from_wire(_message(data))


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("noise_responder", noise_responder, (HandshakeError,), noise_responder.__doc__),
        Target("noise_initiator", noise_initiator, (HandshakeError,), noise_initiator.__doc__),
        Target("mux_frames", mux_frames, (ProtocolViolation,), mux_frames.__doc__),
        Target("rpc_frames", rpc_frames, (ProtocolViolation,), rpc_frames.__doc__),
        Target("tensor_header", tensor_header, (tensors.TensorHeaderError,), tensor_header.__doc__),
        Target("nat_messages", nat_messages, (ProtocolViolation,), nat_messages.__doc__),
        Target("multiaddr", multiaddr, (), multiaddr.__doc__),
        Target("peer_id", peer_id, (ValueError,), peer_id.__doc__),
        Target("dht_messages", dht_messages, (), dht_messages.__doc__),
        Target("dht_records", dht_records, (RecordError,), dht_records.__doc__),
        Target(
            "allreduce_control",
            allreduce_control,
            (commit.ControlError,),
            allreduce_control.__doc__,
        ),
        Target(
            "matchmaking_declarations",
            matchmaking_declarations,
            (),
            matchmaking_declarations.__doc__,
        ),
        Target("codec_int8", codec_int8, (CodecError,), codec_int8.__doc__),
        Target("codec_int4", codec_int4, (CodecError,), codec_int4.__doc__),
        Target("codec_sparse", codec_sparse, (CodecError,), codec_sparse.__doc__),
        Target("manifest", manifest, (ManifestError,), manifest.__doc__),
        Target("checkpoint", checkpoint, (CheckpointError,), checkpoint.__doc__),
        Target(
            "work_log_state",
            work_log_state,
            (state_file.StateFileError,),
            work_log_state.__doc__,
        ),
        Target("status_inputs", status_inputs, (), status_inputs.__doc__),
        Target(
            "verification_evidence",
            verification_evidence,
            (EvidenceError,),
            verification_evidence.__doc__,
        ),
        *NET_TARGETS,
        *APP_TARGETS,
    )
}
