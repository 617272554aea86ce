"""State sync: download the newest state from its holders, verified, resumable."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.averaging.deadline import Deadline
from shoal.averaging.state_sync import (
    MovedOn,
    NoHolders,
    State,
    StateServer,
    StateSyncError,
    downloads_in,
    find_holders,
    load_state_from_peers,
    load_version_from_peers,
    make_state,
)
from shoal.dht.node import DHTNode
from shoal.dht.records import owner_marker
from shoal.transport.multiaddr import Multiaddr

HOST_OPTS = {"max_connections_per_ip": 100_000, "close_grace": 0.1}
KEY = "exp/params"


def sample_state(seed: int, step: int, version: str | None = None) -> State:
    g = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(300, 257, generator=g),
        torch.randn(1000, generator=g).to(torch.bfloat16),
        torch.arange(10, dtype=torch.int64),
        torch.empty(0),
    ]
    metadata: dict[str, Any] = {"step": step, "lr": 0.1}
    if version is not None:
        metadata["version"] = version
    return make_state(tensors, metadata)


@pytest.fixture
async def dhts(make_host: Callable[..., Any]) -> AsyncIterator[Callable[..., Any]]:
    nodes: list[DHTNode] = []

    async def make(n: int) -> list[DHTNode]:
        out = []
        for _ in range(n):
            host = await make_host(**HOST_OPTS)
            boot = [str(nodes[0].host.addresses()[0])] if nodes else []
            node = await DHTNode.create(host, bootstrap=boot, hop_timeout=1.0)
            nodes.append(node)
            out.append(node)
        return out

    yield make
    await asyncio.gather(*(n.aclose() for n in nodes), return_exceptions=True)


def assert_same(a: State, b: State) -> None:
    assert a.fingerprint == b.fingerprint
    assert dict(a.metadata) == dict(b.metadata)
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)


async def test_a_newcomer_downloads_the_newest_state_and_verifies_it(
    dhts: Callable[..., Any],
) -> None:
    old, new = sample_state(1, step=5), sample_state(2, step=9)
    a, b, c, loader = await dhts(4)
    servers = [StateServer(a, KEY, lambda: old), StateServer(b, KEY, lambda: new),
               StateServer(c, KEY, lambda: new)]  # fmt: skip
    for s in servers:
        assert await s.announce()
    holders = await find_holders(loader, KEY)
    assert [h.step for h in holders] == [9, 9, 5]
    got = await load_state_from_peers(loader, KEY)
    assert_same(got, new)


async def test_a_download_inside_downloads_in_lands_in_a_file_of_that_folder(
    dhts: Callable[..., Any], tmp_path: Path
) -> None:
    """A re-sync's downloaded tensors live in a shared mapping of an unlinked file of the
    folder (the kernel may write their pages back and drop them), bit for bit; a
    folder that cannot take them (here: a file in its place) leaves them in memory."""
    new = sample_state(2, step=9)
    a, loader = await dhts(2)
    assert await StateServer(a, KEY, lambda: new).announce()
    folder = tmp_path / "downloads"
    with downloads_in(folder):
        got = await load_state_from_peers(loader, KEY, chunk_bytes=64 * 1024)
    assert_same(got, new)
    assert list(folder.iterdir()) == []
    assert [m.endswith(".download (deleted)") for m in mapped_files(folder)] == [True]
    del got
    assert mapped_files(folder) == []

    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    with downloads_in(blocked):
        again = await load_state_from_peers(loader, KEY, chunk_bytes=64 * 1024)
    assert_same(again, new)


async def test_the_state_of_most_work_is_downloaded_first_and_keeps_its_work(
    dhts: Callable[..., Any],
) -> None:
    """A peer that stepped alone holds more commits (steps) than the swarm but less
    work (lineage.py): a newcomer loads the swarm's state, with its work. A holder of
    an older release says no work: its steps count as its work."""
    lone = dataclasses.replace(sample_state(1, step=14), work=20)
    swarm = dataclasses.replace(sample_state(2, step=10), work=31)
    older = sample_state(3, step=12)
    a, b, c, loader = await dhts(4)
    servers = [StateServer(a, KEY, lambda: lone), StateServer(b, KEY, lambda: swarm),
               StateServer(c, KEY, lambda: older)]  # fmt: skip
    for s in servers:
        assert await s.announce()
    holders = await find_holders(loader, KEY)
    assert [(h.step, h.work, h.rank) for h in holders] == [(10, 31, 31), (14, 20, 20),
                                                           (12, None, 12)]  # fmt: skip
    got = await load_state_from_peers(loader, KEY)
    assert_same(got, swarm)
    assert got.work == 31


async def test_download_resumes_from_another_holder_when_the_source_dies(
    dhts: Callable[..., Any],
) -> None:
    state = sample_state(3, step=1)
    a, b, loader = await dhts(3)
    total = sum(t.numel() * t.element_size() for t in state.tensors)
    chunk = 64 * 1024
    # Whichever source serves first dies after its second chunk.
    original = StateServer._on_fetch
    served_requests: dict[int, int] = {}

    async def dying_fetch(self: StateServer, ctx: Any, payload: Any) -> Any:
        n = served_requests[id(self)] = served_requests.get(id(self), 0) + 1
        if n > 2 and not served_requests.get(-1):
            served_requests[-1] = id(self)
            await self.dht.host.aclose()
            raise ConnectionError("killed")
        async for item in original(self, ctx, payload):
            yield item

    StateServer._on_fetch = dying_fetch  # type: ignore[method-assign]
    try:
        # Handlers are bound when a server is made: patch first.
        sa, sb = StateServer(a, KEY, lambda: state), StateServer(b, KEY, lambda: state)
        await sa.announce()
        await sb.announce()
        got = await load_state_from_peers(loader, KEY, chunk_bytes=chunk, request_timeout=5)
    finally:
        StateServer._on_fetch = original  # type: ignore[method-assign]
    assert_same(got, state)
    assert served_requests.get(-1), "the first source never died"
    # Resumed, not restarted: together they served the state about once.
    assert sa.served_bytes + sb.served_bytes < total + 2 * chunk


async def test_a_source_serving_corrupt_bytes_is_dropped_for_an_honest_one(
    dhts: Callable[..., Any],
) -> None:
    state = sample_state(4, step=3)
    a, b, loader = await dhts(3)
    liar, honest = StateServer(a, KEY, lambda: state), StateServer(b, KEY, lambda: state)
    await liar.announce()
    await honest.announce()
    snap = liar._snapshot(None)
    snap.views[0][100] ^= 0xFF  # its copy rots after the fingerprint was taken
    got = await load_state_from_peers(loader, KEY, request_timeout=5)
    assert_same(got, state)


async def test_the_state_may_change_during_a_download(dhts: Callable[..., Any]) -> None:
    live = [sample_state(5, step=1)]
    a, loader = await dhts(2)
    original = StateServer._on_fetch
    first = live[0]

    async def moving_fetch(self: StateServer, ctx: Any, payload: Any) -> Any:
        async for item in original(self, ctx, payload):
            live[0] = sample_state(6, step=2)  # the swarm commits a new round meanwhile
            yield item

    StateServer._on_fetch = moving_fetch  # type: ignore[method-assign]
    try:
        server = StateServer(a, KEY, lambda: live[0])
        await server.announce()
        got = await load_state_from_peers(loader, KEY, chunk_bytes=64 * 1024)
    finally:
        StateServer._on_fetch = original  # type: ignore[method-assign]
    assert live[0] is not first, "the state never changed"
    assert_same(got, first)


def mapped_files(folder: Path) -> list[str]:
    """Files of `folder` this process maps (deleted ones too: /proc/self/maps)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return sorted({line.split(maxsplit=5)[5] for line in lines
                   if len(line.split(maxsplit=5)) == 6 and str(folder) in line})  # fmt: skip


