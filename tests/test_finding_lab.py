"""Finding peers without an address, in the NAT lab (issue 44): `/dnsaddr/` and mDNS.

A DNS server in the lab's public namespace (`dns_server.py`, run there as a
process) publishes the bootstrap peer's address as a `_dnsaddr.` TXT record; a
peer behind NAT router A is given only the name and that server, joins, and
`shoal doctor` there names the network and what the name resolved to. Then two
hosts behind one router, its uplink cut (no bootstrap reachable, nothing
public at all), listening on their LAN addresses (mDNS `auto` runs on the
interfaces a peer listens on), find each other over mDNS and average, and the
doctor run there names the network and the peers it heard.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from daemon_harness import TINY_TASK, Daemon, cli_env_path, die_with_parent, wait_for
from lab import PUB_IP, Lab, LabError, lab_unavailable

pytestmark = [
    pytest.mark.lab,
    pytest.mark.slow,
    pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable())),
]

DNS_SCRIPT = Path(__file__).resolve().with_name("dns_server.py")
NAME = "boot.l44.test"
TRAIN = {
    "SHOAL_INNER_STEPS": "5",
    "SHOAL_TASK_OPTIONS": TINY_TASK,
    "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=2,round_timeout=15,stall_timeout=3",
}


class LabDns:
    """`dns_server.py` serving TXT `records` on port 53 of a lab namespace."""

    def __init__(self, lab: Lab, ns: str, ip: str, records: list[str]) -> None:
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", lab.ns(ns), sys.executable, str(DNS_SCRIPT), f"{ip}:53",
             *records],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=die_with_parent,  # noqa: PLW1509 (prctl only: see its doc)
        )  # fmt: skip
        self._stderr: str | None = None
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "ready IP:PORT", or "" when it failed
        if not line.startswith("ready"):
            raise LabError(f"the lab DNS server did not start: {self.stop()}")

    def stop(self) -> str:
        """Stop it (closing its stdin); what it printed on stderr (the names it was asked)."""
        if self._stderr is None:
            try:
                _, self._stderr = self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                _, self._stderr = self.proc.communicate()
        return self._stderr


def doctor_in(
    lab: Lab, ns: str, home: Path, args: list[str], env: dict[str, str]
) -> dict[str, Any]:
    """`shoal doctor --json ARGS` in namespace `ns`: its report."""
    out = subprocess.run(
        ["ip", "netns", "exec", lab.ns(ns), sys.executable, "-m", "shoal.peer", "doctor",
         "--json", *args],
        check=False, capture_output=True, text=True, timeout=60,
        env=cli_env_path(home) | env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def peer_id(daemon: Daemon) -> str:
    found = re.search(r"peer ID (\S+)", daemon.log())
    assert found, daemon.tail()
    return found.group(1)


@pytest.mark.timeout(120)
def test_a_peer_behind_a_nat_joins_through_a_dnsaddr_name_served_by_a_lab_dns_server(
    tmp_path: Path,
) -> None:
    lab = Lab("l44d-")
    lab.sh("up")
    daemons: list[Daemon] = []
    dns = None
    try:
        pub = Daemon("pub", tmp_path, ["--listen", "/ip4/0.0.0.0/tcp/4001"], TRAIN,
                     netns=lab.ns("pub"))  # fmt: skip
        daemons.append(pub)
        pub.wait_ready()
        boot = pub.address_on(PUB_IP)
        dns = LabDns(lab, "pub", PUB_IP, [f"_dnsaddr.{NAME}=dnsaddr={boot}"])
        # Behind router A, given only the name and the DNS server to ask.
        joiner = Daemon("a1", tmp_path, ["--listen", "/ip4/0.0.0.0/tcp/4002", "--bootstrap",
                        f"/dnsaddr/{NAME}", "--dns-server", PUB_IP], TRAIN,
                        netns=lab.ns("a1"))  # fmt: skip
        daemons.append(joiner)
        joiner.wait_ready()
        assert f"/dnsaddr/{NAME} resolves to 1 addresses" in joiner.log(), joiner.tail()
        assert "joined the network: 1 peer known" in joiner.log(), joiner.tail()
        assert joiner.join_ref == pub.join_ref  # the experiment the bootstrap peer hosts

        # The doctor behind the same router, for a named network whose list is that name.
        networks = tmp_path / "networks.toml"
        networks.write_text(f'[lab44]\nbootstrap = ["/dnsaddr/{NAME}"]\n')
        args = ["--network", "lab44", "--networks", str(networks), "--dns-server", PUB_IP]
        report = doctor_in(lab, "a1", tmp_path / "doctor", args, {"SHOAL_MDNS": "auto"})
        assert report["network"]["network"] == "lab44"
        assert report["network"]["dnsaddr"][0]["addrs"] == [boot]
        checks = {c["check"]: c for c in report["checks"]}
        assert checks["network"]["verdict"] == "ok", checks["network"]
        detail = checks["network"]["detail"]
        assert detail.startswith("lab44: network lab44"), detail
        assert f"/dnsaddr/{NAME} -> 1 addresses" in detail and "mDNS: " in detail, detail
        assert checks["bootstrap"]["verdict"] == "ok", checks["bootstrap"]  # dialled through A
        asked = dns.stop()
        assert asked.count(f"_dnsaddr.{NAME}") == 2, asked  # the daemon's query, the doctor's
    finally:
        for d in daemons:
            d.kill()
        if dns is not None:
            dns.stop()
        lab.sh("down")


@pytest.mark.timeout(120)
def test_two_peers_behind_one_nat_with_its_uplink_cut_find_each_other_over_mdns_and_average(
    tmp_path: Path,
) -> None:
    lab = Lab("l44m-")
    lab.sh("up")
    daemons: list[Daemon] = []
    try:
        lab.add_lan_host("natA", "a2", "10.0.1.3")
        lab.cut_uplink("natA")  # no bootstrap peer, no DNS, nothing public is reachable
        network = f"l44-{uuid.uuid4().hex[:8]}"
        env = TRAIN | {"SHOAL_MDNS": "auto", "SHOAL_NETWORK": network}
        first = Daemon("a1", tmp_path, ["--listen", "/ip4/10.0.1.2/tcp/4001"], env,
                       netns=lab.ns("a1"))  # fmt: skip
        daemons.append(first)
        first.wait_ready()
        assert "starting a new network" in first.log(), first.tail()
        second = Daemon("a2", tmp_path, ["--listen", "/ip4/10.0.1.3/tcp/4001"], env,
                        netns=lab.ns("a2"))  # fmt: skip
        daemons.append(second)
        second.wait_ready()
        assert "joined the peers found over mDNS" in second.log(), second.tail()
        assert second.join_ref == first.join_ref  # the experiment the first one hosts

        def a_round_of_both() -> list[int]:
            rounds = [first.committed_rounds(), second.committed_rounds()]
            return [s for s in rounds[0] if s in rounds[1] and rounds[0][s] == rounds[1][s]]

        wait_for(
            "a round committed by both with one fingerprint",
            a_round_of_both,
            60,
            debug=lambda: first.tail(15) + "\n" + second.tail(15),
        )
        # The doctor beside the second peer (its own throwaway identity) hears both.
        report = doctor_in(lab, "a2", tmp_path / "doctor", ["--network", network],
                           {"SHOAL_MDNS": "auto"})  # fmt: skip
        heard = {p["peer"] for p in report["network"]["mdns"]}
        assert heard == {peer_id(first), peer_id(second)}, report["network"]
        checks = {c["check"]: c for c in report["checks"]}
        assert checks["network"]["verdict"] == "ok", checks["network"]
        detail = checks["network"]["detail"]
        assert detail.startswith(f"{network}: network {network} (no list"), detail
        assert "mDNS: 2 peers" in detail, detail
        assert checks["bootstrap"]["verdict"] == "ok", checks["bootstrap"]  # dialled on the LAN
        # Only LAN peers answered: nobody can tell how the internet reaches it (it says
        # so at once, instead of waiting 25 s for a verdict that cannot come).
        assert "only peers on this LAN answered" in checks["reachability"]["detail"], checks
    finally:
        for d in daemons:
            d.kill()
        lab.sh("down")


@pytest.mark.timeout(240)
def test_a_first_start_whose_bootstrap_peers_are_cut_off_joins_through_its_lan_neighbour(
    tmp_path: Path,
) -> None:
    """A peer behind router A joins the public host; then A's uplink is cut and a second
    peer starts behind A with the same bootstrap address, which no longer answers. Its
    neighbour, heard over mDNS, is in the network: the second peer joins through it
    (it exited before: a CI soak's peer started in a partition), finds the host's
    experiment there, and the two average."""
    lab = Lab("l44b-")
    lab.sh("up")
    daemons: list[Daemon] = []
    try:
        lab.add_lan_host("natA", "a2", "10.0.1.3")
        pub = Daemon("pub", tmp_path, ["--listen", "/ip4/0.0.0.0/tcp/4001"], TRAIN,
                     netns=lab.ns("pub"))  # fmt: skip
        daemons.append(pub)
        pub.wait_ready()
        boot = pub.address_on(PUB_IP)
        env = TRAIN | {"SHOAL_MDNS": "auto"}
        first = Daemon("a1", tmp_path, ["--listen", "/ip4/10.0.1.2/tcp/4001", "--bootstrap",
                       boot], env, netns=lab.ns("a1"))  # fmt: skip
        daemons.append(first)
        first.wait_ready()
        assert "joined the network" in first.log(), first.tail()
        lab.cut_uplink("natA")
        second = Daemon("a2", tmp_path, ["--listen", "/ip4/10.0.1.3/tcp/4001", "--bootstrap",
                        boot], env, netns=lab.ns("a2"))  # fmt: skip
        daemons.append(second)
        second.wait_ready(timeout=120.0)
        assert "joined through the peers found on this LAN" in second.log(), second.tail()
        assert second.join_ref == pub.join_ref  # the host's experiment, read through a1

        def a_round_of_both() -> list[int]:
            rounds = [first.committed_rounds(), second.committed_rounds()]
            return [s for s in rounds[0] if s in rounds[1] and rounds[0][s] == rounds[1][s]]

        wait_for(
            "a round committed by both with one fingerprint",
            a_round_of_both,
            90,
            debug=lambda: first.tail(15) + "\n" + second.tail(15),
        )
    finally:
        for d in daemons:
            d.kill()
        lab.sh("down")


@pytest.mark.timeout(120)
def test_lan_neighbours_found_over_mdns_do_not_make_peers_behind_a_nat_public(
    tmp_path: Path,
) -> None:
    """Two hosts behind one router, a public bootstrap peer reachable: they join it,
    and each other over mDNS. A neighbour's dial-back on the LAN proves nothing of the
    internet: both find themselves private and take a relay address, and neither
    advertises its LAN address as a public one (mDNS made them "public" at 10.0.1.x)."""
    lab = Lab("l44r-")
    lab.sh("up")
    daemons: list[Daemon] = []
    try:
        lab.add_lan_host("natA", "a2", "10.0.1.3")
        pub = Daemon("pub", tmp_path, ["--listen", "/ip4/0.0.0.0/tcp/4001", "--no-train"], {},
                     netns=lab.ns("pub"))  # fmt: skip
        daemons.append(pub)
        pub.wait_ready()
        env = {"SHOAL_MDNS": "auto", "SHOAL_NO_TRAIN": "1"}
        args = ["--listen", "/ip4/0.0.0.0/tcp/4001", "--bootstrap", pub.address_on(PUB_IP)]
        pair = [Daemon(ns, tmp_path, args, env, netns=lab.ns(ns)) for ns in ("a1", "a2")]
        daemons += pair
        for d in pair:
            d.wait_ready()
        wait_for(
            "one to join the other over mDNS",
            lambda: any("mDNS: joined" in d.log() for d in pair),
            30,
            debug=lambda: pair[0].tail(15) + "\n" + pair[1].tail(15),
        )
        for d in pair:
            wait_for(
                f"{d.name} to be private, on a relay",
                lambda d=d: (
                    (s := d.status())["reachability"] == "private"
                    and any("p2p-circuit" in a for a in s["addresses"])
                ),
                30,
                debug=d.tail,
            )
        for d in pair:
            assert "-> public" not in d.log(), d.tail()
            assert not any("/ip4/10.0.1." in a for a in d.status()["addresses"]), d.status()
    finally:
        for d in daemons:
            d.kill()
        lab.sh("down")
