#!/usr/bin/env python3
"""torchrun of PyTorch 2.x (python -m torch.distributed.run) with
--rdzv-backend=c10d --rdzv-endpoint at the store under test: two agents
(--nnodes=2 --nproc-per-node=2), whose 4 gloo workers
(torch2_torchrun_worker.py) init_process_group from the environment and
check an all_reduce. While every worker is alive, the test finds each
listening TCP socket of the job's processes (agents and workers, from
/proc) and asks it for TCPStore's PING: a TCPStore server echoes it.
--setup picks one of:
  default           torchrun as it comes: the rendezvous is in the store
                    under test, and the rank-0 agent hosts the workers'
                    TCPStore (2.x shares an agent-owned store with them)
  disable_share     TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 alone: the agent
                    hosts nothing, but worker rank 0 hosts the store at a
                    port the rank-0 agent picked (the control for the next)
  store_on_cohortd  the workers' store is the store under test too, and no
                    process of the job hosts a TCPStore:
                    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, --rdzv-conf
                    is_host=false, and the workers started through
                    `--no-python env MASTER_ADDR=... MASTER_PORT=...
                    TORCHELASTIC_USE_AGENT_STORE=True python worker.py`
                    (torchrun sets those 3 itself for each worker, from
                    nothing a flag of the c10d backend changes)
and --kill_agent, with any of them, runs the job with --max-restarts=3 and,
mid-job (the workers all_reduce in a loop), SIGKILLs the agent of group
rank 1 and its workers, as when a node dies, and starts a replacement
agent: the survivor's workers fail, it re-rendezvouses with the replacement
and their new workers must finish. That holds with disable_share only: with
torch 2.11's default the survivor keeps the workers' store of the first
round (DynamicRendezvousHandler caches its bootstrap store info) and does
not publish one for the new round, and the replacement's wait for
MASTER_ADDR times out; with store_on_cohortd the new round's workers read
the gloo addresses the first round's left in the store (torch puts no
per-attempt prefix on them) and fail to connect. Both fail the same way
against torch's own server.
Against cohortd the rendezvous state is then read back with cohortctl."""
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import harness as ct  # noqa: E402
import torch2_harness as t2  # noqa: E402

WORKER = os.path.join(ct.HERE, "torch2_torchrun_worker.py")
RUN_ID = "torch2job"
WORLD = 4
# How long the job may take to get where the test waits for it (two
# agents and four workers importing torch on a loaded 2-core machine; a
# re-rendezvous waits out the dead node's heartbeats, 15 s). Only a hung job
# reaches it; the Bazel targets' timeouts are longer (medium: 300 s; the
# kill_agent one is large: 900 s).
JOB_GIVE_UP_S = 240
KILL_AGENT_GIVE_UP_S = 480


def extra_flags(p):
    p.add_argument("--setup", required=True,
                   choices=["default", "disable_share", "store_on_cohortd"])
    p.add_argument("--kill_agent", action="store_true",
                   help="kill one agent mid-job and start a replacement")


class Listeners(threading.Thread):
    """Samples the job's listening sockets until stopped: each new one is
    probed for TCPStore's PING at once (in a thread of its own: a socket
    that is not TCPStore's costs the probe its whole timeout), so one that
    is gone by the next sample is still classified."""

    def __init__(self, roots):
        super().__init__(daemon=True)
        self.roots = roots  # agents' pids; the list may grow
        self.seen = {}  # (pid, port) -> {"agent", "pid", "addr", "port", "answer"}
        self.passes = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def _probe(self, entry):
        answer = t2.answers_tcpstore(entry["addr"], entry["port"])
        with self.lock:
            entry["answer"] = answer

    def run(self):
        while not self.stop.is_set():
            roots = list(self.roots)
            for pid, addr, port in t2.job_listeners(roots):
                with self.lock:
                    if (pid, port) in self.seen:
                        continue
                    entry = {"agent": pid in roots, "pid": pid, "addr": addr, "port": port,
                             "answer": None}
                    self.seen[(pid, port)] = entry
                threading.Thread(target=self._probe, args=(entry,), daemon=True).start()
            with self.lock:
                self.passes += 1
            time.sleep(0.1)

    def wait_passes(self, n):
        """Waits until n more full passes have run and every socket seen
        is classified."""
        with self.lock:
            target = self.passes + n
        while True:
            with self.lock:
                if (self.passes >= target and
                        all(e["answer"] for e in self.seen.values())):
                    return
            time.sleep(0.05)

    def all(self):
        with self.lock:
            return list(self.seen.values())