@pytest.mark.parametrize("copies", ["in memory", "in a folder"])
async def test_a_live_server_copies_its_owner_s_tensors_only_for_a_download_a_change_overlaps(
    dhts: Callable[..., Any], tmp_path: Path, copies: str
) -> None:
    """A live server holds no copy of a state nobody reads; when its owner is about
    to change the tensors mid-download, the download finishes on a copy of the
    state it began (bit for bit), and the next one gets the changed state. With a
    folder for copies the copy is a file of it, mapped and already unlinked: no
    memory of the process's own, and nothing left in the folder."""
    folder = tmp_path / "copies" if copies == "in a folder" else None
    first = sample_state(5, step=1)
    tensors = [t.clone() for t in first.tensors]
    live = [make_state(tensors, first.metadata)]
    a, loader = await dhts(2)
    original = StateServer._on_fetch
    changed: list[State | None] = []

    async def changing_fetch(self: StateServer, ctx: Any, payload: Any) -> Any:
        async for item in original(self, ctx, payload):
            if not changed:  # the owner commits while the first chunks go out
                changed.append(await self.before_change())
                with torch.no_grad():
                    tensors[0].add_(1.0)
                live[0] = make_state(tensors, {"step": 2, "lr": 0.1})
            yield item

    StateServer._on_fetch = changing_fetch  # type: ignore[method-assign]
    try:
        server = StateServer(a, KEY, lambda: live[0], live=True, copies_dir=folder)
        served = server._snapshot(None).state.tensors
        assert all(x.data_ptr() == y.data_ptr() for x, y in zip(served, tensors, strict=True))
        await server.announce()
        got = await load_state_from_peers(loader, KEY, chunk_bytes=64 * 1024)
    finally:
        StateServer._on_fetch = original  # type: ignore[method-assign]
    assert changed and changed[0] is not None and changed[0].fingerprint == first.fingerprint
    assert_same(got, first)
    if folder is not None:
        assert list(folder.iterdir()) == []
        assert [m.endswith(".state (deleted)") for m in mapped_files(folder)] == [True]
        assert_same(changed[0], first)  # (the copy, read from its file)

    await server.announce()
    again = await load_state_from_peers(loader, KEY, chunk_bytes=64 * 1024)
    assert_same(again, live[0])
    assert torch.equal(again.tensors[0], first.tensors[0] + 1.0)


