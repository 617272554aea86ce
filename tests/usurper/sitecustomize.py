"""Tampered code for the provenance daemon test (on the PYTHONPATH of one daemon only):
a peer that tries to take the swarm over with a state of its own (issue 39 part 1).

In every mode it never averages (each round of its shared state commits alone, so
the state is its own), trains by gradient ascent (its reported loss is the true
one: it rises), and declares an enormous lineage work in every declaration,
state announcement and checkpoint, declaring itself looking (only looking peers'
versions sway a re-sync). `SHOAL_USURPER` picks what it adds:

- ``boast``: nothing more (what took the swarm over before certificates);
- ``forge``: its ``chain`` answers certificates of its commits alone rewritten to
  list the honest members of a real round it holds, carrying its own signature
  and the honest members' signatures copied from that round;
- ``copy``: before each commit it fetches the chain of the version the honest
  peers hold, and announces and serves its own bytes under that version (the
  honest certificates copied onto another state).

It writes `usurper.jsonl` in its data directory: one line per commit alone, with
the fingerprint it serves, so the test knows its states whatever it announces,
and one per attack made (a forged chain served, an honest version taken, a state
download served under it).
"""

import json
import os
import time

from shoal.averaging import averager as _averager
from shoal.peer.training import inner

MODE = os.environ.get("SHOAL_USURPER", "boast")
BOAST = 10**15
_JOURNAL = os.path.join(os.environ.get("HOME", "."), ".shoal", "usurper.jsonl")

# ---------------------------------------------------------------- gradient ascent

_honest_step = inner.InnerOptimizer.step


def _ascent(self, loss_of, step_index):  # type: ignore[no-untyped-def]
    return -_honest_step(self, lambda: -loss_of(), step_index)


inner.InnerOptimizer.step = _ascent  # type: ignore[method-assign]

# ---------------------------------------------------------------- the boast

Averager = _averager.Averager


def _get_work(self):  # type: ignore[no-untyped-def]
    if getattr(self, "config", None) is not None and self.config.shared_state:
        return BOAST
    return self.__dict__.get("_honest_work", 0)


def _set_work(self, value):  # type: ignore[no-untyped-def]
    self.__dict__["_honest_work"] = value


Averager.work = property(_get_work, _set_work)  # type: ignore[assignment]

_honest_presence = Averager.announce_presence


async def _looking(self, timeout=2.0):  # type: ignore[no-untyped-def]
    """Declared looking, not busy: only looking peers' versions sway a re-sync."""
    if not self.config.shared_state:
        return await _honest_presence(self, timeout)
    from shoal.averaging.matchmaking_rules import PeerState

    self.presence.renewed()
    declarer = self._matchmaker.declarer
    return await declarer.declare(PeerState.LOOKING, self.state_version, timeout=timeout,
                                  work=self.work)  # fmt: skip


Averager.announce_presence = _looking  # type: ignore[method-assign]

# ---------------------------------------------------------------- never averaging

_honest_averager_step = Averager.step


async def _step_alone(self, weight=1.0, *, timeout=None, alone=True):  # type: ignore[no-untyped-def]
    if not self.config.shared_state:
        return await _honest_averager_step(self, weight, timeout=timeout, alone=alone)
    if MODE == "copy":
        await _usurp_honest_version(self)
    elif MODE == "forge" and not _DONORS:
        await _take_donor_round(self)
    self._runner.log.clear()
    result = await self._runner._commit_alone(time.monotonic(), 1, max(weight, 1.0))
    _journal(fp=self.last_fingerprint)
    return result


def _journal(**event):  # type: ignore[no-untyped-def]
    with open(_JOURNAL, "a") as f:
        f.write(json.dumps({"mode": MODE, **event}) + "\n")


Averager.step = _step_alone  # type: ignore[method-assign]

# ---------------------------------------------------------------- copy

_honest_metadata = Averager.metadata


def _metadata(self):  # type: ignore[no-untyped-def]
    meta = _honest_metadata(self)
    usurped = getattr(self, "_usurped", None)
    if usurped is not None:  # another version's name on our bytes
        commits = int.from_bytes(usurped[:8], "big")
        meta.update(version=usurped.hex(), commits=commits, step=commits)
    return meta