def start_agent(cmd, env, log_path):
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)


def kill_tree(pid):
    """SIGKILLs pid and every process below it, as a node's death would
    (torchrun starts each worker in a session of its own, so a process
    group would not reach them)."""
    for p in t2.descendants([pid]):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_reports(out_dir, n, pred, deadline, agents):
    """Reports matching pred, once there are n of them (or the deadline
    passed, or every agent exited)."""
    while True:
        reports = []
        for path in glob.glob(os.path.join(out_dir, "rank*.json")):
            with open(path) as f:
                rep = json.load(f)
            if pred(rep):
                reports.append(rep)
        if (len(reports) >= n or time.monotonic() > deadline or
                all(a.poll() is not None for a in agents)):
            return sorted(reports, key=lambda r: r["rank"])
        time.sleep(0.1)


def main():
    args = ct.parse_args(__doc__, extra_flags)
    t2.import_torch2()
    name = args.setup + ("_kill_agent" if args.kill_agent else "")
    c = ct.Checks(f"torch2_torchrun_test[{name}]")
    b = ct.Backend(args, f"torch2_torchrun_{name}")
    b.start()
    print(f"{b.kind}: TCPStore protocol on 127.0.0.1:{b.port}", flush=True)
    out_dir = ct.scratch_dir(f"torch2_torchrun_{name}/out")
    for f in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, f))
    # LOGLEVEL=INFO: the agents log their rendezvous rounds and restarts.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LOGLEVEL="INFO")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    restarts = 3 if args.kill_agent else 0
    cmd = [t2.PYTHON, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{b.port}",
           f"--rdzv-id={RUN_ID}", f"--max-restarts={restarts}", "--monitor-interval=0.2"]
    if args.setup in ("disable_share", "store_on_cohortd"):
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if args.setup == "store_on_cohortd":
        cmd += ["--rdzv-conf=is_host=false", "--no-python", "env", "MASTER_ADDR=127.0.0.1",
                f"MASTER_PORT={b.port}", "TORCHELASTIC_USE_AGENT_STORE=True", t2.PYTHON]
    cmd += [WORKER, out_dir]
    print(" ".join(cmd), flush=True)
    if args.kill_agent:
        open(os.path.join(out_dir, "until_killed"), "w").close()
        open(os.path.join(out_dir, "go"), "w").close()

    agents, logs = [], []
    sampler = Listeners([])
    try:
        t0 = time.monotonic()
        deadline = t0 + (KILL_AGENT_GIVE_UP_S if args.kill_agent else JOB_GIVE_UP_S)
        for i in range(2):
            logs.append(os.path.join(b.dir, f"agent{i}.log"))
            agents.append(start_agent(cmd, env, logs[-1]))
            sampler.roots.append(agents[-1].pid)
        if args.kill_agent:
            run_kill_agent(c, b, cmd, env, out_dir, agents, logs, deadline)
        else:
            sampler.start()
            reports = wait_reports(out_dir, WORLD, lambda r: True, deadline, agents)
            c.eq("workers that reported", [r["rank"] for r in reports], list(range(WORLD)))
            # Every worker is alive now, waiting for "go": look at its sockets.
            sampler.wait_passes(2)
            open(os.path.join(out_dir, "go"), "w").close()
            wait_agents(c, agents, deadline)
            print(f"job done in {time.monotonic() - t0:.1f}s", flush=True)
            check_job(c, b, args, reports, sampler)
    finally:
        sampler.stop.set()
        # Workers left waiting (a failed check) leave, and none loops.
        for marker in ("go", "killed"):
            open(os.path.join(out_dir, marker), "w").close()
        for a in agents:
            if a.poll() is None:  # not reaped: its pid is still this agent's
                kill_tree(a.pid)
                a.wait()
        b.kill9()
        if c.failures:
            for path in logs:
                print(f"==== {path}")
                with open(path, errors="replace") as f:
                    print(f.read()[-8000:])
    c.finish()