async def test_a_live_state_nobody_read_lately_is_dropped_not_copied_when_it_changes(
    dhts: Callable[..., Any],
) -> None:
    (a,) = await dhts(1)
    state = sample_state(5, step=1)
    server = StateServer(a, KEY, lambda: state, live=True)
    snap = server._snapshot(None)
    snap.last_used -= 60.0  # (read a minute ago: its download is over)
    assert await server.before_change() is None
    assert server._snapshots == {}


async def test_a_holder_that_stepped_since_it_announced_serves_its_state_now(
    dhts: Callable[..., Any],
) -> None:
    """Announcements lag a stage that steps faster than the DHT is read: the
    loader takes what the holder holds when asked (a newer step), instead of
    failing it for having moved on and finding nobody else."""
    live = [sample_state(7, step=1)]
    a, loader = await dhts(2)
    server = StateServer(a, KEY, lambda: live[0])
    assert await server.announce()
    live[0] = sample_state(8, step=2)  # stepped; its announcement still says step 1
    assert [h.step for h in await find_holders(loader, KEY)] == [1]
    got = await load_state_from_peers(loader, KEY, timeout=20)
    assert_same(got, live[0])


async def test_a_holder_behind_the_newest_announcement_is_no_source_of_it(
    dhts: Callable[..., Any],
) -> None:
    """A holder whose state went back under the newest announced step is not
    the newest state: the loader takes it from the holder that has it."""
    old, new = [sample_state(1, step=9)], sample_state(2, step=9)
    a, b, loader = await dhts(3)
    behind = StateServer(a, KEY, lambda: old[0])
    assert await behind.announce()
    assert await StateServer(b, KEY, lambda: new).announce()
    old[0] = sample_state(3, step=4)  # a re-sync took it back; it still announces 9
    got = await load_state_from_peers(loader, KEY, timeout=20)
    assert_same(got, new)


