"""The status page at / in a real headless browser (Debian's chromium, through selenium).

The server runs a fake swarm whose history grows on every poll. The page must
render the peers, the loss curve and the swarm's loss curves (a line per peer,
the validation loss where it changed, a legend of the first 8 peers and a count
of the others), keep up as the history grows, show an
error (not throw) while the daemon is down, and recover when it is back on the
same port, and show a peer's untrusted report as text, never as markup. A
screenshot is kept in test-output/status-page.png.

Skipped when chromium or chromedriver is missing (CI installs both with apt).
"""

from __future__ import annotations

import asyncio
import math
import random
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from shoal.peer import __version__
from shoal.peer.status.metrics import Metrics
from shoal.peer.status.server import StatusServer
from shoal.transport.identity import Identity

pytestmark = pytest.mark.timeout(90)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SCREENSHOT = Path(__file__).resolve().parents[1] / "test-output" / "status-page.png"
WAIT_TIMEOUT = 15.0  # the page polls every 2 s; a loaded machine may start chromium slowly
WINDOW_WIDTH, WINDOW_HEIGHT = 1440, 1000
N_PEERS = 6
HOSTILE = '<img src=x onerror="document.body.dataset.pwned = 1">'

FIRST_HISTORY_POINTS = 60
POINTS_PER_POLL = 5
SWARM_EXTRA_PEERS = 6  # in /swarm beyond the N_PEERS of /peers: one left, all beyond the legend
SWARM_POINTS = 40  # per peer, 15 s apart
SWARM_COLOURED = 8  # the page names this many peers in its legend