def wait_agents(c, agents, deadline, names=None):
    for i, a in enumerate(agents):
        name = names[i] if names else f"agent {i}"
        try:
            a.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(a.pid)
            a.wait()
        c.eq(f"{name} exit status", a.returncode, 0)


def print_listeners(sampler):
    for s in sorted(sampler.all(), key=lambda s: (not s["agent"], s["pid"], s["port"])):
        print(f"  {'agent ' if s['agent'] else 'worker'} pid {s['pid']} listened on "
              f"{s['addr']}:{s['port']}: {s['answer']}")


def check_job(c, b, args, reports, sampler):
    for rep in reports:
        c.eq(f"rank {rep['rank']} world size", rep["world_size"], WORLD)
        c.eq(f"rank {rep['rank']} all_reduce", rep["all_reduce"], rep["expected"])
    print("workers' store: " + ", ".join(
        f"rank {r['rank']} {r['env']['MASTER_ADDR']}:{r['env']['MASTER_PORT']} "
        f"USE_AGENT_STORE={r['env']['TORCHELASTIC_USE_AGENT_STORE']}" for r in reports))
    print("listening sockets of the job's processes, and whether they answered TCPStore's PING:")
    print_listeners(sampler)
    if not reports:
        return
    ports = {int(r["env"]["MASTER_PORT"]) for r in reports}
    c.eq("one MASTER_PORT for all workers", len(ports), 1)
    master_port = ports.pop()
    agent_store = {r["env"]["TORCHELASTIC_USE_AGENT_STORE"] for r in reports}
    seen = sampler.all()
    # One listening socket per port: a process that shows the same port as
    # an agent holds the agent's socket, inherited in the moment between
    # fork and exec of a worker (seen under load), so a port counts as an
    # agent's if any agent holds it.
    by_port = {}
    for s in seen:
        if s["answer"] == "tcpstore":
            by_port[s["port"]] = by_port.get(s["port"], False) or s["agent"]
    servers = sorted((agent, port) for port, agent in by_port.items())
    worker_pids = {r["pid"] for r in reports}
    c.ok(any(s["pid"] in worker_pids for s in seen),
         "no listening socket of a worker was seen (gloo's, at least): the sampling missed them")
    rank0 = next((r for r in reports if r["rank"] == 0), {})
    if args.setup == "default":
        c.eq("TORCHELASTIC_USE_AGENT_STORE", agent_store, {"True"})
        c.ok(master_port != b.port, "workers' MASTER_PORT is the rendezvous endpoint")
        c.eq("TCPStore servers in the job (agent?, port): the rank-0 agent's at MASTER_PORT",
             servers, [(True, master_port)])
    elif args.setup == "disable_share":
        c.eq("TORCHELASTIC_USE_AGENT_STORE", agent_store, {"False"})
        c.ok(master_port != b.port, "workers' MASTER_PORT is the rendezvous endpoint")
        c.eq("TCPStore servers in the job (agent?, port): worker rank 0's at MASTER_PORT",
             servers, [(False, master_port)])
        c.ok(any(s["pid"] == rank0.get("pid") and s["port"] == master_port for s in seen),
             "worker rank 0 did not listen on MASTER_PORT")
    else:
        c.eq("TORCHELASTIC_USE_AGENT_STORE", agent_store, {"True"})
        c.eq("workers' MASTER_ADDR:MASTER_PORT",
             {f"{r['env']['MASTER_ADDR']}:{r['env']['MASTER_PORT']}" for r in reports},
             {f"127.0.0.1:{b.port}"})
        c.eq("TCPStore servers in the job", servers, [])
    if not b.is_cohortd:
        return
    rc, out, err = b.ctl("list")
    keys = out.split()
    rdzv = f"/torch.rendezvous.{RUN_ID}"
    c.ok(rdzv in keys, f"cohortctl list lacks {rdzv} (the c10d backend's state): {err}")
    published = b.ctl("get", f"{rdzv}.0/MASTER_PORT", "--timeout=5")[1].strip()
    print(f"rendezvous keys in cohortd: {[k for k in keys if k.startswith(rdzv)]}")
    gloo_keys = sorted(k for k in keys if k.startswith("/default_pg/"))
    if args.setup == "store_on_cohortd":
        # The workers' keys, where torch puts them: no run id, no attempt.
        c.eq("workers' keys in cohortd (gloo's bootstrap under env://)", gloo_keys,
             [f"/default_pg/0//cpu//0/{r}" for r in range(WORLD)])
        print(f"the port the rank-0 agent published (and nobody used): {published}")
    else:
        c.eq("the workers' MASTER_PORT is the one the rank-0 agent published in cohortd",
             published, str(master_port))
        c.eq("workers' keys in cohortd", gloo_keys, [])
    c.eq("cohortd exit status on SIGTERM", b.stop(), 0)