async def test_a_holder_alone_behind_its_announcement_serves_what_it_holds(
    dhts: Callable[..., Any],
) -> None:
    """The only holder went back under the step it announced: its state is the
    newest there is, and the loader takes it instead of waiting for the
    announcement to expire."""
    live = [sample_state(1, step=9)]
    a, loader = await dhts(2)
    assert await StateServer(a, KEY, lambda: live[0]).announce()
    live[0] = sample_state(3, step=4)
    got = await load_state_from_peers(loader, KEY, timeout=20)
    assert_same(got, live[0])


async def test_a_download_whose_snapshot_is_dropped_starts_over_on_the_holder_s_state_now(
    dhts: Callable[..., Any],
) -> None:
    """A holder keeps a few snapshots; when the one being fetched is dropped
    (the holder stepped and others asked for newer ones), the source is not at
    fault: the loader looks again and downloads the state the holder has now."""
    live = [sample_state(5, step=1)]
    a, loader = await dhts(2)
    original = StateServer._on_fetch
    dropped: list[bool] = []

    async def forgetting_fetch(self: StateServer, ctx: Any, payload: Any) -> Any:
        if payload["offset"] > 0 and not dropped:
            dropped.append(True)
            live[0] = sample_state(6, step=2)
            self._snapshots.clear()
        async for item in original(self, ctx, payload):
            yield item

    StateServer._on_fetch = forgetting_fetch  # type: ignore[method-assign]
    try:
        server = StateServer(a, KEY, lambda: live[0])
        await server.announce()
        got = await load_state_from_peers(loader, KEY, chunk_bytes=64 * 1024, timeout=20)
    finally:
        StateServer._on_fetch = original  # type: ignore[method-assign]
    assert dropped, "the snapshot was never dropped"
    assert_same(got, live[0])


async def test_no_holder_is_its_own_error(dhts: Callable[..., Any]) -> None:
    # A peer alone is not a failure: callers tell it apart by type, not by message.
    (loader,) = await dhts(1)
    with pytest.raises(NoHolders, match="nobody announced"):
        await load_state_from_peers(loader, KEY, timeout=5)


async def test_a_re_sync_downloads_the_version_it_was_told_not_the_most_announced(
    dhts: Callable[..., Any],
) -> None:
    """Two groups committed step 9, ours (announced by more peers) and theirs,
    which the swarm holds now: the newest state in the DHT is ours, and only a
    download by version gets theirs. Without a reachable holder of a version,
    the download fails (naming it) instead of handing back another state."""
    ours, theirs = sample_state(4, 9, "aa" * 16), sample_state(5, 9, "bb" * 16)
    a, b, c, loader = await dhts(4)
    for node, state in ((a, ours), (b, ours), (c, theirs)):
        assert await StateServer(node, KEY, lambda s=state: s).announce()
    assert (await load_state_from_peers(loader, KEY)).fingerprint == ours.fingerprint
    assert [h.version for h in await find_holders(loader, KEY)].count("bb" * 16) == 1

    got = await load_version_from_peers(loader, KEY, "bb" * 16, deadline=Deadline.after(20))
    assert_same(got, theirs)
    # Named sources first, with their addresses: a peer the DHT does not list.
    d = (await dhts(1))[0]
    StateServer(d, KEY, lambda: theirs)  # serves, never announces
    got = await load_version_from_peers(
        loader, KEY, "bb" * 16, sources=[(d.peer_id, d.host.addresses())],
        deadline=Deadline.after(20),
    )  # fmt: skip
    assert_same(got, theirs)
    with pytest.raises(StateSyncError, match="version cccccccccccc"):
        await load_version_from_peers(loader, KEY, "cc" * 16, deadline=Deadline.after(20))