async def _most_announced(self):  # type: ignore[no-untyped-def]
    """The version most other peers announce and who announces it, or None."""
    from shoal.averaging.state_sync import find_holders

    if self.certifier is None:
        return None
    try:
        holders = await find_holders(self.dht, self.key)
    except Exception:
        return None
    by_version: dict[str, list] = {}
    for h in holders:
        if h.version and len(h.version) == 32:
            by_version.setdefault(h.version, []).append(h.peer_id)
    if not by_version:
        return None
    version_hex, peers = max(by_version.items(), key=lambda vp: len(vp[1]))
    return bytes.fromhex(version_hex), peers


async def _usurp_honest_version(self):  # type: ignore[no-untyped-def]
    """Take the chain of the version most other peers announce, to announce it as ours."""
    announced = await _most_announced(self)
    if announced is None:
        return
    version, peers = announced
    if version == getattr(self, "_usurped", None):
        return
    found = await self.certifier.lineage(version, peers)
    if found is None:
        return
    try:
        self.certifier.book.adopt(version, found.certs)
    except ValueError:
        return
    self._usurped = version
    _journal(usurped=version.hex())


# ---------------------------------------------------------------- forge's donor rounds

# Certificates of real rounds of several honest members, whose signatures the forge
# copies. The state it loaded at its join brings some; a join whose load failed (a
# slow machine) brings none, so it also fetches the chain the honest peers announce:
# the attack must not hang on how its join went.
_DONORS: list = []


async def _take_donor_round(self):  # type: ignore[no-untyped-def]
    announced = await _most_announced(self)
    if announced is None:
        return
    found = await self.certifier.lineage(*announced)
    if found is not None:
        _DONORS.extend(c for c in found.certs if c.signers >= 2)
        _journal(donors=len(_DONORS))


if MODE == "copy":
    from shoal.averaging import state_sync

    Averager.metadata = _metadata  # type: ignore[method-assign]
    _honest_on_fetch = state_sync.StateServer._on_fetch

    async def _on_fetch(self, ctx, payload):  # type: ignore[no-untyped-def]
        _journal(served=ctx.peer.short())
        async for item in _honest_on_fetch(self, ctx, payload):
            yield item

    state_sync.StateServer._on_fetch = _on_fetch  # type: ignore[method-assign]

# ---------------------------------------------------------------- forge

if MODE == "forge":
    from shoal.averaging import certifier as _certifier
    from shoal.averaging import provenance_sync
    from shoal.averaging.certificate import Certificate, Statement

    _honest_init = _certifier.Certifier.__init__

    def _init(self, host, key, service):  # type: ignore[no-untyped-def]
        _honest_init(self, host, key, service)
        self.server.identity = host.identity

    _certifier.Certifier.__init__ = _init  # type: ignore[method-assign]
    _honest_on_chain = provenance_sync.ProvenanceService._on_chain

    async def _forged_chain(self, ctx, payload):  # type: ignore[no-untyped-def]
        answer = await _honest_on_chain(self, ctx, payload)
        rounds = [c for c in self.book._certs.values() if c.signers >= 2] + _DONORS
        if not rounds:
            return answer
        donor = max(rounds, key=lambda c: c.statement.commits)
        me = self.identity.peer_id
        certs = []
        for wire in answer["certs"]:
            cert = Certificate.from_wire(wire)
            if cert.statement.members != (me,):  # (a round of others: served as it is)
                certs.append(wire)
                continue
            st = cert.statement
            members = tuple(sorted({*st.members, *donor.statement.members}))
            forged = Statement(st.key, st.previous, st.round_id, st.version, st.fingerprint,
                               members)  # fmt: skip
            sigs = {**donor.signatures, me: self.identity.sign(forged.signed_bytes())}
            certs.append([*forged._fields(), [[p.to_bytes(), s] for p, s in sigs.items()]])
        _journal(forged=sum(c is not w for c, w in zip(certs, answer["certs"], strict=True)),
                 to=ctx.peer.short())  # fmt: skip
        return {**answer, "certs": certs}

    provenance_sync.ProvenanceService._on_chain = _forged_chain  # type: ignore[method-assign]
