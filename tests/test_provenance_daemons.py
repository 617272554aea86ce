"""End to end (issue 39 part 1): separate `shoal run` processes on loopback, some of
them running tampered code (tests/usurper) that tries to take the swarm over with a
state of its own: a usurper never averages, trains by gradient ascent and declares
an enormous lineage work, and in the `forge` and `copy` modes also serves forged
certificates or the honest peers' certificates over its own bytes.

Three honest peers train; three usurpers (one per mode) join and commit alone on
their own states; then a newcomer joins and an honest peer is restarted from its
checkpoint. No honest peer, neither the restarted one nor the newcomer, ever loads
a usurper's state; the honest peers keep committing equal fingerprints, and their
loss keeps falling. (Before commit certificates, a newcomer's first loss was 22,356
and the honest peers re-synced onto the usurper's state within seconds.)"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from daemon_harness import TINY_TASK, Daemon, wait_for

pytestmark = pytest.mark.slow  # swarms of daemons

USURPER_CODE = Path(__file__).parent / "usurper"
ROUNDS = {
    "SHOAL_INNER_STEPS": "10",
    "SHOAL_TASK_OPTIONS": TINY_TASK,
    "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=3,round_timeout=15,stall_timeout=3",
    # Unverified: the usurper must be stopped by provenance, not by an audit of its work.
    "SHOAL_VERIFY": "off",
}
LOADED_RE = re.compile(r"loaded state (\w+) of ")
# Commits alone the usurper makes before the newcomer comes and an honest peer restarts.
USURPER_COMMITS = 3


def _debug(*daemons: Daemon) -> str:
    return "\n".join(d.tail(40) for d in daemons)


def _attack_debug(usurper: Daemon, honest: list[Daemon]) -> str:
    """What a usurper did besides committing, what it loaded, and which chains the
    honest peers refused (an attack that never came: was it never asked?)."""
    lines = [f"--- {usurper.name}: journal without commits, then what it loaded"]
    lines += [json.dumps(e) for e in _journal(usurper) if "fp" not in e][-20:]
    lines += [line for line in usurper.log().splitlines() if "loaded state" in line][-5:]
    for d in honest:
        refused = [line for line in d.log().splitlines() if "does not check" in line]
        lines += [f"--- {d.name}: {len(refused)} chains refused, the last:", *refused[-5:]]
    return "\n".join(lines)


def _journal(usurper: Daemon) -> list[dict[str, Any]]:
    """What the usurper did (tests/usurper writes it): its commits and attacks."""
    journal = usurper.data_dir / "usurper.jsonl"
    if not journal.exists():
        return []
    lines = journal.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def _usurper_states(usurper: Daemon) -> set[str]:
    """The fingerprints of every state the usurper committed alone."""
    return {e["fp"] for e in _journal(usurper) if "fp" in e}


def _loaded(daemon: Daemon) -> list[str]:
    """The fingerprints (12 hex digits) of the states `daemon` ever loaded."""
    return LOADED_RE.findall(daemon.log())


def _loss(daemon: Daemon) -> float:
    loss = daemon.status()["loss"]
    assert isinstance(loss, float), loss
    return loss


def _steps_agreed_by(daemons: list[Daemon], after: int) -> list[int]:
    """Outer steps past `after` that every daemon committed, with one fingerprint."""
    rounds = [d.committed_rounds() for d in daemons]
    common = set.intersection(*(set(r) for r in rounds))
    return sorted(s for s in common if s > after and len({r[s] for r in rounds}) == 1)


def _tampered(mode: str) -> dict[str, Any]:
    path = os.pathsep.join(filter(None, [str(USURPER_CODE), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "SHOAL_USURPER": mode}


MODES = ("boast", "forge", "copy")
ATTACKS = {"boast": "fp", "forge": "forged", "copy": "usurped"}


@pytest.mark.timeout(420)
def test_peers_that_boast_forge_or_copy_for_states_of_their_own_take_over_nobody(
    tmp_path: Path,
) -> None:
    """The three usurpers attack the same swarm at once (one run, a third of the time
    of one run per mode, and a harder case: three lineages of false claims)."""
    host = Daemon("host", tmp_path, ["--host-experiment", "usurped"], ROUNDS)
    daemons = [host]
    try:
        host.wait_ready()
        join = ["--join", host.join_ref, "--bootstrap", host.address]
        a, b = (Daemon(f"honest-{i}", tmp_path, join, {}) for i in (1, 2))
        daemons += [a, b]
        for d in (a, b):
            d.wait_ready()
        trio = [host, a, b]
        wait_for("2 rounds of the three honest peers",
                 lambda: len(_steps_agreed_by(trio, 0)) >= 2, 150,
                 debug=lambda: _debug(*trio))  # fmt: skip
        early_loss = {d.name: _loss(d) for d in (host, a)}

        usurpers = {m: Daemon(f"usurper-{m}", tmp_path, join, _tampered(m)) for m in MODES}
        daemons += usurpers.values()
        for usurper in usurpers.values():
            usurper.wait_ready()
        for mode, usurper in usurpers.items():
            wait_for(f"{USURPER_COMMITS} commits alone by the {mode} usurper",
                     lambda u=usurper: len(_usurper_states(u)) >= USURPER_COMMITS, 120,
                     debug=lambda u=usurper: _debug(u))  # fmt: skip
        attack_step = max(d.status()["outer_step"] for d in trio)

        # A newcomer joins; an honest peer restarts from its checkpoint.
        newcomer = Daemon("newcomer", tmp_path, join, {})
        daemons.append(newcomer)
        code, _ = b.terminate()
        assert code == 0, b.tail()
        b = Daemon("honest-2", tmp_path, join, {})  # (same home: same data dir, checkpoint)
        daemons.append(b)
        for d in (newcomer, b):
            d.wait_ready()
        honest = [host, a, b, newcomer]
        wait_for("2 rounds of the four honest peers after the attack",
                 lambda: len(_steps_agreed_by(honest, attack_step)) >= 2, 180,
                 debug=lambda: _debug(*honest, *usurpers.values()))  # fmt: skip

        # Each attack is made when an honest peer asks the usurper for its chain (a
        # newcomer, a re-sync, a background check of a version in the view): with three
        # usurpers at once, the last one asked may be asked later.
        for mode, usurper in usurpers.items():
            attack = ATTACKS[mode]
            wait_for(f"the {mode} usurper's {attack} attack",
                     lambda u=usurper, a=attack: any(a in e for e in _journal(u)), 120,
                     debug=lambda u=usurper: _attack_debug(u, honest))  # fmt: skip

        # Nobody took a usurper's state, though each went on committing alone.
        for mode, usurper in usurpers.items():
            usurped = _usurper_states(usurper)
            assert len(usurped) > USURPER_COMMITS, usurper.tail()
            prefixes = {fp[:12] for fp in usurped}
            for d in honest:
                assert not prefixes & set(_loaded(d)), f"{d.name} loaded the {mode} state"
                assert not {fp[:16] for fp in usurped} & set(d.committed_rounds().values())
            # Their loss, on their own states, rose.
            assert _loss(usurper) > max(early_loss.values()), mode
        assert _loaded(newcomer), "the newcomer loaded the honest state"
        assert "resumed from checkpoint" in b.log()
        # The honest peers agree on every round after the attack.
        for step in range(attack_step + 1, max(host.committed_rounds()) + 1):
            prints = {d.committed_rounds().get(step) for d in honest} - {None}
            assert len(prints) <= 1, f"fingerprints differ at outer step {step}: {prints}"
        # Their loss kept falling. (Waited for: a newcomer's first contribution, from a
        # fresh inner optimizer, may lift the smoothed loss for a round; CI ci36 read
        # 3.178 against 3.160 at one instant.)
        wait_for("the honest peers' loss below its level before the attack",
                 lambda: all(_loss(d) < early_loss[d.name] for d in (host, a)), 90,
                 debug=lambda: f"{early_loss} now {[_loss(d) for d in (host, a)]}")  # fmt: skip
        # (A fresh inner optimizer's first steps raise it a little; on a usurper's
        # state it was 22,356.)
        assert _loss(newcomer) < 1.5 * max(early_loss.values()), _loss(newcomer)
    finally:
        for d in daemons:
            d.kill()