async def test_a_version_whose_holders_moved_on_is_its_own_error(dhts: Callable[..., Any]) -> None:
    """No holder serves the version asked for, and one that answered holds another
    now: `MovedOn` (a newer version is worth looking up), even when the other
    holders could not be dialed. Unreachable holders alone are a plain failure."""
    moved, gone, loader = await dhts(3)
    for node, state in ((moved, sample_state(4, 9, "bb" * 16)), (gone, sample_state(4, 8))):
        assert await StateServer(node, KEY, lambda s=state: s).announce()
    await gone.host.aclose()  # (its record lives on)
    with pytest.raises(MovedOn, match="another version now"):
        await load_version_from_peers(
            loader, KEY, "aa" * 16, sources=[(gone.peer_id, ()), (moved.peer_id, ())],
            deadline=Deadline.after(20),
        )  # fmt: skip
    with pytest.raises(StateSyncError) as refused:
        await load_version_from_peers(
            loader, KEY, "aa" * 16, sources=[(gone.peer_id, ())], deadline=Deadline.after(20)
        )
    assert not isinstance(refused.value, MovedOn)


def bare(node: DHTNode) -> tuple[Multiaddr, ...]:
    """`node`'s addresses without their /p2p/ID: as a record carries them."""
    return tuple(Multiaddr(str(a).split("/p2p/")[0]) for a in node.host.addresses())


async def _client_holder(
    make_host: Callable[..., Any], boot: DHTNode, state: State
) -> tuple[DHTNode, StateServer]:
    """A holder that is a DHT client (a peer behind a NAT): nobody looks anything up
    through it, so a loader that reads the DHT is connected to it only if it dials."""
    host = await make_host(**HOST_OPTS)
    node = await DHTNode.create(
        host, bootstrap=[str(boot.host.addresses()[0])], hop_timeout=1.0, serves=lambda: False
    )
    server = StateServer(node, KEY, lambda: state)
    assert await server.announce()
    return node, server


async def test_a_holder_nobody_is_connected_to_is_dialed_at_the_addresses_it_announced(
    dhts: Callable[..., Any], make_host: Callable[..., Any]
) -> None:
    """Found in the soak: a peer that joined (or came back from a partition) held no
    connection to the holders it read from the DHT, and a peer ID alone cannot be
    dialed ("no address known"). Holders announce where they are reached."""
    state = sample_state(6, 9, "dd" * 16)
    (boot,) = await dhts(1)
    holder, _ = await _client_holder(make_host, boot, state)
    (loader,) = await dhts(1)  # (after the announcement: the holder never stored to it)
    try:
        (found,) = await find_holders(loader, KEY)
        assert found.addrs == bare(holder)
        assert loader.host.connection(holder.peer_id) is None
        assert_same(await load_state_from_peers(loader, KEY, timeout=20), state)
        await loader.host.disconnect(holder.peer_id)
        got = await load_version_from_peers(loader, KEY, "dd" * 16, deadline=Deadline.after(20))
        assert_same(got, state)
    finally:
        await holder.aclose()


async def test_announced_addresses_are_claims_a_handshake_checks(
    dhts: Callable[..., Any], make_host: Callable[..., Any]
) -> None:
    """A record's addresses are bounded and parsed (junk dropped), and one that points
    at another peer costs a failed dial: the download goes on from the next holder."""
    state = sample_state(7, 9)
    boot, liar = await dhts(2)
    holder, _ = await _client_holder(make_host, boot, state)
    (loader,) = await dhts(1)
    try:
        record = {"fp": state.fingerprint, "step": 9,
                  "addrs": ["junk", 5, "/ip4/127.0.0.1/tcp/0", *map(str, bare(boot)),
                            *["/ip4/127.0.0.1/tcp/9"] * 1000]}  # fmt: skip
        assert await liar.store(f"{KEY}/state", record, time.time() + 60,
                                subkey=owner_marker(liar.peer_id))  # fmt: skip
        by_peer = {h.peer_id: h for h in await find_holders(loader, KEY)}
        assert by_peer[liar.peer_id].addrs == (*bare(boot), Multiaddr("/ip4/127.0.0.1/tcp/9"))
        await liar.aclose()  # (its own address would answer for it: only the lie is left)
        assert_same(await load_state_from_peers(loader, KEY, timeout=20), state)
    finally:
        await holder.aclose()