class GrowingSwarm:
    """A peer 60+ steps into training with five others; each /history call adds samples."""

    def __init__(self) -> None:
        rng = random.Random(7)
        self.ids = [str(Identity.generate().peer_id) for _ in range(N_PEERS)]
        self.peer_id = self.ids[0]
        self.started = time.time() - 3 * 3600 - 754
        self.t0 = time.time() - 2 * FIRST_HISTORY_POINTS
        self.noise = [rng.gauss(0, 0.05) for _ in range(2000)]
        self.traffic = [rng.uniform(0.6, 1.4) for _ in range(2000)]
        self.points = FIRST_HISTORY_POINTS
        self.served: list[int] = []  # history lengths served, in order
        self.hostile_peer = False  # a peer whose DHT report carries markup
        self.swarm_ids = self.ids + [
            str(Identity.generate().peer_id) for _ in range(SWARM_EXTRA_PEERS)
        ]
        self.swarm_served: list[dict[str, Any]] = []

    def _loss(self, step: int) -> float:
        return 1.9 + 3.6 * math.exp(-step / 18) + self.noise[step]

    def _addresses(self, i: int) -> list[str]:
        pid = self.ids[i]
        addrs = [f"/ip4/192.0.2.{10 + i}/tcp/31337/p2p/{pid}"]
        if i % 2:
            addrs.append(f"/ip4/198.51.100.{i}/tcp/4001/p2p/{self.ids[0]}/p2p-circuit/p2p/{pid}")
        return addrs

    def status(self) -> dict[str, Any]:
        step = self.points - 1
        kinds = ("direct", "holepunched", "relayed", "direct", "direct")
        return {
            "peer_id": self.peer_id,
            "version": __version__,
            "addresses": [
                f"/ip4/192.0.2.10/tcp/31337/p2p/{self.peer_id}",
                f"/ip6/2001:db8::10/tcp/31337/p2p/{self.peer_id}",
            ],
            "reachability": "public",
            "connections": [
                {
                    "peer_id": pid,
                    "kind": kinds[i],
                    "bytes_sent": 3_100_000 * (i + 1),
                    "bytes_received": 2_700_000 * (i + 2),
                }
                for i, pid in enumerate(self.ids[1:])
            ],
            "dht_peers": 11,
            "experiment": "bytegpt-tiny",
            "strategy": "diloco",  # an optional key the page shows when present
            "task": "bytegpt",
            "step": step,
            "loss": self._loss(step),
            "val_loss": 2.0412,
            "tokens_per_s": 18_432.5,
            "device": {
                "kind": "cuda",
                "name": "NVIDIA A100-SXM4-80GB",
                "memory_used_bytes": 9 * 2**30,
                "memory_total_bytes": 80 * 2**30,
            },
            "mfu": 0.412,
            "clock_skew_s": -312.4,
            "checkpoint_error": "cannot write a checkpoint in /data: No space left on device",
            "outer_step": 17,
            "last_commit_at": time.time() - 8,
            "join_command": "shoal run --join bytegpt-tiny@12D3KooWabc "
            "--bootstrap /ip4/192.0.2.10/tcp/31337/p2p/12D3KooWabc",
            "last_round": {
                "group_size": 4,
                "duration_s": 2.31,
                "outcome": "committed",
                "fingerprint": "b3f91c07e2d45a60",
            },
            "bytes_sent": 3_000_000 * step,
            "bytes_received": 4_100_000 * step,
            "uptime_s": time.time() - self.started,
            "config": {"listen": "/ip4/0.0.0.0/tcp/31337", "status_addr": "127.0.0.1:8080"},
            "verification": {
                "enabled": True,
                "audits_done": 12,
                "audits_passed": 11,
                "audits_failed": 1,
                "probation": False,
                "banned": [BANNED],
                "convictions": [{"peer": BANNED, "round": 9, "accusers": self.ids[1:3], "at": 1.0}],
                "convicted_self": False,
                "rejected_evidence": 0,
            },
            "pipeline": {
                "stage": 1,
                "trainer": True,
                "stages": [
                    {
                        "stage": 0,
                        "peers": 2,
                        "throughput": 410.5,
                        "peer_ids": self.ids[1:3],
                        "servers": [
                            self._server(self.ids[1], 19.5),
                            self._server(self.ids[2], 0.0, banned=True),
                            self._server(BANNED, 0.0),
                        ],
                    },
                    {
                        "stage": 1,
                        "peers": 2,
                        "throughput": None,
                        "peer_ids": [HOSTILE, self.peer_id],
                        # (pipeline/stage_losses.py: every peer left, none had a checkpoint)
                        "lost": {"version": 37, "since": 1.0},
                        "servers": [
                            self._server(HOSTILE, 7.25),
                            self._server(self.peer_id, 12.0, own=True),
                        ],
                    },
                ],
                "microbatches": 57,
                "flow": {
                    "window_s": 10.2,
                    "microbatches_per_s": 9.75,
                    "samples_per_s": 39.0,
                    "stages": [
                        {"stage": 0, "requests_per_s": 19.5},
                        {"stage": 1, "requests_per_s": 19.25},
                    ],
                    "served_per_s": {"forward": 6.0, "backward": 6.0},
                },
                "bans": [{"peer_id": self.ids[2], "stage": 0, "ban_s": 13.2}],
            },
        }

    @staticmethod
    def _server(
        peer_id: str, flow: float, *, banned: bool = False, own: bool = False
    ) -> dict[str, Any]:
        """A peer box of the pipeline drawing (peer/status/pipeline_status.py's schema)."""
        return {
            "peer_id": peer_id,
            "self": own,
            "throughput": 1680.9,
            "measured": None if own else 2096.2,
            "queue": 2,
            "in_flight": None if own else 1,
            "version": 82,
            "flow": flow,
            "banned": banned,
            "ban_s": 13.2 if banned else None,
            "age_s": 4.5,
        }

    async def peers(self) -> list[dict[str, Any]]:
        now, step = time.time(), self.points - 1
        hostile = [
            {
                "peer_id": HOSTILE,
                "step": 1,
                "loss": None,
                "tokens_per_s": None,
                "addresses": [HOSTILE],
                "updated_at": now,
                "self": False,
            }
        ]
        return (hostile if self.hostile_peer else []) + [
            {
                "peer_id": pid,
                "step": step - 3 * i,
                "loss": self._loss(step - 3 * i),
                "val_loss": 2.0412 if i < 3 else None,  # the others: no round yet
                "tokens_per_s": 18_432.5 - 1500 * i,
                "addresses": self._addresses(i),
                "updated_at": now - 4 * i - (400 if i == N_PEERS - 1 else 0),
                "self": i == 0,
            }
            for i, pid in enumerate(self.ids)
        ]

    def swarm(self) -> dict[str, Any]:
        """SwarmHistory's shape: every peer 15 s apart, its validation loss repeated in every
        report until the next round's (a new value every 4 points); the last extra peer left
        10 minutes ago; the hostile peer (once there) reports markup as its ID."""
        now = time.time()
        peers: dict[str, list[dict[str, Any]]] = {}
        ids = self.swarm_ids + ([HOSTILE] if self.hostile_peer else [])
        for i, pid in enumerate(ids):
            end = now - (600 if i == len(self.swarm_ids) - 1 else 0)
            peers[pid] = [
                {
                    "t": end - 15 * (SWARM_POINTS - 1 - k),
                    "step": 5 * k,
                    "loss": self._loss(5 * k // 3) + 0.02 * i,
                    "val_loss": None if k < 4 else round(self._loss(k // 4 * 4), 4) + 0.1,
                }
                for k in range(i, SWARM_POINTS)  # of different lengths: they joined later
            ]
        served = {"peers": peers, "self": self.peer_id}
        self.swarm_served.append(served)
        return served

    def history(self) -> list[dict[str, Any]]:
        if self.served:
            self.points += POINTS_PER_POLL
        self.served.append(self.points)
        sent = received = 0.0
        out = []
        for i in range(self.points):
            sent += 1_500_000 * self.traffic[i]
            received += 2_050_000 * self.traffic[-i]
            out.append(
                {
                    "t": self.t0 + 2 * i,
                    "step": i,
                    "loss": self._loss(i),
                    "tokens_per_s": 18_000.0,
                    "bytes_sent": int(sent),
                    "bytes_received": int(received),
                }
            )
        return out


def _need_browser() -> None:
    pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium)")
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if shutil.which(path) is None:
            pytest.skip(f"{path} is missing (apt-get install {package})")


def _start_chromium(user_data_dir: Path) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--window-size={WINDOW_WIDTH},{WINDOW_HEIGHT}",
        f"--user-data-dir={user_data_dir}",
    ):
        options.add_argument(flag)
    # An explicit driver path: selenium must not go looking for (or download) one.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(WAIT_TIMEOUT)
    driver.set_script_timeout(WAIT_TIMEOUT)
    return driver


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[Any]:
    _need_browser()
    # Selenium blocks; in a thread, so that the server on this event loop keeps answering.
    driver = await asyncio.to_thread(_start_chromium, tmp_path / "chromium-profile")
    try:
        yield driver
    finally:
        await asyncio.to_thread(driver.quit)


async def wait_for(driver: Any, script: str, done: Callable[[Any], bool], what: str) -> Any:
    """Poll the DOM with `script` until `done(value)`; fail naming `what` after WAIT_TIMEOUT."""
    deadline = time.monotonic() + WAIT_TIMEOUT
    value = None
    while time.monotonic() < deadline:
        value = await asyncio.to_thread(driver.execute_script, script)
        if done(value):
            return value
        await asyncio.sleep(0.1)  # the polling interval of this check, not a synchronization
    raise AssertionError(f"page never showed {what} within {WAIT_TIMEOUT:g} s; last: {value!r}")


def fit_window_to_page(driver: Any) -> None:
    """Make the window as tall as the page, so that the screenshot shows all of it."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(WINDOW_WIDTH, max(WINDOW_HEIGHT, int(height) + 140))


PAGE_STATE = """
const rows = [...document.querySelectorAll('#peers tbody tr')];
return {
  rows: rows.map((r) => r.dataset.peerId),
  selfRows: rows.filter((r) => r.classList.contains('self')).length,
  lossPoints: Number(document.getElementById('loss-curve').dataset.points),
  swarm: (() => {
    const c = document.getElementById('swarm-curve');
    const legend = [...document.querySelectorAll('#swarm-legend li[data-peer-id]')];
    const others = document.querySelector('#swarm-legend li.others');
    return {
      peers: Number(c.dataset.peers), points: Number(c.dataset.points),
      valPoints: Number(c.dataset.valPoints), height: c.getBoundingClientRect().height,
      legend: legend.map((li) => li.dataset.peerId),
      legendClasses: legend.map((li) => li.className),
      legendText: legend.map((li) => li.textContent),
      others: others ? Number(others.dataset.count) : 0,
      aside: document.getElementById('swarm-aside').textContent,
    };
  })(),
  valLoss: document.getElementById('val-loss').textContent,
  bandwidthPoints: Number(document.getElementById('bandwidth').dataset.points),
  connections: document.querySelectorAll('#connections tbody tr').length,
  peerId: document.getElementById('peer-id').textContent,
  step: document.getElementById('step').textContent,
  loss: document.getElementById('loss').textContent,
  device: document.getElementById('device').textContent,
  swarmRound: document.getElementById('swarm-round').textContent,
  joinCommand: document.getElementById('join-command').textContent,
  joinHidden: document.getElementById('join-box').hidden,
  experiment: document.getElementById('experiment').textContent,
  lastRound: document.getElementById('last-round').textContent,
  error: document.getElementById('error').classList.contains('shown'),
  errorText: document.getElementById('error').textContent,
  polls: Number(document.body.dataset.polls),
  pwned: document.body.dataset.pwned !== undefined,
  images: document.querySelectorAll('#peers img').length,
  peersText: document.getElementById('peers').textContent,
  bans: [...document.querySelectorAll('#bans tbody tr')].map((r) => r.dataset.peerId),
  audits: document.getElementById('audits').textContent,
  stages: [...document.querySelectorAll('#stages tbody tr')].map((r) => r.textContent),
  pipelineRole: document.getElementById('pipeline-role').textContent,
  drawing: (() => {
    const d = document.getElementById('pipeline-drawing');
    return {
      stages: Number(d.dataset.stages),
      columns: [...d.querySelectorAll('.stage-column')].map((c) => ({
        stage: c.dataset.stage,
        boxes: [...c.querySelectorAll('.peer-box')].map((b) => ({
          id: b.dataset.peerId, classes: [...b.classList].sort(), flow: b.dataset.flow,
          text: b.textContent,
        })),
      })),
      liveLinks: d.querySelectorAll('.pipe-link i.live').length,
      width: d.getBoundingClientRect().width,
    };
  })(),
  pipelineFlow: document.getElementById('pipeline-flow').textContent,
  pipelineBans: [...document.querySelectorAll('#pipeline-bans li')].map(
    (li) => [li.dataset.peerId, li.className]),
  selfConvictedShown: getComputedStyle(document.getElementById('self-convicted')).display
    !== 'none',
  attention: [...document.querySelectorAll('#attention-list li')].map(
    (li) => [li.dataset.problem, li.textContent]),
  attentionShown: !document.getElementById('attention').hidden,
};
"""


BANNED = "12D3KooWCheaterCheaterCheaterCheaterCheaterCheaterCheat"


async def test_page_renders_peers_and_a_growing_loss_curve_and_survives_a_restart(
    browser: Any,
) -> None:
    swarm = GrowingSwarm()
    server = StatusServer(swarm, Metrics(swarm), "127.0.0.1", 0)
    await server.start()
    try:
        await asyncio.to_thread(browser.get, server.url + "/")

        # The curve follows the history: at least one refresh after the first load.
        page = await wait_for(
            browser,
            PAGE_STATE,
            lambda p: (
                p["lossPoints"] >= FIRST_HISTORY_POINTS + POINTS_PER_POLL
                and p["lossPoints"] in swarm.served
                and len(p["rows"]) == N_PEERS
            ),
            f"{N_PEERS} peer rows and a loss curve grown past {FIRST_HISTORY_POINTS} points",
        )
        assert sorted(page["rows"]) == sorted(swarm.ids)
        # The swarm's curves: every peer's line, the validation loss where it changed.
        served = swarm.swarm_served[-1]["peers"]
        drawn = page["swarm"]
        assert drawn["peers"] == len(served) == N_PEERS + SWARM_EXTRA_PEERS
        assert drawn["points"] == sum(len(series) for series in served.values())
        changes = sum(
            len({p["val_loss"] for p in series if p["val_loss"] is not None})
            for series in served.values()
        )
        assert drawn["valPoints"] == changes and changes > 0
        assert drawn["height"] >= 200
        assert len(drawn["legend"]) == SWARM_COLOURED and drawn["legend"][0] == swarm.peer_id
        assert drawn["legendClasses"][0] == "self" and drawn["legendText"][0].startswith(
            "this peer"
        )
        assert " · val " in drawn["legendText"][0]
        assert drawn["others"] == len(served) - SWARM_COLOURED
        assert drawn["aside"] == f"{len(served) - 1} reporting, 1 left"
        assert page["valLoss"] == "validation 2.0412"
        assert "2.0412" in page["peersText"]  # the Val loss column

        assert page["rows"][0] == swarm.peer_id and page["selfRows"] == 1  # this peer first
        assert page["bandwidthPoints"] == 2 * (page["lossPoints"] - 1)  # sent + received rates
        assert page["connections"] == N_PEERS - 1
        assert page["peerId"] == swarm.peer_id
        assert page["experiment"] == "bytegpt-tiny"
        assert page["step"].replace(",", "").isdigit()
        assert "NVIDIA A100" in page["device"] and "MFU 41.2%" in page["device"], page["device"]
        assert page["swarmRound"].startswith("round 17 · committed "), page["swarmRound"]
        assert not page["joinHidden"] and page["joinCommand"].startswith("shoal run --join ")
        assert "committed" in page["lastRound"] and "b3f91c07e2d45a60" in page["lastRound"]
        assert page["bans"] == [BANNED] and page["audits"] == "12 audits · 1 failed"
        assert not page["selfConvictedShown"]  # shown only to a convicted peer
        assert page["attentionShown"] and [k for k, _ in page["attention"]] == [
            "clock",
            "checkpoint",
        ]
        assert "-312 s off" in page["attention"][0][1] and "NTP" in page["attention"][0][1]
        assert "No space left" in page["attention"][1][1]
        assert len(page["stages"]) == 2 and "410.5" in page["stages"][0]
        assert "lost at version 37" in page["stages"][1] and "lost" not in page["stages"][0]
        assert page["pipelineRole"] == "serving stage 1 · training · 57 microbatches"
        # The drawing: a column per stage, a box per peer with its numbers and state.
        drawing = page["drawing"]
        assert drawing["stages"] == 2 and [c["stage"] for c in drawing["columns"]] == ["0", "1"]
        first, second = (c["boxes"] for c in drawing["columns"])
        assert [b["id"] for b in first] == [swarm.ids[1], swarm.ids[2], BANNED]
        assert [b["id"] for b in second] == [HOSTILE, swarm.peer_id]
        assert first[0]["classes"] == ["peer-box"] and first[0]["flow"] == "19.50"
        assert "banned" in first[1]["classes"] and "banned 13 s" in first[1]["text"]
        assert "convicted" in first[2]["classes"]  # verification's ban, shown in its stage
        assert "self" in second[1]["classes"] and "this peer" in second[1]["text"]
        assert "1,681" in first[0]["text"] and "19.5 req/s" in first[0]["text"]
        assert HOSTILE[-8:] in second[0]["text"]  # the markup, as text
        assert drawing["liveLinks"] == 6  # trainer -> 0 -> 1 -> loss, both directions
        assert drawing["width"] > 600  # a full-width card, not squeezed into the side column
        assert page["pipelineFlow"] == "9.8 microbatches/s over the last 10 s"
        assert page["pipelineBans"] == [[swarm.ids[2], "routing"], [BANNED, "convicted"]]
        assert not page["error"], page["errorText"]

        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(fit_window_to_page, browser)
        assert await asyncio.to_thread(browser.save_screenshot, str(SCREENSHOT))
        print(f"\nstatus page screenshot: {SCREENSHOT}")

        # The daemon stops: the page says so instead of breaking.
        port = int(server.url.rsplit(":", 1)[1])
        await server.aclose()
        page = await wait_for(browser, PAGE_STATE, lambda p: p["error"], "the error banner")
        assert "Cannot reach this peer" in page["errorText"]
        assert len(page["rows"]) == N_PEERS  # the last data stays on screen

        # It comes back on the same port, with a new peer whose report carries markup:
        # the page recovers by itself and shows the markup as text.
        polls_before = page["polls"]
        swarm.hostile_peer = True
        server = StatusServer(swarm, Metrics(swarm), "127.0.0.1", port)
        await server.start()
        page = await wait_for(
            browser,
            PAGE_STATE,
            lambda p: not p["error"] and p["polls"] > polls_before and len(p["rows"]) > N_PEERS,
            "recovery after the restart",
        )
        assert page["lossPoints"] in swarm.served
        assert HOSTILE in page["rows"] and HOSTILE in page["peersText"]
        await wait_for(
            browser,
            PAGE_STATE,
            lambda p: p["swarm"]["peers"] == N_PEERS + SWARM_EXTRA_PEERS + 1,
            "the hostile peer's series in the swarm's curves (fetched every 10 s)",
        )
        assert page["images"] == 0 and not page["pwned"]

        logs = await asyncio.to_thread(browser.get_log, "browser")
        problems = [
            e["message"]
            for e in logs
            if "Uncaught" in e["message"] or "Content Security Policy" in e["message"]
        ]
        assert not problems, problems
    finally:
        await server.aclose()
