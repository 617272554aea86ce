"""Experiments with no coordinator: a signed manifest in the DHT.

An experiment is described by a `Manifest`: its name, the task and model
configuration (and, for a custom task, the digest of its code: `task_code`),
the hyperparameters, the averaging strategy, the fingerprint of the initial
state (a pipeline's: one per stage, and the initial one derived from them) and a
format version, signed by the peer that created it (the *host*).
Once published, nobody is special: the host may leave, and any participant
keeps the manifest alive in the DHT.

Where it lives: key ``shoal/experiment/<name>``, one subkey per host (the
host's base58 peer ID), the value being the signed manifest bytes. The subkey
is deliberately *not* an owner-marked DHT subkey: an owner-marked record can
only be refreshed by its owner, and the experiment must outlive its host.
Instead every node refuses, through a validator on the prefix, a record
whose value is not a manifest signed by the peer its subkey names. A forger
can then publish only under its own peer ID, which a joiner who names the
host (``NAME@PEERID``, the form the host prints) never picks, and which makes
a bare ``NAME`` ambiguous rather than hijacked.

An experiment's identity (`Manifest.experiment_id`) is a hash of the signed
manifest: the averaging keys, the peers' status reports and the checkpoint
folder are derived from it, so two experiments with the same name never mix.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from shoal.dht.node import DHTNode
from shoal.dht.records import Record, RecordError, RecordValidator
from shoal.pipeline.options import MAX_STAGES
from shoal.transport.identity import Identity, PeerID

log = logging.getLogger("shoal.experiment")

__all__ = [
    "EXPERIMENT_PREFIX",
    "MANIFEST_FORMAT",
    "MANIFEST_FORMATS",
    "ExperimentRef",
    "Manifest",
    "ManifestError",
    "ManifestNotFound",
    "find_manifest",
    "manifest_key",
    "parse_experiment_ref",
    "publish_manifest",
    "register_manifest_validator",
    "stages_fingerprint",
]

# Format 2 is format 1 plus `task_digest`, written only for a custom task: a shoal
# that reads only format 1 (and would import a custom task's code unchecked)
# refuses it, while built-in experiments stay format 1, joinable by either.
# Format 3 is format 2 plus `stage_fingerprints`, written for a pipeline: its stages are
# built one at a time (`make_stage`), initialized unlike the stages of an older shoal,
# which must not join (it refuses format 3). Other experiments are written as before.
MANIFEST_FORMAT = 3
MANIFEST_FORMATS = (1, 2, 3)
EXPERIMENT_PREFIX = "shoal/experiment/"
MAX_MANIFEST_BYTES = 32 * 1024
_SIGNING_DOMAIN = b"shoal-manifest:"
_STAGES_DOMAIN = b"shoal/stage-fingerprints/v1\x00"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
NAME_RULE = "1-64 characters: letters, digits, '.', '_' or '-', starting with a letter or digit"


class ManifestError(ValueError):
    """A manifest is malformed, forged or of an unsupported format; the message is one line."""


class ManifestNotFound(ManifestError):
    """No peer in the network publishes a valid manifest of the experiment (right now)."""


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ManifestError(f"invalid experiment name {name!r}: {NAME_RULE}")
    return name


def manifest_key(name: str) -> str:
    return EXPERIMENT_PREFIX + check_name(name)


def stages_fingerprint(stage_fingerprints: Sequence[str]) -> str:
    """A pipeline's initial fingerprint, of its stages' (in order): the manifest's
    `initial_fingerprint` of a pipeline, so that it names the whole initial model
    although no peer ever builds the whole of it."""
    h = hashlib.sha256(_STAGES_DOMAIN)
    h.update(len(stage_fingerprints).to_bytes(4, "big"))
    for fingerprint in stage_fingerprints:
        h.update(bytes.fromhex(fingerprint))
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class ExperimentRef:
    """What `--join` names: an experiment name and, optionally, its host's peer ID."""

    name: str
    host: PeerID | None = None

    def __str__(self) -> str:
        return self.name if self.host is None else f"{self.name}@{self.host}"


