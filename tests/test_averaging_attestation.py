"""Verified all-reduce rounds: every contribution travels with its sender's signed
commitment, and the owner of each part checks every chunk it receives against the
commitment's Merkle root. A member that sends anything else, or a commitment its
peers refuse, is vetoed out of the round by name; the others commit without it."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from shoal.averaging.allreduce import AllReduceConfig, AllReduceOutcome, AllReduceService
from shoal.averaging.attestation import ReceivedCommitments, global_chunks
from shoal.averaging.group import Group, Member, make_round_id
from shoal.averaging.partition import Plan
from shoal.transport.host import Host
from shoal.transport.identity import PeerID
from shoal.transport.version import Hello, ProtocolVersion
from shoal.verification.commitment import Commitment, MerkleTree, leaf_hash
from shoal.verification.referees import new_secret, seed_commit

pytestmark = pytest.mark.timeout(60)

# No test here waits for a stall, so the bounds cost nothing: at 1 s a first round of
# 4 fresh hosts on a loaded CI machine (1.8 s against 0.3 s idle) stalled.
FAST = {"heartbeat_interval": 0.05, "stall_timeout": 5.0, "decision_timeout": 5.0}


def h(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class Attestor:
    """Commits to what the round hands it (or, `lying`, to other bytes), and accepts
    commitments of round 7 that started from the same global state."""

    def __init__(self, host: Host, *, start: str = "global", lying: bool = False) -> None:
        self.host = host
        self.start = h(start)
        self.lying = lying

    def commit(self, group: Group, delta_root: bytes, parts: int, weight: float) -> Commitment:
        if self.lying:
            delta_root = MerkleTree([leaf_hash(b"other bytes %d" % i) for i in range(parts)]).root
        return Commitment(
            "exp", self.host.peer_id, 7, self.start, h("optimizer"), 0, 6, 3,
            (h("a"), h("b")), delta_root, parts, b"", seed_commit(new_secret()),
        ).signed(self.host.identity)  # fmt: skip

    def accept(self, group: Group, commitment: Commitment, weight: float) -> str | None:
        if commitment.round != 7:
            return "a commitment for another round"
        if commitment.start != self.start:
            return "work started from another global state"
        return None

    def on_commit(self, group: Group, commitments: Mapping[PeerID, Commitment]) -> None:
        pass  # (called by the Averager, not by the service)

    def round_fields(self, group: Group) -> tuple[str, int]:
        return "exp", 7


@pytest.fixture
async def services(make_host: Callable[..., Any]) -> Any:
    made: list[AllReduceService] = []

    async def make(n: int, **config: Any) -> tuple[list[Host], list[AllReduceService]]:
        hosts = [await make_host(close_grace=0.5) for _ in range(n)]
        cfg = AllReduceConfig(**{**FAST, **config})
        made.extend(AllReduceService(host, cfg) for host in hosts)
        return hosts, made[-n:]

    yield make
    await asyncio.gather(*(s.aclose() for s in made), return_exceptions=True)


def group_of(hosts: list[Host]) -> Group:
    members = tuple(Member(h.peer_id, tuple(h.addresses()), 1.0) for h in hosts)
    return Group(
        "test", make_round_id("test", [m.peer_id for m in members], os.urandom(16)), members
    )


async def run(
    services: list[AllReduceService], attestors: list[Attestor], group: Group, codec: str
) -> tuple[list[AllReduceOutcome], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(5000, generator=g) for _ in services]
    outs = await asyncio.gather(
        *(
            s.run(group, [t], 1.0, codec=codec, attestor=a)
            for s, t, a in zip(services, tensors, attestors, strict=True)
        )
    )
    return list(outs), tensors


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_honest_members_commit_bit_identical_and_learn_every_commitment(
    services: Any, codec: str
) -> None:
    hosts, svcs = await services(4, chunk_bytes=4096, streams_per_peer=2)
    attestors = [Attestor(host) for host in hosts]
    outs, tensors = await run(svcs, attestors, group_of(hosts), codec)
    assert all(o.committed for o in outs), [o.reason for o in outs]
    assert all(torch.equal(t, tensors[0]) for t in tensors)
    everyone = {h.peer_id for h in hosts}
    for o in outs:
        assert set(o.commitments) == everyone
        # The same commitment reached every member (one per prover, several chunks each).
        assert {p: c.digest() for p, c in o.commitments.items()} == {
            p: c.digest() for p, c in outs[0].commitments.items()
        }
        plan = Plan.build(5000, [1.0] * 4, streams=2, chunk_elements=1024)
        assert o.commitments[hosts[0].peer_id].parts == len(global_chunks(plan)) > 4


async def test_a_member_that_sends_other_bytes_than_it_committed_to_is_named_and_left_out(
    services: Any,
) -> None:
    hosts, svcs = await services(4, chunk_bytes=4096)
    attestors = [Attestor(host, lying=i == 2) for i, host in enumerate(hosts)]
    outs, _ = await run(svcs, attestors, group_of(hosts), "none")
    assert not any(o.committed for o in outs)
    honest = [o for i, o in enumerate(outs) if i != 2]
    assert all(o.failed == (hosts[2].peer_id,) for o in honest), [o.failed for o in honest]
    assert any("does not match its commitment" in o.reason for o in honest)
    # The others commit without it.
    outs, _ = await run(svcs[:2] + svcs[3:], attestors[:2] + attestors[3:],
                              group_of(hosts[:2] + hosts[3:]), "none")  # fmt: skip
    assert all(o.committed and len(o.commitments) == 3 for o in outs)


async def test_a_commitment_from_another_start_state_is_refused(services: Any) -> None:
    """Members check that a contribution was computed from the round's global state.
    (Whoever vetoes first is blamed: the odd one out blames an honest member as readily
    as they blame it; matchmaking's state versions keep such a member out before.)"""
    hosts, svcs = await services(4)
    attestors = [
        Attestor(host, start="stale" if i == 0 else "global") for i, host in enumerate(hosts)
    ]
    outs, _ = await run(svcs, attestors, group_of(hosts), "none")
    assert not any(o.committed for o in outs)
    assert all("another global state" in o.reason for o in outs), [o.reason for o in outs]


async def test_a_member_without_an_attestor_cannot_join_a_verified_round(services: Any) -> None:
    hosts, svcs = await services(2)
    g = group_of(hosts)
    outs = await asyncio.gather(
        svcs[0].run(g, [torch.ones(100)], 1.0, attestor=Attestor(hosts[0])),
        svcs[1].run(g, [torch.ones(100)], 1.0),
    )
    assert not any(o.committed for o in outs)
    assert any("plan mismatch" in o.reason for o in outs)


class RecordingAttestor(Attestor):
    """Notes whether its commitment was made on the event loop, and can be held in it."""

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        self.on_loop: list[bool] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.finished = False

    def commit(self, group: Group, delta_root: bytes, parts: int, weight: float) -> Commitment:
        try:
            asyncio.get_running_loop()
            self.on_loop.append(True)
        except RuntimeError:
            self.on_loop.append(False)
        self.entered.set()
        self.release.wait(10)  # (a verifier's seal: seconds at real model sizes)
        commitment = super().commit(group, delta_root, parts, weight)
        self.finished = True
        return commitment


async def test_the_commitment_is_made_off_the_event_loop(services: Any) -> None:
    hosts, svcs = await services(2)
    attestors = [RecordingAttestor(host) for host in hosts]
    outs, _ = await run(svcs, attestors, group_of(hosts), "none")  # type: ignore[arg-type]
    assert all(o.committed for o in outs), [o.reason for o in outs]
    assert [a.on_loop for a in attestors] == [[False], [False]]


async def test_a_cancelled_round_returns_only_once_the_commitment_in_its_thread_is_made(
    services: Any,
) -> None:
    """The attestor reads the model in its thread: a round that returned while it still
    read would let the trainer's next step change the model under it."""
    hosts, svcs = await services(2)
    slow, other = RecordingAttestor(hosts[0]), Attestor(hosts[1])
    slow.release.clear()
    g = group_of(hosts)
    ones = [torch.ones(100), torch.ones(100)]
    rounds = [
        asyncio.create_task(s.run(g, [t], 1.0, attestor=a))
        for s, t, a in zip(svcs, ones, [slow, other], strict=True)
    ]
    finished_when_done: list[bool] = []
    rounds[0].add_done_callback(lambda _: finished_when_done.append(slow.finished))
    assert await asyncio.to_thread(slow.entered.wait, 10)
    rounds[0].cancel()
    done, _ = await asyncio.wait({rounds[0]}, timeout=0.2)
    assert not done  # still waiting for the thread
    slow.release.set()
    await asyncio.gather(*rounds, return_exceptions=True)
    assert finished_when_done == [True]


async def _union_round(
    services: list[AllReduceService], attestors: list[Attestor], group: Group
) -> list[AllReduceOutcome]:
    """An owner-written round (the sparse slots' `union`): member i writes part i."""
    size = 1024
    tensors = []
    for i in range(len(services)):
        t = torch.zeros(size * len(services))
        t[i * size : (i + 1) * size] = torch.randn(size, generator=torch.Generator().manual_seed(i))
        tensors.append(t)
    outs = await asyncio.gather(
        *(
            s.run(group, [t], 1.0, codec="none", attestor=a)
            for s, t, a in zip(services, tensors, attestors, strict=True)
        )
    )
    return list(outs)


async def test_in_an_owner_written_round_a_part_other_than_committed_is_named_and_left_out(
    services: Any,
) -> None:
    """In an owner-written round nobody sends to another's part, so no owner checks
    chunks on arrival: each member checks every other member's part, as it came to
    everyone, against that member's commitment before it votes."""
    hosts, svcs = await services(4, chunk_bytes=1024, reduction="union")
    attestors = [Attestor(host) for host in hosts]
    outs = await _union_round(svcs, attestors, group_of(hosts))
    assert all(o.committed for o in outs), [o.reason for o in outs]
    attestors[1] = Attestor(hosts[1], lying=True)
    outs = await _union_round(svcs, attestors, group_of(hosts))
    assert not any(o.committed for o in outs)
    honest = [o for i, o in enumerate(outs) if i != 1]
    assert all(hosts[1].peer_id in o.failed for o in honest), [o.failed for o in honest]
    assert any("another part than it committed to" in o.reason for o in honest)
    outs = await _union_round([svcs[0], *svcs[2:]], [attestors[0], *attestors[2:]],
                              group_of([hosts[0], *hosts[2:]]))  # fmt: skip
    assert all(o.committed for o in outs), [o.reason for o in outs]


@pytest.mark.parametrize("reduction", ["mean", "union"])
async def test_an_owner_of_2_10_is_sent_whole_headers_and_the_others_compact_ones(
    services: Any, monkeypatch: pytest.MonkeyPatch, reduction: str
) -> None:
    """Protocol 2.11: a lane header to an owner that speaks it leaves out what the round's
    members know (and an owner-written round's proofs); to an older owner it is whole.
    Both kinds of owner check what they get, and the round commits."""
    hosts, svcs = await services(4, chunk_bytes=1024, reduction=reduction)
    old = hosts[3].peer_id
    for host in hosts[:3]:  # (they read an older hello from member 3)
        said = host.versions.peer_version
        monkeypatch.setattr(host.versions, "peer_version", lambda p, said=said: (
            Hello(ProtocolVersion(2, 10)) if p == old else said(p)))  # fmt: skip
    received: dict[PeerID, set[str]] = {h.peer_id: set() for h in hosts}
    attach = ReceivedCommitments.attach

    def recording(self: ReceivedCommitments, sender: int, lane: int, header: Any, w: float) -> Any:
        received[self.group.peer_ids[self.me]].update(k for k in ("c", "k", "m") if k in header)
        return attach(self, sender, lane, header, w)

    monkeypatch.setattr(ReceivedCommitments, "attach", recording)
    attestors = [Attestor(host) for host in hosts]
    if reduction == "union":
        outs = await _union_round(svcs, attestors, group_of(hosts))
    else:
        outs, _ = await run(svcs, attestors, group_of(hosts), "none")
    assert all(o.committed for o in outs), [o.reason for o in outs]
    assert received[old] == {"c", "m"}  # (from the three that know it is older)
    compact = {"k"} if reduction == "union" else {"k", "m"}
    assert all(received[h.peer_id] == compact for h in hosts[:3]), received
