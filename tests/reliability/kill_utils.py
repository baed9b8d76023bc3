"""Kill one process of a serving setup while clients stream from it, and check what is left.

`kill_under_load` starts CLIENTS long streamed completions, waits until each has its first
chunk (all of them are running), SIGKILLs the victim, then records for each client when and
how its call ended, and how a fresh request right after the kill is answered. The checks that
follow are the same for every process kind:
- every client whose request the victim served got an error within CLIENT_DEADLINE_S of the
  kill; none hangs (a data-parallel survivor's clients finish normally);
- a fresh request is answered 503 or refused within CLIENT_DEADLINE_S;
- `kvserve serve` exits non-zero by itself (unless told to stay up);
- no process of the setup is left (every pid seen before the kill is gone, the process
  group is empty) and no shared-memory segment created by one of them is left in /dev/shm.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import httpx
import openai
import psutil

CLIENTS = 6
MAX_TOKENS = 220           # with a short prompt, within max-model-len 256; not done by the kill
CLIENT_DEADLINE_S = 5.0    # the bound: an error or a 503 within 5 s
LEFTOVER_WAIT_S = 15.0     # for the processes to go once the server exited


@dataclass
class KillReport:
    kind: str
    killed_at: float = 0.0
    ended_after: list = field(default_factory=list)    # seconds after the kill, per client
    outcomes: list = field(default_factory=list)       # "error: ..." or "finished"
    fresh_after: float = 0.0
    fresh_outcome: str = ""
    exit_code: Optional[int] = None
    leftover_pids: list = field(default_factory=list)
    leftover_shm: list = field(default_factory=list)
    # Chunks each client had when the kill came: a client that finished anyway had its whole
    # stream made before the kill (a too-short load, not a server fault).
    chunks_at_kill: list = field(default_factory=list)

    def error_times(self) -> list[float]:
        return [t for t, o in zip(self.ended_after, self.outcomes) if o.startswith("error")]

    def line(self) -> str:
        worst = max(self.error_times(), default=0.0)
        return (f"kill {self.kind}: {len(self.error_times())} of {len(self.outcomes)} clients "
                f"got an error, within {worst:.2f} s ({self.outcomes.count('hung')} hung); "
                f"fresh request "
                f"{self.fresh_outcome} after {self.fresh_after:.2f} s; exit {self.exit_code}; "
                f"leftover pids {self.leftover_pids}, shm {self.leftover_shm}; "
                f"chunks each client had at the kill {self.chunks_at_kill}")


def tree_pids(root_pid: int) -> set[int]:
    root = psutil.Process(root_pid)
    return {root_pid, *(p.pid for p in root.children(recursive=True))}


def find_process(root_pid: int, match: Callable[[psutil.Process], bool],
                 timeout: float = 60.0) -> psutil.Process:
    """A descendant of root_pid that `match`es (a spawned child renames itself a moment after
    it starts, so wait for it)."""
    deadline = time.monotonic() + timeout
    while True:
        for p in psutil.Process(root_pid).children(recursive=True):
            try:
                if match(p):
                    return p
            except psutil.NoSuchProcess:
                continue
        if time.monotonic() > deadline:
            names = [(p.pid, p.name()) for p in psutil.Process(root_pid).children(recursive=True)]
            raise AssertionError(f"no matching process under {root_pid}: {names}")
        time.sleep(0.1)


def named(name: str) -> Callable[[psutil.Process], bool]:
    return lambda p: p.name() == name


def shm_of(pids: Iterable[int]) -> list[str]:
    """/dev/shm entries created by these processes: kvserve's ring buffers are named
    kvserve_mq_<creator pid>_<random>; torch's and multiprocessing's carry the pid too."""
    tags = {str(pid) for pid in pids}
    found = []
    for name in os.listdir("/dev/shm"):
        parts = set(name.replace("-", "_").split("_"))
        if parts & tags:
            found.append(name)
    return sorted(found)


def alive(pids: Iterable[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


async def _stream(client: openai.AsyncOpenAI, model: str, i: int, first: threading.Event,
                  ends: dict, last_chunk: dict, counts: dict, max_tokens: int) -> None:
    try:
        stream = await client.completions.create(
            model=model, prompt=f"client {i} tells a long story", max_tokens=max_tokens,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            last_chunk[i] = time.monotonic()
            counts[i] = counts.get(i, 0) + 1
            first.set()
        ends[i] = (time.monotonic(), "finished")
    except Exception as e:  # noqa: BLE001 - the error is the outcome
        first.set()
        ends[i] = (time.monotonic(), f"error: {type(e).__name__}: {str(e)[:120]}")


async def _fresh_request(base_url: str, model: str) -> tuple[float, str]:
    """A new request after the kill: 503 (or refused: the server is going away)."""
    async with httpx.AsyncClient(timeout=CLIENT_DEADLINE_S) as http:
        try:
            r = await http.post(base_url + "/v1/completions",
                                json={"model": model, "prompt": "hi", "max_tokens": 2})
            return time.monotonic(), f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            return time.monotonic(), f"refused: {type(e).__name__}"


async def _load_and_kill(report: KillReport, base_url: str, model: str, victim_pid: int,
                         fresh_delay: float, wait_all_s: float,
                         trigger: Optional[Callable[[], bool]], max_tokens: int) -> None:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="EMPTY", max_retries=0,
                                timeout=60)
    ends: dict[int, tuple[float, str]] = {}
    last_chunk: dict[int, float] = {}
    counts: dict[int, int] = {}
    # Threading events, and the kill from a thread: a client that parses chunks slower than a
    # tiny model makes them reads its backlog without yielding to the event loop, so a kill
    # waiting on the loop came after ~175 chunks of each stream (and, on CI, after the engine
    # had finished them all).
    firsts = [threading.Event() for _ in range(CLIENTS)]
    tasks = [asyncio.ensure_future(_stream(client, model, i, firsts[i], ends, last_chunk,
                                           counts, max_tokens)) for i in range(CLIENTS)]
    deadline = time.monotonic() + (120 if trigger is None else 60)

    def kill_when_ready() -> None:
        if trigger is None:        # every client has its first chunk: all are running
            assert all(e.wait(max(0.0, deadline - time.monotonic())) for e in firsts), \
                "not every client got a first chunk"
        else:                      # the moment the caller waits for (a KV transfer in flight)
            while not trigger():
                assert time.monotonic() < deadline, "the kill's trigger never came"
                time.sleep(0.01)
        os.kill(victim_pid, signal.SIGKILL)
        report.killed_at = time.monotonic()
        report.chunks_at_kill = [counts.get(i, 0) for i in range(CLIENTS)]

    await asyncio.to_thread(kill_when_ready)
    await asyncio.sleep(fresh_delay)
    fresh = asyncio.ensure_future(_fresh_request(base_url, model))
    # Bounded: a hung client shows as a missing end, not as a hung test.
    await asyncio.wait(tasks, timeout=wait_all_s)
    fresh_at, report.fresh_outcome = await fresh
    report.fresh_after = fresh_at - report.killed_at
    for i in range(CLIENTS):
        # Not ended: still served (a chunk in the last second: a data-parallel survivor's
        # client), or hung.
        streaming = last_chunk.get(i, 0.0) > time.monotonic() - 1.0
        at, outcome = ends.get(i, (float("inf"), "streaming" if streaming else "hung"))
        report.ended_after.append(round(at - report.killed_at, 2))
        report.outcomes.append(outcome)
    for t in tasks:
        t.cancel()
    await client.close()


def kill_under_load(kind: str, base_url: str, model: str, server_pid: int, victim_pid: int,
                    wait_exit: Callable[[float], Optional[int]], fresh_delay: float = 0.2,
                    keep_alive_wait: Optional[float] = None,
                    wait_all_s: float = CLIENT_DEADLINE_S + 10,
                    trigger: Optional[Callable[[], bool]] = None,
                    max_tokens: int = MAX_TOKENS) -> KillReport:
    """Kill `victim_pid` under CLIENTS streams; then wait for the server (`wait_exit(timeout)`
    returns its exit code, None if it is still running) and look for leftovers. With
    `keep_alive_wait` (a server told to stay up) only wait that long and return."""
    report = KillReport(kind)
    pids = tree_pids(server_pid) | tree_pids(victim_pid)
    asyncio.run(_load_and_kill(report, base_url, model, victim_pid, fresh_delay, wait_all_s,
                               trigger, max_tokens))
    report.exit_code = wait_exit(keep_alive_wait if keep_alive_wait is not None else 30.0)
    if keep_alive_wait is not None:     # told to stay up: the caller stops it and checks
        print(report.line(), flush=True)
        return report
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    report.leftover_pids = alive(pids)
    report.leftover_shm = shm_of(pids)
    print(report.line(), flush=True)
    return report


def assert_clean_failure(report: KillReport, expect_exit: bool = True) -> None:
    assert "hung" not in report.outcomes, report.line()
    assert report.error_times(), report.line()
    assert max(report.error_times()) <= CLIENT_DEADLINE_S, report.line()
    assert report.fresh_after <= CLIENT_DEADLINE_S + 0.5, report.line()
    assert report.fresh_outcome in ("HTTP 503",) or report.fresh_outcome.startswith("refused"), \
        report.line()
    if expect_exit:
        assert report.exit_code not in (None, 0), report.line()
    assert not report.leftover_pids, report.line()
    assert not report.leftover_shm, report.line()