def parse_experiment_ref(text: str) -> ExperimentRef:
    """``NAME`` or ``NAME@PEERID``; raises ManifestError."""
    name, sep, host = text.strip().partition("@")
    check_name(name)
    if not sep:
        return ExperimentRef(name)
    try:
        return ExperimentRef(name, PeerID.from_base58(host))
    except Exception:
        raise ManifestError(f"invalid host peer ID {host!r} in {text!r}") from None


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str
    task: str  # a built-in task name, "module:factory" or "path/to/file.py:factory"
    task_config: dict[str, Any]
    strategy: str
    strategy_options: dict[str, Any]
    hyperparameters: dict[str, Any]
    seed: int  # model initialization
    initial_fingerprint: str  # of the initial parameters: every joiner must build the same
    host: PeerID
    created: float
    task_digest: str = ""  # a custom task's `task_code.task_digest`; "" for a built-in
    # A pipeline's: each stage's initial parameters (format 3), computed by the host one
    # stage at a time; a peer checks the one stage it builds against its entry.
    stage_fingerprints: tuple[str, ...] = ()
    format: int = 1
    signature: bytes = field(default=b"", compare=False)

    @classmethod
    def create(
        cls,
        identity: Identity,
        *,
        name: str,
        task: str,
        task_config: dict[str, Any],
        strategy: str,
        strategy_options: dict[str, Any],
        hyperparameters: dict[str, Any],
        seed: int,
        initial_fingerprint: str,
        created: float | None = None,
        task_digest: str = "",
        stage_fingerprints: Sequence[str] = (),
    ) -> Manifest:
        version = 3 if stage_fingerprints else 2 if task_digest else 1
        _check_task_digest(task, task_digest, version)
        if stage_fingerprints:
            _check_stage_fingerprints(list(stage_fingerprints), initial_fingerprint)
        unsigned = cls(
            check_name(name),
            task,
            dict(task_config),
            strategy,
            dict(strategy_options),
            dict(hyperparameters),
            int(seed),
            initial_fingerprint,
            identity.peer_id,
            time.time() if created is None else float(created),
            task_digest,
            tuple(stage_fingerprints),
            version,
        )
        signature = identity.sign(unsigned._signing_payload())
        signed = Manifest(*(getattr(unsigned, f) for f in _FIELDS), signature=signature)
        signed.to_bytes()  # fail at creation, not at publication, on an unencodable config
        return signed

    def _body(self) -> dict[str, Any]:
        body = {
            "format": self.format,
            "name": self.name,
            "task": self.task,
            "task_config": self.task_config,
            "strategy": self.strategy,
            "strategy_options": self.strategy_options,
            "hyperparameters": self.hyperparameters,
            "seed": self.seed,
            "initial_fingerprint": self.initial_fingerprint,
            "host": self.host.to_base58(),
            "created": self.created,
        }
        if self.format >= 2:
            body["task_digest"] = self.task_digest
        if self.format >= 3:
            body["stage_fingerprints"] = list(self.stage_fingerprints)
        return body

    def _signing_payload(self) -> bytes:
        try:
            body = msgpack.packb(_canonical(self._body()), use_bin_type=True)
        except (TypeError, ValueError, OverflowError, RecursionError) as e:
            # RecursionError: a configuration nested hundreds deep (from the network).
            raise ManifestError(f"the experiment configuration cannot be encoded: {e}") from None
        return _SIGNING_DOMAIN + body

    def to_bytes(self) -> bytes:
        data = msgpack.packb(
            {"body": _canonical(self._body()), "signature": self.signature}, use_bin_type=True
        )
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"the manifest is {len(data)} bytes, limit {MAX_MANIFEST_BYTES}: "
                "the task and strategy options are too large"
            )
        return data

    @property
    def experiment_id(self) -> str:
        """A short stable identity: two manifests with the same name differ here."""
        return hashlib.sha256(self.to_bytes()).hexdigest()[:16]

    @property
    def namespace(self) -> str:
        """What names the experiment in the DHT (its keys' prefix) and in
        commitments and convictions."""
        return f"shoal/x/{self.experiment_id}"

    @property
    def ref(self) -> ExperimentRef:
        return ExperimentRef(self.name, self.host)

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Decode and verify a manifest from the network; only ManifestError escapes."""
        if not isinstance(data, bytes | bytearray) or len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError("not a manifest (not bytes, or too large)")
        try:
            outer = msgpack.unpackb(
                data, raw=False, strict_map_key=True, max_bin_len=MAX_MANIFEST_BYTES
            )
        except Exception as e:
            raise ManifestError(f"not a manifest: {type(e).__name__}") from None
        if not isinstance(outer, dict) or set(outer) != {"body", "signature"}:
            raise ManifestError("not a manifest: expected a signed body")
        body, signature = outer["body"], outer["signature"]
        if not isinstance(body, dict) or not isinstance(signature, bytes):
            raise ManifestError("not a manifest: malformed body or signature")
        version = body.get("format")
        if version not in MANIFEST_FORMATS or isinstance(version, bool):
            raise ManifestError(
                f"manifest format {version!r} is not supported by this shoal "
                f"(it reads formats 1 to 3); upgrade shoal"
            )
        expected = {
            "format": int,
            "name": str,
            "task": str,
            "task_config": dict,
            "strategy": str,
            "strategy_options": dict,
            "hyperparameters": dict,
            "seed": int,
            "initial_fingerprint": str,
            "host": str,
            "created": float,
        }
        if version >= 2:
            expected["task_digest"] = str
        if version >= 3:
            expected["stage_fingerprints"] = list
        if set(body) != set(expected):
            # (repr: a forged body may have keys of any type, which do not sort together)
            differ = sorted(set(body) ^ set(expected), key=repr)
            raise ManifestError(f"malformed manifest: fields {differ} differ"[:300])
        for key, kind in expected.items():
            value = body[key]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = body[key] = float(value)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ManifestError(f"malformed manifest: {key} is not a {kind.__name__}")
        if not math.isfinite(body["created"]):
            raise ManifestError("malformed manifest: created is not finite")
        try:
            check_name(body["name"])
            _check_task_digest(body["task"], body.get("task_digest", ""), version)
            if version >= 3:
                _check_stage_fingerprints(body["stage_fingerprints"], body["initial_fingerprint"])
            host = PeerID.from_base58(body["host"])
        except ManifestError:
            raise
        except Exception:
            raise ManifestError("malformed manifest: host is not a peer ID") from None
        manifest = cls(
            body["name"],
            body["task"],
            body["task_config"],
            body["strategy"],
            body["strategy_options"],
            body["hyperparameters"],
            body["seed"],
            body["initial_fingerprint"],
            host,
            body["created"],
            body.get("task_digest", ""),
            tuple(body.get("stage_fingerprints", ())),
            body["format"],
            signature,
        )
        if not host.verify(signature, manifest._signing_payload()):
            raise ManifestError(
                f"forged manifest for experiment {body['name']!r}: the signature is not "
                f"{host.short()}'s"
            )
        return manifest

    def describe(self) -> str:
        return (
            f"experiment {self.name!r} (id {self.experiment_id}, host {self.host.short()}, "
            f"task {self.task}, strategy {self.strategy})"
        )


_FIELDS = (
    "name",
    "task",
    "task_config",
    "strategy",
    "strategy_options",
    "hyperparameters",
    "seed",
    "initial_fingerprint",
    "host",
    "created",
    "task_digest",
    "stage_fingerprints",
    "format",
)


_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def _check_task_digest(task: str, digest: str, version: int = 2) -> None:
    """A custom task's digest is 64 hex digits (in format 2); a built-in has none."""
    builtin = ":" not in task
    if builtin and digest:
        raise ManifestError(f"malformed manifest: built-in task {task!r} with a code digest")
    if version >= 2 and not builtin and not _DIGEST_RE.fullmatch(digest):
        raise ManifestError(f"malformed manifest: task {task!r} has no valid code digest")