def run_kill_agent(c, b, cmd, env, out_dir, agents, logs, deadline):
    first = wait_reports(out_dir, WORLD, lambda r: r["until_killed"], deadline, agents)
    c.eq("round 0: workers that reported", [r["rank"] for r in first], list(range(WORLD)))
    c.eq("round 0: all_reduce", {r["all_reduce"] for r in first}, {10.0})
    # The agent of group rank 1 is the node to lose: it hosts no store.
    by_group = {r["env"]["GROUP_RANK"]: r for r in first}
    victim_pid = None
    for a in agents:
        if by_group.get("1") and by_group["1"]["pid"] in t2.descendants([a.pid]):
            victim_pid = a.pid
    if not c.ok(victim_pid is not None, "no agent found for group rank 1's workers"):
        return
    victim = next(a for a in agents if a.pid == victim_pid)
    survivor = next(a for a in agents if a.pid != victim_pid)
    open(os.path.join(out_dir, "killed"), "w").close()
    kill_tree(victim.pid)
    victim.wait()
    c.eq("the killed agent died of SIGKILL", victim.returncode, -9)
    print(f"killed agent pid {victim.pid} (group rank 1) and its workers; survivor: agent pid "
          f"{survivor.pid}; starting a replacement", flush=True)
    logs.append(os.path.join(b.dir, "agent_replacement.log"))
    replacement = start_agent(cmd, env, logs[-1])
    agents.append(replacement)
    wait_agents(c, [survivor, replacement], deadline, ["surviving agent", "replacement agent"])
    after = wait_reports(out_dir, WORLD, lambda r: not r["until_killed"], time.monotonic(),
                         [])
    c.eq("after the kill: workers that reported", [r["rank"] for r in after],
         list(range(WORLD)))
    for rep in after:
        c.eq(f"after the kill: rank {rep['rank']} all_reduce", rep["all_reduce"],
             rep["expected"])
    print("after the kill: " + ", ".join(
        f"rank {r['rank']} (group {r['env']['GROUP_RANK']}, restart "
        f"{r['env']['TORCHELASTIC_RESTART_COUNT']}, store {r['env']['MASTER_PORT']})"
        for r in after), flush=True)
    # The survivor restarts its workers when they fail (a restart it
    # counts) or when it sees the replacement waiting (one it does not).
    c.eq("after the kill: agents of the workers (survivor, replacement)",
         sorted(r["agent"] for r in after),
         sorted([survivor.pid] * 2 + [replacement.pid] * 2))
    c.eq("the replacement's workers' TORCHELASTIC_RESTART_COUNT",
         [r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in after
          if r["agent"] == replacement.pid], ["0", "0"])
    if b.is_cohortd:
        rc, out, err = b.ctl("list", f"/torch.rendezvous.{RUN_ID}")
        rounds = sorted({k.split("/")[1] for k in out.split() if "/" in k[1:]})
        print(f"rendezvous rounds in cohortd: {rounds}")
        c.ok(len(rounds) >= 2, f"expected keys of 2 rendezvous rounds in cohortd, got {rounds}")
        c.eq("cohortd exit status on SIGTERM", b.stop(), 0)


if __name__ == "__main__":
    main()
