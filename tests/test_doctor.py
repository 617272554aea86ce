"""`shoal doctor`: the verdicts (sans-I/O), and the command against real peers.

The lab test runs the doctor behind the namespace lab's three kinds of
router: on the public host it says public; behind NAT A (MASQUERADE, which
keeps a port for every destination) "private, hole punching possible" and it
punches a direct connection to a training peer behind NAT C; behind NAT B
(--random-fully, a new port per destination) "private, relay needed", and the
punch fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from daemon_harness import TINY_TASK, Daemon, cli_env_path, wait_for
from lab import PUB_IP, Lab, lab_unavailable

from shoal.peer.diagnosis import Facts, can_take_part, diagnose, nat_mapping
from shoal.peer.doctor import _write_probe


def verdicts(facts: Facts) -> dict[str, tuple[str, str]]:
    return {c.name: (c.verdict, c.detail) for c in diagnose(facts)}


def test_no_bootstrap_peer_answering_means_it_cannot_take_part() -> None:
    facts = Facts(bootstrap=[("/ip4/192.0.2.1/tcp/1", "connection refused")], torch="2.13")
    checks = diagnose(facts)
    assert not can_take_part(checks)
    bootstrap = next(c for c in checks if c.name == "bootstrap")
    assert "connection refused" in bootstrap.detail and bootstrap.advice
    # What needs a peer is not checked, rather than reported as three more problems.
    assert {c.name: c.verdict for c in checks if c.verdict == "skip"}.keys() == {
        "reachability", "hole punch", "relays", "clock",
    }  # fmt: skip


def test_the_nat_mapping_needs_two_observers_at_different_ips() -> None:
    assert nat_mapping([("1.1.1.1", "/ip4/5.5.5.5/tcp/10")]) == "unknown"
    same = [("1.1.1.1", "/ip4/5.5.5.5/tcp/10"), ("2.2.2.2", "/ip4/5.5.5.5/tcp/10")]
    assert nat_mapping(same) == "consistent"
    other = [("1.1.1.1", "/ip4/5.5.5.5/tcp/10"), ("2.2.2.2", "/ip4/5.5.5.5/tcp/77")]
    assert nat_mapping(other) == "per-destination"


def test_reachability_verdicts_say_what_works() -> None:
    base = {"bootstrap": [("/ip4/192.0.2.1/tcp/1", None)], "torch": "2.13"}
    punch = Facts(
        **base,
        reachability="private",
        observed=[("1.1.1.1", "/ip4/5.5.5.5/tcp/10"), ("2.2.2.2", "/ip4/5.5.5.5/tcp/10")],
    )
    assert verdicts(punch)["reachability"][1].startswith("private, hole punching possible")
    relay = Facts(
        **base,
        reachability="private",
        observed=[("1.1.1.1", "/ip4/5.5.5.5/tcp/10"), ("2.2.2.2", "/ip4/5.5.5.5/tcp/77")],
    )
    assert verdicts(relay)["reachability"][0] == "warn"
    assert verdicts(relay)["reachability"][1].startswith("private, relay needed")
    assert verdicts(Facts(**base, reachability="public"))["reachability"][0] == "ok"
    skewed = Facts(**base, clock_skews_s=[120.0, 119.0, 121.0])
    assert verdicts(skewed)["clock"][0] == "warn" and "+120s" in verdicts(skewed)["clock"][1]
    assert can_take_part(diagnose(relay))
    punched = Facts(**{**base, "reachability": "private", "punches": [("…abc", None)]})
    assert verdicts(punched)["hole punch"][0] == "ok"
    failed = Facts(**{**base, "reachability": "private", "punches": [("…abc", "relayed")]})
    assert verdicts(failed)["hole punch"][0] == "warn"
    assert verdicts(Facts(**base, reachability="private"))["hole punch"][0] == "skip"


@pytest.mark.lab
@pytest.mark.timeout(240)
@pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable()))
def test_doctor_behind_each_kind_of_router(tmp_path: Path) -> None:
    lab = Lab("dr-")
    lab.sh("up")
    daemons = []
    try:
        env = {"SHOAL_NO_TRAIN": "1"}
        train = {"SHOAL_TASK_OPTIONS": TINY_TASK, "SHOAL_INNER_STEPS": "10"}
        pub = Daemon("pub", tmp_path, ["--listen", "/ip4/0.0.0.0/tcp/4001", "--host-experiment",
                     "lab"], train, netns=lab.ns("pub"))  # fmt: skip
        daemons.append(pub)
        pub.wait_ready()
        boot = pub.address_on(PUB_IP)
        # A second public peer, at another IP (router C's, its port opened on the router's
        # firewall): two observers tell the NAT kinds apart.
        open_port = "iptables -I INPUT -i wan0 -p tcp --dport 4002 -j ACCEPT"
        lab.sh("exec", lab.ns("natC"), *open_port.split())
        other = Daemon("other", tmp_path, ["--listen", "/ip4/0.0.0.0/tcp/4002", "--bootstrap",
                       boot], env, netns=lab.ns("natC"))  # fmt: skip
        daemons.append(other)
        other.wait_ready()
        # The doctor learns of the second observer from the DHT, which lists a peer once
        # it knows itself public.
        wait_for("it to be public", lambda: other.status()["reachability"] == "public", 60)
        wait_for("the bootstrap peer to list it", lambda: pub.status()["dht_peers"] >= 1, 30)
        # A training peer behind NAT C (MASQUERADE): what the others punch a hole to. Told
        # it is private: the second public peer sits on router C and could reach its LAN.
        natted = Daemon("c1", tmp_path, ["--listen", "/ip4/0.0.0.0/tcp/4003", "--bootstrap",
                        boot, "--join", pub.join_ref, "--reachability", "private"], train,
                        netns=lab.ns("c1"))  # fmt: skip
        daemons.append(natted)
        natted.wait_ready()
        wait_for(
            "the NATed peer to hold a relay address",
            lambda: any("p2p-circuit" in a for a in natted.status()["addresses"]),
            60,
        )
        found = {}
        for ns in ("pub", "a1", "b1"):
            out = subprocess.run(
                ["ip", "netns", "exec", lab.ns(ns), sys.executable, "-m", "shoal.peer",
                 "doctor", "--json", "--bootstrap", boot],
                check=False, capture_output=True, text=True, timeout=90,
                env=cli_env_path(tmp_path / f"doctor-{ns}"),
            )  # fmt: skip
            assert out.returncode == 0, out.stdout + out.stderr
            report = json.loads(out.stdout)
            found[ns] = {c["check"]: c for c in report["checks"]}
        assert found["pub"]["reachability"]["detail"].startswith("public")
        assert found["a1"]["reachability"]["detail"].startswith("private, hole punching possible")
        assert found["b1"]["reachability"]["detail"].startswith("private, relay needed")
        assert found["b1"]["relays"]["verdict"] == "ok"  # it got a reservation on the public peer
        assert found["a1"]["hole punch"]["verdict"] == "ok", found["a1"]["hole punch"]
        assert found["b1"]["hole punch"]["verdict"] == "warn", found["b1"]["hole punch"]
    finally:
        for d in daemons:
            d.kill()
        lab.sh("down")


def test_a_data_directory_that_cannot_be_written_fails_the_disk_check(tmp_path: Path) -> None:
    ok = Facts(torch="2.13", free_disk_bytes=10 << 30, data_dir=str(tmp_path))
    assert verdicts(ok)["disk"][0] == "ok"
    full = Facts(torch="2.13", free_disk_bytes=0, data_dir="/d", unwritable="No space left")
    verdict, detail = verdicts(full)["disk"]
    assert verdict == "fail" and "No space left" in detail


def test_the_write_probe_writes_in_the_data_directory_and_leaves_nothing(tmp_path: Path) -> None:
    assert _write_probe(tmp_path) is None
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")
    assert _write_probe(tmp_path / "file") is not None  # (works as root too: not a dir)


def test_bootstrap_peers_of_another_protocol_say_to_upgrade_not_to_check_the_address() -> None:
    error = "IncompatibleProtocol: incompatible peer: it speaks shoal protocol 2.0 (shoal 0.3.0)"
    facts = Facts(bootstrap=[("/ip4/192.0.2.1/tcp/1", error)], torch="2.13")
    (check,) = [c for c in diagnose(facts) if c.name == "bootstrap"]
    assert check.verdict == "fail" and "another protocol" in check.detail
    assert "pip install -U shoal" in check.advice