def _check_stage_fingerprints(stage_fingerprints: list[Any], initial: str) -> None:
    """A pipeline's stage fingerprints: 2 to MAX_STAGES of 64 hex digits, from which its
    initial fingerprint derives."""
    if not 2 <= len(stage_fingerprints) <= MAX_STAGES or not all(
        isinstance(f, str) and _DIGEST_RE.fullmatch(f) for f in stage_fingerprints
    ):
        raise ManifestError(
            f"malformed manifest: stage_fingerprints must be 2 to {MAX_STAGES} fingerprints"
        )
    if initial != stages_fingerprint(stage_fingerprints):
        raise ManifestError(
            "malformed manifest: initial_fingerprint is not its stage_fingerprints' fingerprint"
        )


def _canonical(obj: Any) -> Any:
    """Sorted maps and lists for tuples, so the signed bytes do not depend on dict order."""
    if isinstance(obj, dict):
        return {k: _canonical(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list | tuple):
        return [_canonical(v) for v in obj]
    return obj


def _check_manifest_record(record: Record) -> None:
    """DHT validator: under the prefix, only manifests signed by the peer the subkey names."""
    name = record.key[len(EXPERIMENT_PREFIX) :]
    if record.subkey is None:
        raise RecordError(f"{record.describe()}: an experiment is a dictionary of hosts")
    try:
        host = PeerID.from_base58(record.subkey)
    except Exception:
        raise RecordError(f"{record.describe()}: subkey is not a host peer ID") from None
    try:
        data = msgpack.unpackb(record.value, raw=False)
        manifest = Manifest.from_bytes(data)
    except ManifestError as e:
        raise RecordError(f"{record.describe()}: {e}") from None
    except Exception:
        raise RecordError(f"{record.describe()}: value is not a manifest") from None
    if manifest.host != host or manifest.name != name:
        raise RecordError(f"{record.describe()}: manifest of another host or experiment")


def register_manifest_validator(validator: RecordValidator) -> None:
    """Make a DHT node refuse forged or malformed experiment manifests."""
    validator.register(EXPERIMENT_PREFIX, _check_manifest_record)


# --- publication and discovery ---------------------------------------------------------------

# The DHT's longest TTL; participants refresh the record well before it ends.
MANIFEST_TTL = 24 * 3600.0


async def publish_manifest(dht: DHTNode, manifest: Manifest) -> bool:
    """Store (or refresh) `manifest` in the DHT; any participant may do this, not only the host."""
    return await dht.store(
        manifest_key(manifest.name),
        manifest.to_bytes(),
        time.time() + MANIFEST_TTL,
        subkey=manifest.host.to_base58(),
    )


PROGRESS_EVERY = 5.0  # seconds between the "still looking" lines


async def find_manifest(
    dht: DHTNode, ref: ExperimentRef, *, timeout: float = 20.0, retry_every: float = 1.0
) -> Manifest:
    """The manifest `ref` names, verified. Raises ManifestError with a line for the user.

    Retries until `timeout`: a peer that has just joined may not see a record
    that a peer published a moment ago.
    """
    key = manifest_key(ref.name)
    started = time.monotonic()
    deadline = started + timeout
    next_word = started + PROGRESS_EVERY
    problems: list[str] = []
    while True:
        found = await dht.get(key, latest=True)
        manifests, problems = _valid_manifests(found.value if found is not None else None)
        if ref.host is not None:
            manifests = [m for m in manifests if m.host == ref.host]
        if len(manifests) == 1:
            return manifests[0]
        if len(manifests) > 1:
            names = ", ".join(f"{ref.name}@{m.host}" for m in manifests)
            raise ManifestError(
                f"several peers host an experiment named {ref.name!r}; choose one with "
                f"--join NAME@PEERID: {names}"
            )
        now = time.monotonic()
        if now + retry_every > deadline:
            break
        if now >= next_word:  # said while it waits, not only when it gives up
            log.info(
                "looking for experiment %r in the network (%.0fs of %.0fs, %d peers known)",
                str(ref),
                now - started,
                timeout,
                len(dht.routing_table),
            )
            next_word = now + PROGRESS_EVERY
        await asyncio.sleep(retry_every)
    if problems:
        raise ManifestNotFound(
            f"experiment {str(ref)!r} has no valid manifest in the network ({problems[0]}); "
            "ask its host for the exact --join argument"
        )
    hint = "" if ref.host is None else f" hosted by {ref.host.short()}"
    raise ManifestNotFound(
        f"unknown experiment {str(ref)!r}{hint}: no peer in the network publishes it; "
        f"check the name and the --bootstrap address, or host it with --host-experiment {ref.name}"
    )


def _valid_manifests(value: Any) -> tuple[list[Manifest], list[str]]:
    if not isinstance(value, dict):
        return [], ([] if value is None else ["the record is not a dictionary of hosts"])
    manifests, problems = [], []
    for subkey, data in value.items():
        try:
            manifest = Manifest.from_bytes(data)
        except ManifestError as e:
            problems.append(str(e))
            continue
        if manifest.host.to_base58() != subkey:
            problems.append("a manifest stored under another host's name")
            continue
        manifests.append(manifest)
    return manifests, problems
